"""The outcome's shortcut for rows this process sealed itself agrees with full verification.

A claim seals its row, appends its event and seals the chain's head; the outcome reads
the row back and, when it finds exactly what it wrote (every column, seal and MAC), does
not verify it again (``IntegrityMixin._check_row``'s ``mine``, ``judge_whole``'s
``sealed``). That is only sound if *any* other content takes the full check. So every
column of the row, of its last event and of the chain's head is edited in turn, behind
the ledger's back, while the effect acts (or before the next claim, for the head), and
the verdict of a ledger with the shortcut must equal that of one without it: the same
refusal, or the same outcome. The positive control is a ledger that trusts the mere
presence of its memory, not its comparison: it must disagree somewhere.

On SQLite the checks are folded into the writing statements themselves (a fresh claim's
insert, an outcome's update: ``folded_claim_sql``, ``folded_transition_sql``). The same
edits, and edits made between two calls (a planted row or event, a deleted one, the head
gone), must give the verdicts of full verification; a cold call must take the folded
statements (or the fold is never tested); and folds planted without their conditions
must be told apart.

On PostgreSQL a row's write, its event and the head's move are one statement
(``test_ledger_write_fold``); the full-verification ledger here writes them apart, so
every edit also compares the two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from onceonly.ledger import Ledger, OutcomeClass
from onceonly.ledger._integrity import EVENT_COLS as _EVENT_COLS
from onceonly.ledger._integrity import effect_parts
from onceonly.ledger._schema import COLUMNS
from tests.dbutil import execute, fetch
from tests.ledger_support import Ledgers, ident
from tests.statements import watch_statements

EVENT_COLS = [c.strip() for c in _EVENT_COLS.split(",")] + ["mac"]
# key columns (editing them makes another row, not an edited one)
ROW_EDITS = [c for c in COLUMNS if c not in ("key_id",)]
EVENT_EDITS = [c for c in EVENT_COLS if c not in ("chain", "seq")]
HEAD_EDITS = ["seq", "hash", "seal"]


# The checks folded into the writing statements are SQLite's (PostgreSQL reads and locks
# first; its one-statement writes are test_ledger_write_fold's).
_SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


class _NoShortcut(Ledger):
    """Full verification always: it never remembers what it sealed, and folds no check
    into a writing statement."""

    _folds = False

    def _remember_mine(self, row: Any, event: Any) -> None:
        return None

    def _check_chain(self, cur: Any, chain: str, found: Any = None, mark: Any = None) -> None:
        self._head_seals.clear()
        super()._check_chain(cur, chain, found, mark)


class _TrustsPresence(Ledger):
    """The planted bug: any remembered row is taken as verified, compared or not."""

    def _check_row(self, cur: Any, row: Any, last: Any = (), *, mine: Any = None) -> None:
        if mine is not None:
            return
        super()._check_row(cur, row, last)


def _changed(value: Any) -> Any:
    if value is None:
        return "x"
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 1.0
    if isinstance(value, bytes | memoryview):
        data = bytearray(bytes(value) or b"\0")
        data[-1] ^= 1
        return bytes(data)
    return str(value) + "x"


def _edit(engine: Engine, table: str, col: str, where: str, **params: Any) -> None:
    [(value,)] = fetch(engine, f"SELECT {col} FROM {table} WHERE {where}", **params)
    if table == "oo_effects" and col == "status":
        new: Any = "claimed" if value != "claimed" else "unknown"
    else:
        new = _changed(value)
    execute(engine, f"UPDATE {table} SET {col} = :v WHERE {where}", v=new, **params)


def _drop(fn: Callable[[int], int], i: int, _claim: Any) -> int:
    return fn(i)


def _verdict(fn: Callable[[], Any], *, result: bool = False) -> str:
    """The refusal's type, or ``done`` (with ``result``: ``done`` and what it returned)."""
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 - the verdict is the refusal's type
        return type(exc).__name__
    return f"done {got!r}" if result else "done"


