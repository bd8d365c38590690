"""Schema versions and migrations, SQLite durability settings, unreachable and locked
databases."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, event, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.schema import CreateTable

from onceonly.checkpoint import (
    ConfigurationError,
    DatabaseLocked,
    DatabaseRetry,
    DatabaseUnavailable,
    RunStatus,
    SchemaVersionError,
    Store,
    WaitKind,
    Waits,
    WaitStatus,
    WeakDurabilityError,
    migrate,
)
from onceonly.checkpoint import _schema as schema_module
from tests.dbutil import execute, fetch

CHECKPOINT_TABLES = {
    "oo_waits",
    "onceonly_schema",
    "oo_runs",
    "oo_checkpoints",
    "oo_blobs",
    "oo_blob_refs",
}


@pytest.fixture
def plain_engine(db_url: str) -> Iterator[Engine]:
    """An engine without onceonly's hooks, for looking at (and editing) the database."""
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _version(engine: Engine) -> int:
    rows = fetch(engine, "SELECT version FROM onceonly_schema WHERE component = 'checkpoint'")
    assert len(rows) == 1
    return int(rows[0][0])


def _usable(store: Store) -> None:
    rid = store.create_run("flow").run_id
    store.save(rid, {"a": [1, 2]}, step="0", status=RunStatus.WAITING)
    assert store.load(rid).state == {"a": [1, 2]}


# -- versions -----------------------------------------------------------------------------


def test_a_fresh_database_gets_the_schema(db_url: str, plain_engine: Engine) -> None:
    with Store.open(db_url) as store:
        _usable(store)
    assert _tables(plain_engine) >= CHECKPOINT_TABLES
    assert _version(plain_engine) == schema_module.CHECKPOINT_MIGRATIONS[-1].version
    applied = fetch(plain_engine, "SELECT applied_at FROM onceonly_schema")
    with Store.open(db_url) as store:  # opening again applies nothing
        _usable(store)
    assert fetch(plain_engine, "SELECT applied_at FROM onceonly_schema") == applied


def test_create_false_on_an_empty_database_raises(db_url: str, plain_engine: Engine) -> None:
    with pytest.raises(SchemaVersionError) as exc:
        Store.open(db_url, create=False)
    assert exc.value.component == "checkpoint"
    assert exc.value.found == 0
    assert "onceonly migrate" in str(exc.value)
    assert _tables(plain_engine) & CHECKPOINT_TABLES <= {"onceonly_schema"}


def test_migrate_sql_shows_the_ddl_and_creates_nothing(db_url: str, plain_engine: Engine) -> None:
    sql = migrate(db_url, sql=True)
    for table in CHECKPOINT_TABLES:
        assert f"CREATE TABLE {table}" in sql
    assert _tables(plain_engine) == set()
    with pytest.raises(SchemaVersionError):
        Store.open(db_url, create=False)


def test_migrate_creates_the_schema_then_the_store_opens(db_url: str, plain_engine: Engine) -> None:
    summary = migrate(db_url)
    assert f"applied {len(schema_module.CHECKPOINT_MIGRATIONS)}" in summary
    assert _tables(plain_engine) >= CHECKPOINT_TABLES
    with Store.open(db_url, create=False) as store:
        _usable(store)
    assert "applied 0" in migrate(db_url)
    assert "CREATE TABLE" not in migrate(db_url, sql=True)


def test_a_newer_schema_is_refused(db_url: str, plain_engine: Engine) -> None:
    with Store.open(db_url) as store:
        rid = store.create_run("flow").run_id
    current = _version(plain_engine)
    execute(
        plain_engine,
        "UPDATE onceonly_schema SET version = :v WHERE component = 'checkpoint'",
        v=current + 1,
    )
    for create in (True, False):
        with pytest.raises(SchemaVersionError) as exc:
            Store.open(db_url, create=create)
        assert (exc.value.found, exc.value.expected) == (current + 1, current)
        assert "newer" in str(exc.value)
    with pytest.raises(SchemaVersionError):
        migrate(db_url)
    assert _version(plain_engine) == current + 1
    assert fetch(plain_engine, "SELECT run_id FROM oo_runs") == [(rid,)]


