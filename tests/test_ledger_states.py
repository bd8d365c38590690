"""The ledger's state machine: every transition, its compare-and-set on (key, epoch), and
the one claim/act/record path (``perform`` / ``aperform``).

Every test runs on SQLite and on PostgreSQL. "Another process" is a new Store and Ledger
on the same database (no shared caches); time moves through the ledgers' ``clock``.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from onceonly.checkpoint import ConfigurationError, Store
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectInDoubt,
    EffectInFlight,
    EffectRecord,
    EffectStatus,
    Evidence,
    InFlightPolicy,
    InvalidTransition,
    LeaseLost,
    Ledger,
    OutcomeClass,
    ProviderClass,
    Replay,
    ResultUnknown,
    UnknownEffect,
)
from tests.ledger_support import Clock, Ledgers, audit_rows, effect_row, ident, keyring


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="worker-a")


def claimed(out: Claim | Replay) -> Claim:
    assert isinstance(out, Claim), f"expected a Claim, got {out!r}"
    return out


def replayed(out: Claim | Replay) -> Replay:
    assert isinstance(out, Replay), f"expected a Replay, got {out!r}"
    return out


def events(led: Ledger, chain: str = "run-1") -> list[tuple[str, str, int, str, str]]:
    """(event, status, epoch, actor, detail) of a chain, in order."""
    return [
        (e["event"], e["status"], int(e["epoch"]), e["actor"], e["detail"])
        for e in led.audit_events(chain)
    ]


# -- claim and the outcomes ----------------------------------------------------------------


def test_claim_is_durable_before_acting(ledger: Ledger, ledgers: Ledgers, clock: Clock) -> None:
    c = claimed(
        ledger.claim(ident(), {"to": "a@example.com"}, provider_class=ProviderClass.QUERYABLE)
    )
    assert c.key_id == ledger.key_id(ident())
    assert c.epoch == 1
    assert c.attempt == 1
    assert c.resend is False
    assert c.lease_owner == "worker-a"
    assert c.lease_expires_at == pytest.approx(clock.now + 30.0)
    assert c.provider_class is ProviderClass.QUERYABLE
    assert c.provider_key == ledger.keyring.provider_key("k1", c.key_id)
    assert c.fencing_token == f"{c.provider_key}:1"
    assert c.subject == "run-1"
    assert c.chain == "run-1"

    other = ledgers.fresh()
    rec = other.get(c.key_id)
    assert rec.status is EffectStatus.CLAIMED
    assert (rec.epoch, rec.attempts, rec.lease_owner) == (1, 1, "worker-a")
    assert rec.lease_expires_at == pytest.approx(c.lease_expires_at)
    assert rec.provider_key == c.provider_key
    assert (rec.run_id, rec.step_id, rec.effect, rec.tenant) == (
        "run-1",
        "notify",
        "send_email@1",
        "acme",
    )
    assert events(other) == [("claimed", "claimed", 1, "worker-a", "")]


def test_commit_replays_in_this_and_in_another_process(ledger: Ledger, ledgers: Ledgers) -> None:
    c = claimed(ledger.claim(ident(), {"to": "a@example.com"}))
    rec = ledger.commit(c, {"message_id": "<m1@x>", "n": 1})
    assert rec.status is EffectStatus.COMMITTED
    assert rec.outcome_class is OutcomeClass.SUCCEEDED
    assert (rec.epoch, rec.attempts, rec.lease_owner, rec.lease_expires_at) == (1, 1, None, None)
    trail = events(ledger)

    again = replayed(ledger.claim(ident(), {"to": "a@example.com"}))
    assert again.result == {"message_id": "<m1@x>", "n": 1}
    assert again.record.status is EffectStatus.COMMITTED
    other = ledgers.fresh()
    there = replayed(other.claim(ident(), {"to": "a@example.com"}))
    assert there.result == {"message_id": "<m1@x>", "n": 1}
    assert there.record.key_id == c.key_id
    # replays change nothing: no transition, no event
    assert (
        events(other)
        == trail
        == [
            ("claimed", "claimed", 1, "worker-a", ""),
            ("committed", "committed", 1, "worker-a", ""),
        ]
    )
    assert other.get(c.key_id).epoch == 1


def test_failed_replays_effect_failed_with_the_recorded_error(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    rec = ledger.fail(c, "CardDeclined", "the card was declined", {"code": 402})
    assert rec.status is EffectStatus.FAILED
    assert rec.outcome_class is OutcomeClass.REJECTED
    for led in (ledger, ledgers.fresh()):
        with pytest.raises(EffectFailed) as exc:
            led.claim(ident(), {"amount": 5})
        assert exc.value.key_id == c.key_id
        assert exc.value.error_type == "CardDeclined"
        assert exc.value.message == "the card was declined"
        assert exc.value.info == {"code": 402}
        assert "CardDeclined: the card was declined" in str(exc.value)
    assert ledger.get(c.key_id).status is EffectStatus.FAILED
    assert [e[0] for e in events(ledger)] == ["claimed", "failed"]


def test_mark_unknown_puts_the_effect_in_doubt_for_everyone(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    rec = ledger.mark_unknown(c, "read timeout after sending")
    assert rec.status is EffectStatus.UNKNOWN
    assert rec.outcome_class is OutcomeClass.AMBIGUOUS
    assert (rec.lease_owner, rec.lease_expires_at) == (None, None)
    for led in (ledger, ledgers.fresh()):
        with pytest.raises(EffectInDoubt) as exc:
            led.claim(ident(), {"amount": 5})
        assert exc.value.key_id == c.key_id
        assert exc.value.status == "unknown"
        assert exc.value.provider_class == "C"
    assert events(ledger)[-1] == ("unknown", "unknown", 1, "worker-a", "read timeout after sending")
    assert ledger.get(c.key_id).epoch == 1


def test_release_lets_the_next_claim_send_again_with_the_next_epoch(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    c1 = claimed(ledger.claim(ident(), {"amount": 5}))
    rec = ledger.release(c1, "connection refused")
    assert rec.status is EffectStatus.NOT_HAPPENED
    assert rec.outcome_class is OutcomeClass.NOT_SENT

    other = ledgers.fresh(owner="worker-b")
    c2 = claimed(other.claim(ident(), {"amount": 5}))
    assert (c2.key_id, c2.provider_key) == (c1.key_id, c1.provider_key)
    assert (c2.epoch, c2.attempt, c2.lease_owner) == (2, 2, "worker-b")
    assert c2.fencing_token == f"{c1.provider_key}:2"
    assert other.commit(c2, "sent").status is EffectStatus.COMMITTED
    assert replayed(ledger.claim(ident(), {"amount": 5})).result == "sent"
    assert events(other) == [
        ("claimed", "claimed", 1, "worker-a", ""),
        ("not_sent", "not_happened", 1, "worker-a", "connection refused"),
        ("reclaimed", "claimed", 2, "worker-b", ""),
        ("committed", "committed", 2, "worker-b", ""),
    ]


def test_a_stale_epoch_changes_nothing(ledger: Ledger, ledgers: Ledgers, store: Store) -> None:
    c1 = claimed(ledger.claim(ident(), {"amount": 5}))
    ledger.release(c1)
    other = ledgers.fresh(owner="worker-b")
    c2 = claimed(other.claim(ident(), {"amount": 5}))
    row_before, audit_before = effect_row(store.engine, c1.key_id), audit_rows(store.engine)

    stale_calls: dict[str, Callable[[], object]] = {
        "commit": lambda: ledger.commit(c1, "late result"),
        "fail": lambda: ledger.fail(c1, "E", "late"),
        "mark_unknown": lambda: ledger.mark_unknown(c1, "late"),
        "release": lambda: ledger.release(c1, "late"),
        "renew": lambda: ledger.renew(c1),
    }
    for name, call in stale_calls.items():
        with pytest.raises(LeaseLost) as exc:
            call()
        assert (exc.value.key_id, exc.value.epoch) == (c1.key_id, 1), name
        assert (exc.value.current_epoch, exc.value.status) == (2, "claimed"), name
        assert effect_row(store.engine, c1.key_id) == row_before, name
    # Each refused outcome left a trace (a renewal is no outcome), the row did not move.
    late = audit_rows(store.engine)[len(audit_before) :]
    assert audit_rows(store.engine)[: len(audit_before)] == audit_before
    assert [e[-9:-5] for e in late] == [("late_outcome", 1, "claimed", "worker-a")] * 4
    assert ledger.verify().ok

    # the current holder is unaffected, and the stale worker's ledger still works
    other.commit(c2, "on time")
    assert replayed(ledger.claim(ident(), {"amount": 5})).result == "on time"
    assert ledger.get(c1.key_id).epoch == 2


def test_a_second_outcome_for_the_same_claim_is_refused(ledger: Ledger, store: Store) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    ledger.commit(c, "first")
    row, trail = effect_row(store.engine, c.key_id), audit_rows(store.engine)
    calls: list[Callable[[], object]] = [
        lambda: ledger.commit(c, "second"),
        lambda: ledger.fail(c, "E", "m"),
        lambda: ledger.mark_unknown(c),
        lambda: ledger.release(c),
    ]
    for call in calls:
        with pytest.raises(LeaseLost) as exc:
            call()
        assert exc.value.status == "committed"
    assert effect_row(store.engine, c.key_id) == row
    assert audit_rows(store.engine)[: len(trail)] == trail
    assert [e[3] for e in audit_rows(store.engine)[len(trail) :]] == ["late_outcome"] * 4
    assert ledger.verify().ok
    assert replayed(ledger.claim(ident(), {"amount": 5})).result == "first"


# -- leases -----------------------------------------------------------------------------


def test_an_expired_lease_is_in_doubt_never_free(
    ledger: Ledger, ledgers: Ledgers, clock: Clock
) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    other = ledgers.fresh(owner="worker-b")
    clock.advance(29.0)
    with pytest.raises(EffectInFlight):
        other.claim(ident(), {"amount": 5})
    clock.advance(1.5)
    with pytest.raises(EffectInDoubt) as exc:
        other.claim(ident(), {"amount": 5})
    assert exc.value.status == "unknown"
    rec = other.get(c.key_id)
    assert rec.status is EffectStatus.UNKNOWN
    assert (rec.epoch, rec.attempts, rec.lease_owner) == (1, 1, None)
    assert events(other)[-1][:4] == ("lease_expired", "unknown", 1, "worker-b")
    # still in doubt for everyone, including the original owner, whose outcome is fenced
    with pytest.raises(EffectInDoubt):
        ledger.claim(ident(), {"amount": 5})
    with pytest.raises(LeaseLost) as lost:
        ledger.commit(c, "too late")
    assert lost.value.status == "unknown"
    assert other.get(c.key_id).status is EffectStatus.UNKNOWN


def test_renew_keeps_a_long_call_live(ledger: Ledger, ledgers: Ledgers, clock: Clock) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    clock.advance(20.0)
    renewed = ledger.renew(c)
    assert renewed.lease_expires_at == pytest.approx(clock.now + 30.0)
    assert (renewed.epoch, renewed.key_id, renewed.provider_key) == (
        c.epoch,
        c.key_id,
        c.provider_key,
    )
    assert ledger.get(c.key_id).lease_expires_at == pytest.approx(renewed.lease_expires_at)
    clock.advance(20.0)  # past the first lease, inside the renewed one
    with pytest.raises(EffectInFlight):
        ledgers.fresh(owner="worker-b").claim(ident(), {"amount": 5})
    assert ledger.commit(renewed, "done").status is EffectStatus.COMMITTED


def test_renew_of_an_expired_claim_that_someone_moved_on_is_refused(
    ledger: Ledger, ledgers: Ledgers, clock: Clock
) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    clock.advance(31.0)
    with pytest.raises(EffectInDoubt):
        ledgers.fresh(owner="worker-b").claim(ident(), {"amount": 5})
    with pytest.raises(LeaseLost):
        ledger.renew(c)


def test_a_live_claim_is_in_flight_for_other_workers(
    ledger: Ledger, ledgers: Ledgers, store: Store
) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    row, trail = effect_row(store.engine, c.key_id), audit_rows(store.engine)
    other = ledgers.fresh(owner="worker-b", in_flight=InFlightPolicy(wait_s=0))
    started = time.monotonic()
    with pytest.raises(EffectInFlight) as exc:
        other.claim(ident(), {"amount": 5})
    assert time.monotonic() - started < 2.0
    assert exc.value.key_id == c.key_id
    assert exc.value.owner == "worker-a"
    assert exc.value.expires_at == pytest.approx(c.lease_expires_at)
    # the same worker asking twice is in flight too: it never gets a second claim
    with pytest.raises(EffectInFlight):
        ledger.claim(ident(), {"amount": 5})
    assert effect_row(store.engine, c.key_id) == row
    assert audit_rows(store.engine) == trail


@pytest.mark.parametrize("outcome", ["commit", "fail", "mark_unknown", "release"])
def test_a_waiting_claimer_gets_the_owners_outcome(
    outcome: str, db_url: str, ledgers: Ledgers
) -> None:
    owner = ledgers.fresh(owner="worker-a", clock=time.time)
    waiter = ledgers.fresh(
        owner="worker-b",
        clock=time.time,
        in_flight=InFlightPolicy(wait_s=20.0, initial_backoff_s=0.01, max_backoff_s=0.05),
    )
    c = claimed(owner.claim(ident(), {"amount": 5}))
    got: list[Any] = []

    def wait() -> None:
        try:
            got.append(waiter.claim(ident(), {"amount": 5}))
        except Exception as exc:  # noqa: BLE001  (handed to the test thread)
            got.append(exc)

    t = threading.Thread(target=wait)
    started = time.monotonic()
    t.start()
    time.sleep(0.3)
    assert not got, "the waiter returned while the owner's claim was live"
    if outcome == "commit":
        owner.commit(c, "delivered")
    elif outcome == "fail":
        owner.fail(c, "Rejected", "no such mailbox")
    elif outcome == "mark_unknown":
        owner.mark_unknown(c, "timeout")
    else:
        owner.release(c, "connection refused")
    t.join(timeout=15)
    assert not t.is_alive()
    assert time.monotonic() - started >= 0.3
    [res] = got
    if outcome == "commit":
        assert replayed(res).result == "delivered"
    elif outcome == "fail":
        assert isinstance(res, EffectFailed)
        assert (res.error_type, res.message) == ("Rejected", "no such mailbox")
    elif outcome == "mark_unknown":
        assert isinstance(res, EffectInDoubt)
        assert res.status == "unknown"
    else:
        again = claimed(res)
        assert (again.epoch, again.lease_owner) == (2, "worker-b")


def test_waiting_gives_up_after_wait_s(ledgers: Ledgers) -> None:
    owner = ledgers.fresh(owner="worker-a", clock=time.time)
    waiter = ledgers.fresh(owner="worker-b", clock=time.time, in_flight=InFlightPolicy(wait_s=0.4))
    claimed(owner.claim(ident(), {"amount": 5}))
    started = time.monotonic()
    with pytest.raises(EffectInFlight) as exc:
        waiter.claim(ident(), {"amount": 5})
    assert 0.35 <= time.monotonic() - started < 5.0
    assert exc.value.owner == "worker-a"


# -- reconciliation ------------------------------------------------------------------------


def in_doubt(led: Ledger, args: Any = None, **kwargs: Any) -> Claim:
    """Claim ident() and mark it UNKNOWN; return the (now stale) claim."""
    c = claimed(led.claim(ident(), {"amount": 5} if args is None else args, **kwargs))
    led.mark_unknown(c, "timeout")
    return c


def test_reconcile_happened_commits_the_probed_result(ledger: Ledger, ledgers: Ledgers) -> None:
    c = in_doubt(ledger, provider_class=ProviderClass.QUERYABLE)
    rec = ledger.reconcile(
        c.key_id, Evidence.HAPPENED, result={"id": 7}, actor="probe:imap", detail="found"
    )
    assert isinstance(rec, EffectRecord)
    assert rec.status is EffectStatus.COMMITTED
    assert rec.epoch == 1
    for led in (ledger, ledgers.fresh()):
        assert replayed(led.claim(ident(), {"amount": 5})).result == {"id": 7}
    assert events(ledger)[-1] == ("reconciled", "committed", 1, "probe:imap", "found")


def test_reconcile_not_happened_allows_a_resend_with_the_next_epoch(ledger: Ledger) -> None:
    c = in_doubt(ledger, provider_class=ProviderClass.QUERYABLE)
    rec = ledger.reconcile(c.key_id, "not_happened")
    assert isinstance(rec, EffectRecord)
    assert rec.status is EffectStatus.NOT_HAPPENED
    again = claimed(ledger.claim(ident(), {"amount": 5}))
    assert (again.epoch, again.attempt, again.provider_key) == (2, 2, c.provider_key)
    assert events(ledger)[-2][:2] == ("reconciled", "not_happened")


def test_reconcile_window_open_resends_with_the_same_provider_key(
    ledger: Ledger, ledgers: Ledgers, clock: Clock
) -> None:
    c = in_doubt(ledger, provider_class=ProviderClass.DEDUPLICATING, window_s=3600.0)
    clock.advance(600.0)
    other = ledgers.fresh(owner="worker-b")
    resend = other.reconcile(c.key_id, Evidence.WINDOW_OPEN)
    assert isinstance(resend, Claim)
    assert resend.resend is True
    assert (resend.key_id, resend.provider_key) == (c.key_id, c.provider_key)
    assert (resend.epoch, resend.attempt, resend.lease_owner) == (2, 2, "worker-b")
    assert resend.fencing_token == f"{c.provider_key}:2"
    rec = other.get(c.key_id)
    assert (rec.status, rec.epoch) == (EffectStatus.CLAIMED, 2)
    with pytest.raises(LeaseLost):
        ledger.commit(c, "from the first attempt")
    other.commit(resend, "deduplicated by provider")
    assert replayed(ledger.claim(ident(), {"amount": 5})).result == "deduplicated by provider"
    assert [e[:3] for e in events(other)] == [
        ("claimed", "claimed", 1),
        ("unknown", "unknown", 1),
        ("resend", "claimed", 2),
        ("late_outcome", "claimed", 1),  # the first attempt's commit, refused
        ("committed", "committed", 2),
    ]


def test_reconcile_window_closed_needs_a_human(ledger: Ledger, clock: Clock) -> None:
    c = in_doubt(ledger, provider_class=ProviderClass.DEDUPLICATING, window_s=3600.0)
    clock.advance(3601.0)
    rec = ledger.reconcile(c.key_id, Evidence.WINDOW_OPEN)
    assert isinstance(rec, EffectRecord)
    assert (rec.status, rec.epoch) == (EffectStatus.NEEDS_HUMAN, 1)
    with pytest.raises(EffectInDoubt) as exc:
        ledger.claim(ident(), {"amount": 5})
    assert exc.value.status == "needs_human"
    assert "resolve" in str(exc.value)
    assert events(ledger)[-1][:2] == ("needs_human", "needs_human")


@pytest.mark.parametrize("pclass", [ProviderClass.QUERYABLE, ProviderClass.OPAQUE])
def test_window_open_is_never_a_resend_for_classes_b_and_c(
    ledger: Ledger, pclass: ProviderClass
) -> None:
    c = in_doubt(ledger, provider_class=pclass)
    rec = ledger.reconcile(c.key_id, Evidence.WINDOW_OPEN)
    assert isinstance(rec, EffectRecord)
    assert (rec.status, rec.epoch) == (EffectStatus.NEEDS_HUMAN, 1)


def test_reconcile_inconclusive_needs_a_human(ledger: Ledger) -> None:
    c = in_doubt(ledger, provider_class=ProviderClass.QUERYABLE)
    rec = ledger.reconcile(c.key_id, Evidence.INCONCLUSIVE, actor="probe:imap")
    assert isinstance(rec, EffectRecord)
    assert rec.status is EffectStatus.NEEDS_HUMAN
    assert events(ledger)[-1][:4] == ("needs_human", "needs_human", 1, "probe:imap")
    with pytest.raises(InvalidTransition):
        ledger.reconcile(c.key_id, Evidence.HAPPENED, result="x")


def test_reconcile_an_expired_claim_directly(ledger: Ledger, clock: Clock) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    with pytest.raises(InvalidTransition) as exc:
        ledger.reconcile(c.key_id, Evidence.HAPPENED, result=1)
    assert exc.value.status == "claimed"
    clock.advance(31.0)
    rec = ledger.reconcile(c.key_id, Evidence.HAPPENED, result=1)
    assert isinstance(rec, EffectRecord)
    assert rec.status is EffectStatus.COMMITTED
    assert replayed(ledger.claim(ident(), {"amount": 5})).result == 1


def test_reconcile_refuses_entries_that_are_not_in_doubt(ledger: Ledger) -> None:
    done = claimed(ledger.claim(ident(0), 0))
    ledger.commit(done, "ok")
    failed = claimed(ledger.claim(ident(1), 1))
    ledger.fail(failed, "E", "no")
    released = claimed(ledger.claim(ident(2), 2))
    ledger.release(released)
    for c, status in ((done, "committed"), (failed, "failed"), (released, "not_happened")):
        for ev in Evidence:
            with pytest.raises(InvalidTransition) as exc:
                ledger.reconcile(c.key_id, ev, result="x")
            assert (exc.value.key_id, exc.value.status) == (c.key_id, status)
        assert ledger.get(c.key_id).status.value == status
    with pytest.raises(UnknownEffect) as unknown:
        ledger.reconcile("00" * 32, Evidence.HAPPENED)
    assert unknown.value.key_id == "00" * 32


# -- operator resolution -----------------------------------------------------------------


def test_resolve_happened_records_the_operator_and_evidence(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    c = in_doubt(ledger)
    rec = ledger.resolve(
        c.key_id,
        happened=True,
        evidence="booking 4711 visible in the partner portal",
        actor="alice@ops",
        result={"booking": 4711},
    )
    assert rec.status is EffectStatus.COMMITTED
    other = ledgers.fresh()
    assert replayed(other.claim(ident(), {"amount": 5})).result == {"booking": 4711}
    assert events(other)[-1] == (
        "resolved",
        "committed",
        1,
        "alice@ops",
        "booking 4711 visible in the partner portal",
    )


def test_resolve_not_happened_from_needs_human_allows_a_resend(ledger: Ledger) -> None:
    c = in_doubt(ledger)
    ledger.reconcile(c.key_id, Evidence.INCONCLUSIVE)
    rec = ledger.resolve(
        c.key_id, happened=False, evidence="no booking in the portal", actor="bob@ops"
    )
    assert rec.status is EffectStatus.NOT_HAPPENED
    assert events(ledger)[-1] == (
        "resolved",
        "not_happened",
        1,
        "bob@ops",
        "no booking in the portal",
    )
    again = claimed(ledger.claim(ident(), {"amount": 5}))
    assert (again.epoch, again.provider_key) == (2, c.provider_key)


def test_resolve_an_expired_claim(ledger: Ledger, clock: Clock) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    with pytest.raises(InvalidTransition):
        ledger.resolve(c.key_id, happened=True, evidence="seen", actor="alice")
    clock.advance(31.0)
    rec = ledger.resolve(c.key_id, happened=True, evidence="seen", actor="alice", result=3)
    assert rec.status is EffectStatus.COMMITTED
    with pytest.raises(LeaseLost):
        ledger.commit(c, 4)
    assert replayed(ledger.claim(ident(), {"amount": 5})).result == 3


def test_resolve_refuses_definite_entries_and_needs_evidence(ledger: Ledger, store: Store) -> None:
    done = claimed(ledger.claim(ident(0), 0))
    ledger.commit(done, "ok")
    failed = claimed(ledger.claim(ident(1), 1))
    ledger.fail(failed, "E", "no")
    released = claimed(ledger.claim(ident(2), 2))
    ledger.release(released)
    for c in (done, failed, released):
        for happened in (True, False):
            with pytest.raises(InvalidTransition):
                ledger.resolve(c.key_id, happened=happened, evidence="e", actor="alice")
    doubt = claimed(ledger.claim(ident(3), 3))
    ledger.mark_unknown(doubt)
    trail = audit_rows(store.engine)
    for evidence, actor in (("", "alice"), ("  ", "alice"), ("seen", ""), ("seen", " ")):
        with pytest.raises(ConfigurationError):
            ledger.resolve(doubt.key_id, happened=True, evidence=evidence, actor=actor)
    assert audit_rows(store.engine) == trail
    assert ledger.get(doubt.key_id).status is EffectStatus.UNKNOWN
    with pytest.raises(UnknownEffect):
        ledger.resolve("ab" * 32, happened=True, evidence="e", actor="alice")


# -- perform: the one claim/act/record path --------------------------------------------------


class Provider:
    """A fake provider that counts every call it receives, by provider key."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.claims: list[Claim] = []

    def send(self, claim: Claim) -> str:
        self.calls[claim.provider_key] += 1
        self.claims.append(claim)
        return f"sent:{claim.epoch}"


