"""A row's write, its audit event and the head's move, folded (both backends).

``TransitionMixin._write_appending`` writes an effect row (a claim's insert, a
transition's compare-and-set update), then appends the event that records it and moves
the chain's sealed head. On PostgreSQL the three are one statement (one round trip
instead of three), each part conditional on the one before it having written; on SQLite
they stay three statements. Whatever the backend, the verdicts must be those of three
separate statements:

* a write that writes nothing (a lost compare-and-set, a lost insert race) appends no
  event and leaves the head where it was;
* a write over a head this process cached but another ledger has moved since writes
  the row, then appends after the head it reads again;
* a cold call on PostgreSQL takes the folded statements (or the fold is never tested),
  and a ledger with folds off takes the separate ones.

Planted bugs (an event that does not wait for its row's write; a stale head taken for
a write that wrote nothing) must be told apart. Edits made behind the ledger's back are
compared between folded and unfolded ledgers by ``test_ledger_own_rows``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from onceonly.ledger import EffectStatus, Ledger
from tests.dbutil import fetch
from tests.ledger_support import Ledgers, audit_rows, effect_row, ident
from tests.statements import watch_statements

# the folded statement is PostgreSQL's (SQLite folds its checks instead: test_ledger_own_rows)
_POSTGRESQL = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


class _Unfolded(Ledger):
    """Three statements on every backend."""

    _folds = False


class _EventIgnoresLead(Ledger):
    """The planted bug: the event is appended whether or not its row was written."""

    def _lead_append(self, cur: Any, lead: Any, insert: str, *args: Any) -> Any:
        insert = insert.replace("EXISTS (SELECT 1 FROM lead) AND ", "", 1)
        _wrote, appended = super()._lead_append(cur, lead, insert, *args)
        return True, appended


class _StaleHeadIsNoWrite(Ledger):
    """The planted bug: a fold that missed the head is taken for a write that wrote
    nothing (the row it did write is then read back as someone else's)."""

    def _lead_append(self, cur: Any, *args: Any) -> Any:
        _wrote, appended = super()._lead_append(cur, *args)
        return appended, appended


def _head(ledgers: Ledgers, chain: str) -> tuple[Any, ...]:
    sql = "SELECT seq, hash, seal FROM oo_chain_heads WHERE chain = :c"
    (row,) = fetch(ledgers.store().engine, sql, c=chain)
    return tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)


def _write_nothing(led: Ledger, key_id: str) -> Any:
    """A transition's compare-and-set on an epoch the row does not have, then its event."""
    q = led._q
    row = effect_row(led.store.engine, key_id)
    lead = (
        f"UPDATE oo_effects SET attempts = attempts WHERE key_id = {q} AND epoch = {q}",
        [key_id, int(row["epoch"]) + 7],
    )
    return led._write(
        lambda cur: led._write_appending(cur, lead, row, "test", "tester", ""), outcome=False
    )


@pytest.mark.parametrize("cls", [Ledger, _Unfolded])
def test_a_write_that_writes_nothing_appends_nothing(ledgers: Ledgers, cls: type[Ledger]) -> None:
    led = ledgers.on(ledgers.store(), cls=cls)
    led.perform(ident(run="nothing"), {"a": 1}, lambda _c: {"sent": 1})
    kid = led.key_id(ident(run="nothing"))
    engine = led.store.engine
    events, head = audit_rows(engine), _head(ledgers, "nothing")
    assert _write_nothing(led, kid) is None
    assert audit_rows(engine) == events
    assert _head(ledgers, "nothing") == head
    # the ledger goes on: its cached head is still the chain's
    led.perform(ident(1, run="nothing"), {"a": 2}, lambda _c: {"sent": 2})
    assert led.verify().ok, led.verify().problems


@_POSTGRESQL
def test_control_an_event_that_ignores_its_write_is_caught(ledgers: Ledgers) -> None:
    led = ledgers.on(ledgers.store(), cls=_EventIgnoresLead)
    led.perform(ident(run="ignores"), {"a": 1}, lambda _c: {"sent": 1})
    events = audit_rows(led.store.engine)
    _write_nothing(led, led.key_id(ident(run="ignores")))
    assert audit_rows(led.store.engine) != events  # an event for a row never written


def _alternate(ledgers: Ledgers, cls: type[Ledger], run: str) -> list[Any]:
    """Two ledgers (two processes' views) make calls in one run in turn: each call but
    the first finds the head its ledger cached moved by the other."""
    store = ledgers.store()
    one, two = ledgers.on(store, cls=cls), ledgers.on(store, cls=cls)
    out = []
    for i in range(6):
        led = (one, two)[i % 2]
        out.append(led.perform(ident(i, run=run), {"i": i}, functools.partial(_sent, i)))
    return out


def _sent(i: int, _claim: Any) -> dict[str, int]:
    return {"sent": i}


@pytest.mark.parametrize("cls", [Ledger, _Unfolded])
def test_a_write_over_a_moved_head_appends_after_the_head_read_again(
    ledgers: Ledgers, cls: type[Ledger]
) -> None:
    run = f"moved-{cls.__name__}"
    assert _alternate(ledgers, cls, run) == [{"sent": i} for i in range(6)]
    led = ledgers.on(ledgers.store())
    records = led.effects(run_id=run)
    assert sorted(r.status for r in records) == [EffectStatus.COMMITTED] * 6
    chain = [e for e in audit_rows(led.store.engine) if e[0] == run]
    assert [e[1] for e in chain] == list(range(1, 13))  # claimed + committed, no gap
    report = led.verify()
    assert report.ok, report.problems


@_POSTGRESQL
def test_control_a_moved_head_taken_for_no_write_is_caught(ledgers: Ledgers) -> None:
    with pytest.raises(Exception):  # noqa: B017,PT011  (whatever the misread row gives)
        _alternate(ledgers, _StaleHeadIsNoWrite, "stale")


def _statements(ledgers: Ledgers, cls: type[Ledger], monkeypatch: Any) -> list[str]:
    led = ledgers.on(ledgers.store(), cls=cls)
    run = f"count-{cls.__name__}"
    for i in range(3):
        led.perform(ident(i, run=run), {"i": i}, lambda _c: {"ok": 1})
    seen: list[str] = []
    watch_statements(monkeypatch, lambda sql, _p: seen.append(sql.split(None, 1)[0].upper()))
    led.perform(ident(3, run=run), {"i": 3}, lambda _c: {"ok": 1})
    return list(seen)


@_POSTGRESQL
def test_a_cold_call_on_postgresql_takes_the_folded_writes(
    ledgers: Ledgers, monkeypatch: pytest.MonkeyPatch
) -> None:
    folded = _statements(ledgers, Ledger, monkeypatch)
    # claim: read the row, check the chain, then write row + event + head at once;
    # outcome: read the row, its last event, then write row + event + head at once
    assert folded == ["SELECT", "SELECT", "WITH", "SELECT", "SELECT", "WITH"], folded
    unfolded = _statements(ledgers, _Unfolded, monkeypatch)
    assert "WITH" not in unfolded, unfolded
    assert len(unfolded) == len(folded) + 4, unfolded
