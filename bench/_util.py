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
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
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


ROOT = Path(__file__).resolve().parent.parent


def pg_server(prefix: str) -> tuple[str, Callable[[], None]]:
    """A PostgreSQL server's URL and a function that stops it: ``ONCEONLY_TEST_PG_URL``
    when it is set (left running), else a throwaway cluster (``tests/pgserver.py``, unix
    socket only) started now."""
    url = os.environ.get("ONCEONLY_TEST_PG_URL")
    if url:
        return url, lambda: None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests import pgserver

    # Its own directory under /tmp: as root the server runs as ``postgres``, which may
    # not enter the benchmark's (private) temporary directory.
    base = Path(tempfile.mkdtemp(prefix=prefix))

    def stop() -> None:
        pgserver.stop(base)
        shutil.rmtree(base, ignore_errors=True)

    return pgserver.start(base), stop


def pg_database(server_url: str) -> str:
    """A new, empty database on the server of ``server_url`` (a SQLAlchemy URL); its URL."""
    import psycopg

    name = "bench_" + uuid.uuid4().hex[:16]
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, query = server_url.partition("?")
    return base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")


def pg_drop(url: str) -> None:
    """Drop the database at ``url`` (one :func:`pg_database` made)."""
    import psycopg

    base, _, query = url.partition("?")
    name = base.rsplit("/", 1)[1]
    admin = base.rsplit("/", 1)[0] + "/postgres" + ("?" + query if query else "")
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def libpq_url(url: str) -> str:
    """A SQLAlchemy ``postgresql+psycopg://`` URL as libpq reads it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def pg_bytes(url: str) -> int:
    """Bytes held by the tables (with their indexes and TOAST) of the database at ``url``."""
    import psycopg

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind = 'r' AND n.nspname = current_schema()"
        ).fetchone()
    return int(row[0]) if row else 0
