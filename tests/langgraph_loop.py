"""A LangGraph node that calls a model and a ``ToolNode`` in a loop, in one task.

A scripted "model" (no LLM) plans bookings one ``AIMessage`` at a time (a ``PLANS``
entry: a list of messages, each a list of bookings, so a message may hold parallel
calls); every message gets fresh tool call ids, as a re-run model makes. Every booking is
an HTTP write to the counting provider on 127.0.0.1 (``/bookings``; the provider's raw
request log is the oracle), class B: the provider looks a call up by our provider key.
Shapes:

* ``loop``: one node ``agent`` runs model -> ``ToolNode.invoke`` -> model ... until the
  model answers without tool calls (one task, several ``ToolNode`` invocations);
* ``loop-subgraph``: the same node inside a subgraph;
* ``graph``: the usual ReAct graph (``model`` and ``tools`` nodes: one batch per task);
* ``send``: the ReAct graph whose model edge fans each call out with ``Send``.

``--kill effect`` SIGKILLs the process as soon as the provider answered the ``--at``-th
booking of this process (nothing recorded after it); ``--kill recorded`` once the guard
recorded it. ``--guard short`` is the planted defect (every call keyed by its index in
its message alone, the key form before the fix), ``--guard none`` no guard at all.

Worker (a fresh process; exit 0 and the final tool messages' contents as JSON, 5 on
``EffectInDoubt``, 6 on ``KeyReuseError``)::

    python -m tests.langgraph_loop DB_URL SAVER_PATH PROVIDER_URL THREAD \\
        --shape loop --plan different --kill effect --at 2 --guard guard --resume
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, Send

from onceonly.adapters import current_claim
from onceonly.adapters.langgraph import ToolGuard, ToolPolicy
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import EffectInDoubt, KeyReuseError
from tests.langgraph_durability import lookup_probe

__all__ = [
    "INPUT",
    "PLANS",
    "R12",
    "R14",
    "Short",
    "booking_tools",
    "build",
    "contents",
    "policies",
]

R12 = {"room": "r-12", "night": "2025-05-01"}
R14 = {"room": "r-14", "night": "2025-05-02"}
PLANS: dict[str, list[list[dict[str, str]]]] = {
    "different": [[R12], [R14]],
    "same": [[R12], [R12]],
    "parallel": [[R12, R12], [R12]],
}
"""Per plan, the model's messages in order, each the bookings it asks for."""
# Generous: these fakes never delay on purpose, and a loaded or paused machine can
# stall a thread for seconds (a quiet CI run once read nothing for 10 s here).
TIMEOUT = httpx.Timeout(60.0)
INPUT: Any = {"messages": [("user", "Book the rooms")]}


class Short(ToolGuard):
    """The planted defect: the key form before the fix, ``<ns>/tool_calls[index]`` for
    every call, so the first call of every ``ToolNode`` invocation in a task collides."""

    def position(self, request: ToolCallRequest) -> tuple[str, str]:
        run_id, step_id = super().position(request)
        ns, _, index = step_id.rpartition("tool_calls[")
        return run_id, ns.partition("/messages[")[0].rstrip("/") + "/tool_calls[" + index


def policies(url: str) -> dict[str, ToolPolicy]:
    return {"book_room": ToolPolicy(provider_class="B", probe=lookup_probe(url))}


def booking_tools(url: str, kill: str = "none", at: int = 0) -> list[BaseTool]:
    booked: list[int] = []

    @tool
    def book_room(room: str, night: str) -> str:
        """Book a hotel room for one night."""
        try:
            headers = {"Idempotency-Key": f'"{current_claim().provider_key}"'}
        except ConfigurationError:  # unguarded
            headers = {}
        resp = httpx.post(
            url + "/bookings", json={"room": room, "night": night}, headers=headers, timeout=TIMEOUT
        )
        resp.raise_for_status()
        booked.append(1)
        if kill == "effect" and len(booked) == at:
            os.kill(os.getpid(), signal.SIGKILL)  # the provider applied it; nothing else did
        return json.dumps(resp.json(), sort_keys=True)

    return [book_room]


def _model(plan: str, messages: Sequence[BaseMessage], fail: list[bool] | None = None) -> AIMessage:
    """The next message of ``plan``: one per tool-calling message already answered.

    While ``fail`` holds an item, the final answer raises ``ConnectionError`` (and pops it).
    """
    done = sum(1 for m in messages if isinstance(m, AIMessage) and m.tool_calls)
    answered = isinstance(messages[-1], ToolMessage)
    if done and not answered:
        raise AssertionError("the model was asked before its calls were answered")
    steps = PLANS[plan]
    if done >= len(steps):
        if fail:
            fail.pop()
            raise ConnectionError("the model's provider refused the connection")
        return AIMessage("All booked.")
    calls = [
        {"name": "book_room", "args": args, "id": f"call_{uuid.uuid4().hex[:12]}"}
        for args in steps[done]
    ]
    return AIMessage("", tool_calls=calls)


