"""Every operator action is in the run's audit chain (issue [12]): approvals, rejections,
edit-then-approve, edits, retries, forks, restarts, cancels, upgrades and a console's
snoozes, each an ``operator`` event with the operator's identity and reason, hash-chained
and sealed with the run's effects' events, never mistaken for an effect; and an edited or
deleted action is found by ``audit verify``. Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from onceonly.checkpoint import RunStatus
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from tests.ledger_support import Clock, Ledgers
from tests.test_runtime import Env, approve


@pytest.fixture
def env(store: Any, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


def _flow(env: Env) -> Flow:
    """``ask`` waits for an approval of the order, ``pay`` sends it (and fails while the
    state says ``boom``) as it was approved; a rejection ends the run."""
    flow = Flow("orders")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval("ok", ctx.state["order"], then="pay", on_reject="told")

    @flow.step
    def pay(ctx: StepContext) -> Transition:
        if ctx.state.get("boom"):
            raise RuntimeError("the provider's account is closed")
        env.send(ctx, "pay@1", ctx.approved("ok")["subject"])
        return ctx.end("paid")

    @flow.step
    def told(ctx: StepContext) -> Transition:
        return ctx.end("declined")

    return flow


def _actions(env: Env, run_id: str) -> list[tuple[str, str, str]]:
    """(action, actor, reason) of each recorded action, oldest first."""
    out = []
    for a in env.operator.actions(run_id):
        assert a["actor"] == a["detail"]["by"]
        out.append((a["detail"]["action"], a["actor"], a["detail"].get("reason", "")))
    return out


def test_every_operator_action_is_in_the_runs_audit_chain_and_none_is_an_effect(
    env: Env,
) -> None:
    rt = env.runtime(_flow(env))
    op = env.operator

    # approve, then the run pays
    a = rt.start("orders", {"order": "A-1"}, run_id="a")
    rt.drive(a)
    approve(env, a, "ok", actor="bob")
    assert rt.drive(a).status is RunStatus.COMPLETED
    (rec,) = op.actions(a)
    assert rec["detail"]["approval"] == "ok"
    assert rec["detail"]["subject_hash"] == op.show(a).waits[0].subject_hash

    # reject with a reason
    r = rt.start("orders", {"order": "R-1"}, run_id="r")
    rt.drive(r)
    op.reject(r, "ok", actor="carol", reason="not budgeted")
    assert _actions(env, r) == [("operator:reject", "carol", "not budgeted")]

    # edit-then-approve: one action naming the hash that was shown
    e = rt.start("orders", {"order": "E-1"}, run_id="e")
    rt.drive(e)
    shown = op.show(e).waits[0].subject_hash
    assert shown is not None
    op.approve_edited(e, "ok", actor="dave", subject_hash=shown, subject="E-2", reason="typo")
    assert rt.drive(e).status is RunStatus.COMPLETED
    (rec,) = op.actions(e)
    assert (rec["detail"]["action"], rec["detail"]["edited_from"]) == ("operator:approve", shown)
    assert rec["detail"]["subject_hash"] != shown

    # a failed run: edited, retried; then forked, restarted and (the fork) cancelled
    f = rt.start("orders", {"order": "F-1", "boom": True}, run_id="f")
    rt.drive(f)
    approve(env, f, "ok", actor="bob")
    assert rt.drive(f).status is RunStatus.FAILED
    op.edit(f, "boom", value=False, actor="erin", reason="account reopened")
    op.retry(f, actor="erin", reason="after the fix")
    assert rt.drive(f).status is RunStatus.COMPLETED
    fork = op.fork(f, 0, actor="frank", reason="try the other order", new_run_id="f2")
    op.cancel(fork, actor="frank", reason="not needed after all")
    again = op.restart(f, actor="gina", reason="the plan was wrong")
    op.record(again, "snooze", {"approval": "ok", "until": 1e10}, actor="hal")

    assert _actions(env, f) == [
        ("operator:approve", "bob", ""),
        ("operator:edit", "erin", "account reopened"),
        ("operator:retry", "erin", "after the fix"),
        ("operator:restart", "gina", f"restarted as {again}: the plan was wrong"),
    ]
    edit = op.actions(f)[1]["detail"]
    assert edit["channel"] == "boom"
    assert edit["seq"] in {c.seq for c in env.store.history(f)}  # names its checkpoint
    assert _actions(env, fork) == [
        ("operator:fork", "frank", "try the other order"),
        ("operator:cancel", "frank", "not needed after all"),
    ]
    assert op.actions(fork)[0]["detail"]["from"] == {"run": f, "seq": 0}
    assert _actions(env, again) == [("operator:snooze", "hal", "")]
    assert op.show(f).actions == op.actions(f)

    # none of them is an effect: the ledger holds the payments only, each sent once
    effects = [x for run in (a, r, e, f, fork, again) for x in env.ledger.effects(run_id=run)]
    assert sorted(x.effect for x in effects) == ["pay@1", "pay@1", "pay@1"]
    assert env.provider.sent("pay@1") == ["A-1", "E-2", "F-1"]
    report = env.ledger.verify()
    assert report.ok, report.problems


def test_an_action_recorded_again_is_not_appended_twice(env: Env) -> None:
    rt = env.runtime(_flow(env))
    rid = rt.start("orders", {"order": "A-1"}, run_id="a")
    rt.drive(rid)
    detail = {"by": "ops", "action": "operator:note", "reason": "once"}
    first = env.ledger.record_action(rid, "note#1", actor="ops", detail=detail)
    again = env.ledger.record_action(rid, "note#1", actor="ops", detail=detail)
    assert first == again
    assert len(env.operator.actions(rid)) == 1
    assert env.ledger.verify().ok


@pytest.mark.parametrize("tamper", ["edit", "delete"])
def test_an_edited_or_deleted_action_is_found_by_verify(env: Env, tamper: str) -> None:
    rt = env.runtime(_flow(env))
    rid = rt.start("orders", {"order": "A-1"}, run_id="a")
    rt.drive(rid)
    env.operator.reject(rid, "ok", actor="carol", reason="no")
    assert env.ledger.verify().ok  # the control: untouched, it verifies
    q = "?" if env.store.dialect == "sqlite" else "%s"

    def change(cur: Any) -> None:
        if tamper == "edit":
            cur.execute(
                f"UPDATE oo_audit SET detail = REPLACE(detail, 'carol', 'mallory') "
                f"WHERE chain = {q} AND event = 'operator'",
                (rid,),
            )
        else:
            cur.execute(f"DELETE FROM oo_audit WHERE chain = {q} AND event = 'operator'", (rid,))
        assert cur.rowcount == 1

    env.store.transact(change)
    report = env.ledger.verify()
    assert not report.ok
    assert any(repr(rid) in p for p in report.problems), report.problems
