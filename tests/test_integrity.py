"""Tampered or damaged records are refused on read, naming what failed, never returned.

The tampering goes through SQL against ``store.engine``, the way a bad disk, a careless
operator or an attacker with database access would change the rows.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from onceonly.checkpoint import Codec, CorruptRecord, Store, UnknownCodecTag
from onceonly.checkpoint import _delta as delta
from tests.dbutil import blob_hashes, execute, fetch
from tests.values import Note, Point, make_codec


def _big(seed: int) -> bytes:
    return random.Random(seed).randbytes(6000)  # large enough to be stored as a blob


def _states(seed: int = 7) -> list[dict[str, Any]]:
    big = _big(seed)
    return [
        {"doc": big, "n": 0, "log": ["a"]},
        {"doc": big, "n": 1, "log": ["a", "b"], "extra": {"k": "v" * 300}},
        {"doc": big, "n": 2, "log": ["a", "b", "c"], "extra": {"k": "w" * 300}},
        {"doc": big, "n": 3, "log": ["a", "b", "c", "d"]},
    ]


def _write_run(store: Store, run_id: str | None = None, seed: int = 7) -> str:
    rid = store.create_run("flow", run_id=run_id).run_id
    for i, state in enumerate(_states(seed)):
        store.save(rid, state, step=f"s{i}")
    return rid


def _write_run_with_own_blob(store: Store, seed: int) -> tuple[str, bytes]:
    before = blob_hashes(store.engine)
    rid = _write_run(store, seed=seed)
    (h,) = blob_hashes(store.engine) - before
    return rid, h


@pytest.fixture
def open_store(db_url: str) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def factory(**kwargs: Any) -> Store:
        s = Store.open(db_url, **kwargs)
        opened.append(s)
        return s

    yield factory
    for s in opened:
        s.close()


def _body(store: Store, rid: str, seq: int) -> bytes:
    rows = fetch(
        store.engine,
        "SELECT body FROM oo_checkpoints WHERE run_id = :r AND seq = :s",
        r=rid,
        s=seq,
    )
    return bytes(rows[0][0])


def _set_body(store: Store, rid: str, seq: int, body: bytes) -> None:
    n = execute(
        store.engine,
        "UPDATE oo_checkpoints SET body = :b WHERE run_id = :r AND seq = :s",
        b=body,
        r=rid,
        s=seq,
    )
    assert n == 1


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x20
    return bytes(out)


def _assert_refused(
    stores: list[Store],
    rid: str,
    seqs: list[int | None],
    *,
    named_seqs: set[int],
    blob: str | None = None,
    error: type[CorruptRecord] = CorruptRecord,
) -> None:
    """Every load of ``seqs`` in every store raises ``error`` naming the run, one of
    ``named_seqs`` and (when given) the blob."""
    for store in stores:
        for seq in seqs:
            with pytest.raises(error) as exc:
                store.load(rid, seq)
            assert exc.value.run_id == rid
            assert exc.value.seq in named_seqs
            if blob is not None:
                assert exc.value.blob == blob
            assert rid in str(exc.value)
        # The batch read (a history listing's) refuses alike.
        numbered = [s for s in seqs if s is not None]
        if numbered:
            with pytest.raises(error) as exc:
                list(store.load_each(rid, numbered))
            assert exc.value.run_id == rid


def _assert_loads(stores: list[Store], rid: str, seqs: list[int]) -> None:
    for store in stores:
        for seq in seqs:
            assert store.load(rid, seq).state == _states()[seq]
        # Each state is the walk's own (updated in place by the next step): copied here.
        walked = {info.seq: copy.deepcopy(state) for info, state in store.load_each(rid, seqs)}
        assert walked == {seq: _states()[seq] for seq in seqs}


def _only_blob(store: Store) -> bytes:
    hashes = blob_hashes(store.engine)
    assert len(hashes) == 1
    return next(iter(hashes))


# -- blobs --------------------------------------------------------------------------------


def test_a_flipped_byte_in_a_blob_is_refused(
    store: Store, open_store: Callable[..., Store], subtests: pytest.Subtests
) -> None:
    for seed, where in enumerate(("first", "second", "middle", "last")):
        with subtests.test(msg=where):
            rid, h = _write_run_with_own_blob(store, seed)
            data = bytes(
                fetch(store.engine, "SELECT data FROM oo_blobs WHERE hash = :h", h=h)[0][0]
            )
            pos = {"first": 0, "second": 1, "middle": len(data) // 2, "last": len(data) - 1}
            execute(
                store.engine,
                "UPDATE oo_blobs SET data = :d WHERE hash = :h",
                d=_flip(data, pos[where]),
                h=h,
            )
            _assert_refused(
                [store, open_store()],
                rid,
                [None, 0, 1, 2, 3],
                named_seqs={0, 1, 2, 3},
                blob=h.hex(),
            )


def test_a_blob_replaced_by_another_blob_is_refused(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = _write_run(store)
    h = _only_blob(store)
    other = open_store()
    orid = other.create_run("other").run_id
    other.save(orid, {"doc": random.Random(8).randbytes(6000)}, step="0")
    h2 = next(iter(blob_hashes(store.engine) - {h}))
    data2 = fetch(store.engine, "SELECT data FROM oo_blobs WHERE hash = :h", h=h2)[0][0]
    execute(store.engine, "UPDATE oo_blobs SET data = :d WHERE hash = :h", d=bytes(data2), h=h)
    _assert_refused([store, open_store()], rid, [None, 0], named_seqs={0, 3}, blob=h.hex())
    assert other.load(orid).state["doc"] == random.Random(8).randbytes(6000)


def test_a_deleted_blob_is_refused(store: Store, open_store: Callable[..., Store]) -> None:
    rid = _write_run(store)
    h = _only_blob(store)
    assert execute(store.engine, "DELETE FROM oo_blobs WHERE hash = :h", h=h) == 1
    _assert_refused([store, open_store()], rid, [None, 0, 2], named_seqs={0, 1, 2, 3}, blob=h.hex())
    _verify_finds(open_store(), f"blob {h.hex()} is missing (deleted)")


@pytest.mark.parametrize("edit", ["deleted", "owner edited", "hash edited"])
def test_a_lost_blob_reference_is_found_before_garbage_collection_deletes_the_blob(
    store: Store, open_store: Callable[..., Store], edit: str
) -> None:
    """A run's reference to a blob its checkpoints name is what keeps the blob from
    garbage collection: ``verify_integrity`` reports a missing one while the blob is still
    there (the control below shows the collection it would allow)."""
    rid = _write_run(store)
    h = _only_blob(store)
    where = "owner = :r AND hash = :h"
    sql = {
        "deleted": f"DELETE FROM oo_blob_refs WHERE {where}",
        "owner edited": f"UPDATE oo_blob_refs SET owner = 'run-x' WHERE {where}",
        "hash edited": f"UPDATE oo_blob_refs SET hash = :other WHERE {where}",
    }[edit]
    assert execute(store.engine, sql, r=rid, h=h, other=bytes(32)) == 1
    fresh = open_store()
    _, problems = fresh.verify_integrity()
    # An edited hash also leaves a reference to a blob that is not stored.
    dangling = [f"blob {bytes(32).hex()}, referenced by run {rid!r}: missing (deleted)"]
    unreferenced = [p for p in problems if "no reference" in p]
    assert sorted(set(problems) - set(unreferenced)) == (dangling if edit == "hash edited" else [])
    assert len(unreferenced) == 1
    assert rid in unreferenced[0]
    assert h.hex() in unreferenced[0]
    assert fresh.load(rid).state == _states()[-1]  # the blob itself is intact
    # the control: what the report is for
    if edit == "deleted":
        assert fresh.collect_garbage() == 1
        with pytest.raises(CorruptRecord):
            open_store().load(rid)


# -- checkpoint rows -----------------------------------------------------------------------


def test_a_flipped_byte_in_a_checkpoint_body_is_refused(
    store: Store, open_store: Callable[..., Store], subtests: pytest.Subtests
) -> None:
    for seq in (0, 2):  # a keyframe, a delta
        for where in ("first", "middle", "last"):
            with subtests.test(msg=f"{where} byte of checkpoint {seq}"):
                rid = _write_run(store)
                body = _body(store, rid, seq)
                pos = {"first": 0, "middle": len(body) // 2, "last": len(body) - 1}[where]
                _set_body(store, rid, seq, _flip(body, pos))
                affected: list[int | None] = [None, *range(seq, 4)]
                _assert_refused([store, open_store()], rid, affected, named_seqs={seq})
                _assert_loads([store, open_store()], rid, list(range(seq)))


def test_a_truncated_checkpoint_body_is_refused(
    store: Store, open_store: Callable[..., Store], subtests: pytest.Subtests
) -> None:
    for seq in (0, 2):  # a keyframe, a delta
        for keep in ("nothing", "one byte", "half"):
            with subtests.test(msg=f"checkpoint {seq} cut to {keep}"):
                rid = _write_run(store)
                body = _body(store, rid, seq)
                cut = {"nothing": 0, "one byte": 1, "half": len(body) // 2}[keep]
                _set_body(store, rid, seq, body[:cut])
                _assert_refused([store, open_store()], rid, [None, 3, seq], named_seqs={seq})
                _assert_loads([store], rid, list(range(seq)))


def test_a_changed_digest_is_refused(store: Store, open_store: Callable[..., Store]) -> None:
    rid = _write_run(store)
    digest = bytes(
        fetch(
            store.engine,
            "SELECT digest FROM oo_checkpoints WHERE run_id = :r AND seq = 1",
            r=rid,
        )[0][0]
    )
    execute(
        store.engine,
        "UPDATE oo_checkpoints SET digest = :d WHERE run_id = :r AND seq = 1",
        d=_flip(digest, 3),
        r=rid,
    )
    _assert_refused([store, open_store()], rid, [None, 1, 2], named_seqs={1})
    _assert_loads([store], rid, [0])


@pytest.mark.parametrize(
    ("column", "value"),
    [("step", "a-step-never-run"), ("source", "operator"), ("created_at", 0.0)],
)
def test_edited_checkpoint_metadata_is_refused(
    store: Store, open_store: Callable[..., Store], column: str, value: object
) -> None:
    rid = _write_run(store)
    n = execute(
        store.engine,
        f"UPDATE oo_checkpoints SET {column} = :v WHERE run_id = :r AND seq = 1",
        v=value,
        r=rid,
    )
    assert n == 1
    _assert_refused([store, open_store()], rid, [None, 1, 2], named_seqs={1})
    _assert_loads([store], rid, [0])
    checked, problems = open_store().verify_integrity()
    assert checked > 0
    assert any("checkpoint 1" in p and "digest" in p for p in problems), problems


def test_swapped_checkpoint_seqs_are_refused(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = _write_run(store)
    for old, new in ((1, -1), (2, 1), (-1, 2)):
        n = execute(
            store.engine,
            "UPDATE oo_checkpoints SET seq = :new WHERE run_id = :r AND seq = :old",
            new=new,
            old=old,
            r=rid,
        )
        assert n == 1
    _assert_refused([store, open_store()], rid, [None, 1, 2, 3], named_seqs={1, 2})
    _assert_loads([store], rid, [0])


def test_a_row_moved_to_another_run_is_refused(
    store: Store, open_store: Callable[..., Store]
) -> None:
    a = _write_run(store, "run-a")
    b = _write_run(store, "run-b")
    execute(store.engine, "DELETE FROM oo_checkpoints WHERE run_id = :r AND seq = 3", r=b)
    n = execute(
        store.engine,
        "UPDATE oo_checkpoints SET run_id = :b WHERE run_id = :a AND seq = 3",
        a=a,
        b=b,
    )
    assert n == 1
    _assert_refused([store, open_store()], b, [None, 3], named_seqs={3})
    _assert_loads([store], b, [0, 1, 2])


def test_a_body_copied_from_another_run_is_refused(
    store: Store, open_store: Callable[..., Store]
) -> None:
    a = _write_run(store, "run-a")
    b = _write_run(store, "run-b")  # the same states, so the same bodies
    row = fetch(
        store.engine, "SELECT body, digest FROM oo_checkpoints WHERE run_id = :r AND seq = 2", r=a
    )[0]
    execute(
        store.engine,
        "UPDATE oo_checkpoints SET body = :body, digest = :d WHERE run_id = :r AND seq = 2",
        body=bytes(row[0]),
        d=bytes(row[1]),
        r=b,
    )
    _assert_refused([store, open_store()], b, [None, 2, 3], named_seqs={2})
    _assert_loads([store], a, [0, 1, 2, 3])


def test_a_deleted_middle_delta_is_refused(store: Store, open_store: Callable[..., Store]) -> None:
    rid = _write_run(store)
    assert not store.history(rid)[2].keyframe
    assert (
        execute(store.engine, "DELETE FROM oo_checkpoints WHERE run_id = :r AND seq = 2", r=rid)
        == 1
    )
    _assert_refused([store, open_store()], rid, [None, 3], named_seqs={2, 3})
    _assert_loads([store, open_store()], rid, [0, 1])
    _verify_finds(open_store(), f"run {rid!r}: checkpoints 2 below its head 3 are missing")


def test_a_deleted_latest_checkpoint_is_refused(
    store: Store, open_store: Callable[..., Store]
) -> None:
    """The run says checkpoint 3 is its head; without that row, loading must not look
    like a run with no checkpoints (a caller would start it again from scratch)."""
    rid = _write_run(store)
    assert store.get_run(rid).head_seq == 3
    execute(store.engine, "DELETE FROM oo_checkpoints WHERE run_id = :r AND seq = 3", r=rid)
    _assert_refused([store, open_store()], rid, [None], named_seqs={3})
    _assert_loads([store], rid, [0, 1, 2])


def test_a_deleted_keyframe_is_refused(store: Store, open_store: Callable[..., Store]) -> None:
    rid = _write_run(store)
    execute(store.engine, "DELETE FROM oo_checkpoints WHERE run_id = :r AND seq = 0", r=rid)
    _assert_refused([store, open_store()], rid, [None, 1, 2], named_seqs={0, 1, 2, 3})
    _verify_finds(open_store(), f"run {rid!r}: checkpoints 0 below its head 3 are missing")


def test_a_deleted_run_row_is_found_by_verify(
    store: Store, open_store: Callable[..., Store]
) -> None:
    """A run row deleted with its checkpoints left: verify names the run (it was once
    silent, as if the checkpoints were a finished run's leftovers)."""
    rid = _write_run(store)
    keep = _write_run(store, seed=8)
    assert execute(store.engine, "DELETE FROM oo_runs WHERE run_id = :r", r=rid) == 1
    _verify_finds(open_store(), f"run {rid!r}: checkpoints 0-3 but no run row (deleted)")
    assert open_store().load(keep).state == _states(8)[-1]  # the other run is untouched


def test_a_history_with_every_checkpoint_verifies_clean(
    store: Store, open_store: Callable[..., Store]
) -> None:
    """The control of the three above: runs written whole verify with no problem."""
    _write_run(store)
    _write_run_with_own_blob(store, seed=9)
    checked, problems = open_store().verify_integrity()
    assert problems == []
    assert checked > 8


def _verify_finds(store: Store, needle: str) -> None:
    """``verify_integrity`` reports exactly one problem, containing ``needle``."""
    _, problems = store.verify_integrity()
    assert len(problems) == 1, problems
    assert needle in problems[0], problems


def test_a_body_rewritten_with_an_unknown_tag_is_refused(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = _write_run(store)
    forged = b'j{"d":{"n":["s",{"\\u0000zz":1}]}}'
    _set_body(store, rid, 1, forged)
    _assert_refused([store, open_store()], rid, [None, 1], named_seqs={1})


# -- values this codec does not know ------------------------------------------------------


def test_a_checkpoint_with_an_unregistered_dataclass_raises_unknown_codec_tag(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    writer = open_store(codec=make_codec())
    rid = writer.create_run("flow").run_id
    writer.save(rid, {"n": 0}, step="0")
    writer.save(rid, {"n": 1, "p": Point(1, 2)}, step="1")
    writer.save(rid, {"n": 2, "p": Point(1, 2)}, step="2")
    reader = open_store(codec=Codec())
    _assert_refused([reader], rid, [None, 1, 2], named_seqs={1, 2}, error=UnknownCodecTag)
    assert reader.load(rid, 0).state == {"n": 0}
    assert open_store(codec=make_codec()).load(rid).state == {"n": 2, "p": Point(1, 2)}


def test_a_blob_with_an_unregistered_dataclass_raises_unknown_codec_tag(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    writer = open_store(codec=make_codec())
    rid = writer.create_run("flow").run_id
    note = Note("big", [f"tag {i}" for i in range(600)], {})
    writer.save(rid, {"note": note}, step="0")
    h = _only_blob(writer)
    reader = open_store(codec=Codec())
    _assert_refused([reader], rid, [None, 0], named_seqs={0}, blob=h.hex(), error=UnknownCodecTag)


def test_other_runs_still_load_after_one_is_damaged(
    store: Store, open_store: Callable[..., Store]
) -> None:
    damaged = _write_run(store, "damaged")
    healthy = store.create_run("flow").run_id
    store.save(healthy, {"ok": True}, step="0")
    _set_body(store, damaged, 3, b"")
    with pytest.raises(CorruptRecord):
        store.load(damaged)
    assert store.load(healthy).state == {"ok": True}
    assert open_store().load(healthy).state == {"ok": True}


def test_an_unknown_source_in_an_unkeyed_store_is_a_corrupt_record(
    open_store: Callable[..., Store],
) -> None:
    """``source`` is not in the unkeyed digest: a value no writer produces is still
    refused as damage (``CorruptRecord``), not a stray ``ValueError``."""
    store = open_store()
    rid = _write_run(store)
    # As someone who recomputes the unkeyed digest would.
    for seq, kind, kf, ver, step, at, body in fetch(
        store.engine,
        "SELECT seq, kind, keyframe_seq, schema_version, step, created_at, body "
        "FROM oo_checkpoints WHERE run_id = :r",
        r=rid,
    ):
        raw = delta.unpack(bytes(body))
        digest = delta.row_digest(rid, seq, kind, kf, ver, step, "bogus", at, raw)
        execute(
            store.engine,
            "UPDATE oo_checkpoints SET source = 'bogus', digest = :d WHERE run_id = :r "
            "AND seq = :s",
            d=digest,
            r=rid,
            s=seq,
        )
    fresh = open_store()
    with pytest.raises(CorruptRecord, match="unknown source"):
        fresh.load(rid)
    with pytest.raises(CorruptRecord, match="unknown source"):
        fresh.load_run(rid)
    with pytest.raises(CorruptRecord, match="unknown source"):
        fresh.history(rid)
