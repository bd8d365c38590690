"""The checkpoint store: runs, checkpoints (delta + keyframe), leases, concurrency.

Every test runs on SQLite and on PostgreSQL through the ``store`` / ``db_url`` fixtures.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from onceonly.checkpoint import (
    CheckpointNotFound,
    Codec,
    CodecError,
    ConcurrentWrite,
    ConfigurationError,
    DatabaseUnavailable,
    Handoff,
    KeyframePolicy,
    LeaseHeld,
    RunExists,
    RunNotFound,
    RunStatus,
    Source,
    Store,
)
from tests.dbutil import blob_count, body_sizes, stored_bytes
from tests.values import Note, Point, Unregistered, codec_values, make_codec, strict_equal


def new_run(store: Store, **kwargs: Any) -> str:
    return store.create_run("flow", **kwargs).run_id


@pytest.fixture
def open_store(db_url: str) -> Iterator[Callable[..., Store]]:
    """Open extra stores on the test's database (each is a new process's view); all are
    closed after the test."""
    opened: list[Store] = []

    def factory(**kwargs: Any) -> Store:
        s = Store.open(db_url, **kwargs)
        opened.append(s)
        return s

    yield factory
    for s in opened:
        s.close()


# -- runs --------------------------------------------------------------------------------


def test_create_run_records_what_it_was_given(store: Store) -> None:
    before = time.time()
    run = store.create_run(
        "onboarding", code_version="7", state_version=3, next_step="collect", run_id="r-1"
    )
    assert run.run_id == "r-1"
    assert run.flow == "onboarding"
    assert run.code_version == "7"
    assert run.state_version == 3
    assert run.status is RunStatus.RUNNING
    assert run.next_step == "collect"
    assert run.head_seq is None
    assert run.lease_owner is None
    assert run.lease_expires_at is None
    assert run.handoff == Handoff()
    assert before <= run.created_at == run.updated_at <= time.time()
    assert store.get_run("r-1") == run


def test_generated_run_ids_are_unique(store: Store) -> None:
    ids = {new_run(store) for _ in range(20)}
    assert len(ids) == 20


def test_create_run_with_an_existing_id_raises_run_exists(store: Store) -> None:
    first = store.create_run("a", run_id="dup", next_step="x")
    with pytest.raises(RunExists) as exc:
        store.create_run("b", run_id="dup", next_step="y")
    assert exc.value.run_id == "dup"
    assert store.get_run("dup") == first


def test_missing_run_raises_run_not_found_everywhere(store: Store) -> None:
    calls: list[Callable[[], object]] = [
        lambda: store.get_run("nope"),
        lambda: store.update_run("nope", status=RunStatus.FAILED),
        lambda: store.load("nope"),
        lambda: store.load("nope", 0),
        lambda: store.history("nope"),
        lambda: store.save("nope", {"a": 1}, step="s"),
        lambda: store.update("nope", step="s", set={"a": 1}),
        lambda: store.acquire_lease("nope", "w", 10),
    ]
    for call in calls:
        with pytest.raises(RunNotFound) as exc:
            call()
        assert exc.value.run_id == "nope"
    assert store.list_runs() == []


def test_list_runs_orders_by_last_update_and_filters(store: Store) -> None:
    a = store.create_run("alpha", run_id="a").run_id
    time.sleep(0.01)
    b = store.create_run("beta", run_id="b").run_id
    time.sleep(0.01)
    c = store.create_run("alpha", run_id="c").run_id
    time.sleep(0.01)
    store.update_run(a, status=RunStatus.WAITING)
    assert [r.run_id for r in store.list_runs()] == [a, c, b]
    assert [r.run_id for r in store.list_runs(status=RunStatus.WAITING)] == [a]
    assert [r.run_id for r in store.list_runs(status="running")] == [c, b]
    assert [r.run_id for r in store.list_runs(flow="alpha")] == [a, c]
    assert [r.run_id for r in store.list_runs(limit=2)] == [a, c]
    assert store.list_runs(flow="gamma") == []


def test_update_run_changes_only_what_it_is_given(store: Store) -> None:
    run = store.create_run("f", next_step="one", code_version="1")
    time.sleep(0.01)
    updated = store.update_run(run.run_id, status=RunStatus.WAITING, code_version="2")
    assert updated.status is RunStatus.WAITING
    assert updated.code_version == "2"
    assert updated.next_step == "one"
    assert updated.updated_at > run.updated_at
    assert updated.created_at == run.created_at
    cleared = store.update_run(run.run_id, next_step=None)
    assert cleared.next_step is None
    assert cleared.status is RunStatus.WAITING
    assert store.get_run(run.run_id) == cleared


def test_handoff_round_trips(store: Store) -> None:
    note = Handoff(
        goal="onboard ACME \u2014 vendor #1 \U0001f680",
        done=("collect documents", "extract details"),
        next=("screen sanctions",),
        ruled_out=("manual entry", ""),
    )
    rid = store.create_run("f", handoff=note).run_id
    assert store.get_run(rid).handoff == note
    later = Handoff(goal=note.goal, done=(*note.done, "screen sanctions"), next=())
    assert store.update_run(rid, handoff=later).handoff == later
    assert store.get_run(rid).handoff == later
    assert store.get_run(rid).next_step is None


def test_handoff_is_seen_by_another_store(store: Store, open_store: Callable[..., Store]) -> None:
    note = Handoff(goal="g", done=("a",), next=("b",), ruled_out=("c",))
    rid = store.create_run("f", handoff=note).run_id
    assert open_store().get_run(rid).handoff == note


# -- save, load, history -------------------------------------------------------------------


def test_save_load_and_history(store: Store) -> None:
    rid = new_run(store)
    states: list[dict[str, Any]] = [
        {"docs": [], "vendor": None},
        {"docs": ["w9.pdf"], "vendor": None},
        {"docs": ["w9.pdf", "bank.pdf"], "vendor": {"name": "ACME"}},
        {"docs": ["w9.pdf", "bank.pdf"], "vendor": {"name": "ACME", "iban": "GB00"}},
    ]
    infos = [store.save(rid, s, step=f"step-{i}") for i, s in enumerate(states)]
    assert [i.seq for i in infos] == [0, 1, 2, 3]
    assert all(i.run_id == rid and i.source is Source.STEP for i in infos)
    history = store.history(rid)
    assert history == infos
    assert [h.step for h in history] == ["step-0", "step-1", "step-2", "step-3"]
    assert history[0].keyframe
    assert [h.created_at for h in history] == sorted(h.created_at for h in history)
    snap = store.load(rid)
    assert snap.state == states[-1]
    assert snap.info == infos[-1]
    for i, s in enumerate(states):
        assert store.load(rid, i).state == s
        assert store.load(rid, i).info == infos[i]
    assert store.history(rid, limit=2) == infos[2:]
    assert store.get_run(rid).head_seq == 3


def test_history_of_a_run_without_checkpoints_is_empty(store: Store) -> None:
    assert store.history(new_run(store)) == []


def test_loading_a_missing_checkpoint_raises_checkpoint_not_found(store: Store) -> None:
    rid = new_run(store)
    with pytest.raises(CheckpointNotFound) as exc:
        store.load(rid)
    assert exc.value.run_id == rid
    assert exc.value.seq is None
    store.save(rid, {"a": 1}, step="s")
    for seq in (1, 7, -1):
        with pytest.raises(CheckpointNotFound) as exc:
            store.load(rid, seq)
        assert exc.value.seq == seq


def _evolve(i: int) -> dict[str, Any]:
    """A state that changes in every way a step can change it."""
    state: dict[str, Any] = {
        "counter": i,
        "log": [f"entry {j}" for j in range(i * 7)],
        "table": {f"k{j % 90}": j for j in range(i * 5)},
        "flag": i % 3 == 0,
    }
    if i % 4 != 1:
        state["sometimes"] = {"i": i, "when": dt.date(2024, 1, 1 + i % 28)}
    if i % 5 == 2:
        state["log"] = state["log"][: i * 3]
    return state


def test_every_earlier_checkpoint_loads_exactly(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    writer = open_store(keyframes=KeyframePolicy(max_deltas=4))
    rid = new_run(writer)
    for i in range(30):
        writer.save(rid, _evolve(i), step=f"s{i}")
    reader = open_store()
    for store in (writer, reader):
        for i in range(30):
            snap = store.load(rid, i)
            assert strict_equal(snap.state, _evolve(i)), i
            assert snap.info.step == f"s{i}"
    assert strict_equal(reader.load(rid).state, _evolve(29))


@pytest.mark.parametrize(
    "seqs", [range(30), [29], [0], [3, 4, 5, 11, 12, 29], [7, 2, 7, 20]], ids=str
)
def test_load_each_walks_to_every_checkpoint_across_keyframes(
    db_url: str, open_store: Callable[..., Store], seqs: Any
) -> None:
    """One forward walk gives each asked checkpoint's state, oldest first, equal to its
    own load (keyframes every 5 checkpoints: the walk restarts at each)."""
    writer = open_store(keyframes=KeyframePolicy(max_deltas=4))
    rid = new_run(writer)
    for i in range(30):
        writer.save(rid, _evolve(i), step=f"s{i}")
    for store in (writer, open_store()):
        walked = [
            (info.seq, info.step, strict_equal(state, _evolve(info.seq)))
            for info, state in store.load_each(rid, seqs)
        ]
        assert walked == [(i, f"s{i}", True) for i in sorted(set(seqs))]


def test_load_each_refuses_what_is_not_there(store: Store) -> None:
    rid = new_run(store)
    for i in range(3):
        store.save(rid, {"n": i}, step=str(i))
    assert list(store.load_each(rid, [])) == []
    for seqs in ([3], [1, 5], [-1, 1]):
        with pytest.raises(CheckpointNotFound):
            list(store.load_each(rid, seqs))
    with pytest.raises(CheckpointNotFound):
        list(store.load_each("no-such-run", [0]))


def test_update_applies_set_merge_append_and_delete(store: Store) -> None:
    rid = new_run(store)
    store.save(rid, {"profile": {"a": 1, "b": 2}, "log": ["x"], "tmp": 1, "n": 0}, step="0")
    store.update(rid, step="1", set={"n": 1, "new": (1, 2)}, append={"log": ["y", "z"]})
    store.update(rid, step="2", merge={"profile": {"b": 20, "c": 3}}, delete=["tmp"])
    store.update(rid, step="3", append={"log": []}, merge={"profile": {}})
    expected = {"profile": {"a": 1, "b": 20, "c": 3}, "log": ["x", "y", "z"], "n": 1}
    expected["new"] = (1, 2)
    assert strict_equal(store.load(rid).state, expected)
    assert strict_equal(store.load(rid, 1).state["new"], (1, 2))
    assert store.load(rid, 1).state["tmp"] == 1
    assert [h.step for h in store.history(rid)] == ["0", "1", "2", "3"]


def test_update_refuses_merge_or_append_of_the_wrong_kind(store: Store) -> None:
    rid = new_run(store)
    store.save(rid, {"d": {"a": 1}, "l": [1], "s": "text"}, step="0")
    bad: list[Callable[[], object]] = [
        lambda: store.update(rid, step="x", merge={"l": {"a": 1}}),
        lambda: store.update(rid, step="x", merge={"missing": {"a": 1}}),
        lambda: store.update(rid, step="x", append={"d": [1]}),
        lambda: store.update(rid, step="x", append={"s": [1]}),
    ]
    for call in bad:
        with pytest.raises(ConfigurationError):
            call()
    assert len(store.history(rid)) == 1
    assert store.load(rid).state == {"d": {"a": 1}, "l": [1], "s": "text"}


def test_update_and_save_can_be_mixed(store: Store) -> None:
    rid = new_run(store)
    store.update(rid, step="0", set={"log": [], "d": {}})
    store.update(rid, step="1", append={"log": [1]}, merge={"d": {"a": 1}})
    store.save(rid, {"log": [1, 2], "d": {"a": 1, "b": 2}}, step="2")
    store.update(rid, step="3", append={"log": [3]}, delete=["d"])
    assert store.load(rid).state == {"log": [1, 2, 3]}


def test_save_advances_next_step_and_status_with_the_checkpoint(store: Store) -> None:
    rid = store.create_run("f", next_step="collect").run_id
    info = store.save(rid, {"a": 1}, step="collect", next_step="review", status="waiting")
    run = store.get_run(rid)
    assert (run.next_step, run.status, run.head_seq) == ("review", RunStatus.WAITING, info.seq)
    store.update(rid, step="review", set={"a": 2}, next_step=None, status=RunStatus.COMPLETED)
    run = store.get_run(rid)
    assert (run.next_step, run.status, run.head_seq) == (None, RunStatus.COMPLETED, 1)
    store.save(rid, {"a": 3}, step="fix")
    run = store.get_run(rid)
    assert (run.next_step, run.status, run.head_seq) == (None, RunStatus.COMPLETED, 2)
    assert [r.run_id for r in store.list_runs(status="completed")] == [rid]


def test_save_records_source_and_schema_version(store: Store) -> None:
    rid = store.create_run("f", state_version=2).run_id
    a = store.save(rid, {"a": 1}, step="s")
    b = store.save(rid, {"a": 2}, step="fix", source=Source.OPERATOR)
    c = store.save(rid, {"a": 3}, step="s", schema_version=3)
    assert (a.schema_version, b.schema_version, c.schema_version) == (2, 2, 3)
    assert b.source is Source.OPERATOR
    assert c.keyframe
    assert store.get_run(rid).state_version == 3
    assert [h.source for h in store.history(rid)] == [Source.STEP, Source.OPERATOR, Source.STEP]


def test_loaded_state_belongs_to_the_caller(store: Store) -> None:
    rid = new_run(store)
    state: dict[str, Any] = {"log": [1], "d": {"k": [1]}}
    store.save(rid, state, step="0")
    state["log"].append(2)  # changed after saving, not saved
    state["d"]["k"].append(2)
    assert store.load(rid).state == {"log": [1], "d": {"k": [1]}}
    snap = store.load(rid)
    snap.state["log"].append(99)
    snap.state["d"]["k"].clear()
    assert store.load(rid).state == {"log": [1], "d": {"k": [1]}}
    store.save(rid, snap.state, step="1")  # the caller's edits are a change like any other
    assert store.load(rid).state == {"log": [1, 99], "d": {"k": []}}
    store.save(rid, state, step="2")
    assert store.load(rid).state == {"log": [1, 2], "d": {"k": [1, 2]}}


@pytest.mark.parametrize(
    "value",
    [
        {
            "none": None,
            "bool": True,
            "int": -(10**40),
            "float": -0.0,
            "inf": float("inf"),
            "str": "\x00\u2603",
            "bytes": b"\x00\xff",
            "list": [1, "a"],
            "tuple": (1, (2,)),
            "dict": {"\x00m": 1, "a": {"b": 2}},
            "keys": {1: "a", (1, 2): "b", None: "c"},
            "set": {1, "a", (2, 3)},
            "frozenset": frozenset({b"x"}),
            "naive": dt.datetime(2024, 1, 2, 3, 4, 5, 6),
            "aware": dt.datetime(2024, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=-3))),
            "date": dt.date(2024, 1, 2),
            "decimal": Decimal("1.50"),
            "uuid": uuid.UUID(int=42),
            "point": Point(1, 2),
            "note": Note("t", ["a"], {"p": Point(3, 4)}),
        }
    ],
)
def test_every_codec_type_round_trips_through_the_store(
    db_url: str, open_store: Callable[..., Store], value: dict[str, Any]
) -> None:
    writer = open_store(codec=make_codec())
    rid = new_run(writer)
    writer.save(rid, {"all": value, **value}, step="0")
    reader = open_store(codec=make_codec())
    assert strict_equal(reader.load(rid).state, {"all": value, **value})
    # a fresh process saving an equal (freshly built) state changes nothing
    reader.save(rid, {"all": dict(value), **value}, step="1")
    assert strict_equal(writer.load(rid).state, {"all": value, **value})


_STORE_PROPS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@_STORE_PROPS
@given(value=codec_values(max_leaves=8))
def test_any_codec_value_round_trips_through_the_store(store: Store, value: Any) -> None:
    store.codec = make_codec()
    rid = new_run(store)
    store.save(rid, {"v": value}, step="0")
    store.save(rid, {"v": value, "w": [value]}, step="1")
    assert strict_equal(store.load(rid).state, {"v": value, "w": [value]})
    assert strict_equal(store.load(rid, 0).state, {"v": value})


@_STORE_PROPS
@given(value=codec_values(max_leaves=6))
def test_a_store_that_cannot_decode_a_state_saves_it_back_exactly(
    store: Store, open_store: Callable[..., Store], value: Any
) -> None:
    """A tool without the writer's dataclasses (the CLI: a non-strict codec) loads a
    state, changes one channel and saves it, as a delta and as a keyframe, eager and
    lazy: the writer reads back every value it wrote, and no blob changes its hash."""
    store.codec = make_codec()
    rid = new_run(store)
    state: dict[str, Any] = {
        "v": value,
        "paged": {f"k{i:03d}": [i, value] for i in range(70)},  # pages in a keyframe
        "log": [[i, value] for i in range(70)],  # a sealed chunk and a tail
        "large": [value, "x" * 5000],  # a blob of its own
    }
    store.save(rid, state, step="0")
    blobs = blob_count(store.engine)
    tool = open_store(codec=Codec(strict=False), keyframes=KeyframePolicy(max_deltas=1))
    for n, lazy in enumerate([False, True, False]):
        seen = tool.load(rid, lazy=lazy).state
        seen["note"] = n  # a delta, then a keyframe over every other channel, ...
        state["note"] = n
        if not lazy:
            seen["log"].append(["more", n])
            state["log"].append(["more", n])
        tool.save(rid, seen, step=str(n + 1))
    assert blob_count(store.engine) == blobs  # every blob re-encoded to the same bytes
    assert any(i.keyframe for i in tool.history(rid)[1:])
    assert strict_equal(open_store(codec=make_codec()).load(rid).state, state)


def test_saving_a_signalling_nan_decimal_again_works(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    rid = new_run(open_store())
    open_store().save(rid, {"d": Decimal("sNaN"), "n": 0}, step="0")
    open_store().save(rid, {"d": Decimal("sNaN"), "n": 1}, step="1")
    assert str(open_store().load(rid).state["d"]) == "sNaN"


# Values that compare equal with == but are different values: a change from one to the
# other must be recorded like any other change. (1 -> True and 1 -> 1.0 are controls.)
_EQUAL_BUT_DIFFERENT: list[tuple[str, Any, Any]] = [
    ("int-bool", 1, True),
    ("int-float-in-list", [1], [1.0]),
    ("zero-negative-zero", 0.0, -0.0),
    ("decimal-exponent", Decimal("1.0"), Decimal("1.00")),
    (
        "datetime-offset",
        dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC),
        dt.datetime(2024, 1, 1, 13, tzinfo=dt.timezone(dt.timedelta(hours=1))),
    ),
    ("dict-key-type", {1: "a"}, {True: "a"}),
    ("set-member-type", {1}, {True}),
]


def test_save_records_changes_between_values_that_compare_equal(
    store: Store, subtests: pytest.Subtests
) -> None:
    for name, before, after in _EQUAL_BUT_DIFFERENT:
        for where in ("channel", "large-dict-key"):
            with subtests.test(msg=f"{name} in a {where}"):
                _check_change_is_recorded(store, before, after, where)


def _check_change_is_recorded(store: Store, before: Any, after: Any, where: str) -> None:
    def state(v: Any) -> dict[str, Any]:
        if where == "channel":
            return {"x": v}
        return {"x": {**{f"k{i}": i for i in range(80)}, "v": v}}

    rid = new_run(store)
    store.save(rid, state(before), step="0")
    store.save(rid, state(after), step="1")
    assert strict_equal(store.load(rid).state, state(after))
    assert strict_equal(store.load(rid, 0).state, state(before))


def test_deleting_keys_of_a_dict_with_mixed_key_types(store: Store) -> None:
    rid = new_run(store)
    before = {1: "a", "w": "b", "x": 1, "y": 2, "z": 3, "q": 4}
    after = {"x": 1, "y": 2, "z": 3, "q": 4}
    store.save(rid, {"m": before}, step="0")
    store.save(rid, {"m": after}, step="1")
    assert strict_equal(store.load(rid).state, {"m": after})


# -- what a checkpoint stores ----------------------------------------------------------------


def _delta_bytes_for_changed_keys(store: Store, size: int, changed: int) -> tuple[int, int]:
    """Bytes added to the store by a checkpoint that changes ``changed`` keys of a dict of
    ``size`` keys, and the encoded size of that dict."""
    rid = new_run(store)
    big = {f"key-{i:05d}": f"value {i} " + "x" * 40 for i in range(size)}
    store.save(rid, {"docs": big, "n": 0}, step="0")
    before = stored_bytes(store.engine)
    for k in list(big)[:: max(1, size // changed)][:changed]:
        big[k] = "changed"
    store.save(rid, {"docs": big, "n": 1}, step="1")
    return stored_bytes(store.engine) - before, len(store.codec.encode(big))


def test_a_dict_checkpoint_stores_only_the_changed_keys(store: Store) -> None:
    small_delta, _ = _delta_bytes_for_changed_keys(store, 300, 3)
    big_delta, big_size = _delta_bytes_for_changed_keys(store, 6000, 3)
    assert big_delta < big_size / 200
    assert big_delta <= small_delta + 32  # independent of the dict's size
    more_delta, _ = _delta_bytes_for_changed_keys(store, 6000, 30)
    assert big_delta < more_delta < big_size / 20  # grows with what changed


def test_deleting_and_merging_keys_stores_only_those_keys(store: Store) -> None:
    rid = new_run(store)
    big = {f"key-{i:05d}": "y" * 50 for i in range(5000)}
    store.save(rid, {"docs": big}, step="0")
    size = len(store.codec.encode(big))
    before = stored_bytes(store.engine)
    del big["key-00010"], big["key-04000"]
    store.save(rid, {"docs": big}, step="1")
    store.update(rid, step="2", merge={"docs": {"key-00020": "z", "new": "n"}})
    assert stored_bytes(store.engine) - before < size / 100
    big.update({"key-00020": "z", "new": "n"})
    assert store.load(rid).state == {"docs": big}


def _append_bytes(store: Store, existing: int, via_update: bool) -> int:
    rid = new_run(store)
    items = [f"message {i:06d} " + "m" * 20 for i in range(existing)]
    store.save(rid, {"log": items, "n": 0}, step="0")
    before = stored_bytes(store.engine)
    new = ["appended one", "appended two", "appended three"]
    if via_update:
        store.update(rid, step="1", append={"log": new})
    else:
        store.save(rid, {"log": [*items, *new], "n": 0}, step="1")
    added = stored_bytes(store.engine) - before
    assert store.load(rid).state["log"] == [*items, *new]
    return added


@pytest.mark.parametrize("via_update", [False, True], ids=["save", "update"])
def test_appending_to_a_list_writes_only_the_appended_items(store: Store, via_update: bool) -> None:
    short = _append_bytes(store, 10, via_update)
    long = _append_bytes(store, 20000, via_update)
    appended = len(store.codec.encode(["appended one", "appended two", "appended three"]))
    assert long <= short + 16
    assert long < appended + 100


def test_keyframes_of_a_long_list_share_its_sealed_chunks(db_url: str) -> None:
    with Store.open(db_url, keyframes=KeyframePolicy(max_deltas=0)) as store:
        rid = new_run(store)
        items = [f"message {i:06d} " + "m" * 30 for i in range(6000)]
        store.save(rid, {"log": items}, step="0")
        list_size = len(store.codec.encode(items))
        for i in range(1, 11):
            before, blobs_before = stored_bytes(store.engine), blob_count(store.engine)
            items.append(f"new {i}")
            info = store.save(rid, {"log": items}, step=str(i))
            assert info.keyframe
            assert stored_bytes(store.engine) - before < list_size / 5
            assert blob_count(store.engine) - blobs_before <= 1
        assert store.load(rid).state["log"] == items
        assert store.load(rid, 3).state["log"] == items[: 6000 + 3]


def test_keyframes_of_a_large_dict_share_unchanged_pages(db_url: str) -> None:
    with Store.open(db_url, keyframes=KeyframePolicy(max_deltas=0)) as store:
        rid = new_run(store)
        big = {f"key-{i:05d}": f"value {i} " + "v" * 40 for i in range(4000)}
        store.save(rid, {"docs": big}, step="0")
        size = len(store.codec.encode(big))
        before = stored_bytes(store.engine)
        big["key-01234"] = "changed"
        assert store.save(rid, {"docs": big}, step="1").keyframe
        assert stored_bytes(store.engine) - before < size / 4
        assert store.load(rid).state == {"docs": big}


def test_keyframes_are_written_periodically(db_url: str, open_store: Callable[..., Store]) -> None:
    policy = KeyframePolicy(max_deltas=3)
    store = open_store(keyframes=policy)
    rid = new_run(store)
    state: dict[str, Any] = {"text": "t" * 2000, "log": []}
    for i in range(25):
        state["log"].append(i)
        state["n"] = i
        store.save(rid, state, step=str(i))
    for history in (store.history(rid), open_store().history(rid)):
        assert len(history) == 25
        keyframes = [h.seq for h in history if h.keyframe]
        assert keyframes[0] == 0
        assert len(keyframes) >= 25 // (policy.max_deltas + 1)
        for h in history:
            assert h.keyframe == (h.keyframe_seq == h.seq)
            assert history[h.keyframe_seq].keyframe
            # loading h reads its keyframe and at most max_deltas deltas
            assert 0 <= h.seq - h.keyframe_seq <= policy.max_deltas
    reader = open_store()
    for i in range(25):
        assert reader.load(rid, i).state["log"] == list(range(i + 1))


def test_replay_ratio_bounds_the_deltas_since_the_keyframe(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    store = open_store(keyframes=KeyframePolicy(max_deltas=1000, replay_ratio=0.5))
    rid = new_run(store)
    for i in range(20):
        store.save(rid, {"note": f"{i:04d}" * 250, "n": i}, step=str(i))
    history = store.history(rid)
    keyframes = [h.seq for h in history if h.keyframe]
    assert len(keyframes) >= 5
    assert max(h.seq - h.keyframe_seq for h in history) <= 3
    assert open_store().load(rid).state["n"] == 19


def test_max_deltas_zero_writes_only_keyframes(db_url: str) -> None:
    with Store.open(db_url, keyframes=KeyframePolicy(max_deltas=0)) as store:
        rid = new_run(store)
        for i in range(5):
            store.save(rid, {"n": i}, step=str(i))
        assert all(h.keyframe for h in store.history(rid))


def test_delta_checkpoints_are_small_next_to_keyframes(store: Store) -> None:
    rid = new_run(store)
    state: dict[str, Any] = {
        "docs": {f"k{i}": "d" * 30 for i in range(500)},
        "log": list(range(500)),
    }
    store.save(rid, state, step="0")
    state["docs"]["k1"] = "x"
    state["log"].append(500)
    store.save(rid, state, step="1")
    sizes = body_sizes(store.engine, rid)
    assert sizes[1] * 20 < len(store.codec.encode(state))


# -- list channels replaced, not appended ---------------------------------------------------

_FIRST = [f"first {i}" for i in range(100)]
_SECOND = [f"second {i}" for i in range(130)]


def _replace_by_save(store: Store, rid: str) -> None:
    store.save(rid, {"log": _FIRST}, step="0")
    store.save(rid, {"log": [*_FIRST, "x"]}, step="1")
    store.save(rid, {"log": _SECOND}, step="2")


def _replace_by_update(store: Store, rid: str) -> None:
    store.save(rid, {"log": _FIRST}, step="0")
    store.update(rid, step="1", append={"log": ["x"]})
    store.update(rid, step="2", set={"log": _SECOND})


def _edit_first_item(store: Store, rid: str) -> None:
    store.save(rid, {"log": _FIRST}, step="0")
    store.save(rid, {"log": [*_FIRST, "x"]}, step="1")
    store.save(rid, {"log": ["edited", *_FIRST[1:], "x"]}, step="2")


def _delete_then_recreate(store: Store, rid: str) -> None:
    store.save(rid, {"log": _FIRST}, step="0")
    store.save(rid, {}, step="1")
    store.save(rid, {"log": _SECOND}, step="2")


_REPLACEMENTS: list[tuple[str, int, Callable[[Store, str], None], list[str]]] = [
    ("save-replaces", 1, _replace_by_save, _SECOND),
    ("update-sets", 1, _replace_by_update, _SECOND),
    ("save-edits", 1, _edit_first_item, ["edited", *_FIRST[1:], "x"]),
    ("delete-recreate", 0, _delete_then_recreate, _SECOND),
    ("control-deltas-only", 100, _replace_by_save, _SECOND),
]


def test_a_long_list_replaced_at_a_keyframe_loads_as_replaced(
    open_store: Callable[..., Store], subtests: pytest.Subtests
) -> None:
    for name, max_deltas, steps, expected in _REPLACEMENTS:
        with subtests.test(msg=name):
            store = open_store(keyframes=KeyframePolicy(max_deltas=max_deltas))
            rid = new_run(store)
            steps(store, rid)
            assert store.history(rid)[-1].keyframe == (max_deltas < 2)
            assert store.load(rid).state["log"] == expected
            assert open_store().load(rid).state["log"] == expected


# -- leases -----------------------------------------------------------------------------------


def test_lease_acquire_renew_conflict_release(store: Store) -> None:
    rid = new_run(store)
    t0 = time.time()
    run = store.acquire_lease(rid, "worker-1", ttl_s=30)
    assert run.lease_owner == "worker-1"
    assert run.lease_expires_at is not None
    assert t0 + 30 <= run.lease_expires_at <= time.time() + 30
    renewed = store.acquire_lease(rid, "worker-1", ttl_s=60)
    assert renewed.lease_expires_at is not None
    assert renewed.lease_expires_at > run.lease_expires_at
    with pytest.raises(LeaseHeld) as exc:
        store.acquire_lease(rid, "worker-2", ttl_s=30)
    assert exc.value.run_id == rid
    assert exc.value.owner == "worker-1"
    assert exc.value.expires_at == pytest.approx(renewed.lease_expires_at)
    assert store.get_run(rid).lease_owner == "worker-1"
    assert store.release_lease(rid, "worker-2") is False
    assert store.get_run(rid).lease_owner == "worker-1"
    assert store.release_lease(rid, "worker-1") is True
    released = store.get_run(rid)
    assert (released.lease_owner, released.lease_expires_at) == (None, None)
    assert store.release_lease(rid, "worker-1") is False
    assert store.acquire_lease(rid, "worker-2", ttl_s=5).lease_owner == "worker-2"


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED])
def test_the_write_that_ends_a_run_clears_its_lease(store: Store, status: RunStatus) -> None:
    """No moment at which a reader sees an ended run still leased (a worker releases
    its lease in a later write; until then a completed run looked taken)."""
    rid = new_run(store)
    store.acquire_lease(rid, "worker-1", ttl_s=30)
    store.save(rid, {"n": 1}, step="a", next_step="b")
    assert store.get_run(rid).lease_owner == "worker-1"  # a step's save keeps it
    store.save(rid, {"n": 2}, step="b", next_step=None, status=status)
    ended, snap = store.load_run(rid)
    assert (ended.status, ended.lease_owner, ended.lease_expires_at) == (status, None, None)
    assert snap is not None
    assert snap.state == {"n": 2}
    fresh = store.get_run(rid)
    assert (fresh.lease_owner, fresh.lease_expires_at) == (None, None)
    assert store.release_lease(rid, "worker-1") is False  # nothing left to release


def test_an_expired_lease_can_be_taken_by_another_owner(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = new_run(store)
    store.acquire_lease(rid, "worker-1", ttl_s=0.3)
    other = open_store()
    with pytest.raises(LeaseHeld):
        other.acquire_lease(rid, "worker-2", ttl_s=10)
    time.sleep(0.4)
    assert other.acquire_lease(rid, "worker-2", ttl_s=10).lease_owner == "worker-2"
    assert store.release_lease(rid, "worker-1") is False
    with pytest.raises(LeaseHeld) as exc:
        store.acquire_lease(rid, "worker-1", ttl_s=10)
    assert exc.value.owner == "worker-2"


def test_lease_errors(store: Store) -> None:
    rid = new_run(store)
    for ttl in (0, -1.0):
        with pytest.raises(ConfigurationError):
            store.acquire_lease(rid, "w", ttl_s=ttl)
    assert store.get_run(rid).lease_owner is None


def test_lease_does_not_touch_checkpoints(store: Store) -> None:
    rid = new_run(store)
    store.save(rid, {"a": 1}, step="0", next_step="n")
    store.acquire_lease(rid, "w", ttl_s=10)
    store.save(rid, {"a": 2}, step="1")
    store.release_lease(rid, "w")
    assert store.load(rid).state == {"a": 2}
    assert store.get_run(rid).next_step == "n"


# -- concurrency ------------------------------------------------------------------------------


def test_two_stores_writing_one_run_raise_concurrent_write(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = store.create_run("f", next_step="a0").run_id
    store.save(rid, {"v": 0}, step="a0", next_step="a1")
    other = open_store()
    assert other.load(rid).state == {"v": 0}
    store.save(rid, {"v": 1}, step="a1", next_step="a2")
    with pytest.raises(ConcurrentWrite) as exc:
        other.save(rid, {"v": 99}, step="b1", next_step="bogus", status="failed")
    assert exc.value.run_id == rid
    assert exc.value.expected_seq == 0
    run = store.get_run(rid)
    assert (run.next_step, run.status, run.head_seq) == ("a2", RunStatus.RUNNING, 1)
    assert [h.step for h in store.history(rid)] == ["a0", "a1"]
    assert store.load(rid).state == {"v": 1}
    # the losing store recovers by reloading
    assert other.load(rid).state == {"v": 1}
    assert other.save(rid, {"v": 2}, step="b2").seq == 2
    assert store.load(rid).state == {"v": 2}
    other.save(rid, {"v": 3}, step="b3")
    with pytest.raises(ConcurrentWrite):
        store.update(rid, step="a3", set={"v": 30})
    assert store.load(rid).state == {"v": 3}


def test_two_stores_racing_on_one_run_never_lose_a_checkpoint(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    a, b = open_store(), open_store()
    rid = new_run(a)
    a.save(rid, {"log": []}, step="init")
    errors: list[BaseException] = []

    def worker(store: Store, name: str) -> None:
        done = 0
        while done < 15:
            try:
                state = store.load(rid).state
                state["log"].append(name)
                store.save(rid, state, step=name)
                done += 1
            except ConcurrentWrite:
                continue
            except BaseException as exc:  # noqa: BLE001  (re-raised in the test thread)
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    log = open_store().load(rid).state["log"]
    assert sorted(log) == ["a"] * 15 + ["b"] * 15
    history = a.history(rid)
    assert [h.seq for h in history] == list(range(31))
    assert [h.step for h in history[1:]] == log


# -- codec errors at save time -----------------------------------------------------------------


def _generator() -> Iterator[int]:
    yield 1


_BAD_VALUES: list[tuple[str, Callable[[], Any]]] = [
    ("object", object),
    ("unregistered-dataclass", lambda: Unregistered(1)),
    ("nested", lambda: {"deep": [1, {"x": Unregistered(2)}]}),
    ("complex-in-set", lambda: {1, 2, 3.5j}),
    ("int-too-long", lambda: 10**5000),
    ("lock", threading.Lock),
    ("generator", _generator),
]


def test_codec_error_at_save_writes_nothing_and_the_store_stays_usable(
    store: Store, open_store: Callable[..., Store], subtests: pytest.Subtests
) -> None:
    for name, make_bad in _BAD_VALUES:
        with subtests.test(msg=name):
            _check_codec_error_writes_nothing(store, open_store, make_bad)


def _check_codec_error_writes_nothing(
    store: Store, open_store: Callable[..., Store], make_bad: Callable[[], Any]
) -> None:
    rid = store.create_run("f", next_step="one").run_id
    store.save(rid, {"a": 1, "log": [1, 2]}, step="one", next_step="two")
    before = stored_bytes(store.engine)
    with pytest.raises(CodecError):
        store.save(
            rid,
            {"a": 2, "bad": make_bad(), "log": [1, 2, 3]},
            step="two",
            next_step="three",
            status="waiting",
        )
    with pytest.raises(CodecError):
        store.update(rid, step="two", set={"bad": make_bad()}, append={"log": [3]})
    assert stored_bytes(store.engine) == before
    assert len(store.history(rid)) == 1
    run = store.get_run(rid)
    assert (run.next_step, run.status, run.head_seq) == ("two", RunStatus.RUNNING, 0)
    assert store.load(rid).state == {"a": 1, "log": [1, 2]}
    info = store.save(rid, {"a": 3, "log": [1, 2, 4]}, step="two", next_step="three")
    assert info.seq == 1
    assert open_store().load(rid).state == {"a": 3, "log": [1, 2, 4]}
    assert store.get_run(rid).next_step == "three"


def test_codec_error_on_the_first_save_writes_nothing(
    store: Store, subtests: pytest.Subtests
) -> None:
    for name, make_bad in _BAD_VALUES:
        with subtests.test(msg=name):
            rid = new_run(store)
            with pytest.raises(CodecError):
                store.save(rid, {"bad": make_bad()}, step="0")
            assert store.history(rid) == []
            assert store.get_run(rid).head_seq is None
            assert store.save(rid, {"ok": 1}, step="0").seq == 0
            assert store.load(rid).state == {"ok": 1}


def test_channel_names_must_be_plain_strings(store: Store, subtests: pytest.Subtests) -> None:
    channels: list[Any] = [1, ("a",), "\x00hidden", None]
    for channel in channels:
        with subtests.test(msg=repr(channel)):
            rid = new_run(store)
            store.save(rid, {"ok": 1}, step="0")
            with pytest.raises(CodecError):
                store.save(rid, {"ok": 1, channel: 2}, step="1")
            with pytest.raises(CodecError):
                store.update(rid, step="1", set={channel: 2})
            assert len(store.history(rid)) == 1
            assert store.load(rid).state == {"ok": 1}


def test_store_is_closed_after_close(db_url: str) -> None:
    store = Store.open(db_url)
    rid = new_run(store)
    store.close()
    store.close()  # idempotent
    with pytest.raises(ConfigurationError):
        store.get_run(rid)
    with Store.open(db_url) as again:
        assert again.get_run(rid).run_id == rid


def test_unknown_durability_is_a_configuration_error(db_url: str) -> None:
    with pytest.raises(ConfigurationError):
        Store.open(db_url, durability="eventually")


def test_policies_refuse_bad_settings() -> None:
    with pytest.raises(ConfigurationError):
        KeyframePolicy(max_deltas=-1)
    with pytest.raises(ConfigurationError):
        KeyframePolicy(replay_ratio=0)


def test_connections_of_exited_threads_go_back_to_the_pool(store: Store) -> None:
    import threading

    rid = store.create_run("f").run_id
    store.save(rid, {"n": 0}, step="s")
    # More short-lived threads than the pool holds (LangGraph runs each invoke on a new
    # thread pool; ctx.parallel starts threads per step): none may keep its connection.
    for i in range(40):
        t = threading.Thread(target=lambda i=i: store.load(rid))
        t.start()
        t.join(10)
        assert not t.is_alive()
    assert len(store._pinned) <= 2  # this thread's, and at most the last exited one
    assert store.load(rid).state == {"n": 0}


# -- reads nested in a read ----------------------------------------------------------------


def test_a_load_inside_a_read_sees_the_reads_snapshot(
    store: Store, open_store: Callable[..., Store]
) -> None:
    """``load`` and ``load_each`` inside ``read(fn)`` see the moment ``fn``'s statements
    see: a checkpoint another store commits meanwhile is not there for them; after the
    read, it is."""
    run_id = new_run(store)
    store.save(run_id, {"n": 1}, step="a")
    reader, writer = open_store(), open_store()
    q = reader.param

    def fn(cur: Any) -> tuple[int, int, int, list[int]]:
        cur.execute(f"SELECT head_seq FROM oo_runs WHERE run_id = {q}", (run_id,))
        head = int(cur.fetchone()[0])
        writer.save(run_id, {"n": 2}, step="b")  # committed on another connection, mid-read
        snap = reader.load(run_id)
        each = [info.seq for info, _ in reader.load_each(run_id, [0])]
        return head, snap.info.seq, snap.state["n"], each

    assert reader.read(fn) == (0, 0, 1, [0])
    after = reader.load(run_id)
    assert (after.info.seq, after.state["n"]) == (1, 2)


def _fails_once(fn: Callable[..., Any], name: str, calls: list[str]) -> Callable[..., Any]:
    """``fn``, logging ``name`` in ``calls`` on every call; the first raises a transient
    ``DatabaseUnavailable`` (a lost connection) instead."""

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        if calls.count(name) == 1:
            raise DatabaseUnavailable("connection lost (test)", transient=True)
        return fn(*args, **kwargs)

    return flaky


def test_a_failure_inside_a_nested_read_retries_the_outermost_read(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient failure in a ``load`` inside ``read(fn)`` ends the whole read: ``fn``
    runs again in a new transaction, and the inner load is not retried on its own (its
    transaction is the one that failed)."""
    run_id = new_run(store)
    store.save(run_id, {"n": 1}, step="a")
    calls: list[str] = []
    monkeypatch.setattr(
        store, "_materialise", _fails_once(store._materialise, "materialise", calls)
    )
    store._heads.clear()  # the load reads the database

    def fn(cur: Any) -> int:
        calls.append("fn")
        return int(store.load(run_id).state["n"])

    assert store.read(fn) == 1
    assert calls == ["fn", "materialise", "fn", "materialise"]


