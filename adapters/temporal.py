"""Temporal activities whose effects happen once: keys from the workflow, not the attempt.

Temporal retries an activity whose worker died, timed out or lost its heartbeat; for the
e-mail, payment or booking inside it that is at-least-once: a worker killed after the
provider acted and before the activity completed makes the next attempt act again.
:func:`guarded_activity` closes that gap. Inside the decorated activity every guarded
call (:func:`adapters.guard`, ``GuardedHTTP``, ``GuardedSMTP``, ...) is keyed by where
it sits in the workflow::

    run  = "temporal:{namespace}/{workflow_id}"
    step = "{activity_type}#{activity_id}"      + the effect's name and ordinal

The activity id of a workflow's activity is its position in the workflow's history, so
the keys are the same in every attempt, on every worker, after a worker restart, on a
workflow replay and after a reset to a point before the activity; they never include the
attempt number or the run id. An attempt that finds the effect recorded replays its
result instead of acting.

While a guarded call is acting, the activity heartbeats (details: the effect's key id)
and renews the claim's lease in the ledger, so a long call is neither taken for a dead
worker by Temporal nor for an abandoned claim by the ledger. A worker that dies is
noticed by Temporal after the activity's ``heartbeat_timeout`` and by the ledger after
its ``lease_s``.

Ledger errors become Temporal application errors (``type`` is the error's class name,
the first detail the key id):

* ``EffectInDoubt`` (the effect may have happened and no evidence settles it; the
  provider is class C, or class A past its window), ``ResultUnknown``, ``EffectFailed``,
  ``KeyReuseError``, ``PayloadErased`` and ``StepDiverged``: **non-retryable**; the
  message names the key id and the fix (``onceonly effects resolve KEY ...``). After an
  operator resolves it, run the workflow again (reset it to before the activity, or start
  it anew under the same workflow id): the effect replays the recorded result (or is sent,
  if it was resolved as not happened).
* ``EffectInFlight`` (another attempt still holds a live claim: a timed-out attempt that
  is still running): retryable, after the claim's lease.

What is exactly-once: class A (a provider that deduplicates our key, inside its window)
and class B (queryable) effects happen once; a class C effect whose outcome was lost is
never re-sent — it needs a person, and the activity fails until one decides.

A workflow id names one business transaction: a workflow started anew under the same id
replays its effects (that is how a failed workflow is retried). A workflow that
continues as new starts its activity ids again from 1: give it ``run_key=`` (for example
the workflow id and an iteration the workflow passes to its activities).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, cast

try:
    from temporalio import activity
    from temporalio.exceptions import ApplicationError
except ImportError as exc:  # pragma: no cover  (tests/test_extras.py runs it)
    raise ImportError(
        "onceonly.adapters.temporal needs temporalio: pip install 'onceonly[temporal]'"
    ) from exc

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectInDoubt,
    EffectInFlight,
    KeyReuseError,
    Ledger,
    PayloadErased,
    ResultUnknown,
)

from . import _leases
from .context import StepDiverged, _watching, step

__all__ = ["activity_position", "guarded_activity", "temporal_error"]

P = ParamSpec("P")
R = TypeVar("R")


_FINAL = (EffectInDoubt, ResultUnknown, EffectFailed, KeyReuseError, PayloadErased, StepDiverged)


def activity_position(info: activity.Info) -> tuple[str, str]:
    """The run and step an activity's effects are keyed by.

    Args:
        info: The running activity's info (``activity.info()``).

    Returns:
        ``("temporal:{namespace}/{workflow_id}", "{activity_type}#{activity_id}")``; an
        activity started on its own (no workflow) is keyed by its activity id alone.
    """
    namespace = info.workflow_namespace or info.namespace
    if info.workflow_id is None:
        return f"temporal:{namespace}/activity", f"{info.activity_type}#{info.activity_id}"
    return f"temporal:{namespace}/{info.workflow_id}", f"{info.activity_type}#{info.activity_id}"


def temporal_error(exc: Exception) -> ApplicationError | None:
    """The Temporal application error a ledger error becomes, or None for other errors.

    Args:
        exc: An error raised inside a guarded activity.

    Returns:
        A non-retryable ``ApplicationError`` for an effect in doubt or otherwise settled
        (it must not be attempted again until a person decides), a retryable one for an
        effect another attempt still holds; None for any other error.
    """
    key_id = getattr(exc, "key_id", None) or ""
    if isinstance(exc, EffectInFlight):
        return ApplicationError(
            f"{exc} (an earlier attempt of this activity may still be running); retrying "
            f"after its lease",
            key_id,
            type="EffectInFlight",
            next_retry_delay=timedelta(seconds=max(exc.expires_at - time.time(), 0.0) + 0.5),
        )
    if not isinstance(exc, _FINAL):
        return None
    if isinstance(exc, EffectInDoubt) and exc.status == "unknown" and exc.provider_class == "A":
        return ApplicationError(
            f"{exc}; retrying: the provider deduplicates the key inside its window, so the "
            f"next attempt re-sends it under the same key",
            key_id,
            type="EffectInDoubt",
        )
    if isinstance(exc, EffectInDoubt):
        message = (
            f"effect {key_id} is in doubt ({exc.status}, provider class "
            f"{exc.provider_class}): it may have happened, so it was not sent again and this "
            f"activity is not retried. Check the provider, then run `onceonly effects resolve "
            f"{key_id} --happened --result JSON --evidence TEXT` (or --not-happened), and run "
            f"the workflow again (reset it to before this activity, or start it anew with the "
            f"same workflow id): the effect replays the recorded result, or is sent if it did "
            f"not happen"
        )
    else:
        message = f"{exc}; this activity is not retried"
    return ApplicationError(message, key_id, type=type(exc).__name__, non_retryable=True)


class _Beats:
    """Heartbeats the activity and renews the leases of the claims acting below it."""

    def __init__(self, ledger: Ledger, period_s: float, *, is_async: bool) -> None:
        self.ledger = ledger
        self.period_s = period_s
        self.is_async = is_async
        self._live: dict[str, tuple[Claim, Ledger]] = {}
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stop: threading.Event | None = None

    def started(self, claim: Claim, ledger: Ledger) -> None:
        with self._lock:
            self._live[claim.key_id] = (claim, ledger)
        activity.heartbeat(claim.key_id)  # the in-flight effect, in the details
        self._start()

    def stopped(self, claim: Claim) -> None:
        with self._lock:
            self._live.pop(claim.key_id, None)
            idle = not self._live
        if idle:
            self._halt()

    def _start(self) -> None:
        if self.is_async:
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._abeat())
        elif self._stop is None:
            self._stop = threading.Event()
            run = contextvars.copy_context().run
            threading.Thread(
                target=run, args=(self._beat, self._stop), daemon=True, name="onceonly-beat"
            ).start()

    def _halt(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def _renew(self) -> str | None:
        """Renew every live claim's lease; the key id to report, if any."""
        with self._lock:
            claims = list(self._live.values())
        _leases.renew(claims)
        return claims[0][0].key_id if claims else None

    async def _abeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.period_s)
            run = contextvars.copy_context().run
            key_id = await loop.run_in_executor(self.ledger.executor(), run, self._renew)
            if key_id is None:
                return
            activity.heartbeat(key_id)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            key_id = self._renew()
            if key_id is None:
                return
            activity.heartbeat(key_id)


