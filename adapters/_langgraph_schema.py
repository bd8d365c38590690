"""Tables of the LangGraph checkpointer (component ``langgraph`` in ``onceonly_schema``).

Channel values live in the checkpoint core (one store run per thread and namespace, one
store checkpoint per LangGraph checkpoint: delta + keyframe, content-addressed blobs).
These tables hold what LangGraph needs besides: which store run a thread's namespace
lives in, each checkpoint's id, parent, metadata and versions, and pending writes.
Checkpoint and write rows carry an unkeyed digest over their columns (accidents), and
every row a keyed **seal** (``<key id>:<MAC>``, :class:`checkpoint.RowKeys`, the
keyring's row keys) over the columns the saver trusts, checked before anything of the row
is decoded: without the secret a row can be neither forged nor recomputed after an edit.

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
from sqlalchemy.schema import DDL, CreateIndex, CreateTable

from onceonly.checkpoint import CorruptRecord, Migration, OnlyOn, RowKeys, Store, migrate_component

__all__ = [
    "CHECKPOINTS",
    "COMPONENT",
    "LANGGRAPH_MIGRATIONS",
    "THREADS",
    "UNKEYED_LIMITS",
    "WRITES",
    "check",
    "checkpoint_digest",
    "checkpoint_parts",
    "digest",
    "drop_store_runs",
    "make_seal",
    "migrate",
    "seal_unsealed",
    "thread_parts",
    "write_digest",
    "write_parts",
]

COMPONENT = "langgraph"

metadata = MetaData()


def _threads_table(meta: MetaData, *, sealed: bool) -> Table:
    """Which store run holds the channel values of a thread's namespace. A new run id is
    chosen whenever a namespace is (re)created or rewritten, so a run id is never reused."""
    return Table(
        "oo_lg_threads",
        meta,
        Column("thread_id", String, nullable=False),
        Column("checkpoint_ns", String, nullable=False),
        Column("run_id", String(200), nullable=False),
        Column("created_at", Float, nullable=False),
        *([Column("seal", LargeBinary, nullable=True)] if sealed else []),
        PrimaryKeyConstraint("thread_id", "checkpoint_ns"),
    )


def _checkpoints_table(meta: MetaData, *, sealed: bool) -> Table:
    """One row per LangGraph checkpoint; (run_id, seq) is the store checkpoint holding its
    channel values. ``record`` is canonical codec JSON of the checkpoint without its
    channel values (id, ts, versions, versions seen, ...) and of its metadata (stored
    compressed as checkpoint bodies are: see ``_delta.pack``)."""
    return Table(
        "oo_lg_checkpoints",
        meta,
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
        *([Column("seal", LargeBinary, nullable=True)] if sealed else []),
        PrimaryKeyConstraint("thread_id", "checkpoint_ns", "checkpoint_id"),
        sqlite_with_rowid=False,
    )


def _writes_table(meta: MetaData, *, sealed: bool) -> Table:
    """Pending writes of a checkpoint's tasks; ``value`` is canonical codec JSON."""
    return Table(
        "oo_lg_writes",
        meta,
        Column("thread_id", String, nullable=False),
        Column("checkpoint_ns", String, nullable=False),
        Column("checkpoint_id", String, nullable=False),
        Column("task_id", String, nullable=False),
        Column("idx", Integer, nullable=False),
        Column("channel", String, nullable=False),
        Column("task_path", String, nullable=False),
        Column("value", LargeBinary, nullable=False),
        Column("digest", LargeBinary, nullable=False),
        *([Column("seal", LargeBinary, nullable=True)] if sealed else []),
        PrimaryKeyConstraint("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"),
        sqlite_with_rowid=False,
    )


_v1 = MetaData()
_threads_v1 = _threads_table(_v1, sealed=False)
_checkpoints_v1 = _checkpoints_table(_v1, sealed=False)
_checkpoints_v1_by_lg_run = Index("oo_lg_checkpoints_lg_run", _checkpoints_v1.c.lg_run_id)
_writes_v1 = _writes_table(_v1, sealed=False)
# Today's tables (version 2: a keyed seal on every row).
threads = _threads_table(metadata, sealed=True)
checkpoints = _checkpoints_table(metadata, sealed=True)
checkpoints_by_lg_run = Index("oo_lg_checkpoints_lg_run", checkpoints.c.lg_run_id)
writes = _writes_table(metadata, sealed=True)

