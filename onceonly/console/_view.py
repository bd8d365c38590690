"""What pages show: stored values rendered readably (and inertly: templates escape
everything), times, and the state diff between checkpoints."""

from __future__ import annotations

import json
import time
from typing import Any

MAX_STATE_CHARS = 20_000
"""A state channel longer than this is cut on the run page (the subject of an approval
never is: an approver sees all of what they approve)."""


def readable(codec: Any, value: Any) -> str:
    """``value`` as indented JSON in the codec's readable form (what `onceonly runs show`
    prints). Never raises: a value that cannot be shown says so."""
    try:
        doc = codec.readable(value)
    except Exception as exc:  # noqa: BLE001 - display only: a page never fails on a value
        return f"(cannot be shown: {type(exc).__name__})"
    try:
        return json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=True)
    except (RecursionError, ValueError):
        return json.dumps(doc, ensure_ascii=False, sort_keys=True, check_circular=False)


def cut(text: str, limit: int = MAX_STATE_CHARS) -> str:
    """``text``, cut at ``limit`` characters with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… ({len(text) - limit} more characters; see `onceonly runs show`)"


def when(t: float | None, now: float | None = None) -> str:
    """A UNIX time as ``YYYY-MM-DD HH:MM:SS UTC (3m ago)``."""
    if t is None:
        return "-"
    now = time.time() if now is None else now
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    delta = t - now
    return f"{stamp} ({_span(abs(delta))} {'from now' if delta >= 0 else 'ago'})"


def _span(seconds: float) -> str:
    s = round(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def state_diff(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str]]:
    """The channels a checkpoint changed: ``(channel, added|changed|removed)``."""
    out = []
    for k in sorted(set(before) | set(after), key=str):
        if k not in before:
            out.append((str(k), "added"))
        elif k not in after:
            out.append((str(k), "removed"))
        elif before[k] != after[k]:
            out.append((str(k), "changed"))
    return out
