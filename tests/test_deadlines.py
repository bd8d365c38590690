"""Time limits (issue [11]): a step's timeout, a run's deadline, and waits that expire
onto a path of their own (remind, escalate, take it as a rejection) instead of failing.

Time is the runtime's clock (a settable :class:`Clock`): a step "takes long" by
advancing it, so nothing here depends on how fast the machine is. The oracle for
effects is the provider's raw deliveries. Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import pytest

from onceonly.checkpoint import (
    ConfigurationError,
    RunStatus,
    Store,
    WaitRefused,
    Waits,
    WaitStatus,
)
from onceonly.context import StepContext
from onceonly.flow import Flow, StepRetry, Transition
from onceonly.ledger import RunFenced
from onceonly.runtime import DEADLINE_WAIT, Runtime
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Env, approve


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def _slow(env: Env, *, seconds: float, **limit: Any) -> Flow:
    """``work`` sends, then takes ``seconds`` (on the runtime's clock), then sends
    again; ``done`` ends the run."""
    flow = Flow("slow")

    @flow.step(start=True, **limit)
    def work(ctx: StepContext) -> Transition:
        ctx.state["touched"] = True  # dropped if the attempt runs out of time
        env.send(ctx, "first@1", ctx.visit)
        env.clock.advance(seconds)
        env.send(ctx, "second@1", ctx.visit)
        return ctx.next("done")

    @flow.step
    def done(ctx: StepContext) -> Transition:
        return ctx.end("done")

    return flow


def test_a_step_within_its_timeout_runs_as_usual(env: Env) -> None:
    rt = env.runtime(_slow(env, seconds=5, timeout_s=10))
    rid = rt.start("slow")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == [0, 0]
    assert env.state(rid)["result"] == "done"


def test_a_step_past_its_timeout_claims_nothing_more_and_fails_the_run(env: Env) -> None:
    rt = env.runtime(_slow(env, seconds=11, timeout_s=10))
    rid = rt.start("slow")
    run = rt.drive(rid)
    assert run.status is RunStatus.FAILED
    assert env.provider.sent("first@1") == [0]
    assert env.provider.sent("second@1") == []  # refused before it was sent
    error = env.meta(rid)["error"]
    assert (error["step"], error["type"]) == ("work", "StepTimedOut")
    assert "timeout of 10 s" in error["message"]
    assert "touched" not in env.state(rid)


def test_a_step_that_returns_after_its_timeout_is_dropped_and_takes_its_path(env: Env) -> None:
    flow = Flow("late-return")

    @flow.step(start=True, timeout_s=10, on_timeout="fallback")
    def work(ctx: StepContext) -> Transition:
        env.send(ctx, "first@1", "x")
        ctx.state["touched"] = True
        env.clock.advance(30)  # no claim after this: it just returns late
        return ctx.end("too late")

    @flow.step
    def fallback(ctx: StepContext) -> Transition:
        env.send(ctx, "fallback@1", "y")
        return ctx.end("fallback")

    rt = env.runtime(flow)
    rid = rt.start("late-return")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "fallback"
    assert "touched" not in env.state(rid)
    assert env.provider.sent() == ["x", "y"]
    meta = env.meta(rid)
    assert meta["last_error"]["type"] == "StepTimedOut"
    assert meta["visits"] == {"fallback": 1}  # the timed-out visit is not counted


def test_a_step_that_catches_the_refusal_is_still_timed_out(env: Env) -> None:
    flow = Flow("catches")

    @flow.step(start=True, timeout_s=10)
    def work(ctx: StepContext) -> Transition:
        env.clock.advance(11)
        try:
            env.send(ctx, "first@1", "x")
        except RunFenced:
            return ctx.end("pretended it went fine")
        return ctx.end("sent")

    rt = env.runtime(flow)
    rid = rt.start("catches")
    assert rt.drive(rid).status is RunStatus.FAILED
    assert env.provider.deliveries == []
    assert env.meta(rid)["error"]["type"] == "StepTimedOut"


def test_a_timed_out_attempt_is_retried_and_its_effects_replay(env: Env) -> None:
    slow = [31.0, 0.0]
    flow = Flow("retried")

    @flow.step(start=True, timeout_s=30, retry=StepRetry(attempts=2, backoff_s=5))
    def work(ctx: StepContext) -> Transition:
        env.send(ctx, "first@1", "x")
        env.clock.advance(slow.pop(0))
        env.send(ctx, "second@1", "y")
        return ctx.end("done")

    rt = env.runtime(flow)
    rid = rt.start("retried")
    assert rt.drive(rid).status is RunStatus.WAITING  # attempt 1 timed out: a timer
    meta = env.meta(rid)
    assert (meta["retry"]["failed"], meta["last_error"]["type"]) == (1, "StepTimedOut")
    env.clock.advance(5)
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["x", "y"]  # "x" replayed in attempt 2


def test_the_last_timed_out_attempt_takes_the_timeout_path(env: Env) -> None:
    flow = Flow("gives-up")

    @flow.step(start=True, timeout_s=30, on_timeout="late", retry=StepRetry(attempts=2))
    def work(ctx: StepContext) -> Transition:
        env.clock.advance(31)
        return ctx.end("never")

    @flow.step
    def late(ctx: StepContext) -> Transition:
        return ctx.end("late")

    rt = env.runtime(flow)
    rid = rt.start("gives-up")
    assert rt.drive(rid).status is RunStatus.WAITING
    env.clock.advance(1)
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "late"
    assert env.meta(rid)["last_error"]["attempt"] == 2


# -- a run's deadline ------------------------------------------------------------------


def _waits_for_approval(env: Env, **flow_args: Any) -> Flow:
    flow = Flow("review", **flow_args)

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval("ok", {"doc": 1}, then="publish")

    @flow.step
    def publish(ctx: StepContext) -> Transition:
        env.send(ctx, "publish@1", "doc")
        return ctx.end("published")

    @flow.step
    def too_late(ctx: StepContext) -> Transition:
        env.send(ctx, "apologise@1", "doc")
        return ctx.end("too late")

    return flow


@pytest.mark.parametrize("path", ["step", "fail"])
def test_a_waiting_run_leaves_its_wait_at_its_deadline(env: Env, path: str) -> None:
    on = {"on_deadline": "too_late"} if path == "step" else {}
    rt = env.runtime(_waits_for_approval(env, deadline_s=3600, **on))
    rid = rt.start("review", started_by="alice")
    assert rt.drive(rid).status is RunStatus.WAITING
    ready = Waits(env.store, clock=env.clock)
    env.clock.advance(3599)
    assert ready.claim_ready("w", 30) == []
    env.clock.advance(1)
    assert ready.claim_ready("rt", 30) == [rid]  # the deadline timer makes it due
    run = rt.drive(rid)
    waits = {w.name: w.status for w in env.operator.show(rid).waits}
    assert waits == {DEADLINE_WAIT: WaitStatus.FIRED, "ok": WaitStatus.CANCELLED}
    with pytest.raises(WaitRefused):  # nobody decides what the run no longer waits for
        approve(env, rid, "ok")
    if path == "step":
        assert run.status is RunStatus.COMPLETED
        assert env.provider.sent() == ["doc"]
        assert [e for e, _, _ in env.provider.deliveries] == ["apologise@1"]
        assert env.meta(rid)["last_error"]["type"] == "DeadlineExceeded"
    else:
        assert run.status is RunStatus.FAILED
        assert env.provider.deliveries == []
        assert env.meta(rid)["error"]["type"] == "DeadlineExceeded"
    assert ready.claim_ready("rt", 30) == []  # nothing left to wake it


def test_a_run_deadline_stops_a_running_step_and_the_next_one(env: Env) -> None:
    flow = Flow("busy", deadline_s=100, on_deadline="wrap_up")

    @flow.step(start=True)
    def tick(ctx: StepContext) -> Transition:
        env.send(ctx, "tick@1", ctx.visit)
        env.clock.advance(40)
        return ctx.next("tick")

    @flow.step
    def wrap_up(ctx: StepContext) -> Transition:
        env.send(ctx, "wrap@1", "bye")
        return ctx.end(ctx.visit)

    rt = env.runtime(flow)
    rid = rt.start("busy")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    # ticks at 0, 40, 80; the third ended past 100 (dropped, its tick stays sent); the
    # deadline path then runs (its own time limit is gone: it is the way out)
    assert env.provider.sent("tick@1") == [0, 1, 2]
    assert env.provider.sent("wrap@1") == ["bye"]
    assert env.meta(rid)["visits"]["tick"] == 2
    assert env.meta(rid)["deadline"]["passed"] is True


def test_a_deadline_given_at_start_overrides_the_flows(env: Env) -> None:
    rt = env.runtime(_waits_for_approval(env, deadline_s=3600))
    rid = rt.start("review", started_by="alice", deadline_s=60)
    rt.drive(rid)
    env.clock.advance(61)
    assert rt.drive(rid).status is RunStatus.FAILED


def test_a_run_that_ends_before_its_deadline_closes_its_timer(env: Env) -> None:
    rt = env.runtime(_waits_for_approval(env, deadline_s=3600))
    rid = rt.start("review", started_by="alice")
    rt.drive(rid)
    approve(env, rid, "ok")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    waits = {w.name: w.status for w in env.operator.show(rid).waits}
    assert waits[DEADLINE_WAIT] is WaitStatus.CANCELLED
    env.clock.advance(7200)
    assert Waits(env.store, clock=env.clock).claim_ready("rt", 30) == []
    assert env.provider.sent() == ["doc"]


def test_a_deadline_survives_a_restart_of_the_process(env: Env) -> None:
    rt = env.runtime(_waits_for_approval(env, deadline_s=3600, on_deadline="too_late"))
    rid = rt.start("review", started_by="alice")
    rt.drive(rid)
    env.clock.advance(3600)
    flow = _waits_for_approval(env, deadline_s=3600, on_deadline="too_late")
    again = env.runtime(flow, fresh=True)
    assert again.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "too late"


# -- waits that expire onto a path -----------------------------------------------------


def _chaser(env: Env, kind: str, reminders: int = 2) -> Flow:
    """Asks (an approval or a signal) for an hour; on expiry sends a reminder and asks
    again, ``reminders`` times, then escalates to a manager's approval."""
    flow = Flow("chaser")

    def ask_for(ctx: StepContext) -> Transition:
        if kind == "approval":
            return ctx.wait_for_approval(
                "ok", {"po": 7}, then="order", expires_in=3600, on_expire="remind"
            )
        return ctx.wait_for_signal("ok", then="order", expires_in=3600, on_expire="remind")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ask_for(ctx)

    @flow.step
    def remind(ctx: StepContext) -> Transition:
        assert ctx.wait_outcome("ok") == "expired"
        if ctx.visit < reminders:
            env.send(ctx, "remind@1", ctx.visit)  # once per expiry, however often re-run
            return ask_for(ctx)
        return ctx.wait_for_approval(
            "escalated", {"po": 7}, then="order", requested_by="alice", on_reject="dropped"
        )

    @flow.step
    def order(ctx: StepContext) -> Transition:
        env.send(ctx, "order@1", ctx.wait_outcome("ok"))
        return ctx.end("ordered")

    @flow.step
    def dropped(ctx: StepContext) -> Transition:
        return ctx.end("dropped")

    return flow


@pytest.mark.parametrize("kind", ["approval", "signal"])
def test_an_expiring_wait_reminds_and_asks_again(env: Env, kind: str) -> None:
    rt = env.runtime(_chaser(env, kind))
    rid = rt.start("chaser", started_by="alice")
    assert rt.drive(rid).status is RunStatus.WAITING
    env.clock.advance(3600)
    assert rt.drive(rid).status is RunStatus.WAITING  # reminded, asking again
    assert rt.drive(rid).status is RunStatus.WAITING  # driving again sends nothing more
    assert env.provider.sent("remind@1") == [0]
    if kind == "approval":
        approve(env, rid, "ok")
    else:
        env.operator.signal(rid, "ok", {"yes": True}, actor="portal")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent("order@1") == ["approved" if kind == "approval" else "delivered"]


@pytest.mark.parametrize("kind", ["approval", "signal"])
def test_a_wait_that_keeps_expiring_escalates(env: Env, kind: str) -> None:
    rt = env.runtime(_chaser(env, kind, reminders=1))
    rid = rt.start("chaser", started_by="alice")
    rt.drive(rid)
    for _ in range(2):
        env.clock.advance(3600)
        rt.drive(rid)
    assert env.provider.sent("remind@1") == [0]
    [esc] = [w for w in env.operator.show(rid).waits if w.name == "escalated"]
    assert esc.status is WaitStatus.OPEN
    env.operator.reject(rid, "escalated", actor="manager", reason="not needed")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "dropped"
    assert env.provider.sent("order@1") == []


def test_a_signal_past_its_wait_is_kept_for_the_next_wait(env: Env) -> None:
    rt = env.runtime(_chaser(env, "signal"))
    rid = rt.start("chaser")
    rt.drive(rid)
    env.clock.advance(3600)
    # it comes before any worker saw the wait expire: the wait expires, the signal waits
    env.operator.signal(rid, "ok", {"yes": True}, actor="portal")
    assert rt.drive(rid).status is RunStatus.COMPLETED  # the reminder's wait took it
    assert env.provider.sent("remind@1") == [0]
    assert env.provider.sent("order@1") == ["delivered"]


def test_a_signal_wait_without_an_expiry_path_fails_on_expiry(env: Env) -> None:
    flow = Flow("strict")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_signal("docs", then="done", expires_in=60)

    @flow.step
    def done(ctx: StepContext) -> Transition:
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("strict")
    rt.drive(rid)
    env.clock.advance(60)
    assert rt.drive(rid).status is RunStatus.FAILED
    assert env.meta(rid)["error"]["step"] == "wait:docs"


def test_an_expiry_can_be_taken_as_a_rejection(env: Env) -> None:
    flow = Flow("silence-is-no")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval(
            "ok", 1, then="go", expires_in=60, on_reject="no", on_expire="no"
        )

    @flow.step
    def go(ctx: StepContext) -> Transition:
        return ctx.end("go")

    @flow.step
    def no(ctx: StepContext) -> Transition:
        return ctx.end(ctx.wait_outcome("ok"))

    rt = env.runtime(flow)
    rid = rt.start("silence-is-no", started_by="alice")
    rt.drive(rid)
    env.clock.advance(60)
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "expired"


# -- refused configurations ------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "10", True])
def test_a_malformed_time_limit_is_refused(bad: Any) -> None:
    flow = Flow("f")
    with pytest.raises(ConfigurationError, match="timeout_s"):
        flow.step(timeout_s=bad)
    with pytest.raises(ConfigurationError, match="deadline_s"):
        Flow("g", deadline_s=bad)


def test_a_path_that_names_no_step_is_refused_before_any_run(env: Env) -> None:
    flow = Flow("f", deadline_s=10, on_deadline="nowhere")

    @flow.step
    def a(ctx: StepContext) -> Transition:
        return ctx.end()

    with pytest.raises(ConfigurationError, match="on_deadline"):
        env.runtime(flow)
    other = Flow("g")
    with pytest.raises(ConfigurationError, match="on_timeout= needs timeout_s"):
        other.step(on_timeout="a")
    timed = Flow("h")

    @timed.step(timeout_s=5, on_timeout="missing")
    def b(ctx: StepContext) -> Transition:
        return ctx.end()

    with pytest.raises(ConfigurationError, match="on_timeout"):
        Runtime(env.store, env.ledger, [timed])


# -- operator actions keep the time a run has -------------------------------------------


def test_a_restart_gets_the_whole_time_again_and_a_fork_the_time_left(env: Env) -> None:
    rt = env.runtime(_waits_for_approval(env, deadline_s=3600, on_deadline="too_late"))
    rid = rt.start("review", started_by="alice")
    rt.drive(rid)  # waiting for "ok"; checkpoint 1 was written at t0
    env.clock.advance(3000)  # 600 s left
    fork = env.operator.fork(rid, 1, actor="ops", reason="ask again", new_run_id="f1")
    restart = env.operator.restart(rid, actor="ops", reason="wrong plan", new_run_id="r1")
    # checkpoint 1 was written with the whole hour left; the restart starts the hour again
    assert env.meta(fork)["deadline"]["at"] == pytest.approx(env.clock.now + 3600, abs=5)
    assert env.meta(restart)["deadline"]["at"] == pytest.approx(env.clock.now + 3600, abs=5)
    rt.drive(restart)
    ready = Waits(env.store, clock=env.clock)
    env.clock.advance(3600)
    assert set(ready.claim_ready("rt", 30, limit=5)) == {fork, restart}  # their own timers
    for new in (fork, restart):
        assert rt.drive(new).status is RunStatus.COMPLETED
        assert env.state(new)["result"] == "too late"


def test_a_failed_run_retried_by_an_operator_keeps_its_deadline(env: Env) -> None:
    broken = [True]
    flow = Flow("fragile", deadline_s=3600, on_deadline="too_late")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        if broken:
            raise RuntimeError("a bug, fixed by the next deploy")
        return ctx.wait_for_approval("ok", {"doc": 1}, then="too_late")

    @flow.step
    def too_late(ctx: StepContext) -> Transition:
        env.send(ctx, "apologise@1", "doc")
        return ctx.end("too late")

    rt = env.runtime(flow)
    rid = rt.start("fragile", started_by="alice")
    assert rt.drive(rid).status is RunStatus.FAILED
    broken.clear()
    env.operator.retry(rid, actor="ops", reason="fixed")
    assert rt.drive(rid).status is RunStatus.WAITING
    env.clock.advance(3600)
    assert Waits(env.store, clock=env.clock).claim_ready("rt", 30) == [rid]  # its timer
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["doc"]
