"""The S11 state machine: the whole runtime (three durability modes, and the three mixed
in one store; two tenants, an operator, deploys, crashes) beside a plain model, checked
against the provider's raw log.

See :mod:`property_tests.test_s11_runtime_model` for what is run and the positive
controls; :mod:`property_tests.s11_flows` for the flows and the provider.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from onceonly.checkpoint import (
    ENDED,
    CheckpointLost,
    ConcurrentWrite,
    ConfigurationError,
    Durability,
    LeaseHeld,
    RunNotFound,
    RunStatus,
    Store,
    WaitKind,
    WaitRefused,
)
from onceonly.checkpoint.failpoints import armed
from onceonly.errors import RunNotResumable, UpgradeRefused
from onceonly.ledger import InFlightPolicy, Keyring, Ledger, Secret
from onceonly.operator import Operator
from onceonly.runtime import META, Runtime
from property_tests.s1_support import wipe
from property_tests.s11_flows import (
    AFTER_EFFECTS,
    BRANCHED,
    TENANTS,
    WAIT_KINDS,
    FlowSpec,
    Provider,
    StepSpec,
    build_flows,
    flow_name,
    predicted,
)
from tests.ledger_support import K1, Clock

__all__ = ["MODES", "Counts", "Crash", "RuntimeModel", "flow_specs"]

MODES = tuple(d.value for d in Durability)
MIXED = "mixed"
"""A fourth worker process whose store is in the default mode and whose runs each have a
mode of their own (``Runtime.start(durability=...)``): all three modes in one store."""
PROCS = (*MODES, MIXED)
CRASH_POINTS = (
    "runtime.step.before",
    "ledger.claim.before",
    "ledger.claim.after",
    "adapters.act.before",
    "adapters.act.after",
    "ledger.commit.before",
    "ledger.commit.after",
    AFTER_EFFECTS,
    "runtime.step.after",
    "waits.open.after",
    "waits.settle.before",
    "checkpoint.commit.before",
    "checkpoint.commit.after",
)
# Failpoints a step passes outside any open transaction: an operator can act there.
BETWEEN = (
    "ledger.claim.after",
    "adapters.act.before",
    "adapters.act.after",
    "ledger.commit.after",
    AFTER_EFFECTS,
)
CLAIM_LEASE_S = 30.0
"""The claim lease of the model's ledgers (in the model's clock)."""
REFUSALS = ("StepDiverged", "BranchesDiverged", "ForkDiverged", "KeyReuseError")
"""How a run refuses to go on after a deploy changed a step it is in the middle of."""
DEPLOYS = (
    "rename_branch",
    "rename_repeated_branch",
    "swap_branches",
    "reorder_effects",
    "insert_effect",
    "remove_effect",
    "insert_step",
    "remove_step",
    "rename_step",
)


def _step_thread() -> bool:
    """A step runs here: the main thread, one of its branches, or the ledger's thread pool
    (not a store writer). An ``async`` step's guarded calls make their ledger calls on
    that pool (the guard's async driver): its ``ledger.*`` failpoints fire there, and a
    crash raised there reaches the step through the awaited future, as a kill of the
    process would stop it there."""
    name = threading.current_thread().name
    return name == "MainThread" or name.startswith(("branch", "onceonly-ledger"))


class Crash(BaseException):
    """The process dies here: nothing after it runs, nothing catches it."""


@st.composite
def flow_specs(draw: st.DrawFn) -> FlowSpec:
    """A flow with a plain step first, then (in some order) a parallel step, an async
    step, a loop, an explicit-key step, one or two waits and a slow step (never last)."""
    kinds = ["parallel", "async", "loop", "explicit"]
    kinds = list(draw(st.permutations(kinds)))
    for kind in [*draw(st.lists(st.sampled_from(WAIT_KINDS), min_size=1, max_size=2)), "slow"]:
        kinds.insert(draw(st.integers(0, len(kinds) - 1)), kind)
    kinds.insert(0, "plain")
    steps: list[StepSpec] = []
    n = 0

    def what() -> str:
        nonlocal n
        n += 1
        return f"w{n}"

    for i, kind in enumerate(kinds):
        name = f"{kind[:3]}{i}"
        if kind == "plain":
            steps.append(
                StepSpec(name, kind, tuple(what() for _ in range(draw(st.integers(1, 2)))))
            )
        elif kind in ("explicit", "slow"):
            steps.append(StepSpec(name, kind, (what(), what())))
        elif kind == "parallel":
            steps.append(StepSpec(name, kind, (what(), what(), what())))
        elif kind == "async":
            # the branches' three, then the step's own positional effect(s)
            own = draw(st.integers(1, 2))
            steps.append(StepSpec(name, kind, tuple(what() for _ in range(3 + own))))
        elif kind == "loop":
            gate = draw(st.sampled_from(["", *WAIT_KINDS]))
            steps.append(StepSpec(name, kind, (what(),), times=draw(st.integers(2, 3)), gate=gate))
        else:
            steps.append(StepSpec(name, kind))
    return FlowSpec(tuple(steps))


@dataclass
class Counts:
    examples: int = 0
    steps: int = 0
    runs: int = 0
    effects: int = 0
    raw: int = 0
    crashes: int = 0
    detected: int = 0
    needs_human: int = 0
    duplicates: int = 0
    lost: int = 0
    kinds: Counter[str] = field(default_factory=Counter)


@dataclass
class RunModel:
    rid: str
    tenant: str
    mode: str
    lineage: str
    start_version: int
    gone: bool = False
    refused: bool = False
    done: bool = False
    proc: str = ""
    """The worker process that drives it (its mode's, or :data:`MIXED`)."""


@dataclass
class Proc:
    """One worker process of a durability mode: its store, ledger and runtime."""

    store: Store
    ledger: Ledger
    runtime: Runtime


class RuntimeModel(RuleBasedStateMachine):
    """Runs of generated flows in three processes (one per durability mode) and an
    operator, on one database, beside a model of what the provider must have seen."""

    db_url = ""
    counts = Counts()
    fixed_spec: FlowSpec | None = None

    def __init__(self) -> None:
        super().__init__()
        wipe(self.db_url)
        self.clock = Clock()
        self.secrets: list[Secret] = [K1]
        self.provider = Provider()
        self.spec = FlowSpec(())
        self.versions: list[FlowSpec] = []
        self.procs: dict[str, Proc] = {}
        self.runs: dict[str, RunModel] = {}
        self.approved: Counter[tuple[str, str]] = Counter()
        self.rejected: set[str] = set()
        self.gcs = 0
        self.step_renames: list[int] = []  # versions that renamed a step
        self.dups: set[str] = set()
        self.rotations = 0
        self.cancel_at: dict[str, tuple[int, frozenset[str]]] = {}
        self.retired: Counter[str] = Counter()
        self.next_id = 0
        self.visiting = ""  # the kind of the step visit that began last
        self.counts.examples += 1
        self.op_store = Store.open(self.db_url)
        self.op_ledger = self._ledger(self.op_store, "op")
        self.operator = Operator(self.op_store, self.op_ledger, clock=self.clock)

    # -- processes ---------------------------------------------------------------------
    def _ledger(self, store: Store, owner: str) -> Ledger:
        return Ledger(
            store,
            Keyring(self.secrets),
            owner=owner,
            lease_s=CLAIM_LEASE_S,
            in_flight=InFlightPolicy(wait_s=0),
            clock=self.clock,
        )

    def _open(self, mode: str) -> Proc:
        store = Store.open(self.db_url, durability="sync" if mode == MIXED else mode)
        ledger = self._ledger(store, f"rt-{mode}")
        return Proc(store, ledger, self._runtime(store, ledger, mode))

    def _runtime(self, store: Store, ledger: Ledger, mode: str) -> Runtime:
        flows = build_flows(self.spec, self.provider, ran=self._ran, elapse=self.clock.advance)
        return Runtime(store, ledger, flows, owner=f"rt-{mode}", clock=self.clock)

    def _ran(self, kind: str, run_id: str) -> None:
        """A step of ``kind`` began a visit (``KIND:acted``: its effects are done)."""
        rm = self.runs.get(run_id)
        if not kind.endswith(":acted"):
            self.visiting = kind
        self.counts.kinds[f"ran:{kind}"] += 1
        if rm is not None:
            self.counts.kinds[f"ran:{kind}:{rm.mode}"] += 1

    def _close(self, proc: Proc) -> None:
        with contextlib.suppress(Exception):
            proc.ledger.close()
        with contextlib.suppress(Exception):
            proc.store.close()

    def _restart(self, mode: str) -> None:
        self._close(self.procs[mode])
        self.procs[mode] = self._open(mode)

    def setup(self, spec: FlowSpec) -> None:
        self.spec = spec
        self.versions = [spec]
        for mode in PROCS:
            self.procs[mode] = self._open(mode)

    def teardown(self) -> None:
        try:
            if self.procs:
                self.drain()
        finally:
            self.counts.raw += len(self.provider.log)
            self.counts.effects += len({d.payload for d in self.provider.log})
            for proc in self.procs.values():
                self._close(proc)
            with contextlib.suppress(Exception):
                self.op_ledger.close()
            with contextlib.suppress(Exception):
                self.op_store.close()

    # -- helpers -----------------------------------------------------------------------
    def live(self) -> list[str]:
        return sorted(r for r, m in self.runs.items() if not m.gone)

    def _status(self, rid: str) -> RunStatus | None:
        try:
            return self.op_store.get_run(rid).status
        except RunNotFound:
            self.runs[rid].gone = True
            return None

    def _drive(self, rm: RunModel, handler: Callable[[str], None] | None = None) -> None:
        rt = self.procs[rm.proc or rm.mode].runtime
        for _ in range(3):
            try:
                with armed(handler) if handler is not None else contextlib.nullcontext():
                    run = rt.drive(rm.rid, max_steps=200)
                if run.status is RunStatus.FAILED:
                    error = self.operator.show(rm.rid).meta.get("error") or {}
                    kind = str(error.get("type"))
                    self.counts.kinds[f"failed:{kind}"] += 1
                    if kind in REFUSALS:
                        self.counts.detected += 1
                return
            except CheckpointLost:
                continue  # said once: another writer won the race; look again
            except LeaseHeld as held:
                # Parked until another process's live claim on one of its effects lapses
                # (the runtime holds the run under "<owner>:deferred" meanwhile): let that
                # time pass, in the ledger's clock and for the parking lease.
                if not held.owner.endswith(":deferred"):
                    raise
                self.clock.now = max(self.clock.now, time.time()) + CLAIM_LEASE_S + 1.0
                self.op_store.release_lease(rm.rid, held.owner)
                self.counts.kinds["parked-on-a-live-claim"] += 1
                continue
            except ConfigurationError:
                # The run names a step the deployed code no longer has: refused, nothing
                # sent (deploy code that has it, or fork the run).
                rm.refused = True
                self.counts.detected += 1
                return
            except RunNotFound:
                rm.gone = True
                return

    def _pick(self, data: st.DataObject) -> RunModel:
        return self.runs[data.draw(st.sampled_from(self.live()))]

    def _pick_in(self, data: st.DataObject, *statuses: RunStatus) -> RunModel | None:
        """A run in one of ``statuses`` now (most rules only mean something there)."""
        some = [r for r in self.live() if self._status(r) in statuses]
        return self.runs[data.draw(st.sampled_from(some))] if some else None

    # -- rules -------------------------------------------------------------------------
    @initialize(
        spec=flow_specs(),
        tenants=st.lists(st.sampled_from(TENANTS), min_size=3, max_size=3),
        mixed=st.sampled_from(MODES),
    )
    def init(self, spec: FlowSpec, tenants: list[str], mixed: str) -> None:
        """The flow, and a run in each durability mode (the rules add more), and one of
        a mode of its own in the mixed process."""
        self.setup(self.fixed_spec or spec)
        for tenant, mode in zip(tenants, MODES, strict=True):
            self.begin(tenant, mode)
        self.begin(tenants[0], mixed, shared=True)

    @precondition(lambda self: len(self.runs) < 7)
    @rule(tenant=st.sampled_from(TENANTS), mode=st.sampled_from(MODES), shared=st.booleans())
    def start(self, tenant: str, mode: str, shared: bool) -> None:
        self.begin(tenant, mode, shared=shared)

    def begin(self, tenant: str, mode: str, *, shared: bool = False) -> RunModel:
        """A run of ``mode``: in its mode's process, or (``shared``) in the mixed one,
        with the mode given to the run."""
        self.next_id += 1
        proc = MIXED if shared else mode
        rid = f"r{self.next_id}-{tenant}-{mode}{'-m' if shared else ''}"
        self.procs[proc].runtime.start(
            flow_name(tenant), {"lineage": rid}, run_id=rid, durability=mode if shared else None
        )
        rm = RunModel(rid, tenant, mode, rid, self.spec.version, proc=proc)
        self.runs[rid] = rm
        self.counts.runs += 1
        self.counts.kinds[f"mode:{mode}{':mixed' if shared else ''}"] += 1
        return rm

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def drive(self, data: st.DataObject) -> None:
        self._drive(self._pick(data))

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def drive_again(self, data: st.DataObject) -> None:
        self._drive(self._pick(data))

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data(), point=st.sampled_from(CRASH_POINTS), k=st.integers(1, 3))
    def crash(self, data: st.DataObject, point: str, k: int) -> None:
        rm = self._pick(data)
        self.crash_at(rm, point, k)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data(), point=st.sampled_from(CRASH_POINTS), k=st.integers(1, 2))
    def crash_again(self, data: st.DataObject, point: str, k: int) -> None:
        self.crash_at(self._pick(data), point, k)

    def crash_at(self, rm: RunModel, point: str, k: int) -> None:
        if point.startswith("checkpoint.commit") and rm.mode != "sync":
            point = "runtime.step.after"  # async / exit commits run on the writer thread
        hits = 0
        lock = threading.Lock()

        def handler(name: str) -> None:
            nonlocal hits
            if name != point:
                return
            if not _step_thread():
                return  # a background writer of the store: not the step's thread
            with lock:
                hits += 1
                now = hits
            if now == k:
                raise Crash(point)

        self.visiting = ""
        try:
            self._drive(rm, handler)
        except Crash:
            self.counts.crashes += 1
            self.counts.kinds[f"crash:{point}"] += 1
            if self.visiting == "async" and point.startswith(("ledger.", "adapters.", "s11.")):
                # a crash inside an async step's visit (at one of its effects' points)
                self.counts.kinds[f"crash-in-async:{point}"] += 1
        self._restart(rm.proc or rm.mode)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data(), point=st.sampled_from(BETWEEN), k=st.integers(1, 3), cancel=st.booleans())
    def act_mid_step(self, data: st.DataObject, point: str, k: int, cancel: bool) -> None:
        """An operator cancels or edits the run while one of its steps runs."""
        rm = self._pick_in(data, RunStatus.RUNNING)
        if rm is not None:
            self.mid_step(rm, point, k, cancel)

    def mid_step(self, rm: RunModel, point: str, k: int, cancel: bool) -> None:
        hits = 0
        done = False
        lock = threading.Lock()

        def handler(name: str) -> None:
            nonlocal hits, done
            if name != point or not _step_thread():
                return
            with lock:
                hits += 1
                if hits != k or done:
                    return
                done = True
                if cancel:
                    self._cancel(rm)
                else:
                    self._edit(rm)

        self._drive(rm, handler)
        if done:
            self.counts.kinds["mid-step:" + ("cancel" if cancel else "edit")] += 1

    def _cancel(self, rm: RunModel) -> None:
        # Claims granted before the cancel may finish their effect; nothing claimed after.
        # The claims are read once the cancel has committed: in the middle of an async
        # step, the other branches' claims run on the ledger's threads while this one
        # cancels, and one granted between a read before the cancel and its commit is
        # rightly granted (deep tier: flagged as "claimed after"). Deliveries are checked
        # from before the cancel; a claim the fence let through after it is still caught
        # by the effects the step and the run go on to claim (the planted control).
        mark = len(self.provider.log)
        try:
            self.operator.cancel(rm.rid, actor="ops", reason="s11")
        except (RunNotResumable, RunNotFound):
            return
        granted = frozenset(r.key_id for r in self.op_ledger.effects(run_id=rm.lineage))
        self.cancel_at.setdefault(rm.rid, (mark, granted))
        self.counts.kinds["cancel"] += 1

    def _edit(self, rm: RunModel) -> None:
        with contextlib.suppress(ConcurrentWrite, RunNotResumable, RunNotFound):
            self.operator.edit(rm.rid, "memo", self.next_id, actor="ops", reason="s11 edit")
            self.counts.kinds["edit"] += 1

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self._cancel(self._pick(data))

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def edit(self, data: st.DataObject) -> None:
        self._edit(self._pick(data))

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def approve(self, data: st.DataObject) -> None:
        self.decide_open(self._pick(data), approve=True)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def reject(self, data: st.DataObject) -> None:
        rm = self._pick_in(data, RunStatus.WAITING)
        if rm is not None:
            self.decide_open(rm, approve=False)

    def decide_open(self, rm: RunModel, *, approve: bool) -> None:
        for w in self.operator.waits.find(run_id=rm.rid, status="open"):
            if w.kind is not WaitKind.APPROVAL:
                continue
            try:
                if approve:
                    self.operator.approve(
                        rm.rid, w.name, actor="alice", subject_hash=str(w.subject_hash)
                    )
                else:
                    self.operator.reject(rm.rid, w.name, actor="alice", reason="no")
            except WaitRefused:
                continue
            if approve:
                self.approved[(rm.lineage, w.name)] += 1
            else:
                self.rejected.add(rm.lineage)
            self.counts.kinds["approve" if approve else "reject"] += 1

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def signal(self, data: st.DataObject) -> None:
        self.signal_open(self._pick(data))

    def signal_open(self, rm: RunModel) -> None:
        for w in self.operator.waits.find(run_id=rm.rid, status="open"):
            if w.kind is WaitKind.SIGNAL and not w.name.startswith("effect:"):
                with contextlib.suppress(WaitRefused):
                    self.operator.signal(rm.rid, w.name, {"n": 1}, actor="ops")
                    self.counts.kinds["signal"] += 1

    @rule()
    def timers_fire(self) -> None:
        self.clock.now = max(self.clock.now, time.time()) + 61.0

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        rm = self._pick_in(data, RunStatus.FAILED)
        if rm is None:
            return
        with contextlib.suppress(RunNotResumable, RunNotFound, ConcurrentWrite):
            self.operator.retry(rm.rid, actor="ops", reason="s11 retry")
            self.counts.kinds["retry"] += 1
            self._drive(rm)

    @precondition(lambda self: bool(self.live()) and len(self.runs) < 8)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rm = self._pick(data)
        try:
            history = self.op_store.history(rm.rid)
        except RunNotFound:
            return
        if not history:
            return
        seq = data.draw(st.sampled_from([h.seq for h in history]))
        self.fork_at(rm, seq)

    def fork_at(self, rm: RunModel, seq: int) -> RunModel | None:
        if any(v > rm.start_version for v in self.step_renames):
            # A fork across a deploy that renamed a step its origin ran (S11 found it
            # re-sending that step's effects; it now refuses with ForkDiverged).
            self.counts.kinds["fork-across-step-rename"] += 1
        self.next_id += 1
        new = f"f{self.next_id}-{rm.tenant}-{rm.mode}"
        try:
            self.operator.fork(rm.rid, seq, actor="ops", reason="s11 fork", new_run_id=new)
        except (ConfigurationError, RunNotFound) as exc:
            self.counts.kinds[f"fork-refused:{type(exc).__name__}"] += 1
            return None
        fm = replace(rm, rid=new, gone=False, refused=False, done=False)
        self.runs[new] = fm
        self.counts.runs += 1
        self.counts.kinds["fork"] += 1
        return fm

    @precondition(lambda self: self.gcs < 3)
    @rule()
    def gc(self) -> None:
        self.gcs += 1
        self.clock.now = max(self.clock.now, time.time()) + 5.0
        for proc in self.procs.values():
            proc.store.flush()
        self.operator.gc(older_than_s=0)
        self.counts.kinds["gc"] += 1
        for rid in self.live():
            self._status(rid)
        # An explicit key's entry goes with the last run of its key space: after that the
        # key is free again (retention's documented limit), so one more delivery is due.
        alive = {m.lineage for m in self.runs.values() if not m.gone}
        for payload, n in Counter(d.payload for d in self.provider.log).items():
            if "|X|" in payload:
                owners = {
                    self.runs[d.run].lineage for d in self.provider.log if d.payload == payload
                }
                if not owners & alive:
                    self.retired[payload] = n

    @rule(fault=st.sampled_from(["lose", "drop"]))
    def lose_next(self, fault: str) -> None:
        self.provider.fault = fault

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def resolve(self, data: st.DataObject) -> None:
        self.resolve_parked(self._pick(data))

    def resolve_parked(self, rm: RunModel) -> bool:
        try:
            meta = self.operator.show(rm.rid).meta
        except RunNotFound:
            return False
        waiting = meta.get("waiting") or {}
        key_id = waiting.get("effect")
        if not key_id:
            return False
        # The truth comes from the provider's own log, as a person would look it up.
        happened = any(d.key_id == key_id for d in self.provider.log)
        with contextlib.suppress(Exception):
            rec = self.op_ledger.get(str(key_id))
            if rec.status.value in ("unknown", "needs_human", "claimed"):
                self.operator.resolve(
                    str(key_id), happened=happened, evidence="log", actor="ops", result={"ok": 1}
                )
                self.counts.needs_human += 1
        return True

    @precondition(lambda self: self.rotations < 2)
    @rule()
    def rotate(self) -> None:
        self.rotations += 1
        n = len(self.secrets) + 1
        self.secrets = [Secret(f"k{n}", bytes([n]) * 32), *self.secrets]
        for mode in PROCS:
            self._restart(mode)
        self.op_ledger.close()
        self.op_store.close()
        self.op_store = Store.open(self.db_url)
        self.op_ledger = self._ledger(self.op_store, "op")
        self.operator = Operator(self.op_store, self.op_ledger, clock=self.clock)
        self.counts.kinds["rotate"] += 1

    @rule(mode=st.sampled_from(PROCS))
    def restart(self, mode: str) -> None:
        self._restart(mode)

    @rule(how=st.sampled_from(DEPLOYS), data=st.data())
    def deploy(self, how: str, data: st.DataObject) -> None:
        new = self.deployed(how, lambda xs: data.draw(st.sampled_from(xs)))
        if new is not None:
            self.install(new, how)
            self.counts.kinds[f"deploy:{how}"] += 1

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data(), how=st.sampled_from(DEPLOYS), point=st.sampled_from(BETWEEN))
    def crash_then_deploy(self, data: st.DataObject, how: str, point: str) -> None:
        """A worker dies in the middle of a step; the deploy that follows changes that
        very step (when it can); the run resumes on the new code."""
        running = [r for r in self.live() if self._status(r) is RunStatus.RUNNING]
        if not running:
            return
        rm = self.runs[data.draw(st.sampled_from(running))]
        self.mid_deploy(rm, how, point)

    def mid_deploy(self, rm: RunModel, how: str, point: str, k: int = 1) -> None:
        self.crash_at(rm, point, k)
        try:
            at = self.op_store.get_run(rm.rid).next_step
        except RunNotFound:
            return
        names = [s.name for s in self.spec.steps]
        new = self.deployed(how, lambda xs: next((i for i in xs if names[i] == at), xs[0]))
        if new is not None:
            self.install(new, how)
            self.counts.kinds[f"deploy:{how}"] += 1
        self._drive(rm)

    @rule(how=st.sampled_from(DEPLOYS), data=st.data())
    def deploy_again(self, how: str, data: st.DataObject) -> None:
        self.deploy(how, data)

    @precondition(lambda self: bool(self.live()) and len(self.versions) > 1)
    @rule(data=st.data())
    def upgrade(self, data: st.DataObject) -> None:
        """An operator moves a run started under older code onto the deployed version
        (``onceonly runs upgrade``), its renamed steps mapped."""
        self.upgrade_run(self._pick(data))

    def _renames(self) -> dict[str, dict[str, str]]:
        """Per older version, its steps the deployed code renamed (``x`` → ``xr``...)."""
        names = [s.name for s in self.spec.steps]
        out: dict[str, dict[str, str]] = {}
        for v in self.versions:
            if v.version == self.spec.version:
                continue
            renames = {}
            for s in v.steps:
                if s.name in names:
                    continue
                new = [n for n in names if n.startswith(s.name) and set(n[len(s.name) :]) == {"r"}]
                if len(new) == 1:
                    renames[s.name] = new[0]
            if renames:
                out[str(v.version)] = renames
        return out

    def upgrade_run(self, rm: RunModel) -> bool:
        """Upgrade ``rm`` to the deployed version; whether it moved. A refusal must leave
        the run as it was (the oracle then sees the same deliveries)."""
        try:
            run = self.op_store.get_run(rm.rid)
        except RunNotFound:
            rm.gone = True
            return False
        if run.code_version == str(self.spec.version) or run.status in ENDED:
            return False
        flows = build_flows(self.spec, self.provider, self._renames(), elapse=self.clock.advance)
        by_name = {f.name: f for f in flows}
        try:
            self.operator.upgrade(rm.rid, by_name[run.flow], actor="ops", reason="s11 upgrade")
        except UpgradeRefused as exc:
            self.counts.kinds[f"upgrade-refused:{exc.reason.split(':')[0][:40]}"] += 1
            after = self.op_store.get_run(rm.rid)
            assert (after.code_version, after.next_step, after.status) == (
                run.code_version,
                run.next_step,
                run.status,
            ), "a refused upgrade changed the run"
            return False
        rm.refused = False  # a run a rename had stranded goes on under the new name
        self.counts.kinds["upgrade"] += 1
        return True

    def install(self, new: FlowSpec, how: str = "") -> None:
        if how == "rename_step":
            self.step_renames.append(new.version)
        self.spec = new
        self.versions.append(new)
        for mode, proc in self.procs.items():
            proc.store.flush()
            proc.runtime = self._runtime(proc.store, proc.ledger, mode)

    def deployed(self, how: str, choose: Callable[[list[int]], int]) -> FlowSpec | None:
        steps = list(self.spec.steps)
        fresh = f"n{len(self.versions)}"

        def where(kinds: tuple[str, ...], *, first: bool = True, need: int = 1) -> int | None:
            idx = [
                i
                for i, s in enumerate(steps)
                if s.kind in kinds and len(s.whats) >= need and (first or i > 0)
            ]
            return choose(idx) if idx else None

        if how in ("rename_branch", "rename_repeated_branch", "swap_branches"):
            i = where(BRANCHED)
            if i is None:
                return None
            s = steps[i]
            self.counts.kinds[f"deploy-on:{s.kind}"] += 1
            b0, b1, b2 = s.branches
            if how == "rename_branch":
                steps[i] = replace(s, branches=(b0 + "r", b1, b2))
            elif how == "rename_repeated_branch":
                steps[i] = replace(s, branches=(b0, b1, b2 + "r"))
            else:
                w0, w1, *rest = s.whats
                steps[i] = replace(s, whats=(w1, w0, *rest))
        elif how in ("reorder_effects", "insert_effect", "remove_effect"):
            i = where(("plain",), need=2 if how != "insert_effect" else 1)
            if i is None:
                return None
            s = steps[i]
            if how == "reorder_effects":
                whats = tuple(reversed(s.whats))
            elif how == "insert_effect":
                whats = (fresh, *s.whats)
            else:
                whats = s.whats[:-1]
            steps[i] = replace(s, whats=whats)
        elif how == "insert_step":
            i = choose(list(range(1, len(steps))))
            steps.insert(i, StepSpec(f"ins{len(self.versions)}", "plain", (fresh,)))
        elif how in ("remove_step", "rename_step"):
            i = where(("plain", "explicit", *BRANCHED), first=False)
            if i is None or (how == "remove_step" and i == len(steps) - 1):
                return None  # (the last step stays: a wait is never left last)
            if how == "remove_step":
                del steps[i]
            else:
                steps[i] = replace(steps[i], name=steps[i].name + "r")
        return self.spec.bumped(tuple(steps))

    # -- the oracle --------------------------------------------------------------------
    def violations(self) -> list[str]:
        """Everything the provider's raw log shows that the model says must not be."""
        log = self.provider.log
        out: list[str] = []
        seen: Counter[str] = Counter(d.payload for d in log)
        for payload, n in seen.items():
            if n > 1 + self.retired.get(payload, 0):
                by = [
                    (d.run, d.key_id[:12], d.provider_key[:12]) for d in log if d.payload == payload
                ]
                out.append(
                    f"duplicate: {payload} delivered {n} times (run, key, provider key: {by})"
                )
                if os.environ.get("S11_DEBUG") == "1":
                    out += self._trail(payload)
                if payload not in self.dups:
                    self.dups.add(payload)
                    self.counts.duplicates += 1
        tenants_by_key: dict[str, set[str]] = {}
        for i, d in enumerate(log):
            rm = self.runs.get(d.run)
            parts = d.payload.split("|")
            tenant = parts[0]
            tenants_by_key.setdefault(d.provider_key, set()).add(tenant)
            if rm is None:
                out.append(f"a delivery from an unknown run {d.run}: {d.payload}")
                continue
            if tenant != rm.tenant:
                out.append(f"run {d.run} of {rm.tenant} delivered {d.payload}")
            cancelled = self.cancel_at.get(d.run)
            if cancelled is not None and i >= cancelled[0] and d.key_id not in cancelled[1]:
                out.append(f"{d.payload} claimed after run {d.run} was cancelled")
            if parts[1] == "X":
                continue
            lineage, what, visit = parts[1], parts[2], int(parts[3])
            if lineage != rm.lineage:
                out.append(f"run {d.run} delivered another key space's {d.payload}")
            out += self._possible(lineage, what, visit, d.payload)
        for key, ts in tenants_by_key.items():
            if len(ts) > 1:
                out.append(f"tenants {sorted(ts)} share the provider key {key[:12]}")
        out += self._complete()
        return out

    def _trail(self, payload: str) -> list[str]:
        """S11_DEBUG=1: every audit event of the key ids that delivered ``payload``, and
        the raw log (what a duplicate's cause is read from)."""
        keys = {d.key_id for d in self.provider.log if d.payload == payload}

        def events(cur: Any) -> list[Any]:
            cur.execute("SELECT chain, seq, key_id, event, actor FROM oo_audit ORDER BY chain, seq")
            return [row for row in cur.fetchall() if row[2] in keys]

        out = [
            f"  event {c} #{n} {k[:12]} {ev} by {who}"
            for c, n, k, ev, who in self.op_store.read(events)
        ]
        out += [
            f"  delivery {i}: {d.run} {d.payload} {d.key_id[:12]}"
            for i, d in enumerate(self.provider.log)
        ]
        return out

    def _possible(self, lineage: str, what: str, visit: int, payload: str) -> list[str]:
        """The delivery is of a step visit some deployed code has, and every approval
        that step sits behind was granted (in every version that has it)."""
        homes = [(v, i) for v in self.versions for i, s in enumerate(v.steps) if what in s.sent()]
        if not homes:
            return [f"{payload}: no deployed step has {what}"]
        most = max(v.steps[i].times if v.steps[i].kind == "loop" else 1 for v, i in homes)
        if visit >= most:
            return [f"{payload}: visit {visit} of a step that runs {most} time(s)"]
        needs: set[tuple[str, int]] | None = None
        for v, i in homes:
            s = v.steps[i]
            # (wait, how many approvals of it this visit sits behind)
            here = {(g.wait_name(), 1) for g in v.steps[:i] if g.kind == "approval"}
            if s.kind == "loop" and s.gate == "approval" and visit > 0:
                here.add((s.wait_name(), visit))
            needs = here if needs is None else needs & here
        missing = [(w, n) for w, n in sorted(needs or ()) if self.approved[(lineage, w)] < n]
        return [f"{payload} paid out without approval {w} (needs {n})" for w, n in missing]

    def _complete(self) -> list[str]:
        """Every run that completed had everything its path sends delivered."""
        out: list[str] = []
        delivered = {d.payload for d in self.provider.log}
        for rm in self.runs.values():
            if rm.done or rm.gone:
                continue
            try:
                run, snap = self.op_store.load_run(rm.rid)
            except RunNotFound:
                rm.gone = True
                continue
            if run.status is not RunStatus.COMPLETED or snap is None:
                continue
            rm.done = True
            if rm.start_version == self.spec.version and len(self.versions) == 1:
                want = predicted(self.spec, rm.tenant, rm.lineage)
            else:  # the code changed under the run: what its steps say they did
                want = set(snap.state.get("trail", []))
                assert META in snap.state
            for payload in sorted(want - delivered):
                out.append(f"lost: run {rm.rid} completed without {payload}")
                self.counts.lost += 1  # once: the run is marked done
        return out

    @invariant()
    def the_provider_saw_what_the_model_allows(self) -> None:
        self.counts.steps += 1
        problems = self.violations()
        assert not problems, problems

    # -- the end of an example -----------------------------------------------------------
    def drain(self) -> None:
        """Let every run finish: resolve truthfully, approve, signal, fire timers, drive;
        then every run must be terminal (or refused by a deploy, then cancelled)."""
        for _ in range(16):
            open_runs = []
            for rid in self.live():
                rm = self.runs[rid]
                status = self._status(rid)
                if status is None or status in ENDED:
                    continue
                if rm.refused:
                    self._cancel(rm)
                    continue
                open_runs.append(rm)
                self.resolve_parked(rm)
                self.decide_open(rm, approve=True)
                self.signal_open(rm)
                self._drive(rm)
            if not open_runs:
                break
            self.timers_fire()
        stuck = [r for r in self.live() if self._status(r) not in (*ENDED, None)]
        assert not stuck, f"runs never finished: {stuck}"
        if len(self.versions) == 1:
            # Nothing but a rejection may fail a run whose code never changed.
            for rid in self.live():
                rm = self.runs[rid]
                if self._status(rid) is RunStatus.FAILED and rm.lineage not in self.rejected:
                    error = self.operator.show(rid).meta.get("error")
                    raise AssertionError(f"run {rid} failed with nothing to fail it: {error}")
        problems = self.violations()
        assert not problems, problems
