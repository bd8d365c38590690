"""Tables of the LangGraph checkpointer (component ``langgraph`` in ``onceonly_schema``).

Channel values live in the checkpoint core (one store run per thread and namespace, one
store checkpoint per LangGraph checkpoint: delta + keyframe, content-addressed blobs).
These tables hold what LangGraph needs besides: which store run a thread's namespace
lives in, each checkpoint's id, parent, metadata and versions, and pending writes. Every
row carries a digest over its columns, checked when it is read.

Imports nothing from LangGraph: ``onceonly migrate`` can create these tables without the
``onceonly[langgraph]`` extra.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import blake3
from sqlalchemy import (
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
)
from sqlalchemy.engine import Engine
from sqlalchemy.schema import CreateIndex, CreateTable

from checkpoint import Migration, migrate_component

__all__ = ["COMPONENT", "LANGGRAPH_MIGRATIONS", "digest", "drop_store_runs", "migrate"]

COMPONENT = "langgraph"

metadata = MetaData()

# Which store run holds the channel values of a thread's namespace. A new run id is
# chosen whenever a namespace is (re)created or rewritten, so a run id is never reused.
threads = Table(
    "oo_lg_threads",
    metadata,
    Column("thread_id", String, nullable=False),
    Column("checkpoint_ns", String, nullable=False),
    Column("run_id", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    PrimaryKeyConstraint("thread_id", "checkpoint_ns"),
)

# One row per LangGraph checkpoint; (run_id, seq) is the store checkpoint holding its
# channel values. ``record`` is canonical codec JSON of the checkpoint without its
# channel values (id, ts, versions, versions seen, ...) and of its metadata (sealed:
# zlib-compressed when that saves at least 10 %).
checkpoints = Table(
    "oo_lg_checkpoints",
    metadata,
    Column("thread_id", String, nullable=False),
    Column("checkpoint_ns", String, nullable=False),
    Column("checkpoint_id", String, nullable=False),
    Column("parent_checkpoint_id", String, nullable=True),
    Column("run_id", String(200), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("lg_run_id", String, nullable=True),  # metadata["run_id"], for delete_for_runs
    Column("record", LargeBinary, nullable=False),
    Column("digest", LargeBinary, nullable=False),
    Column("created_at", Float, nullable=False),
    PrimaryKeyConstraint("thread_id", "checkpoint_ns", "checkpoint_id"),
    sqlite_with_rowid=False,
)
checkpoints_by_lg_run = Index("oo_lg_checkpoints_lg_run", checkpoints.c.lg_run_id)

# Pending writes of a checkpoint's tasks; ``value`` is canonical codec JSON (sealed).
writes = Table(
    "oo_lg_writes",
    metadata,
    Column("thread_id", String, nullable=False),
    Column("checkpoint_ns", String, nullable=False),
    Column("checkpoint_id", String, nullable=False),
    Column("task_id", String, nullable=False),
    Column("idx", Integer, nullable=False),
    Column("channel", String, nullable=False),
    Column("task_path", String, nullable=False),
    Column("value", LargeBinary, nullable=False),
    Column("digest", LargeBinary, nullable=False),
    PrimaryKeyConstraint("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"),
    sqlite_with_rowid=False,
)

LANGGRAPH_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "LangGraph checkpointer: thread namespaces to store runs, checkpoint records "
        "(ids, parents, metadata, versions) and pending writes",
        (
            CreateTable(threads),
            CreateTable(checkpoints),
            CreateIndex(checkpoints_by_lg_run),
            CreateTable(writes),
        ),
    ),
)


def migrate(url_or_engine: str | Engine, *, sql: bool = False) -> str:
    """Bring the LangGraph checkpointer's tables to this release's version (or return
    their SQL, without the version table, which :func:`checkpoint.migrate`'s SQL
    creates)."""
    return migrate_component(
        url_or_engine, COMPONENT, LANGGRAPH_MIGRATIONS, sql=sql, version_table=False
    )


def digest(*fields: Any) -> bytes:
    """A digest binding a row's columns together (length-prefixed, so fields cannot
    slide into each other)."""
    h = blake3.blake3()
    for f in fields:
        if f is None:
            b = b"\xff"
        elif isinstance(f, bytes | bytearray | memoryview):
            b = b"b" + bytes(f)
        else:
            b = b"s" + str(f).encode("utf-8")
        h.update(b"%d:" % len(b) + b)
    return h.digest(length=16)


def drop_store_runs(cur: Any, dialect: str, q: str, run_ids: Iterable[str]) -> None:
    """Delete store runs with their checkpoints, blob references and the blobs no
    other run refers to, inside the caller's transaction.

    A stopgap until the checkpoint core offers this as ``Store.delete_runs``: the
    same statements :meth:`checkpoint.Store.apply_retention` runs per victim, plus a
    blob sweep limited to the dropped runs' blobs.
    """
    ids = sorted(set(run_ids))
    if not ids:
        return
    if dialect == "postgresql":
        # As Store.collect_garbage: wait for writers that inserted a blob and have not
        # yet committed its reference, so a shared blob is never swept between the two.
        cur.execute("LOCK TABLE oo_blobs IN SHARE ROW EXCLUSIVE MODE")
    hashes: set[bytes] = set()
    for rid in ids:
        cur.execute(f"SELECT hash FROM oo_blob_refs WHERE owner = {q}", (rid,))
        hashes.update(bytes(r[0]) for r in cur.fetchall())
        cur.execute(f"DELETE FROM oo_blob_refs WHERE owner = {q}", (rid,))
        cur.execute(f"DELETE FROM oo_checkpoints WHERE run_id = {q}", (rid,))
        cur.execute(f"DELETE FROM oo_run_links WHERE run_id = {q}", (rid,))
        cur.execute(f"DELETE FROM oo_runs WHERE run_id = {q}", (rid,))
    want = sorted(hashes)
    for i in range(0, len(want), 500):
        part = want[i : i + 500]
        marks = ", ".join([q] * len(part))
        cur.execute(
            f"DELETE FROM oo_blobs WHERE hash IN ({marks}) AND NOT EXISTS "
            f"(SELECT 1 FROM oo_blob_refs r WHERE r.hash = oo_blobs.hash)",
            part,
        )
