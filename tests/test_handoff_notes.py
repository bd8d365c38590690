"""The handoff note where it is read (issue [11]): passed to the step that resumes a run,
kept with every checkpoint, and its history readable checkpoint by checkpoint. Every
test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import os

import pytest

from onceonly.checkpoint import Handoff, RunStatus, Store
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.operator import note_history
from tests.dbutil import body_sizes
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Crash, Env


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def _research(env: Env, seen: list[Handoff], crash: list[bool]) -> Flow:
    flow = Flow("research")

    @flow.step(start=True)
    def plan(ctx: StepContext) -> Transition:
        ctx.note(goal="find a supplier", next=["search"])
        return ctx.next("search")

    @flow.step
    def search(ctx: StepContext) -> Transition:
        seen.append(ctx.handoff)  # what a resumed agent is told
        ctx.note(done=["searched"], ruled_out=["supplier X: no ISO cert"], next=["ask"])
        if crash:
            crash.pop()
            raise Crash("killed after deciding, before the checkpoint")
        return ctx.next("wait")

    @flow.step
    def wait(ctx: StepContext) -> Transition:
        seen.append(ctx.handoff)
        return ctx.wait_for_signal("go", then="finish")

    @flow.step
    def finish(ctx: StepContext) -> Transition:
        seen.append(ctx.handoff)
        ctx.note(done=[*ctx.handoff.done, "asked"], next=[])
        return ctx.end()

    return flow


def test_each_checkpoint_keeps_the_note_and_the_history_shows_its_changes(env: Env) -> None:
    seen: list[Handoff] = []
    rt = env.runtime(_research(env, seen, crash=[True]))
    rid = rt.start("research", handoff=Handoff(goal="initial"))
    with pytest.raises(Crash):
        rt.drive(rid)
    # the resumed step is told the note as the last checkpoint left it, not the lost one
    again = env.runtime(_research(env, seen, crash=[]), fresh=True)
    assert again.drive(rid).status is RunStatus.WAITING
    assert seen[0] == seen[1] == Handoff(goal="find a supplier", next=("search",))
    assert seen[2].ruled_out == ("supplier X: no ISO cert",)
    env.operator.note(rid, Handoff(goal="find a supplier", done=("searched",), next=("ship",)))
    env.operator.signal(rid, "go", actor="portal")
    assert again.drive(rid).status is RunStatus.COMPLETED
    assert seen[3].next == ("ship",)  # the operator's note reached the next step

    history = note_history(env.store, rid)
    assert [(c.step, c.handoff.goal, c.handoff.done) for c in history] == [
        ("start", "initial", ()),
        ("plan", "find a supplier", ()),
        ("search", "find a supplier", ("searched",)),
        ("wait:go", "find a supplier", ("searched",)),  # the operator's, kept from here
        ("finish", "find a supplier", ("searched", "asked")),
    ]
    assert history[2].handoff.ruled_out == ("supplier X: no ISO cert",)
    assert [c.seq for c in history] == sorted(c.seq for c in history)
    assert env.operator.notes(rid) == history


def test_an_unchanged_note_costs_no_bytes_in_a_checkpoint(env: Env) -> None:
    flow = Flow("loop")

    @flow.step(start=True)
    def tick(ctx: StepContext) -> Transition:
        ctx.state["n"] = ctx.visit
        if ctx.visit == 0:
            ctx.note(goal="count to three", ruled_out=[os.urandom(1000).hex()])
        return ctx.next("tick") if ctx.visit < 3 else ctx.end()

    rt = env.runtime(flow)
    rid = rt.start("loop")
    rt.drive(rid)
    sizes = body_sizes(env.store.engine, rid)
    assert sizes[1] > 1000  # the checkpoint that set the long note carries it
    deltas = [i.seq for i in env.store.history(rid) if i.seq > 1 and not i.keyframe]
    assert len(deltas) >= 2
    assert all(sizes[seq] < 600 for seq in deltas), sizes  # the deltas after it do not
    assert [c.step for c in note_history(env.store, rid)] == ["start", "tick"]
