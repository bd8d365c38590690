"""The saver: LangGraph's ``BaseCheckpointSaver`` interface, sync and async, over one
:class:`~._storage.Storage`; one call at a time (see ``OnceOnlySaver._call`` for on which
thread)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from onceonly.adapters import _langgraph_schema as _schema
from onceonly.adapters._langgraph_serde import StrictSerializer
from onceonly.adapters._langgraph_values import register
from onceonly.checkpoint import (
    ConfigurationError,
    Durability,
    KeyframePolicy,
    Store,
    ensure_schema,
)
from onceonly.ledger import Keyring

from ._rows import _row_keys
from ._storage import Storage

T = TypeVar("T")

_LIST_BATCH = 64  # checkpoints of one list() whose values are built in one forward walk


_CLOSED = "the saver is closed; open a new one"


class OnceOnlySaver(BaseCheckpointSaver[str]):
    """LangGraph's ``BaseCheckpointSaver`` on onceonly's checkpoint core (SQLite or
    PostgreSQL).

    Implements the sync methods (``get_tuple``, ``list``, ``put``, ``put_writes``,
    ``delete_thread``, ``delete_for_runs``, ``copy_thread``, ``prune``) and their async
    twins. Calls on one saver are serialised; a sync call runs on the caller's thread on
    SQLite and on the saver's worker thread on PostgreSQL, an async one on the worker
    thread (awaited): safe to share between threads and event loops.

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
        self._storage = Storage(store, self.serde)
        self._owns_store = False
        # Serialises every call, wherever it runs; reentrant: ``alist`` runs ``list`` on
        # the worker, whose batches call again.
        self._lock = threading.RLock()
        self._closed = False
        # See ``_call``: on SQLite a sync call runs on the caller's thread.
        self._inline = store.engine.dialect.name == "sqlite"
        self._worker_ident: int | None = None
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="onceonly-langgraph", initializer=self._mark
        )

    def _mark(self) -> None:
        self._worker_ident = threading.get_ident()

    @property
    def integrity_note(self) -> str | None:
        """What this saver cannot detect (None when it seals and checks its rows)."""
        return None if self._storage.keys is not None else _schema.UNKEYED_LIMITS

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
        keys = self._storage.keys
        if keys is None:
            raise ConfigurationError(f"nothing to seal with: {_schema.UNKEYED_LIMITS}")
        return self._call(self._storage.seal_unsealed, keys)

    def verify(self) -> tuple[int, list[str]]:
        """Check every row of the saver's tables, in every thread: each thread, checkpoint
        and pending-write row against its digest and (with keys) its seal, nothing of it
        decoded. A read finds an edited row of the thread it reads; this finds one that was
        moved to another thread or checkpoint (which a read of its own thread no longer
        meets), an edited thread mapping before the next put meets it, and every other.

        Returns:
            (rows checked, one line per problem found).
        """
        return self._call(self._storage.verify_rows)

    def close(self) -> None:
        """Stop the saver's worker thread; close the store if this saver opened it
        (:meth:`from_url`)."""
        with self._lock:  # after the call under way; calls queued behind it are refused
            if self._closed:
                return
            self._closed = True
        self._worker.shutdown(wait=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> OnceOnlySaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> OnceOnlySaver:
        """``async with OnceOnlySaver.from_url(url) as saver:`` (as LangGraph's async
        savers are used); :meth:`close` runs off the event loop on the way out."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    from_conn_string = from_url
    """:meth:`from_url` under the name LangGraph's SQL savers use (the saver it returns
    is a context manager, sync and async, as theirs are): ``url`` may also be a libpq
    connection string (``host=... dbname=... user=...``) or a ``postgres://`` URI."""

    def setup(self) -> None:
        """What LangGraph's SQL savers ask for before first use: the saver's tables and
        the store's exist at this release's version afterwards. This saver creates them
        when it opens (``create=True``), so ``setup()`` only checks them, and may be
        called any number of times.

        Raises:
            SchemaVersionError: The tables are older (run ``onceonly migrate
                --langgraph``) or newer than this code.
        """
        self._call(self._setup)

    async def asetup(self) -> None:
        """:meth:`setup` for async code."""
        await self._acall(self._setup)

    def _setup(self) -> None:
        # the store's own tables were checked (or created) when it opened
        ensure_schema(
            self.store.engine, _schema.COMPONENT, _schema.LANGGRAPH_MIGRATIONS, create=True
        )

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
        keys = self._call(self._storage.list_keys, config, filter, before, limit)
        if limit is not None and limit <= 0:
            return
        n = 0
        at = 0
        while at < len(keys):
            # Batches whose values are built in one forward walk (no more than a limit
            # asks for: a filter may skip some, then the next batch reads on).
            size = _LIST_BATCH if limit is None else min(_LIST_BATCH, max(limit - n, 1))
            part = keys[at : at + size]
            at += len(part)
            for tup in self._call(self._storage.list_items, part, filter):
                yield tup
                n += 1
                if limit is not None and n >= limit:
                    return

    # -- the public API: one call at a time -------------------------------------------
    # On SQLite a sync call runs on the caller's thread, under the saver's lock: handing
    # it to a thread of the saver's own cost a fresh process's ``get_state`` a thread
    # start and 2-5 ms (the same work ran slower on the woken thread), and a SQLite
    # connection per calling thread measured no slower per step (the store pins one to
    # each thread up to its pool's capacity, returns those of exited threads, and lends
    # any thread past that one per transaction). On PostgreSQL every call runs on the saver's worker
    # thread, so one server connection serves them all: LangGraph calls from a new pool
    # of threads on every invoke, and a connection per thread warmed up its own server
    # session and prepared statements (a 50-turn agent's checkpoints took ~10 % longer).
    # An async call always runs on the worker, so the event loop never waits for the
    # database.
    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._inline or threading.get_ident() == self._worker_ident:
            with self._lock:
                if self._closed:
                    raise ConfigurationError(_CLOSED)
                return fn(*args)
        return self._submit(fn, *args).result()

    async def _acall(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` queued for the worker thread (run there by :meth:`_call`)."""
        if self._closed:
            raise ConfigurationError(_CLOSED)
        try:
            return self._worker.submit(self._call, fn, *args)
        except RuntimeError:  # shut down meanwhile: closed
            raise ConfigurationError(_CLOSED) from None

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
        return self._call(self._storage.put, config, checkpoint, metadata, new_versions)

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
        self._call(self._storage.put_writes, config, writes, task_id, task_path)

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """LangGraph's ``DeltaChannel`` history (its walk up the parent chain, with the
        same result as the default one), the ancestors built in batches that share one
        forward walk of the store instead of one ``get_tuple`` each.

        Raises:
            CorruptRecord: A row, delta, blob or write failed its integrity check.
        """
        found = self._call(self._storage.delta_history, config, list(channels))
        return cast(Mapping[str, DeltaChannelHistory], found)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """:meth:`get_delta_channel_history`, awaiting the saver's worker thread."""
        found = await self._acall(self._storage.delta_history, config, list(channels))
        return cast(Mapping[str, DeltaChannelHistory], found)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the namespace's latest without a
        ``checkpoint_id``; ``None`` when there is none.

        Raises:
            CorruptRecord: A row, delta, blob or write failed its integrity check.
        """
        return self._call(self._storage.get_tuple, config)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread (all namespaces), with the
        channel values and the blobs only they used."""
        self._call(self._storage.delete_thread, thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) whose metadata names one of
        ``run_ids``; each namespace they were in is rewritten without their values."""
        self._call(self._storage.delete_for_runs, run_ids)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads: ``"keep_latest"`` keeps the newest checkpoint of each
        namespace (and its writes), stored afresh as a keyframe; ``"delete"`` deletes
        the threads.

        Raises:
            ConfigurationError: Unknown strategy.
        """
        self._call(self._storage.prune, thread_ids, strategy)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint (all namespaces, same ids) and write of a thread to
        another thread. A source without checkpoints copies nothing."""
        self._call(self._storage.copy_thread, source_thread_id, target_thread_id)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`get_tuple`, awaiting the saver's worker thread."""
        return await self._acall(self._storage.get_tuple, config)

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
        return await self._acall(self._storage.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """:meth:`put_writes`, awaiting the saver's worker thread."""
        await self._acall(self._storage.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """:meth:`delete_thread`, awaiting the saver's worker thread."""
        await self._acall(self._storage.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """:meth:`delete_for_runs`, awaiting the saver's worker thread."""
        await self._acall(self._storage.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """:meth:`copy_thread`, awaiting the saver's worker thread."""
        await self._acall(self._storage.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """:meth:`prune`, awaiting the saver's worker thread."""
        await self._acall(self._storage.prune, thread_ids, strategy)


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
