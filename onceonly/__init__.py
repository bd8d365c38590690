"""onceonly: durable runs that resume, not restart, on the checkpoint core and the
effects ledger.

A :class:`Flow` is a set of named steps; a :class:`Runtime` starts and drives its runs; a
:class:`Worker` claims ready runs in as many processes as share the database; an
:class:`Operator` approves, signals, edits, cancels, retries, forks and cleans up. The
``onceonly`` command line (:mod:`onceonly.cli`) wraps them; ``onceonly demo`` runs the
vendor-onboarding example (:mod:`onceonly.demo.flow`).

The names are imported on first use (PEP 562): ``import onceonly`` (and the
``onceonly.checkpoint`` / ``onceonly.ledger`` / ``onceonly.adapters`` packages it holds,
which import it first) stays cheap, and the command line starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and mypy see; at run time, __getattr__ below
    from .context import BranchContext, StepContext
    from .errors import (
        ApprovalMismatch,
        DeadlineExceeded,
        FlowNotRegistered,
        RunError,
        RunNotResumable,
        StepTimedOut,
        UpgradeRefused,
        VersionNotServed,
    )
    from .flow import End, Fail, Flow, Next, StepRetry, StepTimeout, WaitFor
    from .operator import GcReport, Operator, RunView
    from .runtime import Runtime, default_owner
    from .worker import Worker, WorkerStats

__all__ = [
    "ApprovalMismatch",
    "BranchContext",
    "DeadlineExceeded",
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
    "StepRetry",
    "StepTimedOut",
    "StepTimeout",
    "UpgradeRefused",
    "VersionNotServed",
    "WaitFor",
    "Worker",
    "WorkerStats",
    "default_owner",
]

# Each public name and the module that defines it.
_WHERE = {
    "ApprovalMismatch": "errors",
    "BranchContext": "context",
    "DeadlineExceeded": "errors",
    "End": "flow",
    "Fail": "flow",
    "Flow": "flow",
    "FlowNotRegistered": "errors",
    "GcReport": "operator",
    "Next": "flow",
    "Operator": "operator",
    "RunError": "errors",
    "RunNotResumable": "errors",
    "RunView": "operator",
    "Runtime": "runtime",
    "StepContext": "context",
    "StepRetry": "flow",
    "StepTimedOut": "errors",
    "StepTimeout": "flow",
    "UpgradeRefused": "errors",
    "VersionNotServed": "errors",
    "WaitFor": "flow",
    "Worker": "worker",
    "WorkerStats": "worker",
    "default_owner": "runtime",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
