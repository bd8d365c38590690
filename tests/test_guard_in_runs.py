"""Guarded effects inside runs of the runtime: where a call sits decides its key.

Explicit keys belong to the run's tenant and record the run they were made from; a key
rotation between two attempts of a step leaves the step's recorded effects replayable;
an interrupt while acting stops the worker instead of parking the run. The oracle is an
in-process fake provider that logs every raw delivery; every test runs on SQLite and
PostgreSQL, "another process" being a fresh Store and Ledger on the same database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from onceonly.adapters import current_claim, guard
from onceonly.checkpoint import RunStatus, Store
from onceonly.checkpoint.failpoints import armed
from onceonly.context import BranchContext, StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectRecord, EffectStatus, Evidence, RetentionPolicy
from onceonly.operator import Operator
from onceonly.runtime import Runtime
from onceonly.worker import Worker
from tests.ledger_support import K1, K2, Clock, Ledgers, keyring


class Crash(BaseException):
    """The process dies here: nothing after it runs, nothing catches it."""


@dataclass
class Provider:
    """A fake provider: ``deliveries`` is every raw request (provider key, payload)."""

    deliveries: list[tuple[str, Any]] = field(default_factory=list)
    interrupt: list[BaseException] = field(default_factory=list)

    def send(self, payload: Any) -> dict[str, Any]:
        key = current_claim().provider_key
        self.deliveries.append((key, payload))
        if self.interrupt:
            raise self.interrupt.pop(0)  # applied; the process is stopped mid-call
        return {"id": len(self.deliveries), "payload": payload}

    def lookup(self, record: EffectRecord) -> tuple[Evidence, Any]:
        for i, (key, payload) in enumerate(self.deliveries, 1):
            if key == record.provider_key:
                return Evidence.HAPPENED, {"id": i, "payload": payload}
        return Evidence.NOT_HAPPENED, None

    def sent(self) -> list[Any]:
        return [p for _, p in self.deliveries]


@pytest.fixture
def provider() -> Provider:
    return Provider()


def runtime(ledgers: Ledgers, flows: list[Flow], **ledger: Any) -> Runtime:
    """A runtime in "another process" (a fresh Store and Ledger, the same worker name)."""
    led = ledgers.fresh(owner="w1", **ledger)
    return Runtime(led.store, led, flows, owner="rt", clock=ledgers.clock)


# -- explicit keys: the run's tenant, and the run kept with them ([7] item 8) --------------


def paying(tenant: str, provider: Provider) -> Flow:
    flow = Flow(f"pay-{tenant}", tenant=tenant)

    @flow.step(start=True)
    def pay(ctx: StepContext) -> Transition:
        send = guard(ctx.ledger, effect="pay@1", key=lambda p: f"invoice-{p['invoice']}")(
            provider.send
        )
        ctx.state["receipt"] = send({"invoice": ctx.state["invoice"], "tenant": tenant})
        return ctx.end()

    return flow


def test_two_tenants_runs_with_the_same_explicit_key_each_send_their_own(
    store: Store, ledgers: Ledgers, provider: Provider
) -> None:
    flows = [paying("acme", provider), paying("globex", provider)]
    rt = runtime(ledgers, flows)
    runs = {
        name: rt.start(f"pay-{tenant}", {"invoice": 7}, run_id=name)
        for name, tenant in (("acme-1", "acme"), ("globex-1", "globex"), ("acme-2", "acme"))
    }
    for rid in runs.values():
        assert rt.drive(rid).status is RunStatus.COMPLETED
    # one payment per tenant; acme's second run replays acme's (dedup across its runs)
    assert provider.sent() == [
        {"invoice": 7, "tenant": "acme"},
        {"invoice": 7, "tenant": "globex"},
    ]
    state = {rid: store.load(rid).state["receipt"] for rid in runs.values()}
    assert state["acme-1"]["payload"]["tenant"] == "acme"
    assert state["globex-1"]["payload"]["tenant"] == "globex"
    assert state["acme-2"] == state["acme-1"]
    # each entry names the run and step it was made from, and its run's tenant
    for rid, tenant in (("acme-1", "acme"), ("globex-1", "globex")):
        [rec] = rt.ledger.effects(run_id=rid)
        assert (rec.tenant, rec.step_id, rec.status) == (tenant, "pay#0", EffectStatus.COMMITTED)


def test_retention_keeps_explicit_key_entries_while_their_run_exists(
    store: Store, ledgers: Ledgers, clock: Clock, provider: Provider
) -> None:
    rt = runtime(ledgers, [paying("acme", provider)])
    rid = rt.start("pay-acme", {"invoice": 7}, run_id="acme-1")
    assert rt.drive(rid).status is RunStatus.COMPLETED
    clock.advance(3600)
    assert rt.ledger.apply_retention(RetentionPolicy(older_than_s=0)) == 0
    again = rt.start("pay-acme", {"invoice": 7}, run_id="acme-2")
    assert rt.drive(again).status is RunStatus.COMPLETED
    assert len(provider.deliveries) == 1  # still deduplicated by the kept entry


def test_an_explicit_key_another_run_sends_at_last_stays_while_that_run_lives(
    store: Store, ledgers: Ledgers, clock: Clock, provider: Provider
) -> None:
    """Found by S11's deep tier: run A claims an explicit key and dies before sending; the
    entry is settled as not sent; run B claims it again and sends. The entry kept naming
    A, so collecting A (finished) removed it while B and B's forks lived, and a fork of B
    sent the payment a second time."""
    flow = Flow("pay-acme", tenant="acme")

    @flow.step(start=True)
    def pay(ctx: StepContext) -> Transition:
        note = guard(ctx.ledger, effect="note@1")(provider.send)  # positional, first
        send = guard(ctx.ledger, effect="pay@1", key=lambda p: f"invoice-{p['invoice']}")(
            provider.send
        )
        note(f"paying {ctx.state['invoice']}")
        ctx.state["receipt"] = send({"invoice": ctx.state["invoice"], "tenant": "acme"})
        return ctx.end()

    rt = runtime(ledgers, [flow])
    a = rt.start("pay-acme", {"invoice": 7}, run_id="acme-a")

    def die(name: str) -> None:
        if name == "adapters.act.before" and len(provider.deliveries) == 1:
            raise Crash(name)  # the note went out; the payment is claimed, not sent

    with armed(die), pytest.raises(Crash):
        rt.drive(a)
    assert provider.sent() == ["paying 7"]
    op = Operator(store, ledgers.fresh(owner="ops"), clock=clock)
    clock.advance(3600)  # A's claim lapses: in doubt; an operator says it was not sent
    b = rt.start("pay-acme", {"invoice": 7}, run_id="acme-b")
    rt2 = runtime(ledgers, [flow])
    assert rt2.drive(b).status is RunStatus.WAITING  # parked on the entry in doubt
    [doubt] = [r for r in op.ledger.effects() if r.status is not EffectStatus.COMMITTED]
    op.resolve(doubt.key_id, happened=False, evidence="provider: no such payment", actor="ops")
    assert rt2.drive(b).status is RunStatus.COMPLETED
    paid = ["paying 7", "paying 7", {"invoice": 7, "tenant": "acme"}]  # A's note, B's, B's pay
    assert provider.sent() == paid
    fork = op.fork(b, store.history(b)[0].seq, actor="ops", reason="again")
    op.cancel(a, actor="ops", reason="abandoned")
    clock.advance(3600)
    op.gc(older_than_s=0)
    # a new process; the fork replays B's note and B's payment, in the order B made them
    done = runtime(ledgers, [flow]).drive(fork)
    assert done.status is RunStatus.COMPLETED, op.show(fork).meta.get("error")
    assert provider.sent() == paid  # replayed, not re-sent
    entry = next(r for r in op.ledger.effects() if r.effect == "pay@1")
    assert (entry.run_id, entry.step_id) == (b, "pay#0")  # B sent it: the entry is B's now


# -- a key rotation between two attempts of a step ([7] item 9) ----------------------------


def two_effects(provider: Provider, stop: list[BaseException]) -> Flow:
    """One step: a positional effect, an explicit-key one and two branches, then (once)
    the step stops; then one more effect."""
    flow = Flow("rotate")

    @flow.step(start=True)
    def work(ctx: StepContext) -> Transition:
        send = guard(ctx.ledger, effect="send@1")(provider.send)
        pay = guard(ctx.ledger, effect="pay@1", key=lambda p: "invoice-1")(provider.send)
        ctx.state["first"] = send("first")
        ctx.state["paid"] = pay("paid")

        def branch(b: BranchContext) -> Any:
            return guard(b.ledger, effect="b@1")(provider.send)(b.name)

        ctx.state["branches"] = ctx.parallel({"left": branch, "right": branch})
        if stop:
            raise stop.pop(0)
        ctx.state["second"] = send("second")
        return ctx.end()

    return flow


@pytest.mark.parametrize("how", ["resume", "retry"])
def test_a_step_in_progress_finishes_after_a_key_rotation(
    store: Store, ledgers: Ledgers, provider: Provider, how: str
) -> None:
    stop: list[BaseException] = [Crash() if how == "resume" else ValueError("flaky")]
    rid = runtime(ledgers, [two_effects(provider, stop)]).start("rotate", {})
    first = runtime(ledgers, [two_effects(provider, stop)])
    if how == "resume":
        with pytest.raises(Crash):  # the process dies mid-step
            first.drive(rid)
    else:
        assert first.drive(rid).status is RunStatus.FAILED
    assert len(provider.deliveries) == 4
    # The documented rotation: a new current secret, the old one kept after it.
    rotated = runtime(ledgers, [two_effects(provider, stop)], keyring=keyring(K2, K1))
    if how == "retry":
        Operator(rotated.store, rotated.ledger).retry(rid, actor="ops", reason="rotated")
    run = rotated.drive(rid)
    assert run.status is RunStatus.COMPLETED, store.load(rid).state
    # the recorded four replayed (branches run concurrently, in either order), one more sent
    sent = provider.sent()
    assert (sent[:2], sorted(sent[2:4]), sent[4:]) == (
        ["first", "paid"],
        ["left", "right"],
        ["second"],
    )
    secrets = [r.secret_id for r in rotated.ledger.effects(run_id=rid) if r.effect == "send@1"]
    assert sorted(secrets) == ["k1", "k2"]


# -- an interrupt while acting stops the worker ([7] item 16) ------------------------------


def interrupted(provider: Provider) -> Flow:
    flow = Flow("interrupted")

    @flow.step(start=True)
    def deliver(ctx: StepContext) -> Transition:
        send = guard(ctx.ledger, effect="deliver@1", provider_class="B", probe=provider.lookup)
        ctx.state["receipt"] = send(provider.send)("hello")
        return ctx.end()

    return flow


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit], ids=lambda t: t.__name__)
def test_an_interrupt_while_acting_stops_the_worker_and_the_effect_is_reconciled_later(
    store: Store, ledgers: Ledgers, provider: Provider, interrupt: type[BaseException]
) -> None:
    provider.interrupt.append(interrupt())
    rt = runtime(ledgers, [interrupted(provider)])
    rid = rt.start("interrupted", {})
    with pytest.raises(interrupt):  # not parked as in doubt, not carried on
        Worker(rt, poll_s=0.1).run(until_idle=True)
    assert store.get_run(rid).status is RunStatus.RUNNING
    [rec] = rt.ledger.effects(run_id=rid)
    assert (rec.status, rec.lease_owner) == (EffectStatus.UNKNOWN, None)
    # the next worker (same name, restarted) settles it with the probe: never re-sent
    later = runtime(ledgers, [interrupted(provider)])
    assert later.drive(rid).status is RunStatus.COMPLETED
    assert len(provider.deliveries) == 1
    assert store.load(rid).state["receipt"] == {"id": 1, "payload": "hello"}
