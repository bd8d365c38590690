"""Two more LangGraph shapes, killed right after their effect, in their own process.

* ``agent``: langchain's ``create_agent`` with a scripted chat model (no LLM) that asks for
  ``book_room`` and ``notify`` in one message, guarded by ``ToolGuard.middleware()``;
* ``task``: the functional API, an ``@entrypoint`` that calls a ``book_room`` ``@task``
  and then a ``notify`` ``@task``, each guarded by ``ToolGuard.task``.

Each effect is an HTTP write to the counting provider on 127.0.0.1 (``/bookings``,
``/notifications``; its raw request log is the oracle), class B (the provider looks a
call up by our provider key). The first run (without ``--resume``) SIGKILLs itself as
soon as the provider answered the booking: nothing is recorded, nothing saved after it.
``--guard none`` runs the same shape unguarded (the control).

Worker (a fresh process; prints the final state as JSON)::

    python -m tests.langgraph_shapes DB_URL SAVER_PATH PROVIDER_URL THREAD \\
        --shape agent|task --durability sync|async --guard guard|none [--resume|--fork]

``--fork`` takes the thread back to its first checkpoint (``invoke(None, that config)``),
so every call of the run is planned again in the fork's own lineage.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import sys
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, tool

from onceonly.adapters import current_claim
from onceonly.adapters.langgraph import ToolGuard, ToolPolicy
from onceonly.checkpoint import ConfigurationError
from tests.langgraph_durability import CALLS, lookup_probe

__all__ = ["ScriptedModel"]

# Generous: these fakes never delay on purpose, and a loaded or paused machine can
# stall a thread for seconds (a quiet CI run once read nothing for 10 s here).
TIMEOUT = httpx.Timeout(60.0)


class ScriptedModel(BaseChatModel):
    """Asks for both tools on the user's message, answers once tool messages came back
    (decided from the messages alone, so a fresh process answers alike)."""

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if isinstance(messages[-1], ToolMessage):
            reply = AIMessage("Booked and notified.")
        else:
            reply = AIMessage("", tool_calls=CALLS)
        return ChatResult(generations=[ChatGeneration(message=reply)])

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self


def _post(url: str, path: str, body: dict[str, Any], *, kill: bool) -> dict[str, Any]:
    try:
        headers = {"Idempotency-Key": f'"{current_claim().provider_key}"'}
    except ConfigurationError:  # unguarded
        headers = {}
    resp = httpx.post(url + path, json=body, headers=headers, timeout=TIMEOUT)
    resp.raise_for_status()
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)  # the provider applied it; nothing else did
    answer: dict[str, Any] = resp.json()
    return answer


def _agent(url: str, saver: Any, guard: ToolGuard | None, kill: bool) -> Any:
    from langchain.agents import create_agent

    @tool
    def book_room(room: str, night: str) -> str:
        """Book a hotel room for one night."""
        return json.dumps(_post(url, "/bookings", {"room": room, "night": night}, kill=kill))

    @tool
    def notify(to: str) -> str:
        """Tell the guest."""
        return json.dumps(_post(url, "/notifications", {"to": to}, kill=False))

    tools: list[BaseTool] = [book_room, notify]
    middleware = [] if guard is None else [guard.middleware()]
    return create_agent(ScriptedModel(), tools, middleware=middleware, checkpointer=saver)


def _functional(url: str, saver: Any, guard: ToolGuard | None, kill: bool) -> Any:
    from langgraph.func import entrypoint, task

    def guarded(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return (lambda fn: fn) if guard is None else guard.task(name)

    @task
    @guarded("book_room")
    def book_room(room: str, night: str) -> dict[str, Any]:
        return _post(url, "/bookings", {"room": room, "night": night}, kill=kill)

    @task
    @guarded("notify")
    def notify(to: str) -> dict[str, Any]:
        return _post(url, "/notifications", {"to": to}, kill=False)

    @entrypoint(checkpointer=saver)
    def workflow(request: dict[str, str]) -> dict[str, Any]:
        booked = book_room(request["room"], request["night"]).result()
        told = notify(request["to"]).result()
        return {"booked": booked, "told": told}

    return workflow


def _worker(argv: Sequence[str]) -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from onceonly.checkpoint import Store
    from onceonly.ledger import Ledger
    from tests.ledger_support import keyring

    parser = argparse.ArgumentParser()
    for name in ("db_url", "saver_path", "url", "thread"):
        parser.add_argument(name)
    parser.add_argument("--shape", choices=["agent", "task"], required=True)
    parser.add_argument("--durability", default="async")
    parser.add_argument("--guard", choices=["guard", "none"], default="guard")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--fork", action="store_true", help="time travel: run again from the first checkpoint"
    )
    args = parser.parse_args(argv)

    store = Store.open(args.db_url)
    # A stable owner: the restarted worker finds its dead predecessor's claims in doubt
    # at once, and the class B probe settles them.
    ledger = Ledger(store, keyring(), owner="shapes-worker")
    conn = sqlite3.connect(args.saver_path, check_same_thread=False)
    policy = ToolPolicy(provider_class="B", probe=lookup_probe(args.url))
    guard = (
        ToolGuard(ledger, policies={"book_room": policy, "notify": policy})
        if args.guard == "guard"
        else None
    )
    make = _agent if args.shape == "agent" else _functional
    app = make(args.url, SqliteSaver(conn), guard, not args.resume)
    config: Any = {"configurable": {"thread_id": args.thread}}
    start: Any = None
    if args.fork:
        history = list(app.get_state_history(config))
        [first] = [h for h in history if h.metadata["source"] == "input"]
        config = first.config
    elif not args.resume:
        start = (
            {"messages": [("user", "Book r-12 and tell the guest")]}
            if args.shape == "agent"
            else {"room": "r-12", "night": "2025-05-01", "to": "guest@example.com"}
        )
    try:
        final = app.invoke(start, config, durability=args.durability)
    finally:
        conn.close()
        ledger.close()
        store.close()
    if args.shape == "agent":
        final = {m.tool_call_id: m.content for m in final["messages"] if isinstance(m, ToolMessage)}
    print(json.dumps(final, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
