"""A legitimate commit by another process between any two statements of a check.

Under PostgreSQL's READ COMMITTED every statement of a write transaction sees its own
moment; a check that reads what belongs together (a chain's head and its events, a row
and its audit trail) in two statements sees a concurrent commit half-way and reports
tampering that never happened (found in CI: "audit chain has events but no head" when a
rival's first claim on a run committed between the two reads, under load). SQLite
serialises writers, so there the rival commits after; both backends run every case.

Each case runs an operation once per statement position: after statement ``k`` of its
transaction a rival ledger (another Store: another process's view) claims and commits a
new effect on the same run. Every position must give the same answer as no rival at all,
with nothing lost or doubled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event

from onceonly.checkpoint import LeaseHeld, _connections
from onceonly.checkpoint.store import Store
from onceonly.ledger import Claim, EffectInFlight, Ledger
from tests.conftest import _fresh_pg_database
from tests.ledger_support import Ledgers, ident


def _writes(sql: str) -> bool:
    """Whether a ``WITH`` statement writes (a data-modifying common table expression)."""
    upper = sql.upper()
    return any(verb in upper for verb in ("INSERT INTO ", "UPDATE ", "DELETE FROM "))


class _Cursor:
    """A DBAPI cursor that, after its ``at``-th SELECT (SQLite: statement), lets a rival
    commit."""

    def __init__(self, cur: Any, hook: _Hook) -> None:
        self._cur = cur
        self._hook = hook

    def execute(self, sql: str, params: Any = ()) -> Any:
        out = self._cur.execute(sql, params)
        verb = sql.lstrip()[:6].upper()
        if verb == "SELECT" or (not self._hook.pg and verb in ("INSERT", "UPDATE", "DELETE")):
            # SQLite: after any statement (its writes fold their checks into them; the
            # rival waits for the write lock either way)
            self._hook.after_select()
        if verb in ("INSERT", "UPDATE", "DELETE") or (verb.startswith("WITH") and _writes(sql)):
            self._hook.wrote = True  # (PostgreSQL folds a row's writes into one WITH)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Hook:
    """Counts the SELECTs of one store's transactions (SQLite: every statement); at
    number ``at`` (PostgreSQL: before the transaction wrote, as a rival waiting on its
    row locks would never get through) runs ``rival`` to completion in another thread."""

    def __init__(self, store: Store, rival: Callable[[], None], *, pg: bool) -> None:
        self.store = store
        self.rival = rival
        self.pg = pg
        self.at = -1
        self.seen = 0
        self.fired = False
        self.wrote = False
        self.errors: list[BaseException] = []
        self._late: list[threading.Thread] = []

    def arm(self, at: int) -> None:
        self.at, self.seen, self.fired, self.wrote = at, 0, False, False

    def after_select(self) -> None:
        self.seen += 1
        if self.seen != self.at or self.fired or (self.wrote and self.pg):
            return
        self.fired = True

        def run() -> None:
            try:
                self.rival()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        if self.pg:
            t.join()  # READ COMMITTED: the rival's commit lands between our statements
        else:
            self._late.append(t)  # SQLite: the rival waits for our write lock

    def settle(self) -> None:
        for t in self._late:
            t.join()
        self._late.clear()
        if self.errors:
            raise self.errors[0]


@pytest.fixture
def interleave(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _Hook]]:
    hooks: list[_Hook] = []
    enter = _connections._RawTxn.__enter__

    def wrapped(self: Any) -> Any:
        cur = enter(self)
        for hook in hooks:
            if self._store is hook.store:
                self._cur = _Cursor(cur, hook)
                return self._cur
        return cur

    monkeypatch.setattr(_connections._RawTxn, "__enter__", wrapped)

    def make(store: Store, rival: Callable[[], None]) -> _Hook:
        hook = _Hook(store, rival, pg=store.dialect != "sqlite")
        hooks.append(hook)
        return hook

    yield make
    for hook in hooks:
        hook.settle()


def _rival(ledgers: Ledgers, run: Callable[[], str]) -> Callable[[], None]:
    other = ledgers.fresh()
    n = iter(range(1000, 10_000))

    def go() -> None:
        out = other.claim(ident(next(n), run=run()), {"rival": True})
        assert isinstance(out, Claim)
        other.commit(out, {"ok": True})

    return go


def _positions(hook: _Hook, op: Callable[[int], None]) -> int:
    """Run ``op(k)`` with the rival at every position (above) until one runs past the
    operation's last SELECT; returns how many positions fired."""
    for k in range(1, 60):
        hook.arm(k)
        op(k)
        hook.settle()
        if not hook.fired:
            return k - 1
    raise AssertionError("the operation never ran out of statements")


def _ledger(ledgers: Ledgers) -> tuple[Ledger, Store]:
    store = ledgers.store()
    return ledgers.on(store), store


def test_first_claim_on_a_run_while_a_rival_starts_its_chain(
    ledgers: Ledgers, interleave: Callable[..., _Hook]
) -> None:
    """The failure CI found: both claims are the first on their run's chain."""
    led, store = _ledger(ledgers)
    runs = iter(range(100))
    run = {"id": ""}
    hook = interleave(store, _rival(ledgers, lambda: run["id"]))

    def op(k: int) -> None:
        run["id"] = f"first-{k}-{next(runs)}"
        out = led.claim(ident(0, run=run["id"]), {"n": 0})
        assert isinstance(out, Claim)
        led.commit(out, {"sent": 1})

    assert _positions(hook, op) >= 2
    report = led.verify()
    assert report.ok, report


