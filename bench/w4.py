"""W4 — many workers on PostgreSQL: runs x guarded effects drained by 1, 2 and 4 worker
processes claiming runs with leases.

``python -m bench.w4 phase --server URL --workers N --runs R --effects E --out R.json``
    one measurement: a fresh database on the server, a counting fake provider (Starlette
    under uvicorn on 127.0.0.1, in this process, no deduplication), R runs of a flow whose
    steps make E guarded HTTP effects in all (``PER_STEP`` per step), then N worker
    processes (``python -m bench.w4 worker``) released at once; the clock runs from their
    release until the last one found nothing left to claim. Afterwards every run must be
    completed and the provider's raw log must hold each of the R x E effects exactly once.
``python -m bench.w4 worker --url URL --owner NAME --out S.json``
    one worker process: the same set-up as ``onceonly worker`` (a ``Runtime`` and a
    ``Worker``; ``until_idle``), started on a ``go`` line on stdin; writes its stats.

The orchestrator (``python -m bench``, :func:`run`) alternates the worker counts within
each repetition, each phase in fresh processes, and uses ``ONCEONLY_TEST_PG_URL`` when it
is set or starts a throwaway cluster (``tests/pgserver.py``, unix socket only).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _util

if TYPE_CHECKING:
    from rich.progress import Progress

    from onceonly.context import StepContext
    from onceonly.flow import Flow, Transition

    from .runner import Runner
    from .summary import Target

RUNS = 500
EFFECTS = 20
PER_STEP = 5
WORKERS = [1, 2, 4]
QUICK_RUNS = 50
SECRET = bytes(range(32))
LEASE_S = 30.0
POLL_S = 0.5
ROOT = Path(__file__).resolve().parent.parent


# -- the flow the workers run --------------------------------------------------------
def flows() -> list[Flow]:
    """The W4 flow: ``send`` delivers ``PER_STEP`` effects per visit (class B HTTP
    requests to the provider in the run's state) until ``effects`` are delivered."""
    import httpx

    from onceonly.adapters.http import GuardedHTTP
    from onceonly.flow import Flow

    flow = Flow("w4", version="1")
    client = httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0))

    @flow.step(start=True)
    def send(ctx: StepContext) -> Transition:
        http = GuardedHTTP(client, ctx.ledger)
        url = str(ctx.state["url"])
        done = int(ctx.state["sent"])
        upto = min(done + PER_STEP, int(ctx.state["effects"]))
        for i in range(done, upto):
            http.post(
                f"{url}/deliver",
                effect="deliver@1",
                json={"run": ctx.run_id, "i": i},
                provider_class="B",
                lookup=f"{url}/lookup/{{key}}",
            )
        ctx.state["sent"] = upto
        return ctx.end(upto) if upto >= int(ctx.state["effects"]) else ctx.next("send")

    return [flow]


