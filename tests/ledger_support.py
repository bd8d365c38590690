"""Shared helpers of the ledger tests: fixed secrets, a test clock, ledgers that stand for
other processes, raw table access, and fault injection at the database.

Faults are injected the way a bad disk, an operator or a dead server would cause them,
from outside the library: SQL triggers, a competing lock holder, refused connections.
Only the stored schema's table and column names are used, never the ledger's internals.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Engine

from onceonly.checkpoint import Store
from onceonly.ledger import EffectIdentity, InFlightPolicy, Keyring, Ledger, Secret
from tests.dbutil import execute, fetch

__all__ = [
    "K1",
    "K2",
    "Clock",
    "Ledgers",
    "admin_url",
    "all_values",
    "audit_rows",
    "effect_row",
    "fail_commits",
    "fail_statements",
    "ident",
    "keyring",
    "sqlite_path",
    "unwritable",
]

K1 = Secret("k1", bytes(range(32)))
K2 = Secret("k2", bytes(range(100, 148)))


def keyring(*secrets: Secret) -> Keyring:
    """A keyring of the given secrets (default: K1 alone)."""
    return Keyring(list(secrets) or [K1])


def ident(
    ordinal: int = 0,
    *,
    run: str | None = "run-1",
    step: str | None = "notify",
    visit: int = 0,
    effect: str = "send_email@1",
    tenant: str = "acme",
    explicit: str | None = None,
) -> EffectIdentity:
    """An effect identity; the defaults name the first e-mail of step ``notify``."""
    return EffectIdentity(tenant, run, step, visit, effect, ordinal, explicit)


class Clock:
    """A settable time source for ``Ledger(clock=...)``: leases and windows expire when
    the test says so, not when the machine is slow."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Ledgers:
    """Ledgers on one database. :meth:`fresh` opens a new Store and Ledger, which is what
    another process (or this one after a restart) sees: no shared caches.

    Args:
        db_url: The database.
        clock: The time source every ledger gets unless told otherwise.
    """

    def __init__(self, db_url: str, clock: Callable[[], float]) -> None:
        self.db_url = db_url
        self.clock = clock
        self._stores: list[Store] = []
        self._ledgers: list[Ledger] = []

    def store(self, **kwargs: Any) -> Store:
        s = Store.open(self.db_url, **kwargs)
        self._stores.append(s)
        return s

    def on(self, store: Store, *, cls: type[Ledger] = Ledger, **kwargs: Any) -> Ledger:
        """A ledger (of class ``cls``) on an existing store (default: K1, 30 s leases,
        never wait)."""
        kwargs.setdefault("clock", self.clock)
        kwargs.setdefault("in_flight", InFlightPolicy(wait_s=0))
        kwargs.setdefault("lease_s", 30.0)
        ring = kwargs.pop("keyring", None) or keyring()
        led = cls(store, ring, **kwargs)
        self._ledgers.append(led)
        return led

    def fresh(self, *, store_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Ledger:
        """A ledger on a new Store of the same database (another process's view)."""
        return self.on(self.store(**(store_kwargs or {})), **kwargs)

    def close(self) -> None:
        for led in self._ledgers:
            led.close()
        for s in self._stores:
            with contextlib.suppress(Exception):
                s.close()


# -- raw access ---------------------------------------------------------------------------


def effect_row(engine: Engine, key_id: str) -> dict[str, Any]:
    """The stored effect row, every column, as the database holds it."""
    with engine.connect() as conn:
        row = (
            conn.execute(text("SELECT * FROM oo_effects WHERE key_id = :k"), {"k": key_id})
            .mappings()
            .first()
        )
        conn.rollback()
    assert row is not None, f"no effect row {key_id}"
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in row.items()}


def audit_rows(engine: Engine) -> list[tuple[Any, ...]]:
    """Every audit event, in chain and sequence order, as stored."""
    rows = fetch(
        engine,
        "SELECT chain, seq, key_id, event, epoch, status, actor, detail, row_digest, at, "
        "prev_hash, hash FROM oo_audit ORDER BY chain, seq",
    )
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows]


