"""Flows: named steps that read and change a run's state and say what comes next.

A step is a function of a :class:`StepContext`. It reads and changes ``ctx.state`` (a
mapping of channels), performs effects through guarded adapters (their keys come from
the run's position: run, step, visit, effect, ordinal), and returns a transition:
``ctx.next("step")``, a wait (``ctx.wait_for_approval``, ``ctx.wait_for_signal``,
``ctx.sleep``), ``ctx.end()`` or ``ctx.fail(reason)``. Nothing a step does to the state
is kept unless the step returns: a step that crashes half-way is run again, and its
recorded effects replay instead of acting again.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from onceonly.checkpoint import ConfigurationError, Durability, StateMigrations

if TYPE_CHECKING:
    from .context import StepContext

__all__ = [
    "End",
    "Fail",
    "Flow",
    "Next",
    "Step",
    "StepRetry",
    "StepTimeout",
    "Transition",
    "WaitFor",
]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
_VERSION = re.compile(r"^[\x21-\x7e]{1,100}$")


@dataclass(frozen=True)
class Next:
    """Run ``step`` next."""

    step: str


@dataclass(frozen=True)
class End:
    """The run is complete; ``result`` is kept in the state channel ``result``."""

    result: Any = None


@dataclass(frozen=True)
class Fail:
    """The run failed for ``reason`` (an operator may retry or fork it)."""

    reason: str


@dataclass(frozen=True)
class WaitFor:
    """Suspend the run until the wait ``name`` settles.

    Attributes:
        name: Unique within the run.
        kind: ``approval``, ``signal`` or ``timer``.
        then: The step after an approval, a signal or a timer.
        due_at: A timer's due time or an approval's expiry (UNIX seconds).
        subject: Approvals: exactly what is to be approved.
        requested_by: Approvals: who asks (may not approve it).
        allow_self: Approvals: the requester may approve.
        on_reject: Approvals: the step after a rejection (None: the run fails).
        on_expire: Approvals and signals: the step after expiry (None: the run fails).
    """

    name: str
    kind: str
    then: str
    due_at: float | None = None
    subject: Any = None
    requested_by: str | None = None
    allow_self: bool = False
    on_reject: str | None = None
    on_expire: str | None = None


@dataclass(frozen=True)
class StepRetry:
    """Durable retries of a step whose code raises (a flaky dependency).

    A failed attempt does not hold a process: the run waits on a timer (shown by
    ``onceonly runs show``, kept across restarts and deploys), then runs the same step
    visit again, so the effects its earlier attempts recorded replay instead of acting
    again. The error of every attempt is kept (type, message, traceback); after the
    last attempt the run fails with it. A step that returns ``ctx.fail(...)`` is not
    retried, and neither are the runtime's own refusals (a key reused with other
    arguments, an approval of another subject, an effect in doubt: those park or fail
    the run as without a policy).

    Attributes:
        attempts: Attempts in all, the first included (1: no retry).
        backoff_s: Pause before the second attempt.
        multiplier: Growth of the pause per attempt.
        max_backoff_s: Longest pause.
        on: Exception types that are retried (others fail the run at once).
    """

    attempts: int = 3
    backoff_s: float = 1.0
    multiplier: float = 2.0
    max_backoff_s: float = 86_400.0
    on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.attempts, int)
            or self.attempts < 1
            or self.backoff_s < 0
            or self.multiplier < 1
            or self.max_backoff_s < self.backoff_s
        ):
            raise ConfigurationError(
                "StepRetry needs attempts >= 1, backoff_s >= 0, multiplier >= 1 and "
                "max_backoff_s >= backoff_s"
            )
        if (
            not isinstance(self.on, tuple)
            or not self.on
            or not all(isinstance(t, type) and issubclass(t, BaseException) for t in self.on)
        ):
            raise ConfigurationError("StepRetry.on is a non-empty tuple of exception types")

    def pause(self, failed: int) -> float:
        """Seconds to wait after failed attempt ``failed`` (1, 2, ...)."""
        return float(
            min(self.backoff_s * self.multiplier ** max(failed - 1, 0), self.max_backoff_s)
        )

    def retries(self, exc: BaseException) -> bool:
        """Whether ``exc`` is one this policy retries."""
        return isinstance(exc, self.on)


@dataclass(frozen=True)
class StepTimeout:
    """A step's time limit (``@flow.step(timeout_s=..., on_timeout=...)``).

    Attributes:
        seconds: How long one attempt may take.
        then: The step after the last attempt timed out (None: the run fails).
    """

    seconds: float
    then: str | None = None


def durability_mode(value: Durability | str | None) -> Durability | None:
    """``value`` as a :class:`Durability` (None stays None: the store's mode).

    Raises:
        ConfigurationError: It names no mode.
    """
    if value is None:
        return None
    try:
        return Durability(value)
    except ValueError:
        raise ConfigurationError(
            f"durability is one of {[d.value for d in Durability]}, not {value!r}"
        ) from None


def _check_seconds(what: str, value: float | None) -> None:
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or value == float("inf")
    ):
        raise ConfigurationError(f"{what} is a positive number of seconds, not {value!r}")


Transition = Next | End | Fail | WaitFor
Step = Callable[["StepContext"], Transition] | Callable[["StepContext"], Awaitable[Transition]]
"""A step: a function of its context, ``def`` or ``async def``, returning a transition."""


class Flow:
    """A named set of steps.

    Args:
        name: The flow's name (runs record it; workers look flows up by it).
        version: The code version, recorded on the run's checkpoints.
        state_version: The state-schema version of the state this code writes.
        migrations: Upgrades of older state, run on resume.
        tenant: Tenant of the runs' effect keys.
        deadline_s: How long a run of this flow may take, from its start (None: no
            limit; ``Runtime.start(deadline_s=...)`` sets it per run).
        on_deadline: The step a run goes to when its deadline passes (None: the run
            fails with ``DeadlineExceeded``).
        durability: When its runs' checkpoints become durable (``sync``, ``async`` or
            ``exit``; None: the store's); ``Runtime.start(durability=...)`` sets it per
            run. Effects are as safe in every mode: a checkpoint is durable before the
            next effect is claimed.
        serves: Older versions of this flow whose runs this code also drives (it keeps
            their steps and reads their state). A run stays on the version that started
            it: a worker drives only runs of the versions its flows serve (their own and
            these), and a run of another version waits for a worker that serves it, or
            for ``onceonly runs upgrade``.
        upgrades: For ``onceonly runs upgrade``: per older version, the steps its runs
            take under this code's names (``{"1": {"review": "check"}}``: a run of
            version 1 at ``review`` goes on at ``check``). Steps not named keep their
            names. The state is upgraded by ``migrations``.

    Example::

        flow = Flow("greet")

        @flow.step(start=True)
        def hello(ctx):
            ctx.state["greeted"] = True
            return ctx.end()
    """

    def __init__(
        self,
        name: str,
        *,
        version: str = "1",
        state_version: int = 1,
        migrations: StateMigrations | None = None,
        tenant: str = "",
        deadline_s: float | None = None,
        on_deadline: str | None = None,
        durability: Durability | str | None = None,
        serves: Iterable[str] = (),
        upgrades: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        if not _NAME.match(name):
            raise ConfigurationError(f"flow name {name!r}: use 1-100 of A-Z a-z 0-9 _ . -")
        if not isinstance(version, str) or not _VERSION.match(version):
            raise ConfigurationError(f"flow version {version!r}: use 1-100 printable characters")
        if isinstance(serves, str):
            raise ConfigurationError("serves= takes versions (a tuple of strings), not one string")
        older = tuple(serves)
        if not all(isinstance(v, str) and _VERSION.match(v) for v in older):
            raise ConfigurationError(f"serves= takes version strings, not {older!r}")
        self.served = frozenset((version, *older))
        self.upgrades: dict[str, dict[str, str]] = {}
        for old_version, renames in (upgrades or {}).items():
            if not isinstance(old_version, str) or not isinstance(renames, Mapping):
                raise ConfigurationError("upgrades= maps an older version to {old step: new step}")
            self.upgrades[old_version] = {str(a): str(b) for a, b in renames.items()}
        _check_seconds("deadline_s", deadline_s)
        self.durability = durability_mode(durability)
        self.name = name
        self.version = version
        self.state_version = migrations.current if migrations is not None else state_version
        self.migrations = migrations
        self.tenant = tenant
        self.steps: dict[str, Step] = {}
        self.retries: dict[str, StepRetry] = {}
        self.timeouts: dict[str, StepTimeout] = {}
        self.deadline_s = deadline_s
        self.on_deadline = on_deadline
        self.start: str | None = None

    @overload
    def step(self, fn: Step, /) -> Step: ...

    @overload
    def step(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        start: bool = False,
        retry: StepRetry | None = None,
        timeout_s: float | None = None,
        on_timeout: str | None = None,
    ) -> Callable[[Step], Step]: ...

    def step(
        self,
        fn: Step | None = None,
        /,
        *,
        name: str | None = None,
        start: bool = False,
        retry: StepRetry | None = None,
        timeout_s: float | None = None,
        on_timeout: str | None = None,
    ) -> Step | Callable[[Step], Step]:
        """Register a step (decorator). The first registered step starts unless another
        says ``start=True``; ``retry``: how an error the step raises is retried;
        ``timeout_s``: how long one attempt of the step may take (an attempt still
        running then claims no further effect and its result is dropped; it counts as a
        failed attempt for ``retry``, and after the last one the run goes to
        ``on_timeout``, or fails with ``StepTimedOut``)."""
        if retry is not None and not isinstance(retry, StepRetry):
            raise ConfigurationError(f"retry= takes a StepRetry, not {type(retry).__name__}")
        _check_seconds("timeout_s", timeout_s)
        if on_timeout is not None and timeout_s is None:
            raise ConfigurationError("on_timeout= needs timeout_s=")

        def register(f: Step) -> Step:
            step_name = name or f.__name__
            if not _NAME.match(step_name) or step_name in self.steps:
                raise ConfigurationError(
                    f"step name {step_name!r} of flow {self.name!r} is malformed or taken"
                )
            self.steps[step_name] = f
            if retry is not None:
                self.retries[step_name] = retry
            if timeout_s is not None:
                self.timeouts[step_name] = StepTimeout(float(timeout_s), on_timeout)
            if start or self.start is None:
                self.start = step_name
            return f

        return register if fn is None else register(fn)

    def drives(self, version: str) -> bool:
        """Whether this code drives runs started under ``version`` (its own version, or
        one it ``serves``)."""
        return version in self.served

    def step_after_upgrade(self, from_version: str, step: str) -> str:
        """The name under this code of step ``step`` of a run of ``from_version``."""
        return self.upgrades.get(from_version, {}).get(step, step)

    def get(self, step: str) -> Step:
        """The step function ``step``.

        Raises:
            ConfigurationError: The flow has no such step (the code changed under a
                stored run).
        """
        try:
            return self.steps[step]
        except KeyError:
            raise ConfigurationError(
                f"flow {self.name!r} (version {self.version}) has no step {step!r}; a stored "
                f"run names it: deploy code that has it, or fork the run"
            ) from None


def flow_map(flows: Iterable[Flow]) -> dict[str, Flow]:
    """Flows by name; a name given twice is an error."""
    out: dict[str, Flow] = {}
    for f in flows:
        if f.name in out:
            raise ConfigurationError(f"flow {f.name!r} given twice")
        if f.start is None:
            raise ConfigurationError(f"flow {f.name!r} has no steps")
        # the paths a deadline or a timeout takes exist: found at start, not on expiry
        paths = [("on_deadline", f.on_deadline)] + [
            (f"on_timeout of {s!r}", t.then) for s, t in f.timeouts.items()
        ]
        for what, target in paths:
            if target is not None and target not in f.steps:
                raise ConfigurationError(f"flow {f.name!r}: {what} names no step ({target!r})")
        for old_version, renames in f.upgrades.items():
            for target in renames.values():
                if target not in f.steps:
                    raise ConfigurationError(
                        f"flow {f.name!r}: upgrades from version {old_version!r} name no "
                        f"step {target!r}"
                    )
        out[f.name] = f
    return out