def test_perform_acts_once_and_replays_everywhere(ledger: Ledger, ledgers: Ledgers) -> None:
    p = Provider()
    assert ledger.perform(ident(), {"to": "a"}, p.send) == "sent:1"
    assert ledger.perform(ident(), {"to": "a"}, p.send) == "sent:1"
    assert ledgers.fresh().perform(ident(), {"to": "a"}, p.send) == "sent:1"
    [c] = p.claims
    rec = ledger.get(c.key_id)
    assert p.calls == Counter({rec.provider_key: 1})
    assert c.fencing_token == f"{rec.provider_key}:1"
    assert (rec.status, rec.epoch, rec.attempts) == (EffectStatus.COMMITTED, 1, 1)


def test_perform_not_sent_releases_and_the_next_call_sends(ledger: Ledger) -> None:
    p = Provider()
    seen: list[BaseException] = []

    def refused(claim: Claim) -> str:
        p.send(claim)
        raise ConnectionRefusedError("connect refused")

    def classify(exc: BaseException) -> OutcomeClass:
        seen.append(exc)
        return OutcomeClass.NOT_SENT

    with pytest.raises(ConnectionRefusedError):
        ledger.perform(ident(), {"to": "a"}, refused, classify=classify)
    assert isinstance(seen[0], ConnectionRefusedError)
    key = ledger.key_id(ident())
    assert ledger.get(key).status is EffectStatus.NOT_HAPPENED
    assert ledger.perform(ident(), {"to": "a"}, p.send) == "sent:2"
    assert [c.epoch for c in p.claims] == [1, 2]
    assert len({c.provider_key for c in p.claims}) == 1
    assert ledger.get(key).status is EffectStatus.COMMITTED


