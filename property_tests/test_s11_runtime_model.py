"""S11: the whole runtime beside a plain model (RELIABILITY.md, S11).

A hypothesis state machine (:class:`property_tests.s11_model.RuntimeModel`) generates a
flow (a plain step, a parallel step whose second ``ctx.parallel`` call repeats a branch
name of the first, its ``async def`` sibling (the same two calls as ``ctx.aparallel``
with async branches, then positional effects of its own, all through the guard's async
driver), a step with a time limit that runs past it on the runtime's clock (its late
effect is refused; the run takes its ``on_timeout`` path), a loop revisited 2-3 times
with an approval, a signal, a timer or nothing between visits, an explicit-key step, one
or two waits) and runs it for two tenants in three worker processes, one per durability
mode (``sync``, ``async``, ``exit``), and a fourth whose store is in the default mode
and whose runs each have a mode of their own (``Runtime.start(durability=...)``: all
three modes in one store and one worker), on one database, while an operator in a fifth
approves, rejects, signals, edits, cancels (between steps and in the middle of one),
retries, forks, collects garbage at zero age and resolves in-doubt effects; workers
crash at failpoints (an injected ``BaseException``) and restart; the keyring rotates;
deploys rename, reorder, insert and remove steps, effects and parallel branches.

The oracle is the provider's raw log (every delivery with the run that sent it), checked
after every rule against a model of what may have happened: no identity delivered twice,
nothing delivered that no deployed step sends at that visit, nothing behind an approval
paid out without it, nothing claimed after a cancel, no provider key shared by tenants,
and every effect of a completed run delivered (predicted from the flow while its code
did not change; from the run's own trail after a deploy). An example ends by letting
every run finish; a run that never does is a failure.

A crash inside an async step is the same ``BaseException`` raised at the same failpoints:
the ones its guarded calls meet on the ledger's thread pool reach the step through the
awaited future (the model counts crashes there as step crashes). A small SIGKILL part
runs a generated flow, an async step among its steps, in a child process killed at
random times.
Positive controls re-introduce each defect class of issue [7] by monkeypatching and the
checker must catch every one.

CI size: 5 examples x 22 rules per backend (deep: x20).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from onceonly.checkpoint import RunNotFound, RunStatus, Store, Waits
from onceonly.context import StepContext
from onceonly.ledger import Keyring, Ledger
from onceonly.operator import Operator
from property_tests.reliability import SuiteReport, scaled, seeds
from property_tests.s1_support import wipe
from property_tests.s11_flows import AFTER_EFFECTS, FileProvider, FlowSpec, StepSpec, predicted
from property_tests.s11_model import CRASH_POINTS, DEPLOYS, MODES, Counts, RuntimeModel
from tests.ledger_support import K1

pytestmark = pytest.mark.slow

EXAMPLES = scaled(ci=10, deep=200)
STEPS = scaled(ci=40, deep=60)
KILLS = scaled(ci=4, deep=60)
ROOT = Path(__file__).resolve().parent.parent

REPORT = SuiteReport(suite="S11", seeds=seeds(1))


def _add(c: Counts) -> None:
    REPORT.add(
        scenarios=c.examples,
        runs=c.runs,
        effects=c.effects,
        raw_deliveries=c.raw,
        crash_points=c.crashes,
        detected=c.detected,
        needs_human=c.needs_human,
        duplicates=c.duplicates,
        lost=c.lost,
    )


def _machine(db_url: str, counts: Counts, spec: FlowSpec | None = None) -> type[RuntimeModel]:
    class Bound(RuntimeModel):
        pass

    Bound.db_url = db_url
    Bound.counts = counts
    Bound.fixed_spec = spec
    return Bound


def _debug() -> dict[str, Any]:
    # S11_NO_SHRINK=1: report the first failing example as found (a quick look).
    if os.environ.get("S11_NO_SHRINK") == "1":
        return {"phases": [Phase.explicit, Phase.generate], "report_multiple_bugs": False}
    return {}


@pytest.fixture(autouse=True)
def _bounded_shrinking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS", 60, raising=False
    )


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[SuiteReport]:
    REPORT._started = time.monotonic()
    yield REPORT
    REPORT.check()


@pytest.mark.timeout(scaled(300, 7200))
def test_the_runtime_behaves_like_its_model(db_url: str, report: SuiteReport) -> None:
    counts = Counts()
    try:
        run_state_machine_as_test(
            _machine(db_url, counts),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                derandomize=REPORT.tier == "ci",
                database=None,
                suppress_health_check=list(HealthCheck),
                **_debug(),
            ),
        )
    finally:
        _add(counts)
        print(f"S11 {db_url.split(':', maxsplit=1)[0]}: {counts}", file=sys.stderr)
    # The machine must have exercised what it exists for, in every mode.
    for kind in ("mode:sync", "mode:async", "mode:exit", "fork", "gc", "approve", "upgrade"):
        assert counts.kinds[kind] > 0, (kind, dict(counts.kinds))
    # async steps ran to their effects' end (a crash at each point inside one: below)
    assert counts.kinds["ran:async:acted"] > 0, dict(counts.kinds)
    # slow steps ran past their time limit (and took their on_timeout path: the oracle
    # holds their late effect to never delivered, their first to delivered)
    assert counts.kinds["ran:slow:late"] > 0, dict(counts.kinds)
    assert counts.crashes > 0
    assert counts.raw > 0
    assert any(k.startswith("deploy:") for k in counts.kinds), dict(counts.kinds)


# -- a deploy in the middle of a step: go on safely or refuse, never resend -----------------


@pytest.mark.parametrize("how", DEPLOYS)
def test_a_deploy_in_the_middle_of_a_step_goes_on_safely_or_refuses(
    db_url: str, how: str, report: SuiteReport
) -> None:
    spec = _spec(
        StepSpec("pla0", "plain", ("w1", "w2")),
        StepSpec("par1", "parallel", ("w3", "w4", "w5")),
        StepSpec("exp2", "explicit", ("w6", "w7")),
        LAST,
    )
    counts = Counts()
    m = _machine(db_url, counts, spec)()
    m.setup(spec)
    outcomes = []
    try:
        # the step this kind of deploy changes: a branch's, an effect's, or a whole step's
        i = 1 if "branch" in how else 0 if "effect" in how or how == "insert_step" else 2
        crashes = (("ledger.commit.after", 1), ("ledger.commit.after", 3), (AFTER_EFFECTS, 1))
        for (point, k), mode in zip(crashes, MODES, strict=True):
            m.install(replace(spec, version=m.spec.version + 1))  # the original code
            rm = m.begin("acme", mode)
            rt = m.procs[mode].runtime
            while m.op_store.get_run(rm.rid).next_step != spec.steps[i].name:
                rt.drive(rm.rid, max_steps=1)
            m.mid_deploy(rm, how, point, k)
            assert not m.violations()
            outcomes.append("refused" if rm.refused else m._status(rm.rid))
        m.drain()
    finally:
        m.teardown()
        _add(counts)
    # every run completed, failed with a refusal, or (its step removed) was refused
    assert set(outcomes) <= {RunStatus.COMPLETED, RunStatus.FAILED, "refused"}, outcomes
    print(f"S11 mid-step deploy {how}: {dict(counts.kinds)}", file=sys.stderr)


# -- a crash inside an async step: at each of its points, as a kill there ----------------

IN_STEP = tuple(p for p in CRASH_POINTS if p.startswith(("ledger.", "adapters.", "s11.")))
ASYNC_HITS = 9
"""How often the async step below meets each ledger and adapter failpoint: two
branch-set reads, three branch memos, four effects (three in branches, one its own)."""


def test_a_crash_inside_an_async_step_is_a_kill_there(db_url: str, report: SuiteReport) -> None:
    """Hits of every failpoint an async step's visit meets (its branch-set and branch memo
    reads, each effect's claim, act and commit, on the step's thread or the ledger's
    pool; a middle hit, in the branches, and the last, its own effect), crashed in turn,
    the modes in turn: the crash stops the step there, the worker restarts, the effect in
    flight is in doubt and settled from the provider's log (or replays), and the run
    completes with each effect delivered once."""
    spec = _spec(
        StepSpec("pla0", "plain", ("w1",)),
        StepSpec("asy1", "async", ("w3", "w4", "w5", "w6")),
        LAST,
    )
    cases = [
        (point, k)
        for point in IN_STEP
        for k in ((1,) if point == AFTER_EFFECTS else (5, ASYNC_HITS))
    ]
    counts = Counts()
    m = _machine(db_url, counts, spec)()
    m.setup(spec)
    try:
        for i, (point, k) in enumerate(cases):
            mode = MODES[i % len(MODES)]
            rm = m.begin("acme", mode)
            m.procs[mode].runtime.drive(rm.rid, max_steps=1)  # at asy1
            before = counts.kinds[f"crash-in-async:{point}"]
            m.crash_at(rm, point, k)
            assert counts.kinds[f"crash-in-async:{point}"] == before + 1, (point, k, mode)
            for _ in range(3):
                if m._status(rm.rid) is RunStatus.COMPLETED:
                    break
                m.resolve_parked(rm)
                m._drive(rm)
            assert m._status(rm.rid) is RunStatus.COMPLETED, (point, k, mode)
            assert not m.violations(), (point, k, mode, m.violations())
        m.drain()
    finally:
        m.teardown()
        _add(counts)
    assert counts.duplicates == counts.lost == 0
    assert counts.needs_human > 0  # a crash between claim and outcome left it in doubt
    print(f"S11 crash inside an async step: {dict(counts.kinds)}", file=sys.stderr)


# -- found defect: a fork across a step rename -----------------------------------------------


def test_found_defect_a_fork_after_a_step_rename_does_not_resend(db_url: str) -> None:
    """Found by S11 (fixed: the fork refuses with ForkDiverged): a fork made after a
    deploy renamed a step its origin completed re-sent that step's effects."""
    spec = _spec(
        StepSpec("pla0", "plain", ("w1",)),
        StepSpec("par1", "parallel", ("w3", "w4", "w5")),
        LAST,
    )
    m = _machine(db_url, Counts(), spec)()
    m.setup(spec)
    try:
        rm = m.begin("acme", "sync")
        m._drive(rm)
        assert m._status(rm.rid) is RunStatus.COMPLETED
        start = next(h.seq for h in m.op_store.history(rm.rid) if h.step == "start")
        # the deploy renames par1 (same effects, same branches) ...
        m.install(m.spec.bumped((spec.steps[0], replace(spec.steps[1], name="par1r"), LAST)))
        # ... and a fork of the completed run from its first checkpoint runs on it
        fork = m.fork_at(replace(rm, start_version=m.spec.version), start)
        assert fork is not None
        m._drive(fork)
        # the fork either refuses or replays its origin's effects: never sends them again
        assert not m.violations(), m.violations()
    finally:
        procs, m.procs = m.procs, {}
        for proc in procs.values():
            m._close(proc)
        m.teardown()


