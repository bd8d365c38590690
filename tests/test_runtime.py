"""The runtime in one process: steps, resumes, divergence, waits, operator actions.

The oracle for effects is :class:`Provider`, an in-process fake that logs every raw
delivery; the ledger is never asked what happened. A "crash" inside a step is an
exception the runtime does not catch (:class:`Crash`, a ``BaseException``): the step's
checkpoint is never written, exactly as when the process dies there. "Another process"
is a fresh :class:`Store` and :class:`Ledger` on the same database (no shared caches).
Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from onceonly.adapters import current_claim, guard
from onceonly.checkpoint import (
    ConfigurationError,
    Handoff,
    RunStatus,
    Source,
    StateMigrations,
    Store,
    Wait,
    WaitKind,
    WaitRefused,
    Waits,
    WaitStatus,
)
from onceonly.context import BranchContext, StepContext
from onceonly.errors import RunNotResumable
from onceonly.flow import Flow, StepRetry, Transition
from onceonly.ledger import EffectIdentity, EffectStatus
from onceonly.operator import Operator
from onceonly.runtime import META, Runtime
from tests.ledger_support import Clock, Ledgers


class Crash(BaseException):
    """The process dies here: nothing after it runs, nothing catches it."""


@dataclass
class Provider:
    """A fake provider: ``deliveries`` is every raw request, in order.

    ``ambiguous`` names effects whose next request is applied and then answered with a
    timeout (the answer is lost); ``lost`` names effects whose next request times out
    before it is applied.
    """

    deliveries: list[tuple[str, str, Any]] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    def send(self, effect: str, payload: Any) -> dict[str, Any]:
        if effect in self.lost:
            self.lost.remove(effect)
            raise TimeoutError("connect timeout")
        key = current_claim().provider_key
        self.deliveries.append((effect, key, payload))
        receipt = {"id": len(self.deliveries), "payload": payload}
        if effect in self.ambiguous:
            self.ambiguous.remove(effect)
            raise TimeoutError("read timeout")
        return receipt

    def sent(self, effect: str | None = None) -> list[Any]:
        return [p for e, _, p in self.deliveries if effect is None or e == effect]


class Env:
    """A store, its ledger, an operator and the provider, with a settable clock."""

    def __init__(self, store: Store, ledgers: Ledgers, clock: Clock) -> None:
        self.store = store
        self.ledgers = ledgers
        self.clock = clock
        self.ledger = ledgers.on(store, owner="w1")
        self.provider = Provider()
        self.operator = Operator(store, self.ledger, clock=clock)

    def runtime(self, *flows: Flow, fresh: bool = False) -> Runtime:
        """A runtime; ``fresh``: in "another process" (same worker name)."""
        ledger = self.ledgers.fresh(owner="w1") if fresh else self.ledger
        return Runtime(ledger.store, ledger, flows, owner="rt", clock=self.clock)

    def send(self, ctx: StepContext | BranchContext, effect: str, payload: Any) -> Any:
        """Perform ``effect`` once (class C: nobody can tell whether a lost one happened)."""
        fn = guard(ctx.ledger, effect=effect)(lambda p: self.provider.send(effect, p))
        return fn(payload)

    def state(self, run_id: str) -> dict[str, Any]:
        return self.operator.show(run_id).state

    def meta(self, run_id: str) -> dict[str, Any]:
        return self.operator.show(run_id).meta


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def approve(env: Env, run_id: str, name: str, actor: str = "bob") -> None:
    wait = [w for w in env.operator.show(run_id).waits if w.name == name][-1]  # the latest
    assert wait.subject_hash is not None
    env.operator.approve(run_id, name, actor=actor, subject_hash=wait.subject_hash)


# -- steps and resumes -------------------------------------------------------------------


def test_a_multi_step_flow_completes_and_each_effect_happens_once(env: Env) -> None:
    flow = Flow("order")

    @flow.step(start=True)
    def reserve(ctx: StepContext) -> Transition:
        ctx.state["reservation"] = env.send(ctx, "reserve@1", {"sku": ctx.state["sku"]})["id"]
        return ctx.next("notify")

    @flow.step
    def notify(ctx: StepContext) -> Transition:
        for to in ("a@x", "b@x"):
            env.send(ctx, "email@1", {"to": to})
        return ctx.next("charge")

    @flow.step
    def charge(ctx: StepContext) -> Transition:
        env.send(ctx, "charge@1", {"amount": 10})
        return ctx.end({"reservation": ctx.state["reservation"]})

    rt = env.runtime(flow)
    rid = rt.start("order", {"sku": "X1"}, run_id="order-1")
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.COMPLETED, None)
    assert [e for e, _, _ in env.provider.deliveries] == [
        "reserve@1",
        "email@1",
        "email@1",
        "charge@1",
    ]
    assert len({k for _, k, _ in env.provider.deliveries}) == 4
    assert env.state(rid)["result"] == {"reservation": 1}
    assert env.meta(rid)["visits"] == {"reserve": 1, "notify": 1, "charge": 1}
    assert [c.step for c in env.store.history(rid)] == ["start", "reserve", "notify", "charge"]
    assert rt.drive(rid).status is RunStatus.COMPLETED  # nothing more to do
    assert len(env.provider.deliveries) == 4


def test_each_visit_of_a_looping_step_acts_again(env: Env) -> None:
    flow = Flow("poll")

    @flow.step(start=True)
    def ping(ctx: StepContext) -> Transition:
        env.send(ctx, "ping@1", {"n": 1})  # the same arguments on every pass
        ctx.state["n"] = ctx.state.get("n", 0) + 1
        return ctx.next("ping") if ctx.state["n"] < 3 else ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("poll")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert len(env.provider.deliveries) == 3
    assert len({k for _, k, _ in env.provider.deliveries}) == 3


def test_a_step_that_raises_after_an_effect_fails_and_a_retry_replays_it(env: Env) -> None:
    flow = Flow("flaky")
    failures = [RuntimeError("upstream 500")]

    @flow.step(start=True)
    def work(ctx: StepContext) -> Transition:
        ctx.state["log"].append("working")  # in place: must not survive a failed attempt
        ctx.state["receipt"] = env.send(ctx, "send@1", "hello")
        if failures:
            raise failures.pop()
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("flaky", {"log": []})
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.FAILED, "work")
    error = env.meta(rid)["error"]
    assert (error["step"], error["type"], error["message"]) == (
        "work",
        "RuntimeError",
        "upstream 500",
    )
    assert env.state(rid)["log"] == []
    assert "receipt" not in env.state(rid)

    env.operator.retry(rid, actor="ops", reason="upstream fixed")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["hello"]
    assert env.state(rid)["log"] == ["working"]
    assert env.state(rid)["receipt"] == {"id": 1, "payload": "hello"}
    assert env.meta(rid)["error"] is None


def _flaky(env: Env, failures: list[BaseException], retry: StepRetry) -> Flow:
    """A step that sends, changes the state in place, then raises the next of
    ``failures`` (until there are none)."""
    flow = Flow("flaky")

    @flow.step(start=True, retry=retry)
    def work(ctx: StepContext) -> Transition:
        ctx.state["log"].append("working")  # in place: must not survive a failed attempt
        ctx.state["receipt"] = env.send(ctx, "send@1", "hello")
        if failures:
            raise failures.pop(0)
        return ctx.next("done")

    @flow.step
    def done(ctx: StepContext) -> Transition:
        env.send(ctx, "done@1", "bye")
        return ctx.end()

    return flow


def test_a_flaky_step_is_retried_on_a_timer_and_its_effects_replay(env: Env) -> None:
    failures: list[BaseException] = [TimeoutError("upstream slow"), ConnectionError("reset")]
    retry = StepRetry(attempts=3, backoff_s=10, multiplier=3, on=(OSError,))
    rt = env.runtime(_flaky(env, failures, retry))
    rid = rt.start("flaky", {"log": []})
    assert rt.drive(rid).status is RunStatus.WAITING  # attempt 1 failed: a timer, no process
    meta = env.meta(rid)
    assert meta["retry"] == {
        "step": "work",
        "visit": 0,
        "failed": 1,
        "attempts": 3,
        "due_at": env.clock.now + 10,
        "wait": "retry.work.0.1",
    }
    last = meta["last_error"]
    assert (last["type"], last["message"], last["attempt"]) == ("TimeoutError", "upstream slow", 1)
    assert "in work" in last["traceback"]
    assert "TimeoutError: upstream slow" in last["traceback"]
    assert meta.get("error") is None
    assert env.state(rid)["log"] == []
    assert "receipt" not in env.state(rid)

    env.clock.advance(9.9)
    assert rt.drive(rid).status is RunStatus.WAITING  # not due yet: nothing runs
    assert env.provider.sent() == ["hello"]
    env.clock.advance(0.1)
    assert rt.drive(rid).status is RunStatus.WAITING  # attempt 2 failed: 30 s this time
    assert env.meta(rid)["retry"]["due_at"] == env.clock.now + 30
    assert env.meta(rid)["last_error"]["type"] == "ConnectionError"
    env.clock.advance(30)
    assert rt.drive(rid).status is RunStatus.COMPLETED  # attempt 3 succeeded
    assert env.provider.sent() == ["hello", "bye"]  # the send of attempts 1-2 replayed
    assert env.state(rid)["log"] == ["working"]
    meta = env.meta(rid)
    assert "retry" not in meta
    assert "last_error" not in meta
    assert meta["attempts"] == {}
    assert [meta["waits"][w]["status"] for w in ("retry.work.0.1", "retry.work.0.2")] == [
        "fired",
        "fired",
    ]


def test_the_last_attempt_fails_the_run_with_its_traceback(env: Env) -> None:
    failures: list[BaseException] = [RuntimeError(f"down {i}") for i in range(5)]
    rt = env.runtime(_flaky(env, failures, StepRetry(attempts=2, backoff_s=1)))
    rid = rt.start("flaky", {"log": []})
    assert rt.drive(rid).status is RunStatus.WAITING
    env.clock.advance(1)
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.FAILED, "work")
    error = env.meta(rid)["error"]
    assert (error["type"], error["message"], error["attempt"]) == ("RuntimeError", "down 1", 2)
    assert "RuntimeError: down 1" in error["traceback"]
    assert "retry" not in env.meta(rid)
    # an operator's retry gives the step a fresh set of attempts
    env.operator.retry(rid, actor="ops", reason="upstream back")
    assert rt.drive(rid).status is RunStatus.WAITING
    assert env.meta(rid)["retry"]["failed"] == 1
    assert env.provider.sent() == ["hello"]


@pytest.mark.parametrize("why", ["not listed", "ctx.fail"])
def test_only_the_errors_a_policy_lists_are_retried(env: Env, why: str) -> None:
    flow = Flow("picky")

    @flow.step(start=True, retry=StepRetry(attempts=5, on=(TimeoutError,)))
    def work(ctx: StepContext) -> Transition:
        if why == "ctx.fail":
            return ctx.fail("the input is wrong")
        raise ValueError("a bug, not a flake")

    rt = env.runtime(flow)
    rid = rt.start("picky")
    assert rt.drive(rid).status is RunStatus.FAILED
    assert "retry" not in env.meta(rid)


@pytest.mark.parametrize(
    "bad",
    [
        {"attempts": 0},
        {"backoff_s": -1},
        {"multiplier": 0.5},
        {"backoff_s": 10, "max_backoff_s": 5},
        {"on": ()},
        {"on": (int,)},
        {"on": [TimeoutError]},
    ],
)
def test_a_malformed_retry_policy_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="StepRetry"):
        StepRetry(**bad)


def test_a_step_takes_only_a_retry_policy() -> None:
    flow = Flow("typed")
    with pytest.raises(ConfigurationError, match="StepRetry"):
        flow.step(retry=3)  # type: ignore[call-overload]


def test_a_step_that_crashes_half_way_is_rerun_and_its_effects_replay(env: Env) -> None:
    crash = [True]

    def flow() -> Flow:
        f = Flow("twice")

        @f.step(start=True)
        def both(ctx: StepContext) -> Transition:
            ctx.state["items"].append("seen")
            first = env.send(ctx, "send@1", "one")
            if crash:
                crash.pop()
                raise Crash
            second = env.send(ctx, "send@1", "two")
            ctx.state["ids"] = [first["id"], second["id"]]
            return ctx.end()

        return f

    rid = env.runtime(flow()).start("twice", {"items": []})
    with pytest.raises(Crash):
        env.runtime(flow()).drive(rid)
    assert env.store.get_run(rid).status is RunStatus.RUNNING  # nothing checkpointed
    run = env.runtime(flow(), fresh=True).drive(rid)  # a new process picks it up
    assert run.status is RunStatus.COMPLETED
    assert env.provider.sent() == ["one", "two"]
    assert env.state(rid)["ids"] == [1, 2]
    assert env.state(rid)["items"] == ["seen"]


def _divergent(variant: str, env: Env) -> Callable[[StepContext], None]:
    def renamed(ctx: StepContext) -> None:
        env.send(ctx, "send@2", "one")

    def reordered(ctx: StepContext) -> None:
        env.send(ctx, "other@1", "two")
        env.send(ctx, "send@1", "one")

    def removed(ctx: StepContext) -> None:
        env.send(ctx, "other@1", "two")  # send@1 is gone

    def dropped(ctx: StepContext) -> None:
        pass  # asks for nothing at all

    def added_before(ctx: StepContext) -> None:
        env.send(ctx, "audit@1", "zero")
        env.send(ctx, "send@1", "one")
        env.send(ctx, "other@1", "two")

    def args_changed(ctx: StepContext) -> None:
        env.send(ctx, "send@1", "ONE")
        env.send(ctx, "other@1", "two")

    return {
        "renamed": renamed,
        "reordered": reordered,
        "removed": removed,
        "dropped": dropped,
        "added_before": added_before,
        "args_changed": args_changed,
    }[variant]


@pytest.mark.parametrize(
    ("variant", "error"),
    [
        ("renamed", "StepDiverged"),
        ("reordered", "StepDiverged"),
        ("removed", "StepDiverged"),
        ("dropped", "StepDiverged"),
        ("added_before", "StepDiverged"),
        ("args_changed", "KeyReuseError"),
    ],
)
def test_a_resumed_step_whose_code_changed_fails_before_acting(
    env: Env, variant: str, error: str
) -> None:
    old = Flow("pay", version="1")

    @old.step(start=True)
    def act(ctx: StepContext) -> Transition:
        env.send(ctx, "send@1", "one")
        env.send(ctx, "other@1", "two")
        raise Crash  # dies before its checkpoint

    rid = env.runtime(old).start("pay")
    with pytest.raises(Crash):
        env.runtime(old).drive(rid)
    assert len(env.provider.deliveries) == 2

    new = Flow("pay", version="2", serves=("1",))  # a deploy that drives the old runs
    change = _divergent(variant, env)

    @new.step(start=True, name="act")
    def act2(ctx: StepContext) -> Transition:
        change(ctx)
        return ctx.end()

    run = env.runtime(new, fresh=True).drive(rid)
    assert run.status is RunStatus.FAILED
    assert env.meta(rid)["error"]["type"] == error
    assert env.meta(rid)["error"]["step"] == "act"
    assert len(env.provider.deliveries) == 2  # nothing more reached the provider
    assert env.runtime(new).drive(rid).status is RunStatus.FAILED  # and stays failed


def test_the_same_code_resumes_where_the_changed_code_diverged(env: Env) -> None:
    """A control for the divergence test: unchanged code passes the same checks."""
    crash = [True]
    flow = Flow("pay")

    @flow.step(start=True)
    def act(ctx: StepContext) -> Transition:
        env.send(ctx, "send@1", "one")
        env.send(ctx, "other@1", "two")
        if crash:
            crash.pop()
            raise Crash
        env.send(ctx, "third@1", "three")
        return ctx.end()

    rid = env.runtime(flow).start("pay")
    with pytest.raises(Crash):
        env.runtime(flow).drive(rid)
    assert env.runtime(flow, fresh=True).drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["one", "two", "three"]


def test_recorded_reads_are_asked_once_across_a_resume(env: Env) -> None:
    asked: list[str] = []
    crash = [True]
    flow = Flow("llm")

    def complete(prompt: str) -> str:
        asked.append(prompt)
        return f"answer #{len(asked)} to {prompt}"

    @flow.step(start=True)
    def think(ctx: StepContext) -> Transition:
        answer = ctx.recorded("llm@1", complete, "plan the trip")
        if crash:
            crash.pop()
            raise Crash
        ctx.state["answer"] = answer
        return ctx.end()

    rid = env.runtime(flow).start("llm")
    with pytest.raises(Crash):
        env.runtime(flow).drive(rid)
    assert env.runtime(flow, fresh=True).drive(rid).status is RunStatus.COMPLETED
    assert asked == ["plan the trip"]
    assert env.state(rid)["answer"] == "answer #1 to plan the trip"


def test_a_resume_reruns_only_the_branch_that_failed(env: Env) -> None:
    flow = Flow("fanout")
    calls: list[str] = []
    broken = [True]

    def hotel(b: BranchContext) -> int:
        calls.append("hotel")
        return int(env.send(b, "book@1", "hotel")["id"])

    def flight(b: BranchContext) -> int:
        calls.append("flight")
        if broken:
            raise ConnectionError("airline down")
        return int(env.send(b, "book@1", "flight")["id"])

    @flow.step(start=True)
    def book(ctx: StepContext) -> Transition:
        ctx.state["booked"] = ctx.parallel({"hotel": hotel, "flight": flight})
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("fanout")
    assert rt.drive(rid).status is RunStatus.FAILED
    assert env.meta(rid)["error"]["type"] == "ConnectionError"
    assert calls.count("hotel") == 1
    assert env.provider.sent() == ["hotel"]

    broken.clear()
    calls.clear()
    env.operator.retry(rid, actor="ops", reason="airline back")
    assert env.runtime(flow, fresh=True).drive(rid).status is RunStatus.COMPLETED
    assert calls == ["flight"]  # the finished branch replays its recorded output
    assert env.provider.sent() == ["hotel", "flight"]
    assert env.state(rid)["booked"] == {"hotel": 1, "flight": 2}


# -- restart on purpose -------------------------------------------------------------------


def _plan(env: Env, fail: list[bool]) -> Flow:
    flow = Flow("plan")

    @flow.step(start=True)
    def book(ctx: StepContext) -> Transition:
        ctx.state["hotel"] = env.send(ctx, "hotel@1", ctx.state["city"])
        if fail and fail.pop(0):
            return ctx.fail("the plan was wrong: wrong dates")
        return ctx.end("booked")

    return flow


def test_a_restart_starts_over_in_a_key_space_of_its_own(env: Env) -> None:
    rt = env.runtime(_plan(env, [True]))
    rid = rt.start("plan", {"city": "Oslo"}, run_id="trip", started_by="ann")
    env.operator.note(rid, Handoff(goal="book Oslo", ruled_out=("the 3rd: sold out",)))
    assert rt.drive(rid).status is RunStatus.FAILED
    new = env.operator.restart(rid, actor="ops", reason="wrong dates")
    assert new == "trip.restart-1"
    assert rt.drive(new).status is RunStatus.COMPLETED
    # the new run's effects happened again; the old run's stay recorded and visible
    assert env.provider.sent() == ["Oslo", "Oslo"]
    assert [r.status for r in env.ledger.effects(run_id=rid)] == [EffectStatus.COMMITTED]
    assert [r.status for r in env.ledger.effects(run_id=new)] == [EffectStatus.COMMITTED]
    assert env.store.get_run(rid).status is RunStatus.FAILED  # it had ended: left as it is
    old, fresh = env.meta(rid), env.meta(new)
    assert old["restarted_as"] == [new]
    assert (fresh["restarted_from"]["run"], fresh["restarted_from"]["by"]) == (rid, "ops")
    assert (fresh["key_run"], fresh["started_by"]) == (new, "ann")
    assert env.store.get_run(new).handoff.ruled_out == ("the 3rd: sold out",)
    assert env.state(new)["city"] == "Oslo"
    assert env.operator.restart(rid, actor="ops", reason="again") == "trip.restart-2"


def test_a_restart_of_a_waiting_run_cancels_it_and_asks_again(env: Env) -> None:
    rt = env.runtime(_approval_flow(env))
    rid = rt.start("invoice", {"amount": 70})
    assert rt.drive(rid).status is RunStatus.WAITING
    new = env.operator.restart(rid, actor="ops", reason="amount was wrong")
    assert env.store.get_run(rid).status is RunStatus.CANCELLED
    assert [w.status for w in env.operator.show(rid).waits] == [WaitStatus.CANCELLED]
    assert rt.drive(new).status is RunStatus.WAITING
    assert [w.status for w in env.operator.show(new).waits] == [WaitStatus.OPEN]


def test_an_interrupted_restart_is_finished_by_repeating_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = env.runtime(_plan(env, [True]))
    rid = rt.start("plan", {"city": "Rome"})
    assert rt.drive(rid).status is RunStatus.FAILED

    def crash(*_: Any) -> None:
        raise KeyboardInterrupt  # the operator's process dies after the new run exists

    with monkeypatch.context() as m:
        m.setattr(Operator, "_mark_restarted", crash)
        with pytest.raises(KeyboardInterrupt):
            env.operator.restart(rid, actor="ops", reason="wrong")
    assert env.operator.restart(rid, actor="ops", reason="wrong") == f"{rid}.restart-1"
    assert env.meta(rid)["restarted_as"] == [f"{rid}.restart-1"]
    assert [r.run_id for r in env.store.list_runs()].count(f"{rid}.restart-1") == 1


@pytest.mark.parametrize(("actor", "reason"), [("", "why"), ("ops", " ")])
def test_a_restart_needs_an_actor_and_a_reason(env: Env, actor: str, reason: str) -> None:
    rt = env.runtime(_plan(env, [True]))
    rid = rt.start("plan", {"city": "Rome"})
    with pytest.raises(ConfigurationError, match="identity and a reason"):
        env.operator.restart(rid, actor=actor, reason=reason)


# -- waits -------------------------------------------------------------------------------


def _approval_flow(env: Env, **handlers: str) -> Flow:
    flow = Flow("invoice")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval(
            "pay",
            {"amount": ctx.state["amount"]},
            then="pay",
            expires_in=3600,
            **handlers,  # type: ignore[arg-type]
        )

    @flow.step
    def pay(ctx: StepContext) -> Transition:
        ctx.approved("pay", {"amount": ctx.state["amount"]})
        env.send(ctx, "pay@1", ctx.state["amount"])
        return ctx.end("paid")

    @flow.step
    def rejected(ctx: StepContext) -> Transition:
        env.send(ctx, "tell@1", "rejected")
        return ctx.end("rejected")

    @flow.step
    def expired(ctx: StepContext) -> Transition:
        env.send(ctx, "tell@1", "expired")
        return ctx.end("expired")

    return flow


@pytest.mark.parametrize(
    ("decision", "handled", "status", "sent"),
    [
        ("approve", True, RunStatus.COMPLETED, ["pay@1"]),
        ("reject", True, RunStatus.COMPLETED, ["tell@1"]),
        ("reject", False, RunStatus.FAILED, []),
        ("expire", True, RunStatus.COMPLETED, ["tell@1"]),
        ("expire", False, RunStatus.FAILED, []),
    ],
)
def test_an_approval_decides_the_path(
    env: Env, decision: str, handled: bool, status: RunStatus, sent: list[str]
) -> None:
    handlers = {"on_reject": "rejected", "on_expire": "expired"} if handled else {}
    rt = env.runtime(_approval_flow(env, **handlers))
    rid = rt.start("invoice", {"amount": 120}, started_by="alice")
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.WAITING, "pay")
    [wait] = env.operator.show(rid).waits
    assert (wait.kind, wait.requested_by, wait.subject) == (
        WaitKind.APPROVAL,
        "alice",
        {"amount": 120},
    )
    assert wait.due_at == pytest.approx(env.clock() + 3600)
    assert rt.drive(rid).status is RunStatus.WAITING  # nothing decided yet
    if decision == "approve":
        with pytest.raises(WaitRefused):
            approve(env, rid, "pay", actor="alice")  # the requester may not approve
        approve(env, rid, "pay")
    elif decision == "reject":
        env.operator.reject(rid, "pay", actor="bob", reason="no budget")
    else:
        env.clock.advance(3601)
    run = rt.drive(rid)
    assert run.status is status
    assert [e for e, _, _ in env.provider.deliveries] == sent
    got = env.meta(rid)["waits"]["pay"]
    assert (
        got["status"]
        == {"approve": "approved", "reject": "rejected", "expire": "expired"}[decision]
    )
    if status is RunStatus.FAILED:
        assert env.meta(rid)["error"]["step"] == "wait:pay"


def test_a_signal_payload_reaches_the_next_step(env: Env) -> None:
    flow = Flow("kyc")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_signal("docs", then="check")

    @flow.step
    def check(ctx: StepContext) -> Transition:
        docs = ctx.signal("docs")
        env.send(ctx, "verify@1", docs)
        return ctx.wait_for_signal("extra", then="finish")

    @flow.step
    def finish(ctx: StepContext) -> Transition:
        return ctx.end([ctx.signal("docs"), ctx.signal("extra")])

    rt = env.runtime(flow)
    rid = rt.start("kyc")
    env.operator.signal(rid, "extra", {"late": False}, actor="portal")  # before it waits
    assert rt.drive(rid).status is RunStatus.WAITING
    env.operator.signal(rid, "docs", ["passport.pdf"], actor="portal")
    assert rt.drive(rid).status is RunStatus.COMPLETED  # "extra" was already there
    assert env.provider.sent() == [["passport.pdf"]]
    assert env.state(rid)["result"] == [["passport.pdf"], {"late": False}]


def test_an_approval_does_not_cover_a_changed_subject(env: Env) -> None:
    rt = env.runtime(_approval_flow(env))
    rid = rt.start("invoice", {"amount": 120}, started_by="alice")
    rt.drive(rid)
    approve(env, rid, "pay")
    env.operator.edit(rid, "amount", 9000, actor="mallory", reason="typo")
    run = rt.drive(rid)
    assert run.status is RunStatus.FAILED
    assert env.meta(rid)["error"]["type"] == "ApprovalMismatch"
    assert env.provider.deliveries == []


def test_a_timer_wakes_the_run_on_the_clock(env: Env) -> None:
    flow = Flow("remind")

    @flow.step(start=True)
    def nap(ctx: StepContext) -> Transition:
        return ctx.sleep("nap", 3600, then="ring")

    @flow.step
    def ring(ctx: StepContext) -> Transition:
        env.send(ctx, "ring@1", "wake up")
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("remind")
    assert rt.drive(rid).status is RunStatus.WAITING
    ready = Waits(env.store, clock=env.clock)
    assert ready.claim_ready("w", 30) == []
    env.clock.advance(3599)
    assert rt.drive(rid).status is RunStatus.WAITING
    assert env.provider.deliveries == []
    env.clock.advance(1)
    assert ready.claim_ready("rt", 30) == [rid]  # a worker finds it due
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["wake up"]
    assert env.meta(rid)["waits"]["nap"]["status"] == "fired"


@pytest.mark.parametrize("happened", [True, False])
def test_an_effect_in_doubt_parks_the_run_until_a_person_resolves_it(
    env: Env, happened: bool
) -> None:
    flow = Flow("wire")
    steps: list[str] = []

    @flow.step(start=True)
    def wire(ctx: StepContext) -> Transition:
        steps.append("wire")
        ctx.state["receipt"] = env.send(ctx, "wire@1", 500)
        return ctx.next("done")

    @flow.step
    def done(ctx: StepContext) -> Transition:
        return ctx.end(ctx.state["receipt"])

    (env.provider.ambiguous if happened else env.provider.lost).append("wire@1")
    rt = env.runtime(flow)
    rid = rt.start("wire")
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.WAITING, "wire")
    [effect] = env.ledger.effects(run_id=rid)
    assert effect.status is EffectStatus.NEEDS_HUMAN
    [wait] = env.operator.show(rid).waits
    assert wait.kind is WaitKind.SIGNAL
    assert wait.name.startswith(f"effect:{effect.key_id[:16]}:")
    assert rt.drive(rid).status is RunStatus.WAITING  # nothing moves it but a person
    assert steps == ["wire"]

    env.operator.resolve(
        effect.key_id,
        happened=happened,
        evidence="bank statement line 7" if happened else "not on the statement",
        actor="ops",
        result={"id": 1, "payload": 500} if happened else None,
    )
    assert env.store.get_run(rid).status is RunStatus.RUNNING
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == [500]  # applied once either way
    assert env.state(rid)["result"]["payload"] == 500
    assert steps == ["wire", "wire"]


@pytest.mark.parametrize("meanwhile", ["the worker signals", "the run is cancelled"])
def test_a_resolve_whose_wait_was_settled_meanwhile_still_records_the_decision(
    env: Env, meanwhile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Operator.resolve finds the parked run's open wait, then signals it; in between, the
    run's own worker may see the resolution and signal the wait itself, or the run may end.
    The resolve must not fail then (S3 on PostgreSQL under load: 'delivered already by
    s3-worker'): the decision is recorded, and the run goes on once."""
    flow = Flow("wire")

    @flow.step(start=True)
    def wire(ctx: StepContext) -> Transition:
        ctx.state["receipt"] = env.send(ctx, "wire@1", 500)
        return ctx.end(ctx.state["receipt"])

    env.provider.lost.append("wire@1")
    rt = env.runtime(flow)
    rid = rt.start("wire")
    assert rt.drive(rid).status is RunStatus.WAITING
    [effect] = env.ledger.effects(run_id=rid)
    find = env.operator.waits.find

    def find_then_race(**kwargs: Any) -> list[Wait]:
        found = find(**kwargs)
        for wait in found:
            if meanwhile == "the worker signals":
                env.operator.waits.signal(wait.run_id, wait.name, {"resolved": 1}, actor="w")
            else:
                env.operator.cancel(wait.run_id, actor="ops", reason="duplicate")
        return found

    monkeypatch.setattr(env.operator.waits, "find", find_then_race)
    record = env.operator.resolve(
        effect.key_id, happened=False, evidence="not on the statement", actor="ops"
    )
    assert record.status is EffectStatus.NOT_HAPPENED
    if meanwhile == "the worker signals":
        assert rt.drive(rid).status is RunStatus.COMPLETED
        assert env.provider.sent() == [500]
    else:
        assert rt.drive(rid).status is RunStatus.CANCELLED
        assert env.provider.sent() == []


