"""``ToolPolicy(approval=True)``: a booking runs only on a decision about exactly its arguments.

A plain ``interrupt()`` in a tool accepts any resume value: a person approves a booking,
someone changes the call's arguments with ``update_state`` before the resume, and the
resume's "yes" makes the changed booking without a new prompt (the positive control
below shows it). The guard's approval interrupts with the tool's name, arguments and
their keyed ``args_hash``, and acts only on ``{"approve": args_hash}`` for the arguments
it is about to send; anything else asks again.

The graph is :mod:`tests.langgraph_graph`'s (a scripted model asks for ``book_room`` and
``notify`` in one message); the counting provider on 127.0.0.1 is the oracle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, interrupt

from onceonly.adapters.langgraph import ToolGuard, ToolPolicy
from onceonly.ledger import EffectStatus
from tests.http_fake import FakeProvider
from tests.langgraph_graph import NOTIFY, Tools, build, tool_messages
from tests.ledger_support import Ledgers

INPUT: Any = {"messages": [("user", "Book room r-12 and tell the guest")]}
R12 = {"room": "r-12", "night": "2025-05-01"}
R99 = {"room": "r-99", "night": "2025-05-01"}


def config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(dedup=False, require_key=False)
    try:
        provider.start()
        yield provider
    finally:
        provider.stop()


def booked(fake: FakeProvider) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in fake.writes if r.path == "/bookings"]


def prompts(result: dict[str, Any]) -> list[Any]:
    return [i.value for i in result.get("__interrupt__", ())]


def guarded(fake: FakeProvider, ledgers: Ledgers) -> tuple[Any, ToolGuard]:
    policies = {"book_room": ToolPolicy(approval=True), "notify": NOTIFY}
    guard = ToolGuard(ledgers.fresh(), policies=policies)
    return build(Tools(fake.url, notify_failures=0), InMemorySaver(), guard), guard


def change_room(app: Any, thread: str, args: dict[str, str]) -> None:
    """``update_state`` as an operator would: the pending booking gets other arguments."""
    state = app.get_state(config(thread))
    ai = state.values["messages"][-1]
    calls = [{**c, "args": args} if c["name"] == "book_room" else c for c in ai.tool_calls]
    app.update_state(
        config(thread), {"messages": [ai.model_copy(update={"tool_calls": calls})]}, as_node="model"
    )


def run(app: Any, start: Any, thread: str, api: str) -> Any:
    if api == "ainvoke":
        return asyncio.run(app.ainvoke(start, config(thread)))
    return app.invoke(start, config(thread))


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_a_booking_waits_for_an_approval_of_its_arguments(
    fake: FakeProvider, ledgers: Ledgers, api: str
) -> None:
    app, guard = guarded(fake, ledgers)
    first = run(app, INPUT, "t-1", api)
    [prompt] = prompts(first)
    assert prompt["kind"] == "onceonly.approval"
    assert prompt["tool"] == "book_room"
    assert prompt["args"] == R12
    assert prompt["args_hash"] == guard.approval_hash("book_room", R12)
    assert booked(fake) == []

    # A bare "yes" names nothing: the same prompt again, nothing booked.
    again = run(app, Command(resume="yes"), "t-1", api)
    assert prompts(again) == [prompt]
    assert booked(fake) == []

    final = run(app, Command(resume={"approve": prompt["args_hash"]}), "t-1", api)
    assert booked(fake) == [R12]
    assert '"id": 1' in tool_messages(final)["call_book"]["content"]


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_changed_arguments_ask_again(fake: FakeProvider, ledgers: Ledgers, api: str) -> None:
    app, guard = guarded(fake, ledgers)
    [prompt] = prompts(run(app, INPUT, "t-1", api))

    change_room(app, "t-1", R99)
    # The approval of r-12 does not cover r-99: a new prompt, with the new arguments.
    asked = run(app, Command(resume={"approve": prompt["args_hash"]}), "t-1", api)
    [again] = prompts(asked)
    assert again["args"] == R99
    assert again["args_hash"] == guard.approval_hash("book_room", R99) != prompt["args_hash"]
    assert booked(fake) == []

    run(app, Command(resume={"approve": again["args_hash"]}), "t-1", api)
    assert booked(fake) == [R99]
    # No call was cut off by an interrupt of its sibling: nothing is left claimed.
    records = guard.ledger.effects(run_id="t-1")
    assert {r.status for r in records} == {EffectStatus.COMMITTED}


def test_a_rejection_is_told_to_the_model_and_nothing_is_booked(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    app, _ = guarded(fake, ledgers)
    [prompt] = prompts(app.invoke(INPUT, config("t-1")))
    final = app.invoke(
        Command(resume={"reject": prompt["args_hash"], "reason": "over budget"}), config("t-1")
    )
    refused = tool_messages(final)["call_book"]
    assert refused["status"] == "error"
    assert "over budget" in refused["content"]
    assert booked(fake) == []


def test_an_approved_booking_replays_on_resume_without_a_new_prompt(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """notify fails after the approved booking; the resume replays the booking."""
    policies = {"book_room": ToolPolicy(approval=True), "notify": NOTIFY}
    ledger = ledgers.fresh()
    app = build(
        Tools(fake.url, notify_failures=1), InMemorySaver(), ToolGuard(ledger, policies=policies)
    )
    [prompt] = prompts(app.invoke(INPUT, config("t-1")))
    with pytest.raises(ConnectionRefusedError):
        app.invoke(Command(resume={"approve": prompt["args_hash"]}), config("t-1"))
    assert booked(fake) == [R12]
    final = app.invoke(None, config("t-1"))
    assert "__interrupt__" not in final
    assert booked(fake) == [R12]
    assert tool_messages(final)["call_notify"]["status"] == "success"
    [entry] = ledger.effects(run_id="t-1", effect="book_room@1")
    assert entry.status is EffectStatus.COMMITTED


def test_the_hash_is_keyed_and_ignores_argument_order(ledgers: Ledgers) -> None:
    guard = ToolGuard(ledgers.fresh())
    a = guard.approval_hash("book_room", {"room": "r-12", "night": "2025-05-01"})
    b = guard.approval_hash("book_room", {"night": "2025-05-01", "room": "r-12"})
    assert a == b
    assert a != guard.approval_hash("book_room", R99)
    assert a != guard.approval_hash("hold_room", R12)
    assert len(a) >= 32


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_plain_interrupt_books_changed_arguments_without_a_new_prompt(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """Positive control: the approval in the tool itself accepts the resume's "yes" for
    arguments nobody saw."""

    @tool
    def book_room(room: str, night: str) -> str:
        """Book a hotel room for one night."""
        if interrupt({"tool": "book_room", "room": room}) != "yes":
            return "not approved"
        resp = httpx.post(fake.url + "/bookings", json={"room": room, "night": night}, timeout=5)
        return resp.text

    def model(state: MessagesState) -> dict[str, Any]:
        if isinstance(state["messages"][-1], ToolMessage):
            return {"messages": [AIMessage("Booked.")]}
        call = {"name": "book_room", "args": R12, "id": "call_book"}
        return {"messages": [AIMessage("", tool_calls=[call])]}

    guard = ToolGuard(ledgers.fresh())
    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([book_room], wrap_tool_call=guard.wrap_tool_call))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    app = graph.compile(checkpointer=InMemorySaver())

    [prompt] = prompts(app.invoke(INPUT, config("t-1")))
    assert prompt["room"] == "r-12"
    change_room(app, "t-1", R99)
    final = app.invoke(Command(resume="yes"), config("t-1"))
    assert prompts(final) == []
    assert booked(fake) == [R99]  # approved "r-12", booked r-99


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_each_decision_is_in_the_runs_audit_chain_once(
    fake: FakeProvider, ledgers: Ledgers, api: str
) -> None:
    """Who approved or rejected which arguments is an ``operator`` event in the run's
    audit chain, recorded once however often LangGraph replays the resume value, and
    ``audit verify`` checks it."""
    app, guard = guarded(fake, ledgers)
    [prompt] = prompts(run(app, INPUT, "t-1", api))
    change_room(app, "t-1", R99)
    [again] = prompts(run(app, Command(resume={"approve": prompt["args_hash"]}), "t-1", api))
    decision = {"reject": again["args_hash"], "reason": "wrong room", "actor": "ops@example.com"}
    run(app, Command(resume=decision), "t-1", api)
    run(app, None, "t-1", api)  # a resume with nothing pending: no new decision
    actions = guard.ledger.operator_actions("t-1")
    assert [(a["actor"], a["detail"]["action"], a["detail"]["args_hash"]) for a in actions] == [
        ("ops@example.com", "langgraph.reject", again["args_hash"])
    ]
    assert actions[0]["detail"]["reason"] == "wrong room"
    assert actions[0]["detail"]["tool"] == "book_room"
    assert booked(fake) == []
    assert guard.ledger.verify().ok


def test_an_approval_without_an_actor_is_recorded_as_unnamed(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    app, guard = guarded(fake, ledgers)
    [prompt] = prompts(app.invoke(INPUT, config("t-1")))
    app.invoke(Command(resume={"approve": prompt["args_hash"]}), config("t-1"))
    [action] = guard.ledger.operator_actions("t-1")
    assert action["detail"]["action"] == "langgraph.approve"
    assert action["actor"].startswith("unnamed")
    assert booked(fake) == [R12]
