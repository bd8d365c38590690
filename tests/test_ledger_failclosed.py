"""Fail closed (I7): when the ledger cannot be written nothing is acted on; when an
outcome cannot be recorded the ledger stops (every later call raises LedgerUnavailable)
and a new ledger recovers from what is on disk, with the effect in doubt.

Faults come from outside the library: another connection holding SQLite's write lock,
a PostgreSQL database that refuses connections after its backends were terminated, a
statement that fails inside the transaction (an I/O error injected by a trigger), and a
transaction whose every statement succeeded but whose COMMIT fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from onceonly.checkpoint import DatabaseRetry, Store
from onceonly.ledger import (
    Claim,
    EffectInDoubt,
    EffectInFlight,
    EffectStatus,
    Evidence,
    Ledger,
    LedgerUnavailable,
    Replay,
)
from tests.ledger_support import (
    Clock,
    Ledgers,
    fail_commits,
    fail_statements,
    ident,
    unwritable,
)

FAULTS = ["unwritable", "statement fails", "commit fails"]


def open_ledger(ledgers: Ledgers, **kwargs: Any) -> Ledger:
    """A ledger on its own store, whose SQLite writers give up on a held lock quickly and
    whose store retries a lock held or a connection refused only briefly (by default it
    retries for 30 s; tests/test_transient.py rides such failures out)."""
    store_kwargs = kwargs.pop("store_kwargs", {})
    return ledgers.fresh(
        store_kwargs={"busy_timeout_ms": 100, "retry": DatabaseRetry(budget_s=0.2), **store_kwargs},
        **kwargs,
    )


def fault(name: str, led: Ledger, db_url: str) -> contextlib.AbstractContextManager[None]:
    if name == "unwritable":
        return unwritable(db_url)
    if name == "statement fails":
        return fail_statements(led.store.engine, "oo_effects")
    return fail_commits(led.store.engine)


class Act:
    """A provider call that must not happen while the ledger cannot be written."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, claim: Claim) -> str:
        self.calls += 1
        return f"sent:{claim.epoch}"

    async def async_call(self, claim: Claim) -> str:
        self.calls += 1
        await asyncio.sleep(0)
        return f"sent:{claim.epoch}"


# -- nothing is acted on ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["new run", "prefetched run", "outside a run"])
@pytest.mark.parametrize("name", FAULTS)
def test_an_unrecordable_intent_is_never_acted_on(
    name: str, where: str, db_url: str, ledgers: Ledgers
) -> None:
    led = open_ledger(ledgers)
    act = Act()
    if where == "new run":
        target = ident(0, run="run-new")
    elif where == "prefetched run":
        assert led.perform(ident(0), {"n": 0}, act) == "sent:1"
        target = ident(1)
    else:
        target = ident(run=None, explicit="inv-1", effect="charge@1")
    calls = act.calls
    with fault(name, led, db_url):
        with pytest.raises(LedgerUnavailable):
            led.perform(target, {"n": 1}, act)
        with pytest.raises(LedgerUnavailable):
            led.claim(target, {"n": 1})
        with pytest.raises(LedgerUnavailable):
            asyncio.run(led.aperform(target, {"n": 1}, act.async_call))
    assert act.calls == calls
    # a refused intent does not stop the ledger: nothing was acted on
    assert open_ledger(ledgers).effects(status=EffectStatus.CLAIMED) == []
    assert led.perform(target, {"n": 1}, act) == "sent:1"
    assert act.calls == calls + 1


# -- an unrecorded outcome stops the ledger ------------------------------------------------


def refuses_everything(led: Ledger, claim: Claim) -> list[str]:
    """Names of the calls a stopped ledger did NOT refuse with LedgerUnavailable."""
    act = Act()
    calls: dict[str, Callable[[], object]] = {
        "claim": lambda: led.claim(ident(90), {"n": 90}),
        "claim other run": lambda: led.claim(ident(0, run="run-other"), {"n": 0}),
        "perform": lambda: led.perform(ident(91), {"n": 91}, act),
        "aperform": lambda: asyncio.run(led.aperform(ident(92), {"n": 92}, act.async_call)),
        "commit": lambda: led.commit(claim, "late"),
        "fail": lambda: led.fail(claim, "E", "late"),
        "mark_unknown": lambda: led.mark_unknown(claim, "late"),
        "release": lambda: led.release(claim, "late"),
        "renew": lambda: led.renew(claim),
        "reconcile": lambda: led.reconcile(claim.key_id, Evidence.HAPPENED, result=1),
        "resolve": lambda: led.resolve(claim.key_id, happened=True, evidence="e", actor="a"),
        "erase": lambda: led.erase("run-1"),
    }
    not_refused = []
    for what, call in calls.items():
        try:
            call()
        except LedgerUnavailable:
            continue
        except Exception as exc:  # noqa: BLE001  (reported as not refused)
            not_refused.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        not_refused.append(f"{what}: returned")
    assert act.calls == 0, "a stopped ledger acted"
    return not_refused


OUTCOMES: dict[str, Callable[[Ledger, Claim], object]] = {
    "commit": lambda led, c: led.commit(c, {"sent": True}),
    "fail": lambda led, c: led.fail(c, "Rejected", "no"),
    "mark_unknown": lambda led, c: led.mark_unknown(c, "timeout"),
    "release": lambda led, c: led.release(c, "refused"),
}


