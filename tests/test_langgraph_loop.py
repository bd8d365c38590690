"""A node that calls a ``ToolNode`` more than once in one task: every call is its own effect.

The key of a tool call used to be ``<checkpoint_ns>/tool_calls[index]``: the task and
the call's index in its ``AIMessage``. A node that loops model -> ``ToolNode`` inside one
task gave the first call of every invocation the same key: two different bookings
failed with ``KeyReuseError``, two identical ones ran once and the second was answered
with the first's recorded result (a lost effect). The key now holds the position of the
call's ``AIMessage`` in the message list too, except for the one batch the short form
always meant (a ``ToolNode`` as the node, a ``Send`` to it, the node's first batch), so
runs recorded before keep replaying.

The graphs are :mod:`tests.langgraph_loop`'s; the counting provider on 127.0.0.1 is the
oracle. The planted defect (:class:`tests.langgraph_loop.Short`, the old key form) and an
unguarded graph are the positive controls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import ToolNode, create_react_agent
from langgraph.warnings import LangGraphDeprecatedSinceV10

from onceonly.adapters.langgraph import ToolGuard
from onceonly.ledger import EffectStatus, KeyReuseError, Ledger
from tests.conftest import BACKENDS
from tests.http_fake import FakeProvider
from tests.langgraph_loop import (
    INPUT,
    PLANS,
    R12,
    R14,
    Short,
    booking_tools,
    build,
    contents,
    policies,
)
from tests.ledger_support import Ledgers

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ["loop", "loop-subgraph"]
CALLS = {plan: sum(len(message) for message in steps) for plan, steps in PLANS.items()}


def config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A provider that does not deduplicate: every booking request books a room."""
    provider = FakeProvider(dedup=False, require_key=False)
    try:
        provider.start()
        yield provider
    finally:
        provider.stop()


def booked(fake: FakeProvider) -> list[dict[str, Any]]:
    """The body of every booking request that reached the provider, in order."""
    return [json.loads(r.body) for r in fake.writes if r.path == "/bookings"]


def expected(plan: str) -> list[dict[str, str]]:
    return [args for message in PLANS[plan] for args in message]


def rooms(answers: Sequence[Any]) -> list[str]:
    return [json.loads(answer)["request"]["room"] for answer in answers]


def run(app: Any, start: Any, thread: str, api: str) -> Any:
    if api == "ainvoke":
        return asyncio.run(app.ainvoke(start, config(thread)))
    return app.invoke(start, config(thread))


def committed(ledger: Ledger, thread: str) -> list[str]:
    """The step ids of the thread's committed entries, sorted."""
    records = ledger.effects(run_id=thread)
    assert {r.status for r in records} <= {EffectStatus.COMMITTED}
    return sorted(r.step_id or "" for r in records)


# -- in one process ------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("shape", LOOPS)
def test_a_model_tool_loop_in_one_node_makes_every_booking_once(
    fake: FakeProvider, ledgers: Ledgers, shape: str, plan: str, api: str
) -> None:
    ledger = ledgers.fresh()
    app = build(
        fake.url,
        InMemorySaver(),
        ToolGuard(ledger, policies=policies(fake.url)),
        shape=shape,
        plan=plan,
    )
    final = run(app, INPUT, "t-1", api)

    assert booked(fake) == expected(plan)  # identical bookings too: each one delivered
    answers = contents(final)
    assert len(set(answers)) == CALLS[plan]  # each answer is its own booking's
    assert rooms(answers) == [args["room"] for args in expected(plan)]
    steps = committed(ledger, "t-1")
    assert len(set(steps)) == CALLS[plan]
    # The node's first batch keeps the short form; later batches hold their position.
    assert sum("/messages[" not in s for s in steps) == len(PLANS[plan][0])


