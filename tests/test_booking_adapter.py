"""The booking adapter against a real HTTP server (``tests.booking_fake``), class B.

The provider does not deduplicate: every applied POST creates a hold or a confirmation.
For every fault the final state is applied once, failed definitely or needs-human,
counted from the provider's raw request log and its holds and confirmations; a
restarted process (a fresh Ledger) replays without sending.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from unittest.mock import ANY

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import RetryPolicy, step
from onceonly.adapters.booking import (
    AsyncGuardedBooking,
    BookingRejected,
    Confirmation,
    GuardedBooking,
    Hold,
)
from onceonly.checkpoint import Store
from onceonly.ledger import EffectFailed, EffectInDoubt, EffectRecord, EffectStatus, Ledger
from tests.booking_fake import BookingProvider
from tests.ledger_support import Ledgers

TIMEOUT = httpx.Timeout(5.0, read=0.2)
RETRY = RetryPolicy(max_attempts=3, initial_s=0.0)
EFFECTS = {"reserve": "booking.reserve@1", "confirm": "booking.confirm@1"}


@contextlib.contextmanager
def running(provider: BookingProvider) -> Iterator[BookingProvider]:
    try:
        provider.start()
        yield provider
    finally:
        provider.stop()


@pytest.fixture
def fake() -> Iterator[BookingProvider]:
    with running(BookingProvider()) as provider:
        yield provider


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


@pytest.fixture
def clients() -> Iterator[Callable[[str], httpx.Client]]:
    made: list[httpx.Client] = []

    def make(url: str) -> httpx.Client:
        made.append(httpx.Client(base_url=url, timeout=TIMEOUT))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def booking(
    fake: BookingProvider, ledger: Ledger, clients: Callable[[str], httpx.Client]
) -> GuardedBooking:
    return GuardedBooking(clients(fake.url), ledger, retry=RETRY)


@pytest.fixture
def restart(
    fake: BookingProvider, ledgers: Ledgers, clients: Callable[[str], httpx.Client]
) -> Callable[[], GuardedBooking]:
    """Another process: a fresh ledger and client each call (no shared caches)."""
    return lambda: GuardedBooking(clients(fake.url), ledgers.fresh(owner="w2"), retry=RETRY)


def book(booking: GuardedBooking) -> tuple[Hold, Confirmation]:
    """Step ``book`` of ``run-1``: hold room 101 for a night, then confirm the hold."""
    with step("run-1", "book"):
        hold = booking.reserve("101", "2025-06-01")
        return hold, booking.confirm(hold["hold_id"])


def records(ledger: Ledger) -> dict[str, EffectRecord]:
    return {r.effect.split("@")[0].split(".")[1]: r for r in ledger.effects()}


def check_span(
    spans: InMemorySpanExporter, effect: str, outcome: str, rec: EffectRecord, index: int = -1
) -> None:
    """A span of ``effect`` with ``outcome``, our ids, and neither key nor payload."""
    mine = [s for s in spans.get_finished_spans() if s.name == f"execute_tool {EFFECTS[effect]}"]
    attrs = dict(mine[index].attributes or {})
    assert attrs["onceonly.effect.outcome"] == outcome
    assert attrs["onceonly.provider_class"] == "B"
    assert attrs["onceonly.effect.key_id"] == rec.key_id
    shown = " ".join(map(str, attrs.values()))
    assert rec.provider_key not in shown
    assert "101" not in shown
    assert "2025-06-01" not in shown


def applied_once(fake: BookingProvider, ledger: Ledger, hold: Hold, conf: Confirmation) -> None:
    """One hold and one confirmation at the provider, matching the ledger's records."""
    recs = records(ledger)
    assert [h["client_reference"] for h in fake.holds] == [recs["reserve"].provider_key]
    assert [c["client_reference"] for c in fake.confirmations] == [recs["confirm"].provider_key]
    assert hold == {
        "hold_id": fake.holds[0]["id"],
        "room": "101",
        "night": "2025-06-01",
        "client_reference": recs["reserve"].provider_key,
    }
    assert conf["confirmation_id"] == fake.confirmations[0]["id"]
    assert conf["hold_id"] == hold["hold_id"]
    assert {r.status for r in recs.values()} == {EffectStatus.COMMITTED}


# -- the fake itself -------------------------------------------------------------------


