"""``onceonly demo``: vendor onboarding, with a worker killed mid-run and resumed.

The demo starts real local servers (SMTP + IMAP, a sanctions-screening API, an ERP API;
:mod:`onceonly.demo.services`), starts a run of :mod:`onceonly.demo.flow` on an embedded
SQLite store, and runs it with worker processes (:mod:`onceonly.demo._worker`, the same
``Worker`` as ``onceonly worker``):

* default: the worker e-mails the supplier and waits; the supplier's documents arrive (a
  signal); the worker extracts and screens them and waits for a compliance officer. Then a
  deploy: the worker is SIGKILLed while the run waits. The officer approves from this
  process; a fresh worker resumes and creates the vendor record.
* ``--crash-at random``: workers are SIGKILLed at random instructions of our code
  (counted by a line tracer), over and over, until the run completes.

It ends with the ledger and each server's raw delivery counts: one e-mail, one screening,
one vendor record.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from onceonly.checkpoint import RunStatus, Store
from onceonly.ledger import Keyring, Ledger, Secret
from onceonly.operator import Operator
from onceonly.runtime import META, Runtime

from .flow import FLOWS
from .services import HTTPService, MailService

__all__ = ["run"]

RUN_ID = "vendor-acme-001"
_CRASH_ROUNDS = 12  # workers SIGKILLed at a random line, one after another
_CRASH_SPAN = 4000  # the kill lands within the first this-many lines a worker executes
_DOCUMENTS = (
    "Certificate of incorporation: ACME Tooling Ltd\n"
    "Tax ID: GB-123456789\n"
    "IBAN: GB33 BUKB 2020 1555 5555 55\n"
)


def run(db: str | None = None, crash_at: str = "approval", seed: int | None = None) -> int:
    """Run the demo; returns the process exit code (0: every effect happened once)."""
    console = Console(highlight=False)
    work = Path(tempfile.mkdtemp(prefix="onceonly-demo-"))
    db_path = Path(db) if db else work / "onceonly.db"
    if db_path.exists():
        console.print(f"[red]{db_path} exists; the demo wants a fresh database[/red]")
        return 2
    url = f"sqlite:///{db_path}"
    secret = os.urandom(32)
    env = {**os.environ, "ONCEONLY_SECRETS": f"demo:{secret.hex()}"}
    rng = random.Random(seed)  # noqa: S311  (where to crash, not a secret)
    mail = MailService().start()
    screening = HTTPService(
        "screening",
        "screenings",
        lambda body, n: {"id": f"S-{n:05d}", "hit": False, "list": "demo-sanctions-2026-11"},
    ).start()
    erp = HTTPService(
        "erp", "vendors", lambda body, n: {"id": f"V-{n:06d}", "name": body["name"]}
    ).start()
    workers: list[subprocess.Popen[bytes]] = []
    try:
        store = Store.open(url)
        ledger = Ledger(store, Keyring([Secret("demo", secret)]), owner="demo-operator")
        rt = Runtime(store, ledger, FLOWS, owner="demo-operator")
        ops = Operator(store, ledger)
        services = {
            "smtp_port": mail.smtp_port,
            "imap_port": mail.imap_port,
            "imap_user": mail.user,
            "imap_password": mail.password,
            "screening": screening.url,
            "erp": erp.url,
        }
        supplier = {"name": "ACME Tooling Ltd", "email": "accounts@acme.example"}
        rt.start(
            "vendor-onboarding",
            {"supplier": supplier, "services": services},
            run_id=RUN_ID,
            started_by="onboarding-agent",
        )
        console.print(f"[bold]run {RUN_ID}[/bold] started on {url}")

        def spawn(crash_after: int | None = None) -> subprocess.Popen[bytes]:
            log = open(work / f"worker-{len(workers) + 1}.log", "wb")  # noqa: SIM115
            cmd = [sys.executable, "-m", "onceonly.demo._worker", url]
            if crash_after is not None:
                cmd += ["--crash-after", str(crash_after), str(work / "crash.txt")]
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            workers.append(proc)
            return proc

        def waiting_on(name: str) -> Callable[[], bool]:
            def check() -> bool:
                run = store.get_run(RUN_ID)
                meta = (store.load(RUN_ID).state.get(META) or {}) if run.head_seq else {}
                waiting = meta.get("waiting") or {}
                return run.status is RunStatus.WAITING and waiting.get("name") == name

            return check

        def completed() -> bool:
            return store.get_run(RUN_ID).status is RunStatus.COMPLETED

        documents = {"from": supplier["email"], "text": _DOCUMENTS}
        if crash_at == "random":
            kills = _random_crashes(
                console, rng, spawn, work, store, ledger, ops, documents, completed
            )
        else:
            kills = _deploy_during_approval(console, spawn, store, ops, documents, waiting_on, url)
        ok = _wait(completed, 60, workers)
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # drain
        for proc in workers:
            proc.wait(30)
        code = _report(console, store, ledger, mail, screening, erp, ok, kills)
        ledger.close()
        store.close()
        if code == 0 and db is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"database {db_path} and worker logs in {work} are kept")
        return code
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        erp.stop()
        screening.stop()
        mail.stop()


def _deploy_during_approval(
    console: Console,
    spawn: Callable[..., subprocess.Popen[bytes]],
    store: Store,
    ops: Operator,
    documents: dict[str, str],
    waiting_on: Callable[[str], Callable[[], bool]],
    url: str,
) -> int:
    first = spawn()
    console.print(f"worker 1 (pid {first.pid}) e-mails the supplier and waits for documents")
    if not _wait(waiting_on("documents"), 60, [first]):
        raise SystemExit("the run did not reach the documents wait; see the worker log")
    ops.signal(RUN_ID, "documents", documents, actor="supplier@acme.example")
    console.print("the supplier's documents arrive (signal [italic]documents[/italic])")
    if not _wait(waiting_on("compliance"), 60, [first]):
        raise SystemExit("the run did not reach the approval; see the worker log")
    run = store.get_run(RUN_ID)
    console.print(f"waiting for compliance; handoff note: done {list(run.handoff.done)}")
    console.print(
        "a compliance officer would open the run in the console: "
        f"[bold]onceonly console --url {url}[/bold], then "
        f"http://127.0.0.1:8080/runs/{RUN_ID} (this demo approves it itself)",
        soft_wrap=True,
    )
    first.kill()
    first.wait(10)
    console.print("[yellow]deploy: worker 1 SIGKILLed while the run waits[/yellow]")
    wait = ops.waits.get(RUN_ID, "compliance")
    ops.approve(
        RUN_ID,
        "compliance",
        actor="compliance-officer@demo.example",
        subject_hash=str(wait.subject_hash),
    )
    console.print(f"compliance officer approves subject {str(wait.subject_hash)[:12]}…")
    second = spawn()
    console.print(f"worker 2 (pid {second.pid}) resumes the run")
    return 1


def _random_crashes(
    console: Console,
    rng: random.Random,
    spawn: Callable[..., subprocess.Popen[bytes]],
    work: Path,
    store: Store,
    ledger: Ledger,
    ops: Operator,
    documents: dict[str, str],
    completed: Callable[[], bool],
) -> int:
    kills = 0
    signalled = approved = False
    for round_ in range(_CRASH_ROUNDS + 1):
        if completed():
            break
        # The last worker is not crashed: the run must complete whatever came before.
        crash = rng.randint(1, _CRASH_SPAN) if round_ < _CRASH_ROUNDS else None
        proc = spawn(crash_after=crash)
        while proc.poll() is None and not completed():
            run = store.get_run(RUN_ID)
            if run.status is RunStatus.WAITING:
                waits = {w.name: w for w in ops.waits.find(run_id=RUN_ID)}
                if not signalled and "documents" in waits:
                    ops.signal(RUN_ID, "documents", documents, actor="supplier@acme.example")
                    signalled = True
                if not approved and "compliance" in waits:
                    ops.approve(
                        RUN_ID,
                        "compliance",
                        actor="compliance-officer@demo.example",
                        subject_hash=str(waits["compliance"].subject_hash),
                    )
                    approved = True
            time.sleep(0.05)
        if proc.poll() == -signal.SIGKILL:
            kills += 1
            where = (work / "crash.txt").read_text().strip()
            console.print(f"[yellow]kill {kills}: worker SIGKILLed at {where}[/yellow]")
    return kills


def _report(
    console: Console,
    store: Store,
    ledger: Ledger,
    mail: MailService,
    screening: HTTPService,
    erp: HTTPService,
    ok: bool,
    kills: int,
) -> int:
    run = store.get_run(RUN_ID)
    table = Table(title="effects ledger")
    for col in ("effect", "status", "provider class", "attempts", "epoch"):
        table.add_column(col)
    for rec in sorted(ledger.effects(run_id=RUN_ID), key=lambda r: r.created_at):
        table.add_row(
            rec.effect,
            rec.status.value,
            rec.provider_class.value,
            str(rec.attempts),
            str(rec.epoch),
        )
    console.print(table)
    counts = {
        "e-mails at the SMTP server": mail.deliveries(),
        "screening requests": screening.deliveries,
        "vendor-record requests": erp.deliveries,
    }
    raw = Table(title="raw deliveries counted by the servers")
    raw.add_column("server")
    raw.add_column("count")
    for name, n in counts.items():
        raw.add_row(name, str(n))
    console.print(raw)
    audit = ledger.verify()
    result: Any = (store.load(RUN_ID).state.get("result") or {}) if ok else None
    good = ok and all(n == 1 for n in counts.values()) and audit.ok
    console.print(
        f"run {RUN_ID}: {run.status.value}; worker kills: {kills}; audit chain "
        f"{'verified' if audit.ok else 'BROKEN'}; vendor {result}"
    )
    if good:
        console.print("[green]OK: resumed, not restarted; every effect happened once[/green]")
        return 0
    console.print("[red]FAILED: see the tables above[/red]")
    return 1


def _wait(pred: Callable[[], bool], timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> bool:
    """Poll ``pred`` until it holds, ``timeout_s`` passes or every worker has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        if procs and all(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    return pred()
