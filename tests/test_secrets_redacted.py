"""No database password and no keyring secret in any message (issue [8] item 9).

Every path that formats a database URL or a driver's message is exercised with a URL
carrying the password ``s3cr3t``: a server that refuses the connection (a closed port),
a missing driver, URLs SQLAlchemy cannot parse, driver messages that echo the
connection string (libpq does, for a URL it cannot parse), the store's retry log, the
worker's log lines and its ``LISTEN`` connection, and the command line (stdout, stderr,
``--json``). The password must appear in no exception message, no message of any
exception chained to it, no traceback, no log record, no output.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, make_url, text

from onceonly.adapters.langgraph_saver import OnceOnlySaver
from onceonly.checkpoint import (
    ConfigurationError,
    DatabaseRetry,
    DatabaseUnavailable,
    OnceOnlyError,
    Store,
    StoreError,
    migrate,
    redact,
    safe_url,
)
from onceonly.checkpoint._engine import translate
from onceonly.ledger import migrate as ledger_migrate
from onceonly.worker import _describe, _Listener

ROOT = Path(__file__).resolve().parent.parent
ONCEONLY = Path(sys.executable).parent / "onceonly"
PASSWORD = "s3cr3t"  # noqa: S105  (the needle the tests look for)
SECRET_HEX = "5e" * 32

CLOSED_PORT = f"postgresql+psycopg://u:{PASSWORD}@127.0.0.1:1/db"
NO_DRIVER = f"postgresql+nosuchdriver://u:{PASSWORD}@h/db"
BAD_PORT = f"postgresql+psycopg://u:{PASSWORD}@h:notaport/db"
NO_SCHEME_SEP = f"postgresql+psycopg//u:{PASSWORD}@h/db"
UNKNOWN_DIALECT = f"nosuchdb://u:{PASSWORD}@h/db"
URLS = [CLOSED_PORT, NO_DRIVER, BAD_PORT, NO_SCHEME_SEP, UNKNOWN_DIALECT]


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception chained to it (causes, contexts, SQLAlchemy's orig)."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is o for o in out):
            continue
        out.append(e)
        orig = getattr(e, "orig", None)
        todo += [e.__cause__, e.__context__, orig if isinstance(orig, BaseException) else None]
    return out


def _assert_clean(exc: BaseException, logs: str = "", *secrets: str) -> None:
    for needle in (PASSWORD, *secrets):
        for e in _chain(exc):
            assert needle not in str(e), (type(e).__name__, str(e))
            assert needle not in repr(e.args), (type(e).__name__, e.args)
        assert needle not in "".join(traceback.format_exception(exc))
        assert needle not in logs


# -- the library: opening a store, a saver; driver messages; the retry log -----------------


@pytest.mark.parametrize("url", URLS)
def test_opening_a_store_never_shows_the_password(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(OnceOnlyError) as err:
        Store.open(url, retry=DatabaseRetry(budget_s=0.3, initial_s=0.01, max_s=0.05))
    assert isinstance(err.value, ConfigurationError | DatabaseUnavailable)
    assert "u:***@" in str(err.value) or isinstance(err.value, DatabaseUnavailable)
    _assert_clean(err.value, caplog.text)
    with pytest.raises(OnceOnlyError) as again:
        OnceOnlySaver.from_url(url, unkeyed=True)
    _assert_clean(again.value, caplog.text)
    with pytest.raises(OnceOnlyError) as migrating:
        migrate(url)
    _assert_clean(migrating.value, caplog.text)


@pytest.mark.parametrize(
    "dsn",
    [
        # libpq echoes a URI it cannot parse in its message.
        f"postgresql://u:{PASSWORD}@[::1/db",
        f"postgresql://u:{PASSWORD}@127.0.0.1:1:2/db",
        f"host=127.0.0.1 port=1 user=u password={PASSWORD} sslmode=bogus",
        f"host=127.0.0.1 port=1 user=u password='{PASSWORD}' sslmode=bogus",
    ],
)
def test_a_driver_message_that_echoes_the_dsn_is_masked(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreError) as err, translate("open the store"):
        psycopg.connect(dsn, connect_timeout=5)
    _assert_clean(err.value)
    # The worker's log line of a driver error, given the same.
    with pytest.raises(psycopg.Error) as raw:
        psycopg.connect(dsn, connect_timeout=5)
    assert PASSWORD not in _describe(raw.value)
    # The retry log of a transient failure whose driver message carries the URL.
    attempts = 0

    def refused() -> None:
        nonlocal attempts
        attempts += 1
        with translate("take a lease"):
            raise psycopg.OperationalError(f"could not connect to server: {dsn}")

    policy = DatabaseRetry(budget_s=0.2, initial_s=0.01, max_s=0.02, jitter_s=0)
    with pytest.raises(DatabaseUnavailable) as retried:
        policy.call("take a lease", refused, idempotent=True)
    assert attempts > 1
    assert "retrying" in caplog.text
    _assert_clean(retried.value, caplog.text)


def test_redact_and_safe_url() -> None:
    assert safe_url(CLOSED_PORT) == "postgresql+psycopg://u:***@127.0.0.1:1/db"
    assert safe_url(BAD_PORT) == "postgresql+psycopg://u:***@h:notaport/db"
    assert safe_url(f"u:{PASSWORD}@h/db") == "u:***@h/db"
    assert safe_url(make_url(CLOSED_PORT)) == "postgresql+psycopg://u:***@127.0.0.1:1/db"
    assert safe_url("sqlite:////tmp/a@b/x.db") == "sqlite:////tmp/a@b/x.db"
    assert (
        safe_url("postgresql+psycopg:///db?host=/tmp/s") == "postgresql+psycopg:///db?host=/tmp/s"
    )
    text_ = f'bad URI "postgresql://u:{PASSWORD}@[::1/db" and password={PASSWORD} here'
    assert PASSWORD not in redact(text_)
    assert redact(f"token {PASSWORD!r}", PASSWORD) == "token '***'"
    assert redact("p%40ss%2F", "p@ss/") == "***"  # percent-encoded too


# -- the worker: its LISTEN connection and its log lines -----------------------------------


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database, its URL carrying a password (the test
    server trusts local connections, so any password is accepted)."""
    if os.environ.get("ONCEONLY_TEST_NO_PG") == "1":
        pytest.skip("ONCEONLY_TEST_NO_PG=1: the PostgreSQL LISTEN test does not run")
    server: str = request.getfixturevalue("pg_server_url")
    name = "r_" + uuid.uuid4().hex[:16]
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server).set(database=name, password=PASSWORD)
    rendered = url.render_as_string(hide_password=False)
    migrate(rendered)
    ledger_migrate(rendered)
    try:
        yield rendered
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_the_listen_connection_never_logs_the_password(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    db = make_url(pg_url).database
    with Store.open(pg_url) as store:
        listener = _Listener(store, threading.Event())
        try:
            assert listener._conn is not None  # connected from keywords, not a URL string
            # Its connection is terminated (a server restart would do the same): the
            # failure is logged, and it opens again.
            admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                        "datname = :d AND query LIKE 'LISTEN%'"
                    ),
                    {"d": db},
                )
            admin.dispose()
            listener.wait(0.5)
            listener.wait(0.1)
        finally:
            listener.close()
    assert "the LISTEN connection failed" in caplog.text
    assert "listening for ready runs again" in caplog.text
    assert PASSWORD not in caplog.text


