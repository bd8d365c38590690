"""How :mod:`onceonly.testing` runs a scenario: one worker's view of the database, driven
to the run's end, with a failpoint handler armed. Also what a crash child process runs
(:mod:`onceonly.testing._crash_child`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from onceonly.checkpoint import ENDED, Durability, RunStatus, Store, WaitKind, WaitStatus
from onceonly.checkpoint.failpoints import armed
from onceonly.flow import Flow
from onceonly.ledger import Keyring, Ledger, Secret
from onceonly.operator import Operator
from onceonly.runtime import META, Runtime

from ._fakes import Clock

__all__ = ["Counter", "Crash", "Env", "Outcome", "Scenario", "drive", "run_once"]

RUN_ID = "crash-harness-run"
OWNER = "crash-harness"
ACTOR = "crash-harness-operator"
SECRET = Secret("crash-harness", bytes(range(32)))
TERMINAL = ENDED
EXIT_CODE = 137  # what a shell reports for a SIGKILLed process
DEFINITE = ("HTTPRejected", "EffectFailed")  # a step failed by a definite refusal


class Crash(BaseException):
    """The simulated crash: raised at the chosen failpoint, and at every failpoint after
    it (the process is dead: nothing more may reach the database or a provider).

    Attributes:
        failpoint: Where the crash happened.
        hit: Its number among the run's failpoint hits (1-based).
    """

    def __init__(self, failpoint: str, hit: int) -> None:
        super().__init__(f"crash at failpoint {failpoint!r} (hit {hit})")
        self.failpoint = failpoint
        self.hit = hit


@dataclass(frozen=True)
class Scenario:
    """One run of a flow, as the harness drives it.

    The harness starts the run (id ``crash-harness-run``) with ``state``, drives it to
    its end, and answers its waits as people would: approvals are approved by
    ``crash-harness-operator``, signals get ``signals[name]`` (default None), timers fire
    (the harness's :class:`Clock` jumps to them), and an effect that needs a human is
    resolved by asking the fakes whether it happened.

    Attributes:
        flow: The flow. For crash mode ``"exit"`` it must be a module-level name of an
            importable module (a child process imports it).
        state: The run's initial state (for mode ``"exit"``: encodable by the store's codec).
        signals: Payloads of the signals the run waits for, by name.
    """

    flow: Flow
    state: Mapping[str, Any] = field(default_factory=dict)
    signals: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """How a driven run ended: its status, the failed step's error type, and how many
    in-doubt effects were handed to a human."""

    status: RunStatus | None
    needs_human: int = 0
    error: str = ""
    resolved: list[str] = field(default_factory=list)  # provider keys a human settled


class Counter:
    """Counts failpoint hits; crashes at hit ``at`` and at every one after it."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.names: list[str] = []
        self.dead = False
        self._lock = threading.Lock()

    def __call__(self, name: str) -> None:
        with self._lock:
            if not self.dead:
                self.names.append(name)
                self.dead = len(self.names) == self.at
            dead, n = self.dead, len(self.names)
        if dead:
            raise Crash(name, n)


class Env:
    """One worker process's view: store (in ``durability`` mode), ledger, runtime,
    operator."""

    def __init__(
        self,
        url: str,
        flow: Flow,
        keyring: Keyring,
        clock: Clock,
        durability: Durability | str = Durability.SYNC,
    ) -> None:
        self.store = Store.open(url, durability=durability)
        try:
            self.ledger = Ledger(self.store, keyring, owner=OWNER, clock=clock, create=False)
            self.runtime = Runtime(self.store, self.ledger, [flow], owner=OWNER, clock=clock)
        except BaseException:
            self.store.close()
            raise
        self.operator = Operator(self.store, self.ledger, clock=clock)
        self.clock = clock

    def close(self) -> None:
        try:
            self.ledger.close()
        finally:
            self.store.close()


def drive(
    env: Env,
    scenario: Scenario,
    evidence: Callable[[str], tuple[bool, Any]] | None,
    *,
    max_passes: int = 200,
) -> Outcome:
    """Start (idempotently) and drive the run to its end, answering its waits."""
    out = Outcome(None)
    env.runtime.start(scenario.flow.name, dict(scenario.state), run_id=RUN_ID, started_by=OWNER)
    for _ in range(max_passes):
        run = env.runtime.drive(RUN_ID)
        out.status = run.status
        if run.status in TERMINAL:
            error = (env.store.load(RUN_ID).state.get(META) or {}).get("error") or {}
            out.error = str(error.get("type", ""))
            return out
        if run.status is RunStatus.WAITING and not _answer(env, scenario, evidence, out):
            return out
    out.error = f"still {out.status} after {max_passes} passes"
    return out


def _answer(
    env: Env,
    scenario: Scenario,
    evidence: Callable[[str], tuple[bool, Any]] | None,
    out: Outcome,
) -> bool:
    """Answer the run's open waits; False when there is nothing to answer."""
    waits = env.runtime.waits.find(run_id=RUN_ID, status=WaitStatus.OPEN)
    if not waits:
        return False
    for wait in waits:
        if wait.kind is WaitKind.APPROVAL:
            env.operator.approve(
                RUN_ID, wait.name, actor=ACTOR, subject_hash=str(wait.subject_hash)
            )
        elif wait.kind is WaitKind.TIMER:
            env.clock.now = max(env.clock.now, float(wait.due_at or 0.0))
        elif wait.name.startswith("effect:"):
            if evidence is None:
                return False
            meta = env.store.load(RUN_ID).state.get(META) or {}
            key_id = str((meta.get("waiting") or {}).get("effect"))
            record = env.ledger.get(key_id)
            happened, result = evidence(record.provider_key)
            out.needs_human += 1
            out.resolved.append(record.provider_key)
            env.operator.resolve(
                key_id,
                happened=happened,
                evidence="the fake provider's delivery log",
                actor=ACTOR,
                result=result,
            )
        else:
            env.operator.signal(RUN_ID, wait.name, scenario.signals.get(wait.name), actor=ACTOR)
    return True


def run_once(
    url: str,
    scenario: Scenario,
    keyring: Keyring,
    clock: Clock,
    handler: Callable[[str], None],
    evidence: Callable[[str], tuple[bool, Any]] | None,
    durability: Durability | str = Durability.SYNC,
) -> Outcome:
    """One worker: open (its store in ``durability`` mode), drive with ``handler`` armed,
    close.

    The store is closed with the handler still armed: in ``async`` / ``exit`` mode closing
    writes the checkpoints still queued, and those writes pass failpoints like any other
    (a crash may land there; after a :class:`Crash` every later failpoint raises again, so
    a dead worker's close writes nothing, as a killed process would not). An error of
    that close after a crash is the dead process's, not the run's: the :class:`Crash` is
    what the caller sees, also when the crash hit another thread (the ``async`` writer)
    and reached this one as that thread's failure.
    """
    env = Env(url, scenario.flow, keyring, clock, durability)
    with armed(handler):
        try:
            out = drive(env, scenario, evidence)
        except BaseException as exc:
            with contextlib.suppress(Exception, Crash):
                env.close()
            if isinstance(handler, Counter) and handler.dead and not isinstance(exc, Crash):
                # The crash hit another thread (the async writer): this thread learnt of
                # it as that thread's failure, but in the process it simulates every
                # thread died at that moment.
                raise Crash(handler.names[-1], len(handler.names)) from exc
            raise
        env.close()
    return out
