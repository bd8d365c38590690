"""The LangGraph graph of the adapter tests, and a worker that runs it in its own process.

A scripted "model" node (no LLM) answers the user with one ``AIMessage`` holding two tool
calls — ``book_room`` (an HTTP booking at a fake provider on 127.0.0.1) and ``notify``
(fails with ``ConnectionRefusedError`` while ``Tools.notify_failures`` lasts) — and
finishes once tool messages came back. The provider's raw request log is the oracle.

Worker (a fresh process; exit 3 when the run stopped with an error)::

    python -m tests.langgraph_graph DB_URL SAVER_PATH PROVIDER_URL THREAD first|resume
"""

from __future__ import annotations

import json
import sqlite3
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from onceonly.adapters import RetryPolicy, current_claim
from onceonly.adapters.langgraph import ToolGuard, ToolPolicy
from onceonly.checkpoint import ConfigurationError
from onceonly.ledger import OutcomeClass

__all__ = ["CALLS", "NOTIFY", "Tools", "build", "classify_notify", "tool_messages"]

CALLS = [
    {"name": "book_room", "args": {"room": "r-12", "night": "2025-05-01"}, "id": "call_book"},
    {"name": "notify", "args": {"to": "guest@example.com"}, "id": "call_notify"},
]
TIMEOUT = httpx.Timeout(5.0, read=0.3)


def classify_notify(exc: BaseException) -> OutcomeClass:
    """``notify``'s provider refused the connection: nothing was sent."""
    if isinstance(exc, ConnectionRefusedError):
        return OutcomeClass.NOT_SENT
    return OutcomeClass.AMBIGUOUS


NOTIFY = ToolPolicy(classify=classify_notify, retry=RetryPolicy(max_attempts=1))
"""The notify tool's policy: one attempt, so its failure reaches the graph (the default
policy would send the not-sent notification again at once)."""


def _provider_key() -> str | None:
    """The claim's provider key inside a guarded call; None in the unguarded control."""
    try:
        return current_claim().provider_key
    except ConfigurationError:
        return None


@dataclass
class Tools:
    """The two tools, against the provider at ``url``."""

    url: str
    notify_failures: int = 1
    sent: list[str] = field(default_factory=list)

    def all(self) -> list[BaseTool]:
        @tool
        def book_room(room: str, night: str) -> str:
            """Book a hotel room for one night."""
            key = _provider_key()
            headers = {} if key is None else {"Idempotency-Key": f'"{key}"'}
            resp = httpx.post(
                self.url + "/bookings",
                json={"room": room, "night": night},
                headers=headers,
                timeout=TIMEOUT,
            )
            if resp.status_code == 402:
                raise PermissionError("payment required")
            resp.raise_for_status()
            return json.dumps(resp.json(), sort_keys=True)

        @tool
        def notify(to: str) -> str:
            """Tell the guest."""
            if self.notify_failures > 0:
                self.notify_failures -= 1
                raise ConnectionRefusedError("mail server refused the connection")
            self.sent.append(to)
            return f"sent to {to}"

        return [book_room, notify]


def _model(state: MessagesState) -> dict[str, list[BaseMessage]]:
    if isinstance(state["messages"][-1], ToolMessage):
        return {"messages": [AIMessage("Booked and notified.")]}
    return {"messages": [AIMessage("", tool_calls=CALLS)]}


def build(
    tools: Tools, saver: BaseCheckpointSaver[Any], guard: ToolGuard | None
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """model → tools (guarded when ``guard`` is given) → model."""
    if guard is None:
        node = ToolNode(tools.all())
    else:
        node = ToolNode(
            tools.all(), wrap_tool_call=guard.wrap_tool_call, awrap_tool_call=guard.awrap_tool_call
        )
    graph = StateGraph(MessagesState)
    graph.add_node("model", _model)
    graph.add_node("tools", node)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=saver)


def tool_messages(state: dict[str, Any]) -> dict[str, Any]:
    """The tool messages of a final state, by tool call id."""
    return {
        m.tool_call_id: {"content": m.content, "status": m.status}
        for m in state["messages"]
        if isinstance(m, ToolMessage)
    }


def _worker(db_url: str, saver_path: str, url: str, thread: str, phase: str) -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from onceonly.checkpoint import Store
    from onceonly.ledger import Ledger
    from tests.ledger_support import keyring

    store = Store.open(db_url)
    ledger = Ledger(store, keyring())
    conn = sqlite3.connect(saver_path, check_same_thread=False)
    tools = Tools(url, notify_failures=1 if phase == "first" else 0)
    guard = ToolGuard(ledger, policies={"notify": NOTIFY})
    app = build(tools, SqliteSaver(conn), guard)
    config: Any = {"configurable": {"thread_id": thread}}
    try:
        final = app.invoke(
            {"messages": [("user", "Book r-12")]} if phase == "first" else None, config
        )
    except ConnectionRefusedError:
        return 3
    finally:
        conn.close()
        ledger.close()
        store.close()
    print(json.dumps(tool_messages(final)))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:6]))