# -- the command line ----------------------------------------------------------------------


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("ONCEONLY_DATABASE_URL", None)
    full.update(env)
    return subprocess.run(
        [str(ONCEONLY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=full,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["runs", "list"],
        ["runs", "list", "--json"],
        ["effects", "list", "--json"],
        ["runs", "show", "r-1", "--json"],
        ["migrate", "--langgraph"],
        ["worker", "--flows", "tests.worker_flows:FLOWS", "--until-idle"],
    ],
    ids=" ".join,
)
def test_the_cli_never_prints_the_password_or_a_secret(args: list[str]) -> None:
    secrets = {"ONCEONLY_SECRETS": f"k1:{SECRET_HEX}"}
    for url in (CLOSED_PORT, NO_DRIVER):
        proc = _cli(*args, "--url", url, **secrets)
        assert proc.returncode == 1, proc.stderr
        assert "error:" in proc.stderr
        for needle in (PASSWORD, SECRET_HEX):
            assert needle not in proc.stdout + proc.stderr
    # The URL from the environment.
    proc = _cli(*args, ONCEONLY_DATABASE_URL=BAD_PORT, **secrets)
    assert proc.returncode == 1, proc.stderr
    assert "u:***@h:notaport" in proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr


@pytest.mark.parametrize("secrets", ["k1" + SECRET_HEX, f"k1:{SECRET_HEX[:-1]}zz", "k1:"])
def test_a_malformed_keyring_is_reported_without_its_secret(secrets: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    proc = _cli(
        "worker",
        "--url",
        url,
        "--flows",
        "tests.worker_flows:FLOWS",
        "--until-idle",
        ONCEONLY_SECRETS=secrets,
    )
    assert proc.returncode == 1, proc.stderr
    assert "ONCEONLY_SECRETS" in proc.stderr or "secret" in proc.stderr
    assert SECRET_HEX[:-1] not in proc.stdout + proc.stderr
