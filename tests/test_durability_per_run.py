"""Durability chosen per run (issue [11]): runs of every mode share one store and one
runtime, each checkpoint becomes durable as its run's mode says, and in every mode the
checkpoint a step is built on is durable before the step's first effect is claimed.

"Durable" is judged by another process: a fresh :class:`Store` on the same database,
which sees only what was committed. Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from onceonly.adapters import guard
from onceonly.checkpoint import ConfigurationError, Durability, RunStatus, Store, failpoints
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.runtime import Runtime
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Env

MODES = ("sync", "async", "exit")


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def _durable_head(db_url: str, run_id: str) -> int | None:
    """The run's head as another process sees it: what is committed."""
    with Store.open(db_url) as other:
        return other.get_run(run_id).head_seq


def _probing(env: Env, db_url: str, seen: dict[str, list[Any]], **flow_args: Any) -> Flow:
    """``prepare`` changes the state (no effect); ``act`` notes the committed head
    before its effect and when the provider receives it."""
    flow = Flow("probe", **flow_args)

    @flow.step(start=True)
    def prepare(ctx: StepContext) -> Transition:
        ctx.state["prepared"] = True
        return ctx.next("act")

    @flow.step
    def act(ctx: StepContext) -> Transition:
        rid = ctx.run_id
        seen[rid].append(_durable_head(db_url, rid))

        def deliver(p: Any) -> Any:
            seen[rid].append(_durable_head(db_url, rid))
            return env.provider.send("act@1", p)

        guard(ctx.ledger, effect="act@1")(deliver)(rid)
        return ctx.end("acted")

    return flow


def test_each_run_keeps_its_own_mode_and_every_mode_is_durable_before_an_effect(
    env: Env, db_url: str
) -> None:
    seen: dict[str, list[Any]] = {}
    rt = env.runtime(_probing(env, db_url, seen))
    ids = {mode: rt.start("probe", run_id=f"r-{mode}", durability=mode) for mode in MODES}
    for rid in ids.values():
        seen[rid] = []
        assert _durable_head(db_url, rid) == 0  # a run's start is durable in every mode
    for rid in ids.values():
        assert rt.drive(rid).status is RunStatus.COMPLETED
    # before the effect: "prepare"'s checkpoint (1) is committed in sync mode, still
    # queued in exit mode (the store's own mode is sync: the run's mode was used)
    assert seen["r-sync"][0] == 1
    assert seen["r-exit"][0] == 0
    # when the provider receives the effect, it is committed in every mode
    assert [seen[r][1] for r in ids.values()] == [1, 1, 1]
    assert env.provider.sent() == list(ids.values())
    for mode, rid in ids.items():
        assert env.meta(rid)["durability"] == mode
        assert _durable_head(db_url, rid) == 2  # drive flushed what the run queued


def test_a_flows_mode_is_its_runs_default(env: Env, db_url: str) -> None:
    seen: dict[str, list[Any]] = {"r1": [], "r2": []}
    rt = env.runtime(_probing(env, db_url, seen, durability="exit"))
    rt.start("probe", run_id="r1")
    rt.start("probe", run_id="r2", durability="sync")
    for rid in ("r1", "r2"):
        rt.drive(rid)
    assert (seen["r1"][0], seen["r2"][0]) == (0, 1)
    assert env.meta("r1")["durability"] == "exit"


def test_without_a_mode_a_run_follows_the_store(env: Env, db_url: str) -> None:
    seen: dict[str, list[Any]] = {"r1": []}
    with Store.open(db_url, durability="exit") as store:
        ledger = env.ledgers.on(store, owner="w9")
        rt = Runtime(store, ledger, [_probing(env, db_url, seen)], owner="w9")
        rt.start("probe", run_id="r1")
        assert rt.drive("r1").status is RunStatus.COMPLETED
        ledger.close()
    assert seen["r1"] == [0, 1]
    assert "durability" not in env.meta("r1")


def test_an_operator_edit_of_a_queued_run_in_the_same_process_keeps_the_order(
    env: Env, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync checkpoint (an operator's edit) of a run whose async checkpoints are still
    queued in this process: the queued ones are written first, and the edit builds on
    them."""
    flow = Flow("two")

    @flow.step(start=True)
    def one(ctx: StepContext) -> Transition:
        ctx.state["n"] = 1
        return ctx.next("two")  # not a suspension: its checkpoint is not flushed

    @flow.step
    def two(ctx: StepContext) -> Transition:
        return ctx.wait_for_signal("go", then="three")

    @flow.step
    def three(ctx: StepContext) -> Transition:
        return ctx.end(ctx.state["n"])

    rt = env.runtime(flow)
    # The writer thread is held before it commits until the edit asks for a barrier, so
    # "one"'s async checkpoint is still queued when the edit is built (not written first
    # by a fast writer thread, which would leave the flush-first path untried).
    gate = threading.Event()

    def hold_writer(name: str) -> None:
        if name == "checkpoint.commit.before" and threading.current_thread().name == (
            "onceonly-checkpoint-writer"
        ):
            assert gate.wait(60), "the edit never asked for the queued checkpoint"

    barriers: list[str] = []

    def opening(real: Any, what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            barriers.append(what)
            gate.set()
            return real(*args, **kwargs)

        return call

    store = env.store
    monkeypatch.setattr(store, "flush", opening(store.flush, "flush"))
    monkeypatch.setattr(store, "transact", opening(store.transact, "transact"))
    for mode in ("async", "exit"):
        rid = rt.start("two", run_id=f"q-{mode}", durability=mode)
        gate.clear()
        barriers.clear()
        with failpoints.armed(hold_writer):
            rt.step_once(rid)  # "one"'s checkpoint queued (no drive: nothing flushed it)
            assert _durable_head(db_url, rid) == 0, barriers
            env.operator.edit(rid, "n", 5, actor="ops", reason="fix")
        assert barriers  # the edit wrote the queued checkpoint first
        env.operator.signal(rid, "go", actor="portal")
        assert rt.drive(rid).status is RunStatus.COMPLETED
        assert env.state(rid)["result"] == 5
        assert [s.step for s in env.store.history(rid)][:3] == ["start", "one", "operator:edit"]


@pytest.mark.parametrize("bad", ["fast", "SYNC ", 3])
def test_an_unknown_mode_is_refused(env: Env, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="durability"):
        Flow("f", durability=bad)
    flow = Flow("g")

    @flow.step
    def a(ctx: StepContext) -> Transition:
        return ctx.end()

    rt = env.runtime(flow)
    with pytest.raises(ConfigurationError, match="durability"):
        rt.start("g", durability=bad)
    with pytest.raises(ConfigurationError, match="durability"):
        env.store.save("nope", {}, step="x", durability=bad)


def test_a_restart_and_a_fork_keep_the_runs_mode(env: Env) -> None:
    flow = Flow("w")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_signal("go", then="done")

    @flow.step
    def done(ctx: StepContext) -> Transition:
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("w", durability=Durability.ASYNC)
    rt.drive(rid)
    fork = env.operator.fork(rid, 1, actor="ops", reason="again")
    restart = env.operator.restart(rid, actor="ops", reason="wrong plan")
    assert env.meta(fork)["durability"] == env.meta(restart)["durability"] == "async"
