"""The seal encoding never changes: every seal already stored must keep verifying.

``checkpoint.integrity._encode`` has an encoder made for each list of exact common part
types and a part-by-part one for any other list (subclasses); both must give the bytes
the encoding has always given (fixed here byte for byte, and compared with a plain
reference implementation on generated parts), and raise as it does.
"""

from __future__ import annotations

import enum
import random
import struct

import pytest

from onceonly.checkpoint import RowKeys, integrity
from onceonly.checkpoint.integrity import _encode


def _reference(parts: list[object]) -> bytes:
    out = bytearray()
    for p in parts:
        if p is None:
            out += b"N"
        elif isinstance(p, bool):
            out += b"T" if p else b"F"
        elif isinstance(p, int):
            data = str(p).encode("ascii")
            out += b"i%d:%s" % (len(data), data)
        elif isinstance(p, float):
            out += b"f" + struct.pack(">d", p)
        elif isinstance(p, str):
            data = p.encode("utf-8")
            out += b"s%d:%s" % (len(data), data)
        else:
            data = bytes(p)  # type: ignore[call-overload]
            out += b"b%d:%s" % (len(data), data)
    return bytes(out)


class _S(enum.StrEnum):
    A = "aé"


class _I(enum.IntEnum):
    X = 7


def test_the_encoding_is_fixed_byte_for_byte() -> None:
    parts: list[object] = ["effects", "kéy", 12, -3, 1.5, None, True, False, b"\x00\x01", ""]
    assert _encode(parts) == (
        b"s7:effectss4:k\xc3\xa9yi2:12i2:-3f?\xf8\x00\x00\x00\x00\x00\x00NTFb2:\x00\x01s0:"
    )
    # the seal these parts had before the fast path existed (computed then)
    keys = RowKeys("k1", {"k1": bytes(range(32))})
    before = bytes.fromhex("6b313ad75c7d7fe4a2d6c8de4ba9448c26ef62c39ac657cef32576df83dfb4f3276b3f")
    assert keys.seal("t", parts) == before
    assert keys.valid("t", parts, before)


def test_every_type_encodes_as_the_reference_does() -> None:
    values: list[object] = [
        None, True, False, 0, -5, 10**30, 1.5, -0.0, float("inf"), "", "héllo",
        b"", b"\x00ab", bytearray(b"xy"), memoryview(b"zz"), _S.A, _I.X,
    ]  # fmt: skip
    rng = random.Random(7)
    for _ in range(3000):
        parts = [rng.choice(values) for _ in range(rng.randint(0, 8))]
        assert _encode(parts) == _reference(parts), parts


def test_other_types_are_refused() -> None:
    with pytest.raises(TypeError):
        _encode([object()])


def test_lists_of_exact_types_get_their_own_encoder_and_agree_with_the_reference() -> None:
    """Lists of exact types are encoded by encoders made for them (up to the bound, then
    part by part): on thousands of lists, both give the reference's bytes."""
    exact: list[object] = [None, 0, -5, 10**30, 1.5, -0.0, float("nan"), "", "héllo", b"", b"\x00"]
    rng = random.Random(11)
    saved = dict(integrity._ENCODERS)
    integrity._ENCODERS.clear()
    try:
        for _ in range(3000):
            parts = [rng.choice(exact) for _ in range(rng.randint(1, 13))]
            assert _encode(parts) == _reference(parts), parts
            assert _encode(tuple(parts)) == _reference(parts), parts  # again, as a tuple
        assert len(integrity._ENCODERS) == integrity._ENCODERS_MAX  # made, then bounded
    finally:
        integrity._ENCODERS.clear()
        integrity._ENCODERS.update(saved)


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        (["\ud800"], UnicodeEncodeError),
        (["ok", "\ud800"], UnicodeEncodeError),
        ([10**5000], ValueError),
        (["a", 10**5000], ValueError),
    ],
    ids=["lone surrogate", "surrogate second", "huge int", "huge int second"],
)
def test_an_unencodable_part_raises_on_either_path(
    parts: list[object], error: type[Exception]
) -> None:
    with pytest.raises(error, match=r"surrogate|digits"):
        _encode(parts)
    with pytest.raises(error, match=r"surrogate|digits"):
        integrity._encode_each(parts)
