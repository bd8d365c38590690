"""W3 — resume cost versus history length, one phase per process.

``python -m bench.w3 build --system NAME --workdir DIR --sizes 100,1000,10000 --out R.json``
    write one history of W2-shaped steps by the system's fastest path that stores the same
    rows; at each size (and at a few more points, for the bytes-versus-steps plot) fold the
    WAL, record the database bytes and, at each size, copy the database to
    ``DIR/<size>.db``.
``python -m bench.w3 resume --system NAME --db PATH --steps N --out R.json``
    fresh process: open, load the latest checkpoint and reach the start of step N + 1;
    the state is verified equal to the expected state after N steps (after the timing).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _util, systems, workload

SIZES = [100, 1000, 10_000]
SYSTEMS = [
    "onceonly",
    "onceonly-lazy",
    "floor-full",
    "floor-delta",
    "floor-latest",
    "langgraph",
    "langgraph-delta",
]
#: Systems that resume from another system's histories (same rows, another read path).
BUILD_AS = {"onceonly-lazy": "onceonly"}
FLOOR = "floor-latest"
BYTE_POINTS = [10, 30, 100, 300, 1000, 3000, 10_000]


def snapshot_path(workdir: Path, size: int) -> Path:
    """Where the build leaves the database as it was after ``size`` steps."""
    return workdir / f"{size}.db"


def build_phase(name: str, workdir: Path, sizes: Sequence[int]) -> dict[str, Any]:
    """Build ``name``'s histories up to ``max(sizes)`` steps."""
    workdir.mkdir(parents=True, exist_ok=True)
    live = workdir / "live.db"
    if live.exists():
        raise FileExistsError(live)
    top = max(sizes)
    points = sorted({*sizes, *(p for p in BYTE_POINTS if p <= top)})
    bytes_at: dict[str, int] = {}
    t_points: dict[str, float] = {}
    system = systems.get(name)
    t0 = time.perf_counter()

    def at_point(n: int) -> None:
        bytes_at[str(n)] = _util.checkpoint_and_size(live)
        t_points[str(n)] = time.perf_counter() - t0
        if n in sizes:
            _util.copy_db(live, snapshot_path(workdir, n))

    extra = system.build(live, points, at_point)
    build_s = time.perf_counter() - t0
    live.unlink()
    for suffix in ("-wal", "-shm"):
        live.with_name(live.name + suffix).unlink(missing_ok=True)
    return {
        "system": name,
        "phase": "build",
        "sizes": list(sizes),
        "bytes_at": bytes_at,
        "elapsed_at_s": t_points,
        "build_s": build_s,
        "extra": extra,
    }


def resume_phase(name: str, db: Path, steps: int) -> dict[str, Any]:
    """Open ``db`` in this (fresh) process and reach the start of step ``steps + 1``."""
    system = systems.get(name)
    _util.quiesce_gc()
    res = system.resume(db, steps)
    try:
        ok, why = workload.same_state(res.state, steps)
    finally:
        if res.close is not None:
            res.close()
    return {
        "system": name,
        "phase": "resume",
        "steps": steps,
        "resume_ms": res.seconds * 1e3,
        "breakdown": res.breakdown,
        "verified": ok,
        "why": why,
        "extra": res.extra,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w3", description=__doc__)
    p.add_argument("phase", choices=["build", "resume"])
    p.add_argument("--system", required=True, choices=systems.names())
    p.add_argument("--workdir", type=Path)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--db", type=Path)
    p.add_argument("--steps", type=int)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.phase == "build":
        if a.workdir is None:
            p.error("build needs --workdir")
        sizes = sorted({int(x) for x in a.sizes.split(",") if x})
        result = build_phase(a.system, a.workdir, sizes)
    else:
        if a.db is None or a.steps is None:
            p.error("resume needs --db and --steps")
        result = resume_phase(a.system, a.db, a.steps)
    _util.emit(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
