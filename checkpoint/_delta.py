"""The delta + keyframe storage model, independent of the database.

A run's state is a mapping of channels. A checkpoint body is canonical codec JSON:

* a **delta** ``{"d": {channel: op}}`` with ops ``["s", value]`` (set), ``["sb", hex]``
  (set, value in a blob), ``["x"]`` (delete), ``["m", {key: value}, [deleted keys]]``
  (merge into a dict channel) and ``["a", [items]]`` (append to a list channel);
* a **keyframe** ``{"k": {channel: entry}}`` with entries ``["s", value]``, ``["sb", hex]``,
  ``["M", [page hex, ...]]`` (a large dict split into pages by a stable hash of the key)
  and ``["L", [[chunk hex, count, size], ...], [tail items]]`` (a list stored as sealed
  chunks plus a short inline tail).

Pages, chunks and large values are content-addressed blobs (blake3 of their canonical
bytes), so an unchanged page or a sealed chunk is shared by every keyframe, run and
process that refers to it. Appending to a list writes only the appended items; a
keyframe seals full chunks once and refers to old ones by hash.
"""

from __future__ import annotations

import operator
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, overload

import blake3
import zstandard

from .codec import Codec, Opaque
from .errors import CodecError, CorruptRecord

BLOB_MIN = 4096  # a set value at least this large (encoded) goes to a blob
MAP_MIN_KEYS = 64  # a dict channel at least this large is paged in keyframes
PAGE_KEYS = 128  # target keys per page
CHUNK_ITEMS = 64  # items per sealed list chunk
_COMPRESS_MIN = 256

_RAW = b"j"
_ZLIB = b"z"  # written by releases before 0.2; still read
_ZSTD = b"Z"  # a bare zstd frame: written by earlier releases; still read
# A zstd frame after a blake3 digest of the frame's own bytes. The digests and seals above
# this layer cover the decompressed bytes, and a frame can be edited without changing
# what it decompresses to (a header bit the decoder ignores, padding in a bitstream):
# about one bit flip in 3,000 in a frame goes unseen by them. The digest makes any edit
# of the stored bytes a refusal.
_ZSTD_SUMMED = b"C"
_SUM = 16


class _Codecs(threading.local):
    """Per-thread zstd contexts (a context serves one thread at a time; creating one per
    call costs more than compressing a delta)."""

    def __init__(self) -> None:
        self.c = zstandard.ZstdCompressor(level=3)
        self.d = zstandard.ZstdDecompressor()


_codecs = _Codecs()


def blob_hash(raw: bytes) -> bytes:
    """Content address of canonical bytes."""
    return blake3.blake3(raw).digest()


def pack(raw: bytes) -> bytes:
    """Stored form of canonical bytes: zstd-compressed when that saves at least 10 %,
    the frame preceded by a digest of its own bytes (any edit of the stored bytes is
    refused on read, even one the frame would decompress through unchanged).

    zstd rather than zlib: it decompresses four to five times faster (a fresh process's
    load of a large state is mostly decompression) and compresses these payloads as
    small or smaller.
    """
    if len(raw) >= _COMPRESS_MIN:
        z = _codecs.c.compress(raw)
        if len(z) + _SUM < len(raw) * 0.9:
            return _ZSTD_SUMMED + blake3.blake3(z).digest(length=_SUM) + z
    return _RAW + raw


def unpack(stored: bytes) -> bytes:
    """Canonical bytes from their stored form.

    Raises:
        CorruptRecord: Unknown header, a frame that fails its digest, or undecompressible
            data (caller adds location).
    """
    head, body = stored[:1], stored[1:]
    if head == _RAW:
        return bytes(body)
    if head == _ZSTD_SUMMED:
        frame = body[_SUM:]
        if len(body) <= _SUM or blake3.blake3(frame).digest(length=_SUM) != body[:_SUM]:
            raise CorruptRecord("compressed data is damaged (it does not match its checksum)")
        return _unzstd(frame)
    if head == _ZSTD:
        return _unzstd(body)
    if head == _ZLIB:
        try:
            return zlib.decompress(body)
        except zlib.error as exc:
            raise CorruptRecord(f"compressed data is damaged ({exc})") from exc
    raise CorruptRecord(f"unknown storage header {head!r}")


