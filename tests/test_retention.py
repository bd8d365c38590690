"""Retention: finished runs older than the policy are archived and deleted; live runs are
never touched; blobs are collected only when no remaining run refers to them."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from onceonly.checkpoint import (
    ConfigurationError,
    Handoff,
    RetentionPolicy,
    RunNotFound,
    RunStatus,
    Store,
)
from tests.dbutil import blob_count, blob_hashes
from tests.values import strict_equal

_SHARED = random.Random(1).randbytes(6000)  # blob-sized, used by an old and a live run
_OWN = random.Random(2).randbytes(6000)  # blob-sized, used only by an old finished run


@dataclass
class _Fleet:
    """Runs on both sides of a cutoff, and their latest states."""

    old: dict[RunStatus, str]
    recent_completed: str
    states: dict[str, list[dict[str, Any]]]
    cutoff: float
    own_blob: bytes
    shared_blob: bytes


def _save_all(store: Store, rid: str, states: list[dict[str, Any]], status: RunStatus) -> None:
    for i, state in enumerate(states):
        last = i == len(states) - 1
        store.save(rid, state, step=f"s{i}", status=status if last else None)
    if not states:
        store.update_run(rid, status=status)


def _fleet(store: Store) -> _Fleet:
    states: dict[str, list[dict[str, Any]]] = {}
    old: dict[RunStatus, str] = {}

    waiting = store.create_run("onboarding", run_id="old-waiting").run_id
    states[waiting] = [{"doc": _SHARED, "n": 0}]
    _save_all(store, waiting, states[waiting], RunStatus.WAITING)
    old[RunStatus.WAITING] = waiting
    shared = blob_hashes(store.engine)
    assert len(shared) == 1

    completed = store.create_run(
        "onboarding",
        run_id="old-completed",
        handoff=Handoff(goal="onboard", done=("a", "b"), next=(), ruled_out=("c",)),
    ).run_id
    states[completed] = [
        {"doc": _SHARED, "n": 0, "log": ["start"]},
        {"doc": _SHARED, "own": _OWN, "n": 1, "log": ["start", "finish"], "set": {1, 2}},
    ]
    _save_all(store, completed, states[completed], RunStatus.COMPLETED)
    old[RunStatus.COMPLETED] = completed
    own = blob_hashes(store.engine) - shared
    assert len(own) == 1

    for status in (RunStatus.FAILED, RunStatus.RUNNING):
        rid = store.create_run("onboarding", run_id=f"old-{status.value}").run_id
        states[rid] = [{"n": 0}, {"n": 1, "error": None}]
        _save_all(store, rid, states[rid], status)
        old[status] = rid
    cancelled = store.create_run("onboarding", run_id="old-cancelled").run_id
    states[cancelled] = []
    _save_all(store, cancelled, [], RunStatus.CANCELLED)
    old[RunStatus.CANCELLED] = cancelled

    last_old = max(store.get_run(rid).updated_at for rid in old.values())
    time.sleep(0.05)
    recent = store.create_run("onboarding", run_id="recent-completed").run_id
    states[recent] = [{"n": 0}]
    _save_all(store, recent, states[recent], RunStatus.COMPLETED)
    first_recent = store.get_run(recent).updated_at
    assert last_old < first_recent
    return _Fleet(
        old=old,
        recent_completed=recent,
        states=states,
        cutoff=(last_old + first_recent) / 2,
        own_blob=own.pop(),
        shared_blob=shared.pop(),
    )


def _assert_intact(store: Store, fleet: _Fleet, rid: str) -> None:
    states = fleet.states[rid]
    assert store.get_run(rid).run_id == rid
    assert len(store.history(rid)) == len(states)
    for i, state in enumerate(states):
        assert strict_equal(store.load(rid, i).state, state)


def test_retention_deletes_only_finished_runs_older_than_the_policy(
    store: Store, tmp_path: Path
) -> None:
    fleet = _fleet(store)
    archive = tmp_path / "archive.jsonl"
    policy = RetentionPolicy(older_than_s=3600, archive_path=str(archive))
    blobs_before = blob_count(store.engine)

    report = store.apply_retention(policy, now=fleet.cutoff + 3600)

    finished = [fleet.old[s] for s in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)]
    assert report.runs_deleted == 3
    assert report.runs_archived == 3
    for rid in finished:
        with pytest.raises(RunNotFound):
            store.get_run(rid)
        with pytest.raises(RunNotFound):
            store.load(rid)
        with pytest.raises(RunNotFound):
            store.history(rid)
    for rid in (fleet.old[RunStatus.WAITING], fleet.old[RunStatus.RUNNING], fleet.recent_completed):
        _assert_intact(store, fleet, rid)
    assert sorted(r.run_id for r in store.list_runs()) == sorted(
        [fleet.old[RunStatus.WAITING], fleet.old[RunStatus.RUNNING], fleet.recent_completed]
    )

    # the blob only the deleted run used is collected; the shared one survives
    hashes = blob_hashes(store.engine)
    assert fleet.own_blob not in hashes
    assert fleet.shared_blob in hashes
    assert report.blobs_collected >= 1
    assert blob_count(store.engine) == blobs_before - report.blobs_collected

    # a second pass finds nothing more to do
    again = store.apply_retention(policy, now=fleet.cutoff + 3600)
    assert (again.runs_deleted, again.runs_archived, again.blobs_collected) == (0, 0, 0)
    assert len(archive.read_text(encoding="utf-8").splitlines()) == 3


def test_the_archive_has_run_record_state_and_history(store: Store, tmp_path: Path) -> None:
    fleet = _fleet(store)
    archive = tmp_path / "archive.jsonl"
    completed = fleet.old[RunStatus.COMPLETED]
    history = store.history(completed)
    run = store.get_run(completed)
    store.apply_retention(
        RetentionPolicy(older_than_s=60, archive_path=str(archive)), now=fleet.cutoff + 60
    )
    records = {
        rec["run"]["run_id"]: rec
        for rec in (json.loads(line) for line in archive.read_text(encoding="utf-8").splitlines())
    }
    assert set(records) == {
        fleet.old[RunStatus.COMPLETED],
        fleet.old[RunStatus.FAILED],
        fleet.old[RunStatus.CANCELLED],
    }
    rec = records[completed]
    assert rec["run"]["flow"] == "onboarding"
    assert rec["run"]["status"] == "completed"
    assert rec["run"]["state_version"] == run.state_version
    assert rec["run"]["handoff"] == {
        "goal": "onboard",
        "done": ["a", "b"],
        "next": [],
        "ruled_out": ["c"],
    }
    # the state is canonical codec JSON: it decodes back to exactly the latest state
    state_bytes = json.dumps(rec["state"], ensure_ascii=False).encode("utf-8")
    assert strict_equal(store.codec.decode(state_bytes), fleet.states[completed][-1])
    assert [(h["seq"], h["step"], h["source"]) for h in rec["history"]] == [
        (h.seq, h.step, h.source.value) for h in history
    ]
    cancelled = records[fleet.old[RunStatus.CANCELLED]]
    assert cancelled["state"] is None
    assert cancelled["history"] == []
    failed = records[fleet.old[RunStatus.FAILED]]
    assert failed["state"] == {"n": 1, "error": None}
    assert [h["seq"] for h in failed["history"]] == [0, 1]


def test_live_runs_are_never_deleted(store: Store) -> None:
    fleet = _fleet(store)
    report = store.apply_retention(RetentionPolicy(older_than_s=0), now=time.time() + 10**6)
    assert report.runs_deleted == 4  # completed, failed, cancelled, recent completed
    remaining = {r.run_id: r.status for r in store.list_runs()}
    assert remaining == {
        fleet.old[RunStatus.WAITING]: RunStatus.WAITING,
        fleet.old[RunStatus.RUNNING]: RunStatus.RUNNING,
    }
    _assert_intact(store, fleet, fleet.old[RunStatus.WAITING])
    _assert_intact(store, fleet, fleet.old[RunStatus.RUNNING])
    assert fleet.shared_blob in blob_hashes(store.engine)


def test_retention_respects_the_statuses_it_is_given(store: Store) -> None:
    fleet = _fleet(store)
    report = store.apply_retention(
        RetentionPolicy(older_than_s=10, statuses=(RunStatus.FAILED,)), now=fleet.cutoff + 10
    )
    assert report.runs_deleted == 1
    assert report.runs_archived == 0
    with pytest.raises(RunNotFound):
        store.get_run(fleet.old[RunStatus.FAILED])
    _assert_intact(store, fleet, fleet.old[RunStatus.COMPLETED])
    assert fleet.own_blob in blob_hashes(store.engine)


def test_runs_updated_after_the_cutoff_are_kept(store: Store) -> None:
    fleet = _fleet(store)
    completed = fleet.old[RunStatus.COMPLETED]
    store.update_run(completed, next_step=None)  # touched again: now recent
    report = store.apply_retention(RetentionPolicy(older_than_s=10), now=fleet.cutoff + 10)
    assert report.runs_deleted == 2
    _assert_intact(store, fleet, completed)
    assert fleet.own_blob in blob_hashes(store.engine)


def test_collect_garbage_keeps_every_referenced_blob(store: Store) -> None:
    fleet = _fleet(store)
    before = blob_hashes(store.engine)
    assert store.collect_garbage() == 0
    assert blob_hashes(store.engine) == before
    for rid in fleet.states:
        if fleet.states[rid]:
            _assert_intact(store, fleet, rid)


def test_retention_policy_refuses_live_statuses_and_negative_ages() -> None:
    with pytest.raises(ConfigurationError):
        RetentionPolicy(older_than_s=1, statuses=(RunStatus.COMPLETED, RunStatus.WAITING))
    with pytest.raises(ConfigurationError):
        RetentionPolicy(older_than_s=1, statuses=(RunStatus.RUNNING,))
    with pytest.raises(ConfigurationError):
        RetentionPolicy(older_than_s=-1)
