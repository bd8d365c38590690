"""Tamper-evident where it acts (issue [8]): edits made by SQL behind the library's back,
on SQLite and PostgreSQL, are refused before anything is sent, and found by `verify`.

Every edit here is one an attacker with database access but without the keyring's
secret can make: change columns, recompute the *unkeyed* digests, delete rows, move a
head back. The oracle is the fake provider's delivery log.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import text

from onceonly.adapters import current_claim, guard
from onceonly.checkpoint import CorruptRecord, RunStatus, Store, Waits, WaitStatus
from onceonly.checkpoint import _delta as delta
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectIdentity, Ledger
from onceonly.ledger import _integrity as integrity
from onceonly.ledger._integrity import StoreRolledBack
from onceonly.ledger.audit import event_hash, row_digest
from onceonly.operator import Operator
from onceonly.runtime import Runtime
from onceonly.worker import Worker
from tests.dbutil import execute, fetch
from tests.ledger_support import Ledgers, effect_row


class Provider:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def pay(self, payload: Any) -> dict[str, Any]:
        self.sent.append((payload, current_claim().provider_key))
        return {"n": len(self.sent)}


def _payment_flow(provider: Provider) -> Flow:
    flow = Flow("payment")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval(
            "cfo", {"amount": ctx.state["amount"]}, then="pay", requested_by="alice"
        )

    @flow.step
    def pay(ctx: StepContext) -> Transition:
        ctx.approved("cfo", {"amount": ctx.state["amount"]})
        guard(ctx.ledger, effect="pay@1")(provider.pay)({"amount": ctx.state["amount"]})
        return ctx.end("paid")

    return flow


class World:
    def __init__(self, ledgers: Ledgers) -> None:
        self.ledgers = ledgers
        self.provider = Provider()
        self.ledger = ledgers.fresh(owner="w1")
        self.store = self.ledger.store
        self.flow = _payment_flow(self.provider)
        self.operator = Operator(self.store, self.ledger)

    def runtime(self) -> Runtime:
        """A worker process's runtime: a fresh store and ledger (no caches)."""
        led = self.ledgers.fresh(owner="w2")
        return Runtime(led.store, led, [self.flow], owner="w2")

    def waiting_run(self) -> str:
        rt = self.runtime()
        rid = rt.start("payment", {"amount": 900}, started_by="alice")
        assert rt.drive(rid).status is RunStatus.WAITING
        return rid


@pytest.fixture
def world(ledgers: Ledgers) -> World:
    return World(ledgers)


def _work(world: World) -> None:
    """A worker takes every ready run; what it cannot trust it skips (and logs)."""
    rt = world.runtime()
    Worker(rt, poll_s=0.05).run(until_idle=True)


def _verify_finds(world: World, needle: str) -> None:
    report = world.ledger.verify()
    assert not report.ok
    assert any(needle in p for p in report.problems), report.problems


# -- 1: a forged approval is refused before the payment ------------------------------------


@pytest.mark.parametrize("decided", [None, "rejected"])
def test_a_forged_approval_is_not_acted_on(world: World, decided: str | None) -> None:
    rid = world.waiting_run()
    if decided == "rejected":
        world.operator.reject(rid, "cfo", actor="bob", reason="no")
        assert world.runtime().drive(rid).status is RunStatus.FAILED
    execute(
        world.store.engine,
        "UPDATE oo_waits SET status = 'approved', decided_by = 'cfo', decided_at = 1 "
        "WHERE run_id = :r",
        r=rid,
    )
    execute(world.store.engine, "UPDATE oo_runs SET status = 'running' WHERE run_id = :r", r=rid)
    _work(world)
    assert world.provider.sent == []
    with pytest.raises(CorruptRecord):
        world.operator.show(rid)
    _verify_finds(world, "wait 'cfo'")


