"""The guard: keys from the step, one claim/act/record path, retries only on evidence.

The provider is an in-process fake that logs every raw delivery (the oracle) and, when
asked to, deduplicates by the provider key (class A) or answers lookups (class B).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import RetryPolicy, StepDiverged, current_claim, guard, identity_for, step
from onceonly.checkpoint import ConfigurationError, Store
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    KeyRecipe,
    Ledger,
    OutcomeClass,
    ResultUnknown,
)
from tests.ledger_support import Clock, Ledgers, fail_statements


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
        from onceonly.adapters.context import identity_for

        dead.claim(identity_for("send@1"), {"to": "a@x"}, provider_class="B")
    successor = ledgers.fresh(owner="w1")
    send = send_fn(successor, provider, provider_class="B", probe=provider.lookup)
    with step("run-1", "s"):
        receipt = send("a@x")
    assert len(provider.deliveries) == 1
    assert receipt == provider.applied[provider.deliveries[0]]
    [rec] = successor.effects()
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 2)


# -- explicit keys belong to the step's tenant ([7] item 8) -------------------------------


def keyed(ledger: Ledger, provider: Provider, how: str, **options: Any) -> Any:
    """A guarded send whose key is the invoice number, by ``key=`` or by ``recipe=``."""
    if how == "key":
        return send_fn(ledger, provider, key=lambda to: "invoice-7", **options)
    return send_fn(ledger, provider, recipe=KeyRecipe(("to",)), **options)


@pytest.mark.parametrize("how", ["key", "recipe"])
def test_explicit_keys_take_the_steps_tenant_and_name_its_run(ledger: Ledger, how: str) -> None:
    provider = Provider()
    send = keyed(ledger, provider, how)
    with step("run-acme", "pay", tenant="acme"):
        acme = send("a@x")
    with step("run-globex", "pay", tenant="globex"):
        globex = send("a@x")  # the same explicit key in another tenant: another effect
    with step("run-acme-2", "pay", tenant="acme"):
        again = send("a@x")  # the same key in the same tenant: deduplicated across runs
    assert len(provider.deliveries) == 2
    assert acme != globex
    assert again == acme
    [first] = ledger.effects(run_id="run-acme")
    [other] = ledger.effects(run_id="run-globex")
    assert (first.tenant, first.step_id, other.tenant) == ("acme", "pay", "globex")
    assert ledger.effects(run_id="run-acme-2") == []  # replayed the first run's entry


def test_explicit_keys_take_the_steps_tenant_in_async_calls(ledger: Ledger) -> None:
    provider = Provider()

    @guard(ledger, effect="asend@1", key=lambda to: "invoice-7")
    async def asend(to: str) -> dict[str, Any]:
        return provider.send(current_claim().provider_key, to)

    async def main(run_id: str, tenant: str) -> dict[str, Any]:
        with step(run_id, "pay", tenant=tenant):
            return await asend("a@x")

    acme = asyncio.run(main("r1", "acme"))
    assert asyncio.run(main("r2", "globex")) != acme
    assert asyncio.run(main("r3", "acme")) == acme
    assert len(provider.deliveries) == 2


@pytest.mark.parametrize("how", ["key", "recipe"])
def test_a_guard_tenant_other_than_the_steps_is_refused(ledger: Ledger, how: str) -> None:
    provider = Provider()
    with step("run-1", "pay", tenant="acme"), pytest.raises(ConfigurationError, match="tenant"):
        keyed(ledger, provider, how, tenant="globex")("a@x")
    assert provider.deliveries == []
    assert ledger.effects() == []
    with step("run-1", "pay", tenant="acme"):  # naming the step's own tenant is fine
        keyed(ledger, provider, how, tenant="acme")("a@x")
    # outside a step the guard's tenant is the key's
    assert (
        keyed(ledger, provider, how, tenant="globex")("a@x")
        != provider.applied[provider.deliveries[0]]
    )
    assert len(provider.deliveries) == 2


def test_explicit_keys_recorded_by_a_step_are_checked_in_any_order_on_resume(
    ledger: Ledger,
) -> None:
    provider = Provider()
    pay = send_fn(ledger, provider, key=lambda to: f"invoice:{to}")
    note = send_fn(ledger, provider)
    with step("run-1", "s"):
        pay("a@x")
        pay("b@x")
        note("c@x")
    recorded = [e["key_id"] for e in ledger.audit_events("run-1") if e["event"] == "claimed"]
    with step("run-1", "s", recorded=recorded):  # explicit keys out of their recorded order
        pay("b@x")
        pay("a@x")
        note("c@x")
    with pytest.raises(StepDiverged), step("run-1", "s", recorded=recorded):
        note("c@x")  # a positional call before recorded ones: diverged, nothing sent
    assert len(provider.deliveries) == 3


# -- re-sends the evidence allows, and no claim left behind ([7] items 12, 18) ------------

CLASSES = ["A", "B", "C"]


def class_options(pclass: str, provider: Provider) -> dict[str, Any]:
    if pclass == "A":
        return {"provider_class": "A", "window_s": 3600}
    if pclass == "B":
        return {"provider_class": "B", "probe": provider.lookup}
    return {"provider_class": "C"}


def run_send(send: Callable[[str], Any], mode: str) -> Any:
    """Call ``send`` in step ``s`` of ``run-1``, directly or from a coroutine."""
    if mode == "sync":
        with step("run-1", "s"):
            return send("a@x")

    async def main() -> Any:
        with step("run-1", "s"):
            return await send("a@x")

    return asyncio.run(main())


def sender(ledger: Ledger, provider: Provider, mode: str, **options: Any) -> Callable[[str], Any]:
    if mode == "sync":
        return send_fn(ledger, provider, **options)

    @guard(ledger, effect="send@1", classify=classify, **options)
    async def asend(to: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        return provider.send(current_claim().provider_key, to)

    return asend


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("pclass", CLASSES)
@pytest.mark.parametrize("applied", [True, False], ids=["answer-lost", "not-applied"])
def test_the_default_policy_makes_every_resend_the_evidence_allows(
    ledger: Ledger, ledgers: Ledgers, mode: str, pclass: str, applied: bool
) -> None:
    # One ambiguous failure (a timeout, a 500) with the default policy: class A re-sends
    # inside its window, class B asks its probe (and re-sends what did not happen), class
    # C needs a human. It used to take one attempt and fail the run.
    provider = Provider(dedup=pclass == "A")
    if applied:
        provider.fail_after_apply.append(TimeoutError("read timeout"))
    else:
        provider.fail_next.append(TimeoutError("500, then the connection closed"))
    send = sender(ledger, provider, mode, **class_options(pclass, provider))
    if pclass == "C":
        with pytest.raises(EffectInDoubt) as doubt:
            run_send(send, mode)
        assert doubt.value.status == "needs_human"
        assert len(provider.deliveries) == (1 if applied else 0)
        return
    receipt = run_send(send, mode)
    assert len(provider.applied) == 1
    assert receipt == next(iter(provider.applied.values()))
    assert run_send(sender(ledgers.fresh(), provider, mode), mode) == receipt  # replayed
    assert len(provider.applied) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("pclass", CLASSES)
@pytest.mark.parametrize("attempts", [1, 2])
@pytest.mark.parametrize("failure", ["answer-lost", "not-applied", "not-sent", "rejected"])
def test_no_claim_outlives_its_call(
    ledger: Ledger,
    ledgers: Ledgers,
    mode: str,
    pclass: str,
    attempts: int,
    failure: str,
) -> None:
    # Whatever a call ends with, it leaves no live claim behind: the next call (another
    # process that never waits for a claim) settles the entry at once, never
    # EffectInFlight. Class A with no attempt left stays UNKNOWN and the caller gets
    # EffectInDoubt (it used to get the raw error, with a re-send claim left open).
    provider = Provider(dedup=pclass == "A")
    error: dict[str, BaseException] = {
        "answer-lost": TimeoutError("read timeout"),
        "not-applied": TimeoutError("read timeout"),
        "not-sent": ConnectionRefusedError("refused"),
        "rejected": PermissionError("denied"),
    }
    for _ in range(attempts):
        if failure == "answer-lost":
            provider.fail_after_apply.append(error[failure])
        else:
            provider.fail_next.append(error[failure])
    options = class_options(pclass, provider)
    policy = RetryPolicy(max_attempts=attempts, initial_s=0.0)
    raised: BaseException | None = None
    try:
        run_send(sender(ledger, provider, mode, retry=policy, **options), mode)
    except Exception as exc:  # noqa: BLE001  (what it raised is checked below)
        raised = exc
    [rec] = ledger.effects()
    assert rec.status is not EffectStatus.CLAIMED
    assert rec.lease_owner is None
    if pclass == "A" and (failure == "not-applied" or (failure == "answer-lost" and attempts == 1)):
        assert isinstance(raised, EffectInDoubt)
        assert (raised.status, raised.key_id) == ("unknown", rec.key_id)
        assert raised.__cause__ is error[failure]
    # the next call, in another process, settles it at once (no lease to wait out)
    later = sender(ledgers.fresh(owner="w2"), provider, mode, **options)
    try:
        run_send(later, mode)
    except (EffectInDoubt, EffectFailed):
        assert pclass == "C" or failure == "rejected"
    assert len(provider.applied) <= 1


# -- interrupts stop the call, in doubt ([7] item 16) -----------------------------------


class Halt(BaseException):
    """Another interrupt: a BaseException that is not an Exception."""


@pytest.mark.parametrize("pclass", CLASSES)
@pytest.mark.parametrize(
    "interrupt", [KeyboardInterrupt(), SystemExit(3), GeneratorExit(), Halt()], ids=type
)
def test_an_interrupt_while_acting_is_raised_as_is_and_leaves_the_entry_in_doubt(
    ledger: Ledger, pclass: str, interrupt: BaseException, spans: InMemorySpanExporter
) -> None:
    provider = Provider(dedup=pclass == "A", fail_after_apply=[interrupt])
    probed: list[str] = []

    def probe(record: EffectRecord) -> tuple[Evidence, Any]:
        probed.append(record.key_id)
        return provider.lookup(record)

    options = class_options(pclass, provider)
    if pclass == "B":
        options["probe"] = probe
    send = send_fn(ledger, provider, retry=RetryPolicy(max_attempts=5, initial_s=0.0), **options)
    with step("run-1", "s"), pytest.raises(type(interrupt)) as info:
        send("a@x")
    assert info.value is interrupt  # the interrupt itself, not EffectInDoubt
    [rec] = ledger.effects()
    assert (rec.status, rec.lease_owner, rec.epoch) == (EffectStatus.UNKNOWN, None, 1)
    assert len(provider.deliveries) == 1  # neither retried
    assert probed == []  # nor reconciled
    assert (spans.get_finished_spans()[-1].attributes or {})["onceonly.effect.outcome"] == (
        "in_doubt"
    )


def test_an_interrupt_when_the_ledger_cannot_be_written_leaves_the_claim_to_lapse(
    store: Store, ledgers: Ledgers, clock: Clock
) -> None:
    ledger = ledgers.on(store, owner="w1")
    broken = contextlib.ExitStack()

    def send(to: str) -> dict[str, Any]:
        broken.enter_context(fail_statements(store.engine, "oo_effects", "UPDATE"))
        raise KeyboardInterrupt  # and the ledger cannot record it (until the block ends)

    guarded = guard(ledger, effect="send@1", provider_class="B", probe=Provider().lookup)(send)
    with broken, step("run-1", "s"), pytest.raises(KeyboardInterrupt):
        guarded("a@x")
    [rec] = ledgers.fresh().effects()
    assert rec.status is EffectStatus.CLAIMED  # lapses with its lease: in doubt then
    clock.advance(ledger.lease_s + 1)
    with step("run-1", "s"):
        later = ledgers.fresh(owner="w2")
        guard(later, effect="send@1", provider_class="B", probe=Provider().lookup)(
            lambda to: {"sent": to}
        )("a@x")
    assert later.get(rec.key_id).status is EffectStatus.COMMITTED


@pytest.mark.parametrize("pclass", CLASSES)
def test_a_cancelled_async_call_is_in_doubt_and_never_retried(ledger: Ledger, pclass: str) -> None:
    provider = Provider(dedup=pclass == "A")
    applied = asyncio.Event()

    @guard(
        ledger,
        effect="send@1",
        retry=RetryPolicy(max_attempts=5, initial_s=0.0),
        **class_options(pclass, provider),
    )
    async def asend(to: str) -> dict[str, Any]:
        receipt = provider.send(current_claim().provider_key, to)
        if not applied.is_set():  # the first answer never comes; a retry (a bug) returns
            applied.set()
            await asyncio.Event().wait()
        return receipt

    async def main() -> None:
        with step("run-1", "s"):
            task = asyncio.create_task(asend("a@x"))
            await applied.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    [rec] = ledger.effects()
    assert (rec.status, rec.lease_owner, rec.epoch) == (EffectStatus.UNKNOWN, None, 1)
    assert len(provider.deliveries) == 1


def test_a_call_cancelled_while_claiming_gives_its_claim_back(
    ledger: Ledger, ledgers: Ledgers
) -> None:
    provider = Provider()
    acted: list[str] = []

    @guard(ledger, effect="send@1", provider_class="B", probe=provider.lookup)
    async def asend(to: str) -> dict[str, Any]:
        acted.append(to)
        return provider.send(current_claim().provider_key, to)

    async def main() -> None:
        with step("run-1", "s"):
            task = asyncio.create_task(asend("a@x"))
            await asyncio.sleep(0)  # the task is now waiting for its claim to be recorded
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    ledger.close()  # waits for the claim's thread, and the give-back after it
    assert acted == []
    [rec] = ledgers.fresh().effects()
    assert (rec.status, rec.lease_owner) == (EffectStatus.NOT_HAPPENED, None)
    with step("run-1", "s"):
        send_fn(ledgers.fresh(owner="w2"), provider, provider_class="B", probe=provider.lookup)(
            "a@x"
        )
    assert len(provider.deliveries) == 1


# -- a resolution without a result ([7] item 19) ----------------------------------------


def resolve_without_result(ledger: Ledger, provider: Provider) -> str:
    """A call whose answer was lost, that nobody could tell about at the time, resolved by
    an operator as happened without the provider's result."""
    provider.fail_after_apply.append(TimeoutError("read timeout"))
    with step("run-1", "s"), pytest.raises(EffectInDoubt) as doubt:
        send_fn(ledger, provider)("a@x")
    ledger.resolve(str(doubt.value.key_id), happened=True, evidence="in the portal", actor="ops")
    return str(doubt.value.key_id)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_result_left_out_by_the_operator_is_asked_of_the_probe(
    ledger: Ledger, ledgers: Ledgers, mode: str
) -> None:
    provider = Provider()
    key_id = resolve_without_result(ledger, provider)
    # the step runs again, now with an adapter that can ask the provider
    send = sender(
        ledgers.fresh(owner="w2"), provider, mode, provider_class="B", probe=provider.lookup
    )
    receipt = run_send(send, mode)
    assert receipt == next(iter(provider.applied.values()))
    assert len(provider.deliveries) == 1
    [*_, corrected] = ledger.audit_events("run-1", key_ids=[key_id])
    assert (corrected["event"], corrected["actor"]) == ("corrected", "probe")
    assert run_send(sender(ledgers.fresh(), provider, mode), mode) == receipt  # replays it


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("probe", ["none", "not-found", "broken"])
def test_a_result_nobody_knows_is_a_typed_error_and_nothing_is_sent(
    ledger: Ledger, ledgers: Ledgers, mode: str, probe: str
) -> None:
    provider = Provider()
    key_id = resolve_without_result(ledger, provider)

    def not_found(record: EffectRecord) -> tuple[Evidence, Any]:
        return Evidence.NOT_HAPPENED, None

    def broken(record: EffectRecord) -> tuple[Evidence, Any]:
        raise OSError("lookup down")

    probes: dict[str, Any] = {"none": None, "not-found": not_found, "broken": broken}
    for _ in range(2):  # and again: a retry of the step gets the same answer
        send = sender(ledgers.fresh(owner="w2"), provider, mode, probe=probes[probe])
        with pytest.raises(ResultUnknown) as info:
            run_send(send, mode)
        assert info.value.key_id == key_id
        assert f"onceonly effects correct {key_id}" in str(info.value)
    assert len(provider.deliveries) == 1
    ledger.correct(key_id, result={"id": 1}, evidence="portal receipt 1", actor="ops")
    assert run_send(sender(ledgers.fresh(owner="w3"), provider, mode), mode) == {"id": 1}
    assert len(provider.deliveries) == 1