def test_an_older_schema_is_refused_until_migrated(
    db_url: str, plain_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store.open(db_url) as store:
        _usable(store)
    shipped = schema_module.CHECKPOINT_MIGRATIONS
    old = shipped[-1].version
    extra_table = Table("oo_test_extra", MetaData(), Column("x", Integer))
    newer_release = (
        *shipped,
        schema_module.Migration(old + 1, "a table for the test", (CreateTable(extra_table),)),
    )
    # This process now plays a newer onceonly release with one more migration.
    monkeypatch.setattr(schema_module, "CHECKPOINT_MIGRATIONS", newer_release)
    monkeypatch.setattr(schema_module, "CHECKPOINT_SCHEMA_VERSION", old + 1)
    for create in (True, False):
        with pytest.raises(SchemaVersionError) as exc:
            Store.open(db_url, create=create)
        assert (exc.value.found, exc.value.expected) == (old, old + 1)
        assert "onceonly migrate" in str(exc.value)
    assert "oo_test_extra" not in _tables(plain_engine)
    sql = migrate(db_url, sql=True)
    assert "CREATE TABLE oo_test_extra" in sql
    assert "CREATE TABLE oo_runs" not in sql
    assert "oo_test_extra" not in _tables(plain_engine)
    assert _version(plain_engine) == old
    migrate(db_url)
    assert "oo_test_extra" in _tables(plain_engine)
    assert _version(plain_engine) == old + 1
    with Store.open(db_url, create=False) as store:
        _usable(store)
        assert len(store.list_runs()) == 2


# -- SQLite durability settings ------------------------------------------------------------


@pytest.mark.parametrize(
    ("pragma", "setting"),
    [
        ("journal_mode=DELETE", "journal_mode"),
        ("journal_mode=MEMORY", "journal_mode"),
        ("synchronous=OFF", "synchronous"),
        ("synchronous=NORMAL", "synchronous"),
        ("busy_timeout=0", "busy_timeout"),
    ],
)
def test_weak_sqlite_settings_are_refused(tmp_path: Path, pragma: str, setting: str) -> None:
    url = f"sqlite:///{tmp_path / 'weak.db'}"
    store = Store.open(url)
    engine = store.engine
    store.close()

    # Registered after onceonly's own hook, so it runs after it on every new connection.
    @event.listens_for(engine, "connect")
    def weaken(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA {pragma}")
        cur.close()

    try:
        with pytest.raises(WeakDurabilityError) as exc:
            Store(engine)
        assert exc.value.setting == setting
        assert isinstance(exc.value, ConfigurationError)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///:memory:",
        pytest.param(
            "sqlite:///file:oo_mem?mode=memory&cache=shared&uri=true",
            # SQLAlchemy's own notice about the pool it picks for such URLs, not ours
            marks=pytest.mark.filterwarnings(
                "ignore:Selection of the SingletonThreadPool:sqlalchemy.exc.SADeprecationWarning"
            ),
        ),
    ],
)
def test_in_memory_sqlite_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        Store.open(url)


def test_an_in_memory_engine_is_refused() -> None:
    engine = create_engine("sqlite://")
    try:
        with pytest.raises(ConfigurationError):
            Store(engine)
    finally:
        engine.dispose()


@pytest.mark.parametrize("url", ["nonsense", "bad://x", "mysql+nosuchdriver://u@h/db"])
def test_malformed_or_unsupported_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises(ConfigurationError):
        Store.open(url)
    with pytest.raises(ConfigurationError):
        migrate(url)


# -- unreachable and locked databases ------------------------------------------------------


@pytest.fixture(params=["postgresql", "sqlite"])
def unreachable_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        # a socket directory with no server listening in it
        return f"postgresql+psycopg://postgres@/postgres?host={tmp_path}"
    return f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"


_ACTIONS: dict[str, Callable[[str], object]] = {
    "open": Store.open,
    "migrate": migrate,
    "migrate-sql": lambda url: migrate(url, sql=True),
}


@pytest.mark.parametrize("action", sorted(_ACTIONS))
def test_an_unreachable_database_raises_database_unavailable(
    unreachable_url: str, action: str
) -> None:
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable):
        _ACTIONS[action](unreachable_url)
    assert time.monotonic() - started < 30


