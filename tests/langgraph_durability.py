"""A guarded LangGraph run killed mid-effect, in its own process, under each durability mode.

A scripted "model" (no LLM) asks for two tool calls in one ``AIMessage``: ``book_room``
and ``notify``, each an HTTP write to the counting provider on 127.0.0.1 (``/bookings``,
``/notifications``; the provider's raw request log is the oracle). Both are class B: the
provider looks a call up by our provider key, so a call cut off by a crash is settled on
resume. Shapes of the tools step:

* ``message``: one ``ToolNode`` task runs both calls;
* ``subgraph``: the model and the ``ToolNode`` run in a subgraph (default
  ``checkpointer=None``: it saves under the parent's checkpointer);
* ``send``: the model's edge fans the calls out with ``Send`` (one task per call, as
  ``create_agent`` does).

``--kill effect`` SIGKILLs the process as soon as the provider answered ``book_room``
(nothing recorded, nothing saved after it); ``--kill recorded`` once the guard recorded
it (before LangGraph saved the tool's writes). ``--hold`` models a slow checkpointer under
``durability="async"``: a checkpoint that plans the tools step stays unsaved until someone
asks the saver for it, so a tool that does not wait for it acts before it is durable.
``--guard unwaiting`` is the planted defect (the guard without its wait for the checkpoint),
``--guard none`` no guard at all.

Worker (a fresh process; exit 0 and the final tool messages as JSON, 4 on
``PlanNotDurable``, 5 on ``EffectInDoubt``)::

    python -m tests.langgraph_durability DB_URL SAVER SAVER_PATH PROVIDER_URL THREAD \\
        --shape message --durability async --kill effect --hold --guard guard
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import httpx
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, Send

from onceonly.adapters import current_claim
from onceonly.adapters.langgraph import PlanNotDurable, ToolGuard, ToolPolicy
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import EffectInDoubt, EffectRecord, Evidence

__all__ = ["CALLS", "HeldSaver", "Unwaiting", "build", "lookup_probe"]

CALLS = [
    {"name": "book_room", "args": {"room": "r-12", "night": "2025-05-01"}, "id": "call_book"},
    {"name": "notify", "args": {"to": "guest@example.com"}, "id": "call_notify"},
]
# Generous: these fakes never delay on purpose, and a loaded or paused machine can
# stall a thread for seconds (a quiet CI run once read nothing for 10 s here).
TIMEOUT = httpx.Timeout(60.0)
HOLD_S = 60.0  # a held save gives up waiting for a reader (the test has failed by then)


class HeldSaver(BaseCheckpointSaver[Any]):
    """A checkpointer whose saves of checkpoints that plan the tools step are slow.

    Such a ``put`` does not reach ``inner`` until a reader asks for that checkpoint (or
    ``HOLD_S`` passed): a tool that acts without asking acts while its checkpoint is not
    durable, exactly as under a slow disk; a tool that waits for it gets it.
    """

    def __init__(self, inner: BaseCheckpointSaver[Any]) -> None:
        super().__init__(serde=inner.serde)
        self.inner = inner
        self._asked: dict[str, threading.Event] = {}
        self._released = False
        self._lock = threading.Lock()

    def _event(self, checkpoint_id: str) -> threading.Event:
        with self._lock:
            return self._asked.setdefault(checkpoint_id, threading.Event())

    def _held(self, checkpoint: Checkpoint) -> bool:
        planned = {"branch:to:tools", "__pregel_tasks"}
        return bool(planned & set(checkpoint.get("updated_channels") or ()))

    def release(self) -> None:
        """Let every held save through (and every later one)."""
        with self._lock:
            self._released = True
            for event in self._asked.values():
                event.set()

    def _ask(self, config: RunnableConfig) -> None:
        checkpoint_id = config["configurable"].get("checkpoint_id")
        if checkpoint_id:
            self._event(checkpoint_id).set()

    def _hold(self, checkpoint: Checkpoint) -> threading.Event | None:
        if not self._held(checkpoint):
            return None
        event = self._event(checkpoint["id"])
        with self._lock:
            if self._released:
                event.set()
        return event

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        self._ask(config)
        return self.inner.get_tuple(config)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        self._ask(config)
        return await self.inner.aget_tuple(config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        async for item in self.inner.alist(config, filter=filter, before=before, limit=limit):
            yield item

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        if (event := self._hold(checkpoint)) is not None:
            event.wait(HOLD_S)
        return self.inner.put(config, checkpoint, metadata, new_versions)

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        if (event := self._hold(checkpoint)) is not None:
            await asyncio.to_thread(event.wait, HOLD_S)
        return await self.inner.aput(config, checkpoint, metadata, new_versions)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self.inner.put_writes(config, writes, task_id, task_path)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await self.inner.aput_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self.inner.delete_thread(thread_id)


class Unwaiting(ToolGuard):
    """The planted defect: a guard that acts without waiting for its checkpoint (and
    without placing forked calls, whose read of the checkpoint would release a held
    save: the guard it plants the defect in reads nothing before acting)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("forks", "act")
        super().__init__(*args, **kwargs)

    def _wait_saved(self, plan: Any) -> None:
        return None

    async def _await_saved(self, plan: Any) -> None:
        return None