# zstd's densest block (RLE: 4 bytes for up to 128 KiB) bounds what a frame can hold.
_MAX_RATIO = 32768
_BLOCK = 128 << 10


def _unzstd(frame: bytes) -> bytes:
    try:
        # pack() writes the content size into every frame; one without is not ours
        size = zstandard.frame_content_size(frame)
        if size < 0:
            raise CorruptRecord("compressed data is damaged (no content size)")
        if size > len(frame) * _MAX_RATIO + _BLOCK:
            # an edited size field: the output buffer is allocated for it up front
            raise CorruptRecord(
                f"compressed data is damaged (a {len(frame)}-byte frame says it holds {size} bytes)"
            )
        return _codecs.d.decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptRecord(f"compressed data is damaged ({exc})") from exc


def row_digest(
    run_id: str,
    seq: int,
    kind: int,
    keyframe_seq: int,
    schema_version: int,
    step: str,
    source: str,
    created_at: float,
    raw: bytes,
) -> bytes:
    """Digest binding a checkpoint body to every column of its row: editing, moving or
    truncating either is detected."""
    meta = "\x1f".join(
        [
            run_id,
            str(seq),
            str(kind),
            str(keyframe_seq),
            str(schema_version),
            step,
            source,
            repr(float(created_at)),
        ]
    ).encode("utf-8")
    return blake3.blake3(b"%d:%s|" % (len(meta), meta) + raw).digest(length=16)


# -- lazily loaded list channels ------------------------------------------------------

ChunkFetcher = Callable[[Sequence[str]], dict[str, list[Any]]]


class ChunkedList(Sequence[Any]):
    """A list channel whose sealed chunks are read from the store on first access.

    Returned by ``Store.load(..., lazy=True)`` for long lists (message histories):
    ``len()`` and appending cost nothing, indexing or slicing near the end reads only the
    chunks it touches, and iterating reads them all in one query. Chunks are verified
    against their hashes when read. Compare it with ``==`` to a list, or call
    :meth:`to_list` for a plain list.
    """

    __slots__ = ("_cache", "_chunks", "_fetch", "_sealed", "_starts", "_tail")

    def __init__(
        self,
        chunks: list[tuple[str, int, int]],
        tail: list[Any],
        fetch: ChunkFetcher,
        cache: dict[str, list[Any]] | None = None,
    ) -> None:
        self._chunks = chunks
        self._tail = tail
        self._fetch = fetch
        self._cache: dict[str, list[Any]] = {} if cache is None else cache
        self._starts: list[int] = []
        n = 0
        for _h, count, _size in chunks:
            self._starts.append(n)
            n += count
        self._sealed = n

    def __len__(self) -> int:
        return self._sealed + len(self._tail)

    def _load(self, hexes: Sequence[str]) -> None:
        missing = [h for h in hexes if h not in self._cache]
        if missing:
            fetched = self._fetch(missing)
            counts = {c[0]: c[1] for c in self._chunks}
            for h, items in fetched.items():
                if type(items) is not list or len(items) != counts.get(h, -1):
                    raise CorruptRecord(f"list chunk {h} has the wrong length", blob=h)
            self._cache.update(fetched)

    def _chunk(self, i: int) -> list[Any]:
        h = self._chunks[i][0]
        self._load([h])
        return self._cache[h]

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            rng = range(start, stop, step)
            if step == 1 and start >= self._sealed:
                return self._tail[start - self._sealed : stop - self._sealed]
            first = self._chunk_index(rng[0]) if rng else 0
            last = self._chunk_index(rng[-1]) if rng else 0
            self._load([c[0] for c in self._chunks[first : last + 1]])
            return [self[i] for i in rng]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError("list index out of range")
        if i >= self._sealed:
            return self._tail[i - self._sealed]
        ci = self._chunk_index(i)
        return self._chunk(ci)[i - self._starts[ci]]

    def _chunk_index(self, i: int) -> int:
        import bisect  # noqa: PLC0415  (stdlib, cheap; only on indexed access)

        return bisect.bisect_right(self._starts, i) - 1 if i < self._sealed else len(self._chunks)

    def __iter__(self) -> Iterator[Any]:
        self._load([c[0] for c in self._chunks])
        for h, _count, _size in self._chunks:
            yield from self._cache[h]
        yield from self._tail

    def to_list(self) -> list[Any]:
        """All items as a plain list (reads every chunk not yet read)."""
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkedList):
            if other._chunks == self._chunks:
                return bool(other._tail == self._tail)
            return self.to_list() == other.to_list()
        if isinstance(other, list):
            return len(other) == len(self) and self.to_list() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkedList(len={len(self)}, chunks={len(self._chunks)})"

    def copy(self) -> ChunkedList:
        """A copy sharing the immutable chunks (and their read cache), not the tail."""
        return ChunkedList(
            list(self._chunks), [private_copy(x) for x in self._tail], self._fetch, self._cache
        )

    def _extend(self, items: list[Any]) -> None:
        self._tail.extend(items)

    def _seal(self, chunk: tuple[str, int, int], items: list[Any]) -> None:
        self._starts.append(self._sealed)
        self._chunks.append(chunk)
        self._sealed += chunk[1]
        self._cache[chunk[0]] = items
        del self._tail[: chunk[1]]