# -- an upgrade after a rename: moves a run that had not acted there, refuses one that had --


@pytest.mark.parametrize("mode", MODES)
def test_an_upgrade_after_a_step_rename_goes_on_or_refuses_never_resends(
    db_url: str, mode: str, report: SuiteReport
) -> None:
    """A deploy renames the step two runs are at: one has not acted in it yet (it waits
    before it), the other crashed after the step's first effect. The deployed code cannot
    drive either (the step is missing); ``Operator.upgrade`` with the rename mapped moves
    the first, which completes with each effect sent once, and refuses the second, which
    stays as it was (under its new name the step would send again)."""
    spec = _spec(
        StepSpec("app0", "approval", ()),
        StepSpec("pla1", "plain", ("w1", "w2")),
        LAST,
    )
    counts = Counts()
    m = _machine(db_url, counts, spec)()
    m.setup(spec)
    try:
        waiting = m.begin("acme", mode)
        m._drive(waiting)  # at its approval, next step pla1
        acted = m.begin("acme", mode)
        m._drive(acted)
        m.decide_open(acted, approve=True)
        m.crash_at(acted, "ledger.commit.after", 1)  # pla1 sent w1, then the worker died
        assert m.op_store.get_run(acted.rid).next_step == "pla1"
        new = m.deployed("rename_step", lambda xs: xs[0])
        assert new is not None
        assert [st.name for st in new.steps] == ["app0", "pla1r", "pla9"]
        m.install(new, "rename_step")
        m.decide_open(waiting, approve=True)
        for rm in (waiting, acted):
            m._drive(rm)
            assert rm.refused, rm.rid  # the deployed code lacks pla1
        assert m.upgrade_run(waiting)
        assert not m.upgrade_run(acted)
        assert m.op_store.get_run(waiting.rid).next_step == "pla1r"
        m._drive(waiting)
        assert m._status(waiting.rid) is RunStatus.COMPLETED
        assert not m.violations(), m.violations()
        m.drain()  # the refused one is cancelled; nothing was sent twice
        assert not m.violations(), m.violations()
    finally:
        m.teardown()
        _add(counts)
    assert counts.kinds["upgrade"] == 1
    (refusal,) = [k for k, n in counts.kinds.items() if k.startswith("upgrade-refused") and n]
    assert "acted" in refusal or "effects" in refusal, refusal  # not "a worker holds it"


