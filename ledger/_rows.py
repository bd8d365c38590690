"""Effect rows as read from the database, and their conversion to records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onceonly.checkpoint.errors import CorruptRecord

from ._schema import COLUMNS
from .records import EffectRecord, EffectStatus, OutcomeClass, ProviderClass

Row = dict[str, Any]
SELECT = "SELECT " + ", ".join(COLUMNS) + " FROM oo_effects"
TERMINAL = (EffectStatus.COMMITTED.value, EffectStatus.FAILED.value)


def effect_row(values: Sequence[Any]) -> Row:
    """A row tuple (columns in schema order) as a dict, binary columns as bytes."""
    row = dict(zip(COLUMNS, values, strict=True))
    for c in ("args_ct", "result_ct", "error_ct", "seal"):
        if row[c] is not None:
            row[c] = bytes(row[c])
    return row


def effect_record(row: Row) -> EffectRecord:
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
