"""A LangGraph checkpointer on onceonly's checkpoint core (the ``onceonly[langgraph]`` extra).

Swap LangGraph's checkpointer for :class:`OnceOnlySaver` and a graph's checkpoints get
compact storage (deltas and keyframes, content-addressed blobs), integrity checks on
every read, and live in the same database as the effects ledger::

    saver = OnceOnlySaver.from_url("sqlite:///agent.db")
    graph = builder.compile(checkpointer=saver)
    graph.invoke(inputs, {"configurable": {"thread_id": "t-1"}})

**What is stored how.** Each ``(thread_id, checkpoint_ns)`` is one run of the checkpoint
core, and each LangGraph checkpoint one checkpoint of that run whose state is the
checkpoint's ``channel_values``: a channel unchanged since the previous checkpoint costs
nothing, a dict channel costs the keys that changed, a list channel (messages) the
appended items; every so often a keyframe stores the whole state, large dicts split into
pages and long lists into sealed chunks, each a content-addressed (blake3) blob shared by
every checkpoint that refers to it. Values are stored in onceonly's canonical codec where
it is exact (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, and lists, tuples
and string-keyed dicts of them); every other value inside them (LangChain messages,
Pydantic models, LangGraph's markers) is serialised by the saver's ``serde`` and its
bytes stored inside the canonical JSON, so a list of messages is still stored message by
message. The rest of a checkpoint (id, parent, timestamp, channel versions, versions seen)
and its metadata are one record row, pending writes one row each (tables ``oo_lg_*``,
schema component ``langgraph``).

**Integrity.** Every row carries a digest (accidents) and, with integrity keys, a keyed
seal (deliberate edits): thread rows, checkpoint records, pending writes here, and the
store's runs and checkpoints under them (:mod:`checkpoint.integrity`). The keys come from
the keyring (``keyring=``, else ``ONCEONLY_SECRETS``); a saver without them must be asked
for (``unkeyed=True``) and says what it cannot detect (:attr:`OnceOnlySaver.integrity_note`).
Seals are checked before anything of a row is decoded. A row, delta, blob or write that
fails a check raises :class:`~checkpoint.CorruptRecord` and is never returned.

**No code from stored bytes.** The default ``serde`` is :class:`StrictSerializer`:
LangGraph's encoding, and a decoder that builds only allow-listed types (LangChain
messages, LangGraph's markers, the types you register) and refuses any other with
:class:`UnregisteredType` before anything is constructed.

**Durability.** :meth:`OnceOnlySaver.from_url` opens its own store and commits each
``put`` (the channel values and the checkpoint record) in one transaction, durable when
``put`` returns. Around a store you pass in, ``put`` follows that store's durability mode
(``sync``: values first, then the record; a record is never written for values that are
not there).

**Deletion.** ``delete_thread``, ``prune`` and ``delete_for_runs`` rewrite or drop the
affected namespaces' store runs, so deleted channel values and the blobs only they used
are removed from the database, not merely hidden.

LangGraph is imported by this module: import it only with the extra installed
(``import adapters`` does not import it).
"""

from __future__ import annotations

import asyncio
import builtins
import os
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from onceonly.checkpoint import (
    CheckpointNotFound,
    Codec,
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    Durability,
    Handoff,
    KeyframePolicy,
    OnceOnlyError,
    RowKeys,
    RunNotFound,
    Store,
    ensure_schema,
)
from onceonly.ledger import Keyring

from . import _langgraph_schema as _schema
from ._langgraph_serde import StrictSerializer, UnregisteredType
from ._langgraph_values import pack, register, seal, unpack, unseal

__all__ = ["OnceOnlySaver", "StrictSerializer", "UnregisteredType", "copy_threads", "migrate"]

migrate = _schema.migrate

T = TypeVar("T")
_FLOW = "langgraph"
_RUN_CACHE = 4096
_ATTEMPTS = 3
_CK_COLS = (
    "thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, seq, lg_run_id, "
    "record, digest, seal"
)
_WRITE_COLS = "task_id, idx, channel, task_path, value, digest, seal"


class _Stale(OnceOnlyError):
    """The store run this process remembered for a namespace is gone (deleted or
    rewritten by another saver): look it up again."""


@dataclass(frozen=True)
class _Row:
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str | None
    run_id: str
    seq: int
    lg_run_id: str | None
    record: bytes
    digest: bytes
    seal: bytes | None

    @classmethod
    def of(cls, r: Sequence[Any]) -> _Row:
        return cls(
            str(r[0]),
            str(r[1]),
            str(r[2]),
            None if r[3] is None else str(r[3]),
            str(r[4]),
            int(r[5]),
            None if r[6] is None else str(r[6]),
            bytes(r[7]),
            bytes(r[8]),
            None if r[9] is None else bytes(r[9]),
        )

    def parts(self) -> list[object]:
        return _schema.checkpoint_parts(
            self.thread_id,
            self.checkpoint_ns,
            self.checkpoint_id,
            self.parent_checkpoint_id,
            self.run_id,
            self.seq,
            self.lg_run_id,
            self.record,
        )


