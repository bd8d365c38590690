"""The diff's fast paths (checked in C, identity before comparison) decide exactly as
the plain definitions: which dicts are stored as pages, and which ops turn one state
into the next."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

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


@PROPS
@given(
    st.dictionaries(KEYS | st.integers(-2, 2), VALUES, max_size=8),
    st.lists(st.sampled_from(["same", "copy", "other"]), max_size=8),
    st.sampled_from(["same keys", "reordered", "key copies", "one more", "one less"]),
)
@example({"a": 1, "b": 2, "c": 3}, ["same", "other", "same"], "same keys")
@example({"a": 1, "b": 2, "c": 3}, ["other", "other", "other"], "same keys")  # most: set
@example({"a": 1, "\x00b": 2}, ["same", "other"], "same keys")  # not pageable
@example({"a": True, "b": -0.0}, ["other", "other"], "same keys")  # ==, stored otherwise
def test_a_diff_that_knows_the_old_dict_is_pageable_decides_as_one_that_does_not(
    old: dict[Any, Any], how: list[str], keys: str
) -> None:
    """``diff_known`` skips the key checks of a dict channel whose keys are the old
    dict's very key objects in its order (as a caller's dict keeps them): the ops it
    gives are the plain diff's, whatever the values and keys, and the channels it reports
    pageable are."""
    new: dict[Any, Any] = {}
    for i, (k, v) in enumerate(old.items()):
        h = how[i] if i < len(how) else "same"
        new[k] = v if h == "same" else copy.deepcopy(v) if h == "copy" else _other(v)
    if keys == "reordered":
        new = dict(reversed(new.items()))
    elif keys == "key copies":  # equal keys, other objects: the fast path does not apply
        new = {(("" + k + ".")[:-1] if type(k) is str else k): v for k, v in new.items()}
    elif keys == "one more":
        new["zz"] = 1
    elif keys == "one less" and new:
        new.pop(next(iter(new)))
    paged = frozenset({"c"}) if _reference_pageable(old) else frozenset()
    ops, found = _delta.diff_known({"c": old}, {"c": new}, CODEC, paged)
    plain = _delta.diff({"c": old}, {"c": new}, CODEC)
    assert ops.keys() == plain.keys()
    assert all(strict_equal(ops[ch], plain[ch]) for ch in plain)
    assert strict_equal(_stored_and_applied(old, ops), new)
    if "c" in found:
        assert _reference_pageable(new)
    elif ops.get("c", ("",))[0] == "m":
        raise AssertionError("a merge into a dict not reported pageable")


def test_a_store_remembers_which_dict_channels_are_pageable_only_while_they_are(
    db_url: str,
) -> None:
    """The head's pageable channels follow every kind of change: a dict that gains a key
    no page can hold, one replaced by ``update(set=...)``, a deleted channel; each state
    reads back as saved (the latest in this store, each one in a fresh store), and is
    stored as a merge exactly when it changed a few keys of a pageable dict."""
    from onceonly.checkpoint import Store

    kv: dict[Any, Any] = {"a": 1, "b": 2, "e": 0}
    states: dict[int, dict[str, Any]] = {}
    with Store.open(db_url) as store:
        run, info = store.start_run("flow", {"c": kv})
        states[info.seq] = copy.deepcopy({"c": kv})

        def save(step: str) -> None:
            info = store.save(run.run_id, {"c": kv}, step=step)
            states[info.seq] = copy.deepcopy({"c": kv})

        def update(step: str, want: dict[str, Any], **change: Any) -> None:
            info = store.update(run.run_id, step=step, **change)
            states[info.seq] = want

        kv["a"] = 10
        save("s1")  # the same key objects; found pageable by the plain diff
        kv["b"] = 20
        save("s2")  # the remembered fast path
        kv["\x00x"] = 3
        save("s3")  # no longer pageable: set whole
        kv["a"] = 11
        save("s4")  # the same keys, still not pageable
        del kv["\x00x"]
        save("s5")  # pageable again
        kv["b"] = 21
        save("s6")
        update("u1", {"c": {"a": 1, 7: 2}}, set={"c": {"a": 1, 7: 2}})
        kv = {"a": 1, 7: 3}
        save("s7")  # an int key: not pageable, whatever the head remembered
        update("u2", {}, delete=["c"])
        kv = {"a": 5}
        save("s8")
        kv["a"] = 6
        save("s9")
        assert strict_equal(store.load(run.run_id).state, {"c": {"a": 6}})
    with Store.open(db_url) as fresh:
        history = fresh.history(run.run_id)
        assert sorted(i.seq for i in history) == sorted(states)
        for seq, want in states.items():
            assert strict_equal(fresh.load(run.run_id, seq).state, want), seq
        with fresh.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT seq, body FROM oo_checkpoints WHERE run_id = :r ORDER BY seq"),
                {"r": run.run_id},
            ).all()
    kinds = {}
    for seq, body in rows:
        decoded = CODEC.decode(_delta.unpack(bytes(body)))
        if "d" in decoded and "c" in decoded["d"]:
            kinds[seq] = decoded["d"]["c"][0]
    merges = {seq for seq, kind in kinds.items() if kind == "m"}
    # a merge: a few values of a pageable dict changed, its keys kept
    assert merges == {
        seq
        for seq in kinds
        if seq > 0
        and _reference_pageable(states[seq].get("c"))
        and _reference_pageable(states[seq - 1].get("c"))
        and states[seq]["c"].keys() == states[seq - 1]["c"].keys()
    }, kinds
