"""How LangGraph values are stored: our canonical codec where it is exact, LangGraph's
serde for the rest.

A value made only of ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and
``list`` / ``tuple`` / ``dict`` (string keys) of such values is stored as itself in
canonical codec JSON, so the checkpoint core can diff it (a dict channel key by key, a
list channel by its appended items). Anything else inside it (a LangChain message, a
Pydantic model, an enum, a datetime with a named zone, LangGraph's own markers) is
serialised by the saver's serde (``JsonPlusSerializer``: msgpack) and stored as a
:class:`SerdeValue` leaf, its bytes inside the canonical JSON. Decoding reverses both.

Imports nothing from LangGraph; the serde is passed in.
"""

from __future__ import annotations

import math
import operator
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import compress
from typing import Any, Protocol

from onceonly.checkpoint import Codec, CodecError, _delta

__all__ = [
    "SERDE_VALUE_NAME",
    "PackMemo",
    "Serde",
    "SerdeValue",
    "pack",
    "register",
    "seal",
    "unpack",
    "unseal",
]

SERDE_VALUE_NAME = "onceonly.langgraph.serde.v1"


class Serde(Protocol):
    """LangGraph's ``SerializerProtocol`` (typed methods only)."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]: ...

    def loads_typed(self, data: tuple[str, bytes]) -> Any: ...


@dataclass(frozen=True)
class SerdeValue:
    """A value our codec cannot represent exactly, as LangGraph's serde wrote it.

    Attributes:
        type: The serde's type tag (``"msgpack"``, ``"json"``, ...).
        data: The serde's bytes.
    """

    type: str
    data: bytes

    def __copy__(self) -> SerdeValue:
        return self  # immutable: a private copy of a state may share it

    def __deepcopy__(self, memo: dict[int, Any]) -> SerdeValue:
        return self


def register(codec: Codec) -> None:
    """Allow :class:`SerdeValue` leaves on ``codec``.

    Raises:
        CodecError: The name is taken by another class on this codec.
    """
    if codec.registered.get(SERDE_VALUE_NAME) is not SerdeValue:
        codec.register(SerdeValue, name=SERDE_VALUE_NAME, exact=True)


def pack(v: Any, serde: Serde, memo: PackMemo | None = None) -> Any:
    """``v`` with every part our codec cannot store exactly replaced by a
    :class:`SerdeValue`.

    ``memo``: the serde's encodings of objects packed before, reused for an object that
    is provably unchanged since (see :class:`PackMemo`)."""
    t = type(v)
    if t is str or t is int or t is float or t is bool or v is None or t is bytes:
        return v
    if t is list:
        if _STR_ONLY.issuperset(map(type, v)):
            return v.copy()  # strings only (checked in C): nothing to pack
        if memo is not None:
            return memo.pack_list(v, serde)
        return [x if type(x) is str else pack(x, serde, memo) for x in v]
    if t is dict:
        if _STR_ONLY.issuperset(map(type, v)):
            if _STR_ONLY.issuperset(map(type, v.values())):
                return v.copy()
            return {k: (x if type(x) is str else pack(x, serde, memo)) for k, x in v.items()}
    elif t is tuple:
        return tuple(pack(x, serde, memo) for x in v)
    if memo is None:
        return _dump(v, serde)
    return memo.pack(v, serde)


_STR_ONLY = frozenset({str})


def _dump(v: Any, serde: Serde) -> SerdeValue:
    type_, data = serde.dumps_typed(v)
    if type(data) is not bytes:
        data = bytes(data)
    return SerdeValue(type_, data)


class PackMemo:
    """The serde's encodings of the objects a saver packed lately, reused while each
    object is provably unchanged.

    A LangGraph state carries the same message objects from step to step (a
    ``messages`` channel is the previous list plus the new ones), and a checkpoint
    stores the whole state: without a memo every message would be encoded again at
    every step. Message objects are mutable, so an entry is reused only if the object
    is still equal to a snapshot taken before it was encoded, compared strictly enough
    that equal means "encodes to the same bytes":

    * only instances of Pydantic models whose ``model_dump`` is a function of their
      fields alone (Pydantic's own ``model_dump``, no computed fields, no serializer
      functions) are memoised: LangChain's messages are such models;
    * every field value (and every extra) must be built of ``str``, ``bytes``,
      ``None``, ``bool``, ``int``, ``float``, ``list``, ``tuple`` and ``dict`` with
      ``str`` keys, exactly those types; anything else is encoded every time;
    * the snapshot compares ``bool``, ``int``, ``float`` and ``bytes`` by type as well
      as value (``1``, ``1.0`` and ``True`` differ, so do ``-0.0`` and ``0.0``), and
      dicts in key order as well.

    An edited field, a new extra, an item appended to a nested list, a value replaced
    by an equal one of another type: each encodes again. Strings, ``None``, lists and
    tuples are compared by Python's own equality, which also asks an object that
    replaced one of them: an object whose ``__eq__`` claims to equal a string it is not
    (``unittest.mock.ANY``) would go unseen. A snapshot taken before the encoding means
    an edit racing with it reads as a change, never as no change. The memo belongs to
    one serde (another one empties it) and holds at most ``size`` objects whose
    encodings total at most ``max_bytes`` (the least recently used go first), keeping
    them alive meanwhile.
    """

    def __init__(self, size: int = 4096, max_bytes: int = 32 << 20) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._bytes = 0
        self._serde: Serde | None = None
        self._entries: OrderedDict[int, tuple[Any, Any, SerdeValue]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def pack_list(self, items: list[Any], serde: Serde) -> list[Any]:
        """:func:`pack` of each item of a list: the memo's entries for all of them are
        looked up (and marked as used) at once, so that a list of messages carried from
        step to step costs one lookup pass and one check per message."""
        ids = list(map(id, items))
        with self._lock:
            if serde is not self._serde:
                self._entries.clear()
                self._bytes = 0
                self._serde = serde
            entries = list(map(self._entries.get, ids))
            # most recently used: every item found (in C; an entry is a non-empty tuple)
            deque(map(self._entries.move_to_end, compress(ids, entries)), maxlen=0)
        out: list[Any] = []
        add = out.append
        hits = 0
        for x, entry in zip(items, entries, strict=True):
            if entry is not None and entry[0] is x and _unchanged(x, entry[1]):
                hits += 1
                add(entry[2])
            else:
                add(x if type(x) is str else pack(x, serde, self))
        self.hits += hits
        return out

    def pack(self, v: Any, serde: Serde) -> SerdeValue:
        """``v``'s encoding by ``serde``: the memoised one while ``v`` is unchanged."""
        key = id(v)
        with self._lock:
            if serde is not self._serde:
                self._entries.clear()
                self._bytes = 0
                self._serde = serde
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None and entry[0] is v and _unchanged(v, entry[1]):
            self.hits += 1
            return entry[2]
        snap = _snapshot(v)  # before the encoding: an edit meanwhile reads as a change
        packed = _dump(v, serde)
        if snap is not None and len(packed.data) <= self.max_bytes:
            with self._lock:
                if serde is self._serde:
                    old = self._entries.pop(key, None)
                    if old is not None:
                        self._bytes -= len(old[2].data)
                    self._entries[key] = (v, snap, packed)
                    self._bytes += len(packed.data)
                    while len(self._entries) > self.size or self._bytes > self.max_bytes:
                        self._bytes -= len(self._entries.popitem(last=False)[1][2].data)
        return packed


