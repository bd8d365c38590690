"""Tables of the checkpoint core, declared once with SQLAlchemy Core, and its migrations.

Migrations are data: an ordered list per component, each a list of DDL statements. The
version of every component is kept in the ``onceonly_schema`` table; upper layers (the
ledger) register their own component with its own migration list.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    inspect,
    select,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.schema import DDL, CreateIndex, CreateTable, DDLElement

from .errors import SchemaVersionError

metadata = MetaData()

schema_versions = Table(
    "onceonly_schema",
    metadata,
    Column("component", String(32), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("applied_at", Float, nullable=False),
)


def _runs_table(meta: MetaData, *, sealed: bool) -> Table:
    """``oo_runs`` before schema version 4 (``sealed=False``, for migration 1) or now."""
    return Table(
        "oo_runs",
        meta,
        Column("run_id", String(200), primary_key=True),
        Column("flow", String(200), nullable=False),
        Column("code_version", String(100), nullable=False),
        Column("state_version", Integer, nullable=False),
        Column("status", String(16), nullable=False),
        Column("next_step", String(200), nullable=True),
        Column("lease_owner", String(200), nullable=True),
        Column("lease_expires_at", Float, nullable=True),
        Column("handoff", LargeBinary, nullable=True),
        Column("head_seq", Integer, nullable=True),
        Column("created_at", Float, nullable=False),
        Column("updated_at", Float, nullable=False),
        *([Column("seal", LargeBinary, nullable=True)] if sealed else []),
        *([Column("waits_digest", LargeBinary, nullable=True)] if sealed else []),
        *([Column("rev", Integer, nullable=True)] if sealed else []),
    )


def _checkpoints_table(meta: MetaData, *, sealed: bool) -> Table:
    """``oo_checkpoints`` before schema version 4 (``sealed=False``) or now."""
    return Table(
        "oo_checkpoints",
        meta,
        Column("run_id", String(200), nullable=False),
        Column("seq", Integer, nullable=False),
        Column("kind", SmallInteger, nullable=False),  # 0 keyframe, 1 delta
        Column("keyframe_seq", Integer, nullable=False),
        Column("step", String(200), nullable=False),
        Column("source", String(16), nullable=False),
        Column("schema_version", Integer, nullable=False),
        Column("created_at", Float, nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("digest", LargeBinary, nullable=False),
        *([Column("seal", LargeBinary, nullable=True)] if sealed else []),
        PrimaryKeyConstraint("run_id", "seq"),
        sqlite_with_rowid=False,
    )


_v1 = MetaData()
_runs_v1 = _runs_table(_v1, sealed=False)
_runs_v1_by_status = Index("oo_runs_status", _runs_v1.c.status)
_checkpoints_v1 = _checkpoints_table(_v1, sealed=False)
runs = _runs_table(metadata, sealed=True)
# Status only: updated_at changes on every checkpoint, and indexing it would add a page
# write to every step's commit.
runs_by_status = Index("oo_runs_status", runs.c.status)
checkpoints = _checkpoints_table(metadata, sealed=True)

blobs = Table(
    "oo_blobs",
    metadata,
    Column("hash", LargeBinary(32), primary_key=True),
    Column("size", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
)

blob_refs = Table(
    "oo_blob_refs",
    metadata,
    Column("owner", String(200), nullable=False),
    Column("hash", LargeBinary(32), nullable=False),
    PrimaryKeyConstraint("owner", "hash"),
    sqlite_with_rowid=False,
)
blob_refs_by_hash = Index("oo_blob_refs_hash", blob_refs.c.hash)


@dataclass(frozen=True)
class Migration:
    """One schema migration of a component.

    Attributes:
        version: The schema version this migration produces.
        description: What it changes, for ``onceonly migrate --sql``.
        statements: DDL elements (or :class:`OnlyOn` one database), executed in order
            in one transaction.
    """

    version: int
    description: str
    statements: Sequence[DDLElement | OnlyOn]


@dataclass(frozen=True)
class OnlyOn:
    """A migration statement for one database only (a table rebuild on SQLite, an
    ``ALTER`` on PostgreSQL)."""

    dialect: str
    element: DDLElement


def _sql(text: str) -> DDLElement:
    return DDL(text)  # type: ignore[no-untyped-call]


def _for(dialect: str, migration: Migration) -> list[DDLElement]:
    """The statements of ``migration`` that run on ``dialect``."""
    out: list[DDLElement] = []
    for stmt in migration.statements:
        if isinstance(stmt, OnlyOn):
            if stmt.dialect == dialect:
                out.append(stmt.element)
        else:
            out.append(stmt)
    return out


def _waits_table(meta: MetaData, *, version: int) -> Table:
    """``oo_waits`` as of schema version 2 (for migration 2), 3 (for migration 3's
    rebuild on SQLite) or 4 (today's: sealed rows).

    Version 3 makes a wait belong to the step visit that opened it: ``(run_id, name,
    instance)`` is the key, ``opened_by`` the opening step visit (``step#visit``; NULL
    for a signal delivered before any wait of its name opened). A loop that waits under
    one name on every pass opens a new instance each pass.
    """
    extra: list[Any] = []
    if version >= 3:
        extra = [
            Column("instance", Integer, nullable=False, server_default="0"),
            Column("opened_by", String(200), nullable=True),
            *([Column("seal", LargeBinary, nullable=True)] if version >= 4 else []),
            PrimaryKeyConstraint("run_id", "name", "instance"),
        ]
    else:
        extra = [PrimaryKeyConstraint("run_id", "name")]
    return Table(
        "oo_waits",
        meta,
        Column("run_id", String(200), nullable=False),
        Column("name", String(200), nullable=False),
        Column("kind", String(16), nullable=False),  # approval | signal | timer
        Column("status", String(16), nullable=False),
        Column("due_at", Float, nullable=True),  # timer due, or approval expiry
        Column("subject_hash", String(64), nullable=True),
        Column("subject", LargeBinary, nullable=True),  # what is to be approved (codec)
        Column("requested_by", String(200), nullable=True),
        Column("allow_self", SmallInteger, nullable=False),
        Column("payload", LargeBinary, nullable=True),  # a signal's payload (codec)
        Column("decided_by", String(200), nullable=True),
        Column("decided_at", Float, nullable=True),
        Column("reason", String(2000), nullable=True),
        Column("created_at", Float, nullable=False),
        *extra,
    )


_v2 = MetaData()
_waits_v2 = _waits_table(_v2, version=2)
_waits_v2_by_due = Index("oo_waits_due", _waits_v2.c.status, _waits_v2.c.due_at)
_v3 = MetaData()
_waits_v3 = _waits_table(_v3, version=3)
_waits_v3_by_due = Index("oo_waits_due", _waits_v3.c.status, _waits_v3.c.due_at)
waits = _waits_table(metadata, version=4)
# The worker's scan for due timers and expired approvals.
waits_by_due = Index("oo_waits_due", waits.c.status, waits.c.due_at)

_WAIT_V2_COLS = (
    "run_id, name, kind, status, due_at, subject_hash, subject, requested_by, allow_self, "
    "payload, decided_by, decided_at, reason, created_at"
)
# Version 3 re-keys oo_waits by (run_id, name, instance). SQLite cannot change a primary
# key in place: the table is rebuilt (in the migration's one transaction).
_WAITS_V3_SQLITE: tuple[OnlyOn, ...] = tuple(
    OnlyOn("sqlite", stmt)
    for stmt in (
        _sql("ALTER TABLE oo_waits RENAME TO oo_waits_v2"),
        _sql("DROP INDEX IF EXISTS oo_waits_due"),
        CreateTable(_waits_v3),
        _sql(
            f"INSERT INTO oo_waits ({_WAIT_V2_COLS}, instance, opened_by) "
            f"SELECT {_WAIT_V2_COLS}, 0, NULL FROM oo_waits_v2"
        ),
        _sql("DROP TABLE oo_waits_v2"),
        CreateIndex(_waits_v3_by_due),
    )
)
_WAITS_V3_PG: tuple[OnlyOn, ...] = tuple(
    OnlyOn("postgresql", _sql(stmt))
    for stmt in (
        (
            "ALTER TABLE oo_waits ADD COLUMN instance INTEGER NOT NULL DEFAULT 0, "
            "ADD COLUMN opened_by VARCHAR(200)"
        ),
        "ALTER TABLE oo_waits DROP CONSTRAINT oo_waits_pkey",
        "ALTER TABLE oo_waits ADD PRIMARY KEY (run_id, name, instance)",
    )
)

# A run that shares another run's effect keys (a fork and its origin): retention keeps
# the origin, whose ledger entries the fork replays, while the fork exists.
run_links = Table(
    "oo_run_links",
    metadata,
    Column("run_id", String(200), primary_key=True),
    Column("key_run", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
)
run_links_by_key_run = Index("oo_run_links_key_run", run_links.c.key_run)

CHECKPOINT_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "runs, checkpoints (delta + keyframe), content-addressed blobs and their references",
        (
            CreateTable(_runs_v1),
            CreateIndex(_runs_v1_by_status),
            CreateTable(_checkpoints_v1),
            CreateTable(blobs),
            CreateTable(blob_refs),
            CreateIndex(blob_refs_by_hash),
        ),
    ),
    Migration(
        2,
        "waits: approvals (bound to a subject hash), signals and timers of waiting runs; "
        "links from forks to the runs whose effect keys they share",
        (
            CreateTable(_waits_v2),
            CreateIndex(_waits_v2_by_due),
            CreateTable(run_links),
            CreateIndex(run_links_by_key_run),
        ),
    ),
    Migration(
        3,
        "waits belong to the step visit that opened them: oo_waits keyed by (run_id, name, "
        "instance), with the opening step visit (a loop that waits under one name opens a "
        "new wait on every pass)",
        (*_WAITS_V3_SQLITE, *_WAITS_V3_PG),
    ),
    Migration(
        4,
        "keyed seals on the rows the runtime trusts: runs, checkpoints and waits (a seal "
        "column each; rows of earlier versions are sealed by `onceonly audit seal`)",
        tuple(
            OnlyOn(dialect, _sql(f"ALTER TABLE {table} ADD COLUMN seal {blob}"))
            for dialect, blob in (("sqlite", "BLOB"), ("postgresql", "BYTEA"))
            for table in ("oo_runs", "oo_checkpoints", "oo_waits")
        ),
    ),
    Migration(
        5,
        "a run's seal covers the digest of its waits (oo_runs.waits_digest: a wait put "
        "back to an earlier, genuinely sealed version is refused) and the row's revision "
        "(oo_runs.rev, one more at every sealed write: what a witness records)",
        tuple(
            OnlyOn(dialect, _sql(f"ALTER TABLE oo_runs ADD COLUMN {col} {kind}"))
            for dialect, blob in (("sqlite", "BLOB"), ("postgresql", "BYTEA"))
            for col, kind in (("waits_digest", blob), ("rev", "INTEGER"))
        ),
    ),
)
CHECKPOINT_SCHEMA_VERSION = CHECKPOINT_MIGRATIONS[-1].version


def _version_table_exists(conn: Connection) -> bool:
    if conn.dialect.name == "sqlite":
        q = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'onceonly_schema'"
        return conn.exec_driver_sql(q).first() is not None
    if conn.dialect.name == "postgresql":
        q = "SELECT to_regclass('onceonly_schema') IS NOT NULL"
        return bool(conn.exec_driver_sql(q).scalar())
    return inspect(conn).has_table(schema_versions.name)


def current_version(conn: Connection, component: str) -> int:
    """The schema version of ``component`` recorded in the database (0 when absent)."""
    if not _version_table_exists(conn):
        return 0
    row = conn.execute(
        select(schema_versions.c.version).where(schema_versions.c.component == component)
    ).first()
    return 0 if row is None else int(row[0])


def pending_sql(
    engine: Engine,
    component: str,
    migrations: Sequence[Migration],
    *,
    version_table: bool = True,
) -> str:
    """The SQL that :func:`apply_migrations` would run, for review by a DBA.

    Applying the output by hand leaves the database exactly as ``migrate`` would,
    including the recorded version. Pass ``version_table=False`` when concatenating the
    SQL of several components, so the version table is created once.
    """
    with engine.connect() as conn:
        have = current_version(conn, component)
        has_table = _version_table_exists(conn)
    out: list[str] = []
    dialect = engine.dialect
    if not has_table and version_table:
        out.append(str(CreateTable(schema_versions).compile(dialect=dialect)).strip() + ";")
    latest = migrations[-1].version
    for m in migrations:
        if m.version <= have:
            continue
        out.append(f"-- {component} v{m.version}: {m.description}")
        out.extend(str(s.compile(dialect=dialect)).strip() + ";" for s in _for(dialect.name, m))
    if latest > have:
        if have == 0:
            out.append(
                f"INSERT INTO onceonly_schema (component, version, applied_at) "
                f"VALUES ('{component}', {latest}, 0);"
            )
        else:
            out.append(
                f"UPDATE onceonly_schema SET version = {latest} WHERE component = '{component}';"
            )
    return "\n".join(out) + "\n" if out else ""


def apply_migrations(engine: Engine, component: str, migrations: Sequence[Migration]) -> int:
    """Apply every migration of ``component`` newer than the database, in one transaction.

    Returns:
        The number of migrations applied.

    Raises:
        SchemaVersionError: The database is newer than this code.
    """
    latest = migrations[-1].version
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Workers opening a fresh database at once: one migrates, the rest wait here
            # and then find the schema in place. (SQLite's BEGIN IMMEDIATE does the same.)
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7412958231)")
        if not _version_table_exists(conn):
            conn.execute(CreateTable(schema_versions, if_not_exists=True))
        have = current_version(conn, component)
        if have > latest:
            raise newer_schema_error(component, have, latest)
        applied = 0
        for m in migrations:
            if m.version <= have:
                continue
            for stmt in _for(conn.dialect.name, m):
                conn.execute(stmt)
            applied += 1
        if applied:
            now = time.time()
            if have == 0:
                conn.execute(
                    schema_versions.insert().values(
                        component=component, version=latest, applied_at=now
                    )
                )
            else:
                conn.execute(
                    schema_versions.update()
                    .where(schema_versions.c.component == component)
                    .values(version=latest, applied_at=now)
                )
    return applied


def newer_schema_error(component: str, found: int, expected: int) -> SchemaVersionError:
    return SchemaVersionError(
        component,
        found,
        expected,
        f"the database's {component} schema is version {found}, newer than version "
        f"{expected} that this onceonly understands; it was written by a newer release. "
        f"Upgrade onceonly (never downgrade a store in place); nothing was changed.",
    )


def older_schema_error(component: str, found: int, expected: int) -> SchemaVersionError:
    return SchemaVersionError(
        component,
        found,
        expected,
        f"the database's {component} schema is version {found}; this onceonly needs "
        f"version {expected}. Run `onceonly migrate --url <database url>` (or "
        f"`onceonly migrate --url <url> --sql` to review the SQL first); nothing was changed.",
    )
