"""The LangGraph checkpointer's serializer: LangGraph's encoding, a decoder that builds
only allow-listed types.

LangGraph's ``JsonPlusSerializer`` writes values our codec cannot hold as msgpack with
extension records naming a class (``module``, ``name``) and its arguments; its decoder
imports and calls whatever a record names (permissive by default, the only guard an
environment variable), and even in its strict mode it turns a refused record into its raw
arguments with a log line, so a state can change silently. :class:`StrictSerializer`
keeps LangGraph's encoding and its vetted list of types (``SAFE_MSGPACK_TYPES``: LangChain
messages and documents, LangGraph's ``Send`` / ``Interrupt`` / ``Command`` and other
markers, datetimes, UUIDs, decimals, sets, paths...) and decodes in two passes: first
every extension record in the value is checked against the allow-list, without importing
or calling anything; then, only if all pass, the value is built. A record naming any other
type is refused with :class:`UnregisteredType` (a :class:`~checkpoint.CorruptRecord`)
before any constructor runs; so is a value in LangGraph's ``json`` or ``pickle`` formats.

Types your graph stores (your Pydantic models, dataclasses, enums, named tuples) are
allowed by registering them: ``StrictSerializer(allow=[Order, Status])``. Writing a value
of a type that is not allowed fails at once (:class:`~checkpoint.CodecError`), not when
the checkpoint is next read. Under ``LANGGRAPH_STRICT_MSGPACK=true`` LangGraph adds the
types of a graph's state schema itself when it compiles (``with_msgpack_allowlist``).
"""

from __future__ import annotations

import importlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ormsgpack
from langgraph.checkpoint.serde._msgpack import (  # LangGraph's vetted types and methods
    SAFE_MSGPACK_METHODS,
    SAFE_MSGPACK_TYPES,
)
from langgraph.checkpoint.serde.jsonplus import (
    EXT_CONSTRUCTOR_KW_ARGS,
    EXT_CONSTRUCTOR_POS_ARGS,
    EXT_CONSTRUCTOR_SINGLE_ARG,
    EXT_DELTA_SNAPSHOT,
    EXT_METHOD_SINGLE_ARG,
    EXT_NUMPY_ARRAY,
    EXT_PYDANTIC_V1,
    EXT_PYDANTIC_V2,
    JsonPlusSerializer,
)
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from onceonly.checkpoint import CodecError, ConfigurationError, CorruptRecord

__all__ = ["StrictSerializer", "UnregisteredType"]

_NAMED = (
    EXT_CONSTRUCTOR_SINGLE_ARG,
    EXT_CONSTRUCTOR_POS_ARGS,
    EXT_CONSTRUCTOR_KW_ARGS,
    EXT_METHOD_SINGLE_ARG,
    EXT_PYDANTIC_V1,
    EXT_PYDANTIC_V2,
)
_OPT = ormsgpack.OPT_NON_STR_KEYS
_CHECKED = 8192  # encodings a serializer remembers as checked
_CHECKED_MAX_BYTES = 16384  # larger ones are checked every time
_PLAIN_FORMATS = ("null", "bytes", "bytearray")
_ARRAY32 = struct.Struct(">BI")  # a msgpack array32 header


class UnregisteredType(CorruptRecord):
    """A stored value names a type the saver's serializer does not build.

    Nothing of the value was constructed. If your graph stores values of this type,
    register it (``StrictSerializer(allow=[TheType])``); if it does not, the row was
    written by someone else (or by a saver with a permissive serializer).

    Attributes:
        type_name: ``module.name`` of the refused type (several: comma-separated), or
            the refused format.
    """

    def __init__(self, type_name: str, *, detail: str | None = None) -> None:
        self.type_name = type_name
        text = detail or (
            f"a stored value names {type_name}, a type the saver's serializer does not "
            f"build (not allow-listed); nothing of it was constructed"
        )
        super().__init__(text)
        # Not the generic advice (restore from a backup): usually a registration is missing.
        advice = (
            f"{text}. If your graph stores this type, register it: "
            f"OnceOnlySaver(..., serde=StrictSerializer(allow=[...])); otherwise the row "
            f"was written by someone else and is not read"
        )
        self.args = (advice,)


