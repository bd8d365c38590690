"""One consistent run position in every durability mode, under every operator action.

Regressions of issue [7]: each test drives a real runtime on SQLite and PostgreSQL, in
``sync``, ``async`` and ``exit`` store durability, and counts raw deliveries at a fake
provider (the ledger is never asked what happened). "Another process" is a fresh Store
and Ledger on the same database.
"""

from __future__ import annotations

from typing import Any

import pytest

from onceonly.adapters import current_claim, guard
from onceonly.checkpoint import CodecError, Durability, RunNotFound, RunStatus
from onceonly.checkpoint.failpoints import armed
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import Ledger
from onceonly.operator import Operator
from onceonly.runtime import Runtime
from onceonly.worker import Worker
from tests.ledger_support import Ledgers

MODES = [d.value for d in Durability]


class Provider:
    """Logs every raw delivery: (effect, provider key, payload)."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[str, str, Any]] = []

    def send(self, effect: str, payload: Any) -> dict[str, Any]:
        self.deliveries.append((effect, current_claim().provider_key, payload))
        return {"n": len(self.deliveries)}

    def effects(self) -> list[str]:
        return [e for e, _, _ in self.deliveries]


@pytest.fixture(params=MODES)
def durability(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class World:
    """A runtime on a store of the chosen durability, an operator in another process."""

    def __init__(self, ledgers: Ledgers, durability: str) -> None:
        self.ledgers = ledgers
        self.provider = Provider()
        self.store = ledgers.store(durability=durability)
        self.ledger = ledgers.on(self.store, owner="w1")
        self.other = ledgers.fresh(owner="op")  # sync store: another process
        self.operator = Operator(self.other.store, self.other)

    def runtime(self, *flows: Flow, ledger: Ledger | None = None) -> Runtime:
        led = ledger or self.ledger
        return Runtime(led.store, led, flows, owner="rt")

    def send(self, ctx: StepContext, effect: str) -> Any:
        fn = guard(ctx.ledger, effect=effect)(lambda: self.provider.send(effect, None))
        return fn()


@pytest.fixture
def world(ledgers: Ledgers, durability: str) -> World:
    return World(ledgers, durability)


def _two_steps(world: World) -> Flow:
    flow = Flow("two")

    @flow.step(start=True)
    def a(ctx: StepContext) -> Transition:
        world.send(ctx, "a@1")
        return ctx.next("b")

    @flow.step
    def b(ctx: StepContext) -> Transition:
        world.send(ctx, "b@1")
        return ctx.end("done")

    return flow


# -- 1: the step name and its visit come from one moment -----------------------------------


def test_a_completed_step_never_runs_again_in_any_mode(world: World) -> None:
    rt = world.runtime(_two_steps(world))
    rid = rt.start("two", {})
    run = rt.drive(rid)
    assert run.status is RunStatus.COMPLETED
    assert world.provider.effects() == ["a@1", "b@1"]
    world.store.flush()
    assert world.other.store.get_run(rid).status is RunStatus.COMPLETED
    steps = {r.step_id for r in world.other.effects(run_id=rid)}
    assert steps == {"a#0", "b#0"}  # never a#1: the visit count and the step agree


def test_a_worker_runs_each_step_once_in_any_mode(world: World) -> None:
    rt = world.runtime(_two_steps(world))
    rids = [rt.start("two", {}) for _ in range(3)]
    Worker(rt, poll_s=0.05).run(until_idle=True)
    world.store.flush()
    for rid in rids:
        assert world.other.store.get_run(rid).status is RunStatus.COMPLETED
    assert sorted(world.provider.effects()) == ["a@1"] * 3 + ["b@1"] * 3


# -- 2, 3: a cancel at any point of a step stops it before its next claim ------------------

# Failpoints a step passes outside any open transaction: an operator (another process) can
# act there without waiting on the step's own write lock.
_BETWEEN = (
    "runtime.step.before",
    "ledger.claim.before",
    "ledger.claim.after",
    "adapters.act.before",
    "adapters.act.after",
    "ledger.commit.before",
    "ledger.commit.after",
)


def _three_effects(world: World) -> Flow:
    flow = Flow("three")

    @flow.step(start=True)
    def s(ctx: StepContext) -> Transition:
        for i in range(3):
            world.send(ctx, f"e{i}@1")
        return ctx.next("t")

    @flow.step
    def t(ctx: StepContext) -> Transition:
        world.send(ctx, "last@1")
        return ctx.end()

    return flow


def _hits(world: World, flow: Flow) -> list[str]:
    """The failpoints one undisturbed run of ``flow`` passes between transactions."""
    hits: list[str] = []
    rt = world.runtime(flow)
    rid = rt.start(flow.name, {})
    with armed(lambda name: hits.append(name) if name in _BETWEEN else None):
        rt.drive(rid)
    return hits


def test_a_cancel_at_any_point_stops_the_step_before_its_next_claim(world: World) -> None:
    flow = _three_effects(world)
    points = _hits(world, flow)
    assert points.count("ledger.claim.after") == 4
    for k in range(len(points)):
        world.provider.deliveries.clear()
        rt = world.runtime(flow)
        rid = rt.start(flow.name, {})
        seen: list[str] = []
        claimed_before = 0

        def at_point(name: str, k: int = k, rid: str = rid, seen: list[str] = seen) -> None:
            nonlocal claimed_before
            if name not in _BETWEEN:
                return
            seen.append(name)
            if len(seen) == k + 1:
                claimed_before = seen.count("ledger.claim.after")
                world.operator.cancel(rid, actor="ops", reason=f"cancel at {name}")

        with armed(at_point):
            run = rt.drive(rid)
        assert run.status is RunStatus.CANCELLED, (k, points[k])
        # The effect in progress when the cancel landed finishes; nothing is claimed after.
        assert len(world.provider.deliveries) == claimed_before, (k, points[k])
        history = world.other.store.history(rid)
        assert history[-1].step == "operator:cancel", (k, points[k])


def test_a_cancel_between_the_workers_reads_is_not_undone(world: World) -> None:
    """Cancel lands after the worker read the run and before it loaded the checkpoint (the
    old interleaving): the step sees one snapshot and its save is refused."""
    flow = _two_steps(world)
    rt = world.runtime(flow)
    rid = rt.start("two", {})
    cancelled = False

    def at_point(name: str) -> None:
        nonlocal cancelled
        if name == "runtime.step.before" and not cancelled:
            cancelled = True
            world.operator.cancel(rid, actor="ops", reason="stop")

    with armed(at_point):
        run = rt.drive(rid)
    assert run.status is RunStatus.CANCELLED
    assert world.provider.effects() == []


def test_an_edit_during_a_step_drops_the_step_and_reruns_it_on_the_edited_state(
    world: World,
) -> None:
    flow = Flow("edited")

    @flow.step(start=True)
    def s(ctx: StepContext) -> Transition:
        world.send(ctx, "first@1")
        n = ctx.state["n"]
        guard(ctx.ledger, effect="second@1")(lambda n: world.provider.send("second@1", n))(n)
        return ctx.end(n)

    rt = world.runtime(flow)
    rid = rt.start("edited", {"n": 1})
    edited = False

    def at_point(name: str) -> None:
        nonlocal edited
        if name == "ledger.commit.after" and not edited:
            edited = True
            world.operator.edit(rid, "n", 2, actor="ops", reason="wrong n")

    with armed(at_point):
        run = rt.drive(rid)
    assert run.status is RunStatus.COMPLETED
    # "first" was sent before the edit and replays; "second" was never claimed for n=1:
    # the step ran again on the edited state.
    assert [(e, p) for e, _, p in world.provider.deliveries] == [
        ("first@1", None),
        ("second@1", 2),
    ]
    assert world.other.store.load(rid).state["result"] == 2


# -- 11: one run's conflict never fails another run's effect -------------------------------


def test_a_conflict_of_one_run_never_fails_another_runs_effect(ledgers: Ledgers) -> None:
    store = ledgers.store(durability="async")
    ledger = ledgers.on(store, owner="w1")
    other = ledgers.fresh(owner="op")
    flow = Flow("one")
    provider = Provider()

    @flow.step(start=True)
    def s(ctx: StepContext) -> Transition:
        guard(ctx.ledger, effect="charge@1")(lambda: provider.send("charge@1", None))()
        return ctx.end()

    rt = Runtime(store, ledger, [flow], owner="rt")
    r1 = rt.start("one", {"x": 1})
    r2 = rt.start("one", {"x": 2})
    state = store.load(r1).state
    Operator(other.store, other).edit(r1, "x", 10, actor="ops", reason="routine edit")
    # This process's queued checkpoint of R1 (built on what it read) loses its race to
    # the edit...
    state["x"] = 3
    store.save(r1, state, step="stale")
    # ... and R2's effect rides on the same group commit.
    run = rt.drive(r2)
    assert run.status is RunStatus.COMPLETED
    assert provider.effects() == ["charge@1"]
    [record] = other.effects(run_id=r2)
    assert record.status.value == "committed"
    assert other.store.load(r1).state["x"] == 10  # the operator's edit stands


# -- 14: a start is atomic ---------------------------------------------------------------------


class _Unencodable:
    pass


def test_a_start_with_unencodable_state_leaves_no_run(world: World) -> None:
    rt = world.runtime(_two_steps(world))
    with pytest.raises(CodecError):
        rt.start("two", {"bad": _Unencodable()}, run_id="r-bad")
    with pytest.raises(RunNotFound):
        world.other.store.get_run("r-bad")
    rid = rt.start("two", {}, run_id="r-bad")  # the id is free, and the run starts whole
    assert rt.drive(rid).status is RunStatus.COMPLETED


def test_a_started_run_has_its_first_checkpoint_durable_in_every_mode(world: World) -> None:
    rt = world.runtime(_two_steps(world))
    rid = rt.start("two", {"x": 1})
    run = world.other.store.get_run(rid)  # another process, before any flush
    assert (run.status, run.head_seq, run.next_step) == (RunStatus.RUNNING, 0, "a")
    assert world.other.store.load(rid).state["x"] == 1


def test_start_is_idempotent_by_run_id(world: World) -> None:
    rt = world.runtime(_two_steps(world))
    rid = rt.start("two", {"x": 1}, run_id="same")
    assert rt.start("two", {"x": 2}, run_id="same") == rid
    assert world.other.store.load(rid).state["x"] == 1


# -- 4, 5: every position a branch acts from is part of its identity ----------------------


class Crash(BaseException):
    """The process dies here: nothing after it runs, nothing catches it."""


def test_two_parallel_calls_with_a_branch_name_in_common_both_run(world: World) -> None:
    flow = Flow("twice")

    def branch(label: str) -> Any:
        def fn(b: Any) -> Any:
            guard(b.ledger, effect="notify@1")(lambda x: world.provider.send("notify@1", x))(label)
            return label

        return fn

    @flow.step(start=True)
    def s(ctx: StepContext) -> Transition:
        first = ctx.parallel({"x": branch("first-x"), "y": branch("first-y")})
        second = ctx.parallel({"x": branch("second-x")})
        return ctx.end({"first": first, "second": second})

    rt = world.runtime(flow)
    rid = rt.start("twice", {})
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert sorted(p for _, _, p in world.provider.deliveries) == [
        "first-x",
        "first-y",
        "second-x",
    ]
    result = world.other.store.load(rid).state["result"]
    assert result == {"first": {"x": "first-x", "y": "first-y"}, "second": {"x": "second-x"}}


def test_a_crash_between_two_parallel_calls_replays_the_first_and_runs_the_second_once(
    world: World,
) -> None:
    crash = {"armed": True}

    def make_flow() -> Flow:
        flow = Flow("twice")

        def branch(label: str) -> Any:
            def fn(b: Any) -> Any:
                guard(b.ledger, effect="notify@1")(lambda x: world.provider.send("notify@1", x))(
                    label
                )
                return label

            return fn

        @flow.step(start=True)
        def s(ctx: StepContext) -> Transition:
            ctx.parallel({"x": branch("first-x")})
            if crash["armed"]:
                crash["armed"] = False
                raise Crash
            out = ctx.parallel({"x": branch("second-x")})
            return ctx.end(out)

        return flow

    rt = world.runtime(make_flow())
    rid = rt.start("twice", {})
    with pytest.raises(Crash):
        rt.drive(rid)
    rt.store.flush()
    again = world.runtime(make_flow(), ledger=world.ledgers.fresh(owner="w1"))
    assert again.drive(rid).status is RunStatus.COMPLETED
    assert [p for _, _, p in world.provider.deliveries] == ["first-x", "second-x"]


def test_a_deploy_that_renames_a_branch_does_not_send_its_effects_again(world: World) -> None:
    def make_flow(names: tuple[str, str], crash_after: str | None) -> Flow:
        flow = Flow("fan", version="1")

        def branch(label: str) -> Any:
            def fn(b: Any) -> Any:
                guard(b.ledger, effect="book@1")(lambda x: world.provider.send("book@1", x))(label)
                if label == crash_after:
                    raise Crash
                return label

            return fn

        @flow.step(start=True)
        def s(ctx: StepContext) -> Transition:
            out = ctx.parallel({names[0]: branch("room"), names[1]: branch("car")}, max_workers=1)
            return ctx.end(out)

        return flow

    rt = world.runtime(make_flow(("hotel", "rental"), crash_after="room"))
    rid = rt.start("fan", {})
    with pytest.raises(Crash):
        rt.drive(rid)
    rt.store.flush()
    assert sorted(p for _, _, p in world.provider.deliveries) == ["car", "room"]
    # The deploy renames "hotel" to "lodging": its effect would go out again.
    renamed = world.runtime(
        make_flow(("lodging", "rental"), crash_after=None), ledger=world.ledgers.fresh(owner="w1")
    )
    run = renamed.drive(rid)
    assert run.status is RunStatus.FAILED
    meta = Operator(world.other.store, world.other).show(rid).meta
    assert meta["error"]["type"] == "BranchesDiverged"
    assert sorted(p for _, _, p in world.provider.deliveries) == ["car", "room"]
    # Deploying the code that recorded them back, a retry finishes: both replay.
    Operator(world.other.store, world.other).retry(rid, actor="ops", reason="rolled back")
    back = world.runtime(
        make_flow(("hotel", "rental"), crash_after=None), ledger=world.ledgers.fresh(owner="w1")
    )
    assert back.drive(rid).status is RunStatus.COMPLETED
    assert sorted(p for _, _, p in world.provider.deliveries) == ["car", "room"]


# -- 7: retention and fork never remove or orphan what a live run can replay ---------------


def test_gc_at_zero_age_keeps_what_a_parked_run_will_replay(world: World) -> None:
    """A run parked on an in-doubt effect is live: gc keeps its branch memos and its
    effects, and the step's re-run after the resolution sends nothing twice."""
    doubt = {"armed": True}
    flow = Flow("parked")

    def branch(b: Any) -> Any:
        return guard(b.ledger, effect="screen@1")(lambda: world.provider.send("screen@1", None))()

    def flaky() -> Any:
        world.provider.send("charge@1", None)
        if doubt["armed"]:
            doubt["armed"] = False
            raise TimeoutError("read timeout")  # class C, applied: in doubt
        return {"ok": True}

    @flow.step(start=True)
    def s(ctx: StepContext) -> Transition:
        ctx.parallel({"a": branch})
        guard(ctx.ledger, effect="charge@1")(flaky)()
        return ctx.end()

    rt = world.runtime(flow)
    rid = rt.start("parked", {})
    assert rt.drive(rid).status is RunStatus.WAITING
    assert world.provider.effects() == ["screen@1", "charge@1"]
    report = world.operator.gc(older_than_s=0)
    assert report.effects_deleted == 0
    [charge] = [r for r in world.other.effects(run_id=rid) if r.effect == "charge@1"]
    world.operator.resolve(
        charge.key_id, happened=True, evidence="provider portal", actor="ops", result={"ok": 1}
    )
    world.operator.gc(older_than_s=0)
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert world.provider.effects() == ["screen@1", "charge@1"]


