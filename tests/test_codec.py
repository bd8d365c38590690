"""The canonical codec: exact round trips, deterministic bytes, strict encode, typed
decode errors, data never code."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceonly.checkpoint import Codec, CodecError, CorruptRecord, Opaque, UnknownCodecTag
from tests.codec_corpus import corpus
from tests.values import (
    Note,
    Point,
    Unregistered,
    codec_values,
    hashable_values,
    make_codec,
    reordered,
    strict_equal,
)

ROOT = Path(__file__).resolve().parent.parent
CODEC = make_codec()
PROPS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def round_trip(value: Any) -> Any:
    return CODEC.decode(CODEC.encode(value))


# -- round trips -----------------------------------------------------------------------


@PROPS
@given(codec_values())
def test_every_value_round_trips_exactly(value: Any) -> None:
    data = CODEC.encode(value)
    back = CODEC.decode(data)
    assert strict_equal(back, value)
    assert CODEC.encode(back) == data


@PROPS
@given(st.integers() | st.integers(min_value=-(10**4200), max_value=10**4200))
def test_ints_round_trip_including_huge(value: int) -> None:
    back = round_trip(value)
    assert type(back) is int
    assert back == value


@PROPS
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_floats_round_trip_bit_for_bit(value: float) -> None:
    back = round_trip(value)
    assert type(back) is float
    if math.isnan(value):
        assert math.isnan(back)
    else:
        assert back == value
        assert math.copysign(1.0, back) == math.copysign(1.0, value)


def test_special_floats_keep_their_identity() -> None:
    assert math.copysign(1.0, round_trip(-0.0)) == -1.0
    assert math.copysign(1.0, round_trip(0.0)) == 1.0
    assert round_trip(math.inf) == math.inf
    assert round_trip(-math.inf) == -math.inf
    assert math.isnan(round_trip(math.nan))
    assert CODEC.encode(-0.0) != CODEC.encode(0.0)


@PROPS
@given(st.dictionaries(st.text().map(lambda s: "\x00" + s) | st.text(), st.text(), max_size=6))
def test_string_keys_that_look_like_tags_are_data(value: dict[str, str]) -> None:
    back = round_trip(value)
    assert strict_equal(back, value)


@pytest.mark.parametrize(
    "value",
    [
        {"\x00t": [1, 2]},
        {"\x00m": [[1, 2]]},
        {"\x00c": ["tests.point.v1", {"x": 1, "y": 2}]},
        {"\x00f": "nan"},
        {"\x00zz": 1},
        {"\x00": None},
        ["\x00b", "\x00t"],
        "\x00dt",
    ],
)
def test_user_data_shaped_like_a_tag_is_not_interpreted(value: Any) -> None:
    assert strict_equal(round_trip(value), value)


@pytest.mark.parametrize(
    "value",
    [
        {1: "a", 2: "b"},
        {(1, "x"): [1], (2, "y"): [2]},
        {None: 1, True: 2, 3.5: 3, b"k": 4, "s": 5},
        {frozenset({1, 2}): "fs", Point(1, 2): "pt"},
        {dt.date(2024, 1, 1): 1, uuid.UUID(int=7): 2},
    ],
)
def test_dicts_with_non_string_keys_round_trip(value: dict[Any, Any]) -> None:
    back = round_trip(value)
    assert strict_equal(back, value)


@PROPS
@given(st.sets(hashable_values(), max_size=8), st.frozensets(hashable_values(), max_size=8))
def test_sets_and_frozensets_keep_their_type(s: set[Any], fs: frozenset[Any]) -> None:
    back = round_trip({"s": s, "fs": fs})
    assert type(back["s"]) is set
    assert type(back["fs"]) is frozenset
    assert strict_equal(back, {"s": s, "fs": fs})


@pytest.mark.parametrize(
    "value",
    [
        dt.datetime(2024, 2, 29, 23, 59, 59, 999999),
        dt.datetime(2024, 2, 29, 23, 59, 59, tzinfo=dt.UTC),
        dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=-5, minutes=-30))),
        dt.datetime(9999, 12, 31, 23, 59, tzinfo=dt.timezone(dt.timedelta(seconds=37))),
        dt.date(2000, 1, 1),
        Decimal("1.00"),
        Decimal("-0"),
        Decimal("1E+3"),
        Decimal("Infinity"),
        Decimal("NaN"),
        Decimal("sNaN"),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        b"",
        b"\x00\xff" * 100,
        (),
        (1,),
        ((), [], {}),
        "",
        "\x00",
        "\u2603\U0001f600 \u0301e",
    ],
)
def test_scalar_edge_cases_round_trip(value: Any) -> None:
    assert strict_equal(round_trip(value), value)


def test_datetime_naive_and_aware_stay_distinct() -> None:
    naive = dt.datetime(2024, 5, 1, 12, 0)
    aware = naive.replace(tzinfo=dt.UTC)
    assert round_trip(naive).tzinfo is None
    back = round_trip(aware)
    assert back.utcoffset() == dt.timedelta(0)
    assert back == aware
    assert type(round_trip(dt.date(2024, 5, 1))) is dt.date


@pytest.mark.parametrize(
    "offset",
    [
        dt.timedelta(microseconds=1),
        dt.timedelta(seconds=30, microseconds=500000),
        -dt.timedelta(hours=5, microseconds=999999),
    ],
    ids=["1us", "30.5s", "minus-5h-and-almost-1s"],
)
def test_an_aware_datetime_never_silently_changes_its_offset(offset: dt.timedelta) -> None:
    """``datetime.timezone`` allows sub-second offsets; the codec must keep them or refuse
    the value when saving, never hand back another instant."""
    value = dt.datetime(2000, 1, 1, 12, tzinfo=dt.timezone(offset))
    try:
        data = CODEC.encode(value)
    except CodecError:
        return
    back = CODEC.decode(data)
    assert back.utcoffset() == offset
    assert back == value


def test_registered_dataclasses_round_trip_with_nested_values() -> None:
    note = Note("t", ["a", "b"], {"when": dt.date(2020, 1, 1), "pt": Point(1, 2), "s": {1, 2}})
    back = round_trip({"note": note, "points": [Point(3, 4), Point(5, 6)]})
    assert type(back["note"]) is Note
    assert strict_equal(back["note"], note)
    assert back["note"].length == 1
    assert back["points"] == [Point(3, 4), Point(5, 6)]


def test_dataclass_is_stored_under_its_registered_name() -> None:
    other = Codec()

    @dataclasses.dataclass(frozen=True)
    class Renamed:
        x: int
        y: int

    other.register(Renamed, name="tests.point.v1")
    back = other.decode(CODEC.encode(Point(1, 2)))
    assert back == Renamed(1, 2)


# -- determinism -----------------------------------------------------------------------


@PROPS
@given(codec_values())
def test_equal_values_encode_to_equal_bytes_whatever_the_insertion_order(value: Any) -> None:
    assert CODEC.encode(reordered(value)) == CODEC.encode(value)


def test_dict_and_set_order_do_not_change_bytes() -> None:
    a = {"b": 1, "a": 2, 3: "x", (1, 2): "y"}
    b = {(1, 2): "y", 3: "x", "a": 2, "b": 1}
    assert CODEC.encode(a) == CODEC.encode(b)
    assert CODEC.encode({"z", "a", "m"}) == CODEC.encode({"m", "z", "a"})
    assert CODEC.encode({"b": 1, "a": 2}) == CODEC.encode({"a": 2, "b": 1})


@pytest.mark.slow
def test_bytes_are_identical_across_processes_and_hash_seeds() -> None:
    here = [CODEC.encode(v).hex() for v in corpus()]
    outputs = []
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-m", "tests.codec_corpus"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(proc.stdout.split())
    for out in outputs:
        assert out == here


# -- strict encode -----------------------------------------------------------------------


class _Custom:
    pass


class _MyDict(dict[str, int]):
    pass


class _MyInt(int):
    pass


@pytest.mark.parametrize(
    "value",
    [
        _Custom(),
        object(),
        _MyDict(a=1),
        _MyInt(3),
        complex(1, 2),
        bytearray(b"x"),
        range(3),
        Unregistered(1),
        [1, {"deep": [Unregistered(2)]}],
        {"k": {1, 2, _MyInt(3)}},
        {Unregistered: 1},
        10**5000,
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_values_raise_codec_error_at_encode(value: Any) -> None:
    with pytest.raises(CodecError):
        CODEC.encode(value)


def test_unregistered_dataclass_error_says_how_to_register() -> None:
    with pytest.raises(CodecError, match="register"):
        CODEC.encode({"x": Unregistered(1)})


def test_register_refuses_non_dataclasses_and_name_clashes() -> None:
    codec = Codec()
    with pytest.raises(CodecError):
        codec.register(_Custom)
    codec.register(Point, name="shared")
    with pytest.raises(CodecError):
        codec.register(Note, name="shared")
    assert codec.registered == {"shared": Point}


def test_self_referencing_value_raises_codec_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(CodecError):
        CODEC.encode(loop)


# -- decode errors ---------------------------------------------------------------------


def test_unknown_tag_raises_unknown_codec_tag() -> None:
    with pytest.raises(UnknownCodecTag):
        CODEC.decode(json.dumps({"\x00zz": 1}).encode())


def test_unregistered_dataclass_on_decode_raises_unknown_codec_tag() -> None:
    data = CODEC.encode({"n": Note("a", [], {})})
    with pytest.raises(UnknownCodecTag, match=r"tests\.note\.v1"):
        Codec().decode(data)


def test_dataclass_whose_fields_changed_raises_unknown_codec_tag() -> None:
    @dataclasses.dataclass(frozen=True)
    class PointV2:
        x: int
        z: int

    reader = Codec()
    reader.register(PointV2, name="tests.point.v1")
    with pytest.raises(UnknownCodecTag):
        reader.decode(CODEC.encode(Point(1, 2)))


# -- a non-strict codec keeps what it cannot decode, exactly -----------------------------
#
# A tool that does not know the writer's dataclasses (the CLI) loads states and saves them
# again (fork, edit, cancel, retry): what it did not understand must be written back byte
# for byte, by it and by any codec, and read by the writer's codec as the original value.

LENIENT = Codec(strict=False)


def _unknown_tags() -> st.SearchStrategy[bytes]:
    """Canonical bytes holding tags no codec knows, at any depth (around a known value)."""
    tags = st.text(st.characters(codec="ascii", categories=["L"]), min_size=2, max_size=3)
    return st.tuples(codec_values(max_leaves=6), tags, codec_values(max_leaves=4)).map(
        lambda t: CODEC.encode({"a": t[0], "b": [t[0]]}).replace(
            b'"b":[', b'"b":[{"\\u0000' + t[1].encode() + b'":' + CODEC.encode(t[2]) + b"},", 1
        )
    )


@PROPS
@given(codec_values())
def test_a_non_strict_codec_writes_back_what_it_could_not_decode_byte_for_byte(
    value: Any,
) -> None:
    data = CODEC.encode(value)
    back = LENIENT.decode(data)
    assert LENIENT.encode(back) == data
    assert CODEC.encode(back) == data  # the writer's strict codec writes it verbatim too
    assert strict_equal(CODEC.decode(LENIENT.encode(back)), value)
    assert strict_equal(LENIENT.decode(LENIENT.encode(back)), back)  # stable placeholders


@PROPS
@given(_unknown_tags())
def test_unknown_tags_survive_a_non_strict_round_trip(data: bytes) -> None:
    back = LENIENT.decode(data)
    assert LENIENT.encode(back) == data
    assert CODEC.encode(back) == data
    with pytest.raises(UnknownCodecTag):
        CODEC.decode(data)


def test_placeholders_are_frozen_hashable_values_and_readable() -> None:
    @dataclasses.dataclass(frozen=True)
    class PointV2:
        x: int
        z: int

    data = CODEC.encode({"p": [Point(1, 2)], "s": {Point(3, 4)}, "n": Note("t", [], {})})
    other = Codec(strict=False)
    other.register(PointV2, name="tests.point.v1")  # registered, but the fields changed
    for lenient in (LENIENT, other):
        back = lenient.decode(data)
        (placeholder,) = back["p"]
        assert isinstance(placeholder, Opaque)
        assert (placeholder.tag, placeholder.value) == ("tests.point.v1", {"x": 1, "y": 2})
        assert placeholder.encoded == CODEC.encode(Point(1, 2)).decode()
        assert back["s"] == {Opaque("tests.point.v1", CODEC.encode(Point(3, 4)).decode())}
        with pytest.raises(dataclasses.FrozenInstanceError):
            placeholder.tag = "x"  # type: ignore[misc]
        assert lenient.encode(back) == data
    shown = LENIENT.readable(LENIENT.decode(data))
    assert shown["p"] == [{"$unknown": "tests.point.v1", "value": {"x": 1, "y": 2}}]
    assert shown["n"] == {
        "$unknown": "tests.note.v1",
        "value": {"meta": {}, "tags": [], "title": "t"},
    }
    assert LENIENT.readable(LENIENT.decode(b'{"\\u0000zz":[1]}')) == {
        "$unknown": "zz",
        "value": [1],
    }
    assert LENIENT.readable({"raw": b"\x01"}) == {"raw": {"\x00b": "AQ=="}}  # known tags kept
    assert CODEC.readable(Point(1, 2)) == {"\x00c": ["tests.point.v1", {"x": 1, "y": 2}]}


def _lenient_registered() -> Codec:
    codec = Codec(strict=False)
    codec.register(Point, name="tests.point.v1")
    codec.register(Note, name="tests.note.v1")
    return codec


@pytest.mark.parametrize("codec", [CODEC, _lenient_registered()], ids=["strict", "lenient"])
@pytest.mark.parametrize(
    "value",
    [
        {"$unknown": "tests.point.v1", "value": {"x": 1, "y": 2}},
        [1, {"deep": {"$unknown": "zz", "value": None}}],
        Note("t", [], {"m": {"$unknown": "x", "value": 1}}),
    ],
)
def test_the_old_lossy_placeholder_is_never_stored_as_data(codec: Codec, value: Any) -> None:
    with pytest.raises(CodecError, match="placeholder"):
        codec.encode(value)
    assert CODEC.encode({"$unknown": "x"}) == b'{"$unknown":"x"}'  # only that exact shape
    assert CODEC.encode({"$unknown": 1, "value": 2, "more": 3})


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"\xff\xfe\x00",
        b'{"a": 1} trailing',
        b'{"\\u0000b": "not base64!"}',
        b'{"\\u0000b": 5}',
        b'{"\\u0000t": 5}',
        b'{"\\u0000dt": "yesterday"}',
        b'{"\\u0000dt": 5}',
        b'{"\\u0000d": "2024-13-01"}',
        b'{"\\u0000n": "twelve"}',
        b'{"\\u0000n": {"a": 1}}',
        b'{"\\u0000u": "xyz"}',
        b'{"\\u0000u": 5}',
        b'{"\\u0000S": 5}',
        b'{"\\u0000S": [[1]]}',
        b'{"\\u0000F": [{}]}',
        b'{"\\u0000f": "big"}',
        b'{"\\u0000f": 5}',
        b'{"\\u0000m": 5}',
        b'{"\\u0000m": [5]}',
        b'{"\\u0000m": [[1]]}',
        b'{"\\u0000m": [[]]}',
        b'{"\\u0000m": [[[1], 2]]}',
        b'{"\\u0000c": 5}',
        b'{"\\u0000c": ["tests.point.v1"]}',
        b'{"\\u0000c": [[1], {}]}',
        b"[" * 100000,
    ],
)
def test_malformed_bytes_raise_corrupt_record(data: bytes) -> None:
    with pytest.raises(CorruptRecord):
        CODEC.decode(data)


_json_trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    *("\x00b", "\x00t", "\x00dt", "\x00d", "\x00n", "\x00u", "\x00S"),
                    *("\x00F", "\x00f", "\x00m", "\x00c", "\x00zz", "a"),
                ]
            ),
            inner,
            max_size=1,
        )
    ),
    max_leaves=6,
)


@PROPS
@given(_json_trees)
def test_arbitrary_stored_json_decodes_or_raises_only_corrupt_record(tree: Any) -> None:
    data = json.dumps(tree).encode()
    with contextlib.suppress(CorruptRecord):
        CODEC.decode(data)


@PROPS
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_only_corrupt_record(data: bytes) -> None:
    with contextlib.suppress(CorruptRecord):
        CODEC.decode(data)


# -- data, never code --------------------------------------------------------------------

# Pickle streams, written out as literals: ``pickle.dumps(1, protocol=5)`` and the classic
# "call os.system" payload. A codec that fell back to pickle would run the second one.
_PICKLE_INT = b"\x80\x05K\x01."
_PICKLE_CALL = b"cos\nsystem\n(S'echo pwned'\ntR."


@pytest.mark.parametrize("data", [_PICKLE_INT, _PICKLE_CALL])
def test_pickle_streams_are_refused(data: bytes) -> None:
    with pytest.raises(CorruptRecord):
        CODEC.decode(data)


@PROPS
@given(codec_values())
def test_encoding_is_plain_utf8_json(value: Any) -> None:
    data = CODEC.encode(value)
    tree = json.loads(data.decode("utf-8"))
    assert json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() == (
        data
    )


def test_objects_with_pickle_hooks_are_refused_not_pickled() -> None:
    class Sneaky:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("echo pwned",))

    with pytest.raises(CodecError):
        CODEC.encode({"x": Sneaky()})


@dataclasses.dataclass(frozen=True)
class _Leaf:
    kind: str
    data: bytes


def test_an_exact_class_is_diffed_by_equality_and_stored_alike() -> None:
    """``register(exact=True)``: the store compares such values with ``==`` when it
    diffs a state (no encoding of both); what it stores is unchanged."""
    from onceonly.checkpoint import _delta

    plain, exact = Codec(), Codec()
    plain.register(_Leaf, name="leaf")
    exact.register(_Leaf, name="leaf", exact=True)
    assert exact.is_exact(_Leaf)
    assert not plain.is_exact(_Leaf)
    a, b, c = _Leaf("m", b"x"), _Leaf("m", b"x"), _Leaf("m", b"y")
    for codec in (plain, exact):
        assert _delta.same(a, b, codec)
        assert not _delta.same(a, c, codec)
        assert codec.decode(codec.encode(a)) == a
    assert plain.encode([a, c]) == exact.encode([a, c])
    exact.register(_Leaf, name="leaf")  # registered again without it: compared by encoding
    assert not exact.is_exact(_Leaf)