def test_a_subject_swapped_under_its_approval_is_refused(world: World) -> None:
    rid = world.waiting_run()
    codec = world.store.codec
    execute(
        world.store.engine,
        "UPDATE oo_waits SET subject = :s WHERE run_id = :r",
        s=codec.encode({"amount": 1}),
        r=rid,
    )
    with pytest.raises(CorruptRecord):
        world.operator.approve(rid, "cfo", actor="bob", subject_hash="0" * 64)
    assert world.provider.sent == []


# -- run rows and checkpoints with recomputed unkeyed digests --------------------------------


def test_a_finished_run_flipped_back_to_running_is_not_run(world: World) -> None:
    rid = world.waiting_run()
    [wait] = [w for w in world.operator.show(rid).waits if w.name == "cfo"]
    assert wait.subject_hash is not None
    world.operator.approve(rid, "cfo", actor="bob", subject_hash=wait.subject_hash)
    assert world.runtime().drive(rid).status is RunStatus.COMPLETED
    assert len(world.provider.sent) == 1
    # Roll the run row back to "waiting at pay" and its next step, by SQL.
    execute(
        world.store.engine,
        "UPDATE oo_runs SET status = 'running', next_step = 'pay' WHERE run_id = :r",
        r=rid,
    )
    _work(world)
    assert len(world.provider.sent) == 1
    _verify_finds(world, f"run {rid!r}")


def test_a_checkpoint_with_a_recomputed_digest_is_refused_before_it_is_decoded(
    world: World,
) -> None:
    rt = world.runtime()
    rid = rt.start("payment", {"amount": 900}, started_by="alice")
    [(seq, kind, kf, ver, step, src, at, body)] = fetch(
        world.store.engine,
        "SELECT seq, kind, keyframe_seq, schema_version, step, source, created_at, body "
        "FROM oo_checkpoints WHERE run_id = :r",
        r=rid,
    )
    raw = delta.unpack(bytes(body))
    forged = raw.replace(b"900", b"1")
    assert forged != raw
    digest = delta.row_digest(rid, seq, kind, kf, ver, step, src, at, forged)
    execute(
        world.store.engine,
        "UPDATE oo_checkpoints SET body = :b, digest = :d WHERE run_id = :r",
        b=delta.pack(forged),
        d=digest,
        r=rid,
    )
    with pytest.raises(CorruptRecord):
        world.runtime().drive(rid)
    _work(world)
    assert world.provider.sent == []
    _verify_finds(world, "seal")


def loop_flow() -> Flow:
    """Two steps visited in turn, four times: a history of several checkpoints."""
    flow = Flow("steps")

    @flow.step(start=True)
    def one(ctx: StepContext) -> Transition:
        ctx.state["n"] = ctx.state.get("n", 0) + 1
        return ctx.next("two") if ctx.state["n"] < 4 else ctx.end()

    @flow.step
    def two(ctx: StepContext) -> Transition:
        return ctx.next("one")

    return flow


def test_a_cut_back_history_is_refused(world: World) -> None:
    flow = loop_flow()
    led = world.ledgers.fresh(owner="w3")
    rt = Runtime(led.store, led, [flow], owner="w3")
    rid = rt.start("steps", {})
    assert rt.drive(rid).status is RunStatus.COMPLETED
    [(head,)] = fetch(world.store.engine, "SELECT head_seq FROM oo_runs WHERE run_id = :r", r=rid)
    execute(
        world.store.engine,
        "DELETE FROM oo_checkpoints WHERE run_id = :r AND seq > :h",
        r=rid,
        h=head - 2,
    )
    execute(
        world.store.engine,
        "UPDATE oo_runs SET head_seq = :h, status = 'running' WHERE run_id = :r",
        r=rid,
        h=head - 2,
    )
    fresh = world.ledgers.fresh(owner="w4").store
    with pytest.raises(CorruptRecord):
        fresh.load_run(rid)
    with pytest.raises(CorruptRecord):
        fresh.get_run(rid)
    _verify_finds(world, f"run {rid!r}")


