"""Every hot statement is planned through an index, on both backends (issue [10]).

The statements are not listed by hand: the test runs the hot paths (a guarded call that
executes, one replayed by a fresh process, the operator's read of a run's effects, and
workers driving runs whose steps make guarded calls) and captures every statement they
run, with its parameters; then it asks the database for each one's plan:

* SQLite: ``EXPLAIN QUERY PLAN``; no ``SCAN`` of a table or of an index (a full pass
  over it). Only the constant row and subqueries the plan itself builds may be scanned.
* PostgreSQL: ``EXPLAIN`` with ``enable_seqscan = off`` (the planner then picks a
  sequential scan only when no index can serve the statement: small test tables would
  otherwise be scanned whatever their indexes); no ``Seq Scan`` of a store table.

A missing index shows up here as a scan. A statement that uses an index but walks
through a run's whole history in it (a plan that looks fine) is what
``test_flat_cost`` measures. The positive control drops the index a hot read needs and
the check must name that read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import event

from onceonly.adapters import guard
from onceonly.checkpoint import RunStatus, Store
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectIdentity, Keyring, Ledger, Secret
from onceonly.runtime import Runtime
from onceonly.worker import Worker

from .statements import Statement, watch_statements

SECRET = Secret("k1", bytes(range(32)))
_PLANNED = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")


class Captured:
    """The distinct statements run while capturing is on (raw hot-path transactions and
    everything else that goes through the store's engine)."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        self.statements: dict[str, Statement] = {}
        watch_statements(monkeypatch, self._seen)

        def before(_conn: Any, _cur: Any, sql: str, params: Any, *_: Any) -> None:
            self._seen(sql, params)

        event.listen(store.engine, "before_cursor_execute", before)

    def _seen(self, sql: str, params: Any) -> None:
        if self.on and sql.lstrip().split(None, 1)[0].upper() in _PLANNED:
            self.statements.setdefault(sql, (sql, params))

    def __enter__(self) -> Captured:
        self.on = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.on = False


def _sqlite_scans(rows: Sequence[Sequence[Any]]) -> list[str]:
    """The full scans in an ``EXPLAIN QUERY PLAN`` (rows ``(id, parent, notused,
    detail)``): ``SCAN x`` where ``x`` is not a subquery or CTE the plan builds, nor
    the catalog (a schema check, once per process, reads ``sqlite_master``, which has no
    index; the PostgreSQL check likewise counts only store tables)."""
    built = {"CONSTANT ROW", "sqlite_master", "sqlite_schema"}
    bad = []
    for row in rows:
        detail = str(row[3])
        for lead in ("CO-ROUTINE ", "MATERIALIZE "):
            if detail.startswith(lead):
                built.add(detail[len(lead) :].split(" ", maxsplit=1)[0])
        if detail.startswith("SCAN "):
            name = detail[5:]
            if name not in built and name.split(" ")[0] not in built:
                bad.append(detail)
    return bad


def _pg_scans(node: dict[str, Any]) -> list[str]:
    bad = []
    if node.get("Node Type") == "Seq Scan" and str(node.get("Relation Name", "")).startswith("oo_"):
        bad.append(f"Seq Scan on {node['Relation Name']}")
    for child in node.get("Plans", []):
        bad.extend(_pg_scans(child))
    return bad


def scans(store: Store, statements: dict[str, Statement]) -> dict[str, list[str]]:
    """Each captured statement planned with a full scan, with the scans."""
    found: dict[str, list[str]] = {}
    conn = store.engine.raw_connection()
    try:
        cur = conn.cursor()
        if store.dialect != "sqlite":
            cur.execute("ANALYZE")
            cur.execute("SET enable_seqscan = off")
        for sql, params in statements.values():
            if store.dialect == "sqlite":
                cur.execute(f"EXPLAIN QUERY PLAN {sql}", params or ())
                bad = _sqlite_scans(cur.fetchall())
            else:
                cur.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
                got = cur.fetchone()
                assert got is not None
                plan = json.loads(got[0]) if isinstance(got[0], str) else got[0]
                bad = _pg_scans(plan[0]["Plan"])
            if bad:
                found[sql] = bad
        conn.rollback()
    finally:
        conn.close()
    return found


def _identity(i: int) -> EffectIdentity:
    return EffectIdentity("t", "planned", "send", 0, "send@1", ordinal=i)


def _act(_claim: Any) -> dict[str, int]:
    return {"ok": 1}


def _flow() -> Flow:
    flow = Flow("planned")

    @flow.step(start=True)
    def send(ctx: StepContext) -> Transition:
        guard(ctx.ledger, effect="send@1")(lambda v: {"sent": v})(ctx.visit)
        ctx.state["n"] = int(ctx.state["n"]) + 1
        return ctx.next("send") if int(ctx.state["n"]) < 3 else ctx.end()

    return flow


def _hot_paths(store: Store, captured: Captured) -> None:
    ledger = Ledger(store, Keyring([SECRET]))
    for i in range(20):
        ledger.perform(_identity(i), {"i": i}, _act)
    rt = Runtime(store, ledger, [_flow()], owner="planner")
    runs = [rt.start("planned", {"n": 0}) for _ in range(3)]
    with captured:
        for i in range(20, 23):  # executes
            ledger.perform(_identity(i), {"i": i}, _act)
        resumed = Ledger(store, Keyring([SECRET]))  # a fresh process replays
        for i in (0, 21):
            assert resumed.perform(_identity(i), {"i": i}, _act) == {"ok": 1}
        assert len(ledger.effects(run_id="planned")) == 23
        Worker(rt, poll_s=0.05).run(until_idle=True)
    for rid in runs:
        assert store.get_run(rid).status is RunStatus.COMPLETED


def test_every_hot_statement_is_planned_through_an_index(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    captured = Captured(store, monkeypatch)
    _hot_paths(store, captured)
    # the capture saw the hot path (else this test could not fail)
    sqls = list(captured.statements)
    assert any("INSERT INTO oo_effects" in s for s in sqls)
    assert any("oo_checkpoints" in s for s in sqls)
    assert any(s.startswith("UPDATE oo_runs") for s in sqls)
    assert len(sqls) >= 15, sqls
    bad = scans(store, captured.statements)
    assert not bad, "\n".join(f"{b}: {s[:240]}" for s, b in bad.items())


def test_control_a_dropped_index_is_named(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    captured = Captured(store, monkeypatch)
    _hot_paths(store, captured)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX oo_effects_run_step")
    bad = scans(store, captured.statements)
    assert bad, "a read of a run's effects without its index was not reported"
    assert all("oo_effects" in s and "run_id" in s for s in bad), bad
