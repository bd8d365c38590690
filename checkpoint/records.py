"""Records and small frozen policies of the checkpoint core."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError

__all__ = [
    "ENDED",
    "CheckpointInfo",
    "Durability",
    "Handoff",
    "KeyframePolicy",
    "RetentionPolicy",
    "RetentionReport",
    "Run",
    "RunStatus",
    "Snapshot",
    "Source",
    "StateMigrations",
]


class RunStatus(enum.StrEnum):
    """Where a run is in its life."""

    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


ENDED: frozenset[RunStatus] = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED}
)
"""The statuses a run ends in: nothing drives it on from there (an operator's retry or
fork does), and retention may remove it."""


class Source(enum.StrEnum):
    """Who wrote a checkpoint."""

    STEP = "step"
    OPERATOR = "operator"
    MIGRATION = "migration"


class Durability(enum.StrEnum):
    """When checkpoints become durable.

    * ``SYNC``: before :meth:`Store.save` returns.
    * ``ASYNC``: a background writer commits queued checkpoints in groups while the next
      step runs; a crash loses at most the checkpoints not yet committed, never corrupts.
      Errors surface on the next call, on :meth:`Store.flush` and on close.
    * ``EXIT``: only at :meth:`Store.flush` (suspension, exit, before an effect) and close.

    In every mode :meth:`Store.flush` is a write barrier: when it returns, every
    checkpoint saved before it is durable.
    """

    SYNC = "sync"
    ASYNC = "async"
    EXIT = "exit"


@dataclass(frozen=True)
class Handoff:
    """The intent layer a resumed agent reads: what the run is for and where it stands.

    Attributes:
        goal: What "done" means for the whole run.
        done: What has been completed.
        next: What comes next.
        ruled_out: What was tried or considered and rejected, so it is not explored again.
    """

    goal: str = ""
    done: tuple[str, ...] = ()
    next: tuple[str, ...] = ()
    ruled_out: tuple[str, ...] = ()

    def to_doc(self) -> dict[str, Any]:
        """The note as plain data (what its stored forms encode)."""
        return {
            "goal": self.goal,
            "done": list(self.done),
            "next": list(self.next),
            "ruled_out": list(self.ruled_out),
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Handoff:
        """The note :meth:`to_doc` gave.

        Raises:
            KeyError, TypeError: ``doc`` is not such a note.
        """
        return cls(
            goal=str(doc["goal"]),
            done=tuple(doc["done"]),
            next=tuple(doc["next"]),
            ruled_out=tuple(doc["ruled_out"]),
        )


@dataclass(frozen=True)
class Run:
    """A durable run as stored.

    Attributes:
        run_id: Unique id.
        flow: The flow (workflow, agent) name.
        code_version: The version of the code that created or last advanced the run.
        state_version: The state-schema version of the run's latest checkpoint.
        status: Where the run is in its life.
        next_step: The step to run next, if any.
        lease_owner: The worker holding the run, if any.
        lease_expires_at: When that lease expires (UNIX seconds).
        handoff: The run's handoff note.
        head_seq: The sequence number of the latest checkpoint (None before the first).
        created_at: UNIX seconds.
        updated_at: UNIX seconds.
    """

    run_id: str
    flow: str
    code_version: str
    state_version: int
    status: RunStatus
    next_step: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    handoff: Handoff
    head_seq: int | None
    created_at: float
    updated_at: float
    #: The digest of the run's waits as last written (covered by the run's seal), so a
    #: wait row put back to an earlier, genuinely sealed version is refused; None
    #: without integrity keys, and for runs sealed before schema version 5.
    waits_digest: bytes | None = field(default=None, repr=False, compare=False)
    #: The revision of the run's row: one more at every sealed write (a checkpoint, a
    #: status change, a wait decided); what a witness records (0 before schema 5).
    rev: int = field(default=0, repr=False, compare=False)


@dataclass(frozen=True)
class CheckpointInfo:
    """Metadata of one checkpoint.

    Attributes:
        run_id: The run.
        seq: Position in the run's history, from 0.
        step: The step that produced it.
        source: Who wrote it (step, operator, migration).
        schema_version: The state-schema version of its state.
        created_at: UNIX seconds.
        keyframe: Whether it stores the full state (else only changes since its parent).
        keyframe_seq: The keyframe a load of this checkpoint starts from.
        digest: The checkpoint row's digest: what identifies this exact checkpoint (two
            writers racing for one sequence number write different digests).
    """

    run_id: str
    seq: int
    step: str
    source: Source
    schema_version: int
    created_at: float
    keyframe: bool
    keyframe_seq: int
    digest: bytes = field(default=b"", repr=False, compare=False)


@dataclass(frozen=True)
class Snapshot:
    """A loaded checkpoint: its state (a fresh dict the caller owns) and metadata."""

    state: dict[str, Any]
    info: CheckpointInfo


@dataclass(frozen=True)
class KeyframePolicy:
    """When a checkpoint stores the full state instead of a delta.

    A new keyframe is written when either bound is reached, so loading the latest
    checkpoint reads one keyframe and at most ``max_deltas`` deltas whose total size is
    at most about ``replay_ratio`` times the state: independent of history length.

    Attributes:
        max_deltas: Deltas after which the next checkpoint is a keyframe.
        replay_ratio: Bytes of deltas since the keyframe, relative to the keyframe's
            size, after which the next checkpoint is a keyframe.
    """

    max_deltas: int = 256
    replay_ratio: float = 2.0

    def __post_init__(self) -> None:
        if self.max_deltas < 0:
            raise ConfigurationError("KeyframePolicy.max_deltas must be >= 0")
        if self.replay_ratio <= 0:
            raise ConfigurationError("KeyframePolicy.replay_ratio must be > 0")


@dataclass(frozen=True)
class RetentionPolicy:
    """Which finished runs to remove, and how.

    Waiting and running runs are never touched, whatever ``statuses`` says.

    Attributes:
        older_than_s: Only runs not updated for at least this many seconds.
        statuses: Which statuses are eligible.
        archive_path: When set, each run is appended to this JSONL file (run record,
            latest state in canonical codec JSON, history) before it is deleted.
    """

    older_than_s: float
    statuses: tuple[RunStatus, ...] = tuple(s for s in RunStatus if s in ENDED)
    archive_path: str | None = None

    def __post_init__(self) -> None:
        if self.older_than_s < 0:
            raise ConfigurationError("RetentionPolicy.older_than_s must be >= 0")
        live = {RunStatus.WAITING, RunStatus.RUNNING} & set(self.statuses)
        if live:
            raise ConfigurationError(
                f"retention never removes live runs; drop {sorted(live)} from statuses"
            )


@dataclass(frozen=True)
class RetentionReport:
    """What :meth:`Store.apply_retention` did."""

    runs_deleted: int
    runs_archived: int
    blobs_collected: int


Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class StateMigrations:
    """Upgrade functions for a flow's state schema.

    ``upgrades[v]`` turns a state of version ``v`` into version ``v + 1``. Loading a
    checkpoint older than ``current`` applies them in order and records the result as a
    checkpoint with source ``migration``; a checkpoint newer than ``current`` is refused.

    Example::

        migrations = StateMigrations(current=2, upgrades={1: add_currency_field})
    """

    current: int
    upgrades: Mapping[int, Upgrade] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.current < 1:
            raise ConfigurationError("StateMigrations.current must be >= 1")
        missing = [v for v in self.upgrades if v >= self.current or v < 1]
        if missing:
            raise ConfigurationError(
                f"upgrades for versions {missing} cannot exist below current={self.current}"
            )