def _row_keys(keyring: Keyring | None, *, unkeyed: bool) -> RowKeys | None:
    """The keys a saver seals with: the keyring's, else ``ONCEONLY_SECRETS``'s; none
    only when asked for (``unkeyed``).

    Raises:
        ConfigurationError: No keyring, no ``ONCEONLY_SECRETS`` and not ``unkeyed``; or a
            keyring and ``unkeyed`` both; or ``ONCEONLY_SECRETS`` is malformed.
    """
    if keyring is not None and unkeyed:
        raise ConfigurationError("OnceOnlySaver: pass a keyring or unkeyed=True, not both")
    if keyring is not None:
        return keyring.row_keys()
    if unkeyed:
        return None
    if os.environ.get("ONCEONLY_SECRETS"):
        return Keyring.from_env().row_keys()
    raise ConfigurationError(_NO_KEYS)


_NO_KEYS = (
    "OnceOnlySaver: no integrity keys. Set ONCEONLY_SECRETS (as for the ledger), pass "
    "keyring=Keyring(...), or give it a store opened with integrity keys; or pass "
    "unkeyed=True to run without them: then a checkpoint, write or thread row edited by "
    "someone who recomputes its unkeyed digest is not detected"
)


def _conf(config: RunnableConfig) -> dict[str, Any]:
    return config.get("configurable") or {}


