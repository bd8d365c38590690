"""The controller side of the process suites S3 and S4: starts runs, plays the people
(the supplier's documents, the compliance officer, the operator who settles an effect
that needs a human, with evidence from the provider), and judges the end state by the
fakes' raw logs."""

from __future__ import annotations

import collections
import imaplib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from onceonly.checkpoint import ENDED, RunStatus, Store, WaitKind, WaitRefused, migrate
from onceonly.demo.services import HOST, HTTPService, MailService
from onceonly.ledger import EffectStatus, Keyring, Ledger, Secret
from onceonly.ledger import migrate as ledger_migrate
from onceonly.operator import Operator
from onceonly.runtime import Runtime

from .s3_fakes import FencedAPI
from .s3_flows import FLOWS, labels_of, plan_for

__all__ = ["Controller", "Onboarding", "migrate_all"]

KEYRING = Keyring([Secret("k1", bytes.fromhex("5a" * 32))])
TERMINAL = ENDED
DOCUMENTS = "Tax ID: GB-{n:09d}\nIBAN: GB33 BUKB 2020 1555 5555 {n:02d}\n"


def migrate_all(url: str) -> None:
    migrate(url)
    ledger_migrate(url)


class Onboarding:
    """The vendor-onboarding demo's world: mail-devel (SMTP + IMAP) and the screening
    and ERP APIs, each counting every raw delivery."""

    def __init__(self) -> None:
        self.mail = MailService().start()
        self.screening = HTTPService(
            "screening", "screenings", lambda body, n: {"id": f"S-{n}", "hit": False, **body}
        ).start()
        self.erp = HTTPService("erp", "vendors", lambda body, n: {"id": f"V-{n}", **body}).start()

    def services(self) -> dict[str, Any]:
        return {
            "smtp_port": self.mail.smtp_port,
            "imap_port": self.mail.imap_port,
            "imap_user": self.mail.user,
            "imap_password": self.mail.password,
            "screening": self.screening.url,
            "erp": self.erp.url,
        }

    def mails_to(self) -> collections.Counter[str]:
        """Messages in the INBOX per recipient (every message the SMTP server took)."""
        conn = imaplib.IMAP4(HOST, self.mail.imap_port, timeout=10)
        try:
            conn.login(self.mail.user, self.mail.password)
            conn.select("INBOX", readonly=True)
            _, data = conn.search(None, "ALL")
            ids = b" ".join(d for d in data if isinstance(d, bytes)).split()
            out: collections.Counter[str] = collections.Counter()
            for i in ids:
                _, parts = conn.fetch(i.decode(), "(BODY.PEEK[HEADER.FIELDS (TO)])")
                for part in parts:
                    if isinstance(part, tuple):
                        to = part[1].decode().partition(":")[2].strip()
                        out[to] += 1
            return out
        finally:
            conn.logout()

    def judge(self, names: dict[str, str]) -> dict[str, int]:
        """``names``: supplier e-mail -> supplier name, one per onboarding run. Each run
        must have sent one e-mail, one screening and one vendor record; class B re-sends
        that reached a provider count as duplicates too."""
        mails = self.mails_to()
        dup = lost = 0
        for email in names:
            dup += max(mails[email] - 1, 0)
            lost += int(mails[email] == 0)
        dup += sum(n for e, n in mails.items() if e not in names)
        for svc in (self.screening, self.erp):
            per_name = collections.Counter(str(v.get("name")) for v in svc.applied.values())
            for name in names.values():
                dup += max(per_name[name] - 1, 0)
                lost += int(per_name[name] == 0)
            dup += svc.deliveries - len(svc.applied)  # a re-send that reached it
        raw = sum(mails.values()) + self.screening.deliveries + self.erp.deliveries
        return {"effects": 3 * len(names), "raw": raw, "duplicates": dup, "lost": lost}

    def stop(self) -> None:
        self.erp.stop()
        self.screening.stop()
        self.mail.stop()