# -- async ledger calls see the caller's context ([7]) -------------------------------------

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="-")


def test_async_ledger_calls_run_in_the_callers_context(ledger: Ledger) -> None:
    provider = Provider(fail_next=[ConnectionRefusedError("refused")])
    seen: list[str] = []

    def classify_seeing(exc: BaseException) -> OutcomeClass:
        seen.append(_CALLER.get())  # runs in the ledger call that records the attempt
        return OutcomeClass.NOT_SENT

    def probe(record: EffectRecord) -> tuple[Evidence, Any]:
        seen.append(_CALLER.get())  # runs in the ledger call that claims
        return Evidence.NOT_HAPPENED, None

    @guard(
        ledger,
        effect="send@1",
        provider_class="B",
        probe=probe,
        classify=classify_seeing,
        retry=RetryPolicy(max_attempts=2, initial_s=0.0),
    )
    async def asend(to: str) -> dict[str, Any]:
        return provider.send(current_claim().provider_key, to)

    async def main() -> None:
        _CALLER.set("run-1 fence")
        with step("run-1", "s"):
            await asend("a@x")
        with step("run-1", "t"):
            claim = ledger.claim(identity_for("send@1"), {"to": "b@x"}, provider_class="B")
            assert isinstance(claim, Claim)
            ledger.mark_unknown(claim, "timeout")  # in doubt: the next call probes it
        with step("run-1", "t"):
            await asend("b@x")

    asyncio.run(main())
    assert seen == ["run-1 fence", "run-1 fence"]
