"""The runtime: start runs, run their steps, suspend them on waits, resume them anywhere.

One step at a time: load the run's latest checkpoint (migrating older state), run the
step inside :func:`adapters.step` so every guarded effect is keyed by the run's position
(run, ``step#visit``, effect, ordinal), and save the step's changes together with the next
step, the status and the handoff note in one checkpoint. A crash anywhere before that
checkpoint leaves the step to run again: its recorded effects replay (they never act
again), and a step whose effects no longer match what its earlier attempt recorded stops
with :class:`adapters.StepDiverged` before acting.

Bookkeeping lives in the reserved state channel ``_onceonly``: how often each step
completed (its *visit*, part of every effect key), the wait the run is in, what settled
waits brought, the key space (a fork shares its origin's so it never re-fires an effect
the ledger holds), who started the run, and the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import inspect
import logging
import os
import re
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import trace

from onceonly.adapters import StepDiverged, step
from onceonly.checkpoint import (
    ENDED,
    CodecError,
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    Durability,
    Handoff,
    LeaseHeld,
    Run,
    RunExists,
    RunStatus,
    Store,
    StoreError,
    Wait,
    WaitKind,
    WaitNotFound,
    WaitRefused,
    Waits,
    WaitStatus,
    notify_ready,
)
from onceonly.checkpoint.failpoints import failpoint
from onceonly.ledger import (
    EffectInDoubt,
    EffectInFlight,
    EffectStatus,
    KeyReuseError,
    LeaseLost,
    Ledger,
    LedgerError,
    LedgerUnavailable,
    RunFence,
    RunFenced,
    run_fence,
)

from .context import StepContext, _Position, _recorded_keys
from .errors import (
    ApprovalMismatch,
    DeadlineExceeded,
    FlowNotRegistered,
    ForkDiverged,
    StepTimedOut,
    VersionNotServed,
)
from .flow import (
    End,
    Fail,
    Flow,
    Next,
    StepRetry,
    Transition,
    WaitFor,
    _check_seconds,
    durability_mode,
    flow_map,
)

__all__ = ["DEADLINE_WAIT", "META", "Runtime", "default_owner"]

META = "_onceonly"
"""The reserved state channel holding the runtime's bookkeeping."""
DEADLINE_WAIT = "deadline.run"
"""The timer that wakes a waiting run at its deadline (opened with the run)."""

_VISIT = re.compile(r"\d+")
log = logging.getLogger("onceonly.runtime")
_TRACEBACK_CHARS = 8000


def _error_record(name: str, exc: BaseException, *, attempt: int | None = None) -> dict[str, Any]:
    """What the run keeps of a step's error: its type, message and traceback (the end of
    it, where the error was raised), and the attempt it ended."""
    tb = "".join(traceback.format_exception(exc))
    record: dict[str, Any] = {
        "step": name,
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "traceback": tb[-_TRACEBACK_CHARS:],
    }
    if attempt is not None:
        record["attempt"] = attempt
    return record


"""The visit at the head of what follows a step name's ``#`` in an effect's step id."""
_IN_DOUBT = (EffectStatus.UNKNOWN, EffectStatus.NEEDS_HUMAN, EffectStatus.CLAIMED)
_tracer = trace.get_tracer("onceonly.runtime")


class _AsyncTimeUp(Exception):
    """An async step was still running when its time was up: it was cancelled."""


def _run_coroutine(
    fn: Callable[[StepContext], Any],
    ctx: StepContext,
    time_up: float | None,
    clock: Callable[[], float],
) -> Any:
    """Run an ``async def`` step to its transition on an event loop of its own, in this
    thread's context (the run fence and the step's position reach its guarded calls).
    With a time limit the step is cancelled when the time is up (an effect it was
    sending is left in doubt, as a kill would leave it) and :class:`_AsyncTimeUp` is
    raised. Called from a thread whose event loop is running (``drive`` in async code),
    the step runs on a loop of its own in a helper thread."""

    async def main() -> Any:
        task = asyncio.ensure_future(fn(ctx))
        if time_up is None:
            return await task
        done, _ = await asyncio.wait({task}, timeout=max(time_up - clock(), 0.0))
        if done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # it stops at its next await; what it returns is dropped
        raise _AsyncTimeUp

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    here = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onceonly-step") as pool:
        return pool.submit(here.run, asyncio.run, main()).result()


class _TryLater(Exception):
    """The step cannot go on now (another worker's live claim); try again at ``until``."""

    def __init__(self, until: float) -> None:
        super().__init__(f"try again at {until:.3f}")
        self.until = until