def test_perform_rejected_records_a_definite_failure(ledger: Ledger, ledgers: Ledgers) -> None:
    p = Provider()

    def rejected(claim: Claim) -> str:
        p.send(claim)
        raise ValueError("mailbox does not exist")

    with pytest.raises(ValueError, match="mailbox does not exist"):
        ledger.perform(ident(), {"to": "a"}, rejected, classify=lambda _exc: OutcomeClass.REJECTED)
    for led in (ledger, ledgers.fresh()):
        with pytest.raises(EffectFailed) as exc:
            led.perform(ident(), {"to": "a"}, p.send)
        assert (exc.value.error_type, exc.value.message) == ("ValueError", "mailbox does not exist")
    assert sum(p.calls.values()) == 1
    assert ledger.get(ledger.key_id(ident())).status is EffectStatus.FAILED


class Interrupted(BaseException):
    """Stands in for KeyboardInterrupt / SystemExit arriving during the call."""


@pytest.mark.parametrize("error", [TimeoutError("read timed out"), Interrupted("stop")])
def test_perform_without_evidence_is_ambiguous(
    ledger: Ledger, ledgers: Ledgers, error: BaseException
) -> None:
    p = Provider()

    def ambiguous(claim: Claim) -> str:
        p.send(claim)
        raise error

    with pytest.raises(type(error)):
        ledger.perform(ident(), {"to": "a"}, ambiguous)
    key = ledger.key_id(ident())
    rec = ledger.get(key)
    assert (rec.status, rec.outcome_class) == (EffectStatus.UNKNOWN, OutcomeClass.AMBIGUOUS)
    for led in (ledger, ledgers.fresh()):
        with pytest.raises(EffectInDoubt):
            led.perform(ident(), {"to": "a"}, p.send)
    assert sum(p.calls.values()) == 1