def test_cancel_closes_the_waits_and_stops_the_run(env: Env) -> None:
    rt = env.runtime(_approval_flow(env))
    rid = rt.start("invoice", {"amount": 120}, started_by="alice")
    rt.drive(rid)
    run = env.operator.cancel(rid, actor="ops", reason="duplicate invoice")
    assert run.status is RunStatus.CANCELLED
    [wait] = env.operator.show(rid).waits
    assert (wait.status, wait.decided_by) == (WaitStatus.CANCELLED, "ops")
    with pytest.raises(WaitRefused):
        approve(env, rid, "pay")
    assert rt.drive(rid).status is RunStatus.CANCELLED
    assert Waits(env.store, clock=env.clock).claim_ready("w", 30) == []
    assert env.provider.deliveries == []
    assert env.meta(rid)["operator_log"][-1]["reason"] == "duplicate invoice"


def _cancelled_mid_step(env: Env, operator: Operator, durability: str | None = None) -> str:
    """A run whose first step sends, is cancelled by ``operator`` (meanwhile, elsewhere)
    and would go on to send again; driven: the cancel wins."""
    flow = Flow("long", durability=durability)

    @flow.step(start=True)
    def first(ctx: StepContext) -> Transition:
        env.send(ctx, "send@1", "first")
        operator.cancel(ctx.run_id, actor="ops", reason="stop")
        ctx.state["touched"] = True
        return ctx.next("second")

    @flow.step
    def second(ctx: StepContext) -> Transition:
        env.send(ctx, "send@1", "second")
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("long")
    assert rt.drive(rid).status is RunStatus.CANCELLED
    assert env.provider.sent() == ["first"]
    return rid