def plain(v: Any) -> Any:
    """``v`` with a lazily loaded list turned into a plain list."""
    return v.to_list() if type(v) is ChunkedList else v


# -- structural equality and private copies -------------------------------------------


def same(a: Any, b: Any, codec: Codec) -> bool:
    """Whether ``a`` and ``b`` would be stored identically.

    Stricter than ``==``: types must match all the way down (``1``, ``1.0`` and ``True``
    differ; so do ``0.0`` and ``-0.0``, or equal instants with different UTC offsets).
    Plain containers of plain values are compared directly; anything else by its
    canonical encoding.
    """
    if a is b:
        return True
    ta = type(a)
    if ta is not type(b):
        return False
    if ta is str or ta is int or ta is bytes or ta is bool or ta is Opaque:
        return bool(a == b)  # an Opaque is its exact encoding
    if ta is float:
        return bool(a.hex() == b.hex())  # keeps -0.0 apart from 0.0; nan matches nan
    if ta is list or ta is tuple:
        return len(a) == len(b) and all(same(x, y, codec) for x, y in zip(a, b, strict=True))
    if ta is dict and _pageable(a) and _pageable(b):
        if len(a) != len(b):
            return False
        return all(k in b and same(x, b[k], codec) for k, x in a.items())
    if codec.is_exact(ta):
        return bool(a == b)
    try:
        return codec.encode(a) == codec.encode(b)
    except CodecError:
        return False


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, Opaque})


def private_copy(v: Any) -> Any:
    """A copy sharing no mutable container with ``v`` (immutable leaves are shared)."""
    t = type(v)
    if t in _LEAVES:
        return v
    # leaves are taken as they are, without a call each (a loaded state is mostly leaves)
    if t is dict:
        return {k: x if type(x) in _LEAVES else private_copy(x) for k, x in v.items()}
    if t is list:
        return [x if type(x) in _LEAVES else private_copy(x) for x in v]
    if t is tuple:
        return tuple(private_copy(x) for x in v)
    if t is set:
        return set(v)
    if t is ChunkedList:
        return v.copy()
    import copy  # noqa: PLC0415  (rare path: dataclasses and other registered values)

    return copy.deepcopy(v)


def _pageable(v: Any) -> bool:
    """Whether ``v`` is a dict whose keys are all strings, none starting with NUL (the
    codec's tag prefix): checked in C for the common case (a channel's state of
    thousands of keys is checked on every save)."""
    if type(v) is not dict:
        return False
    if not v:
        return True
    if _STR_ONLY.issuperset(map(type, v)):
        # A key starting with NUL sorts before every other key but "": the least key
        # tells, unless it is "".
        least: str = min(v)
        if least:
            return least[:1] != "\x00"
        return all(k[:1] != "\x00" for k in v)
    return False


_STR_ONLY = frozenset({str})


# -- diff and apply ------------------------------------------------------------------

Op = tuple[Any, ...]


def check_channel(ch: object) -> None:
    if type(ch) is not str or ch[:1] == "\x00":
        raise CodecError(f"channel names must be strings not starting with NUL: {ch!r}")


