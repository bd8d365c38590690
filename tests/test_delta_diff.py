"""The diff's fast paths (checked in C, identity before comparison) decide exactly as
the plain definitions: which dicts are stored as pages, and which ops turn one state
into the next."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from onceonly.adapters import _langgraph_values
from onceonly.checkpoint import _delta
from tests.values import make_codec, strict_equal

CODEC = make_codec()
PROPS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

KEYS = st.sampled_from(["", "\x00", "\x00m", "a", "b", "\x00\x00", "\x01", "ab"]) | st.text(
    max_size=3
)
ANY_KEY = KEYS | st.integers(-2, 2) | st.just(("t",))
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 2), st.floats(allow_nan=False), st.text(max_size=3)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=6,
)


def _stored_and_applied(old: Any, ops: dict[str, Any]) -> Any:
    """``old`` with ``ops`` applied as a load does: encoded as a delta body, decoded,
    resolved and applied to a copy."""
    enc = _delta.encode_delta(CODEC, ops)
    blobs = {h: CODEC.decode(raw) for h, raw in enc.blobs.items()}
    state = {"c": copy.deepcopy(old)}
    _delta.apply(state, _delta.resolve_delta(CODEC.decode(enc.raw), blobs), where="test")
    return state["c"]


def _reference_pageable(v: Any) -> bool:
    return type(v) is dict and all(type(k) is str and k[:1] != "\x00" for k in v)


@PROPS
@given(st.dictionaries(ANY_KEY, st.integers(), max_size=8))
def test_pageable_is_its_definition(value: dict[Any, int]) -> None:
    assert _delta._pageable(value) is _reference_pageable(value)


@PROPS
@given(
    st.dictionaries(KEYS | st.integers(-2, 2), VALUES, max_size=8),
    st.dictionaries(KEYS, VALUES, max_size=8),
    st.lists(st.booleans(), max_size=8),
)
@example({"a": 1, "b": 2, "c": 3, "d": 4}, {"e": 5}, [True, True, True])  # one out, one in
@example({"a": True, "b": -0.0, "c": "x"}, {"a": 1, "b": 0.0}, [True, True, True])
@example({"a": 1, "b": 2, "c": 3, "d": 4, 1: "x", "z": "y"}, {}, [True] * 4)  # old not pageable
def test_a_dict_channel_diff_applied_gives_the_new_state(
    old: dict[Any, Any], replace: dict[str, Any], keep: list[bool]
) -> None:
    """The new state shares some of the old values by identity (as a caller's dict does
    between steps), replaces some by equal-but-not-identical or different values (``1``
    for ``True``, ``0.0`` for ``-0.0``: stored differently), adds and drops keys."""
    new: dict[Any, Any] = {}
    for i, (k, v) in enumerate(old.items()):
        if i < len(keep):
            new[k] = v if keep[i] else copy.deepcopy(v)
    new.update(replace)
    ops = _delta.diff({"c": old}, {"c": new}, CODEC)
    assert strict_equal(_stored_and_applied(old, ops), new)
    if not ops:
        assert all(_delta.same(old.get(k), v, CODEC) for k, v in new.items())
        assert old.keys() == new.keys()


@PROPS
@given(
    st.lists(VALUES, max_size=8),
    st.lists(st.sampled_from(["same", "copy", "replace"]), max_size=8),
    st.lists(VALUES, max_size=3),
)
@example([True, 1, 0.0, "a"], ["replace", "replace", "replace", "same"], [])
@example(["a", "b"], ["same", "same"], ["c"])
def test_a_list_channel_diff_applied_gives_the_new_state(
    old: list[Any], how: list[str], more: list[Any]
) -> None:
    """A new list that keeps the old items by identity, as equal copies or replaced
    (``1`` for ``True``: stored differently), possibly shorter, then appends."""
    new = []
    for i, x in enumerate(old[: len(how)]):
        new.append(x if how[i] == "same" else copy.deepcopy(x) if how[i] == "copy" else _other(x))
    new += more
    ops = _delta.diff({"c": old}, {"c": new}, CODEC)
    assert strict_equal(_stored_and_applied(old, ops), new)
    kept = len(how) >= len(old) and all(h != "replace" for h in how[: len(old)])
    if kept:  # an unchanged prefix is an append (or nothing), never the whole list again
        assert (ops["c"][0] == "a") if len(new) > len(old) else not ops


def _other(x: Any) -> Any:
    """A value stored differently from ``x``, equal to it by ``==`` where one exists."""
    if type(x) is bool:
        return int(x)
    if type(x) is int:
        return float(x)
    if type(x) is float and x == 0:
        return -x
    return [x]


@PROPS
@given(VALUES)
def test_langgraph_pack_of_plain_values_is_an_equal_private_copy(value: Any) -> None:
    packed = _langgraph_values.pack(value, serde=None)  # type: ignore[arg-type]
    assert strict_equal(packed, value)
    if isinstance(value, list | dict):
        assert packed is not value