@pytest.mark.parametrize("same_store", [True, False])
def test_a_cancel_during_a_step_wins_over_the_step(env: Env, same_store: bool) -> None:
    operator = env.operator if same_store else Operator(env.ledgers.store(), env.ledger)
    rid = _cancelled_mid_step(env, operator)
    assert "touched" not in env.state(rid)


@pytest.mark.parametrize("mode", ["async", "exit"])
def test_an_operators_action_is_durable_on_return_on_a_store_of_any_mode(
    env: Env, mode: str
) -> None:
    """An operator on a store opened in ``async`` or ``exit`` mode: its action is
    written, race-checked, before it returns and before the audit chain records it. It
    was queued with the store's mode: an edit of the address the next step mails,
    reported done and recorded, was still waiting when a worker ran the step, which
    mailed the old address (and the edit then lost the race: never written)."""
    flow = Flow("mail")

    @flow.step(start=True)
    def mail(ctx: StepContext) -> Transition:
        env.send(ctx, "mail@1", ctx.state["to"])
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("mail", {"to": "old@example.com"})
    store = env.ledgers.store(durability=mode)
    # its audit records go to the runtime's store: nothing of them flushes this one
    operator = Operator(store, env.ledger)
    info = operator.edit(rid, "to", "new@example.com", actor="ops", reason="moved")
    assert [a["detail"]["action"] for a in operator.actions(rid)] == ["operator:edit"]
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["new@example.com"]
    with Store.open(env.ledgers.db_url) as fresh:
        edited = fresh.load(rid, info.seq).state
        assert edited["to"] == "new@example.com"
    assert operator.show(rid).run.status is RunStatus.COMPLETED


