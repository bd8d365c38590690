"""Shared test values: registered dataclasses, hypothesis strategies of every codec type,
and a type-strict equality that is the oracle of the round-trip tests.

Plain ``==`` is too weak an oracle for a codec: ``1 == True == 1.0``, ``0.0 == -0.0``,
``Decimal("1.0") == Decimal("1.00")`` and two aware datetimes at the same instant in
different offsets all compare equal. :func:`strict_equal` requires the same types and the
same representation all the way down.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import uuid
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from onceonly.checkpoint import Codec

__all__ = [
    "Note",
    "Point",
    "Unregistered",
    "codec_values",
    "hashable_values",
    "make_codec",
    "reordered",
    "strict_equal",
]


@dataclasses.dataclass(frozen=True)
class Point:
    """A small frozen (hashable) dataclass."""

    x: int
    y: int


@dataclasses.dataclass
class Note:
    """A mutable dataclass with container fields and a field not passed to __init__."""

    title: str
    tags: list[str]
    meta: dict[str, Any]
    length: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.length = len(self.title)


@dataclasses.dataclass
class Unregistered:
    """A dataclass no codec in the tests registers."""

    value: int


def make_codec() -> Codec:
    """A strict codec with the test dataclasses registered under stable names."""
    codec = Codec()
    codec.register(Point, name="tests.point.v1")
    codec.register(Note, name="tests.note.v1")
    return codec


# -- type-strict equality --------------------------------------------------------------


def _find_key(k: Any, d: dict[Any, Any]) -> tuple[bool, Any]:
    if type(k) is str:
        return (k in d), k
    for other in d:
        if strict_equal(k, other):
            return True, other
    return False, None


def strict_equal(a: Any, b: Any) -> bool:
    """Equality that also requires equal types and representations, all the way down."""
    if type(a) is not type(b):
        return False
    if a is None or type(a) in (bool, int, str, bytes, uuid.UUID, dt.date):
        return bool(a == b)
    if type(a) is float:
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if type(a) is Decimal:
        return str(a) == str(b)
    if type(a) is dt.datetime:
        return (a.tzinfo is None) == (b.tzinfo is None) and a.isoformat() == b.isoformat()
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        if len(a) != len(b):
            return False
        for k, v in a.items():
            found, other = _find_key(k, b)
            if not found or not strict_equal(k, other) or not strict_equal(v, b[other]):
                return False
        return True
    if type(a) in (set, frozenset):
        if len(a) != len(b):
            return False
        rest = list(b)
        for x in a:
            for i, y in enumerate(rest):
                if strict_equal(x, y):
                    del rest[i]
                    break
            else:
                return False
        return True
    if dataclasses.is_dataclass(a):
        return all(
            strict_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    raise TypeError(f"strict_equal does not know {type(a)!r}")


def reordered(v: Any) -> Any:
    """An equal value whose dicts and sets were built in reverse insertion order."""
    t = type(v)
    if t is dict:
        return {k: reordered(x) for k, x in reversed(list(v.items()))}
    if t is list:
        return [reordered(x) for x in v]
    if t is tuple:
        return tuple(reordered(x) for x in v)
    if t in (set, frozenset):
        out = set()
        for x in reversed(list(v)):
            out.add(reordered(x))
        return out if t is set else frozenset(out)
    if t is Note:
        return Note(title=v.title, tags=reordered(v.tags), meta=reordered(v.meta))
    return v


# -- strategies ------------------------------------------------------------------------

_OFFSETS = st.builds(
    dt.timezone,
    st.timedeltas(min_value=dt.timedelta(hours=-23, minutes=-59), max_value=dt.timedelta(hours=23)),
)

_huge_ints = st.integers(min_value=-(10**4000), max_value=10**4000)

_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]
)

_decimals = st.decimals(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [Decimal("1.0"), Decimal("1.00"), Decimal("-0"), Decimal("1E+3"), Decimal("sNaN")]
)

_datetimes = (
    st.datetimes() | st.datetimes(timezones=st.timezones()) | st.datetimes(timezones=_OFFSETS)
)

_tag_like_keys = st.sampled_from(["\x00m", "\x00t", "\x00b", "\x00c", "\x00", "\x00zz"]) | st.text(
    max_size=5
).map(lambda s: "\x00" + s)

_str_keys = st.text(max_size=8) | _tag_like_keys

_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | _huge_ints
    | _floats
    | st.text()
    | st.binary()
    | _datetimes
    | st.dates()
    | _decimals
    | st.uuids()
    | st.builds(Point, st.integers(), st.integers())
)


def hashable_values() -> st.SearchStrategy[Any]:
    """Hashable values: set members and non-string dict keys."""
    scalar = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=6)
        | st.binary(max_size=6)
        | st.dates()
        | st.uuids()
        | st.builds(Point, st.integers(), st.integers())
    )
    return st.recursive(
        scalar,
        lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
        max_leaves=4,
    )


def codec_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any value the codec accepts, nested."""
    keys = hashable_values()

    def containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return (
            st.lists(inner, max_size=4)
            | st.tuples(inner, inner)
            | st.dictionaries(_str_keys, inner, max_size=4)
            | st.dictionaries(keys, inner, max_size=4)
            | st.sets(keys, max_size=4)
            | st.frozensets(keys, max_size=4)
            | st.builds(
                Note,
                st.text(max_size=6),
                st.lists(st.text(max_size=4), max_size=3),
                st.dictionaries(st.text(max_size=4), inner, max_size=3),
            )
        )

    return st.recursive(_leaves, containers, max_leaves=max_leaves)
