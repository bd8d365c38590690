"""W1 — guarded effects (N = 2000 sequential calls in one run), one phase per process.

``python -m bench.w1 cold --system NAME --db PATH --calls N --out R.json``
    new database; N guarded calls, every one executing, intent and outcome durable (sync
    durability); per-call latency, total; results verified equal to what the body computes.
``python -m bench.w1 warm --system NAME --db PATH --calls N --out R.json``
    fresh process, the cold phase's database, the same run resumed: every call must return
    its recorded result without executing (the effect counter stays 0); per-call latency.
``python -m bench.w1 async --system onceonly --db PATH --calls N --concurrency 32 --out R.json``
    new database; 32 concurrent guarded calls in asyncio (``aperform`` on an ``async``
    durability store, group commit) until N are done; effects per second.
``python -m bench.w1 probe --system NAME --db PATH --calls 50 --out R.json``
    durable-before-return probe: a child process makes 50 guarded calls and ``os._exit``s
    right after the 50th returns; this process then counts the outcomes the database holds,
    and a second child resumes the run and counts how many of the 50 it executes again.
``python -m bench.w1 profile --system onceonly --db PATH --calls N --out R.json``
    the cold phase under cProfile (not a timing: where the time goes).
``python -m bench.w1 io --system NAME --db PATH --calls N --out R.json``
    the cold phase's I/O profile (not a timing): statements, commits, WAL frames and
    bytes per call, from SQLite's own trace of every connection the system opens; the
    same phase with no call is subtracted (set-up and schema).

The orchestrator (``python -m bench``) runs these alternating systems, each in a fresh
process, for every repetition.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import math
import os
import pstats
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _util, systems, workload

CALLS = workload.W1_CALLS
PROBE_CALLS = 50
CONCURRENCY = 32
SYSTEMS = ["onceonly", "onceonly-guard", "onceonly-witness", "floor", "langgraph", "dbos"]
FLOOR = "floor"
ASYNC_SYSTEMS = ["onceonly"]
CHILD_TIMEOUT_S = 300
#: Quantiles kept of each run's per-call latencies (the full lists would be 2000 numbers
#: per phase): enough for the distribution plots.
QUANTILES = [q / 2 for q in range(201)]


def verify(results: Sequence[Any], calls: int) -> tuple[bool, str]:
    """Whether call i returned, for every i, the result the body computes for its argument."""
    if len(results) != calls:
        return False, f"{len(results)} results for {calls} calls"
    for i, got in enumerate(results):
        if got != workload.make_result(workload.make_arg(i)):
            return False, f"call {i} returned {str(got)[:80]!r}, not the original result"
    return True, "equal"


def _quantiles_ms(xs: Sequence[float]) -> list[float]:
    if not xs:
        return []
    ordered = sorted(xs)
    n = len(ordered)
    out = []
    for q in QUANTILES:
        rank = min(n, max(1, math.ceil(q / 100.0 * n)))
        out.append(round(ordered[rank - 1] * 1e3, 5))
    return out


def _calls_result(
    name: str,
    phase: str,
    calls: int,
    res: systems.CallsResult,
    *,
    want_executed: int,
    cpu_s: float = math.nan,
) -> dict[str, Any]:
    same, why = verify(res.results, calls)
    executed_ok = res.executed == want_executed
    if not executed_ok:
        why = f"{res.executed} bodies executed, expected {want_executed}; results: {why}"
    return {
        "system": name,
        "phase": phase,
        "calls": calls,
        "call": _util.latency_summary(res.call_s),
        "total_s": res.total_s,
        "per_s": calls / res.total_s if res.total_s > 0 else math.nan,
        "first_ms": res.call_s[0] * 1e3 if res.call_s else math.nan,
        # process CPU time (all threads) over the system's whole phase, open included
        "cpu_ms_per_call": cpu_s * 1e3 / calls,
        "executed": res.executed,
        "verified": same and executed_ok,
        "why": why,
        "errors_by_type": res.errors,
        "call_ms_q": _quantiles_ms(res.call_s),
        "extra": res.extra,
    }


def cold_phase(name: str, db: Path, calls: int) -> tuple[dict[str, Any], bool]:
    """Run the timed cold phase of ``name`` into the new database ``db``."""
    system = systems.get_w1(name)
    _util.quiesce_gc()
    c0 = time.process_time()
    res = system.cold(db, calls)
    cpu = time.process_time() - c0
    out = _calls_result(name, "cold", calls, res, want_executed=calls, cpu_s=cpu)
    out["bytes"] = _stored_bytes(db)
    return out, res.hard_exit


def _stored_bytes(db: Path) -> int:
    """Database + WAL bytes after the run, folded with ``wal_checkpoint(TRUNCATE)`` where
    nothing holds it back (DBOS's process is still up: then db + wal as they are)."""
    try:
        return _util.checkpoint_and_size(db)
    except (RuntimeError, OSError, sqlite3.Error):
        return _util.db_bytes(db)


def warm_phase(name: str, db: Path, calls: int) -> dict[str, Any]:
    """Resume the cold run in this (fresh) process: every call replays."""
    system = systems.get_w1(name)
    _util.quiesce_gc()
    c0 = time.process_time()
    res = system.warm(db, calls)
    cpu = time.process_time() - c0
    return _calls_result(name, "warm", calls, res, want_executed=0, cpu_s=cpu)


def async_phase(name: str, db: Path, calls: int, concurrency: int) -> dict[str, Any]:
    """``concurrency`` concurrent guarded calls until ``calls`` are done (new database)."""
    system = systems.get_w1(name)
    _util.quiesce_gc()
    c0 = time.process_time()
    res = system.run_async(db, calls, concurrency)
    cpu = time.process_time() - c0
    out = _calls_result(name, "async", calls, res, want_executed=calls, cpu_s=cpu)
    out["concurrency"] = concurrency
    return out


def _child(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "bench.w1", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )


def probe_phase(name: str, db: Path, calls: int) -> dict[str, Any]:
    """A child makes ``calls`` guarded calls and exits right after the last returns; a
    second child counts the outcomes the database holds, then resumes the run and counts
    how many of the calls it executes again. (This process imports no system.)"""
    t0 = time.perf_counter()
    child = _child(["probe-child", "--system", name, "--db", str(db), "--calls", str(calls)])
    child_s = time.perf_counter() - t0
    if child.returncode != 0:
        tail = "\n".join((child.stderr or child.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"probe child exited {child.returncode}:\n{tail}")
    with tempfile.TemporaryDirectory(prefix="w1-probe-") as tmp:
        out = Path(tmp) / "resume.json"
        args = ["resume", "--system", name, "--db", str(db), "--calls", str(calls)]
        resume = _child([*args, "--out", str(out)])
        if resume.returncode != 0 or not out.exists():
            tail = "\n".join((resume.stderr or resume.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"probe resume exited {resume.returncode}:\n{tail}")
        res = json.loads(out.read_text(encoding="utf-8"))
    errors = sum(res["errors_by_type"].values())
    return {
        "system": name,
        "phase": "probe",
        "calls": calls,
        "recorded": res["recorded"],
        "not_reexecuted": calls - res["executed"],
        "replayed": calls - res["executed"] - errors,
        "reexecuted": res["executed"],
        "resume_errors": res["errors_by_type"],
        "resume_verified": res["verified"],
        "resume_why": res["why"],
        "child_s": child_s,
        "ok": res["recorded"] == calls and res["executed"] == 0 and errors == 0,
    }


def resume_phase(name: str, db: Path, calls: int) -> dict[str, Any]:
    """The probe's second child: count the recorded outcomes (a read), then resume like
    warm, except that a call that raises is counted rather than fatal."""
    system = systems.get_w1(name)
    recorded = system.recorded(db, calls)
    res = system.warm(db, calls, tolerant=True)
    out = _calls_result(name, "resume", calls, res, want_executed=0)
    out["recorded"] = recorded
    return out


def profile_phase(name: str, db: Path, calls: int, top: int = 25) -> dict[str, Any]:
    """The cold phase under cProfile: the functions where the time goes."""
    system = systems.get_w1(name)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    res = system.cold(db, calls)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_cc, ncalls, tt, ct, _callers) in st.stats.items():
        # site-packages/x, lib/python3.N/x and the snapshot's src/x all print as x
        short = path.removeprefix(os.getcwd() + os.sep)
        short = re.sub(r"^.*?(site-packages/|/lib/python3\.\d+/|/src/)", "", short)
        rows.append(
            {
                "function": f"{short}:{line}({func})",
                "calls": ncalls,
                "tottime_s": tt,
                "cumtime_s": ct,
            }
        )
    by_tot = sorted(rows, key=lambda r: r["tottime_s"], reverse=True)[:top]
    by_cum = sorted(rows, key=lambda r: r["cumtime_s"], reverse=True)[: top * 2]
    return {
        "system": name,
        "phase": "profile",
        "calls": calls,
        "profiled_wall_s": wall,
        "profiled_total_s": res.total_s,
        "by_tottime": by_tot,
        "by_cumtime": by_cum,
    }


def _traced_cold(name: str, db: Path, calls: int) -> dict[str, Any]:
    """Run the cold phase with every SQLite connection traced (statements by their first
    word) and never checkpointed (``wal_autocheckpoint=0``, so the WAL files only grow:
    their largest size seen is every frame the phase wrote)."""
    counts: dict[str, int] = {}
    wals: dict[str, int] = {}
    pages: dict[str, int] = {}
    connect = sqlite3.connect

    def seen(sql: str) -> None:
        word = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else "?"
        counts[word] = counts.get(word, 0) + 1
        for wal, size in list(wals.items()):
            with contextlib.suppress(OSError):
                wals[wal] = max(size, os.stat(wal).st_size)

    def traced(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(database, *args, **kwargs)
        path = str(database)
        if path.startswith("file:"):
            path = path[5:].split("?", 1)[0]
        if path not in (":memory:", ""):
            wals.setdefault(path + "-wal", 0)
            pages[path + "-wal"] = int(conn.execute("PRAGMA page_size").fetchone()[0])
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.set_trace_callback(seen)
        return conn

    sqlite3.connect = traced  # type: ignore[assignment]
    sqlite3.dbapi2.connect = traced  # type: ignore[assignment]
    try:
        systems.get_w1(name).cold(db, calls)
    finally:
        sqlite3.connect = connect
        sqlite3.dbapi2.connect = connect
    frames = 0
    written = 0
    for wal, size in wals.items():
        page = pages.get(wal, 4096)
        n = max(size - 32, 0) // (page + 24)  # WAL header, then (frame header + page)s
        frames += n
        written += n * (page + 24)
    return {"statements": counts, "frames": frames, "wal_bytes": written}


def io_phase(name: str, db: Path, calls: int) -> dict[str, Any]:
    """Statements, commits, WAL frames and bytes per call of the cold phase."""
    empty = db.with_name(db.stem + "-empty" + db.suffix)

    def traced(path: Path, n: int) -> dict[str, Any]:
        # each in a process of its own (a system may start only once per process)
        out = path.with_suffix(".io.json")
        cmd = [sys.executable, "-m", "bench.w1", "io-raw", "--system", name, "--db", str(path)]
        subprocess.run(
            [*cmd, "--calls", str(n), "--out", str(out)],
            check=True,
            timeout=CHILD_TIMEOUT_S,
            capture_output=True,
        )
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    base = traced(empty, 0)
    full = traced(db, calls)
    words = sorted(set(base["statements"]) | set(full["statements"]))
    per_word = {
        w: (full["statements"].get(w, 0) - base["statements"].get(w, 0)) / calls for w in words
    }
    per_word = {w: n for w, n in per_word.items() if n > 0}
    commits = per_word.get("COMMIT", 0.0) + per_word.get("END", 0.0)
    frames = (full["frames"] - base["frames"]) / calls
    wal_bytes = (full["wal_bytes"] - base["wal_bytes"]) / calls
    return {
        "system": name,
        "phase": "io",
        "calls": calls,
        "statements_per_call": sum(per_word.values()),
        "by_word": per_word,
        "commits_per_call": commits,
        "frames_per_call": frames,
        "frames_per_commit": frames / commits if commits else math.nan,
        "wal_bytes_per_call": wal_bytes,
        "wal_bytes_per_commit": wal_bytes / commits if commits else math.nan,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w1", description=__doc__)
    p.add_argument(
        "phase",
        choices=[
            "cold",
            "warm",
            "async",
            "probe",
            "probe-child",
            "resume",
            "profile",
            "io",
            "io-raw",
        ],
    )
    p.add_argument("--system", required=True, choices=systems.w1_names())
    p.add_argument("--db", required=True, type=Path)
    p.add_argument("--calls", type=int, default=CALLS)
    p.add_argument("--concurrency", type=int, default=CONCURRENCY)
    p.add_argument("--out")
    a = p.parse_args(argv)
    fresh = a.phase in ("cold", "async", "probe", "probe-child", "profile", "io", "io-raw")
    if fresh and a.db.exists():
        p.error(f"{a.db} exists; the {a.phase} phase needs a new database")
    if a.phase == "probe-child":
        systems.get_w1(a.system).probe_child(a.db, a.calls)
        return 1  # probe_child never returns normally
    if a.out is None:
        p.error("--out is required")
    hard_exit = False
    if a.phase == "cold":
        result, hard_exit = cold_phase(a.system, a.db, a.calls)
    elif a.phase == "warm":
        result = warm_phase(a.system, a.db, a.calls)
    elif a.phase == "async":
        result = async_phase(a.system, a.db, a.calls, a.concurrency)
    elif a.phase == "probe":
        result = probe_phase(a.system, a.db, a.calls)
    elif a.phase == "resume":
        result = resume_phase(a.system, a.db, a.calls)
    elif a.phase == "io":
        result = io_phase(a.system, a.db, a.calls)
    elif a.phase == "io-raw":
        result = _traced_cold(a.system, a.db, a.calls)
        hard_exit = True  # a system's threads (DBOS's) may outlive the phase
    else:
        result = profile_phase(a.system, a.db, a.calls)
    _util.emit(a.out, result)
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
