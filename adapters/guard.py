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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import tenacity
from opentelemetry import trace

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.checkpoint.failpoints import failpoint
from onceonly.ledger import (
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
    ResultUnknown,
)

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


class _Again(Exception):
    """This attempt may be repeated with the same key; carries what it saw."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


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

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[EffectIdentity, Any]:
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


# -- the attempt loop -----------------------------------------------------------------
#
# One loop, written once for both worlds: each attempt claims (or replays, or settles an
# in-doubt entry by evidence), acts, and records the outcome by evidence. The sync and
# async wrappers differ only in how they call the act and the ledger. No claim outlives
# the attempt that took it: an ambiguous attempt leaves its entry UNKNOWN, and the next
# attempt (after its pause) reconciles it into a re-send claim it sends under at once.


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
    if isinstance(exc, EffectInDoubt) or not isinstance(exc, Exception):
        return "in_doubt"  # an interrupt leaves the entry in doubt
    if isinstance(exc, EffectFailed | ResultUnknown):
        return "replayed"  # a recorded outcome, raised again
    return "failed"


class _Settled(Exception):
    """An in-doubt entry was settled by evidence as happened: here is its result."""

    def __init__(self, replay: Replay) -> None:
        super().__init__("settled")
        self.replay = replay


def _claim(spec: _Spec, ident: EffectIdentity, call_args: Any) -> Claim | Replay:
    """A claim or a replay; raises :class:`_Settled` when reconciliation proved that an
    in-doubt entry happened (or a probe found the result of one resolved without it),
    :class:`_Again` when it proved it did not."""
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
    except ResultUnknown as unknown:
        raise _Settled(_learn_result(spec, unknown)) from None


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
    """Settle an in-doubt entry by evidence: a re-send claim (class A, window open: send
    under it now), or raise :class:`_Settled` (happened), :class:`_Again` (did not
    happen) or ``EffectInDoubt`` (no evidence)."""
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
        raise _Again(cause)
    raise EffectInDoubt(key_id, moved.status.value, moved.provider_class.value) from cause


def _learn_result(spec: _Spec, unknown: ResultUnknown) -> Replay:
    """An operator resolved the entry as happened without its result: ask the adapter's
    probe for it, record what it found as an audited correction, and replay that.

    Raises:
        ResultUnknown: No probe, or the probe did not find the effect's result.
    """
    key_id = str(unknown.key_id)
    if spec.probe is None:
        raise unknown
    ledger = spec.ledger
    try:
        evidence, result = spec.probe(ledger.get(key_id))
    except Exception as exc:  # not asked is no answer: a person looks
        raise ResultUnknown(key_id, f"the probe failed: {type(exc).__name__}") from exc
    if Evidence(evidence) is not Evidence.HAPPENED:
        raise ResultUnknown(key_id, f"the probe answered {Evidence(evidence).value}")
    ledger.correct(
        key_id,
        result=result,
        evidence="probe: the provider's result of the effect resolved as happened",
        actor="probe",
    )
    return ledger.replay(key_id)


def _after_error(spec: _Spec, claim: Claim, exc: Exception, *, last: bool) -> _Again:
    """Record a failed attempt by evidence; return the retry signal, or raise (the
    original error when rejected; :class:`_Settled` / ``EffectInDoubt`` when the
    in-doubt attempt was reconciled, or could not be re-sent)."""
    ledger = spec.ledger
    outcome = _classified(spec.classify, exc)
    detail = type(exc).__name__
    if outcome is OutcomeClass.NOT_SENT:
        ledger.release(claim, detail, error=exc)
        return _Again(exc)
    if outcome is OutcomeClass.REJECTED:
        ledger.fail(claim, type(exc).__name__, str(exc))
        raise exc
    ledger.mark_unknown(claim, detail, error=exc)
    if spec.provider_class is ProviderClass.DEDUPLICATING:
        if last:  # a re-send claim now would be left unused, blocking the next call
            raise EffectInDoubt(
                claim.key_id,
                EffectStatus.UNKNOWN.value,
                ProviderClass.DEDUPLICATING.value,
                "no attempt left to re-send it; the next call re-sends it with the same key "
                "while the provider's dedup window is open",
            ) from exc
        return _Again(exc)  # the next attempt re-sends it, after its pause
    if spec.probe is not None and not last:
        return _Again(exc)  # the next attempt asks the probe, after its pause
    try:  # the last class B attempt asks its probe now; class C needs a human
        unused = _reconcile(spec, claim.key_id, exc)
    except _Again as again:  # proved not to have happened (the next call sends it)
        return again
    ledger.give_back(unused, "re-send claim not used")  # only class A re-sends
    raise EffectInDoubt(unused.key_id, EffectStatus.UNKNOWN.value, spec.provider_class.value)


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


def _run(spec: _Spec, ident: EffectIdentity, call_args: Any, act: Callable[[], Any]) -> Any:
    ledger = spec.ledger
    attempts = spec.retry.max_attempts
    with _tracer.start_as_current_span(
        f"execute_tool {spec.effect}", record_exception=False, set_status_on_exception=False
    ) as span:
        _start(span, spec, ident, ledger.key_id(ident))
        attempt = 0
        last: BaseException | None = None
        try:
            for attempt in range(1, attempts + 1):
                if attempt > 1:
                    time.sleep(spec.retry.pause_before(attempt))
                try:
                    out = _claim_settling(spec, ident, call_args)
                except _Again as again:  # reconciled as not happened: claim anew
                    last = again.cause
                    continue
                if isinstance(out, Replay):
                    _finish(span, "replayed", None, attempt)
                    return out.result
                failpoint("adapters.act.before")
                try:
                    with _acting(out):
                        result = act()
                except Exception as exc:  # noqa: BLE001  (recorded by evidence)
                    last = _after_error(spec, out, exc, last=attempt == attempts).cause
                    continue
                except BaseException as exc:  # an interrupt: in doubt, and stop
                    _interrupted(ledger, out, exc)
                    raise
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
    """The same loop for coroutines; ledger calls run on the ledger's thread pool, each in
    a copy of the caller's context (context variables reach the ledger).

    A cancellation is an interrupt: while acting, the entry is left in doubt as if the
    process had been killed; while a claim is being recorded, the claim is given back
    once it is (nothing was sent under it).
    """
    ledger = spec.ledger
    pool = ledger.executor()
    attempts = spec.retry.max_attempts

    async def call(fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, contextvars.copy_context().run, fn)

    async def claim() -> Claim | Replay:
        done = pool.submit(contextvars.copy_context().run, _claim_settling, spec, ident, call_args)
        try:
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            done.add_done_callback(functools.partial(_give_back_unused, ledger))
            raise

    with _tracer.start_as_current_span(
        f"execute_tool {spec.effect}", record_exception=False, set_status_on_exception=False
    ) as span:
        _start(span, spec, ident, ledger.key_id(ident))
        attempt = 0
        last: BaseException | None = None
        try:
            for attempt in range(1, attempts + 1):
                if attempt > 1:
                    await asyncio.sleep(spec.retry.pause_before(attempt))
                try:
                    out = await claim()
                except _Again as again:
                    last = again.cause
                    continue
                if isinstance(out, Replay):
                    _finish(span, "replayed", None, attempt)
                    return out.result
                failpoint("adapters.act.before")
                try:
                    with _acting(out):
                        result = await act()
                except Exception as exc:  # noqa: BLE001  (recorded by evidence)
                    final = attempt == attempts
                    after = functools.partial(_after_error, spec, out, exc, last=final)
                    last = (await call(after)).cause
                    continue
                except BaseException as exc:  # cancelled or interrupted: in doubt, and stop
                    done = pool.submit(
                        contextvars.copy_context().run, _interrupted, ledger, out, exc
                    )
                    with contextlib.suppress(asyncio.CancelledError):  # it finishes anyway
                        await asyncio.shield(asyncio.wrap_future(done))
                    raise
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


def _give_back_unused(ledger: Ledger, done: concurrent.futures.Future[Claim | Replay]) -> None:
    """A claim recorded for a task that was cancelled meanwhile: nothing was sent."""
    if done.cancelled() or done.exception() is not None:
        return
    out = done.result()
    if isinstance(out, Claim):
        ledger.give_back(out, "cancelled before acting")
