"""Errors raised by the effects ledger, extending the tree rooted in
:class:`checkpoint.errors.OnceOnlyError`::

    OnceOnlyError
    └── LedgerError
        ├── KeyReuseError        same key, different arguments: the run diverged
        ├── LeaseLost            a stale worker's transition was refused (fencing)
        ├── EffectInFlight       another worker holds a live claim on the key
        ├── EffectInDoubt        the effect may or may not have happened: reconcile it
        ├── EffectFailed         the effect failed definitely (recorded; replayed as such)
        ├── ResultUnknown        the effect happened, but its result was never recorded
        ├── PayloadErased        the effect's data key was erased; its payload is gone
        ├── SubjectErased        a new effect for an erased data subject is refused
        ├── LedgerUnavailable    the ledger cannot be written: nothing is acted on
        ├── UnknownEffect        no entry with this key id
        ├── InvalidTransition    the entry is not in a state that allows this change
        └── RunFenced            the run moved on (cancelled, edited, lease lost): no claim
    CorruptRecord (checkpoint)
    └── StoreRolledBack          the store is behind its witness (restored): nothing acts

Every error carries the ``key_id`` it is about, where there is one, and says what to do.
"""

from __future__ import annotations

from typing import Any

from onceonly.checkpoint.errors import CorruptRecord, OnceOnlyError

__all__ = [
    "EffectFailed",
    "EffectInDoubt",
    "EffectInFlight",
    "InvalidTransition",
    "KeyReuseError",
    "LeaseLost",
    "LedgerError",
    "LedgerUnavailable",
    "PayloadErased",
    "ResultUnknown",
    "RunFenced",
    "StoreRolledBack",
    "SubjectErased",
    "UnknownEffect",
]


class LedgerError(OnceOnlyError):
    """Root of the ledger's errors."""

    key_id: str | None = None


class KeyReuseError(LedgerError):
    """The key was recorded with other arguments: the run diverged; nothing was replayed.

    Attributes:
        key_id: The effect's key id.
        effect: The effect name@version.
    """

    def __init__(self, key_id: str, effect: str) -> None:
        self.key_id = key_id
        self.effect = effect
        super().__init__(
            f"effect {effect} with key {key_id[:16]}… was recorded with different "
            f"arguments: the run diverged from its recorded history (or two different calls "
            f"share a key). Nothing was sent or replayed. Fix the key recipe so distinct calls "
            f"get distinct keys, or resolve the run's divergence by hand."
        )


class LeaseLost(LedgerError):
    """This worker's claim is stale: another worker or an operator moved the entry on.

    Attributes:
        key_id: The effect's key id.
        epoch: The epoch this worker held.
        current_epoch: The entry's epoch now.
        status: The entry's status now.
    """

    def __init__(self, key_id: str, epoch: int, current_epoch: int, status: str) -> None:
        self.key_id = key_id
        self.epoch = epoch
        self.current_epoch = current_epoch
        self.status = status
        super().__init__(
            f"claim on {key_id[:16]}… at epoch {epoch} is stale (entry is {status} at epoch "
            f"{current_epoch}); nothing was changed. Stop this attempt: the entry belongs to "
            f"whoever moved it on."
        )


class EffectInFlight(LedgerError):
    """Another worker holds a live claim on this key.

    Attributes:
        key_id: The effect's key id.
        owner: The claim's owner.
        expires_at: When its lease expires (UNIX seconds).
    """

    def __init__(self, key_id: str, owner: str, expires_at: float) -> None:
        self.key_id = key_id
        self.owner = owner
        self.expires_at = expires_at
        super().__init__(
            f"effect {key_id[:16]}… is being performed by {owner!r} (lease until "
            f"{expires_at:.3f}); wait for its outcome instead of acting"
        )


class EffectInDoubt(LedgerError):
    """The effect may have happened: it is UNKNOWN or NEEDS_HUMAN, and must not be re-sent.

    Attributes:
        key_id: The effect's key id.
        status: ``unknown`` or ``needs_human``.
        provider_class: A, B or C.
    """

    def __init__(self, key_id: str, status: str, provider_class: str, detail: str = "") -> None:
        self.key_id = key_id
        self.status = status
        self.provider_class = provider_class
        todo = (
            "an operator must check the provider and run `onceonly effects resolve "
            f"{key_id} --happened|--not-happened --evidence TEXT`"
            if status == "needs_human"
            else "reconcile it with the adapter's probe (Ledger.reconcile) or an operator "
            f"decision (`onceonly effects resolve {key_id} ...`)"
        )
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"effect {key_id[:16]}… is in doubt: {status}{extra}; it was not re-sent. {todo}"
        )


