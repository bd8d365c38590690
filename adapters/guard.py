"""``guard``: make a callable an effect that happens once.

The guard derives the effect's key (from the current step, an explicit key function or a
key recipe), claims it in the ledger before calling, calls, classifies the outcome by
evidence, records it, and replays recorded results; one OpenTelemetry span per call.
Retries keep one key across all attempts and only happen when evidence allows: the
attempt never left (NOT_SENT), or a class-A provider deduplicates our key and its window
is open. An in-doubt call is reconciled by the adapter's probe where there is one;
otherwise it needs a human and the caller gets :class:`~ledger.EffectInDoubt`.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import tenacity
from opentelemetry import trace

from checkpoint.errors import ConfigurationError
from checkpoint.failpoints import failpoint
from ledger import (
    Claim,
    EffectFailed,
    EffectIdentity,
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    KeyRecipe,
    Ledger,
    OutcomeClass,
    ProviderClass,
    Replay,
)

from .context import _acting, expect_key, identity_for

__all__ = ["Probe", "RetryPolicy", "guard"]

P = ParamSpec("P")
R = TypeVar("R")

Probe = Callable[[EffectRecord], tuple[Evidence, Any]]
"""Asks the provider whether the effect of an in-doubt entry happened (by its
``provider_key``): returns the evidence and, if it happened, the provider's result."""

_tracer = trace.get_tracer("onceonly.adapters")


@dataclass(frozen=True)
class RetryPolicy:
    """How often a guarded call is attempted, and the pauses between attempts.

    Only attempts whose outcome allows it are retried (see the module docstring); every
    attempt carries the same key.

    Attributes:
        max_attempts: Attempts in all (1: never retry).
        initial_s: First pause.
        max_s: Longest pause.
        multiplier: Growth of the pause per attempt.
    """

    max_attempts: int = 3
    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_s < 0 or self.max_s < self.initial_s:
            raise ConfigurationError("RetryPolicy needs max_attempts >= 1, 0 <= initial_s <= max_s")

    def wait(self) -> tenacity.wait.wait_base:
        """The tenacity wait strategy: exponential from ``initial_s``, capped at ``max_s``."""
        return tenacity.wait_exponential(
            multiplier=self.initial_s, exp_base=self.multiplier, max=self.max_s
        )

    def pause_before(self, attempt: int) -> float:
        """Seconds to pause before ``attempt`` (2, 3, ...), as tenacity computes them."""
        state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        state.attempt_number = attempt - 1
        return float(self.wait()(state))


