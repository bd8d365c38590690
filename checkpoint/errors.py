"""Errors raised by the checkpoint core.

Every error onceonly raises derives from :class:`OnceOnlyError`; the upper layers
(``ledger``, ``adapters``, ``onceonly``) extend this tree rather than start their own::

    OnceOnlyError
    ├── ConfigurationError          a setting is missing, malformed or too weak
    │   └── WeakDurabilityError     SQLite pragmas read back weaker than required
    ├── StoreError                  the database refused or failed (driver errors chained)
    │   ├── DatabaseLocked          another writer held the lock past busy_timeout
    │   ├── DatabaseUnavailable     the database cannot be opened or reached, or went away
    │   ├── ConcurrentWrite         another writer advanced the run first
    │   │   └── CheckpointLost      a queued (async / exit) checkpoint lost that race
    │   └── RunExists               a run with this id already exists
    ├── SchemaVersionError          the store's schema is older or newer than this code
    ├── CodecError                  a value cannot be encoded (raised at save time)
    ├── CorruptRecord               a stored blob or row fails its integrity check
    │   └── UnknownCodecTag         a stored value carries a tag this codec does not know
    ├── StateVersionError           a checkpoint's state schema cannot be brought to current
    ├── NotFound                    no such run, checkpoint or wait
    │   ├── RunNotFound
    │   ├── CheckpointNotFound
    │   └── WaitNotFound
    ├── WaitRefused                 an approval, rejection or signal was not accepted
    ├── LeaseHeld                   another worker holds the run's lease
    └── AsyncWriteError             a background (async durability) write failed earlier

Errors carry structured fields (``run_id``, ``seq``, ``blob``) and their message says
what to do about them.
"""

from __future__ import annotations

__all__ = [
    "AsyncWriteError",
    "CheckpointLost",
    "CheckpointNotFound",
    "CodecError",
    "ConcurrentWrite",
    "ConfigurationError",
    "CorruptRecord",
    "DatabaseLocked",
    "DatabaseUnavailable",
    "LeaseHeld",
    "NotFound",
    "OnceOnlyError",
    "RunExists",
    "RunNotFound",
    "RunRolledBack",
    "SchemaVersionError",
    "StateVersionError",
    "StoreError",
    "UnknownCodecTag",
    "WaitNotFound",
    "WaitRefused",
    "WeakDurabilityError",
]


class OnceOnlyError(Exception):
    """Root of every error raised by onceonly."""


class ConfigurationError(OnceOnlyError):
    """A setting is missing, malformed, or weaker than onceonly requires."""


class WeakDurabilityError(ConfigurationError):
    """The database reports durability settings weaker than required.

    Attributes:
        setting: The pragma or parameter that is too weak.
        actual: The value the database reported.
        required: The value onceonly requires.
    """

    def __init__(self, setting: str, actual: object, required: object) -> None:
        self.setting = setting
        self.actual = actual
        self.required = required
        super().__init__(
            f"SQLite reports {setting}={actual!r}, weaker than the required {required!r}; "
            f"a crash could lose or tear committed checkpoints. Open the store on a local "
            f"file system that supports {setting}={required!r} (not a network share or "
            f"an in-memory database), or do not override this pragma."
        )


class StoreError(OnceOnlyError):
    """The database refused or failed an operation; the driver error is chained.

    Attributes:
        transient: The failure passes by itself (a lock held past ``busy_timeout``, a
            connection refused, lost or terminated, a serialization failure or deadlock):
            the same call may succeed later. The store has retried it already, for its
            :class:`~checkpoint.DatabaseRetry` budget, before raising it.
        may_have_committed: The connection was lost while COMMIT was on its way: the
            transaction may or may not have been written (it was not run again).
    """

    def __init__(
        self, *args: object, transient: bool = False, may_have_committed: bool = False
    ) -> None:
        super().__init__(*args)
        self.transient = transient
        self.may_have_committed = may_have_committed


class DatabaseLocked(StoreError):
    """Another writer held the database lock for longer than ``busy_timeout``
    (transient: retried by the store before it is raised)."""


class DatabaseUnavailable(StoreError):
    """The database cannot be opened or reached, or the connection to it was lost
    (transient, except a SQLite file that cannot be opened)."""


class ConcurrentWrite(StoreError):
    """Another writer advanced the run between this writer's read and its write.

    Attributes:
        run_id: The run that was written concurrently.
        expected_seq: The head this writer expected.
    """

    def __init__(self, run_id: str, expected_seq: int) -> None:
        self.run_id = run_id
        self.expected_seq = expected_seq
        super().__init__(
            f"run {run_id!r} advanced past checkpoint {expected_seq} in another writer; "
            f"nothing was written. Take the run's lease before writing (Store.acquire_lease), "
            f"reload it with Store.load and apply the step again."
        )


class CheckpointLost(ConcurrentWrite):
    """Checkpoints of this run that were queued (``async`` or ``exit`` durability) were
    not written, because another writer advanced the run first. Raised once, by the next
    save or load of that run; other runs in the same group commit were written.

    Attributes:
        run_id: The run.
        expected_seq: The head the first lost checkpoint was built on.
    """

    def __init__(self, run_id: str, expected_seq: int) -> None:
        self.run_id = run_id
        self.expected_seq = expected_seq
        StoreError.__init__(
            self,
            f"queued checkpoints of run {run_id!r} after checkpoint {expected_seq} were not "
            f"written: another writer advanced the run first (its checkpoint stands). "
            f"Reload the run with Store.load and apply the step again.",
        )


