"""``ToolGuard(in_doubt="interrupt")``: an in-doubt tool call interrupts the run, and a
``Command(resume=...)`` settles it in the ledger.

The graph is :mod:`tests.langgraph_graph`'s (a scripted model asks for ``book_room`` and
``notify`` in one message); ``book_room`` is class C (no dedup, no probe). The fake
provider on 127.0.0.1 breaks the connection after booking (``cut``: it happened) or
answers 500 before booking (``error``: it did not); the guard cannot tell which, so the
call is in doubt. The provider's own lists — every raw booking request and every booking
it applied — are the oracle, never the ledger.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from onceonly.adapters.langgraph import ToolGuard
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import EffectInDoubt, EffectStatus, Ledger
from tests.http_fake import FakeProvider
from tests.langgraph_graph import NOTIFY, Tools, build, tool_messages
from tests.ledger_support import Ledgers

INPUT: Any = {"messages": [("user", "Book room r-12 and tell the guest")]}
R12 = {"room": "r-12", "night": "2025-05-01"}


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


def requests(fake: FakeProvider) -> int:
    """Booking requests that reached the provider."""
    return sum(1 for r in fake.writes if r.path == "/bookings")


def applied(fake: FakeProvider) -> int:
    """Bookings the provider made."""
    return len(fake.applied)


def app_for(fake: FakeProvider, ledger: Ledger, saver: InMemorySaver) -> Any:
    guard = ToolGuard(ledger, policies={"notify": NOTIFY}, in_doubt="interrupt")
    return build(Tools(fake.url, notify_failures=0), saver, guard)


def run(app: Any, start: Any, thread: str, api: str) -> Any:
    if api == "ainvoke":
        return asyncio.run(app.ainvoke(start, config(thread)))
    return app.invoke(start, config(thread))


def asked(result: dict[str, Any]) -> dict[str, Any]:
    [prompt] = [i.value for i in result.get("__interrupt__", ())]
    assert prompt["kind"] == "onceonly.in_doubt"
    return dict(prompt)


def decision(prompt: dict[str, Any], *, happened: bool, **extra: Any) -> Command[Any]:
    answer = {"resolve": prompt["key_id"], "epoch": prompt["epoch"], "happened": happened}
    return Command(resume={**answer, "actor": "ops@example.com", **extra})


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_happened_replays_the_provider_result_and_never_sends_again(
    fake: FakeProvider, ledgers: Ledgers, api: str
) -> None:
    fake.faults = ["cut"]  # booked, then the answer is lost
    saver = InMemorySaver()
    ledger = ledgers.fresh()
    prompt = asked(run(app_for(fake, ledger, saver), INPUT, "t-1", api))
    assert (requests(fake), applied(fake)) == (1, 1)
    assert prompt["tool"] == "book_room"
    assert prompt["args"] == R12
    assert prompt["provider_class"] == "C"
    assert prompt["status"] == "needs_human"
    assert prompt["choices"] == ["happened", "not_happened"]
    assert "RemoteProtocolError" in prompt["evidence"]
    [entry] = ledger.effects(run_id="t-1", effect="book_room@1")
    assert (prompt["key_id"], prompt["epoch"]) == (entry.key_id, entry.epoch)
    assert prompt["provider_key"] == entry.provider_key
    # The sibling acted and was recorded: no ticket for it.
    [notify] = ledger.effects(run_id="t-1", effect="notify@1")
    assert notify.status is EffectStatus.COMMITTED

    # Resumed by another process's view of the ledger, with what the provider shows.
    booked = fake.applied[0][1]
    again = app_for(fake, ledgers.fresh(), saver)
    resume = decision(prompt, happened=True, evidence="booking 1 found", result=booked)
    final = run(again, resume, "t-1", api)
    assert "__interrupt__" not in final
    assert json.loads(tool_messages(final)["call_book"]["content"]) == booked
    assert (requests(fake), applied(fake)) == (1, 1)
    assert ledger.get(entry.key_id).status is EffectStatus.COMMITTED
    events = ledger.audit_events("t-1", key_ids=[entry.key_id])
    assert ("resolved", "ops@example.com", "booking 1 found") in [
        (e["event"], e["actor"], e["detail"]) for e in events
    ]


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_not_happened_sends_once_more(fake: FakeProvider, ledgers: Ledgers, api: str) -> None:
    fake.faults = ["error"]  # 500 before booking: nothing happened, but the guard can't know
    saver = InMemorySaver()
    ledger = ledgers.fresh()
    app = app_for(fake, ledger, saver)
    prompt = asked(run(app, INPUT, "t-1", api))
    assert (requests(fake), applied(fake)) == (1, 0)

    final = run(app, decision(prompt, happened=False), "t-1", api)
    assert "__interrupt__" not in final
    assert (requests(fake), applied(fake)) == (2, 1)
    assert '"id": 1' in tool_messages(final)["call_book"]["content"]
    [entry] = ledger.effects(run_id="t-1", effect="book_room@1")
    assert entry.status is EffectStatus.COMMITTED
    assert entry.epoch == prompt["epoch"] + 1
    # A resume of the finished run sends nothing.
    run(app, None, "t-1", api)
    assert (requests(fake), applied(fake)) == (2, 1)


def test_a_decision_about_an_earlier_epoch_does_not_settle_a_new_doubt(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """Not happened, sent again, in doubt again (and this time it happened): the task's
    re-run replays the first decision, which must not be applied to the new attempt."""
    fake.faults = ["error", "cut"]
    ledger = ledgers.fresh()
    app = app_for(fake, ledger, InMemorySaver())
    first = asked(app.invoke(INPUT, config("t-1")))
    second = asked(app.invoke(decision(first, happened=False), config("t-1")))
    assert second["key_id"] == first["key_id"]
    assert second["epoch"] == first["epoch"] + 1
    assert (requests(fake), applied(fake)) == (2, 1)

    final = app.invoke(decision(second, happened=True, result={"id": 1}), config("t-1"))
    assert "__interrupt__" not in final
    assert (requests(fake), applied(fake)) == (2, 1)  # the stale "not happened" sent nothing


def test_an_answer_that_does_not_fit_asks_again_and_sends_nothing(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    fake.faults = ["cut"]
    ledger = ledgers.fresh()
    app = app_for(fake, ledger, InMemorySaver())
    prompt = asked(app.invoke(INPUT, config("t-1")))
    answers: list[Any] = [
        "yes",
        {"resolve": prompt["key_id"], "epoch": prompt["epoch"], "happened": False},  # no actor
        {"resolve": "0" * 64, "epoch": prompt["epoch"], "happened": False, "actor": "ops"},
        {
            "resolve": prompt["key_id"],
            "epoch": prompt["epoch"] + 7,
            "happened": False,
            "actor": "o",
        },
        {"resolve": prompt["key_id"], "epoch": prompt["epoch"], "happened": "no", "actor": "ops"},
    ]
    for answer in answers:
        again = asked(app.invoke(Command(resume=answer), config("t-1")))
        assert again["refused_answer"]
        assert (again["key_id"], again["epoch"]) == (prompt["key_id"], prompt["epoch"])
    assert (requests(fake), applied(fake)) == (1, 1)
    [entry] = ledger.effects(run_id="t-1", effect="book_room@1")
    assert entry.status is EffectStatus.NEEDS_HUMAN


def test_happened_without_a_result_tells_the_model_it_happened(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    fake.faults = ["cut"]
    app = app_for(fake, ledgers.fresh(), InMemorySaver())
    prompt = asked(app.invoke(INPUT, config("t-1")))
    final = app.invoke(decision(prompt, happened=True), config("t-1"))
    message = tool_messages(final)["call_book"]
    assert message["status"] == "success"
    assert "happened" in message["content"]
    assert (requests(fake), applied(fake)) == (1, 1)


def test_a_decision_from_the_console_is_honoured_on_resume(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    fake.faults = ["cut"]
    ledger = ledgers.fresh()
    app = app_for(fake, ledger, InMemorySaver())
    prompt = asked(app.invoke(INPUT, config("t-1")))
    ledger.resolve(prompt["key_id"], happened=True, evidence="seen", actor="ops", result="ok")
    final = app.invoke(None, config("t-1"))
    assert tool_messages(final)["call_book"]["content"] == "ok"
    assert (requests(fake), applied(fake)) == (1, 1)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_default_still_raises_and_a_bad_mode_is_refused(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """Positive control: without the opt-in, the run stops with ``EffectInDoubt`` outside
    LangGraph (the behaviour of earlier releases)."""
    fake.faults = ["cut"]
    ledger = ledgers.fresh()
    app = build(Tools(fake.url, notify_failures=0), InMemorySaver(), ToolGuard(ledger))
    with pytest.raises(EffectInDoubt):
        app.invoke(INPUT, config("t-1"))
    with pytest.raises(ConfigurationError, match="in_doubt"):
        ToolGuard(ledger, in_doubt="ask")
