"""Effect rows as read from the database (their conversion to records is
:func:`~onceonly.ledger.records.effect_record`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._schema import COLUMNS
from .records import EffectStatus, effect_record

__all__ = ["SELECT", "TERMINAL", "Row", "effect_record", "effect_row"]

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
