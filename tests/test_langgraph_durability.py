"""``ToolGuard`` under every LangGraph durability mode: a tool acts only from a saved plan.

The key of a tool call holds LangGraph's task id, which derives from the checkpoint the
super-step was planned from. Under ``durability="async"`` that checkpoint is saved while
the step runs; a crash after the tool acted and before the save landed resumes from an
older checkpoint, re-plans the step and gets a new task id, so the tool acted twice. The
guard now waits until the checkpointer holds the checkpoint (and every enclosing graph's)
before the first call, refuses ``durability="exit"`` for calls planned from unsaved
checkpoints, and a subgraph that never saves.

The crash tests run the graph of :mod:`tests.langgraph_durability` in child processes,
SIGKILL it right after the provider applied a booking, and resume in a fresh process with
``invoke(None, config)``; the counting provider in this process is the oracle. A slow
checkpointer (``--hold``) makes the async window certain; the planted defect (the guard
without its wait) shows that the window is real: it books twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolCall, ToolMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from onceonly.adapters.langgraph import PlanNotDurable, ToolGuard, ToolPolicy
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import EffectStatus, KeyReuseError, Ledger
from tests.conftest import BACKENDS
from tests.http_fake import FakeProvider
from tests.langgraph_durability import HeldSaver, Unwaiting, build, lookup_probe
from tests.ledger_support import Ledgers

ROOT = Path(__file__).resolve().parent.parent
START: Any = {"messages": [("user", "Book r-12 and tell the guest")]}
SHAPES = ["message", "subgraph", "send"]


def config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A provider that does not deduplicate: every write request takes effect."""
    provider = FakeProvider(dedup=False, require_key=False)
    try:
        provider.start()
        yield provider
    finally:
        provider.stop()


def deliveries(fake: FakeProvider) -> dict[str, int]:
    """How many write requests reached each of the provider's endpoints."""
    counts = {"/bookings": 0, "/notifications": 0}
    for request in fake.writes:
        counts[request.path] += 1
    return counts


ONCE = {"/bookings": 1, "/notifications": 1}


def policies(fake: FakeProvider) -> dict[str, ToolPolicy]:
    policy = ToolPolicy(provider_class="B", probe=lookup_probe(fake.url))
    return {"book_room": policy, "notify": policy}


def unsaved(saver: BaseCheckpointSaver[Any], request: ToolCallRequest) -> list[str]:
    """The namespaces whose planning checkpoint ``saver`` does not hold for ``request``."""
    conf = request.runtime.config["configurable"]
    return [
        ns
        for ns, checkpoint_id in conf["checkpoint_map"].items()
        if saver.get_tuple(
            {
                "configurable": {
                    "thread_id": conf["thread_id"],
                    "checkpoint_ns": ns,
                    "checkpoint_id": checkpoint_id,
                }
            }
        )
        is None
    ]


def run(app: Any, start: Any, thread: str, *, durability: str, api: str) -> Any:
    if api == "ainvoke":
        return asyncio.run(app.ainvoke(start, config(thread), durability=durability))
    return app.invoke(start, config(thread), durability=durability)


