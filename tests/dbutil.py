"""Read and tamper with a store's tables directly, the way an operator or a bad disk would.

Only table and column names of the stored schema are used here (they are what
``onceonly migrate --sql`` shows a DBA), never the store's Python internals.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

__all__ = [
    "blob_count",
    "blob_hashes",
    "body_sizes",
    "execute",
    "fetch",
    "stored_bytes",
]


def execute(engine: Engine, sql: str, **params: Any) -> int:
    """Run one statement in its own transaction; return the affected row count."""
    with engine.begin() as conn:
        res = conn.execute(text(sql), params)
        return int(res.rowcount or 0)


def fetch(engine: Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Rows of a query."""
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text(sql), params)]
        conn.rollback()
    return rows


def body_sizes(engine: Engine, run_id: str) -> dict[int, int]:
    """Stored body size in bytes of each checkpoint of a run, by seq."""
    rows = fetch(engine, "SELECT seq, length(body) FROM oo_checkpoints WHERE run_id = :r", r=run_id)
    return {int(seq): int(size) for seq, size in rows}


def blob_count(engine: Engine) -> int:
    """Rows in the blob table."""
    return int(fetch(engine, "SELECT count(*) FROM oo_blobs")[0][0])


def blob_hashes(engine: Engine) -> set[bytes]:
    """Hashes of every stored blob."""
    return {bytes(r[0]) for r in fetch(engine, "SELECT hash FROM oo_blobs")}


def stored_bytes(engine: Engine) -> int:
    """Bytes of every checkpoint body and blob in the store."""
    bodies = fetch(engine, "SELECT coalesce(sum(length(body)), 0) FROM oo_checkpoints")[0][0]
    blobs = fetch(engine, "SELECT coalesce(sum(length(data)), 0) FROM oo_blobs")[0][0]
    return int(bodies) + int(blobs)
