"""State-schema versions: registered upgrades run on load and are recorded; states from
newer code, or with a missing upgrade, are refused without writing anything."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from onceonly.checkpoint import (
    ConfigurationError,
    Source,
    StateMigrations,
    StateVersionError,
    Store,
)


def _amount_with_currency(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    out["amount"] = {"value": out["amount"], "currency": "EUR"}
    return out


def _add_notes(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    out["notes"] = [f"migrated {len(out['log'])} entries"]
    return out


V1_STATES = [
    {"amount": 10, "log": ["a"]},
    {"amount": 12, "log": ["a", "b"]},
]


def _v3(state: dict[str, Any]) -> dict[str, Any]:
    return _add_notes(_amount_with_currency(state))


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


def _v1_run(store: Store) -> str:
    rid = store.create_run("invoice", state_version=1, next_step="pay").run_id
    for i, state in enumerate(V1_STATES):
        store.save(rid, state, step=f"step-{i}")
    return rid


def test_upgrades_run_in_order_and_are_recorded_as_a_migration_checkpoint(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = _v1_run(store)
    calls: list[int] = []

    def up1(s: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        return _amount_with_currency(s)

    def up2(s: dict[str, Any]) -> dict[str, Any]:
        calls.append(2)
        assert isinstance(s["amount"], dict)  # runs after up1
        return _add_notes(s)

    mig = StateMigrations(current=3, upgrades={2: up2, 1: up1})
    snap = store.load(rid, migrations=mig)
    assert calls == [1, 2]
    assert snap.state == _v3(V1_STATES[-1])
    assert snap.info.source is Source.MIGRATION
    assert snap.info.schema_version == 3
    assert snap.info.seq == 2
    assert snap.info.step == "step-1"
    run = store.get_run(rid)
    assert (run.state_version, run.head_seq, run.next_step) == (3, 2, "pay")
    history = store.history(rid)
    assert [h.source for h in history] == [Source.STEP, Source.STEP, Source.MIGRATION]
    assert [h.schema_version for h in history] == [1, 1, 3]

    # already current: nothing runs, nothing is written
    again = store.load(rid, migrations=mig)
    assert again.state == _v3(V1_STATES[-1])
    assert again.info.seq == 2
    assert calls == [1, 2]
    assert len(store.history(rid)) == 3

    # another process reads the migrated state without any migrations
    reader = open_store()
    latest = reader.load(rid)
    assert latest.state == _v3(V1_STATES[-1])
    assert latest.info.schema_version == 3
    # the earlier checkpoints are untouched
    for i, state in enumerate(V1_STATES):
        snap_i = reader.load(rid, i)
        assert snap_i.state == state
        assert snap_i.info.schema_version == 1
    # later checkpoints carry the new version
    info = reader.save(rid, {**latest.state, "paid": True}, step="pay")
    assert info.schema_version == 3


def test_the_store_default_migrations_apply_on_load(open_store: Callable[..., Store]) -> None:
    rid = _v1_run(open_store())
    mig = StateMigrations(current=2, upgrades={1: _amount_with_currency})
    store = open_store(migrations=mig)
    snap = store.load(rid)
    assert snap.state == _amount_with_currency(V1_STATES[-1])
    assert snap.info.source is Source.MIGRATION
    assert open_store().get_run(rid).state_version == 2


def test_a_checkpoint_newer_than_the_code_is_refused(store: Store) -> None:
    rid = store.create_run("invoice", state_version=1).run_id
    store.save(rid, {"amount": 1}, step="a")
    store.save(rid, {"amount": {"value": 1}}, step="b", schema_version=3)
    mig = StateMigrations(current=2, upgrades={1: _amount_with_currency})
    with pytest.raises(StateVersionError) as exc:
        store.load(rid, migrations=mig)
    assert (exc.value.run_id, exc.value.found, exc.value.current) == (rid, 3, 2)
    assert "newer" in str(exc.value)
    assert len(store.history(rid)) == 2
    assert store.get_run(rid).state_version == 3
    assert store.load(rid).state == {"amount": {"value": 1}}


@pytest.mark.parametrize(
    ("upgrades", "found"),
    [
        pytest.param({2: _add_notes}, 1, id="first-missing"),
        pytest.param({1: _amount_with_currency}, 2, id="second-missing"),
    ],
)
def test_a_missing_upgrade_is_refused_and_nothing_is_written(
    store: Store, upgrades: dict[int, Callable[[dict[str, Any]], dict[str, Any]]], found: int
) -> None:
    rid = _v1_run(store)
    with pytest.raises(StateVersionError) as exc:
        store.load(rid, migrations=StateMigrations(current=3, upgrades=upgrades))
    assert (exc.value.run_id, exc.value.found, exc.value.current) == (rid, found, 3)
    assert len(store.history(rid)) == 2
    assert store.get_run(rid).state_version == 1
    assert store.load(rid).state == V1_STATES[-1]


def test_an_upgrade_that_returns_no_dict_is_refused(store: Store) -> None:
    rid = _v1_run(store)

    def not_a_dict(state: dict[str, Any]) -> Any:
        return [state]

    bad = StateMigrations(current=2, upgrades={1: not_a_dict})
    with pytest.raises(StateVersionError):
        store.load(rid, migrations=bad)
    assert len(store.history(rid)) == 2


def test_loading_an_earlier_checkpoint_upgrades_in_memory_only(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = _v1_run(store)
    mig = StateMigrations(current=3, upgrades={1: _amount_with_currency, 2: _add_notes})
    snap = store.load(rid, 0, migrations=mig)
    assert snap.state == _v3(V1_STATES[0])
    assert snap.info.seq == 0
    assert snap.info.source is Source.STEP
    assert len(store.history(rid)) == 2
    assert store.get_run(rid).state_version == 1
    reader = open_store()
    assert reader.load(rid, 0).state == V1_STATES[0]
    assert reader.load(rid).state == V1_STATES[-1]


def test_an_upgrade_that_rewrites_a_long_list_is_stored_as_upgraded(
    store: Store, open_store: Callable[..., Store]
) -> None:
    rid = store.create_run("chat", state_version=1).run_id
    messages = [f"message {i}" for i in range(150)]
    store.save(rid, {"messages": messages}, step="0")
    store.save(rid, {"messages": [*messages, "last"]}, step="1")

    def to_records(state: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [{"text": m} for m in state["messages"]]}

    mig = StateMigrations(current=2, upgrades={1: to_records})
    expected = to_records({"messages": [*messages, "last"]})
    assert store.load(rid, migrations=mig).state == expected
    assert store.load(rid).state == expected
    assert open_store().load(rid).state == expected


def test_state_migrations_refuse_bad_settings() -> None:
    with pytest.raises(ConfigurationError):
        StateMigrations(current=0)
    with pytest.raises(ConfigurationError):
        StateMigrations(current=2, upgrades={2: _add_notes})
    with pytest.raises(ConfigurationError):
        StateMigrations(current=2, upgrades={0: _add_notes})
