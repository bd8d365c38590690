"""A fixed corpus of values whose encoding must not depend on the process or hash seed.

``python -m tests.codec_corpus`` prints the hex of each value's encoding, one a line; the
codec tests run it under different ``PYTHONHASHSEED`` values and compare. Sets of strings
iterate in a hash-seed dependent order, so they are the point of the corpus.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

from tests.values import Point, make_codec


def corpus() -> list[Any]:
    """Values built deterministically, containing hash-ordered collections."""
    words = [f"word-{i}-\u00e9\u4e2d" for i in range(40)]
    return [
        set(words),
        frozenset(words),
        {w: i for i, w in enumerate(words)},
        {(i, w): w for i, w in enumerate(words)},
        {frozenset(words[i : i + 3]): i for i in range(0, 30, 3)},
        {i: set(words[: i + 1]) for i in range(10)},
        [set(words[i::7]) for i in range(7)],
        {"\x00m": set(words), 3: frozenset({b"a", b"b", b"c"})},
        {Point(i, -i) for i in range(20)},
        {
            "when": dt.datetime(2024, 2, 29, 12, 30, tzinfo=dt.timezone(dt.timedelta(hours=2))),
            "day": dt.date(2024, 2, 29),
            "amount": Decimal("12.50"),
            "id": uuid.UUID(int=12345),
            "tags": {"b", "a", "c", "\x00", ""},
        },
    ]


def main() -> None:
    codec = make_codec()
    for value in corpus():
        print(codec.encode(value).hex())


if __name__ == "__main__":
    main()