def lookup_probe(url: str) -> Any:
    """Class B: the provider's lookup by our provider key."""

    def probe(record: EffectRecord) -> tuple[Evidence, Any]:
        resp = httpx.get(f"{url}/lookup/{record.provider_key}", timeout=TIMEOUT)
        if resp.status_code == 200:
            return Evidence.HAPPENED, resp.json()
        if resp.status_code == 404:
            return Evidence.NOT_HAPPENED, None
        return Evidence.INCONCLUSIVE, None

    return probe


def _tools(url: str, kill: str) -> list[BaseTool]:
    def post(path: str, body: dict[str, Any]) -> str:
        try:
            headers = {"Idempotency-Key": f'"{current_claim().provider_key}"'}
        except ConfigurationError:  # unguarded
            headers = {}
        resp = httpx.post(url + path, json=body, headers=headers, timeout=TIMEOUT)
        resp.raise_for_status()
        return json.dumps(resp.json(), sort_keys=True)

    @tool
    def book_room(room: str, night: str) -> str:
        """Book a hotel room for one night."""
        answer = post("/bookings", {"room": room, "night": night})
        if kill == "effect":
            os.kill(os.getpid(), signal.SIGKILL)  # the provider applied it; nothing else did
        return answer

    @tool
    def notify(to: str) -> str:
        """Tell the guest."""
        return post("/notifications", {"to": to})

    return [book_room, notify]


def _model(state: MessagesState) -> dict[str, list[BaseMessage]]:
    if isinstance(state["messages"][-1], ToolMessage):
        return {"messages": [AIMessage("Booked and notified.")]}
    return {"messages": [AIMessage("", tool_calls=CALLS)]}


def _fan_out(state: MessagesState) -> list[Send] | str:
    last = state["messages"][-1]
    if isinstance(last, AIMessage) and last.tool_calls:
        return [Send("tools", [call]) for call in last.tool_calls]
    return END


def _agent(node: ToolNode, shape: str) -> StateGraph[Any, Any, Any, Any]:
    graph = StateGraph(MessagesState)
    graph.add_node("model", _model)
    graph.add_node("tools", node)
    graph.add_edge(START, "model")
    if shape == "send":
        graph.add_conditional_edges("model", _fan_out, ["tools", END])
    else:
        graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph


