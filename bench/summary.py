"""From raw phase results to the published figures: medians of per-run medians, and
ratios to the floor measured in the same repetition (median over repetitions)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._util import median

MB = 1e6
TIMES = "\N{MULTIPLICATION SIGN}"


@dataclass(frozen=True)
class Target:
    """One benchmark target, evaluated for one system."""

    workload: str
    text: str
    system: str
    value: float
    unit: str
    limit: float
    spread: tuple[float, float] = (math.nan, math.nan)  # per-repetition min, max
    at_least: bool = False  # the target is value >= limit (else value <= limit)

    @property
    def met(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit


def _ok(r: dict[str, Any]) -> bool:
    return "error" not in r


def _per_rep(
    runs: Sequence[dict[str, Any]],
    get: Callable[[dict[str, Any]], float],
    **match: Any,
) -> dict[int, float]:
    """For each repetition, the median over that repetition's samples (fresh processes)
    of the runs matching ``match``: the per-run figure."""
    samples: dict[int, list[float]] = {}
    for r in runs:
        if _ok(r) and all(r.get(k) == v for k, v in match.items()):
            samples.setdefault(int(r["rep"]), []).append(get(r))
    return {rep: median(xs) for rep, xs in samples.items()}


def _ratios(mine: dict[int, float], floor: dict[int, float]) -> list[float]:
    return [mine[k] / floor[k] for k in mine if k in floor and floor[k] > 0]


def _med_ratio(mine: dict[int, float], floor: dict[int, float]) -> float:
    """Median over repetitions of the ratio to the floor of the same repetition."""
    return median(_ratios(mine, floor))


def _range(mine: dict[int, float], floor: dict[int, float]) -> tuple[float, float]:
    """Smallest and largest same-repetition ratio."""
    xs = _ratios(mine, floor)
    return (min(xs), max(xs)) if xs else (math.nan, math.nan)


W1_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "median_ms": lambda r: float(r["call"]["median_ms"]),
    "p99_ms": lambda r: float(r["call"]["p99_ms"]),
    "max_ms": lambda r: float(r["call"]["max_ms"]),
    "total_s": lambda r: float(r["total_s"]),
    "per_s": lambda r: float(r["per_s"]),
    "first_ms": lambda r: float(r.get("first_ms", math.nan)),
    "cpu_ms": lambda r: float(r.get("cpu_ms_per_call", math.nan)),
    "bytes": lambda r: float(r.get("bytes", math.nan)),
}


def summarize_w1(w1: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: cold and warm per-call figures (median over repetitions of the per-run
    figure) with their ratios to the floor's cold or warm run of the same repetition; the
    probe's counts per repetition; and for the async systems, effects per second and the
    ratio to the same system's sync (cold) throughput in the same repetition."""
    runs = w1["runs"]
    floor = w1["floor"]
    out: dict[str, dict[str, Any]] = {}
    for name in w1["systems"]:
        row: dict[str, Any] = {}
        for phase in ("cold", "warm"):
            mine_runs = [r for r in runs if r["system"] == name and r["phase"] == phase]
            ok = [r for r in mine_runs if _ok(r)]
            row[f"{phase}_reps"] = len(ok)
            row[f"{phase}_verified"] = bool(ok) and all(r["verified"] for r in ok)
            row[f"{phase}_why"] = sorted({r["why"] for r in ok if not r["verified"]})
            row[f"{phase}_executed"] = [int(r["executed"]) for r in ok]
            for fig, get in W1_FIGURES.items():
                mine = _per_rep(runs, get, system=name, phase=phase)
                theirs = _per_rep(runs, get, system=floor, phase=phase)
                row[f"{phase}_{fig}"] = median(list(mine.values()))
                row[f"x_{phase}_{fig}"] = _med_ratio(mine, theirs)
                row[f"xr_{phase}_{fig}"] = _range(mine, theirs)
            row[f"{phase}_extra"] = ok[0].get("extra", {}) if ok else {}
        probes = sorted(
            (r for r in runs if r["system"] == name and r["phase"] == "probe" and _ok(r)),
            key=lambda r: r["rep"],
        )
        row["probe_recorded"] = [int(r["recorded"]) for r in probes]
        row["probe_not_reexecuted"] = [int(r["not_reexecuted"]) for r in probes]
        row["probe_errors"] = [r["resume_errors"] for r in probes if r["resume_errors"]]
        row["probe_calls"] = w1["probe_calls"]
        if name in w1.get("async_systems", []):
            per_s = W1_FIGURES["per_s"]
            a = _per_rep(runs, per_s, system=name, phase="async")
            sync = _per_rep(runs, per_s, system=name, phase="cold")
            arows = [r for r in runs if r["system"] == name and r["phase"] == "async" and _ok(r)]
            row["async_per_s"] = median(list(a.values()))
            row["sync_per_s"] = median(list(sync.values()))
            row["x_async"] = _med_ratio(a, sync)
            row["xr_async"] = _range(a, sync)
            row["async_median_ms"] = median(
                list(_per_rep(runs, W1_FIGURES["median_ms"], system=name, phase="async").values())
            )
            row["async_p99_ms"] = median(
                list(_per_rep(runs, W1_FIGURES["p99_ms"], system=name, phase="async").values())
            )
            row["async_verified"] = bool(arows) and all(r["verified"] for r in arows)
            row["async_cpu_ms"] = median(
                list(_per_rep(runs, W1_FIGURES["cpu_ms"], system=name, phase="async").values())
            )
        row["errors"] = [r["error"] for r in runs if r["system"] == name and not _ok(r)]
        out[name] = row
    return out


