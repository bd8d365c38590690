"""Durability modes (sync, async, exit), the flush barrier, background write errors, and
crash safety under SIGKILL with real processes."""

from __future__ import annotations

import contextlib
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from onceonly.checkpoint import (
    AsyncWriteError,
    CheckpointLost,
    ConcurrentWrite,
    Durability,
    Store,
)
from tests.checkpoint_worker import KEYFRAMES, model_state
from tests.dbutil import execute, stored_bytes
from tests.values import strict_equal

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def open_store(db_url: str) -> Iterator[Callable[..., Store]]:
    """Open stores on the test's database; each is closed (errors ignored) afterwards."""
    opened: list[Store] = []

    def factory(**kwargs: Any) -> Store:
        s = Store.open(db_url, **kwargs)
        opened.append(s)
        return s

    yield factory
    for s in opened:
        with contextlib.suppress(AsyncWriteError):
            s.close()


def _small(i: int) -> dict[str, Any]:
    return {"n": i, "log": list(range(i)), "d": {f"k{j % 7}": j for j in range(i)}}


# -- async --------------------------------------------------------------------------------


def test_async_saves_are_durable_after_flush(open_store: Callable[..., Store]) -> None:
    writer = open_store(durability=Durability.ASYNC)
    rid = writer.create_run("flow").run_id
    infos = [writer.save(rid, _small(i), step=f"s{i}") for i in range(300)]
    assert [i.seq for i in infos] == list(range(300))
    writer.flush()
    reader = open_store()
    assert reader.get_run(rid).head_seq == 299
    assert [h.seq for h in reader.history(rid)] == list(range(300))
    assert reader.load(rid).state == _small(299)
    for i in range(0, 300, 13):
        assert reader.load(rid, i).state == _small(i)


def test_flush_is_a_barrier_every_time(open_store: Callable[..., Store]) -> None:
    writer = open_store(durability="async")
    reader = open_store()
    rid = writer.create_run("flow").run_id
    seq = -1
    for round_ in range(15):
        for _ in range(round_ % 4 + 1):
            seq += 1
            writer.save(rid, _small(seq), step=str(seq))
        writer.flush()
        snap = reader.load(rid)
        assert snap.info.seq == seq
        assert snap.state == _small(seq)


def test_async_close_flushes(open_store: Callable[..., Store], db_url: str) -> None:
    writer = Store.open(db_url, durability="async")
    rid = writer.create_run("flow").run_id
    for i in range(100):
        writer.save(rid, _small(i), step=str(i))
    writer.close()
    assert open_store().load(rid).state == _small(99)


def _conflict(writer: Store, other: Store) -> str:
    """A run whose head ``other`` advanced behind ``writer``'s back."""
    rid = writer.create_run("flow").run_id
    writer.save(rid, {"v": "a0"}, step="a0")
    writer.flush()
    assert other.load(rid).state == {"v": "a0"}
    other.save(rid, {"v": "other"}, step="other")
    return rid


def test_an_async_lost_race_surfaces_once_to_its_own_run(
    open_store: Callable[..., Store],
) -> None:
    writer = open_store(durability="async")
    other = open_store()
    rid = _conflict(writer, other)
    writer.save(rid, {"v": "lost"}, step="a1")  # queued; its write will conflict
    writer.flush()
    writer.list_runs()  # nothing else is failed by it
    with pytest.raises(CheckpointLost) as lost:
        writer.load(rid)
    assert lost.value.run_id == rid
    # surfaced once; the store goes on from what is durable
    assert writer.get_run(rid).head_seq == 1
    assert writer.load(rid).state == {"v": "other"}
    assert writer.save(rid, {"v": "a2"}, step="a2").seq == 2
    writer.flush()
    assert [h.step for h in other.history(rid)] == ["a0", "other", "a2"]
    assert other.load(rid).state == {"v": "a2"}


