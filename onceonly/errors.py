"""Errors raised by the runtime (runs, workers, operator tools).

They extend the tree rooted in :class:`checkpoint.errors.OnceOnlyError`::

    OnceOnlyError
    └── RunError                    a run cannot go on as asked
        ├── ApprovalMismatch        the step acts on something other than what was approved
        ├── RunNotResumable         the run is completed, failed or cancelled
        └── FlowNotRegistered       no flow of the run's name is registered here
"""

from __future__ import annotations

from checkpoint import OnceOnlyError

__all__ = ["ApprovalMismatch", "FlowNotRegistered", "RunError", "RunNotResumable"]


class RunError(OnceOnlyError):
    """A run cannot go on as asked.

    Attributes:
        run_id: The run.
    """

    def __init__(self, run_id: str, message: str) -> None:
        self.run_id = run_id
        super().__init__(message)


class ApprovalMismatch(RunError):
    """What the step is about to act on is not what was approved (its hash differs).

    Attributes:
        name: The approval.
    """

    def __init__(self, run_id: str, name: str) -> None:
        self.name = name
        super().__init__(
            run_id,
            f"run {run_id!r}: approval {name!r} was given for something else than what the "
            f"step now acts on (the state changed after the approval); nothing was sent. "
            f"Fork the run from before the approval request to ask again",
        )


class RunNotResumable(RunError):
    """The run is completed, failed or cancelled (or waits); it does not run steps.

    Attributes:
        status: Its status.
    """

    def __init__(self, run_id: str, status: str, hint: str = "") -> None:
        self.status = status
        super().__init__(run_id, f"run {run_id!r} is {status}; nothing was run. {hint}".strip())


class FlowNotRegistered(RunError):
    """The run names a flow this process does not know.

    Attributes:
        flow: The flow name.
    """

    def __init__(self, run_id: str, flow: str) -> None:
        self.flow = flow
        super().__init__(
            run_id,
            f"run {run_id!r} belongs to flow {flow!r}, which is not registered with this "
            f"runtime or worker (pass it with --flows module:attribute)",
        )
