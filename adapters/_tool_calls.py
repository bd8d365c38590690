"""What the tool guards of the agent SDKs share: a policy's guard, the approval hash, and
the ``tool()`` wrapper that binds a call's arguments and runs it under its step.

Private: :class:`~adapters.pydantic_ai.PydanticAIToolGuard` and
:class:`~adapters.openai_agents.AgentsToolGuard` derive from :class:`SDKToolGuard`;
:class:`~adapters.langgraph.ToolGuard` uses :func:`policy_guard` and :func:`approval_hash`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import Ledger, OutcomeClass
from onceonly.ledger.keys import canonical_args

from .context import step
from .guard import guard

if TYPE_CHECKING:  # langgraph imports this module: no import of it at run time
    from .langgraph import ToolPolicy

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")

Guarded = Callable[[Callable[..., Any]], Callable[..., Any]]


def require(module: str, what: str, extra: str) -> Any:
    """The optional SDK ``module`` (imported lazily), or an ImportError naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover  (the extras are installed in CI)
        raise ImportError(
            f"guarding {what} tools needs the extra: pip install 'onceonly[{extra}]'"
        ) from exc


def policy_guard(
    ledger: Ledger,
    policy: ToolPolicy,
    name: str,
    classify: Callable[[BaseException], OutcomeClass] | None,
) -> Guarded:
    """The guard of a call of tool ``name`` under ``policy`` (classified by ``classify``)."""
    return guard(
        ledger,
        effect=policy.effect or f"{name}@1",
        provider_class=policy.provider_class,
        window_s=policy.window_s,
        retry=policy.retry,
        classify=classify,
        probe=policy.probe,
    )


def approval_hash(ledger: Ledger, tool: str, args: Any) -> str:
    """The keyed hash an approval of ``tool`` called with ``args`` must name."""
    keyring = ledger.keyring
    canonical = canonical_args({"tool": tool, "args": args}, ledger.codec)
    return keyring.fingerprint(keyring.current_id, canonical)


class SDKToolGuard:
    """The base of an agent SDK's tool guard: subclasses give :meth:`position` and
    :meth:`_guarded`, and their ``tool`` calls :meth:`_wrap_tool`."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        policies: Mapping[str, ToolPolicy] | None,
        default: ToolPolicy,
        tenant: str,
    ) -> None:
        self.ledger = ledger
        self.policies = dict(policies or {})
        self.default = default
        self.tenant = tenant

    def policy(self, tool: str) -> ToolPolicy:
        """The policy of ``tool``."""
        return self.policies.get(tool, self.default)

    def approval_hash(self, tool: str, args: Any) -> str:
        """The keyed hash an approval of ``tool`` called with ``args`` must name.

        Keyed with the ledger's current secret (an unkeyed hash of arguments is a
        dictionary oracle); equal arguments in any order hash alike.
        """
        return approval_hash(self.ledger, tool, args)

    def position(self, ctx: Any) -> tuple[str, str]:
        raise NotImplementedError

    def _guarded(self, ctx: Any, tool_args: dict[str, Any]) -> Guarded:
        raise NotImplementedError

    def _wrap_tool(
        self, fn: Callable[Concatenate[C, P], R], context: str
    ) -> Callable[Concatenate[C, P], R]:
        """``fn`` (its first parameter is the SDK's ``context``) guarded, its signature kept."""
        sig = inspect.signature(fn)
        params = list(sig.parameters)
        if not params:
            raise ConfigurationError(
                f"{fn.__name__}: a guarded tool takes the {context} as its first parameter"
            )

        def prepare(ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            bound = sig.bind(ctx, *args, **kwargs)
            bound.apply_defaults()
            call_args = dict(bound.arguments)
            call_args.pop(params[0])
            return call_args

        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[..., Awaitable[Any]], fn)

            @functools.wraps(fn)
            async def awrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
                tool_args = prepare(ctx, args, kwargs)
                guarded = self._guarded(ctx, tool_args)

                async def act(tool_args: dict[str, Any]) -> Any:
                    return await afn(ctx, *args, **kwargs)

                run_id, step_id = self.position(ctx)
                with step(run_id, step_id, tenant=self.tenant):
                    return await guarded(act)(tool_args)

            return cast(Callable[Concatenate[C, P], R], awrapper)

        @functools.wraps(fn)
        def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            tool_args = prepare(ctx, args, kwargs)
            guarded = self._guarded(ctx, tool_args)

            def act(tool_args: dict[str, Any]) -> Any:
                return fn(ctx, *args, **kwargs)

            run_id, step_id = self.position(ctx)
            with step(run_id, step_id, tenant=self.tenant):
                return guarded(act)(tool_args)

        return cast(Callable[Concatenate[C, P], R], wrapper)