class _NotPlain(Exception):
    """A value the memo does not snapshot."""


_PLAIN_MODELS: dict[type, bool] = {}


def _plain_model(cls: type) -> bool:
    """Whether ``cls`` is a Pydantic model whose ``model_dump`` depends on its field
    values (``__dict__``) and extras alone."""
    known = _PLAIN_MODELS.get(cls)
    if known is not None:
        return known
    ok = False
    base = next(
        (c for c in cls.__mro__ if c.__module__ == "pydantic.main" and c.__name__ == "BaseModel"),
        None,
    )
    if base is not None:
        decorators = getattr(cls, "__pydantic_decorators__", None)
        ok = bool(
            getattr(cls, "model_dump", None) is base.__dict__.get("model_dump")
            and getattr(cls, "__pydantic_complete__", False)
            and not getattr(cls, "model_computed_fields", True)
            and decorators is not None
            and not decorators.field_serializers
            and not decorators.model_serializers
            and not _has_serializer(getattr(cls, "__pydantic_core_schema__", None))
        )
    _PLAIN_MODELS[cls] = ok
    return ok


def _has_serializer(schema: Any) -> bool:
    """Whether a Pydantic core schema names a serializer function anywhere."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "serialization" in node or node.get("computed_fields"):
                return True
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False


def _snapshot(v: Any) -> Any:
    """A strict copy of ``v``'s fields and extras (``None``: not memoised)."""
    if not _plain_model(type(v)):
        return None
    try:
        fields = _freeze(vars(v))
        extra = _freeze(getattr(v, "__pydantic_extra__", None))
    except (_NotPlain, RecursionError):
        return None
    return (fields, extra)


