"""The waits table: approvals bound to what was requested, signals, timers, ready runs.

Every test runs on SQLite and PostgreSQL. "Another process" is a second :class:`Store`
on the same database (no shared caches); races use threads, each with its own store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from onceonly.checkpoint import (
    ConfigurationError,
    RunNotFound,
    RunStatus,
    Store,
    WaitKind,
    WaitNotFound,
    WaitRefused,
    Waits,
    WaitStatus,
    subject_hash,
)
from tests.ledger_support import Clock, Ledgers

SUBJECT = {"vendor": "acme", "amount": 1250, "iban": "DE02 1203 0000 0000 2020 51"}


@pytest.fixture
def waits(store: Store, clock: Clock) -> Waits:
    return Waits(store, clock=clock)


def waiting_run(store: Store, run_id: str = "run-1") -> str:
    return store.create_run("flow", run_id=run_id, status=RunStatus.WAITING).run_id


def status_of(store: Store, run_id: str) -> RunStatus:
    return store.get_run(run_id).status


def refused(fn: Callable[[], Any]) -> str:
    with pytest.raises(WaitRefused) as info:
        fn()
    return info.value.reason


# -- approvals ---------------------------------------------------------------------------


def test_an_approval_is_bound_to_the_hash_of_its_subject(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    opened = waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT, requested_by="alice")
    assert opened.status is WaitStatus.OPEN
    assert opened.subject == SUBJECT
    assert opened.subject_hash == subject_hash(store, SUBJECT)

    changed = {**SUBJECT, "iban": "GB33 BUKB 2020 1555 5555 55"}
    reason = refused(
        lambda: waits.approve(rid, "pay", actor="bob", subject_hash=subject_hash(store, changed))
    )
    assert reason == "subject_changed"
    after = waits.get(rid, "pay")
    assert (after.status, after.decided_by, after.decided_at) == (WaitStatus.OPEN, None, None)
    assert status_of(store, rid) is RunStatus.WAITING  # nothing recorded, nothing woken

    got = waits.approve(
        rid, "pay", actor="bob", subject_hash=subject_hash(store, SUBJECT), reason="ok"
    )
    assert (got.status, got.decided_by, got.reason) == (WaitStatus.APPROVED, "bob", "ok")
    assert status_of(store, rid) is RunStatus.RUNNING


def test_reopening_an_approval_with_another_subject_is_refused(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    first = waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    assert waits.open(rid, "pay", WaitKind.APPROVAL, subject=dict(SUBJECT)) == first  # idempotent
    assert (
        refused(lambda: waits.open(rid, "pay", WaitKind.APPROVAL, subject={**SUBJECT, "amount": 1}))
        == "subject_changed"
    )
    assert waits.get(rid, "pay").subject == SUBJECT


def test_an_expired_approval_cannot_be_decided(store: Store, waits: Waits, clock: Clock) -> None:
    rid = waiting_run(store)
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT, due_at=clock() + 60)
    digest = subject_hash(store, SUBJECT)
    assert waits.fire_if_due(rid, "pay").status is WaitStatus.OPEN  # not yet
    assert not waits.wake_if_settled(rid, "pay")
    clock.advance(60)
    assert refused(lambda: waits.approve(rid, "pay", actor="bob", subject_hash=digest)) == "expired"
    assert refused(lambda: waits.reject(rid, "pay", actor="bob")) == "expired"
    assert waits.get(rid, "pay").status is WaitStatus.OPEN
    assert status_of(store, rid) is RunStatus.WAITING
    fired = waits.fire_if_due(rid, "pay")
    assert (fired.status, fired.decided_by) == (WaitStatus.EXPIRED, "clock")
    assert refused(lambda: waits.approve(rid, "pay", actor="bob", subject_hash=digest)) == "decided"


def test_the_requester_may_not_approve_unless_allowed(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    digest = subject_hash(store, SUBJECT)
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT, requested_by="alice")
    reason = refused(lambda: waits.approve(rid, "pay", actor="alice", subject_hash=digest))
    assert reason == "self_approval"
    assert waits.get(rid, "pay").status is WaitStatus.OPEN

    waits.open(
        rid, "own", WaitKind.APPROVAL, subject=SUBJECT, requested_by="alice", allow_self=True
    )
    assert waits.approve(rid, "own", actor="alice", subject_hash=digest).status is (
        WaitStatus.APPROVED
    )


def test_a_decision_is_final(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    digest = subject_hash(store, SUBJECT)
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    waits.approve(rid, "pay", actor="bob", subject_hash=digest)
    assert refused(lambda: waits.approve(rid, "pay", actor="bob", subject_hash=digest)) == "decided"
    assert refused(lambda: waits.reject(rid, "pay", actor="carol")) == "decided"
    final = waits.get(rid, "pay")
    assert (final.status, final.decided_by) == (WaitStatus.APPROVED, "bob")


def test_a_rejection_wakes_the_run_and_is_final(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    got = waits.reject(rid, "pay", actor="carol", reason="wrong vendor")
    assert (got.status, got.decided_by, got.reason) == (
        WaitStatus.REJECTED,
        "carol",
        "wrong vendor",
    )
    assert status_of(store, rid) is RunStatus.RUNNING
    digest = subject_hash(store, SUBJECT)
    assert refused(lambda: waits.approve(rid, "pay", actor="bob", subject_hash=digest)) == "decided"


def test_decisions_need_an_actor_and_an_existing_approval(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    digest = subject_hash(store, SUBJECT)
    with pytest.raises(WaitNotFound):
        waits.approve(rid, "nope", actor="bob", subject_hash=digest)
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    with pytest.raises(ConfigurationError):
        waits.approve(rid, "pay", actor="", subject_hash=digest)
    waits.open(rid, "tick", WaitKind.TIMER, due_at=1e12)
    assert refused(lambda: waits.reject(rid, "tick", actor="bob")) == "not_approval"


def test_concurrent_approvers_exactly_one_wins(
    store: Store, ledgers: Ledgers, clock: Clock
) -> None:
    rid = waiting_run(store)
    Waits(store, clock=clock).open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    digest = subject_hash(store, SUBJECT)
    approvers = [Waits(ledgers.store(), clock=clock) for _ in range(6)]
    start = threading.Barrier(len(approvers))
    outcomes: dict[str, str] = {}

    def approve(i: int, w: Waits) -> None:
        start.wait()
        try:
            if i % 2:
                w.reject(rid, "pay", actor=f"a{i}")
            else:
                w.approve(rid, "pay", actor=f"a{i}", subject_hash=digest)
            outcomes[f"a{i}"] = "won"
        except WaitRefused as exc:
            outcomes[f"a{i}"] = exc.reason

    threads = [threading.Thread(target=approve, args=(i, w)) for i, w in enumerate(approvers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [a for a, o in outcomes.items() if o == "won"]
    assert len(outcomes) == len(approvers)
    assert len(winners) == 1, outcomes
    assert set(outcomes.values()) == {"won", "decided"}
    final = Waits(store, clock=clock).get(rid, "pay")
    assert final.decided_by == winners[0]
    assert final.status is (WaitStatus.REJECTED if int(winners[0][1:]) % 2 else WaitStatus.APPROVED)


# -- signals -----------------------------------------------------------------------------


def test_a_signal_before_the_wait_is_kept_and_settles_it(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    early = waits.signal(rid, "docs", {"files": 3}, actor="portal")
    assert (early.status, early.payload, early.decided_by) == (
        WaitStatus.DELIVERED,
        {"files": 3},
        "portal",
    )
    assert status_of(store, rid) is RunStatus.WAITING  # nothing waits for it yet
    opened = waits.open(rid, "docs", WaitKind.SIGNAL)
    assert (opened.status, opened.payload) == (WaitStatus.DELIVERED, {"files": 3})
    assert waits.wake_if_settled(rid, "docs")
    assert status_of(store, rid) is RunStatus.RUNNING


def test_a_signal_after_the_wait_opened_wakes_the_run(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    assert waits.open(rid, "docs", WaitKind.SIGNAL).status is WaitStatus.OPEN
    assert not waits.wake_if_settled(rid, "docs")
    got = waits.signal(rid, "docs", [1, 2], actor="portal")
    assert (got.status, got.payload) == (WaitStatus.DELIVERED, [1, 2])
    assert status_of(store, rid) is RunStatus.RUNNING


def test_a_signal_is_delivered_once(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    waits.open(rid, "docs", WaitKind.SIGNAL)
    waits.signal(rid, "docs", "first")
    assert refused(lambda: waits.signal(rid, "docs", "second")) == "decided"
    assert waits.get(rid, "docs").payload == "first"
    waits.signal(rid, "early", "one")  # before any wait: kept, and still only once
    assert refused(lambda: waits.signal(rid, "early", "two")) == "decided"
    assert waits.get(rid, "early").payload == "one"


def test_kinds_do_not_mix(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    assert refused(lambda: waits.signal(rid, "pay", "x")) == "kind_mismatch"
    assert refused(lambda: waits.open(rid, "pay", WaitKind.SIGNAL)) == "kind_mismatch"
    waits.signal(rid, "docs", 1)
    assert refused(lambda: waits.open(rid, "docs", WaitKind.TIMER, due_at=1.0)) == "kind_mismatch"
    digest = subject_hash(store, None)
    assert refused(lambda: waits.approve(rid, "docs", actor="b", subject_hash=digest)) == (
        "not_approval"
    )
    assert waits.get(rid, "pay").status is WaitStatus.OPEN
    with pytest.raises(RunNotFound):
        waits.signal("no-such-run", "docs", 1)
    with pytest.raises(ConfigurationError):
        waits.open(rid, "tick", WaitKind.TIMER)  # a timer needs its due time


# -- timers, cancel ----------------------------------------------------------------------


def test_a_timer_fires_when_due(store: Store, waits: Waits, clock: Clock) -> None:
    rid = waiting_run(store)
    waits.open(rid, "tick", WaitKind.TIMER, due_at=clock() + 30)
    assert waits.fire_if_due(rid, "tick").status is WaitStatus.OPEN
    assert not waits.wake_if_settled(rid, "tick")
    clock.advance(30)
    assert waits.wake_if_settled(rid, "tick")  # due counts as ready
    assert status_of(store, rid) is RunStatus.RUNNING
    fired = waits.fire_if_due(rid, "tick")
    assert fired.status is WaitStatus.FIRED
    assert fired.decided_at == clock()


def test_cancel_open_closes_only_open_waits(store: Store, waits: Waits) -> None:
    rid = waiting_run(store)
    other = waiting_run(store, "run-2")
    waits.open(rid, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    waits.open(rid, "docs", WaitKind.SIGNAL)
    waits.open(rid, "done", WaitKind.SIGNAL)
    waits.signal(rid, "done", 1)
    waits.open(other, "pay", WaitKind.APPROVAL, subject=SUBJECT)
    assert waits.cancel_open(rid, actor="ops", reason="duplicate order") == 2
    by_name = {w.name: w for w in waits.find(run_id=rid)}
    assert {n: w.status for n, w in by_name.items()} == {
        "pay": WaitStatus.CANCELLED,
        "docs": WaitStatus.CANCELLED,
        "done": WaitStatus.DELIVERED,
    }
    assert (by_name["pay"].decided_by, by_name["pay"].reason) == ("ops", "duplicate order")
    assert waits.get(other, "pay").status is WaitStatus.OPEN
    digest = subject_hash(store, SUBJECT)
    assert refused(lambda: waits.approve(rid, "pay", actor="b", subject_hash=digest)) == "decided"
    assert refused(lambda: waits.signal(rid, "docs", 1)) == "decided"
    assert waits.cancel_open(rid, actor="ops") == 0
    assert [w.name for w in waits.find(status=WaitStatus.OPEN)] == ["pay"]


# -- ready runs --------------------------------------------------------------------------


def test_claim_ready_finds_exactly_the_runs_that_can_move(
    store: Store, waits: Waits, clock: Clock
) -> None:
    now = clock()
    store.create_run("flow", run_id="new")  # running, never leased
    store.create_run("flow", run_id="held")
    store.acquire_lease("held", "other-worker", 3600)
    store.create_run("flow", run_id="done", status=RunStatus.COMPLETED)
    for rid, kind, due in [
        ("timer-due", WaitKind.TIMER, now - 1),
        ("timer-later", WaitKind.TIMER, now + 600),
        ("approval-expired", WaitKind.APPROVAL, now - 1),
        ("approval-open", WaitKind.APPROVAL, now + 600),
        ("approval-forever", WaitKind.APPROVAL, None),
        ("signal", WaitKind.SIGNAL, None),
    ]:
        waiting_run(store, rid)
        waits.open(rid, "w", kind, due_at=due, subject=SUBJECT)
    # Fired by a worker that died before its checkpoint: firing woke the run (running),
    # so it is ready again rather than stuck waiting on a timer that is no longer open.
    waiting_run(store, "timer-fired")
    waits.open("timer-fired", "w", WaitKind.TIMER, due_at=now - 1)
    waits.fire_if_due("timer-fired", "w")

    got = waits.claim_ready("me", 60, limit=100)
    assert sorted(got) == ["approval-expired", "new", "timer-due", "timer-fired"]
    for rid in got:
        run = store.get_run(rid)
        assert run.lease_owner == "me"
        assert run.lease_expires_at == pytest.approx(now + 60)
    assert waits.claim_ready("you", 60, limit=100) == []  # leased: nobody else gets them
    clock.advance(61)  # the leases lapse (a crashed worker): ready again
    assert sorted(waits.claim_ready("you", 60, limit=100)) == sorted(got)


def test_claim_ready_respects_the_limit_and_age_order(
    store: Store, waits: Waits, clock: Clock
) -> None:
    for i in range(5):
        store.create_run("flow", run_id=f"r{i}")
        clock.advance(1)
    store.update_run("r0", next_step="touched")  # updated last: claimed last
    first = waits.claim_ready("w1", 60, limit=2)
    second = waits.claim_ready("w2", 60, limit=2)
    third = waits.claim_ready("w3", 60, limit=2)
    assert [len(first), len(second), len(third)] == [2, 2, 1]
    assert third == ["r0"]
    assert sorted(first + second + third) == [f"r{i}" for i in range(5)]
    assert waits.claim_ready("w4", 60, limit=2) == []
    # A worker restarted under its own name takes its runs back at once.
    assert waits.claim_ready("w1", 60, limit=5) == first
    for bad in ({"ttl_s": 0, "limit": 1}, {"ttl_s": 1, "limit": 0}):
        with pytest.raises(ConfigurationError):
            waits.claim_ready("me", bad["ttl_s"], limit=int(bad["limit"]))


def test_two_owners_never_claim_the_same_run(store: Store, ledgers: Ledgers, clock: Clock) -> None:
    total = 40
    for i in range(total):
        store.create_run("flow", run_id=f"r{i:02}")
    workers = [Waits(ledgers.store(), clock=clock) for _ in range(4)]
    start = threading.Barrier(len(workers))
    claimed: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def work(i: int, w: Waits) -> None:
        mine: list[str] = []
        claimed[f"w{i}"] = mine
        start.wait()
        try:
            while True:
                # Its own leases count as free (a restart under the same name): only
                # runs new to this owner are progress.
                got = [r for r in w.claim_ready(f"w{i}", 600, limit=3) if r not in mine]
                if not got:
                    return
                mine.extend(got)
        except BaseException as exc:  # noqa: BLE001  (reported by the test thread)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    every = [rid for mine in claimed.values() for rid in mine]
    assert sorted(every) == [f"r{i:02}" for i in range(total)]  # each exactly once
    for owner, mine in claimed.items():
        for rid in mine:
            assert store.get_run(rid).lease_owner == owner
