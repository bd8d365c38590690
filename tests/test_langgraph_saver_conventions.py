"""LangGraph's saver conventions (issue [13]): ``async with`` and ``with`` over
``from_url`` / ``from_conn_string``, ``setup()``/``asetup()``, and libpq connection
strings (key/value and ``postgres://``), with a real graph on each backend."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langgraph.types import Command
from sqlalchemy import make_url

from onceonly.adapters.langgraph_saver import OnceOnlySaver
from onceonly.checkpoint import ConfigurationError, Store
from onceonly.checkpoint._engine import conninfo_url, redact, safe_url, url_password
from tests.langgraph_saver_graph import START_INPUT, build, config
from tests.ledger_support import keyring


def _conninfo(url: str) -> str:
    """The libpq key/value form of a test database URL."""
    u = make_url(url)
    parts = {"dbname": u.database, "user": u.username, "password": u.password}
    parts["host"] = u.query.get("host") or u.host  # type: ignore[assignment]
    if u.port:
        parts["port"] = str(u.port)
    return " ".join(f"{k}={v}" for k, v in parts.items() if v)


def test_async_with_from_url_runs_a_graph_and_setup_is_idempotent(db_url: str) -> None:
    async def go() -> dict[str, Any]:
        async with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
            await saver.asetup()
            await saver.asetup()
            graph = build(saver)
            await graph.ainvoke(START_INPUT, config("conv"))
            return dict(await graph.ainvoke(Command(resume="ok"), config("conv")))

    out = asyncio.run(go())
    assert out["trail"] == ["draft", "review:ok", "publish"]
    # closed on the way out, and what it saved is there for the next process
    with OnceOnlySaver.from_conn_string(db_url, keyring=keyring()) as again:
        again.setup()
        state = build(again).get_state(config("conv"))
        assert state.values["trail"] == ["draft", "review:ok", "publish"]


def test_a_libpq_connection_string_opens_the_same_database(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("libpq connection strings name PostgreSQL databases")
    dsn = _conninfo(db_url)
    assert "://" not in dsn
    with OnceOnlySaver.from_conn_string(dsn, keyring=keyring()) as saver:
        graph = build(saver)
        graph.invoke(START_INPUT, config("libpq"))
    uri = db_url.replace("postgresql+psycopg://", "postgres://", 1)
    with OnceOnlySaver.from_url(uri, keyring=keyring()) as saver:
        assert build(saver).get_state(config("libpq")).next == ("review",)
    with Store.open(dsn) as store:
        assert store.dialect == "postgresql"


def test_a_libpq_string_becomes_the_url_it_means_and_its_password_is_masked() -> None:
    url = conninfo_url("host=db.internal port=6432 dbname=app user=me password=s3cret-pw")
    assert url == make_url("postgresql+psycopg://me:s3cret-pw@db.internal:6432/app")
    sock = conninfo_url("host=/run/postgresql dbname=app user=me sslmode=disable")
    assert sock.host is None
    assert dict(sock.query) == {"host": "/run/postgresql", "sslmode": "disable"}
    dsn = "host=db dbname=app user=me password=s3cret-pw"
    assert url_password(dsn) == "s3cret-pw"
    assert "s3cret-pw" not in safe_url(dsn)
    assert "s3cret-pw" not in redact(f"failed: {dsn}", url_password(dsn))


def test_a_malformed_libpq_string_is_refused_without_repeating_it() -> None:
    bad = "host=db password='s3cret-pw dbname=app"  # an unclosed quote
    with pytest.raises(ConfigurationError) as caught:
        Store.open(bad)
    assert "s3cret-pw" not in str(caught.value)
    assert "libpq connection string" in str(caught.value)
