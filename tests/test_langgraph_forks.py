"""``ToolGuard(forks=...)``: a time-travel fork does not repeat a call already made from
the checkpoint it copies, unless asked to.

``invoke(None, past_config)`` makes LangGraph copy the past checkpoint into a fork with a
new id, so its tasks get new ids; keyed by those alone, every fork of the same
checkpoint booked the room again (the ``forks="act"`` control shows it). The graph is
:mod:`tests.langgraph_graph`'s; the provider's raw request log is the oracle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from onceonly.adapters.langgraph import ToolGuard
from onceonly.checkpoint import ConfigurationError
from tests.http_fake import FakeProvider
from tests.langgraph_graph import NOTIFY, Tools, build, tool_messages
from tests.ledger_support import Ledgers

INPUT: Any = {"messages": [("user", "Book room r-12 and tell the guest")]}
CONFIG: Any = {"configurable": {"thread_id": "t-1"}}
R12 = {"room": "r-12", "night": "2025-05-01"}
R99 = {"room": "r-99", "night": "2025-05-01"}


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


def before_tools(app: Any) -> Any:
    """The config of the original run's checkpoint whose next step runs the tools."""
    history = list(app.get_state_history(CONFIG))
    [planned] = [h for h in history if h.next == ("tools",) and h.metadata["source"] == "loop"]
    return planned.config


def run(app: Any, start: Any, config: Any, api: str) -> Any:
    if api == "ainvoke":
        return asyncio.run(app.ainvoke(start, config))
    return app.invoke(start, config)


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_the_same_fork_taken_twice_books_once(
    fake: FakeProvider, ledgers: Ledgers, api: str
) -> None:
    tools = Tools(fake.url, notify_failures=0)
    guard = ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY})
    app = build(tools, InMemorySaver(), guard)
    run(app, INPUT, CONFIG, api)
    assert booked(fake) == [R12]
    past = before_tools(app)

    for _ in range(2):
        final = run(app, None, past, api)
        assert '"id": 1' in tool_messages(final)["call_book"]["content"]  # the recorded one
    assert booked(fake) == [R12]
    assert tools.sent == ["guest@example.com"]


def test_forks_act_again_when_asked_to(fake: FakeProvider, ledgers: Ledgers) -> None:
    """Positive control: ``forks="act"`` (the earlier behaviour) books on every fork."""
    tools = Tools(fake.url, notify_failures=0)
    guard = ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}, forks="act")
    app = build(tools, InMemorySaver(), guard)
    app.invoke(INPUT, CONFIG)
    past = before_tools(app)
    app.invoke(None, past)
    app.invoke(None, past)
    assert booked(fake) == [R12, R12, R12]
    assert len(tools.sent) == 3


def test_changed_arguments_act_once_per_change(fake: FakeProvider, ledgers: Ledgers) -> None:
    """``update_state`` plans another booking: it is made, once, and travelling back to
    either plan replays what that plan made."""
    tools = Tools(fake.url, notify_failures=0)
    app = build(tools, InMemorySaver(), ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    app.invoke(INPUT, CONFIG)
    past = before_tools(app)
    ai = app.get_state(past).values["messages"][-1]
    calls = [{**c, "args": R99} if c["name"] == "book_room" else c for c in ai.tool_calls]
    changed = app.update_state(
        past, {"messages": [ai.model_copy(update={"tool_calls": calls})]}, as_node="model"
    )
    app.invoke(None, changed)
    assert booked(fake) == [R12, R99]  # a new plan: acted

    app.invoke(None, changed)  # the changed plan again: a fork of it
    app.invoke(None, past)  # the original plan again
    assert booked(fake) == [R12, R99]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_bad_fork_policy_is_refused(ledgers: Ledgers) -> None:
    with pytest.raises(ConfigurationError, match="forks"):
        ToolGuard(ledgers.fresh(), forks="never")


def first_checkpoint(app: Any) -> Any:
    """The config of the original run's input checkpoint: a fork from it runs the model
    first, so its tools run from a later checkpoint of the fork's own lineage."""
    history = list(app.get_state_history(CONFIG))
    [start] = [h for h in history if h.metadata["source"] == "input"]
    return start.config


def latest_tools_checkpoint(app: Any, after: Any) -> Any:
    """The newest checkpoint (after ``after``'s id) whose next step runs the tools."""
    history = list(app.get_state_history(CONFIG))
    newer = after["configurable"]["checkpoint_id"]
    [planned] = [
        h
        for h in history
        if h.next == ("tools",) and h.config["configurable"]["checkpoint_id"] > newer
    ][:1]
    return planned.config


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_a_fork_from_an_earlier_super_step_books_once(
    fake: FakeProvider, ledgers: Ledgers, api: str
) -> None:
    """The fork's first super-step runs the model; its tools run from a checkpoint of the
    fork's own lineage (new ids), still the same calls as the original's from there."""
    tools = Tools(fake.url, notify_failures=0)
    guard = ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY})
    app = build(tools, InMemorySaver(), guard)
    run(app, INPUT, CONFIG, api)
    start = first_checkpoint(app)
    for _ in range(3):
        final = run(app, None, start, api)
        assert '"id": 1' in tool_messages(final)["call_book"]["content"]
    assert booked(fake) == [R12]
    assert tools.sent == ["guest@example.com"]


