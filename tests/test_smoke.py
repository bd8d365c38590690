from __future__ import annotations

from onceonly.checkpoint import Store


def test_round_trip(store: Store) -> None:
    run = store.create_run("smoke")
    store.save(run.run_id, {"a": 1, "b": [1, 2]}, step="one")
    store.save(run.run_id, {"a": 2, "b": [1, 2, 3]}, step="two")
    snap = store.load(run.run_id)
    assert snap.state == {"a": 2, "b": [1, 2, 3]}
    assert snap.info.seq == 1
    assert store.load(run.run_id, 0).state == {"a": 1, "b": [1, 2]}
