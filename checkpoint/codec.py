"""The canonical, type-tagged value codec.

Values are encoded as canonical JSON (sorted keys, no whitespace, UTF-8) in which every
value that JSON cannot carry exactly is a one-key object whose key starts with ``"\\x00"``::

    bytes       {"\\x00b": "<base64>"}           tuple      {"\\x00t": [...]}
    datetime    {"\\x00dt": "<isoformat>"}       date       {"\\x00d": "<isoformat>"}
    datetime with a sub-minute UTC offset: {"\\x00dto": ["<naive isoformat>", offset µs]}
    Decimal     {"\\x00n": "<str>"}              UUID       {"\\x00u": "<hex>"}
    set         {"\\x00S": [...sorted]}          frozenset  {"\\x00F": [...sorted]}
    nan / inf   {"\\x00f": "nan" | "inf" | "-inf"}
    dataclass   {"\\x00c": ["<registered name>", {field: value, ...}]}
    other dict  {"\\x00m": [[key, value], ...sorted by the key's encoding]}

A plain ``dict`` whose keys are all strings not starting with ``"\\x00"`` is a JSON
object; any other mapping (integer or tuple keys, or a key that looks like a tag) uses the
escaped ``"\\x00m"`` form, so no user data can be mistaken for a tag.

Guarantees:

* **Deterministic**: equal values of the same types encode to the same bytes, whatever the
  insertion order of dicts or sets, the process or the hash seed.
* **Strict**: only the types above (exact types, not subclasses) and dataclasses
  registered with :meth:`Codec.register` are accepted; anything else raises
  :class:`~checkpoint.errors.CodecError` when saving, never when loading.
* **Data, never code**: decoding constructs only the types above; there is no pickle.

Aware datetimes keep their UTC offset but not a named zone (``ZoneInfo`` becomes a fixed
offset, which compares equal). ``-0.0`` and ``0.0`` are kept distinct.

A non-strict codec (``Codec(strict=False)``, for tools that do not know the writer's
dataclasses, such as the ``onceonly`` CLI) decodes a value it cannot rebuild to an
:class:`Opaque` that holds its tag and its exact encoded form, and every codec encodes an
``Opaque`` back to exactly those bytes: a tool that loads a state and saves it again
(fork, edit, cancel, retry) never changes what it did not understand.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as _dt
import json
import math
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from .errors import CodecError, CorruptRecord, UnknownCodecTag

__all__ = ["Codec", "Opaque"]

_DUMPS = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False
).encode
_TAG = "\x00"
_ESCAPED_TAG = "\\u0000"  # how the tag character appears in encoded text
_PLAIN = json.JSONDecoder().decode


def _sort_key(item: tuple[Any, Any]) -> str:
    return _DUMPS(item[0])


@dataclasses.dataclass(frozen=True)
class Opaque:
    """A stored value that a non-strict codec could not rebuild, kept exactly.

    Every codec encodes it back to ``encoded``, byte for byte, so a tool that does not
    know a dataclass can load a state holding one and save it again unchanged; a codec
    that registers the dataclass decodes those bytes to the real value. Immutable and
    hashable (a set member or mapping key stays one).

    Attributes:
        tag: The dataclass's registered name, or the unknown codec tag (without its NUL).
        encoded: The value's canonical encoding (JSON text, tag included).
    """

    tag: str
    encoded: str

    @property
    def value(self) -> Any:
        """The stored content under the tag, as JSON (a dataclass's fields), for display."""
        ((key, content),) = json.loads(self.encoded).items()
        return content[1] if key == "\x00c" else content


class Codec:
    """Encodes values to canonical bytes and back.

    A codec holds the registry of dataclasses it may encode. Register each dataclass
    under a stable name (it is stored with the value, so renaming the Python class does
    not break old checkpoints)::

        codec = Codec()
        codec.register(Vendor, name="vendor.v1")

    Args:
        strict: When False, a value with an unknown tag, an unregistered dataclass name
            or fields its registered class does not take decodes to an :class:`Opaque`
            (encoded back verbatim) instead of raising; for tools that do not know the
            writer's types.
    """

    def __init__(self, *, strict: bool = True) -> None:
        self._strict = strict
        self._by_type: dict[type[Any], str] = {}
        self._by_name: dict[str, type[Any]] = {}
        self._exact: set[type[Any]] = set()
        self._decoder = json.JSONDecoder(object_hook=self._hook)

    # -- registry ---------------------------------------------------------------------
    def register(
        self, cls: type[Any], *, name: str | None = None, exact: bool = False
    ) -> type[Any]:
        """Allow instances of a dataclass to be encoded.

        Args:
            cls: A dataclass type.
            name: The stable name stored with each value; defaults to
                ``module.QualName``.
            exact: Instances are immutable and ``==`` holds exactly when they encode
                alike (a frozen dataclass of strings and bytes): the store compares
                them with ``==`` when diffing a state instead of encoding both.

        Returns:
            ``cls``, so this can be used as a decorator via ``functools.partial``.

        Raises:
            CodecError: ``cls`` is not a dataclass, or the name is taken by another type.
        """
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise CodecError(f"only dataclasses can be registered, not {cls!r}")
        tag_name = name or f"{cls.__module__}.{cls.__qualname__}"
        existing = self._by_name.get(tag_name)
        if existing is not None and existing is not cls:
            raise CodecError(f"codec name {tag_name!r} is already registered for {existing!r}")
        self._by_type[cls] = tag_name
        self._by_name[tag_name] = cls
        if exact:
            self._exact.add(cls)
        else:
            self._exact.discard(cls)
        return cls

    def is_exact(self, cls: type[Any]) -> bool:
        """Whether ``cls`` was registered with ``exact=True``."""
        return cls in self._exact

    @property
    def registered(self) -> dict[str, type[Any]]:
        """The registered dataclasses by stored name (a copy)."""
        return dict(self._by_name)

    # -- encoding ---------------------------------------------------------------------
    def encode(self, value: Any) -> bytes:
        """Encode ``value`` to canonical UTF-8 JSON bytes.

        Raises:
            CodecError: The value (or something inside it) has an unsupported type.
        """
        try:
            return _DUMPS(self._tree(value)).encode("utf-8")
        except CodecError:
            raise
        except (ValueError, TypeError, RecursionError, UnicodeEncodeError) as exc:
            raise CodecError(f"cannot encode value: {exc}") from exc

    def _tree(self, v: Any) -> Any:
        t = type(v)
        if t is str or t is int or t is bool or v is None:
            return v
        if t is float:
            if math.isfinite(v):
                return v
            return {"\x00f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if t is dict:
            if len(v) == 2 and "$unknown" in v and "value" in v:
                raise CodecError(
                    'a dict {"$unknown": ..., "value": ...} is the lossy placeholder older '
                    "onceonly tools wrote for a value they could not decode; it is refused "
                    "as data (the value it stood for is lost in it). Restore the value "
                    "(an earlier checkpoint, `onceonly runs edit`) before saving"
                )
            tree = self._tree
            out: dict[str, Any] = {}
            for k, x in v.items():
                if type(k) is not str or k[:1] == _TAG:
                    return self._mapping(v)
                tx = type(x)
                out[k] = x if (tx is str or tx is int or tx is bool) else tree(x)
            return out
        if t is list:
            tree = self._tree
            return [x if type(x) is str else tree(x) for x in v]
        if t is tuple:
            return {"\x00t": [self._tree(x) for x in v]}
        if t is bytes:
            return {"\x00b": base64.b64encode(v).decode("ascii")}
        if t is _dt.datetime:
            off = v.utcoffset()
            if off is not None and off % _dt.timedelta(minutes=1):
                # fromisoformat drops sub-minute offsets: keep them exactly.
                naive = v.replace(tzinfo=None).isoformat()
                return {"\x00dto": [naive, off // _dt.timedelta(microseconds=1)]}
            return {"\x00dt": v.isoformat()}
        if t is _dt.date:
            return {"\x00d": v.isoformat()}
        if t is Decimal:
            return {"\x00n": str(v)}
        if t is uuid.UUID:
            return {"\x00u": v.hex}
        if t is set or t is frozenset:
            items = sorted((self._tree(x) for x in v), key=_DUMPS)
            return {("\x00S" if t is set else "\x00F"): items}
        if t is Opaque:
            return json.loads(v.encoded)  # verbatim: re-serialised to the same bytes
        name = self._by_type.get(t)
        if name is not None:
            fields = {
                f.name: self._tree(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init
            }
            return {"\x00c": [name, fields]}
        if dataclasses.is_dataclass(v):
            raise CodecError(
                f"dataclass {t.__module__}.{t.__qualname__} is not registered with this "
                f"codec; call codec.register({t.__qualname__}, name=...) before saving it"
            )
        raise CodecError(
            f"cannot encode a value of type {t.__module__}.{t.__qualname__}: supported are "
            f"None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, "
            f"datetime, date, Decimal, UUID and registered dataclasses"
        )

    def _mapping(self, v: dict[Any, Any]) -> dict[str, Any]:
        pairs = [(self._tree(k), self._tree(x)) for k, x in v.items()]
        pairs.sort(key=_sort_key)
        return {"\x00m": [list(p) for p in pairs]}

    # -- decoding ---------------------------------------------------------------------
    def decode(self, data: bytes | str) -> Any:
        """Decode bytes produced by :meth:`encode`.

        Raises:
            CorruptRecord: The bytes are not valid canonical JSON.
            UnknownCodecTag: A tag (or dataclass name) is not known to this codec
                (a strict one; a non-strict codec returns an :class:`Opaque`).
        """
        try:
            text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
            if not self._strict:
                return self._lenient(json.loads(text))
            if _ESCAPED_TAG not in text:
                # No string holds the tag character (JSON can only spell it escaped), so
                # the hook would hand back every object as it is: skip calling it.
                return _PLAIN(text)
            return self._decoder.decode(text)
        except CorruptRecord:
            raise
        except (ValueError, TypeError, RecursionError) as exc:
            raise CorruptRecord(f"undecodable value ({exc})") from exc

    def _hook(self, d: dict[str, Any]) -> Any:
        if len(d) != 1:
            return d
        ((k, x),) = d.items()
        if k[:1] != _TAG:
            return d
        try:
            decoder = _DECODERS.get(k)
            if decoder is not None:
                return decoder(x)
            if k == "\x00c":
                return self._dataclass(x)
            if k == "\x00m":
                return {(_hashable(p[0])): p[1] for p in x}
        except CorruptRecord:
            raise
        except Exception as exc:
            raise CorruptRecord(f"malformed {k[1:]!r} value ({type(exc).__name__}: {exc})") from exc
        raise UnknownCodecTag(f"unknown codec tag {k[1:]!r}")

    def _dataclass(self, x: Any) -> Any:
        name, fields = x
        cls = self._by_name.get(name)
        if cls is None:
            raise UnknownCodecTag(
                f"dataclass {name!r} is not registered with this codec; register the class "
                f"that wrote it with codec.register(cls, name={name!r})"
            )
        try:
            return cls(**fields)
        except TypeError as exc:
            raise UnknownCodecTag(
                f"stored fields of dataclass {name!r} do not match its definition ({exc}); "
                f"load with a codec that registers the old definition under this name, "
                f"convert the value, and save it again (or use a StateMigrations upgrade on "
                f"state that holds plain dicts)"
            ) from exc

    def _lenient(self, node: Any) -> Any:
        """Decode a parsed JSON tree, turning each tagged value this codec cannot rebuild
        into an :class:`Opaque` of its exact canonical form (the stored bytes are
        canonical, so re-serialising the parsed subtree gives them back)."""
        t = type(node)
        if t is list:
            return [self._lenient(x) for x in node]
        if t is not dict:
            return node
        inner = {k: self._lenient(x) for k, x in node.items()}
        if len(node) == 1:
            ((k, x),) = node.items()
            if k[:1] == _TAG:
                tag = x[0] if k == "\x00c" and type(x) is list and x else k[1:]
                try:
                    return self._hook(inner)
                except UnknownCodecTag:
                    return Opaque(str(tag), _DUMPS(node))
        return self._hook(inner)

    def readable(self, value: Any) -> Any:
        """``value`` as plain JSON for people and tools (``onceonly runs show``).

        Values JSON cannot carry keep their tagged canonical form (``{"\\u0000dt":
        "..."}``); a tagged value this codec does not know (an :class:`Opaque`) appears
        as ``{"$unknown": tag, "value": ...}``. For display only: this codec refuses to
        store that shape.

        Raises:
            CodecError: The value cannot be encoded.
        """

        def show(d: dict[str, Any]) -> Any:
            if len(d) == 1:
                ((k, x),) = d.items()
                if k == "\x00c" and type(x) is list and len(x) == 2 and x[0] not in self._by_name:
                    return {"$unknown": x[0], "value": x[1]}
                if k[:1] == _TAG and k not in _DECODERS and k not in ("\x00c", "\x00m"):
                    return {"$unknown": k[1:], "value": x}
            return d

        return json.loads(self.encode(value), object_hook=show)


def _hashable(v: Any) -> Any:
    # Keys of an escaped mapping arrive decoded; lists cannot be keys, tuples can.
    if type(v) is list:
        raise CorruptRecord("a mapping key decoded to a list")
    return v


def _float(x: str) -> float:
    if x not in ("nan", "inf", "-inf"):
        raise CorruptRecord(f"bad float tag value {x!r}")
    return float(x)


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "\x00t": tuple,
    # strict: only the base64 alphabet with exact padding (as b64decode(validate=True)
    # accepts), without its per-call Python checks
    "\x00b": lambda x: binascii.a2b_base64(x, strict_mode=True),
    "\x00dt": _dt.datetime.fromisoformat,
    "\x00d": _dt.date.fromisoformat,
    "\x00dto": lambda x: _dt.datetime.fromisoformat(x[0]).replace(
        tzinfo=_dt.timezone(_dt.timedelta(microseconds=int(x[1])))
    ),
    "\x00n": Decimal,
    "\x00u": lambda x: uuid.UUID(hex=x),
    "\x00S": set,
    "\x00F": frozenset,
    "\x00f": _float,
}
