"""The store's shared state, its per-thread pinned connections and raw transactions."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from . import _engine, _retry
from ._engine import READ_ONLY, lost_commit, translate
from ._retry import DatabaseRetry, retried
from ._sql import _SQL
from ._state import _HEAD_CACHE, _Barrier, _Head, _Pending
from ._witness import Witness
from .codec import Codec
from .errors import AsyncWriteError, CheckpointLost, ConfigurationError, RunRolledBack
from .integrity import RowKeys
from .records import Durability, KeyframePolicy, StateMigrations

T = TypeVar("T")


class _Connections:
    """The base of :class:`~checkpoint.store.Store`: the state every part of it shares
    (set by ``Store.__init__``), pinned per-thread connections, read transactions and the
    head cache."""

    integrity: RowKeys | None
    witness: Witness | None
    retry: DatabaseRetry
    durability: Durability
    engine: Engine
    codec: Codec
    keyframes: KeyframePolicy
    migrations: StateMigrations | None
    _behind: RunRolledBack | None
    _dialect: str
    _sql: _SQL
    _lock: threading.RLock
    _heads: OrderedDict[str, _Head]
    _pending: list[_Pending]
    _queue: queue.Queue[_Pending | _Barrier | None]
    _async_error: BaseException | None
    _writer: threading.Thread | None
    _closed: bool
    _heads_stale: bool
    _stale_runs: set[str]
    _unwritten: dict[str, int]
    _queued_mode: dict[str, Durability]
    _lost: dict[str, int]
    _reported: dict[str, int]
    _count_lock: threading.Lock
    _gen: int
    _dead_gen: int
    _local: threading.local
    _pinned: list[tuple[weakref.ref[threading.Thread], Any]]
    _pin_lock: threading.Lock

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("the store is closed; open a new one")
        if self._heads_stale:
            # Set by the background writer, which never takes the lock (a caller may be
            # waiting on a barrier while holding it): forget heads it could not write.
            self._heads_stale = False
            self._heads.clear()
        if self._stale_runs:
            with self._count_lock:
                stale, self._stale_runs = self._stale_runs, set()
            for run_id in stale:
                self._heads.pop(run_id, None)
        err = self._async_error
        if err is not None:
            self._async_error = None
            self._gen = self._dead_gen + 1  # saves from now on build on a reloaded head
            raise AsyncWriteError(
                f"a background checkpoint write failed: {err}; the checkpoints queued after "
                f"it were not written. Reload the run with Store.load to continue from what "
                f"is durable."
            ) from err

    def _take_lost(self, run_id: str, report: bool = True) -> None:
        """Raise :class:`CheckpointLost` once for a run whose queued checkpoints were
        left out (another writer won the race); with ``report=False``, take the report
        without raising it (the caller reads the head that stands)."""
        if self._lost:
            with self._count_lock:
                seq = self._lost.pop(run_id, None)
            if seq is not None:
                self._heads.pop(run_id, None)
                with self._count_lock:
                    # What was queued before this report and fails later is part of it.
                    self._reported[run_id] = self._reported.get(run_id, 0) + 1
                if report:
                    raise CheckpointLost(run_id, seq)

    def _remember(self, run_id: str, head: _Head) -> None:
        self._heads[run_id] = head
        self._heads.move_to_end(run_id)
        while len(self._heads) > _HEAD_CACHE:
            self._heads.popitem(last=False)

    def _checkout(self) -> tuple[Any, bool]:
        local = self._local
        conn = getattr(local, "conn", None)
        if getattr(local, "busy", False):
            return self.engine.raw_connection(), False  # nested: a pooled one
        if conn is None:
            self._reap_exited()
            me = (weakref.ref(threading.current_thread()), None)
            with self._pin_lock:  # a place is taken at once: threads start together
                room = len(self._pinned) < self._pin_limit()
                if room:
                    self._pinned.append(me)
            if not room:
                # Every pinned connection is held by a live thread for as long as it
                # lives: pinning one per thread past the pool's capacity would leave the
                # next thread waiting for a connection nobody returns (a thread pool
                # wider than the engine's pool, under load). This one is returned at
                # check-in instead.
                return self.engine.raw_connection(), False
            try:
                conn = self.engine.raw_connection()
            except BaseException:
                with self._pin_lock:
                    self._pinned = [p for p in self._pinned if p is not me]
                raise
            local.conn = conn
            with self._pin_lock:
                self._pinned = [(me[0], conn) if p is me else p for p in self._pinned]
        local.busy = True
        return conn, True

    def _pin_limit(self) -> int:
        """How many threads may keep a connection of their own: the engine pool's
        capacity less two (a nested read of a thread that holds one, and the writer, still
        find a connection); unbounded for a pool without a limit."""
        pool = self.engine.pool
        size = getattr(pool, "size", None)
        overflow = getattr(pool, "_max_overflow", -1)
        if not callable(size) or overflow < 0:
            return sys.maxsize
        return max(1, int(size()) + int(overflow) - 2)

    def _checkin(self, conn: Any, pinned: bool) -> None:
        if not pinned:
            conn.close()
            return
        self._local.busy = False
        if self._closed:
            self._discard(conn, pinned, invalidate=False)

    def _discard(self, conn: Any, pinned: bool, *, invalidate: bool = True) -> None:
        if pinned:
            self._local.busy = False
            self._local.conn = None
            with self._pin_lock:
                self._pinned = [(t, c) for t, c in self._pinned if c is not conn]
        with contextlib.suppress(*_engine.DRIVER_ERRORS):
            if invalidate:
                conn.invalidate()
            else:
                conn.close()

    def _close_pinned(self) -> None:
        with self._pin_lock:
            conns, self._pinned = self._pinned, []
        for _, conn in conns:
            if conn is not None:  # None: a place taken by a thread still connecting
                with contextlib.suppress(*_engine.DRIVER_ERRORS):
                    conn.close()

    def _reap_exited(self) -> None:
        """Return the pinned connections of threads that have exited to the pool."""
        with self._pin_lock:
            live = [(t, c) for t, c in self._pinned if (th := t()) is not None and th.is_alive()]
            if len(live) == len(self._pinned):
                return
            kept = {id(c) for _, c in live}
            gone = [c for _, c in self._pinned if c is not None and id(c) not in kept]
            self._pinned = live
        for conn in gone:
            with contextlib.suppress(*_engine.DRIVER_ERRORS):
                conn.close()

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._dialect

    @property
    def param(self) -> str:
        """The DBAPI parameter marker of this database (``?`` or ``%s``)."""
        return self._sql.q

    def _revs_mark(self, back_to: int | None = None) -> int:
        """How many run revisions this thread's transaction noted; with ``back_to``,
        forget those noted since (their savepoint was rolled back)."""
        pending = getattr(self._local, "revs", None)
        if pending is None:
            return 0
        if back_to is not None:
            del pending[back_to:]
        return len(pending)

    def _note_rev(self, run_id: str, rev: int) -> None:
        """A sealed run-row write at ``rev`` in this thread's transaction: witnessed
        once it commits."""
        if self.witness is not None:
            pending = getattr(self._local, "revs", None)
            if pending is not None:
                pending.append((run_id, rev))

    @retried("read", idempotent=True)
    def read(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(cursor)`` in a read-only transaction (one snapshot); run again on a
        transient failure. The store's reads inside ``fn`` on this thread (``load``,
        ``load_each``, a nested ``read``) join it: one snapshot for all, and only the
        outermost read is run again."""
        self._check_open()
        with translate("read"), _RawTxn(self, write=False) as cur:
            return fn(cur)

    def _reader(self) -> Any:
        return self.engine.connect().execution_options(**{READ_ONLY: True})