# -- the counting provider (the oracle) ----------------------------------------------
class Provider:
    """Applies and logs every write (no deduplication); answers lookups by key."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.lock = threading.Lock()
        self.log: list[tuple[str, int, str | None]] = []
        self.by_key: dict[str, Any] = {}
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without
        # it Nagle's algorithm holds the response body behind its headers until the
        # client's delayed ACK, about 40 ms per request.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = Starlette(
            routes=[
                Route("/deliver", self._deliver, methods=["POST"]),
                Route("/lookup/{key}", self._lookup, methods=["GET"]),
            ]
        )
        self.server: Any = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve in a thread."""
        import uvicorn

        config = uvicorn.Config(
            self.app, log_config=None, log_level="critical", lifespan="off", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the counting provider did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(10)
        self.sock.close()

    async def _deliver(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        body = await request.json()
        header = request.headers.get("idempotency-key")
        key = header.strip('"') if header else None
        with self.lock:
            self.log.append((str(body["run"]), int(body["i"]), key))
            response = {"id": len(self.log)}
            if key is not None:
                self.by_key[key] = response
        return JSONResponse(response, 201)

    async def _lookup(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        with self.lock:
            found = self.by_key.get(request.path_params["key"])
        if found is None:
            return JSONResponse({"error": "unknown"}, 404)
        return JSONResponse(found, 200)


# -- phases ----------------------------------------------------------------------------
def _database(server: str) -> tuple[str, Any]:
    from sqlalchemy import create_engine, text

    name = "w4_" + uuid.uuid4().hex[:12]
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base, _, query = server.partition("?")
    url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


def worker_phase(url: str, owner: str, lease_s: float, poll_s: float) -> dict[str, Any]:
    """One worker process: set up, print ``ready``, wait for ``go``, drain, report."""
    from onceonly.checkpoint import Store
    from onceonly.ledger import Keyring, Ledger, Secret
    from onceonly.runtime import Runtime
    from onceonly.worker import Worker

    with Store.open(url) as store:
        ledger = Ledger(store, Keyring([Secret("k1", SECRET)]), owner=owner)
        try:
            rt = Runtime(store, ledger, flows(), owner=owner, lease_s=lease_s)
            worker = Worker(rt, batch=1, poll_s=poll_s)
            print("ready", flush=True)
            if sys.stdin.readline().strip() != "go":
                raise RuntimeError("the phase did not say go")
            t_go = time.time()
            stats = worker.run(until_idle=True)
            t_end = time.time()
        finally:
            ledger.close()
    return {
        "owner": owner,
        "runs_driven": stats.runs_driven,
        "claim_conflicts": stats.claim_conflicts,
        "leases_lost": stats.leases_lost,
        "runs_skipped": stats.runs_skipped,
        "t_go": t_go,
        "t_end": t_end,
    }


def measure_phase(server: str, workers: int, runs: int, effects: int) -> dict[str, Any]:
    """One measurement (see the module docstring)."""
    from onceonly.checkpoint import RunStatus, Store, migrate
    from onceonly.ledger import Keyring, Ledger, Secret
    from onceonly.ledger import migrate as ledger_migrate
    from onceonly.runtime import Runtime

    load_start = list(os.getloadavg())
    url, drop = _database(server)
    provider = Provider()
    tmp = Path(tempfile.mkdtemp(prefix="w4-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        migrate(url)
        ledger_migrate(url)
        provider.start()
        with Store.open(url) as store:
            ledger = Ledger(store, Keyring([Secret("k1", SECRET)]), owner="bench")
            rt = Runtime(store, ledger, flows(), owner="bench")
            t0 = time.perf_counter()
            ids = [
                rt.start("w4", {"url": provider.url, "effects": effects, "sent": 0})
                for _ in range(runs)
            ]
            start_s = time.perf_counter() - t0
            for k in range(workers):
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.w4",
                    "worker",
                    "--url",
                    url,
                    "--owner",
                    f"w{k + 1}",
                    "--out",
                    str(tmp / f"w{k + 1}.json"),
                ]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=(tmp / f"w{k + 1}.log").open("w"),
                        text=True,
                        cwd=os.getcwd(),
                    )
                )
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a worker did not start: {_tail(tmp)}")
            for p in procs:  # release them together
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:
                if p.wait(timeout=3000) != 0:
                    raise RuntimeError(f"a worker exited {p.returncode}: {_tail(tmp)}")
            stats = [json.loads((tmp / f"w{k + 1}.json").read_text()) for k in range(workers)]
            status = collections.Counter(rt.store.get_run(r).status.value for r in ids)
            ledger.close()
        wall = max(s["t_end"] for s in stats) - min(s["t_go"] for s in stats)
        with provider.lock:
            log = list(provider.log)
        counts = collections.Counter((run, i) for run, i, _key in log)
        expected = {(r, i) for r in ids for i in range(effects)}
        total = runs * effects
        return {
            "workers": workers,
            "runs": runs,
            "effects": effects,
            "per_step": PER_STEP,
            "wall_s": wall,
            "effects_per_s": total / wall,
            "runs_per_s": runs / wall,
            "start_runs_s": start_s,
            "deliveries": len(log),
            "expected": total,
            "duplicates": sum(n - 1 for n in counts.values()),
            "lost": len(expected - set(counts)),
            "unexpected": len(set(counts) - expected),
            "completed": status.get(RunStatus.COMPLETED.value, 0),
            "status": dict(status),
            "claim_conflicts": sum(s["claim_conflicts"] for s in stats),
            "leases_lost": sum(s["leases_lost"] for s in stats),
            "per_worker": stats,
            "lease_s": LEASE_S,
            "poll_s": POLL_S,
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        provider.stop()
        drop()
        shutil.rmtree(tmp, ignore_errors=True)


def _tail(tmp: Path) -> str:
    return " | ".join(
        p.name + ": " + " / ".join(p.read_text().strip().splitlines()[-3:])
        for p in sorted(tmp.glob("*.log"))
    )


# -- orchestration (called by bench.runner) --------------------------------------------
def phase_count(reps: int) -> int:
    """How many phases W4 runs (for the progress bar)."""
    return reps * len(WORKERS)


def run(reps: int, quick: bool, runner: Runner, progress: Progress, task: Any) -> dict[str, Any]:
    """W4: per repetition, one phase per worker count (1, 2, 4), alternating."""
    # Worker processes run from the runner's copy of the sources: add the upper layers.
    for pkg in ("adapters", "onceonly"):
        if not (runner.src / pkg).exists():
            shutil.copytree(
                ROOT / pkg, runner.src / pkg, ignore=shutil.ignore_patterns("__pycache__")
            )
    runs_n = QUICK_RUNS if quick else RUNS
    server, stop = _util.pg_server("onceonly-w4-pg-")
    out: list[dict[str, Any]] = []
    try:
        for rep in range(reps):
            line = []
            for n in WORKERS:
                progress.update(task, description=f"W4 rep {rep + 1}/{reps} {n} worker(s)")
                res = runner.phase(
                    "bench.w4",
                    [
                        "phase",
                        "--server",
                        server,
                        "--workers",
                        str(n),
                        "--runs",
                        str(runs_n),
                        "--effects",
                        str(EFFECTS),
                    ],
                    timeout=3600,
                )
                out.append({"rep": rep, "workers": n, **res})
                progress.advance(task)
                if "error" not in res:
                    line.append(
                        f"{n}: {res['effects_per_s']:,.0f} effects/s, "
                        f"{res['deliveries']:,}/{res['expected']:,} delivered"
                    )
                else:
                    line.append(f"{n}: failed")
            progress.console.print(f"W4 rep {rep + 1}: " + "; ".join(line))
    finally:
        stop()
    return {
        "runs": runs_n,
        "effects": EFFECTS,
        "per_step": PER_STEP,
        "workers": WORKERS,
        "server": "ONCEONLY_TEST_PG_URL" if os.environ.get("ONCEONLY_TEST_PG_URL") else "pgserver",
        "runs_list": out,
    }


# -- summary and report (called by bench.report) ---------------------------------------
def summarize(w4: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per worker count: effects/s (median over repetitions, min, max), the speed-up
    over one worker within the same repetition, claim conflicts, deliveries."""
    ok = [r for r in w4["runs_list"] if "error" not in r]
    one = {r["rep"]: r["effects_per_s"] for r in ok if r["workers"] == 1}
    out: dict[int, dict[str, Any]] = {}
    for n in w4["workers"]:
        mine = [r for r in ok if r["workers"] == n]
        eps = [r["effects_per_s"] for r in mine]
        ups = [r["effects_per_s"] / one[r["rep"]] for r in mine if one.get(r["rep"])]
        out[n] = {
            "effects_per_s": _util.median(eps),
            "min": min(eps) if eps else math.nan,
            "max": max(eps) if eps else math.nan,
            "speedup": _util.median(ups),
            "speedup_range": (min(ups), max(ups)) if ups else (math.nan, math.nan),
            "claim_conflicts": sum(r["claim_conflicts"] for r in mine),
            "leases_lost": sum(r["leases_lost"] for r in mine),
            "deliveries": sorted({r["deliveries"] for r in mine}),
            "exact": sum(
                r["deliveries"] == r["expected"] and not r["duplicates"] and not r["lost"]
                for r in mine
            ),
            "completed": sorted({r["completed"] for r in mine}),
            "load1": _util.median([r["loadavg_start"][0] for r in mine if "loadavg_start" in r]),
            "phases": len(mine),
            "errors": [r["error"] for r in w4["runs_list"] if r["workers"] == n and "error" in r],
        }
    return out


def targets(s4: dict[int, dict[str, Any]] | None, w4: dict[str, Any] | None) -> list[Target]:
    """The W4 targets."""
    from .summary import Target

    if not s4 or not w4:
        return []
    expected = w4["runs"] * w4["effects"]
    two = s4.get(2, {})
    return [
        Target(
            "W4",
            "effects/s grow from 1 to 2 worker processes (2 workers ÷ 1 worker > 1)",
            "onceonly worker",
            two.get("speedup", math.nan),
            "\N{MULTIPLICATION SIGN}",
            1.0,
            two.get("speedup_range", (math.nan, math.nan)),
            at_least=True,
        ),
        Target(
            "W4",
            f"raw deliveries exactly {expected:,} in every phase (phases exact / phases)",
            "onceonly worker",
            float(sum(r["exact"] for r in s4.values())),
            "calls",
            float(len(w4["runs_list"])),
            at_least=True,
        ),
    ]


def section(results: dict[str, Any]) -> list[str]:
    """The W4 section of docs/performance.md."""
    w4 = results["w4"]
    s4 = summarize(w4)
    expected = w4["runs"] * w4["effects"]
    head = [
        "worker processes",
        "effects/s (median)",
        "range over repetitions",
        "speed-up over 1 worker (same repetition)",
        "claim conflicts",
        "leases lost",
        f"raw deliveries (must be {expected:,})",
        "runs completed",
        "load average at start (median)",
    ]
    rows = []
    for n, r in s4.items():
        rows.append(
            [
                str(n),
                f"{r['effects_per_s']:,.0f}/s",
                f"{r['min']:,.0f} to {r['max']:,.0f}/s",
                f"{r['speedup']:.2f}\N{MULTIPLICATION SIGN}",
                str(r["claim_conflicts"]),
                str(r["leases_lost"]),
                ", ".join(f"{d:,}" for d in r["deliveries"])
                + f" ({r['exact']}/{r['phases']} exact)",
                ", ".join(f"{c:,}" for c in r["completed"]) + f" of {w4['runs']:,}",
                f"{r['load1']:.1f}",
            ]
        )
    align = "lrrrrrrrr"
    seps = ["---:" if a == "r" else "---" for a in align]
    lines = ["## W4 — many workers on PostgreSQL", ""]
    m = w4.get("meta")
    if m:  # measured by its own invocation (``python -m bench --only w4``), merged in
        lines += [
            (
                f"Measured {m['started_utc']} with {m['reps']} repetitions in "
                f"{m['duration_s'] / 60:.1f} min (load average {_load(m.get('loadavg_start'))} "
                f"at the start, {_load(m.get('loadavg_end'))} at the end)."
            ),
            "",
        ]
    lines += [
        (
            f"{w4['runs']:,} runs \N{MULTIPLICATION SIGN} {w4['effects']} guarded effects "
            f"({w4['per_step']} per step, "
            f"so {w4['effects'] // w4['per_step']} steps and checkpoints per run) drained by 1, 2 "
            "and 4 `onceonly` worker processes claiming runs with leases (`FOR UPDATE SKIP "
            "LOCKED`) on one throwaway PostgreSQL cluster (fsync on, unix socket). Each effect is "
            "a class B HTTP request to a counting fake provider (Starlette under uvicorn on "
            "127.0.0.1, in the phase's own process; it deduplicates nothing), so the raw "
            "delivery count is the oracle for duplicates and losses, not the ledger."
        ),
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(seps) + " |",
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        (
            "Effects/s = runs \N{MULTIPLICATION SIGN} effects \N{DIVISION SIGN} the time "
            "from releasing the workers (all set up and "
            "listening) until the last of them found nothing left to claim. A claim conflict is "
            "a run a worker claimed but found leased by another when it came to drive it; "
            "SKIP LOCKED makes concurrent claimers skip each other's rows, so conflicts only "
            "arise when a lease lapses under a slow worker. A worker spends much of each "
            "effect waiting (two PostgreSQL commits and the provider's answer), so more "
            "workers than CPUs still help until the CPUs, shared here by the provider, the "
            "server and the workers, or the WAL flushes saturate. The machine is shared with "
            "other jobs: read the figures with the load average beside them."
        ),
        "",
    ]
    errors = [e for r in s4.values() for e in r["errors"]]
    lines += [f"- W4 failed: `{e.splitlines()[0]}`" for e in errors]
    if errors:
        lines.append("")
    return lines


def _load(xs: Sequence[float] | None) -> str:
    return "/".join(f"{x:.1f}" for x in xs) if xs else "?"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w4", description=__doc__)
    p.add_argument("phase", choices=["phase", "worker"])
    p.add_argument("--server", help="PostgreSQL server URL (phase)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--runs", type=int, default=RUNS)
    p.add_argument("--effects", type=int, default=EFFECTS)
    p.add_argument("--url", help="database URL (worker)")
    p.add_argument("--owner", default="w1")
    p.add_argument("--lease-s", type=float, default=LEASE_S)
    p.add_argument("--poll-s", type=float, default=POLL_S)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.phase == "phase":
        if not a.server:
            p.error("phase needs --server")
        result = measure_phase(a.server, a.workers, a.runs, a.effects)
    else:
        if not a.url:
            p.error("worker needs --url")
        result = worker_phase(a.url, a.owner, a.lease_s, a.poll_s)
    _util.emit(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