def test_claim_commit_and_replay_on_a_chain_a_rival_appends_to(
    ledgers: Ledgers, interleave: Callable[..., _Hook]
) -> None:
    led, store = _ledger(ledgers)
    run = "shared-run"
    seed = led.claim(ident(0, run=run), {"n": 0})
    assert isinstance(seed, Claim)
    led.commit(seed, {"sent": 0})
    hook = interleave(store, _rival(ledgers, lambda: run))
    ordinal = iter(range(1, 500))

    def claim_and_commit(_k: int) -> None:
        out = led.claim(ident(next(ordinal), run=run), {"n": 1})
        assert isinstance(out, Claim)
        led.commit(out, {"sent": 1})

    def replay(_k: int) -> None:
        # A ledger of its own on the hooked store: no cached outcome, the row is read.
        again = ledgers.on(store).claim(ident(0, run=run), {"n": 0})
        assert not isinstance(again, Claim)
        assert again.result == {"sent": 0}

    def read(_k: int) -> None:
        rec = led.get(led.key_id(ident(0, run=run)))
        assert (rec.status.value, rec.integrity) == ("committed", "ok")
        rows = led.effects(run_id=run)
        assert rows
        assert all(r.integrity == "ok" for r in rows)

    assert _positions(hook, claim_and_commit) >= 2
    assert _positions(hook, replay) >= 1
    assert _positions(hook, read) >= 1

    def audit(_k: int) -> None:
        report = led.verify()
        assert report.ok, report

    assert _positions(hook, audit) >= 1
    report = led.verify()
    assert report.ok, report
    # Nothing doubled: each ordinal of the run is one row.
    rows = led.effects(run_id=run)
    assert len({r.key_id for r in rows}) == len(rows)


def test_two_claims_of_one_key_one_wins_neither_reports_tampering(
    ledgers: Ledgers, interleave: Callable[..., _Hook]
) -> None:
    """The rival claims the very key being claimed (a key raced by two workers): the row
    and its audit trail are read while the rival's claim of that row commits."""
    led, store = _ledger(ledgers)
    other = ledgers.fresh()
    current = {"k": 0}
    won: list[str] = []

    def rival() -> None:
        try:
            out = other.claim(ident(current["k"], run="same-key"), {"n": current["k"]})
        except EffectInFlight:
            return
        if isinstance(out, Claim):
            won.append("rival")
            other.commit(out, {"by": "rival"})

    hook = interleave(store, rival)

    def op(k: int) -> None:
        current["k"] = k
        try:
            out = led.claim(ident(k, run="same-key"), {"n": k})
        except EffectInFlight:
            out = None
        if isinstance(out, Claim):
            won.append("led")
            led.commit(out, {"by": "led"})
        hook.settle()
        assert len(won) == k, won  # exactly one winner per key

    assert _positions(hook, op) >= 2
    report = led.verify()
    assert report.ok, report


def test_a_lease_let_go_between_the_refusal_and_its_explanation_is_taken(
    ledgers: Ledgers,
) -> None:
    """``acquire_lease`` refuses in one statement and reads who holds the lease in the
    next; a holder letting go in between left a lease with no owner to report (a
    ``TypeError`` on PostgreSQL). The lease is free by then: it must be taken."""
    mine, theirs = ledgers.store(), ledgers.store()
    rid = mine.create_run("f").run_id
    theirs.acquire_lease(rid, "other", 30)
    pg = mine.dialect != "sqlite"
    late: list[threading.Thread] = []

    def after(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        if late or not statement.lstrip().upper().startswith("UPDATE"):
            return
        if "lease_owner" not in statement or cursor.rowcount != 0:
            return
        t = threading.Thread(target=theirs.release_lease, args=(rid, "other"))
        late.append(t)
        t.start()
        if pg:
            t.join()  # READ COMMITTED: the release lands between our two statements

    event.listen(mine.engine, "after_cursor_execute", after)
    try:
        if pg:
            assert mine.acquire_lease(rid, "mine", 30).lease_owner == "mine"
        else:  # SQLite serialises writers: the release waits for our refusal
            with pytest.raises(LeaseHeld):
                mine.acquire_lease(rid, "mine", 30)
    finally:
        event.remove(mine.engine, "after_cursor_execute", after)
        for t in late:
            t.join()
    assert late, "the refusal was never interleaved"
    if not pg:
        assert mine.acquire_lease(rid, "mine", 30).lease_owner == "mine"


def test_a_read_is_one_read_only_snapshot_and_the_next_write_is_not(pg_server_url: str) -> None:
    """Reads run REPEATABLE READ, READ ONLY on PostgreSQL (said in their BEGIN); the
    connection goes back to the server's defaults for the transaction after. (SQLite has
    one snapshot per transaction and no isolation levels.)"""
    url, drop = _fresh_pg_database(pg_server_url)
    store = Store.open(url)
    try:

        def levels(cur: Any) -> tuple[str, str]:
            cur.execute("SHOW transaction_isolation")
            isolation = cur.fetchone()[0]
            cur.execute("SHOW transaction_read_only")
            return isolation, cur.fetchone()[0]

        for _ in range(2):
            assert store.read(levels) == ("repeatable read", "on")
            assert store.transact(levels) == ("read committed", "off")
    finally:
        store.close()
        drop()