class RunExists(StoreError):
    """A run with this id already exists; nothing was written."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(
            f"a run {run_id!r} already exists; load it with Store.load({run_id!r}) to resume "
            f"it, or pick another run id"
        )


class SchemaVersionError(OnceOnlyError):
    """The database schema is older or newer than this version of onceonly.

    Attributes:
        component: The schema component (``checkpoint``, ``ledger``).
        found: The version recorded in the database.
        expected: The version this code needs.
    """

    def __init__(self, component: str, found: int, expected: int, message: str) -> None:
        self.component = component
        self.found = found
        self.expected = expected
        super().__init__(message)


class CodecError(OnceOnlyError):
    """A value cannot be encoded; raised when saving, never first discovered when loading."""


class CorruptRecord(OnceOnlyError):
    """A stored blob or row failed its integrity check and was not used.

    Attributes:
        run_id: The run the record belongs to, when known.
        seq: The checkpoint sequence number, when known.
        blob: The hex digest of the blob, when the record is a blob.
        detail: What exactly failed.
    """

    def __init__(
        self,
        detail: str,
        *,
        run_id: str | None = None,
        seq: int | None = None,
        blob: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.detail = detail
        self.run_id = run_id
        self.seq = seq
        self.blob = blob
        where = []
        if run_id is not None:
            where.append(f"run {run_id!r}")
        if seq is not None:
            where.append(f"checkpoint {seq}")
        if blob is not None:
            where.append(f"blob {blob}")
        place = ", ".join(where) if where else "a stored record"
        if hint is None:
            hint = (
                "The record was not used. Restore the database from a backup, or load an "
                "earlier checkpoint that still verifies (Store.load(run_id, seq)) and carry "
                "on from it in a new run."
            )
        super().__init__(f"{place}: {detail}." + (f" {hint}" if hint else ""))


class RunRolledBack(CorruptRecord):
    """A run row is older than its witness saw: the store was restored from an older
    copy (or the row put back). Nothing is done with the run until an operator accepts
    the restore (``onceonly audit accept-restore``).

    Attributes:
        revision: The row's revision in the store.
        witnessed: The revision the witness saw.
    """

    def __init__(self, run_id: str, revision: int, witnessed: int, path: str) -> None:
        self.revision = revision
        self.witnessed = witnessed
        super().__init__(
            f"the store is behind its witness {path}: the run's row is at revision "
            f"{revision}, the witness saw {witnessed} (a restore or rollback); nothing is "
            f"done with it. Reconcile what happened since the backup, then run `onceonly "
            f"audit accept-restore --as <you> --reason <why>`",
            run_id=run_id,
            hint="",
        )


class UnknownCodecTag(CorruptRecord):
    """A stored value carries a type tag this codec does not know.

    Usually a dataclass that was registered by the code that wrote the value and is not
    registered here: register it (``Codec.register``) or load with the writer's codec.
    """


class StateVersionError(OnceOnlyError):
    """A checkpoint's state schema version cannot be brought to the current one.

    Attributes:
        run_id: The run.
        found: The state schema version stored with the checkpoint.
        current: The version the caller's migrations produce.
    """

    def __init__(self, run_id: str, found: int, current: int, message: str) -> None:
        self.run_id = run_id
        self.found = found
        self.current = current
        super().__init__(message)


class NotFound(OnceOnlyError):
    """No such record."""


class RunNotFound(NotFound):
    """No run with this id exists in the store."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"no run {run_id!r} in this store; list runs with `onceonly runs list`")


class CheckpointNotFound(NotFound):
    """The run has no checkpoint with this sequence number (or none at all)."""

    def __init__(self, run_id: str, seq: int | None) -> None:
        self.run_id = run_id
        self.seq = seq
        what = "no checkpoint yet" if seq is None else f"no checkpoint {seq}"
        super().__init__(f"run {run_id!r} has {what}; see Store.history({run_id!r})")


class WaitNotFound(NotFound):
    """The run has no wait (approval, signal or timer) with this name."""

    def __init__(self, run_id: str, name: str) -> None:
        self.run_id = run_id
        self.name = name
        super().__init__(
            f"run {run_id!r} has no wait named {name!r}; see `onceonly runs show {run_id}`"
        )


class WaitRefused(OnceOnlyError):
    """An approval, rejection or signal was refused; nothing was recorded.

    Attributes:
        run_id: The run.
        name: The wait.
        reason: Machine-readable reason: ``decided`` (already approved, rejected,
            expired or cancelled), ``expired``, ``subject_changed`` (the hash given is not
            the hash of what was requested), ``self_approval``, ``not_approval`` or
            ``kind_mismatch``.
    """

    def __init__(self, run_id: str, name: str, reason: str, message: str) -> None:
        self.run_id = run_id
        self.name = name
        self.reason = reason
        super().__init__(message)


class LeaseHeld(OnceOnlyError):
    """Another worker holds a live lease on the run.

    Attributes:
        run_id: The run.
        owner: The current lease owner.
        expires_at: When the lease expires (UNIX seconds).
    """

    def __init__(self, run_id: str, owner: str, expires_at: float) -> None:
        self.run_id = run_id
        self.owner = owner
        self.expires_at = expires_at
        super().__init__(
            f"run {run_id!r} is leased by {owner!r} until {expires_at:.3f}; wait for the "
            f"lease to expire or for that worker to release it"
        )


class AsyncWriteError(OnceOnlyError):
    """A background write (durability ``async``) failed; the original error is chained.

    The checkpoints queued after the failed one were not written. Reload the run from
    the store to see what was made durable.
    """