# -- in one process: the call acts only once its checkpoint is saved ---------------------


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("kind", "durability"), [("guard", "sync"), ("guard", "async"), ("planted defect", "async")]
)
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the ledger is not the subject
def test_a_call_acts_only_once_the_checkpoint_it_was_planned_from_is_saved(
    fake: FakeProvider, ledgers: Ledgers, kind: str, shape: str, durability: str, api: str
) -> None:
    memory = InMemorySaver()
    # Under async the save of a checkpoint that plans the tools step is slow (held until
    # someone asks for it); under sync LangGraph waits for it before the step anyway.
    saver: BaseCheckpointSaver[Any] = HeldSaver(memory) if durability == "async" else memory
    seen: list[list[str]] = []

    def before_act(request: ToolCallRequest) -> None:
        seen.append(unsaved(memory, request))
        if isinstance(saver, HeldSaver):
            saver.release()  # let the run finish (the planted defect never asks)

    guards = {"guard": ToolGuard, "planted defect": Unwaiting}
    guard = guards[kind](ledgers.fresh(), policies=policies(fake))
    app = build(fake.url, saver, guard, shape=shape, before_act=before_act)
    final = run(app, START, "t-1", durability=durability, api=api)

    assert deliveries(fake) == ONCE
    assert len([m for m in final["messages"] if isinstance(m, ToolMessage)]) == 2
    assert len(seen) == 2
    if kind == "guard":
        assert seen == [[], []]
    else:  # positive control: the calls acted while their plan was not saved
        assert any(seen), seen


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
def test_exit_durability_refuses_the_call_then_a_resume_acts_from_the_saved_checkpoint(
    fake: FakeProvider, ledgers: Ledgers, api: str
) -> None:
    ledger = ledgers.fresh()
    app = build(fake.url, InMemorySaver(), ToolGuard(ledger, policies=policies(fake)))
    with pytest.raises(PlanNotDurable, match="durability='exit'") as info:
        run(app, START, "t-1", durability="exit", api=api)
    assert info.value.durability == "exit"
    assert info.value.thread_id == "t-1"
    assert info.value.checkpoint_ns == ""
    assert fake.writes == []
    assert ledger.effects(run_id="t-1") == []

    # LangGraph saved the checkpoint as the run exited: the same plan is now durable.
    final = run(app, None, "t-1", durability="exit", api=api)
    assert deliveries(fake) == ONCE
    assert len([m for m in final["messages"] if isinstance(m, ToolMessage)]) == 2