def test_an_older_genuine_run_row_put_back_is_refused(world: World) -> None:
    """A run row rolled back alone to an older version of itself (genuinely sealed: a
    status, next step and head from before) is refused: a checkpoint sits above its head."""
    rid = world.waiting_run()
    [wait] = [w for w in world.operator.show(rid).waits if w.name == "cfo"]
    assert wait.subject_hash is not None
    world.operator.approve(rid, "cfo", actor="bob", subject_hash=wait.subject_hash)
    engine = world.store.engine
    with engine.connect() as conn:
        older = dict(
            conn.execute(text("SELECT * FROM oo_runs WHERE run_id = :r"), {"r": rid})
            .mappings()
            .one()
        )
        conn.rollback()
    assert world.runtime().drive(rid).status is RunStatus.COMPLETED
    assert len(world.provider.sent) == 1
    cols = ", ".join(older)
    execute(engine, "DELETE FROM oo_runs WHERE run_id = :run_id", run_id=rid)
    execute(engine, f"INSERT INTO oo_runs ({cols}) VALUES ({', '.join(':' + c for c in older)})",
            **older)  # fmt: skip
    fresh = world.ledgers.fresh(owner="w5").store
    with pytest.raises(CorruptRecord, match="above its head"):
        fresh.load_run(rid)
    with pytest.raises(CorruptRecord, match="above its head"):
        fresh.load(rid)
    _work(world)
    assert len(world.provider.sent) == 1
    _verify_finds(world, "above its head")


def test_an_unkeyed_store_says_what_it_cannot_detect(ledgers: Ledgers) -> None:
    bare = Store.open(ledgers.db_url)
    try:
        assert bare.integrity_note is not None
        assert "deliberate edits" in bare.integrity_note
    finally:
        bare.close()
    keyed = ledgers.fresh().store
    assert keyed.integrity_note is None


def test_waits_and_runs_are_sealed_on_both_backends(world: World) -> None:
    rid = world.waiting_run()
    [(seal,)] = fetch(world.store.engine, "SELECT seal FROM oo_waits WHERE run_id = :r", r=rid)
    assert seal is not None
    [(rseal,)] = fetch(world.store.engine, "SELECT seal FROM oo_runs WHERE run_id = :r", r=rid)
    assert rseal is not None
    assert world.operator.show(rid).waits[0].status is WaitStatus.OPEN
    assert isinstance(world.ledger, Ledger)


def test_rows_written_without_keys_are_refused_until_sealed(ledgers: Ledgers) -> None:
    bare = Store.open(ledgers.db_url)
    try:
        rid = bare.create_run("flow", next_step="a").run_id
        bare.save(rid, {"x": 1}, step="start")
    finally:
        bare.close()
    keyed = ledgers.fresh().store
    with pytest.raises(CorruptRecord, match="carries no seal"):
        keyed.load_run(rid)
    assert keyed.seal_unsealed() == 2  # the run row and its checkpoint
    run, snap = keyed.load_run(rid)
    assert snap is not None
    assert (run.next_step, snap.state) == ("a", {"x": 1})
    assert keyed.seal_unsealed() == 0


# -- the ledger: deleted events, recomputed digests, a restored store --------------------


def _effect(world: World, ledger: Ledger, n: int) -> Any:
    ident = EffectIdentity("t", "run-x", "s", 0, f"send{n}@1", 0)
    return ledger.perform(
        ident, {"n": n}, lambda claim: world.provider.sent.append((n, claim.provider_key))
    )


