"""Versioned flows (issue [11]): a run stays on the version that started it, a worker
claims and drives only the versions its code serves, the registry tells which runs no
live worker serves, and an operator moves a run to another version on purpose (state
migrations and a step mapping, recorded in an operator checkpoint and the audit chain).
Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from onceonly.checkpoint import ConfigurationError, RunStatus, Source, StateMigrations, Waits
from onceonly.context import StepContext
from onceonly.errors import UpgradeRefused, VersionNotServed
from onceonly.flow import Flow, Transition
from onceonly.registry import WorkerRegistry, unserved
from onceonly.worker import Worker
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Env


@pytest.fixture
def env(store: Any, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def _orders(env: Env, version: str, *, rename: bool = False, **kw: Any) -> Flow:
    """``ask`` waits for an approval, then ``pay`` sends; a rejection goes to
    ``tell`` (``notify`` when renamed)."""
    flow = Flow("orders", version=version, **kw)
    reject = "notify" if rename else "tell"

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval("ok", ctx.state["order"], then="pay", on_reject=reject)

    @flow.step
    def pay(ctx: StepContext) -> Transition:
        env.send(ctx, "pay@1", ctx.state["order"])
        return ctx.end(f"paid by {ctx.flow_version}")

    @flow.step(name=reject)
    def told(ctx: StepContext) -> Transition:
        return ctx.end(f"declined by {ctx.flow_version}")

    return flow


def _waiting(env: Env, version: str = "1", run_id: str = "o-1") -> str:
    rt = env.runtime(_orders(env, version))
    rid = rt.start("orders", {"order": "A-1"}, run_id=run_id)
    assert rt.drive(rid).status is RunStatus.WAITING
    return rid


def test_a_run_is_driven_only_by_code_that_serves_its_version(env: Env) -> None:
    rid = _waiting(env)
    env.operator.reject(rid, "ok", actor="bob")
    v2 = env.runtime(_orders(env, "2"))
    with pytest.raises(VersionNotServed, match="version '1'") as err:
        v2.drive(rid)
    assert (err.value.version, err.value.served) == ("1", frozenset({"2"}))
    run = env.store.get_run(rid)
    assert (run.status, run.lease_owner, run.code_version) == (RunStatus.RUNNING, None, "1")
    # no worker of version 2 even leases it; one that serves 1 drives it, and the run
    # stays on version 1
    ready = Waits(env.store, clock=env.clock)
    assert ready.claim_ready("w2", 30, flows=v2.served) == []
    both = env.runtime(_orders(env, "2", serves=("1",)))
    assert ready.claim_ready("w3", 30, flows=both.served) == [rid]
    env.store.release_lease(rid, "w3")
    assert both.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "declined by 2"
    assert env.store.get_run(rid).code_version == "1"


def test_a_worker_process_of_another_version_leaves_the_run(env: Env) -> None:
    """The Worker loop, not only the claim: it announces what it serves, drives nothing
    of another version, and leaves the registry when it stops."""
    rid = _waiting(env)
    env.operator.reject(rid, "ok", actor="bob")
    registry = WorkerRegistry(env.store, clock=env.clock)
    w2 = Worker(env.runtime(_orders(env, "2")), poll_s=0.01)
    assert w2.run(until_idle=True).runs_driven == 0
    assert env.store.get_run(rid).status is RunStatus.RUNNING
    assert registry.workers() == []  # it removed its row when it stopped
    assert [r.run_id for r in unserved(env.store, registry)] == [rid]
    w1 = Worker(env.runtime(_orders(env, "1")), poll_s=0.01)
    assert w1.run(until_idle=True).runs_driven == 1
    assert env.state(rid)["result"] == "declined by 1"


def test_the_registry_counts_live_workers_only(env: Env) -> None:
    rid = _waiting(env)
    registry = WorkerRegistry(env.store, clock=env.clock)
    assert [r.run_id for r in unserved(env.store, registry)] == [rid]
    registry.announce("w1", {"orders": ["1"]}, beat_s=10)
    registry.announce("w2", {"orders": ["2"], "other": ["1"]}, beat_s=10)
    assert unserved(env.store, registry) == []
    (w1,) = [w for w in registry.workers() if w.owner == "w1"]
    assert w1.serves("orders", "1")
    assert not w1.serves("orders", "2")
    env.clock.advance(25)
    assert registry.beat("w2")
    env.clock.advance(10)  # w1 not seen for 35 s > 3 x 10 s: gone
    assert [w.owner for w in registry.live()] == ["w2"]
    assert [r.run_id for r in unserved(env.store, registry)] == [rid]
    registry.leave("w2")
    assert not registry.beat("w2")  # gone: a worker that finds its row missing announces


def _upgraded_flow(env: Env, **kw: Any) -> Flow:
    return _orders(env, "2", rename=True, upgrades={"1": {"tell": "notify"}}, **kw)


def test_an_upgrade_maps_the_steps_and_migrates_the_state_once(env: Env) -> None:
    rid = _waiting(env)

    def to_v2(state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "order": state["order"].lower()}

    v2 = _upgraded_flow(env, migrations=StateMigrations(current=2, upgrades={1: to_v2}))
    run = env.operator.upgrade(rid, v2, actor="alice", reason="retire v1")
    assert run.code_version == "2"
    meta = env.meta(rid)
    assert meta["waiting"]["on_reject"] == "notify"
    (entry,) = [e for e in meta["operator_log"] if e["action"] == "operator:upgrade"]
    assert (entry["by"], entry["from"], entry["to"], entry["steps"]) == (
        "alice",
        "1",
        "2",
        {"tell": "notify"},
    )
    sources = [c.source for c in env.store.history(rid)]
    assert sources[-2:] == [Source.MIGRATION, Source.OPERATOR]
    assert env.state(rid)["order"] == "a-1"
    # the audit chain holds the same record
    (record,) = [a["detail"] for a in env.operator.actions(rid)]
    assert (record["action"], record["by"], record["from"], record["to"]) == (
        "operator:upgrade",
        "alice",
        "1",
        "2",
    )
    assert record["steps"] == {"tell": "notify"}
    assert env.ledger.verify().ok
    # the same upgrade again changes nothing
    n = len(env.store.history(rid))
    assert env.operator.upgrade(rid, v2, actor="alice", reason="again").code_version == "2"
    assert len(env.store.history(rid)) == n
    env.operator.reject(rid, "ok", actor="bob")
    with pytest.raises(VersionNotServed):  # version 1's code no longer drives it
        env.runtime(_orders(env, "1")).drive(rid)
    rt = env.runtime(v2)
    assert rt.drive(rid).status is RunStatus.COMPLETED
    assert env.state(rid)["result"] == "declined by 2"


def test_an_upgrade_that_cannot_be_made_changes_nothing(env: Env) -> None:
    rid = _waiting(env)

    def seen() -> tuple[Any, ...]:
        r = env.store.get_run(rid)
        what = (r.status, r.next_step, r.code_version, r.head_seq, r.lease_owner)
        return (*what, len(env.store.history(rid)), len(env.ledger.effects(run_id=rid)))

    before = seen()

    def unchanged() -> None:
        assert seen() == before

    # the renamed rejection path has no mapping
    with pytest.raises(UpgradeRefused, match="'tell'"):
        env.operator.upgrade(rid, _orders(env, "2", rename=True), actor="a", reason="r")
    unchanged()
    # state of a version the code cannot upgrade
    with pytest.raises(UpgradeRefused, match="state is version 1"):
        env.operator.upgrade(rid, _orders(env, "2", state_version=2), actor="a", reason="r")
    unchanged()
    other = Flow("invoices", version="2")
    other.step(name="begin", start=True)(lambda ctx: ctx.end())
    with pytest.raises(UpgradeRefused, match="flow 'orders'"):
        env.operator.upgrade(rid, other, actor="a", reason="r")
    with pytest.raises(ConfigurationError):
        env.operator.upgrade(rid, _upgraded_flow(env), actor="a", reason=" ")
    # a worker holds it
    env.store.acquire_lease(rid, "w9", 30)
    with pytest.raises(UpgradeRefused, match="holds it"):
        env.operator.upgrade(rid, _upgraded_flow(env), actor="a", reason="r")
    env.store.release_lease(rid, "w9")
    unchanged()
    # an ended run
    env.operator.cancel(rid, actor="a", reason="r")
    with pytest.raises(UpgradeRefused, match="cancelled"):
        env.operator.upgrade(rid, _upgraded_flow(env), actor="a", reason="r")


def test_a_renamed_step_that_already_acted_is_not_moved(env: Env) -> None:
    """A step that sent, then stopped before its checkpoint: under a new name its
    recorded effect would not replay, so the upgrade is refused; a mapping that keeps
    the name goes through and the effect replays."""

    class Stop(Exception):
        pass

    v1 = Flow("ship", version="1")

    @v1.step(start=True)
    def send(ctx: StepContext) -> Transition:
        env.send(ctx, "ship@1", "box")
        raise Stop

    rt = env.runtime(v1)
    rid = rt.start("ship", run_id="s-1")
    assert rt.drive(rid).status is RunStatus.FAILED  # it sent, then raised
    assert len(env.provider.deliveries) == 1

    def v2(renames: dict[str, str]) -> Flow:
        flow = Flow("ship", version="2", upgrades={"1": renames})
        for name in {"send", *renames.values()}:

            @flow.step(name=name, start=name == "send")
            def go(ctx: StepContext) -> Transition:
                env.send(ctx, "ship@1", "box")
                return ctx.end()

        return flow

    with pytest.raises(UpgradeRefused, match="act again"):
        env.operator.upgrade(rid, v2({"send": "dispatch"}), actor="a", reason="r")
    assert env.store.get_run(rid).code_version == "1"
    keep = v2({})
    env.operator.upgrade(rid, keep, actor="a", reason="r")
    env.operator.retry(rid, actor="a", reason="fixed")
    assert env.runtime(keep).drive(rid).status is RunStatus.COMPLETED
    assert len(env.provider.deliveries) == 1  # replayed, not sent again


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"version": ""}, "version"),
        ({"version": "has space"}, "version"),
        ({"serves": "1"}, "serves"),
        ({"serves": (1,)}, "serves"),
        ({"upgrades": {"1": ["a"]}}, "upgrades"),
    ],
)
def test_malformed_versions_are_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Flow("f", **kw)
