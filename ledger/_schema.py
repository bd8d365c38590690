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
from sqlalchemy.schema import CreateIndex, CreateTable, DropIndex

from onceonly.checkpoint import Migration, migrate_component
from onceonly.checkpoint._schema import OnlyOn, _sql

metadata = MetaData()


def _effects_table(meta: MetaData, *, sealed: bool) -> Table:
    """``oo_effects`` before ledger schema version 3 (for migration 1) or now (sealed)."""
    return Table(
        "oo_effects",
        meta,
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
        *([Column("seal", LargeBinary, nullable=True)] if sealed else []),
        sqlite_with_rowid=False,
    )


_v1 = MetaData()
_effects_v1 = _effects_table(_v1, sealed=False)
_effects_v1_by_run = Index("oo_effects_run", _effects_v1.c.run_id)
_effects_v3 = _effects_table(MetaData(), sealed=True)
_effects_v3_by_run = Index("oo_effects_run", _effects_v3.c.run_id)
effects = _effects_table(metadata, sealed=True)
# The only secondary index: a run's effects are prefetched in one range scan, and a step's
# (what its earlier attempt recorded) in a range of that range, however long the run.
# Status queries (operators listing in-doubt entries) scan; indexing status would add a
# page write to every transition on the hot path.
effects_by_run = Index("oo_effects_run_step", effects.c.run_id, effects.c.step_id)


def _audit_table(meta: MetaData, *, sealed: bool) -> Table:
    """``oo_audit`` before ledger schema version 3 (for migration 1) or now (sealed)."""
    return Table(
        "oo_audit",
        meta,
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
        *([Column("mac", LargeBinary, nullable=True)] if sealed else []),
        PrimaryKeyConstraint("chain", "seq"),
        sqlite_with_rowid=False,
    )


_audit_v1 = _audit_table(_v1, sealed=False)
audit = _audit_table(metadata, sealed=True)

# Every chain's last event, sealed: a claim reads it in its transaction to know the chain
# is whole up to its head (deleted events, newest included, are refused), and a witness
# outside the database keeps heads a restored store has fallen behind.
chain_heads = Table(
    "oo_chain_heads",
    metadata,
    Column("chain", String(220), primary_key=True),
    Column("seq", Integer, nullable=False),
    Column("hash", LargeBinary, nullable=False),
    Column("seal", LargeBinary, nullable=True),
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
            CreateTable(_effects_v1),
            CreateIndex(_effects_v1_by_run),
            CreateTable(_audit_v1),
            CreateTable(data_keys),
        ),
    ),
    Migration(
        2,
        "index of audit events by key: every read checks a row against its last event",
        (CreateIndex(audit_by_key),),
    ),
    Migration(
        3,
        "keyed seals: every effect row and audit event is sealed, and every chain's head "
        "is kept sealed in oo_chain_heads (rows of earlier versions are sealed by "
        "`onceonly audit seal`)",
        (
            *(
                OnlyOn(dialect, _sql(f"ALTER TABLE {table} ADD COLUMN {col} {blob}"))
                for dialect, blob in (("sqlite", "BLOB"), ("postgresql", "BYTEA"))
                for table, col in (("oo_effects", "seal"), ("oo_audit", "mac"))
            ),
            CreateTable(chain_heads),
        ),
    ),
    Migration(
        4,
        "index of effects by run and step: a step reads what its earlier attempt "
        "recorded without reading the rest of the run",
        (DropIndex(_effects_v3_by_run), CreateIndex(effects_by_run)),
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
