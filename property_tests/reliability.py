"""Shared machinery of the reliability suites S1-S11 (see ../shared/RELIABILITY.md).

* :func:`depth` / :func:`scaled` / :func:`seeds`: the CI tier (fixed seeds, CI sizes) or
  the deep tier (``RELIABILITY_DEPTH=deep``: sizes x20-x100, random seeds that are
  printed so a failure can be replayed with ``RELIABILITY_SEED``).
* :class:`SuiteReport`: the counters every suite writes to
  ``reports/reliability/<suite>.json``; :meth:`SuiteReport.check` fails the test on any
  duplicate, loss, accepted tamper, or a suite whose providers received nothing.
* :data:`MODES`: the store's durability modes; the suites of :data:`MODE_SUITES` rotate
  them across their scenarios, seeds and workers and count them in ``modes``.
* ``python -m property_tests.reliability`` prints the summary table of every report
  (``.ci/run`` calls it after the tests) and exits non-zero if a report shows a failure
  or a positive control that was not caught.

The counters come from the fake providers' raw delivery logs, never from our ledger.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPORT_DIR = Path(os.environ.get("RELIABILITY_REPORTS", "reports/reliability"))

FIELDS = (
    "suite",
    "tier",
    "seeds",
    "crash_points",
    "scenarios",
    "runs",
    "effects",
    "raw_deliveries",
    "duplicates",
    "lost",
    "needs_human",
    "detected",
    "accepted",
    "controls_run",
    "controls_caught",
    "wall_s",
    "modes",
)


EXPECTED_SUITES = ("S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8", "S9")
"""Every suite must write a report; S10 is the positive controls each of them runs."""

MODES = ("sync", "async", "exit")
"""The durability modes of the store (:class:`checkpoint.Durability` values)."""

MODE_SUITES = ("S1", "S2", "S3", "S4", "S7")
"""The suites that must run their scenarios in every durability mode (RELIABILITY.md:
"every suite in every mode"); the summary fails one whose report misses a mode."""


def mode_of(i: int) -> str:
    """The durability mode of scenario (seed, worker) number ``i``: :data:`MODES` in turn,
    so every mode gets a third of a suite's scenarios instead of the suite running three
    times."""
    return MODES[i % len(MODES)]


def depth() -> str:
    """``ci`` (default) or ``deep``."""
    value = os.environ.get("RELIABILITY_DEPTH", "ci")
    if value not in ("ci", "deep"):
        raise SystemExit(f"RELIABILITY_DEPTH must be ci or deep, not {value!r}")
    return value


def scaled(ci: int, deep: int) -> int:
    """A size: ``ci`` in the CI tier, ``deep`` (x20-x100) in the deep tier."""
    return deep if depth() == "deep" else ci


def seeds(n: int, *, base: int = 20261130) -> list[int]:
    """``n`` seeds: fixed in the CI tier; random (printed) in the deep tier, or the one
    given in ``RELIABILITY_SEED`` to replay a failure."""
    given = os.environ.get("RELIABILITY_SEED")
    if given:
        return [int(given)]
    if depth() == "ci":
        return [base + i for i in range(n)]
    rng = random.SystemRandom()
    out = [rng.randrange(2**32) for _ in range(n)]
    print(f"reliability seeds (replay one with RELIABILITY_SEED=<seed>): {out}", file=sys.stderr)
    return out


@dataclass
class SuiteReport:
    """The counters of one suite run (accumulate across its tests, then :meth:`write`).

    Attributes mirror the report fields of RELIABILITY.md; ``controls_run`` and
    ``controls_caught`` count S10 positive controls run by this suite's harness;
    ``modes`` counts, per durability mode, the suite's units that ran in it (scenarios,
    or the worker stores of a suite whose scenarios mix modes; each suite's docstring
    says which), added with :meth:`mode`.
    """

    suite: str
    tier: str = field(default_factory=depth)
    seeds: list[int] = field(default_factory=list)
    crash_points: int = 0
    scenarios: int = 0
    runs: int = 0
    effects: int = 0
    raw_deliveries: int = 0
    duplicates: int = 0
    lost: int = 0
    needs_human: int = 0
    detected: int = 0
    accepted: int = 0
    controls_run: int = 0
    controls_caught: int = 0
    wall_s: float = 0.0
    modes: dict[str, int] = field(default_factory=dict)
    _started: float = field(default_factory=time.monotonic, repr=False)

    def add(self, **counts: int) -> None:
        """Add to counters, e.g. ``report.add(runs=1, effects=5, raw_deliveries=5)``."""
        for name, n in counts.items():
            if name not in FIELDS or name in ("suite", "tier", "seeds", "wall_s", "modes"):
                raise KeyError(f"unknown counter {name!r}")
            setattr(self, name, getattr(self, name) + n)

    def mode(self, name: str, n: int = 1) -> None:
        """Count ``n`` units (scenarios, worker stores) run in durability mode ``name``."""
        if name not in MODES:
            raise KeyError(f"unknown durability mode {name!r}")
        self.modes[name] = self.modes.get(name, 0) + n

    def missing_modes(self) -> list[str]:
        """The durability modes this suite should have run in and did not (only the
        suites of :data:`MODE_SUITES` must run in all of them)."""
        if self.suite not in MODE_SUITES:
            return []
        return [m for m in MODES if not self.modes.get(m)]

    def control(self, caught: bool) -> None:
        """Record one positive control (a deliberately broken build) and whether the
        harness caught it."""
        self.controls_run += 1
        self.controls_caught += int(caught)

    def failures(self) -> list[str]:
        """What makes this report a failure (empty: it passed)."""
        out = []
        if self.duplicates:
            out.append(f"{self.duplicates} duplicate(s)")
        if self.lost:
            out.append(f"{self.lost} lost effect(s)")
        if self.accepted:
            out.append(f"{self.accepted} accepted tamper(s)")
        if self.effects and not self.raw_deliveries:
            out.append("the providers received nothing")
        if self.controls_caught != self.controls_run:
            out.append(f"{self.controls_run - self.controls_caught} control(s) not caught")
        return out

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data["wall_s"] = round(time.monotonic() - self._started, 2)
        return data

    def write(self) -> Path:
        """Write ``reports/reliability/<suite>.json`` (atomically)."""
        REPORT_DIR.mkdir(parents=True, exist_ok=True)
        path = REPORT_DIR / f"{self.suite}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    def check(self) -> None:
        """Write the report, then fail (AssertionError) if it shows a failure."""
        self.write()
        problems = self.failures()
        assert not problems, f"{self.suite}: " + "; ".join(problems)


def summary(report_dir: Path = REPORT_DIR) -> tuple[str, bool]:
    """The summary table of every report in ``report_dir``, and whether all passed."""
    rows = []
    ok = True
    for path in sorted(report_dir.glob("*.json")):
        data = json.loads(path.read_text())
        rep = SuiteReport(suite=data["suite"])
        for name in FIELDS:
            if name in data and name not in ("wall_s",):
                setattr(rep, name, data[name])
        problems = rep.failures()
        if rep.missing_modes():
            problems.append(f"never ran in durability mode {', '.join(rep.missing_modes())}")
        ok = ok and not problems
        rows.append((data, "FAIL: " + "; ".join(problems) if problems else "ok"))
    cols = (
        "suite",
        "tier",
        "crash_points",
        "scenarios",
        "runs",
        "effects",
        "raw_deliveries",
        "duplicates",
        "lost",
        "needs_human",
        "detected",
        "accepted",
        "controls_run",
        "controls_caught",
        "wall_s",
    )
    head = ["suite", "tier", "crash pts", "scen", "runs", "effects", "raw", "dup", "lost"]
    head += ["human", "detected", "accepted", "ctl run", "ctl caught", "wall s", "modes"]
    head += ["result"]
    lines = [" | ".join(head)]
    for data, verdict in rows:
        modes = data.get("modes") or {}
        shown = " ".join(f"{m}:{modes[m]}" for m in MODES if m in modes) or "-"
        lines.append(" | ".join([*(str(data.get(c, "")) for c in cols), shown, verdict]))
    found = {str(data["suite"]) for data, _ in rows}
    missing = [name for name in EXPECTED_SUITES if name not in found]
    if missing:
        ok = False
        lines.append(f"FAIL: no report from {', '.join(missing)} (a suite that did not run)")
    run = sum(int(data.get("controls_run", 0)) for data, _ in rows)
    caught = sum(int(data.get("controls_caught", 0)) for data, _ in rows)
    verdict = "ok" if run and run == caught else "FAIL"
    ok = ok and verdict == "ok"
    lines.append(f"S10 positive controls: run {run}, caught {caught}: {verdict}")
    return "\n".join(lines), ok


def main() -> int:
    table, ok = summary()
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
