"""Shared fixtures: every store test runs on SQLite and on PostgreSQL.

PostgreSQL comes from ``ONCEONLY_TEST_PG_URL`` (``.ci/run`` starts one) or, when unset,
from a throwaway cluster this session starts and stops. It is never skipped silently:
set ``ONCEONLY_TEST_NO_PG=1`` to run the SQLite half alone, and the run says so.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import create_engine, text

from onceonly.checkpoint import Store

from . import pgserver
from .ledger_support import Clock, Ledgers

BACKENDS = ["sqlite"] if os.environ.get("ONCEONLY_TEST_NO_PG") == "1" else ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    url = os.environ.get("ONCEONLY_TEST_PG_URL")
    if url:
        yield url
        return
    base = Path(tempfile.mkdtemp(prefix="onceonly-pg-"))
    url = pgserver.start(base)
    try:
        yield url
    finally:
        pgserver.stop(base)
        shutil.rmtree(base, ignore_errors=True)


def _fresh_pg_database(server_url: str) -> tuple[str, Callable[[], None]]:
    name = "t_" + uuid.uuid4().hex[:16]
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    base, _, query = server_url.partition("?")
    url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")

    def drop() -> None:
        eng = create_engine(server_url, isolation_level="AUTOCOMMIT")
        with eng.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        eng.dispose()

    return url, drop


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database URL on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'onceonly.db'}"
        return
    server = request.getfixturevalue("pg_server_url")
    url, drop = _fresh_pg_database(server)
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A sync-durability store on a fresh database, closed after the test."""
    s = Store.open(db_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def clock() -> Clock:
    """A settable clock for leases and windows."""
    return Clock()


@pytest.fixture
def ledgers(db_url: str, clock: Clock) -> Iterator[Ledgers]:
    """Factory of ledgers (each an "other process" view) on the test database."""
    lg = Ledgers(db_url, clock)
    try:
        yield lg
    finally:
        lg.close()


_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="session", autouse=True)
def _tracing() -> None:
    """One SDK tracer provider for the session (OpenTelemetry allows setting it once)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)


@pytest.fixture(scope="module", autouse=True)
def _no_event_loop_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that leaves an event loop running in the main thread (a session-wide
    Playwright sync API did) makes every later ``asyncio.run`` fail, far from the cause:
    name the module that did it instead."""
    yield
    if asyncio.events._get_running_loop() is not None:
        pytest.fail(f"{request.module.__name__} left an event loop running in the main thread")


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """The finished spans of this test (the exporter is cleared first)."""
    _EXPORTER.clear()
    return _EXPORTER
