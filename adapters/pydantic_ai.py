"""Pydantic AI tools whose effects happen once: :class:`PydanticAIToolGuard`.

A Pydantic AI agent is at-least-once for its tools: a process that dies after a tool
booked a table, and before the run finished, books it again when the agent is run again
with the same conversation. Decorate the tool with :meth:`PydanticAIToolGuard.tool` and
each call claims its key in the ledger before acting and records its result before the
model sees it; a re-run of the agent replays the recorded result instead of acting.

**Keys.** A call's key comes from the conversation (``RunContext.conversation_id``: pass
``conversation_id=`` to ``Agent.run``, or a ``message_history`` that carries it) and the
call's position in it: the index of the model response that asked for it in the run's
messages and the call's index among that response's tool calls. The model's
``tool_call_id`` only locates the call in the messages, it is never the key (a model
re-planning after a crash sends new ids for the same calls). The same position with other
arguments is :class:`~ledger.KeyReuseError` (the conversation diverged), not a replay.

**Outcomes.** Per tool, a :class:`~adapters.ToolPolicy` (shared with the LangGraph
adapter) names the provider class and its window, probe, classifier and retry policy;
everything :func:`adapters.guard` does applies. A call in doubt (the process died between
the provider's answer and the ledger's record) raises :class:`~ledger.EffectInDoubt`
out of the run for a class C tool: it is never re-sent blindly.

**Approvals.** ``ToolPolicy(approval=True)`` makes a person approve each call, bound to
its arguments, with Pydantic AI's deferred tools: the call raises ``ApprovalRequired``
with metadata ``{"kind": "onceonly.approval", "tool", "args_hash"}`` (the run ends with
``DeferredToolRequests``; give the agent ``output_type=[..., DeferredToolRequests]``). It
runs only when the next run's ``DeferredToolResults`` approve it *and* carry
``metadata={tool_call_id: {"approve": args_hash}}`` for exactly the arguments it is about
to use; a bare ``True``, or an approval whose ``override_args`` changed the arguments,
asks again.

Pydantic AI is imported lazily: this module imports without the
``onceonly[pydantic-ai]`` extra, and needs it only when a guarded tool runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import Ledger

from ._tool_calls import Guarded, SDKToolGuard, policy_guard, require
from .langgraph import ToolPolicy

__all__ = ["PydanticAIToolGuard"]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")


def _require() -> Any:
    return require("pydantic_ai", "Pydantic AI", "pydantic-ai")


class PydanticAIToolGuard(SDKToolGuard):
    """Guards the tools of Pydantic AI agents (see the module docstring).

    Example::

        tools = PydanticAIToolGuard(ledger, policies={"book": ToolPolicy(approval=True)})

        @agent.tool
        @tools.tool
        async def book(ctx: RunContext[None], table: int, time: str) -> str: ...

    Args:
        ledger: The effects ledger.
        policies: Per tool name.
        default: The policy of every other tool (default: class C, every exception
            ambiguous: never re-sent).
        tenant: The tenant of every key.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        policies: Mapping[str, ToolPolicy] | None = None,
        default: ToolPolicy | None = None,
        tenant: str = "",
    ) -> None:
        super().__init__(ledger, policies=policies, default=default or ToolPolicy(), tenant=tenant)

    def position(self, ctx: Any) -> tuple[str, str]:
        """The ``(run_id, step_id)`` a tool call's key is derived from: the conversation,
        and the call's place in its messages.

        Raises:
            ConfigurationError: No conversation id, or the call is not found in a model
                response of the run's messages.
        """
        conversation = getattr(ctx, "conversation_id", None)
        if not conversation:
            raise ConfigurationError(
                "a guarded Pydantic AI tool needs RunContext.conversation_id: run the agent "
                "with conversation_id=... (the same one when you run it again)"
            )
        call_id = ctx.tool_call_id
        messages = list(ctx.messages)
        for at in range(len(messages) - 1, -1, -1):
            calls = [
                p
                for p in getattr(messages[at], "parts", ())
                if getattr(p, "part_kind", None) == "tool-call"
            ]
            for index, part in enumerate(calls):
                if part.tool_call_id == call_id:
                    return str(conversation), f"pydantic-ai/messages[{at}].tool_calls[{index}]"
        raise ConfigurationError(
            f"tool call {call_id!r} of {ctx.tool_name!r} is not in a model response of the "
            f"run's messages: a guarded tool must be called by the agent, not directly"
        )

    def tool(self, fn: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[C, P], R]:
        """Guard a tool function whose first parameter is the ``RunContext``.

        Apply it under ``@agent.tool`` (or pass the result to ``Tool(...)``); the
        signature Pydantic AI builds the tool's schema from is preserved. The tool's
        arguments and its result must be encodable by the ledger's codec (JSON-like
        values).
        """
        return self._wrap_tool(fn, "RunContext")

    def _guarded(self, ctx: Any, tool_args: dict[str, Any]) -> Guarded:
        """The tool call's guard; raises ``ApprovalRequired`` first when the call
        needs an approval of exactly these arguments that it does not have."""
        name = str(ctx.tool_name)
        policy = self.policy(name)
        if policy.approval:
            digest = self.approval_hash(name, tool_args)
            metadata = ctx.tool_call_metadata if isinstance(ctx.tool_call_metadata, dict) else {}
            if not (ctx.tool_call_approved and metadata.get("approve") == digest):
                raise _require().ApprovalRequired(
                    metadata={"kind": "onceonly.approval", "tool": name, "args_hash": digest}
                )
        return policy_guard(self.ledger, policy, name, policy.classify)
