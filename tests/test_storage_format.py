"""The stored form of checkpoint bodies and blobs: checked zstd now, the older forms
still read.

Every body and blob is stored as a one-byte header and its data: ``j`` raw canonical
bytes, ``C`` a zstd frame after a digest of the frame's bytes (written now), ``Z`` a bare
zstd frame and ``z`` a zlib stream (written by earlier releases, read for ever). A
database written in an old form loads unchanged; a damaged frame (cut short, extended,
not a frame at all, or any bit of it flipped, even one the frame would decompress
through unchanged) is a typed refusal, never a wrong state.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import pytest

from onceonly.checkpoint import CorruptRecord, Store
from onceonly.checkpoint import _delta as delta
from tests.dbutil import execute, fetch


def _state(n: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"message {i} " * 40} for i in range(n)],
        "notes": {f"k{i}": "v" * 300 for i in range(n)},
        "step": n,
    }


def _zlib_pack(raw: bytes) -> bytes:
    """The stored form releases before 0.2 wrote."""
    if len(raw) >= 256:
        c = zlib.compressobj(1, zlib.DEFLATED, 12, 5)
        z = c.compress(raw) + c.flush()
        if len(z) < len(raw) * 0.9:
            return b"z" + z
    return b"j" + raw


_pack = delta.pack


def _bare_zstd_pack(raw: bytes) -> bytes:
    """The stored form earlier releases wrote: a zstd frame without its digest."""
    stored = _pack(raw)
    if stored[:1] == b"C":
        return b"Z" + stored[17:]
    return stored


def _headers(store: Store) -> set[bytes]:
    rows = fetch(store.engine, "SELECT body FROM oo_checkpoints")
    rows += fetch(store.engine, "SELECT data FROM oo_blobs")
    return {bytes(r[0])[:1] for r in rows}


def test_new_bodies_and_blobs_are_checked_zstd_and_round_trip(store: Store) -> None:
    rid = store.create_run("f", run_id="z").run_id
    for n in (1, 80, 200):
        store.save(rid, _state(n), step=f"s{n}")
    assert b"C" in _headers(store)
    assert _headers(store) <= {b"C", b"j"}
    for seq, n in enumerate((1, 80, 200)):
        assert store.load(rid, seq).state == _state(n)


@pytest.mark.parametrize(("form", "header"), [("zlib", b"z"), ("bare zstd", b"Z")])
def test_a_database_written_in_an_older_form_loads_unchanged(
    db_url: str, monkeypatch: pytest.MonkeyPatch, form: str, header: bytes
) -> None:
    older = {"zlib": _zlib_pack, "bare zstd": _bare_zstd_pack}[form]
    with monkeypatch.context() as m:
        m.setattr(delta, "pack", older)
        with Store.open(db_url) as old:
            rid = old.create_run("f", run_id="old").run_id
            for n in (1, 80, 200):
                old.save(rid, _state(n), step=f"s{n}")
            assert _headers(old) <= {header, b"j"}
            assert header in _headers(old)
    with Store.open(db_url) as new:
        for seq, n in enumerate((1, 80, 200)):
            assert new.load("old", seq).state == _state(n)
        assert new.verify_integrity()[1] == []
        # and carries on in the new form
        new.save("old", _state(201), step="s201")
        assert new.load("old").state == _state(201)
        assert {header, b"C"} <= _headers(new)


def test_every_bit_flip_of_a_stored_frame_is_refused() -> None:
    """The class behind it: the digests above the stored form cover decompressed bytes,
    and a zstd frame decompresses through some edits unchanged (an ignored header bit,
    bitstream padding). Every single-bit edit of the stored bytes is refused, including
    those: a bare frame lets about one flip in 3,000 through."""
    raw = b"".join(b"%05d:" % i + bytes(range(i % 7, 90 + i % 7)) for i in range(120))
    stored = delta.pack(raw)
    assert stored[:1] == b"C"
    frame = stored[17:]
    silent_bare = 0
    for pos in range(len(stored)):
        for bit in range(8):
            flipped = bytearray(stored)
            flipped[pos] ^= 1 << bit
            with pytest.raises(CorruptRecord):
                delta.unpack(bytes(flipped))
            if pos >= 17:  # the same flip in the frame stored bare, as before
                bare = bytearray(b"Z" + frame)
                bare[pos - 16] ^= 1 << bit
                with contextlib.suppress(CorruptRecord):
                    silent_bare += delta.unpack(bytes(bare)) == raw
    assert silent_bare > 0  # the control: the bare form does let some through


@pytest.mark.parametrize(
    "damage", ["cut", "extended", "not_a_frame", "unknown_header", "ignored_bit", "digest"]
)
def test_a_damaged_body_is_refused_typed(db_url: str, damage: str) -> None:
    with Store.open(db_url) as store:
        rid = store.create_run("f", run_id="d").run_id
        store.save(rid, {"text": "a fairly compressible body " * 100}, step="s")
        [(body,)] = fetch(store.engine, "SELECT body FROM oo_checkpoints WHERE run_id = 'd'")
        body = bytes(body)
        assert body[:1] == b"C"
        bad = {
            "cut": body[:-5],
            "extended": body + b"\x00\x01",
            "not_a_frame": b"C" + b"\x00" * 40,
            # the frame header's unused bit: zstd decompresses through it unchanged
            "ignored_bit": body[:21] + bytes([body[21] ^ 0x10]) + body[22:],
            "digest": body[:3] + bytes([body[3] ^ 1]) + body[4:],
            "unknown_header": b"Q" + body[1:],
        }[damage]
        execute(store.engine, "UPDATE oo_checkpoints SET body = :b WHERE run_id = 'd'", b=bad)
    with Store.open(db_url) as fresh, pytest.raises(CorruptRecord):
        fresh.load("d")


def test_a_blob_edited_where_zstd_does_not_look_is_refused_and_found(db_url: str) -> None:
    """A blob is checked against its address, a hash of its decompressed bytes: the
    frame's own digest is what sees an edit that decompresses to the same bytes."""
    with Store.open(db_url) as store:
        rid = store.create_run("f", run_id="b").run_id
        store.save(rid, {"doc": "a large, compressible document " * 400}, step="s")
        [(h, data)] = fetch(store.engine, "SELECT hash, data FROM oo_blobs")
        data = bytes(data)
        assert data[:1] == b"C"
        bare = b"Z" + data[17:21] + bytes([data[21] ^ 0x10]) + data[22:]
        assert delta.unpack(bare) == delta.unpack(data)  # unseen without the digest
        flipped = data[:21] + bytes([data[21] ^ 0x10]) + data[22:]
        execute(store.engine, "UPDATE oo_blobs SET data = :d WHERE hash = :h", d=flipped, h=h)
    with Store.open(db_url) as fresh:
        with pytest.raises(CorruptRecord):
            fresh.load("b")
        _, problems = fresh.verify_integrity()
        assert any("checksum" in p for p in problems)


def test_pack_keeps_incompressible_data_raw() -> None:
    import os

    raw = os.urandom(4000)
    assert delta.pack(raw)[:1] == b"j"
    assert delta.unpack(delta.pack(raw)) == raw
    big = b"abc" * 100_000  # compresses far more than 64x: still exact
    assert delta.pack(big)[:1] == b"C"
    assert delta.unpack(delta.pack(big)) == big
