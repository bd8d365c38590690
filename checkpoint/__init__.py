"""onceonly's compact checkpoint core: runs, delta + keyframe checkpoints, blobs.

The bottom layer of onceonly; it imports nothing from ``ledger``, ``adapters`` or
``onceonly``.
"""

if __name__ != "onceonly.checkpoint":  # imported as a top-level module (from a checkout's root)
    raise ImportError(
        f"import onceonly.checkpoint, not {__name__}: the folder checkpoint/ is the package "
        f"onceonly.checkpoint (a second copy under another name would not share its state)"
    )


from ._delta import ChunkedList
from ._engine import redact, safe_url, scrub
from ._retry import DatabaseRetry, interrupt_retries, is_transient
from ._schema import Migration, OnlyOn, apply_migrations, pending_sql
from .codec import Codec, Opaque
from .errors import (
    AsyncWriteError,
    CheckpointLost,
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
    RunRolledBack,
    SchemaVersionError,
    StateVersionError,
    StoreError,
    UnknownCodecTag,
    WaitNotFound,
    WaitRefused,
    WeakDurabilityError,
)
from .failpoints import arm, armed, disarm, failpoint
from .integrity import RowKeys
from .records import (
    ENDED,
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
from .waits import Wait, WaitKind, Waits, WaitStatus, notify_ready, subject_hash

__all__ = [
    "ENDED",
    "AsyncWriteError",
    "CheckpointInfo",
    "CheckpointLost",
    "CheckpointNotFound",
    "ChunkedList",
    "Codec",
    "CodecError",
    "ConcurrentWrite",
    "ConfigurationError",
    "CorruptRecord",
    "DatabaseLocked",
    "DatabaseRetry",
    "DatabaseUnavailable",
    "Durability",
    "Handoff",
    "KeyframePolicy",
    "LeaseHeld",
    "Migration",
    "NotFound",
    "OnceOnlyError",
    "OnlyOn",
    "Opaque",
    "RetentionPolicy",
    "RetentionReport",
    "RowKeys",
    "Run",
    "RunExists",
    "RunNotFound",
    "RunRolledBack",
    "RunStatus",
    "SchemaVersionError",
    "Snapshot",
    "Source",
    "StateMigrations",
    "StateVersionError",
    "Store",
    "StoreError",
    "UnknownCodecTag",
    "Wait",
    "WaitKind",
    "WaitNotFound",
    "WaitRefused",
    "WaitStatus",
    "Waits",
    "WeakDurabilityError",
    "apply_migrations",
    "arm",
    "armed",
    "disarm",
    "ensure_schema",
    "failpoint",
    "interrupt_retries",
    "is_transient",
    "migrate",
    "migrate_component",
    "notify_ready",
    "pending_sql",
    "redact",
    "safe_url",
    "scrub",
    "subject_hash",
]
