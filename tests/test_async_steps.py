"""Async steps (issue [11]): ``async def`` steps with the async adapters inside them,
asyncio branches (``ctx.aparallel``), async recorded reads, and cancellation at a step's
timeout, which leaves an effect being sent in doubt exactly as a kill would.

The oracle is the fake provider's raw log (a real HTTP server on 127.0.0.1) or the
in-process provider's deliveries. A "crash" is :class:`Crash`, a ``BaseException`` the
runtime does not catch. Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from onceonly.adapters import guard
from onceonly.adapters.http import AsyncGuardedHTTP
from onceonly.checkpoint import RunStatus, Store
from onceonly.context import BranchContext, StepContext
from onceonly.flow import Flow, StepRetry, Transition
from onceonly.ledger import EffectStatus
from tests.http_fake import FakeProvider
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Crash, Env


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(dedup=False)  # class B: it answers lookups by our key
    provider.start()
    try:
        yield provider
    finally:
        provider.stop()


def _pay(fake: FakeProvider, crash: list[bool], asked: list[str]) -> Flow:
    flow = Flow("pay")

    async def quote(item: str) -> dict[str, Any]:
        asked.append(item)
        await asyncio.sleep(0)
        return {"item": item, "price": 12}

    @flow.step(start=True)
    async def charge(ctx: StepContext) -> Transition:
        price = await ctx.arecorded("quote@1", quote, ctx.state["item"])
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            paid = await AsyncGuardedHTTP(client, ctx.ledger).post(
                fake.url + "/payments",
                effect="pay@1",
                json={"amount": price["price"]},
                provider_class="B",
                lookup=fake.url + "/lookup/{key}",
            )
        ctx.state["paid"] = paid["status"]
        if crash:
            crash.pop()
            raise Crash("killed after paying, before the checkpoint")
        return ctx.next("done")

    @flow.step
    def done(ctx: StepContext) -> Transition:  # sync and async steps in one flow
        return ctx.end(ctx.state["paid"])

    return flow


def test_an_async_step_acts_once_and_resumes_after_a_crash(env: Env, fake: FakeProvider) -> None:
    asked: list[str] = []
    rt = env.runtime(_pay(fake, [True], asked))
    rid = rt.start("pay", {"item": "desk"})
    with pytest.raises(Crash):
        rt.drive(rid)
    again = env.runtime(_pay(fake, [], asked), fresh=True)
    assert again.drive(rid).status is RunStatus.COMPLETED
    assert len(fake.writes) == 1  # the resumed step replayed the payment
    assert asked == ["desk"]  # and the recorded read
    assert env.state(rid)["result"] == 201


def test_an_async_step_runs_when_drive_is_called_from_async_code(
    env: Env, fake: FakeProvider
) -> None:
    rt = env.runtime(_pay(fake, [], []))
    rid = rt.start("pay", {"item": "lamp"})

    async def caller() -> RunStatus:
        return rt.drive(rid).status  # a loop runs in this thread already

    assert asyncio.run(caller()) is RunStatus.COMPLETED
    assert len(fake.writes) == 1


def _fan(env: Env, fail: list[str], ran: list[str]) -> Flow:
    flow = Flow("fan")

    async def send(bctx: BranchContext, what: str) -> Any:
        async def deliver(p: str) -> Any:
            await asyncio.sleep(0.01)
            return env.provider.send(f"{what}@1", p)

        return await guard(bctx.ledger, effect=f"{what}@1")(deliver)(what)

    def branch(what: str) -> Any:
        async def run(bctx: BranchContext) -> Any:
            ran.append(what)
            out = await send(bctx, what)
            if what in fail:
                fail.remove(what)
                raise RuntimeError(f"{what} failed after sending")
            return {"id": out["id"]}

        return run

    @flow.step(start=True)
    async def both(ctx: StepContext) -> Transition:
        ctx.state["outs"] = await ctx.aparallel({"a": branch("a"), "b": branch("b")})
        return ctx.end(sorted(ctx.state["outs"]))

    return flow


def test_async_branches_record_as_they_finish_and_a_resume_reruns_only_the_failed(
    env: Env,
) -> None:
    ran: list[str] = []
    # a failed branch is tried once more in the same attempt (as a parallel branch is)
    rt = env.runtime(_fan(env, ["b", "b"], ran))
    rid = rt.start("fan")
    assert rt.drive(rid).status is RunStatus.FAILED
    assert env.meta(rid)["error"]["message"] == "b failed after sending"
    env.operator.retry(rid, actor="ops", reason="b is fixed")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert sorted(ran) == ["a", "b", "b", "b"]  # "a" finished and was recorded: not rerun
    assert sorted(env.provider.sent()) == ["a", "b"]  # "b"'s send replayed in its re-run
    assert env.state(rid)["result"] == ["a", "b"]


def test_branch_names_that_changed_on_resume_are_refused(env: Env) -> None:
    ran: list[str] = []
    rt = env.runtime(_fan(env, ["b", "b"], ran))
    rid = rt.start("fan")
    assert rt.drive(rid).status is RunStatus.FAILED
    flow = Flow("fan")

    @flow.step(start=True)
    async def both(ctx: StepContext) -> Transition:
        async def c(bctx: BranchContext) -> int:
            return 1

        await ctx.aparallel({"a": c, "c": c})
        return ctx.end()

    env.operator.retry(rid, actor="ops", reason="deploy")
    assert env.runtime(flow).drive(rid).status is RunStatus.FAILED
    assert env.meta(rid)["error"]["type"] == "BranchesDiverged"


def test_an_async_step_past_its_timeout_is_cancelled_and_takes_its_path(env: Env) -> None:
    stopped = threading.Event()
    flow = Flow("slow")

    @flow.step(start=True, timeout_s=0.3, on_timeout="fallback")
    async def work(ctx: StepContext) -> Transition:
        env.send(ctx, "first@1", "x")
        try:
            await asyncio.sleep(60)  # cancelled here, not waited out
        except asyncio.CancelledError:
            stopped.set()
            raise
        env.send(ctx, "never@1", "y")
        return ctx.end("finished")

    @flow.step
    def fallback(ctx: StepContext) -> Transition:
        return ctx.end("fallback")

    rt = env.runtime(flow)
    rid = rt.start("slow")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert stopped.is_set()
    assert env.state(rid)["result"] == "fallback"
    assert env.provider.sent() == ["x"]
    assert env.meta(rid)["last_error"]["type"] == "StepTimedOut"


def test_a_step_cancelled_while_it_sends_leaves_the_effect_in_doubt_like_a_kill(
    env: Env, fake: FakeProvider
) -> None:
    """The provider applies the payment and answers late; the step's timeout cancels it
    while it waits: the entry is in doubt (nothing was recorded as done), the next
    attempt settles it by lookup (class B), and the payment is made once."""
    fake.sleep_s = 3.0
    fake.faults.append("drop")  # apply, then answer only after 3 s
    flow = Flow("late")

    @flow.step(start=True, timeout_s=1.0, retry=StepRetry(attempts=2, backoff_s=60))
    async def charge(ctx: StepContext) -> Transition:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
            paid = await AsyncGuardedHTTP(client, ctx.ledger).post(
                fake.url + "/payments",
                effect="pay@1",
                json={"amount": 5},
                provider_class="B",
                lookup=fake.url + "/lookup/{key}",
            )
        return ctx.end(paid["status"])

    rt = env.runtime(flow)
    rid = rt.start("late")
    assert rt.drive(rid).status is RunStatus.WAITING  # attempt 1 timed out: a retry timer
    [entry] = env.ledger.effects(run_id=rid)
    assert entry.status in (EffectStatus.UNKNOWN, EffectStatus.CLAIMED)
    assert len(fake.writes) == 1
    env.clock.advance(60)
    assert rt.drive(rid).status is RunStatus.COMPLETED  # attempt 2: settled by lookup
    assert len(fake.writes) == 1
    [entry] = env.ledger.effects(run_id=rid)
    assert entry.status is EffectStatus.COMMITTED