@pytest.mark.parametrize("name", FAULTS)
def test_an_unrecorded_outcome_stops_the_ledger_and_a_new_one_recovers(
    name: str, db_url: str, ledgers: Ledgers, clock: Clock, subtests: pytest.Subtests
) -> None:
    for i, (outcome, record) in enumerate(OUTCOMES.items()):
        with subtests.test(msg=outcome):
            worker = open_ledger(ledgers, owner=f"worker-{i}")
            c = worker.claim(ident(i), {"n": i})
            assert isinstance(c, Claim)
            with fault(name, worker, db_url), pytest.raises(LedgerUnavailable):
                record(worker, c)
            assert refuses_everything(worker, c) == []

            # the restarted worker finds the effect as it was before the lost write
            restarted = open_ledger(ledgers, owner=f"restarted-{i}")
            rec = restarted.get(c.key_id)
            assert (rec.status, rec.epoch, rec.lease_owner) == (
                EffectStatus.CLAIMED,
                1,
                f"worker-{i}",
            )
            with pytest.raises(EffectInFlight):
                restarted.claim(ident(i), {"n": i})
            clock.advance(31.0)
            with pytest.raises(EffectInDoubt) as exc:
                restarted.claim(ident(i), {"n": i})
            assert exc.value.status == "unknown"
            restarted.reconcile(c.key_id, Evidence.HAPPENED, result="probed")
            out = restarted.claim(ident(i), {"n": i})
            assert isinstance(out, Replay)
            assert out.result == "probed"
            assert restarted.verify().ok


def test_an_unrecorded_outcome_of_a_reclaimed_effect_stops_the_ledger(
    db_url: str, ledgers: Ledgers, clock: Clock
) -> None:
    """The worker that re-sends after a release never created the entry's data key."""
    first = open_ledger(ledgers, owner="worker-a")
    c1 = first.claim(ident(), {"n": 1})
    assert isinstance(c1, Claim)
    first.release(c1, "connection refused")
    second = open_ledger(ledgers, owner="worker-b")
    c2 = second.claim(ident(), {"n": 1})
    assert isinstance(c2, Claim)
    assert c2.epoch == 2
    with unwritable(db_url), pytest.raises(LedgerUnavailable):
        second.commit(c2, "sent")
    assert refuses_everything(second, c2) == []
    restarted = open_ledger(ledgers)
    assert restarted.get(c2.key_id).status is EffectStatus.CLAIMED
    clock.advance(31.0)
    with pytest.raises(EffectInDoubt):
        restarted.claim(ident(), {"n": 1})


def test_an_unrecorded_outcome_with_async_durability_stops_the_ledger(
    db_url: str, ledgers: Ledgers, clock: Clock
) -> None:
    worker = open_ledger(ledgers, store_kwargs={"durability": "async"})
    c = worker.claim(ident(), {"n": 1})
    assert isinstance(c, Claim)
    with fail_commits(worker.store.engine), pytest.raises(LedgerUnavailable):
        worker.commit(c, "sent")
    assert refuses_everything(worker, c) == []
    restarted = open_ledger(ledgers)
    clock.advance(31.0)
    with pytest.raises(EffectInDoubt):
        restarted.claim(ident(), {"n": 1})


def test_aperform_whose_outcome_cannot_be_recorded_stops_the_ledger(
    db_url: str, ledgers: Ledgers
) -> None:
    worker = open_ledger(ledgers, store_kwargs={"durability": "async"})
    act = Act()

    with contextlib.ExitStack() as broken:

        async def act_then_break(claim: Claim) -> str:
            act.calls += 1
            broken.enter_context(fail_commits(worker.store.engine))
            await asyncio.sleep(0)
            return "sent"

        with pytest.raises(LedgerUnavailable):
            asyncio.run(worker.aperform(ident(), {"n": 1}, act_then_break))
    assert act.calls == 1
    with pytest.raises(LedgerUnavailable):
        asyncio.run(worker.aperform(ident(1), {"n": 1}, act.async_call))
    assert act.calls == 1
    assert open_ledger(ledgers).get(worker.key_id(ident())).status is EffectStatus.CLAIMED


def test_a_transaction_that_failed_to_commit_leaves_no_trace_in_the_chain(
    ledgers: Ledgers, store: Store
) -> None:
    """A worker whose claim failed at COMMIT keeps working; its next events must chain
    after what is on disk (another worker appended meanwhile), not after its lost one."""
    a = open_ledger(ledgers, owner="worker-a")
    b = open_ledger(ledgers, owner="worker-b")
    a.commit(claim_of(a.claim(ident(0), 0)), "zero")
    with fail_commits(store.engine), pytest.raises(LedgerUnavailable):
        a.claim(ident(1), 1)
    b.claim(ident(2), 2)  # one event: the chain is as long as worker a last believed
    a.commit(claim_of(a.claim(ident(3), 3)), "three")
    report = b.verify()
    assert report.ok, report.problems
    assert [e["key_id"] for e in b.audit_events("run-1")] == [
        a.key_id(ident(0)),
        a.key_id(ident(0)),
        a.key_id(ident(2)),
        a.key_id(ident(3)),
        a.key_id(ident(3)),
    ]


def claim_of(out: Claim | Replay) -> Claim:
    assert isinstance(out, Claim), out
    return out