@dataclass
class Controller:
    """Starts runs on ``url`` and plays every person the runs need."""

    url: str
    api: FencedAPI
    rng: random.Random
    onboarding: Onboarding | None = None
    classes: str = "aabbbc"
    expected: set[tuple[str, str]] = field(default_factory=set)
    gen_runs: list[str] = field(default_factory=list)
    suppliers: dict[str, str] = field(default_factory=dict)  # email -> name
    ob_runs: list[str] = field(default_factory=list)
    needs_human: int = 0
    hold_keys: set[str] = field(default_factory=set)  # provider keys not to settle yet
    frozen: bool = False  # a worker is stopped now: a send it claimed may still arrive
    thawed_at: float = 0.0  # when the last stopped worker was resumed (monotonic)
    settle_after_s: float = 0.0
    durability: str = "sync"  # the controller's own store (the operator's process)
    _seen: dict[str, float] = field(default_factory=dict)
    _open: set[str] = field(default_factory=set)
    _settled: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.store = Store.open(self.url, durability=self.durability)
        self.ledger = Ledger(self.store, KEYRING, owner="controller")
        self.rt = Runtime(self.store, self.ledger, FLOWS, owner="controller")
        self.ops = Operator(self.store, self.ledger)

    def close(self) -> None:
        self.ledger.close()
        self.store.close()

    def start_gen(self, n: int, *, steps: int = 5, per_step: int = 4) -> None:
        for _ in range(n):
            plan = plan_for(self.rng, steps, per_step, self.classes)
            rid = self.rt.start("gen", {"url": self.api.url, "plan": plan})
            self.gen_runs.append(rid)
            self._open.add(rid)
            self.expected |= {(rid, label) for label in labels_of(plan)}

    def start_onboarding(self, n: int) -> None:
        assert self.onboarding is not None
        for _ in range(n):
            k = len(self.suppliers) + 1
            supplier = {"name": f"Supplier {k} Ltd", "email": f"accounts{k}@s{k}.example"}
            rid = self.rt.start(
                "vendor-onboarding",
                {"supplier": supplier, "services": self.onboarding.services()},
                started_by="onboarding-agent",
            )
            self.suppliers[supplier["email"]] = supplier["name"]
            self.ob_runs.append(rid)
            self._open.add(rid)

    @property
    def runs(self) -> list[str]:
        return self.gen_runs + self.ob_runs

    def open_runs(self) -> int:
        """Runs not ended yet (ended runs stay ended: only open ones are looked at)."""
        self._open = {r for r in self._open if self.store.get_run(r).status not in TERMINAL}
        return len(self._open)

    def chores(self) -> None:
        """Deliver documents, approve, and settle effects that need a human."""
        for wait in self.ops.waits.find(status="open"):
            tag = (wait.run_id, wait.name)
            if tag in self._settled:
                continue
            try:
                if wait.name == "documents":
                    n = self.ob_runs.index(wait.run_id) + 1
                    self.ops.signal(
                        wait.run_id, "documents", {"text": DOCUMENTS.format(n=n)}, actor="supplier"
                    )
                elif wait.name == "compliance" and wait.kind is WaitKind.APPROVAL:
                    self.ops.approve(
                        wait.run_id,
                        "compliance",
                        actor="officer@example",
                        subject_hash=str(wait.subject_hash),
                    )
                else:
                    continue
            except WaitRefused:
                pass
            self._settled.add(tag)
        now = time.monotonic()
        for rec in self.ledger.effects(status=EffectStatus.NEEDS_HUMAN):
            if rec.provider_key in self.hold_keys:
                continue  # its worker is paused mid-send: the evidence is not in yet
            # A person looks a while after the alert, not within milliseconds: a send
            # still in flight from a slow worker has landed by then.
            first = self._seen.setdefault(rec.key_id, now)
            if now - first < self.settle_after_s:
                continue
            happened = self.api.applied_key(rec.provider_key)
            if not happened and (self.frozen or now - self.thawed_at < self.settle_after_s):
                # A person says "it never arrived" only once no worker that may hold the
                # request is stopped (nor was resumed a moment ago): a stopped worker
                # sends on when resumed, and a "not happened" given meanwhile would let
                # the effect be sent twice (found by S4 on a loaded machine: a worker
                # stopped mid-send outlasted the settle delay).
                continue
            self.needs_human += 1
            self.ops.resolve(
                rec.key_id,
                happened=happened,
                evidence=f"provider log: {'applied' if happened else 'never arrived'}",
                actor="operator@example",
                result=None,  # the flows do not use a delivery's result
            )

    def finish(self, timeout_s: float) -> bool:
        """Do chores until every run ended (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.chores()
            if self.open_runs() == 0:
                return True
            time.sleep(0.1)
        return self.open_runs() == 0

    def unfinished(self) -> list[tuple[str, str]]:
        return [
            (r, self.store.get_run(r).status.value)
            for r in self.runs
            if self.store.get_run(r).status is not RunStatus.COMPLETED
        ]

    def explain(self, run_id: str) -> str:
        """What an unfinished run is waiting for (for failure messages)."""
        run = self.store.get_run(run_id)
        waits = [(w.name, w.status.value) for w in self.ops.waits.find(run_id=run_id)]
        effects = [
            (e.effect, e.status.value, e.epoch, e.lease_owner)
            for e in self.ledger.effects(run_id=run_id)
            if e.status not in (EffectStatus.COMMITTED, EffectStatus.FAILED)
        ]
        return (
            f"run {run_id}: {run.status.value} next={run.next_step} lease={run.lease_owner} "
            f"until={run.lease_expires_at} waits={waits} open effects={effects}"
        )