W2_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "write_median_ms": lambda r: float(r["write"]["median_ms"]),
    "write_p99_ms": lambda r: float(r["write"]["p99_ms"]),
    "step_median_ms": lambda r: float(r["step"]["median_ms"]),
    "step_p99_ms": lambda r: float(r["step"]["p99_ms"]),
    "total_s": lambda r: float(r["total_s"]),
    "bytes": lambda r: float(r["bytes"]),
}
LOAD_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "load_ms": lambda r: float(r["load_ms"]),
    "open_ms": lambda r: float(r["breakdown"]["open_ms"]),
    "load_only_ms": lambda r: float(r["breakdown"]["load_ms"]),
    "cpu_ms": lambda r: float(r["breakdown"].get("cpu_ms", math.nan)),
}


def summarize_w2(w2: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: each figure (median over repetitions of the per-run figure) and its
    ratio to the floor (median over repetitions of the same-repetition ratio)."""
    runs = w2["runs"]
    floor = w2["floor"]
    out: dict[str, dict[str, Any]] = {}
    for name in w2["systems"]:
        writes = [r for r in runs if r["system"] == name and r["phase"] == "write" and _ok(r)]
        loads = [r for r in runs if r["system"] == name and r["phase"] == "load" and _ok(r)]
        row: dict[str, Any] = {
            "reps": len({r["rep"] for r in writes}),
            "load_samples": len(loads),
        }
        figures = [("write", W2_FIGURES), ("load", LOAD_FIGURES)]
        for phase, table in figures:
            for fig, get in table.items():
                mine = _per_rep(runs, get, system=name, phase=phase)
                theirs = _per_rep(runs, get, system=floor, phase=phase)
                row[fig] = median(list(mine.values()))
                row[f"x_{fig}"] = _med_ratio(mine, theirs)
                row[f"xr_{fig}"] = _range(mine, theirs)
        row["verified"] = bool(loads) and all(r["verified"] for r in loads)
        row["errors"] = [r["error"] for r in runs if r["system"] == name and not _ok(r)]
        row["extra"] = writes[0].get("extra", {}) if writes else {}
        out[name] = row
    return out


def _cpu(r: dict[str, Any]) -> float:
    return float(r["breakdown"].get("cpu_ms", math.nan))


def summarize_w3(w3: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system and size: resume latency (median over repetitions of the per-run
    median), its ratio to the floor at the same size and repetition, the ratio of the
    largest to the smallest size (same repetition), and the bytes stored."""
    runs = w3["runs"]
    floor = w3["floor"]

    def resume(r: dict[str, Any]) -> float:
        return float(r["resume_ms"])

    out: dict[str, dict[str, Any]] = {}
    for name, sizes in w3["sizes"].items():
        build = w3["builds"].get(name, {})
        row: dict[str, Any] = {"sizes": {}, "build": build}
        for n in sizes:
            mine = _per_rep(runs, resume, system=name, steps=n)
            fl = _per_rep(runs, resume, system=floor, steps=n)
            cpu = _per_rep(runs, _cpu, system=name, steps=n)
            cpu_fl = _per_rep(runs, _cpu, system=floor, steps=n)
            cell = [r for r in runs if r["system"] == name and r["steps"] == n and _ok(r)]
            row["sizes"][n] = {
                "resume_ms": median(list(mine.values())),
                "min_ms": min(mine.values()) if mine else math.nan,
                "max_ms": max(mine.values()) if mine else math.nan,
                "x_floor": _med_ratio(mine, fl),
                "cpu_ms": median(list(cpu.values())),
                "x_floor_cpu": _med_ratio(cpu, cpu_fl),
                "open_ms": median([float(r["breakdown"]["open_ms"]) for r in cell]),
                "load_ms": median([float(r["breakdown"]["load_ms"]) for r in cell]),
                "bytes": build.get("bytes_at", {}).get(str(n), math.nan),
                "reps": len(mine),
                "samples": len(cell),
                "verified": bool(cell) and all(r["verified"] for r in cell),
            }
        lo, hi = min(sizes), max(sizes)
        row["ratio_lo"] = lo
        row["ratio_hi"] = hi
        at_hi = _per_rep(runs, resume, system=name, steps=hi)
        at_lo = _per_rep(runs, resume, system=name, steps=lo)
        row["ratio"] = _med_ratio(at_hi, at_lo) if hi != lo else math.nan
        row["ratio_range"] = _range(at_hi, at_lo) if hi != lo else (math.nan, math.nan)
        row["errors"] = [r["error"] for r in runs if r["system"] == name and not _ok(r)]
        if "error" in build:
            row["errors"].append(build["error"])
        out[name] = row
    return out


def targets(
    s2: dict[str, dict[str, Any]] | None,
    s3: dict[str, dict[str, Any]] | None,
    s1: dict[str, dict[str, Any]] | None = None,
) -> list[Target]:
    """The W1, W2 and W3 targets, evaluated for onceonly (the figures issue [10] asks
    for)."""
    out: list[Target] = []
    if s1 and "onceonly" in s1:
        r = s1["onceonly"]
        out += [
            Target(
                "W1",
                f"cold per-call median ≤ 1.5{TIMES} the two-commit floor",
                "onceonly",
                r["x_cold_median_ms"],
                TIMES,
                1.5,
                r["xr_cold_median_ms"],
            ),
            Target(
                "W1",
                f"warm per-call median ≤ 1.5{TIMES} the floor lookup",
                "onceonly",
                r["x_warm_median_ms"],
                TIMES,
                1.5,
                r["xr_warm_median_ms"],
            ),
        ]
        g = s1.get("onceonly-guard")
        if g is not None:
            out += [
                Target(
                    "W1",
                    f"cold per-call median ≤ 1.6{TIMES} the two-commit floor",
                    "onceonly-guard",
                    g["x_cold_median_ms"],
                    TIMES,
                    1.6,
                    g["xr_cold_median_ms"],
                ),
                Target(
                    "W1",
                    f"warm per-call median ≤ 1.5{TIMES} the floor lookup",
                    "onceonly-guard",
                    g["x_warm_median_ms"],
                    TIMES,
                    1.5,
                    g["xr_warm_median_ms"],
                ),
            ]
        rec = r["probe_recorded"]
        if rec:
            out.append(
                Target(
                    "W1",
                    f"durable-before-return probe {r['probe_calls']}/{r['probe_calls']} "
                    "(worst repetition)",
                    "onceonly",
                    float(min(rec)),
                    "calls",
                    float(r["probe_calls"]),
                    (float(min(rec)), float(max(rec))),
                    at_least=True,
                )
            )
        if "x_async" in r:
            out.append(
                Target(
                    "W1",
                    f"W1-async ≥ 5{TIMES} the sync throughput",
                    "onceonly",
                    r["x_async"],
                    TIMES,
                    5.0,
                    r["xr_async"],
                    at_least=True,
                )
            )
    if s2:
        for name in ("onceonly", "onceonly-save"):
            if name not in s2:
                continue
            r = s2[name]
            out += [
                Target("W2", "bytes after 300 steps ≤ 0.5 MB", name, r["bytes"] / MB, "MB", 0.5),
                Target(
                    "W2",
                    f"write median ≤ 0.5{TIMES} the full-pickle floor",
                    name,
                    r["x_write_median_ms"],
                    TIMES,
                    0.5,
                    r["xr_write_median_ms"],
                ),
                Target(
                    "W2",
                    f"fresh-process load ≤ 2{TIMES} its floor",
                    name,
                    r["x_load_ms"],
                    TIMES,
                    2.0,
                    r["xr_load_ms"],
                ),
            ]
    for name in ("onceonly", "onceonly-lazy"):
        if not s3 or name not in s3:
            continue
        r = s3[name]
        out.append(
            Target(
                "W3",
                f"resume {r['ratio_hi']:,} / {r['ratio_lo']:,} steps ≤ 1.2",
                name,
                r["ratio"],
                TIMES,
                1.2,
                r["ratio_range"],
            )
        )
    return out
