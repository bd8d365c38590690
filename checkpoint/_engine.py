"""Engine set-up per dialect: SQLite pragmas (read back and enforced), write transactions,
and translation of driver errors into onceonly errors at the boundary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from .errors import (
    ConfigurationError,
    DatabaseLocked,
    DatabaseUnavailable,
    StoreError,
    WeakDurabilityError,
)

READ_ONLY = "onceonly_read_only"
_CONFIGURED = "_onceonly_configured"


def make_engine(url: str, *, busy_timeout_ms: int) -> Engine:
    """Create an engine for ``url`` with onceonly's settings."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("sqlite") and (
        ":memory:" in url or url.rstrip("/") in ("sqlite:", "sqlite:/")
    ):
        raise ConfigurationError(
            "an in-memory SQLite database cannot be durable; use a file, e.g. sqlite:///onceonly.db"
        )
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": busy_timeout_ms / 1000.0}
    elif url.startswith("postgresql"):
        kwargs["pool_pre_ping"] = False
    try:
        engine = create_engine(url, **kwargs)
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ValueError, ImportError) as exc:
        raise ConfigurationError(
            f"cannot use database URL {url!r}: {exc}. onceonly supports sqlite:///PATH and "
            f"postgresql+psycopg://... (install the postgres extra: pip install "
            f"'onceonly[postgres]')"
        ) from exc
    configure(engine, busy_timeout_ms=busy_timeout_ms)
    return engine


def configure(engine: Engine, *, busy_timeout_ms: int) -> None:
    """Install onceonly's connection hooks on ``engine`` (idempotent)."""
    if getattr(engine, _CONFIGURED, False):
        return
    if engine.dialect.name == "sqlite":
        if engine.url.database in (None, "", ":memory:"):
            raise ConfigurationError(
                "an in-memory SQLite database cannot be durable; use a file, e.g. "
                "sqlite:///onceonly.db"
            )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Take transaction control from the driver so BEGIN IMMEDIATE is ours.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            _switch_to_wal(cur, busy_timeout_ms)
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            if conn.get_execution_options().get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
            else:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

        if not isinstance(engine.pool, NullPool):
            engine.dispose()  # connections made before the hooks lack the pragmas
    setattr(engine, _CONFIGURED, True)


def _switch_to_wal(cur: Any, busy_timeout_ms: int) -> None:
    """Set WAL mode, waiting like busy_timeout would.

    Switching a fresh database to WAL needs an exclusive lock, and SQLite answers "database
    is locked" at once (without its busy handler) when several processes open the same new
    file together; retry for up to busy_timeout.
    """
    import sqlite3  # noqa: PLC0415
    import time  # noqa: PLC0415

    deadline = time.monotonic() + busy_timeout_ms / 1000.0
    pause = 0.002
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def open_checks(engine: Engine, component: str) -> int:
    """Read the SQLite settings back (refusing anything weaker than required) and the
    schema version of ``component`` (0 when absent), on one raw connection.

    Raises:
        WeakDurabilityError: journal mode is not WAL, or synchronous is below FULL, or
            busy_timeout is 0.
    """
    with translate("open the store"):
        conn = engine.raw_connection()
        try:
            cur = conn.cursor()
            if engine.dialect.name == "sqlite":
                journal = str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower()
                sync = int(cur.execute("PRAGMA synchronous").fetchone()[0] or 0)
                busy = int(cur.execute("PRAGMA busy_timeout").fetchone()[0] or 0)
                if journal != "wal":
                    raise WeakDurabilityError("journal_mode", journal, "wal")
                if sync < 2:  # 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA
                    raise WeakDurabilityError("synchronous", sync, "FULL (2)")
                if busy <= 0:
                    raise WeakDurabilityError("busy_timeout", busy, "> 0 ms")
                cur.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'onceonly_schema'"
                )
                exists = cur.fetchone() is not None
                mark = "?"
            else:
                cur.execute("SELECT to_regclass('onceonly_schema') IS NOT NULL")
                found = cur.fetchone()
                exists = bool(found and found[0])
                mark = "%s"
            version = 0
            if exists:
                cur.execute(
                    f"SELECT version FROM onceonly_schema WHERE component = {mark}",
                    (component,),
                )
                row = cur.fetchone()
                version = 0 if row is None else int(row[0])
            cur.close()
            conn.rollback()
        finally:
            conn.close()
    return version


def _driver_errors() -> tuple[type[BaseException], ...]:
    import sqlite3  # noqa: PLC0415

    errors: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg  # noqa: PLC0415
    except ImportError:  # the postgres extra is optional
        pass
    else:
        errors.append(psycopg.Error)
    return tuple(errors)


DRIVER_ERRORS: tuple[type[BaseException], ...] = _driver_errors()


@contextlib.contextmanager
def translate(action: str) -> Iterator[None]:
    """Translate driver errors raised inside the block into onceonly errors.

    Both SQLAlchemy-wrapped errors and raw DBAPI errors (from the hot paths, which use
    the pooled DBAPI connection directly) are translated.
    """
    try:
        yield
    except sa_exc.DBAPIError as exc:
        raise classify(exc, action) from exc
    except DRIVER_ERRORS as exc:
        raise classify(exc, action) from exc