def _list_diff(o: Any, v: Any, codec: Codec) -> Op | None:
    """Append op, set op, or None (unchanged) for a list channel."""
    if type(o) is ChunkedList and type(v) is ChunkedList and o._chunks == v._chunks:
        n = len(o._tail)
        tail = v._tail
        if len(tail) >= n and _same_prefix(o._tail, tail, codec):
            return ("a", tail[n:]) if len(tail) > n else None
        return ("s", v.to_list())
    ol, vl = plain(o), plain(v)
    n = len(ol)
    if len(vl) >= n and _same_prefix(ol, vl, codec):
        return ("a", vl[n:]) if len(vl) > n else None
    return ("s", vl)


def _same_prefix(old: Sequence[Any], new: Sequence[Any], codec: Codec) -> bool:
    """Whether ``new`` starts with the items of ``old`` (``len(new) >= len(old)``). An
    unchanged item is most often the very object stored before: the identities are
    compared in C first, item by item only if one differs."""
    if all(map(operator.is_, old, new)):
        return True
    return all(x is y or same(x, y, codec) for x, y in zip(old, new, strict=False))


_ABSENT = object()


def diff(old: Mapping[str, Any], new: Mapping[str, Any], codec: Codec) -> dict[str, Op]:
    """The ops that turn ``old`` into ``new``."""
    return diff_known(old, new, codec, frozenset())[0]


def diff_known(
    old: Mapping[str, Any], new: Mapping[str, Any], codec: Codec, paged: AbstractSet[str]
) -> tuple[dict[str, Op], frozenset[str]]:
    """The ops that turn ``old`` into ``new``, knowing that ``old``'s dict channels named
    in ``paged`` are pageable; and the dict channels of ``new`` found pageable (for the
    next call, once ``new`` is the old state).

    A dict channel of ``paged`` that comes back with the very key objects of ``old``'s,
    in the same order (the caller's dict keeps its keys between steps, as a reducer's
    ``{**old, **update}`` does), is pageable as ``old``'s was: its keys are neither
    type-checked nor ordered again, and only the values that are not the very objects
    stored before are compared (both passes in C).
    """
    ops: dict[str, Op] = {}
    found: set[str] = set()
    for ch, v in new.items():
        check_channel(ch)
        if ch not in old:
            ops[ch] = ("s", plain(v))
            continue
        o = old[ch]
        if o is v:
            # The caller handed back our own object; state is always compared by value.
            if ch in paged:
                found.add(ch)
            continue
        to, tv = type(o), type(v)
        if to is dict and tv is dict and ch in paged and _same_keys(o, v):
            found.add(ch)
            changed = {
                k: v[k]
                for k in compress(v, map(operator.is_not, o.values(), v.values()))
                if not same(o[k], v[k], codec)
            }
            if changed:
                ops[ch] = _dict_op(v, changed, ())
        elif to is dict and tv is dict and _pageable(v):
            found.add(ch)
            # An unchanged value is most often the very object stored before (the
            # caller's dict keeps its values between steps): no call for it.
            changed = {
                k: x
                for k, x in v.items()
                if (y := o.get(k, _ABSENT)) is not x and (y is _ABSENT or not same(y, x, codec))
            }
            # The old keys are the new ones (pageable) but for those deleted: only these
            # are looked at, and only when some may be (the old dict is larger than the
            # keys it shares with the new one).
            shared = len(v) - sum(1 for k in changed if k not in o)
            deleted = o.keys() - v.keys() if len(o) > shared else ()
            if deleted and not _pageable(dict.fromkeys(deleted)):
                ops[ch] = ("s", v)  # the old dict was not pageable: not a merge
                continue
            if changed or deleted:
                ops[ch] = _dict_op(v, changed, deleted)
        elif to in (list, ChunkedList) and tv in (list, ChunkedList):
            op = _list_diff(o, v, codec)
            if op is not None:
                ops[ch] = op
        elif not same(o, v, codec):
            ops[ch] = ("s", plain(v))
    for ch in old:
        if ch not in new:
            ops[ch] = ("x",)
    return ops, frozenset(found)


