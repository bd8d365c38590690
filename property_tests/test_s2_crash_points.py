"""S2: crash at every durable point (RELIABILITY.md), with the public harness
:func:`onceonly.testing.crash_at_every_point`.

For each scenario the harness counts the K failpoints an undisturbed run passes, then for
each chosen k runs it on a fresh database, crashes at the k-th, resumes it as a restarted
worker, and counts from the fake providers' raw logs: duplicates (I1), losses (I2), a
resume that re-acted on a recorded effect (I3), runs that did not finish (liveness).

What runs (CI tier; the deep tier in brackets):

* every effect sequence of length <= 3 over provider classes A/B/C (39), all in one step,
  crashed at every distinct point, in-process (mode 1), on SQLite [also one effect per
  step, at every point];
* two sequences at *every* point, not only the distinct ones (the equivalence the
  distinct choice relies on is checked, not assumed);
* a seeded sample of length-3 sequences on PostgreSQL [all 39];
* a few sequences in child processes that ``os._exit`` at the point (mode 2) [all 39];
* generated scenarios (5-30 effects, waits, parallel branches, recorded choices,
  definite refusals and provider faults): 40 in mode 1, 15 in mode 2, each crashed at a
  seeded sample of its distinct points, 6 in mode 1 and 3 in mode 2 [x20 scenarios, 30 and
  15 points each: about x100 the crash runs. Every distinct point of every deep scenario
  would be x370, about 88 000 runs of ~0.1 s, more than a deep run can hold];
* positive controls: the same harness against a ledger that forgets what was applied,
  and one that takes a crashed attempt for one that never left, must find duplicates;
* every known failpoint must have been passed by some run, in every durability mode.

Every mode: the scenarios of each group take the store's three durability modes in turn
(scenario i of a group: ``MODES[i % 3]``; the worker's store in the undisturbed run, the
crashed run and its resume), so each mode gets a third of them, not a copy of the suite.
In ``async`` and ``exit`` mode the checkpoint writes pass their failpoints elsewhere (the
background writer's group commits; the next ledger transition, a flush, the store's
close), and the crash lands there too: a crash is a crash of every thread, and the store
is closed with the crash still armed, so a dead worker writes nothing more. Every mode
must pass every known failpoint (``never_hit`` per mode in the details, all empty). The
report's ``modes`` counts scenarios per mode. ("Crash mode" 1 / 2 above is how the
process dies, unrelated.)

Per-scenario K, distinct points and failpoints never hit go to
``reports/reliability/details/S2.json``.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly.checkpoint.failpoints import KNOWN_FAILPOINTS
from onceonly.ledger import Ledger
from onceonly.ledger._claims import _Outcome
from onceonly.ledger.records import EffectStatus
from onceonly.testing import (
    Clock,
    HarnessReport,
    HTTPProvider,
    PostgresDatabases,
    Scenario,
    SQLiteDatabases,
    crash_at_every_point,
)

from .crash_flows import CLIENTS, WINDOW_S, plan_flow
from .reliability import MODES, REPORT_DIR, SuiteReport, depth, mode_of, scaled, seeds

pytestmark = pytest.mark.slow

CLASSES = ("A", "B", "C")
SEQUENCES = [list(seq) for n in (1, 2, 3) for seq in itertools.product(CLASSES, repeat=n)]  # 39


class Suite:
    """The S2 report, the failpoints seen, and per-scenario details."""

    def __init__(self) -> None:
        self.report = SuiteReport(suite="S2")
        self.seen: set[str] = set()
        self.seen_in: dict[str, set[str]] = {m: set() for m in MODES}
        self.crashed_in: dict[str, collections.Counter[str]] = {
            m: collections.Counter() for m in MODES
        }
        self.details: list[dict[str, Any]] = []

    def never_hit(self, mode: str) -> list[str]:
        """Known failpoints no run in durability ``mode`` passed."""
        return [n for n in KNOWN_FAILPOINTS if n not in self.seen_in[mode]]

    def add(self, name: str, got: HarnessReport, *, chosen: int, durability: str) -> None:
        rep = self.report
        rep.mode(durability)
        self.seen_in[durability] |= got.seen
        self.crashed_in[durability].update(got.crashed_at)
        rep.add(
            scenarios=1,
            crash_points=chosen,
            runs=got.runs,
            effects=got.effects,
            raw_deliveries=got.raw_requests,
            duplicates=got.duplicates,
            lost=got.lost + got.stuck,
            needs_human=got.needs_human,
        )
        self.seen |= got.seen
        self.details.append(
            {
                "scenario": name,
                "mode": got.mode,
                "durability": durability,
                "K": got.crash_points,
                "distinct": got.distinct_points,
                "crashed_at": chosen,
                "runs": got.runs,
                "deliveries": got.deliveries,
                "needs_human": got.needs_human,
                "failed": got.failed,
                "not_reached": got.not_reached,
                "never_hit": list(got.never_hit),
                "problems": got.problems[:20],
            }
        )

    def write_details(self) -> None:
        path = REPORT_DIR / "details"
        path.mkdir(parents=True, exist_ok=True)
        never = [n for n in KNOWN_FAILPOINTS if n not in self.seen]
        data = {
            "tier": depth(),
            "never_hit": never,
            "never_hit_by_durability": {m: self.never_hit(m) for m in MODES},
            "crashed_at_by_durability": {m: dict(self.crashed_in[m]) for m in MODES},
            "scenarios": self.details,
        }
        (path / "S2.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def suite() -> Iterator[Suite]:
    s = Suite()
    yield s
    s.write_details()
    s.report.check()


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def fakes(clock: Clock) -> Iterator[dict[str, HTTPProvider]]:
    """One fake per provider class, sharing the harness's clock; in-process runs use
    their refusing clients (so ``refuse`` faults refuse the connection)."""
    out = {c: HTTPProvider(c, clock=clock, window_s=WINDOW_S).start() for c in CLASSES}
    for p in out.values():
        CLIENTS[p.url] = p.client(timeout=10.0)
    try:
        yield out
    finally:
        for p in out.values():
            CLIENTS.pop(p.url).close()
            p.stop()


@pytest.fixture(scope="module")
def sqlite() -> Iterator[SQLiteDatabases]:
    shm = "/dev/shm"  # noqa: S108  (a private directory in it, made by mkdtemp)
    where = tempfile.mkdtemp(prefix="onceonly-s2-", dir=shm if os.path.isdir(shm) else None)
    dbs = SQLiteDatabases(where)
    try:
        yield dbs
    finally:
        dbs.close()
        shutil.rmtree(where, ignore_errors=True)


def scenario(fakes: dict[str, HTTPProvider], plan: list[dict[str, Any]]) -> Scenario:
    urls = {c: p.url for c, p in fakes.items()}
    return Scenario(plan_flow, {"urls": urls, "plan": plan}, signals={})


def one_step(seq: list[str]) -> list[dict[str, Any]]:
    effects = [[c, f"s{i}-{c}", False] for i, c in enumerate(seq)]
    return [{"op": "effects", "effects": effects}, {"op": "effects", "effects": []}]


def step_each(seq: list[str]) -> list[dict[str, Any]]:
    return [{"op": "effects", "effects": [[c, f"s{i}-{c}", False]]} for i, c in enumerate(seq)]


def crash(
    suite: Suite,
    name: str,
    sc: Scenario,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    database: Any,
    *,
    mode: str = "raise",
    points: Any = "distinct",
    plans: dict[str, list[str]] | None = None,
    sample: int | None = None,
    seed: int = 0,
    durability: str = "sync",
) -> HarnessReport:
    for c, p in fakes.items():
        p.fault_plan = list((plans or {}).get(c, []))
    try:
        got = crash_at_every_point(
            sc,
            list(fakes.values()),
            mode=mode,
            points=points,
            sample=sample,
            seed=seed,
            database=database,
            clock=clock,
            durability=durability,
        )
    finally:
        for p in fakes.values():
            p.fault_plan = []
    chosen = got.runs - 1
    suite.add(name, got, chosen=chosen, durability=durability)
    return got


def check_all(reports: list[tuple[str, HarnessReport]]) -> None:
    bad = [f"{name}: {p}" for name, got in reports for p in got.problems]
    assert not bad, f"{len(bad)} problem(s):\n" + "\n".join(bad[:30])


# -- the registry matches the code -------------------------------------------------------------


def test_s2_known_failpoints_are_the_ones_library_code_marks() -> None:
    """Every name library code passes to ``failpoint`` (literally, or through the ledger's
    table of outcome points) is in ``KNOWN_FAILPOINTS``, and every known one is used."""
    root = Path(__file__).resolve().parent.parent
    used: set[str] = set()
    for package in ("checkpoint", "ledger", "adapters", "onceonly"):
        for path in (root / package).glob("*.py"):
            if path.name == "failpoints.py":  # the registry itself
                continue
            text = path.read_text(encoding="utf-8")
            used |= set(re.findall(r'failpoint\("([a-z_.]+)"\)', text))
            used |= set(
                re.findall(
                    r'"((?:ledger|adapters|checkpoint|runtime|waits)\.[a-z_]+'
                    r'\.(?:before|after))"',
                    text,
                )
            )
    assert sorted(used) == sorted(KNOWN_FAILPOINTS)
    assert list(KNOWN_FAILPOINTS) == sorted(KNOWN_FAILPOINTS)


# -- exhaustive: every sequence of length <= 3 ------------------------------------------------


def test_s2_every_sequence_up_to_3_on_sqlite(
    suite: Suite, fakes: dict[str, HTTPProvider], clock: Clock, sqlite: SQLiteDatabases
) -> None:
    layouts = [("one-step", one_step)]
    if depth() == "deep":
        layouts.append(("step-each", step_each))
    points = "all" if depth() == "deep" else "distinct"
    got = []
    for i, ((layout, build), seq) in enumerate(itertools.product(layouts, SEQUENCES)):
        mode = mode_of(i)
        name = f"{layout}:{''.join(seq)}:{mode}"
        sc = scenario(fakes, build(seq))
        got.append(
            (name, crash(suite, name, sc, fakes, clock, sqlite, points=points, durability=mode))
        )
    check_all(got)
    # sync and exit runs pass the same failpoints every time; in async mode the group
    # commits depend on the writer thread's timing, so a run may pass fewer (counted in
    # the details; coverage per mode is checked by test_s2_every_failpoint_was_passed).
    missed = [n for n, g in got if g.not_reached and not n.endswith(":async")]
    assert not missed, f"a deterministic run missed a crash point: {missed}"
    # class C crashed between claim and outcome: in doubt, handed to a human, never re-sent
    assert sum(g.needs_human for _, g in got) > 0


def test_s2_every_point_not_only_distinct_ones(
    suite: Suite, fakes: dict[str, HTTPProvider], clock: Clock, sqlite: SQLiteDatabases
) -> None:
    got = []
    for i, seq in enumerate((["A", "B", "C"], ["C", "B", "A"], ["B", "C", "A"])):
        mode = mode_of(i)
        name = f"every-point:{''.join(seq)}:{mode}"
        sc = scenario(fakes, one_step(seq))
        got.append(
            (name, crash(suite, name, sc, fakes, clock, sqlite, points="all", durability=mode))
        )
    check_all(got)
    assert all(g.runs == g.crash_points + 1 for _, g in got)


def test_s2_sequences_on_postgresql(
    suite: Suite, fakes: dict[str, HTTPProvider], clock: Clock, pg_server_url: str
) -> None:
    seed = seeds(1, base=2002)[0]
    suite.report.seeds.append(seed)
    rng = random.Random(seed)
    sample = SEQUENCES if depth() == "deep" else rng.sample(SEQUENCES[12:], 3)
    dbs = PostgresDatabases(pg_server_url)
    try:
        got = []
        for i, seq in enumerate(sample):
            mode = mode_of(i)
            name = f"pg:{''.join(seq)}:{mode}"
            sc = scenario(fakes, one_step(seq))
            got.append((name, crash(suite, name, sc, fakes, clock, dbs, durability=mode)))
    finally:
        dbs.close()
    check_all(got)


def test_s2_sequences_in_child_processes_that_exit(
    suite: Suite, fakes: dict[str, HTTPProvider], clock: Clock, sqlite: SQLiteDatabases
) -> None:
    sample = SEQUENCES if depth() == "deep" else [["A", "B", "C"], ["C", "C", "B"], ["B", "A"]]
    points = "all" if depth() == "deep" else "distinct"
    got = []
    for i, seq in enumerate(sample):
        store_mode = mode_of(i)
        name = f"exit:{''.join(seq)}:{store_mode}"
        sc = scenario(fakes, one_step(seq))
        got.append(
            (
                name,
                crash(
                    suite,
                    name,
                    sc,
                    fakes,
                    clock,
                    sqlite,
                    mode="exit",
                    points=points,
                    durability=store_mode,
                ),
            )
        )
    check_all(got)
    missed = [n for n, g in got if g.not_reached and not n.endswith(":async")]
    assert not missed, f"a child ended before its crash point: {missed}"


# -- generated scenarios -----------------------------------------------------------------------


def generate(
    rng: random.Random, n_effects: int, faults: tuple[str, ...] = ("error", "refuse")
) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """A plan of ``n_effects`` effects in steps, parallel branches and recorded choices,
    with waits between them, some definite refusals, and (sometimes) provider faults."""
    plan: list[dict[str, Any]] = []
    n = 0
    waits = 0

    def effect() -> list[Any]:
        nonlocal n
        n += 1
        return [rng.choice(CLASSES), f"g{n}", rng.random() < 0.06]

    left = n_effects
    while left > 0:
        r = rng.random()
        if r < 0.45:
            k = min(left, rng.randint(1, 4))
            plan.append({"op": "effects", "effects": [effect() for _ in range(k)]})
            left -= k
        elif r < 0.6 and left >= 2:
            names = [f"b{len(plan)}-{i}" for i in range(rng.randint(2, 3))]
            branches: dict[str, list[list[Any]]] = {b: [] for b in names}
            k = min(left, rng.randint(2, 2 * len(names)))
            for i in range(k):
                branches[names[i % len(names)]].append(effect())
            plan.append({"op": "branches", "branches": branches})
            left -= k
        elif r < 0.72:
            plan.append({"op": "choose", "label": f"c{len(plan)}", "options": [effect(), effect()]})
            left -= 1
        elif waits < 3:
            waits += 1
            kind = rng.choice(("approval", "signal", "sleep"))
            plan.append({"op": kind, "name": f"w{len(plan)}-{kind}"})
    plans: dict[str, list[str]] = {}
    if rng.random() < 0.5:
        for c in CLASSES:
            slots: list[str] = []
            for _ in range(rng.randint(2, 12)):
                slots += ["ok"] * rng.randint(1, 4) + [rng.choice(faults)]
            plans[c] = slots
    return plan, plans


def _generated(
    suite: Suite,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    sqlite: SQLiteDatabases,
    *,
    count: int,
    per_scenario: tuple[int, int],
    mode: str,
    base: int,
) -> list[tuple[str, HarnessReport]]:
    got = []
    chosen = seeds(count, base=base)
    suite.report.seeds += chosen
    for i, seed in enumerate(chosen):
        store_mode = mode_of(i)
        rng = random.Random(seed)
        # A child process has no refusing client, and cannot hand an effect to a human
        # (the harness resolves those from the fakes, in the test process): its plans use
        # server-side faults only, on classes A and B only.
        faults = ("error",) if mode == "exit" else ("error", "refuse")
        plan, plans = generate(rng, rng.randint(5, 30), faults)
        if mode == "exit":
            plans.pop("C", None)
        name = f"gen-{mode}:{seed}:{store_mode}"
        # A seeded sample of the scenario's distinct points, larger in the deep tier.
        sample = scaled(*per_scenario)
        got.append(
            (
                name,
                crash(
                    suite,
                    name,
                    scenario(fakes, plan),
                    fakes,
                    clock,
                    sqlite,
                    mode=mode,
                    plans=plans,
                    sample=sample,
                    seed=seed,
                    durability=store_mode,
                ),
            )
        )
    return got


def test_s2_generated_scenarios_in_process(
    suite: Suite, fakes: dict[str, HTTPProvider], clock: Clock, sqlite: SQLiteDatabases
) -> None:
    got = _generated(
        suite,
        fakes,
        clock,
        sqlite,
        count=scaled(40, 800),
        per_scenario=(6, 30),
        mode="raise",
        base=20262000,
    )
    check_all(got)


def test_s2_generated_scenarios_in_child_processes(
    suite: Suite, fakes: dict[str, HTTPProvider], clock: Clock, sqlite: SQLiteDatabases
) -> None:
    got = _generated(
        suite,
        fakes,
        clock,
        sqlite,
        count=scaled(15, 300),
        per_scenario=(3, 15),
        mode="exit",
        base=20263000,
    )
    check_all(got)


# -- every failpoint kind in every mode -------------------------------------------------------

KINDS_PLAN: list[dict[str, Any]] = [
    {"op": "effects", "effects": [["A", "k1", False], ["B", "k2", False], ["C", "k3", False]]},
    {"op": "approval", "name": "k-approval"},
    {"op": "effects", "effects": [["A", "k4", True], ["B", "k5", False], ["C", "k6", False]]},
    {"op": "signal", "name": "k-signal"},
    {"op": "branches", "branches": {"x": [["B", "k7", False]], "y": [["C", "k8", False]]}},
    {"op": "sleep", "name": "k-sleep"},
    {"op": "effects", "effects": [["A", "k9", False]]},
]
"""One scenario that passes every kind of failpoint: a definite refusal (fail), a refused
connection (release, then a retry), a 500 to class B (probe, reconcile) and to class C (in
doubt, resolved by the operator), each kind of wait, parallel branches."""
KINDS_FAULTS = {"A": ["ok", "ok", "refuse"], "B": ["ok", "error"], "C": ["ok", "error"]}
CHECKPOINT_POINTS = ("checkpoint.commit.after", "checkpoint.commit.before", "checkpoint.run.write")


@pytest.mark.parametrize("durability", MODES)
def test_s2_every_failpoint_kind_in_every_mode(
    suite: Suite,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    sqlite: SQLiteDatabases,
    durability: str,
) -> None:
    """The generated scenarios rotate the modes, so which kinds a mode meets there is
    luck: this scenario makes sure each mode passes every failpoint (and crashes at the
    checkpoint writes: their timing is what the modes change)."""
    name = f"kinds:{durability}"
    got = crash(
        suite,
        name,
        scenario(fakes, KINDS_PLAN),
        fakes,
        clock,
        sqlite,
        plans=KINDS_FAULTS,
        sample=None if depth() == "deep" else 12,
        seed=len(name),
        durability=durability,
    )
    check_all([(name, got)])
    assert not got.never_hit, f"{name}: never hit {got.never_hit}"


# -- positive controls: the harness must catch a broken ledger ---------------------------------


def _forgets_what_was_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The "already applied?" check removed: a committed effect is claimed again."""
    original = Ledger._claim_txn

    def claim_txn(self: Ledger, cur: Any, *args: Any) -> _Outcome:
        out = original(self, cur, *args)
        if out.kind == "replay" and out.row["status"] == EffectStatus.COMMITTED.value:
            moved = self._reclaim(cur, out.row, "reclaimed", resend=False, fence=None)
            assert moved is not None
            return _Outcome("claim", moved, self._claim_of(moved))
        return out

    monkeypatch.setattr(Ledger, "_claim_txn", claim_txn)
    monkeypatch.setattr(Ledger, "prefetch", lambda self, run_id: 0)


