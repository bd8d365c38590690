"""The escape hatch: what a person does to a run, as a Python API (the CLI calls it).

Every operation is recorded with the operator's identity in the run's audit chain in
the ledger (an ``operator`` event, hash-chained and sealed with the run's effects'
events: :meth:`Operator.actions`), and where it acts: decisions on the wait row, state
changes as checkpoints with source ``operator`` (with the reason in the run's operator
log), effect resolutions as the effect's own audit event. None of them ever re-fires an
effect the ledger holds as committed.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from onceonly.checkpoint import (
    ENDED,
    CheckpointInfo,
    ConcurrentWrite,
    ConfigurationError,
    Durability,
    Handoff,
    LeaseHeld,
    RetentionPolicy,
    Run,
    RunExists,
    RunStatus,
    Snapshot,
    Source,
    Store,
    StoreError,
    Wait,
    WaitKind,
    WaitRefused,
    Waits,
    notify_ready,
)
from onceonly.ledger import UNKNOWN_RESULT, EffectRecord, Ledger
from onceonly.ledger import RetentionPolicy as EffectRetention

from .deploy import named_steps
from .errors import RunNotResumable, UpgradeRefused
from .flow import Flow
from .runtime import DEADLINE_WAIT, META

_UPGRADE_LEASE_S = 120.0  # the operator's hold on a run it upgrades (released after)

__all__ = ["GcReport", "NoteChange", "Operator", "RunView", "note_history"]

_IN_DOUBT = ("unknown", "needs_human", "claimed")


@dataclass(frozen=True)
class NoteChange:
    """The handoff note as a checkpoint set it.

    Attributes:
        seq: The checkpoint.
        step: What wrote it.
        at: When (UNIX seconds).
        handoff: The note from that checkpoint on.
    """

    seq: int
    step: str
    at: float
    handoff: Handoff


@dataclass(frozen=True)
class RunView:
    """Everything an operator needs to see about a run.

    Attributes:
        run: The run row (status, next step, lease, handoff).
        state: Its latest state (without the runtime's bookkeeping).
        meta: The runtime's bookkeeping (visits, waits, errors, operator log).
        history: Its checkpoints, oldest first.
        waits: Its waits (open and settled).
        effects: Its effects in the ledger.
        actions: The operators' actions in its audit chain (:meth:`Operator.actions`).
    """

    run: Run
    state: dict[str, Any]
    meta: dict[str, Any]
    history: list[CheckpointInfo]
    waits: list[Wait]
    effects: list[EffectRecord]
    actions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class GcReport:
    """What :meth:`Operator.gc` removed."""

    runs_archived: int
    runs_deleted: int
    effects_deleted: int
    blobs_deleted: int
    waits_deleted: int = 0


class Operator:
    """Operator actions on a store's runs.

    Args:
        store: The checkpoint store.
        ledger: The effects ledger on it.
        clock: Current UNIX time.
    """

    def __init__(
        self, store: Store, ledger: Ledger, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.ledger = ledger
        # An operator's writes are sealed like the runtime's (a store of its own gets the
        # ledger's keys).
        store.attach_integrity(ledger.keyring.row_keys())
        self.waits = Waits(store, clock=clock)
        self.clock = clock

    def show(self, run_id: str) -> RunView:
        """The run, its state, history, waits and effects."""
        run = self.store.get_run(run_id)
        state: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        if run.head_seq is not None:
            state = self._load(run_id).state
            meta = dict(state.pop(META, None) or {})
        key_run = str(meta.get("key_run") or run_id)
        return RunView(
            run=run,
            state=state,
            meta=meta,
            history=self.store.history(run_id),
            waits=self.waits.find(run_id=run_id),
            effects=self.ledger.effects(run_id=key_run),
            actions=self.actions(run_id),
        )

    # -- waits -------------------------------------------------------------------------
    def approve(
        self, run_id: str, name: str, *, actor: str, subject_hash: str, reason: str = ""
    ) -> Wait:
        """Approve exactly what was requested (``subject_hash`` from :meth:`show`).

        Raises:
            RunNotFound: No such run (not reported as a missing approval).
            WaitNotFound: The run has no approval of that name.
        """
        self.store.get_run(run_id)
        wait = self.waits.approve(
            run_id, name, actor=actor, subject_hash=subject_hash, reason=reason
        )
        self._record_decision(wait, "approve")
        return wait

    def approve_edited(
        self,
        run_id: str,
        name: str,
        *,
        actor: str,
        subject_hash: str,
        subject: Any,
        reason: str = "",
    ) -> Wait:
        """Edit, then approve: approve ``subject`` instead of what was requested (whose
        hash, ``subject_hash``, the approver saw), as one recorded decision. The step
        after the approval finds the new subject in ``ctx.approved(name)["subject"]``,
        and ``ctx.approved(name, x)`` checks ``x`` against it.

        Raises:
            RunNotFound: No such run.
            WaitNotFound: The run has no approval of that name.
            WaitRefused: As :meth:`approve`.
            CodecError: The new subject cannot be stored.
        """
        self.store.get_run(run_id)
        wait = self.waits.approve_edited(
            run_id, name, actor=actor, subject_hash=subject_hash, subject=subject, reason=reason
        )
        self._record_decision(wait, "approve", {"edited_from": subject_hash})
        return wait

    def reject(self, run_id: str, name: str, *, actor: str, reason: str = "") -> Wait:
        """Reject an approval request.

        Raises:
            RunNotFound: No such run (not reported as a missing approval).
            WaitNotFound: The run has no approval of that name.
        """
        self.store.get_run(run_id)
        wait = self.waits.reject(run_id, name, actor=actor, reason=reason)
        self._record_decision(wait, "reject")
        return wait

    def signal(self, run_id: str, name: str, payload: Any = None, *, actor: str = "") -> Wait:
        """Deliver a signal to a run (kept if it does not wait for it yet).

        Raises:
            RunNotFound: No such run.
        """
        self.store.get_run(run_id)
        return self.waits.signal(run_id, name, payload, actor=actor)

    # -- effects -----------------------------------------------------------------------
    def resolve(
        self,
        key_id: str,
        *,
        happened: bool,
        evidence: str,
        actor: str,
        result: Any = UNKNOWN_RESULT,
    ) -> EffectRecord:
        """Record a person's decision on an in-doubt effect, and wake the run that waits
        for it (it re-runs its step: the effect replays, or is sent if it did not
        happen). Without ``result``, a happened effect's result is unknown (see
        :meth:`ledger.Ledger.resolve`)."""
        record = self.ledger.resolve(
            key_id, happened=happened, evidence=evidence, actor=actor, result=result
        )
        for wait in self.waits.find(status="open"):
            if wait.kind is WaitKind.SIGNAL and wait.name.startswith(f"effect:{key_id[:16]}:"):
                try:
                    self.waits.signal(wait.run_id, wait.name, {"resolved": key_id}, actor=actor)
                except WaitRefused as exc:
                    # Settled since it was found: the run's worker saw the resolution and
                    # signalled its own wait, or the run ended. Either way there is
                    # nothing left to wake, and the decision above is recorded.
                    if exc.reason != "decided":
                        raise
        return record

    # -- state -------------------------------------------------------------------------
    def edit(
        self, run_id: str, channel: str, value: Any, *, actor: str, reason: str
    ) -> CheckpointInfo:
        """Set a state channel (a new checkpoint, source ``operator``; the reason and the
        actor are kept in the run's operator log).

        Raises:
            ConfigurationError: No actor or reason, or the reserved channel.
            ConcurrentWrite: The run advanced meanwhile; look again and retry.
        """
        if not actor.strip() or not reason.strip():
            raise ConfigurationError("an edit needs the operator's identity and a reason")
        if channel == META:
            raise ConfigurationError(f"the channel {META!r} is the runtime's; it is not edited")
        return self._operator_checkpoint(
            run_id, "operator:edit", actor, reason, set_channel=(channel, value)
        )

    def cancel(self, run_id: str, *, actor: str, reason: str = "") -> Run:
        """Cancel a run: its open waits close and no step runs again. A step running now
        finishes the effect it is performing and claims no other: its next claim is
        refused (the run fence), and its checkpoint too.

        A worker's checkpoint that lands first is not an error: the cancel is applied on
        top of it (looked at again, a few times).

        Raises:
            RunNotResumable: The run is completed or cancelled already.
        """

        def cancellable(run: Run) -> None:
            if run.status in (RunStatus.COMPLETED, RunStatus.CANCELLED):
                raise RunNotResumable(run_id, run.status.value, "it cannot be cancelled")

        self.waits.cancel_open(run_id, actor=actor, reason=reason)
        self._operator_checkpoint(
            run_id,
            "operator:cancel",
            actor,
            reason or "cancelled",
            status=RunStatus.CANCELLED,
            expect=cancellable,
            attempts=8,
        )
        # A step that opened a wait after the first sweep has its checkpoint refused;
        # close what it opened.
        self.waits.cancel_open(run_id, actor=actor, reason=reason)
        return self.store.get_run(run_id)

    def retry(self, run_id: str, *, actor: str, reason: str = "") -> Run:
        """Make a failed run ready again at the step that failed (after a fix).

        The step runs again at the same position: effects its failed attempt recorded
        replay (they never act again), so a fix that changes what the step sends stops it
        with a divergence instead of sending something else.

        Raises:
            RunNotResumable: The run is not failed, or it failed on a wait (a rejection
                or an expiry with no step to take): fork it from before the wait.
        """
        run, snap = self._load_run(run_id)
        if run.status is not RunStatus.FAILED or snap is None:
            raise RunNotResumable(run_id, run.status.value, "only a failed run is retried")
        meta = dict(snap.state.get(META) or {})
        error = dict(meta.get("error") or {})
        failed = str(error.get("step") or "")
        visits = dict(meta.get("visits") or {})
        if run.next_step is not None:  # the step raised: it never completed this visit
            nxt = run.next_step
        elif error.get("type") == "Fail" and failed:
            # The step returned ctx.fail(): its visit was counted; run the same visit
            # again so what it recorded replays.
            nxt = failed
            visits[failed] = max(0, int(visits.get(failed, 1)) - 1)
        else:
            raise RunNotResumable(
                run_id,
                run.status.value,
                f"it failed at {failed or 'an unknown point'} and has no step to retry; "
                f"fork it from an earlier checkpoint (`onceonly runs fork`)",
            )
        self._operator_checkpoint(
            run_id,
            "operator:retry",
            actor,
            reason or "retry",
            status=RunStatus.RUNNING,
            next_step=nxt,
            # a fresh set of attempts for a step with a retry policy
            meta_update={"visits": visits, "next": nxt, "attempts": {}},
            parent=snap.info.seq,
        )
        self.store.transact(lambda cur: notify_ready(cur, self.store.dialect))
        return self.store.get_run(run_id)

    def fork(
        self,
        run_id: str,
        seq: int,
        *,
        actor: str,
        reason: str,
        new_run_id: str | None = None,
    ) -> str:
        """Start a new run from checkpoint ``seq`` of ``run_id``.

        The fork uses its origin's effect keys: a step it repeats with the same arguments
        replays the origin's recorded effect (it never re-fires one the ledger holds);
        with other arguments it stops with a divergence, for a person to decide.

        Returns:
            The new run's id.
        """
        if not actor.strip() or not reason.strip():
            raise ConfigurationError("a fork needs the operator's identity and a reason")
        origin = self.store.get_run(run_id)
        snap = self._load(run_id, seq)
        state = snap.state
        meta = dict(state.pop(META, None) or {})
        waiting = meta.get("waiting")
        nxt = meta.get("next")
        if not waiting and not nxt:
            raise ConfigurationError(
                f"checkpoint {seq} of run {run_id!r} has no next step (the run ended or "
                f"failed there); fork from an earlier checkpoint"
            )
        meta["forked_from"] = {"run": run_id, "seq": seq, "by": actor, "reason": reason}
        meta["key_run"] = meta.get("key_run") or run_id
        meta["error"] = None
        new = new_run_id or uuid.uuid4().hex
        # Parked on an in-doubt effect: if it is settled now, the step just runs again
        # (the effect replays, or is sent if it did not happen); else park the fork too.
        if (
            waiting
            and waiting.get("effect")
            and self.ledger.get(str(waiting["effect"])).status.value not in _IN_DOUBT
        ):
            waiting = None
            meta["waiting"] = None
        also = None
        if waiting:  # ask again: a decision of the origin does not carry over
            name = str(waiting["name"])
            old = self.waits.get(run_id, name, waiting.get("instance"))
            due = old.due_at
            if old.kind is WaitKind.APPROVAL and due is not None:
                due = self.clock() + max(0.0, due - old.created_at)  # the same time to decide
            also = self.waits.opening(
                new,
                name,
                old.kind,
                due_at=due,
                subject=old.subject,
                requested_by=old.requested_by,
                allow_self=old.allow_self,
                opened_by=old.opened_by,
            )
            meta["waiting"] = {**waiting, "instance": 0}  # the new run's first of the name
        limit = meta.get("deadline")
        if limit and not limit.get("passed"):
            # the time the run had left at that checkpoint, from now (as an approval's),
            # with a timer of its own that wakes the fork if it waits then
            due = self.clock() + max(0.0, float(limit["at"]) - snap.info.created_at)
            meta["deadline"] = {**limit, "at": due}
            timer = self.waits.opening(
                new, DEADLINE_WAIT, WaitKind.TIMER, due_at=due, opened_by=DEADLINE_WAIT
            )
            also = timer if also is None else _both(also, timer)
        state[META] = meta
        # The run, its first checkpoint, its wait and its link to the key run, in one
        # transaction that also checks the key run still exists (retention keeps it, and
        # its effects, from then on): a fork never re-sends an effect its origin made.
        self.store.start_run(
            origin.flow,
            state,
            run_id=new,
            step="operator:fork",
            code_version=origin.code_version,
            state_version=snap.info.schema_version,
            next_step=nxt,
            handoff=origin.handoff,
            status=RunStatus.WAITING if waiting else RunStatus.RUNNING,
            source=Source.OPERATOR,
            key_run=str(meta["key_run"]),
            also=also,
        )
        self._record(
            new,
            "fork",
            "0",
            {
                "at": self.clock(),
                "by": actor,
                "action": "operator:fork",
                "reason": reason,
                "from": {"run": run_id, "seq": seq},
            },
        )
        if waiting:
            self.waits.wake_if_settled(new, str(waiting["name"]))
        self.store.transact(lambda cur: notify_ready(cur, self.store.dialect))
        return new

    def restart(
        self, run_id: str, *, actor: str, reason: str, new_run_id: str | None = None
    ) -> str:
        """Start the run over, for a plan that was wrong: a new run from the state the
        run began with (its first checkpoint), in a key space of its own, so every effect
        happens again for the new run. The old run's effects stay recorded and visible;
        the old run is cancelled unless it has ended; both say where the other is
        (``restarted_as``, ``restarted_from``). The new run takes the old one's latest
        handoff note (what was ruled out stays ruled out).

        Resume (``retry``) goes on from where a run stopped and replays its effects; a
        fork starts from any checkpoint and shares its origin's keys (it never sends an
        effect the origin made); a restart starts from the beginning and sends again.

        Repeating a restart that was interrupted finishes it (the new run's default id,
        ``RUN.restart-N``, is the same): it never makes two.

        Returns:
            The new run's id.

        Raises:
            ConfigurationError: No actor or reason, or the run began waiting (a fork from
                a wait): fork it from a checkpoint instead.
        """
        if not actor.strip() or not reason.strip():
            raise ConfigurationError("a restart needs the operator's identity and a reason")
        origin, head = self._load_run(run_id)
        done = list(((head.state.get(META) or {}) if head else {}).get("restarted_as") or [])
        first = self._load(run_id, 0)
        state = first.state
        began = dict(state.pop(META, None) or {})
        if began.get("waiting") or not began.get("next"):
            raise ConfigurationError(
                f"run {run_id!r} began waiting (a fork from a wait) or with no step: fork it "
                f"from a checkpoint instead (`onceonly runs fork`)"
            )
        new = new_run_id or f"{run_id}.restart-{len(done) + 1}"
        at = self.clock()
        state[META] = {
            "visits": dict(began.get("visits") or {}),
            "waiting": None,
            "waits": dict(began.get("waits") or {}),
            "key_run": new,  # its own key space: its effects happen again
            "started_by": began.get("started_by"),
            "next": began["next"],
            "restarted_from": {"run": run_id, "by": actor, "reason": reason, "at": at},
            "operator_log": [
                {"at": at, "by": actor, "action": "operator:restart", "reason": reason}
            ],
        }
        if began.get("durability"):
            state[META]["durability"] = began["durability"]  # the mode it was started in
        also = None
        limit = began.get("deadline")
        if limit:
            # a fresh attempt gets the whole time again, and the timer that enforces it
            due = at + float(limit["s"])
            state[META]["deadline"] = {"at": due, "s": float(limit["s"]), "then": limit["then"]}
            also = self.waits.opening(
                new, DEADLINE_WAIT, WaitKind.TIMER, due_at=due, opened_by=DEADLINE_WAIT
            )
        try:
            self.store.start_run(
                origin.flow,
                state,
                run_id=new,
                step="operator:restart",
                code_version=origin.code_version,
                state_version=first.info.schema_version,
                next_step=str(began["next"]),
                handoff=origin.handoff,
                status=RunStatus.RUNNING,
                source=Source.OPERATOR,
                also=also,
            )
        except RunExists:
            # An earlier restart of this run that did not finish: finish it.
            mine = (self._load(new, 0).state.get(META) or {}).get("restarted_from") or {}
            if mine.get("run") != run_id:
                raise
        if new not in done:
            self._mark_restarted(run_id, new, done, actor, reason)
        self.store.transact(lambda cur: notify_ready(cur, self.store.dialect))
        return new

    def _mark_restarted(
        self, run_id: str, new: str, done: list[str], actor: str, reason: str
    ) -> None:
        """Record on the old run that it was restarted as ``new``; cancel it unless it has
        ended (decided on the run as the checkpoint finds it, looked at again if a
        worker's checkpoint lands first)."""
        for _ in range(8):
            ended = self.store.get_run(run_id).status in ENDED

            def unchanged(run: Run, ended: bool = ended) -> None:
                if (run.status in ENDED) != ended:
                    raise ConcurrentWrite(run_id, -1)

            if not ended:
                self.waits.cancel_open(run_id, actor=actor, reason=f"restarted as {new}")
            try:
                self._operator_checkpoint(
                    run_id,
                    "operator:restart",
                    actor,
                    f"restarted as {new}: {reason}",
                    status=None if ended else RunStatus.CANCELLED,
                    meta_update={"restarted_as": [*done, new]},
                    expect=unchanged,
                )
            except ConcurrentWrite:
                continue
            if not ended:  # what a step opened after the first sweep
                self.waits.cancel_open(run_id, actor=actor, reason=f"restarted as {new}")
            return
        # workers kept advancing the run: say at which checkpoint it is now
        raise ConcurrentWrite(run_id, int(self.store.get_run(run_id).head_seq or 0))

    def upgrade(self, run_id: str, flow: Flow, *, actor: str, reason: str) -> Run:
        """Move a run on purpose to ``flow``'s version (the code that is to drive it).

        A run stays on the version that started it; this moves it. Its state is
        upgraded by ``flow.migrations`` (a checkpoint of source ``migration``), and the
        steps it names (its next step, a wait's paths, its deadline's path, the visits
        and attempts counted) take the names ``flow.upgrades`` gives for the run's
        version (unnamed steps keep theirs). Every step it names must exist in
        ``flow``. The move is an operator checkpoint (``operator:upgrade``, with the
        actor, the reason, both versions and the renames in the run's operator log), and
        a record in the run's audit chain in the ledger (``operator.upgrade@1``); then
        the run's version is ``flow.version``. The run is leased to the operator
        meanwhile: no worker drives it halfway.

        A running run whose next step is renamed and has effects recorded at its current
        visit (a step that acted, then stopped) is refused: under its new name the step
        would act again. Let a worker of the run's version finish that step first.

        Repeating an upgrade that was interrupted finishes it; an upgrade to the run's
        own version returns the run unchanged.

        Raises:
            ConfigurationError: No actor or reason.
            UpgradeRefused: Another flow; an ended run; a step it names missing from
                ``flow``; a state version ``flow`` cannot upgrade; a half-done renamed
                step; a worker holds the run. Nothing changed.
        """
        if not actor.strip() or not reason.strip():
            raise ConfigurationError("an upgrade needs the operator's identity and a reason")
        run = self.store.get_run(run_id)
        if run.flow != flow.name:
            raise UpgradeRefused(run_id, f"it is a run of flow {run.flow!r}, not {flow.name!r}")
        if run.code_version == flow.version:
            return run
        if run.status in (RunStatus.COMPLETED, RunStatus.CANCELLED):
            # (a failed run is moved: an operator's retry then goes on under the new code)
            raise UpgradeRefused(run_id, f"it is {run.status.value}: an ended run stays as it was")
        holder = f"operator:{actor}"[:200]
        try:
            self.store.acquire_lease(run_id, holder, _UPGRADE_LEASE_S)
        except LeaseHeld as exc:
            raise UpgradeRefused(
                run_id, f"a worker holds it ({exc}); try again when its step is done"
            ) from exc
        try:
            return self._upgrade(run_id, flow, actor=actor, reason=reason)
        finally:
            with contextlib.suppress(LeaseHeld, StoreError):
                self.store.release_lease(run_id, holder)

    def _upgrade(self, run_id: str, flow: Flow, *, actor: str, reason: str) -> Run:
        run, snap = self._load_run(run_id)
        if snap is None:
            raise UpgradeRefused(run_id, "it has no checkpoint yet")
        old = run.code_version
        meta = dict(snap.state.get(META) or {})
        # what this run's steps are called under ``flow``
        renames = {a: b for a, b in flow.upgrades.get(old, {}).items() if a != b}

        def moved(step: Any) -> Any:
            return renames.get(step, step) if isinstance(step, str) else step

        missing = sorted(
            {
                f"{moved(step)!r} ({where})"
                for step, where in named_steps(run, meta)
                if moved(step) not in flow.steps
            }
        )
        if missing:
            raise UpgradeRefused(
                run_id,
                f"version {flow.version!r} of {flow.name!r} has no step "
                f"{', '.join(missing)}: map it in Flow(upgrades={{{old!r}: {{...}}}})",
            )
        mig = flow.migrations
        have = snap.info.schema_version
        if mig is None and have != flow.state_version:
            raise UpgradeRefused(
                run_id,
                f"its state is version {have} and the code writes version "
                f"{flow.state_version} with no migrations",
            )
        if mig is not None and have > mig.current:
            raise UpgradeRefused(
                run_id, f"its state is version {have}, newer than the code's {mig.current}"
            )
        visits = {str(k): int(v) for k, v in dict(meta.get("visits") or {}).items()}
        nxt = run.next_step
        retry = dict(meta.get("retry") or {})
        # the step visit the run goes on with (a step that failed, stopped or waits for
        # its retry timer): under a new name its recorded effects would not replay
        for step in sorted({str(x) for x in (nxt, retry.get("step")) if x in renames}):
            at = f"{step}#{visits.get(step, 0)}"
            key_run = str(meta.get("key_run") or run_id)
            if any(_at_position(r.step_id, at) for r in self.ledger.effects(run_id=key_run)):
                raise UpgradeRefused(
                    run_id,
                    f"its step {step!r} has effects recorded at visit {visits.get(step, 0)} "
                    f"(it acted, then stopped): as {renames[step]!r} it would act again; "
                    f"let a worker of version {old!r} finish the step first",
                )
        if mig is not None and have != mig.current:
            # a checkpoint of source ``migration`` with the upgraded state
            run, snap = self._load_run(run_id, migrations=mig)
            assert snap is not None
            meta = dict(snap.state.get(META) or {})
        # The renamed visits count from the old ones; the old counts stay (visits passed
        # under the old name are behind the run, whatever the code now calls them).
        for a, b in renames.items():
            if a in visits:
                visits[b] = max(visits.get(b, 0), visits[a])
        attempts = {}
        for sid, n in dict(meta.get("attempts") or {}).items():
            name, sep, rest = str(sid).partition("#")
            attempts[f"{moved(name)}{sep}{rest}"] = n
        update: dict[str, Any] = {"visits": visits, "attempts": attempts, "next": moved(nxt)}
        waiting = meta.get("waiting")
        if waiting:
            update["waiting"] = {
                **waiting,
                **{k: moved(waiting.get(k)) for k in ("then", "on_reject", "on_expire")},
            }
        if retry:
            update["retry"] = {**retry, "step": moved(retry.get("step"))}
        deadline = meta.get("deadline")
        if deadline:
            update["deadline"] = {**deadline, "then": moved(deadline.get("then"))}
        record = {
            "from": old,
            "to": flow.version,
            "steps": dict(sorted(renames.items())),
            "by": actor,
            "reason": reason,
        }
        info = self._operator_checkpoint(
            run_id,
            "operator:upgrade",
            actor,
            reason,
            next_step=moved(nxt),
            meta_update={**update, "upgraded": [*list(meta.get("upgraded") or []), record]},
            log_extra={"from": old, "to": flow.version, "steps": record["steps"]},
            parent=snap.info.seq,
        )
        self.store.update_run(run_id, code_version=flow.version, expect_head=info.seq)
        self.store.transact(lambda cur: notify_ready(cur, self.store.dialect))
        return self.store.get_run(run_id)

    def note(self, run_id: str, handoff: Handoff) -> Run:
        """Replace the run's handoff note (the step that runs next reads it, and keeps it
        in its checkpoint: :meth:`notes`)."""
        return self.store.update_run(run_id, handoff=handoff)

    def notes(self, run_id: str) -> list[NoteChange]:
        """How the run's handoff note changed: :func:`note_history`."""
        return note_history(self.store, run_id)

    # -- retention ---------------------------------------------------------------------
    def gc(
        self,
        *,
        older_than_s: float,
        archive_path: str | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> GcReport:
        """Archive (optional) and delete completed, failed and cancelled runs not updated
        for ``older_than_s``, drop ledger entries older than that and past their dedup
        windows, delete the waits of deleted runs, and collect unreferenced blobs.
        Waiting and running runs, open approvals and effects inside their windows are
        never touched.

        Args:
            older_than_s: Minimum age (seconds since the last update).
            archive_path: Append each removed run to this JSONL file first (and each
                removed ledger entry to ``<archive_path>.effects``).
            on_phase: Called with ``runs``, ``effects`` and ``waits`` as each phase
                starts (progress display).
        """
        phase = on_phase or (lambda _name: None)
        phase("runs")
        report = self.store.apply_retention(
            RetentionPolicy(older_than_s=older_than_s, archive_path=archive_path),
            now=self.clock(),
        )
        phase("effects")
        effects = self.ledger.apply_retention(
            EffectRetention(
                older_than_s=older_than_s,
                archive_path=None if archive_path is None else archive_path + ".effects",
            )
        )
        phase("waits")

        def orphans(cur: Any) -> int:
            cur.execute("DELETE FROM oo_waits WHERE run_id NOT IN (SELECT run_id FROM oo_runs)")
            return int(cur.rowcount or 0)

        waits = self.store.transact(orphans)
        return GcReport(
            report.runs_archived, report.runs_deleted, effects, report.blobs_collected, waits
        )

    # -- internals ---------------------------------------------------------------------
    def _load(self, run_id: str, seq: int | None = None) -> Snapshot:
        """``store.load``, past a :class:`CheckpointLost` report (see :meth:`_load_run`)."""
        return self.store.load(run_id, seq, report_lost=False)

    def _load_run(self, run_id: str, **kwargs: Any) -> tuple[Run, Snapshot | None]:
        """``store.load_run``, past a :class:`CheckpointLost` report: on a store shared
        with a worker, a step's queued (``async``) checkpoint that lost to another writer
        is reported once, to the next load of the run. It is the worker's (which runs the
        step again); an operator reads the head that stands."""
        return self.store.load_run(run_id, report_lost=False, **kwargs)

    def _operator_checkpoint(
        self,
        run_id: str,
        step: str,
        actor: str,
        reason: str,
        *,
        set_channel: tuple[str, Any] | None = None,
        status: RunStatus | None = None,
        next_step: str | None = None,
        meta_update: dict[str, Any] | None = None,
        expect: Callable[[Run], None] | None = None,
        parent: int | None = None,
        attempts: int = 1,
        log_extra: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write an operator's checkpoint on top of the run's head as read together with
        the run row (``expect`` checks that row; ``parent`` pins the head the caller
        decided on). A head another writer advanced meanwhile is ``ConcurrentWrite``,
        or, with ``attempts`` > 1, the action is applied again on the new head.

        Then the action is in the run's audit chain (:meth:`_record`): the operator
        log's entry (with ``log_extra``) and the new checkpoint's ``seq``."""
        if not actor.strip():
            raise ConfigurationError(f"{step} needs the operator's identity")
        for attempt in range(1, attempts + 1):
            run, snap = self._load_run(run_id)
            if expect is not None:
                expect(run)
            if snap is None:
                raise RunNotResumable(run_id, run.status.value, "it has no checkpoint yet")
            if parent is not None and snap.info.seq != parent:
                raise ConcurrentWrite(run_id, parent)
            state = snap.state
            meta = dict(state.get(META) or {})
            log = list(meta.get("operator_log") or [])
            entry: dict[str, Any] = {
                "at": self.clock(),
                "by": actor,
                "action": step,
                "reason": reason,
            }
            if set_channel is not None:
                entry["channel"] = set_channel[0]
                state[set_channel[0]] = set_channel[1]
            entry.update(log_extra or {})
            log.append(entry)
            meta["operator_log"] = log
            if status is RunStatus.RUNNING:
                meta["error"] = None
            meta.update(meta_update or {})
            state[META] = meta
            # Left out, the store's default keeps the run's next step.
            moves: dict[str, Any] = {} if next_step is None else {"next_step": next_step}
            try:
                # Durable and race-checked before the action is recorded and returned,
                # whatever the store's mode: an ``async`` store would queue it, and a
                # worker's checkpoint landing first would drop it after it was reported
                # done (CheckpointLost on the next call, the audit chain saying it
                # happened).
                info = self.store.save(
                    run_id,
                    state,
                    step=step,
                    status=status,
                    source=Source.OPERATOR,
                    parent=snap.info.seq,
                    durability=Durability.SYNC,
                    **moves,
                )
            except ConcurrentWrite:
                if attempt == attempts:
                    raise
                continue
            self._record(
                run_id,
                step.removeprefix("operator:"),
                str(info.seq),
                {**entry, "seq": info.seq},
            )
            return info
        raise AssertionError("unreachable")  # pragma: no cover

    def _record(self, run_id: str, action: str, where: str, record: dict[str, Any]) -> None:
        """Append an operator's action to the run's audit chain in the ledger: an
        ``operator`` event (hash-chained and sealed with the run's effects' events) whose
        detail is ``record`` (who, when, why, what), named ``ACTION#WHERE`` in the chain.
        Recording it again (an interrupted action repeated) appends nothing.

        The action itself is written first (the wait's decision, the checkpoint): a
        process killed between the two leaves it recorded there only, with the
        operator's identity, not in the chain."""
        self.ledger.record_action(
            run_id, f"{action}#{where}", actor=str(record.get("by") or ""), detail=record
        )

    def actions(self, run_id: str) -> list[dict[str, Any]]:
        """The operators' actions in the run's audit chain, oldest first: each with
        ``seq`` (its place in the chain), ``at``, ``actor`` and ``detail`` (``action``,
        ``reason`` and what the action names: a checkpoint, an approval, a fork's origin,
        an upgrade's versions)."""
        return [
            {"seq": e["seq"], "at": e["at"], "actor": e["actor"], "detail": e["detail"]}
            for e in self.ledger.operator_actions(run_id)
        ]

    def _record_decision(
        self, wait: Wait, action: str, extra: dict[str, Any] | None = None
    ) -> None:
        """A decision on an approval, in the run's audit chain."""
        record: dict[str, Any] = {
            "at": wait.decided_at,
            "by": wait.decided_by,
            "action": f"operator:{action}",
            "reason": wait.reason or "",
            "approval": wait.name,
            "instance": wait.instance,
            "subject_hash": wait.subject_hash,
            **(extra or {}),
        }
        self._record(wait.run_id, action, f"{wait.name}:{wait.instance}", record)

    def record(self, run_id: str, action: str, details: dict[str, Any], *, actor: str) -> None:
        """Record an operator's action that changes nothing in the run itself (a console's
        snooze) in the run's audit chain, with the actor and the time (one event per
        call; :meth:`actions` lists them).

        Raises:
            ConfigurationError: No actor, or an action name that is not a plain word.
            RunNotFound: No such run.
        """
        if not actor.strip():
            raise ConfigurationError(f"recording {action!r} needs the operator's identity")
        if not action.replace("_", "").isalnum():
            raise ConfigurationError(f"an action is a plain word, not {action!r}")
        self.store.get_run(run_id)
        record = {"at": self.clock(), "by": actor, "action": f"operator:{action}", **details}
        self._record(run_id, action, uuid.uuid4().hex, record)


def _at_position(step_id: str | None, at: str) -> bool:
    """Whether an effect's step id sits at step visit ``at`` (``name#visit``): the visit
    itself, or a branch, a ``parallel`` call or a memo of it."""
    sid = step_id or ""
    return sid == at or (sid.startswith(at) and sid[len(at)] in "/.:")


def _both(first: Callable[[Any], Any], second: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Two pieces of work for one transaction, in order."""

    def run(cur: Any) -> Any:
        first(cur)
        return second(cur)

    return run


def note_history(store: Store, run_id: str) -> list[NoteChange]:
    """How the run's handoff note changed, checkpoint by checkpoint, oldest first:
    the checkpoints that set another note than the one before (what was done, what
    was ruled out, and when). Reads every checkpoint: for an operator, not a hot
    path. Checkpoints written before notes were kept in them are skipped.

    Raises:
        RunNotFound: No such run.
    """
    out: list[NoteChange] = []
    last: dict[str, Any] | None = None
    for info in store.history(run_id):
        meta = store.load(run_id, info.seq, lazy=True).state.get(META) or {}
        doc = meta.get("note")
        if doc is None or doc == last:
            continue
        last = doc
        out.append(NoteChange(info.seq, info.step, info.created_at, Handoff.from_doc(doc)))
    return out