# -- positive controls: each defect class of issue [7], planted back ------------------------

PLAIN = StepSpec("pla0", "plain", ("w1", "w2", "w3"))
LAST = StepSpec("pla9", "plain", ("w9",))


def _spec(*steps: StepSpec) -> FlowSpec:
    return FlowSpec(tuple(steps))


def _scenario_cancel_mid_step(m: RuntimeModel) -> None:
    rm = m.begin("acme", "sync")
    m.mid_step(rm, "ledger.commit.after", 1, cancel=True)


def _scenario_loop_approval(m: RuntimeModel) -> None:
    rm = m.begin("acme", "sync")
    m._drive(rm)
    m.decide_open(rm, approve=True)
    m._drive(rm)
    m._drive(rm)


def _scenario_two_tenants_one_key(m: RuntimeModel) -> None:
    for tenant in ("acme", "globex"):
        m._drive(m.begin(tenant, "sync"))


def _scenario_two_parallel_calls(m: RuntimeModel) -> None:
    m._drive(m.begin("acme", "async"))


def _scenario_renamed_branch(m: RuntimeModel) -> None:
    rm = m.begin("acme", "sync")
    m.crash_at(rm, AFTER_EFFECTS, 1)
    new = m.deployed("rename_branch", lambda xs: xs[0])
    assert new is not None
    m.install(new)
    m._drive(rm)