def _period(ledger: Ledger, info: activity.Info, beat_s: float | None) -> float:
    if beat_s is not None:
        return beat_s
    period = ledger.lease_s / 3
    if info.heartbeat_timeout is not None:
        period = min(period, info.heartbeat_timeout.total_seconds() / 3)
    return max(period, 0.05)


def guarded_activity(
    ledger: Ledger,
    *,
    tenant: str = "",
    beat_s: float | None = None,
    run_key: Callable[[activity.Info], str] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Key the guarded calls inside a Temporal activity by its place in the workflow.

    Put it under ``@activity.defn``. Sync and ``async`` activities are both supported;
    the signature is preserved (Temporal reads its type hints).

    Args:
        ledger: The effects ledger (one per worker process; a PostgreSQL ledger when
            workers run on several machines).
        tenant: The tenant the effects belong to.
        beat_s: Seconds between heartbeats (and lease renewals) while an effect is in
            flight (default: a third of the activity's ``heartbeat_timeout`` or of the
            ledger's ``lease_s``, whichever is shorter).
        run_key: Names the run from the activity's info instead of the namespace and
            workflow id (for workflows that continue as new).

    Returns:
        The decorator.

    Raises:
        ConfigurationError: ``beat_s`` is not positive.
    """
    if beat_s is not None and beat_s <= 0:
        raise ConfigurationError("guarded_activity needs beat_s > 0")

    def position() -> tuple[str, str]:
        info = activity.info()
        run_id, step_id = activity_position(info)
        if run_key is not None:
            run_id = f"temporal:{info.workflow_namespace or info.namespace}/{run_key(info)}"
        return run_id, step_id

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[..., Awaitable[Any]], fn)

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                run_id, step_id = position()
                beats = _Beats(ledger, _period(ledger, activity.info(), beat_s), is_async=True)
                try:
                    with step(run_id, step_id, tenant=tenant), _watching(beats):
                        return await afn(*args, **kwargs)
                except Exception as exc:
                    converted = temporal_error(exc)
                    if converted is None:
                        raise
                    raise converted from exc
                finally:
                    beats._halt()

            return cast(Callable[P, R], awrapper)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            run_id, step_id = position()
            beats = _Beats(ledger, _period(ledger, activity.info(), beat_s), is_async=False)
            try:
                with step(run_id, step_id, tenant=tenant), _watching(beats):
                    return fn(*args, **kwargs)
            except Exception as exc:
                converted = temporal_error(exc)
                if converted is None:
                    raise
                raise converted from exc
            finally:
                beats._halt()

        return wrapper

    return decorate
