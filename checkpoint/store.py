"""The checkpoint store: runs, checkpoints (delta + keyframe), blobs, durability modes."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import queue
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import blake3
from sqlalchemy import and_, delete, exists, or_, select, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from . import _delta, _schema
from ._engine import (
    DRIVER_ERRORS,
    READ_ONLY,
    begin,
    classify,
    configure,
    is_integrity_error,
    lost_commit,
    make_engine,
    open_checks,
    translate,
)
from ._retry import DatabaseRetry, retried
from ._witness import Witness
from .codec import Codec
from .errors import (
    AsyncWriteError,
    CheckpointLost,
    CheckpointNotFound,
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    LeaseHeld,
    OnceOnlyError,
    RunExists,
    RunNotFound,
    RunRolledBack,
    StateVersionError,
    StoreError,
)
from .failpoints import failpoint
from .integrity import UNKEYED_LIMITS, RowKeys
from .integrity import _check_seal as check
from .integrity import _encode as _encode_parts
from .integrity import _make_seal as seal
from .records import (
    CheckpointInfo,
    Durability,
    Handoff,
    KeyframePolicy,
    RetentionPolicy,
    RetentionReport,
    Run,
    RunStatus,
    Snapshot,
    Source,
    StateMigrations,
)

__all__ = ["Store", "ensure_schema", "migrate", "migrate_component"]

_UNSET: Final = object()
log = logging.getLogger("onceonly.store")

T = TypeVar("T")
_KEYFRAME, _DELTA = 0, 1
_HEAD_CACHE = 1024


@dataclass
class _Head:
    """What this process knows of a run's latest checkpoint (a private copy).

    ``run`` is the run row as of this checkpoint when this process read it together with
    the checkpoint, or wrote the checkpoint itself (with the status, next step and handoff
    written atomically with it); None when only the checkpoint was read.
    """

    seq: int
    keyframe_seq: int
    deltas: int
    delta_bytes: int
    keyframe_bytes: int
    schema_version: int
    state: dict[str, Any]
    lists: dict[str, _delta.ListChunks] = field(default_factory=dict)
    info: CheckpointInfo | None = None
    run: Run | None = None


@dataclass
class _Pending:
    """A checkpoint encoded and waiting to be written."""

    run_id: str
    seq: int
    kind: int
    keyframe_seq: int
    step: str
    source: str
    schema_version: int
    created_at: float
    body: bytes  # stored form
    digest: bytes
    blobs: dict[bytes, bytes]  # hash -> stored form
    refs: set[bytes]
    run_values: dict[str, Any]
    parent_digest: bytes = b""  # the checkpoint this one was built on (seq - 1)
    reported: int = 0  # losses of its run reported when it was queued
    gen: int = 0  # async mode: the error generation it was queued in

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(
            run_id=self.run_id,
            seq=self.seq,
            step=self.step,
            source=Source(self.source),
            schema_version=self.schema_version,
            created_at=self.created_at,
            keyframe=self.kind == _KEYFRAME,
            keyframe_seq=self.keyframe_seq,
            digest=self.digest,
        )


_NO_WAIT = threading.Event()


class _Barrier:
    """A write barrier, optionally carrying work to run in the same transaction."""

    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[Any], Any] | None = None, *, waits: bool = True) -> None:
        # Only barriers handed to the background writer are waited on.
        self.done = threading.Event() if waits else _NO_WAIT
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None


class Store:
    """A durable store of runs and their checkpoints.

    Open one with :meth:`open` (a URL) or construct it around an existing SQLAlchemy
    :class:`~sqlalchemy.engine.Engine`. The same schema and behaviour hold on SQLite (the
    embedded default: WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE`` writes, read back
    and enforced) and on PostgreSQL (psycopg 3).

    Example::

        with Store.open("sqlite:///runs.db") as store:
            run = store.create_run("onboarding", next_step="collect")
            store.save(run.run_id, {"docs": [], "vendor": None}, step="start")
            snap = store.load(run.run_id)

    Args:
        engine: The SQLAlchemy engine. onceonly installs its connection hooks on it.
        durability: When checkpoints become durable (see :class:`Durability`).
        codec: The value codec (register your dataclasses on it).
        keyframes: When to write a full keyframe instead of a delta.
        migrations: Default state migrations applied when loading.
        create: Create the schema when the database has none (an older schema is never
            migrated implicitly; use :func:`migrate`).
        busy_timeout_ms: How long a SQLite writer waits for the lock. SQLite has one write
            lock per database: a process stopped (SIGSTOP, a debugger, a frozen container)
            while one of its threads is inside a write transaction blocks every writer of
            every process until it is resumed or killed; after ``retry``'s budget they get
            :class:`DatabaseLocked`. The store itself holds the lock only for one
            transaction's statements, never across a provider call or a sleep. (On
            PostgreSQL a stopped process holds only its open transaction's row locks.)
        integrity: The keys that seal runs, checkpoints and waits (see
            :mod:`checkpoint.integrity`; a :class:`~ledger.Ledger` attaches its keyring's
            on the store it is given). Without them nothing deliberate is detected:
            :data:`~checkpoint.integrity.UNKEYED_LIMITS`.
        retry: How long a call keeps retrying while the database is briefly unavailable
            (a lock held past ``busy_timeout_ms``, a lost or refused connection, a
            deadlock); see :class:`DatabaseRetry`. ``DatabaseRetry(budget_s=0)``: never.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        durability: Durability | str = Durability.SYNC,
        codec: Codec | None = None,
        keyframes: KeyframePolicy | None = None,
        migrations: StateMigrations | None = None,
        create: bool = True,
        busy_timeout_ms: int = 5000,
        integrity: RowKeys | None = None,
        retry: DatabaseRetry | None = None,
        witness: str | None = None,
    ) -> None:
        self.integrity = integrity
        #: The witness of run-row revisions (see :meth:`attach_witness`), if any.
        self.witness: Witness | None = None
        self._behind: RunRolledBack | None = None
        self.retry = retry or DatabaseRetry()
        try:
            self.durability = Durability(durability)
        except ValueError as exc:
            raise ConfigurationError(
                f"durability must be one of {[d.value for d in Durability]}, not {durability!r}"
            ) from exc
        configure(engine, busy_timeout_ms=busy_timeout_ms)
        self.engine = engine
        self.codec = codec or Codec()
        self.keyframes = keyframes or KeyframePolicy()
        self.migrations = migrations
        self._dialect = engine.dialect.name
        if self._dialect not in ("sqlite", "postgresql"):
            raise ConfigurationError(
                f"onceonly supports SQLite and PostgreSQL, not {self._dialect!r}"
            )
        self._lock = threading.RLock()
        self._heads: OrderedDict[str, _Head] = OrderedDict()
        self._pending: list[_Pending] = []
        self._queue: queue.Queue[_Pending | _Barrier | None] = queue.Queue()
        self._async_error: BaseException | None = None
        self._writer: threading.Thread | None = None
        self._closed = False
        self._heads_stale = False
        # Runs whose queued checkpoint lost a race to another writer (async / exit mode):
        # their cached heads are dropped before the next use. Only that run is affected.
        self._stale_runs: set[str] = set()
        # Checkpoints this process queued and has not yet written, per run: while a run
        # has some, this process's own view of the run is ahead of the database.
        self._unwritten: dict[str, int] = {}
        # Runs whose queued checkpoints were left out, with the head the first one was
        # built on: the next save or load of that run raises CheckpointLost once.
        self._lost: dict[str, int] = {}
        self._reported: dict[str, int] = {}  # per run: how many losses were reported
        self._count_lock = threading.Lock()
        self._gen = 0
        self._dead_gen = -1
        self._local = threading.local()
        # Each thread's pinned connection, with the thread it belongs to: a connection of a
        # thread that has exited (a thread pool's, a LangGraph invoke's) goes back.
        self._pinned: list[tuple[weakref.ref[threading.Thread], Any]] = []
        self._pin_lock = threading.Lock()
        _check_schema(engine, create=create)
        self._sql = _SQL(self._dialect)
        if witness:
            self.attach_witness(witness)
        if self.durability is Durability.ASYNC:
            self._writer = threading.Thread(
                target=self._write_loop, name="onceonly-checkpoint-writer", daemon=True
            )
            self._writer.start()

    @classmethod
    def open(
        cls,
        url: str = "sqlite:///onceonly.db",
        *,
        durability: Durability | str = Durability.SYNC,
        codec: Codec | None = None,
        keyframes: KeyframePolicy | None = None,
        migrations: StateMigrations | None = None,
        create: bool = True,
        busy_timeout_ms: int = 5000,
        integrity: RowKeys | None = None,
        retry: DatabaseRetry | None = None,
        witness: str | None = None,
    ) -> Store:
        """Open a store from a database URL (``sqlite:///path`` or
        ``postgresql+psycopg://...``).

        Raises:
            ConfigurationError: The URL is malformed or names an unsupported database.
            WeakDurabilityError: SQLite cannot provide WAL + synchronous=FULL there.
            DatabaseUnavailable: The database cannot be reached.
            SchemaVersionError: The schema is older (migrate first) or newer (upgrade).
        """
        engine = make_engine(url, busy_timeout_ms=busy_timeout_ms)
        try:
            return cls(
                engine,
                durability=durability,
                codec=codec,
                keyframes=keyframes,
                migrations=migrations,
                create=create,
                busy_timeout_ms=busy_timeout_ms,
                integrity=integrity,
                retry=retry,
                witness=witness,
            )
        except BaseException:
            engine.dispose()
            raise

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush pending checkpoints, stop the background writer and dispose the engine.

        Raises:
            AsyncWriteError: A background write failed (the engine is still disposed).
            CheckpointLost: A queued checkpoint lost its race to another writer and
                nobody was told yet (the engine is still disposed).
        """
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._queue.put(None)
                self._writer.join()
            self._close_pinned()
            self.engine.dispose()
        with self._count_lock:
            lost, self._lost = self._lost, {}
        for run_id, seq in sorted(lost.items()):
            raise CheckpointLost(run_id, seq)

    def _take_lost(self, run_id: str) -> None:
        """Raise :class:`CheckpointLost` once for a run whose queued checkpoints were
        left out (another writer won the race)."""
        if self._lost:
            with self._count_lock:
                seq = self._lost.pop(run_id, None)
            if seq is not None:
                self._heads.pop(run_id, None)
                with self._count_lock:
                    # What was queued before this report and fails later is part of it.
                    self._reported[run_id] = self._reported.get(run_id, 0) + 1
                raise CheckpointLost(run_id, seq)

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

    def flush(self) -> None:
        """Write barrier: when this returns, every checkpoint saved before it is durable.

        Call it before any external effect. A no-op in ``sync`` mode.

        Raises:
            AsyncWriteError: A background write failed.
            StoreError: Writing the pending checkpoints failed (``exit`` mode).
        """
        if self.durability is Durability.ASYNC and self._writer is not None:
            if self._writer.is_alive():
                barrier = _Barrier()
                self._queue.put(barrier)
                barrier.done.wait()
        elif self.durability is Durability.EXIT:
            with self._lock:
                self._flush_locked_pending()
        self._check_open()

    # -- pinned connections -------------------------------------------------------------
    def _checkout(self) -> tuple[Any, bool]:
        local = self._local
        conn = getattr(local, "conn", None)
        if getattr(local, "busy", False):
            return self.engine.raw_connection(), False  # nested: a pooled one
        if conn is None:
            self._reap_exited()
            conn = self.engine.raw_connection()
            local.conn = conn
            with self._pin_lock:
                self._pinned.append((weakref.ref(threading.current_thread()), conn))
        local.busy = True
        return conn, True

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
        with contextlib.suppress(*DRIVER_ERRORS):
            if invalidate:
                conn.invalidate()
            else:
                conn.close()

    def _close_pinned(self) -> None:
        with self._pin_lock:
            conns, self._pinned = self._pinned, []
        for _, conn in conns:
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()

    def _reap_exited(self) -> None:
        """Return the pinned connections of threads that have exited to the pool."""
        with self._pin_lock:
            gone = [c for t, c in self._pinned if (th := t()) is None or not th.is_alive()]
            if not gone:
                return
            self._pinned = [(t, c) for t, c in self._pinned if c not in gone]
        for conn in gone:
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()

    # -- transactions for upper layers --------------------------------------------------
    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._dialect

    def attach_witness(self, path: str) -> Witness:
        """Keep a witness of every run row's revision in the file ``path`` (a Ledger
        with ``ONCEONLY_WITNESS`` does this with its own): each sealed run-row write is
        appended and fsynced after it commits, and a run row read back at a revision
        below the witnessed one (the store restored from an older copy) is refused
        (:class:`RunRolledBack`). Idempotent for the same path.

        Returns:
            The witness (shared with the caller).

        Raises:
            ConfigurationError: The store already has a witness at another path.
        """
        if self.witness is None:
            self.witness = Witness(path)
            self._behind = self._runs_behind()
        elif self.witness.path != path:
            raise ConfigurationError(
                f"this store already keeps its witness in {self.witness.path}; one witness "
                f"per store"
            )
        return self.witness

    def _runs_behind(self) -> RunRolledBack | None:
        """The first witnessed run the store has at an older revision, or not at all
        (a restore from an older copy), read when the witness is attached."""
        assert self.witness is not None
        if not self.witness.runs:
            return None
        have = self.run_revisions()
        for run_id, rev in sorted(self.witness.runs.items()):
            if have.get(run_id, -1) < rev:
                behind = RunRolledBack(run_id, have.get(run_id, 0), rev, self.witness.path)
                log.error("%s", behind)
                return behind
        return None

    def accept_restore(self) -> None:
        """Act on the store as it is (the witness was reset to it by
        :meth:`ledger.Ledger.accept_restore`)."""
        self._behind = None

    def run_revisions(self) -> dict[str, int]:
        """Every run's current row revision (what an accepted restore witnesses)."""

        def read(cur: Any) -> dict[str, int]:
            cur.execute("SELECT run_id, rev FROM oo_runs WHERE rev IS NOT NULL")
            return {str(r): int(v) for r, v in cur.fetchall()}

        return self.read(read)

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

    def attach_integrity(self, keys: RowKeys) -> None:
        """Seal and check rows with ``keys`` from now on (a Ledger does this with its
        keyring's row keys). Idempotent for the same keys.

        Raises:
            ConfigurationError: The store already has other keys.
        """
        if self.integrity is None:
            self.integrity = keys
        elif self.integrity.keys != keys.keys or self.integrity.current_id != keys.current_id:
            raise ConfigurationError(
                "this store already seals its rows with other keys; open one store per keyring"
            )

    @property
    def param(self) -> str:
        """The DBAPI parameter marker of this database (``?`` or ``%s``)."""
        return self._sql.q

    def transact(self, fn: Callable[[Any], T], *, idempotent: bool = False) -> T:
        """Run ``fn(cursor)`` in a write transaction behind the write barrier.

        Every checkpoint saved before this call is committed in the same transaction as
        ``fn``'s statements (``exit`` mode), or in the same group commit (``async`` mode:
        concurrent callers share one durable commit), or before it (``sync``). When this
        returns, both are durable. ``fn`` runs inside a savepoint: if it raises, its own
        statements are rolled back, the checkpoints still commit, and the error is
        re-raised here. Upper layers (the effects ledger) write through this method.

        A transient failure (see :class:`DatabaseRetry`) that wrote nothing runs ``fn``
        again in a new transaction, so ``fn`` must keep no effects outside its cursor that
        a second run would repeat.

        Args:
            fn: Receives a DBAPI cursor (parameter marker :attr:`param`).
            idempotent: Running ``fn`` again after its COMMIT may have gone through is
                harmless: a lost COMMIT is retried too instead of raised.

        Returns:
            What ``fn`` returned.

        Raises:
            StoreError: The transaction could not be committed (nothing of it is durable),
                or, with ``may_have_committed`` set, its COMMIT's answer was lost.
        """
        return self.retry.call(
            "run a transaction", lambda: self._transact(fn), idempotent=idempotent
        )

    def _transact(self, fn: Callable[[Any], T]) -> T:
        self._check_open()
        is_async = self.durability is Durability.ASYNC and self._writer is not None
        barrier = _Barrier(fn, waits=is_async)
        if is_async:
            self._queue.put(barrier)
            barrier.done.wait()
            # Our work committed (or failed on its own): an unrelated background failure
            # surfaces on the next call, never as this call's error.
        else:
            with self._lock:
                if self.durability is Durability.EXIT:
                    self._write_exit([barrier])
                else:
                    self._write_batch([], [barrier])
        if barrier.error is not None:
            raise barrier.error
        return barrier.result  # type: ignore[no-any-return]

    @retried("read", idempotent=True)
    def read(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(cursor)`` in a read-only transaction (one snapshot on SQLite); run
        again on a transient failure."""
        self._check_open()
        with translate("read"), _RawTxn(self, write=False) as cur:
            return fn(cur)

    # -- runs --------------------------------------------------------------------------
    @retried("create a run", idempotent=False)
    def create_run(
        self,
        flow: str,
        *,
        run_id: str | None = None,
        code_version: str = "0",
        state_version: int = 1,
        next_step: str | None = None,
        handoff: Handoff | None = None,
        status: RunStatus = RunStatus.RUNNING,
        key_run: str | None = None,
    ) -> Run:
        """Create a run (no checkpoint yet).

        Args:
            key_run: The run whose effect keys this run shares (a fork's origin):
                retention keeps that run, and so its ledger entries, while this one exists.

        Raises:
            RunExists: A run with ``run_id`` exists already.
        """
        self._check_open()
        rid = run_id or uuid.uuid4().hex
        now = time.time()
        values = {
            "run_id": rid,
            "flow": flow,
            "code_version": code_version,
            "state_version": state_version,
            "status": RunStatus(status).value,
            "next_step": next_step,
            "lease_owner": None,
            "lease_expires_at": None,
            "handoff": self._encode_handoff(handoff or Handoff()),
            "head_seq": None,
            "created_at": now,
            "updated_at": now,
            "waits_digest": None,
            "rev": 0,
        }
        values["seal"] = seal(self.integrity, "runs", _run_parts(values, None))
        try:
            failpoint("checkpoint.run.write")
            with translate("create a run"), begin(self.engine) as conn:
                conn.execute(_schema.runs.insert().values(**values))
                if key_run is not None and key_run != rid:
                    conn.execute(
                        _schema.run_links.insert().values(
                            run_id=rid, key_run=key_run, created_at=now
                        )
                    )
        except StoreError as exc:
            if isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise RunExists(rid) from exc.__cause__
            raise
        return self._run_from_row(values)

    @retried("start a run", idempotent=False)
    def start_run(
        self,
        flow: str,
        state: Mapping[str, Any],
        *,
        run_id: str | None = None,
        step: str = "start",
        code_version: str = "0",
        state_version: int = 1,
        next_step: str | None = None,
        handoff: Handoff | None = None,
        status: RunStatus = RunStatus.RUNNING,
        source: Source | str = Source.STEP,
        key_run: str | None = None,
        also: Callable[[Any], Any] | None = None,
    ) -> tuple[Run, CheckpointInfo]:
        """Create a run and its first checkpoint in **one** transaction (durable on return,
        whatever the durability mode): a run never exists without its state.

        Args:
            flow, run_id, code_version, state_version, next_step, handoff: As in
                :meth:`create_run`.
            state: The first checkpoint's state (validated before anything is written).
            step: The first checkpoint's step name.
            status: The run's status once started.
            source: Who wrote the first checkpoint.
            key_run: The run whose effect keys this run shares (a fork's origin). It must
                exist when this commits (checked in the same transaction, so a fork never
                outlives its origin's removal by retention).
            also: More work ``also(cursor)`` for the same transaction (a fork's wait).

        Raises:
            RunExists: A run with ``run_id`` exists already; nothing was written.
            RunNotFound: ``key_run`` does not exist (any more); nothing was written.
            CodecError: A value cannot be encoded; nothing was written.
        """
        with self._lock:
            self._check_open()
            rid = run_id or uuid.uuid4().hex
            now = time.time()
            base = Run(
                run_id=rid,
                flow=flow,
                code_version=code_version,
                state_version=state_version,
                status=RunStatus.WAITING,
                next_step=next_step,
                lease_owner=None,
                lease_expires_at=None,
                handoff=handoff or Handoff(),
                head_seq=None,
                created_at=now,
                updated_at=now,
            )
            ops = _delta.diff({}, state, self.codec)
            pending, head = self._build(
                rid, None, ops, step, next_step, status, source, state_version, handoff, base
            )
            q = self._sql.q
            pg = self._dialect == "postgresql"

            def txn(cur: Any) -> None:
                if key_run is not None and key_run != rid:
                    # The origin must exist now, and stay while this commits: on
                    # PostgreSQL a share lock makes a concurrent retention delete of it
                    # wait (and then find this run's link); SQLite writers are serial.
                    lock = " FOR SHARE" if pg else ""
                    cur.execute(f"SELECT 1 FROM oo_runs WHERE run_id = {q}{lock}", (key_run,))
                    if cur.fetchone() is None:
                        raise RunNotFound(key_run)
                values = {
                    "run_id": rid,
                    "flow": flow,
                    "code_version": code_version,
                    "state_version": state_version,
                    "status": RunStatus.WAITING.value,
                    "next_step": next_step,
                    "lease_owner": None,
                    "lease_expires_at": None,
                    "handoff": self._encode_handoff(base.handoff),
                    "head_seq": None,
                    "created_at": now,
                    "updated_at": now,
                    "waits_digest": None,
                    "rev": 0,
                }
                values["seal"] = seal(self.integrity, "runs", _run_parts(values, None))
                try:
                    cur.execute(
                        f"INSERT INTO oo_runs ({', '.join(_RUN_COLS)}) VALUES "
                        f"({', '.join([q] * len(_RUN_COLS))})",
                        tuple(values[c] for c in _RUN_COLS),
                    )
                except DRIVER_ERRORS as exc:
                    if is_integrity_error(exc):
                        raise RunExists(rid) from exc
                    raise
                if key_run is not None and key_run != rid:
                    cur.execute(
                        f"INSERT INTO oo_run_links (run_id, key_run, created_at) "
                        f"VALUES ({q}, {q}, {q})",
                        (rid, key_run, now),
                    )
                self._write_pending(cur, pending)
                if also is not None:
                    also(cur)

            failpoint("checkpoint.run.write")
            try:
                with translate("start a run"), _RawTxn(self, write=True) as cur:
                    txn(cur)
                    failpoint("checkpoint.commit.before")
            except BaseException:
                self._heads.pop(rid, None)
                raise
            failpoint("checkpoint.commit.after")
            self._remember(rid, head)
            assert head.run is not None
            return head.run, pending.info()

    @retried("read a run", idempotent=True)
    def get_run(self, run_id: str) -> Run:
        """The stored run (its seal checked, with integrity keys).

        Raises:
            RunNotFound: No such run.
            CorruptRecord: The run row fails its seal.
        """
        self._check_open()
        run = self.read(lambda cur: self.read_run_in(cur, run_id))
        if run is None:
            raise RunNotFound(run_id)
        return run

    def read_run_in(self, cur: Any, run_id: str, *, lock: bool = False) -> Run | None:
        """The run row read through ``cur`` (in the caller's transaction), its seal
        checked; None when there is no such run. ``lock``: ``FOR UPDATE`` on PostgreSQL.

        Raises:
            CorruptRecord: The run row fails its seal.
        """
        if lock and self._dialect != "sqlite":
            # Lock first, then read row and head in a statement of their own: a locking
            # join re-reads only the locked row after a wait (READ COMMITTED), and would
            # pair the new head with the old head's digest.
            q = self._sql.q
            cur.execute(f"SELECT 1 FROM oo_runs WHERE run_id = {q} FOR UPDATE", (run_id,))
        cur.execute(self._sql.run_row, (run_id,))
        found = cur.fetchone()
        if found is None:
            return None
        return self._checked_run(found)

    def _waits_digest_in(self, cur: Any, run_id: str) -> bytes:
        """The digest of a run's waits as they stand: every wait's name, instance and
        seal (a wait row put back to an earlier version has an earlier seal)."""
        q = self._sql.q
        cur.execute(
            f"SELECT name, instance, seal FROM oo_waits WHERE run_id = {q} ORDER BY name, instance",
            (run_id,),
        )
        h = blake3.blake3(b"onceonly.waits.v1")
        for name, instance, sealed in cur.fetchall():
            h.update(_encode_parts([name, int(instance), b"" if sealed is None else bytes(sealed)]))
        return h.digest()

    def _seal_waits_in(self, cur: Any, run_id: str) -> None:
        """After a wait of ``run_id`` was written in this transaction: record the digest
        of the run's waits in its (sealed) run row. The run row is locked first, so
        concurrent writers of two waits of one run cannot both record a stale digest."""
        if self.integrity is None:
            return
        run = self.read_run_in(cur, run_id, lock=True)
        if run is None:
            return
        # The cached head stays: a wait changes no checkpoint, and in async or exit mode
        # the cache is this process's own view, ahead of the database (dropping it would
        # build the next checkpoint on an older head). Sealed writes read the row afresh.
        self._update_run_in(cur, run, {"waits_digest": self._waits_digest_in(cur, run_id)})

    def _check_waits_in(self, cur: Any, run_id: str) -> None:
        """Before a wait of ``run_id`` is decided on: its waits are the ones its run row
        was sealed with.

        Raises:
            CorruptRecord: A wait was put back to an earlier version, deleted or added
                behind the store's back (or the run row fails its seal).
        """
        if self.integrity is None:
            return
        run = self.read_run_in(cur, run_id)
        if run is None or run.waits_digest is None:
            return  # no run (a fork's start in progress) or waits sealed before v5
        if not hmac.compare_digest(run.waits_digest, self._waits_digest_in(cur, run_id)):
            raise CorruptRecord(
                "its waits are not the ones its run row was sealed with (a wait put back "
                "to an earlier version, deleted or added behind the store's back); nothing "
                "is decided on them. Run `onceonly audit verify`",
                run_id=run_id,
                hint="",
            )

    def run_head_in(self, cur: Any, run_id: str) -> tuple[Run, bytes | None] | None:
        """The run row (seal checked) and its head checkpoint's digest, read through
        ``cur`` in one statement; None when there is no such run. What a claim's fence
        reads in the claim's transaction.

        Raises:
            CorruptRecord: The run row fails its seal.
        """
        cur.execute(self._sql.run_row, (run_id,))
        found = cur.fetchone()
        if found is None:
            return None
        digest = found[len(_RUN_COLS)]
        return self._checked_run(found), None if digest is None else bytes(digest)

    def _checked_run(self, found: Sequence[Any]) -> Run:
        n = len(_RUN_COLS)
        values = dict(zip(_RUN_COLS, found[:n], strict=True))
        digest = found[n]
        check(
            self.integrity,
            "runs",
            _run_parts(values, None if digest is None else bytes(digest)),
            None if values["seal"] is None else bytes(values["seal"]),
            what=f"run {values['run_id']!r}",
            run_id=values["run_id"],
        )
        if self.witness is not None:
            self._check_witnessed(values["run_id"], int(values.get("rev") or 0))
        return self._run_from_row(values)

    def _check_witnessed(self, run_id: str, rev: int) -> None:
        """A run row read at ``rev`` is not behind its witnessed revision.

        A read whose snapshot began before another thread's write committed (and was
        witnessed) is merely stale, as any read may be: the run's revision is read
        again, outside the caller's transaction, before anything is refused.

        Raises:
            RunRolledBack: The store holds an older revision than the witness saw.
        """
        assert self.witness is not None
        if self._behind is not None:
            raise self._behind  # the store as a whole is behind: nothing is done with it
        seen = self.witness.runs.get(run_id, 0)
        if rev >= seen:
            return
        with self.engine.connect() as conn:
            now = conn.exec_driver_sql(
                f"SELECT rev FROM oo_runs WHERE run_id = {self._sql.q}", (run_id,)
            ).scalar()
        if now is not None and int(now) >= seen:
            return
        raise RunRolledBack(run_id, rev, seen, self.witness.path)

    @retried("list runs", idempotent=True)
    def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        flow: str | None = None,
        limit: int | None = None,
    ) -> list[Run]:
        """Runs, most recently updated first, optionally filtered (seals checked).

        Raises:
            CorruptRecord: A run row fails its seal.
        """
        self._check_open()
        q = self._sql.q
        where: list[str] = []
        params: list[Any] = []
        if status is not None:
            where.append(f"r.status = {q}")
            params.append(RunStatus(status).value)
        if flow is not None:
            where.append(f"r.flow = {q}")
            params.append(flow)
        sql = self._sql.runs_rows
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY r.updated_at DESC, r.run_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"

        def scan(cur: Any) -> list[Any]:
            cur.execute(sql, params)
            return list(cur.fetchall())

        return [self._checked_run(row) for row in self.read(scan)]

    @retried("update a run", idempotent=True)
    def update_run(
        self,
        run_id: str,
        *,
        status: RunStatus | str | None = None,
        next_step: Any = _UNSET,
        handoff: Handoff | None = None,
        code_version: str | None = None,
        expect_status: RunStatus | str | None = None,
        expect_head: int | None = None,
    ) -> Run:
        """Change a run's status, next step, handoff note or code version.

        Args:
            expect_status: Change it only if the run still has this status.
            expect_head: Change it only if the run's head is still this checkpoint.

        Raises:
            RunNotFound: No such run.
            ConcurrentWrite: An expectation does not hold (another writer changed the
                run); nothing was changed.
        """
        self._check_open()
        values: dict[str, Any] = {}
        if status is not None:
            values["status"] = RunStatus(status).value
        if next_step is not _UNSET:
            values["next_step"] = next_step
        if handoff is not None:
            values["handoff"] = self._encode_handoff(handoff)
        if code_version is not None:
            values["code_version"] = code_version

        def txn(cur: Any) -> None:
            run = self.read_run_in(cur, run_id, lock=True)
            if run is None:
                raise RunNotFound(run_id)
            if (expect_status is not None and run.status is not RunStatus(expect_status)) or (
                expect_head is not None and run.head_seq != expect_head
            ):
                raise ConcurrentWrite(run_id, -1 if expect_head is None else expect_head)
            self._update_run_in(cur, run, values)

        failpoint("checkpoint.run.write")
        with translate("update a run"), _RawTxn(self, write=True) as cur:
            txn(cur)
        with self._lock:
            self._heads.pop(run_id, None)  # the cached run row is no longer current
        return self.get_run(run_id)

    def _update_run_in(self, cur: Any, run: Run, changes: Mapping[str, Any]) -> None:
        """Change sealed columns of a run row read (and checked) in this transaction,
        sealing the result (the head stays: its digest is read again here)."""
        q = self._sql.q
        cur.execute(
            f"SELECT digest FROM oo_checkpoints WHERE run_id = {q} AND seq = {q}",
            (run.run_id, -1 if run.head_seq is None else run.head_seq),
        )
        found = cur.fetchone()
        values = {
            "run_id": run.run_id,
            "flow": run.flow,
            "code_version": run.code_version,
            "state_version": run.state_version,
            "status": run.status.value,
            "next_step": run.next_step,
            "handoff": self._encode_handoff(run.handoff),
            "head_seq": run.head_seq,
            "waits_digest": run.waits_digest,
            **changes,
            "rev": run.rev + 1,
        }
        values["seal"] = seal(
            self.integrity, "runs", _run_parts(values, None if found is None else bytes(found[0]))
        )
        self._note_rev(run.run_id, values["rev"])
        cols = ["status", "next_step", "handoff", "code_version", "seal", "waits_digest", "rev"]
        sets = ", ".join([f"{c} = {q}" for c in cols] + [f"updated_at = {q}"])
        cur.execute(
            f"UPDATE oo_runs SET {sets} WHERE run_id = {q}",
            [*(values[c] for c in cols), time.time(), run.run_id],
        )

    @retried("take a lease", idempotent=True)
    def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Run:
        """Take (or renew) the run's lease for ``ttl_s`` seconds.

        Raises:
            LeaseHeld: Another owner holds a lease that has not expired.
            RunNotFound: No such run.
        """
        self._check_open()
        if ttl_s <= 0:
            raise ConfigurationError("lease ttl_s must be > 0")
        now = time.time()
        r = _schema.runs
        failpoint("checkpoint.run.write")
        with translate("take a lease"), begin(self.engine) as conn:
            res = conn.execute(
                update(r)
                .where(r.c.run_id == run_id)
                .where(
                    or_(
                        r.c.lease_owner.is_(None),
                        r.c.lease_owner == owner,
                        r.c.lease_expires_at < now,
                    )
                )
                .values(lease_owner=owner, lease_expires_at=now + ttl_s, updated_at=now)
            )
            if res.rowcount == 0:
                row = conn.execute(
                    select(r.c.lease_owner, r.c.lease_expires_at).where(r.c.run_id == run_id)
                ).first()
                if row is None:
                    raise RunNotFound(run_id)
                raise LeaseHeld(run_id, str(row[0]), float(row[1]))
        return self.get_run(run_id)

    @retried("release a lease", idempotent=True)
    def release_lease(self, run_id: str, owner: str) -> bool:
        """Give up the lease if ``owner`` holds it. Returns whether it was held."""
        self._check_open()
        r = _schema.runs
        failpoint("checkpoint.run.write")
        with translate("release a lease"), begin(self.engine) as conn:
            res = conn.execute(
                update(r)
                .where(and_(r.c.run_id == run_id, r.c.lease_owner == owner))
                .values(lease_owner=None, lease_expires_at=None)
            )
        return bool(res.rowcount)

    # -- checkpoints: write ------------------------------------------------------------
    def save(
        self,
        run_id: str,
        state: Mapping[str, Any],
        *,
        step: str,
        next_step: Any = _UNSET,
        status: RunStatus | str | None = None,
        source: Source | str = Source.STEP,
        schema_version: int | None = None,
        handoff: Handoff | None = None,
        parent: int | None = None,
    ) -> CheckpointInfo:
        """Checkpoint the run's whole state; only what changed since the parent is stored.

        Dict channels are compared key by key and lists by appended suffix, so a step that
        changes five keys of a large dict or appends one message writes about that much.

        Args:
            run_id: The run.
            state: Mapping of channel name to value (any codec-encodable value).
            step: The step that produced this state.
            next_step: The run's next step, advanced atomically with the checkpoint.
            status: The run's new status, advanced atomically with the checkpoint.
            source: Who wrote it.
            schema_version: The state-schema version (default: the run's).
            handoff: The run's new handoff note, written atomically with the checkpoint.
            parent: The sequence number the caller built this state on (``-1``: the run
                must have no checkpoint yet); another head is a ``ConcurrentWrite``.

        Returns:
            The new checkpoint's metadata (durable on return in ``sync`` mode).

        Raises:
            CodecError: A value cannot be encoded; nothing was written.
            ConcurrentWrite: Another writer advanced the run (or its head is not
                ``parent``); nothing was written.
        """
        with self._lock:
            self._check_open()
            self._take_lost(run_id)
            head = self._head(run_id)
            _check_parent(run_id, head, parent)
            ops = _delta.diff(head.state if head else {}, state, self.codec)
            return self._commit_ops(
                run_id, head, ops, step, next_step, status, source, schema_version, handoff
            )

    def update(
        self,
        run_id: str,
        *,
        step: str,
        set: Mapping[str, Any] | None = None,
        merge: Mapping[str, Mapping[str, Any]] | None = None,
        append: Mapping[str, Sequence[Any]] | None = None,
        delete: Iterable[str] = (),
        next_step: Any = _UNSET,
        status: RunStatus | str | None = None,
        source: Source | str = Source.STEP,
        schema_version: int | None = None,
        handoff: Handoff | None = None,
        parent: int | None = None,
    ) -> CheckpointInfo:
        """Checkpoint explicit changes: O(changed) work, no comparison with the parent.

        Args:
            set: Channels replaced by new values.
            merge: For dict channels, keys to set (to remove keys of a dict, use
                :meth:`save` with the whole state).
            append: For list channels, items to append.
            delete: Channels to remove.

        Other arguments and errors as in :meth:`save`.
        """
        with self._lock:
            self._check_open()
            self._take_lost(run_id)
            head = self._head(run_id)
            _check_parent(run_id, head, parent)
            current = head.state if head else {}
            ops: dict[str, _delta.Op] = {}
            for ch, v in (set or {}).items():
                ops[ch] = ("s", v)
            for ch, kv in (merge or {}).items():
                if type(current.get(ch)) is not dict:
                    raise ConfigurationError(f"cannot merge into channel {ch!r}: not a dict")
                if not all(type(k) is str and k[:1] != "\x00" for k in kv):
                    raise ConfigurationError("merge keys must be strings not starting with NUL")
                ops[ch] = ("m", dict(kv), [])
            for ch, items in (append or {}).items():
                if type(current.get(ch)) not in (list, _delta.ChunkedList):
                    raise ConfigurationError(f"cannot append to channel {ch!r}: not a list")
                ops[ch] = ("a", list(items))
            for ch in delete:
                ops[ch] = ("x",)
            for ch in ops:
                _delta.check_channel(ch)
            return self._commit_ops(
                run_id, head, ops, step, next_step, status, source, schema_version, handoff
            )

    def _commit_ops(
        self,
        run_id: str,
        head: _Head | None,
        ops: dict[str, _delta.Op],
        step: str,
        next_step: Any,
        status: RunStatus | str | None,
        source: Source | str,
        schema_version: int | None,
        handoff: Handoff | None,
    ) -> CheckpointInfo:
        base = self.get_run(run_id) if head is None else None
        pending, new_head = self._build(
            run_id, head, ops, step, next_step, status, source, schema_version, handoff, base
        )
        self._remember(run_id, new_head)
        if self.durability is Durability.SYNC:
            try:
                self._write_batch([pending], isolate=False)
            except BaseException:
                self._heads.pop(run_id, None)
                raise
            return pending.info()
        with self._count_lock:
            self._unwritten[run_id] = self._unwritten.get(run_id, 0) + 1
        if self.durability is Durability.ASYNC:
            self._queue.put(pending)
        else:
            self._pending.append(pending)
        return pending.info()

    def _build(
        self,
        run_id: str,
        head: _Head | None,
        ops: dict[str, _delta.Op],
        step: str,
        next_step: Any,
        status: RunStatus | str | None,
        source: Source | str,
        schema_version: int | None,
        handoff: Handoff | None,
        base: Run | None,
    ) -> tuple[_Pending, _Head]:
        """Encode the checkpoint that applies ``ops`` on top of ``head`` (None: the run's
        first, on top of the run row ``base``); returns it and the advanced head (the
        cached head object itself, changed in place)."""
        src = Source(source).value
        run_values: dict[str, Any] = {}
        if handoff is not None:
            run_values["handoff"] = self._encode_handoff(handoff)
        if next_step is not _UNSET:
            run_values["next_step"] = next_step
        ended = status is not None and RunStatus(status) in _ENDED
        if status is not None:
            run_values["status"] = RunStatus(status).value
        if ended:
            # An ended run holds no lease: cleared in the write that ends it, so no reader
            # sees a completed run still leased by the worker that completed it.
            run_values["lease_owner"] = None
            run_values["lease_expires_at"] = None
        # Encode the delta first: it validates every new value, so an unencodable one
        # fails here with nothing written and the cached head untouched.
        enc = _delta.encode_delta(self.codec, ops)
        if head is None:
            assert base is not None
            version = schema_version or base.state_version
            new_head = _Head(-1, 0, 0, 0, 0, version, {}, run=base)
            parent_digest = b""
        else:
            version = schema_version or head.schema_version
            new_head = head
            parent_digest = b"" if head.info is None else head.info.digest
        run_values["state_version"] = version
        seq = new_head.seq + 1
        policy = self.keyframes
        keyframe = (
            head is None
            or version != head.schema_version
            or new_head.deltas >= policy.max_deltas
            or new_head.delta_bytes >= policy.replay_ratio * max(new_head.keyframe_bytes, 1)
        )
        try:
            for ch, op in ops.items():
                if op[0] != "a":  # the sealed chunks remembered for it no longer apply
                    new_head.lists.pop(ch, None)
            _delta.apply(new_head.state, _copy_ops(ops), where="save")
            if keyframe:
                enc = _delta.encode_keyframe(self.codec, new_head.state, new_head.lists)
                kind, kf_seq = _KEYFRAME, seq
            else:
                kind, kf_seq = _DELTA, new_head.keyframe_seq
        except BaseException:
            self._heads.pop(run_id, None)  # the cached state may hold part of the change
            raise
        created = time.time()
        pending = _Pending(
            run_id=run_id,
            seq=seq,
            kind=kind,
            keyframe_seq=kf_seq,
            step=step,
            source=src,
            schema_version=version,
            created_at=created,
            body=_delta.pack(enc.raw),
            digest=_delta.row_digest(
                run_id, seq, kind, kf_seq, version, step, src, created, enc.raw
            ),
            blobs={h: _delta.pack(raw) for h, raw in enc.blobs.items()},
            refs=enc.refs,
            run_values=run_values,
            parent_digest=parent_digest,
            reported=self._reported.get(run_id, 0),
            gen=self._gen,
        )
        new_head.seq = seq
        new_head.schema_version = version
        new_head.info = pending.info()
        if new_head.run is not None:
            new_head.run = dataclasses.replace(
                new_head.run,
                status=RunStatus(status) if status is not None else new_head.run.status,
                next_step=new_head.run.next_step if next_step is _UNSET else next_step,
                handoff=new_head.run.handoff if handoff is None else handoff,
                state_version=version,
                head_seq=seq,
                updated_at=created,
            )
            if ended:
                new_head.run = dataclasses.replace(
                    new_head.run, lease_owner=None, lease_expires_at=None
                )
        if keyframe:
            new_head.keyframe_seq = seq
            new_head.deltas = 0
            new_head.delta_bytes = 0
            new_head.keyframe_bytes = enc.state_bytes
        else:
            new_head.deltas += 1
            new_head.delta_bytes += len(enc.raw)
        return pending, new_head

    @retried("write checkpoints", idempotent=False)
    def _write_batch(
        self,
        batch: Sequence[_Pending],
        participants: Sequence[_Barrier] = (),
        *,
        isolate: bool = True,
    ) -> list[_Pending]:
        """Write checkpoints, then run participants' work, in one durable commit.

        A group commit isolates its members: each queued checkpoint is written in its
        own savepoint, so one that lost a race to another writer (ConcurrentWrite) is
        left out and the others, and every participant's work, still commit. Only a
        synchronous save (``isolate=False``: its caller waits for it) gets its
        ConcurrentWrite raised.

        The hot path uses the pooled DBAPI connection with fixed SQL: one statement per
        row, no ORM, no per-call statement compilation.

        Returns:
            The checkpoints that were left out (a lost race).
        """
        for part in participants:
            part.error = None  # from an earlier attempt of this batch
        lost: list[_Pending] = []
        lost_runs: set[str] = set()
        with translate("write checkpoints"), _RawTxn(self, write=True) as cur:
            for i, p in enumerate(batch):
                if p.run_id in lost_runs:
                    # Built on a checkpoint of this batch that was left out: left out too.
                    lost.append(p)
                    continue
                if not isolate:
                    self._write_pending(cur, p)
                    continue
                cur.execute(f"SAVEPOINT oo_c{i}")
                mark = self._revs_mark()
                try:
                    self._write_pending(cur, p)
                except (ConcurrentWrite, CorruptRecord):
                    # A lost race, or a run row that fails its seal (its next load says
                    # so): this member alone is left out.
                    cur.execute(f"ROLLBACK TO SAVEPOINT oo_c{i}")
                    self._revs_mark(mark)
                    lost.append(p)
                    lost_runs.add(p.run_id)
                cur.execute(f"RELEASE SAVEPOINT oo_c{i}")
            solo = not batch and len(participants) == 1
            for i, part in enumerate(participants):
                if part.fn is None:
                    continue
                if solo:
                    # Alone in its transaction: an error rolls back just its own work.
                    part.result = part.fn(cur)
                    continue
                cur.execute(f"SAVEPOINT oo_p{i}")
                mark = self._revs_mark()
                try:
                    part.result = part.fn(cur)
                except Exception as exc:  # noqa: BLE001  (handed to that participant)
                    # Driver errors reach the participant translated, as they would
                    # outside a savepoint.
                    part.error = (
                        classify(exc, "run a transaction")
                        if isinstance(exc, DRIVER_ERRORS)
                        else exc
                    )
                    cur.execute(f"ROLLBACK TO SAVEPOINT oo_p{i}")
                    self._revs_mark(mark)
                cur.execute(f"RELEASE SAVEPOINT oo_p{i}")
            failpoint("checkpoint.commit.before")
        failpoint("checkpoint.commit.after")
        return lost

    def _write_pending(self, cur: Any, p: _Pending) -> None:
        """Write one checkpoint and advance its run's head, compare-and-set on the parent:
        the run's head must still be the exact checkpoint this one was built on (its
        sequence number *and* its digest), else :class:`ConcurrentWrite`."""
        sql = self._sql
        keys = self.integrity
        # Without keys a run row is left unsealed (never with a seal that no longer
        # matches it): a keyed reader then says plainly that it carries no seal.
        run_values = {**p.run_values, "seal": None} if keys is None else self._resealed(cur, p)
        if p.blobs:
            cur.executemany(sql.ins_blob, [(h, len(d), d) for h, d in p.blobs.items()])
        if p.refs:
            cur.executemany(sql.ins_ref, [(p.run_id, h) for h in p.refs])
        ckpt_seal = seal(
            keys,
            "checkpoints",
            _ckpt_parts(
                p.run_id,
                p.seq,
                p.kind,
                p.keyframe_seq,
                p.schema_version,
                p.step,
                p.source,
                p.created_at,
                p.digest,
            ),
        )
        try:
            cur.execute(
                sql.ins_ckpt,
                (
                    p.run_id,
                    p.seq,
                    p.kind,
                    p.keyframe_seq,
                    p.step,
                    p.source,
                    p.schema_version,
                    p.created_at,
                    p.body,
                    p.digest,
                    ckpt_seal,
                ),
            )
        except DRIVER_ERRORS as exc:
            if is_integrity_error(exc):
                raise ConcurrentWrite(p.run_id, p.seq - 1) from exc
            raise
        cols = sorted(run_values)
        params: list[Any] = [p.seq, p.created_at, *(run_values[c] for c in cols), p.run_id]
        checked = p.seq > 0 and bool(p.parent_digest)
        if p.seq > 0:
            params.append(p.seq - 1)
            if checked:
                params.extend([p.run_id, p.seq - 1, p.parent_digest])
        cur.execute(sql.advance(tuple(cols), first=p.seq == 0, parent=checked), params)
        if cur.rowcount != 1:
            raise ConcurrentWrite(p.run_id, p.seq - 1)

    def _resealed(self, cur: Any, p: _Pending) -> dict[str, Any]:
        """The run columns a checkpoint writes, with the run's new seal: the run row is
        read (and its seal checked against the parent) in the writing transaction."""
        run = self.read_run_in(cur, p.run_id, lock=True)
        expected_head = None if p.seq == 0 else p.seq - 1
        if run is None or run.head_seq != expected_head:
            raise ConcurrentWrite(p.run_id, p.seq - 1)
        values: dict[str, Any] = {
            "run_id": run.run_id,
            "flow": run.flow,
            "code_version": run.code_version,
            "state_version": run.state_version,
            "status": run.status.value,
            "next_step": run.next_step,
            "handoff": self._encode_handoff(run.handoff),
            "waits_digest": run.waits_digest,
            **p.run_values,
            "head_seq": p.seq,
            "rev": run.rev + 1,
        }
        out = dict(p.run_values)
        out["handoff"] = values["handoff"]
        out["rev"] = values["rev"]
        out["seal"] = seal(self.integrity, "runs", _run_parts(values, p.digest))
        self._note_rev(run.run_id, values["rev"])
        return out

    def _written(self, batch: Sequence[_Pending], lost: Sequence[_Pending]) -> None:
        """Bookkeeping after queued checkpoints were written (or left out): forget the
        cached heads of runs whose checkpoint lost a race. Called by whichever thread
        wrote them; takes only the small counting lock."""
        with self._count_lock:
            self._stale_runs.update(p.run_id for p in lost)
            for p in lost:
                if p.reported < self._reported.get(p.run_id, 0):
                    continue  # queued before a loss of its run was reported: said already
                self._lost[p.run_id] = min(self._lost.get(p.run_id, p.seq - 1), p.seq - 1)
            for p in batch:
                n = self._unwritten.get(p.run_id, 0) - 1
                if n > 0:
                    self._unwritten[p.run_id] = n
                else:
                    self._unwritten.pop(p.run_id, None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch: list[_Pending] = []
            barriers: list[_Barrier] = []
            stop = False
            while True:
                if isinstance(item, _Barrier):
                    barriers.append(item)
                elif item is None:
                    stop = True
                    break
                else:
                    batch.append(item)
                if len(batch) >= 512:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            work = [b for b in barriers if b.fn is not None]
            # Checkpoints queued in a generation whose write failed are deltas on top of
            # lost ones: drop them, even after the caller has been told of the failure.
            live = [p for p in batch if p.gen > self._dead_gen]
            if len(live) < len(batch):
                self._heads_stale = True
            lost: list[_Pending] = []
            if live or work:
                try:
                    lost = self._write_batch(live, work)
                except BaseException as exc:  # noqa: BLE001  (surfaced on the next call)
                    for b in work:
                        b.error = exc
                    if live:
                        self._dead_gen = max(p.gen for p in live)
                        self._async_error = exc
                        self._heads_stale = True
            self._written(batch, lost)
            for b in barriers:
                b.done.set()
            if stop:
                return

    # -- checkpoints: read -------------------------------------------------------------
    def _head(self, run_id: str) -> _Head | None:
        head = self._heads.get(run_id)
        if head is not None:
            self._heads.move_to_end(run_id)
            return head
        # Not cached (new to this process, or evicted): whatever this process queued for
        # the run must be in the database before the head is read from there.
        if self.durability is Durability.EXIT:
            self._flush_locked_pending()
        elif self.durability is Durability.ASYNC:
            self.flush()
        try:
            _, head = self._load(run_id, None, lazy=True)
        except CheckpointNotFound:
            return None
        self._remember(run_id, head)
        return head

    def _flush_locked_pending(self) -> None:
        if self.durability is Durability.EXIT and self._pending:
            self._write_exit([])

    def _write_exit(self, participants: Sequence[_Barrier]) -> None:
        """``exit`` mode: write every pending checkpoint (and ``participants``' work) in
        one transaction, under the lock."""
        pending, self._pending = self._pending, []
        try:
            lost = self._write_batch(pending, participants)
        except BaseException:
            if pending:
                self._heads.clear()
            self._written(pending, [])
            raise
        self._written(pending, lost)
        for p in lost:
            self._heads.pop(p.run_id, None)

    def _remember(self, run_id: str, head: _Head) -> None:
        self._heads[run_id] = head
        self._heads.move_to_end(run_id)
        while len(self._heads) > _HEAD_CACHE:
            self._heads.popitem(last=False)

    def load(
        self,
        run_id: str,
        seq: int | None = None,
        *,
        lazy: bool = False,
        migrations: StateMigrations | None = None,
    ) -> Snapshot:
        """Load the latest checkpoint (or checkpoint ``seq``) of a run.

        Reads one keyframe and the deltas after it: the cost does not grow with the
        length of the run's history. Every row and blob read is integrity-checked.

        With ``lazy=True``, long list channels (message histories) come back as
        :class:`~checkpoint.ChunkedList`: their sealed chunks are read on first access, so
        resuming costs the same whatever the length of the history.

        When ``migrations`` (or the store's default) is given and the checkpoint's state
        is older, the upgrades run; loading the latest checkpoint then records the result
        as a new checkpoint with source ``migration``.

        Raises:
            RunNotFound / CheckpointNotFound: Nothing to load.
            CorruptRecord: A row or blob failed its check; nothing is returned.
            StateVersionError: The checkpoint is newer than ``migrations.current``, or an
                upgrade is missing.
        """
        with self._lock:
            self._check_open()
            self.flush()
            if seq is None:
                self._take_lost(run_id)
            snap, head = self._load(run_id, seq, lazy=lazy)
            if seq is None:
                self._remember(run_id, head)
            mig = migrations or self.migrations
            if mig is None or snap.info.schema_version == mig.current:
                return snap
            snap = Snapshot({k: _delta.plain(v) for k, v in snap.state.items()}, snap.info)
            upgraded = _upgrade(run_id, snap, mig)
            if seq is not None and seq != self._load_head_seq(run_id):
                return Snapshot(upgraded, snap.info)
            info = self.save(
                run_id,
                upgraded,
                step=snap.info.step,
                source=Source.MIGRATION,
                schema_version=mig.current,
            )
            self.flush()
            return Snapshot(_delta.private_copy(upgraded), info)

    def load_run(
        self,
        run_id: str,
        *,
        lazy: bool = False,
        migrations: StateMigrations | None = None,
    ) -> tuple[Run, Snapshot | None]:
        """The run row and its latest checkpoint as **one consistent snapshot**.

        Status, next step, head and state all come from the same moment: read together in
        one statement from the database, or, while this process still has checkpoints of
        the run queued (``async`` / ``exit`` durability), this process's own view as of
        its last checkpoint (ahead of the database, and what the database will hold once
        they are written; a queued checkpoint that loses a race to another writer is
        dropped and the next call reads the database again). A caller that acts on the
        snapshot fences its effects on ``(head seq, digest)`` of the returned checkpoint.

        Args:
            run_id: The run.
            lazy: As in :meth:`load`.
            migrations: As in :meth:`load`: older state is upgraded and the upgrade is
                recorded as a checkpoint (source ``migration``) before it is returned.

        Returns:
            The run and its latest checkpoint (None when it has none yet).

        Raises:
            RunNotFound: No such run.
            CorruptRecord: A row or blob failed its check; nothing is returned.
            StateVersionError: As in :meth:`load`.
        """
        with self._lock:
            self._check_open()
            self._take_lost(run_id)
            head = self._heads.get(run_id)
            with self._count_lock:
                ahead = self._unwritten.get(run_id, 0) > 0 and run_id not in self._stale_runs
            if ahead and head is not None and head.run is not None and head.info is not None:
                run = head.run
                snap = Snapshot(_delta.private_copy(head.state), head.info)
            else:
                run, loaded = self._load_run_rows(run_id, lazy=lazy)
                if loaded is None:
                    return run, None
                snap, head = loaded
                head.run = run
                self._remember(run_id, head)
            mig = migrations or self.migrations
            if mig is None or snap.info.schema_version == mig.current:
                return run, snap
            plain = Snapshot({k: _delta.plain(v) for k, v in snap.state.items()}, snap.info)
            upgraded = _upgrade(run_id, plain, mig)
            info = self.save(
                run_id,
                upgraded,
                step=snap.info.step,
                source=Source.MIGRATION,
                schema_version=mig.current,
                parent=snap.info.seq,
            )
            self.flush()
            run = dataclasses.replace(run, head_seq=info.seq, state_version=mig.current)
            return run, Snapshot(_delta.private_copy(upgraded), info)

    @retried("load a run", idempotent=True)
    def _load_run_rows(
        self, run_id: str, *, lazy: bool
    ) -> tuple[Run, tuple[Snapshot, _Head] | None]:
        """Read the run row and its head checkpoint's rows in one statement (one
        snapshot on both databases), then its blobs in the same read transaction (blobs
        are immutable and referenced, so they cannot change under it)."""
        with translate("load a run"), _RawTxn(self, write=False) as cur:
            cur.execute(self._sql.run_and_head, (run_id,))
            found = cur.fetchall()
            if not found:
                raise RunNotFound(run_id)
            n = len(_RUN_COLS)
            rows = [_Row(*r[n:-1]) for r in found if r[n] is not None]
            head_digest = rows[-1].digest if rows else None
            run = self._checked_run([*found[0][:n], head_digest])
            _check_nothing_above(run_id, run.head_seq, found[0][-1])
            if run.head_seq is None:
                return run, None
            if not rows:
                raise CorruptRecord(
                    "the checkpoint, or the keyframe it depends on, is missing",
                    run_id=run_id,
                    seq=int(run.head_seq),
                )
            return run, self._materialise(cur, run_id, rows, int(run.head_seq), lazy=lazy)

    @retried("read a run", idempotent=True)
    def _load_head_seq(self, run_id: str) -> int | None:
        r = _schema.runs
        with translate("read a run"), self._reader() as conn:
            row = conn.execute(select(r.c.head_seq).where(r.c.run_id == run_id)).first()
        if row is None:
            raise RunNotFound(run_id)
        return None if row[0] is None else int(row[0])

    def _reader(self) -> Any:
        return self.engine.connect().execution_options(**{READ_ONLY: True})

    @retried("load a checkpoint", idempotent=True)
    def _load(self, run_id: str, seq: int | None, *, lazy: bool) -> tuple[Snapshot, _Head]:
        sql = self._sql
        with translate("load a checkpoint"), _RawTxn(self, write=False) as cur:
            if seq is None:
                cur.execute(sql.run_head_top, (run_id, run_id))
                found = cur.fetchone()
                if found is not None:
                    _check_nothing_above(run_id, found[0], found[1])
                cur.execute(sql.head_rows, (run_id, run_id, run_id, run_id))
            else:
                cur.execute(sql.seq_rows, (run_id, run_id, seq, seq))
            rows = [_Row(*r) for r in cur.fetchall()]
            if not rows:
                cur.execute(sql.run_head, (run_id,))
                found = cur.fetchone()
                if found is None:
                    raise RunNotFound(run_id)
                head_seq = found[0]
                asked = head_seq if seq is None else seq
                if head_seq is not None and 0 <= asked <= int(head_seq):
                    # The run says this checkpoint exists: it (or its keyframe) was lost,
                    # which must never read as "not saved yet" (a caller would restart).
                    raise CorruptRecord(
                        "the checkpoint, or the keyframe it depends on, is missing",
                        run_id=run_id,
                        seq=int(asked),
                    )
                raise CheckpointNotFound(run_id, seq)
            target = rows[-1].seq
            if seq is not None and target != seq:
                raise CheckpointNotFound(run_id, seq)
            return self._materialise(cur, run_id, rows, target, lazy=lazy)

    def _materialise(
        self, cur: Any, run_id: str, rows: Sequence[_Row], target: int, *, lazy: bool
    ) -> tuple[Snapshot, _Head]:
        """Verify a keyframe and its deltas up to ``target`` and build the state (blobs
        are read through ``cur``, in the caller's read transaction)."""
        if rows[-1].seq != target:
            raise CorruptRecord(
                "the run's head checkpoint is missing", run_id=run_id, seq=int(target)
            )
        bodies, raw_sizes = self._verify_rows(run_id, rows)
        wanted: set[bytes] = set()
        for body in bodies:
            wanted |= _delta.blob_refs_of(body, chunks=not lazy)
        blob_values, blob_sizes = self._read_blobs(cur, run_id, target, wanted)
        first = rows[0]
        if first.kind != _KEYFRAME or first.seq != rows[-1].keyframe_seq:
            raise CorruptRecord(
                "the keyframe this checkpoint depends on is missing", run_id=run_id, seq=target
            )
        expected = list(range(first.seq, target + 1))
        if [row.seq for row in rows] != expected:
            raise CorruptRecord("a delta in the chain is missing", run_id=run_id, seq=target)
        lists: dict[str, _delta.ListChunks] = {}
        try:
            fetch = self._chunk_fetcher(run_id) if lazy else None
            state = _delta.materialise_keyframe(bodies[0], blob_values, lists, fetch)
            delta_bytes = sum(raw_sizes[1:])
            for row, body in zip(rows[1:], bodies[1:], strict=True):
                ops = _delta.resolve_delta(body, blob_values)
                _delta.apply(state, ops, where=f"checkpoint {row.seq}")
                for ch, op in ops.items():
                    if op[0] != "a":
                        lists.pop(ch, None)
        except CorruptRecord as exc:
            raise CorruptRecord(exc.detail, run_id=run_id, seq=target) from exc
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"checkpoint body is malformed ({exc!r})", run_id=run_id, seq=target
            ) from exc
        last = rows[-1]
        info = CheckpointInfo(
            run_id=run_id,
            seq=int(last.seq),
            step=last.step,
            source=_source(last.source, run_id, int(last.seq)),
            schema_version=int(last.schema_version),
            created_at=float(last.created_at),
            keyframe=last.kind == _KEYFRAME,
            keyframe_seq=int(last.keyframe_seq),
            digest=bytes(last.digest),
        )
        # Canonical (uncompressed) sizes, as the writer counts them: the keyframe policy
        # behaves the same whether or not the process was restarted.
        kf_bytes = raw_sizes[0] + sum(blob_sizes.values())
        head = _Head(
            seq=info.seq,
            keyframe_seq=info.keyframe_seq,
            deltas=len(rows) - 1,
            delta_bytes=delta_bytes,
            keyframe_bytes=kf_bytes,
            schema_version=info.schema_version,
            state=state,
            lists=lists,
            info=info,
        )
        return Snapshot(_delta.private_copy(state), info), head

    def _verify_rows(self, run_id: str, rows: Sequence[_Row]) -> tuple[list[Any], list[int]]:
        """Check every row against its seal (with integrity keys) and its digest, before
        anything of it is decoded; then decode all bodies in one pass."""
        raws = []
        for row in rows:
            check(
                self.integrity,
                "checkpoints",
                row.seal_parts(run_id),
                None if row.seal is None else bytes(row.seal),
                what=f"checkpoint {row.seq} of run {run_id!r}",
                run_id=run_id,
                seq=row.seq,
            )
            try:
                raw = _delta.unpack(row.body)
            except CorruptRecord as exc:
                raise CorruptRecord(exc.detail, run_id=run_id, seq=row.seq) from exc
            digest = _delta.row_digest(
                run_id,
                row.seq,
                row.kind,
                row.keyframe_seq,
                row.schema_version,
                row.step,
                row.source,
                row.created_at,
                raw,
            )
            if digest != bytes(row.digest):
                raise CorruptRecord(
                    "checkpoint row does not match its digest (edited, truncated or moved)",
                    run_id=run_id,
                    seq=row.seq,
                )
            raws.append(raw)
        try:
            bodies = self.codec.decode(b"[" + b",".join(raws) + b"]")
        except CorruptRecord:
            bodies = []
            for row, raw in zip(rows, raws, strict=True):  # find the culprit
                try:
                    bodies.append(self.codec.decode(raw))
                except CorruptRecord as exc:
                    raise type(exc)(exc.detail, run_id=run_id, seq=row.seq) from exc
        for row, body in zip(rows, bodies, strict=True):
            if not isinstance(body, dict) or not (("k" in body) ^ ("d" in body)):
                raise CorruptRecord("checkpoint body has no state", run_id=run_id, seq=row.seq)
        return list(bodies), [len(raw) for raw in raws]

    def _chunk_fetcher(self, run_id: str) -> _delta.ChunkFetcher:
        def fetch(hexes: Sequence[str]) -> dict[str, list[Any]]:
            if self._closed:
                raise ConfigurationError(
                    "the store this list was loaded from is closed; read lazily loaded "
                    "lists before closing it, or load with lazy=False"
                )
            wanted = {bytes.fromhex(h) for h in hexes}

            def read() -> dict[bytes, Any]:
                with translate("read list chunks"), _RawTxn(self, write=False) as cur:
                    return self._read_blobs(cur, run_id, None, wanted)[0]

            values = self.retry.call("read list chunks", read, idempotent=True)
            return {h.hex(): v for h, v in values.items()}

        return fetch

    def _read_blobs(
        self, cur: Any, run_id: str, seq: int | None, wanted: set[bytes]
    ) -> tuple[dict[bytes, Any], dict[bytes, int]]:
        values: dict[bytes, Any] = {}
        sizes: dict[bytes, int] = {}
        if not wanted:
            return values, sizes
        want = list(wanted)
        for i in range(0, len(want), 500):
            part = want[i : i + 500]
            cur.execute(self._sql.blobs_in(len(part)), part)
            for h, data in cur.fetchall():
                key = bytes(h)
                values[key], sizes[key] = self._verify_blob(run_id, seq, key, bytes(data))
        missing = wanted - values.keys()
        if missing:
            raise CorruptRecord(
                "a blob the checkpoint refers to is missing",
                run_id=run_id,
                seq=seq,
                blob=sorted(missing)[0].hex(),
            )
        return values, sizes

    def _verify_blob(
        self, run_id: str, seq: int | None, h: bytes, stored: bytes
    ) -> tuple[Any, int]:
        """The decoded value of a verified blob and its canonical (uncompressed) size."""
        try:
            raw = _delta.unpack(stored)
        except CorruptRecord as exc:
            raise CorruptRecord(exc.detail, run_id=run_id, seq=seq, blob=h.hex()) from exc
        if _delta.blob_hash(raw) != h:
            raise CorruptRecord(
                "blob content does not match its hash", run_id=run_id, seq=seq, blob=h.hex()
            )
        try:
            return self.codec.decode(raw), len(raw)
        except CorruptRecord as exc:
            raise type(exc)(exc.detail, run_id=run_id, seq=seq, blob=h.hex()) from exc

    @retried("read history", idempotent=True)
    def history(self, run_id: str, *, limit: int | None = None) -> list[CheckpointInfo]:
        """Metadata of a run's checkpoints, oldest first (the last ``limit`` if given).

        Raises:
            RunNotFound: No such run.
        """
        self._check_open()
        self.flush()
        c = _schema.checkpoints
        q = select(
            c.c.seq,
            c.c.kind,
            c.c.keyframe_seq,
            c.c.step,
            c.c.source,
            c.c.schema_version,
            c.c.created_at,
            c.c.digest,
            c.c.seal,
        ).where(c.c.run_id == run_id)
        q = q.order_by(c.c.seq.desc()).limit(limit) if limit is not None else q.order_by(c.c.seq)
        with translate("read history"), self._reader() as conn:
            rows = conn.execute(q).all()
            if not rows:
                r = _schema.runs
                if conn.execute(select(r.c.run_id).where(r.c.run_id == run_id)).first() is None:
                    raise RunNotFound(run_id)
        for row in rows:
            check(
                self.integrity,
                "checkpoints",
                _ckpt_parts(
                    run_id,
                    row.seq,
                    row.kind,
                    row.keyframe_seq,
                    row.schema_version,
                    row.step,
                    row.source,
                    row.created_at,
                    bytes(row.digest),
                ),
                None if row.seal is None else bytes(row.seal),
                what=f"checkpoint {row.seq} of run {run_id!r}",
                run_id=run_id,
                seq=int(row.seq),
            )
        infos = [
            CheckpointInfo(
                run_id=run_id,
                seq=int(row.seq),
                step=row.step,
                source=_source(row.source, run_id, int(row.seq)),
                schema_version=int(row.schema_version),
                created_at=float(row.created_at),
                keyframe=row.kind == _KEYFRAME,
                keyframe_seq=int(row.keyframe_seq),
                digest=bytes(row.digest),
            )
            for row in rows
        ]
        infos.sort(key=lambda i: i.seq)
        return infos

    def verify_integrity(self) -> tuple[int, list[str]]:
        """Check every stored blob against its hash, every checkpoint row against its
        digest, and (with integrity keys) every run, checkpoint and wait against its
        seal, and every run's history for checkpoints missing below its head or left
        above it (a cut-back history), without loading any state. Without keys,
        :attr:`integrity_note` says what cannot be detected.

        Returns:
            (records checked, one line per problem found).
        """
        self.flush()
        problems: list[str] = []
        checked = 0

        def scan(cur: Any) -> None:
            nonlocal checked
            cur.execute("SELECT hash, data FROM oo_blobs")
            for h, data in cur.fetchall():
                checked += 1
                try:
                    raw = _delta.unpack(bytes(data))
                except CorruptRecord as exc:
                    problems.append(f"blob {bytes(h).hex()}: {exc.detail}")
                    continue
                if _delta.blob_hash(raw) != bytes(h):
                    problems.append(f"blob {bytes(h).hex()}: content does not match its hash")
            cur.execute(
                "SELECT run_id, seq, kind, keyframe_seq, schema_version, step, source, "
                "created_at, body, digest FROM oo_checkpoints"
            )
            seqs: dict[str, list[int]] = {}
            for run_id, seq, kind, kf, ver, step, src, at, body, digest in cur.fetchall():
                checked += 1
                seqs.setdefault(run_id, []).append(int(seq))
                try:
                    raw = _delta.unpack(bytes(body))
                except CorruptRecord as exc:
                    problems.append(f"run {run_id!r} checkpoint {seq}: {exc.detail}")
                    continue
                calc = _delta.row_digest(run_id, seq, kind, kf, ver, step, src, at, raw)
                if calc != bytes(digest):
                    problems.append(f"run {run_id!r} checkpoint {seq}: row fails its digest")
            cur.execute(
                "SELECT run_id, seq, kind, keyframe_seq, schema_version, step, source, "
                "created_at, digest, seal FROM oo_checkpoints"
            )
            for run_id, seq, kind, kf, ver, step, src, at, digest, sealed in cur.fetchall():
                try:
                    check(
                        self.integrity,
                        "checkpoints",
                        _ckpt_parts(run_id, seq, kind, kf, ver, step, src, at, bytes(digest)),
                        None if sealed is None else bytes(sealed),
                        what=f"checkpoint {seq}",
                    )
                except CorruptRecord as exc:
                    problems.append(f"run {run_id!r} checkpoint {seq}: {exc.detail}")
            cur.execute(self._sql.runs_rows)
            for found in cur.fetchall():
                checked += 1
                values = dict(zip(_RUN_COLS, found[: len(_RUN_COLS)], strict=True))
                run_id, head = values["run_id"], values["head_seq"]
                try:
                    self._checked_run(found)
                except CorruptRecord as exc:
                    problems.append(f"run {run_id!r}: {exc.detail}")
                have = sorted(seqs.get(run_id, []))
                if head is None:
                    if have:
                        problems.append(f"run {run_id!r}: checkpoints {have} but no head")
                    continue
                above = [x for x in have if x > int(head)]
                if above:
                    problems.append(
                        f"run {run_id!r}: checkpoints {above} above its head {head} (a cut-back "
                        f"history, or a head moved back)"
                    )
                if int(head) not in have:
                    problems.append(f"run {run_id!r}: its head checkpoint {head} is missing")
            from .waits import _READ as WAIT_COLS  # noqa: PLC0415  (waits imports store)
            from .waits import Waits  # noqa: PLC0415

            waits = Waits(self)
            cur.execute(f"SELECT {WAIT_COLS} FROM oo_waits")
            for row in cur.fetchall():
                checked += 1
                try:
                    waits._checked(row)
                except CorruptRecord as exc:
                    problems.append(f"run {row[0]!r} wait {row[1]!r}#{row[14]}: {exc.detail}")
            if self.integrity is not None:
                cur.execute("SELECT DISTINCT run_id FROM oo_waits ORDER BY run_id")
                for (rid,) in cur.fetchall():
                    try:
                        self._check_waits_in(cur, rid)
                    except CorruptRecord as exc:
                        problems.append(f"run {rid!r}: {exc.detail}")

        self.read(scan)
        return checked, problems

    def seal_unsealed(self) -> int:
        """Seal every run, checkpoint and wait that carries no seal (a store created
        before sealing, or written by a store without keys), as they stand: an
        operator's decision to trust the current contents, taken after ``verify``.

        Returns:
            How many rows were sealed.

        Raises:
            ConfigurationError: This store has no integrity keys.
        """
        keys = self.integrity
        if keys is None:
            raise ConfigurationError(f"nothing to seal with: {UNKEYED_LIMITS}")
        from .waits import _COLS as WAIT_COLS  # noqa: PLC0415  (waits imports store)
        from .waits import _wait_parts  # noqa: PLC0415

        q = self._sql.q

        def txn(cur: Any) -> int:
            n = 0
            cur.execute(
                "SELECT run_id, seq, kind, keyframe_seq, schema_version, step, source, "
                "created_at, digest FROM oo_checkpoints WHERE seal IS NULL"
            )
            for rid, seq, kind, kf, ver, step, src, at, digest in cur.fetchall():
                parts = _ckpt_parts(rid, seq, kind, kf, ver, step, src, at, bytes(digest))
                cur.execute(
                    f"UPDATE oo_checkpoints SET seal = {q} WHERE run_id = {q} AND seq = {q}",
                    (keys.seal("checkpoints", parts), rid, seq),
                )
                n += 1
            cur.execute(self._sql.runs_rows + " WHERE r.seal IS NULL")
            for found in cur.fetchall():
                values = dict(zip(_RUN_COLS, found[: len(_RUN_COLS)], strict=True))
                digest = found[len(_RUN_COLS)]
                parts = _run_parts(values, None if digest is None else bytes(digest))
                cur.execute(
                    f"UPDATE oo_runs SET seal = {q} WHERE run_id = {q}",
                    (keys.seal("runs", parts), values["run_id"]),
                )
                n += 1
            cur.execute(f"SELECT {WAIT_COLS} FROM oo_waits WHERE seal IS NULL")
            for row in cur.fetchall():
                cur.execute(
                    f"UPDATE oo_waits SET seal = {q} WHERE run_id = {q} AND name = {q} "
                    f"AND instance = {q}",
                    (keys.seal("waits", _wait_parts(tuple(row))), row[0], row[1], row[14]),
                )
                n += 1
            # Bind every run's waits to its run row (runs sealed before schema 5 too).
            cur.execute(
                "SELECT DISTINCT w.run_id FROM oo_waits w JOIN oo_runs r ON r.run_id = "
                "w.run_id WHERE r.waits_digest IS NULL ORDER BY w.run_id"
            )
            for (rid,) in cur.fetchall():
                self._seal_waits_in(cur, rid)
                n += 1
            return n

        return self.transact(txn)

    @property
    def integrity_note(self) -> str | None:
        """What this store cannot detect (None when it seals its rows)."""
        return None if self.integrity is not None else UNKEYED_LIMITS

    # -- retention ---------------------------------------------------------------------
    # Idempotent: a run deleted already is not selected again (one archived but not yet
    # deleted when the database failed is archived a second time, in an identical line).
    @retried("apply retention", idempotent=True)
    def apply_retention(
        self, policy: RetentionPolicy, *, now: float | None = None
    ) -> RetentionReport:
        """Delete (optionally archiving first) finished runs older than the policy allows,
        then collect blobs no run refers to. Waiting and running runs are never touched,
        nor a run whose effect keys a remaining run shares (a live fork's origin).

        Returns:
            What was removed.
        """
        self._check_open()
        self.flush()
        cutoff = (time.time() if now is None else now) - policy.older_than_s
        r = _schema.runs
        statuses = [RunStatus(s).value for s in policy.statuses]
        links = _schema.run_links
        live = r.alias("live")
        # A run whose effect keys a remaining run shares (a live fork's origin) stays.
        shared = (
            select(links.c.run_id)
            .join(live, live.c.run_id == links.c.run_id)
            .where(links.c.key_run == r.c.run_id)
            .exists()
        )
        archived = 0
        deleted = 0
        seen: set[str] = set()
        # Rounds: a fork's origin becomes removable once the fork itself was removed.
        while True:
            with translate("select runs for retention"), self._reader() as conn:
                victims = [
                    row[0]
                    for row in conn.execute(
                        select(r.c.run_id)
                        .where(r.c.status.in_(statuses), r.c.updated_at < cutoff, ~shared)
                        .order_by(r.c.updated_at)
                    )
                    if row[0] not in seen
                ]
            if not victims:
                break
            seen.update(victims)
            for run_id in victims:
                archived, deleted = self._retire(
                    run_id, policy, statuses, cutoff, archived, deleted
                )
        collected = self.collect_garbage()
        return RetentionReport(deleted, archived, collected)

    def _retire(
        self,
        run_id: str,
        policy: RetentionPolicy,
        statuses: list[str],
        cutoff: float,
        archived: int,
        deleted: int,
    ) -> tuple[int, int]:
        """Archive and delete one run selected for retention, unless it was resumed or
        forked meanwhile. Returns the counters, advanced."""
        r = _schema.runs
        links = _schema.run_links
        if policy.archive_path is not None:
            self._archive(run_id, policy.archive_path)
            archived += 1
        with translate("delete a run"), self.engine.begin() as conn:
            # Re-check inside the write transaction: the run may have been resumed.
            # On PostgreSQL the row lock makes a fork that is starting on this run
            # (which share-locks it) either finish first, so its link is seen below,
            # or find the run gone; SQLite writers are serial anyway.
            still = conn.execute(
                select(r.c.run_id)
                .where(r.c.run_id == run_id, r.c.status.in_(statuses), r.c.updated_at < cutoff)
                .with_for_update()
            ).first()
            forked = conn.execute(
                select(links.c.run_id).where(
                    links.c.key_run == run_id,
                    links.c.run_id.in_(select(r.c.run_id).where(r.c.run_id != run_id)),
                )
            ).first()
            if still is None or forked is not None:
                return archived, deleted  # resumed or forked meanwhile (it stays)
            if self.witness is not None:
                self.witness.forget([run_id])  # before the removal commits
            conn.execute(delete(links).where(links.c.run_id == run_id))
            conn.execute(delete(_schema.checkpoints).where(_schema.checkpoints.c.run_id == run_id))
            conn.execute(delete(_schema.blob_refs).where(_schema.blob_refs.c.owner == run_id))
            conn.execute(delete(r).where(r.c.run_id == run_id))
            deleted += 1
        self._heads.pop(run_id, None)
        return archived, deleted

    def _archive(self, run_id: str, path: str) -> None:
        run = self.get_run(run_id)
        try:
            snap: Snapshot | None = self._load(run_id, None, lazy=False)[0]
        except CheckpointNotFound:
            snap = None
        record = {
            "run": {
                "run_id": run.run_id,
                "flow": run.flow,
                "code_version": run.code_version,
                "state_version": run.state_version,
                "status": run.status.value,
                "next_step": run.next_step,
                "handoff": {
                    "goal": run.handoff.goal,
                    "done": list(run.handoff.done),
                    "next": list(run.handoff.next),
                    "ruled_out": list(run.handoff.ruled_out),
                },
                "created_at": run.created_at,
                "updated_at": run.updated_at,
            },
            "state": None if snap is None else json.loads(self.codec.encode(snap.state)),
            "history": [
                {
                    "seq": i.seq,
                    "step": i.step,
                    "source": i.source.value,
                    "schema_version": i.schema_version,
                    "created_at": i.created_at,
                }
                for i in self.history(run_id)
            ],
        }
        line = json.dumps(record, sort_keys=True, ensure_ascii=False)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            import os  # noqa: PLC0415

            os.fsync(fh.fileno())

    @retried("collect unreferenced blobs", idempotent=True)
    def collect_garbage(self) -> int:
        """Delete blobs that no run refers to. Returns how many were deleted."""
        self._check_open()
        b, ref = _schema.blobs, _schema.blob_refs
        with translate("collect unreferenced blobs"), begin(self.engine) as conn:
            if self._dialect == "postgresql":
                # Writers insert blob + reference in one transaction; this lock makes the
                # sweep wait for them, so a blob is never swept between the two.
                conn.execute(text("LOCK TABLE oo_blobs IN SHARE ROW EXCLUSIVE MODE"))
            res = conn.execute(delete(b).where(~exists().where(ref.c.hash == b.c.hash)))
        return int(res.rowcount or 0)

    # -- helpers -----------------------------------------------------------------------
    def _encode_handoff(self, h: Handoff) -> bytes:
        if not isinstance(h, Handoff):
            raise ConfigurationError(f"handoff must be a Handoff, not {type(h).__name__}")
        return self.codec.encode(
            {
                "goal": h.goal,
                "done": list(h.done),
                "next": list(h.next),
                "ruled_out": list(h.ruled_out),
            }
        )

    def _run_from_row(self, row: Mapping[str, Any]) -> Run:
        handoff = Handoff()
        if row["handoff"] is not None:
            try:
                d = self.codec.decode(bytes(row["handoff"]))
                handoff = Handoff(
                    goal=d["goal"],
                    done=tuple(d["done"]),
                    next=tuple(d["next"]),
                    ruled_out=tuple(d["ruled_out"]),
                )
            except (KeyError, TypeError, OnceOnlyError) as exc:
                raise CorruptRecord(
                    "the run's handoff note is unreadable", run_id=row["run_id"]
                ) from exc
        try:
            status = RunStatus(row["status"])
        except ValueError as exc:
            raise CorruptRecord(
                f"unknown run status {row['status']!r}", run_id=row["run_id"]
            ) from exc
        return Run(
            run_id=row["run_id"],
            flow=row["flow"],
            code_version=row["code_version"],
            state_version=int(row["state_version"]),
            status=status,
            next_step=row["next_step"],
            lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"],
            handoff=handoff,
            head_seq=row["head_seq"],
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
            waits_digest=None if row.get("waits_digest") is None else bytes(row["waits_digest"]),
            rev=int(row.get("rev") or 0),
        )


def _copy_ops(ops: Mapping[str, _delta.Op]) -> dict[str, _delta.Op]:
    out: dict[str, _delta.Op] = {}
    for ch, op in ops.items():
        if op[0] == "s":
            out[ch] = ("s", _delta.private_copy(_delta.plain(op[1])))
        elif op[0] == "m":
            out[ch] = ("m", _delta.private_copy(op[1]), list(op[2]))
        elif op[0] == "a":
            out[ch] = ("a", _delta.private_copy(op[1]))
        else:
            out[ch] = op
    return out


def _upgrade(run_id: str, snap: Snapshot, mig: StateMigrations) -> dict[str, Any]:
    version = snap.info.schema_version
    if version > mig.current:
        raise StateVersionError(
            run_id,
            version,
            mig.current,
            f"run {run_id!r} checkpoint {snap.info.seq} has state version {version}, newer "
            f"than this code's {mig.current}; it was written by newer code. Run it with that "
            f"code; nothing was changed.",
        )
    state = snap.state
    while version < mig.current:
        fn = mig.upgrades.get(version)
        if fn is None:
            raise StateVersionError(
                run_id,
                version,
                mig.current,
                f"no upgrade registered from state version {version} to {version + 1}; add "
                f"it to StateMigrations.upgrades. Nothing was changed.",
            )
        state = fn(state)
        if not isinstance(state, dict):
            raise StateVersionError(
                run_id, version, mig.current, f"upgrade from version {version} returned no dict"
            )
        version += 1
    return state


def _check_schema(engine: Engine, *, create: bool) -> None:
    ensure_schema(engine, "checkpoint", _schema.CHECKPOINT_MIGRATIONS, create=create)


def _check_parent(run_id: str, head: _Head | None, parent: int | None) -> None:
    """Refuse a checkpoint built on another head than ``parent`` (-1: no checkpoint yet).

    The head is the store's own (cached, or read under its lock), so a checkpoint written
    through this same Store object since the caller's load is caught here; another
    process's is caught by the commit's compare-and-set.
    """
    if parent is not None and (-1 if head is None else head.seq) != parent:
        raise ConcurrentWrite(run_id, parent)


def ensure_schema(
    engine: Engine, component: str, migrations: Sequence[_schema.Migration], *, create: bool
) -> None:
    """Check a component's schema version; create it in an empty database if asked.

    Raises:
        SchemaVersionError: Older (run ``onceonly migrate``) or newer (upgrade onceonly).
    """
    have = open_checks(engine, component)
    want = migrations[-1].version
    if have == want:
        return
    if have > want:
        raise _schema.newer_schema_error(component, have, want)
    if have == 0 and create:
        with translate("create the schema"):
            _schema.apply_migrations(engine, component, migrations)
        return
    raise _schema.older_schema_error(component, have, want)


def migrate(url_or_engine: str | Engine, *, sql: bool = False) -> str:
    """Bring the checkpoint schema to this release's version (or return the SQL).

    Args:
        url_or_engine: The database.
        sql: Return the SQL that would run instead of running it.

    Returns:
        The SQL (``sql=True``) or a one-line summary of what was applied.

    Raises:
        SchemaVersionError: The database is newer than this release.
        DatabaseUnavailable: The database cannot be reached.
    """
    return migrate_component(url_or_engine, "checkpoint", _schema.CHECKPOINT_MIGRATIONS, sql=sql)


def migrate_component(
    url_or_engine: str | Engine,
    component: str,
    migrations: Sequence[_schema.Migration],
    *,
    sql: bool = False,
    version_table: bool = True,
) -> str:
    """:func:`migrate` for any schema component (upper layers register their own)."""
    engine = (
        make_engine(url_or_engine, busy_timeout_ms=5000)
        if isinstance(url_or_engine, str)
        else url_or_engine
    )
    try:
        if sql:
            with translate("read the schema version"):
                return _schema.pending_sql(
                    engine, component, migrations, version_table=version_table
                )
        with translate("migrate the schema"):
            n = _schema.apply_migrations(engine, component, migrations)
        return (
            f"{component} schema: applied {n} migration(s); now at version {migrations[-1].version}"
        )
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


@dataclass(frozen=True)
class _Row:
    seq: int
    kind: int
    keyframe_seq: int
    step: str
    source: str
    schema_version: int
    created_at: float
    body: bytes
    digest: bytes
    seal: bytes | None = None

    def seal_parts(self, run_id: str) -> list[object]:
        return _ckpt_parts(
            run_id,
            self.seq,
            self.kind,
            self.keyframe_seq,
            self.schema_version,
            self.step,
            self.source,
            self.created_at,
            self.digest,
        )


def _source(value: str, run_id: str, seq: int) -> Source:
    """A stored checkpoint's source; a value no writer produces is a damaged row."""
    try:
        return Source(value)
    except ValueError:
        raise CorruptRecord(
            f"checkpoint {seq} has an unknown source {value!r} (edited)", run_id=run_id, seq=seq
        ) from None


def _check_nothing_above(run_id: str, head: int | None, top: int | None) -> None:
    """Refuse a run whose row is older than its checkpoints: a checkpoint above the
    head is never written without moving the head to it in the same transaction, so
    one there means the run row was put back (an older, genuinely sealed version of
    it: a status, next step and head from before), or the history was cut back.

    Raises:
        CorruptRecord: A checkpoint of the run sits above its head.
    """
    if top is not None and (head is None or int(top) > int(head)):
        raise CorruptRecord(
            f"run {run_id!r} has checkpoint {int(top)} above its head "
            f"{'(none)' if head is None else int(head)}: its row was rolled back to an "
            f"older version (or its history cut back); it is not acted on. Run "
            f"`onceonly audit verify`",
            run_id=run_id,
            seq=int(top),
        )


def _ckpt_parts(
    run_id: str,
    seq: int,
    kind: int,
    keyframe_seq: int,
    schema_version: int,
    step: str,
    source: str,
    created_at: float,
    digest: bytes,
) -> list[object]:
    """What a checkpoint's seal covers: every column but the body, whose digest it holds."""
    return [
        run_id,
        int(seq),
        int(kind),
        int(keyframe_seq),
        int(schema_version),
        step,
        source,
        float(created_at),
        bytes(digest),
    ]


def _run_parts(values: Mapping[str, Any], head_digest: bytes | None) -> list[object]:
    """What a run's seal covers: everything a step or an operator acts on, and the head
    checkpoint's digest (the lease and the timestamps are operational)."""
    handoff = values["handoff"]
    head = values["head_seq"]
    return [
        values["run_id"],
        values["flow"],
        values["code_version"],
        int(values["state_version"]),
        values["status"],
        values["next_step"],
        None if handoff is None else bytes(handoff),
        None if head is None else int(head),
        b"" if head_digest is None else bytes(head_digest),
        # Only once the run has sealed waits (schema 5), so earlier seals still verify;
        # setting it back to NULL changes the parts as much as any other edit.
        *([] if values.get("waits_digest") is None else [bytes(values["waits_digest"])]),
        # The row's revision (schema 5; rows sealed before it have none).
        *([] if values.get("rev") is None else [int(values["rev"])]),
    ]


_RUN_COLS = (
    "run_id",
    "flow",
    "code_version",
    "state_version",
    "status",
    "next_step",
    "lease_owner",
    "lease_expires_at",
    "handoff",
    "head_seq",
    "created_at",
    "updated_at",
    "seal",
    "waits_digest",
    "rev",
)
_CKPT_COLS = "seq, kind, keyframe_seq, step, source, schema_version, created_at, body, digest, seal"


class _SQL:
    """Fixed SQL for the hot paths, in the driver's parameter style."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        q = "?" if dialect == "sqlite" else "%s"
        self.q = q
        self.ins_blob = (
            f"INSERT INTO oo_blobs (hash, size, data) VALUES ({q}, {q}, {q}) ON CONFLICT DO NOTHING"
        )
        self.ins_ref = (
            f"INSERT INTO oo_blob_refs (owner, hash) VALUES ({q}, {q}) ON CONFLICT DO NOTHING"
        )
        self.ins_ckpt = (
            "INSERT INTO oo_checkpoints (run_id, seq, kind, keyframe_seq, step, source, "
            "schema_version, created_at, body, digest, seal) VALUES (" + ", ".join([q] * 11) + ")"
        )
        rcols0 = ", ".join(f"r.{c}" for c in _RUN_COLS)
        # One run row with its head checkpoint's digest (what its seal covers).
        self.run_row = (
            f"SELECT {rcols0}, c.digest FROM oo_runs r LEFT JOIN oo_checkpoints c "
            f"ON c.run_id = r.run_id AND c.seq = r.head_seq WHERE r.run_id = {q}"
        )
        self.runs_rows = (
            f"SELECT {rcols0}, c.digest FROM oo_runs r LEFT JOIN oo_checkpoints c "
            f"ON c.run_id = r.run_id AND c.seq = r.head_seq"
        )
        head = f"(SELECT head_seq FROM oo_runs WHERE run_id = {q})"
        self.head_rows = (
            f"SELECT {_CKPT_COLS} FROM oo_checkpoints WHERE run_id = {q} AND seq >= "
            f"(SELECT keyframe_seq FROM oo_checkpoints WHERE run_id = {q} AND seq = {head}) "
            f"AND seq <= {head} ORDER BY seq"
        )
        self.seq_rows = (
            f"SELECT {_CKPT_COLS} FROM oo_checkpoints WHERE run_id = {q} AND seq >= "
            f"(SELECT keyframe_seq FROM oo_checkpoints WHERE run_id = {q} AND seq = {q}) "
            f"AND seq <= {q} ORDER BY seq"
        )
        self.run_head = f"SELECT head_seq FROM oo_runs WHERE run_id = {q}"
        # The head and the highest checkpoint, in one statement (one snapshot).
        top = f"(SELECT MAX(m.seq) FROM oo_checkpoints m WHERE m.run_id = {q})"
        self.run_head_top = f"SELECT head_seq, {top} FROM oo_runs WHERE run_id = {q}"
        # The run row and its head checkpoint's keyframe + deltas, in one statement (one
        # snapshot even under READ COMMITTED); a run without checkpoints gives one row
        # of NULL checkpoint columns.
        rcols = ", ".join(f"r.{c}" for c in _RUN_COLS)
        ccols = ", ".join(f"c.{c.strip()}" for c in _CKPT_COLS.split(","))
        self.run_and_head = (
            f"SELECT {rcols}, {ccols}, (SELECT MAX(m.seq) FROM oo_checkpoints m WHERE "
            f"m.run_id = r.run_id) FROM oo_runs r LEFT JOIN oo_checkpoints c "
            f"ON c.run_id = r.run_id AND c.seq <= r.head_seq AND c.seq >= "
            f"(SELECT k.keyframe_seq FROM oo_checkpoints k WHERE k.run_id = r.run_id "
            f"AND k.seq = r.head_seq) WHERE r.run_id = {q} ORDER BY c.seq"
        )
        self._advance: dict[tuple[tuple[str, ...], bool, bool], str] = {}
        self._blobs_in: dict[int, str] = {}

    def advance(self, cols: tuple[str, ...], *, first: bool, parent: bool = False) -> str:
        """The run-head compare-and-set: ``head_seq`` must be NULL (``first``) or the
        parent's sequence number, and with ``parent`` the checkpoint there must be the
        exact parent (its digest), so a checkpoint built on one that lost a race to
        another writer at the same sequence number never lands on the winner's."""
        key = (cols, first, parent)
        sql = self._advance.get(key)
        if sql is None:
            q = self.q
            sets = ", ".join(
                [f"head_seq = {q}", f"updated_at = {q}"] + [f"{c} = {q}" for c in cols]
            )
            cond = "head_seq IS NULL" if first else f"head_seq = {q}"
            if parent:
                cond += (
                    f" AND EXISTS (SELECT 1 FROM oo_checkpoints WHERE run_id = {q} "
                    f"AND seq = {q} AND digest = {q})"
                )
            sql = f"UPDATE oo_runs SET {sets} WHERE run_id = {q} AND {cond}"
            self._advance[key] = sql
        return sql

    def blobs_in(self, n: int) -> str:
        sql = self._blobs_in.get(n)
        if sql is None:
            marks = ", ".join([self.q] * n)
            sql = f"SELECT hash, data FROM oo_blobs WHERE hash IN ({marks})"
            self._blobs_in[n] = sql
        return sql


_ENDED = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
_PG_READ = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


class _RawTxn:
    """A transaction on a DBAPI connection pinned to the calling thread (hot paths only).

    Each thread keeps one connection between transactions, so the hot path skips the
    pool's check-out and reset (a nested transaction in the same thread gets a pooled
    one). SQLite writers take the lock up front (``BEGIN IMMEDIATE``) so a transaction
    never fails half-way on a lock upgrade; readers use a deferred ``BEGIN`` for one
    snapshot. A transaction that fails, including at COMMIT, is rolled back; a connection
    that cannot even roll back is discarded. A COMMIT whose answer was lost raises
    ``DatabaseUnavailable`` with ``may_have_committed`` (:func:`_engine.lost_commit`).
    """

    def __init__(self, store: Store, *, write: bool) -> None:
        self._store = store
        self._sqlite = store.dialect == "sqlite"
        self._write = write
        self._conn: Any = None
        self._cur: Any = None
        self._pinned = False

    def __enter__(self) -> Any:
        self._conn, self._pinned = self._store._checkout()
        local = self._store._local
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
                self._cur.execute(_PG_READ)
        except BaseException:
            self._store._discard(self._conn, self._pinned)
            raise
        return self._cur

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
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
                except DRIVER_ERRORS as err:
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
                except DRIVER_ERRORS:
                    healthy = False
            try:
                self._cur.close()
            except DRIVER_ERRORS:
                healthy = False
            if healthy:
                self._store._checkin(conn, self._pinned)
            else:
                self._store._discard(conn, self._pinned)
            local = self._store._local
            revs, local.revs = getattr(local, "revs", None), self._outer_revs
            witness = self._store.witness
            if done and self._write and revs and witness is not None:
                witness.advance_runs(revs)  # committed: witnessed before anyone acts on it