def all_values(engine: Engine) -> list[tuple[str, Any]]:
    """Every value of every table of the database, as ``(table, value)``."""
    if engine.dialect.name == "sqlite":
        q = "SELECT name FROM sqlite_master WHERE type = 'table'"
    else:
        q = "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
    tables = [str(r[0]) for r in fetch(engine, q)]
    out: list[tuple[str, Any]] = []
    for t in tables:
        for row in fetch(engine, f'SELECT * FROM "{t}"'):
            out.extend((t, v) for v in row)
    return out


def sqlite_path(db_url: str) -> str | None:
    """The file of a SQLite URL, or None for another database."""
    url = make_url(db_url)
    return url.database if url.get_backend_name() == "sqlite" else None


def admin_url(db_url: str) -> str:
    """The same PostgreSQL server's maintenance database."""
    return make_url(db_url).set(database="postgres").render_as_string(hide_password=False)


# -- fault injection ----------------------------------------------------------------------


@contextlib.contextmanager
def fail_statements(engine: Engine, table: str, ops: str = "INSERT OR UPDATE") -> Iterator[None]:
    """Every ``ops`` statement on ``table`` fails inside the transaction (an injected I/O
    error), until the block ends."""
    if engine.dialect.name == "sqlite":
        names = []
        for op in ops.split(" OR "):
            name = f"oo_test_fail_{table}_{op.lower()}"
            execute(
                engine,
                f"CREATE TRIGGER {name} BEFORE {op} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, 'disk I/O error (injected)'); END",
            )
            names.append(name)
        try:
            yield
        finally:
            for name in names:
                execute(engine, f"DROP TRIGGER {name}")
        return
    execute(
        engine,
        "CREATE OR REPLACE FUNCTION oo_test_fail() RETURNS trigger AS $$ BEGIN "
        "RAISE EXCEPTION 'could not write block: I/O error (injected)'; END $$ "
        "LANGUAGE plpgsql",
    )
    execute(
        engine,
        f"CREATE TRIGGER oo_test_fail_t BEFORE {ops} ON {table} FOR EACH ROW "
        f"EXECUTE FUNCTION oo_test_fail()",
    )
    try:
        yield
    finally:
        execute(engine, f"DROP TRIGGER oo_test_fail_t ON {table}")


@contextlib.contextmanager
def fail_commits(engine: Engine) -> Iterator[None]:
    """Every transaction that appends an audit event fails at COMMIT (every statement in
    it succeeded), until the block ends. A deferred constraint makes the commit fail."""
    if engine.dialect.name == "sqlite":
        execute(engine, "CREATE TABLE oo_test_parent (id INTEGER PRIMARY KEY)")
        execute(
            engine,
            "CREATE TABLE oo_test_child (pid INTEGER REFERENCES oo_test_parent(id) "
            "DEFERRABLE INITIALLY DEFERRED)",
        )
        execute(
            engine,
            "CREATE TRIGGER oo_test_commit_t AFTER INSERT ON oo_audit "
            "BEGIN INSERT INTO oo_test_child VALUES (1); END",
        )
        try:
            yield
        finally:
            execute(engine, "DROP TRIGGER oo_test_commit_t")
            execute(engine, "DROP TABLE oo_test_child")
            execute(engine, "DROP TABLE oo_test_parent")
        return
    execute(
        engine,
        "CREATE OR REPLACE FUNCTION oo_test_commit_fail() RETURNS trigger AS $$ BEGIN "
        "RAISE EXCEPTION 'could not fsync file: I/O error (injected at commit)'; END $$ "
        "LANGUAGE plpgsql",
    )
    execute(
        engine,
        "CREATE CONSTRAINT TRIGGER oo_test_commit_t AFTER INSERT ON oo_audit "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION oo_test_commit_fail()",
    )
    try:
        yield
    finally:
        execute(engine, "DROP TRIGGER oo_test_commit_t ON oo_audit")


@contextlib.contextmanager
def unwritable(db_url: str) -> Iterator[None]:
    """The database cannot be written until the block ends.

    SQLite: another connection holds the write lock (open the store with a small
    ``busy_timeout_ms``). PostgreSQL: the database refuses connections and every
    existing connection to it is terminated (``pg_terminate_backend``).
    """
    path = sqlite_path(db_url)
    if path is not None:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    name = make_url(db_url).database
    admin = create_engine(admin_url(db_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"
                ),
                {"d": name},
            )
        try:
            yield
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
    finally:
        admin.dispose()