def test_a_subgraph_that_never_saves_its_checkpoints_is_refused(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    ledger = ledgers.fresh()
    guard = ToolGuard(ledger, policies=policies(fake), checkpoint_wait_s=0.2)
    app = build(fake.url, InMemorySaver(), guard, shape="subgraph", inner_checkpointer=False)
    with pytest.raises(PlanNotDurable, match="checkpointer=False") as info:
        app.invoke(START, config("t-1"))
    assert info.value.checkpoint_ns.startswith("agent:")
    assert info.value.durability == "async"
    assert fake.writes == []
    assert ledger.effects(run_id="t-1") == []


def test_a_thread_without_a_checkpointer_is_refused_before_acting(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    app = build(fake.url, None, ToolGuard(ledgers.fresh(), policies=policies(fake)))
    with pytest.raises(ConfigurationError, match="checkpointer"):
        app.invoke(START, config("t-1"))
    assert fake.writes == []


def test_the_wait_must_be_positive(ledgers: Ledgers) -> None:
    with pytest.raises(ConfigurationError, match="checkpoint_wait_s"):
        ToolGuard(ledgers.fresh(), checkpoint_wait_s=0)


def test_a_re_planned_call_with_other_arguments_at_the_same_position_is_refused(
    fake: FakeProvider, ledgers: Ledgers
) -> None:
    ledger = ledgers.fresh()
    guard = ToolGuard(ledger, policies=policies(fake))
    requests: list[ToolCallRequest] = []
    app = build(fake.url, InMemorySaver(), guard, before_act=requests.append)
    app.invoke(START, config("t-1"))
    request = next(r for r in requests if r.tool_call["name"] == "book_room")

    # The same position (thread, task, index) with another room: the run diverged.
    moved = ToolCall(name="book_room", args={"room": "r-13", "night": "2025-05-01"}, id="call_book")
    messages = request.state["messages"]
    ai = messages[1].model_copy(update={"tool_calls": [moved, *messages[1].tool_calls[1:]]})
    other = request.override(tool_call=moved, state={"messages": [messages[0], ai]})

    def must_not_run(_: ToolCallRequest) -> ToolMessage | Command[Any]:
        raise AssertionError("the tool ran again")

    with pytest.raises(KeyReuseError):
        guard.wrap_tool_call(other, must_not_run)
    assert deliveries(fake) == ONCE


# -- across processes: SIGKILL right after the effect, resume in a fresh process ----------


def _savers() -> list[Any]:
    """(saver, ledger backend): SqliteSaver on a file; OnceOnlySaver in the ledger's db."""
    params = [
        pytest.param("sqlite", "sqlite", id="SqliteSaver"),
        pytest.param("onceonly", "sqlite", id="OnceOnlySaver-sqlite"),
    ]
    if "postgresql" in BACKENDS:
        params.append(pytest.param("onceonly", "postgresql", id="OnceOnlySaver-postgresql"))
    return params


class Worker:
    """Runs the graph's worker in a fresh process against one ledger, saver and provider."""

    def __init__(self, db_url: str, saver: str, saver_path: Path, fake: FakeProvider) -> None:
        self.args = [db_url, saver, str(saver_path), fake.url, "t-crash"]

    def __call__(self, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.langgraph_durability", *self.args, *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


@contextlib.contextmanager
def worker(
    db_url: str, saver: str, tmp_path: Path, fake: FakeProvider, ledgers: Ledgers
) -> Iterator[tuple[Worker, Ledger]]:
    ledger = ledgers.fresh()  # creates the ledger's schema
    yield Worker(db_url, saver, tmp_path / "graph.sqlite", fake), ledger


def crash_then_resume(
    work: Worker, *, shape: str, durability: str, kill: str, guard: str = "guard"
) -> subprocess.CompletedProcess[str]:
    """The first run, killed by ``kill``; the resume in a fresh process (its result)."""
    common = ["--shape", shape, "--durability", durability, "--guard", guard]
    if durability == "exit":
        refused = work(*common)
        assert refused.returncode == 4, refused.stderr  # PlanNotDurable: nothing sent
        assert "durability='exit'" in refused.stderr
        killed = work(*common, "--resume", "--kill", kill)
    else:
        hold = ["--hold"] if durability == "async" else []  # the save lands late
        killed = work(*common, "--kill", kill, *hold)
    assert killed.returncode == -9, killed.stderr  # SIGKILL after the provider applied it
    return work(*common, "--resume")


def assert_once(
    resumed: subprocess.CompletedProcess[str], fake: FakeProvider, ledger: Ledger
) -> None:
    assert resumed.returncode == 0, resumed.stderr
    assert deliveries(fake) == ONCE
    messages = json.loads(resumed.stdout)
    assert '"room": "r-12"' in messages["call_book"]["content"]
    assert '"to": "guest@example.com"' in messages["call_notify"]["content"]
    records = ledger.effects(run_id="t-crash")
    assert sorted((r.effect, r.status) for r in records) == [
        ("book_room@1", EffectStatus.COMMITTED),
        ("notify@1", EffectStatus.COMMITTED),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
@pytest.mark.parametrize(("saver", "db_url"), _savers(), indirect=["db_url"])
def test_a_kill_right_after_the_booking_delivers_it_once(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, saver: str, durability: str, tmp_path: Path
) -> None:
    with worker(db_url, saver, tmp_path, fake, ledgers) as (work, ledger):
        resumed = crash_then_resume(work, shape="message", durability=durability, kill="effect")
        assert_once(resumed, fake, ledger)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "kill"), [("message", "recorded"), ("subgraph", "effect"), ("send", "recorded")]
)
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_subgraphs_send_fan_out_and_a_recorded_call_deliver_once_under_async(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, shape: str, kill: str, tmp_path: Path
) -> None:
    with worker(db_url, "sqlite", tmp_path, fake, ledgers) as (work, ledger):
        resumed = crash_then_resume(work, shape=shape, durability="async", kill=kill)
        assert_once(resumed, fake, ledger)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["message", "subgraph"])  # every shape in one process above
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_planted_defect_books_twice_under_async(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, shape: str, tmp_path: Path
) -> None:
    """Positive control: without the wait, the resume re-plans the step and books again."""
    with worker(db_url, "sqlite", tmp_path, fake, ledgers) as (work, _):
        resumed = crash_then_resume(
            work, shape=shape, durability="async", kill="effect", guard="unwaiting"
        )
        assert resumed.returncode == 0, resumed.stderr
        assert deliveries(fake)["/bookings"] == 2
