"""W2 — incremental checkpoints (S = 300 steps), one phase per process.

``python -m bench.w2 write --system NAME --db PATH --steps S --out RESULT.json``
    new database; S steps with sync durability, one checkpoint per step; per-step write
    latency and wall time; database bytes after ``wal_checkpoint(TRUNCATE)``.
``python -m bench.w2 load --system NAME --db PATH --steps S --out RESULT.json``
    fresh process: open the database and load the latest state, verified equal to the
    expected state after S steps.

The orchestrator (``python -m bench``) runs these alternating systems, each in a fresh
process, for every repetition.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _util, systems, workload

STEPS = 300
SYSTEMS = ["onceonly", "onceonly-save", "floor-full", "floor-delta", "langgraph", "langgraph-delta"]
FLOOR = "floor-full"


def _ms(xs: Sequence[float]) -> list[float]:
    return [round(x * 1e3, 5) for x in xs]


def write_phase(name: str, db: Path, steps: int) -> dict[str, Any]:
    """Run the timed write phase of ``name`` into the new database ``db``."""
    system = systems.get(name)
    _util.quiesce_gc()
    res = system.write_w2(db, steps)
    size = _util.checkpoint_and_size(db)
    return {
        "system": name,
        "phase": "write",
        "steps": steps,
        "write": _util.latency_summary(res.write_s),
        "step": _util.latency_summary(res.step_s),
        "total_s": res.total_s,
        "bytes": size,
        "write_ms": _ms(res.write_s),
        "step_ms": _ms(res.step_s),
        "extra": res.extra,
    }


def load_phase(name: str, db: Path, steps: int) -> dict[str, Any]:
    """Open ``db`` in this (fresh) process, load the latest state and verify it."""
    system = systems.get(name)
    _util.quiesce_gc()
    res = system.load_w2(db, steps)
    try:
        ok, why = workload.same_state(res.state, steps)
    finally:
        if res.close is not None:
            res.close()
    return {
        "system": name,
        "phase": "load",
        "steps": steps,
        "load_ms": res.seconds * 1e3,
        "breakdown": res.breakdown,
        "verified": ok,
        "why": why,
        "extra": res.extra,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w2", description=__doc__)
    p.add_argument("phase", choices=["write", "load"])
    p.add_argument("--system", required=True, choices=systems.names())
    p.add_argument("--db", required=True, type=Path)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.phase == "write":
        if a.db.exists():
            p.error(f"{a.db} exists; the write phase needs a new database")
        result = write_phase(a.system, a.db, a.steps)
    else:
        result = load_phase(a.system, a.db, a.steps)
    _util.emit(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