def _unchanged(v: Any, snap: Any) -> bool:
    """Whether ``v`` still equals its snapshot (the snapshot compares first)."""
    fields, extra = snap
    try:
        return bool(fields == vars(v) and extra == getattr(v, "__pydantic_extra__", None))
    except Exception:  # noqa: BLE001  (a value that cannot be compared: encode again)
        return False


def _freeze(x: Any) -> Any:
    t = type(x)
    if t is str or x is None:
        return x  # compared by identity first, then by str's (or None's) own __eq__
    if t is bool:
        return _TRUE if x else _FALSE
    if t is int:
        return _Int(x)
    if t is float:
        return _Float(x)
    if t is list:
        return [_freeze(i) for i in x]
    if t is tuple:
        return tuple(_freeze(i) for i in x)
    if t is dict:
        if not all(type(k) is str for k in x):
            raise _NotPlain
        frozen = {k: _freeze(i) for k, i in x.items()}
        return _Ordered(frozen) if len(frozen) > 1 else frozen
    if t is bytes:
        return _Bytes(x)
    raise _NotPlain


# Strict stand-ins in a snapshot, where the builtin equality is too lenient for "encodes
# the same": 1 == 1.0 == True, -0.0 == 0.0, b"x" == bytearray(b"x"), and dicts equal in
# any key order. Each derives from the builtin type it stands for, or compares against
# objects that do not derive from it, so its own __eq__ runs first whichever side of a
# comparison it is on.


class _Bool:
    """``True`` or ``False``: equal to that very object only."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, *, value: bool) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return other is self.value

    def __ne__(self, other: object) -> bool:
        return other is not self.value


_TRUE = _Bool(value=True)
_FALSE = _Bool(value=False)


class _Strict:
    """Unequal exactly when not equal (a builtin base's ``__ne__`` would use the lenient
    equality). Each subclass defines ``__eq__`` without ``__hash__``: unhashable."""

    __slots__ = ()

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


class _Int(_Strict, int):  # noqa: PLW1641
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is int and int.__eq__(self, other)


class _Float(_Strict, float):  # noqa: PLW1641
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        # -0.0 and 0.0 encode differently; a NaN never equals (encoded again)
        return (
            type(other) is float
            and float.__eq__(self, other)
            and math.copysign(1.0, self) == math.copysign(1.0, other)
        )


class _Bytes(_Strict, bytes):  # noqa: PLW1641
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is bytes and bytes.__eq__(self, other)


class _Ordered(_Strict, dict):  # type: ignore[type-arg]  # noqa: PLW1641
    """A dict equal only to a dict with the same items in the same order."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        # Equal dicts hold the same keys; in the same order if key for key the same
        # objects (most often: the same interned names), else compared by value.
        return (
            type(other) is dict
            and dict.__eq__(self, other)
            and (all(map(operator.is_, self, other)) or list(self) == list(other))
        )


def unpack(v: Any, serde: Serde) -> Any:
    """The inverse of :func:`pack`."""
    t = type(v)
    if t is str or t is int or t is float or t is bool or v is None or t is bytes:
        return v
    if t is list:
        many = getattr(serde, "loads_many", None)
        if many is not None and len(v) > 1:
            # A list of messages: the serde's one decoding pass for all of them.
            datas = [x.data for x in v if type(x) is SerdeValue and x.type == "msgpack"]
            if len(datas) > 1:
                built = iter(many(datas))
                return [
                    next(built)
                    if type(x) is SerdeValue and x.type == "msgpack"
                    else (x if type(x) is str else unpack(x, serde))
                    for x in v
                ]
        return [x if type(x) is str else unpack(x, serde) for x in v]
    if t is dict:
        return {k: (x if type(x) is str else unpack(x, serde)) for k, x in v.items()}
    if t is tuple:
        return tuple(unpack(x, serde) for x in v)
    if t is SerdeValue:
        return serde.loads_typed((v.type, v.data))
    raise CodecError(f"unexpected stored value of type {t.__name__}")


def seal(raw: bytes) -> bytes:
    """Stored form of canonical bytes, as the checkpoint core stores its bodies and
    blobs (zstd-compressed when that saves at least 10 %; see ``_delta.pack``)."""
    return _delta.pack(raw)


def unseal(stored: bytes) -> bytes:
    """Canonical bytes from their stored form (zstd, the zlib of releases before 0.2,
    or raw).

    Raises:
        CorruptRecord: Unknown header or damaged compressed data.
    """
    return _delta.unpack(stored)
