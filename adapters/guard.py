"""``guard``: make a callable an effect that happens once.

The guard derives the effect's key (from the current step, an explicit key function or a
key recipe), claims it in the ledger before calling, calls, classifies the outcome by
evidence, records it, and replays recorded results; one OpenTelemetry span per call.
Retries keep one key across all attempts and only happen when evidence allows: the
attempt never left (NOT_SENT), a class-A provider deduplicates our key and its window
is open, or a class-B probe proved the attempt did not happen. The default policy makes
every re-send the evidence allows (:data:`DEFAULT_RETRY`). An in-doubt call is
reconciled by the adapter's probe where there is one; otherwise it needs a human and the
caller gets :class:`~ledger.EffectInDoubt`.

A re-send claim is only taken by an attempt that sends under it: when the last attempt's
outcome is ambiguous, a class-A entry is left in doubt (UNKNOWN: the next call re-sends
it inside the window) and the caller gets ``EffectInDoubt``. An interrupt while acting
(``KeyboardInterrupt``, ``SystemExit``, a cancelled task: a ``BaseException`` that is not
an ``Exception``) leaves the entry in doubt without reconciling or retrying, and is
re-raised as it was.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import tenacity
from opentelemetry import trace

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.checkpoint.failpoints import failpoint
from onceonly.ledger import (
    Claim,
    EffectIdentity,
    EffectInDoubt,
    EffectRecord,
    Evidence,
    KeyRecipe,
    Ledger,
    OutcomeClass,
    ProviderClass,
    ResultUnknown,
)

from . import _guard_core as _core
from .context import _acting, expect_key, explicit_identity, identity_for

__all__ = ["DEFAULT_RETRY", "Probe", "RetryPolicy", "guard"]

P = ParamSpec("P")
R = TypeVar("R")

Probe = Callable[[EffectRecord], tuple[Evidence, Any]]
"""Asks the provider whether the effect of an in-doubt entry happened (by its
``provider_key``): returns the evidence and, if it happened, the provider's result."""

_tracer = trace.get_tracer("onceonly.adapters")
log = logging.getLogger("onceonly.adapters")


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


DEFAULT_RETRY = RetryPolicy()
"""The guard's default: three attempts, pausing 0.05 s then 0.1 s. Only the re-sends the
evidence allows are made (not sent; class A inside its window; class B proved not to
have happened); a class C call whose outcome was lost is never re-sent."""


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
        tenant: Tenant for explicit keys outside a step (inside one, every key takes the
            step's tenant; another tenant here is a ConfigurationError at the call).
        retry: Attempts and pauses (default: :data:`DEFAULT_RETRY`).
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
        retry or DEFAULT_RETRY,
        classify,
        probe,
        subject,
    )

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        sig = inspect.signature(fn)
        positional = _plain_names(sig)

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[EffectIdentity, Any]:
            if positional is not None and not kwargs and len(args) == len(positional):
                # every parameter given by position: what bind() would map, without it
                call_args = dict(zip(positional, args, strict=True))
            else:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                call_args = dict(bound.arguments)
            if key is not None or recipe is not None:
                explicit = (
                    key(*args, **kwargs)
                    if key is not None
                    else cast(KeyRecipe, recipe).explicit_key(call_args, ledger.codec)
                )
                ident = explicit_identity(effect, explicit, tenant)
            else:
                ident = identity_for(effect)
            # A resumed step must not diverge; its recorded keys may be under an older
            # secret than the current one (a rotation between the attempts).
            candidates = [kid for _, kid in ledger.key_ids(ident)]
            expect_key(candidates, explicit=ident.explicit is not None)
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


def _plain_names(sig: inspect.Signature) -> tuple[str, ...] | None:
    """The parameter names when every parameter is an ordinary positional-or-keyword one
    (then a call giving all of them by position binds them in order); else None."""
    params = sig.parameters.values()
    if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return tuple(p.name for p in params)
    return None


# -- the drivers ------------------------------------------------------------------------
#
# The attempt loop is decided once, by the I/O-free core in ``_guard_core``; the two
# drivers below only carry its actions out. The sync driver makes every call inline; the
# async driver awaits the act, and runs each run of blocking calls (ledger, probe,
# classifier) on the ledger's thread pool in a copy of the caller's context.


def _start(span: trace.Span, spec: _Spec, ident: EffectIdentity, key_id: str) -> None:
    span.set_attribute("gen_ai.operation.name", "execute_tool")
    span.set_attribute("gen_ai.tool.name", spec.effect)
    span.set_attribute("gen_ai.tool.call.id", key_id[:16])
    span.set_attribute("onceonly.effect.key_id", key_id)
    span.set_attribute("onceonly.provider_class", spec.provider_class.value)