def test_an_operator_sharing_an_async_workers_store_reads_past_its_lost_checkpoint(
    env: Env,
) -> None:
    """A worker's ``async`` step checkpoint loses to a cancel from another console; the
    store reports the loss once, to the next load of the run. An operator sharing the
    worker's store got that report (``CheckpointLost``) from ``show`` and from its
    actions: it is the worker's, and the operator reads the head that stands."""
    console = Operator(env.ledgers.store(), env.ledger)
    rid = _cancelled_mid_step(env, console, "async")
    env.store.flush()  # the step's queued checkpoint: written or lost by now
    view = env.operator.show(rid)
    assert view.run.status is RunStatus.CANCELLED
    assert "touched" not in view.state
    info = env.operator.edit(rid, "note", "checked", actor="ops", reason="audit")
    assert env.store.load(rid).info.seq == info.seq
    assert env.provider.sent() == ["first"]


def test_a_drive_after_an_async_checkpoint_lost_to_an_operator_runs_the_step_again(
    env: Env,
) -> None:
    """An operator's edit lands while an ``async`` run's step runs: the step's queued
    checkpoint loses the race and is reported once, to the next load of the run. The
    runtime's own next drive got that report as ``CheckpointLost``; it now runs the step
    again on the edited head (its effect replays), then the next one."""
    flow = Flow("mail", durability="async")
    console = Operator(env.ledgers.store(), env.ledger)

    @flow.step(start=True)
    def first(ctx: StepContext) -> Transition:
        env.send(ctx, "mail@1", "first")
        if "note" not in ctx.state:
            console.edit(ctx.run_id, "note", "edited", actor="ops", reason="context")
        return ctx.next("second")

    @flow.step
    def second(ctx: StepContext) -> Transition:
        env.send(ctx, "mail@1", f"second {ctx.state.get('note')}")
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("mail")
    for _ in range(4):
        env.store.flush()  # the queued checkpoints: written or lost by now
        if rt.drive(rid).status is RunStatus.COMPLETED:
            break
    assert env.store.get_run(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["first", "second edited"]


def test_a_fork_replays_committed_effects_and_asks_again(env: Env) -> None:
    flow = _approval_flow(env)

    @flow.step(start=True, name="quote")
    def quote(ctx: StepContext) -> Transition:
        ctx.state["quote"] = env.send(ctx, "quote@1", ctx.state["amount"])["id"]
        return ctx.next("ask")

    rt = env.runtime(flow)
    rid = rt.start("invoice", {"amount": 120}, started_by="alice")
    assert rt.drive(rid).status is RunStatus.WAITING
    approve(env, rid, "pay")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    sent = list(env.provider.deliveries)
    assert [e for e, _, _ in sent] == ["quote@1", "pay@1"]

    history = env.store.history(rid)
    at_start = next(c.seq for c in history if c.step == "start")
    waiting = next(c.seq for c in history if c.step == "ask")
    for seq in (at_start, waiting):
        fork = env.operator.fork(rid, seq, actor="ops", reason="audit replay")
        assert fork != rid
        run = rt.drive(fork)
        assert run.status is RunStatus.WAITING  # the origin's approval does not carry over
        [wait] = env.operator.show(fork).waits
        assert (wait.status, wait.subject) == (WaitStatus.OPEN, {"amount": 120})
        approve(env, fork, "pay", actor="carol")
        assert rt.drive(fork).status is RunStatus.COMPLETED
        assert env.provider.deliveries == sent  # replayed, never re-fired
        assert env.state(fork)["quote"] == 1
        assert env.meta(fork)["forked_from"]["seq"] == seq


def _two_steps(env: Env, second: str) -> Flow:
    flow = Flow("orders")

    @flow.step(start=True)
    def reserve(ctx: StepContext) -> Transition:
        env.send(ctx, "reserve@1", ctx.state["order"])
        return ctx.next(second)

    def charge(ctx: StepContext) -> Transition:
        env.send(ctx, "charge@1", ctx.state["order"])
        return ctx.end()

    flow.step(name=second)(charge)
    return flow


def test_a_fork_after_a_deploy_renamed_its_origins_step_refuses_to_resend(env: Env) -> None:
    rt = env.runtime(_two_steps(env, "charge"))
    rid = rt.start("orders", {"order": 7})
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert [e for e, _, _ in env.provider.deliveries] == ["reserve@1", "charge@1"]
    history = env.store.history(rid)
    at_start = next(c.seq for c in history if c.step == "start")
    # A deploy renames the step that charged: its effects' keys name the old step.
    renamed = env.runtime(_two_steps(env, "charge_card"))
    fork = env.operator.fork(rid, at_start, actor="ops", reason="redo the order")
    run = renamed.drive(fork)
    assert run.status is RunStatus.FAILED
    error = env.meta(fork)["error"]
    assert error["type"] == "ForkDiverged", error
    assert "charge" in error["message"]
    assert [e for e, _, _ in env.provider.deliveries] == ["reserve@1", "charge@1"]
    # The same fork on the code that recorded them replays them.
    again = env.operator.fork(rid, at_start, actor="ops", reason="redo on the old code")
    assert rt.drive(again).status is RunStatus.COMPLETED
    assert [e for e, _, _ in env.provider.deliveries] == ["reserve@1", "charge@1"]


def _sent(env: Env) -> list[str]:
    return [e for e, _, _ in env.provider.deliveries]


def _refused(env: Env, rt: Runtime, rid: str, step: str) -> None:
    assert rt.drive(rid).status is RunStatus.FAILED
    error = env.meta(rid)["error"]
    assert error["type"] == "ForkDiverged", error
    assert step in error["message"]


def _chain(env: Env, *names: str) -> Flow:
    """Steps in a line; step i sends effect ``e{i}@1`` whatever it is called."""
    flow = Flow("orders")
    for i, name in enumerate(names):

        def fn(ctx: StepContext, i: int = i) -> Transition:
            env.send(ctx, f"e{i}@1", ctx.state["order"])
            return ctx.next(names[i + 1]) if i + 1 < len(names) else ctx.end()

        flow.step(name=name, start=i == 0)(fn)
    return flow


def test_no_run_of_a_shared_key_space_resends_after_a_rename(env: Env) -> None:
    """Found by S11's deep tier: the check looked only at a fork's own origin after the
    fork point, so a sibling fork, the origin itself and a fork of a fork re-sent what
    another run of the key space had sent at a step a deploy then renamed."""
    rt = env.runtime(_chain(env, "reserve", "pack", "charge"))
    rid = rt.start("orders", {"order": 7})
    assert rt.drive(rid, max_steps=1).next_step == "pack"  # reserved, not charged
    start = next(c.seq for c in env.store.history(rid) if c.step == "start")
    first, sibling, third = (
        env.operator.fork(rid, start, actor="ops", reason=f"try {n}") for n in (1, 2, 3)
    )
    child = env.operator.fork(first, env.store.history(first)[0].seq, actor="ops", reason="c")
    # One fork charges on the old code (the charge is keyed by the origin's key space) ...
    assert rt.drive(first).status is RunStatus.COMPLETED
    assert _sent(env) == ["e0@1", "e1@1", "e2@1"]
    # ... then a deploy renames the step; no other run of the key space charges again.
    renamed = env.runtime(_chain(env, "reserve", "pack", "charge_card"))
    for other in (sibling, rid, child):
        _refused(env, renamed, other, "charge")
    assert _sent(env) == ["e0@1", "e1@1", "e2@1"]
    # On the code that recorded the charge, another fork replays it.
    assert rt.drive(third).status is RunStatus.COMPLETED
    assert _sent(env) == ["e0@1", "e1@1", "e2@1"]


def test_a_renamed_step_a_fork_has_passed_does_not_stop_it(env: Env) -> None:
    rt = env.runtime(_chain(env, "reserve", "charge", "ship"))
    rid = rt.start("orders", {"order": 7})
    assert rt.drive(rid).status is RunStatus.COMPLETED
    after_charge = next(c.seq for c in env.store.history(rid) if c.step == "charge")
    renamed = env.runtime(_chain(env, "reserve", "charge_card", "ship"))
    fork = env.operator.fork(rid, after_charge, actor="ops", reason="ship again")
    assert renamed.drive(fork).status is RunStatus.COMPLETED
    assert _sent(env) == ["e0@1", "e1@1", "e2@1"]  # ship replayed


def test_a_failed_run_is_retried_at_the_step_that_failed(env: Env) -> None:
    flow = Flow("check")
    verdicts = ["not yet", "ok"]

    @flow.step(start=True)
    def check(ctx: StepContext) -> Transition:
        env.send(ctx, "probe@1", "p")
        verdict = verdicts.pop(0)
        if verdict != "ok":
            return ctx.fail(verdict)
        return ctx.next("finish")

    @flow.step
    def finish(ctx: StepContext) -> Transition:
        return ctx.end("ok")

    rt = env.runtime(flow)
    rid = rt.start("check")
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.FAILED, "check")
    assert env.meta(rid)["error"] == {"step": "check", "type": "Fail", "message": "not yet"}
    retried = env.operator.retry(rid, actor="ops", reason="try again")
    assert retried.status is RunStatus.RUNNING
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == ["p"]  # the same visit: its effect replays


