"""The graph of the checkpointer tests, and a worker that resumes it in its own process.

``draft`` appends a message and an item, ``review`` asks a human with ``interrupt()``
and records the answer, ``publish`` appends the last item. Each node appends to
``trail``, so a node that ran twice shows up twice.

Worker (a fresh process; prints the final state as JSON; its keyring from
``ONCEONLY_SECRETS``)::

    python -m tests.langgraph_saver_graph DB_URL THREAD ANSWER
"""

import json
import operator
import sys
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, interrupt

from onceonly.adapters.langgraph_saver import OnceOnlySaver

__all__ = ["START_INPUT", "build", "config", "summary"]

# Not ``from __future__ import annotations``: LangGraph reads the schema at run time.


class Doc(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    trail: Annotated[list[str], operator.add]
    facts: dict[str, str]
    answer: str


START_INPUT: Any = {"messages": [HumanMessage("Write the release note", id="h1")], "trail": []}


def _draft(state: Doc) -> dict[str, Any]:
    return {
        "messages": [AIMessage("Draft: v1.2 adds the checkpointer", id="a1")],
        "trail": ["draft"],
        "facts": {"version": "1.2", "component": "langgraph"},
    }


def _review(state: Doc) -> dict[str, Any]:
    answer = interrupt({"question": "publish?", "draft": state["messages"][-1].content})
    return {"answer": str(answer), "trail": [f"review:{answer}"]}


def _publish(state: Doc) -> dict[str, Any]:
    return {"trail": ["publish"], "facts": {**state["facts"], "published": state["answer"]}}


def build(saver: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The three-node graph, compiled with ``saver``."""
    g = StateGraph(Doc)
    g.add_node("draft", _draft)
    g.add_node("review", _review)
    g.add_node("publish", _publish)
    g.add_edge(START, "draft")
    g.add_edge("draft", "review")
    g.add_edge("review", "publish")
    g.add_edge("publish", END)
    return g.compile(checkpointer=saver)


def config(thread: str) -> Any:
    """The run config of ``thread``."""
    return {"configurable": {"thread_id": thread}}


def summary(values: dict[str, Any]) -> dict[str, Any]:
    """The state as plain JSON (messages as ``[type, content]``)."""
    return {
        "messages": [[m.type, m.content] for m in values.get("messages", [])],
        "trail": list(values.get("trail", [])),
        "facts": dict(values.get("facts", {})),
        "answer": values.get("answer"),
    }


def main(argv: list[str]) -> int:
    url, thread, answer = argv
    with OnceOnlySaver.from_url(url) as saver:
        graph = build(saver)
        out = graph.invoke(Command(resume=answer), config(thread))
    print(json.dumps(summary(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
