"""onceonly: durable runs that resume, not restart, on the checkpoint core and the
effects ledger.

A :class:`Flow` is a set of named steps; a :class:`Runtime` starts and drives its runs; a
:class:`Worker` claims ready runs in as many processes as share the database; an
:class:`Operator` approves, signals, edits, cancels, retries, forks and cleans up. The
``onceonly`` command line (:mod:`onceonly.cli`) wraps them; ``onceonly demo`` runs the
vendor-onboarding example (:mod:`onceonly.demo.flow`).
"""

from .context import BranchContext, StepContext
from .errors import ApprovalMismatch, FlowNotRegistered, RunError, RunNotResumable
from .flow import End, Fail, Flow, Next, WaitFor
from .operator import GcReport, Operator, RunView
from .runtime import Runtime, default_owner
from .worker import Worker, WorkerStats

__all__ = [
    "ApprovalMismatch",
    "BranchContext",
    "End",
    "Fail",
    "Flow",
    "FlowNotRegistered",
    "GcReport",
    "Next",
    "Operator",
    "RunError",
    "RunNotResumable",
    "RunView",
    "Runtime",
    "StepContext",
    "WaitFor",
    "Worker",
    "WorkerStats",
    "default_owner",
]