def test_a_transition_to_a_missing_step_fails_the_run(env: Env) -> None:
    flow = Flow("typo")

    @flow.step(start=True)
    def first(ctx: StepContext) -> Transition:
        env.send(ctx, "send@1", "x")
        return ctx.next("secnod")

    rt = env.runtime(flow)
    rid = rt.start("typo")
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.FAILED, "first")
    assert env.meta(rid)["error"]["type"] == "ConfigurationError"
    assert env.meta(rid)["visits"] == {}


def test_state_saved_by_older_code_is_migrated_on_resume(env: Env) -> None:
    v1 = Flow("quote", version="1")

    @v1.step(start=True)
    def price(ctx: StepContext) -> Transition:
        ctx.state["amount"] = 12
        return ctx.sleep("cool-off", 60, then="send")

    @v1.step(name="send")
    def send_v1(ctx: StepContext) -> Transition:
        raise AssertionError("v1 never runs this")

    rid = env.runtime(v1).start("quote")
    assert env.runtime(v1).drive(rid).status is RunStatus.WAITING
    assert env.store.get_run(rid).state_version == 1

    def to_v2(state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "amount": {"value": state["amount"], "currency": "EUR"}}

    v2 = Flow(
        "quote",
        version="2",
        serves=("1",),
        migrations=StateMigrations(current=2, upgrades={1: to_v2}),
    )

    @v2.step(name="send")
    def send_v2(ctx: StepContext) -> Transition:
        env.send(ctx, "quote@1", ctx.state["amount"])
        return ctx.end()

    env.clock.advance(60)
    assert env.runtime(v2, fresh=True).drive(rid).status is RunStatus.COMPLETED
    assert env.provider.sent() == [{"value": 12, "currency": "EUR"}]
    assert env.store.get_run(rid).state_version == 2
    assert Source.MIGRATION in {c.source for c in env.store.history(rid)}
    assert env.meta(rid)["waits"]["cool-off"]["status"] == "fired"  # bookkeeping survived


