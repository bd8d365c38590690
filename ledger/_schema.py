"""Tables of the effects ledger (component ``ledger`` in ``onceonly_schema``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)
from sqlalchemy.schema import CreateIndex, CreateTable

from checkpoint import Migration, migrate_component

metadata = MetaData()

effects = Table(
    "oo_effects",
    metadata,
    Column("key_id", String(64), primary_key=True),
    Column("tenant", String(200), nullable=False),
    Column("run_id", String(200), nullable=True),
    Column("step_id", String(200), nullable=True),
    Column("effect", String(200), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("provider_key", String(80), nullable=False),
    Column("provider_class", String(1), nullable=False),
    Column("window_s", Float, nullable=True),
    Column("status", String(16), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("lease_owner", String(200), nullable=True),
    Column("lease_expires_at", Float, nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("outcome_class", String(16), nullable=True),
    Column("subject", String(200), nullable=False),
    Column("secret_id", String(64), nullable=False),
    Column("chain", String(220), nullable=False),
    Column("args_ct", LargeBinary, nullable=True),
    Column("result_ct", LargeBinary, nullable=True),
    Column("error_ct", LargeBinary, nullable=True),
    Column("first_sent_at", Float, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    sqlite_with_rowid=False,
)
# The only secondary index: a run's effects are prefetched in one range scan. Status
# queries (operators listing in-doubt entries) scan; indexing status would add a page
# write to every transition on the hot path.
effects_by_run = Index("oo_effects_run", effects.c.run_id)

audit = Table(
    "oo_audit",
    metadata,
    Column("chain", String(220), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("key_id", String(64), nullable=False),
    Column("event", String(24), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("actor", String(200), nullable=False),
    Column("detail", Text, nullable=False),
    Column("row_digest", LargeBinary, nullable=False),
    Column("at", Float, nullable=False),
    Column("prev_hash", LargeBinary, nullable=False),
    Column("hash", LargeBinary, nullable=False),
    PrimaryKeyConstraint("chain", "seq"),
    sqlite_with_rowid=False,
)

# Reads check a row against its key's last audit event, and a claim of a new key checks
# that the key has no events (a deleted row): both seek by (chain, key_id), newest first.
audit_by_key = Index("oo_audit_key", audit.c.chain, audit.c.key_id, audit.c.seq)

data_keys = Table(
    "oo_data_keys",
    metadata,
    Column("subject", String(200), primary_key=True),
    Column("secret_id", String(64), nullable=False),
    Column("wrapped", LargeBinary, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("erased_at", Float, nullable=True),
)

LEDGER_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "effects, hash-chained audit events per run, wrapped data keys",
        (
            CreateTable(effects),
            CreateIndex(effects_by_run),
            CreateTable(audit),
            CreateTable(data_keys),
        ),
    ),
    Migration(
        2,
        "index of audit events by key: every read checks a row against its last event",
        (CreateIndex(audit_by_key),),
    ),
)
LEDGER_SCHEMA_VERSION = LEDGER_MIGRATIONS[-1].version

COLUMNS: tuple[str, ...] = tuple(c.name for c in effects.columns)


def migrate(url_or_engine: Any, *, sql: bool = False) -> str:
    """Bring the ledger schema to this release's version (or return its SQL, without the
    version table, which :func:`checkpoint.migrate`'s SQL creates)."""
    return migrate_component(
        url_or_engine, "ledger", LEDGER_MIGRATIONS, sql=sql, version_table=False
    )
