"""Before a deploy: the runs new code would strand (issue [11]). A run that is not over
names the steps it goes to next; code lacking one cannot drive it past that point.
Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import logging

import pytest

from onceonly.checkpoint import RunStatus, Store
from onceonly.cli import _report_stranded
from onceonly.context import StepContext
from onceonly.deploy import stranded
from onceonly.flow import Flow, Transition
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Env


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def _orders(*, without: str = "", deadline: bool = True) -> Flow:
    """ask (an approval: then ship, on rejection refund, on expiry remind) -> ship; a
    deadline's path ``late``; ``without`` leaves one step out (a rename in a deploy)."""
    flow = Flow("orders", deadline_s=3600 if deadline else None, on_deadline="late")

    def ask(ctx: StepContext) -> Transition:
        if ctx.state.get("broken"):
            raise RuntimeError("broken")
        return ctx.wait_for_approval(
            "ok", 1, then="ship", expires_in=60, on_reject="refund", on_expire="remind"
        )

    def end(ctx: StepContext) -> Transition:
        return ctx.end()

    steps = {"ask": ask, "ship": end, "refund": end, "remind": end, "late": end}
    for name, fn in steps.items():
        if name != without:
            flow.step(name=name, start=name == "ask")(fn)
    if without == "late":
        flow.on_deadline = None
    return flow


def test_a_deploy_that_renames_a_path_of_a_waiting_run_is_reported(env: Env) -> None:
    rt = env.runtime(_orders())
    waiting = rt.start("orders", started_by="alice", run_id="w1")
    rt.drive(waiting)
    rt.start("orders", run_id="r1")  # not driven: its next step is "ask"
    failed = rt.start("orders", {"broken": True}, run_id="f1")
    assert rt.drive(failed).status is RunStatus.FAILED
    done = rt.start("orders", run_id="d1")
    rt.drive(done)
    env.operator.reject(done, "ok", actor="bob")
    assert rt.drive(done).status is RunStatus.COMPLETED
    other = Flow("other")  # runs of flows the code does not have are not its business
    other.step(name="x")(lambda ctx: ctx.end())

    assert stranded(env.store, [_orders(), other]) == []
    for missing, where in [
        ("refund", {"w1": "on rejection of wait 'ok'"}),
        ("remind", {"w1": "on expiry of wait 'ok'"}),
        ("ship", {"w1": "next step"}),  # a waiting run's next step is the one after
        ("ask", {"r1": "next step", "f1": "next step"}),  # a failed run: a retry's step
    ]:
        found = stranded(env.store, [_orders(without=missing)])
        assert {s.run_id: s.where for s in found} == where, missing
        assert {s.step for s in found} == {missing}
    found = stranded(env.store, [_orders(without="ask")])
    assert {s.run_id: s.status for s in found} == {
        "r1": RunStatus.RUNNING,
        "f1": RunStatus.FAILED,
    }


def test_a_deadline_path_the_code_lacks_is_reported(env: Env) -> None:
    rt = env.runtime(_orders())
    rid = rt.start("orders", started_by="alice")
    rt.drive(rid)
    # a deploy that drops the deadline's step (and the flow's on_deadline with it)
    [s] = stranded(env.store, [_orders(without="late")])
    assert (s.run_id, s.step, s.where) == (rid, "late", "on its deadline")


def test_a_workers_start_checks_the_next_steps_only(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    rt = env.runtime(_orders())
    waiting = rt.start("orders", started_by="alice", run_id="w1")
    rt.drive(waiting)
    rt.start("orders", run_id="r1")
    assert [s.run_id for s in stranded(env.store, [_orders(without="refund")], deep=False)] == []
    with caplog.at_level(logging.WARNING, logger="onceonly.worker"):
        _report_stranded(env.store, [_orders(without="ask")])
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "run_stranded"]
    assert "run r1 (orders, running) names step 'ask' as its next step" in line.getMessage()
