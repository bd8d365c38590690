"""Pydantic AI tools under the guard, offline with the SDK's own ``FunctionModel``.

The oracle is the provider's raw log (``FakeProvider.writes``). The model sends a fresh
``tool_call_id`` every time it is asked (as a re-planning model does), so a guard keyed
by that id would book twice; the guard keys by conversation and position instead.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic_ai import (
    Agent,
    DeferredToolRequests,
    DeferredToolResults,
    ModelMessage,
    ModelResponse,
    RunContext,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from onceonly.adapters import ToolPolicy
from onceonly.adapters.pydantic_ai import PydanticAIToolGuard
from onceonly.checkpoint.errors import ConfigurationError
from onceonly.checkpoint.failpoints import armed
from onceonly.ledger import EffectInDoubt, Ledger
from tests.agent_sdk_support import Killed, ModelDown
from tests.http_fake import FakeProvider, running
from tests.ledger_support import Ledgers


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with running(FakeProvider(dedup=False, require_key=False)) as fake:
        yield fake


def script(calls: list[dict[str, Any]], *, fail_after_tools: bool = False) -> FunctionModel:
    """A model that asks for ``calls`` (one response, fresh ids), then answers with the
    tools' results; ``fail_after_tools``: it fails instead of answering."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p.content for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        if not returns:
            parts: list[Any] = [
                ToolCallPart("book", dict(args), tool_call_id=f"call-{uuid.uuid4().hex}")
                for args in calls
            ]
            return ModelResponse(parts=parts)
        if fail_after_tools:
            raise ModelDown("the model provider is down")
        return ModelResponse(parts=[TextPart(f"booked: {returns}")])

    return FunctionModel(model)


def booking_agent(guard: PydanticAIToolGuard | None, provider: FakeProvider) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(output_type=[str, DeferredToolRequests])

    async def book(ctx: RunContext[None], table: int, time: str) -> str:
        async with httpx.AsyncClient(timeout=30) as client:
            sent = await client.post(f"{provider.url}/bookings", json={"table": table})
        sent.raise_for_status()
        return f"table {table} at {time}, booking {len(provider.writes)}"

    agent.tool(guard.tool(book) if guard is not None else book)
    return agent


def run_sync(agent: Agent[None, Any], prompt: str | None = None, **options: Any) -> Any:
    """``agent.run_sync``, on a loop of its own that is closed after (Pydantic AI's
    ``run_sync`` leaves the loop it makes open)."""
    return asyncio.run(agent.run(prompt, **options))


def writes(provider: FakeProvider, since: int) -> int:
    return len(provider.writes) - since


def test_rerun_after_a_crash_replays(provider: FakeProvider, ledgers: Ledgers) -> None:
    start = len(provider.writes)
    calls = [{"table": 4, "time": "19:00"}, {"table": 4, "time": "21:00"}]
    first = booking_agent(PydanticAIToolGuard(ledgers.fresh()), provider)
    with pytest.raises(ModelDown):
        run_sync(
            first, "book", conversation_id="conv-1", model=script(calls, fail_after_tools=True)
        )
    assert writes(provider, start) == 2  # two calls in one response: two effects

    # the process restarts and runs the agent again: the recorded bookings are replayed
    again = booking_agent(PydanticAIToolGuard(ledgers.fresh()), provider)
    out = run_sync(again, "book", conversation_id="conv-1", model=script(calls))
    assert writes(provider, start) == 2
    assert "booking" in str(out.output)

    # another conversation is another booking
    other = booking_agent(PydanticAIToolGuard(ledgers.fresh()), provider)
    run_sync(other, "book", conversation_id="conv-2", model=script(calls[:1]))
    assert writes(provider, start) == 3


def test_sync_tool_rerun_replays(provider: FakeProvider, ledgers: Ledgers) -> None:
    start = len(provider.writes)
    calls = [{"table": 3, "time": "20:00"}]

    def book(ctx: RunContext[None], table: int, time: str) -> str:
        sent = httpx.post(f"{provider.url}/bookings", json={"table": table}, timeout=30)
        sent.raise_for_status()
        return f"table {table} at {time}"

    for fail in (True, False):
        agent: Agent[None, Any] = Agent(tools=[PydanticAIToolGuard(ledgers.fresh()).tool(book)])
        try:
            run_sync(
                agent, "book", conversation_id="conv-s", model=script(calls, fail_after_tools=fail)
            )
        except ModelDown:
            assert fail
    assert writes(provider, start) == 1