def _key(entry: type | tuple[str, ...]) -> tuple[str, str]:
    if isinstance(entry, type):
        return (entry.__module__, entry.__name__)
    if (
        isinstance(entry, tuple)
        and len(entry) == 2
        and all(isinstance(p, str) and p for p in entry)
    ):
        return (entry[0], entry[1])
    raise ConfigurationError(
        f"StrictSerializer(allow=...): a class or a (module, name) pair, not {entry!r}"
    )


class StrictSerializer(JsonPlusSerializer):
    """LangGraph's ``JsonPlusSerializer`` encoding; decoding builds only allow-listed
    types and refuses everything else before anything is constructed.

    Allowed without registration: LangGraph's ``SAFE_MSGPACK_TYPES`` (LangChain
    messages and documents, LangGraph's markers, datetimes, UUIDs, decimals, sets,
    deques, IP addresses, paths, zone infos), numeric NumPy arrays, and LangGraph's
    delta-channel snapshots. Never: pickle, LangGraph's legacy ``json`` format, any
    other class or callable.

    Args:
        allow: Further types to build: classes (Pydantic models, dataclasses, enums,
            named tuples) or ``(module, name)`` pairs.

    Raises:
        ConfigurationError: An entry of ``allow`` is neither.
    """

    def __init__(self, allow: Iterable[type | tuple[str, ...]] = ()) -> None:
        super().__init__(pickle_fallback=False, allowed_msgpack_modules=None)
        self._allow = tuple(allow)
        classes: dict[tuple[str, str], type] = {}
        names: set[tuple[str, str]] = {(m, n) for m, n, *_ in SAFE_MSGPACK_TYPES}
        for entry in self._allow:
            key = _key(entry)
            names.add(key)
            if isinstance(entry, type):
                classes[key] = entry
        self._classes = classes
        self._resolved: dict[tuple[str, str], Callable[..., Any]] = dict(classes)  # grows
        self.allowed: frozenset[tuple[str, str]] = frozenset(names)
        # Encodings this serializer already checked (pass 1 accepted them): the allow-list
        # never changes, so the same bytes pass again. A history listing decodes each
        # message once per checkpoint that holds it.
        self._checked: OrderedDict[bytes, bool] = OrderedDict()
        self._checked_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"StrictSerializer(<{len(self.allowed)} allowed types>)"

    def allowing(self, *types: type | tuple[str, ...]) -> StrictSerializer:
        """A serializer that also builds ``types``."""
        return StrictSerializer([*self._allow, *types])

    def with_msgpack_allowlist(
        self, extra_allowlist: Iterable[tuple[str, ...] | type]
    ) -> StrictSerializer:
        """LangGraph's hook (strict mode adds a graph's schema types when it compiles)."""
        wanted = [e for e in extra_allowlist if isinstance(e, type) or len(e) == 2]
        if all(_key(e) in self.allowed for e in wanted):
            return self
        return self.allowing(*wanted)

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        """Encode as LangGraph does, refusing a value this serializer would not read back.

        Raises:
            CodecError: The value is, or contains, an instance of a type that is not
                allowed (or that LangGraph cannot encode at all).
        """
        try:
            type_, data = super().dumps_typed(obj)
        except TypeError as exc:  # ormsgpack's encode error is a TypeError
            raise CodecError(f"LangGraph's serializer cannot encode this value: {exc}") from exc
        if type_ == "msgpack":
            try:
                self._check(data)
            except UnregisteredType as exc:
                names = ", ".join(n.rsplit(".", 1)[-1] for n in exc.type_name.split(", "))
                raise CodecError(
                    f"cannot store a value of {exc.type_name}: the saver's StrictSerializer "
                    f"builds only allow-listed types, so it could not be read back. Register "
                    f"them: OnceOnlySaver(..., serde=StrictSerializer(allow=[{names}]))"
                ) from None
        return type_, data

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """Decode, building only allowed types.

        Raises:
            UnregisteredType: The value names a type (or is in a format) that is not
                allowed; nothing of it was constructed.
            CorruptRecord: The bytes are not a value LangGraph's encoder writes.
        """
        type_, raw = data
        if type_ == "null":
            return None
        if type_ == "bytes":
            return bytes(raw)
        if type_ == "bytearray":
            return bytearray(raw)
        if type_ != "msgpack":
            raise UnregisteredType(
                f"{type_!r} data",
                detail=f"a stored value is in LangGraph's {type_!r} format, which the "
                f"saver's serializer never writes and does not read (it may construct "
                f"arbitrary objects)",
            )
        self._check(raw)
        return _Build(self._resolved).run(raw)

    def loads_many(self, datas: Sequence[bytes]) -> list[Any]:
        """:meth:`loads_typed` of each ``("msgpack", data)``, in one decoding pass: a list
        of messages (a state's history, built once per checkpoint a listing reads) pays
        one decoder call instead of one per item.

        Each item passes pass 1 on its own first, which also finds whether it holds
        exactly one value: bytes after a value (which :meth:`loads_typed` ignores, and
        pass 1 never looked at) would be read inside an array as the next item, built
        unchecked. Only exact items are decoded as one array, which must end exactly at
        a random marker after them; otherwise, or if anything failed, the items are
        decoded one by one, as :meth:`loads_typed` does: the values, and any error, are
        that method's.

        Raises:
            UnregisteredType / CorruptRecord: As :meth:`loads_typed`.
        """
        if all(self._check(raw) for raw in datas):
            marker = os.urandom(8)
            n = len(datas) + 1
            blob = b"".join([_ARRAY32.pack(0xDD, n), *datas, b"\xc4\x08", marker])
            try:
                built = _Build(self._resolved).run(blob)
            except Exception:  # noqa: BLE001  (decoded again one by one: their own error)
                built = None
            if type(built) is list and len(built) == n and built[-1] == marker:
                del built[-1]
                return built
        return [self.loads_typed(("msgpack", raw)) for raw in datas]

    def _check(self, raw: bytes) -> bool:
        """Pass 1 (:class:`_Check`), unless these exact bytes passed it before; whether
        they hold one value and nothing after it (what :meth:`loads_many` needs to read
        them inside an array).

        Raises:
            UnregisteredType / CorruptRecord: As :meth:`loads_typed`.
        """
        key = bytes(raw)
        with self._checked_lock:
            exact = self._checked.get(key)
            if exact is not None:
                self._checked.move_to_end(key)
                return exact
        exact = _Check(self.allowed).run_exact(key)
        if len(key) <= _CHECKED_MAX_BYTES:
            with self._checked_lock:
                self._checked[key] = exact
                while len(self._checked) > _CHECKED:
                    self._checked.popitem(last=False)
        return exact