def is_integrity_error(exc: BaseException) -> bool:
    """Whether a (raw or wrapped) driver error is a constraint violation."""
    if isinstance(exc, sa_exc.IntegrityError):
        return True
    return type(exc).__name__ in ("IntegrityError", "UniqueViolation")


# PostgreSQL SQLSTATEs of failures that pass: the connection went away or was refused
# (class 08, an administrator or crash shutdown, a server starting up, too many
# connections), or a concurrent transaction won (serialization failure, deadlock).
_PG_GONE = ("57P01", "57P02", "57P03", "53300")
_PG_CONFLICT = ("40001", "40P01")
# Driver messages of a connection refused or lost (psycopg raises many of these without a
# SQLSTATE, from libpq).
_GONE_TEXT = (
    "connection refused",
    "could not connect",
    "connection failed",
    "no such file or directory",
    "server closed the connection",
    "terminating connection",
    "the connection is closed",
    "connection is lost",
    "consuming input failed",
    "could not receive data from server",
    "could not send data to server",
    "connection reset",
    "broken pipe",
    "connection timed out",
    "ssl syscall error",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "is not currently accepting connections",
    "too many clients",
    "remaining connection slots are reserved",
)
_IO_TEXT = (
    "disk i/o error",
    "i/o error",
    "input/output error",
    "disk is full",
    "database or disk is full",
    "no space left on device",
    "readonly",
    "read-only",
    "could not fsync",
    "could not write",
)


def classify(exc: BaseException, action: str) -> StoreError:
    """Map a driver error to the onceonly error that says what to do.

    The error's ``transient`` flag says whether the failure passes by itself (see
    :mod:`checkpoint._retry` for the rules the store retries by).
    """
    raw = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    orig = " ".join(str(raw).split())  # drivers' messages span lines; ours are one line
    text = orig.lower()
    sqlstate = str(getattr(raw, "sqlstate", None) or "")
    # A failing disk first: its messages may also mention files or connections.
    if any(s in text for s in _IO_TEXT) and sqlstate[:2] != "08":
        return StoreError(
            f"could not {action}: the database reported an I/O error ({orig}); the "
            f"transaction was rolled back. Stop, fix the disk, and restart: the store "
            f"recovers from what was committed."
        )
    if (
        "database is locked" in text
        or "database table is locked" in text
        or sqlstate == "55P03"  # lock_not_available
    ):
        return DatabaseLocked(
            f"could not {action}: the database stayed locked by another writer "
            f"longer than busy_timeout; nothing was written. Retry, raise busy_timeout_ms, "
            f"or move many concurrent workers to PostgreSQL.",
            transient=True,
        )
    if sqlstate in _PG_CONFLICT:
        return StoreError(
            f"could not {action}: a concurrent transaction conflicted with it ({orig}); "
            f"nothing was written. Retry.",
            transient=True,
        )
    if "unable to open database" in text:
        # SQLite: the file or its directory cannot be opened (a wrong path, permissions,
        # no file descriptors left): not something that passes by waiting.
        return DatabaseUnavailable(
            f"could not {action}: the SQLite database file cannot be opened ({orig}); "
            f"nothing was written. Check the path and its permissions."
        )
    invalidated = isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    if (
        invalidated
        or isinstance(exc, sa_exc.InterfaceError)
        or type(raw).__name__ == "InterfaceError"
        or sqlstate[:2] == "08"
        or sqlstate in _PG_GONE
        # libpq reports a refused or broken connection without a SQLSTATE; a server's
        # answer with one (a missing file on the server, say) is not a lost connection.
        or (not sqlstate and any(s in text for s in _GONE_TEXT))
    ):
        return DatabaseUnavailable(
            f"could not {action}: the database is unreachable ({orig}); nothing was "
            f"written. Check that the server is running and the URL is right, then retry.",
            transient=True,
        )
    return StoreError(f"could not {action}: {orig}")


def lost_commit(exc: BaseException) -> StoreError | None:
    """The error for a failure of COMMIT itself when its outcome is unknown.

    A connection lost while COMMIT was on its way may have been committed by the server
    before it went: that is a :class:`DatabaseUnavailable` with ``may_have_committed``,
    which the store never runs again unless the transaction is idempotent. Returns None
    when the database answered the COMMIT with a refusal (SQLite busy, a serialization
    failure, a constraint, an I/O error): the transaction was rolled back, and the error
    is classified as any other.
    """
    err = classify(exc, "commit a transaction")
    if not (isinstance(err, DatabaseUnavailable) and err.transient):
        return None
    raw = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    orig = " ".join(str(raw).split())
    return DatabaseUnavailable(
        f"the connection to the database was lost while committing a transaction "
        f"({orig}): it may or may not have been written, and it was not run again. Read "
        f"back what it wrote before doing it again.",
        transient=True,
        may_have_committed=True,
    )


@contextlib.contextmanager
def begin(engine: Engine) -> Iterator[Connection]:
    """``engine.begin()``, except that a COMMIT whose answer was lost raises
    :func:`lost_commit`'s error (the connection is discarded with it)."""
    with engine.connect() as conn:
        txn = conn.begin()
        try:
            yield conn
        except BaseException:
            with contextlib.suppress(sa_exc.DBAPIError):  # a lost connection cannot roll back
                txn.rollback()
            raise
        try:
            txn.commit()
        except sa_exc.DBAPIError as exc:
            lost = lost_commit(exc)
            if lost is None:
                raise
            raise lost from exc
