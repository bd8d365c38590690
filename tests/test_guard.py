"""The guard: keys from the step, one claim/act/record path, retries only on evidence.

The provider is an in-process fake that logs every raw delivery (the oracle) and, when
asked to, deduplicates by the provider key (class A) or answers lookups (class B).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from adapters import RetryPolicy, current_claim, guard, step
from checkpoint import ConfigurationError, Store
from ledger import (
    EffectFailed,
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    KeyRecipe,
    Ledger,
    OutcomeClass,
)
from tests.ledger_support import Ledgers


@dataclass
class Provider:
    """A fake provider: ``deliveries`` is every raw request; ``applied`` what took effect."""

    dedup: bool = False
    deliveries: list[str] = field(default_factory=list)
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    fail_next: list[BaseException] = field(default_factory=list)
    fail_after_apply: list[BaseException] = field(default_factory=list)

    def send(self, key: str, to: str) -> dict[str, Any]:
        if self.fail_next:
            raise self.fail_next.pop(0)  # refused before anything left
        self.deliveries.append(key)
        if self.dedup and key in self.applied:
            return self.applied[key]
        receipt = {"id": len(self.applied) + 1, "to": to}
        self.applied[key] = receipt
        if self.fail_after_apply:
            raise self.fail_after_apply.pop(0)  # applied, answer lost
        return receipt

    def lookup(self, record: EffectRecord) -> tuple[Evidence, Any]:
        found = self.applied.get(record.provider_key)
        return (Evidence.HAPPENED, found) if found else (Evidence.NOT_HAPPENED, None)


def classify(exc: BaseException) -> OutcomeClass:
    if isinstance(exc, ConnectionRefusedError):
        return OutcomeClass.NOT_SENT
    if isinstance(exc, PermissionError):
        return OutcomeClass.REJECTED
    return OutcomeClass.AMBIGUOUS


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


def send_fn(ledger: Ledger, provider: Provider, **options: Any) -> Callable[[str], dict[str, Any]]:
    @guard(ledger, effect="send@1", classify=classify, **options)
    def send(to: str) -> dict[str, Any]:
        return provider.send(current_claim().provider_key, to)

    return send


def test_each_call_happens_once_and_a_rerun_of_the_step_replays(
    ledger: Ledger, spans: InMemorySpanExporter
) -> None:
    provider = Provider()
    send = send_fn(ledger, provider)
    with step("run-1", "notify"):
        first = [send("a@x"), send("b@x"), send("a@x")]  # ordinals 0, 1, 2
    with step("run-1", "notify"):  # the same visit again: a resume
        again = [send("a@x"), send("b@x"), send("a@x")]
    assert again == first
    assert len(provider.deliveries) == 3
    outcomes = [dict(s.attributes or {}) for s in spans.get_finished_spans()]
    assert [o["onceonly.effect.outcome"] for o in outcomes] == ["executed"] * 3 + ["replayed"] * 3
    assert all(o["gen_ai.tool.name"] == "send@1" for o in outcomes)
    assert all("a@x" not in str(v) and "b@x" not in str(v) for o in outcomes for v in o.values())
    assert spans.get_finished_spans()[0].name == "execute_tool send@1"


def test_a_new_visit_of_the_step_acts_again(ledger: Ledger) -> None:
    provider = Provider()
    send = send_fn(ledger, provider)
    with step("run-1", "poll", visit=0):
        send("a@x")
    with step("run-1", "poll", visit=1):
        send("a@x")
    assert len(provider.deliveries) == 2


def test_not_sent_is_retried_with_the_same_key(ledger: Ledger) -> None:
    provider = Provider(fail_next=[ConnectionRefusedError("refused")])
    send = send_fn(ledger, provider, retry=RetryPolicy(max_attempts=3, initial_s=0.0))
    with step("run-1", "s"):
        send("a@x")
    assert len(provider.deliveries) == 1
    [rec] = ledger.effects()
    assert (rec.status, rec.epoch, rec.attempts) == (EffectStatus.COMMITTED, 2, 2)


def test_class_a_resends_with_the_same_provider_key_inside_its_window(ledger: Ledger) -> None:
    provider = Provider(dedup=True, fail_after_apply=[TimeoutError("read timeout")])
    send = send_fn(
        ledger, provider, provider_class="A", window_s=3600, retry=RetryPolicy(initial_s=0.0)
    )
    with step("run-1", "s"):
        receipt = send("a@x")
    assert len(provider.deliveries) == 2  # the re-send reached the provider...
    assert len(set(provider.deliveries)) == 1  # ...with the same key
    assert len(provider.applied) == 1  # and took effect once
    assert receipt == provider.applied[provider.deliveries[0]]


def test_class_b_is_reconciled_by_its_probe(ledger: Ledger, spans: InMemorySpanExporter) -> None:
    provider = Provider(fail_after_apply=[TimeoutError("read timeout")])
    send = send_fn(ledger, provider, provider_class="B", probe=provider.lookup)
    with step("run-1", "s"):
        receipt = send("a@x")
    assert len(provider.deliveries) == 1
    assert receipt == provider.applied[provider.deliveries[0]]
    [rec] = ledger.effects()
    assert rec.status is EffectStatus.COMMITTED
    [span] = spans.get_finished_spans()
    assert (span.attributes or {})["onceonly.effect.outcome"] == "reconciled"


def test_class_c_in_doubt_needs_a_human_and_is_never_resent(ledger: Ledger) -> None:
    provider = Provider(fail_after_apply=[TimeoutError("read timeout")])
    send = send_fn(ledger, provider, retry=RetryPolicy(max_attempts=5, initial_s=0.0))
    for _ in range(2):
        with step("run-1", "s"), pytest.raises(EffectInDoubt) as info:
            send("a@x")
        assert info.value.status == "needs_human"
    assert len(provider.deliveries) == 1
    [rec] = ledger.effects()
    assert rec.status is EffectStatus.NEEDS_HUMAN


def test_a_rejection_is_recorded_and_replayed_as_failed(ledger: Ledger) -> None:
    provider = Provider(fail_next=[PermissionError("denied")])
    send = send_fn(ledger, provider, retry=RetryPolicy(max_attempts=3, initial_s=0.0))
    with step("run-1", "s"), pytest.raises(PermissionError):
        send("a@x")
    with step("run-1", "s"), pytest.raises(EffectFailed) as info:
        send("a@x")
    assert info.value.error_type == "PermissionError"
    assert provider.deliveries == []


def test_explicit_keys_and_recipes_work_outside_a_step(ledger: Ledger) -> None:
    provider = Provider()
    by_key = send_fn(ledger, provider, key=lambda to: f"invoice-173:{to}")
    by_recipe = send_fn(ledger, provider, recipe=KeyRecipe(("to",)))
    assert by_key("a@x") == by_key("a@x")
    assert by_recipe("b@x") == by_recipe("b@x")
    assert len(provider.deliveries) == 2
    with pytest.raises(ConfigurationError):
        send_fn(ledger, provider)("c@x")  # no step, no key


def test_async_calls_happen_once(ledger: Ledger) -> None:
    provider = Provider()

    @guard(ledger, effect="asend@1")
    async def asend(to: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        return provider.send(current_claim().provider_key, to)

    async def main() -> list[dict[str, Any]]:
        with step("run-1", "fanout"):
            return await asyncio.gather(*(asend(f"u{i}@x") for i in range(10)))

    first = asyncio.run(main())
    again = asyncio.run(main())
    assert again == first
    assert len(provider.deliveries) == 10


def test_the_guard_keeps_the_signature_for_type_checkers(ledger: Ledger) -> None:
    @guard(ledger, effect="typed@1", key=lambda n, label: f"{n}:{label}")
    def typed(n: int, label: str) -> str:
        return f"{label}-{n}"

    result: str = typed(1, "a")
    assert result == "a-1"
    # mypy (strict, warn_unused_ignores) checks the next line is a type error: if the
    # guard erased the signature, this ignore would be unused and the type check fails.
    with pytest.raises(TypeError):
        typed("1", 2, 3)  # type: ignore[call-arg, arg-type]


def test_a_probe_proving_not_happened_sends_within_a_single_attempt(
    store: Store, ledgers: Ledgers
) -> None:
    # A worker claimed and died before sending; its successor (same owner name) finds the
    # claim in doubt, the probe proves nothing happened: that costs no attempt, so the
    # default single attempt still sends (it used to raise EffectInDoubt, and a run
    # parked on an effect that was not in doubt any more).
    dead = ledgers.on(store, owner="w1")
    provider = Provider()
    with step("run-1", "s"):
        from adapters.context import identity_for

        dead.claim(identity_for("send@1"), {"to": "a@x"}, provider_class="B")
    successor = ledgers.fresh(owner="w1")
    send = send_fn(successor, provider, provider_class="B", probe=provider.lookup)
    with step("run-1", "s"):
        receipt = send("a@x")
    assert len(provider.deliveries) == 1
    assert receipt == provider.applied[provider.deliveries[0]]
    [rec] = successor.effects()
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 2)