def _loop_graph(node: ToolNode, plan: str, fail: list[bool]) -> StateGraph[Any, Any, Any, Any]:
    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        local: list[BaseMessage] = list(state["messages"])
        new: list[BaseMessage] = []
        while True:
            ai = _model(plan, local, fail)
            local.append(ai)
            new.append(ai)
            if not ai.tool_calls:
                return {"messages": new}
            answers = node.invoke({"messages": local})["messages"]
            local.extend(answers)
            new.extend(answers)

    async def aagent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        local: list[BaseMessage] = list(state["messages"])
        new: list[BaseMessage] = []
        while True:
            ai = _model(plan, local, fail)
            local.append(ai)
            new.append(ai)
            if not ai.tool_calls:
                return {"messages": new}
            answers = (await node.ainvoke({"messages": local}))["messages"]
            local.extend(answers)
            new.extend(answers)

    graph = StateGraph(MessagesState)
    graph.add_node("agent", RunnableLambda(agent, afunc=aagent))
    graph.add_edge(START, "agent")
    graph.add_edge("agent", END)
    return graph


def _react_graph(node: ToolNode, plan: str, *, send: bool) -> StateGraph[Any, Any, Any, Any]:
    def model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [_model(plan, state["messages"])]}

    def fan_out(state: MessagesState) -> list[Send] | str:
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and last.tool_calls:
            return [Send("tools", [call]) for call in last.tool_calls]
        return END

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", node)
    graph.add_edge(START, "model")
    if send:
        graph.add_conditional_edges("model", fan_out, ["tools", END])
    else:
        graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph


def build(
    url: str,
    saver: BaseCheckpointSaver[Any] | None,
    guard: ToolGuard | None,
    *,
    shape: str = "loop",
    plan: str = "different",
    kill: str = "none",
    at: int = 0,
    fail_at_end: bool = False,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The graph of ``shape`` (see the module docstring), guarded when ``guard`` is given.

    ``fail_at_end``: the loop's model fails once where it would answer without tool calls.
    """
    fail = [True] if fail_at_end else []
    tools = booking_tools(url, kill, at)
    if guard is None:
        node = ToolNode(tools)
    else:
        recorded: list[int] = []

        def wrap(request: ToolCallRequest, execute: Any) -> ToolMessage | Command[Any]:
            message = guard.wrap_tool_call(request, execute)
            recorded.append(1)
            if kill == "recorded" and len(recorded) == at:
                os.kill(os.getpid(), signal.SIGKILL)  # recorded; LangGraph saved nothing
            return message

        node = ToolNode(tools, wrap_tool_call=wrap, awrap_tool_call=guard.awrap_tool_call)
    if shape == "loop":
        return _loop_graph(node, plan, fail).compile(checkpointer=saver)
    if shape == "loop-subgraph":
        outer = StateGraph(MessagesState)
        outer.add_node("outer", _loop_graph(node, plan, fail).compile())
        outer.add_edge(START, "outer")
        return outer.compile(checkpointer=saver)
    return _react_graph(node, plan, send=shape == "send").compile(checkpointer=saver)


def contents(state: dict[str, Any]) -> list[Any]:
    """The contents of a final state's tool messages, in order."""
    return [m.content for m in state["messages"] if isinstance(m, ToolMessage)]


def _worker(argv: Sequence[str]) -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from onceonly.checkpoint import Store
    from onceonly.ledger import Ledger
    from tests.ledger_support import keyring

    parser = argparse.ArgumentParser()
    for name in ("db_url", "saver_path", "url", "thread"):
        parser.add_argument(name)
    parser.add_argument("--shape", default="loop")
    parser.add_argument("--plan", default="different")
    parser.add_argument("--kill", default="none")
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--guard", default="guard")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    store = Store.open(args.db_url)
    ledger = Ledger(store, keyring(), owner="langgraph-loop-worker")  # a stable owner
    conn = sqlite3.connect(args.saver_path, check_same_thread=False)
    kinds = {"guard": ToolGuard, "short": Short}
    guard = kinds[args.guard](ledger, policies=policies(args.url)) if args.guard in kinds else None
    app = build(
        args.url,
        SqliteSaver(conn),
        guard,
        shape=args.shape,
        plan=args.plan,
        kill=args.kill,
        at=args.at,
    )
    config: Any = {"configurable": {"thread_id": args.thread}}
    try:
        final = app.invoke(None if args.resume else INPUT, config)
    except EffectInDoubt as exc:
        print(str(exc), file=sys.stderr)
        return 5
    except KeyReuseError as exc:
        print(str(exc), file=sys.stderr)
        return 6
    finally:
        conn.close()
        ledger.close()
        store.close()
    print(json.dumps(contents(final)))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