def test_aperform_32_concurrent_effects_with_async_durability(ledgers: Ledgers) -> None:
    led = ledgers.fresh(store_kwargs={"durability": "async"}, owner="async-worker")
    calls: Counter[str] = Counter()

    async def act(claim: Claim) -> str:
        calls[claim.key_id] += 1
        await asyncio.sleep(0.01)
        return f"done:{claim.key_id[:8]}"

    async def main() -> list[str]:
        return await asyncio.gather(*(led.aperform(ident(i), {"n": i}, act) for i in range(32)))

    first = asyncio.run(main())
    keys = [led.key_id(ident(i)) for i in range(32)]
    assert first == [f"done:{k[:8]}" for k in keys]
    assert calls == Counter(dict.fromkeys(keys, 1))
    second = asyncio.run(main())
    assert second == first
    assert calls == Counter(dict.fromkeys(keys, 1))

    sync_view = ledgers.fresh()
    recs = {r.key_id: r for r in sync_view.effects(run_id="run-1")}
    assert set(recs) == set(keys)
    for r in recs.values():
        assert (r.status, r.epoch, r.attempts) == (EffectStatus.COMMITTED, 1, 1)
    assert sync_view.verify().ok


def test_aperform_concurrent_callers_of_the_same_effects_act_once(ledgers: Ledgers) -> None:
    led = ledgers.fresh(
        store_kwargs={"durability": "async"},
        clock=time.time,
        in_flight=InFlightPolicy(wait_s=20.0, initial_backoff_s=0.005, max_backoff_s=0.05),
    )
    calls: Counter[str] = Counter()

    async def act(claim: Claim) -> str:
        calls[claim.key_id] += 1
        await asyncio.sleep(0.05)
        return claim.key_id

    async def main() -> list[str]:
        return await asyncio.gather(
            *(led.aperform(ident(i % 8), {"n": i % 8}, act) for i in range(32))
        )

    results = asyncio.run(main())
    keys = [led.key_id(ident(i)) for i in range(8)]
    assert results == [keys[i % 8] for i in range(32)]
    assert calls == Counter(dict.fromkeys(keys, 1))