def _scenario_gc_then_resume(m: RuntimeModel) -> None:
    rm = m.begin("acme", "sync")
    m.crash_at(rm, AFTER_EFFECTS, 1)
    m.gc()
    m._drive(rm)


def _scenario_exit_mode_steps(m: RuntimeModel) -> None:
    m._drive(m.begin("acme", "exit"))


def _no_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("onceonly.ledger._claims.check_fence", lambda *a, **k: None)


def _fence_ignores_the_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from onceonly.ledger import fence as fences

    def check(cur: Any, store: Store, fence: Any) -> None:
        if fence is not None:
            fence = replace(fence, deadline=None)  # the step's time limit is not checked
        fences.check_fence(cur, store, fence)

    monkeypatch.setattr("onceonly.ledger._claims.check_fence", check)


def _scenario_slow_step(m: RuntimeModel) -> None:
    rm = m.begin("acme", "exit")
    m._drive(rm)


def _wait_without_visit(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Waits.open

    def open_(self: Waits, *args: Any, **kwargs: Any) -> Any:
        kwargs["opened_by"] = None  # the wait no longer belongs to its step visit
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Waits, "open", open_)


def _explicit_without_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    from onceonly.ledger.keys import EffectIdentity

    original = EffectIdentity.parts

    def parts(self: EffectIdentity) -> tuple[object, ...]:
        if self.explicit is not None:
            return ("explicit", "", self.effect, self.explicit)
        return original(self)

    monkeypatch.setattr(EffectIdentity, "parts", parts)