def _finish(span: trace.Span, outcome: str, claim: Claim | None, attempt: int) -> None:
    if span is trace.INVALID_SPAN:
        return  # no tracer provider: nothing records it
    span.set_attribute("onceonly.effect.outcome", outcome)
    span.set_attribute("onceonly.effect.attempt", attempt)
    if claim is not None:
        span.set_attribute("onceonly.effect.epoch", claim.epoch)


def _attempts(spec: _Spec) -> _core.Attempts:
    return _core.Attempts(
        provider_class=spec.provider_class,
        has_probe=spec.probe is not None,
        max_attempts=spec.retry.max_attempts,
    )


def _perform(spec: _Spec, ident: EffectIdentity, call_args: Any, call: _core.Call) -> Any:
    """Carry out one blocking call of the core; returns its answer. Errors the core does
    not take as evidence propagate (a store error ends the guarded call)."""
    ledger = spec.ledger
    match call:
        case _core.ClaimKey():
            try:
                return ledger.claim(
                    ident,
                    call_args,
                    provider_class=spec.provider_class,
                    window_s=spec.window_s,
                    subject=spec.subject,
                )
            except (EffectInDoubt, ResultUnknown) as answer:
                return answer
        case _core.Look(key_id):
            return ledger.get(key_id)
        case _core.AskProbe(record):
            evidence, result = cast(Probe, spec.probe)(record)
            return evidence, result
        case _core.AskProbeForResult(key_id):
            try:
                evidence, result = cast(Probe, spec.probe)(ledger.get(key_id))
            except Exception as exc:  # noqa: BLE001  (no answer is evidence: a person looks)
                return exc
            return evidence, result
        case _core.Reconcile(key_id, evidence, actor, result):
            return ledger.reconcile(key_id, evidence, result=result, actor=actor, by=ident)
        case _core.ReadReplay(key_id):
            return ledger.replay(key_id)
        case _core.Correct(key_id, result):
            return ledger.correct(
                key_id,
                result=result,
                evidence="probe: the provider's result of the effect resolved as happened",
                actor="probe",
            )
        case _core.Classify(error):
            return _classified(spec.classify, error)
        case _core.Release(claim, detail, error):
            return ledger.release(claim, detail, error=error)
        case _core.Fail(claim, error_type, message):
            return ledger.fail(claim, error_type, message)
        case _core.MarkUnknown(claim, detail, error):
            return ledger.mark_unknown(claim, detail, error=error)
        case _core.GiveBack(claim, reason):
            return ledger.give_back(claim, reason)
        case _core.Commit(claim, result):
            return ledger.commit(claim, result)
    raise TypeError(f"not a call of the guard's core: {call!r}")  # pragma: no cover


def _classified(
    classify: Callable[[BaseException], OutcomeClass] | None, exc: Exception
) -> OutcomeClass:
    """The outcome of ``exc`` by the adapter's evidence; ambiguous when there is none, or
    when the classifier itself fails (the claim is never left open)."""
    if classify is None:
        return OutcomeClass.AMBIGUOUS
    try:
        return OutcomeClass(classify(exc))
    except Exception:  # no evidence: in doubt
        log.exception("classifying %s failed; the attempt is in doubt", type(exc).__name__)
        return OutcomeClass.AMBIGUOUS


def _interrupted(ledger: Ledger, claim: Claim, exc: BaseException) -> None:
    """An interrupt arrived while acting: in doubt (UNKNOWN) if the ledger can be
    written, else the claim lapses with its lease; never reconciled, never raises."""
    try:
        ledger.mark_unknown(claim, f"interrupted: {type(exc).__name__}")
    except Exception:  # noqa: BLE001  (the claim lapses with its lease instead)
        log.warning(
            "interrupted while acting on %s…; the ledger could not record it in doubt, so "
            "its claim lapses with its lease",
            claim.key_id[:16],
        )


def _acted(result: Any) -> _core.Succeeded:
    """The evidence of a guarded call that returned ``result`` (past the crash point
    between acting and recording)."""
    failpoint("adapters.act.after")
    return _core.Succeeded(result)


def _untraced() -> bool:
    """Whether no tracer provider is set (OpenTelemetry's API would hand out no-op spans)."""
    return isinstance(trace.get_tracer_provider(), _NO_PROVIDER)


_NO_PROVIDER = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