@pytest.mark.parametrize("plan", ["different", "same"])
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the ledger is not the subject
def test_the_old_key_form_collides_in_a_loop(
    fake: FakeProvider, ledgers: Ledgers, plan: str
) -> None:
    """Positive control: keyed by the index in the message alone, the second booking
    is refused (other arguments) or silently answered with the first's result."""
    app = build(
        fake.url, InMemorySaver(), Short(ledgers.fresh(), policies=policies(fake.url)), plan=plan
    )
    if plan == "different":
        with pytest.raises(KeyReuseError):
            app.invoke(INPUT, config("t-1"))
        assert booked(fake) == [R12]
    else:
        final = app.invoke(INPUT, config("t-1"))
        assert booked(fake) == [R12]  # the second booking was lost
        first, second = contents(final)
        assert first == second


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("shape", ["graph", "send"])
def test_a_tool_node_as_the_node_keeps_one_effect_each_and_the_short_key(
    fake: FakeProvider, ledgers: Ledgers, shape: str, plan: str, api: str
) -> None:
    """The usual ReAct graph and a Send fan-out: one batch per task, keyed as before the
    fix (so runs recorded by an older release replay)."""
    ledger = ledgers.fresh()
    app = build(
        fake.url,
        InMemorySaver(),
        ToolGuard(ledger, policies=policies(fake.url)),
        shape=shape,
        plan=plan,
    )
    final = run(app, INPUT, "t-1", api)
    assert booked(fake) == expected(plan)
    assert len(set(contents(final))) == CALLS[plan]
    steps = committed(ledger, "t-1")
    assert len(steps) == CALLS[plan]
    assert all(s.startswith("tools:") and "/messages[" not in s for s in steps)
    if shape == "graph" and plan == "parallel":
        assert sorted(s.rpartition("/")[2] for s in steps) == [
            "tool_calls[0]",
            "tool_calls[0]",
            "tool_calls[1]",
        ]


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
@pytest.mark.parametrize("plan", ["different", "same"])
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_re_run_of_the_loop_in_this_process_replays_every_call(
    fake: FakeProvider, ledgers: Ledgers, plan: str, api: str
) -> None:
    """The node fails after both bookings; the resume re-runs the same task (new tool
    call ids, another ledger view): every call is answered from the ledger."""
    saver = InMemorySaver()
    first = build(
        fake.url,
        saver,
        ToolGuard(ledgers.fresh(), policies=policies(fake.url)),
        plan=plan,
        fail_at_end=True,
    )
    with pytest.raises(ConnectionError):
        run(first, INPUT, "t-1", api)
    assert booked(fake) == expected(plan)

    again = build(
        fake.url, saver, ToolGuard(ledgers.fresh(), policies=policies(fake.url)), plan=plan
    )
    final = run(again, None, "t-1", api)
    assert booked(fake) == expected(plan)
    answers = contents(final)
    assert sorted(json.loads(a)["id"] for a in answers) == [1, 2]
    assert rooms(answers) == [args["room"] for args in expected(plan)]


# -- create_react_agent (deprecated in LangGraph 1.0, still shipped) -----------------------


class _ScriptedChat(GenericFakeChatModel):
    """A chat model that answers from a script and accepts any tools."""

    def bind_tools(self, tools: Any, **_: Any) -> Any:
        return self


def _script(plan: str) -> Iterator[AIMessage]:
    for i, message in enumerate(PLANS[plan]):
        calls = [
            {"name": "book_room", "args": args, "id": f"call_{i}_{j}"}
            for j, args in enumerate(message)
        ]
        yield AIMessage("", tool_calls=calls)
    yield AIMessage("All booked.")


