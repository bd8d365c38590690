"""``create_agent`` (``ToolGuard.middleware()``) and the functional API (``ToolGuard.task``):
a SIGKILL right after the booking reached the provider, a resume in a fresh process, one
booking. Control: the same shapes unguarded book twice.

The graphs are :mod:`tests.langgraph_shapes`'; the counting provider in this process is
the oracle. The ToolNode shapes (a message's calls, a subgraph, ``Send`` fan-out) have
the same test in ``tests/test_langgraph_durability.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task

from onceonly.adapters.langgraph import ToolGuard
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import EffectStatus
from tests.conftest import BACKENDS
from tests.http_fake import FakeProvider
from tests.ledger_support import Ledgers

ROOT = Path(__file__).resolve().parent.parent


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
    counts = {"/bookings": 0, "/notifications": 0}
    for request in fake.writes:
        counts[request.path] += 1
    return counts


def worker(
    db_url: str, saver: Path, fake: FakeProvider, shape: str, *flags: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.langgraph_shapes",
            db_url,
            str(saver),
            fake.url,
            "t-1",
            "--shape",
            shape,
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def crash_and_resume(
    db_url: str, tmp_path: Path, fake: FakeProvider, shape: str, *flags: str
) -> Any:
    saver = tmp_path / "graph.sqlite"
    first = worker(db_url, saver, fake, shape, *flags)
    assert first.returncode == -9, first.stderr  # SIGKILLed after the booking
    assert deliveries(fake)["/bookings"] == 1
    resumed = worker(db_url, saver, fake, shape, *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    return json.loads(resumed.stdout)


def check_one_booking(fake: FakeProvider, final: Any, shape: str) -> None:
    assert deliveries(fake) == {"/bookings": 1, "/notifications": 1}
    # The answer the resumed run got is the provider's answer to the one booking.
    [booking] = [answer for _, answer in fake.applied if "room" in answer["request"]]
    booked = json.loads(final["call_book"]) if shape == "agent" else final["booked"]
    assert booked == booking


# The agent on every backend; the task's ledger calls are the same, so SQLite suffices
# for it (four child processes a case: CI time).
CASES = [
    *(pytest.param(backend, "agent", id=f"{backend}-agent") for backend in BACKENDS),
    pytest.param("sqlite", "task", id="sqlite-task"),
]


@pytest.mark.parametrize(("db_url", "shape"), CASES, indirect=["db_url"])
def test_a_killed_run_resumes_in_a_fresh_process_with_one_booking(
    fake: FakeProvider, ledgers: Ledgers, db_url: str, tmp_path: Path, shape: str
) -> None:
    """Under LangGraph's default ``durability="async"``: the guard waits for the plan's
    checkpoint before the effect, so the resume re-runs the same task (same key)."""
    ledgers.fresh()  # creates the ledger's schema
    final = crash_and_resume(db_url, tmp_path, fake, shape, "--durability", "async")
    check_one_booking(fake, final, shape)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("shape", ["agent", "task"])
def test_unguarded_the_resume_books_twice(
    fake: FakeProvider, db_url: str, tmp_path: Path, shape: str
) -> None:
    """Positive control: the same crash and resume without the guard."""
    crash_and_resume(db_url, tmp_path, fake, shape, "--guard", "none")
    counts = deliveries(fake)
    assert counts["/bookings"] == 2
    # The task shape notifies after the booking, so only on the resume. The agent's tool
    # node runs both calls at once: unguarded, the notification may also have reached the
    # provider before the kill, and the resume sends it again.
    assert counts["/notifications"] in ({1} if shape == "task" else {1, 2})


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_guarded_task_needs_a_thread_and_a_checkpointer(ledgers: Ledgers) -> None:
    guard = ToolGuard(ledgers.fresh())
    sent: list[str] = []

    @task
    @guard.task("book_room")
    def book_room(room: str) -> str:
        sent.append(room)
        return room

    @entrypoint()
    def no_saver(room: str) -> str:
        return book_room(room).result()

    with pytest.raises(ConfigurationError, match="checkpointer"):
        no_saver.invoke("r-12")
    with pytest.raises(ConfigurationError, match="outside a LangGraph run"):
        guard.task("book_room")(lambda room: room)("r-12")

    @entrypoint(checkpointer=InMemorySaver())
    def workflow(room: str) -> str:
        return book_room(room).result()

    config: Any = {"configurable": {"thread_id": "t-1"}}
    assert workflow.invoke("r-12", config) == "r-12"
    assert sent == ["r-12"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_middleware_without_langchain_says_what_to_install(
    ledgers: Ledgers, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard = ToolGuard(ledgers.fresh())
    assert hasattr(guard.middleware(), "wrap_tool_call")
    monkeypatch.setitem(sys.modules, "langchain.agents.middleware", None)  # not installed
    with pytest.raises(ConfigurationError, match=r"pip install \"onceonly\[langchain\]\""):
        guard.middleware()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_async_guarded_task_records_its_result(ledgers: Ledgers) -> None:
    ledger = ledgers.fresh()
    guard = ToolGuard(ledger)
    sent: list[str] = []

    @task
    @guard.task("hold_room")
    async def hold_room(room: str) -> str:
        sent.append(room)
        return f"held {room}"

    @entrypoint(checkpointer=InMemorySaver())
    async def workflow(room: str) -> str:
        return await hold_room(room)

    config: Any = {"configurable": {"thread_id": "t-1"}}
    assert asyncio.run(workflow.ainvoke("r-12", config)) == "held r-12"
    assert sent == ["r-12"]
    [entry] = ledger.effects(run_id="t-1", effect="hold_room@1")
    assert entry.status is EffectStatus.COMMITTED
    assert entry.step_id is not None
    assert entry.step_id.startswith("workflow:")


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_fork_from_the_first_checkpoint_in_fresh_processes_books_nothing_again(
    db_url: str, tmp_path: Path, fake: FakeProvider
) -> None:
    """The killed run resumed, then taken back to its first checkpoint twice, each time
    in a fresh process (the fork's lineage is read back from the saver): the model plans
    the same calls in later super-steps of the fork; they replay (the kill flag would
    SIGKILL a fork that booked again)."""
    final = crash_and_resume(db_url, tmp_path, fake, "agent")
    check_one_booking(fake, final, "agent")
    saver = tmp_path / "graph.sqlite"
    for _ in range(2):
        forked = worker(db_url, saver, fake, "agent", "--fork")
        assert forked.returncode == 0, forked.stderr
        assert json.loads(forked.stdout) == final
    assert deliveries(fake) == {"/bookings": 1, "/notifications": 1}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_unguarded_a_fork_books_again(db_url: str, tmp_path: Path, fake: FakeProvider) -> None:
    """Positive control: the same fork without the guard reaches the provider again."""
    saver = tmp_path / "graph.sqlite"
    started = worker(db_url, saver, fake, "agent", "--guard", "none")
    assert started.returncode == -9, started.stderr
    forked = worker(db_url, saver, fake, "agent", "--guard", "none", "--fork")
    assert forked.returncode == -9, forked.stderr  # booked again: killed again
    assert deliveries(fake)["/bookings"] == 2


def _forked_workflow(guard: ToolGuard, made: list[str], *, asynchronous: bool) -> Any:
    """An entrypoint that thinks (an unguarded @task), then books what it thought."""

    @task
    def think(room: str) -> str:
        return room.upper()

    if asynchronous:

        @task
        @guard.task("book_room")
        async def abook(room: str) -> str:
            made.append(room)
            return f"booked {room}"

        @entrypoint(checkpointer=InMemorySaver())
        async def aworkflow(request: dict[str, str]) -> str:
            return await abook(await think(request["room"]))

        return aworkflow

    @task
    @guard.task("book_room")
    def book(room: str) -> str:
        made.append(room)
        return f"booked {room}"

    @entrypoint(checkpointer=InMemorySaver())
    def workflow(request: dict[str, str]) -> str:
        return book(think(request["room"]).result()).result()

    return workflow


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_guarded_task_in_a_forked_entrypoint_books_once(ledgers: Ledgers, api: str) -> None:
    """Time travel to the entrypoint's first checkpoint: the entrypoint's task and the
    @task it calls get new ids; the guarded task is placed as the original's call and
    replays."""
    made: list[str] = []
    flow = _forked_workflow(ToolGuard(ledgers.fresh()), made, asynchronous=api == "ainvoke")
    config: Any = {"configurable": {"thread_id": "t-1"}}

    def go(start: Any, cfg: Any) -> Any:
        return (
            asyncio.run(flow.ainvoke(start, cfg)) if api == "ainvoke" else flow.invoke(start, cfg)
        )

    assert go({"room": "r12"}, config) == "booked R12"
    [first] = [h for h in flow.get_state_history(config) if h.metadata["source"] == "input"]
    assert go(None, first.config) == "booked R12"
    assert go(None, first.config) == "booked R12"
    assert made == ["R12"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_guarded_task_in_a_forked_entrypoint_acts_again_when_asked_to(
    ledgers: Ledgers,
) -> None:
    """Positive control: ``forks="act"``."""
    made: list[str] = []
    flow = _forked_workflow(ToolGuard(ledgers.fresh(), forks="act"), made, asynchronous=False)
    config: Any = {"configurable": {"thread_id": "t-1"}}
    flow.invoke({"room": "r12"}, config)
    [first] = [h for h in flow.get_state_history(config) if h.metadata["source"] == "input"]
    flow.invoke(None, first.config)
    assert made == ["R12", "R12"]
