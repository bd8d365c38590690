"""Records and policies of the effects ledger."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onceonly.checkpoint.errors import ConfigurationError, CorruptRecord

__all__ = [
    "UNKNOWN_RESULT",
    "Claim",
    "EffectRecord",
    "EffectStatus",
    "Evidence",
    "InFlightPolicy",
    "OutcomeClass",
    "ProviderClass",
    "Replay",
    "RetentionPolicy",
]


class _Unknown(enum.Enum):
    UNKNOWN_RESULT = "UNKNOWN_RESULT"

    def __repr__(self) -> str:
        return "UNKNOWN_RESULT"


UNKNOWN_RESULT: Any = _Unknown.UNKNOWN_RESULT
"""The result of an effect that happened when nobody knows what the provider answered:
the default of ``Ledger.resolve(..., happened=True)`` and ``Ledger.correct``. Recorded
apart from a result of ``None``; replaying it raises :class:`~ledger.ResultUnknown`."""


class EffectStatus(enum.StrEnum):
    """Where an effect entry is.

    ``CLAIMED`` is durable before the caller acts. A claim whose lease expired is treated
    as ``UNKNOWN``, never as free.
    """

    CLAIMED = "claimed"
    COMMITTED = "committed"
    FAILED = "failed"
    UNKNOWN = "unknown"
    NOT_HAPPENED = "not_happened"
    NEEDS_HUMAN = "needs_human"


class ProviderClass(enum.StrEnum):
    """What the provider can tell us about a call whose outcome we lost.

    * ``DEDUPLICATING`` (A): honours our key within a dedup window; an in-doubt call may
      be re-sent with the same provider key while the window is open.
    * ``QUERYABLE`` (B): can be asked whether our reference happened; an in-doubt call is
      probed, and re-sent only if the probe proves it did not happen.
    * ``OPAQUE`` (C): neither; an in-doubt call needs a human, never a blind re-send.
    """

    DEDUPLICATING = "A"
    QUERYABLE = "B"
    OPAQUE = "C"


class OutcomeClass(enum.StrEnum):
    """An attempt's outcome, classified by evidence (not by exception type alone)."""

    NOT_SENT = "not_sent"
    REJECTED = "rejected"
    AMBIGUOUS = "ambiguous"
    SUCCEEDED = "succeeded"


class Evidence(enum.StrEnum):
    """What reconciliation learnt about an in-doubt effect."""

    HAPPENED = "happened"
    NOT_HAPPENED = "not_happened"
    WINDOW_OPEN = "window_open"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class EffectRecord:
    """A ledger entry as stored (payloads decrypted only on request).

    Attributes:
        key_id: The entry's id (hex of the keyed idempotency key).
        tenant: Tenant.
        run_id: The run, if the effect belongs to one.
        step_id: The step, if any.
        effect: ``name@version``.
        fingerprint: Keyed fingerprint of the canonical arguments.
        provider_key: The key sent downstream.
        provider_class: A, B or C.
        window_s: Class A dedup window in seconds.
        status: Current status.
        epoch: Fencing epoch; bumped by every re-claim.
        lease_owner: Worker holding the claim, if CLAIMED.
        lease_expires_at: When that claim lapses.
        attempts: Sends attempted so far.
        outcome_class: The last attempt's classified outcome.
        subject: The data subject whose key encrypts the payloads.
        secret_id: The secret the key was derived with.
        first_sent_at: When the first attempt was claimed (class A window start).
        created_at: UNIX seconds.
        updated_at: UNIX seconds.
        integrity: What reading the row found: ``ok``; ``edited`` (it fails its keyed
            seal); ``unsealed`` (no seal: written before sealing or without the keyring);
            ``diverged`` (it differs from its last audit event, or that event fails its
            MAC; checked by :meth:`Ledger.get`). Operator reads show every row, flagged;
            the acting path refuses anything but ``ok``.
    """

    key_id: str
    tenant: str
    run_id: str | None
    step_id: str | None
    effect: str
    fingerprint: str
    provider_key: str
    provider_class: ProviderClass
    window_s: float | None
    status: EffectStatus
    epoch: int
    lease_owner: str | None
    lease_expires_at: float | None
    attempts: int
    outcome_class: OutcomeClass | None
    subject: str
    secret_id: str
    first_sent_at: float | None
    created_at: float
    updated_at: float
    integrity: str = "ok"