class _Pass:
    """One decoding pass. ormsgpack reports an error raised in an ext hook as a bare
    ``ValueError``: the hook keeps the real one to raise it after."""

    def __init__(self) -> None:
        self.error: CorruptRecord | None = None

    def run(self, data: bytes) -> Any:
        """The value ``data`` encodes (pass 1: None; pass 2: the value)."""
        return self.unpack(data)

    def unpack(self, data: bytes) -> Any:
        try:
            return ormsgpack.unpackb(data, ext_hook=self._hook, option=_OPT)
        except (ValueError, TypeError) as exc:
            if self.error is not None:
                raise self.error from None
            raise CorruptRecord(f"a stored value is not valid msgpack ({exc})") from None

    def _hook(self, code: int, data: bytes) -> Any:
        if self.error is not None:  # an inner record failed: stop at once
            raise self.error
        try:
            return self.ext(code, data)
        except CorruptRecord as exc:
            self.error = exc
            raise
        except Exception as exc:
            self.error = CorruptRecord(f"a stored value could not be rebuilt ({exc!r})")
            raise

    def ext(self, code: int, data: bytes) -> Any:
        raise NotImplementedError


def _named(tup: Any, code: int) -> tuple[str, str]:
    size = 4 if code in (EXT_METHOD_SINGLE_ARG, EXT_PYDANTIC_V2) else 3
    if not (
        isinstance(tup, list)
        and len(tup) >= (4 if code == EXT_METHOD_SINGLE_ARG else 3)
        and len(tup) <= size
        and isinstance(tup[0], str)
        and isinstance(tup[1], str)
    ):
        raise CorruptRecord(f"a stored value has a malformed extension record (code {code})")
    return tup[0], tup[1]