def _trusts_a_crashed_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim left open by a crash is taken for one that never left (a naive retry)."""
    original = Ledger._claim_txn

    def claim_txn(self: Ledger, cur: Any, *args: Any) -> _Outcome:
        out = original(self, cur, *args)
        if out.kind == "doubt" and out.row["status"] == EffectStatus.UNKNOWN.value:
            moved = self._reclaim(cur, out.row, "reclaimed", resend=False, fence=None)
            assert moved is not None
            return _Outcome("claim", moved, self._claim_of(moved))
        return out

    monkeypatch.setattr(Ledger, "_claim_txn", claim_txn)


@pytest.mark.parametrize(
    ("broken", "durability"),
    [(_forgets_what_was_applied, "async"), (_trusts_a_crashed_attempt, "exit")],
)
def test_s2_positive_control(
    suite: Suite,
    fakes: dict[str, HTTPProvider],
    clock: Clock,
    sqlite: SQLiteDatabases,
    monkeypatch: pytest.MonkeyPatch,
    broken: Any,
    durability: str,
) -> None:
    with monkeypatch.context() as patch:
        broken(patch)
        got = crash_at_every_point(
            scenario(fakes, one_step(["B", "C", "A"])),
            list(fakes.values()),
            database=sqlite,
            clock=clock,
            points="distinct",
            durability=durability,
        )
    caught = got.duplicates > 0 or got.re_acts > 0
    suite.report.control(caught)
    assert caught, f"the harness did not catch {broken.__name__}: {got.problems[:5]}"


# -- coverage of the failpoints ----------------------------------------------------------------


def test_s2_every_failpoint_was_passed(suite: Suite) -> None:
    """Runs last (file order): every failpoint library code marks was passed by some run
    of this suite; one never hit is a blind spot of the harness."""
    never = [n for n in KNOWN_FAILPOINTS if n not in suite.seen]
    assert not never, f"failpoints never hit: {never}"
    by_mode = {m: suite.never_hit(m) for m in MODES}
    assert not any(by_mode.values()), f"failpoints never hit, per durability mode: {by_mode}"
    uncrashed = {m: [p for p in CHECKPOINT_POINTS if not suite.crashed_in[m][p]] for m in MODES}
    assert not any(uncrashed.values()), f"checkpoint writes never crashed at: {uncrashed}"
    assert all(suite.report.modes.get(m) for m in MODES), suite.report.modes
    assert suite.report.runs > 0
