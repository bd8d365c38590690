"""Where a guarded call sits: the current step of the current run.

A runtime (or your own loop) enters :func:`step` around each step it executes; every
guarded call inside gets its identity from that position — tenant, run, step, how many
times the run entered the step before, the effect and the call's ordinal among that
effect's calls in the step — so a resumed or retried step derives the same keys. A call
with an explicit key inside a step takes the step's tenant (keys never cross tenants)
and records the run and step it was made from.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from onceonly.checkpoint.errors import ConfigurationError, OnceOnlyError
from onceonly.ledger import Claim, EffectIdentity, Ledger

__all__ = ["StepDiverged", "current_claim", "identity_for", "step"]


class StepDiverged(OnceOnlyError):
    """A resumed step asked for effects other than the ones its earlier attempt recorded.

    The code or the plan changed between the attempts (an effect renamed, reordered,
    removed or added before the recorded ones), or the worker's keyring has other secrets
    than the run was started with (key ids are keyed by them): acting now could duplicate
    or orphan an effect that already happened, so nothing was sent. Start the worker with
    the run's secrets, or deploy the code that recorded them, and retry the run (the
    effects replay); or do the remaining work in a new run (a fork shares its origin's
    keys, so it would diverge the same way).

    Attributes:
        run_id: The run.
        step_id: The step (with its visit).
        expected: The recorded key id the step should have asked for next (None: the step
            finished without asking for recorded effects).
        got: The key id the step asked for (None: the step finished).
        remaining: Recorded key ids the step has not asked for.
    """

    def __init__(
        self,
        run_id: str,
        step_id: str,
        expected: str | None,
        got: str | None,
        remaining: Sequence[str],
    ) -> None:
        self.run_id = run_id
        self.step_id = step_id
        self.expected = expected
        self.got = got
        self.remaining = tuple(remaining)
        if got is None:
            what = f"finished without asking for {len(remaining)} recorded effect(s)"
        else:
            what = f"asked for effect {got[:16]} where the recorded one is {str(expected)[:16]}"
        # Key ids are keyed by the keyring's secrets: a worker started with other secrets
        # than the run's (ONCEONLY_SECRETS mistyped or rotated without the old one) asks
        # for key ids that match none recorded, which reads exactly like changed code.
        deploy = (
            f"deploy the code that recorded them (`onceonly runs retry {run_id}` then replays "
            f"them), or settle this business in a new run"
        )
        if got is not None:
            fix = (
                "Either this worker's keyring differs from the one the run was started with "
                "(key ids are keyed by its secrets: set ONCEONLY_SECRETS as it was, or keep "
                f"the old secret in it after a rotation), or the code changed: {deploy}"
            )
        else:
            fix = f"The code changed: {deploy}"
        super().__init__(
            f"step {step_id!r} of run {run_id!r} diverged from its recorded attempt: it {what}; "
            f"nothing was sent. {fix}"
        )


@dataclass
class _StepState:
    tenant: str
    run_id: str
    step_id: str
    visit: int
    ordinals: dict[str, int] = field(default_factory=dict)
    recorded: tuple[str, ...] = ()
    asked: set[int] = field(default_factory=set)  # indexes into recorded
    lock: threading.Lock = field(default_factory=threading.Lock)  # branches share a step
    first: int = 0  # every recorded index below this one was asked for

    def remaining(self) -> list[str]:
        return [k for i, k in enumerate(self.recorded) if i not in self.asked]

    def _ask(self, i: int) -> None:
        """Mark recorded index ``i`` asked for (under the lock); the first unasked index
        moves past it, so each call costs what it asks, not the step's length."""
        self.asked.add(i)
        while self.first < len(self.recorded) and self.first in self.asked:
            self.first += 1

    def expect(self, key_ids: Sequence[str], *, explicit: bool = False) -> None:
        """Check a call's key against the recorded ones. ``key_ids`` are the call's key
        under every secret of the keyring (an effect recorded before a key rotation
        carries the old secret's key id)."""
        with self.lock:
            head = self.first
            if head >= len(self.recorded):
                return  # past the recorded prefix: new effects are the step's own business
            if self.recorded[head] in key_ids:
                self._ask(head)
                return
            if explicit:
                # An explicit key names its effect wherever the call sits: recorded by this
                # step, it may come in any order (concurrent branches claim in any order);
                # not recorded here, it is another run's effect or a new one.
                for i in range(head + 1, len(self.recorded)):
                    if i not in self.asked and self.recorded[i] in key_ids:
                        self._ask(i)
                        return
                return
            raise StepDiverged(
                self.run_id,
                self.step_id,
                self.recorded[head],
                key_ids[0],
                self.remaining(),
            )


_STEP: contextvars.ContextVar[_StepState | None] = contextvars.ContextVar(
    "onceonly_step", default=None
)
_CLAIM: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "onceonly_claim", default=None
)


