"""OpenAI Agents SDK function tools whose effects happen once: :class:`AgentsToolGuard`.

The Agents SDK is at-least-once for its tools: a process that dies after a tool booked a
table, and before the run finished, books it again when the agent is run again. Decorate
the tool function with :meth:`AgentsToolGuard.tool` (under ``function_tool``) and run the
agent with ``hooks=guard.hooks``: each call claims its key in the ledger before acting and
records its result before the model sees it; a re-run replays the recorded result.

**Keys.** A call's key comes from the conversation (by default ``RunConfig.group_id``,
which the SDK documents as the chat thread's id; or your ``conversation`` function of the
``ToolContext``) and the call's position: the number of input items the run started from,
the number of model requests made so far, and the call's index among the model
response's function calls (recorded by ``guard.hooks`` when the response arrives). The
model's ``call_id`` only locates the call, it is never the key. The same position with
other arguments is :class:`~ledger.KeyReuseError` (the conversation diverged).

**Outcomes.** Per tool, a :class:`~adapters.ToolPolicy` (shared with the LangGraph
adapter) names the provider class, window, probe, classifier and retry policy; a call in
doubt of a class C tool raises :class:`~ledger.EffectInDoubt` out of the run, never
re-sent blindly.

**Approvals.** Give the tool ``needs_approval=True`` as usual; approve an interruption
with :meth:`AgentsToolGuard.approve`, which takes the ``args_hash`` the approver was
shown (:meth:`AgentsToolGuard.approval_hash` of the call's arguments) and refuses with
:class:`ApprovalMismatch` when the call's arguments are not those any more. The approved
call then runs under its key like any other: running the resumed state twice acts once.
A run resumed from a ``RunState`` in a fresh process needs :meth:`AgentsToolGuard.resume`
(``approve`` calls it) so the pending calls' positions are known.

The Agents SDK is imported lazily: this module imports without the
``onceonly[openai-agents]`` extra, and needs it only when :attr:`AgentsToolGuard.hooks` is
first used.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

from onceonly.checkpoint.errors import ConfigurationError, OnceOnlyError
from onceonly.ledger import Ledger

from ._tool_calls import Guarded, SDKToolGuard, policy_guard, require
from .langgraph import ToolPolicy

__all__ = ["AgentsToolGuard", "ApprovalMismatch"]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")

_REMEMBERED = 4096  # pending calls whose positions a guard keeps


class ApprovalMismatch(ConfigurationError):
    """An approval names other arguments than the call now has: not approved.

    Attributes:
        tool: The tool's name.
        call_id: The model's call id.
    """

    def __init__(self, tool: str, call_id: str) -> None:
        self.tool = tool
        self.call_id = call_id
        super().__init__(
            f"the approval of {tool} call {call_id!r} names other arguments than the call has "
            f"now; show the approver the current arguments and their args_hash again"
        )


def _require() -> Any:
    return require("agents", "Agents SDK", "openai-agents")


def _group_id(ctx: Any) -> str | None:
    config = getattr(ctx, "run_config", None)
    return getattr(config, "group_id", None)


class AgentsToolGuard(SDKToolGuard):
    """Guards the function tools of OpenAI Agents SDK agents (see the module docstring).

    Example::

        tools = AgentsToolGuard(ledger)

        @function_tool
        @tools.tool
        async def book(ctx: ToolContext[None], table: int, time: str) -> str: ...

        await Runner.run(agent, "book", hooks=tools.hooks,
                         run_config=RunConfig(group_id=conversation_id))

    Args:
        ledger: The effects ledger.
        policies: Per tool name.
        default: The policy of every other tool (default: class C, every exception
            ambiguous: never re-sent).
        tenant: The tenant of every key.
        conversation: The conversation id of a call's ``ToolContext`` (default: its
            ``RunConfig.group_id``).
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        policies: Mapping[str, ToolPolicy] | None = None,
        default: ToolPolicy | None = None,
        tenant: str = "",
        conversation: Callable[[Any], str | None] = _group_id,
    ) -> None:
        super().__init__(ledger, policies=policies, default=default or ToolPolicy(), tenant=tenant)
        self.conversation = conversation
        self._places: OrderedDict[str, str] = OrderedDict()  # call id -> position
        self._approved: dict[str, str] = {}  # call id -> args hash approved
        self._lock = threading.Lock()
        self._hooks: Any = None

    @property
    def hooks(self) -> Any:
        """``RunHooks`` to pass to ``Runner.run(..., hooks=...)``: they note where each
        function call sits in the model's response when it arrives."""
        if self._hooks is None:
            base: type[Any] = _require().RunHooks
            guard_ = self

            # the SDK is imported lazily, so its base class is Any to the type checker
            class _PositionHooks(base):  # type: ignore[misc]
                async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
                    guard_._note(context, response)

            self._hooks = _PositionHooks()
        return self._hooks

    def resume(self, state: Any) -> None:
        """Note the positions of the calls pending in a ``RunState`` (a run resumed in a
        process that did not see its model response)."""
        # RunState keeps these privately; the run's context does not carry its turn input
        # across serialisation, so it is rebuilt from the run's original input.
        responses = list(getattr(state, "_model_responses", ()) or ())
        context = getattr(state, "_context", None)
        if responses and context is not None:
            items = _require().ItemHelpers.input_to_new_input_list(state._original_input)
            self._note(context, responses[-1], started_from=len(items))

    def approve(self, state: Any, item: Any, args_hash: str) -> None:
        """Approve an interruption for exactly the arguments the approver was shown.

        Args:
            state: The ``RunState`` of the interrupted run.
            item: Its ``ToolApprovalItem``.
            args_hash: :meth:`approval_hash` of the arguments the approver saw.

        Raises:
            ApprovalMismatch: The call's arguments are not those (nothing is approved).
        """
        raw = item.raw_item
        tool = str(getattr(raw, "name", None) or item.tool_name)
        call_id = str(raw.call_id)
        args = json.loads(raw.arguments or "{}")
        if self.approval_hash(tool, args) != args_hash:
            raise ApprovalMismatch(tool, call_id)
        self.resume(state)
        with self._lock:
            self._approved[call_id] = args_hash
        state.approve(item)

    def position(self, ctx: Any) -> tuple[str, str]:
        """The ``(run_id, step_id)`` a tool call's key is derived from.

        Raises:
            ConfigurationError: No conversation id, or the call's position was not noted
                (the run was not given ``hooks=guard.hooks``).
        """
        conversation = self.conversation(ctx)
        if not conversation:
            raise ConfigurationError(
                "a guarded Agents SDK tool needs a conversation id: run with "
                "run_config=RunConfig(group_id=...) (the same one when you run it again), or "
                "give AgentsToolGuard(conversation=...)"
            )
        with self._lock:
            place = self._places.get(ctx.tool_call_id)
        if place is None:
            raise ConfigurationError(
                f"the position of tool call {ctx.tool_call_id!r} is unknown: run the agent "
                f"with Runner.run(..., hooks=guard.hooks), and call guard.resume(state) before "
                f"resuming a RunState in a new process"
            )
        return str(conversation), place

    def tool(self, fn: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[C, P], R]:
        """Guard a tool function whose first parameter is the ``ToolContext``.

        Apply it under ``@function_tool``; the signature the SDK builds the tool's schema
        from is preserved. The tool's arguments and result must be encodable by the
        ledger's codec (JSON-like values).
        """
        return self._wrap_tool(fn, "ToolContext")

    def function_tool(self, fn: Callable[..., Any], **options: Any) -> Any:
        """``agents.function_tool(self.tool(fn), **options)``, with a failure function that
        lets the ledger's errors (in doubt, diverged, misconfigured) stop the run instead of
        being turned into a message for the model; other tool errors are answered as the
        SDK's default does (or by your ``failure_error_function``).

        Args:
            fn: The tool function (its first parameter is the ``ToolContext``).
            **options: Passed to ``agents.function_tool`` (``needs_approval``,
                ``name_override``, ...).
        """
        agents = _require()
        answer = options.pop("failure_error_function", agents.default_tool_error_function)

        def on_error(ctx: Any, error: Exception) -> Any:
            if isinstance(error, OnceOnlyError) or answer is None:
                raise error
            return answer(ctx, error)

        return agents.function_tool(self.tool(fn), failure_error_function=on_error, **options)

    # -- internals ----------------------------------------------------------------------

    def _note(self, context: Any, response: Any, *, started_from: int | None = None) -> None:
        """Remember where each function call of ``response`` sits."""
        if started_from is None:
            started_from = len(getattr(context, "turn_input", ()) or ())
        requests = int(getattr(getattr(context, "usage", None), "requests", 0) or 0)
        calls = [
            item
            for item in getattr(response, "output", ())
            if getattr(item, "type", None) == "function_call"
        ]
        with self._lock:
            for index, item in enumerate(calls):
                self._places[str(item.call_id)] = (
                    f"openai-agents/input[{started_from}].requests[{requests}].tool_calls[{index}]"
                )
                self._places.move_to_end(str(item.call_id))
            while len(self._places) > _REMEMBERED:
                self._places.popitem(last=False)

    def _guarded(self, ctx: Any, tool_args: dict[str, Any]) -> Guarded:
        """The tool call's guard; refuses a call approved for other arguments."""
        name = str(ctx.tool_name)
        policy = self.policy(name)
        with self._lock:
            approved = self._approved.get(ctx.tool_call_id)
        if approved is not None and approved != self.approval_hash(name, tool_args):
            raise ApprovalMismatch(name, str(ctx.tool_call_id))
        return policy_guard(self.ledger, policy, name, policy.classify)
