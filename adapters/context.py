"""Where a guarded call sits: the current step of the current run.

A runtime (or your own loop) enters :func:`step` around each step it executes; every
guarded call inside gets its identity from that position — tenant, run, step, how many
times the run entered the step before, the effect and the call's ordinal among that
effect's calls in the step — so a resumed or retried step derives the same keys.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

from checkpoint.errors import ConfigurationError
from ledger import Claim, EffectIdentity

__all__ = ["current_claim", "identity_for", "step"]


@dataclass
class _StepState:
    tenant: str
    run_id: str
    step_id: str
    visit: int
    ordinals: dict[str, int] = field(default_factory=dict)


_STEP: contextvars.ContextVar[_StepState | None] = contextvars.ContextVar(
    "onceonly_step", default=None
)
_CLAIM: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "onceonly_claim", default=None
)


@contextlib.contextmanager
def step(run_id: str, step_id: str, *, visit: int = 0, tenant: str = "") -> Iterator[None]:
    """Run the enclosed guarded calls as part of ``step_id`` of ``run_id``.

    Args:
        run_id: The run.
        step_id: The step.
        visit: How many times the run entered this step before (from durable state: a
            retry of the same visit must pass the same number, a loop's next pass the next).
        tenant: The tenant.
    """
    token = _STEP.set(_StepState(tenant, run_id, step_id, visit))
    try:
        yield
    finally:
        _STEP.reset(token)


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
def _acting(claim: Claim) -> Iterator[None]:
    token = _CLAIM.set(claim)
    try:
        yield
    finally:
        _CLAIM.reset(token)