def _lock(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_a_locked_database_raises_database_locked_and_writes_nothing(tmp_path: Path) -> None:
    """With retries off (the default retries a held lock for 30 s: tests/test_transient.py)."""
    path = tmp_path / "locked.db"
    with Store.open(
        f"sqlite:///{path}", busy_timeout_ms=200, retry=DatabaseRetry(budget_s=0)
    ) as store:
        rid = store.create_run("flow", next_step="one").run_id
        store.save(rid, {"n": 0}, step="zero", next_step="one")
        blocker = _lock(path)
        try:
            started = time.monotonic()
            with pytest.raises(DatabaseLocked):
                store.save(rid, {"n": 1}, step="one", next_step="two")
            assert time.monotonic() - started < 5
            with pytest.raises(DatabaseLocked):
                store.update(rid, step="one", set={"n": 1})
            with pytest.raises(DatabaseLocked):
                store.create_run("flow", run_id="blocked")
            with pytest.raises(DatabaseLocked):
                store.update_run(rid, status=RunStatus.FAILED)
            # reads are not blocked by a writer in WAL mode
            assert store.load(rid).state == {"n": 0}
        finally:
            blocker.rollback()
            blocker.close()
        assert len(store.history(rid)) == 1
        run = store.get_run(rid)
        assert (run.next_step, run.status, run.head_seq) == ("one", RunStatus.RUNNING, 0)
        assert [r.run_id for r in store.list_runs()] == [rid]
        # the store is still usable once the lock is gone
        assert store.save(rid, {"n": 1}, step="one", next_step="two").seq == 1
    with Store.open(f"sqlite:///{path}") as again:
        assert again.load(rid).state == {"n": 1}
        assert again.get_run(rid).next_step == "two"


def test_workers_opening_a_fresh_database_at_once_all_succeed(db_url: str) -> None:
    """A deployment's first start: several workers create the schema concurrently."""
    n = 6
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    stores: list[Store] = []
    lock = threading.Lock()

    def start() -> None:
        barrier.wait()
        try:
            s = Store.open(db_url)
        except BaseException as exc:  # noqa: BLE001  (collected and asserted below)
            with lock:
                errors.append(exc)
        else:
            with lock:
                stores.append(s)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        for s in stores:
            _usable(s)
    finally:
        for s in stores:
            s.close()


def test_a_version_1_store_migrates_to_waits_keeping_its_runs(
    db_url: str, plain_engine: Engine
) -> None:
    first = schema_module.CHECKPOINT_MIGRATIONS[:1]
    schema_module.apply_migrations(plain_engine, "checkpoint", first)
    execute(
        plain_engine,
        "INSERT INTO oo_runs (run_id, flow, code_version, state_version, status, "
        "created_at, updated_at) VALUES ('r1', 'f', '0', 1, 'running', 0, 0)",
    )
    with pytest.raises(SchemaVersionError) as exc:
        Store.open(db_url, create=False)
    assert (exc.value.found, exc.value.expected) == (1, schema_module.CHECKPOINT_SCHEMA_VERSION)
    assert "v2: waits" in migrate(db_url, sql=True)
    migrate(db_url)
    assert "oo_waits" in _tables(plain_engine)
    with Store.open(db_url, create=False) as store:
        assert store.get_run("r1").flow == "f"


def test_a_version_2_store_migrates_its_waits_to_instances(
    db_url: str, plain_engine: Engine
) -> None:
    """Version 3 re-keys oo_waits by (run, name, instance): a table rebuild on SQLite, an
    ALTER on PostgreSQL; the waits of version 2 become instance 0 and keep working."""
    schema_module.apply_migrations(
        plain_engine, "checkpoint", schema_module.CHECKPOINT_MIGRATIONS[:2]
    )
    execute(
        plain_engine,
        "INSERT INTO oo_runs (run_id, flow, code_version, state_version, status, "
        "created_at, updated_at) VALUES ('r1', 'f', '0', 1, 'waiting', 0, 0)",
    )
    execute(
        plain_engine,
        "INSERT INTO oo_waits (run_id, name, kind, status, allow_self, created_at) "
        "VALUES ('r1', 'docs', 'signal', 'open', 0, 1)",
    )
    sql = migrate(db_url, sql=True)
    assert "v3: waits belong to the step visit" in sql
    assert ("oo_waits_v2" in sql) is db_url.startswith("sqlite")  # one database's statements
    migrate(db_url)
    with Store.open(db_url, create=False) as store:
        waits = Waits(store)
        old = waits.get("r1", "docs")
        assert (old.instance, old.opened_by, old.status) == (0, None, WaitStatus.OPEN)
        # The step visit that opened it before the upgrade adopts it when it re-opens it.
        again = waits.open("r1", "docs", WaitKind.SIGNAL, opened_by="collect#0")
        assert (again.instance, again.opened_by) == (0, "collect#0")
        waits.signal("r1", "docs", {"files": 2})
        assert store.get_run("r1").status is RunStatus.RUNNING
        # Another visit opening the same name gets a new wait.
        nxt = waits.open("r1", "docs", WaitKind.SIGNAL, opened_by="collect#1")
        assert (nxt.instance, nxt.status) == (1, WaitStatus.OPEN)