def _run_edits(ledgers: Ledgers, cls: type[Ledger], run: str) -> dict[str, str]:
    """Each edit's verdict for a ledger of class ``cls``, each in its own run."""
    store = ledgers.store()
    engine = store.engine
    verdicts: dict[str, str] = {}
    n = 0
    for table, cols in (("oo_effects", ROW_EDITS), ("oo_audit", EVENT_EDITS)):
        for col in cols:
            n += 1
            led = ledgers.on(store, cls=cls)
            rid = f"{run}-{n}"

            def act(
                _claim: Any, table: str = table, col: str = col, rid: str = rid
            ) -> dict[str, int]:
                if table == "oo_effects":
                    _edit(engine, table, col, "run_id = :r", r=rid)
                else:
                    _edit(
                        engine,
                        table,
                        col,
                        "chain = :r AND seq = (SELECT MAX(seq) FROM oo_audit WHERE chain = :r)",
                        r=rid,
                    )
                return {"sent": 1}

            verdicts[f"{table}.{col}"] = _verdict(
                functools.partial(led.perform, ident(run=rid), {"a": 1}, act)
            )
    for col in HEAD_EDITS:
        n += 1
        led = ledgers.on(store, cls=cls)
        rid = f"{run}-{n}"
        led.perform(ident(run=rid), {"a": 1}, lambda _c: {"sent": 1})
        _edit(engine, "oo_chain_heads", col, "chain = :r", r=rid)
        verdicts[f"oo_chain_heads.{col}"] = _verdict(
            functools.partial(led.perform, ident(1, run=rid), {"a": 2}, lambda _c: {"s": 2})
        )
    return verdicts


def test_the_shortcut_agrees_with_full_verification_for_every_edit(ledgers: Ledgers) -> None:
    full = _run_edits(ledgers, _NoShortcut, "full")
    short = _run_edits(ledgers, Ledger, "short")
    assert short == full
    # the edits are real: full verification refuses most of them
    refused = [k for k, v in full.items() if v != "done"]
    assert len(refused) >= len(full) // 2, full
    assert full["oo_effects.seal"] != "done"
    assert full["oo_audit.mac"] != "done"
    assert full["oo_chain_heads.seal"] != "done"


def test_control_a_ledger_trusting_its_memory_unchecked_is_caught(ledgers: Ledgers) -> None:
    full = _run_edits(ledgers, _NoShortcut, "full")
    trusting = _run_edits(ledgers, _TrustsPresence, "trust")
    differ = sorted(k for k in full if full[k] != trusting[k])
    assert differ, "the harness cannot tell a shortcut that skips the comparison"
    assert "oo_effects.seal" in differ


@pytest.mark.parametrize("cls", [Ledger, _NoShortcut])
def test_an_untouched_row_commits_and_replays(ledgers: Ledgers, cls: type[Ledger]) -> None:
    store = ledgers.store()
    led = ledgers.on(store, cls=cls)
    sent: list[int] = []

    def send(i: int) -> int:
        sent.append(i)
        return i

    for i in range(3):
        assert led.perform(ident(i, run="plain"), {"i": i}, functools.partial(_drop, send, i)) == i
    again = ledgers.fresh()
    assert [again.perform(ident(i, run="plain"), {"i": i}, lambda _c: -1) for i in range(3)] == [
        0,
        1,
        2,
    ]
    assert sent == [0, 1, 2]


def _copy_last_event(engine: Engine, rid: str, **changes: Any) -> None:
    """Insert a copy of the chain's last event with ``changes`` (a forged extra event)."""
    cols = ", ".join(EVENT_COLS)
    [last] = fetch(
        engine,
        f"SELECT {cols} FROM oo_audit WHERE chain = :r ORDER BY seq DESC LIMIT 1",
        r=rid,
    )
    values = {**dict(zip(EVENT_COLS, last, strict=True)), **changes}
    marks = ", ".join(f":{c}" for c in EVENT_COLS)
    execute(engine, f"INSERT INTO oo_audit ({cols}) VALUES ({marks})", **values)


def _copy_row(engine: Engine, rid: str, key_id: str) -> None:
    """Insert a copy of the run's first row under another key id (a planted row)."""
    cols = ", ".join(COLUMNS)
    [row] = fetch(engine, f"SELECT {cols} FROM oo_effects WHERE run_id = :r LIMIT 1", r=rid)
    values = {**dict(zip(COLUMNS, row, strict=True)), "key_id": key_id}
    marks = ", ".join(f":{c}" for c in COLUMNS)
    execute(engine, f"INSERT INTO oo_effects ({cols}) VALUES ({marks})", **values)


