"""The HTTP adapter against a real HTTP server (the fake provider in ``tests.http_fake``).

For each provider class and failure mode the final ledger state matches the class's
semantics, counted from the provider's raw request log: applied once, failed definitely,
or needs-human; and a restarted process (a fresh Ledger) replays without sending.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import RetryPolicy, step
from onceonly.adapters.http import AsyncGuardedHTTP, GuardedHTTP, HTTPRejected
from onceonly.checkpoint import ConfigurationError, Store
from onceonly.ledger import EffectFailed, EffectInDoubt, EffectStatus, KeyReuseError, Ledger
from tests.http_fake import FakeProvider, running
from tests.ledger_support import Clock, Ledgers

TIMEOUT = httpx.Timeout(5.0, read=0.2)
RETRY = RetryPolicy(max_attempts=4, initial_s=0.0)
WINDOW_S = 3600.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A started class A (deduplicating) fake."""
    with running(FakeProvider()) as provider:
        yield provider


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as c:
        yield c


def options(fake: FakeProvider, pclass: str) -> dict[str, Any]:
    """The request options for a provider of class ``pclass``."""
    if pclass == "A":
        return {"provider_class": "A", "window_s": WINDOW_S}
    if pclass == "B":
        return {"provider_class": "B", "lookup": fake.url + "/lookup/{key}"}
    return {"provider_class": "C"}


def pay(http: GuardedHTTP, fake: FakeProvider, pclass: str, amount: int = 5) -> dict[str, Any]:
    """One payment in step ``pay`` of ``run-1``."""
    with step("run-1", "pay"):
        return http.post(
            fake.url + "/payments", effect="pay@1", json={"amount": amount}, **options(fake, pclass)
        )


@pytest.fixture
def restart(ledgers: Ledgers) -> Iterator[Callable[[], GuardedHTTP]]:
    """Another process: a fresh ledger and client each call (no shared caches)."""
    clients: list[httpx.Client] = []

    def fresh() -> GuardedHTTP:
        clients.append(httpx.Client(timeout=TIMEOUT))
        return GuardedHTTP(clients[-1], ledgers.fresh(owner="w2"), retry=RETRY)

    yield fresh
    for c in clients:
        c.close()


def only(ledger: Ledger) -> Any:
    [rec] = ledger.effects()
    return rec


def check_span(spans: InMemorySpanExporter, outcome: str, rec: Any) -> None:
    """The last guarded call's span: its outcome and ids, never the key or the payload."""
    span = spans.get_finished_spans()[-1]
    attrs = dict(span.attributes or {})
    assert span.name == "execute_tool pay@1"
    assert attrs["onceonly.effect.outcome"] == outcome
    assert attrs["onceonly.provider_class"] == rec.provider_class.value
    assert attrs["onceonly.effect.key_id"] == rec.key_id
    shown = " ".join(map(str, attrs.values()))
    assert rec.provider_key not in shown
    assert "amount" not in shown


CLASSES = ["A", "B", "C"]


def provider_for(pclass: str) -> FakeProvider:
    return FakeProvider(dedup=pclass == "A")


