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


def classify(exc: BaseException, action: str) -> StoreError:
    """Map a driver error to the onceonly error that says what to do."""
    raw = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    orig = " ".join(str(raw).split())  # drivers' messages span lines; ours are one line
    text = orig.lower()
    if "database is locked" in text or "database table is locked" in text:
        return DatabaseLocked(
            f"could not {action}: the SQLite database stayed locked by another writer "
            f"longer than busy_timeout; nothing was written. Retry, raise busy_timeout_ms, "
            f"or move many concurrent workers to PostgreSQL."
        )
    invalidated = isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    if (
        invalidated
        or isinstance(exc, sa_exc.InterfaceError)
        or type(raw).__name__ == "InterfaceError"
        or any(
            s in text
            for s in (
                "unable to open database",
                "connection refused",
                "could not connect",
                "connection failed",
                "no such file or directory",
                "server closed the connection",
                "terminating connection",
                "the connection is closed",
                "connection is lost",
            )
        )
    ):
        return DatabaseUnavailable(
            f"could not {action}: the database is unreachable ({orig}); nothing was "
            f"written. Check that the server is running and the URL is right, then retry."
        )
    if "disk i/o error" in text or "disk is full" in text or "readonly" in text:
        return StoreError(
            f"could not {action}: the database reported an I/O error ({orig}); the "
            f"transaction was rolled back. Stop, fix the disk, and restart: the store "
            f"recovers from what was committed."
        )
    return StoreError(f"could not {action}: {orig}")