LANGGRAPH_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "LangGraph checkpointer: thread namespaces to store runs, checkpoint records "
        "(ids, parents, metadata, versions) and pending writes",
        (
            CreateTable(_threads_v1),
            CreateTable(_checkpoints_v1),
            CreateIndex(_checkpoints_v1_by_lg_run),
            CreateTable(_writes_v1),
        ),
    ),
    Migration(
        2,
        "LangGraph checkpointer: a keyed seal on every thread, checkpoint and write row "
        "(rows of version 1 are sealed by OnceOnlySaver.seal_unsealed())",
        tuple(
            OnlyOn(dialect, DDL(f"ALTER TABLE {table} ADD COLUMN seal {blob}"))  # type: ignore[no-untyped-call]
            for dialect, blob in (("sqlite", "BLOB"), ("postgresql", "BYTEA"))
            for table in ("oo_lg_threads", "oo_lg_checkpoints", "oo_lg_writes")
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


# Seal domains (a seal of one table never verifies as another's).
THREADS = "lg_threads"
CHECKPOINTS = "lg_checkpoints"
WRITES = "lg_writes"

UNKEYED_LIMITS = (
    "this LangGraph saver has no integrity keys (unkeyed=True): it detects accidental "
    "corruption (digests, content hashes) but not a thread, checkpoint or write row edited "
    "on purpose by someone who recomputes its unkeyed digest, which changes what a graph "
    "resumes from (its serializer still builds only allow-listed types, so such an edit "
    "runs no code). Give it a keyring (ONCEONLY_SECRETS, or keyring=...) to detect them"
)


def thread_parts(thread_id: str, ns: str, run_id: str) -> list[object]:
    """What a thread row's seal covers: the namespace and the store run it lives in."""
    return [str(thread_id), str(ns), str(run_id)]


def checkpoint_parts(
    thread_id: str,
    ns: str,
    cid: str,
    parent: str | None,
    run_id: str,
    seq: int,
    lg_run: str | None,
    record: bytes,
) -> list[object]:
    """What a checkpoint row's digest and seal cover: every column but ``created_at``."""
    return [
        str(thread_id),
        str(ns),
        str(cid),
        None if parent is None else str(parent),
        str(run_id),
        int(seq),
        None if lg_run is None else str(lg_run),
        bytes(record),
    ]


def write_parts(
    thread_id: str,
    ns: str,
    cid: str,
    task_id: str,
    idx: int,
    channel: str,
    task_path: str,
    value: bytes,
) -> list[object]:
    """What a write row's digest and seal cover: every column."""
    return [
        str(thread_id),
        str(ns),
        str(cid),
        str(task_id),
        int(idx),
        str(channel),
        str(task_path),
        bytes(value),
    ]


def checkpoint_digest(parts: list[object]) -> bytes:
    """The unkeyed digest of a checkpoint row (:func:`checkpoint_parts`)."""
    return digest("ck", *parts)


def write_digest(parts: list[object]) -> bytes:
    """The unkeyed digest of a write row (:func:`write_parts`)."""
    return digest("wr", *parts)


def make_seal(keys: RowKeys | None, table: str, parts: list[object]) -> bytes | None:
    """The seal to store with a row (None without keys)."""
    return None if keys is None else keys.seal(table, parts)


def check(
    keys: RowKeys | None,
    table: str,
    parts: list[object],
    seal: bytes | None,
    *,
    what: str,
    run_id: str | None = None,
    seq: int | None = None,
) -> None:
    """Refuse a row whose seal does not verify (without keys nothing is checked).

    Raises:
        CorruptRecord: The row was edited, forged or moved, or carries no seal.
    """
    if keys is None:
        return
    if seal is None:
        raise CorruptRecord(
            f"{what} carries no seal (written by a saver without integrity keys or before "
            f"sealing, or edited to drop it); it is not read. If the database predates "
            f"sealing, check it and call OnceOnlySaver.seal_unsealed() once",
            run_id=run_id,
            seq=seq,
        )
    if not keys.valid(table, parts, bytes(seal)):
        raise CorruptRecord(
            f"{what} fails its keyed seal (edited, forged or moved, or sealed with a key "
            f"this keyring no longer holds); it is not read",
            run_id=run_id,
            seq=seq,
        )


def seal_unsealed(store: Store, keys: RowKeys) -> int:
    """Seal every saver row that carries no seal, in one transaction: an operator's
    decision to trust rows written before sealing (or by an unkeyed saver). A checkpoint
    or write row that fails its unkeyed digest is not sealed: then nothing is.

    Returns:
        How many rows were sealed.

    Raises:
        CorruptRecord: An unsealed row fails its digest (nothing was sealed).
    """
    q = store.param

    thread_sql = (
        f"UPDATE oo_lg_threads SET seal = {q} WHERE thread_id = {q} AND checkpoint_ns = {q}"
    )
    checkpoint_sql = (
        f"UPDATE oo_lg_checkpoints SET seal = {q} WHERE thread_id = {q} AND "
        f"checkpoint_ns = {q} AND checkpoint_id = {q}"
    )
    write_sql = (
        f"UPDATE oo_lg_writes SET seal = {q} WHERE thread_id = {q} AND checkpoint_ns = {q} "
        f"AND checkpoint_id = {q} AND task_id = {q} AND idx = {q}"
    )

    def txn(cur: Any) -> int:
        updates: list[tuple[str, tuple[Any, ...]]] = []
        cur.execute("SELECT thread_id, checkpoint_ns, run_id FROM oo_lg_threads WHERE seal IS NULL")
        for tid, ns, rid in cur.fetchall():
            updates.append((thread_sql, (keys.seal(THREADS, thread_parts(tid, ns, rid)), tid, ns)))
        cur.execute(
            "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, "
            "seq, lg_run_id, record, digest FROM oo_lg_checkpoints WHERE seal IS NULL"
        )
        for *cols, dg in cur.fetchall():
            parts = checkpoint_parts(*cols)
            if checkpoint_digest(parts) != bytes(dg):
                raise CorruptRecord(
                    f"LangGraph checkpoint {cols[2]!r} (thread {cols[0]!r}) fails its digest; "
                    f"nothing was sealed"
                )
            updates.append((checkpoint_sql, (keys.seal(CHECKPOINTS, parts), *cols[:3])))
        cur.execute(
            "SELECT thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, task_path, "
            "value, digest FROM oo_lg_writes WHERE seal IS NULL"
        )
        for *cols, dg in cur.fetchall():
            parts = write_parts(*cols)
            if write_digest(parts) != bytes(dg):
                raise CorruptRecord(
                    f"a pending write of LangGraph checkpoint {cols[2]!r} (thread "
                    f"{cols[0]!r}) fails its digest; nothing was sealed"
                )
            updates.append((write_sql, (keys.seal(WRITES, parts), *cols[:5])))
        for sql, params in updates:
            cur.execute(sql, params)
        return len(updates)

    return store.transact(txn)


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