@contextlib.contextmanager
def _traced(spec: _Spec, ident: EffectIdentity, machine: _core.Attempts) -> Iterator[trace.Span]:
    """The call's span; a call that ends with an error is finished by it. With no
    tracer provider set nothing would record it: no span is made (a provider set later
    is picked up by the next call)."""
    if _untraced():
        yield trace.INVALID_SPAN
        return
    with _tracer.start_as_current_span(
        f"execute_tool {spec.effect}", record_exception=False, set_status_on_exception=False
    ) as span:
        _start(span, spec, ident, spec.ledger.key_id(ident))
        try:
            yield span
        except BaseException as exc:
            _finish(span, _core.outcome_of(exc), None, machine.attempt)
            raise


def _end(span: trace.Span, machine: _core.Attempts, end: _core.Settle | _core.Raise) -> Any:
    """The call's result, or raise its error."""
    if isinstance(end, _core.Raise):
        raise end.error
    _finish(span, end.outcome, end.claim, machine.attempt)
    return end.result


def _run(spec: _Spec, ident: EffectIdentity, call_args: Any, act: Callable[[], Any]) -> Any:
    """The sync driver."""
    machine = _attempts(spec)
    if _untraced():  # no span to make: drive the calls without entering one
        return _drive(spec, ident, call_args, act, machine, trace.INVALID_SPAN)
    with _traced(spec, ident, machine) as span:
        return _drive(spec, ident, call_args, act, machine, span)


def _drive(
    spec: _Spec,
    ident: EffectIdentity,
    call_args: Any,
    act: Callable[[], Any],
    machine: _core.Attempts,
    span: trace.Span,
) -> Any:
    """The sync driver's loop: carry out the core's actions until it settles or raises."""
    action = machine.start()
    while not isinstance(action, _core.Settle | _core.Raise):
        answer: Any = None
        match action:
            case _core.Pause(attempt):
                time.sleep(spec.retry.pause_before(attempt))
            case _core.Act(claim):
                failpoint("adapters.act.before")
                try:
                    with _acting(claim, spec.ledger):
                        result = act()
                except BaseException as exc:  # noqa: BLE001  (the core decides)
                    answer = _core.acting_failed(exc)
                else:
                    answer = _acted(result)
            case _core.LeaveInDoubt(claim, error):
                _interrupted(spec.ledger, claim, error)
            case _:
                answer = _perform(spec, ident, call_args, action)
        action = machine.send(answer)
    return _end(span, machine, action)


async def _run_async(
    spec: _Spec, ident: EffectIdentity, call_args: Any, act: Callable[[], Awaitable[Any]]
) -> Any:
    """The async driver: the same core; each run of blocking calls goes to the ledger's
    thread pool at once, in a copy of the caller's context (context variables reach the
    ledger).

    A cancellation is an interrupt: while acting, the entry is left in doubt as if the
    process had been killed; while a claim is being recorded, the claim is given back
    once it is (nothing was sent under it).
    """
    ledger = spec.ledger
    pool = ledger.executor()
    machine = _attempts(spec)

    def calls(action: _core.Action) -> _core.Action:
        while isinstance(action, _core.Call):
            action = machine.send(_perform(spec, ident, call_args, action))
        return action

    async def blocking(action: _core.Action) -> _core.Action:
        run = contextvars.copy_context().run
        if not isinstance(action, _core.ClaimKey):
            return await asyncio.get_running_loop().run_in_executor(pool, run, calls, action)
        done = pool.submit(run, calls, action)
        try:  # the claim is recorded even if we are cancelled meanwhile
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            done.add_done_callback(functools.partial(_give_back_unused, ledger))
            raise

    with _traced(spec, ident, machine) as span:
        action = machine.start()
        while not isinstance(action, _core.Settle | _core.Raise):
            answer: Any = None
            match action:
                case _core.Call():
                    action = await blocking(action)
                    continue
                case _core.Pause(attempt):
                    await asyncio.sleep(spec.retry.pause_before(attempt))
                case _core.Act(claim):
                    failpoint("adapters.act.before")
                    try:
                        with _acting(claim, spec.ledger):
                            result = await act()
                    except BaseException as exc:  # noqa: BLE001  (the core decides)
                        answer = _core.acting_failed(exc)
                    else:
                        answer = _acted(result)
                case _core.LeaveInDoubt(claim, error):
                    done = pool.submit(
                        contextvars.copy_context().run, _interrupted, ledger, claim, error
                    )
                    with contextlib.suppress(asyncio.CancelledError):  # it finishes anyway
                        await asyncio.shield(asyncio.wrap_future(done))
            action = machine.send(answer)
        return _end(span, machine, action)


def _give_back_unused(ledger: Ledger, done: concurrent.futures.Future[_core.Action]) -> None:
    """A claim recorded for a task that was cancelled meanwhile: nothing was sent."""
    if done.cancelled() or done.exception() is not None:
        return
    out = done.result()
    if isinstance(out, _core.Act):
        ledger.give_back(out.claim, "cancelled before acting")
