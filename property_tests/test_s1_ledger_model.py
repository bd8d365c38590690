"""S1: the real effects ledger beside a plain dict model (RELIABILITY.md, S1).

Two workers (each a Store + Ledger, i.e. a process) claim, commit, fail, release and
mark effects unknown; the clock jumps past leases so the other worker finds expired
claims; a worker crashes (its ledger is dropped; it restarts under the same or a new
name); the keyring rotates to a new current secret; approvals are opened, approved
(bound to the subject's hash) or rejected; an effect row is tampered with by SQL.

After every step the ledger must agree with the model: every entry's status and epoch,
epochs never going down, no committed entry ever claimable again, ``verify`` clean
unless a row was tampered with (then it names the row, and every read that could lead
to an action refuses it with ``CorruptRecord``). The provider's raw log (a counting
fake) must show every effect applied at most once.

Every mode: each worker's store takes the next durability mode in turn (worker 0 of example
e starts in ``MODES[e % 3]``, worker 1 in the next, and each restart after a crash or a key
rotation in the next again), so every example mixes modes in one database and every mode
meets every rule; the report's ``modes`` counts the worker stores opened per mode.

CI size: 40 examples x 40 steps per backend (deep: 300 x 50). The positive control
plants a bug (an expired lease is treated as free) and the machine must fail.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from onceonly.checkpoint import CorruptRecord, Store, Waits, WaitStatus, subject_hash
from onceonly.checkpoint.errors import WaitRefused
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectIdentity,
    EffectInDoubt,
    EffectInFlight,
    EffectStatus,
    Evidence,
    InFlightPolicy,
    KeyReuseError,
    Keyring,
    LeaseLost,
    Ledger,
    ProviderClass,
    Replay,
    Secret,
)
from property_tests.reliability import SuiteReport, mode_of, scaled, seeds
from property_tests.s1_support import CountingProvider, wipe
from tests.dbutil import execute
from tests.ledger_support import K1, Clock, ident

EXAMPLES = scaled(ci=40, deep=300)
STEPS = scaled(ci=40, deep=50)
LEASE_S = 30.0
IDENTS: tuple[EffectIdentity, ...] = (
    ident(0),
    ident(1),
    ident(2),
    ident(0, step="book"),
    ident(run=None, explicit="inv-1", effect="charge@1"),
)
ARGS = ({"n": 1}, {"n": 2})
B = ProviderClass.QUERYABLE

REPORT = SuiteReport(suite="S1", seeds=seeds(1))


@dataclass
class Entry:
    """The model of one ledger entry."""

    key_id: str
    secret_id: str
    args: Any
    provider_key: str
    status: str = "claimed"
    epoch: int = 1
    owner: str = ""
    expires: float = 0.0
    result: Any = None
    tampered: bool = False


@dataclass
class Worker:
    """One process: its ledger, its owner name, and the claims it holds (the model of
    the ledger object's own "claims I handed out" set)."""

    ledger: Ledger
    owner: str
    held: dict[int, Claim] = field(default_factory=dict)
    live: set[tuple[str, int]] = field(default_factory=set)


@dataclass
class Counts:
    examples: int = 0
    steps: int = 0
    claims: int = 0
    keys: set[str] = field(default_factory=set)
    raw: int = 0
    needs_human: int = 0
    tampered: int = 0
    detected: int = 0
    modes: dict[str, int] = field(default_factory=dict)


class LedgerModel(RuleBasedStateMachine):
    """The ledger and its model, side by side."""

    db_url = ""
    counts = Counts()

    def __init__(self) -> None:
        super().__init__()
        wipe(self.db_url)
        self.clock = Clock(1_800_000_000.0)
        self.secrets: list[Secret] = [K1]
        self.incarnation = 0
        self.starts = self.counts.examples  # the next worker store's mode: mode_of(starts)
        self.workers = [self._start("w0"), self._start("w1")]
        self.run = self.workers[0].ledger.store.create_run("flow", run_id="run-1").run_id
        self.model: dict[int, Entry] = {}
        self.approvals: dict[str, tuple[str, str]] = {}  # name -> (status, subject hash)
        self.max_epoch: dict[int, int] = {}
        self.provider = CountingProvider()
        self.counts.examples += 1

    @property
    def waits(self) -> Waits:
        return Waits(self.workers[0].ledger.store, clock=self.clock)

    def teardown(self) -> None:
        self.counts.raw += len(self.provider.raw)
        for w in self.workers:
            w.ledger.close()
            with contextlib.suppress(Exception):
                w.ledger.store.close()

    # -- helpers ---------------------------------------------------------------------
    def _start(self, owner: str) -> Worker:
        mode = mode_of(self.starts)
        self.starts += 1
        self.counts.modes[mode] = self.counts.modes.get(mode, 0) + 1
        store = Store.open(self.db_url, durability=mode)
        led = Ledger(
            store,
            Keyring(self.secrets),
            owner=owner,
            lease_s=LEASE_S,
            in_flight=InFlightPolicy(wait_s=0),
            clock=self.clock,
        )
        return Worker(led, owner)

    def _stop(self, w: Worker) -> None:
        w.ledger.close()
        w.ledger.store.close()

    def _expect_claim(self, w: Worker, i: int, args: Any) -> str:
        """What the ledger must answer: claim | replay | failed | reuse | inflight |
        doubt | corrupt (and the model changes it implies)."""
        e = self.model.get(i)
        if e is None:
            return "claim"
        if e.tampered:
            return "corrupt"
        if e.args != args:
            return "reuse"
        if e.status == "committed":
            return "replay"
        if e.status == "failed":
            return "failed"
        if e.status == "claimed":
            live = e.expires > self.clock.now
            orphan = e.owner == w.owner and (e.key_id, e.epoch) not in w.live
            return "inflight" if live and not orphan else "expire"
        if e.status == "not_happened":
            return "reclaim"
        return "doubt"

    # -- rules -----------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        pass

    @rule(
        wi=st.integers(0, 1),
        i=st.integers(0, len(IDENTS) - 1),
        other=st.integers(0, 9).map(lambda n: n == 0),
    )
    def claim(self, wi: int, i: int, other: bool) -> None:
        w = self.workers[wi]
        e = self.model.get(i)
        args = ARGS[1] if other and e is not None else (e.args if e else ARGS[0])
        want = self._expect_claim(w, i, args)
        if e is not None and e.tampered:
            # a terminal row cached before the tamper may be replayed from memory (the
            # true state, nothing acted on); anything else must be refused
            try:
                out = w.ledger.claim(IDENTS[i], args, provider_class=B)
            except (CorruptRecord, KeyReuseError, EffectFailed):
                return
            assert isinstance(out, Replay), f"a tampered entry was claimed: {out}"
            return
        try:
            out = w.ledger.claim(IDENTS[i], args, provider_class=B)
        except KeyReuseError:
            assert want == "reuse", want
            return
        except EffectFailed:
            assert want == "failed", want
            return
        except EffectInFlight:
            assert want == "inflight", want
            return
        except EffectInDoubt:
            assert want in ("doubt", "expire"), want
            if want == "expire":
                assert e is not None
                e.status, e.owner = "unknown", ""
            return
        if isinstance(out, Replay):
            assert want == "replay", want
            assert e is not None
            assert out.result == e.result
            return
        assert want in ("claim", "reclaim"), f"expected {want}, the ledger granted a claim"
        if e is None:
            sid = self.secrets[0].id
            e = Entry(out.key_id, sid, args, out.provider_key)
            self.model[i] = e
            assert out.key_id == w.ledger.key_id(IDENTS[i])
        else:
            assert out.key_id == e.key_id
            e.epoch += 1
            e.status = "claimed"
        assert out.epoch == e.epoch
        assert out.provider_key == e.provider_key
        e.owner, e.expires = w.owner, self.clock.now + LEASE_S
        w.held[i] = out
        w.live.add((out.key_id, out.epoch))
        self.counts.claims += 1
        self.counts.keys.add(out.key_id)
        self.provider.send(out.provider_key, args)  # the act: the provider applies it

    # claims are most of what a ledger sees: give them more of the steps
    @rule(wi=st.integers(0, 1), i=st.integers(0, len(IDENTS) - 1))
    def claim_again(self, wi: int, i: int) -> None:
        self.claim(wi, i, other=False)

    @rule(wi=st.integers(0, 1), i=st.integers(0, len(IDENTS) - 1))
    def claim_once_more(self, wi: int, i: int) -> None:
        self.claim(wi, i, other=False)

    @precondition(lambda self: any(w.held for w in self.workers))
    @rule(data=st.data(), how=st.sampled_from(["commit", "fail", "unknown", "release"]))
    def outcome(self, data: st.DataObject, how: str) -> None:
        w = data.draw(st.sampled_from([w for w in self.workers if w.held]))
        i = data.draw(st.sampled_from(sorted(w.held)))
        c = w.held.pop(i)
        e = self.model[i]
        w.live.discard((c.key_id, c.epoch))
        current = e.status == "claimed" and e.epoch == c.epoch and not e.tampered
        try:
            if how == "commit":
                w.ledger.commit(c, {"sent": c.epoch})
            elif how == "fail":
                w.ledger.fail(c, "Rejected", "no")
            elif how == "unknown":
                w.ledger.mark_unknown(c, "timeout")
            else:
                w.ledger.release(c, "refused")
        except LeaseLost:
            assert not current, "a current claim lost its lease"
            assert not e.tampered, "a tampered entry was read as a stale claim"
            if how in ("fail", "release"):
                self.provider.void(c.provider_key)  # the stale attempt was refused too
            return
        except CorruptRecord:
            assert e.tampered, "an untampered entry was refused as corrupt"
            return
        assert current, f"a stale claim (epoch {c.epoch}) was allowed to {how}"
        e.owner = ""
        if how == "commit":
            e.status, e.result = "committed", {"sent": c.epoch}
        elif how == "fail":
            e.status = "failed"
            self.provider.void(c.provider_key)
        elif how == "unknown":
            e.status = "unknown"
        else:
            e.status = "not_happened"
            self.provider.void(c.provider_key)

    @precondition(
        lambda self: any(
            not e.tampered
            and (e.status == "unknown" or (e.status == "claimed" and e.expires <= self.clock.now))
            for e in self.model.values()
        )
    )
    @rule(data=st.data(), inconclusive=st.booleans())
    def reconcile(self, data: st.DataObject, inconclusive: bool) -> None:
        """The probe asks the provider (class B) whether the reference was applied."""
        doubtful = [
            i
            for i, e in sorted(self.model.items())
            if not e.tampered
            and (e.status == "unknown" or (e.status == "claimed" and e.expires <= self.clock.now))
        ]
        i = data.draw(st.sampled_from(doubtful))
        e = self.model[i]
        w = self.workers[0]
        happened = self.provider.happened(e.provider_key)
        if inconclusive:
            rec = w.ledger.reconcile(e.key_id, Evidence.INCONCLUSIVE)
            e.status = "needs_human"
            self.counts.needs_human += 1
        elif happened:
            rec = w.ledger.reconcile(e.key_id, Evidence.HAPPENED, result="probed")
            e.status, e.result = "committed", "probed"
        else:
            rec = w.ledger.reconcile(e.key_id, Evidence.NOT_HAPPENED)
            e.status = "not_happened"
        e.owner = ""
        assert not isinstance(rec, Claim)
        assert rec.status.value == e.status

    @precondition(
        lambda self: any(e.status == "needs_human" and not e.tampered for e in self.model.values())
    )
    @rule(data=st.data())
    def resolve(self, data: st.DataObject) -> None:
        human = [
            i for i, e in sorted(self.model.items()) if e.status == "needs_human" and not e.tampered
        ]
        i = data.draw(st.sampled_from(human))
        e = self.model[i]
        happened = self.provider.happened(e.provider_key)
        self.workers[1].ledger.resolve(
            e.key_id, happened=happened, evidence="portal", actor="ops", result="resolved"
        )
        e.status = "committed" if happened else "not_happened"
        if happened:
            e.result = "resolved"

    @rule(seconds=st.sampled_from([1.0, LEASE_S + 1.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(wi=st.integers(0, 1), same_name=st.booleans())
    def crash(self, wi: int, same_name: bool) -> None:
        """The worker dies: its claims are gone with it; it restarts from disk."""
        old = self.workers[wi]
        self._stop(old)
        self.incarnation += 1
        owner = old.owner if same_name else f"{old.owner}.{self.incarnation}"
        self.workers[wi] = self._start(owner)

    @rule()
    def rotate(self) -> None:
        """A deploy with a new current secret: both workers restart with the new ring."""
        n = len(self.secrets) + 1
        self.secrets = [Secret(f"k{n}", bytes([n]) * 32), *self.secrets]
        for wi, w in enumerate(self.workers):
            self._stop(w)
            self.workers[wi] = self._start(w.owner)

    @rule(name=st.sampled_from(["a1", "a2"]), subject=st.sampled_from(["pay 10", "pay 99"]))
    def open_approval(self, name: str, subject: str) -> None:
        h = subject_hash(self.waits.store, subject)
        have = self.approvals.get(name)
        refused = ""
        try:
            wait = self.waits.open(self.run, name, "approval", subject=subject, requested_by="bot")
        except WaitRefused as exc:
            refused = exc.reason
        if refused:
            assert have is not None, refused
            assert have[1] != h, refused
            assert refused == "subject_changed"
            return
        if have is None:
            self.approvals[name] = ("open", h)
        assert wait.subject_hash == self.approvals[name][1]

    @precondition(lambda self: bool(self.approvals))
    @rule(
        data=st.data(),
        decision=st.sampled_from(["approve", "reject"]),
        right=st.booleans(),
        actor=st.sampled_from(["alice", "bot"]),
    )
    def decide(self, data: st.DataObject, decision: str, right: bool, actor: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.approvals)))
        status, h = self.approvals[name]
        other = subject_hash(self.waits.store, "something else")
        refused = ""
        try:
            if decision == "approve":
                self.waits.approve(self.run, name, actor=actor, subject_hash=h if right else other)
            else:
                self.waits.reject(self.run, name, actor=actor)
        except WaitRefused as exc:
            refused = exc.reason
        if refused:
            if status != "open":
                expected = "decided"
            elif decision == "approve" and not right:
                expected = "subject_changed"
            elif decision == "approve" and actor == "bot":
                expected = "self_approval"
            else:
                expected = "(no refusal)"
            assert refused == expected, (refused, expected)
            return
        assert status == "open", "a decided approval was decided again"
        assert decision == "reject" or (right and actor != "bot")
        self.approvals[name] = ("approved" if decision == "approve" else "rejected", h)

    @precondition(lambda self: self.model and not any(e.tampered for e in self.model.values()))
    @rule(data=st.data(), how=st.sampled_from(["status", "epoch", "fingerprint", "chain"]))
    def tamper(self, data: st.DataObject, how: str) -> None:
        i = data.draw(st.sampled_from([i for i, e in sorted(self.model.items()) if not e.tampered]))
        e = self.model[i]
        engine = self.workers[0].ledger.store.engine
        if how == "status":
            new = "not_happened" if e.status != "not_happened" else "committed"
            sql = "UPDATE oo_effects SET status = :v WHERE key_id = :k"
            execute(engine, sql, v=new, k=e.key_id)
        elif how == "epoch":
            execute(engine, "UPDATE oo_effects SET epoch = epoch + 1 WHERE key_id = :k", k=e.key_id)
        elif how == "fingerprint":
            sql = "UPDATE oo_effects SET fingerprint = :v WHERE key_id = :k"
            execute(engine, sql, v="0" * 64, k=e.key_id)
        else:
            sql = "UPDATE oo_effects SET chain = 'run-9', run_id = 'run-9' WHERE key_id = :k"
            execute(engine, sql, k=e.key_id)
        e.tampered = True
        self.counts.tampered += 1
        for w in self.workers:
            with pytest.raises(CorruptRecord):
                w.ledger.replay(e.key_id)
        self.counts.detected += 1

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def ledger_matches_the_model(self) -> None:
        self.counts.steps += 1
        led = self.workers[1].ledger
        for i, e in self.model.items():
            rec = led.get(e.key_id)
            assert rec.secret_id == e.secret_id
            if e.tampered:
                continue
            assert rec.status.value == e.status, (i, rec.status, e.status)
            assert rec.epoch == e.epoch, (i, rec.epoch, e.epoch)
            assert rec.epoch >= self.max_epoch.get(i, 0), "an epoch went down"
            self.max_epoch[i] = rec.epoch
            if e.status == "committed":
                # committed is never claimable again: it replays its result
                assert led.replay(e.key_id).result == e.result
        for name, (status, _h) in self.approvals.items():
            assert self.waits.get(self.run, name).status is WaitStatus(status)

    @invariant()
    def verify_is_clean_unless_tampered(self) -> None:
        report = self.workers[0].ledger.verify()
        tampered = [e.key_id for e in self.model.values() if e.tampered]
        if not tampered:
            assert report.ok, report.problems
            return
        for kid in tampered:
            assert any(kid in p for p in report.problems), (kid, report.problems)

    @invariant()
    def no_effect_applied_twice(self) -> None:
        assert self.provider.duplicates() == 0, dict(self.provider.applied)


def _run(db_url: str, *, count: bool = True, **overrides: Any) -> None:
    options: dict[str, Any] = {
        "max_examples": EXAMPLES,
        "stateful_step_count": STEPS,
        "deadline": None,
        "derandomize": REPORT.tier == "ci",
        "database": None,
        "suppress_health_check": list(HealthCheck),
    }
    options.update(overrides)

    class Bound(LedgerModel):
        pass

    Bound.db_url = db_url
    Bound.counts = Counts()
    try:
        run_state_machine_as_test(Bound, settings=settings(**options))
    finally:
        c = Bound.counts
        if count:
            REPORT.add(
                scenarios=c.examples,
                runs=c.steps,
                effects=c.claims,
                raw_deliveries=c.raw,
                needs_human=c.needs_human,
                detected=c.detected,
                accepted=c.tampered - c.detected,
            )
            for mode, n in c.modes.items():
                REPORT.mode(mode, n)


@pytest.fixture(autouse=True)
def _bounded_shrinking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS", 60, raising=False
    )


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[SuiteReport]:
    REPORT._started = time.monotonic()  # the suite's own wall time, not the session's
    yield REPORT
    REPORT.check()


@pytest.mark.slow
def test_the_ledger_behaves_like_its_model(db_url: str, report: SuiteReport) -> None:
    _run(db_url)


# -- positive control: an expired lease treated as free ------------------------------------


def _expired_lease_is_free(original: Callable[..., Any]) -> Callable[..., Any]:
    """The planted bug: before the claim transaction looks at an entry, an expired
    claim is quietly released (recorded, so the audit chain stays consistent), so the
    claim re-sends it with the next epoch instead of finding it in doubt."""

    def claim_txn(self: Ledger, cur: Any, identity: Any, candidates: Any, *a: Any) -> Any:
        from onceonly.ledger._rows import SELECT, effect_row

        ids = [kid for _, kid in candidates]
        marks = ", ".join([self._q] * len(ids))
        cur.execute(f"{SELECT} WHERE key_id IN ({marks})", ids)
        for found in cur.fetchall():
            row = effect_row(found)
            if row["status"] == "claimed" and (row["lease_expires_at"] or 0) <= self._clock():
                self._transition(
                    cur,
                    row,
                    "reconciled",
                    {"status": EffectStatus.NOT_HAPPENED.value},
                    expect="claimed",
                    actor="bug",
                    detail="",
                )
        return original(self, cur, identity, candidates, *a)

    return claim_txn


@pytest.mark.slow
def test_the_model_catches_an_expired_lease_treated_as_free(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Ledger, "_claim_txn", _expired_lease_is_free(Ledger._claim_txn))
    caught = False
    try:
        _run(
            f"sqlite:///{tmp_path / 'control.db'}",
            count=False,
            max_examples=200,
            phases=[Phase.generate],
            report_multiple_bugs=False,
        )
    except AssertionError:
        caught = True
    report.control(caught)
    assert caught, "S1 did not catch an expired lease treated as free"