def test_control_unguarded_rerun_books_again(provider: FakeProvider) -> None:
    start = len(provider.writes)
    calls = [{"table": 4, "time": "19:00"}]
    agent = booking_agent(None, provider)
    with pytest.raises(ModelDown):
        run_sync(
            agent, "book", conversation_id="conv-c", model=script(calls, fail_after_tools=True)
        )
    run_sync(agent, "book", conversation_id="conv-c", model=script(calls))
    assert writes(provider, start) == 2  # the duplicate the guard prevents


def test_crash_between_provider_and_record_is_in_doubt(
    provider: FakeProvider, ledgers: Ledgers
) -> None:
    start = len(provider.writes)
    calls = [{"table": 2, "time": "20:00"}]

    def die(name: str) -> None:
        if name == "adapters.act.after":
            raise Killed(name)

    first = booking_agent(PydanticAIToolGuard(ledgers.fresh(owner="w1")), provider)
    with armed(die), pytest.raises(Killed):
        run_sync(first, "book", conversation_id="conv-d", model=script(calls))
    assert writes(provider, start) == 1
    # the restarted worker finds the call in doubt: not sent again (class C)
    again = booking_agent(PydanticAIToolGuard(ledgers.fresh(owner="w1")), provider)
    with pytest.raises(EffectInDoubt):
        run_sync(again, "book", conversation_id="conv-d", model=script(calls))
    assert writes(provider, start) == 1


def test_same_position_other_arguments_is_refused(provider: FakeProvider, ledgers: Ledgers) -> None:
    from onceonly.ledger import KeyReuseError

    ledger = ledgers.fresh()
    agent = booking_agent(PydanticAIToolGuard(ledger), provider)
    run_sync(agent, "book", conversation_id="conv-r", model=script([{"table": 1, "time": "18:00"}]))
    start = len(provider.writes)
    with pytest.raises(KeyReuseError):
        run_sync(
            agent, "book", conversation_id="conv-r", model=script([{"table": 9, "time": "18:00"}])
        )
    assert writes(provider, start) == 0


def test_approval_is_bound_to_the_arguments(provider: FakeProvider, ledgers: Ledgers) -> None:
    start = len(provider.writes)
    ledger: Ledger = ledgers.fresh()
    guard = PydanticAIToolGuard(ledger, policies={"book": ToolPolicy(approval=True)})
    agent = booking_agent(guard, provider)
    model = script([{"table": 6, "time": "19:30"}])
    asked = run_sync(agent, "book", conversation_id="conv-a", model=model)
    requests = asked.output
    assert isinstance(requests, DeferredToolRequests)
    (call,) = requests.approvals
    meta = requests.metadata[call.tool_call_id]
    assert meta["kind"] == "onceonly.approval"
    assert meta["args_hash"] == guard.approval_hash("book", {"table": 6, "time": "19:30"})
    assert writes(provider, start) == 0

    # a bare "yes" is not an approval of these arguments: asked again, nothing booked
    bare = run_sync(
        agent,
        message_history=asked.all_messages(),
        deferred_tool_results=DeferredToolResults(approvals={call.tool_call_id: True}),
        model=model,
    )
    assert isinstance(bare.output, DeferredToolRequests)
    assert writes(provider, start) == 0

    approved = run_sync(
        agent,
        message_history=asked.all_messages(),
        deferred_tool_results=DeferredToolResults(
            approvals={call.tool_call_id: True},
            metadata={call.tool_call_id: {"approve": meta["args_hash"]}},
        ),
        model=model,
    )
    assert "booking" in str(approved.output)
    assert writes(provider, start) == 1


def test_needs_a_conversation_call(ledgers: Ledgers) -> None:
    guard = PydanticAIToolGuard(ledgers.fresh())

    def no_context() -> str:
        return "x"

    with pytest.raises(ConfigurationError, match="RunContext"):
        guard.tool(no_context)  # type: ignore[arg-type]
