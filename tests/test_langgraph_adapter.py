"""The LangGraph adapter on a real graph: a scripted model, a ``ToolNode``, a checkpointer.

The model asks for two tool calls in one message: ``book_room`` (an HTTP booking at a fake
provider on 127.0.0.1, whose raw request log is the oracle) and ``notify`` (fails the first
time). LangGraph re-runs the whole super-step on resume; with the guard the room is booked
once, without it twice (the positive control).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import RetryPolicy
from onceonly.adapters.langgraph import ToolGuard, ToolPolicy
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import (
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    Ledger,
    OutcomeClass,
)
from tests.http_fake import FakeProvider, running
from tests.langgraph_graph import NOTIFY, Tools, build, tool_messages
from tests.ledger_support import Ledgers

ROOT = Path(__file__).resolve().parent.parent
START: Any = {"messages": [("user", "Book room r-12 and tell the guest")]}


def config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A provider that does not deduplicate: every booking request books a room."""
    with running(FakeProvider(dedup=False, require_key=False)) as provider:
        yield provider


def bookings(fake: FakeProvider) -> list[str | None]:
    """The idempotency keys of every raw booking request the provider received."""
    return [r.idempotency_key for r in fake.writes if r.path == "/bookings"]


def outcomes(spans: InMemorySpanExporter, effect: str) -> list[Any]:
    return [
        (s.attributes or {}).get("onceonly.effect.outcome")
        for s in spans.get_finished_spans()
        if s.name == f"execute_tool {effect}"
    ]


def lookup(fake: FakeProvider) -> Any:
    """A class B probe: the provider's lookup by our provider key."""

    def probe(record: EffectRecord) -> tuple[Evidence, Any]:
        resp = httpx.get(f"{fake.url}/lookup/{record.provider_key}", timeout=5.0)
        if resp.status_code == 200:
            return Evidence.HAPPENED, resp.json()
        if resp.status_code == 404:
            return Evidence.NOT_HAPPENED, None
        return Evidence.INCONCLUSIVE, None

    return probe


