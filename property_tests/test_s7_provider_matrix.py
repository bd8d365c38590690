"""S7: the provider matrix (RELIABILITY.md), with the public harness
:func:`onceonly.testing.fault_at_every_call`.

Each provider class (A: deduplicates our key; B: answers lookups by key; C: neither) x
each failure mode of :data:`onceonly.testing.FAULTS` (the connection refused; a definite
refusal; a 500 before applying; applied, then the connection cut; applied, then no answer
before the client's timeout; applied, then the connection cut and the dedup window
passed) is injected at each call of a 5-effect scenario. The run is driven to its end,
and every cell must end with its effect applied once, failed definitely, or handed to a
human (then resolved from the fake's log), counted from the fake's raw log, with nothing
applied twice or lost. Beyond "one of the three", each cell must end the way its class
promises (``EXPECTED``): e.g. a class A provider that lost its answer is re-sent the same
key and applies once, class C needs a human, and nobody re-sends after the window.

Every mode: the cells of each class take the three durability modes in turn (the harness's
``durability=MODES``: cell i of a class runs in ``MODES[i % 3]``, so each fault meets
every mode across its five calls); the report's ``modes`` counts the runs per mode. The
positive controls run in ``async`` and ``exit``.

CI tier: the whole matrix on SQLite (3 x 6 x 5 = 90 cells), class B's row on PostgreSQL.
Deep tier: both backends in full, and a 10-effect scenario with branches as well.

Positive control: a build that classifies every timeout as "never sent" (a naive retry)
must be caught with duplicates in the timeout cells.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from onceonly.ledger import Evidence, Ledger, OutcomeClass
from onceonly.testing import (
    FAULTS,
    Clock,
    HarnessReport,
    HTTPProvider,
    PostgresDatabases,
    Scenario,
    SQLiteDatabases,
    fault_at_every_call,
)

from .crash_flows import CLIENTS, WINDOW_S, plan_flow
from .reliability import MODES, SuiteReport, depth

pytestmark = pytest.mark.slow

CLASSES = ("A", "B", "C")
READ_TIMEOUT_S = 0.75  # the client's; the fake holds a "timeout" answer for 1 s

EXPECTED = {
    "refuse": {"A": "applied-once", "B": "applied-once", "C": "applied-once"},
    "reject": {"A": "failed-definitely", "B": "failed-definitely", "C": "failed-definitely"},
    "error": {"A": "applied-once", "B": "applied-once", "C": "needs-human"},
    "cut": {"A": "applied-once", "B": "applied-once", "C": "needs-human"},
    "timeout": {"A": "applied-once", "B": "applied-once", "C": "needs-human"},
    "forget": {"A": "needs-human", "B": "applied-once", "C": "needs-human"},
}
"""How the effect of the failed call ends, by fault and provider class."""


@pytest.fixture(scope="module")
def report() -> Iterator[SuiteReport]:
    rep = SuiteReport(suite="S7")
    yield rep
    rep.check()


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def fakes(clock: Clock) -> Iterator[dict[str, HTTPProvider]]:
    # The fakes keep keys exactly as long as the adapters are told they do.
    out = {c: HTTPProvider(c, clock=clock, window_s=WINDOW_S, sleep_s=1.0).start() for c in CLASSES}
    for p in out.values():
        CLIENTS[p.url] = p.client(timeout=READ_TIMEOUT_S)
    try:
        yield out
    finally:
        for p in out.values():
            CLIENTS.pop(p.url).close()
            p.stop()


@pytest.fixture(scope="module")
def sqlite() -> Iterator[SQLiteDatabases]:
    shm = "/dev/shm"  # noqa: S108  (a private directory in it, made by mkdtemp)
    where = tempfile.mkdtemp(prefix="onceonly-s7-", dir=shm if os.path.isdir(shm) else None)
    dbs = SQLiteDatabases(where)
    try:
        yield dbs
    finally:
        dbs.close()
        shutil.rmtree(where, ignore_errors=True)


def five_effects(cls: str, url: str) -> Scenario:
    """Five effects to one provider: two in one step, one alone, two more in a step."""
    e = [[cls, f"m{i}-{cls}", False] for i in range(5)]
    plan = [
        {"op": "effects", "effects": e[:2]},
        {"op": "effects", "effects": e[2:3]},
        {"op": "effects", "effects": e[3:]},
    ]
    return Scenario(plan_flow, {"urls": {cls: url}, "plan": plan})


def ten_with_branches(cls: str, url: str) -> Scenario:
    e = [[cls, f"t{i}-{cls}", False] for i in range(10)]
    plan = [
        {"op": "effects", "effects": e[:3]},
        {"op": "branches", "branches": {"x": e[3:5], "y": e[5:7]}},
        {"op": "choose", "label": "pick", "options": [e[7], e[8]]},
        {"op": "effects", "effects": e[9:]},
    ]
    return Scenario(plan_flow, {"urls": {cls: url}, "plan": plan})


def matrix(
    report: SuiteReport,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    database: Callable[[], str],
    classes: tuple[str, ...],
    build: Callable[[str, str], Scenario],
    faults: tuple[str, ...] = FAULTS,
) -> list[tuple[str, HarnessReport]]:
    out = []
    for cls in classes:
        got = fault_at_every_call(
            build(cls, fakes[cls].url),
            fakes[cls],
            faults=faults,
            database=database,
            clock=clock,
            durability=MODES,
        )
        for mode, n in got.modes.items():
            report.mode(mode, n)
        report.add(
            scenarios=1,
            crash_points=len(got.cells),
            runs=got.runs,
            effects=got.effects,
            raw_deliveries=got.raw_requests,
            duplicates=got.duplicates,
            lost=got.lost + got.stuck,
            needs_human=got.needs_human,
        )
        out.append((cls, got))
    return out


def check(results: list[tuple[str, HarnessReport]], *, calls: int) -> None:
    problems = [f"class {cls}: {p}" for cls, got in results for p in got.problems]
    assert not problems, "\n".join(problems[:30])
    wrong = []
    for cls, got in results:
        assert got.crash_points == calls, f"class {cls}: {got.crash_points} calls, not {calls}"
        for fault, call, outcome in got.cells:
            if outcome != EXPECTED[fault][cls]:
                wrong.append(f"class {cls}, {fault} at call {call}: {outcome}")
    assert not wrong, "cells that ended other than their class promises:\n" + "\n".join(wrong)
    seen = collections.Counter(o for _, got in results for _, _, o in got.cells)
    assert set(seen) <= {"applied-once", "failed-definitely", "needs-human"}, seen


def test_s7_matrix_on_sqlite(
    report: SuiteReport, fakes: dict[str, HTTPProvider], clock: Clock, sqlite: SQLiteDatabases
) -> None:
    got = matrix(report, fakes, clock, sqlite, CLASSES, five_effects)
    check(got, calls=5)
    assert sum(len(g.cells) for _, g in got) == len(CLASSES) * len(FAULTS) * 5
    if depth() == "deep":
        more = matrix(report, fakes, clock, sqlite, CLASSES, ten_with_branches)
        problems = [f"class {cls}: {p}" for cls, g in more for p in g.problems]
        assert not problems, "\n".join(problems[:30])


def test_s7_matrix_on_postgresql(
    report: SuiteReport, fakes: dict[str, HTTPProvider], clock: Clock, pg_server_url: str
) -> None:
    classes = CLASSES if depth() == "deep" else ("B",)
    dbs = PostgresDatabases(pg_server_url)
    try:
        got = matrix(report, fakes, clock, dbs, classes, five_effects)
    finally:
        dbs.close()
    check(got, calls=5)


def test_s7_positive_control_timeouts_taken_for_never_sent(
    report: SuiteReport,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    sqlite: SQLiteDatabases,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A build that re-sends after a timeout as if nothing had left must be caught."""
    from onceonly.adapters import http as http_adapter

    real = http_adapter.classify_http

    def naive(exc: BaseException) -> OutcomeClass:
        if isinstance(exc, httpx.TimeoutException):
            return OutcomeClass.NOT_SENT
        return real(exc)

    with monkeypatch.context() as patch:
        patch.setattr(http_adapter, "classify_http", naive)
        results = [
            fault_at_every_call(
                five_effects(cls, fakes[cls].url),
                fakes[cls],
                faults=("timeout",),
                calls=[2],
                database=sqlite,
                clock=clock,
                durability=mode,
            )
            for cls, mode in (("B", "async"), ("C", "exit"))
        ]
    caught = all(r.duplicates > 0 for r in results)
    report.control(caught)
    assert caught, [r.problems for r in results]


def test_s7_positive_control_resend_after_the_window(
    report: SuiteReport,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    sqlite: SQLiteDatabases,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ledger that re-sends a class A effect after its dedup window closed (it takes
    the window for open whatever the time) must be caught: the provider forgot the key
    and performs the effect again."""
    real = Ledger.reconcile

    def window_always_open(self: Ledger, key_id: str, evidence: Any, **kw: Any) -> Any:
        if Evidence(evidence) is not Evidence.WINDOW_OPEN:
            return real(self, key_id, evidence, **kw)
        saved = self._clock
        self._clock = lambda: 0.0  # every window is open at the epoch
        try:
            return real(self, key_id, evidence, **kw)
        finally:
            self._clock = saved

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "reconcile", window_always_open)
        got = fault_at_every_call(
            five_effects("A", fakes["A"].url),
            fakes["A"],
            faults=("forget",),
            calls=[3],
            database=sqlite,
            clock=clock,
            durability="exit",
        )
    caught = got.duplicates > 0
    report.control(caught)
    assert caught, got.problems