@pytest.mark.parametrize("plan", list(PLANS))
def test_create_react_agent_makes_every_booking_once(
    fake: FakeProvider, ledgers: Ledgers, plan: str
) -> None:
    ledger = ledgers.fresh()
    guard = ToolGuard(ledger, policies=policies(fake.url))
    node = ToolNode(
        booking_tools(fake.url),
        wrap_tool_call=guard.wrap_tool_call,
        awrap_tool_call=guard.awrap_tool_call,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LangGraphDeprecatedSinceV10)
        agent = create_react_agent(
            _ScriptedChat(messages=_script(plan)), node, checkpointer=InMemorySaver()
        )
    final = agent.invoke(INPUT, config("t-1"))
    assert booked(fake) == expected(plan)
    assert len({m.content for m in final["messages"] if isinstance(m, ToolMessage)}) == CALLS[plan]
    steps = committed(ledger, "t-1")
    assert len(steps) == CALLS[plan]
    assert all("/messages[" not in s for s in steps)


# -- across processes: SIGKILL after the second booking, resume in a fresh process --------


class Worker:
    """Runs :mod:`tests.langgraph_loop`'s worker in a fresh process."""

    def __init__(self, db_url: str, saver_path: Path, fake: FakeProvider) -> None:
        self.args = [db_url, str(saver_path), fake.url, "t-crash"]

    def __call__(self, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.langgraph_loop", *self.args, *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


@contextlib.contextmanager
def worker(
    db_url: str, tmp_path: Path, fake: FakeProvider, ledgers: Ledgers
) -> Iterator[tuple[Worker, Ledger]]:
    ledger = ledgers.fresh()  # creates the ledger's schema
    yield Worker(db_url, tmp_path / "graph.sqlite", fake), ledger


def _crash_params() -> list[Any]:
    params = []
    for backend in BACKENDS:
        for shape in LOOPS:
            for plan in ("different", "same"):
                for kill in ("effect", "recorded"):
                    if backend != "sqlite" and (shape, kill) != ("loop", "effect"):
                        continue  # PostgreSQL: the ledger's half, once per plan
                    params.append(
                        pytest.param(
                            backend, shape, plan, kill, id=f"{backend}-{shape}-{plan}-{kill}"
                        )
                    )
    return params


@pytest.mark.slow
@pytest.mark.parametrize(("db_url", "shape", "plan", "kill"), _crash_params(), indirect=["db_url"])
def test_a_kill_after_the_second_booking_resumes_without_a_third(
    fake: FakeProvider,
    ledgers: Ledgers,
    db_url: str,
    shape: str,
    plan: str,
    kill: str,
    tmp_path: Path,
) -> None:
    with worker(db_url, tmp_path, fake, ledgers) as (work, ledger):
        common = ["--shape", shape, "--plan", plan]
        killed = work(*common, "--kill", kill, "--at", "2")
        assert killed.returncode == -9, killed.stderr
        assert booked(fake) == expected(plan)

        resumed = work(*common, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        assert booked(fake) == expected(plan)  # no third delivery
        answers = json.loads(resumed.stdout)
        assert rooms(answers) == [args["room"] for args in expected(plan)]
        # Each answer is its own booking's (the provider numbers them 1, 2).
        assert sorted(json.loads(a)["id"] for a in answers) == [1, 2]
        assert len(committed(ledger, "t-crash")) == 2


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_without_the_guard_the_resume_books_again(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, tmp_path: Path
) -> None:
    """Positive control: the same crash and resume, unguarded, re-runs the node's loop."""
    with worker(db_url, tmp_path, fake, ledgers) as (work, _):
        common = ["--plan", "different", "--guard", "none"]
        assert work(*common, "--kill", "effect", "--at", "2").returncode == -9
        resumed = work(*common, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        assert booked(fake) == [R12, R14, R12, R14]


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_resume_that_re_plans_a_later_batch_with_other_arguments_is_refused(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, tmp_path: Path
) -> None:
    """The node re-runs with a model that now books r-12 twice: the second position was
    recorded with r-14, so the run stops with KeyReuseError and nothing is sent."""
    with worker(db_url, tmp_path, fake, ledgers) as (work, _):
        assert work("--plan", "different", "--kill", "recorded", "--at", "2").returncode == -9
        resumed = work("--plan", "same", "--resume")
        assert resumed.returncode == 6, resumed.stderr
        assert booked(fake) == [R12, R14]
