"""onceonly's compact checkpoint core: runs, delta + keyframe checkpoints, blobs.

The bottom layer of onceonly; it imports nothing from ``ledger``, ``adapters`` or
``onceonly``.
"""

from ._delta import ChunkedList
from ._schema import Migration, apply_migrations, pending_sql
from .codec import Codec
from .errors import (
    AsyncWriteError,
    CheckpointNotFound,
    CodecError,
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    DatabaseLocked,
    DatabaseUnavailable,
    LeaseHeld,
    NotFound,
    OnceOnlyError,
    RunExists,
    RunNotFound,
    SchemaVersionError,
    StateVersionError,
    StoreError,
    UnknownCodecTag,
    WeakDurabilityError,
)
from .records import (
    CheckpointInfo,
    Durability,
    Handoff,
    KeyframePolicy,
    RetentionPolicy,
    RetentionReport,
    Run,
    RunStatus,
    Snapshot,
    Source,
    StateMigrations,
)
from .store import Store, ensure_schema, migrate, migrate_component

__all__ = [
    "AsyncWriteError",
    "CheckpointInfo",
    "CheckpointNotFound",
    "ChunkedList",
    "Codec",
    "CodecError",
    "ConcurrentWrite",
    "ConfigurationError",
    "CorruptRecord",
    "DatabaseLocked",
    "DatabaseUnavailable",
    "Durability",
    "Handoff",
    "KeyframePolicy",
    "LeaseHeld",
    "Migration",
    "NotFound",
    "OnceOnlyError",
    "RetentionPolicy",
    "RetentionReport",
    "Run",
    "RunExists",
    "RunNotFound",
    "RunStatus",
    "SchemaVersionError",
    "Snapshot",
    "Source",
    "StateMigrations",
    "StateVersionError",
    "Store",
    "StoreError",
    "UnknownCodecTag",
    "WeakDurabilityError",
    "apply_migrations",
    "ensure_schema",
    "migrate",
    "migrate_component",
    "pending_sql",
]
