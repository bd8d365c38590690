"""Errors raised by the runtime (runs, workers, operator tools).

They extend the tree rooted in :class:`checkpoint.errors.OnceOnlyError`::

    OnceOnlyError
    ├── RunError                    a run cannot go on as asked
    │   ├── ApprovalMismatch        the step acts on something other than what was approved
    │   ├── RunNotResumable         the run is completed, failed or cancelled
    │   ├── FlowNotRegistered       no flow of the run's name is registered here
    │   ├── StepTimedOut            a step attempt ran past its timeout_s
    │   └── DeadlineExceeded        the run ran past its deadline
    └── StepDiverged (adapters)     a resumed step asked for other effects than recorded
        └── BranchesDiverged        a resumed ``ctx.parallel`` call asked for other branches
"""

from __future__ import annotations

from collections.abc import Sequence

from onceonly.adapters import StepDiverged
from onceonly.checkpoint import OnceOnlyError

__all__ = [
    "ApprovalMismatch",
    "BranchesDiverged",
    "DeadlineExceeded",
    "FlowNotRegistered",
    "ForkDiverged",
    "RunError",
    "RunNotResumable",
    "StepTimedOut",
    "UpgradeRefused",
    "VersionNotServed",
]


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


class VersionNotServed(RunError):
    """The run was started under a version of its flow this code does not serve: a run
    stays on its version until ``onceonly runs upgrade`` moves it. A worker never claims
    such a run; :meth:`Runtime.drive` refuses it, with nothing done.

    Attributes:
        flow: The flow name.
        version: The run's version.
        served: The versions this code serves.
    """

    def __init__(self, run_id: str, flow: str, version: str, served: frozenset[str]) -> None:
        self.flow = flow
        self.version = version
        self.served = served
        super().__init__(
            run_id,
            f"run {run_id!r} of flow {flow!r} is on version {version!r}; this code serves "
            f"{', '.join(sorted(served))}: run a worker with code of that version, declare "
            f"Flow(..., serves=({version!r},)) if this code drives its runs, or move the run "
            f"with `onceonly runs upgrade {run_id} --to VERSION`",
        )


class UpgradeRefused(RunError):
    """``onceonly runs upgrade`` cannot move the run as asked; nothing changed.

    Attributes:
        reason: Why.
    """

    def __init__(self, run_id: str, reason: str) -> None:
        self.reason = reason
        super().__init__(run_id, f"run {run_id!r} is not upgraded: {reason}")


class StepTimedOut(RunError):
    """A step attempt was still running when its ``timeout_s`` ran out: it claimed no
    effect after that, and what it returned is dropped (the effects it made stay
    recorded, and replay if the step runs again).

    Attributes:
        step: The step.
        timeout_s: Its time limit.
    """

    def __init__(self, run_id: str, step: str, timeout_s: float) -> None:
        self.step = step
        self.timeout_s = timeout_s
        super().__init__(
            run_id, f"run {run_id!r}: step {step!r} ran past its timeout of {timeout_s:g} s"
        )


class DeadlineExceeded(RunError):
    """The run was still going (running or waiting) when its deadline passed.

    Attributes:
        deadline: When it passed (UNIX seconds).
    """

    def __init__(self, run_id: str, deadline: float) -> None:
        self.deadline = deadline
        super().__init__(run_id, f"run {run_id!r} passed its deadline ({deadline:.3f})")


class BranchesDiverged(StepDiverged):
    """A resumed step's ``ctx.parallel`` call asked for other branches than its earlier
    attempt recorded (a deploy renamed, added or removed a branch): a renamed branch
    would send its effects again under its new name, so no branch was run.

    Attributes:
        run_id: The run.
        step_id: The step (with its visit).
        call: Which ``parallel`` call of the step visit (from 0).
        names: The branch names asked for now.
    """

    def __init__(self, run_id: str, step_id: str, call: int, names: Sequence[str]) -> None:
        self.run_id = run_id
        self.step_id = step_id
        self.call = call
        self.names = tuple(names)
        self.expected = None
        self.got = None
        self.remaining = ()
        OnceOnlyError.__init__(
            self,
            f"step {step_id!r} of run {run_id!r}: parallel call {call} asks for branches "
            f"{list(names)}, other than the ones its earlier attempt recorded; nothing was "
            f"run. Deploy the code that recorded them (`onceonly runs retry {run_id}` then "
            f"replays them), or settle this business in a new run",
        )


class ForkDiverged(StepDiverged):
    """A run shares its effect keys with others (a fork, its origin, their other forks),
    and one of them made effects at a step this run has not passed yet that the deployed
    flow no longer has (a deploy renamed or removed it): the effects are keyed by the
    step's name, so running on could send them again under another name. Nothing was
    run.

    Attributes:
        run_id: The run that stopped.
        step_id: The step (with its visit) it was about to run.
        origin: The run it was forked from (its own id when it is the origin).
        gone: The steps, with effects recorded in the shared key space at visits ahead
            of this run, that the deployed flow no longer has.
    """

    def __init__(self, run_id: str, step_id: str, origin: str, gone: Sequence[str]) -> None:
        self.run_id = run_id
        self.step_id = step_id
        self.origin = origin
        self.gone = tuple(gone)
        self.expected = None
        self.got = None
        self.remaining = ()
        shares = (
            f"run {run_id!r} shares its effect keys with its forks"
            if origin == run_id
            else f"run {run_id!r} shares the effect keys of run {origin!r}"
        )
        OnceOnlyError.__init__(
            self,
            f"{shares}, and a run of that key space made effects at steps {list(gone)}, "
            f"at visits this run has not passed, that the deployed flow has no longer "
            f"(renamed or removed); running "
            f"{step_id!r} on could send them again under other names, so nothing was run. "
            f"Deploy code that has those steps, or fork from a checkpoint after them",
        )
