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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from onceonly.ledger import Ledger
from onceonly.ledger._integrity import EVENT_COLS as _EVENT_COLS
from onceonly.ledger._schema import COLUMNS
from tests.dbutil import execute, fetch
from tests.ledger_support import Ledgers, ident

EVENT_COLS = [c.strip() for c in _EVENT_COLS.split(",")] + ["mac"]
# key columns (editing them makes another row, not an edited one)
ROW_EDITS = [c for c in COLUMNS if c not in ("key_id",)]
EVENT_EDITS = [c for c in EVENT_COLS if c not in ("chain", "seq")]
HEAD_EDITS = ["seq", "hash", "seal"]


class _NoShortcut(Ledger):
    """Full verification always: it never remembers what it sealed."""

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


def _verdict(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the verdict is the refusal's type
        return type(exc).__name__
    return "done"


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
