"""OpenAI Agents SDK function tools under the guard, offline with the SDK's own
``ScriptedModel``.

The oracle is the provider's raw log (``FakeProvider.writes``). The scripted model sends
fresh call ids every time it is asked (as a re-planning model does), so a guard keyed by
the call id would book twice; the guard keys by conversation and position instead.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agents import Agent, RunConfig, Runner, RunState, UserError, function_tool
from agents.testing.model import ModelStep, ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext

from onceonly.adapters.openai_agents import AgentsToolGuard, ApprovalMismatch
from onceonly.checkpoint.errors import ConfigurationError
from onceonly.checkpoint.failpoints import armed
from onceonly.ledger import EffectInDoubt, KeyReuseError
from tests.agent_sdk_support import Killed, ModelDown
from tests.http_fake import FakeProvider, running
from tests.ledger_support import Ledgers


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with running(FakeProvider(dedup=False, require_key=False)) as fake:
        yield fake


def script(calls: list[dict[str, Any]], *, fail_after_tools: bool = False) -> ScriptedModel:
    """A model that asks for ``calls`` in one response (fresh call ids), then answers;
    ``fail_after_tools``: it fails instead of answering."""
    asked = [function_call("book", args, call_id=f"call-{uuid.uuid4().hex}") for args in calls]
    last: Any = (
        ModelStep.raise_error(ModelDown("the model provider is down"))
        if fail_after_tools
        else [assistant_message("booked")]
    )
    return ScriptedModel([asked, last])


def booking_agent(
    guard: AgentsToolGuard | None, provider: FakeProvider, model: ScriptedModel, **options: Any
) -> Agent[Any]:
    async def book(ctx: ToolContext[Any], table: int, time: str) -> str:
        async with httpx.AsyncClient(timeout=30) as client:
            sent = await client.post(f"{provider.url}/bookings", json={"table": table})
        sent.raise_for_status()
        return f"table {table} at {time}, booking {len(provider.writes)}"

    tool = (
        guard.function_tool(book, **options)
        if guard is not None
        else function_tool(book, **options)
    )
    return Agent(name="booker", tools=[tool], model=model)


def run(
    agent: Agent[Any], guard: AgentsToolGuard | None, conversation: str, inp: Any = "book"
) -> Any:
    hooks = guard.hooks if guard is not None else None
    config = RunConfig(group_id=conversation, tracing_disabled=True)
    return asyncio.run(Runner.run(agent, inp, hooks=hooks, run_config=config))


def writes(provider: FakeProvider, since: int) -> int:
    return len(provider.writes) - since


CALLS = [{"table": 4, "time": "19:00"}, {"table": 4, "time": "21:00"}]


def test_rerun_after_a_crash_replays(provider: FakeProvider, ledgers: Ledgers) -> None:
    start = len(provider.writes)
    first = AgentsToolGuard(ledgers.fresh())
    with pytest.raises(ModelDown):
        run(booking_agent(first, provider, script(CALLS, fail_after_tools=True)), first, "conv-1")
    assert writes(provider, start) == 2  # two calls in one response: two effects

    again = AgentsToolGuard(ledgers.fresh())  # the process restarted
    out = run(booking_agent(again, provider, script(CALLS)), again, "conv-1")
    assert out.final_output == "booked"
    assert writes(provider, start) == 2

    other = AgentsToolGuard(ledgers.fresh())
    run(booking_agent(other, provider, script(CALLS[:1])), other, "conv-2")
    assert writes(provider, start) == 3


def test_sync_tool_rerun_replays(provider: FakeProvider, ledgers: Ledgers) -> None:
    start = len(provider.writes)

    def book(ctx: ToolContext[Any], table: int, time: str) -> str:
        sent = httpx.post(f"{provider.url}/bookings", json={"table": table}, timeout=30)
        sent.raise_for_status()
        return f"table {table} at {time}"

    for fail in (True, False):
        guard = AgentsToolGuard(ledgers.fresh())
        model = script(CALLS[:1], fail_after_tools=fail)
        agent = Agent(name="booker", tools=[guard.function_tool(book)], model=model)
        try:
            run(agent, guard, "conv-s")
        except ModelDown:
            assert fail
    assert writes(provider, start) == 1


def test_control_unguarded_rerun_books_again(provider: FakeProvider) -> None:
    start = len(provider.writes)
    with pytest.raises(ModelDown):
        run(booking_agent(None, provider, script(CALLS[:1], fail_after_tools=True)), None, "c")
    run(booking_agent(None, provider, script(CALLS[:1])), None, "c")
    assert writes(provider, start) == 2  # the duplicate the guard prevents


def test_crash_between_provider_and_record_is_in_doubt(
    provider: FakeProvider, ledgers: Ledgers
) -> None:
    start = len(provider.writes)

    def die(name: str) -> None:
        if name == "adapters.act.after":
            raise Killed(name)

    first = AgentsToolGuard(ledgers.fresh(owner="w1"))
    with armed(die), pytest.raises(Killed):
        run(booking_agent(first, provider, script(CALLS[:1])), first, "conv-d")
    assert writes(provider, start) == 1
    again = AgentsToolGuard(ledgers.fresh(owner="w1"))
    with pytest.raises(UserError) as stopped:  # not answered to the model: the run stops
        run(booking_agent(again, provider, script(CALLS[:1])), again, "conv-d")
    assert isinstance(stopped.value.__cause__, EffectInDoubt)
    assert writes(provider, start) == 1


def test_same_position_other_arguments_is_refused(provider: FakeProvider, ledgers: Ledgers) -> None:
    guard = AgentsToolGuard(ledgers.fresh())
    run(booking_agent(guard, provider, script(CALLS[:1])), guard, "conv-r")
    start = len(provider.writes)
    with pytest.raises(UserError) as stopped:
        run(
            booking_agent(guard, provider, script([{"table": 9, "time": "18:00"}])), guard, "conv-r"
        )
    assert isinstance(stopped.value.__cause__, KeyReuseError)
    assert writes(provider, start) == 0


def test_needs_approval_bound_to_the_arguments(provider: FakeProvider, ledgers: Ledgers) -> None:
    start = len(provider.writes)
    guard = AgentsToolGuard(ledgers.fresh())
    agent = booking_agent(guard, provider, script(CALLS[:1]), needs_approval=True)
    paused = run(agent, guard, "conv-a")
    (item,) = paused.interruptions
    assert writes(provider, start) == 0
    shown = guard.approval_hash("book", CALLS[0])
    state = paused.to_state()
    with pytest.raises(ApprovalMismatch):
        guard.approve(state, item, guard.approval_hash("book", {"table": 5, "time": "19:00"}))
    guard.approve(state, item, shown)
    saved = state.to_string()
    config = RunConfig(group_id="conv-a", tracing_disabled=True)
    done = asyncio.run(Runner.run(agent, state, hooks=guard.hooks, run_config=config))
    assert done.final_output == "booked"
    assert writes(provider, start) == 1

    # the approved state resumed again in a fresh process: the booking is replayed
    fresh = AgentsToolGuard(ledgers.fresh())
    agent = booking_agent(fresh, provider, ScriptedModel([[assistant_message("booked")]]))
    restored = asyncio.run(RunState.from_string(agent, saved))
    fresh.resume(restored)
    again = asyncio.run(Runner.run(agent, restored, hooks=fresh.hooks, run_config=config))
    assert again.final_output == "booked"
    assert writes(provider, start) == 1


def test_without_hooks_or_conversation(provider: FakeProvider, ledgers: Ledgers) -> None:
    guard = AgentsToolGuard(ledgers.fresh())
    agent = booking_agent(guard, provider, script(CALLS[:1]))
    with pytest.raises(UserError) as stopped:
        asyncio.run(
            Runner.run(agent, "book", run_config=RunConfig(group_id="x", tracing_disabled=True))
        )
    assert isinstance(stopped.value.__cause__, ConfigurationError)
    assert "hooks=guard.hooks" in str(stopped.value.__cause__)
    agent = booking_agent(guard, provider, script(CALLS[:1]))
    with pytest.raises(UserError) as stopped:
        asyncio.run(
            Runner.run(
                agent, "book", hooks=guard.hooks, run_config=RunConfig(tracing_disabled=True)
            )
        )
    assert "group_id" in str(stopped.value.__cause__)