def test_start_is_idempotent_by_run_id(env: Env) -> None:
    flow = Flow("once")

    @flow.step(start=True)
    def only(ctx: StepContext) -> Transition:
        return ctx.end(ctx.state["n"])

    rt = env.runtime(flow)
    assert rt.start("once", {"n": 1}, run_id="fixed") == "fixed"
    assert rt.start("once", {"n": 2}, run_id="fixed") == "fixed"
    assert env.runtime(flow, fresh=True).start("once", {"n": 3}, run_id="fixed") == "fixed"
    assert [c.step for c in env.store.history("fixed")] == ["start"]
    assert rt.drive("fixed").status is RunStatus.COMPLETED
    assert rt.start("once", {"n": 4}, run_id="fixed") == "fixed"
    assert env.state("fixed")["result"] == 1
    assert env.store.get_run("fixed").status is RunStatus.COMPLETED


def test_the_handoff_note_is_kept_and_visible(env: Env) -> None:
    flow = Flow("research")
    seen: list[Handoff] = []

    @flow.step(start=True)
    def search(ctx: StepContext) -> Transition:
        seen.append(ctx.handoff)
        ctx.note(done=["searched arxiv"], next=["read top 3"], ruled_out=["scholar: blocked"])
        return ctx.wait_for_signal("go", then="read")

    @flow.step
    def read(ctx: StepContext) -> Transition:
        seen.append(ctx.handoff)
        ctx.note(done=[*ctx.handoff.done, "read top 3"], next=[])
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("research", handoff=Handoff(goal="survey effect ledgers"))
    rt.drive(rid)
    note = env.operator.show(rid).run.handoff
    assert note == Handoff(
        goal="survey effect ledgers",
        done=("searched arxiv",),
        next=("read top 3",),
        ruled_out=("scholar: blocked",),
    )
    env.operator.signal(rid, "go", actor="me")
    assert env.runtime(flow, fresh=True).drive(rid).status is RunStatus.COMPLETED
    assert seen[0] == Handoff(goal="survey effect ledgers")
    assert seen[1] == note  # the next step (in another process) starts from it
    final = env.store.get_run(rid).handoff
    assert final.done == ("searched arxiv", "read top 3")
    assert (final.next, final.ruled_out) == ((), ("scholar: blocked",))
    assert META not in env.state(rid)