def test_a_fork_of_a_forks_later_checkpoint_books_once(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """Time travel to a checkpoint inside a fork's lineage: placed through that fork back
    to the original run's call."""
    tools = Tools(fake.url, notify_failures=0)
    app = build(tools, InMemorySaver(), ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    app.invoke(INPUT, CONFIG)
    start = first_checkpoint(app)
    app.invoke(None, start)
    inside = latest_tools_checkpoint(app, start)
    app.invoke(None, inside)
    app.invoke(None, inside)
    assert booked(fake) == [R12]
    assert tools.sent == ["guest@example.com"]


def test_an_edited_state_is_a_new_plan_and_its_forks_replay_it(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """``update_state`` before the model makes a new plan (not a time-travel copy): its
    calls act, once; taking it again (a fork of the edit) or the original start again
    replays what each made."""
    tools = Tools(fake.url, notify_failures=0)
    app = build(tools, InMemorySaver(), ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    app.invoke(INPUT, CONFIG)
    start = first_checkpoint(app)
    edited = app.update_state(start, {"messages": [("user", "make it r-99")]}, as_node="__input__")
    app.invoke(None, edited)
    assert booked(fake) == [R12, R12]  # the scripted model plans the same booking anew
    app.invoke(None, edited)
    app.invoke(None, start)
    assert booked(fake) == [R12, R12]
    assert tools.sent == ["guest@example.com"] * 2


def test_forks_from_an_earlier_super_step_act_again_when_asked_to(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """Positive control for the lineage walk: ``forks="act"`` books on every fork."""
    tools = Tools(fake.url, notify_failures=0)
    guard = ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}, forks="act")
    app = build(tools, InMemorySaver(), guard)
    app.invoke(INPUT, CONFIG)
    start = first_checkpoint(app)
    app.invoke(None, start)
    app.invoke(None, start)
    assert booked(fake) == [R12, R12, R12]


class CountingSaver(InMemorySaver):
    """Counts the checkpoints the guard reads back (``get_tuple``)."""

    reads = 0

    def get_tuple(self, config: Any) -> Any:
        self.reads += 1
        return super().get_tuple(config)


def test_placing_a_fork_does_not_read_the_whole_thread(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    """A long thread forked near its end: the guard climbs from the fork to the
    checkpoint it copies and stops at the thread's oldest fork (checkpoint ids are
    time-ordered), instead of reading every checkpoint back to the first."""
    tools = Tools(fake.url, notify_failures=0)
    saver = CountingSaver()
    app = build(tools, saver, ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    for turn in range(12):
        app.invoke({"messages": [("user", f"turn {turn}: book r-12")]}, CONFIG)
    history = list(app.get_state_history(CONFIG))
    assert len(history) > 50
    past = next(h.config for h in history if h.next == ("tools",))  # the newest
    made = len(booked(fake))
    # A new guard (as in a fresh process): nothing of the thread is remembered.
    app = build(tools, saver, ToolGuard(ledgers.fresh(), policies={"notify": NOTIFY}))
    saver.reads = 0
    app.invoke(None, past)
    assert len(booked(fake)) == made  # replayed
    assert saver.reads < 20, saver.reads
