"""Named failpoints: the places where a test may crash the process.

Library code calls :func:`failpoint` at every durable write and at every boundary of an
external act. It does nothing (one module-global ``None`` check) until a test arms a
handler; the handler receives the failpoint's name and may count it, raise a
:class:`BaseException` subclass (an in-process crash) or call :func:`os._exit` (a real
one). :mod:`onceonly.testing` drives its crash-at-every-point harness with them.

The armed handler is the one piece of module-level mutable state in onceonly, on
purpose: a crash stops every thread of a process (a step's branches, the ledger's
thread pool), so the hook must be seen by every thread, which a context variable is
not. Nothing arms it outside tests.

The failpoints, in the order a guarded effect inside a step meets them
(:data:`KNOWN_FAILPOINTS` lists them; a test compares it with the names it hit):

* ``runtime.step.before``: a step is about to run (its checkpoint is loaded).
* ``ledger.claim.before`` / ``ledger.claim.after``: around the claim's transaction.
* ``adapters.act.before``: the claim is durable; the provider is called next.
* ``adapters.act.after``: the provider answered; its outcome is not recorded yet.
* ``ledger.commit.before`` / ``ledger.commit.after``: around recording success.
* ``ledger.fail.before`` / ``ledger.fail.after``: around recording a definite failure.
* ``ledger.mark_unknown.before`` / ``ledger.mark_unknown.after``: around recording an
  attempt whose outcome is unknown.
* ``ledger.release.before`` / ``ledger.release.after``: around recording an attempt
  that provably never left.
* ``ledger.reconcile.before`` / ``ledger.reconcile.after``: around settling an
  in-doubt effect by evidence.
* ``waits.open.before`` / ``waits.open.after``: around opening a wait.
* ``waits.settle.before`` / ``waits.settle.after``: around settling a due wait (a timer
  fires, an approval expires) before the run moves on.
* ``runtime.step.after``: the step's checkpoint (state, next step, status) is durable.
* ``checkpoint.commit.before`` / ``checkpoint.commit.after``: inside every write
  transaction of the store (checkpoints and every upper layer's transaction), just
  before its COMMIT, and just after it.
* ``checkpoint.run.write``: before a write to a run's row outside a checkpoint
  (create, status change, lease taken or given up).

Example::

    from onceonly.checkpoint.failpoints import armed

    hits: list[str] = []
    with armed(hits.append):
        runtime.drive(run_id)
    print(hits)  # ['checkpoint.run.write', 'runtime.step.before', ...]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# KNOWN_FAILPOINTS is public too (``checkpoint.failpoints.KNOWN_FAILPOINTS``); it stays
# out of ``__all__`` because the package re-exports every name listed here, and a
# SCREAMING_CASE name cannot sit in the package's list sorted both ways its checks want.
__all__ = ["arm", "armed", "disarm", "failpoint"]

KNOWN_FAILPOINTS: tuple[str, ...] = (
    "adapters.act.after",
    "adapters.act.before",
    "checkpoint.commit.after",
    "checkpoint.commit.before",
    "checkpoint.run.write",
    "ledger.claim.after",
    "ledger.claim.before",
    "ledger.commit.after",
    "ledger.commit.before",
    "ledger.fail.after",
    "ledger.fail.before",
    "ledger.mark_unknown.after",
    "ledger.mark_unknown.before",
    "ledger.reconcile.after",
    "ledger.reconcile.before",
    "ledger.release.after",
    "ledger.release.before",
    "runtime.step.after",
    "runtime.step.before",
    "waits.open.after",
    "waits.open.before",
    "waits.settle.after",
    "waits.settle.before",
)
"""Every failpoint name library code uses, sorted."""

Handler = Callable[[str], None]

_handler: Handler | None = None


def failpoint(name: str) -> None:
    """Mark a failpoint: call the armed handler with ``name``, if one is armed.

    Args:
        name: One of :data:`KNOWN_FAILPOINTS`.

    Raises:
        BaseException: Whatever the armed handler raises (a test's simulated crash).
    """
    handler = _handler
    if handler is not None:
        handler(name)


def arm(handler: Handler) -> None:
    """Arm ``handler`` for every failpoint of this process (every thread), replacing
    any handler armed before."""
    global _handler  # noqa: PLW0603  (the one process-wide hook; see the module docstring)
    _handler = handler


def disarm() -> None:
    """Disarm: failpoints do nothing again."""
    global _handler  # noqa: PLW0603  (the one process-wide hook; see the module docstring)
    _handler = None


@contextlib.contextmanager
def armed(handler: Handler) -> Iterator[Handler]:
    """Arm ``handler`` inside the ``with`` block, then restore what was armed before.

    Yields:
        The handler.
    """
    global _handler  # noqa: PLW0603  (the one process-wide hook; see the module docstring)
    before = _handler
    _handler = handler
    try:
        yield handler
    finally:
        _handler = before
