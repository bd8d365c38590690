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

from dataclasses import dataclass
from typing import Any, Protocol

from onceonly.checkpoint import Codec, CodecError, _delta

__all__ = [
    "SERDE_VALUE_NAME",
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


def pack(v: Any, serde: Serde) -> Any:
    """``v`` with every part our codec cannot store exactly replaced by a
    :class:`SerdeValue`."""
    t = type(v)
    if t is str or t is int or t is float or t is bool or v is None or t is bytes:
        return v
    if t is list:
        return [x if type(x) is str else pack(x, serde) for x in v]
    if t is dict:
        if all(type(k) is str for k in v):
            return {k: (x if type(x) is str else pack(x, serde)) for k, x in v.items()}
    elif t is tuple:
        return tuple(pack(x, serde) for x in v)
    type_, data = serde.dumps_typed(v)
    if type(data) is not bytes:
        data = bytes(data)
    return SerdeValue(type_, data)


def unpack(v: Any, serde: Serde) -> Any:
    """The inverse of :func:`pack`."""
    t = type(v)
    if t is str or t is int or t is float or t is bool or v is None or t is bytes:
        return v
    if t is list:
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