def default_owner() -> str:
    """This process's worker identity: ``host:$ONCEONLY_WORKER_NAME`` when that is set
    (stable across restarts), else ``host:pid``.

    A restarted worker with the same owner finds its predecessor's unfinished claims in
    doubt at once instead of waiting for their leases to lapse, so a stable name must
    belong to one live process at a time: two live workers sharing a name would take
    each other's live claims for a dead predecessor's. Without a configured name every
    process gets its own.
    """
    name = os.environ.get("ONCEONLY_WORKER_NAME") or str(os.getpid())
    return f"{socket.gethostname()}:{name}"


class Runtime:
    """Runs flows on a store and its effects ledger.

    Args:
        store: The checkpoint store.
        ledger: The effects ledger on the same store.
        flows: The flows this process can run.
        owner: This process's worker identity (leases, effect claims).
        lease_s: How long a run's lease lasts without renewal.
        clock: Current UNIX time.
    """

    def __init__(
        self,
        store: Store,
        ledger: Ledger,
        flows: Iterable[Flow],
        *,
        owner: str | None = None,
        lease_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ledger.store is not store:
            raise ConfigurationError("the runtime's ledger must sit on the same store")
        self.store = store
        self.ledger = ledger
        self.flows = flow_map(flows)
        self.owner = owner or default_owner()
        self.lease_s = lease_s
        self.clock = clock
        self.waits = Waits(store, clock=clock)

    # -- starting ----------------------------------------------------------------------
    def start(
        self,
        flow: str,
        state: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        started_by: str | None = None,
        handoff: Handoff | None = None,
        deadline_s: float | None = None,
        durability: Durability | str | None = None,
    ) -> str:
        """Start a run of ``flow`` with its initial ``state``; a worker (or :meth:`drive`)
        runs it. Idempotent by ``run_id``: starting an existing run returns it unchanged.

        ``deadline_s`` (default: the flow's): how long the run may take. When it passes,
        running or waiting, the run leaves what it was doing (an open approval or
        signal is cancelled, a step still running claims nothing more and is dropped)
        and goes to the flow's ``on_deadline`` step, or fails with ``DeadlineExceeded``.

        ``durability`` (default: the flow's, else the store's): when the run's
        checkpoints become durable, whichever process drives it. Runs of every mode
        share one store and one worker; in each, a checkpoint is durable before the next
        effect is claimed (the first one before this returns).

        Returns:
            The run id.
        """
        f = self._flow("", flow)
        initial = dict(state or {})
        if META in initial:
            raise ConfigurationError(f"the state channel {META!r} is reserved")
        rid = run_id or uuid.uuid4().hex
        initial[META] = {
            "visits": {},
            "waiting": None,
            "waits": {},
            "key_run": rid,
            "started_by": started_by,
            "next": f.start,
            "note": (handoff or Handoff()).to_doc(),
        }
        _check_seconds("deadline_s", deadline_s)
        mode = durability_mode(durability) or f.durability
        if mode is not None:
            initial[META]["durability"] = mode.value
        limit = deadline_s if deadline_s is not None else f.deadline_s
        also = None
        if limit is not None:
            at = self.clock() + float(limit)
            initial[META]["deadline"] = {"at": at, "s": float(limit), "then": f.on_deadline}
            # the timer that wakes the run at its deadline if it is waiting then, written
            # with the run (a run never exists without it)
            also = self.waits.opening(
                rid, DEADLINE_WAIT, WaitKind.TIMER, due_at=at, opened_by=DEADLINE_WAIT
            )
        try:
            # The run and its first checkpoint in one transaction: a state the codec
            # cannot encode fails here with nothing written, and no worker ever sees a
            # run without state.
            self.store.start_run(
                f.name,
                initial,
                run_id=rid,
                code_version=f.version,
                state_version=f.state_version,
                next_step=f.start,
                handoff=handoff,
                status=RunStatus.RUNNING,
                also=also,
            )
        except RunExists:
            if self.store.get_run(rid).head_seq is None:
                # Created by an earlier release that wrote the run and its first
                # checkpoint apart: finish its start (only ever the first checkpoint).
                with contextlib.suppress(ConcurrentWrite):
                    self.store.save(
                        rid,
                        initial,
                        step="start",
                        next_step=f.start,
                        status=RunStatus.RUNNING,
                        parent=-1,
                        durability=Durability.SYNC,  # a lost race is raised here
                    )
            return rid
        self.store.transact(lambda cur: notify_ready(cur, self.store.dialect))
        return rid

    # -- running -----------------------------------------------------------------------
    def drive(
        self,
        run_id: str,
        *,
        max_steps: int | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Run:
        """Run steps of ``run_id`` until it waits, ends, fails or ``should_stop()``;
        holds the run's lease meanwhile.

        Raises:
            LeaseHeld: Another worker holds the run.
            LedgerUnavailable / StoreError: The database failed (fail closed: the
                worker should stop; the next start recovers from disk).
        """
        self.store.acquire_lease(run_id, self.owner, self.lease_s)
        hold_until: float | None = None
        try:
            if not self.ledger.prefetched(run_id):
                # once per process and run: a resume after a wait reads only what is new
                self.ledger.prefetch(run_id)
            done = 0
            while not should_stop() and (max_steps is None or done < max_steps):
                try:
                    if not self.step_once(run_id):
                        break
                except _TryLater as later:
                    hold_until = later.until
                    break
                done += 1
        finally:
            # On a database error the lease lapses on its own; the original error matters.
            with contextlib.suppress(StoreError):
                # The run suspends or exits here: what this process queued (async / exit
                # durability) is durable before another worker may take the run.
                self.store.flush()
                if hold_until is None:
                    self.store.release_lease(run_id, self.owner)
                else:
                    # Park the run until the other claim lapses, under a name that is not
                    # ours (our own lease counts as free to us), so no worker spins on it.
                    ttl = max(
                        hold_until - self.clock(), 0.5
                    )  # the claim's expiry: the ledger's clock
                    self.store.release_lease(run_id, self.owner)
                    with contextlib.suppress(LeaseHeld):  # another worker took it: fine
                        self.store.acquire_lease(run_id, f"{self.owner}:deferred", ttl)
        return self.store.get_run(run_id)

    def step_once(self, run_id: str) -> bool:
        """Run the run's next step (or settle its wait). Returns whether more is ready.

        The run row and its head checkpoint are read as one snapshot (one source for the
        status, the next step and the visits, in every durability mode), and every
        effect the step claims is fenced on that snapshot: if the run is cancelled, or
        another writer advances it, or another worker takes its lease while the step
        runs, its next claim is refused before anything is sent and the step's work is
        dropped.
        """
        # A report that this run's queued (async) checkpoints lost to another writer (an
        # operator's action, another worker) is read past: their steps' work was
        # dropped, as when a sync checkpoint loses; the step runs again on the head that
        # stands.
        run, snap = self.store.load_run(run_id, report_lost=False)
        if run.status in ENDED or snap is None:
            return False
        flow = self._flow(run_id, run.flow, run.code_version)
        mig = flow.migrations
        if mig is not None and snap.info.schema_version != mig.current:
            try:
                run, snap = self.store.load_run(run_id, migrations=mig)
            except ConcurrentWrite:
                return True  # another writer advanced the run: look again
            if run.status in ENDED or snap is None:
                return False
        state = snap.state
        meta = dict(state.pop(META, None) or {})
        parent = snap.info.seq
        deadline = self._deadline(meta)
        if deadline is not None and self.clock() >= deadline:
            return self._deadline_passed(run, meta, parent)
        if meta.get("waiting"):
            return self._settle_wait(run, state, meta, parent)
        if run.status is not RunStatus.RUNNING:
            return False
        fence = RunFence(run_id, snap.info.seq, snap.info.digest, owner=self.owner)
        if run.next_step is None:
            # Running with nothing to run (a run retried after it failed at a wait): fail
            # it again rather than let workers claim it forever.
            meta["error"] = {
                "step": None,
                "type": "NothingToRun",
                "message": "the run has no next step; fork it from an earlier checkpoint",
            }
            self._save_meta(
                run,
                "nothing-to-run",
                meta,
                None,
                RunStatus.FAILED,
                parent=parent,
            )
            return False
        return self._run_step(run, flow, state, meta, parent, fence)

    def _run_step(
        self,
        run: Run,
        flow: Flow,
        state: dict[str, Any],
        meta: dict[str, Any],
        parent: int,
        fence: RunFence,
    ) -> bool:
        failpoint("runtime.step.before")
        name = str(run.next_step)
        fn = flow.get(name)
        visits = dict(meta.get("visits") or {})
        visit = int(visits.get(name, 0))
        key_run = str(meta.get("key_run") or run.run_id)
        if key_run != run.run_id:
            self._check_link(run.run_id, key_run)
        step_id = f"{name}#{visit}"
        pos = _Position(run.run_id, key_run, name, visit, flow.tenant)
        limit = flow.timeouts.get(name)
        ends = [self.clock() + limit.seconds] if limit is not None else []
        run_deadline = self._deadline(meta)
        if run_deadline is not None:
            ends.append(run_deadline)
        time_up = min(ends) if ends else None
        if time_up is not None:
            # no effect is claimed for this attempt once its time is up
            fence = dataclasses.replace(fence, deadline=time_up, clock=self.clock)
        ctx = StepContext(
            store=self.store,
            ledger=self.ledger,
            flow=flow.name,
            position=pos,
            state=dict(state),
            handoff=run.handoff,
            waits=meta.get("waits") or {},
            started_by=meta.get("started_by"),
            clock=self.clock,
            deadline=time_up,
            version=run.code_version,
            flow_version=flow.version,
        )
        with _tracer.start_as_current_span(f"step {flow.name}.{name}") as span:
            span.set_attribute("onceonly.run_id", run.run_id)
            span.set_attribute("onceonly.step.visit", visit)
            recorded = _recorded_keys(self.ledger, key_run, step_id)
            span.set_attribute("onceonly.step.resumed", bool(recorded))
            try:
                if not recorded and (key_run != run.run_id or self.store.shares_keys(key_run)):
                    self._check_key_space(run.run_id, step_id, flow, key_run, visits, meta)
                with (
                    run_fence(fence),
                    step(key_run, step_id, visit=visit, tenant=flow.tenant, recorded=recorded),
                ):
                    if inspect.iscoroutinefunction(fn):
                        transition = _run_coroutine(fn, ctx, time_up, self.clock)
                    else:
                        transition = fn(ctx)
            except _AsyncTimeUp:
                return self._time_up(run, flow, meta, name, visit, parent)
            except (LedgerUnavailable, StoreError):
                raise  # fail closed: nothing more is acted on by this worker
            except RunFenced as fenced:
                # The run moved on under the step (cancelled, edited, taken by another
                # worker): nothing of the step is kept; a moved run is looked at again.
                span.set_attribute("onceonly.step.fenced", fenced.reason)
                if fenced.reason == "deadline":
                    return self._time_up(run, flow, meta, name, visit, parent)
                return fenced.reason == "moved"
            except EffectInDoubt as doubt:
                return self._park_in_doubt(run, meta, doubt, parent)
            except EffectInFlight as busy:
                # Another worker's claim on this effect is still live (a predecessor with
                # another owner name that died): nothing of the step is kept, and the run
                # is tried again when that claim lapses (then it is in doubt, and settled).
                raise _TryLater(busy.expires_at) from busy
            except LeaseLost as lost:
                raise _TryLater(time.time() + 1.0) from lost
            except (StepDiverged, KeyReuseError, ApprovalMismatch, LedgerError) as exc:
                return self._fail(run, meta, name, exc, parent)
            except Exception as exc:  # noqa: BLE001  (a step's own error fails the run)
                if time_up is not None and self.clock() >= time_up:
                    # out of time (a refused claim the step's code caught and turned
                    # into another error, or an error after the time was up)
                    return self._time_up(run, flow, meta, name, visit, parent)
                policy = flow.retries.get(name)
                if policy is not None and policy.retries(exc):
                    return self._retry_later(run, meta, name, visit, exc, parent, policy)
                return self._fail(run, meta, name, exc, parent)
        if time_up is not None and self.clock() >= time_up:
            # returned late: what it returned is dropped (its effects stay recorded)
            return self._time_up(run, flow, meta, name, visit, parent)
        if isinstance(transition, Fail):
            # Like an error: the step's changes are dropped and the visit is not counted,
            # so a retry runs the same visit again and its effects replay.
            meta["error"] = {"step": name, "type": "Fail", "message": transition.reason}
            self._save_meta(
                run,
                f"{name}:failed",
                meta,
                name,
                RunStatus.FAILED,
                parent=parent,
                handoff=ctx.handoff,
            )
            return False
        done = dict(meta)
        done["visits"] = {**visits, name: visit + 1}
        # the visit succeeded: its retry bookkeeping is done with
        failed = dict(done.get("attempts") or {})
        if failed.pop(step_id, None) is not None:
            done["attempts"] = failed
            done.pop("retry", None)
            done.pop("last_error", None)
        try:
            return self._transition(run, flow, step_id, ctx, done, transition, parent)
        except (ConfigurationError, WaitRefused, CodecError) as exc:
            # The step's code asked for something impossible (a missing step, a wait name
            # reused for another kind or subject, an unencodable value): nothing of the
            # step is kept and the run fails for a person to look at.
            return self._fail(run, meta, name, exc, parent)

    def _transition(
        self,
        run: Run,
        flow: Flow,
        step_id: str,
        ctx: StepContext,
        meta: dict[str, Any],
        t: Transition,
        parent: int,
    ) -> bool:
        name = step_id.rpartition("#")[0]
        state = dict(ctx.state)
        if isinstance(t, Next):
            flow.get(t.step)  # a typo fails here, before the checkpoint
            meta["next"] = t.step
            return self._save(
                run, name, state, meta, t.step, RunStatus.RUNNING, ctx.handoff, parent=parent
            )
        if isinstance(t, End):
            state["result"] = t.result
            meta["next"] = None
            self._save(
                run, name, state, meta, None, RunStatus.COMPLETED, ctx.handoff, parent=parent
            )
            return False
        if isinstance(t, WaitFor):
            flow.get(t.then)
            for other in (t.on_reject, t.on_expire):
                if other is not None:
                    flow.get(other)
            # The wait belongs to this step visit: a loop's next pass that waits under the
            # same name gets a new, undecided wait (never this one's decision).
            wait = self.waits.open(
                run.run_id,
                t.name,
                t.kind,
                due_at=t.due_at,
                subject=t.subject,
                requested_by=t.requested_by,
                allow_self=t.allow_self,
                opened_by=step_id,
            )
            meta["waiting"] = {
                "name": t.name,
                "instance": wait.instance,
                "kind": t.kind,
                "then": t.then,
                "on_reject": t.on_reject,
                "on_expire": t.on_expire,
            }
            meta["next"] = t.then
            if not self._save(
                run, name, state, meta, t.then, RunStatus.WAITING, ctx.handoff, parent=parent
            ):
                self._drop_orphan_wait(run.run_id)
                return False
            # A decision that landed between opening the wait and saving the checkpoint
            # found the run still running: wake it here.
            return self.waits.wake_if_settled(run.run_id, t.name, wait.instance)
        raise ConfigurationError(
            f"step {name!r} of flow {flow.name!r} returned {t!r}; return ctx.next(...), "
            f"ctx.end(), ctx.fail(...) or a ctx.wait_for_*/sleep(...) transition"
        )

    def _settle_wait(
        self, run: Run, state: dict[str, Any], meta: dict[str, Any], parent: int
    ) -> bool:
        waiting = dict(meta["waiting"])
        name = str(waiting["name"])
        instance = waiting.get("instance")  # None: a checkpoint of an earlier release
        wait = self.waits.fire_if_due(run.run_id, name, instance)
        if not wait.settled:
            if run.status is RunStatus.RUNNING:  # woken for something else: wait again
                try:
                    # Only from the snapshot this decision was made on: an operator's
                    # cancel or edit since then stands.
                    self.store.update_run(
                        run.run_id,
                        status=RunStatus.WAITING,
                        expect_status=RunStatus.RUNNING,
                        expect_head=parent,
                    )
                except ConcurrentWrite:
                    return True
                return self.waits.wake_if_settled(run.run_id, name, wait.instance)
            return False
        nxt, status = self._after(wait, waiting)
        record: dict[str, Any] = {
            "kind": wait.kind.value,
            "status": wait.status.value,
            "by": wait.decided_by,
            "at": wait.decided_at,
            "reason": wait.reason,
        }
        if wait.kind is WaitKind.SIGNAL:
            record["payload"] = wait.payload
        if wait.kind is WaitKind.APPROVAL:
            record["subject_hash"] = wait.subject_hash
            if wait.status is WaitStatus.APPROVED:
                # what was approved (an approver may have edited it): ctx.approved(name)
                record["subject"] = wait.subject
        waits = dict(meta.get("waits") or {})
        waits[name] = record
        meta["waits"] = waits
        meta["waiting"] = None
        meta["next"] = nxt
        if status is RunStatus.FAILED:
            meta["error"] = {"step": f"wait:{name}", "type": "Wait", "message": wait.status.value}
        ok = self._save(run, f"wait:{name}", state, meta, nxt, status, run.handoff, parent=parent)
        return ok and status is RunStatus.RUNNING

    def _drop_orphan_wait(self, run_id: str) -> None:
        """The step's checkpoint was refused (another writer advanced the run): if that
        writer ended the run (a cancel), close the wait the step opened, so no inbox
        shows a request nobody will act on."""
        with contextlib.suppress(StoreError):
            if self.store.get_run(run_id).status in ENDED:
                self.waits.cancel_open(run_id, actor=self.owner, reason="the run ended")

    @staticmethod
    def _after(wait: Wait, waiting: Mapping[str, Any]) -> tuple[str | None, RunStatus]:
        if wait.status in (WaitStatus.APPROVED, WaitStatus.DELIVERED, WaitStatus.FIRED):
            return str(waiting["then"]), RunStatus.RUNNING
        if wait.status is WaitStatus.CANCELLED:
            return None, RunStatus.CANCELLED
        other = waiting.get("on_reject" if wait.status is WaitStatus.REJECTED else "on_expire")
        if other:
            return str(other), RunStatus.RUNNING
        return None, RunStatus.FAILED

    def _park_in_doubt(
        self, run: Run, meta: dict[str, Any], doubt: EffectInDoubt, parent: int
    ) -> bool:
        """An effect needs a human: the run waits (holding nothing) until an operator
        resolves it (:meth:`Operator.resolve` signals the run), then re-runs the step."""
        key_id = str(doubt.key_id)
        record = self.ledger.get(key_id)
        if record.status not in _IN_DOUBT:
            # Settled already (the guard's probe proved it did not happen, or it was
            # resolved): run the step again rather than park. Parking first and
            # signalling after would leave the run waiting forever if this worker died
            # in between (nobody else signals an effect that is no longer in doubt).
            return True
        base = f"effect:{key_id[:16]}:{record.epoch}"
        name, n = base, 1
        while self.waits.open(run.run_id, name, WaitKind.SIGNAL).settled:
            if record.status not in _IN_DOUBT:
                break
            # Its wait was signalled without the effect being resolved (by hand): wait
            # again under a new name, or the run would wake, re-run and park in a loop.
            n += 1
            name = f"{base}.{n}"
        step_name = str(run.next_step)
        meta["waiting"] = {
            "name": name,
            "kind": "signal",
            "then": step_name,
            "effect": doubt.key_id,
        }
        meta["next"] = step_name
        if not self._save_meta(
            run,
            f"{step_name}:in-doubt",
            meta,
            step_name,
            RunStatus.WAITING,
            parent=parent,
        ):
            return False
        if self.ledger.get(key_id).status not in _IN_DOUBT:
            # Resolved between the step's failure and the open wait: Operator.resolve found
            # no wait to signal, so settle it here or the run would wait forever.
            with contextlib.suppress(WaitRefused):
                self.waits.signal(run.run_id, name, {"resolved": key_id}, actor=self.owner)
        return self.waits.wake_if_settled(run.run_id, name)

    def _check_link(self, run_id: str, key_run: str) -> None:
        """A fork acts only while its link row names the run whose effect keys its
        sealed checkpoint says it shares: retention keeps that run, and the effects the
        fork replays, only through the link. Without it (deleted or edited) retention
        could remove the effects and the fork would make them again.

        Raises:
            CorruptRecord: The link row is missing or names another run (nothing was
                acted on; the worker skips the run).
        """
        linked = self.store.key_run_of(run_id)
        if linked != key_run:
            found = "missing" if linked is None else f"names run {linked!r}"
            raise CorruptRecord(
                f"its checkpoint says it shares the effect keys of run {key_run!r} (a "
                f"fork), but its link row to that run is {found}: retention keeps the "
                f"effects a fork replays only through that row. Nothing was acted on; "
                f"put the row (run_id, key_run) = ({run_id!r}, {key_run!r}) back in "
                f"oo_run_links",
                run_id=run_id,
            )

    def _check_key_space(
        self,
        run_id: str,
        step_id: str,
        flow: Flow,
        key_run: str,
        visits: Mapping[str, Any],
        meta: Mapping[str, Any],
    ) -> None:
        """Before a run whose effect keys other runs share (a fork, its origin, their
        other forks) runs a step with nothing recorded: no run of the key space made
        effects at a visit of a step this run has not passed yet, and that the deployed
        flow has lost. Effect keys name their step: a deploy that renamed it would send
        those effects again under the new name.

        Visits this run passed (the visit counts of its checkpoint, inherited by a fork
        from its fork point) are behind it and never run again, whatever the code now
        calls them.

        Raises:
            ForkDiverged: Some run of the key space did.
        """
        lost: set[str] = set()
        for r in self.ledger.effects(run_id=key_run):
            name, _, rest = (r.step_id or "").partition("#")
            if not name or name in flow.steps or ":" in name:
                continue  # (an operator's record, ``operator:upgrade#N``, is no step)
            digits = _VISIT.match(rest)
            if digits is None or int(digits.group()) >= int(visits.get(name, 0)):
                lost.add(name)
        if lost:
            origin = str((meta.get("forked_from") or {}).get("run") or key_run)
            raise ForkDiverged(run_id, step_id, origin, sorted(lost))

    @staticmethod
    def _deadline(meta: Mapping[str, Any]) -> float | None:
        """The run's deadline while it has not passed (UNIX seconds), else None."""
        d = meta.get("deadline")
        if not d or d.get("passed"):
            return None
        return float(d["at"])

    def _deadline_passed(self, run: Run, meta: dict[str, Any], parent: int) -> bool:
        """The run's deadline came: leave what it waits for (its open waits are
        cancelled, so nobody decides a request the run no longer waits for) and go to
        the flow's ``on_deadline`` step, or fail. Idempotent: a crash before the
        checkpoint does it again."""
        d = dict(meta["deadline"])
        with contextlib.suppress(WaitNotFound):  # a fork or restart carries no timer
            self.waits.fire_if_due(run.run_id, DEADLINE_WAIT)
        self.waits.cancel_open(run.run_id, actor="deadline", reason="the run's deadline passed")
        meta["deadline"] = {**d, "passed": True}
        meta["waiting"] = None
        meta.pop("retry", None)
        then = d.get("then")
        exc = DeadlineExceeded(run.run_id, float(d["at"]))
        if then:
            meta["next"] = then
            meta["last_error"] = _error_record(str(run.next_step), exc)
            log.warning(
                "run %s passed its deadline; going on at step %s",
                run.run_id,
                then,
                extra={"event": "run_deadline", "run_id": run.run_id, "step": then},
            )
            return self._save_meta(
                run,
                "deadline",
                meta,
                str(then),
                RunStatus.RUNNING,
                parent=parent,
            )
        meta["error"] = _error_record(str(run.next_step), exc)
        log.error(
            "run %s failed: it passed its deadline",
            run.run_id,
            extra={"event": "run_failed", "run_id": run.run_id, "step": run.next_step},
        )
        self._save_meta(
            run,
            "deadline",
            meta,
            run.next_step,
            RunStatus.FAILED,
            parent=parent,
        )
        return False

    def _time_up(
        self,
        run: Run,
        flow: Flow,
        meta: dict[str, Any],
        name: str,
        visit: int,
        parent: int,
    ) -> bool:
        """A step attempt ran out of time: the run's deadline (its path), or the step's
        timeout (a failed attempt: retried by the step's policy while attempts remain,
        then the step's ``on_timeout`` path, or the run fails). Nothing the attempt did
        to the state is kept; its effects stay recorded and replay if the step runs
        again."""
        run_deadline = self._deadline(meta)
        limit = flow.timeouts.get(name)
        if limit is None or (run_deadline is not None and self.clock() >= run_deadline):
            return self._deadline_passed(run, meta, parent)
        exc = StepTimedOut(run.run_id, name, limit.seconds)
        step_id = f"{name}#{visit}"
        policy = flow.retries.get(name)
        failed = int(dict(meta.get("attempts") or {}).get(step_id, 0)) + 1
        if policy is not None and policy.retries(exc) and failed < policy.attempts:
            return self._retry_later(run, meta, name, visit, exc, parent, policy)
        if limit.then is None:
            if policy is not None:
                meta["attempts"] = {**dict(meta.get("attempts") or {}), step_id: failed}
                meta.pop("retry", None)
                meta.pop("last_error", None)
            return self._fail(
                run, meta, name, exc, parent, attempt=failed if policy is not None else None
            )
        attempts = dict(meta.get("attempts") or {})
        attempts.pop(step_id, None)
        meta["attempts"] = attempts
        meta.pop("retry", None)
        meta["last_error"] = _error_record(name, exc, attempt=failed)
        meta["next"] = limit.then
        log.warning(
            "run %s: step %s timed out after %g s; going on at step %s",
            run.run_id,
            name,
            limit.seconds,
            limit.then,
            extra={"event": "step_timeout", "run_id": run.run_id, "step": name},
        )
        return self._save_meta(
            run,
            f"{name}:timeout",
            meta,
            limit.then,
            RunStatus.RUNNING,
            parent=parent,
        )

    def _retry_later(
        self,
        run: Run,
        meta: dict[str, Any],
        name: str,
        visit: int,
        exc: BaseException,
        parent: int,
        policy: StepRetry,
    ) -> bool:
        """A step's attempt raised an error its :class:`StepRetry` retries: wait on a
        timer (holding no process), then run the same visit again; its recorded effects
        replay. After the last attempt, fail the run. Nothing the step did to the state
        is kept."""
        step_id = f"{name}#{visit}"
        attempts = dict(meta.get("attempts") or {})
        failed = int(attempts.get(step_id, 0)) + 1
        attempts[step_id] = failed
        meta["attempts"] = attempts
        if failed >= policy.attempts:
            meta.pop("retry", None)
            meta.pop("last_error", None)
            return self._fail(run, meta, name, exc, parent, attempt=failed)
        due = self.clock() + policy.pause(failed)
        wait_name = f"retry.{name}.{visit}.{failed}"
        if wait_name in (meta.get("waits") or {}):
            # a fresh set of attempts after an operator's retry: a timer of its own
            wait_name = f"{wait_name}.{parent}"
        wait = self.waits.open(run.run_id, wait_name, WaitKind.TIMER, due_at=due, opened_by=step_id)
        meta["last_error"] = _error_record(name, exc, attempt=failed)
        meta["retry"] = {
            "step": name,
            "visit": visit,
            "failed": failed,
            "attempts": policy.attempts,
            "due_at": due,
            "wait": wait_name,
        }
        meta["waiting"] = {
            "name": wait_name,
            "instance": wait.instance,
            "kind": WaitKind.TIMER.value,
            "then": name,
            "on_reject": None,
            "on_expire": None,
        }
        meta["next"] = name
        log.warning(
            "run %s: step %s failed (attempt %d of %d): %s: %s; retrying in %.1f s",
            run.run_id,
            name,
            failed,
            policy.attempts,
            type(exc).__name__,
            str(exc)[:500],
            due - self.clock(),
            exc_info=exc,
            extra={"event": "step_retry", "run_id": run.run_id, "step": name},
        )
        if not self._save_meta(
            run,
            f"{name}:retry",
            meta,
            name,
            RunStatus.WAITING,
            parent=parent,
        ):
            self._drop_orphan_wait(run.run_id)
            return False
        return self.waits.wake_if_settled(run.run_id, wait_name, wait.instance)

    def _fail(
        self,
        run: Run,
        meta: dict[str, Any],
        name: str,
        exc: BaseException,
        parent: int,
        *,
        attempt: int | None = None,
    ) -> bool:
        """Fail the run at step ``name``: nothing the step did to the state is kept (it
        may have changed values in place), the visit is not counted, and a retry runs
        the same visit again (its recorded effects replay). The error is kept with its
        traceback, and logged."""
        meta["error"] = _error_record(name, exc, attempt=attempt)
        log.error(
            "run %s failed at step %s: %s: %s",
            run.run_id,
            name,
            type(exc).__name__,
            str(exc)[:500],
            exc_info=exc,
            extra={"event": "run_failed", "run_id": run.run_id, "step": name},
        )
        self._save_meta(
            run,
            f"{name}:failed",
            meta,
            run.next_step,
            RunStatus.FAILED,
            parent=parent,
        )
        return False

    def _save_meta(
        self,
        run: Run,
        step_name: str,
        meta: dict[str, Any],
        next_step: str | None,
        status: RunStatus,
        *,
        parent: int,
        handoff: Handoff | None = None,
    ) -> bool:
        """A checkpoint of the runtime's bookkeeping alone (a failed, parked or timed-out
        step, a passed deadline): the state stays as checkpoint ``parent`` has it."""
        return self._save(
            run,
            step_name,
            {},
            meta,
            next_step,
            status,
            run.handoff if handoff is None else handoff,
            parent=parent,
            only_meta=True,
        )

    def _save(
        self,
        run: Run,
        step_name: str,
        state: dict[str, Any],
        meta: dict[str, Any],
        next_step: str | None,
        status: RunStatus,
        handoff: Handoff,
        *,
        parent: int,
        only_meta: bool = False,
    ) -> bool:
        """Checkpoint on top of checkpoint ``parent`` (the one the step started from), or
        return False if another writer advanced the run meanwhile.

        With ``only_meta`` the state is left as the parent has it and only the runtime's
        bookkeeping changes (a failed or parked step: values it changed in place must
        not leak into the checkpoint).
        """
        store = self.store
        # the handoff note as of this checkpoint: kept with it (``Operator.notes`` reads
        # the history); a step's checkpoint diffs the bookkeeping by key (an unchanged
        # note adds no bytes), one of the bookkeeping alone (only_meta) rewrites it whole
        meta["note"] = handoff.to_doc()
        try:
            # A checkpoint of another writer since ``parent`` (another process, or an
            # Operator sharing this Store) is refused by the store as ConcurrentWrite.
            mode = meta.get("durability")  # the run's own, or None: the store's
            if only_meta:
                store.update(
                    run.run_id,
                    step=step_name,
                    set={META: meta},
                    next_step=next_step,
                    status=status,
                    handoff=handoff,
                    parent=parent,
                    durability=mode,
                )
            else:
                state[META] = meta
                store.save(
                    run.run_id,
                    state,
                    step=step_name,
                    next_step=next_step,
                    status=status,
                    handoff=handoff,
                    parent=parent,
                    durability=mode,
                )
        except ConcurrentWrite:
            # An operator (cancel, edit) or another worker advanced the run first; their
            # checkpoint stands and this step's result is dropped (its effects are in the
            # ledger and replay if the step runs again).
            return False
        failpoint("runtime.step.after")
        if status is RunStatus.COMPLETED and self._deadline(meta) is not None:
            # the deadline timer of a run that completed before it: closed, not left open
            # (a failed run keeps it: an operator's retry goes on under the same deadline)
            with contextlib.suppress(StoreError):
                self.waits.cancel_open(run.run_id, actor=self.owner, reason="the run ended")
        return True

    def _flow(self, run_id: str, name: str, version: str | None = None) -> Flow:
        """The flow ``name``; with ``version`` (the run's), only if it drives runs of it.

        Raises:
            FlowNotRegistered: No such flow here.
            VersionNotServed: The flow does not serve the run's version.
        """
        try:
            flow = self.flows[name]
        except KeyError:
            raise FlowNotRegistered(run_id, name) from None
        if version is not None and not flow.drives(version):
            raise VersionNotServed(run_id, name, version, flow.served)
        return flow

    @property
    def served(self) -> dict[str, list[str]]:
        """The flow versions this runtime drives, by flow name (what a worker claims and
        announces)."""
        return {name: sorted(f.served) for name, f in sorted(self.flows.items())}