def test_aperform_ambiguous_failure_is_recorded_unknown(ledgers: Ledgers) -> None:
    led = ledgers.fresh(store_kwargs={"durability": "async"})

    async def act(claim: Claim) -> str:
        await asyncio.sleep(0)
        raise TimeoutError("no answer")

    with pytest.raises(TimeoutError):
        asyncio.run(led.aperform(ident(), {"n": 1}, act))
    assert led.get(led.key_id(ident())).status is EffectStatus.UNKNOWN
    with pytest.raises(EffectInDoubt):
        ledgers.fresh().claim(ident(), {"n": 1})


def test_lease_must_be_positive(store: Store) -> None:
    with pytest.raises(ConfigurationError):
        Ledger(store, keyring(), lease_s=0)
    with pytest.raises(ConfigurationError):
        InFlightPolicy(wait_s=-1)


def test_class_a_needs_a_window(ledger: Ledger) -> None:
    for window in (None, 0.0, -5.0):
        with pytest.raises(ConfigurationError):
            ledger.claim(
                ident(), {"a": 1}, provider_class=ProviderClass.DEDUPLICATING, window_s=window
            )
    assert ledger.effects() == []


def test_a_restarted_worker_finds_its_dead_predecessors_claim_in_doubt_at_once(
    store: Store, ledgers: Ledgers
) -> None:
    first = ledgers.on(store, owner="worker-7")
    c = claimed(first.claim(ident(0), {"a": 1}))
    # worker-7 dies here (between acting and recording); a new process starts as worker-7
    again = ledgers.on(store, owner="worker-7")
    with pytest.raises(EffectInDoubt) as info:
        again.claim(ident(0), {"a": 1})
    assert info.value.status == "unknown"
    events = [e for e in again.audit_events("run-1") if e["key_id"] == c.key_id]
    assert [e["event"] for e in events] == ["claimed", "lease_expired"]
    assert "restarted" in events[-1]["detail"]
    # another worker, by contrast, must still wait for the live lease
    ident1 = ident(1)
    other = ledgers.on(store, owner="worker-8")
    c1 = claimed(ledgers.on(store, owner="worker-9").claim(ident1, {"b": 2}))
    with pytest.raises(EffectInFlight):
        other.claim(ident1, {"b": 2})
    assert c1.epoch == 1