class EffectFailed(LedgerError):
    """The effect failed definitely; the recorded error is replayed, never retried.

    Attributes:
        key_id: The effect's key id.
        error_type: The recorded error's type name.
        message: The recorded error's message.
        info: The recorded error details (a dict), or None if erased.
    """

    def __init__(self, key_id: str, error_type: str, message: str, info: Any = None) -> None:
        self.key_id = key_id
        self.error_type = error_type
        self.message = message
        self.info = info
        super().__init__(f"effect {key_id[:16]}… failed definitely: {error_type}: {message}")


class ResultUnknown(LedgerError):
    """The effect happened, but its result was never recorded: an operator resolved it as
    happened without giving the provider's result. Nothing was sent again.

    A step that needs the result cannot go on; one that does not may catch this. Record
    the result with ``onceonly effects correct KEY --result JSON --evidence TEXT`` (or
    :meth:`ledger.Ledger.correct`), then retry the run: the effect replays it.

    Attributes:
        key_id: The effect's key id.
        detail: What was tried to learn the result (a probe's answer), if anything.
    """

    def __init__(self, key_id: str, detail: str = "") -> None:
        self.key_id = key_id
        self.detail = detail
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"effect {key_id[:16]}… happened, but its result is unknown (it was resolved as "
            f"happened without one){extra}; it was not sent again. Record the provider's "
            f"result with `onceonly effects correct {key_id} --result JSON --evidence TEXT`, "
            f"then retry the run"
        )


class PayloadErased(LedgerError):
    """The effect's arguments and result were erased with its data subject.

    The entry still deduplicates: the effect is not performed again.
    """

    def __init__(self, key_id: str, subject: str) -> None:
        self.key_id = key_id
        self.subject = subject
        super().__init__(
            f"effect {key_id[:16]}… happened, but its recorded payload was erased with data "
            f"subject {subject!r}; it is not performed again and its result cannot be replayed"
        )


class SubjectErased(LedgerError):
    """The data subject was erased: new effects that would store its data are refused."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        super().__init__(
            f"data subject {subject!r} was erased; a new effect storing its data was refused "
            f"and nothing was sent. Use another subject (Ledger.claim(subject=...)) if the "
            f"effect must happen."
        )


class LedgerUnavailable(LedgerError):
    """The ledger could not be written; nothing was acted on.

    After a failed outcome write the ledger object refuses all further work (fail closed):
    stop the worker, fix the database, and start a new one; it recovers from disk.
    """


class UnknownEffect(LedgerError):
    """No ledger entry has this key id."""

    def __init__(self, key_id: str) -> None:
        self.key_id = key_id
        super().__init__(
            f"no effect with key id {key_id!r}; list them with `onceonly effects list`"
        )


class InvalidTransition(LedgerError):
    """The entry's state does not allow the requested change."""

    def __init__(self, key_id: str, status: str, wanted: str) -> None:
        self.key_id = key_id
        self.status = status
        super().__init__(f"effect {key_id[:16]}… is {status}; cannot {wanted}")


class RunFenced(LedgerError):
    """A claim was refused because the run it acts for is no longer where the step
    started: it was cancelled, failed or completed, another writer advanced its head (an
    operator's edit or cancel, a deploy's migration), or another worker took its lease.
    Nothing was claimed and nothing is acted on; the step's work is dropped and the run
    goes on from its durable head.

    Attributes:
        run_id: The run.
        reason: ``not_running``, ``moved``, ``lease``, ``gone`` or ``deadline`` (the
            step's timeout or the run's deadline came).
        status: The run's status as the claim saw it (None when the run is gone).
    """

    def __init__(self, run_id: str, reason: str, status: str | None, detail: str) -> None:
        self.run_id = run_id
        self.reason = reason
        self.status = status
        super().__init__(
            f"run {run_id!r}: no new effect is claimed for it ({detail}); nothing was sent"
        )


LEDGER_HINT = (
    "Find out what changed (`onceonly effects show KEY`), then settle the entry by hand "
    "(`onceonly effects resolve`) or restore a backup you trust."
)
"""What a ledger-side :class:`CorruptRecord` tells the operator to do (a checkpoint's
says how to carry on from an earlier checkpoint instead)."""


class StoreRolledBack(CorruptRecord):
    """The store is behind its witness: it was restored from an older copy (or rolled
    back). Nothing is acted on until an operator accepts the restore.

    Attributes:
        chain: The chain found behind.
        seq: Its head in the store.
        witnessed: The head the witness saw.
    """

    def __init__(self, chain: str, seq: int, witnessed: int, path: str) -> None:
        self.chain = chain
        self.seq = seq
        self.witnessed = witnessed
        super().__init__(
            f"the store is behind its witness {path}: chain {chain!r} is at event {seq}, "
            f"the witness saw {witnessed} (a restore or rollback); nothing is acted on. "
            f"Reconcile what happened since the backup, then run `onceonly audit "
            f"accept-restore --as <you> --reason <why>`",
            run_id=None if chain.startswith("tenant:") else chain,
            hint="",
        )
