"""Engine set-up per dialect: SQLite pragmas (read back and enforced), write transactions,
translation of driver errors into onceonly errors at the boundary, and masking of
database passwords in every message made there (:func:`safe_url`, :func:`redact`)."""

from __future__ import annotations

import contextlib
import re
import sys
import urllib.parse
from collections.abc import Iterator
from typing import Any

from sqlalchemy import create_engine, event, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine
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

_MASK = "***"
# ``scheme://user:PASSWORD@``: the password runs to the last ``@`` of the token (one with
# an unescaped ``@`` is masked whole).
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@'\"]*:)(?P<pw>[^\s'\"]*)(?=@)"
)
# libpq key/value connection strings and URI query parameters: ``password=...``.
_CONNINFO_PASSWORD = re.compile(
    r"(?P<head>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|[^\s&'\"]+)", re.IGNORECASE
)


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with database passwords masked (``***``): the password of every URL in it
    (``scheme://user:PASSWORD@host``), every ``password=...`` of a libpq connection
    string, and every occurrence of ``secrets`` (of 4 characters or more; also
    percent-encoded).

    Apply it to anything that may carry a database URL or a driver's message before it
    is shown or logged.
    """
    out = _URL_PASSWORD.sub(lambda m: m["head"] + _MASK, text)
    out = _CONNINFO_PASSWORD.sub(lambda m: m["head"] + _MASK, out)
    for secret in secrets:
        if secret and len(secret) >= 4:
            out = out.replace(secret, _MASK)
            quoted = urllib.parse.quote(secret, safe="")
            if quoted != secret:
                out = out.replace(quoted, _MASK)
    return out


def _split_userinfo(url: str) -> tuple[str, str | None, str]:
    """``(before the password, the password, from the @ on)`` of a URL that SQLAlchemy
    cannot parse (the password None when there is none)."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url, None, ""
    scheme, sep, userinfo = head.partition("://")
    if not sep:
        scheme, userinfo = "", head
    user, colon, password = userinfo.partition(":")
    if not colon:
        return url, None, ""
    return f"{scheme}{sep}{user}:", password, "@" + tail


def url_password(url: str | URL) -> str | None:
    """The password in a database URL or libpq connection string (None when it has
    none), even one SQLAlchemy cannot parse."""
    if isinstance(url, URL):
        return url.password
    if is_conninfo(url):
        try:
            return conninfo_url(url).password
        except ConfigurationError:
            return None  # unparsable: redact() masks its password= by shape
    try:
        return make_url(url).password
    except (sa_exc.ArgumentError, ValueError, TypeError):
        return _split_userinfo(url)[1]


def safe_url(url: str | URL) -> str:
    """``url`` with its password masked (``postgresql+psycopg://user:***@host/db``): the
    form of a database URL for messages and logs. A URL that SQLAlchemy cannot parse is
    masked from its last ``@`` back to the first ``:`` of its user part."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    if is_conninfo(url):
        try:
            return conninfo_url(url).render_as_string(hide_password=True)
        except ConfigurationError:
            return redact(url)
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError, TypeError):
        before, password, after = _split_userinfo(url)
        return redact(url) if password is None else before + _MASK + after
    if parsed.password is None:
        return redact(url)
    return parsed.render_as_string(hide_password=True)


def scrub(exc: BaseException, *secrets: str | None) -> BaseException:
    """Mask database passwords (as :func:`redact`) in the messages of ``exc`` and of
    every exception chained to it (``__cause__``, ``__context__``, a SQLAlchemy
    error's ``orig``), in place; return ``exc``. For errors chained ``from`` a driver
    error, so a traceback shows no password either."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        args = tuple(redact(a, *secrets) if isinstance(a, str) else a for a in e.args)
        if args != e.args:
            e.args = args
        orig = getattr(e, "orig", None)
        todo += [e.__cause__, e.__context__, orig if isinstance(orig, BaseException) else None]
    return exc


def make_engine(url: str, *, busy_timeout_ms: int) -> Engine:
    """Create an engine for ``url`` with onceonly's settings.

    Raises:
        ConfigurationError: The URL is malformed or names a missing driver (its
            password masked in the message).
    """
    if is_conninfo(url):
        return _engine_for(conninfo_url(url), url, busy_timeout_ms=busy_timeout_ms)
    for scheme in ("postgresql://", "postgres://"):  # libpq's URI schemes
        if url.startswith(scheme):
            url = "postgresql+psycopg://" + url[len(scheme) :]
    return _engine_for(_plain_sqlite(url) or url, url, busy_timeout_ms=busy_timeout_ms)


def _engine_for(target: str | URL, url: str, *, busy_timeout_ms: int) -> Engine:
    """:func:`make_engine`'s engine for ``target`` (``url`` as given: for messages)."""
    if url.startswith("sqlite") and (
        ":memory:" in url or url.rstrip("/") in ("sqlite:", "sqlite:/")
    ):
        raise ConfigurationError(
            "an in-memory SQLite database cannot be durable; use a file, e.g. sqlite:///onceonly.db"
        )
    kwargs: dict[str, Any] = {}
    scheme = target.drivername if isinstance(target, URL) else target
    if scheme.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": busy_timeout_ms / 1000.0}
    elif scheme.startswith("postgresql"):
        kwargs["pool_pre_ping"] = False
        if "psycopg" in scheme and "psycopg2" not in scheme:
            # No store column is hstore: skip the type lookup the dialect otherwise runs
            # on its first connection (a round trip of every fresh process's open).
            kwargs["use_native_hstore"] = False
    try:
        engine = create_engine(target, **kwargs)
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ValueError, ImportError) as exc:
        password = url_password(url)
        raise ConfigurationError(
            f"cannot use database URL {safe_url(url)!r}: {redact(str(exc), password)}. "
            f"onceonly supports sqlite:///PATH and postgresql+psycopg://... (install the "
            f"postgres extra: pip install 'onceonly[postgres]')"
        ) from scrub(exc, password)
    configure(engine, busy_timeout_ms=busy_timeout_ms)
    return engine


def is_conninfo(url: str) -> bool:
    """Whether ``url`` is a libpq key/value connection string (``host=... dbname=...``)
    rather than a URL."""
    return "://" not in url and "=" in url


def conninfo_url(conninfo: str) -> URL:
    """A libpq key/value connection string (``host=/run/pg dbname=app user=me``) as the
    PostgreSQL URL it means (a socket directory or an option other than user, password,
    host, port and dbname goes into the query, as psycopg reads it).

    Raises:
        ConfigurationError: It cannot be parsed, or the postgres extra is missing (the
            string is not repeated: it may hold a password).
    """
    try:
        from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415  (postgres extra)
    except ImportError as exc:
        raise ConfigurationError(
            "a libpq connection string needs the postgres extra: pip install 'onceonly[postgres]'"
        ) from exc
    try:
        parts = {k: str(v) for k, v in conninfo_to_dict(conninfo).items()}
    except Exception as exc:  # noqa: BLE001 - psycopg's parse errors quote the string
        raise ConfigurationError(
            "cannot parse the libpq connection string (not shown: it may hold a "
            f"password): {type(exc).__name__}; the form is 'host=H port=P dbname=D user=U'"
        ) from None
    host = parts.pop("host", None)
    port = parts.pop("port", None)
    if host is not None and (host.startswith("/") or "," in host):
        parts["host"] = host  # a socket directory, or several hosts: as psycopg reads it
        host = None
    try:
        number = int(port) if port is not None and host is not None else None
    except ValueError:
        raise ConfigurationError(
            f"the libpq connection string's port is not a number: {port!r}"
        ) from None
    if port is not None and number is None:
        parts["port"] = port
    return URL.create(
        "postgresql+psycopg",
        username=parts.pop("user", None),
        password=parts.pop("password", None),
        host=host,
        port=number,
        database=parts.pop("dbname", None),
        query=parts,
    )


def _plain_sqlite(url: str) -> URL | None:
    """``sqlite:///PATH`` (no query, no escapes) as a URL object, parsed without
    SQLAlchemy's URL pattern (compiling it is a third of a fresh process's open); None
    for anything else, which ``create_engine`` parses itself. The result equals
    ``make_url(url)`` (tested)."""
    if not url.startswith("sqlite:///") or any(c in url for c in "?#%@"):
        return None
    return URL.create("sqlite", database=url[len("sqlite:///") :])


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
    elif engine.dialect.name == "postgresql":
        _with_psycopg()

        @event.listens_for(engine, "begin")
        def _on_pg_begin(conn: Connection) -> None:
            # A reader sees one snapshot, as on SQLite (READ COMMITTED would give each
            # statement its own).
            if conn.get_execution_options().get(READ_ONLY):
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")

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
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None:
        errors.append(psycopg.Error)
    return tuple(errors)


# The raw driver errors the hot paths catch: sqlite3's, and psycopg's once a PostgreSQL
# engine is configured (psycopg is imported only for PostgreSQL). Read it as
# ``_engine.DRIVER_ERRORS`` at the point of use, never copied by an import.
DRIVER_ERRORS: tuple[type[BaseException], ...] = _driver_errors()


def _with_psycopg() -> None:
    global DRIVER_ERRORS  # noqa: PLW0603 - grows once, when PostgreSQL is first used
    import psycopg  # noqa: PLC0415

    if psycopg.Error not in DRIVER_ERRORS:
        DRIVER_ERRORS = (*DRIVER_ERRORS, psycopg.Error)


def pg_repeatable_read() -> Any:
    """psycopg's REPEATABLE READ isolation level (imported only where PostgreSQL is used)."""
    import psycopg  # noqa: PLC0415

    return psycopg.IsolationLevel.REPEATABLE_READ


@contextlib.contextmanager
def translate(action: str) -> Iterator[None]:
    """Translate driver errors raised inside the block into onceonly errors.

    Both SQLAlchemy-wrapped errors and raw DBAPI errors (from the hot paths, which use
    the pooled DBAPI connection directly) are translated.
    """
    try:
        yield
    except sa_exc.DBAPIError as exc:
        raise classify(exc, action) from scrub(exc)
    except DRIVER_ERRORS as exc:
        raise classify(exc, action) from scrub(exc)


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
    # Drivers' messages span lines (ours are one line), and libpq's may echo a connection
    # string: its password is masked.
    orig = redact(" ".join(str(raw).split()))
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
    orig = redact(" ".join(str(raw).split()))
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
