"""The record adapter against real databases: the user's table is the oracle.

The user's table lives in its own PostgreSQL database (and, for the portable cases, in a
SQLite file), apart from the ledger, which runs on both backends. Faults are produced
the way production meets them: a refused connection (the database refuses
connections), a ``statement_timeout`` and a ``pg_terminate_backend`` during a slow
insert (a trigger that ``pg_sleep``s), and a commit whose answer is lost (a socket proxy
that forwards ``COMMIT`` to the server, then drops the connection instead of the
answer). A sequence bumped by a ``BEFORE INSERT`` trigger counts every insert that
reached the table, committed or not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import (
    CheckConstraint,
    Column,
    Integer,
    MetaData,
    Numeric,
    String,
    Table,
    create_engine,
    make_url,
)
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from onceonly.adapters import RetryPolicy, step
from onceonly.adapters.record import (
    GuardedTable,
    RecordNotSent,
    RecordRejected,
    ReferenceReuseError,
)
from onceonly.checkpoint import ConfigurationError, Store
from onceonly.ledger import EffectFailed, EffectInDoubt, EffectStatus, KeyReuseError, Ledger
from tests.dbutil import execute, fetch
from tests.ledger_support import Clock, Ledgers

NO_PG = os.environ.get("ONCEONLY_TEST_NO_PG") == "1"
RETRY = RetryPolicy(max_attempts=3, initial_s=0.0)
INVOICE = {"vendor": "V-000173", "amount": Decimal("120.00"), "number": "INV-1"}


# -- the user's database --------------------------------------------------------------


@pytest.fixture(scope="module")
def user_pg(pg_server_url: str) -> Iterator[str]:
    """The user's own PostgreSQL database (one per module; a table per test)."""
    if NO_PG:
        pytest.skip("ONCEONLY_TEST_NO_PG=1: the PostgreSQL user-table tests do not run")
    name = "user_" + uuid.uuid4().hex[:12]
    admin = create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    execute(admin, f"CREATE DATABASE {name}")
    base, _, query = pg_server_url.partition("?")
    try:
        yield base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
    finally:
        execute(admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


def invoices(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("client_reference", String(64), nullable=False, unique=True),
        Column("vendor", String(16), nullable=False),
        Column("amount", Numeric(10, 2), CheckConstraint("amount > 0"), nullable=False),
        Column("number", String(16), nullable=False, unique=True),
    )


class UserTable:
    """A fresh table in the user's database; ``tries`` counts inserts that reached it."""

    def __init__(self, url: str, slow: tuple[int, ...] = (), sleep_s: float = 0.0, **kw: Any):
        self.url = url
        self.engine = create_engine(url, poolclass=NullPool, **kw)
        self.table = invoices("inv_" + uuid.uuid4().hex[:10])
        self.table.create(self.engine)
        if self.engine.dialect.name == "postgresql":
            t = self.table.name
            execute(self.engine, f"CREATE SEQUENCE {t}_tries")
            execute(
                self.engine,
                f"CREATE FUNCTION {t}_f() RETURNS trigger AS $$ BEGIN "
                f"IF nextval('{t}_tries') = ANY('{{{','.join(map(str, slow)) or 0}}}'::int[]) "
                f"THEN PERFORM pg_sleep({sleep_s}); END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
            )
            execute(
                self.engine,
                f"CREATE TRIGGER {t}_t BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_f()",
            )

    def rows(self) -> list[tuple[Any, ...]]:
        return fetch(self.engine, f"SELECT vendor, amount, client_reference FROM {self.table.name}")

    def tries(self) -> int:
        seq = f"{self.table.name}_tries"
        return int(fetch(self.engine, f"SELECT last_value - (NOT is_called)::int FROM {seq}")[0][0])


@pytest.fixture(params=["sqlite"] if NO_PG else ["postgresql", "sqlite"])
def user(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UserTable]:
    if request.param == "sqlite":
        t = UserTable(f"sqlite:///{tmp_path / 'user.db'}")
    else:
        t = UserTable(request.getfixturevalue("user_pg"))
    yield t
    t.engine.dispose()


@pytest.fixture
def pg_user(user_pg: str) -> Iterator[Callable[..., UserTable]]:
    made: list[UserTable] = []

    def make(**kw: Any) -> UserTable:
        made.append(UserTable(kw.pop("url", user_pg), **kw))
        return made[-1]

    yield make
    for t in made:
        t.engine.dispose()


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


def adapter(
    ledger: Ledger, user: UserTable, engine: Engine | None = None, **kw: Any
) -> GuardedTable:
    kw.setdefault("retry", RETRY)
    return GuardedTable(ledger, engine or user.engine, user.table, effect="invoice.create@1", **kw)


def create(
    records: GuardedTable, values: dict[str, Any] | None = None, step_id: str = "invoice"
) -> dict[str, Any]:
    with step("run-1", step_id):
        return records.insert(values or INVOICE)


def only(ledger: Ledger) -> Any:
    [rec] = ledger.effects()
    return rec


def span_of(spans: InMemorySpanExporter, outcome: str, rec: Any) -> None:
    """The last guarded call emitted a span with ``outcome``, ids, and no secrets."""
    span = spans.get_finished_spans()[-1]
    attrs = dict(span.attributes or {})
    assert span.name == "execute_tool invoice.create@1"
    assert attrs["onceonly.effect.outcome"] == outcome
    assert attrs["onceonly.provider_class"] == "B"
    assert attrs["onceonly.effect.key_id"] == rec.key_id
    shown = " ".join(map(str, attrs.values()))
    assert rec.provider_key not in shown
    assert "V-000173" not in shown
    assert "120" not in shown


# -- a proxy that loses the answer to COMMIT ------------------------------------------


class CommitCutter:
    """A unix-socket proxy to the PostgreSQL server. When armed, it forwards a client's
    ``COMMIT`` to the server, reads the server's answer (the commit is then durable),
    and closes both sides instead of passing the answer on. ``refuse_after`` then stops
    listening: later connections are refused."""

    def __init__(self, server_url: str, *, refuse_after: bool = False) -> None:
        url = make_url(server_url)
        self.target = f"{url.query['host']}/.s.PGSQL.{url.port or 5432}"
        self.dir = tempfile.mkdtemp(prefix="oo-px-", dir="/tmp")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(f"{self.dir}/.s.PGSQL.5432")
        self.listener.listen()
        self.armed = True
        self.refuse_after = refuse_after
        self.open: list[socket.socket] = []
        self.url = (
            url.set(port=None)
            .update_query_dict({"host": self.dir})
            .render_as_string(hide_password=False)
        )
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.open += [client, server]
                server.connect(self.target)
                cut = threading.Event()
                for args in ((client, server, cut, True), (server, client, cut, False)):
                    threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cut: threading.Event, up: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if up and self.armed and b"COMMIT" in data:
                    self.armed = False
                    cut.set()
                elif not up and cut.is_set():  # the answer to COMMIT: lost on the way
                    if self.refuse_after:
                        self.close()
                    break
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        """Stop listening (connections are refused from now on) and drop every connection."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.listener.close()
        for s in self.open:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv(); close() would not
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- success, replay, divergence -----------------------------------------------------


def test_an_insert_happens_once_and_a_restart_replays_it(
    user: UserTable, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    first = create(adapter(ledger, user))
    rec = only(ledger)
    span_of(spans, "executed", rec)
    assert create(adapter(ledger, user)) == first
    span_of(spans, "replayed", rec)
    assert create(adapter(ledgers.fresh(owner="w2"), user)) == first
    assert first["client_reference"] == rec.provider_key
    assert (first["vendor"], first["amount"]) == ("V-000173", Decimal("120.00"))
    assert user.rows() == [("V-000173", Decimal("120.00"), rec.provider_key)]
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 1)
    with pytest.raises(KeyReuseError):
        create(adapter(ledger, user), {**INVOICE, "amount": Decimal("121.00")})
    assert len(user.rows()) == 1


def test_a_ledger_that_lost_its_history_gets_the_existing_row_not_a_second_one(
    user: UserTable, ledger: Ledger, tmp_path: Path, clock: Clock
) -> None:
    first = create(adapter(ledger, user))
    # Two restored-from-nothing ledgers with the same secret derive the same reference.
    restored = [Ledgers(f"sqlite:///{tmp_path / f'restored{i}.db'}", clock) for i in (1, 2)]
    try:
        again = restored[0].fresh(owner="w2")
        assert create(adapter(again, user)) == first  # the table deduplicated the re-send
        assert only(again).status is EffectStatus.COMMITTED
        other = restored[1].fresh(owner="w3")
        with pytest.raises(ReferenceReuseError) as info:
            create(adapter(other, user), {**INVOICE, "vendor": "V-999"})
        assert info.value.columns == ["vendor"]
        assert only(other).status is EffectStatus.FAILED
    finally:
        for r in restored:
            r.close()
    assert len(user.rows()) == 1


VIOLATIONS: list[tuple[dict[str, Any], set[str]]] = [
    ({"amount": Decimal("-5.00")}, {"23514", "SQLITE_CONSTRAINT_CHECK"}),
    ({"number": "INV-0"}, {"23505", "SQLITE_CONSTRAINT_UNIQUE"}),  # another unique column
    ({"vendor": None}, {"23502", "SQLITE_CONSTRAINT_NOTNULL"}),
]


def test_a_constraint_violation_fails_definitely_and_is_replayed(
    user: UserTable, ledger: Ledger, ledgers: Ledgers
) -> None:
    execute(
        user.engine,
        f"INSERT INTO {user.table.name} (client_reference, vendor, amount, number) "
        f"VALUES ('x', 'V-0', 1, 'INV-0')",
    )
    restarted = adapter(ledgers.fresh(owner="w2"), user)
    for n, (change, code) in enumerate(VIOLATIONS):
        with pytest.raises(RecordRejected) as info:
            create(adapter(ledger, user), {**INVOICE, **change}, f"s{n}")
        assert info.value.code in code
        assert "V-000173" not in str(info.value)  # the driver's first line, not the values
        with pytest.raises(EffectFailed) as failed:
            create(restarted, {**INVOICE, **change}, f"s{n}")
        assert failed.value.error_type == "RecordRejected"
    assert len(user.rows()) == 1  # only the row that was there before
    recs = ledger.effects()
    assert [(r.status, r.attempts) for r in recs] == [(EffectStatus.FAILED, 1)] * 3


def test_a_value_too_long_is_a_definite_data_error(
    pg_user: Callable[..., UserTable], ledger: Ledger
) -> None:
    user = pg_user()
    with pytest.raises(RecordRejected) as info:
        create(adapter(ledger, user), {**INVOICE, "vendor": "V" * 40})
    assert info.value.code == "22001"
    assert (user.rows(), user.tries()) == ([], 0)  # refused before any row was formed
    assert only(ledger).status is EffectStatus.FAILED


def test_the_reference_column_must_be_a_unique_string(ledger: Ledger, tmp_path: Path) -> None:
    user = UserTable(f"sqlite:///{tmp_path / 'user.db'}")
    plain = Table("p", MetaData(), Column("client_reference", String(64)))
    short = Table("s", MetaData(), Column("client_reference", String(20), unique=True))
    for table in (plain, short):
        with pytest.raises(ConfigurationError):
            GuardedTable(ledger, user.engine, table, effect="e@1")
    with pytest.raises(ConfigurationError):
        adapter(ledger, user).insert({**INVOICE, "client_reference": "mine"}, key="k")
    with pytest.raises(ConfigurationError):
        adapter(ledger, user).insert({**INVOICE, "colour": "red"}, key="k")
    assert ledger.effects() == []


# -- not sent ----------------------------------------------------------------------------


def test_a_refused_connection_is_not_sent_and_is_inserted_once_later(
    pg_user: Callable[..., UserTable], ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    user = pg_user()
    name = make_url(user.url).database
    admin = create_engine(make_url(user.url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    execute(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
    try:
        with pytest.raises(RecordNotSent) as info:
            create(adapter(ledger, user))
        assert info.value.phase == "connect"
        assert (only(ledger).status, only(ledger).attempts) == (EffectStatus.NOT_HAPPENED, 3)
    finally:
        execute(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        admin.dispose()
    row = create(adapter(ledgers.fresh(owner="w2"), user))
    span_of(spans, "executed", only(ledger))
    assert create(adapter(ledger, user)) == row
    assert (len(user.rows()), user.tries()) == (1, 1)
    assert (only(ledger).status, only(ledger).epoch) == (EffectStatus.COMMITTED, 4)


def test_a_missing_sqlite_database_is_not_sent(ledger: Ledger, tmp_path: Path) -> None:
    user = UserTable(f"sqlite:///{tmp_path / 'user.db'}")
    gone = create_engine(f"sqlite:///{tmp_path / 'no' / 'such.db'}")
    with pytest.raises(RecordNotSent):
        create(adapter(ledger, user, gone))
    assert only(ledger).status is EffectStatus.NOT_HAPPENED


# -- ambiguous: sent, answer lost ----------------------------------------------------------


def test_a_statement_timeout_is_probed_then_resent_once(
    pg_user: Callable[..., UserTable], ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    user = pg_user(slow=(1,), sleep_s=2, connect_args={"options": "-c statement_timeout=300"})
    row = create(adapter(ledger, user))
    span_of(spans, "executed", only(ledger))  # on the second attempt
    assert create(adapter(ledgers.fresh(owner="w2"), user)) == row
    assert (len(user.rows()), user.tries()) == (1, 2)  # the first insert reached the table
    rec = only(ledger)
    assert (rec.status, rec.epoch, rec.attempts) == (EffectStatus.COMMITTED, 2, 2)


def test_a_terminated_backend_during_the_insert_is_probed_then_resent_once(
    pg_user: Callable[..., UserTable], ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    user = pg_user(slow=(1,), sleep_s=10)
    name = make_url(user.url).database

    def terminate() -> None:
        for _ in range(200):
            killed = fetch(
                user.engine,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :d AND wait_event = 'PgSleep'",
                d=name,
            )
            if killed:
                return
            time.sleep(0.02)

    killer = threading.Thread(target=terminate)
    killer.start()
    row = create(adapter(ledger, user))
    killer.join()
    span_of(spans, "executed", only(ledger))
    assert create(adapter(ledgers.fresh(owner="w2"), user)) == row
    assert (len(user.rows()), user.tries()) == (1, 2)
    assert (only(ledger).status, only(ledger).epoch) == (EffectStatus.COMMITTED, 2)


def test_a_commit_whose_answer_is_lost_is_reconciled_by_the_probe(
    pg_user: Callable[..., UserTable], ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    user = pg_user()
    proxy = CommitCutter(user.url)
    try:
        cut = create_engine(proxy.url, poolclass=NullPool)
        row = create(adapter(ledger, user, cut))
        span_of(spans, "reconciled", only(ledger))
        cut.dispose()
    finally:
        proxy.close()
    assert not proxy.armed  # the cut happened
    assert create(adapter(ledgers.fresh(owner="w2"), user)) == row
    assert (len(user.rows()), user.tries()) == (1, 1)  # sent once, never re-sent
    rec = only(ledger)
    assert (rec.status, rec.epoch, rec.attempts) == (EffectStatus.COMMITTED, 1, 1)


def test_a_lost_commit_answer_with_the_database_gone_needs_a_human(
    pg_user: Callable[..., UserTable], ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    user = pg_user()
    proxy = CommitCutter(user.url, refuse_after=True)
    cut = create_engine(proxy.url, poolclass=NullPool)
    try:
        with pytest.raises(EffectInDoubt) as info:
            create(adapter(ledger, user, cut))
        assert info.value.status == "needs_human"
        span_of(spans, "in_doubt", only(ledger))
        with pytest.raises(EffectInDoubt):  # another process: still not re-sent
            create(adapter(ledgers.fresh(owner="w2"), user))
    finally:
        proxy.close()
        cut.dispose()
    assert (len(user.rows()), user.tries()) == (1, 1)
    assert only(ledger).status is EffectStatus.NEEDS_HUMAN


def test_a_locked_sqlite_table_is_probed_and_inserted_once_the_lock_is_gone(
    ledger: Ledger, ledgers: Ledgers, tmp_path: Path
) -> None:
    user = UserTable(f"sqlite:///{tmp_path / 'user.db'}", connect_args={"timeout": 0.05})
    holder = sqlite3.connect(tmp_path / "user.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(Exception, match="locked"):
            create(adapter(ledger, user))
        assert only(ledger).status is EffectStatus.NOT_HAPPENED  # probed: not there
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    row = create(adapter(ledgers.fresh(owner="w2"), user))
    assert create(adapter(ledger, user)) == row
    assert len(user.rows()) == 1