def build(
    url: str,
    saver: BaseCheckpointSaver[Any] | None,
    guard: ToolGuard | None,
    *,
    shape: str = "message",
    kill: str = "none",
    before_act: Callable[[ToolCallRequest], None] | None = None,
    inner_checkpointer: bool | None = None,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The graph of ``shape`` (see the module docstring), guarded when ``guard`` is given.

    ``before_act`` sees each request as the guard lets its tool run;
    ``inner_checkpointer`` is the subgraph's ``checkpointer=``.
    """
    tools = _tools(url, kill)
    if guard is None:
        node = ToolNode(tools)
    else:

        def wrap(request: ToolCallRequest, execute: Any) -> ToolMessage | Command[Any]:
            def act(request: ToolCallRequest) -> ToolMessage | Command[Any]:
                if before_act is not None:
                    before_act(request)
                return execute(request)  # type: ignore[no-any-return]

            message = guard.wrap_tool_call(request, act)
            if kill == "recorded" and request.tool_call["name"] == "book_room":
                os.kill(os.getpid(), signal.SIGKILL)  # recorded; LangGraph saved nothing
            return message

        async def awrap(request: ToolCallRequest, execute: Any) -> ToolMessage | Command[Any]:
            async def act(request: ToolCallRequest) -> ToolMessage | Command[Any]:
                if before_act is not None:
                    before_act(request)
                return await execute(request)  # type: ignore[no-any-return]

            return await guard.awrap_tool_call(request, act)

        node = ToolNode(tools, wrap_tool_call=wrap, awrap_tool_call=awrap)
    if shape != "subgraph":
        return _agent(node, shape).compile(checkpointer=saver)
    outer = StateGraph(MessagesState)
    outer.add_node("agent", _agent(node, "message").compile(checkpointer=inner_checkpointer))
    outer.add_edge(START, "agent")
    return outer.compile(checkpointer=saver)


def _worker(argv: Sequence[str]) -> int:
    from onceonly.checkpoint import Store
    from onceonly.ledger import Ledger
    from tests.ledger_support import keyring

    parser = argparse.ArgumentParser()
    for name in ("db_url", "saver", "saver_path", "url", "thread"):
        parser.add_argument(name)
    parser.add_argument("--shape", default="message")
    parser.add_argument("--durability", default="async")
    parser.add_argument("--kill", default="none")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--guard", default="guard")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    store = Store.open(args.db_url)
    # A stable owner: the restarted worker finds its dead predecessor's claims in doubt
    # at once (a new name would wait out their leases).
    ledger = Ledger(store, keyring(), owner="langgraph-worker")
    inner: BaseCheckpointSaver[Any]
    if args.saver == "sqlite":
        from langgraph.checkpoint.sqlite import SqliteSaver

        conn = sqlite3.connect(args.saver_path, check_same_thread=False)
        inner, close = SqliteSaver(conn), conn.close
    else:
        from onceonly.adapters.langgraph_saver import OnceOnlySaver

        onceonly = OnceOnlySaver.from_url(args.db_url, keyring=keyring())
        inner, close = onceonly, onceonly.close
    saver = HeldSaver(inner) if args.hold else inner
    policy = ToolPolicy(provider_class="B", probe=lookup_probe(args.url))
    policies = {"book_room": policy, "notify": policy}
    kinds = {"guard": ToolGuard, "unwaiting": Unwaiting}
    guard = kinds[args.guard](ledger, policies=policies) if args.guard in kinds else None
    app = build(args.url, saver, guard, shape=args.shape, kill=args.kill)
    config: Any = {"configurable": {"thread_id": args.thread}}
    start = None if args.resume else {"messages": [("user", "Book r-12 and tell the guest")]}
    try:
        final = app.invoke(start, config, durability=args.durability)
    except PlanNotDurable as exc:
        print(str(exc), file=sys.stderr)
        return 4
    except EffectInDoubt as exc:
        print(str(exc), file=sys.stderr)
        return 5
    finally:
        close()
        ledger.close()
        store.close()
    print(
        json.dumps(
            {
                m.tool_call_id: {"content": m.content, "status": m.status}
                for m in final["messages"]
                if isinstance(m, ToolMessage)
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
