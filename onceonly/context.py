"""What a step sees: the run's state, its position, transitions, recorded reads, branches."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from onceonly.adapters import RetryPolicy, guard, step
from onceonly.checkpoint import ConfigurationError, Handoff, Store, subject_hash
from onceonly.ledger import (
    EffectRecord,
    Evidence,
    KeyReuseError,
    Ledger,
    OutcomeClass,
    ProviderClass,
)

from .errors import BranchesDiverged
from .flow import End, Fail, Next, WaitFor

__all__ = ["BranchContext", "StepContext"]

T = TypeVar("T")


def _not_happened(record: EffectRecord) -> tuple[Evidence, Any]:
    # A read leaves nothing in the world: an attempt lost in a crash may be asked again.
    return Evidence.NOT_HAPPENED, None


def _read_failed(exc: BaseException) -> OutcomeClass:
    return OutcomeClass.NOT_SENT


_READ_RETRY = RetryPolicy(max_attempts=2, initial_s=0.0, max_s=0.0)


def _read_guard(
    ledger: Ledger, effect: str, subject: str | None = None
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """The guard of a recorded read (sync or async): queryable, asked again when lost in
    a crash (a read changes nothing), tried once more when it fails. ``subject``: whose
    data the result is (a branch's memo is the run's: erased with the run's)."""
    return guard(
        ledger,
        effect=effect,
        provider_class=ProviderClass.QUERYABLE,
        retry=_READ_RETRY,
        classify=_read_failed,
        probe=_not_happened,
        subject=subject,
    )


@dataclass
class _Position:
    run_id: str  # the run
    key_run: str  # the run whose key space the effects use (a fork shares its origin's)
    step: str
    visit: int
    tenant: str


class _Recording:
    """Recorded reads, shared by steps and branches."""

    ledger: Ledger
    _pos: _Position

    def recorded(self, effect: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Call an expensive or non-deterministic read once per run position, and replay
        its recorded result on resume (an LLM call, a screening query, ``time.time()``).

        The result must be encodable by the store's codec. A read that fails is tried
        once more, then the step fails; a read lost in a crash is asked again (a read
        changes nothing in the world).

        Args:
            effect: ``name@version`` of the read.
            fn: The read.
            *args: Its positional arguments (fingerprinted: changed arguments on resume
                are a divergence).
            **kwargs: Its keyword arguments (fingerprinted).
        """
        return _read_guard(self.ledger, effect)(fn)(*args, **kwargs)

    async def arecorded(
        self, effect: str, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any
    ) -> T:
        """:meth:`recorded` for an async read (``await ctx.arecorded("llm@1", ask, p)``),
        in an async step or branch: the same key, the same replay on resume."""
        return await _read_guard(self.ledger, effect)(fn)(*args, **kwargs)


class StepContext(_Recording):
    """The run as one step sees it.

    Attributes:
        run_id: The run.
        flow: The flow's name.
        step: This step's name.
        visit: How many times the run completed this step before.
        state: The run's state channels; changes are kept when the step returns.
        handoff: The run's handoff note; assign a new one with :meth:`note`.
        ledger: The effects ledger (for guarded adapters).
        deadline: When this attempt's time is up (UNIX seconds: the step's
            ``timeout_s`` or the run's deadline, the sooner), None without a limit. Give
            the clients the step calls timeouts within it: an effect claimed after it
            is refused, and a step still running then is dropped.
        version: The flow version the run was started under (its recorded code
            version). Code that drives runs of older versions after a deploy branches
            on it (``if ctx.version == "1": ...``); the code's own is ``flow_version``.
        flow_version: The version of the code running this step.
    """

    def __init__(
        self,
        *,
        store: Store,
        ledger: Ledger,
        flow: str,
        position: _Position,
        state: dict[str, Any],
        handoff: Handoff,
        waits: Mapping[str, Mapping[str, Any]],
        started_by: str | None,
        clock: Callable[[], float] = time.time,
        deadline: float | None = None,
        version: str = "",
        flow_version: str = "",
    ) -> None:
        self.store = store
        self.deadline = deadline
        self.version = version
        self.flow_version = flow_version
        self.ledger = ledger
        self.flow = flow
        self._pos = position
        self.run_id = position.run_id
        self.step = position.step
        self.visit = position.visit
        self.state = state
        self.handoff = handoff
        self._waits = waits
        self._started_by = started_by
        self._clock = clock
        self._parallel_calls = 0

    # -- transitions -------------------------------------------------------------------
    def next(self, step: str) -> Next:
        """Continue with ``step``."""
        return Next(step)

    def end(self, result: Any = None) -> End:
        """Complete the run (``result`` is kept in the state channel ``result``)."""
        return End(result)

    def fail(self, reason: str) -> Fail:
        """Fail the run for ``reason``."""
        return Fail(reason)

    def wait_for_approval(
        self,
        name: str,
        subject: Any,
        *,
        then: str,
        expires_in: float | None = None,
        requested_by: str | None = None,
        allow_self: bool = False,
        on_reject: str | None = None,
        on_expire: str | None = None,
    ) -> WaitFor:
        """Suspend until a person approves exactly ``subject`` (bound by its hash).

        Args:
            name: Unique within the run.
            subject: What is to be approved (shown to the approver; hashed).
            then: The step after approval; it can check it acts on what was approved
                with :meth:`approved`.
            expires_in: Seconds until the request expires.
            requested_by: The requester (default: who started the run); they may not
                approve unless ``allow_self``.
            allow_self: The requester may approve their own request.
            on_reject: Step after a rejection (default: the run fails).
            on_expire: Step after expiry (default: the run fails).
        """
        due = None if expires_in is None else self._clock() + expires_in
        return WaitFor(
            name,
            "approval",
            then,
            due_at=due,
            subject=subject,
            requested_by=requested_by or self._started_by,
            allow_self=allow_self,
            on_reject=on_reject,
            on_expire=on_expire,
        )

    def wait_for_signal(
        self,
        name: str,
        *,
        then: str,
        expires_in: float | None = None,
        on_expire: str | None = None,
    ) -> WaitFor:
        """Suspend until the signal ``name`` is delivered (or continue at once if it was);
        read its payload in ``then`` with :meth:`signal`.

        Args:
            expires_in: Seconds to wait at most (None: for ever). A signal that comes
                after is kept for the next wait of its name.
            on_expire: The step after expiry (default: the run fails). It can remind
                and wait again under the same name, escalate, or give up.
        """
        due = None if expires_in is None else self._clock() + expires_in
        return WaitFor(name, "signal", then, due_at=due, on_expire=on_expire)

    def sleep(self, name: str, seconds: float, *, then: str) -> WaitFor:
        """Suspend for ``seconds`` (a timer named ``name``), holding no process."""
        return WaitFor(name, "timer", then, due_at=self._clock() + seconds)

    # -- what earlier waits brought ----------------------------------------------------
    def signal(self, name: str) -> Any:
        """The payload of the delivered signal ``name``.

        Raises:
            ConfigurationError: The run has not received that signal.
        """
        got = self._waits.get(name)
        if got is None or got.get("kind") != "signal":
            raise ConfigurationError(f"run {self.run_id!r} has not received signal {name!r}")
        return got.get("payload")

    def wait_outcome(self, name: str) -> str | None:
        """How the run's last wait named ``name`` settled (``approved``, ``rejected``,
        ``expired``, ``delivered``, ``fired``), None if none has: an ``on_expire`` or
        ``on_reject`` step tells why it runs."""
        got = self._waits.get(name)
        return None if got is None else str(got.get("status"))

    def approved(self, name: str, subject: Any = None) -> Mapping[str, Any]:
        """The approval ``name`` (who, when, and under ``"subject"`` exactly what was
        approved: an approver may have edited the request, so act on this); with
        ``subject``, also check that it is exactly what was approved.

        Raises:
            ConfigurationError: No such approval was granted.
            ApprovalMismatch: ``subject`` is not what was approved (the state changed
                after the approval): nothing should be acted on.
        """
        from .errors import ApprovalMismatch  # noqa: PLC0415

        got = self._waits.get(name)
        if got is None or got.get("status") != "approved":
            raise ConfigurationError(f"run {self.run_id!r} has no granted approval {name!r}")
        if subject is not None and subject_hash(self.store, subject) != got.get("subject_hash"):
            raise ApprovalMismatch(self.run_id, name)
        return got

    # -- notes and branches ------------------------------------------------------------
    def note(
        self,
        *,
        goal: str | None = None,
        done: tuple[str, ...] | list[str] | None = None,
        next: tuple[str, ...] | list[str] | None = None,
        ruled_out: tuple[str, ...] | list[str] | None = None,
    ) -> Handoff:
        """Update the handoff note (kept atomically with this step's checkpoint)."""
        h = self.handoff
        self.handoff = Handoff(
            goal=h.goal if goal is None else goal,
            done=h.done if done is None else tuple(done),
            next=h.next if next is None else tuple(next),
            ruled_out=h.ruled_out if ruled_out is None else tuple(ruled_out),
        )
        return self.handoff

    def parallel(
        self,
        branches: Mapping[str, Callable[[BranchContext], T]],
        *,
        max_workers: int | None = None,
    ) -> dict[str, T]:
        """Run branches concurrently (threads); each finished branch's output is recorded
        as it completes.

        When a branch fails, the others still finish and record; the first error is
        raised after all have stopped. A resume of the step replays the recorded outputs
        and runs only the unfinished branches. Effects inside a branch are keyed by the
        branch's own position: the step visit, which ``parallel`` call of the step this
        is (a step may call it more than once, with names in common), and the branch's
        name. The set of branch names is part of the step's recorded history: a resume
        (after a deploy) that asks for other branches stops with
        :class:`~onceonly.errors.BranchesDiverged` before any branch runs.

        Returns:
            Each branch's output (codec-encodable), by branch name.

        Raises:
            BranchesDiverged: The branch names differ from the ones this call recorded.
        """
        if not branches:
            return {}
        pos = self._pos
        base, memo_step = self._branch_call(sorted(branches))

        def run(name: str, fn: Callable[[BranchContext], T]) -> T:
            bctx = BranchContext(self.ledger, pos, name)
            branch_step = f"{base}/{name}"

            def body() -> T:
                with _branch_scope(self.ledger, pos, branch_step):
                    return fn(bctx)

            # the output is the run's data: erased with the run's
            memo = _read_guard(self.ledger, f"branch:{name}@1", subject=pos.key_run)(body)
            # The memo sits at a position of the run (it belongs to the run: retention
            # keeps it while the run lives), one per call and branch name.
            with step(pos.key_run, memo_step, visit=pos.visit, tenant=pos.tenant):
                return memo()

        workers = max_workers or len(branches)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="branch") as pool:
            futures = {
                name: pool.submit(contextvars.copy_context().run, run, name, fn)
                for name, fn in branches.items()
            }
            concurrent.futures.wait(futures.values())
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            raise errors[0]  # type: ignore[misc]
        return {name: f.result() for name, f in futures.items()}

    def _branch_call(self, names: list[str]) -> tuple[str, str]:
        """Record this ``parallel`` call's branch names (the step's shape) and return the
        position its branches and their memos sit at.

        Raises:
            BranchesDiverged: The call recorded other names.
        """
        pos = self._pos
        call = self._parallel_calls
        self._parallel_calls += 1
        try:
            self.recorded("parallel@1", _branch_set, names)
        except KeyReuseError as exc:
            raise BranchesDiverged(pos.run_id, f"{pos.step}#{pos.visit}", call, names) from exc
        # The first call keeps the positions of releases before calls were numbered.
        base = f"{pos.step}#{pos.visit}" if call == 0 else f"{pos.step}#{pos.visit}.p{call}"
        return base, f"{base}:branches"

    async def aparallel(
        self,
        branches: Mapping[str, Callable[[BranchContext], Awaitable[T]]],
        *,
        max_concurrency: int | None = None,
    ) -> dict[str, T]:
        """:meth:`parallel` for async branches, as asyncio tasks in the step's event loop
        (an ``async def`` step: ``await ctx.aparallel({...})``). The same recording,
        keys and resume: each finished branch's output is recorded as it completes, a
        resume runs only the unfinished ones, other branch names are
        :class:`~onceonly.errors.BranchesDiverged`. When a branch fails, the others still
        finish and record; then the first error is raised. A cancelled step cancels its
        branches: a branch cancelled while it acts leaves that effect in doubt, as a
        kill would.
        """
        if not branches:
            return {}
        base, memo_step = self._branch_call(sorted(branches))
        pos = self._pos
        gate = asyncio.Semaphore(max_concurrency or len(branches))

        async def run(name: str, fn: Callable[[BranchContext], Awaitable[T]]) -> T:
            bctx = BranchContext(self.ledger, pos, name)
            branch_step = f"{base}/{name}"

            async def body() -> T:
                with _branch_scope(self.ledger, pos, branch_step):
                    return await fn(bctx)

            memo = _read_guard(self.ledger, f"branch:{name}@1", subject=pos.key_run)(body)
            async with gate:
                with step(pos.key_run, memo_step, visit=pos.visit, tenant=pos.tenant):
                    return await memo()

        names = list(branches)
        # each task starts in a copy of this context (the fence, the step's position)
        outs = await asyncio.gather(
            *(run(name, branches[name]) for name in names), return_exceptions=True
        )
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        return dict(zip(names, outs, strict=True))  # type: ignore[arg-type]


def _branch_scope(ledger: Ledger, pos: _Position, branch_step: str) -> Any:
    """The position a branch's effects are keyed at, with what an earlier attempt of the
    branch recorded (in its order)."""
    return step(
        pos.key_run,
        branch_step,
        visit=pos.visit,
        tenant=pos.tenant,
        recorded=_recorded_keys(ledger, pos.key_run, branch_step),
    )


def _branch_set(names: list[str]) -> list[str]:
    """The recorded shape of a ``parallel`` call: its branch names."""
    return names


class BranchContext(_Recording):
    """What a branch of :meth:`StepContext.parallel` sees: its name and the ledger (its
    guarded effects and recorded reads are keyed by the branch's position)."""

    def __init__(self, ledger: Ledger, position: _Position, name: str) -> None:
        self.ledger = ledger
        self._pos = position
        self.name = name
        self.run_id = position.run_id


def _recorded_keys(ledger: Ledger, key_run: str, step_id: str) -> list[str]:
    """Key ids an earlier attempt of ``step_id`` recorded, in the order it asked.

    The order is the order of their ``claimed`` events in the run's audit chain: creation
    times tie (a coarse or test clock) and can step backwards (NTP), and a wrong order
    would make a correct resume look diverged. An entry with no event in the run's chain
    (an explicit key another run claimed first, then this one again: its events stay in
    that run's chain) goes last: explicit keys match a recorded entry in any position,
    positional ones only the first one pending.
    """
    rows = ledger.effects(run_id=key_run, step_id=step_id)
    if len(rows) < 2:
        return [r.key_id for r in rows]
    first: dict[str, int] = {}
    for event in ledger.audit_events(key_run, key_ids=[r.key_id for r in rows]):
        first.setdefault(str(event["key_id"]), int(event["seq"]))
    rows.sort(key=lambda r: (first.get(r.key_id, sys.maxsize), r.created_at, r.key_id))
    return [r.key_id for r in rows]