def _max_seq(engine: Engine, rid: str) -> int:
    return int(fetch(engine, "SELECT MAX(seq) FROM oo_audit WHERE chain = :r", r=rid)[0][0])


class _NotSent(Exception):
    """The act's refusal before anything was sent (the claim is released)."""


def _released_then_deleted(engine: Engine, rid: str, led: Ledger) -> None:
    """The next key is claimed and released (its act sent nothing), then its row is
    deleted: its events stay in the chain, and the head is as the ledger sealed it."""

    def refuse(_claim: Any) -> None:
        raise _NotSent

    with pytest.raises(_NotSent):
        led.perform(ident(1, run=rid), {"a": 2}, refuse, classify=lambda _e: OutcomeClass.NOT_SENT)
    execute(engine, "DELETE FROM oo_effects WHERE key_id = :k", k=led.key_id(ident(1, run=rid)))


# Edits made between two calls of one ledger, behind its back, that a fresh claim's
# folded insert (it writes only if no row and no event of the key exists and the head
# is as this process sealed it) must not take past: each gets the verdict of full
# verification. Each takes (engine, run id, the ledger).
_BETWEEN: dict[str, Callable[[Engine, str, Ledger], object]] = {
    "extra event past the head": lambda e, r, led: _copy_last_event(e, r, seq=_max_seq(e, r) + 1),
    "event of the next key planted": lambda e, r, led: _copy_last_event(
        e, r, seq=_max_seq(e, r) + 1, key_id=led.key_id(ident(1, run=r))
    ),
    "last event deleted": lambda e, r, led: execute(
        e,
        "DELETE FROM oo_audit WHERE chain = :r AND seq = "
        "(SELECT MAX(seq) FROM oo_audit WHERE chain = :r)",
        r=r,
    ),
    "row of the next key planted": lambda e, r, led: _copy_row(e, r, led.key_id(ident(1, run=r))),
    "row of the first key deleted": lambda e, r, led: execute(
        e, "DELETE FROM oo_effects WHERE key_id = :k", k=led.key_id(ident(run=r))
    ),
    "released row of the next key deleted": _released_then_deleted,
    "head deleted": lambda e, r, led: execute(
        e, "DELETE FROM oo_chain_heads WHERE chain = :r", r=r
    ),
    "untouched": lambda e, r, led: None,
}


def _run_between(ledgers: Ledgers, cls: type[Ledger], run: str) -> dict[str, tuple[str, str, str]]:
    """Each between-calls edit's verdicts (the next key's call, the first key's call
    again, and that call by a fresh ledger) for a ledger of class ``cls``, each edit in
    its own run."""
    store = ledgers.store()
    engine = store.engine
    verdicts: dict[str, tuple[str, str, str]] = {}
    for n, (name, edit) in enumerate(_BETWEEN.items()):
        led = ledgers.on(store, cls=cls)
        rid = f"{run}-b{n}"
        led.perform(ident(run=rid), {"a": 1}, lambda _c: {"sent": 1})
        edit(engine, rid, led)
        nxt = _verdict(
            functools.partial(led.perform, ident(1, run=rid), {"a": 2}, lambda _c: {"s": 2}),
            result=True,
        )
        again = _verdict(
            functools.partial(led.perform, ident(run=rid), {"a": 1}, lambda _c: {"s": 3}),
            result=True,
        )
        fresh = _verdict(
            functools.partial(
                ledgers.on(store, cls=cls).perform, ident(run=rid), {"a": 1}, lambda _c: {"s": 4}
            ),
            result=True,
        )
        verdicts[name] = (nxt, again, fresh)
    return verdicts


def test_the_folded_claim_agrees_with_full_verification_between_calls(
    ledgers: Ledgers,
) -> None:
    full = _run_between(ledgers, _NoShortcut, "full")
    folded = _run_between(ledgers, Ledger, "fold")
    assert folded == full
    # the edits are real: full verification refuses each but the untouched run somewhere,
    # and no call acts a second time (the first key's result stays the first act's)
    assert full.pop("untouched") == ("done {'s': 2}", "done {'sent': 1}", "done {'sent': 1}")
    assert all("CorruptRecord" in v for v in full.values()), sorted(full.items())
    assert all(
        v[1:].count("done {'sent': 1}") + v[1:].count("CorruptRecord") == 2 for v in full.values()
    ), sorted(full.items())