def _memo_keys_not_positional(monkeypatch: pytest.MonkeyPatch) -> None:
    from onceonly.adapters import step as original  # what onceonly.context calls its `step`

    def step(run_id: str, step_id: str, *args: Any, **kwargs: Any) -> Any:
        if step_id.endswith(":branches"):
            step_id = re.sub(r"\.p\d+:branches$", ":branches", step_id)
        return original(run_id, step_id, *args, **kwargs)

    monkeypatch.setattr("onceonly.context.step", step)


def _branch_sets_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    original = StepContext.recorded

    def recorded(self: StepContext, effect: str, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
        if effect == "parallel@1":
            return fn(*a, **k)  # the branch set is never compared with the recorded one
        return original(self, effect, fn, *a, **k)

    monkeypatch.setattr(StepContext, "recorded", recorded)


def _retention_ignores_live_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from onceonly.ledger._rows import SELECT, effect_row
    from onceonly.ledger.records import EffectStatus

    def apply_retention(self: Ledger, policy: Any) -> int:
        cutoff = self._clock() - policy.older_than_s
        q = self._q

        def pick(cur: Any) -> list[Any]:
            cur.execute(
                f"{SELECT} WHERE status IN ({q}, {q}) AND updated_at < {q}",
                (EffectStatus.COMMITTED.value, EffectStatus.NOT_HAPPENED.value, cutoff),
            )
            return [effect_row(x) for x in cur.fetchall()]

        removed = 0
        for row in self.store.read(pick):

            def txn(cur: Any, row: Any = row) -> int:
                cur.execute(f"DELETE FROM oo_effects WHERE key_id = {q}", (row["key_id"],))
                self._append(cur, {**row, "updated_at": self._clock()}, "retired", "bug", "")
                return 1

            removed += self._write(txn, outcome=False)
            self._terminal.pop(row["key_id"], None)
        return removed

    monkeypatch.setattr(Ledger, "apply_retention", apply_retention)


def _run_row_and_checkpoint_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_run(
        self: Store,
        run_id: str,
        *,
        lazy: bool = False,
        migrations: Any = None,
        report_lost: bool = True,
    ) -> Any:
        run = self.get_run(run_id)  # the run row from the database...
        if run.head_seq is None:
            return run, None
        # ...the head apart
        return run, self.load(run_id, lazy=lazy, migrations=migrations, report_lost=report_lost)

    monkeypatch.setattr(Store, "load_run", load_run)


def _scenario_sibling_fork_after_rename(m: RuntimeModel) -> None:
    # Two forks of a run at its start; one runs the whole flow, a deploy renames its
    # middle step, then the other runs (the key space is shared; the origin never ran it).
    rm = m.begin("acme", "sync")
    m.procs["sync"].runtime.drive(rm.rid, max_steps=1)
    start = next(h.seq for h in m.op_store.history(rm.rid) if h.step == "start")
    first, second = m.fork_at(rm, start), m.fork_at(rm, start)
    assert first is not None
    assert second is not None
    m._drive(first)
    s = m.spec.steps
    m.install(m.spec.bumped((s[0], replace(s[1], name=s[1].name + "r"), *s[2:])), "rename_step")
    m._drive(second)


def _fork_checks_its_origin_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check as it was: a fork's own origin, after the fork point; nobody else.
    from onceonly.errors import ForkDiverged
    from onceonly.runtime import Runtime

    def check(
        self: Runtime, run_id: str, step_id: str, flow: Any, key_run: str, visits: Any, meta: Any
    ) -> None:
        forked = meta.get("forked_from") or {}
        origin, seq = str(forked.get("run") or ""), int(forked.get("seq") or 0)
        if not origin:
            return
        after = {i.step.split(":", 1)[0] for i in self.store.history(origin) if i.seq > seq}
        made = {(r.step_id or "").split("#", 1)[0] for r in self.ledger.effects(run_id=key_run)}
        lost = sorted(x for x in after if x and x not in flow.steps and x in made)
        if lost:
            raise ForkDiverged(run_id, step_id, origin, lost)

    monkeypatch.setattr(Runtime, "_check_key_space", check)


CONTROLS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], FlowSpec, Any]] = {
    "cancel-during-step-acts": (_no_fence, _spec(PLAIN, LAST), _scenario_cancel_mid_step),
    "loop-approval-reused": (
        _wait_without_visit,
        _spec(StepSpec("loo0", "loop", ("w1",), times=3, gate="approval"), LAST),
        _scenario_loop_approval,
    ),
    "tenants-share-explicit-key": (
        _explicit_without_tenant,
        _spec(StepSpec("exp0", "explicit", ("w1", "w2")), LAST),
        _scenario_two_tenants_one_key,
    ),
    "second-parallel-call-lost": (
        _memo_keys_not_positional,
        _spec(StepSpec("par0", "parallel", ("w1", "w2", "w3")), LAST),
        _scenario_two_parallel_calls,
    ),
    "second-aparallel-call-lost": (
        _memo_keys_not_positional,
        _spec(StepSpec("asy0", "async", ("w1", "w2", "w3", "w4")), LAST),
        _scenario_two_parallel_calls,
    ),
    "renamed-branch-resends": (
        _branch_sets_ignored,
        _spec(StepSpec("par0", "parallel", ("w1", "w2", "w3")), LAST),
        _scenario_renamed_branch,
    ),
    "timed-out-step-acts": (
        _fence_ignores_the_time,
        _spec(StepSpec("slo0", "slow", ("w1", "w2")), LAST),
        _scenario_slow_step,
    ),
    "gc-then-resend": (_retention_ignores_live_runs, _spec(PLAIN, LAST), _scenario_gc_then_resume),
    "completed-step-rerun": (
        _run_row_and_checkpoint_apart,
        _spec(StepSpec("pla0", "plain", ("w1",)), StepSpec("pla1", "plain", ("w2",)), LAST),
        _scenario_exit_mode_steps,
    ),
    "sibling-fork-resends-after-rename": (
        _fork_checks_its_origin_only,
        _spec(StepSpec("pla0", "plain", ("w1",)), StepSpec("pla1", "plain", ("w2",)), LAST),
        _scenario_sibling_fork_after_rename,
    ),
}