def test_a_fork_racing_gc_never_resends_its_origins_effects(world: World) -> None:
    flow = _two_steps(world)
    rt = world.runtime(flow)
    origin = rt.start("two", {})
    assert rt.drive(origin).status is RunStatus.COMPLETED
    world.store.flush()
    # gc removes the finished origin while the fork is being made: the fork's start
    # must find it gone and start nothing.
    raced = False

    def gc_now(name: str) -> None:
        nonlocal raced
        if name == "checkpoint.run.write" and not raced:
            raced = True
            Operator(world.ledgers.fresh().store, world.ledgers.fresh()).gc(older_than_s=0)

    with armed(gc_now), pytest.raises(RunNotFound):
        world.operator.fork(origin, 1, actor="ops", reason="again", new_run_id="f1")
    assert raced
    with pytest.raises(RunNotFound):
        world.other.store.get_run("f1")
    assert world.provider.effects() == ["a@1", "b@1"]


def test_a_fork_made_before_gc_keeps_its_origin_and_replays(world: World) -> None:
    flow = _two_steps(world)
    rt = world.runtime(flow)
    origin = rt.start("two", {})
    assert rt.drive(origin).status is RunStatus.COMPLETED
    world.store.flush()
    fork = world.operator.fork(origin, 1, actor="ops", reason="again")  # before step b
    report = world.operator.gc(older_than_s=0)
    assert (report.runs_deleted, report.effects_deleted) == (0, 0)
    assert rt.drive(fork).status is RunStatus.COMPLETED
    assert world.provider.effects() == ["a@1", "b@1"]  # b replayed from the origin's
    world.operator.gc(older_than_s=0)  # both finished now: both may go, with their effects
    with pytest.raises(RunNotFound):
        world.other.store.get_run(origin)