class _FoldsBlind(Ledger):
    """The planted bug: a fresh claim's insert without its folded conditions (it trusts
    that nothing changed since this process sealed the head)."""

    def _fold_claim(self, cur: Any, identity: Any, candidates: Any, *args: Any) -> Any:
        fps, canonical, pclass, window_s, subject, chain, _fence = args
        if self._head_seals.get(chain) is None or self._sealer.cached(subject) is None:
            return None
        from onceonly.ledger._claims import _Outcome

        row, parts, cipher = self._fresh_row(
            cur, identity, candidates[0], fps, canonical, pclass, window_s, subject, chain
        )
        cols = ", ".join(COLUMNS)
        cur.execute(
            f"INSERT INTO oo_effects ({cols}) VALUES ({', '.join([self._q] * len(COLUMNS))}) "
            "ON CONFLICT DO NOTHING",
            [row[c] for c in COLUMNS],
        )
        if cur.rowcount != 1:
            return None
        appended = self._append(cur, row, "claimed", self.owner, "", digest=parts[2])
        self._remember_mine(row, appended)
        return _Outcome("claim", row, self._claim_of(row), cipher)


@_SQLITE
def test_control_a_fold_without_its_conditions_is_caught(ledgers: Ledgers) -> None:
    full = _run_between(ledgers, _NoShortcut, "full")
    blind = _run_between(ledgers, _FoldsBlind, "blind")
    differ = sorted(k for k in full if full[k] != blind[k])
    assert differ, "the harness cannot tell a fold that checks nothing"


class _OutcomeFoldsBlind(Ledger):
    """The planted bug: an outcome's update folded without the row check (it trusts
    that the row and event are still as this process wrote them)."""

    def _fold_outcome(
        self, cur: Any, mine: Any, claim: Any, event: str, changes: Any, detail: str
    ) -> Any:
        row = dict(zip(COLUMNS, mine[0], strict=True))
        new = {**row, **changes, "updated_at": self._clock()}
        new["seal"] = self._seal("effects", effect_parts(new))
        sets = ", ".join(f"{c} = {self._q}" for c in (*changes, "seal", "updated_at"))
        cur.execute(
            f"UPDATE oo_effects SET {sets} WHERE key_id = {self._q} AND epoch = {self._q}",
            [*changes.values(), new["seal"], new["updated_at"], claim.key_id, claim.epoch],
        )
        if cur.rowcount != 1:
            return None
        self._append(cur, new, event, claim.lease_owner, detail)
        return new


@_SQLITE
def test_control_an_outcome_fold_without_its_row_check_is_caught(ledgers: Ledgers) -> None:
    full = _run_edits(ledgers, _NoShortcut, "full")
    blind = _run_edits(ledgers, _OutcomeFoldsBlind, "blind")
    differ = sorted(k for k in full if full[k] != blind[k])
    assert differ, "the harness cannot tell an outcome fold that checks nothing"
    assert "oo_effects.seal" in differ


def _statements_per_call(ledgers: Ledgers, cls: type[Ledger], monkeypatch: Any) -> list[str]:
    """The statements of one cold call (a new effect, executed) by a ledger that made
    calls in the run before."""
    led = ledgers.on(ledgers.store(), cls=cls)
    run = f"count-{cls.__name__}"
    for i in range(3):
        led.perform(ident(i, run=run), {"i": i}, lambda _c: {"ok": 1})
    seen: list[str] = []
    watch_statements(monkeypatch, lambda sql, _p: seen.append(sql.split(None, 2)[:2][0]))
    led.perform(ident(3, run=run), {"i": 3}, lambda _c: {"ok": 1})
    return seen


@_SQLITE
def test_a_cold_call_takes_the_folded_statements(
    ledgers: Ledgers, monkeypatch: pytest.MonkeyPatch
) -> None:
    folded = list(_statements_per_call(ledgers, Ledger, monkeypatch))  # (a copy: it grows)
    # claim: insert the row, append the event, advance the head; outcome: the same three
    assert folded == ["INSERT", "INSERT", "UPDATE", "UPDATE", "INSERT", "UPDATE"], folded
    # control: the full path reads (and checks) first
    full = _statements_per_call(ledgers, _NoShortcut, monkeypatch)
    assert "SELECT" in full, full
    assert len(full) > len(folded), full