class _Watcher(Protocol):
    """An engine adapter (Temporal's activity guard) watching the calls in flight below
    it: it heartbeats the engine and renews the claim's lease meanwhile."""

    def started(self, claim: Claim, ledger: Ledger) -> None: ...  # acting under ``claim``

    def stopped(self, claim: Claim) -> None: ...  # ... and has ended


_WATCH: contextvars.ContextVar[_Watcher | None] = contextvars.ContextVar(
    "onceonly_watch", default=None
)


@contextlib.contextmanager
def step(
    run_id: str,
    step_id: str,
    *,
    visit: int = 0,
    tenant: str = "",
    recorded: Sequence[str] = (),
) -> Iterator[None]:
    """Run the enclosed guarded calls as part of ``step_id`` of ``run_id``.

    Args:
        run_id: The run.
        step_id: The step.
        visit: How many times the run entered this step before (from durable state: a
            retry of the same visit must pass the same number, a loop's next pass the next).
        tenant: The tenant.
        recorded: Key ids an earlier attempt of this step visit recorded, in the order it
            asked for them. The step must ask for them again in that order before it may
            ask for anything new; otherwise :class:`StepDiverged` is raised before acting.
            Leaving the block normally without asking for all of them raises too.

    Raises:
        StepDiverged: On exit, when the block finished normally without asking for every
            recorded effect.
    """
    state = _StepState(tenant, run_id, step_id, visit, recorded=tuple(recorded))
    token = _STEP.set(state)
    try:
        yield
    finally:
        _STEP.reset(token)
    left = state.remaining()
    if left:
        raise StepDiverged(run_id, step_id, left[0], None, left)


def identity_for(effect: str) -> EffectIdentity:
    """The identity of the next call of ``effect`` in the current step.

    Raises:
        ConfigurationError: No step is current (enter :func:`step`, or give the guard an
            explicit key or a key recipe).
    """
    state = _STEP.get()
    if state is None:
        raise ConfigurationError(
            f"guarded call of {effect} outside a step: wrap it in adapters.step(run_id, "
            f"step_id), or give the guard key=... or recipe=KeyRecipe(...)"
        )
    ordinal = state.ordinals.get(effect, 0)
    state.ordinals[effect] = ordinal + 1
    return EffectIdentity(state.tenant, state.run_id, state.step_id, state.visit, effect, ordinal)


def explicit_identity(effect: str, explicit: str, tenant: str = "") -> EffectIdentity:
    """The identity of a call of ``effect`` with an explicit key.

    The key is derived from the tenant, the effect and ``explicit`` alone, so it
    deduplicates across the runs of a tenant. Inside a step the tenant is the step's and
    the identity also names the step's run and step (kept on the entry: retention keeps
    it while the run exists, and the step's resume checks it).

    Args:
        effect: ``name@version``.
        explicit: The explicit key.
        tenant: The tenant outside a step; inside one, empty or the step's.

    Raises:
        ConfigurationError: Inside a step, ``tenant`` names another tenant than the step's.
    """
    state = _STEP.get()
    if state is None:
        return EffectIdentity(tenant, None, None, 0, effect, 0, explicit=explicit)
    if tenant and tenant != state.tenant:
        raise ConfigurationError(
            f"guarded call of {effect} with tenant {tenant!r} inside a step of tenant "
            f"{state.tenant!r}: an explicit key takes the step's tenant (keys never cross "
            f"tenants); drop tenant= from the guard or adapter, or run the step as {tenant!r}"
        )
    return EffectIdentity(
        state.tenant, state.run_id, state.step_id, state.visit, effect, 0, explicit=explicit
    )


def expect_key(key_ids: Sequence[str], *, explicit: bool = False) -> None:
    """Check a call against the current step's recorded effects.

    Args:
        key_ids: The call's key id under each secret of the keyring, current first.
        explicit: The call has an explicit key: recorded by this step, it may be asked
            for in any order; not recorded by it, it is not checked.

    Raises:
        StepDiverged: A position-keyed call asked for another effect than the next
            recorded one.
    """
    state = _STEP.get()
    if state is not None:
        state.expect(key_ids, explicit=explicit)


def current_claim() -> Claim:
    """The claim of the guarded call in progress: send ``provider_key`` (and, where the
    provider checks it, ``fencing_token``) with the request.

    Raises:
        ConfigurationError: Called outside a guarded call.
    """
    claim = _CLAIM.get()
    if claim is None:
        raise ConfigurationError("current_claim() is only available inside a guarded call")
    return claim


@contextlib.contextmanager
def _acting(claim: Claim, ledger: Ledger) -> Iterator[None]:
    token = _CLAIM.set(claim)
    watch = _WATCH.get()
    if watch is not None:
        watch.started(claim, ledger)
    try:
        yield
    finally:
        _CLAIM.reset(token)
        if watch is not None:
            watch.stopped(claim)


@contextlib.contextmanager
def _watching(watch: _Watcher) -> Iterator[None]:
    """Tell ``watch`` of every guarded call below that starts or stops acting."""
    token = _WATCH.set(watch)
    try:
        yield
    finally:
        _WATCH.reset(token)
