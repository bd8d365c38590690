"""Keyed integrity of the rows the runtime trusts: runs, checkpoints and waits.

A row's **seal** is a keyed blake3 MAC over its trusted fields, stored with the id of the
key that made it (``<key id>:<32 bytes>``). The key comes from the effects ledger's
keyring (``Keyring.row_keys()``: a subkey per secret, for this purpose only), so without
the secret a valid row can be neither forged nor recomputed after an edit. Keys rotate
like the keyring: a row sealed with an older key still verifies while that key is kept;
new seals use the current one.

What each seal covers:

* **runs**: flow, code version, state version, status, next step, handoff note, head
  sequence number *and the head checkpoint's digest* — so a status flipped by SQL, a next
  step moved, or a head moved back (a cut-back history) is refused on read; the lease
  columns change on every renewal and are not trusted for anything that acts;
* **checkpoints**: every metadata column and the row digest (which covers the body and,
  through it, the content-addressed blobs it refers to);
* **waits**: kind, status, expiry, the approved subject's hash, requester, self-approval,
  the payload's hash, the decision (who, when, why), the opening step visit, the
  instance.

A :class:`~checkpoint.Store` without keys writes no seals and checks none: it detects
accidental corruption (digests, content hashes) but not an edit made on purpose by
someone who recomputes the unkeyed digests. :data:`UNKEYED_LIMITS` says so in words.
"""

from __future__ import annotations

import hmac
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import blake3

from .errors import ConfigurationError, CorruptRecord

# UNKEYED_LIMITS is public too (``checkpoint.integrity.UNKEYED_LIMITS``), out of
# ``__all__`` as KNOWN_FAILPOINTS is (the package re-exports every name listed here).
__all__ = ["RowKeys"]

UNKEYED_LIMITS = (
    "this store has no integrity keys (open it with a keyring: "
    "Store.open(url, integrity=keyring.row_keys()), or through a Ledger): it detects "
    "accidental corruption but not deliberate edits of runs, checkpoints or waits by "
    "someone who recomputes their unkeyed digests"
)


def _encode(parts: Sequence[object]) -> bytes:
    """Length-prefixed, type-tagged: no two part lists encode alike.

    Every seal of the acting path and every row check of a load goes through here, with
    few distinct lists of part types (one per kind of row): each such list gets its own
    encoder, made once (:func:`_encoder_for`), that formats all parts in one operation.
    A list with another type (a subclass: a ``StrEnum``, a ``bool``) is encoded part by
    part (:func:`_encode_each`); both give the same bytes.
    """
    types = tuple(map(type, parts))
    encoder = _ENCODERS.get(types)
    if encoder is None:
        encoder = _encoder_for(types)
    return encoder(parts)


def _encode_each(parts: Sequence[object]) -> bytes:
    """:func:`_encode`, part by part (any part types)."""
    out: list[bytes] = []
    add = out.append
    for p in parts:
        t = type(p)
        if t is str:
            data = p.encode("utf-8")  # type: ignore[attr-defined]
            add(b"s%d:%s" % (len(data), data))
        elif t is bytes:
            add(b"b%d:%s" % (len(p), p))  # type: ignore[arg-type]
        elif p is None:
            add(b"N")
        elif t is float:
            add(b"f" + _DOUBLE(p))
        elif t is int:
            data = str(p).encode("ascii")
            add(b"i%d:%s" % (len(data), data))
        else:
            add(_encode_other(p))
    return b"".join(out)


# One encoder per list of exact part types; a list of other types is encoded part by part.
_ENCODERS: dict[tuple[type, ...], Callable[[Sequence[object]], bytes]] = {}
_ENCODERS_MAX = 256  # the kinds of rows sealed; past it, new lists are encoded part by part
_ENCODERS_LOCK = threading.Lock()


def _encoder_for(types: tuple[type, ...]) -> Callable[[Sequence[object]], bytes]:
    """The encoder of part lists of exactly ``types``: one bytes formatting of every part
    (built from source, as ``dataclasses`` builds ``__init__``), or :func:`_encode_each`
    when a type has no fixed form here."""
    if (
        not types
        or len(types) > 64
        or len(_ENCODERS) >= _ENCODERS_MAX
        or not all(t in _FORMS for t in types)
    ):
        return _encode_each
    pre: list[str] = []
    fmt = b""
    values: list[str] = []
    for i, t in enumerate(types):
        form, prep, vals = _FORMS[t]
        fmt += form
        if prep:
            pre.append(prep.format(i=i))
        values.extend(v.format(i=i) for v in vals)
    names = ", ".join(f"p{i}" for i in range(len(types)))
    src = (
        f"def encode(parts):\n"
        f"    {names}, = parts\n"
        + "".join(f"    {line}\n" for line in pre)
        + f"    return {fmt!r} % ({''.join(v + ', ' for v in values)})\n"
    )
    scope: dict[str, Any] = {"_DOUBLE": _DOUBLE}
    exec(src, scope)  # noqa: S102  (source made above from fixed pieces, no data)
    encoder = cast(Callable[[Sequence[object]], bytes], scope["encode"])
    with _ENCODERS_LOCK:
        if len(_ENCODERS) < _ENCODERS_MAX:
            _ENCODERS[types] = encoder
    return encoder


