"""Run fences: claims that act for a run only while the run is where its step started.

A runtime enters :func:`run_fence` around each step it executes, naming the run, the head
checkpoint the step was built on (sequence number and digest) and the worker that holds
the run's lease. Every transaction that hands out a claim — a new claim, a re-claim after
an attempt proved not to have happened, a re-send inside a class-A dedup window — checks
the fence in the same transaction, with one indexed read of the run row and its head:
the run must still be ``running``, its head must still be exactly that checkpoint,
(when an owner is given) its lease must be that owner's, and (when the step has a time
limit: its timeout, the run's deadline) that time must not have come. Otherwise the
claim is refused with :class:`~ledger.errors.RunFenced` before anything is written or
sent.

So an operator's cancel takes effect before the step's next effect is claimed (the
effect in progress finishes), an operator's edit or another worker's checkpoint stops a
step built on a state that is no longer the run's, and in ``async`` or ``exit``
durability a step whose predecessor's checkpoint lost a race to another writer never
acts on it. Recorded outcomes replay through a fence (replaying acts on nothing).

The fence travels in a :mod:`contextvars` variable: threads started with a copied
context (``ctx.parallel``'s branches) and executor calls run through
``contextvars.copy_context().run`` carry it.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from onceonly.checkpoint import Store

from .errors import RunFenced

__all__ = ["RunFence", "current_fence", "run_fence"]


@dataclass(frozen=True)
class RunFence:
    """Where a step started, which its claims check.

    Attributes:
        run_id: The run the step acts for (not its key space: a fork acts for itself).
        head_seq: The run's head checkpoint when the step started.
        head_digest: That checkpoint's digest (a racing writer's checkpoint at the same
            sequence number has another).
        owner: The worker holding the run's lease, or None not to check the lease.
        deadline: When the step's time is up (UNIX seconds, on ``clock``), or None.
        clock: The runtime's clock, which set ``deadline``.
    """

    run_id: str
    head_seq: int
    head_digest: bytes = field(repr=False)
    owner: str | None = None
    deadline: float | None = None
    clock: Callable[[], float] = field(default=time.time, repr=False, compare=False)


_FENCE: contextvars.ContextVar[RunFence | None] = contextvars.ContextVar(
    "onceonly_run_fence", default=None
)


@contextlib.contextmanager
def run_fence(fence: RunFence | None) -> Iterator[None]:
    """Fence every claim made inside the block (None: no fence)."""
    token = _FENCE.set(fence)
    try:
        yield
    finally:
        _FENCE.reset(token)


def current_fence() -> RunFence | None:
    """The fence in force here, if any."""
    return _FENCE.get()


def check_fence(cur: Any, store: Store, fence: RunFence | None) -> None:
    """Refuse a claim whose fence no longer holds (inside the claim's transaction; the
    run row's seal is checked too, so a status edited by SQL never lets a claim through).

    Raises:
        RunFenced: The run is gone, not running, moved on, leased to another worker,
            or the step's time is up.
        CorruptRecord: The run row fails its seal.
    """
    if fence is None:
        return
    if fence.deadline is not None and fence.clock() >= fence.deadline:
        raise RunFenced(fence.run_id, "deadline", None, "the step's time is up")
    found = store.run_head_in(cur, fence.run_id)
    if found is None:
        raise RunFenced(fence.run_id, "gone", None, "the run no longer exists")
    run, digest = found
    status = run.status.value
    if status != "running":
        raise RunFenced(fence.run_id, "not_running", status, f"the run is {status}")
    if run.head_seq != fence.head_seq or digest is None or digest != fence.head_digest:
        raise RunFenced(
            fence.run_id,
            "moved",
            status,
            f"another writer advanced it past checkpoint {fence.head_seq} (an operator's "
            f"edit or cancel, or another worker)",
        )
    if fence.owner is not None and run.lease_owner != fence.owner:
        raise RunFenced(fence.run_id, "lease", status, f"its lease is held by {run.lease_owner!r}")