@dataclass(frozen=True)
class Claim:
    """This worker may act now: the intent is durable and fenced by ``epoch``.

    Send ``provider_key`` (and ``fencing_token`` where the provider checks one) with the
    call, then record the outcome with ``Ledger.commit`` / ``fail`` / ``mark_unknown``.
    """

    key_id: str
    epoch: int
    provider_key: str
    attempt: int
    lease_owner: str
    lease_expires_at: float
    provider_class: ProviderClass
    subject: str
    chain: str
    resend: bool = False

    @property
    def fencing_token(self) -> str:
        """``<provider key>:<epoch>``: providers that check it refuse stale epochs."""
        return f"{self.provider_key}:{self.epoch}"


@dataclass(frozen=True)
class Replay:
    """The effect already has a definite outcome: return it, do not act.

    Attributes:
        result: The recorded result (COMMITTED).
        record: The entry (built on first access: replaying is on the hot path).
    """

    result: Any
    row: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def record(self) -> EffectRecord:
        """The ledger entry this result was recorded in."""
        return effect_record(dict(self.row))


@dataclass(frozen=True)
class InFlightPolicy:
    """What a claimer does when another worker holds a live claim on the same key.

    Attributes:
        wait_s: How long to wait for that claim's outcome (0: raise EffectInFlight now).
        initial_backoff_s: First pause between polls; doubles up to ``max_backoff_s``.
        max_backoff_s: Longest pause.
    """

    wait_s: float = 5.0
    initial_backoff_s: float = 0.005
    max_backoff_s: float = 0.25

    def __post_init__(self) -> None:
        if self.wait_s < 0 or self.initial_backoff_s <= 0 or self.max_backoff_s <= 0:
            raise ConfigurationError("InFlightPolicy times must be positive")


@dataclass(frozen=True)
class RetentionPolicy:
    """When finished ledger entries may go.

    An entry is kept at least until its class-A dedup window has closed and it is older
    than ``older_than_s``, and while its run still exists. Entries that are CLAIMED,
    UNKNOWN or NEEDS_HUMAN are never removed.

    Attributes:
        older_than_s: Minimum age since the last update.
        archive_path: Append removed entries (metadata, ciphertexts as hex) to this JSONL.
    """

    older_than_s: float
    archive_path: str | None = None

    def __post_init__(self) -> None:
        if self.older_than_s < 0:
            raise ConfigurationError("RetentionPolicy.older_than_s must be >= 0")


def effect_record(row: Mapping[str, Any]) -> EffectRecord:
    """The public record of a row.

    Raises:
        CorruptRecord: A column holds a value no version of onceonly writes.
    """
    try:
        outcome = row["outcome_class"]
        return EffectRecord(
            key_id=row["key_id"],
            tenant=row["tenant"],
            run_id=row["run_id"],
            step_id=row["step_id"],
            effect=row["effect"],
            fingerprint=row["fingerprint"],
            provider_key=row["provider_key"],
            provider_class=ProviderClass(row["provider_class"]),
            window_s=row["window_s"],
            status=EffectStatus(row["status"]),
            epoch=int(row["epoch"]),
            lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"],
            attempts=int(row["attempts"]),
            outcome_class=None if outcome is None else OutcomeClass(outcome),
            subject=row["subject"],
            secret_id=row["secret_id"],
            first_sent_at=row["first_sent_at"],
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptRecord(f"effect row {row.get('key_id')!r} is malformed ({exc})") from exc