# type -> (its format, a line preparing it, the values the format takes); {i}: the index
_FORMS: dict[type, tuple[bytes, str, tuple[str, ...]]] = {
    str: (b"s%d:%s", 'e{i} = p{i}.encode("utf-8")', ("len(e{i})", "e{i}")),
    bytes: (b"b%d:%s", "", ("len(p{i})", "p{i}")),
    type(None): (b"N", "", ()),
    float: (b"f%s", "", ("_DOUBLE(p{i})",)),
    int: (b"i%d:%s", 'e{i} = str(p{i}).encode("ascii")', ("len(e{i})", "e{i}")),
}


_DOUBLE = struct.Struct(">d").pack


def _encode_other(p: object) -> bytes:
    if isinstance(p, bool):
        return b"T" if p else b"F"
    if isinstance(p, int):
        data = str(p).encode("ascii")
        return b"i%d:%s" % (len(data), data)
    if isinstance(p, float):
        return b"f" + _DOUBLE(p)
    if isinstance(p, str):
        data = p.encode("utf-8")
        return b"s%d:%s" % (len(data), data)
    if isinstance(p, bytes | bytearray | memoryview):
        data = bytes(p)
        return b"b%d:%s" % (len(data), data)
    raise TypeError(f"seal parts are str, int, float, bytes or None, not {type(p)}")


@dataclass(frozen=True, repr=False)
class RowKeys:
    """The keys that seal trusted rows: the current one seals, every one verifies.

    Attributes:
        current_id: Id of the key new seals use.
        keys: Key id -> 32-byte key.
    """

    current_id: str
    keys: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        if self.current_id not in self.keys:
            raise ConfigurationError("RowKeys: the current key is not among the keys")
        for kid, key in self.keys.items():
            if not kid or ":" in kid or len(key) != 32:
                raise ConfigurationError("RowKeys: ids without ':' and 32-byte keys")

    def __repr__(self) -> str:
        return f"RowKeys(current_id={self.current_id!r}, keys=<{len(self.keys)} redacted>)"

    def seal(self, table: str, parts: Sequence[object]) -> bytes:
        """The seal of a row of ``table`` with these trusted ``parts``."""
        return self._mac(self.current_id, table, parts)

    def _mac(self, kid: str, table: str, parts: Sequence[object]) -> bytes:
        body = _encode([table, *parts])
        return kid.encode() + b":" + blake3.blake3(body, key=self.keys[kid]).digest()

    def valid(self, table: str, parts: Sequence[object], seal: bytes | None) -> bool:
        """Whether ``seal`` is a valid seal of these parts (by any known key)."""
        if seal is None:
            return False
        kid, sep, _ = bytes(seal).partition(b":")
        name = kid.decode("utf-8", "replace")
        if not sep or name not in self.keys:
            return False
        return hmac.compare_digest(self._mac(name, table, parts), bytes(seal))


def _check_seal(
    keys: RowKeys | None,
    table: str,
    parts: Sequence[object],
    seal: bytes | None,
    *,
    what: str,
    run_id: str | None = None,
    seq: int | None = None,
) -> None:
    """Refuse a row whose seal does not verify (no keys: nothing is checked).

    Raises:
        CorruptRecord: The row was edited, forged, moved, or written without a key.
    """
    if keys is None:
        return
    if seal is None:
        raise CorruptRecord(
            f"{what} carries no seal (written without integrity keys, or edited to drop "
            f"its seal); it is not trusted. If the store predates sealing, run `onceonly "
            f"audit seal` once after checking it",
            run_id=run_id,
            seq=seq,
        )
    if not keys.valid(table, parts, seal):
        raise CorruptRecord(
            f"{what} fails its keyed seal (edited, forged, rolled back alone or moved); it "
            f"is not acted on. Run `onceonly audit verify`",
            run_id=run_id,
            seq=seq,
        )


def _make_seal(keys: RowKeys | None, table: str, parts: Sequence[object]) -> bytes | None:
    """The seal to store (None without keys)."""
    return None if keys is None else keys.seal(table, parts)