class OnceOnlySaver(BaseCheckpointSaver[str]):
    """LangGraph's ``BaseCheckpointSaver`` on onceonly's checkpoint core (SQLite or
    PostgreSQL).

    Implements the sync methods (``get_tuple``, ``list``, ``put``, ``put_writes``,
    ``delete_thread``, ``delete_for_runs``, ``copy_thread``, ``prune``) and their async
    twins. Every call runs on the saver's one worker thread (the async ones await it):
    safe to share between threads and event loops; calls on one saver are serialised.

    Args:
        store: The checkpoint store (shared with a ``Ledger`` if you like: the ledger
            gives it its keyring's keys). The saver creates its tables there when the
            database has none.
        serde: The serializer for values the codec cannot store exactly (default:
            :class:`StrictSerializer`, which builds only allow-listed types; register
            yours with ``StrictSerializer(allow=[...])``). A permissive serializer
            (LangGraph's ``JsonPlusSerializer``) builds whatever a stored value names.
        create: Create the saver's tables in a database without them (an older schema
            is never migrated implicitly: run ``onceonly migrate --langgraph``).
        keyring: Seal and check rows with this keyring's row keys (attached to
            ``store``). Default: the store's keys, else ``ONCEONLY_SECRETS``'s.
        unkeyed: Accept a store without integrity keys (``ONCEONLY_SECRETS`` is then not
            read; :attr:`integrity_note` says what is not detected).

    Raises:
        ConfigurationError: No integrity keys and not ``unkeyed``; or ``store`` already
            seals with other keys than ``keyring``'s.
        SchemaVersionError: The saver's tables are older or newer than this code.
    """

    def __init__(
        self,
        store: Store,
        *,
        serde: SerializerProtocol | None = None,
        create: bool = True,
        keyring: Keyring | None = None,
        unkeyed: bool = False,
    ) -> None:
        super().__init__(serde=serde or StrictSerializer())
        if keyring is not None or store.integrity is None:
            keys = _row_keys(keyring, unkeyed=unkeyed)
            if keys is not None:
                store.attach_integrity(keys)
        ensure_schema(store.engine, _schema.COMPONENT, _schema.LANGGRAPH_MIGRATIONS, create=create)
        register(store.codec)
        self.store = store
        self._codec = Codec()
        register(self._codec)
        self._q = store.param
        self._lock = threading.RLock()
        self._runs: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._owns_store = False
        self._worker_ident: int | None = None
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="onceonly-langgraph", initializer=self._mark
        )

    def _mark(self) -> None:
        self._worker_ident = threading.get_ident()

    @property
    def _keys(self) -> RowKeys | None:
        # The store's, read at each use: a Ledger given the same store later attaches its
        # keyring's keys there.
        return self.store.integrity

    @property
    def integrity_note(self) -> str | None:
        """What this saver cannot detect (None when it seals and checks its rows)."""
        return None if self._keys is not None else _schema.UNKEYED_LIMITS

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        keyring: Keyring | None = None,
        unkeyed: bool = False,
        serde: SerializerProtocol | None = None,
        keyframes: KeyframePolicy | None = None,
        create: bool = True,
        busy_timeout_ms: int = 5000,
    ) -> OnceOnlySaver:
        """Open a saver on its own store (closed by :meth:`close`).

        Each ``put`` commits the checkpoint's values and its record in one transaction.

        Args:
            url: ``sqlite:///path`` or ``postgresql+psycopg://...``.
            keyring: The keyring whose row keys seal and check every row (default:
                ``Keyring.from_env()`` when ``ONCEONLY_SECRETS`` is set).
            unkeyed: Run without integrity keys (``ONCEONLY_SECRETS`` is then not read):
                accidental corruption is still detected, deliberate edits are not
                (:attr:`integrity_note`).
            serde: As in the constructor.
            keyframes: When the store writes a full keyframe instead of a delta.
            create: Create the schema in an empty database.
            busy_timeout_ms: How long a SQLite writer waits for the lock.

        Raises:
            ConfigurationError: No keyring, ``ONCEONLY_SECRETS`` unset and not
                ``unkeyed``; or as :meth:`checkpoint.Store.open`.
            DatabaseUnavailable / SchemaVersionError: As :meth:`checkpoint.Store.open`.
        """
        keys = _row_keys(keyring, unkeyed=unkeyed)
        # "exit" durability: a put's values wait in memory for the transaction that
        # writes its record, so both commit together (put holds the lock throughout).
        store = Store.open(
            url,
            durability=Durability.EXIT,
            keyframes=keyframes,
            create=create,
            busy_timeout_ms=busy_timeout_ms,
            integrity=keys,
        )
        try:
            saver = cls(store, serde=serde, create=create, unkeyed=keys is None)
        except BaseException:
            store.close()
            raise
        saver._owns_store = True
        return saver

    def seal_unsealed(self) -> int:
        """Seal every row written before sealing (or by an unkeyed saver) as it stands:
        the saver's rows, and the store's runs, checkpoints and waits. An operator's
        decision to trust the current contents, taken once after checking them (an
        upgraded database: ``onceonly migrate --langgraph``, then this).

        Returns:
            How many rows were sealed.

        Raises:
            ConfigurationError: The saver has no integrity keys.
            CorruptRecord: An unsealed saver row fails its digest (none was sealed).
        """
        keys = self._keys
        if keys is None:
            raise ConfigurationError(f"nothing to seal with: {_schema.UNKEYED_LIMITS}")

        def work() -> int:
            with self._lock:
                return _schema.seal_unsealed(self.store, keys) + self.store.seal_unsealed()

        return self._call(work)

    def close(self) -> None:
        """Stop the saver's worker thread; close the store if this saver opened it
        (:meth:`from_url`)."""
        self._worker.shutdown(wait=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> OnceOnlySaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- versions ----------------------------------------------------------------------
    def get_next_version(self, current: str | int | float | None, channel: None) -> str:
        """The next channel version, in the format of LangGraph's SQL savers
        (``"<32-digit counter>.<16-digit random>"``), so threads copied from them keep
        comparable versions."""
        if current is None:
            n = 0
        elif isinstance(current, int | float):
            n = int(current)
        else:
            n = int(str(current).split(".")[0])
        # Not security: a tie-break between versions, as LangGraph's savers do.
        return f"{n + 1:032}.{random.random():016}"  # noqa: S311

    # -- write -------------------------------------------------------------------------
    def _put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint (its channel values as a delta on the namespace's previous
        checkpoint) with its metadata.

        Returns:
            The config of the stored checkpoint.

        Raises:
            CodecError: A value can be stored neither by the codec nor by the serde.
            StoreError: The database refused; nothing of the checkpoint is visible.
        """
        conf = _conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        parent = conf.get("checkpoint_id")
        parent = None if parent is None else str(parent)
        cid = str(checkpoint["id"])
        serde = self.serde
        values = {k: pack(v, serde) for k, v in checkpoint["channel_values"].items()}
        rest = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        md = dict(get_serializable_checkpoint_metadata(config, metadata))
        record = seal(self._codec.encode(pack({"c": rest, "m": md}, serde)))
        lg_run = None if md.get("run_id") is None else str(md["run_id"])
        step = f"{md.get('source', '')}:{md.get('step', '')}"[:200]
        with self._lock:
            for attempt in range(_ATTEMPTS):
                try:
                    run_id = self._run_for(thread_id, ns)
                    seq = self.store.save(run_id, values, step=step).seq

                    def write(cur: Any, run_id: str = run_id, seq: int = seq) -> None:
                        self._check_values(cur, run_id, seq)
                        self._upsert_row(
                            cur, thread_id, ns, cid, parent, run_id, seq, lg_run, record
                        )

                    self.store.transact(write)
                    break
                except (ConcurrentWrite, RunNotFound, _Stale):
                    self._runs.pop((thread_id, ns), None)
                    if attempt == _ATTEMPTS - 1:
                        raise
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}}

    def _put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's pending writes for a checkpoint.

        Regular writes are kept at their first version (a re-run task does not change
        them); writes to LangGraph's special channels (errors, interrupts, resumes) are
        replaced, as in LangGraph's own savers.
        """
        conf = _conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        cid = str(conf["checkpoint_id"])
        encoded = []
        for i, (channel, value) in enumerate(writes):
            idx = WRITES_IDX_MAP.get(channel, i)
            data = seal(self._codec.encode(pack(value, self.serde)))
            encoded.append((str(task_id), idx, str(channel), str(task_path), data))
        if not encoded:
            return
        replace = all(w[0] in WRITES_IDX_MAP for w in writes)
        sql = self._insert_writes_sql(replace=replace)
        with self._lock:
            rows = [self._write_row(thread_id, ns, cid, *w) for w in encoded]
            self.store.transact(lambda cur: cur.executemany(sql, rows))

    # -- read --------------------------------------------------------------------------
    def _get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the namespace's latest without a
        ``checkpoint_id``; ``None`` when there is none.

        Raises:
            CorruptRecord: A row, delta, blob or write failed its integrity check.
        """
        conf = _conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        cid = get_checkpoint_id(config)
        q = self._q
        if cid:
            sql = (
                f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} AND "
                f"checkpoint_ns = {q} AND checkpoint_id = {q}"
            )
            params: tuple[Any, ...] = (thread_id, ns, str(cid))
        else:
            sql = (
                f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} AND "
                f"checkpoint_ns = {q} ORDER BY checkpoint_id DESC LIMIT 1"
            )
            params = (thread_id, ns)

        def read(cur: Any) -> tuple[_Row | None, list[Any]]:
            cur.execute(sql, params)
            found = cur.fetchone()
            if found is None:
                return None, []
            row = _Row.of(found)
            return row, self._select_writes(cur, [row])

        with self._lock:
            row, writes = self.store.read(read)
            if row is None:
                return None
            return self._tuple(row, writes)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first (by checkpoint id), of one thread (and namespace,
        if ``config`` names one), or of every thread when ``config`` is ``None``.

        Args:
            config: Which thread / namespace / checkpoint.
            filter: Metadata keys and the values they must equal.
            before: Only checkpoints older than this one.
            limit: At most this many.
        """
        q = self._q
        where: list[str] = []
        params: list[Any] = []
        conf = _conf(config) if config is not None else {}
        if conf.get("thread_id") is not None:
            where.append(f"thread_id = {q}")
            params.append(str(conf["thread_id"]))
        if "checkpoint_ns" in conf:
            where.append(f"checkpoint_ns = {q}")
            params.append(str(conf["checkpoint_ns"]))
        if conf.get("checkpoint_id"):
            where.append(f"checkpoint_id = {q}")
            params.append(str(conf["checkpoint_id"]))
        before_id = get_checkpoint_id(before) if before is not None else None
        if before_id:
            where.append(f"checkpoint_id < {q}")
            params.append(str(before_id))
        sql = f"SELECT {_CK_COLS} FROM oo_lg_checkpoints"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY checkpoint_id DESC"
        if limit is not None and not filter:
            sql += f" LIMIT {int(limit)}"

        def read(cur: Any) -> list[_Row]:
            cur.execute(sql, params)
            return [_Row.of(r) for r in cur.fetchall()]

        rows = self._call(self.store.read, read)
        if limit is not None and limit <= 0:
            return
        n = 0
        for row in rows:
            tup = self._call(self._list_item, row, filter)
            if tup is None:
                continue
            yield tup
            n += 1
            if limit is not None and n >= limit:
                return

    def _list_item(self, row: _Row, filter: dict[str, Any] | None) -> CheckpointTuple | None:
        if filter:
            md = self._record(row)["m"]
            if not all(k in md and md[k] == v for k, v in filter.items()):
                return None
        with self._lock:
            writes = self.store.read(lambda cur: self._select_writes(cur, [row]))
            return self._tuple(row, writes)

    # -- delete, copy, prune -----------------------------------------------------------
    def _delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread (all namespaces), with the
        channel values and the blobs only they used."""
        tid = str(thread_id)
        q = self._q

        def delete(cur: Any) -> None:
            cur.execute(f"SELECT run_id FROM oo_lg_threads WHERE thread_id = {q}", (tid,))
            runs = {str(r[0]) for r in cur.fetchall()}
            cur.execute(
                f"SELECT DISTINCT run_id FROM oo_lg_checkpoints WHERE thread_id = {q}", (tid,)
            )
            runs.update(str(r[0]) for r in cur.fetchall())
            for table in ("oo_lg_writes", "oo_lg_checkpoints", "oo_lg_threads"):
                cur.execute(f"DELETE FROM {table} WHERE thread_id = {q}", (tid,))
            _schema.drop_store_runs(cur, self.store.dialect, q, runs)

        with self._lock:
            self.store.transact(delete)
            self._forget(lambda key: key[0] == tid)

    def _delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) whose metadata names one of
        ``run_ids``; the namespaces they were in are rewritten without their values."""
        ids = sorted({str(r) for r in run_ids})
        if not ids:
            return
        q = self._q
        marks = ", ".join([q] * len(ids))

        def affected(cur: Any) -> list[tuple[str, str]]:
            cur.execute(
                "SELECT DISTINCT thread_id, checkpoint_ns FROM oo_lg_checkpoints "
                f"WHERE lg_run_id IN ({marks})",
                ids,
            )
            return [(str(r[0]), str(r[1])) for r in cur.fetchall()]

        gone = set(ids)
        with self._lock:
            for thread_id, ns in self.store.read(affected):
                self._rewrite(
                    thread_id, ns, lambda rows: [r for r in rows if r.lg_run_id not in gone]
                )

    def _prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        """Prune threads: ``"keep_latest"`` keeps the newest checkpoint of each
        namespace (and its writes), stored afresh as a keyframe; ``"delete"`` deletes
        the threads.

        Raises:
            ConfigurationError: Unknown strategy.
        """
        if strategy not in ("keep_latest", "delete"):
            raise ConfigurationError(
                f"prune strategy must be 'keep_latest' or 'delete', not {strategy!r}"
            )
        q = self._q
        for thread_id in thread_ids:
            tid = str(thread_id)
            if strategy == "delete":
                self._delete_thread(tid)
                continue

            def namespaces(cur: Any, tid: str = tid) -> list[str]:
                cur.execute(
                    f"SELECT DISTINCT checkpoint_ns FROM oo_lg_checkpoints WHERE thread_id = {q}",
                    (tid,),
                )
                return [str(r[0]) for r in cur.fetchall()]

            with self._lock:
                for ns in self.store.read(namespaces):
                    self._rewrite(tid, ns, lambda rows: [max(rows, key=lambda r: r.checkpoint_id)])

    def _copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint (all namespaces, same ids) and write of a thread to
        another thread. A source without checkpoints copies nothing."""
        src, dst = str(source_thread_id), str(target_thread_id)
        q = self._q

        def read(cur: Any) -> tuple[list[_Row], list[Any]]:
            cur.execute(
                f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} "
                "ORDER BY checkpoint_ns, seq",
                (src,),
            )
            rows = [_Row.of(r) for r in cur.fetchall()]
            cur.execute(
                f"SELECT checkpoint_ns, checkpoint_id, {_WRITE_COLS} FROM oo_lg_writes "
                f"WHERE thread_id = {q}",
                (src,),
            )
            return rows, cur.fetchall()

        with self._lock:
            rows, found = self.store.read(read)
            if not rows:
                return
            # Nothing unverified is sealed afresh under the target thread.
            writes = []
            for ns, cid, *cols in found:
                self._verified_write(src, str(ns), str(cid), cols)
                task_id, idx, channel, path, value = cols[:5]
                writes.append((str(ns), str(cid), str(task_id), int(idx), channel, path, value))
            placed: list[tuple[_Row, str, int]] = []
            for row in rows:
                self._verify(row)
                run_id = self._run_for(dst, row.checkpoint_ns)
                state = self._load_state(row)
                placed.append((row, run_id, self.store.save(run_id, state, step="copy").seq))
            sql = self._insert_writes_sql(replace=False)

            def write(cur: Any) -> None:
                for row, run_id, seq in placed:
                    self._check_values(cur, run_id, seq)
                    self._upsert_row(
                        cur,
                        dst,
                        row.checkpoint_ns,
                        row.checkpoint_id,
                        row.parent_checkpoint_id,
                        run_id,
                        seq,
                        row.lg_run_id,
                        row.record,
                    )
                copied = [
                    self._write_row(dst, ns, cid, task_id, idx, str(channel), str(path), bytes(v))
                    for ns, cid, task_id, idx, channel, path, v in writes
                ]
                if copied:
                    cur.executemany(sql, copied)

            try:
                self.store.transact(write)
            except (ConcurrentWrite, _Stale):
                self._forget(lambda key: key[0] == dst)
                raise

    # -- the public API: every store call runs on the saver's one worker thread ---------
    # LangGraph calls a checkpointer from a new pool of threads on every invoke; the
    # store keeps one connection per calling thread, so calls are funnelled through one
    # thread of the saver's own (which also serialises them).
    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.get_ident() == self._worker_ident:
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    async def _acall(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._worker.submit(fn, *args))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint (its channel values as a delta on the namespace's previous
        checkpoint) with its metadata.

        Returns:
            The config of the stored checkpoint.

        Raises:
            CodecError: A value can be stored neither by the codec nor by the serde.
            StoreError: The database refused; the checkpoint is not visible.
        """
        return self._call(self._put, config, checkpoint, metadata, new_versions)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's pending writes for a checkpoint.

        Regular writes keep their first version (a re-run task does not change them);
        writes to LangGraph's special channels (errors, interrupts, resumes) are
        replaced, as in LangGraph's own savers.
        """
        self._call(self._put_writes, config, writes, task_id, task_path)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the namespace's latest without a
        ``checkpoint_id``; ``None`` when there is none.

        Raises:
            CorruptRecord: A row, delta, blob or write failed its integrity check.
        """
        return self._call(self._get_tuple, config)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread (all namespaces), with the
        channel values and the blobs only they used."""
        self._call(self._delete_thread, thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) whose metadata names one of
        ``run_ids``; each namespace they were in is rewritten without their values."""
        self._call(self._delete_for_runs, run_ids)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads: ``"keep_latest"`` keeps the newest checkpoint of each
        namespace (and its writes), stored afresh as a keyframe; ``"delete"`` deletes
        the threads.

        Raises:
            ConfigurationError: Unknown strategy.
        """
        self._call(self._prune, thread_ids, strategy)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint (all namespaces, same ids) and write of a thread to
        another thread. A source without checkpoints copies nothing."""
        self._call(self._copy_thread, source_thread_id, target_thread_id)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`get_tuple`, awaiting the saver's worker thread."""
        return await self._acall(self._get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """:meth:`list`, awaiting the saver's worker thread (matches are read at once)."""
        items = await self._acall(
            lambda: [*self.list(config, filter=filter, before=before, limit=limit)]
        )
        for item in items:
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """:meth:`put`, awaiting the saver's worker thread."""
        return await self._acall(self._put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """:meth:`put_writes`, awaiting the saver's worker thread."""
        await self._acall(self._put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """:meth:`delete_thread`, awaiting the saver's worker thread."""
        await self._acall(self._delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """:meth:`delete_for_runs`, awaiting the saver's worker thread."""
        await self._acall(self._delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """:meth:`copy_thread`, awaiting the saver's worker thread."""
        await self._acall(self._copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """:meth:`prune`, awaiting the saver's worker thread."""
        await self._acall(self._prune, thread_ids, strategy)

    # -- internals ---------------------------------------------------------------------
    def _run_for(self, thread_id: str, ns: str) -> str:
        """The store run of a namespace, created (with its mapping row) if new."""
        key = (thread_id, ns)
        run_id = self._runs.get(key)
        if run_id is not None:
            self._runs.move_to_end(key)
            return run_id
        q = self._q
        select = (
            f"SELECT thread_id, checkpoint_ns, run_id, seal FROM oo_lg_threads WHERE "
            f"thread_id = {q} AND checkpoint_ns = {q}"
        )

        def lookup(cur: Any) -> str | None:
            cur.execute(select, key)
            found = cur.fetchone()
            return None if found is None else self._mapped_run(found)

        run_id = self.store.read(lookup)
        if run_id is None:
            fresh = uuid.uuid4().hex
            self.store.create_run(
                _FLOW,
                run_id=fresh,
                handoff=Handoff(goal=f"LangGraph thread {thread_id!r}, namespace {ns!r}"),
            )

            def claim(cur: Any) -> str:
                cur.execute(
                    "INSERT INTO oo_lg_threads (thread_id, checkpoint_ns, run_id, created_at, "
                    f"seal) VALUES ({q}, {q}, {q}, {q}, {q}) ON CONFLICT DO NOTHING",
                    (thread_id, ns, fresh, time.time(), self._thread_seal(thread_id, ns, fresh)),
                )
                cur.execute(select, key)
                winner = self._mapped_run(cur.fetchone())
                if winner != fresh:  # another saver created the namespace first
                    _schema.drop_store_runs(cur, self.store.dialect, q, [fresh])
                return winner

            run_id = self.store.transact(claim)
        self._runs[key] = run_id
        while len(self._runs) > _RUN_CACHE:
            self._runs.popitem(last=False)
        return run_id

    def _thread_seal(self, thread_id: str, ns: str, run_id: str) -> bytes | None:
        return _schema.make_seal(
            self._keys, _schema.THREADS, _schema.thread_parts(thread_id, ns, run_id)
        )

    def _mapped_run(self, found: Sequence[Any]) -> str:
        """The store run of a thread row (thread, namespace, run, seal), its seal checked."""
        thread_id, ns, run_id, sealed = found
        _schema.check(
            self._keys,
            _schema.THREADS,
            _schema.thread_parts(thread_id, ns, run_id),
            None if sealed is None else bytes(sealed),
            what=f"the store run of LangGraph thread {thread_id!r} (namespace {ns!r})",
            run_id=str(run_id),
        )
        return str(run_id)

    def _forget(self, match: Any) -> None:
        for key in [k for k in self._runs if match(k)]:
            del self._runs[key]

    def _check_values(self, cur: Any, run_id: str, seq: int) -> None:
        # The record is written only for values that are there: in the same transaction
        # (exit durability) or committed before it (sync).
        q = self._q
        cur.execute(f"SELECT 1 FROM oo_checkpoints WHERE run_id = {q} AND seq = {q}", (run_id, seq))
        if cur.fetchone() is None:
            raise _Stale(f"store run {run_id!r} has no checkpoint {seq}")

    def _upsert_row(
        self,
        cur: Any,
        thread_id: str,
        ns: str,
        cid: str,
        parent: str | None,
        run_id: str,
        seq: int,
        lg_run: str | None,
        record: bytes,
    ) -> None:
        q = self._q
        parts = _schema.checkpoint_parts(thread_id, ns, cid, parent, run_id, seq, lg_run, record)
        dg = _schema.checkpoint_digest(parts)
        sealed = _schema.make_seal(self._keys, _schema.CHECKPOINTS, parts)
        cur.execute(
            f"INSERT INTO oo_lg_checkpoints ({_CK_COLS}, created_at) VALUES "
            f"({', '.join([q] * 11)}) ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id) "
            "DO UPDATE SET parent_checkpoint_id = excluded.parent_checkpoint_id, "
            "run_id = excluded.run_id, seq = excluded.seq, lg_run_id = excluded.lg_run_id, "
            "record = excluded.record, digest = excluded.digest, seal = excluded.seal, "
            "created_at = excluded.created_at",
            (thread_id, ns, cid, parent, run_id, seq, lg_run, record, dg, sealed, time.time()),
        )

    def _insert_writes_sql(self, *, replace: bool) -> str:
        q = self._q
        action = (
            "DO UPDATE SET channel = excluded.channel, task_path = excluded.task_path, "
            "value = excluded.value, digest = excluded.digest, seal = excluded.seal"
            if replace
            else "DO NOTHING"
        )
        return (
            "INSERT INTO oo_lg_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, "
            f"channel, task_path, value, digest, seal) VALUES ({', '.join([q] * 10)}) "
            f"ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id, task_id, idx) {action}"
        )

    def _select_writes(self, cur: Any, rows: Sequence[_Row]) -> builtins.list[Any]:
        q = self._q
        out: builtins.list[Any] = []
        for row in rows:
            cur.execute(
                f"SELECT {_WRITE_COLS} FROM oo_lg_writes "
                f"WHERE thread_id = {q} AND checkpoint_ns = {q} AND checkpoint_id = {q} "
                "ORDER BY task_path, task_id, idx",
                (row.thread_id, row.checkpoint_ns, row.checkpoint_id),
            )
            out.extend(cur.fetchall())
        return out

    def _verify(self, row: _Row) -> None:
        """Check a checkpoint row's seal (with keys), then its digest; nothing of it is
        decoded before."""
        parts = row.parts()
        _schema.check(
            self._keys,
            _schema.CHECKPOINTS,
            parts,
            row.seal,
            what=f"the record of LangGraph checkpoint {row.checkpoint_id!r} (thread "
            f"{row.thread_id!r}, namespace {row.checkpoint_ns!r})",
            run_id=row.run_id,
            seq=row.seq,
        )
        if _schema.checkpoint_digest(parts) != row.digest:
            raise CorruptRecord(
                f"the record of LangGraph checkpoint {row.checkpoint_id!r} (thread "
                f"{row.thread_id!r}, namespace {row.checkpoint_ns!r}) does not match its "
                f"digest (edited, truncated or moved)",
                run_id=row.run_id,
                seq=row.seq,
            )

    def _verified_write(
        self, thread_id: str, ns: str, cid: str, found: Sequence[Any], row: _Row | None = None
    ) -> tuple[str, str, bytes]:
        """A write row's (task id, channel, stored value), its seal (with keys) and digest
        checked; nothing of it is decoded."""
        task_id, idx, channel, path, value, dg, sealed = found
        parts = _schema.write_parts(thread_id, ns, cid, task_id, idx, channel, path, value)
        where = f"a pending write of LangGraph checkpoint {cid!r} (thread {thread_id!r})"
        run_id, seq = (None, None) if row is None else (row.run_id, row.seq)
        _schema.check(
            self._keys,
            _schema.WRITES,
            parts,
            None if sealed is None else bytes(sealed),
            what=where,
            run_id=run_id,
            seq=seq,
        )
        if _schema.write_digest(parts) != bytes(dg):
            raise CorruptRecord(f"{where} fails its digest", run_id=run_id, seq=seq)
        return str(task_id), str(channel), bytes(value)

    def _write_row(
        self,
        thread_id: str,
        ns: str,
        cid: str,
        task_id: str,
        idx: int,
        channel: str,
        path: str,
        data: bytes,
    ) -> tuple[Any, ...]:
        """The columns of a write row to insert (digest and seal computed)."""
        parts = _schema.write_parts(thread_id, ns, cid, task_id, idx, channel, path, data)
        return (
            thread_id,
            ns,
            cid,
            task_id,
            idx,
            channel,
            path,
            data,
            _schema.write_digest(parts),
            _schema.make_seal(self._keys, _schema.WRITES, parts),
        )

    def _record(self, row: _Row) -> dict[str, Any]:
        self._verify(row)
        return self._decode_record(row)

    def _decode_record(self, row: _Row) -> dict[str, Any]:
        """The record of a row :meth:`_verify` accepted."""
        try:
            rec = unpack(self._codec.decode(unseal(row.record)), self.serde)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"the record of LangGraph checkpoint {row.checkpoint_id!r} is unreadable",
                run_id=row.run_id,
                seq=row.seq,
            ) from exc
        if not isinstance(rec, dict) or "c" not in rec or "m" not in rec:
            raise CorruptRecord(
                f"the record of LangGraph checkpoint {row.checkpoint_id!r} is malformed",
                run_id=row.run_id,
                seq=row.seq,
            )
        return rec

    def _load_state(self, row: _Row) -> dict[str, Any]:
        try:
            return self.store.load(row.run_id, row.seq).state
        except (RunNotFound, CheckpointNotFound) as exc:
            raise CorruptRecord(
                f"the channel values of LangGraph checkpoint {row.checkpoint_id!r} are missing",
                run_id=row.run_id,
                seq=row.seq,
            ) from exc

    def _tuple(self, row: _Row, writes: Iterable[Any]) -> CheckpointTuple:
        # Every row is checked (seal, then digest) before anything of any is decoded.
        self._verify(row)
        checked = [
            self._verified_write(row.thread_id, row.checkpoint_ns, row.checkpoint_id, w, row)
            for w in writes
        ]
        rec = self._decode_record(row)
        serde = self.serde
        values = {k: unpack(v, serde) for k, v in self._load_state(row).items()}
        checkpoint = cast(Checkpoint, {**rec["c"], "channel_values": values})
        pending = []
        for task_id, channel, data in checked:
            try:
                value = unpack(self._codec.decode(unseal(data)), serde)
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptRecord(
                    f"a pending write of LangGraph checkpoint {row.checkpoint_id!r} is unreadable",
                    run_id=row.run_id,
                    seq=row.seq,
                ) from exc
            pending.append((task_id, channel, value))
        config: RunnableConfig = {
            "configurable": {
                "thread_id": row.thread_id,
                "checkpoint_ns": row.checkpoint_ns,
                "checkpoint_id": row.checkpoint_id,
            }
        }
        parent: RunnableConfig | None = None
        if row.parent_checkpoint_id:
            parent = {
                "configurable": {
                    "thread_id": row.thread_id,
                    "checkpoint_ns": row.checkpoint_ns,
                    "checkpoint_id": row.parent_checkpoint_id,
                }
            }
        return CheckpointTuple(
            config, checkpoint, cast(CheckpointMetadata, rec["m"]), parent, pending
        )

    def _rewrite(self, thread_id: str, ns: str, keep: Any) -> None:
        """Store a namespace's surviving checkpoints (``keep(rows)``, rows in history
        order) in a new store run and drop the old one with everything else."""
        q = self._q

        def read(cur: Any) -> tuple[list[_Row], list[str]]:
            cur.execute(
                f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} AND "
                f"checkpoint_ns = {q} ORDER BY seq",
                (thread_id, ns),
            )
            rows = [_Row.of(r) for r in cur.fetchall()]
            cur.execute(
                "SELECT thread_id, checkpoint_ns, run_id, seal FROM oo_lg_threads WHERE "
                f"thread_id = {q} AND checkpoint_ns = {q}",
                (thread_id, ns),
            )
            return rows, [self._mapped_run(r) for r in cur.fetchall()]

        rows, mapped = self.store.read(read)
        keep_rows = keep(rows) if rows else []
        if len(keep_rows) == len(rows) and rows:
            return
        old_runs = {r.run_id for r in rows} | set(mapped)
        keep_ids = {r.checkpoint_id for r in keep_rows}
        placed: list[tuple[_Row, int]] = []
        new_run = uuid.uuid4().hex
        if keep_rows:
            self.store.create_run(
                _FLOW,
                run_id=new_run,
                handoff=Handoff(goal=f"LangGraph thread {thread_id!r}, namespace {ns!r}"),
            )
            for row in sorted(keep_rows, key=lambda r: r.seq):
                self._verify(row)
                info = self.store.save(new_run, self._load_state(row), step="rewrite")
                placed.append((row, info.seq))
        dropped = [r.checkpoint_id for r in rows if r.checkpoint_id not in keep_ids]

        def write(cur: Any) -> None:
            where = f"thread_id = {q} AND checkpoint_ns = {q} AND checkpoint_id = {q}"
            for cid in dropped:
                cur.execute(f"DELETE FROM oo_lg_writes WHERE {where}", (thread_id, ns, cid))
                cur.execute(f"DELETE FROM oo_lg_checkpoints WHERE {where}", (thread_id, ns, cid))
            if placed:
                for row, seq in placed:
                    self._check_values(cur, new_run, seq)
                    self._upsert_row(
                        cur,
                        thread_id,
                        ns,
                        row.checkpoint_id,
                        row.parent_checkpoint_id,
                        new_run,
                        seq,
                        row.lg_run_id,
                        row.record,
                    )
                cur.execute(
                    f"UPDATE oo_lg_threads SET run_id = {q}, seal = {q} WHERE thread_id = {q} "
                    f"AND checkpoint_ns = {q}",
                    (new_run, self._thread_seal(thread_id, ns, new_run), thread_id, ns),
                )
            else:
                cur.execute(
                    f"DELETE FROM oo_lg_threads WHERE thread_id = {q} AND checkpoint_ns = {q}",
                    (thread_id, ns),
                )
            _schema.drop_store_runs(cur, self.store.dialect, q, old_runs)

        try:
            self.store.transact(write)
        finally:
            self._runs.pop((thread_id, ns), None)


def copy_threads(
    source: BaseCheckpointSaver[Any],
    target: BaseCheckpointSaver[Any],
    *,
    thread_ids: Iterable[str] | None = None,
) -> int:
    """Copy threads from any LangGraph checkpointer (``SqliteSaver``, ``PostgresSaver``,
    ``InMemorySaver``, another :class:`OnceOnlySaver`) into ``target``.

    Every checkpoint of every namespace is copied oldest first, with its id, parent,
    metadata and pending writes, so a graph compiled with ``target`` resumes each thread
    where it stood and keeps its history (time travel included). Pending writes keep
    their task id and order; their task path, which LangGraph's read API does not
    return, is empty. Copying again overwrites the copied checkpoints with equal ones.

    Args:
        source: The checkpointer to read (its sync ``list`` API).
        target: The checkpointer to write (its sync ``put`` / ``put_writes``).
        thread_ids: Only these threads (default: every thread ``source`` lists).

    Returns:
        The number of checkpoints copied.
    """
    wanted = None if thread_ids is None else {str(t) for t in thread_ids}
    if wanted is None:
        tuples = list(source.list(None))
    else:
        tuples = [
            t for tid in sorted(wanted) for t in source.list({"configurable": {"thread_id": tid}})
        ]
    # Oldest first within each namespace, so parents are written before children and
    # the target's deltas follow the history.
    tuples.sort(
        key=lambda t: (
            str(t.config["configurable"]["thread_id"]),
            str(t.config["configurable"].get("checkpoint_ns", "")),
            str(t.config["configurable"]["checkpoint_id"]),
        )
    )
    for tup in tuples:
        conf = tup.config["configurable"]
        parent = tup.parent_config["configurable"]["checkpoint_id"] if tup.parent_config else None
        put_conf: dict[str, Any] = {
            "thread_id": conf["thread_id"],
            "checkpoint_ns": conf.get("checkpoint_ns", ""),
        }
        if parent is not None:
            put_conf["checkpoint_id"] = parent
        stored = target.put(
            {"configurable": put_conf},
            tup.checkpoint,
            tup.metadata,
            dict(tup.checkpoint["channel_versions"]),
        )
        by_task: dict[str, list[tuple[str, Any]]] = {}
        for task_id, channel, value in tup.pending_writes or []:
            by_task.setdefault(task_id, []).append((channel, value))
        for task_id, task_writes in by_task.items():
            target.put_writes(stored, task_writes, task_id)
    return len(tuples)