def test_the_reserved_channel_cannot_be_started_with(env: Env) -> None:
    flow = Flow("x")

    @flow.step(start=True)
    def only(ctx: StepContext) -> Transition:
        return ctx.end()

    with pytest.raises(ConfigurationError, match="reserved"):
        env.runtime(flow).start("x", {META: {}})
    assert env.store.list_runs() == []


def test_a_signal_without_a_resolution_does_not_release_an_effect_in_doubt(env: Env) -> None:
    flow = Flow("wire")

    @flow.step(start=True)
    def wire(ctx: StepContext) -> Transition:
        env.send(ctx, "wire@1", 500)
        return ctx.end()

    env.provider.ambiguous.append("wire@1")
    rt = env.runtime(flow)
    rid = rt.start("wire")
    rt.drive(rid)
    [first] = env.operator.show(rid).waits
    env.operator.signal(rid, first.name, "go on", actor="impatient")  # not a resolution
    run = rt.drive(rid, max_steps=20)
    assert run.status is RunStatus.WAITING  # it parks again: no busy loop, no re-send
    open_waits = [w for w in env.operator.show(rid).waits if w.status is WaitStatus.OPEN]
    assert [w.name for w in open_waits] == [f"{first.name}.2"]
    assert len(env.provider.deliveries) == 1
    [effect] = env.ledger.effects(run_id=rid)
    env.operator.resolve(effect.key_id, happened=True, evidence="seen", actor="ops", result=1)
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert len(env.provider.deliveries) == 1