@pytest.fixture(params=CLASSES)
def pclass(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cfake(pclass: str) -> Iterator[FakeProvider]:
    """A started fake that deduplicates only for class A."""
    with running(provider_for(pclass)) as provider:
        yield provider


# -- the fake itself ------------------------------------------------------------------


def test_the_fake_honours_the_idempotency_key_draft(fake: FakeProvider) -> None:
    url = fake.url + "/payments"
    with httpx.Client(timeout=TIMEOUT) as c:
        assert c.post(url, json={"a": 1}).status_code == 400
        assert c.post(url, json={"a": 1}, headers={"Idempotency-Key": "k1"}).status_code == 400
        first = c.post(url, json={"a": 1}, headers={"Idempotency-Key": '"k1"'})
        again = c.post(url, json={"a": 1}, headers={"Idempotency-Key": '"k1"'})
        other = c.post(url, json={"a": 2}, headers={"Idempotency-Key": '"k1"'})
        assert (first.status_code, again.status_code, other.status_code) == (201, 201, 422)
        assert again.json() == first.json()
        assert c.get(fake.url + "/lookup/k1").json() == first.json()
        assert c.get(fake.url + "/lookup/k2").status_code == 404
    assert len(fake.writes) == 5
    assert len(fake.applied) == 1


# -- success, replay, restart ---------------------------------------------------------


def test_a_request_happens_once_and_a_restart_replays_without_sending(
    cfake: FakeProvider,
    pclass: str,
    ledger: Ledger,
    restart: Callable[[], GuardedHTTP],
    client: httpx.Client,
    spans: InMemorySpanExporter,
) -> None:
    http = GuardedHTTP(client, ledger, retry=RETRY)
    first = pay(http, cfake, pclass)
    check_span(spans, "executed", only(ledger))
    assert first == {"status": 201, "json": {"id": 1, "request": {"amount": 5}}}
    assert pay(http, cfake, pclass) == first  # the same step again: replayed
    check_span(spans, "replayed", only(ledger))
    assert pay(restart(), cfake, pclass) == first
    [sent] = cfake.writes
    rec = only(ledger)
    assert sent.idempotency_key == f'"{rec.provider_key}"'
    assert sent.fencing == f"{rec.provider_key}:{rec.epoch}"
    assert rec.status is EffectStatus.COMMITTED


def test_a_diverged_body_is_refused_before_the_provider_sees_it(
    fake: FakeProvider, ledger: Ledger, client: httpx.Client
) -> None:
    http = GuardedHTTP(client, ledger)
    pay(http, fake, "A", amount=5)
    with pytest.raises(KeyReuseError):
        pay(http, fake, "A", amount=6)
    assert len(fake.writes) == 1


def test_the_fingerprint_is_the_body_as_json_values_not_its_encoding(
    fake: FakeProvider, ledger: Ledger, client: httpx.Client
) -> None:
    """A resumed step that builds the same body in another key order (as a value read back
    from a checkpoint comes, sorted) with other per-request headers (a rotated token, a
    trace id) replays; another value anywhere in the body is refused."""
    http = GuardedHTTP(client, ledger)
    body: dict[str, Any] = {
        "amount": 5,
        "meta": {"order": "o-1", "lines": [{"sku": "a", "qty": 2}]},
    }
    reordered = {"meta": {"lines": [{"qty": 2, "sku": "a"}], "order": "o-1"}, "amount": 5}

    def send(json: Any, headers: dict[str, str]) -> dict[str, Any]:
        with step("run-1", "pay"):
            return http.post(
                fake.url + "/payments",
                effect="pay@1",
                json=json,
                headers=headers,
                **options(fake, "A"),
            )

    first = send(body, {"Authorization": "Bearer t1", "traceparent": "00-aa-01-01"})
    assert send(reordered, {"authorization": "Bearer t2"}) == first
    for changed in (
        {**body, "amount": 6},
        {**body, "meta": {**body["meta"], "lines": [{"sku": "a", "qty": 3}]}},
        {**body, "currency": "EUR"},
    ):
        with pytest.raises(KeyReuseError):
            send(changed, {})
    assert len(fake.writes) == 1


# -- not sent -------------------------------------------------------------------------


def test_a_refused_connection_is_not_sent_and_is_sent_later(
    pclass: str, ledger: Ledger, restart: Callable[[], GuardedHTTP], client: httpx.Client
) -> None:
    provider = provider_for(pclass)  # bound, not yet listening: connections are refused
    try:
        http = GuardedHTTP(client, ledger, retry=RETRY)
        with pytest.raises(httpx.ConnectError):
            pay(http, provider, pclass)
        rec = only(ledger)
        assert (rec.status, rec.attempts) == (EffectStatus.NOT_HAPPENED, RETRY.max_attempts)
        provider.start()
        result = pay(http, provider, pclass)
        assert pay(restart(), provider, pclass) == result
        assert len(provider.writes) == 1
        assert len(provider.applied) == 1
        assert only(ledger).status is EffectStatus.COMMITTED
    finally:
        provider.stop()


# -- rejected -------------------------------------------------------------------------


def test_a_4xx_fails_definitely_and_is_never_resent(
    cfake: FakeProvider,
    pclass: str,
    ledger: Ledger,
    restart: Callable[[], GuardedHTTP],
    client: httpx.Client,
) -> None:
    cfake.faults = ["reject"]
    http = GuardedHTTP(client, ledger, retry=RETRY)
    with pytest.raises(HTTPRejected) as info:
        pay(http, cfake, pclass)
    assert info.value.status == 402
    assert info.value.body == {"error": "payment required"}
    for again in (http, restart()):
        with pytest.raises(EffectFailed) as failed:
            pay(again, cfake, pclass)
        assert failed.value.error_type == "HTTPRejected"
    assert len(cfake.writes) == 1
    assert cfake.applied == []
    assert only(ledger).status is EffectStatus.FAILED


# -- ambiguous: 5xx before the provider applied -----------------------------------------


@pytest.mark.parametrize("fault", ["refuse", "error"])
def test_a_5xx_before_applying_is_settled_by_the_class(
    cfake: FakeProvider,
    pclass: str,
    fault: str,
    ledger: Ledger,
    restart: Callable[[], GuardedHTTP],
    client: httpx.Client,
    spans: InMemorySpanExporter,
) -> None:
    cfake.faults = [fault]
    http = GuardedHTTP(client, ledger, retry=RETRY)
    if pclass == "C":
        for again in (http, restart()):
            with pytest.raises(EffectInDoubt) as info:
                pay(again, cfake, pclass)
            assert info.value.status == "needs_human"
            check_span(spans, "in_doubt", only(ledger))
        assert len(cfake.writes) == 1
        assert cfake.applied == []
        assert only(ledger).status is EffectStatus.NEEDS_HUMAN
        return
    # A: re-sent with the same key; B: the lookup proves it did not happen, then re-sent.
    result = pay(http, cfake, pclass)
    check_span(spans, "executed", only(ledger))
    assert pay(restart(), cfake, pclass) == result
    assert [w.status for w in cfake.writes] == [503 if fault == "refuse" else 500, 201]
    assert len({w.idempotency_key for w in cfake.writes}) == 1
    assert len(cfake.applied) == 1
    assert only(ledger).status is EffectStatus.COMMITTED


# -- ambiguous: the provider applied, the answer was lost -------------------------------


@pytest.mark.parametrize("fault", ["drop", "cut"])
def test_a_lost_answer_after_applying_is_settled_by_the_class(
    cfake: FakeProvider,
    pclass: str,
    fault: str,
    ledger: Ledger,
    restart: Callable[[], GuardedHTTP],
    client: httpx.Client,
    spans: InMemorySpanExporter,
) -> None:
    cfake.faults = [fault]
    http = GuardedHTTP(client, ledger, retry=RETRY)
    if pclass == "C":
        for again in (http, restart()):
            with pytest.raises(EffectInDoubt) as info:
                pay(again, cfake, pclass)
            assert info.value.status == "needs_human"
            check_span(spans, "in_doubt", only(ledger))
        assert len(cfake.writes) == 1
        assert only(ledger).status is EffectStatus.NEEDS_HUMAN
    else:
        result = pay(http, cfake, pclass)
        # A: the in-window re-send is executed (attempt 2); B: the lookup reconciles it.
        check_span(spans, "executed" if pclass == "A" else "reconciled", only(ledger))
        assert pay(restart(), cfake, pclass) == result
        check_span(spans, "replayed", only(ledger))
        [(_, applied)] = cfake.applied
        assert result == {"status": 201 if pclass == "A" else 200, "json": applied}
        # A: one re-send, answered from the provider's stored response; B: one probe.
        assert len(cfake.writes) == (2 if pclass == "A" else 1)
        assert only(ledger).status is EffectStatus.COMMITTED
    assert len(cfake.applied) == 1


# -- class A: in flight and window -----------------------------------------------------


def test_class_a_409_in_flight_is_ambiguous_and_resent_until_answered(
    fake: FakeProvider, ledger: Ledger, client: httpx.Client
) -> None:
    # The key stays in flight until a re-send meets it (409); the client waits 0.2 s.
    fake.faults = ["held"]
    http = GuardedHTTP(client, ledger, retry=RetryPolicy(max_attempts=50, initial_s=0.1, max_s=0.2))
    result = pay(http, fake, "A")
    statuses = [w.status for w in fake.writes]
    assert 409 in statuses
    assert statuses[-1] == 201
    [(_, applied)] = fake.applied
    assert result == {"status": 201, "json": applied}
    assert only(ledger).status is EffectStatus.COMMITTED


def test_class_a_after_its_window_needs_a_human_not_a_resend(
    ledger: Ledger, restart: Callable[[], GuardedHTTP], clock: Clock, client: httpx.Client
) -> None:
    with running(FakeProvider(forget_after_s=0.0)) as fake:
        window_closed(fake, ledger, restart, clock, client)


def window_closed(
    fake: FakeProvider,
    ledger: Ledger,
    restart: Callable[[], GuardedHTTP],
    clock: Clock,
    client: httpx.Client,
) -> None:
    fake.faults = ["drop"]
    http = GuardedHTTP(client, ledger, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(EffectInDoubt) as doubt:  # no attempt left to re-send it with
        pay(http, fake, "A")
    assert isinstance(doubt.value.__cause__, httpx.ReadTimeout)
    clock.advance(WINDOW_S + 60)  # the window has passed
    with pytest.raises(EffectInDoubt) as info:
        pay(restart(), fake, "A")
    assert info.value.status == "needs_human"
    assert len(fake.writes) == 1  # the provider forgot the key: a re-send would pay twice
    assert len(fake.applied) == 1
    assert only(ledger).status is EffectStatus.NEEDS_HUMAN


def test_class_b_needs_a_lookup(fake: FakeProvider, ledger: Ledger, client: httpx.Client) -> None:
    http = GuardedHTTP(client, ledger)
    with pytest.raises(ConfigurationError):
        http.post(fake.url + "/p", effect="pay@1", key="k", provider_class="B")
    with pytest.raises(ConfigurationError):
        http.post(fake.url + "/p", effect="pay@1", key="k", provider_class="C", lookup="/{key}")
    assert fake.log == []


# -- async ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pclass", "fault"),
    [("A", "drop"), ("B", "cut"), ("B", "refuse")],
)
def test_async_client_settles_like_the_sync_one(
    pclass: str, fault: str, ledger: Ledger, restart: Callable[[], GuardedHTTP]
) -> None:
    provider = provider_for(pclass)
    provider.start()
    provider.faults = [fault]

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            http = AsyncGuardedHTTP(c, ledger, retry=RETRY)
            with step("run-1", "pay"):
                return await http.post(
                    provider.url + "/payments",
                    effect="pay@1",
                    json={"amount": 5},
                    **options(provider, pclass),
                )

    try:
        result = asyncio.run(main())
        assert asyncio.run(main()) == result
        assert pay(restart(), provider, pclass) == result
        assert len(provider.applied) == 1
        assert only(ledger).status is EffectStatus.COMMITTED
    finally:
        provider.stop()


# -- the default policy and the last attempt ([7] items 12, 18) ------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fault", ["error", "refuse", "drop", "cut"])
def test_the_default_policy_settles_one_5xx_or_lost_answer_by_the_class(
    cfake: FakeProvider,
    pclass: str,
    fault: str,
    mode: str,
    ledger: Ledger,
    restart: Callable[[], GuardedHTTP],
) -> None:
    # No retry= given: one 500 (or a lost answer) must not fail a class A or B run, since
    # the ledger has just proven a re-send safe. Class C never re-sends.
    cfake.faults = [fault]

    async def apay() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            with step("run-1", "pay"):
                return await AsyncGuardedHTTP(c, ledger).post(
                    cfake.url + "/payments",
                    effect="pay@1",
                    json={"amount": 5},
                    **options(cfake, pclass),
                )

    def once() -> dict[str, Any]:
        if mode == "async":
            return asyncio.run(apay())
        with httpx.Client(timeout=TIMEOUT) as c:
            return pay(GuardedHTTP(c, ledger), cfake, pclass)

    if pclass == "C":
        with pytest.raises(EffectInDoubt) as info:
            once()
        assert info.value.status == "needs_human"
        assert len(cfake.writes) == 1
        return
    result = once()
    assert pay(restart(), cfake, pclass) == result
    assert len(cfake.applied) == 1
    [(_, applied)] = cfake.applied
    assert result["json"] == applied
    assert only(ledger).status is EffectStatus.COMMITTED


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_class_a_with_no_attempt_left_is_in_doubt_and_the_next_call_resends_at_once(
    fake: FakeProvider, mode: str, ledger: Ledger, restart: Callable[[], GuardedHTTP]
) -> None:
    # It used to raise the raw ReadTimeout and leave a re-send claim nobody used, so the
    # next attempt (a `runs retry`) waited out its lease.
    fake.faults = ["drop"]
    one = RetryPolicy(max_attempts=1)

    async def apay() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            with step("run-1", "pay"):
                return await AsyncGuardedHTTP(c, ledger, retry=one).post(
                    fake.url + "/payments", effect="pay@1", json={"amount": 5}, **options(fake, "A")
                )

    def once() -> dict[str, Any]:
        if mode == "async":
            return asyncio.run(apay())
        with httpx.Client(timeout=TIMEOUT) as c:
            return pay(GuardedHTTP(c, ledger, retry=one), fake, "A")

    with pytest.raises(EffectInDoubt) as doubt:
        once()
    rec = only(ledger)
    assert (doubt.value.key_id, doubt.value.status) == (rec.key_id, "unknown")
    assert isinstance(doubt.value.__cause__, httpx.ReadTimeout)
    assert "re-sends it with the same key" in str(doubt.value)
    assert (rec.status, rec.lease_owner, rec.epoch) == (EffectStatus.UNKNOWN, None, 1)
    result = pay(restart(), fake, "A")  # never waits for a lease: none was left
    assert len(fake.writes) == 2  # the re-send, with the same key
    assert len({w.idempotency_key for w in fake.writes}) == 1
    [(_, applied)] = fake.applied
    assert result == {"status": 201, "json": applied}


# -- explicit keys belong to the step's tenant ([7] item 8) ---------------------------------


def test_the_same_explicit_key_in_two_tenants_steps_is_two_payments(
    fake: FakeProvider, ledger: Ledger, client: httpx.Client
) -> None:
    http = GuardedHTTP(client, ledger)
    paid = {}
    for run_id, tenant in (("r1", "acme"), ("r2", "globex"), ("r3", "acme")):
        with step(run_id, "pay", tenant=tenant):
            paid[run_id] = http.post(
                fake.url + "/payments",
                effect="pay@1",
                json={"amount": 5},
                key="invoice-7",
                **options(fake, "A"),
            )
    assert len(fake.applied) == 2
    assert paid["r1"] != paid["r2"]
    assert paid["r3"] == paid["r1"]