class _RawTxn:
    """A transaction on a DBAPI connection pinned to the calling thread (hot paths only).

    Each thread keeps one connection between transactions, so the hot path skips the
    pool's check-out and reset. A read inside a read of the same thread joins it (one
    snapshot for both: what the outer read found is still there for the inner one, and
    only the outermost read is retried); any other nested transaction gets a pooled
    connection. SQLite writers take the lock up front (``BEGIN IMMEDIATE``) so a transaction
    never fails half-way on a lock upgrade; readers use a deferred ``BEGIN`` for one
    snapshot. A transaction that fails, including at COMMIT, is rolled back; a connection
    that cannot even roll back is discarded. A COMMIT whose answer was lost raises
    ``DatabaseUnavailable`` with ``may_have_committed`` (:func:`_engine.lost_commit`).
    """

    def __init__(self, store: _Connections, *, write: bool) -> None:
        self._store = store
        self._sqlite = store.dialect == "sqlite"
        self._write = write
        self._conn: Any = None
        self._cur: Any = None
        self._pinned = False
        self._pg_read: Any = None
        self._joined = False
        self._reading: Any = None

    def __enter__(self) -> Any:
        local = self._store._local
        if not self._write:
            outer = getattr(local, "reading", None)
            if outer is not None:
                self._joined = True
                return outer
        self._conn, self._pinned = self._store._checkout()
        self._outer_revs = getattr(local, "revs", None)
        local.revs = [] if self._write else self._outer_revs
        try:
            self._cur = self._conn.cursor()
            if self._sqlite:
                self._cur.execute("BEGIN IMMEDIATE" if self._write else "BEGIN")
            elif not self._write:
                # One snapshot for the whole read, as SQLite's deferred BEGIN gives: under
                # READ COMMITTED a check that reads in two statements sees two moments
                # (a concurrent commit between them reads as a row missing or extra).
                # Set on the connection, psycopg says it in the BEGIN it sends anyway
                # (a SET TRANSACTION would be one more round-trip); reset on exit.
                raw = self._conn.driver_connection
                raw.isolation_level = _engine.pg_repeatable_read()
                raw.read_only = True
                self._pg_read = raw
        except BaseException:
            self._store._discard(self._conn, self._pinned)
            raise
        if not self._write and getattr(local, "reading", None) is None:
            local.reading = self._cur  # reads nested in this one join it
            self._reading = _retry._in_read.set(_retry._in_read.get() | {id(self._store)})
        return self._cur

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._joined:
            return  # the read it joined ends it
        if self._reading is not None:
            self._store._local.reading = None
            _retry._in_read.reset(self._reading)
            self._reading = None
        conn = self._conn
        done = False
        try:
            if exc_type is None:
                try:
                    if self._sqlite:
                        self._cur.execute("COMMIT" if self._write else "ROLLBACK")
                    elif self._write:
                        conn.commit()
                    else:
                        conn.rollback()
                except _engine.DRIVER_ERRORS as err:
                    lost = lost_commit(err) if self._write else None
                    if lost is None:
                        raise
                    raise lost from err
                done = True
        finally:
            healthy = True
            if not done:
                try:
                    if self._sqlite:
                        if conn.driver_connection.in_transaction:
                            self._cur.execute("ROLLBACK")
                    else:
                        conn.rollback()
                except _engine.DRIVER_ERRORS:
                    healthy = False
            try:
                self._cur.close()
            except _engine.DRIVER_ERRORS:
                healthy = False
            if self._pg_read is not None:
                try:  # the next transaction on this connection may write
                    self._pg_read.isolation_level = None
                    self._pg_read.read_only = None
                except _engine.DRIVER_ERRORS:
                    healthy = False
                self._pg_read = None
            if healthy:
                self._store._checkin(conn, self._pinned)
            else:
                self._store._discard(conn, self._pinned)
            local = self._store._local
            revs, local.revs = getattr(local, "revs", None), self._outer_revs
            witness = self._store.witness
            if done and self._write and revs and witness is not None:
                witness.advance_runs(revs)  # committed: witnessed before anyone acts on it