def test_another_stores_call_inside_a_read_retries_on_its_own(
    store: Store, open_store: Callable[..., Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Joining is per store: a transient failure of another store's ``load`` inside
    ``read(fn)`` is retried by that load alone (its transaction is its own), and ``fn``
    runs once; a write inside the read retries on its own too."""
    run_id = new_run(store)
    store.save(run_id, {"n": 1}, step="a")
    other = open_store()
    calls: list[str] = []
    monkeypatch.setattr(
        other, "_materialise", _fails_once(other._materialise, "materialise", calls)
    )
    monkeypatch.setattr(store, "_transact", _fails_once(store._transact, "write", calls))
    other._heads.clear()

    def fn(cur: Any) -> int:
        calls.append("fn")
        n = int(other.load(run_id).state["n"])
        store.transact(lambda conn: None)
        return n

    assert store.read(fn) == 1
    assert calls == ["fn", "materialise", "materialise", "write", "write"]


@pytest.mark.parametrize("gone", ["run", "blob"])
def test_a_lazy_list_read_after_its_run_was_deleted_says_so(
    store: Store, open_store: Callable[..., Store], gone: str
) -> None:
    """A list loaded with ``lazy=True`` whose run another process removed (retention;
    its blobs collected) before the chunks were read: ``RunNotFound`` saying why, not a
    corruption alarm. A chunk missing while its run exists is still ``CorruptRecord``."""
    from onceonly.checkpoint import CorruptRecord, RetentionPolicy
    from tests.dbutil import execute

    rid = new_run(store)
    store.save(rid, {"log": [f"m{i}" for i in range(200)]}, step="s")  # sealed chunks
    store.update_run(rid, status=RunStatus.COMPLETED)
    lazy = store.load(rid, lazy=True).state["log"]
    other = open_store()
    if gone == "run":
        report = other.apply_retention(RetentionPolicy(older_than_s=0), now=time.time() + 60)
        assert (report.runs_deleted, report.blobs_collected > 0) == (1, True)
        with pytest.raises(RunNotFound, match=rid) as caught:
            lazy[0]
        assert "lazy=True" in " ".join(caught.value.__notes__)
    else:
        assert execute(other.engine, "DELETE FROM oo_blobs") > 0
        with pytest.raises(CorruptRecord, match="missing"):
            lazy[0]