class _Check(_Pass):
    """Pass 1: every extension record names an allowed type; nothing is imported or
    called. Every refused type is named (a writer registers them all at once)."""

    def __init__(self, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__()
        self.allowed = allowed
        self.refused: dict[str, None] = {}

    def run(self, data: bytes) -> Any:
        self.unpack(data)
        if self.refused:
            raise UnregisteredType(", ".join(self.refused))
        return None

    def run_exact(self, data: bytes) -> bool:
        """:meth:`run`, and whether ``data`` holds one value with nothing after it: read
        as the first of a two-item array whose second is a random marker (a
        :class:`_Check` serves one call)."""
        marker = os.urandom(8)
        try:
            out = self.unpack(b"".join([_ARRAY32.pack(0xDD, 2), data, b"\xc4\x08", marker]))
        except CorruptRecord:
            out = None
        if type(out) is list and len(out) == 2 and out[1] == marker:
            if self.refused:
                raise UnregisteredType(", ".join(self.refused))
            return True
        # More (or less) than one value: checked as loads_typed reads it, alone.
        _Check(self.allowed).run(data)
        return False

    def ext(self, code: int, data: bytes) -> Any:
        inner = self.unpack(data)
        if code == EXT_DELTA_SNAPSHOT:
            return None
        if code == EXT_NUMPY_ARRAY:
            if not (isinstance(inner, list) and len(inner) == 4 and isinstance(inner[0], str)):
                raise CorruptRecord("a stored NumPy array is malformed")
            try:
                numpy = importlib.import_module("numpy")  # only when an array is stored
                dtype = numpy.dtype(inner[0])
            except (ImportError, TypeError, ValueError) as exc:
                raise CorruptRecord(f"a stored NumPy array cannot be read ({exc})") from exc
            if dtype.hasobject:
                self.refused["numpy object array"] = None
            return None
        if code not in _NAMED:
            self.refused[f"msgpack extension {code}"] = None
            return None
        module, name = _named(inner, code)
        if code == EXT_METHOD_SINGLE_ARG:
            method = inner[3]
            if not isinstance(method, str) or (module, name, method) not in SAFE_MSGPACK_METHODS:
                self.refused[f"{module}.{name}.{method}"] = None
        elif (module, name) not in self.allowed:
            self.refused[f"{module}.{name}"] = None
        return None


class _Build(_Pass):
    """Pass 2 (after pass 1 accepted the value): build it, as LangGraph's decoder does."""

    def __init__(self, classes: dict[tuple[str, str], Callable[..., Any]]) -> None:
        super().__init__()
        self.classes = classes

    def _resolve(self, module: str, name: str) -> Callable[..., Any]:
        found = self.classes.get((module, name))
        if found is not None:
            return found
        obj: Callable[..., Any] = getattr(importlib.import_module(module), name)
        # Remembered for the serializer's later passes (pass 1 admitted the name; the
        # map is the serializer's own, and only allowed names ever reach it).
        self.classes[(module, name)] = obj
        return obj

    def ext(self, code: int, data: bytes) -> Any:
        inner = self.unpack(data)
        if code == EXT_DELTA_SNAPSHOT:
            return _DeltaSnapshot(inner)
        if code == EXT_NUMPY_ARRAY:
            numpy = importlib.import_module("numpy")
            dtype_str, shape, order, buf = inner
            return numpy.frombuffer(buf, dtype=numpy.dtype(dtype_str)).reshape(shape, order=order)
        module, name = _named(inner, code)
        target = self._resolve(module, name)
        if code == EXT_CONSTRUCTOR_SINGLE_ARG:
            return target(inner[2])
        if code == EXT_CONSTRUCTOR_POS_ARGS:
            if (module, name) == ("langgraph.types", "Send"):
                return _send(inner[2])
            return target(*inner[2])
        if code == EXT_CONSTRUCTOR_KW_ARGS:
            return target(**inner[2])
        if code == EXT_METHOD_SINGLE_ARG:
            return getattr(target, inner[3])(inner[2])
        # Pydantic: validated construction, else (a model that changed) as LangGraph does.
        try:
            return target(**inner[2])
        except (TypeError, ValueError):  # pydantic's ValidationError is a ValueError
            fallback = "construct" if code == EXT_PYDANTIC_V1 else "model_construct"
            return getattr(target, fallback)(**inner[2])


def _send(args: Any) -> Any:
    from langgraph.types import Send  # noqa: PLC0415  (langgraph.types imports the serde)

    # LangGraph writes Send(node, arg) or Send(node, arg, timeout); the timeout is
    # keyword-only.
    if len(args) == 3:
        return Send(args[0], args[1], timeout=args[2])
    return Send(*args)
