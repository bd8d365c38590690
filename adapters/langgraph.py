"""LangGraph adapter: every tool call a ``ToolNode`` executes happens once.

:class:`ToolGuard` plugs into LangGraph's prebuilt ``ToolNode`` through its hooks::

    guard = ToolGuard(ledger, policies={"book_room": ToolPolicy(provider_class="B", ...)})
    node = ToolNode([book_room, notify], wrap_tool_call=guard.wrap_tool_call,
                    awrap_tool_call=guard.awrap_tool_call)

Each tool call goes through :func:`adapters.guard` (the one claim/act/record path): the
ledger records the intent before the tool runs and the resulting ``ToolMessage`` after.
When LangGraph re-runs the super-step — ``invoke(None, config)`` after a crash or a failed
sibling call, in this process or another — the recorded message is returned (with the
current request's ``tool_call_id``) and the tool does not run again.

**Identity.** A tool call is placed by LangGraph's execution info and its position, never
by the model's ``tool_call_id`` (a re-planned message gets new ids)::

    run_id  = execution_info.thread_id
    step_id = f"{execution_info.checkpoint_ns}/tool_calls[{index}]"             (a batch)
            | f"{execution_info.checkpoint_ns}/messages[{at}].tool_calls[{index}]"
    visit   = 0
    effect  = policy.effect or f"{tool_name}@1"      (ordinal 0)

``checkpoint_ns`` is ``"<node>:<task_id>"``, prefixed by the parent graph's namespace in a
subgraph; ``task_id`` is LangGraph's deterministic uuid5 of the checkpoint the super-step
starts from, the namespace, the step number, the node and its trigger. Resuming the same
super-step (from the same checkpoint, in any process) yields the same task id; the next
super-step, a loop back through the node and ``update_state`` yield new ones, so those
act anew (a time-travel fork does too, but see **Forks** below). ``run_id``,
``node_attempt`` and ``node_first_attempt_time`` change on every resume or node retry and
are not used, which is also why ``visit`` is 0: a node retry is the same visit.

One task may run several batches of calls: a node that calls a model and a ``ToolNode``
in a loop invokes the ``ToolNode`` once per model turn, in one task. So a call is placed
within its task by ``at``, the position of the ``AIMessage`` that holds it in the list the
``ToolNode`` was given (``messages_key``), and ``index``, its position among that
message's ``tool_calls`` (the call's id only finds it there). Both are stable when the
task re-runs: a resume re-runs the whole node from the same checkpoint, and a node that
re-runs deterministically builds the same list, message for message, while the ids a
re-run model gives its messages and calls are new. The short form, without ``at``, is
kept for the one batch it always named (so runs recorded by earlier releases replay): a
batch whose ``AIMessage`` is in the state the task started from (a ``ToolNode`` as the
node, a ``Send`` to it, in a graph or a subgraph), and a node's first batch of its own
(the first ``AIMessage`` with tool calls in the list that is not in that state), unless
the task started with tool calls still unanswered (a node that runs them and then
loops: its own batches all take the long form). Two ``ToolNode`` invocations in one task
whose lists put different calls at the same position (each a fresh two-message
conversation, or a window that drops earlier turns) are one position: give each its
own task (a node, a ``Send``), or keep the earlier turns in the list.

The tool body runs inside that step (:func:`adapters.step`), so guarded adapters it calls
(``GuardedHTTP``, ``GuardedSMTP``) get stable position keys too. The tool name and
arguments are fingerprinted: the same position with other arguments is a
``KeyReuseError`` (a re-run model that re-plans a call with other arguments stops the
run, it does not act). A graph without a checkpointer (or invoked without a
``thread_id``) has no resume: the guard refuses it (``ConfigurationError``).

**Durability.** The task id, and so the key, is only as durable as the checkpoint it is
derived from, and that checkpoint also holds the plan (the ``AIMessage``, the ``Send``)
the call carries out. Under LangGraph's default ``durability="async"`` the super-step's
tasks start while that checkpoint is still being saved: a crash after the tool acted and
before the save landed resumes from an older checkpoint, the model's step is re-run (or
its saved writes re-applied) into a new checkpoint, and the same call comes back under a
new task id, possibly re-planned with other arguments or at another index, and would act
a second time. So before the first call of a super-step the guard waits until the
checkpointer holds every checkpoint in the task's ``checkpoint_map`` (its own graph's and
each enclosing graph's): the call acts only from a durable plan, and any resume re-runs
it from that same checkpoint, so with the same task id and key. ``durability="sync"``
has saved it already (one read confirms it); under ``"exit"`` LangGraph saves only when
the run ends, so a call planned from an unsaved checkpoint is refused at once with
:class:`PlanNotDurable` (nothing is sent; LangGraph saves the checkpoint as the run
exits, and a resume acts from it). A checkpoint still missing after
``checkpoint_wait_s`` (a subgraph compiled with ``checkpointer=False`` never saves its
own; a failing saver) is :class:`PlanNotDurable` too. "Durable" is the saver's word: a
checkpoint its ``get_tuple`` returns must survive a crash (``SqliteSaver``, the
PostgreSQL saver, ``OnceOnlySaver.from_url``; ``InMemorySaver`` only within a process).

**Outcomes.** Per tool, a :class:`ToolPolicy` names the provider class (A with a dedup
window, B with a probe, C), a ``classify`` function (default: every exception is
ambiguous) and a retry policy. A tool exception is classified by evidence:

* *not sent* → released and retried with the same key; when attempts run out the
  exception propagates and the run stops (nothing happened, so a resume tries again);
* *rejected* → recorded as failed and answered with an error ``ToolMessage``
  (``status="error"``), now and on every replay: the refusal is definite, the model may
  re-plan;
* *ambiguous* → class A re-sends within its window, class B asks its probe; otherwise
  :class:`~ledger.EffectInDoubt` propagates out of ``invoke``: **the run stops**. The
  model is never told "error, try again" about a call that may have happened (it would
  re-plan and act twice); an operator resolves the entry (``onceonly effects resolve``)
  and the run resumes with ``invoke(None, config)``. With
  ``ToolGuard(in_doubt="interrupt")`` the call interrupts the run instead, and a
  ``Command(resume={"resolve": key_id, "epoch": epoch, "happened": ..., "actor": ...})``
  records the decision and goes on (:mod:`adapters._langgraph_doubt`).

**Forks.** A time-travel fork runs from a copy of the past checkpoint with a new id, so
its tasks get new ids, and so do those of its later super-steps. With
``forks="replay"`` (the default) a call anywhere in a fork's lineage is placed as the
same call from the matching checkpoint of the lineage the fork left
(:mod:`adapters._langgraph_fork`): the same arguments replay what was made from there;
other arguments get a position of their own, keyed by their hash. ``forks="act"``:
every fork acts anew.

**Shapes.** :meth:`ToolGuard.middleware` is the guard as a langchain ``create_agent``
middleware; :meth:`ToolGuard.task` guards a functional-API ``@task`` body, keyed by the
task's ``checkpoint_ns``.

Keep ``ToolNode``'s default ``handle_tool_errors`` (it re-raises everything but argument
validation errors): with ``handle_tool_errors=True`` the node turns tool exceptions into
error messages before the guard sees them (they are then recorded as the tool's answer)
and turns ``EffectInDoubt`` into a message the model may act on. A tool must return
content (a ``ToolMessage``); a tool returning a ``Command`` cannot be recorded and its
call ends in doubt. An ``interrupt()`` inside a tool counts as *not sent*: LangGraph
re-runs the tool body on resume, so act after the interrupt.

**Approvals.** ``ToolPolicy(approval=True)`` makes a person approve each call of the tool
before it acts: the guard calls LangGraph's ``interrupt`` with ``{"kind":
"onceonly.approval", "tool", "args", "args_hash", "tool_call_id"}``, where ``args_hash``
is :meth:`ToolGuard.approval_hash` (keyed with the ledger's secret, so it is no oracle of
the arguments). The call runs only when the resume value is ``{"approve": args_hash}``
for the arguments it is about to send; ``{"reject": args_hash, "reason": ...}`` answers
the model with an error message (nothing happened, nothing recorded); anything else
(``"yes"``, or the hash of arguments that ``update_state`` has changed since the prompt)
asks again with the current arguments. A re-run of the task (a resume, a crash) replays
the decisions LangGraph stored for it, so an approved call is not asked again.

LangGraph is imported lazily: this module imports without the ``onceonly[langgraph]``
extra, and needs it only when a tool call arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from onceonly.checkpoint.errors import CodecError, ConfigurationError, OnceOnlyError
from onceonly.ledger import (
    EffectFailed,
    EffectInDoubt,
    KeyReuseError,
    Ledger,
    OutcomeClass,
    ProviderClass,
)
from onceonly.ledger.keys import canonical_args

from . import _langgraph_doubt as _doubt
from . import _langgraph_fork as _fork
from . import _tool_calls
from .context import step
from .guard import Probe, RetryPolicy

if TYPE_CHECKING:
    from langchain_core.messages import ToolMessage
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.types import Command

__all__ = ["PlanNotDurable", "ToolGuard", "ToolPolicy"]

P = ParamSpec("P")
R = TypeVar("R")

_RECORD = "tool_message"  # the recorded result's tag (a probe's result has none)
_SAVED = 1024  # checkpoints a guard remembers as saved (one read per super-step, not call)
_FIRST_PAUSE_S = 0.002
_IN_DOUBT = ("raise", "interrupt")
_FORKS = ("replay", "act")
_MAX_PAUSE_S = 0.05
_NO_ACTOR = "unnamed (the resume value gave no actor)"


class PlanNotDurable(ConfigurationError):
    """A tool call's super-step was planned from a checkpoint the saver does not hold.

    Acting now could act twice: a crash would resume from an older checkpoint and the call
    would come back under a new task id, so a new key. Nothing was sent and nothing was
    recorded.

    Attributes:
        thread_id: The thread.
        checkpoint_ns: The namespace of the checkpoint that is not saved.
        checkpoint_id: Its id.
        durability: The run's LangGraph durability mode.
    """

    def __init__(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        durability: str,
        waited_s: float,
    ) -> None:
        self.thread_id = thread_id
        self.checkpoint_ns = checkpoint_ns
        self.checkpoint_id = checkpoint_id
        self.durability = durability
        if durability == "exit":
            why = (
                "the run uses durability='exit', which saves checkpoints only when the run "
                "ends. Invoke graphs with guarded tools with durability='sync' or 'async' (the "
                "default); the checkpoint is saved as this run exits, and a resume "
                "(invoke(None, config)) acts from it"
            )
        else:
            why = (
                f"the checkpointer did not hold it after {waited_s:g} s: a subgraph compiled "
                "with checkpointer=False never saves its checkpoints (compile it with the "
                "default checkpointer=None, or True), or the saver is failing or slower than "
                "ToolGuard(checkpoint_wait_s=...)"
            )
        super().__init__(
            f"tool call not made: its super-step was planned from checkpoint {checkpoint_id} "
            f"(thread {thread_id!r}, namespace {checkpoint_ns!r}), which is not saved, and "
            f"{why}. Nothing was sent."
        )


@dataclass(frozen=True)
class ToolPolicy:
    """How one tool's calls are guarded.

    Attributes:
        provider_class: ``A`` (the tool's provider deduplicates our key for ``window_s``),
            ``B`` (``probe`` can tell whether a call happened) or ``C`` (neither).
        window_s: Class A: how long the provider deduplicates our key.
        probe: Class B: asks the provider about an in-doubt call by its
            ``provider_key``; a found result becomes the replayed message's content.
        classify: The outcome of a tool exception by evidence (default: ambiguous).
        retry: Attempts and pauses (default: :data:`adapters.DEFAULT_RETRY`).
        effect: The effect's ``name@version`` (default: ``"<tool name>@1"``); bump the
            version when the tool's meaning changes.
        approval: A person approves each call first: the guard interrupts the run with
            the tool's name, arguments and their ``args_hash``
            (:meth:`ToolGuard.approval_hash`), and the call runs only when the resume
            value is ``{"approve": args_hash}`` for exactly those arguments
            (``{"reject": args_hash}`` answers the model that it was refused). Any
            other resume value, or a hash of other arguments (changed by
            ``update_state`` after the prompt), asks again with the current arguments.
    """

    provider_class: ProviderClass | str = ProviderClass.OPAQUE
    window_s: float | None = None
    probe: Probe | None = None
    classify: Callable[[BaseException], OutcomeClass] | None = None
    retry: RetryPolicy | None = None
    effect: str | None = None
    approval: bool = False

    def __post_init__(self) -> None:
        pclass = ProviderClass(self.provider_class)
        object.__setattr__(self, "provider_class", pclass)
        if pclass is ProviderClass.DEDUPLICATING and (self.window_s is None or self.window_s <= 0):
            raise ConfigurationError("a class A (deduplicating) tool needs window_s > 0")
        if pclass is ProviderClass.QUERYABLE and self.probe is None:
            raise ConfigurationError("a class B (queryable) tool needs probe=")
        if pclass is not ProviderClass.QUERYABLE and self.probe is not None:
            raise ConfigurationError("probe= is only used by class B tools")


class _Unrecordable(TypeError):
    """The tool acted, but its output cannot be recorded (not a ``ToolMessage`` of
    codec-encodable content): the call is in doubt."""


@dataclass(frozen=True)
class _Call:
    """One tool call, placed: its guard options, position and arguments."""

    tool: str
    args: Any
    policy: ToolPolicy
    classify: Callable[[BaseException], OutcomeClass]
    run_id: str
    step_id: str
    task: tuple[str, str]  # (thread, checkpoint_ns): the ToolNode task it runs in
    plan: _Plan


@dataclass(frozen=True)
class _Plan:
    """The checkpoints a tool call's task was planned from, which must be saved first."""

    thread_id: str
    checkpoints: tuple[tuple[str, str], ...]  # (checkpoint_ns, checkpoint_id), outermost first
    saver: BaseCheckpointSaver[Any]
    durability: str

    def config(self, ns: str, checkpoint_id: str) -> Any:
        return {
            "configurable": {
                "thread_id": self.thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        }


class ToolGuard:
    """Guards the tool calls of a LangGraph ``ToolNode`` (see the module docstring).

    Pass :meth:`wrap_tool_call` and :meth:`awrap_tool_call` to ``ToolNode``; one guard
    may serve several nodes and graphs.

    Args:
        ledger: The effects ledger.
        policies: Per tool name.
        default: The policy of every other tool (default: class C, every exception
            ambiguous: never re-sent).
        tenant: The tenant of every key.
        messages_key: The state key of the message list (as given to ``ToolNode``).
        checkpoint_wait_s: How long a call waits for the checkpointer to hold the
            checkpoint its super-step was planned from (``async`` durability saves it while
            the step runs) before it is refused with :class:`PlanNotDurable`.
        in_doubt: What a call the guard cannot settle by evidence does: ``"raise"``
            (the default, as in earlier releases): :class:`~ledger.EffectInDoubt`
            propagates out of ``invoke`` and an operator resolves the entry;
            ``"interrupt"``: the run interrupts with ``{"kind": "onceonly.in_doubt",
            "tool", "args", "key_id", "epoch", "provider_key", "provider_class",
            "evidence", "choices", ...}`` and a ``Command(resume={"resolve": key_id,
            "epoch": epoch, "happened": bool, "actor": ...})`` records the decision in
            the ledger and replays the call (happened) or sends it once more (did not).

        forks: A time-travel fork (``invoke(None, past_config)``) re-runs the super-steps
            after the checkpoint it copies. ``"replay"`` (the default): a call the fork
            makes, in any of its super-steps, with the same arguments at the same
            position as a call already made from that checkpoint (by the original run
            or an earlier fork) replays its recorded result; other arguments make a new
            call, once per fork of that checkpoint with those arguments. ``"act"``:
            every fork acts anew.

    Raises:
        ConfigurationError: ``checkpoint_wait_s`` is not positive, ``in_doubt`` is
            neither ``"raise"`` nor ``"interrupt"``, or ``forks`` neither ``"replay"``
            nor ``"act"``.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        policies: Mapping[str, ToolPolicy] | None = None,
        default: ToolPolicy | None = None,
        tenant: str = "",
        messages_key: str = "messages",
        checkpoint_wait_s: float = 30.0,
        in_doubt: str = "raise",
        forks: str = "replay",
    ) -> None:
        if not checkpoint_wait_s > 0:
            raise ConfigurationError("checkpoint_wait_s must be > 0")
        if in_doubt not in _IN_DOUBT:
            raise ConfigurationError(f"in_doubt must be 'raise' or 'interrupt', not {in_doubt!r}")
        if forks not in _FORKS:
            raise ConfigurationError(f"forks must be 'replay' or 'act', not {forks!r}")
        self.in_doubt = in_doubt
        self.forks = forks
        self.ledger = ledger
        self.policies = dict(policies or {})
        self.default = default or ToolPolicy()
        self.tenant = tenant
        self.messages_key = messages_key
        self.checkpoint_wait_s = checkpoint_wait_s
        self._peers: dict[tuple[str, str], set[asyncio.Event]] = {}  # per running task
        # (thread, ns, checkpoint id) -> its metadata's source ("fork": a time-travel copy)
        self._saved: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._saved_lock = threading.Lock()  # ToolNode runs a message's calls in threads
        # per saver: where its checkpoints sit relative to time-travel forks
        self._lineages: weakref.WeakKeyDictionary[Any, _fork.Lineage] = weakref.WeakKeyDictionary()

    def policy(self, tool: str) -> ToolPolicy:
        """The policy of ``tool``."""
        return self.policies.get(tool, self.default)

    def position(self, request: ToolCallRequest) -> tuple[str, str]:
        """The ``(run_id, step_id)`` a tool call's key is derived from.

        Raises:
            ConfigurationError: No thread (a graph without a checkpointer, or a
                ``ToolNode`` called outside a graph), or the call is not found exactly
                once in an ``AIMessage`` of the state.
        """
        runtime = getattr(request, "runtime", None)
        info = getattr(runtime, "execution_info", None)
        if info is None or not info.thread_id:
            raise ConfigurationError(
                "a guarded ToolNode must run in a graph compiled with a checkpointer and "
                "invoked with a thread_id: without them there is no resume to protect and "
                "no stable key"
            )
        messages = _messages(request.state, self.messages_key)
        at, index = _index(request, messages, self.messages_key)
        ns = info.checkpoint_ns
        if _first_batch(request, messages, at, self.messages_key):
            return info.thread_id, f"{ns}/tool_calls[{index}]"
        return info.thread_id, f"{ns}/messages[{at}].tool_calls[{index}]"

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        execute: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        """``ToolNode(wrap_tool_call=...)``: run the call once, or replay its message.

        Raises:
            ledger.EffectInDoubt: The call may have happened and no evidence settles it.
            ledger.KeyReuseError: This position was recorded with other arguments.
            PlanNotDurable: The checkpoint the call was planned from is not saved (and
                will not be, or not within ``checkpoint_wait_s``); nothing was sent.
            ConfigurationError: No checkpointer or no thread, or the call has no position.
            Exception: The tool's own exception when it was not sent and attempts ran out.
        """
        call = self._place(request)
        codec = self.ledger.codec
        refused = self._approve(call, request)
        if refused is not None:
            return refused

        def act(tool: str, args: Any) -> dict[str, Any]:
            return _record(execute(request), codec)

        guarded = self._guard(call)(act)
        self._wait_saved(call.plan)
        if self._maybe_fork(call):
            call = self._forked(call, request)
        refusal = ""
        while True:  # each round: act or replay; in doubt: ask, record, go again
            with step(call.run_id, call.step_id, tenant=self.tenant):  # the same key each round
                try:
                    return _message(guarded(call.tool, call.args), request)
                except Exception as exc:
                    answer = self._in_doubt(call, request, exc)
                    if isinstance(answer, _doubt.Doubt):
                        refusal = self._ask(call, request, answer, refusal)
                        continue
                    if answer is None:
                        answer = _answer(call, request, exc)
                    if answer is None:
                        raise
                    return answer

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        execute: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """``ToolNode(awrap_tool_call=...)``: the async twin of :meth:`wrap_tool_call`."""
        call = self._place(request)
        codec = self.ledger.codec

        async def act(tool: str, args: Any) -> dict[str, Any]:
            return _record(await execute(request), codec)

        guarded = self._guard(call)(act)
        # ToolNode gathers a message's calls: the first exception out of gather ends the
        # run and cancels the siblings mid-call, which would leave them in doubt. A
        # failing call waits until its siblings are recorded, then raises.
        peers = self._peers.setdefault(call.task, set())
        done = asyncio.Event()
        peers.add(done)
        try:
            with step(call.run_id, call.step_id, tenant=self.tenant):
                try:
                    # Inside: a refused call, like a failed one, waits for its siblings
                    # (so does one that interrupts for its approval).
                    if call.policy.approval:
                        await asyncio.sleep(0)  # the siblings start (and join peers) first
                    refused = self._approve(call, request)
                    if refused is not None:
                        return refused
                    await self._await_saved(call.plan)
                    if self._maybe_fork(call):
                        call = await asyncio.to_thread(self._forked, call, request)
                    refusal = ""
                    while True:  # as in wrap_tool_call
                        try:
                            with step(call.run_id, call.step_id, tenant=self.tenant):
                                answer = await guarded(call.tool, call.args)
                            return _message(answer, request)
                        except Exception as exc:
                            doubt = await self._ain_doubt(call, request, exc)
                            if not isinstance(doubt, _doubt.Doubt):
                                if doubt is None:
                                    raise
                                return doubt
                            refusal = await self._aask(call, request, doubt, refusal)
                except Exception as exc:
                    answer = _answer(call, request, exc)
                    if answer is None:
                        done.set()
                        await asyncio.gather(*(peer.wait() for peer in list(peers)))
                        raise
                    return answer
        finally:
            done.set()
            peers.discard(done)
            if not peers:
                self._peers.pop(call.task, None)

    def approval_hash(self, tool: str, args: Any) -> str:
        """The keyed hash an approval of ``tool`` called with ``args`` must name.

        Keyed with the ledger's current secret (an unkeyed hash of arguments is a
        dictionary oracle); equal arguments in any order hash alike.
        """
        return _tool_calls.approval_hash(self.ledger, tool, args)

    def middleware(self) -> Any:
        """This guard as a langchain ``create_agent`` middleware (``AgentMiddleware``).

        ``create_agent(model, tools, middleware=[guard.middleware()], checkpointer=...)``
        sends every tool call of the agent through :meth:`wrap_tool_call` /
        :meth:`awrap_tool_call`. Needs ``langchain`` (``pip install
        "onceonly[langchain]"``).

        Raises:
            ConfigurationError: ``langchain`` is not installed.
        """
        try:
            from langchain.agents.middleware import (  # noqa: PLC0415  (optional dependency)
                AgentMiddleware,
            )
        except ImportError as exc:
            raise ConfigurationError(
                'ToolGuard.middleware() needs langchain: pip install "onceonly[langchain]"'
            ) from exc
        owner = self

        class OnceOnlyToolGuard(AgentMiddleware):
            """Runs each of the agent's tool calls once (``onceonly`` ``ToolGuard``)."""

            def wrap_tool_call(
                self,
                request: ToolCallRequest,
                handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
            ) -> ToolMessage | Command[Any]:
                return owner.wrap_tool_call(request, handler)

            async def awrap_tool_call(
                self,
                request: ToolCallRequest,
                handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
            ) -> ToolMessage | Command[Any]:
                return await owner.awrap_tool_call(request, handler)

        return OnceOnlyToolGuard()

    def task(
        self, name: str, *, policy: ToolPolicy | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Guard the body of a functional-API ``@task`` (sync or ``async``)::

            @task
            @guard.task("book_room")
            def book_room(room: str, night: str) -> dict: ...

        The body's effect happens once: LangGraph re-runs a task whose result it did not
        save (a crash after the effect), and the re-run replays the recorded result. The
        key is placed by the task's ``checkpoint_ns`` (its deterministic task id, derived
        from the entrypoint's checkpoint, its call path and its index), like a tool call;
        the arguments are fingerprinted and the result recorded, so both must be
        codec-encodable. The call waits for the checkpoint its task was planned from, as
        tool calls do, and a time-travel fork places it as tool calls are placed (see
        ``forks``). An in-doubt call raises :class:`~ledger.EffectInDoubt`.

        Args:
            name: The effect's name (``"<name>@1"`` unless the policy names one); the
                policy is ``policy`` or :meth:`policy` of ``name``.
            policy: Overrides the guard's policy for ``name``.

        Raises:
            ConfigurationError: Called outside a run with a checkpointer and a thread.
        """
        chosen = policy or self.policy(name)
        classify = _classifier(chosen)

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            guarded = self._guard_as(chosen, name, classify)(fn)
            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def aguarded(*args: Any, **kwargs: Any) -> Any:
                    thread, ns, plan = self._task_position(name)
                    await self._await_saved(plan)
                    at = ns
                    if self._plan_may_fork(plan):
                        at = await asyncio.to_thread(self._task_forked, thread, ns, plan)
                    try:
                        with step(thread, at, tenant=self.tenant):
                            return await guarded(*args, **kwargs)
                    except KeyReuseError:
                        if at == ns:  # not a forked call: the run diverged
                            raise
                    # Other arguments than the call made from that checkpoint: a new call,
                    # placed by its arguments (the same fork taken again replays it).
                    with step(thread, self._by_args(at, name, args, kwargs), tenant=self.tenant):
                        return await guarded(*args, **kwargs)

                return cast(Callable[P, R], aguarded)

            @functools.wraps(fn)
            def sguarded(*args: P.args, **kwargs: P.kwargs) -> R:
                thread, ns, plan = self._task_position(name)
                self._wait_saved(plan)
                at = self._task_forked(thread, ns, plan) if self._plan_may_fork(plan) else ns
                try:
                    with step(thread, at, tenant=self.tenant):
                        return cast(R, guarded(*args, **kwargs))
                except KeyReuseError:
                    if at == ns:
                        raise
                with step(thread, self._by_args(at, name, args, kwargs), tenant=self.tenant):
                    return cast(R, guarded(*args, **kwargs))

            return sguarded

        return decorate

    # -- internals ----------------------------------------------------------------------

    def _in_doubt(
        self, call: _Call, request: ToolCallRequest, exc: Exception
    ) -> _doubt.Doubt | ToolMessage | None:
        """With ``in_doubt="interrupt"``: the entry to ask about, or the answer to a call
        resolved as happened without its result; None: ``exc`` goes its usual way."""
        if self.in_doubt != "interrupt":
            return None
        said = _doubt.unknown_result(exc, call.tool)
        if said is not None:
            return _told(request, said)
        return _doubt.doubt_of(self.ledger, exc)

    async def _ain_doubt(
        self, call: _Call, request: ToolCallRequest, exc: Exception
    ) -> _doubt.Doubt | ToolMessage | None:
        """The async twin of :meth:`_in_doubt` (the ledger read off the event loop)."""
        if self.in_doubt != "interrupt" or not isinstance(exc, EffectInDoubt):
            return self._in_doubt(call, request, exc)  # no I/O on these paths
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.ledger.executor(), functools.partial(_doubt.doubt_of, self.ledger, exc)
        )

    def _ask(self, call: _Call, request: ToolCallRequest, doubt: _doubt.Doubt, refusal: str) -> str:
        """Interrupt with the in-doubt prompt; record the decision. Returns why a decision
        was not taken ("" if it was): the next prompt says so."""
        from langgraph.types import interrupt  # noqa: PLC0415  (optional dependency)

        value = _doubt.prompt(doubt, call.tool, call.args, request.tool_call.get("id"), refusal)
        return _doubt.decide(self.ledger, doubt, interrupt(value), call.run_id)

    async def _aask(
        self, call: _Call, request: ToolCallRequest, doubt: _doubt.Doubt, refusal: str
    ) -> str:
        """The async twin of :meth:`_ask`."""
        from langgraph.types import interrupt  # noqa: PLC0415  (optional dependency)

        value = _doubt.prompt(doubt, call.tool, call.args, request.tool_call.get("id"), refusal)
        decision = interrupt(value)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.ledger.executor(),
            functools.partial(_doubt.decide, self.ledger, doubt, decision, call.run_id),
        )

    def _approve(self, call: _Call, request: ToolCallRequest) -> ToolMessage | None:
        """Wait for a decision on exactly this call's arguments (``ToolPolicy.approval``).

        None: approved (or no approval needed); a message: rejected. LangGraph's
        ``interrupt`` stops the run until it is resumed, and a re-run of the task replays
        the decisions it was given, in order.
        """
        if not call.policy.approval:
            return None
        from langgraph.types import interrupt  # noqa: PLC0415  (optional dependency)

        digest = self.approval_hash(call.tool, call.args)
        prompt = {
            "kind": "onceonly.approval",
            "tool": call.tool,
            "args": call.args,
            "args_hash": digest,
            "tool_call_id": request.tool_call.get("id"),
        }
        while True:  # a decision on anything else asks again
            decision = interrupt(prompt)
            if not isinstance(decision, Mapping):
                continue
            if decision.get("approve") == digest:
                self._record_decision(call, request, digest, decision, "approve", "")
                return None
            if decision.get("reject") == digest:
                reason = str(decision.get("reason") or "the approver refused it")
                self._record_decision(call, request, digest, decision, "reject", reason)
                return _refused(request, "NotApproved", reason)

    def _record_decision(
        self,
        call: _Call,
        request: ToolCallRequest,
        digest: str,
        decision: Mapping[str, Any],
        verdict: str,
        reason: str,
    ) -> None:
        """The approval decision in the run's audit chain (an ``operator`` event, sealed
        and checked by ``onceonly audit verify``), once: LangGraph gives a re-run task
        the same resume values again, and recording the same decision again appends
        nothing."""
        actor = str(decision.get("actor") or "") or _NO_ACTOR
        self.ledger.record_action(
            call.run_id,
            f"langgraph.approval\x1f{call.step_id}\x1f{digest}",
            actor=actor,
            detail={
                "action": f"langgraph.{verdict}",
                "tool": call.tool,
                "args_hash": digest,
                "step_id": call.step_id,
                "tool_call_id": request.tool_call.get("id"),
                "reason": reason,
            },
        )

    def _place(self, request: ToolCallRequest) -> _Call:
        tool = request.tool_call["name"]
        policy = self.policy(tool)
        run_id, step_id = self.position(request)
        task = (run_id, str(getattr(request.runtime.execution_info, "checkpoint_ns", "")))
        return _Call(
            tool,
            request.tool_call["args"],
            policy,
            _classifier(policy),
            run_id,
            step_id,
            task,
            _plan(request, run_id),
        )

    def _maybe_fork(self, call: _Call) -> bool:
        """Whether the call's super-step may have been planned in a time-travel fork's
        lineage (``forks="replay"``): False only when that is known without I/O."""
        if self.forks != "replay":
            return False
        graph_ns, checkpoint_id = call.plan.checkpoints[-1]
        lineage = self._lineage(call.plan.saver)
        return not lineage.known(call.plan.thread_id, graph_ns, checkpoint_id)

    def _plan_may_fork(self, plan: _Plan) -> bool:
        if self.forks != "replay":
            return False
        graph_ns, checkpoint_id = plan.checkpoints[-1]
        return not self._lineage(plan.saver).known(plan.thread_id, graph_ns, checkpoint_id)

    def _task_forked(self, thread: str, ns: str, plan: _Plan) -> str:
        """A functional-API task's namespace from its checkpoint's equivalent (as
        :meth:`_forked` places a tool call); ``ns`` when in no fork's lineage."""
        from langgraph.config import get_config  # noqa: PLC0415  (optional dependency)

        metadata = get_config().get("metadata", {})
        graph_ns, checkpoint_id = plan.checkpoints[-1]
        lineage = self._lineage(plan.saver)
        origin = _fork.origin_namespace(lineage, thread, graph_ns, checkpoint_id, ns, metadata)
        return ns if origin is None else origin

    def _by_args(self, at: str, name: str, args: Any, kwargs: Any) -> str:
        digest = self.approval_hash(name, {"args": list(args), "kwargs": dict(kwargs)})
        return f"{at}/args:{digest[:32]}"

    def _lineage(self, saver: BaseCheckpointSaver[Any]) -> _fork.Lineage:
        with self._saved_lock:
            try:
                lineage = self._lineages.get(saver)
            except TypeError:  # a saver that cannot be weakly referenced: no cache
                return _fork.Lineage(saver.get_tuple, saver.list)
            if lineage is None:
                lineage = self._lineages[saver] = _fork.Lineage(saver.get_tuple, saver.list)
            return lineage

    def _forked(self, call: _Call, request: ToolCallRequest) -> _Call:
        """The call placed as the same call from its checkpoint's equivalent (see
        ``ToolGuard(forks=...)``); unchanged when its checkpoint is in no fork's lineage."""
        plan = call.plan
        graph_ns, checkpoint_id = plan.checkpoints[-1]
        ns = str(getattr(request.runtime.execution_info, "checkpoint_ns", ""))
        metadata = (getattr(request.runtime, "config", None) or {}).get("metadata", {})
        origin = _fork.origin_namespace(
            self._lineage(plan.saver), plan.thread_id, graph_ns, checkpoint_id, ns, metadata
        )
        if origin is None or not call.step_id.startswith(ns):
            return call
        step_id = origin + call.step_id[len(ns) :]
        effect = call.policy.effect or f"{call.tool}@1"
        made = self.ledger.effects(run_id=call.run_id, step_id=step_id, effect=effect)
        if made:
            keyring = self.ledger.keyring
            canonical = canonical_args({"tool": call.tool, "args": call.args}, self.ledger.codec)
            if not any(e.fingerprint == keyring.fingerprint(e.secret_id, canonical) for e in made):
                # Other arguments than the call made from that checkpoint: a new call,
                # placed by its arguments so that the same fork taken again replays it.
                step_id += f"/args:{self.approval_hash(call.tool, call.args)[:32]}"
        return dataclasses.replace(call, step_id=step_id)

    def _unsaved(self, plan: _Plan) -> list[tuple[str, str]]:
        with self._saved_lock:
            return [c for c in plan.checkpoints if (plan.thread_id, *c) not in self._saved]

    def _remember(self, plan: _Plan, checkpoint: tuple[str, str], saved: Any) -> None:
        source = str((getattr(saved, "metadata", None) or {}).get("source", ""))
        with self._saved_lock:
            self._saved[(plan.thread_id, *checkpoint)] = source
            while len(self._saved) > _SAVED:
                self._saved.popitem(last=False)

    def _wait_saved(self, plan: _Plan) -> None:
        """Return once the saver holds every checkpoint of ``plan``; else PlanNotDurable."""
        deadline = time.monotonic() + self.checkpoint_wait_s
        pause = _FIRST_PAUSE_S
        for checkpoint in self._unsaved(plan):
            while (saved := plan.saver.get_tuple(plan.config(*checkpoint))) is None:
                pause = self._pause(plan, checkpoint, deadline, pause)
                time.sleep(pause)
            self._remember(plan, checkpoint, saved)

    async def _await_saved(self, plan: _Plan) -> None:
        """The async twin of :meth:`_wait_saved`."""
        deadline = time.monotonic() + self.checkpoint_wait_s
        pause = _FIRST_PAUSE_S
        for checkpoint in self._unsaved(plan):
            while (saved := await _aget_tuple(plan.saver, plan.config(*checkpoint))) is None:
                pause = self._pause(plan, checkpoint, deadline, pause)
                await asyncio.sleep(pause)
            self._remember(plan, checkpoint, saved)

    def _pause(
        self, plan: _Plan, checkpoint: tuple[str, str], deadline: float, pause: float
    ) -> float:
        """The next pause before asking the saver again; PlanNotDurable when none is left."""
        left = deadline - time.monotonic()
        if plan.durability == "exit" or left <= 0:
            # "exit" saves only when the run ends: waiting inside the run cannot help.
            raise PlanNotDurable(
                plan.thread_id,
                checkpoint[0],
                checkpoint[1],
                plan.durability,
                self.checkpoint_wait_s,
            )
        return min(pause * 2, _MAX_PAUSE_S, left)

    def _guard(self, call: _Call) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._guard_as(call.policy, call.tool, call.classify)

    def _guard_as(
        self, policy: ToolPolicy, name: str, classify: Callable[[BaseException], OutcomeClass]
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return _tool_calls.policy_guard(self.ledger, policy, name, classify)

    def _task_position(self, name: str) -> tuple[str, str, _Plan]:
        """The run, step and plan of the functional-API task now running (for :meth:`task`)."""
        from langgraph.config import get_config  # noqa: PLC0415  (optional dependency)

        try:
            conf: Mapping[str, Any] = get_config().get("configurable", {})
        except RuntimeError as exc:
            raise ConfigurationError(
                f"the guarded task {name!r} was called outside a LangGraph run: call it from "
                "an @entrypoint (or a graph node) compiled with a checkpointer"
            ) from exc
        thread = conf.get("thread_id")
        if not thread:
            raise ConfigurationError(
                f"the guarded task {name!r} needs a run with a thread_id and a checkpointer: "
                "without them there is no resume to protect and no stable key"
            )
        ns = str(conf.get("checkpoint_ns", ""))
        plan = plan_of(conf, str(thread), None, f"the guarded task {name!r}")
        # A task called from an entrypoint's task maps that task's namespace to its
        # graph's checkpoint as well; only a graph's own namespace has checkpoints saved.
        own: list[tuple[str, str]] = []
        for checkpoint in plan.checkpoints:
            if not own or own[-1][1] != checkpoint[1]:
                own.append(checkpoint)
        return str(thread), ns, dataclasses.replace(plan, checkpoints=tuple(own))


def _plan(request: ToolCallRequest, thread_id: str) -> _Plan:
    """The checkpoints the call's task was planned from, the saver and the durability mode.

    ``checkpoint_map`` maps the namespace of the call's graph and of each enclosing graph
    to the checkpoint its current super-step was planned from; the call's task id (in the
    key) derives from the innermost, and its namespace holds the enclosing tasks' ids,
    derived from the others.
    """
    info = request.runtime.execution_info
    conf: Mapping[str, Any] = (getattr(request.runtime, "config", None) or {}).get(
        "configurable", {}
    )
    fallback = None if info is None else (info.checkpoint_ns, info.checkpoint_id)
    return plan_of(conf, thread_id, fallback, "a guarded ToolNode")


def plan_of(
    conf: Mapping[str, Any], thread_id: str, fallback: tuple[str, str] | None, what: str
) -> _Plan:
    """:func:`_plan` from a task's ``configurable`` (``fallback``: the task's namespace
    and checkpoint id when the config has no ``checkpoint_map``)."""
    from langgraph._internal._constants import (  # noqa: PLC0415  (optional dependency)
        CONFIG_KEY_CHECKPOINT_MAP,
        CONFIG_KEY_CHECKPOINTER,
        CONFIG_KEY_DURABILITY,
    )

    saver = conf.get(CONFIG_KEY_CHECKPOINTER)
    if saver is None:
        raise ConfigurationError(
            f"{what} must run in a graph compiled with a checkpointer: without one there is "
            "no resume to protect and no stable key"
        )
    mapped = conf.get(CONFIG_KEY_CHECKPOINT_MAP)
    if not mapped and fallback is not None:
        mapped = {fallback[0].rpartition("|")[0]: fallback[1]}
    if not mapped:
        raise ConfigurationError(
            "cannot tell which checkpoint this call was planned from (no checkpoint_map in "
            "its config): nothing was sent"
        )
    # LangGraph's default (it stores the mode in the config only when one is given).
    durability = str(conf.get(CONFIG_KEY_DURABILITY) or "async")
    return _Plan(thread_id, tuple((str(k), str(v)) for k, v in mapped.items()), saver, durability)


async def _aget_tuple(saver: BaseCheckpointSaver[Any], config: Any) -> Any:
    try:
        return await saver.aget_tuple(config)
    except NotImplementedError:  # a sync-only saver (SqliteSaver) behind an async tool call
        return await asyncio.to_thread(saver.get_tuple, config)


def _answer(call: _Call, request: ToolCallRequest, exc: Exception) -> ToolMessage | None:
    """The message for a definite refusal (recorded or replayed); None: re-raise."""
    if isinstance(exc, EffectFailed):
        return _refused(request, exc.error_type, exc.message)
    if isinstance(exc, OnceOnlyError):
        return None  # in doubt, diverged, misconfigured: the run stops
    if call.classify(exc) is OutcomeClass.REJECTED:
        return _refused(request, type(exc).__name__, str(exc))
    return None


def _classifier(policy: ToolPolicy) -> Callable[[BaseException], OutcomeClass]:
    """The policy's classification, with the adapter's own cases first."""
    from langgraph.errors import GraphBubbleUp  # noqa: PLC0415  (optional dependency)

    user = policy.classify

    def classify(exc: BaseException) -> OutcomeClass:
        if isinstance(exc, _Unrecordable):
            return OutcomeClass.AMBIGUOUS  # the tool acted; only its answer is lost
        if isinstance(exc, GraphBubbleUp):
            return OutcomeClass.NOT_SENT  # an interrupt: LangGraph re-runs the body
        return OutcomeClass.AMBIGUOUS if user is None else user(exc)

    return classify


def _messages(state: Any, messages_key: str) -> Any:
    """The message list of a ``ToolNode``'s input state."""
    if isinstance(state, list):
        return state
    if isinstance(state, Mapping):
        return state.get(messages_key, [])
    return getattr(state, messages_key, [])


def _index(request: ToolCallRequest, messages: Any, messages_key: str) -> tuple[int, int]:
    """The position of the ``AIMessage`` that holds the call in ``messages``, and the
    call's position among that message's tool calls."""
    from langchain_core.messages import AIMessage  # noqa: PLC0415  (optional dependency)

    call_id = request.tool_call.get("id")
    if call_id:
        for at in range(len(messages) - 1, -1, -1):
            message = messages[at]
            if not isinstance(message, AIMessage):
                continue
            ids = [c.get("id") for c in message.tool_calls]
            if call_id in ids:
                if ids.count(call_id) > 1:
                    raise ConfigurationError(
                        f"tool call id {call_id!r} occurs twice in one AIMessage: the calls "
                        "cannot be told apart, so neither is run"
                    )
                return at, ids.index(call_id)
    raise ConfigurationError(
        f"cannot place tool call {call_id!r} of {request.tool_call['name']}: it is not in an "
        f"AIMessage of the state's {messages_key!r} (a ToolNode fed bare tool calls has no "
        "position to key them by)"
    )


def _first_batch(request: ToolCallRequest, messages: Any, at: int, messages_key: str) -> bool:
    """Whether the call's ``AIMessage`` (``messages[at]``) keeps the short step id.

    The short form (``<ns>/tool_calls[i]``, without the message's position) names the one
    batch of calls a task can hold without a model loop in the node: the ``AIMessage`` of
    the state the task started from (a ``ToolNode`` as the node, a ``Send`` to it), or,
    in a node that calls a model and a ``ToolNode`` in a loop, the first ``AIMessage``
    with tool calls the node made itself, unless the task started with calls still
    unanswered (those may be the node's first batch). Every other batch is placed by its
    position in the list as well.
    """
    from langchain_core.messages import AIMessage  # noqa: PLC0415  (optional dependency)

    stored = _stored_messages(request, messages_key)

    def resident(i: int) -> bool:
        if i >= len(stored):
            return False
        mine, theirs = messages[i], stored[i]
        return mine is theirs or (
            getattr(mine, "id", None) is not None and getattr(theirs, "id", None) == mine.id
        )

    if resident(at):
        return True
    if _pending(stored):
        return False
    return not any(
        isinstance(messages[i], AIMessage) and messages[i].tool_calls and not resident(i)
        for i in range(at)
    )


def _stored_messages(request: ToolCallRequest, messages_key: str) -> Sequence[Any]:
    """The message list of the state the call's task started from (empty if unreadable)."""
    from langgraph._internal._constants import (  # noqa: PLC0415  (optional dependency)
        CONFIG_KEY_READ,
    )
    from langgraph.errors import EmptyChannelError  # noqa: PLC0415  (optional dependency)

    conf: Mapping[str, Any] = (getattr(request.runtime, "config", None) or {}).get(
        "configurable", {}
    )
    read = conf.get(CONFIG_KEY_READ)
    if read is None:
        return ()
    try:
        stored = read(messages_key, fresh=False)  # the channels as the super-step started
    except (KeyError, EmptyChannelError):
        return ()
    return stored if isinstance(stored, Sequence) else ()


def _pending(stored: Sequence[Any]) -> bool:
    """Whether the last ``AIMessage`` of ``stored`` has a tool call no message answers."""
    from langchain_core.messages import AIMessage, ToolMessage  # noqa: PLC0415

    answered: set[Any] = set()
    for message in reversed(stored):
        if isinstance(message, ToolMessage):
            answered.add(message.tool_call_id)
        elif isinstance(message, AIMessage):
            return any(c.get("id") not in answered for c in message.tool_calls)
    return False


def _record(output: Any, codec: Any) -> dict[str, Any]:
    """The recorded form of a tool's ``ToolMessage`` (content, status, artifact)."""
    from langchain_core.messages import ToolMessage  # noqa: PLC0415  (optional dependency)

    if not isinstance(output, ToolMessage):
        raise _Unrecordable(
            f"the tool returned {type(output).__name__}, not a ToolMessage: a guarded tool "
            "must return content (not a Command) so its answer can be replayed"
        )
    body: dict[str, Any] = {"content": output.content, "status": output.status}
    if output.artifact is not None:
        body["artifact"] = output.artifact
    try:
        codec.encode(body)
    except CodecError as exc:
        raise _Unrecordable(f"the tool's answer cannot be recorded: {exc}") from exc
    return {_RECORD: body}


def _message(recorded: Any, request: ToolCallRequest) -> ToolMessage:
    """The ``ToolMessage`` for the current request from a recorded (or probed) result."""
    from langchain_core.messages import ToolMessage  # noqa: PLC0415  (optional dependency)

    name = request.tool_call["name"]
    call_id = request.tool_call["id"] or ""
    if isinstance(recorded, dict) and set(recorded) == {_RECORD}:
        body = recorded[_RECORD]
        return ToolMessage(
            content=body["content"],
            status=body["status"],
            artifact=body.get("artifact"),
            name=name,
            tool_call_id=call_id,
        )
    # A probe's or an operator's result: the provider's answer becomes the content.
    content = recorded if isinstance(recorded, str) else json.dumps(recorded, sort_keys=True)
    return ToolMessage(content=content, name=name, tool_call_id=call_id)


def _told(request: ToolCallRequest, content: str) -> ToolMessage:
    """A message to the model that is not the tool's own answer."""
    from langchain_core.messages import ToolMessage  # noqa: PLC0415  (optional dependency)

    return ToolMessage(
        content=content, name=request.tool_call["name"], tool_call_id=request.tool_call["id"] or ""
    )


def _refused(request: ToolCallRequest, error_type: str, message: str) -> ToolMessage:
    """The error message of a definite refusal (the call did not happen)."""
    from langchain_core.messages import ToolMessage  # noqa: PLC0415  (optional dependency)

    return ToolMessage(
        content=f"Error: {request.tool_call['name']} was refused ({error_type}: {message}); "
        "it did not happen.",
        name=request.tool_call["name"],
        tool_call_id=request.tool_call["id"] or "",
        status="error",
    )