def _dict_op(v: dict[str, Any], changed: dict[str, Any], deleted: Iterable[str]) -> Op:
    """A pageable dict channel's op: a merge of its changes, or the whole dict once they
    are more than about half of it."""
    gone = sorted(deleted)
    if len(changed) + len(gone) > len(v) // 2 + 1:
        return ("s", v)
    return ("m", changed, gone)


def _same_keys(o: dict[str, Any], v: dict[str, Any]) -> bool:
    """Whether ``v``'s keys are ``o``'s very key objects, in ``o``'s order."""
    return len(o) == len(v) and all(map(operator.is_, o, v))


def apply(state: dict[str, Any], ops: Mapping[str, Any], *, where: str) -> None:
    """Apply decoded delta ops to ``state`` in place (values already resolved)."""
    for ch, op in ops.items():
        kind = op[0]
        if kind == "s":
            state[ch] = op[1]
        elif kind == "x":
            state.pop(ch, None)
        elif kind == "m":
            target = state.get(ch)
            if type(target) is not dict:
                raise CorruptRecord(f"merge into non-dict channel {ch!r} ({where})")
            target.update(op[1])
            for k in op[2]:
                target.pop(k, None)
        elif kind == "a":
            target = state.get(ch)
            if type(target) is list:
                target.extend(op[1])
            elif type(target) is ChunkedList:
                target._extend(list(op[1]))
            else:
                raise CorruptRecord(f"append to non-list channel {ch!r} ({where})")
        else:
            raise CorruptRecord(f"unknown delta op {kind!r} on channel {ch!r} ({where})")


# -- bodies --------------------------------------------------------------------------


@dataclass
class Encoded:
    """A body ready to store, with the blobs it introduces."""

    raw: bytes
    blobs: dict[bytes, bytes]  # hash -> canonical bytes
    refs: set[bytes]  # every blob the body refers to
    state_bytes: int = 0  # keyframes: bytes an eager load of the latest state reads


def encode_delta(codec: Codec, ops: Mapping[str, Op]) -> Encoded:
    blobs: dict[bytes, bytes] = {}
    out: dict[str, list[Any]] = {}
    for ch, op in ops.items():
        if op[0] == "s":
            raw = codec.encode(op[1])
            if len(raw) >= BLOB_MIN:
                h = blob_hash(raw)
                blobs[h] = raw
                out[ch] = ["sb", h.hex()]
                continue
            out[ch] = ["s", op[1]]
        elif op[0] == "m":
            out[ch] = ["m", op[1], list(op[2])]
        elif op[0] == "a":
            out[ch] = ["a", op[1]]
        else:
            out[ch] = list(op)
    return Encoded(codec.encode({"d": out}), blobs, set(blobs))


def _page_of(key: str, npages: int) -> int:
    return zlib.crc32(key.encode("utf-8")) & (npages - 1)


@dataclass
class ListChunks:
    """Sealed chunks of a plain list channel as of the last keyframe."""

    chunks: list[tuple[str, int, int]] = field(default_factory=list)  # hex, count, size
    sealed: int = 0


