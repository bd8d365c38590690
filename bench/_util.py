"""Small helpers shared by the phases and the orchestrator: statistics, database size,
and the JSON hand-off from a phase process to the orchestrator."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sqlite3
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def quiesce_gc() -> None:
    """Collect, then freeze the heap left by imports and set-up.

    Every phase calls this just before its timed region, for every system alike: without
    it, whether a full (generation 2) collection of the import-time heap — 25-40 ms for
    SQLAlchemy or LangGraph — lands inside one system's timed window depends on allocation
    counts, not on the system. Collections of what the timed code allocates still run.
    """
    gc.collect()
    gc.freeze()


def median(xs: Sequence[float]) -> float:
    """The median (NaN for no data)."""
    return statistics.median(xs) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] (NaN for no data)."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """Median, p99 and max in milliseconds, and the count."""
    return {
        "median_ms": median(seconds) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "max_ms": (max(seconds) if seconds else math.nan) * 1e3,
        "n": float(len(seconds)),
    }


def checkpoint_and_size(db: Path) -> int:
    """Fold the WAL into the database (``wal_checkpoint(TRUNCATE)``), then db + wal bytes.

    Raises:
        RuntimeError: The checkpoint could not complete (a writer or reader is active).
    """
    conn = sqlite3.connect(db)
    try:
        busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.close()
    if busy:
        raise RuntimeError(f"wal_checkpoint(TRUNCATE) of {db} was blocked")
    return db_bytes(db)


def db_bytes(db: Path) -> int:
    """Size of the database file plus its WAL (if any)."""
    total = db.stat().st_size
    wal = db.with_name(db.name + "-wal")
    if wal.exists():
        total += wal.stat().st_size
    return total


def copy_db(src: Path, dst: Path) -> None:
    """Copy a quiescent SQLite database (after a TRUNCATE checkpoint) with its WAL."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    wal = src.with_name(src.name + "-wal")
    if wal.exists() and wal.stat().st_size:
        shutil.copyfile(wal, dst.with_name(dst.name + "-wal"))


def emit(path: str, result: dict[str, Any]) -> None:
    """Write a phase's result for the orchestrator (atomically)."""
    tmp = f"{path}.part"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, path)