def _caught(db_url: str, spec: FlowSpec, scenario: Callable[[RuntimeModel], None]) -> list[str]:
    """Run ``scenario`` on a fresh machine; what the checker says (empty: nothing)."""
    m = _machine(db_url, Counts(), spec)()
    m.setup(spec)
    try:
        scenario(m)
        problems = m.violations()
        if not problems:
            try:
                m.drain()
            except AssertionError as exc:
                problems = [str(exc)]
        return problems
    finally:
        procs, m.procs = m.procs, {}
        for proc in procs.values():
            m._close(proc)
        m.teardown()


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_model_catches_a_planted_defect(
    name: str, tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant, spec, scenario = CONTROLS[name]
    url = f"sqlite:///{tmp_path / 'control.db'}"
    Store.open(url).close()  # the schema, for wipe
    clean = _caught(url, spec, scenario)
    assert not clean, f"the scenario fails on the real build: {clean}"
    plant(monkeypatch)
    problems = _caught(url, spec, scenario)
    report.control(bool(problems))
    assert problems, f"S11 did not catch: {name}"
    print(f"S11 control {name}: {problems[0]}", file=sys.stderr)


# -- SIGKILL: a generated flow in a worker process killed at random times -----------------


def _kill_spec(rng: random.Random) -> FlowSpec:
    steps = [
        StepSpec("par1", "parallel", ("w3", "w4", "w5")),
        StepSpec("loo2", "loop", ("w6",), times=rng.randint(2, 3)),
        StepSpec("exp3", "explicit", ("w7", "w8")),
        StepSpec("asy4", "async", ("w10", "w11", "w12", "w13")),
    ]
    rng.shuffle(steps)
    return FlowSpec((StepSpec("pla0", "plain", ("w1", "w2")), *steps, LAST))


def _resolve_from_log(op: Operator, rid: str, log: str) -> None:
    meta = op.show(rid).meta
    key_id = (meta.get("waiting") or {}).get("effect")
    if key_id:
        happened = any(d.key_id == key_id for d in FileProvider.read(log))
        op.resolve(str(key_id), happened=happened, evidence="log", actor="ops", result={"ok": 1})


@pytest.mark.parametrize("seed", seeds(2, base=20261211))
def test_a_worker_killed_at_random_times_sends_each_effect_once(
    db_url: str, tmp_path: Path, seed: int, report: SuiteReport
) -> None:
    rng = random.Random(seed)
    spec = _kill_spec(rng)
    tenant = rng.choice(["acme", "globex"])
    Store.open(db_url).close()
    store = Store.open(db_url)
    led = Ledger(store, Keyring([K1]), owner="ops")
    op = Operator(store, led)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    kills = 0
    try:
        # A kill is drawn at a random time after the child is ready; a child that ran the
        # whole spec sooner was never killed: try the scenario again, as a new run, with
        # kills drawn from a shorter window (a kill must land, not a time be guessed).
        for attempt in range(6):
            window = 0.4 * 0.5**attempt
            rid = f"k{seed}" if attempt == 0 else f"k{seed}.{attempt}"
            if attempt:
                # A fresh database: an explicit-key effect is the tenant's, not the run's,
                # and the earlier attempt's run made it already (it would replay here and
                # never reach this attempt's log).
                led.close()
                store.close()
                wipe(db_url)
                store = Store.open(db_url)
                led = Ledger(store, Keyring([K1]), owner="ops")
                op = Operator(store, led)
            log = str(tmp_path / f"deliveries-{attempt}.jsonl")
            kills = incarnations = 0
            status = None
            while incarnations < KILLS + 12:
                mode = ("sync", "async", "exit")[incarnations % 3]
                incarnations += 1
                args = [db_url, log, spec.to_json(), rid, tenant, mode]
                proc = subprocess.Popen(
                    [sys.executable, "-m", "property_tests.s11_child", *args],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert proc.stdout is not None
                ready = proc.stdout.readline().strip()
                if ready == "ready" and kills < KILLS:
                    time.sleep(rng.uniform(0.0, window))
                    if proc.poll() is None:
                        os.kill(proc.pid, signal.SIGKILL)
                        kills += 1
                out, _ = proc.communicate(timeout=120)
                assert proc.returncode in (0, -signal.SIGKILL), (ready, out, proc.returncode)
                try:
                    status = store.get_run(rid).status
                except RunNotFound:  # killed before it started the run
                    continue
                if status is RunStatus.COMPLETED:
                    break
                if status is RunStatus.WAITING:
                    _resolve_from_log(op, rid, log)
                assert status not in (RunStatus.FAILED, RunStatus.CANCELLED), op.show(rid).meta
            assert status is RunStatus.COMPLETED, (status, incarnations)
            got = [d.payload for d in FileProvider.read(log)]
            want = predicted(spec, tenant, rid)
            dups = len(got) - len(set(got))
            lost = len(want - set(got))
            report.add(
                scenarios=1,
                runs=1,
                crash_points=kills,
                effects=len(want),
                raw_deliveries=len(got),
                duplicates=dups,
                lost=lost,
            )
            assert dups == 0, sorted(got)
            assert set(got) == want, (sorted(set(got) - want), sorted(want - set(got)))
            if kills >= 1:
                break
        assert kills >= 1  # at least one kill landed before the run ended
    finally:
        led.close()
        store.close()