def test_the_fake_creates_a_hold_per_raw_post_and_finds_them_by_reference(
    fake: BookingProvider,
) -> None:
    with httpx.Client(base_url=fake.url, timeout=TIMEOUT) as c:
        body = {"client_reference": "r1", "room": "101", "night": "2025-06-01"}
        assert c.post("/holds", json=body).status_code == 201
        assert c.post("/holds", json=body).status_code == 201  # no dedup: a second hold
        assert c.post("/holds", json={"room": "101"}).status_code == 422
        assert len(c.get("/holds", params={"client_reference": "r1"}).json()["items"]) == 2
        assert c.get("/holds", params={"client_reference": "r2"}).json() == {"items": []}
        assert c.post("/holds/H-9/confirm", json={"client_reference": "c"}).status_code == 404
    assert len(fake.holds) == 2
    assert [r.status for r in fake.posts] == [201, 201, 422, 404]


# -- success, replay, restart ----------------------------------------------------------


def test_a_booking_happens_once_and_a_restart_replays_it(
    fake: BookingProvider,
    booking: GuardedBooking,
    ledger: Ledger,
    restart: Callable[[], GuardedBooking],
    spans: InMemorySpanExporter,
) -> None:
    hold, conf = book(booking)
    recs = records(ledger)
    check_span(spans, "reserve", "executed", recs["reserve"])
    check_span(spans, "confirm", "executed", recs["confirm"])
    assert book(booking) == (hold, conf)
    check_span(spans, "reserve", "replayed", recs["reserve"])
    check_span(spans, "confirm", "replayed", recs["confirm"])
    assert book(restart()) == (hold, conf)
    applied_once(fake, ledger, hold, conf)
    assert len(fake.posts) == 2
    assert [p.fencing for p in fake.posts] == [
        f"{recs['reserve'].provider_key}:1",
        f"{recs['confirm'].provider_key}:1",
    ]


# -- not sent --------------------------------------------------------------------------


def test_a_refused_connection_is_not_sent_and_is_booked_once_later(
    ledger: Ledger, ledgers: Ledgers, clients: Callable[[str], httpx.Client]
) -> None:
    provider = BookingProvider()  # bound, not yet listening: connections are refused
    try:
        with pytest.raises(httpx.ConnectError):
            book(GuardedBooking(clients(provider.url), ledger, retry=RETRY))
        rec = records(ledger)["reserve"]
        assert (rec.status, rec.attempts) == (EffectStatus.NOT_HAPPENED, RETRY.max_attempts)
        provider.start()
        fresh = GuardedBooking(clients(provider.url), ledgers.fresh(owner="w2"), retry=RETRY)
        hold, conf = book(fresh)
        assert book(GuardedBooking(clients(provider.url), ledger)) == (hold, conf)
        applied_once(provider, ledger, hold, conf)
        assert len(provider.posts) == 2
    finally:
        provider.stop()


# -- rejected --------------------------------------------------------------------------


def test_a_refusal_fails_definitely_and_is_never_resent(
    fake: BookingProvider,
    booking: GuardedBooking,
    ledger: Ledger,
    restart: Callable[[], GuardedBooking],
) -> None:
    again = restart()
    for fault, status in (("taken", 409), ("invalid", 422)):
        fake.faults = [fault]
        with step("run-1", fault), pytest.raises(BookingRejected) as info:
            booking.reserve("101", "2025-06-01")
        assert (info.value.status, info.value.body) == (status, {"error": ANY})
        with step("run-1", fault), pytest.raises(EffectFailed) as failed:
            again.reserve("101", "2025-06-01")  # another process: the failure is replayed
        assert failed.value.error_type == "BookingRejected"
    with pytest.raises(BookingRejected) as info:
        booking.confirm("H-404", key="confirm-H-404")
    assert info.value.status == 404
    with pytest.raises(EffectFailed):
        again.confirm("H-404", key="confirm-H-404")
    assert (len(fake.posts), fake.holds, fake.confirmations) == (3, [], [])
    assert [r.status for r in ledger.effects()] == [EffectStatus.FAILED] * 3


# -- ambiguous -------------------------------------------------------------------------