def test_a_run_retried_after_failing_at_a_wait_fails_again_instead_of_spinning(
    env: Env,
) -> None:
    rt = env.runtime(_approval_flow(env))
    rid = rt.start("invoice", {"amount": 120}, started_by="alice")
    rt.drive(rid)
    env.operator.reject(rid, "pay", actor="bob")
    assert rt.drive(rid).status is RunStatus.FAILED
    with pytest.raises(RunNotResumable):
        env.operator.retry(rid, actor="ops", reason="try")
    env.store.update_run(rid, status=RunStatus.RUNNING)  # made ready by hand anyway
    assert rt.drive(rid).status is RunStatus.FAILED
    assert env.meta(rid)["error"]["type"] == "NothingToRun"
    assert Waits(env.store, clock=env.clock).claim_ready("w", 30) == []


def test_a_loop_that_waits_under_one_name_asks_again_on_every_pass(env: Env) -> None:
    """A wait belongs to the step visit that opened it: the loop's next pass opens a new,
    undecided wait of the same name (never the earlier pass's decision)."""
    flow = Flow("loop")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        n = ctx.state.get("n", 0)
        ctx.state["n"] = n + 1
        return ctx.wait_for_approval("ok", {"n": n}, then="ask", allow_self=True)

    rt = env.runtime(flow)
    rid = rt.start("loop")
    rt.drive(rid)
    approve(env, rid, "ok")
    run = rt.drive(rid)
    assert (run.status, run.next_step) == (RunStatus.WAITING, "ask")
    waits = [w for w in env.operator.show(rid).waits if w.name == "ok"]
    assert [(w.instance, w.status, w.subject) for w in waits] == [
        (0, WaitStatus.APPROVED, {"n": 0}),
        (1, WaitStatus.OPEN, {"n": 1}),
    ]
    assert [w.opened_by for w in waits] == ["ask#0", "ask#1"]
    assert env.state(rid)["n"] == 2


def test_one_approval_is_one_payout_in_a_loop(env: Env) -> None:
    flow = Flow("payouts")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval(
            "payout", {"amount": 100}, then="pay", requested_by="alice", on_reject="stop"
        )

    @flow.step
    def pay(ctx: StepContext) -> Transition:
        ctx.approved("payout", {"amount": 100})
        env.send(ctx, "pay@1", {"amount": 100})
        ctx.state["paid"] = ctx.state.get("paid", 0) + 1
        return ctx.next("ask") if ctx.state["paid"] < 3 else ctx.end(ctx.state["paid"])

    @flow.step
    def stop(ctx: StepContext) -> Transition:
        return ctx.end(ctx.state.get("paid", 0))

    rt = env.runtime(flow)
    rid = rt.start("payouts")
    assert rt.drive(rid).status is RunStatus.WAITING
    approve(env, rid, "payout")
    assert rt.drive(rid).status is RunStatus.WAITING  # asks again for the second payout
    assert env.provider.sent("pay@1") == [{"amount": 100}]
    rt2 = env.runtime(flow, fresh=True)  # another process sees the same
    assert rt2.drive(rid).status is RunStatus.WAITING
    assert len(env.provider.sent("pay@1")) == 1
    approve(env, rid, "payout")
    assert rt.drive(rid).status is RunStatus.WAITING
    assert len(env.provider.sent("pay@1")) == 2
    env.operator.reject(rid, "payout", actor="bob")
    run = rt.drive(rid)
    assert run.status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == 2
    assert len(env.provider.sent("pay@1")) == 2


def test_concurrent_starts_of_one_run_id_start_it_once(env: Env) -> None:
    flow = Flow("once")

    @flow.step(start=True)
    def only(ctx: StepContext) -> Transition:
        return ctx.end(ctx.state["n"])

    runtimes = [env.runtime(flow, fresh=True) for _ in range(4)]
    gate = threading.Barrier(len(runtimes))
    got: list[str] = []
    errors: list[BaseException] = []

    def start(i: int, rt: Runtime) -> None:
        gate.wait()
        try:
            got.append(rt.start("once", {"n": i}, run_id="same"))
        except BaseException as exc:  # noqa: BLE001  (reported by the test thread)
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i, r)) for i, r in enumerate(runtimes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert got == ["same"] * 4
    assert [c.step for c in env.store.history("same")] == ["start"]
    assert env.runtime(flow).drive("same").status is RunStatus.COMPLETED


def test_a_live_claim_of_another_worker_defers_the_run_instead_of_failing_it(
    env: Env, clock: Clock
) -> None:
    flow = Flow("charge")

    @flow.step(start=True)
    def charge(ctx: StepContext) -> Transition:
        env.send(ctx, "charge@1", 10)
        return ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("charge", {}, run_id="r1")
    # A worker with another name claimed the step's effect and died before sending.
    other = env.ledgers.fresh(owner="w0")
    other.claim(EffectIdentity("", rid, "charge#0", 0, "charge@1", 0), {"p": 10})
    run = rt.drive(rid)
    assert run.status is RunStatus.RUNNING  # deferred, not failed
    # Parked under another name until the other claim lapses: not even "rt" re-claims it.
    assert run.lease_owner == "rt:deferred"
    assert env.store.get_run(rid).lease_expires_at is not None
    assert env.provider.sent() == []
    clock.advance(31)  # the dead worker's claim lapses: in doubt, and class C needs a human
    env.store.release_lease(rid, "rt:deferred")  # (the park's lease runs on wall time)
    assert rt.drive(rid).status is RunStatus.WAITING
    assert env.provider.sent() == []


def test_a_step_knows_the_version_its_run_was_started_under(env: Env) -> None:
    """A deploy's code drives the runs older code started; a step branches on the run's
    version (the code's own is ``flow_version``)."""
    seen: list[tuple[str, str]] = []

    def build(version: str) -> Flow:
        flow = Flow("versioned", version=version, serves=("1",))

        @flow.step(start=True)
        def ask(ctx: StepContext) -> Transition:
            seen.append((ctx.version, ctx.flow_version))
            return ctx.wait_for_signal("go", then="ask") if ctx.visit == 0 else ctx.end()

        return flow

    rid = env.runtime(build("1")).start("versioned")
    env.runtime(build("1")).drive(rid)
    env.operator.signal(rid, "go", actor="portal")
    assert env.runtime(build("2")).drive(rid).status is RunStatus.COMPLETED
    assert seen == [("1", "1"), ("1", "2")]