# -- a stale worker's late outcome leaves a trace ([7] item 20) ---------------------------


def test_a_paused_workers_late_outcome_is_refused_recorded_and_logged(
    ledger: Ledger, ledgers: Ledgers, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # worker-a claims and is paused (SIGSTOP) past its lease; worker-b finds the claim in
    # doubt, a probe says it did not happen, and worker-b sends and commits. Then worker-a
    # wakes up, delivers, and reports: refused, but recorded, and the worker's log says so.
    stale = claimed(ledger.claim(ident(), {"amount": 5}, provider_class="B"))
    clock.advance(31.0)
    other = ledgers.fresh(owner="worker-b")
    with pytest.raises(EffectInDoubt):
        other.claim(ident(), {"amount": 5}, provider_class="B")
    other.reconcile(stale.key_id, Evidence.NOT_HAPPENED, actor="probe")
    fresh = claimed(other.claim(ident(), {"amount": 5}, provider_class="B"))
    other.commit(fresh, "sent by worker-b")
    reports: list[Callable[[], EffectRecord]] = [
        lambda: ledger.commit(stale, "sent by worker-a"),
        lambda: ledger.mark_unknown(stale, "ReadTimeout"),
    ]
    for report in reports:
        with caplog.at_level("WARNING", logger="onceonly"), pytest.raises(LeaseLost) as lost:
            report()
        assert (lost.value.epoch, lost.value.current_epoch, lost.value.status) == (
            1,
            2,
            "committed",
        )
    late = [e for e in events(other) if e[0] == "late_outcome"]
    assert late == [
        (
            "late_outcome",
            "committed",
            1,
            "worker-a",
            "refused committed from stale epoch 1; the entry is committed at epoch 2",
        ),
        (
            "late_outcome",
            "committed",
            1,
            "worker-a",
            "refused unknown (ReadTimeout) from stale epoch 1; the entry is committed at epoch 2",
        ),
    ]
    warnings = [r for r in caplog.records if r.name.startswith("onceonly.")]
    assert len(warnings) == 2
    assert all("late outcome refused" in r.getMessage() for r in warnings)
    # the row is as worker-b left it, and it still checks against its audit trail
    assert ledger.verify().ok
    for led in (ledger, other, ledgers.fresh()):
        assert replayed(led.claim(ident(), {"amount": 5})).result == "sent by worker-b"


# -- outcome transactions are idempotent ([7]) -------------------------------------------


@pytest.mark.parametrize("outcome", ["commit", "fail", "mark_unknown", "release"])
def test_an_outcome_transaction_run_again_after_a_lost_commit_succeeds(
    ledger: Ledger, store: Store, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    c = claimed(ledger.claim(ident(), {"amount": 5}))
    transact = store.transact

    def committed_then_retried(fn: Callable[[Any], Any], *args: Any, **kwargs: Any) -> Any:
        # The transaction commits, the answer is lost (the connection dropped at COMMIT),
        # and the store runs the same transaction again.
        transact(fn, *args, **kwargs)
        return transact(fn, *args, **kwargs)

    monkeypatch.setattr(store, "transact", committed_then_retried)
    record: dict[str, Callable[[], EffectRecord]] = {
        "commit": lambda: ledger.commit(c, "ok"),
        "fail": lambda: ledger.fail(c, "E", "refused"),
        "mark_unknown": lambda: ledger.mark_unknown(c, "timeout"),
        "release": lambda: ledger.release(c, "refused"),
    }
    rec = record[outcome]()  # not LeaseLost: it finds its own outcome
    monkeypatch.undo()
    expected = {
        "commit": EffectStatus.COMMITTED,
        "fail": EffectStatus.FAILED,
        "mark_unknown": EffectStatus.UNKNOWN,
        "release": EffectStatus.NOT_HAPPENED,
    }
    assert (rec.status, rec.epoch) == (expected[outcome], 1)
    event = {"commit": "committed", "fail": "failed", "mark_unknown": "unknown"}
    assert [e[0] for e in events(ledger)] == ["claimed", event.get(outcome, "not_sent")]
    # a second outcome of the same claim is still refused (it is not the same transaction)
    with pytest.raises(LeaseLost):
        ledger.commit(c, "ok")
    assert ledger.verify().ok


# -- operator resolutions without a result, and their correction ([7] item 19) -----------


def test_resolve_happened_without_a_result_is_told_apart_from_a_result_of_none(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    unknown = in_doubt(ledger)
    ledger.resolve(unknown.key_id, happened=True, evidence="in the portal", actor="alice")
    none = claimed(ledger.claim(ident(1), {"amount": 6}))
    ledger.mark_unknown(none)
    ledger.resolve(none.key_id, happened=True, evidence="empty answer", actor="alice", result=None)
    for led in (ledger, ledgers.fresh()):
        for _ in range(2):  # not cached as a result either
            with pytest.raises(ResultUnknown) as info:
                led.claim(ident(), {"amount": 5})
            assert info.value.key_id == unknown.key_id
            with pytest.raises(ResultUnknown):
                led.replay(unknown.key_id)
            with pytest.raises(ResultUnknown):
                led.perform(ident(), {"amount": 5}, lambda c: pytest.fail("acted"))
        assert replayed(led.claim(ident(1), {"amount": 6})).result is None
    assert ledger.get(unknown.key_id).status is EffectStatus.COMMITTED
    assert ledger.verify().ok


def test_correct_records_the_left_out_result_for_every_process(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    c = in_doubt(ledger)
    ledger.resolve(c.key_id, happened=True, evidence="in the portal", actor="alice")
    worker = ledgers.fresh(owner="worker-b")  # a long-lived worker that saw it first
    with pytest.raises(ResultUnknown):
        worker.claim(ident(), {"amount": 5})
    rec = ledger.correct(
        c.key_id, result={"booking": 4711}, evidence="booking 4711 in the portal", actor="bob"
    )
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 1)
    for led in (worker, ledger, ledgers.fresh()):
        assert replayed(led.claim(ident(), {"amount": 5})).result == {"booking": 4711}
    # a wrong result is corrected again; the corrected outcome is what everyone replays
    ledger.correct(c.key_id, result={"booking": 4712}, evidence="it was 4712", actor="carol")
    for led in (worker, ledger, ledgers.fresh()):
        assert replayed(led.claim(ident(), {"amount": 5})).result == {"booking": 4712}
    assert events(ledger)[-3:] == [
        ("resolved", "committed", 1, "alice", "in the portal"),
        ("corrected", "committed", 1, "bob", "booking 4711 in the portal"),
        ("corrected", "committed", 1, "carol", "it was 4712"),
    ]
    assert ledger.verify().ok


def test_correct_to_not_happened_lets_the_next_claim_send_and_that_outcome_stands(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    c = in_doubt(ledger)
    ledger.resolve(c.key_id, happened=True, evidence="looked like it", actor="alice", result=1)
    worker = ledgers.fresh(owner="worker-b")
    assert replayed(worker.claim(ident(), {"amount": 5})).result == 1
    ledger.correct(c.key_id, happened=False, evidence="it was another booking", actor="bob")
    again = claimed(worker.claim(ident(), {"amount": 5}))  # the worker does not replay 1
    assert (again.epoch, again.provider_key) == (2, c.provider_key)
    worker.commit(again, 2)
    with pytest.raises(InvalidTransition):  # the provider's answer is not an operator's
        ledger.correct(c.key_id, result=3, evidence="e", actor="bob")
    # and a "did not happen" that was wrong is corrected before anything was re-sent
    d = claimed(ledger.claim(ident(1), {"amount": 6}))
    ledger.mark_unknown(d)
    ledger.resolve(d.key_id, happened=False, evidence="not in the portal", actor="alice")
    ledger.correct(d.key_id, result=9, evidence="it was there after all", actor="bob")
    assert replayed(worker.claim(ident(1), {"amount": 6})).result == 9
    assert ledger.verify().ok


def test_correct_refuses_outcomes_no_operator_decided_and_needs_evidence(
    ledger: Ledger, store: Store
) -> None:
    done = claimed(ledger.claim(ident(0), 0))
    ledger.commit(done, "ok")
    failed = claimed(ledger.claim(ident(1), 1))
    ledger.fail(failed, "E", "no")
    released = claimed(ledger.claim(ident(2), 2))
    ledger.release(released)
    probed = claimed(ledger.claim(ident(3), 3))
    ledger.mark_unknown(probed)
    ledger.reconcile(probed.key_id, Evidence.HAPPENED, result="found")
    doubt = claimed(ledger.claim(ident(4), 4))
    ledger.mark_unknown(doubt)
    live = claimed(ledger.claim(ident(5), 5))
    trail = audit_rows(store.engine)
    for c in (done, failed, released, probed, doubt, live):
        for happened in (True, False):
            with pytest.raises(InvalidTransition):
                ledger.correct(c.key_id, happened=happened, evidence="e", actor="bob")
    resolved = doubt
    ledger.resolve(resolved.key_id, happened=True, evidence="seen", actor="alice")
    trail = audit_rows(store.engine)
    for evidence, actor in (("", "bob"), ("seen", " ")):
        with pytest.raises(ConfigurationError):
            ledger.correct(resolved.key_id, result=1, evidence=evidence, actor=actor)
    with pytest.raises(ConfigurationError):  # a result for what did not happen
        ledger.correct(resolved.key_id, happened=False, result=1, evidence="e", actor="bob")
    assert audit_rows(store.engine) == trail
    with pytest.raises(UnknownEffect):
        ledger.correct("ab" * 32, result=1, evidence="e", actor="bob")
    assert live.epoch == 1


# -- interrupts in perform / aperform ([7] item 16) --------------------------------------


@pytest.mark.parametrize(
    "interrupt", [KeyboardInterrupt(), SystemExit(2), GeneratorExit()], ids=type
)
def test_perform_lets_an_interrupt_through_and_leaves_the_entry_in_doubt(
    ledger: Ledger, interrupt: BaseException
) -> None:
    p = Provider()

    def act(claim: Claim) -> str:
        p.send(claim)
        raise interrupt

    not_sent = lambda _exc: OutcomeClass.NOT_SENT  # noqa: E731  (never asked about interrupts)
    with pytest.raises(type(interrupt)) as info:
        ledger.perform(ident(), {"to": "a"}, act, classify=not_sent)
    assert info.value is interrupt
    rec = ledger.get(ledger.key_id(ident()))
    assert (rec.status, rec.lease_owner) == (EffectStatus.UNKNOWN, None)
    assert events(ledger)[-1][-1] == f"interrupted: {type(interrupt).__name__}"


def test_aperform_cancelled_while_acting_is_in_doubt(ledgers: Ledgers) -> None:
    led = ledgers.fresh()
    p = Provider()
    sent = asyncio.Event()

    async def act(claim: Claim) -> str:
        p.send(claim)
        sent.set()
        await asyncio.Event().wait()
        return "never"

    async def main() -> None:
        task = asyncio.create_task(led.aperform(ident(), {"to": "a"}, act))
        await sent.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    rec = led.get(led.key_id(ident()))
    assert (rec.status, rec.lease_owner) == (EffectStatus.UNKNOWN, None)
    assert sum(p.calls.values()) == 1


def test_aperform_cancelled_while_claiming_gives_the_claim_back(ledgers: Ledgers) -> None:
    led = ledgers.fresh()
    p = Provider()

    async def act(claim: Claim) -> str:
        return p.send(claim)

    async def main() -> None:
        task = asyncio.create_task(led.aperform(ident(), {"to": "a"}, act))
        await asyncio.sleep(0)  # it waits for the claim's transaction now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    led.close()  # the claim's thread, and the give-back after it, are done
    assert p.calls == Counter()
    assert ledgers.fresh().get(led.key_id(ident())).status is EffectStatus.NOT_HAPPENED
    assert ledgers.fresh().perform(ident(), {"to": "a"}, p.send) == "sent:2"


def test_aperform_runs_ledger_calls_in_the_callers_context(ledgers: Ledgers) -> None:
    led = ledgers.fresh()
    caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="-")
    seen: list[str] = []

    def classify(exc: BaseException) -> OutcomeClass:
        seen.append(caller.get())  # runs on the ledger's thread, recording the failure
        return OutcomeClass.NOT_SENT

    async def act(claim: Claim) -> str:
        raise ConnectionRefusedError("refused")

    async def main() -> None:
        caller.set("fenced")
        with pytest.raises(ConnectionRefusedError):
            await led.aperform(ident(), {"to": "a"}, act, classify=classify)

    asyncio.run(main())
    assert seen == ["fenced"]


def test_the_same_resolution_run_again_changes_nothing_and_succeeds(
    ledger: Ledger, store: Store
) -> None:
    # An operator's process that died after the resolution committed, before it woke the
    # run, is run again: the very same decision is no error, any other one is.
    c = in_doubt(ledger)
    first = ledger.resolve(c.key_id, happened=True, evidence="in the portal", actor="alice")
    trail = audit_rows(store.engine)
    again = ledger.resolve(c.key_id, happened=True, evidence="in the portal", actor="alice")
    assert again == first
    assert audit_rows(store.engine) == trail
    others: list[Callable[[], EffectRecord]] = [
        lambda: ledger.resolve(c.key_id, happened=False, evidence="in the portal", actor="alice"),
        lambda: ledger.resolve(c.key_id, happened=True, evidence="elsewhere", actor="alice"),
        lambda: ledger.resolve(c.key_id, happened=True, evidence="in the portal", actor="bob"),
        lambda: ledger.resolve(
            c.key_id, happened=True, evidence="in the portal", actor="alice", result=1
        ),
    ]
    for other in others:
        with pytest.raises(InvalidTransition):
            other()
    assert audit_rows(store.engine) == trail


@pytest.mark.parametrize("how", ["claim", "resend"])
def test_an_explicit_entry_another_run_sends_again_belongs_to_that_run(
    ledger: Ledger, ledgers: Ledgers, clock: Clock, how: str
) -> None:
    """Run A claims an explicit key and dies; run B of the same tenant sends it (after A's
    claim was settled as not sent, or by a class A re-send inside the window): the entry
    names B and B's step from then on (retention keeps it while B lives), its events stay
    in A's chain."""
    a = ident(run="A", step="pay#0", explicit="invoice-7", effect="pay@1")
    b = ident(run="B", step="charge#0", explicit="invoice-7", effect="pay@1")
    args = {"invoice": 7}
    a_class = ProviderClass.DEDUPLICATING
    first = claimed(ledger.claim(a, args, provider_class=a_class, window_s=3600.0))
    other = ledgers.fresh(owner="worker-b")
    clock.advance(31.0)  # A's claim lapses: in doubt
    with pytest.raises(EffectInDoubt):
        other.claim(b, args, provider_class=a_class, window_s=3600.0)
    if how == "claim":
        other.reconcile(first.key_id, Evidence.NOT_HAPPENED)
        again = claimed(other.claim(b, args, provider_class=a_class, window_s=3600.0))
    else:
        resent = other.reconcile(first.key_id, Evidence.WINDOW_OPEN, by=b)
        assert isinstance(resent, Claim)
        again = resent
    other.commit(again, {"paid": 7})
    rec = other.get(first.key_id)
    assert (rec.run_id, rec.step_id, rec.status) == ("B", "charge#0", EffectStatus.COMMITTED)
    assert [e[0] for e in events(other, "A")][-1] == "committed"
    assert other.effects(run_id="A") == []