@pytest.mark.parametrize("which", ["middle", "newest"])
def test_an_effect_deleted_with_its_events_is_not_sent_again(
    world: World, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    led = world.ledgers.fresh(owner="w1")
    for n in range(4):
        _effect(world, led, n)
    kill = 1 if which == "middle" else 3
    [key] = [r.key_id for r in led.effects(run_id="run-x") if r.effect == f"send{kill}@1"]
    execute(world.store.engine, "DELETE FROM oo_audit WHERE key_id = :k", k=key)
    execute(world.store.engine, "DELETE FROM oo_effects WHERE key_id = :k", k=key)
    with pytest.raises(CorruptRecord):  # another process
        _effect(world, world.ledgers.fresh(owner="w2"), kill)
    # This process replays what it remembers; a key it never saw is refused once its
    # recount of the chain finds the gap.
    _effect(world, led, kill)
    later = time.monotonic() + 3600.0  # past any recount interval, however slow the machine

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return later

    monkeypatch.setattr(integrity, "time", Clock)
    with pytest.raises(CorruptRecord):
        _effect(world, led, 9)
    assert len(world.provider.sent) == 4
    _verify_finds(world, "chain 'run-x'")


def test_an_effect_row_with_recomputed_unkeyed_digests_is_refused(world: World) -> None:
    led = world.ledgers.fresh(owner="w1")
    _effect(world, led, 0)
    [rec] = led.effects(run_id="run-x")
    # As an attacker would: flip the row to not_happened, recompute its unkeyed digest
    # into its last event, and that event's (unkeyed) hash, and the head.
    row = effect_row(world.store.engine, rec.key_id)
    row["status"] = "not_happened"
    digest = row_digest(row)
    [(seq, event, epoch, actor, detail, at, prev)] = fetch(
        world.store.engine,
        "SELECT seq, event, epoch, actor, detail, at, prev_hash FROM oo_audit "
        "WHERE key_id = :k ORDER BY seq DESC LIMIT 1",
        k=rec.key_id,
    )
    h = event_hash(
        bytes(prev),
        "run-x",
        seq,
        rec.key_id,
        event,
        epoch,
        "not_happened",
        actor,
        detail,
        digest,
        at,
    )
    execute(
        world.store.engine,
        "UPDATE oo_effects SET status = 'not_happened' WHERE key_id = :k",
        k=rec.key_id,
    )
    execute(
        world.store.engine,
        "UPDATE oo_audit SET status = 'not_happened', row_digest = :d, hash = :h "
        "WHERE key_id = :k AND seq = :s",
        d=digest,
        h=h,
        k=rec.key_id,
        s=seq,
    )
    execute(world.store.engine, "UPDATE oo_chain_heads SET hash = :h WHERE chain = 'run-x'", h=h)
    other = world.ledgers.fresh(owner="w2")
    with pytest.raises(CorruptRecord):
        _effect(world, other, 0)
    assert len(world.provider.sent) == 1
    assert other.get(rec.key_id).integrity == "edited"
    assert [r.integrity for r in other.effects(run_id="run-x")] == ["edited"]
    _verify_finds(world, rec.key_id)


_TABLES = ("oo_effects", "oo_audit", "oo_chain_heads", "oo_data_keys")


def test_a_restored_store_behind_its_witness_refuses_to_act(world: World, tmp_path: Any) -> None:
    path = str(tmp_path / "witness")
    led = world.ledgers.fresh(owner="w1", witness=path)
    _effect(world, led, 0)
    engine = world.store.engine
    for t in _TABLES:  # a backup
        execute(engine, f"CREATE TABLE snap_{t} AS SELECT * FROM {t}")
    _effect(world, led, 1)
    for t in _TABLES:  # ... restored over the store
        execute(engine, f"DELETE FROM {t}")
        execute(engine, f"INSERT INTO {t} SELECT * FROM snap_{t}")
    other = world.ledgers.fresh(owner="w2", witness=path)
    with pytest.raises(StoreRolledBack):
        _effect(world, other, 1)
    with pytest.raises(StoreRolledBack):
        _effect(world, other, 2)  # nothing at all, in the rolled-back chain
    assert len(world.provider.sent) == 2
    # Without the witness the restore looks whole (the positive control of the witness).
    plain = world.ledgers.fresh(owner="w3", witness="")
    assert plain.witness is None
    report = other.verify(witness=path)
    assert any("behind" in p or "rolled back" in p for p in report.problems), report.problems
    other.accept_restore(actor="ops", reason="restored from the 09:00 backup, reconciled")
    _effect(world, other, 2)
    assert len(world.provider.sent) == 3


# -- a wait put back to an earlier, genuinely sealed version of itself ------------------


@pytest.mark.parametrize("then", ["approve", "drive"])
def test_a_rejection_put_back_to_its_open_version_is_refused(world: World, then: str) -> None:
    rid = world.waiting_run()
    cols = "status, decided_by, decided_at, reason, seal"
    [before] = fetch(world.store.engine, f"SELECT {cols} FROM oo_waits WHERE run_id = :r", r=rid)
    world.operator.reject(rid, "cfo", actor="bob", reason="no")
    # Put the wait row back as it was while open: every byte of it genuine and sealed.
    execute(
        world.store.engine,
        "UPDATE oo_waits SET status = :s, decided_by = :b, decided_at = :a, reason = :n, "
        "seal = :seal WHERE run_id = :r",
        s=before[0],
        b=before[1],
        a=before[2],
        n=before[3],
        seal=before[4],
        r=rid,
    )
    fresh = world.runtime()
    act: Any = (
        (lambda: world.operator.approve(rid, "cfo", actor="carol", subject_hash="0" * 64))
        if then == "approve"
        else (lambda: Waits(fresh.store).get(rid, "cfo"))
    )
    with pytest.raises(CorruptRecord, match="waits are not the ones"):
        act()
    _work(world)
    assert world.provider.sent == []
    _verify_finds(world, "waits are not the ones")


def test_a_restored_store_serves_no_run_or_wait_behind_its_witness(
    world: World, tmp_path: Any
) -> None:
    from onceonly.checkpoint import RunRolledBack
    from tests.test_ledger_audit import table_names

    path = str(tmp_path / "witness")
    led = world.ledgers.fresh(owner="w1", witness=path)
    rid = Runtime(led.store, led, [world.flow], owner="w1").start("payment", {"amount": 900})
    assert Runtime(led.store, led, [world.flow], owner="w1").drive(rid).status is RunStatus.WAITING
    engine = world.store.engine
    tables = table_names(engine)
    for t in tables:  # a backup, taken while the approval was open
        execute(engine, f"CREATE TABLE snap_{t} AS SELECT * FROM {t}")
    Operator(led.store, led).reject(rid, "cfo", actor="bob", reason="no")
    for t in tables:  # ... restored over the store: every row genuine and sealed
        execute(engine, f"DELETE FROM {t}")
        execute(engine, f"INSERT INTO {t} SELECT * FROM snap_{t}")
    other = world.ledgers.fresh(owner="w2", witness=path)
    with pytest.raises(RunRolledBack):
        Operator(other.store, other).approve(rid, "cfo", actor="carol", subject_hash="0" * 64)
    with pytest.raises(RunRolledBack):
        Runtime(other.store, other, [world.flow], owner="w2").drive(rid)
    with pytest.raises(RunRolledBack):
        other.store.load_run(rid)
    assert world.provider.sent == []
    report = other.verify()
    assert any(f"run {rid!r}" in p and "rolled back" in p for p in report.problems), report
    # Without the witness the restore looks whole: the open approval is served.
    plain = world.ledgers.fresh(owner="w3", witness="")
    assert Waits(plain.store).get(rid, "cfo").status is WaitStatus.OPEN
    # Accepted by an operator, the store is current again.
    other.accept_restore(actor="ops", reason="restored the 09:00 backup; re-asked the cfo")
    assert Waits(other.store).get(rid, "cfo").status is WaitStatus.OPEN