@pytest.mark.parametrize("via", ["load", "load_run"])
def test_a_lost_race_read_past_is_taken_and_not_reported_again(
    open_store: Callable[..., Store], via: str
) -> None:
    """``report_lost=False`` (the runtime's and the operator's reads) takes the report
    and reads the head that stands; the report is not given to a later load either."""
    writer = open_store(durability="async")
    other = open_store()
    rid = _conflict(writer, other)
    writer.save(rid, {"v": "lost"}, step="a1")  # queued; its write will conflict
    writer.flush()
    if via == "load":
        snap = writer.load(rid, report_lost=False)
    else:
        run, got = writer.load_run(rid, report_lost=False)
        assert got is not None
        assert run.head_seq == got.info.seq == 1
        snap = got
    assert snap.state == {"v": "other"}
    assert snap.info.seq == 1
    assert writer.load(rid).state == {"v": "other"}  # no report left for this one
    assert writer.save(rid, {"v": "a2"}, step="a2").seq == 2
    writer.close()  # nor for close
    assert [h.step for h in other.history(rid)] == ["a0", "other", "a2"]


@contextlib.contextmanager
def _writes_blocked(db_url: str) -> Iterator[None]:
    """Hold the database's write lock (SQLite) or the checkpoint table's (PostgreSQL)
    from another connection, so writers queue up behind it until the block ends."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        lite = sqlite3.connect(str(url.database), isolation_level=None)
        lite.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            lite.rollback()
            lite.close()
        return
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("LOCK TABLE oo_checkpoints IN EXCLUSIVE MODE")
            yield
            conn.rollback()
    finally:
        engine.dispose()


def test_checkpoints_queued_after_a_failed_write_are_not_written(
    db_url: str, open_store: Callable[..., Store]
) -> None:
    """A writer keeps saving while its first queued checkpoint conflicts. The error
    surfaces once, and nothing it queued after the failed checkpoint is written or
    attempted later: each of those is a delta on top of the lost checkpoint, and one
    that lands on the other writer's head would mix the two runs' states. Whether the
    background writer catches up with the error before the caller sees it is up to the
    scheduler, so the scenario is repeated."""
    writer = open_store(durability="async")
    other = open_store()
    for _ in range(6):
        rid = _conflict(writer, other)
        with _writes_blocked(db_url):
            writer.save(rid, {"v": "late 0"}, step="late-0")  # will conflict
            time.sleep(0.05)  # the background writer has taken it and waits for the lock
            for i in range(1, 50):
                writer.save(rid, {"v": f"late {i}"}, step=f"late-{i}")
        surfaced = False
        for i in range(50, 400):
            try:
                writer.save(rid, {"v": f"late {i}"}, step=f"late-{i}")
            except CheckpointLost:
                surfaced = True
                break
        writer.flush()
        if not surfaced:
            with pytest.raises(CheckpointLost):
                writer.load(rid)
        writer.flush()  # reported once: nothing queued before it fails later
        assert [h.step for h in other.history(rid)] == ["a0", "other"]
        assert other.load(rid).state == {"v": "other"}
        assert writer.load(rid).state == {"v": "other"}


def test_an_async_checkpoint_of_a_vanished_run_is_lost_and_said(
    open_store: Callable[..., Store],
) -> None:
    writer = open_store(durability="async")
    rid = writer.create_run("flow").run_id
    writer.save(rid, {"v": 0}, step="0")
    writer.flush()
    execute(writer.engine, "DELETE FROM oo_checkpoints WHERE run_id = :r", r=rid)
    execute(writer.engine, "DELETE FROM oo_runs WHERE run_id = :r", r=rid)
    writer.save(rid, {"v": 1}, step="1")
    writer.flush()
    with pytest.raises(CheckpointLost):
        writer.save(rid, {"v": 2}, step="2")
    assert open_store().list_runs() == []


def test_an_unreported_lost_checkpoint_surfaces_on_close(
    open_store: Callable[..., Store], db_url: str
) -> None:
    writer = Store.open(db_url, durability="async")
    other = open_store()
    rid = _conflict(writer, other)
    writer.save(rid, {"v": "lost"}, step="a1")
    with pytest.raises(CheckpointLost):
        writer.close()
    with pytest.raises(Exception, match="closed"):
        writer.get_run(rid)
    assert other.load(rid).state == {"v": "other"}


# -- exit ---------------------------------------------------------------------------------


def test_exit_mode_writes_nothing_until_flush(open_store: Callable[..., Store]) -> None:
    writer = open_store(durability=Durability.EXIT)
    reader = open_store()
    rid = writer.create_run("flow", next_step="s0").run_id
    before = stored_bytes(reader.engine)
    for i in range(5):
        writer.save(rid, _small(i), step=f"s{i}", next_step=f"s{i + 1}")
    assert stored_bytes(reader.engine) == before
    assert reader.history(rid) == []
    run = reader.get_run(rid)
    assert (run.head_seq, run.next_step) == (None, "s0")
    writer.flush()
    assert [h.seq for h in reader.history(rid)] == [0, 1, 2, 3, 4]
    run = reader.get_run(rid)
    assert (run.head_seq, run.next_step) == (4, "s5")
    for i in range(5):
        assert reader.load(rid, i).state == _small(i)
    writer.save(rid, _small(5), step="s5")
    writer.save(rid, _small(6), step="s6")
    assert reader.get_run(rid).head_seq == 4
    writer.close()
    assert reader.load(rid).state == _small(6)


def test_exit_mode_flush_conflict_leaves_out_only_that_run(
    open_store: Callable[..., Store],
) -> None:
    writer = open_store(durability="exit")
    other = open_store()
    rid = writer.create_run("flow").run_id
    bystander = writer.create_run("flow").run_id
    writer.save(rid, {"v": 0}, step="0")
    writer.save(bystander, {"b": 0}, step="b0")
    writer.flush()
    other.load(rid)
    writer.save(rid, {"v": 1}, step="w1")
    writer.save(bystander, {"b": 1}, step="b1")
    writer.save(rid, {"v": 2}, step="w2")
    other.save(rid, {"v": "other"}, step="o1")
    writer.flush()  # a lost race of one run never fails the barrier for the others
    assert [h.step for h in other.history(rid)] == ["0", "o1"]
    assert other.load(bystander).state == {"b": 1}
    with pytest.raises(CheckpointLost) as lost:
        writer.load(rid)
    assert lost.value.expected_seq == 0
    assert writer.load(rid).state == {"v": "other"}  # said once; then the durable head
    writer.save(rid, {"v": 3}, step="w3")
    writer.flush()
    assert [h.step for h in other.history(rid)] == ["0", "o1", "w3"]


def test_async_conflict_of_one_run_spares_the_group_commit(
    open_store: Callable[..., Store],
) -> None:
    """A queued checkpoint that loses a race fails only itself: the other runs'
    checkpoints and the transactions sharing its group commit still commit."""
    writer = open_store(durability="async")
    other = open_store()
    rid = writer.create_run("flow").run_id
    bystander = writer.create_run("flow").run_id
    writer.save(rid, {"v": 0}, step="0")
    writer.save(bystander, {"b": 0}, step="b0")
    writer.flush()
    other.load(rid)
    other.save(rid, {"v": "other"}, step="o1")  # the race is lost before it is run
    writer.save(rid, {"v": 1}, step="w1")
    writer.save(bystander, {"b": 1}, step="b1")

    def work(cur: Any) -> str:
        cur.execute("SELECT 1")
        return "committed"

    assert writer.transact(work) == "committed"
    assert other.load(bystander).state == {"b": 1}
    assert [h.step for h in other.history(rid)] == ["0", "o1"]
    with pytest.raises(CheckpointLost):
        writer.save(rid, {"v": 2}, step="w2")
    writer.save(rid, {"v": 2}, step="w2")
    writer.flush()
    assert other.load(rid).state == {"v": 2}


def _table(store: Store) -> None:
    store.transact(lambda cur: cur.execute("CREATE TABLE IF NOT EXISTS t_together (v TEXT)"))


def _rows(store: Store) -> list[str]:
    def read(cur: Any) -> list[str]:
        cur.execute("SELECT v FROM t_together ORDER BY v")
        return [str(r[0]) for r in cur.fetchall()]

    return store.read(read)


@pytest.mark.parametrize("store_mode", ["exit", "sync", "async"])
def test_exit_mode_transact_together_commits_all_or_nothing(
    open_store: Callable[..., Store], store_mode: str
) -> None:
    """``transact(fn, together=[run])``: the run's waiting checkpoints and ``fn``'s
    statements commit together or not at all (without ``together``, a failing ``fn``
    leaves the checkpoints committed); a bystander run's waiting checkpoint is written
    on its own, and commits whatever ``fn`` does; after a failure the run's next save
    builds on its stored head. On a store of any mode, for checkpoints saved with
    ``durability="exit"`` (an ``async`` store, its writer running, refused it)."""
    store = open_store(durability=store_mode)
    reader = open_store()
    _table(store)
    q = store.param
    if store_mode == "async":  # the background writer runs, with a write of its own
        busy = store.create_run("flow").run_id
        store.save(busy, {"a": 0}, step="a0")

    class _Exit:
        """The store, its saves queued for the next transaction."""

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def save(self, *args: Any, **kwargs: Any) -> Any:
            return store.save(*args, durability="exit", **kwargs)

    writer: Any = _Exit()
    rid = writer.create_run("flow").run_id
    bystander = writer.create_run("flow").run_id
    writer.save(rid, {"v": 0}, step="0")
    writer.save(bystander, {"b": 0}, step="b0")
    writer.flush()

    def fails(cur: Any) -> None:
        cur.execute(f"INSERT INTO t_together (v) VALUES ({q})", ("failed",))
        raise RuntimeError("fn failed")

    writer.save(rid, {"v": 1}, step="1")
    writer.save(bystander, {"b": 1}, step="b1")
    with pytest.raises(RuntimeError, match="fn failed"):
        writer.transact(fails, together=[rid])
    assert [h.step for h in reader.history(rid)] == ["0"]
    assert reader.load(bystander).state == {"b": 1}  # written first, on its own
    assert _rows(reader) == []
    assert writer.load(rid).state == {"v": 0}

    writer.save(rid, {"v": 2}, step="2")
    writer.transact(
        lambda cur: cur.execute(f"INSERT INTO t_together (v) VALUES ({q})", ("ok",)),
        together=[rid],
    )
    assert [h.step for h in reader.history(rid)] == ["0", "2"]
    assert reader.load(rid).state == {"v": 2}
    assert _rows(reader) == ["ok"]

    # Control: without together, the checkpoint commits although fn failed.
    writer.save(rid, {"v": 3}, step="3")
    with pytest.raises(RuntimeError, match="fn failed"):
        writer.transact(fails)
    assert [h.step for h in reader.history(rid)] == ["0", "2", "3"]
    assert _rows(reader) == ["ok"]


def test_exit_mode_transact_together_raises_a_lost_race_and_commits_nothing(
    open_store: Callable[..., Store],
) -> None:
    writer = open_store(durability="exit")
    other = open_store()
    _table(writer)
    q = writer.param
    rid = writer.create_run("flow").run_id
    writer.save(rid, {"v": 0}, step="0")
    writer.flush()
    other.load(rid)
    other.save(rid, {"v": "other"}, step="o1")
    writer.save(rid, {"v": 1}, step="w1")
    with pytest.raises(ConcurrentWrite):
        writer.transact(
            lambda cur: cur.execute(f"INSERT INTO t_together (v) VALUES ({q})", ("w",)),
            together=[rid],
        )
    assert [h.step for h in other.history(rid)] == ["0", "o1"]
    assert _rows(other) == []
    assert writer.load(rid).state == {"v": "other"}  # the stored head, nothing to report
    writer.save(rid, {"v": 2}, step="w2")
    writer.transact(lambda cur: None, together=[rid])
    assert [h.step for h in other.history(rid)] == ["0", "o1", "w2"]


def test_transact_together_with_nothing_waiting_joins_an_async_group_commit(
    open_store: Callable[..., Store],
) -> None:
    """Nothing of ``together`` waits: ``fn`` commits with the async writer's group
    commit (it used to be refused), durable when ``transact`` returns."""
    writer = open_store(durability="async")
    reader = open_store()
    _table(writer)
    q = writer.param
    rid = writer.create_run("flow").run_id
    writer.save(rid, {"v": 0}, step="0")  # async: the writer's
    writer.transact(
        lambda cur: cur.execute(f"INSERT INTO t_together (v) VALUES ({q})", ("joined",)),
        together=[rid],
    )
    assert _rows(reader) == ["joined"]
    assert reader.load(rid).state == {"v": 0}  # queued before: in that commit or earlier


# -- real processes -------------------------------------------------------------------------


def _worker(db_url: str, run_id: str, durability: str, steps: int, every: int) -> Any:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.checkpoint_worker",
            db_url,
            run_id,
            durability,
            str(steps),
            str(every),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def _assert_run_is_a_model_prefix(store: Store, run_id: str, *, every: int = 1) -> int:
    history = store.history(run_id)
    assert [h.seq for h in history] == list(range(len(history)))
    for h in history[::every] + history[-1:]:
        assert h.step == f"step-{h.seq}"
        assert h.seq - h.keyframe_seq <= KEYFRAMES.max_deltas
        assert strict_equal(store.load(run_id, h.seq).state, model_state(h.seq)), h.seq
    latest = store.load(run_id)
    assert strict_equal(latest.state, model_state(latest.info.seq))
    return latest.info.seq


@pytest.mark.slow
def test_sigkill_in_async_mode_leaves_a_loadable_prefix(db_url: str) -> None:
    rng = random.Random(20261130)
    run_id = "crash-run"
    durable = -1
    for _ in range(3):
        proc = _worker(db_url, run_id, "async", 1_000_000, 25)
        assert proc.stdout is not None
        try:
            ready = proc.stdout.readline().split()
            assert ready[:1] == ["ready"]
            assert ready[2] == "ok"  # it resumed from the model's state
            # resumes after what was found durable (on PostgreSQL a COMMIT the killed
            # worker had already sent may still land after that check, never before)
            assert int(ready[1]) >= durable + 1
            time.sleep(rng.uniform(0.2, 0.8))
            proc.send_signal(signal.SIGKILL)
            out = proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL
        flushed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("flushed")]
        with Store.open(db_url) as store:
            latest = _assert_run_is_a_model_prefix(store, run_id, every=7)
        assert latest >= max(flushed, default=durable)  # every flushed checkpoint survived
        assert latest >= durable
        durable = latest
    assert durable > 0
    with Store.open(db_url) as store:
        _assert_run_is_a_model_prefix(store, run_id)


@pytest.mark.slow
def test_two_processes_writing_different_runs_at_once(db_url: str) -> None:
    Store.open(db_url).close()  # the schema exists (concurrent creation is tested apart)
    procs = [
        _worker(db_url, "proc-a", "sync", 120, 0),
        _worker(db_url, "proc-b", "async", 120, 10),
    ]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0]
    assert all(out.splitlines()[-1] == "done" for out in outputs)
    with Store.open(db_url) as store:
        for run_id in ("proc-a", "proc-b"):
            assert _assert_run_is_a_model_prefix(store, run_id) == 119
