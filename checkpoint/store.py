"""The checkpoint store: runs, checkpoints (delta + keyframe), blobs, durability modes.

:class:`Store` is the facade; its parts live in private modules, each a layer on the
one below (a part calls only what is beneath it):

==================== ================================================================
``_connections``     shared state, pinned per-thread connections, raw transactions
``_runs``            run rows (seals, witness, waits' digest), leases
``_blobs``           blobs: verified reads, garbage collection
``_writer``          durability modes, group commits, the background writer
``_reads``           loading and verifying checkpoint rows, history
``_writes``          saving on the cached head; loading into it
``_retention``       retention policies
``_audit``           the whole-store integrity audit
``_migrate``         schema versions and state migrations
==================== ================================================================
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict

from sqlalchemy.engine import Engine

from ._audit import _Audit
from ._engine import configure, make_engine
from ._migrate import _check_schema, ensure_schema, migrate, migrate_component
from ._retry import DatabaseRetry
from ._sql import _SQL
from .codec import Codec
from .errors import CheckpointLost, ConfigurationError
from .integrity import RowKeys
from .records import Durability, KeyframePolicy, StateMigrations

__all__ = ["Store", "ensure_schema", "migrate", "migrate_component"]


class Store(_Audit):
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
        self.witness = None
        self._behind = None
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
        self._heads = OrderedDict()
        self._pending = []
        self._queue = queue.Queue()
        self._async_error = None
        self._writer = None
        self._closed = False
        self._heads_stale = False
        # Runs whose queued checkpoint lost a race to another writer (async / exit mode):
        # their cached heads are dropped before the next use. Only that run is affected.
        self._stale_runs = set()
        # Checkpoints this process queued and has not yet written, per run: while a run
        # has some, this process's own view of the run is ahead of the database.
        self._unwritten = {}
        self._queued_mode = {}  # per run with unwritten checkpoints: the mode they wait in
        # Runs whose queued checkpoints were left out, with the head the first one was
        # built on: the next save or load of that run raises CheckpointLost once.
        self._lost = {}
        self._reported = {}  # per run: how many losses were reported
        self._count_lock = threading.Lock()
        self._gen = 0
        self._dead_gen = -1
        self._local = threading.local()
        # Each thread's pinned connection, with the thread it belongs to: a connection of a
        # thread that has exited (a thread pool's, a LangGraph invoke's) goes back.
        self._pinned = []
        self._pin_lock = threading.Lock()
        _check_schema(engine, create=create)
        self._sql = _SQL(self._dialect)
        if witness:
            self.attach_witness(witness)
        if self.durability is Durability.ASYNC:
            self._start_writer()

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