def test_a_resume_after_a_failed_sibling_books_the_room_once(
    fake: FakeProvider, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    saver = InMemorySaver()
    tools = Tools(fake.url)
    first = build(tools, saver, ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    with pytest.raises(ConnectionRefusedError):
        first.invoke(START, config("t-1"))
    assert len(bookings(fake)) == 1  # booked; notify failed; the super-step failed

    # Resume with another process's view of the ledger: the booking is replayed.
    other = ledgers.fresh()
    again = build(tools, saver, ToolGuard(other, policies={"notify": NOTIFY}))
    final = again.invoke(None, config("t-1"))

    assert len(bookings(fake)) == 1
    messages = tool_messages(final)
    assert messages["call_book"]["status"] == "success"
    assert '"id": 1' in messages["call_book"]["content"]
    assert messages["call_notify"]["content"] == "sent to guest@example.com"
    assert tools.sent == ["guest@example.com"]
    assert outcomes(spans, "book_room@1") == ["executed", "replayed"]
    assert outcomes(spans, "notify@1") == ["failed", "executed"]
    records = other.effects(run_id="t-1")
    assert {(r.effect, r.status) for r in records} == {
        ("book_room@1", EffectStatus.COMMITTED),
        ("notify@1", EffectStatus.COMMITTED),
    }


def test_without_the_guard_the_resume_books_twice(fake: FakeProvider) -> None:
    """Positive control: the same graph and resume, unguarded, books the room again."""
    saver = InMemorySaver()
    app = build(Tools(fake.url), saver, None)
    with pytest.raises(ConnectionRefusedError):
        app.invoke(START, config("t-1"))
    app.invoke(None, config("t-1"))
    assert len(bookings(fake)) == 2


def test_an_async_resume_books_the_room_once(
    fake: FakeProvider, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    saver = InMemorySaver()
    tools = Tools(fake.url)
    app = build(tools, saver, ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    with pytest.raises(ConnectionRefusedError):
        asyncio.run(app.ainvoke(START, config("t-1")))
    # The failing call waited for its sibling: the booking is recorded, not cut off.
    final = asyncio.run(app.ainvoke(None, config("t-1")))
    assert len(bookings(fake)) == 1
    assert tool_messages(final)["call_notify"]["status"] == "success"
    assert outcomes(spans, "book_room@1") == ["executed", "replayed"]


def test_a_fresh_process_resumes_from_a_sqlite_checkpointer(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, tmp_path: Path
) -> None:
    ledger = ledgers.fresh()  # creates the schema
    saver = str(tmp_path / "graph.sqlite")

    def worker(phase: str) -> subprocess.CompletedProcess[str]:
        args = [db_url, saver, fake.url, "t-proc", phase]
        return subprocess.run(
            [sys.executable, "-m", "tests.langgraph_graph", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = worker("first")
    assert first.returncode == 3, first.stderr
    resumed = worker("resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len(bookings(fake)) == 1
    assert '"call_book"' in resumed.stdout
    [booking] = ledger.effects(run_id="t-proc", effect="book_room@1")
    assert booking.status is EffectStatus.COMMITTED


def test_a_new_tool_call_id_at_the_same_position_replays_with_the_current_id(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    seen: list[ToolCallRequest] = []
    guard = ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY})

    def record(request: ToolCallRequest, execute: Any) -> ToolMessage | Command[Any]:
        seen.append(request)
        return guard.wrap_tool_call(request, execute)

    tools = Tools(fake.url, notify_failures=0)
    app = build(tools, InMemorySaver(), None)
    node = app.builder.nodes["tools"].runnable
    node._wrap_tool_call = record  # type: ignore[union-attr]  # capture the real requests
    app.invoke(START, config("t-1"))
    request = next(r for r in seen if r.tool_call["name"] == "book_room")

    # The model re-emits the message with new ids; the position and the task are the same.
    calls = [{**c, "id": f"new_{i}"} for i, c in enumerate(request.state["messages"][1].tool_calls)]
    state = {"messages": [*request.state["messages"][:1], AIMessage("", tool_calls=calls)]}
    renamed = request.override(tool_call={**request.tool_call, "id": "new_0"}, state=state)

    def must_not_run(_: ToolCallRequest) -> ToolMessage:
        raise AssertionError("the tool ran again")

    message = guard.wrap_tool_call(renamed, must_not_run)
    assert isinstance(message, ToolMessage)
    assert message.tool_call_id == "new_0"
    assert '"id": 1' in str(message.content)
    assert len(bookings(fake)) == 1


def test_class_b_reconciles_a_lost_answer_with_its_probe(
    fake: FakeProvider, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    fake.faults = ["cut"]  # booked, then the connection breaks before the answer
    guard = ToolGuard(
        ledgers.fresh(),
        policies={"book_room": ToolPolicy(provider_class="B", probe=lookup(fake))},
    )
    final = build(Tools(fake.url, notify_failures=0), InMemorySaver(), guard).invoke(
        START, config("t-1")
    )
    assert len(bookings(fake)) == 1
    assert '"id": 1' in tool_messages(final)["call_book"]["content"]
    assert outcomes(spans, "book_room@1") == ["reconciled"]


def test_class_a_resends_with_the_same_key_inside_its_window(ledgers: Ledgers) -> None:
    with running(FakeProvider(dedup=True, require_key=True, faults=["cut"])) as dedup:
        policy = ToolPolicy(
            provider_class="A", window_s=3600, retry=RetryPolicy(max_attempts=2, initial_s=0.0)
        )
        guard = ToolGuard(ledgers.fresh(), policies={"book_room": policy})
        build(Tools(dedup.url, notify_failures=0), InMemorySaver(), guard).invoke(
            START, config("t-1")
        )
        keys = bookings(dedup)
        assert len(keys) == 2  # the re-send reached the provider...
        assert len(set(keys)) == 1  # ...with the same key
        assert len(dedup.applied) == 1  # and booked once


def test_class_c_in_doubt_stops_the_run_until_an_operator_resolves_it(
    fake: FakeProvider, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    fake.faults = ["cut"]
    ledger = ledgers.fresh()
    app = build(Tools(fake.url, notify_failures=0), InMemorySaver(), ToolGuard(ledger))
    for _ in range(2):  # the first run, and a resume before anyone looked
        with pytest.raises(EffectInDoubt) as info:
            app.invoke(START if _ == 0 else None, config("t-1"))
        assert info.value.status == "needs_human"
    assert len(bookings(fake)) == 1  # never re-sent
    assert outcomes(spans, "book_room@1") == ["in_doubt", "in_doubt"]

    [entry] = ledger.effects(run_id="t-1", effect="book_room@1")
    booked = fake.applied[0][1]
    ledger.resolve(
        entry.key_id, happened=True, evidence="booking 1 in the console", actor="ops", result=booked
    )
    final = app.invoke(None, config("t-1"))
    assert len(bookings(fake)) == 1
    assert '"id": 1' in tool_messages(final)["call_book"]["content"]


def test_a_rejection_is_told_to_the_model_and_replayed_on_resume(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    fake.faults = ["reject"]  # 402: a definite refusal, nothing booked

    def classify(exc: BaseException) -> OutcomeClass:
        return OutcomeClass.REJECTED if isinstance(exc, PermissionError) else OutcomeClass.AMBIGUOUS

    policies = {"book_room": ToolPolicy(classify=classify), "notify": NOTIFY}
    app = build(Tools(fake.url), InMemorySaver(), ToolGuard(ledgers.fresh(), policies=policies))
    with pytest.raises(ConnectionRefusedError):
        app.invoke(START, config("t-1"))  # the refusal is recorded; notify stops the run
    final = app.invoke(None, config("t-1"))
    refused = tool_messages(final)["call_book"]
    assert refused["status"] == "error"
    assert "PermissionError: payment required" in refused["content"]
    assert len(bookings(fake)) == 1  # the refused request, not re-sent on resume


def test_a_graph_without_a_checkpointer_is_refused_before_acting(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    app = build(Tools(fake.url), None, ToolGuard(ledgers.fresh()))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="checkpointer"):
        app.invoke(START)
    assert bookings(fake) == []


def test_tool_policies_are_checked_when_made(ledgers: Ledgers) -> None:
    with pytest.raises(ConfigurationError, match="window_s"):
        ToolPolicy(provider_class="A")
    with pytest.raises(ConfigurationError, match="probe"):
        ToolPolicy(provider_class="B")
    with pytest.raises(ConfigurationError, match="class B"):
        ToolPolicy(provider_class="C", probe=lambda record: (Evidence.INCONCLUSIVE, None))
    guard = ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY})
    assert guard.policy("notify") is NOTIFY
    assert guard.policy("other").provider_class == "C"
    assert isinstance(guard.ledger, Ledger)