def encode_keyframe(codec: Codec, state: dict[str, Any], lists: dict[str, ListChunks]) -> Encoded:
    """Encode a full state.

    List channels seal every full chunk of :data:`CHUNK_ITEMS` items exactly once; later
    keyframes refer to sealed chunks by hash. ``lists`` remembers the sealed chunks of
    plain-list channels between keyframes; lazily loaded lists carry their own.
    """
    blobs: dict[bytes, bytes] = {}
    refs: set[bytes] = set()
    size = 0
    out: dict[str, list[Any]] = {}
    for ch, v in state.items():
        check_channel(ch)
        t = type(v)
        if t is dict and len(v) >= MAP_MIN_KEYS and _pageable(v):
            npages = 1
            while npages * PAGE_KEYS < len(v):
                npages *= 2
            pages: list[dict[str, Any]] = [{} for _ in range(npages)]
            for k, x in v.items():
                pages[_page_of(k, npages)][k] = x
            hexes = []
            for page in pages:
                raw = codec.encode(page)
                h = blob_hash(raw)
                blobs[h] = raw
                size += len(raw)
                hexes.append(h.hex())
            out[ch] = ["M", hexes]
        elif t is ChunkedList:
            while len(v._tail) >= CHUNK_ITEMS:
                items = v._tail[:CHUNK_ITEMS]
                raw = codec.encode(items)
                h = blob_hash(raw)
                blobs[h] = raw
                v._seal((h.hex(), len(items), len(raw)), items)
            refs.update(bytes.fromhex(c[0]) for c in v._chunks)
            out[ch] = ["L", [list(c) for c in v._chunks], v._tail]
        elif t is list:
            lc = lists.get(ch)
            if lc is None or lc.sealed > len(v):
                lc = ListChunks()
            refs.update(bytes.fromhex(c[0]) for c in lc.chunks)
            while len(v) - lc.sealed >= CHUNK_ITEMS:
                chunk = v[lc.sealed : lc.sealed + CHUNK_ITEMS]
                raw = codec.encode(chunk)
                h = blob_hash(raw)
                blobs[h] = raw
                lc.chunks.append((h.hex(), len(chunk), len(raw)))
                lc.sealed += len(chunk)
            lists[ch] = lc
            out[ch] = ["L", [list(c) for c in lc.chunks], v[lc.sealed :]]
        else:
            raw = codec.encode(v)
            if len(raw) >= BLOB_MIN:
                h = blob_hash(raw)
                blobs[h] = raw
                size += len(raw)
                out[ch] = ["sb", h.hex()]
            else:
                out[ch] = ["s", v]
    body = codec.encode({"k": out})
    refs.update(blobs)
    return Encoded(body, blobs, refs, state_bytes=size + len(body))


def blob_refs_of(body: Mapping[str, Any], *, chunks: bool) -> set[bytes]:
    """The blob hashes a decoded body refers to (list chunks only if ``chunks``)."""
    out: set[bytes] = set()
    for entry in (body.get("k") or body.get("d") or {}).values():
        kind = entry[0]
        if kind == "sb":
            out.add(bytes.fromhex(entry[1]))
        elif kind == "M":
            out.update(bytes.fromhex(h) for h in entry[1])
        elif kind == "L" and chunks:
            out.update(bytes.fromhex(c[0]) for c in entry[1])
    return out


def materialise_keyframe(
    body: Mapping[str, Any],
    blob_values: Mapping[bytes, Any],
    lists: dict[str, ListChunks],
    fetch: ChunkFetcher | None,
) -> dict[str, Any]:
    """Build the state of a keyframe from its body and its decoded blobs.

    With ``fetch``, list channels with sealed chunks become :class:`ChunkedList`;
    without, their chunks must be among ``blob_values``.
    """
    state: dict[str, Any] = {}
    for ch, entry in body["k"].items():
        kind = entry[0]
        if kind == "s":
            state[ch] = entry[1]
        elif kind == "sb":
            state[ch] = blob_values[bytes.fromhex(entry[1])]
        elif kind == "M":
            merged: dict[str, Any] = {}
            for h in entry[1]:
                page = blob_values[bytes.fromhex(h)]
                if type(page) is not dict:
                    raise CorruptRecord(f"page {h} of channel {ch!r} is not a mapping")
                merged.update(page)
            state[ch] = merged
        elif kind == "L":
            chunks = [(str(h), int(count), int(csize)) for h, count, csize in entry[1]]
            if fetch is not None and chunks:
                state[ch] = ChunkedList(chunks, list(entry[2]), fetch)
                continue
            items: list[Any] = []
            for h, count, _csize in chunks:
                chunk = blob_values[bytes.fromhex(h)]
                if type(chunk) is not list or len(chunk) != count:
                    raise CorruptRecord(f"chunk {h} of channel {ch!r} has the wrong length")
                items.extend(chunk)
            items.extend(entry[2])
            state[ch] = items
            lists[ch] = ListChunks(chunks, sum(c[1] for c in chunks))
        else:
            raise CorruptRecord(f"unknown keyframe entry {kind!r} for channel {ch!r}")
    return state


def resolve_delta(body: Mapping[str, Any], blob_values: Mapping[bytes, Any]) -> dict[str, Op]:
    ops: dict[str, Op] = {}
    for ch, op in body["d"].items():
        if op[0] == "sb":
            ops[ch] = ("s", blob_values[bytes.fromhex(op[1])])
        else:
            ops[ch] = tuple(op)
    return ops