@pytest.mark.parametrize("at", ["reserve", "confirm"])
def test_a_503_before_applying_is_probed_and_resent_once(
    fake: BookingProvider,
    booking: GuardedBooking,
    ledger: Ledger,
    restart: Callable[[], GuardedBooking],
    spans: InMemorySpanExporter,
    at: str,
) -> None:
    fake.faults = ["refuse"] if at == "reserve" else ["none", "refuse"]
    hold, conf = book(booking)
    assert book(restart()) == (hold, conf)
    applied_once(fake, ledger, hold, conf)
    rec = records(ledger)[at]
    assert (rec.epoch, rec.attempts) == (2, 2)
    check_span(spans, at, "executed", rec, index=0)
    assert [p.status for p in fake.posts].count(503) == 1
    assert len(fake.posts) == 3  # the refused one, then one per effect


@pytest.mark.parametrize("fault", ["drop", "cut"])
@pytest.mark.parametrize("at", ["reserve", "confirm"])
def test_a_lost_answer_after_applying_is_reconciled_by_the_lookup(
    fake: BookingProvider,
    booking: GuardedBooking,
    ledger: Ledger,
    restart: Callable[[], GuardedBooking],
    spans: InMemorySpanExporter,
    at: str,
    fault: str,
) -> None:
    fake.faults = [fault] if at == "reserve" else ["none", fault]
    hold, conf = book(booking)
    check_span(spans, at, "reconciled", records(ledger)[at], index=0)
    assert book(restart()) == (hold, conf)
    applied_once(fake, ledger, hold, conf)
    assert len(fake.posts) == 2  # never re-sent
    rec = records(ledger)[at]
    assert (rec.epoch, rec.attempts) == (1, 1)


def test_a_lost_answer_with_the_lookup_down_needs_a_human_and_is_never_resent(
    fake: BookingProvider,
    booking: GuardedBooking,
    ledger: Ledger,
    restart: Callable[[], GuardedBooking],
    spans: InMemorySpanExporter,
) -> None:
    fake.faults, fake.lookups_down = ["cut"], True
    with pytest.raises(EffectInDoubt) as info:
        book(booking)
    assert info.value.status == "needs_human"
    check_span(spans, "reserve", "in_doubt", records(ledger)["reserve"])
    fake.lookups_down = False
    with pytest.raises(EffectInDoubt):
        book(restart())  # another process: a human must decide first
    assert (len(fake.posts), len(fake.holds)) == (1, 1)
    assert records(ledger)["reserve"].status is EffectStatus.NEEDS_HUMAN


# -- async -----------------------------------------------------------------------------


@pytest.mark.parametrize("faults", [["refuse", "cut"], ["drop", "none"]])
def test_the_async_client_settles_like_the_sync_one(
    fake: BookingProvider,
    ledger: Ledger,
    restart: Callable[[], GuardedBooking],
    faults: list[str],
) -> None:
    fake.faults = list(faults)

    async def main() -> tuple[Hold, Confirmation]:
        async with httpx.AsyncClient(base_url=fake.url, timeout=TIMEOUT) as c:
            booking = AsyncGuardedBooking(c, ledger, retry=RETRY)
            with step("run-1", "book"):
                hold = await booking.reserve("101", "2025-06-01")
                return hold, await booking.confirm(hold["hold_id"])

    hold, conf = asyncio.run(main())
    assert asyncio.run(main()) == (hold, conf)
    assert book(restart()) == (hold, conf)
    applied_once(fake, ledger, hold, conf)
    assert len(fake.posts) == (3 if "refuse" in faults else 2)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fault", ["refuse", "cut"])
def test_the_default_policy_sends_again_what_the_lookup_proves_did_not_happen(
    fake: BookingProvider,
    ledger: Ledger,
    clients: Callable[[str], httpx.Client],
    restart: Callable[[], GuardedBooking],
    fault: str,
    mode: str,
) -> None:
    # No retry= given ([7] item 18): a 503 the lookup proves was not applied is sent
    # again, a lost answer the lookup finds is settled; neither fails the booking.
    fake.faults = [fault]

    async def abook() -> tuple[Hold, Confirmation]:
        async with httpx.AsyncClient(base_url=fake.url, timeout=TIMEOUT) as c:
            booking = AsyncGuardedBooking(c, ledger)
            with step("run-1", "book"):
                hold = await booking.reserve("101", "2025-06-01")
                return hold, await booking.confirm(hold["hold_id"])

    if mode == "async":
        hold, conf = asyncio.run(abook())
    else:
        hold, conf = book(GuardedBooking(clients(fake.url), ledger))
    assert book(restart()) == (hold, conf)
    applied_once(fake, ledger, hold, conf)