class _Again(Exception):
    """This attempt may be repeated with the same key; carries what it saw."""

    def __init__(self, cause: BaseException, claim: Claim | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.claim = claim  # a re-send claim (class A window open), if any


@dataclass(frozen=True)
class _Spec:
    ledger: Ledger
    effect: str
    provider_class: ProviderClass
    window_s: float | None
    retry: RetryPolicy
    classify: Callable[[BaseException], OutcomeClass] | None
    probe: Probe | None
    subject: str | None


def guard(
    ledger: Ledger,
    *,
    effect: str,
    provider_class: ProviderClass | str = ProviderClass.OPAQUE,
    window_s: float | None = None,
    key: Callable[..., str] | None = None,
    recipe: KeyRecipe | None = None,
    tenant: str = "",
    retry: RetryPolicy | None = None,
    classify: Callable[[BaseException], OutcomeClass] | None = None,
    probe: Probe | None = None,
    subject: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Guard a function (sync or ``async``) so its effect happens once.

    Use as a decorator, or wrap a client method: ``send = guard(ledger, ...)(client.send)``.
    The wrapped signature is preserved for type checkers. Inside the call,
    :func:`adapters.current_claim` gives the provider key to send.

    Args:
        ledger: The effects ledger.
        effect: ``name@version``; bump the version when the effect's meaning changes.
        provider_class: What the provider can tell us about a call whose outcome was lost.
        window_s: Class A: how long the provider deduplicates our key.
        key: Explicit key from the call's arguments (same signature as the function).
        recipe: Explicit key from chosen argument fields.
        tenant: Tenant for explicit keys (position keys take the step's tenant).
        retry: Attempts and pauses (default: a single attempt).
        classify: Outcome of an exception by evidence (default: ambiguous).
        probe: Reconciles an in-doubt entry by asking the provider.
        subject: Data subject whose key encrypts the payloads (default: the run).

    Raises:
        ConfigurationError: Both ``key`` and ``recipe`` given, or a class A provider
            without a window.
    """
    if key is not None and recipe is not None:
        raise ConfigurationError("give a guard either key= or recipe=, not both")
    pclass = ProviderClass(provider_class)
    if pclass is ProviderClass.DEDUPLICATING and (window_s is None or window_s <= 0):
        raise ConfigurationError("a class A (deduplicating) provider needs window_s > 0")
    spec = _Spec(
        ledger,
        effect,
        pclass,
        window_s,
        retry or RetryPolicy(max_attempts=1),
        classify,
        probe,
        subject,
    )

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        sig = inspect.signature(fn)

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[EffectIdentity, Any]:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            call_args = dict(bound.arguments)
            if key is not None:
                ident = EffectIdentity(
                    tenant, None, None, 0, effect, 0, explicit=key(*args, **kwargs)
                )
            elif recipe is not None:
                explicit = recipe.explicit_key(call_args, ledger.codec)
                ident = EffectIdentity(tenant, None, None, 0, effect, 0, explicit=explicit)
            else:
                ident = identity_for(effect)
                expect_key(ledger.key_id(ident))  # a resumed step must not diverge
            return ident, call_args

        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[..., Awaitable[Any]], fn)

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                ident, call_args = prepare(args, kwargs)
                return await _run_async(spec, ident, call_args, lambda: afn(*args, **kwargs))

            return cast(Callable[P, R], awrapper)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            ident, call_args = prepare(args, kwargs)
            return cast(R, _run(spec, ident, call_args, lambda: fn(*args, **kwargs)))

        return wrapper

    return decorate


# -- the attempt loop -----------------------------------------------------------------
#
# One loop, written once for both worlds: each attempt claims (or replays, or settles an
# in-doubt entry by evidence), acts, and records the outcome by evidence. The sync and
# async wrappers differ only in how they call the act and the ledger.


def _start(span: trace.Span, spec: _Spec, ident: EffectIdentity, key_id: str) -> None:
    span.set_attribute("gen_ai.operation.name", "execute_tool")
    span.set_attribute("gen_ai.tool.name", spec.effect)
    span.set_attribute("gen_ai.tool.call.id", key_id[:16])
    span.set_attribute("onceonly.effect.key_id", key_id)
    span.set_attribute("onceonly.provider_class", spec.provider_class.value)


def _finish(span: trace.Span, outcome: str, claim: Claim | None, attempt: int) -> None:
    span.set_attribute("onceonly.effect.outcome", outcome)
    span.set_attribute("onceonly.effect.attempt", attempt)
    if claim is not None:
        span.set_attribute("onceonly.effect.epoch", claim.epoch)


def _outcome_of(exc: BaseException) -> str:
    """The span outcome of a call that ends with ``exc``."""
    if isinstance(exc, EffectInDoubt):
        return "in_doubt"
    if isinstance(exc, EffectFailed):
        return "replayed"  # a recorded definite failure, raised again
    return "failed"


class _Settled(Exception):
    """An in-doubt entry was settled by evidence as happened: here is its result."""

    def __init__(self, replay: Replay) -> None:
        super().__init__("settled")
        self.replay = replay


def _claim(spec: _Spec, ident: EffectIdentity, call_args: Any) -> Claim | Replay:
    """A claim or a replay; raises :class:`_Settled` when reconciliation proved that an
    in-doubt entry happened, :class:`_Again` when it proved it did not."""
    try:
        return spec.ledger.claim(
            ident,
            call_args,
            provider_class=spec.provider_class,
            window_s=spec.window_s,
            subject=spec.subject,
        )
    except EffectInDoubt as doubt:
        return _reconcile(spec, str(doubt.key_id), doubt)


def _claim_settling(spec: _Spec, ident: EffectIdentity, call_args: Any) -> Claim | Replay:
    """:func:`_claim`, claiming again at once when reconciliation proved that an in-doubt
    entry did not happen: nothing was sent in this attempt, so it costs no retry."""
    for _ in range(2):
        try:
            return _claim(spec, ident, call_args)
        except _Again:
            continue
    return _claim(spec, ident, call_args)


def _reconcile(spec: _Spec, key_id: str, cause: BaseException) -> Claim:
    """Settle an in-doubt entry by evidence: a re-send claim, or raise :class:`_Settled`
    (happened), :class:`_Again` (did not happen) or ``EffectInDoubt`` (no evidence)."""
    ledger = spec.ledger
    record = ledger.get(key_id)
    if record.status is EffectStatus.NEEDS_HUMAN:
        raise EffectInDoubt(key_id, record.status.value, record.provider_class.value) from cause
    if spec.provider_class is ProviderClass.DEDUPLICATING:
        moved = ledger.reconcile(key_id, Evidence.WINDOW_OPEN, actor="guard")
    elif spec.probe is not None:
        evidence, result = spec.probe(record)
        moved = ledger.reconcile(key_id, evidence, result=result, actor="probe")
    else:
        moved = ledger.reconcile(key_id, Evidence.INCONCLUSIVE, actor="guard")
    if isinstance(moved, Claim):
        return moved
    if moved.status is EffectStatus.COMMITTED:
        raise _Settled(ledger.replay(key_id))
    if moved.status is EffectStatus.NOT_HAPPENED:
        raise _Again(cause, None)
    raise EffectInDoubt(key_id, moved.status.value, moved.provider_class.value) from cause


def _after_error(spec: _Spec, claim: Claim, exc: BaseException) -> _Again:
    """Record a failed attempt by evidence; return the retry signal, or raise (the
    original error when rejected; :class:`_Settled` / ``EffectInDoubt`` when the
    in-doubt attempt was reconciled)."""
    ledger = spec.ledger
    outcome = OutcomeClass.AMBIGUOUS if spec.classify is None else spec.classify(exc)
    detail = type(exc).__name__
    if outcome is OutcomeClass.NOT_SENT:
        ledger.release(claim, detail, error=exc)
        return _Again(exc, None)
    if outcome is OutcomeClass.REJECTED:
        ledger.fail(claim, type(exc).__name__, str(exc))
        raise exc
    ledger.mark_unknown(claim, detail, error=exc)
    try:
        return _Again(exc, _reconcile(spec, claim.key_id, exc))
    except _Again as again:  # proved not to have happened: send again
        return _Again(exc, again.claim)


def _run(spec: _Spec, ident: EffectIdentity, call_args: Any, act: Callable[[], Any]) -> Any:
    ledger = spec.ledger
    with _tracer.start_as_current_span(
        f"execute_tool {spec.effect}", record_exception=False, set_status_on_exception=False
    ) as span:
        _start(span, spec, ident, ledger.key_id(ident))
        resend: Claim | None = None
        attempt = 0
        last: BaseException | None = None
        try:
            for attempt in range(1, spec.retry.max_attempts + 1):
                if attempt > 1:
                    time.sleep(spec.retry.pause_before(attempt))
                try:
                    out = resend if resend is not None else _claim_settling(spec, ident, call_args)
                except _Again as again:  # reconciled as not happened: claim anew
                    resend, last = again.claim, again.cause
                    continue
                resend = None
                if isinstance(out, Replay):
                    _finish(span, "replayed", None, attempt)
                    return out.result
                failpoint("adapters.act.before")
                try:
                    with _acting(out):
                        result = act()
                except BaseException as exc:  # noqa: BLE001  (recorded by evidence)
                    signal = _after_error(spec, out, exc)
                    resend, last = signal.claim, exc
                    continue
                failpoint("adapters.act.after")
                ledger.commit(out, result)
                _finish(span, "executed", out, attempt)
                return result
        except _Settled as settled:
            _finish(span, "reconciled", None, attempt)
            return settled.replay.result
        except BaseException as exc:
            _finish(span, _outcome_of(exc), None, attempt)
            raise
        _finish(span, _outcome_of(last) if last is not None else "failed", None, attempt)
        assert last is not None
        raise last


async def _run_async(
    spec: _Spec, ident: EffectIdentity, call_args: Any, act: Callable[[], Awaitable[Any]]
) -> Any:
    """The same loop for coroutines; ledger writes run on the ledger's thread pool."""
    import asyncio  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    pool = spec.ledger.executor()

    async def call(fn: Callable[[], Any]) -> Any:
        return await loop.run_in_executor(pool, fn)

    ledger = spec.ledger
    with _tracer.start_as_current_span(
        f"execute_tool {spec.effect}", record_exception=False, set_status_on_exception=False
    ) as span:
        _start(span, spec, ident, ledger.key_id(ident))
        resend: Claim | None = None
        attempt = 0
        last: BaseException | None = None
        try:
            for attempt in range(1, spec.retry.max_attempts + 1):
                if attempt > 1:
                    await asyncio.sleep(spec.retry.pause_before(attempt))
                try:
                    out = (
                        resend
                        if resend is not None
                        else await call(functools.partial(_claim_settling, spec, ident, call_args))
                    )
                except _Again as again:
                    resend, last = again.claim, again.cause
                    continue
                resend = None
                if isinstance(out, Replay):
                    _finish(span, "replayed", None, attempt)
                    return out.result
                failpoint("adapters.act.before")
                try:
                    with _acting(out):
                        result = await act()
                except BaseException as exc:  # noqa: BLE001  (recorded by evidence)
                    signal = await call(functools.partial(_after_error, spec, out, exc))
                    resend, last = signal.claim, exc
                    continue
                failpoint("adapters.act.after")
                await call(functools.partial(ledger.commit, out, result))
                _finish(span, "executed", out, attempt)
                return result
        except _Settled as settled:
            _finish(span, "reconciled", None, attempt)
            return settled.replay.result
        except BaseException as exc:
            _finish(span, _outcome_of(exc), None, attempt)
            raise
        _finish(span, _outcome_of(last) if last is not None else "failed", None, attempt)
        assert last is not None
        raise last
