"""The stored form of checkpoint bodies and blobs: zstd now, zlib still read.

Every body and blob is stored as a one-byte header and its data: ``j`` raw canonical
bytes, ``Z`` a zstd frame (written since 0.2), ``z`` a zlib stream (written before, read
for ever). A database written in the old form loads unchanged; a damaged frame (cut
short, extended, or not a frame at all) is a typed refusal, never a wrong state.
"""

from __future__ import annotations

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


def _headers(store: Store) -> set[bytes]:
    rows = fetch(store.engine, "SELECT body FROM oo_checkpoints")
    rows += fetch(store.engine, "SELECT data FROM oo_blobs")
    return {bytes(r[0])[:1] for r in rows}


def test_new_bodies_and_blobs_are_zstd_and_round_trip(store: Store) -> None:
    rid = store.create_run("f", run_id="z").run_id
    for n in (1, 80, 200):
        store.save(rid, _state(n), step=f"s{n}")
    assert b"Z" in _headers(store)
    assert b"z" not in _headers(store)
    for seq, n in enumerate((1, 80, 200)):
        assert store.load(rid, seq).state == _state(n)


def test_a_database_written_with_zlib_loads_unchanged(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:
        m.setattr(delta, "pack", _zlib_pack)
        with Store.open(db_url) as old:
            rid = old.create_run("f", run_id="old").run_id
            for n in (1, 80, 200):
                old.save(rid, _state(n), step=f"s{n}")
            assert _headers(old) <= {b"z", b"j"}
            assert b"z" in _headers(old)
    with Store.open(db_url) as new:
        for seq, n in enumerate((1, 80, 200)):
            assert new.load("old", seq).state == _state(n)
        # and carries on in the new form
        new.save("old", _state(201), step="s201")
        assert new.load("old").state == _state(201)
        assert {b"z", b"Z"} <= _headers(new)


@pytest.mark.parametrize("damage", ["cut", "extended", "not_a_frame", "unknown_header"])
def test_a_damaged_body_is_refused_typed(db_url: str, damage: str) -> None:
    with Store.open(db_url) as store:
        rid = store.create_run("f", run_id="d").run_id
        store.save(rid, {"text": "a fairly compressible body " * 100}, step="s")
        [(body,)] = fetch(store.engine, "SELECT body FROM oo_checkpoints WHERE run_id = 'd'")
        body = bytes(body)
        assert body[:1] == b"Z"
        bad = {
            "cut": body[:-5],
            "extended": body + b"\x00\x01",
            "not_a_frame": b"Z" + b"\x00" * 40,
            "unknown_header": b"Q" + body[1:],
        }[damage]
        execute(store.engine, "UPDATE oo_checkpoints SET body = :b WHERE run_id = 'd'", b=bad)
    with Store.open(db_url) as fresh, pytest.raises(CorruptRecord):
        fresh.load("d")


def test_pack_keeps_incompressible_data_raw() -> None:
    import os

    raw = os.urandom(4000)
    assert delta.pack(raw)[:1] == b"j"
    assert delta.unpack(delta.pack(raw)) == raw
    big = b"abc" * 100_000  # compresses far more than 64x: still exact
    assert delta.pack(big)[:1] == b"Z"
    assert delta.unpack(delta.pack(big)) == big
