"""Render ``docs/performance.md`` and its plots (``docs/img/*.png``) from the raw results."""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from . import startup, summary, w2lg, w4
from ._util import median
from .summary import MB, Target
from .systems import LABELS, W1_LABELS
from .w1 import QUANTILES

TIMES = "\N{MULTIPLICATION SIGN}"
IMG = "img"
PLOTS = {
    "w1_latency": "bench-w1-latency.png",
    "bytes": "bench-bytes-vs-steps.png",
    "w2_latency": "bench-w2-latency.png",
    "w3_resume": "bench-w3-resume.png",
}
COLORS = {
    "onceonly": "#d62728",
    "onceonly-save": "#ff9896",
    "onceonly-lazy": "#8c564b",
    "floor-full": "#7f7f7f",
    "floor-delta": "#bcbd22",
    "floor-latest": "#17becf",
    "langgraph": "#1f77b4",
    "langgraph-delta": "#9467bd",
}
W1_COLORS = {
    "onceonly": "#d62728",
    "onceonly-witness": "#ff9896",
    "onceonly-guard": "#e377c2",
    "floor": "#7f7f7f",
    "langgraph": "#1f77b4",
    "dbos": "#2ca02c",
}


# -- formatting ----------------------------------------------------------------------


def ms(x: float) -> str:
    """Milliseconds with three significant digits."""
    if x is None or math.isnan(x):
        return "—"
    if x >= 100:
        return f"{x:,.0f} ms"
    if x >= 10:
        return f"{x:.1f} ms"
    if x >= 1:
        return f"{x:.2f} ms"
    return f"{x:.3f} ms"


def ratio(x: float) -> str:
    """A ratio to the floor."""
    if x is None or math.isnan(x):
        return "—"
    if x >= 10:
        return f"{x:.0f}{TIMES}"
    if x >= 0.1:
        return f"{x:.2f}{TIMES}"
    return f"{x:.3f}{TIMES}"


def mbytes(b: float) -> str:
    """Bytes as MB (10^6)."""
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "—"
    mb = b / MB
    if mb >= 100:
        return f"{mb:,.0f} MB"
    if mb >= 10:
        return f"{mb:.1f} MB"
    return f"{mb:.2f} MB"


def label(name: str) -> str:
    """The table label of a system."""
    return LABELS.get(name, name)


def w1_label(name: str) -> str:
    """The table label of a W1 system."""
    return W1_LABELS.get(name, name)


def mark(t: Target) -> str:
    """Met / missed."""
    return "**met**" if t.met else "**missed**"


def _target_value(t: Target) -> str:
    if t.unit == "MB":
        return f"{t.value:.2f} MB"
    if t.unit == "calls":
        return f"{t.value:.0f}/{t.limit:.0f}"
    return ratio(t.value)


def per_s(x: float) -> str:
    """Effects per second."""
    if x is None or math.isnan(x):
        return "—"
    return f"{x:,.0f}/s"


def _fsync(ms: float | None) -> str:
    if ms is None:
        return "not measured"
    return (
        f"{ms:.3f} ms (a durable commit waits at least this long: W1's cold figures and "
        f"W1-async's gain over sync depend on it)"
    )


def _fsync_note(ms: float | None) -> str:
    return "" if ms is None else f", fsync {ms:.3f} ms"


def _loadavg(xs: Sequence[float] | None) -> str:
    return "/".join(f"{x:.1f}" for x in xs) if xs else "?"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(head) - 1)
    seps = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(seps) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


# -- plots ---------------------------------------------------------------------------


def plot(results: dict[str, Any], img: Path) -> dict[str, str]:
    """Draw the plots that have data; returns {key: file name}."""
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}
    w1 = results.get("w1")
    w2 = results.get("w2")
    w3 = results.get("w3")

    if w1:
        qs = QUANTILES
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, phase in ((axes[0], "cold"), (axes[1], "warm")):
            for name in w1["systems"]:
                curves = [
                    r["call_ms_q"]
                    for r in w1["runs"]
                    if r["system"] == name
                    and r["phase"] == phase
                    and "error" not in r
                    and r.get("call_ms_q")
                ]
                if not curves:
                    continue
                # the median over repetitions of each quantile of the per-call latency
                xs = [median([c[k] for c in curves]) for k in range(len(qs))]
                ax.step(
                    xs,
                    [q / 100 for q in qs],
                    where="post",
                    color=W1_COLORS.get(name),
                    label=w1_label(name).replace("`", ""),
                )
            ax.set_xscale("log")
            ax.set_xlabel("ms per guarded call (log scale)")
            ax.set_title(f"W1 {phase}: per-call latency, {w1['calls']:,} calls")
            ax.grid(visible=True, which="both", alpha=0.3)
        axes[0].set_ylabel("fraction of calls ≤ x (median over repetitions)")
        axes[1].legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(img / PLOTS["w1_latency"], dpi=110)
        plt.close(fig)
        made["w1_latency"] = PLOTS["w1_latency"]

    if w3:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for name, build in w3["builds"].items():
            if "as" in build:
                continue
            pts = sorted((int(n), b) for n, b in build.get("bytes_at", {}).items())
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                xs,
                [y / MB for y in ys],
                "o-",
                color=COLORS.get(name),
                label=label(name).replace("`", ""),
            )
        for skip in results.get("skipped", []):
            est = skip.get("estimated_bytes")
            if est:
                ax.plot(
                    [1000, 10_000],
                    [w3["builds"][skip["system"]]["bytes_at"]["1000"] / MB, est / MB],
                    ":",
                    color=COLORS.get(skip["system"]),
                )
        ax.plot([300], [0.6], "k*", markersize=12, label="W2 target: ≤ 0.6 MB at 300 steps")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("steps in the run's history")
        ax.set_ylabel("database bytes (MB, after wal_checkpoint(TRUNCATE))")
        ax.set_title("Bytes stored versus steps (W2 step shape; dotted: extrapolated)")
        ax.grid(visible=True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(img / PLOTS["bytes"], dpi=110)
        plt.close(fig)
        made["bytes"] = PLOTS["bytes"]

    if w2:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, key, title in (
            (axes[0], "write_ms", "checkpoint write latency per step"),
            (axes[1], "step_ms", "step wall time"),
        ):
            for name in w2["systems"]:
                xs = sorted(
                    x
                    for r in w2["runs"]
                    if r["system"] == name and r["phase"] == "write" and "error" not in r
                    for x in r[key]
                )
                if not xs:
                    continue
                n = len(xs)
                ax.step(
                    xs,
                    [(i + 1) / n for i in range(n)],
                    where="post",
                    color=COLORS.get(name),
                    label=label(name).replace("`", ""),
                )
            ax.set_xscale("log")
            ax.set_xlabel("ms (log scale)")
            ax.set_title(f"W2: {title} (all repetitions)")
            ax.grid(visible=True, which="both", alpha=0.3)
        axes[0].set_ylabel("fraction of steps ≤ x")
        axes[1].legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(img / PLOTS["w2_latency"], dpi=110)
        plt.close(fig)
        made["w2_latency"] = PLOTS["w2_latency"]

    if w3:
        s3 = summary.summarize_w3(w3)
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for name, row in s3.items():
            pts = sorted((n, v) for n, v in row["sizes"].items() if not math.isnan(v["resume_ms"]))
            if not pts:
                continue
            xs = [n for n, _ in pts]
            med = [v["resume_ms"] for _, v in pts]
            lo = [v["resume_ms"] - v["min_ms"] for _, v in pts]
            hi = [v["max_ms"] - v["resume_ms"] for _, v in pts]
            ax.errorbar(
                xs,
                med,
                yerr=[lo, hi],
                fmt="o-",
                capsize=3,
                color=COLORS.get(name),
                label=label(name).replace("`", ""),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("steps in the run's history")
        ax.set_ylabel("fresh process: open + load + reach next step (ms)")
        ax.set_title(
            "W3: resume latency versus history length (median, min-max of per-run medians)"
        )
        ax.grid(visible=True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(img / PLOTS["w3_resume"], dpi=110)
        plt.close(fig)
        made["w3_resume"] = PLOTS["w3_resume"]
    return made


# -- markdown ------------------------------------------------------------------------


def _probe_cell(r: dict[str, Any]) -> str:
    rec = r["probe_recorded"]
    if not rec:
        return "—"
    n = r["probe_calls"]
    ok = all(x == n for x in rec) and all(x == n for x in r["probe_not_reexecuted"])
    cell = ", ".join(f"{x}/{n}" for x in rec)
    if r["probe_not_reexecuted"] != rec:
        cell += " (resume re-used " + ", ".join(map(str, r["probe_not_reexecuted"])) + ")"
    return cell if ok else f"**{cell}**"


def _w1_section(
    results: dict[str, Any], s1: dict[str, dict[str, Any]], plots: dict[str, str]
) -> list[str]:
    w1 = results["w1"]
    calls = w1["calls"]
    reps = results["meta"]["reps"]
    n_probe = len(next(iter(s1.values()))["probe_recorded"]) if s1 else 0
    lines = [
        f"## W1 — guarded effects ({calls:,} sequential calls)",
        "",
        (
            "Each call is a guarded function whose body increments a process-global counter "
            "and returns a 200-byte result derived from the sha256 of its 200-byte JSON "
            "argument. **Cold**: new process, new database, every call executes, intent "
            "durable before the body and outcome durable after (sync durability). **Warm**: "
            "new process, same database, same run resumed: every call must return its "
            "recorded result (counter stays 0, results equal to the originals). "
            f"{reps} repetitions, each phase in a fresh process, systems alternating; figures "
            f"are medians over repetitions of each run's per-call median (or p99); "
            f"**{TIMES}floor** is the ratio to the floor's cold (or warm) run in the same "
            "repetition (median over repetitions)."
        ),
        "",
    ]
    rows = []
    for name in w1["systems"]:
        r = s1[name]
        if not r["cold_reps"]:
            rows.append([w1_label(name), "failed", *["—"] * 7])
            continue
        rows.append(
            [
                w1_label(name),
                ms(r["cold_median_ms"]),
                ratio(r["x_cold_median_ms"]),
                ms(r["cold_p99_ms"]),
                ratio(r["x_cold_p99_ms"]),
                f"{r['cold_total_s']:.2f} s ({ratio(r['x_cold_total_s'])})",
                f"{ms(r['cold_cpu_ms'])} ({ratio(r['x_cold_cpu_ms'])})",
                f"{mbytes(r['cold_bytes'])} ({ratio(r['x_cold_bytes'])})",
                "yes" if r["cold_verified"] else "**NO**",
            ]
        )
    lines += ["### Cold: every call executes", ""]
    lines += _table(
        [
            "system",
            "per-call median",
            f"{TIMES}floor",
            "per-call p99",
            f"{TIMES}floor",
            f"total, {calls:,} calls",
            f"CPU per call ({TIMES}floor)",
            f"database after ({TIMES}floor)",
            "verified",
        ],
        rows,
    )
    rows = []
    for name in w1["systems"]:
        r = s1[name]
        if not r["warm_reps"]:
            rows.append([w1_label(name), "failed", *["—"] * 6])
            continue
        rows.append(
            [
                w1_label(name),
                ms(r["warm_median_ms"]),
                ratio(r["x_warm_median_ms"]),
                ms(r["warm_p99_ms"]),
                ms(r["warm_first_ms"]),
                f"{r['warm_total_s']:.3f} s ({ratio(r['x_warm_total_s'])})",
                _probe_cell(r),
                "yes" if r["warm_verified"] else "**NO**",
            ]
        )
    lines += ["", "### Warm: every call replays; durable-before-return probe", ""]
    lines += _table(
        [
            "system",
            "per-call median",
            f"{TIMES}floor",
            "per-call p99",
            "first call",
            f"total, {calls:,} calls",
            f"probe: outcomes recorded ({n_probe} run(s))",
            "verified (0 executed, results equal)",
        ],
        rows,
    )
    lines += [
        "",
        (
            "*Per-call latency* is the guarded call alone (the argument is built before the "
            "clock starts); *CPU per call* is the phase process's CPU time (all threads) over "
            "the system's whole phase, divided by the calls; *database after* is db + WAL "
            "after `wal_checkpoint(TRUNCATE)` (DBOS: as left, its process still running). "
            "onceonly: `Ledger.perform(EffectIdentity(...), arg, act)` on "
            '`Store.open("sqlite:///…")` (claim transaction before `act`, outcome '
            "transaction before returning; the warm run's first call also prefetches the run's "
            "recorded outcomes in one range scan). Floor: stdlib `sqlite3`, WAL, "
            "`synchronous=FULL`, `INSERT` intent + `COMMIT`, body, `UPDATE` outcome + `COMMIT`; "
            "warm floor: one primary-key `SELECT` + `json.loads`. LangGraph: "
            "`@entrypoint(checkpointer=SqliteSaver)` calling one `@task` per call, "
            '`durability="sync"`, the entrypoint raises after call N (a crash) and the warm '
            "run is `invoke(None, config)`. DBOS: `@DBOS.step` calls in a `@DBOS.workflow` "
            "started with a fixed id, SQLite system database created beforehand in WAL mode; "
            "the cold process ends with `os._exit` after call N (the workflow stays pending) "
            "and the warm process's `DBOS.launch()` recovers it."
        ),
        "",
        (
            f"*Durable-before-return probe*: a child process makes {w1['probe_calls']} guarded "
            "calls and `os._exit(0)`s right after the last one returns; a second process "
            "counts the outcomes the database holds (onceonly: COMMITTED ledger entries; "
            "floor: committed rows; LangGraph: the thread's `__return__` task writes; DBOS: "
            "the workflow's `operation_outputs` rows for the step), then resumes the run and "
            "counts the calls it executes again (shown in parentheses where that differs). "
            "Every figure must be "
            f"{w1['probe_calls']}/{w1['probe_calls']}: a call whose result the caller saw "
            "but whose outcome was not recorded runs twice after a crash. `os._exit` ends the "
            "process without flushing anything; it does not cut power, so the probe tests "
            "whether the outcome was written before the call returned, not the fsync."
        ),
        "",
    ]
    arows = [n for n in w1.get("async_systems", []) if "async_per_s" in s1.get(n, {})]
    if arows:
        lines += [
            f"### W1-async — {w1['concurrency']} concurrent guarded calls",
            "",
            (
                f"{w1['concurrency']} asyncio workers call `Ledger.aperform` until "
                f'{calls:,} calls are done, on a `durability="async"` store (concurrent '
                "ledger transactions share group commits; each call still returns only after "
                f"its outcome is durable). **{TIMES}sync** is the ratio to the same system's sync "
                "(cold) throughput in the same repetition."
            ),
            "",
        ]
        rows = []
        for name in arows:
            r = s1[name]
            rows.append(
                [
                    w1_label(name).replace(" (sync durability)", ""),
                    per_s(r["sync_per_s"]),
                    per_s(r["async_per_s"]),
                    ratio(r["x_async"]),
                    f"{ms(r['async_median_ms'])} / {ms(r['async_p99_ms'])}",
                    "yes" if r["async_verified"] else "**NO**",
                ]
            )
        lines += _table(
            [
                "system",
                "sync effects/s (cold run)",
                f"async effects/s ({w1['concurrency']} concurrent)",
                f"{TIMES}sync",
                "async per-call median / p99",
                "verified",
            ],
            rows,
        )
        lines += [
            "",
            (
                "W1-async is defined for onceonly against its own sync path (`bench/summary.py`); "
                "the floor and the peers have no async row."
            ),
            "",
        ]
    if "w1_latency" in plots:
        lines += [f"![W1 per-call latency, CDF]({IMG}/{plots['w1_latency']})", ""]
    lines += _io_section(w1.get("io") or {}, w1.get("floor", "floor"))
    lines += _profile_section(w1.get("profile") or {}, calls)
    return lines


def _io_section(io: dict[str, Any], floor: str) -> list[str]:
    """Statements, commits, WAL frames and bytes per call, per system (SQLite's trace)."""
    ok = {n: r for n, r in io.items() if isinstance(r, dict) and "frames_per_call" in r}
    if not ok:
        return []
    calls = next(iter(ok.values()))["calls"]
    lines = [
        "### What each cold call makes SQLite do",
        "",
        (
            f"Counted, not timed: one cold run of {calls:,} calls per system with SQLite's "
            "trace on every connection it opens and automatic checkpoints off, so the WAL "
            "files hold every frame written; the same run with no call is subtracted "
            "(set-up and schema). A frame is one page written to the WAL (page + 24-byte "
            "header); each commit fsyncs the frames it appended. "
            "Reproduce with `python -m bench.w1 io --system NAME --db /tmp/x.db --calls "
            f"{calls} --out /tmp/x.json`."
        ),
        "",
    ]
    base = ok.get(floor)
    rows = []
    for name, r in ok.items():
        words = ", ".join(f"{w} {n:.2g}" for w, n in sorted(r["by_word"].items()))
        fx = (
            f" ({r['frames_per_commit'] / base['frames_per_commit']:.1f}{TIMES})"
            if base and base.get("frames_per_commit")
            else ""
        )
        rows.append(
            [
                w1_label(name),
                f"{r['statements_per_call']:.1f}",
                words,
                f"{r['commits_per_call']:.2f}",
                f"{r['frames_per_commit']:.2f}{fx}",
                f"{r['wal_bytes_per_commit'] / 1024:.1f} KiB",
            ]
        )
    lines += _table(
        [
            "system",
            "statements per call",
            "by kind",
            "commits per call",
            "WAL frames per commit",
            "WAL bytes per commit",
        ],
        rows,
        "lrlrrr",
    )
    lines.append("")
    return lines


def _profile_section(prof: dict[str, Any], calls: int) -> list[str]:
    if not prof or "by_tottime" not in prof:
        return []
    total = prof["profiled_total_s"]
    lines = [
        "### Where onceonly's cold time goes (cProfile)",
        "",
        (
            f"One extra cold run of {calls:,} calls under cProfile (not a timing: profiling "
            f"slows Python code, not SQLite), {total:.2f} s for the calls. The functions with "
            "the most time of their own:"
        ),
        "",
    ]
    rows = [
        [
            f"`{r['function']}`",
            f"{r['calls']:,}",
            f"{r['tottime_s']:.3f} s",
            f"{100 * r['tottime_s'] / total:.0f} %",
        ]
        for r in prof["by_tottime"][:10]
    ]
    lines += _table(["function", "calls", "own time", "of the calls' time"], rows, "lrrr")
    ours = [
        r
        for r in prof["by_cumtime"]
        if ("ledger/" in r["function"] or "checkpoint/" in r["function"])
        and "w1_" not in r["function"]
    ][:12]
    if ours:
        lines += ["", "And inclusive time of onceonly's own functions:", ""]
        rows = [
            [
                f"`{r['function']}`",
                f"{r['calls']:,}",
                f"{r['cumtime_s']:.3f} s",
                f"{100 * r['cumtime_s'] / total:.0f} %",
            ]
            for r in ours
        ]
        lines += _table(["function", "calls", "inclusive time", "of the calls' time"], rows, "lrrr")
    lines.append("")
    return lines


def _w2_section(
    results: dict[str, Any], s2: dict[str, dict[str, Any]], plots: dict[str, str]
) -> list[str]:
    w2 = results["w2"]
    steps = w2["steps"]
    reps = results["meta"]["reps"]
    samples = results["meta"].get("samples", 1)
    lines = [
        f"## W2 — incremental checkpoints ({steps} steps)",
        "",
        (
            f"One checkpoint per step, sync durability; {reps} repetitions, each phase in a "
            "fresh process, systems alternating. Figures are medians over repetitions of each "
            f"run's median (or p99) — for loads, of the median of {samples} fresh-process "
            f"load(s) per repetition; **{TIMES}floor** is the ratio to the full-pickle floor "
            "measured in the same repetition (median over repetitions)."
        ),
        "",
        "### Writes",
        "",
    ]
    rows = []
    for name in w2["systems"]:
        r = s2[name]
        if not r["reps"]:
            rows.append([label(name), *["failed"] + ["—"] * 6])
            continue
        rows.append(
            [
                label(name),
                ms(r["write_median_ms"]),
                ratio(r["x_write_median_ms"]),
                ms(r["write_p99_ms"]),
                ratio(r["x_write_p99_ms"]),
                ms(r["step_median_ms"]),
                ms(r["step_p99_ms"]),
                f"{r['total_s']:.3f} s ({ratio(r['x_total_s'])})",
            ]
        )
    lines += _table(
        [
            "system",
            "write median",
            f"{TIMES}floor",
            "write p99",
            f"{TIMES}floor",
            "step wall median",
            "step wall p99",
            f"total, {steps} steps",
        ],
        rows,
    )
    lines += [
        "",
        (
            "*Write* is the checkpoint call alone: onceonly `update()`/`save()`; for the floors, "
            "pickling + `INSERT` + `COMMIT`; for LangGraph, the `SqliteSaver.put` + `put_writes` "
            "calls made during the step (LangGraph has no separate checkpoint call, so its "
            "comparable figure is the *step wall time*: node entry to next node entry, including "
            "the saver and the graph's own work). *Step wall* includes computing the step's "
            "change."
        ),
        "",
        "### Storage and fresh-process load",
        "",
    ]
    rows = []
    for name in w2["systems"]:
        r = s2[name]
        rows.append(
            [
                label(name),
                mbytes(r["bytes"]),
                ratio(r["x_bytes"]),
                ms(r["load_ms"]),
                ratio(r["x_load_ms"]),
                f"{ms(r['open_ms'])} + {ms(r['load_only_ms'])}",
                f"{ms(r['cpu_ms'])} ({ratio(r['x_cpu_ms'])})",
                "yes" if r["verified"] else "**NO**",
            ]
        )
    lines += _table(
        [
            "system",
            f"database after {steps} steps",
            f"{TIMES}floor",
            "open + load latest, fresh process",
            f"{TIMES}floor",
            "of which open + load",
            f"process CPU time ({TIMES}floor)",
            "state verified",
        ],
        rows,
    )
    lines += [
        "",
        (
            "Bytes: database file + WAL after `PRAGMA wal_checkpoint(TRUNCATE)` (MB = 10⁶ bytes). "
            "The load is timed from before opening the database to holding the latest state "
            "(LangGraph: `SqliteSaver` + `compile()` + `get_state()`); the state is then compared "
            "with the expected one, outside the timing."
        ),
        "",
    ]
    if "w2_latency" in plots:
        lines += [
            f"![W2 write latency and step wall time, CDF]({IMG}/{plots['w2_latency']})",
            "",
        ]
    return lines


def _w3_section(
    results: dict[str, Any], s3: dict[str, dict[str, Any]], plots: dict[str, str]
) -> list[str]:
    w3 = results["w3"]
    sizes = sorted({n for s in w3["sizes"].values() for n in s})
    lines = [
        "## W3 — resume cost versus history length",
        "",
        "Runs of " + ", ".join(f"{n:,}" for n in sizes) + " W2-shaped steps. In a fresh "
        "process: open the database, load the latest checkpoint and reach the start of the "
        "next step (onceonly: `Store.open` + `get_run` + `load`, and where the store offers "
        "it `load(lazy=True)`, which reads list chunks on first access; floors: connect + read + "
        "unpickle/replay; LangGraph: `SqliteSaver` + `compile()` + `invoke(None)` of a "
        "thread left by a crash, timed to the entry of the next node). The live state grows "
        "with the history (one 500-char message per step: ≈ 0.16 MB at 100 steps, ≈ 5.1 MB "
        "at 10 000), so some growth is inherent; the *latest-only* floor shows how much. "
        f"**{TIMES}floor** is the ratio to that floor at the same size, in the same repetition.",
        "",
    ]
    head = ["system", *[f"{n:,} steps" for n in sizes], "ratio largest / 100"]
    rows = []
    for name in w3["sizes"]:
        r = s3[name]
        cells = [label(name)]
        for n in sizes:
            v = r["sizes"].get(n)
            if v is None:
                cells.append("skipped")
            elif math.isnan(v["resume_ms"]):
                cells.append("failed")
            else:
                ok = "" if v["verified"] else " **unverified**"
                cells.append(f"{ms(v['resume_ms'])} ({ratio(v['x_floor'])}){ok}")
        hi = r["ratio_hi"]
        cells.append(
            f"{ratio(r['ratio'])} ({hi:,}/{r['ratio_lo']:,})" if not math.isnan(r["ratio"]) else "—"
        )
        rows.append(cells)
    lines += _table(head, rows)
    lines += [
        "",
        (
            "The same resumes in process CPU time (`time.process_time()` over the same region): "
            "less sensitive to other work on a shared machine, blind to waiting for I/O."
        ),
        "",
    ]
    rows = []
    for name in w3["sizes"]:
        r = s3[name]
        cells = [label(name)]
        for n in sizes:
            v = r["sizes"].get(n)
            if v is None:
                cells.append("skipped")
            else:
                cells.append(f"{ms(v['cpu_ms'])} ({ratio(v['x_floor_cpu'])})")
        rows.append(cells)
    lines += _table(head[:-1], rows)
    lines += ["", "Database bytes after each history (from the build):", ""]
    rows = []
    for name in w3["sizes"]:
        r = s3[name]
        cells = [label(name)]
        for n in sizes:
            v = r["sizes"].get(n)
            cells.append(mbytes(v["bytes"]) if v else "skipped")
        build = r["build"]
        if "as" in build:
            cells.append(f"(the {build['as']} histories)")
        else:
            cells.append(f"{build['build_s']:.1f} s" if "build_s" in build else "failed")
        rows.append(cells)
    lines += _table(["system", *[f"{n:,} steps" for n in sizes], "build time"], rows)
    lines += [""]
    if "w3_resume" in plots:
        lines += [f"![W3 resume latency versus history length]({IMG}/{plots['w3_resume']})", ""]
    return lines


def _targets_section(ts: Sequence[Target]) -> list[str]:
    rows = [
        [
            t.workload,
            t.text,
            w1_label(t.system) if t.workload == "W1" else label(t.system),
            _target_value(t),
            _spread(t),
            mark(t),
        ]
        for t in ts
    ]
    return [
        "## Targets (defined in `bench/summary.py`, `bench/w4.py` and `bench/w2lg.py`)",
        "",
        *_table(
            ["workload", "target", "system", "measured", "range over repetitions", "status"],
            rows,
            "lllrrl",
        ),
        "",
        (
            "A ratio is the median over repetitions of the ratio measured within one repetition; "
            "the range shows how far single repetitions strayed (a status near its limit can flip "
            "from one invocation to the next)."
        ),
        "",
    ]


def _spread(t: Target) -> str:
    lo, hi = t.spread
    if math.isnan(lo):
        return "—"
    if t.unit == "calls":
        return f"{lo:.0f} to {hi:.0f}"
    return f"{ratio(lo)} to {ratio(hi)}"


def _w1_observations(results: dict[str, Any], s1: dict[str, Any] | None) -> list[str]:
    if not s1:
        return []
    obs: list[str] = []
    w1 = results["w1"]
    o = s1.get("onceonly")
    prof = w1.get("profile") or {}
    if o and prof.get("by_tottime"):
        execs = [r for r in prof["by_tottime"] if "sqlite3.Cursor" in r["function"]]
        if execs:
            total = prof["profiled_total_s"]
            per_call = execs[0]["calls"] / w1["calls"]
            share = 100 * execs[0]["tottime_s"] / total
            commits = [
                r
                for r in prof.get("by_cumtime", [])
                if "checkpoint/store.py" in r["function"] and "(__exit__)" in r["function"]
            ]
            commit = (
                f", {100 * commits[0]['cumtime_s'] / total:.0f} % in the two COMMITs alone "
                "(the store's transaction exit, fsync included)"
                if commits
                else ""
            )
            obs.append(
                f"W1 cold, onceonly under cProfile: {share:.0f} % of the calls' time is in "
                f"`sqlite3.Cursor.execute`{commit}; {per_call:.1f} statements per call "
                "against the floor's 6 (`BEGIN`, `INSERT`, `COMMIT`, `BEGIN`, `UPDATE`, "
                "`COMMIT`); the rest is Python around them (the audit hash chain's JSON "
                "encoding and hashing in `_append`, key and fingerprint derivation, sealing, "
                "the store's transaction plumbing)."
            )
    io = {n: r for n, r in (w1.get("io") or {}).items() if isinstance(r, dict) and "by_word" in r}
    mine, fl = io.get("onceonly"), io.get(w1.get("floor", "floor"))
    if mine and fl:
        once = [w1_label(n) for n, r in io.items() if r["commits_per_call"] < 1.5]
        obs.append(
            f"W1 cold I/O: onceonly appends {mine['frames_per_commit']:.1f} WAL frames "
            f"({mine['wal_bytes_per_commit'] / 1024:.0f} KiB) per commit against the "
            f"floor's {fl['frames_per_commit']:.1f} ({fl['wal_bytes_per_commit'] / 1024:.0f} "
            "KiB): each claim writes the entry, its run index, an audit event, the event's "
            "key index and the chain head (five B-tree pages before any split), each outcome "
            "all but the run index; the fsync of a commit grows with the pages it appended."
            + (
                " "
                + ", ".join(once)
                + " commit once per call: the call's result only, after the body ran (no "
                "intent is durable before it acts)."
                if once
                else ""
            )
        )
    if o and o.get("warm_reps"):
        obs.append(
            f"W1 warm, onceonly: the first call ({ms(o['warm_first_ms'])}) prefetches the "
            "run's recorded outcomes in one range scan and loads the subject's data key; "
            f"every later call (median {ms(o['warm_median_ms'])}) is a dictionary lookup, "
            "the key and fingerprint derivations and opening the sealed result."
        )
    g = s1.get("onceonly-guard")
    if o and g and g.get("warm_reps") and o.get("warm_reps"):
        obs.append(
            f"W1 warm, onceonly `guard` in a `step`: median {ms(g['warm_median_ms'])} against "
            f"`perform`'s {ms(o['warm_median_ms'])} (first call {ms(g['warm_first_ms'])}, the "
            "same prefetch). On top of `perform` the guard binds the call's arguments, takes "
            "the identity from the step, derives the key once (the ledger remembers it for "
            "the claim and the span), checks the step's recorded prefix and drives the "
            "attempt loop of its core; with no tracer provider set it makes no span. "
            f"Cold: {ms(g['cold_median_ms'])} against `perform`'s {ms(o['cold_median_ms'])}."
        )
    if o and o.get("cold_reps"):
        obs.append(
            f"W1 cold: onceonly's CPU time per call is {ms(o['cold_cpu_ms'])} against the "
            f"floor's {ms(s1.get('floor', {}).get('cold_cpu_ms', math.nan))}; the rest of "
            "each system's wall time is waiting, mostly for the fsyncs of its commits, whose "
            "latency on this shared disk moves every cold figure from one repetition to the "
            "next (the per-repetition ratios are in the targets table)."
        )
    if o and not math.isnan(o.get("x_cold_bytes", math.nan)):
        obs.append(
            f"W1 cold: onceonly's database after {w1['calls']:,} calls is "
            f"{ratio(o['x_cold_bytes'])} the floor's ({mbytes(o['cold_bytes'])}): each entry "
            "holds the sealed argument and result, key, fingerprint, provider key and lease "
            "columns, and every call appends two hash-chained audit events (claimed, "
            "committed); each commit has that many more WAL pages to write and fsync."
        )
    if o and "async_cpu_ms" in o and not math.isnan(o["async_cpu_ms"]):
        busy = o["async_per_s"] * o["async_cpu_ms"] / 1e3
        ceiling = 1e3 / o["async_cpu_ms"]
        obs.append(
            f"W1-async, onceonly: {ms(o['async_cpu_ms'])} of CPU time per call (all "
            f"threads), so {per_s(o['async_per_s'])} keeps {busy:.2f} CPU-seconds per second "
            "busy"
            + (
                ": the Python work per call (under one GIL), not the commits, bounds the "
                "async throughput; group commit removes the fsync waits, not that work. At "
                f"that CPU cost one interpreter tops out near {per_s(ceiling)}, "
                f"{ratio(ceiling / o['sync_per_s'])} this run's sync throughput: 5{TIMES} "
                "needs less CPU per call, not more concurrency."
                if busy >= 0.8
                else "."
            )
        )
    lg = s1.get("langgraph")
    if lg and lg["probe_recorded"] and min(lg["probe_recorded"]) < lg["probe_calls"]:
        obs.append(
            "W1 cold, LangGraph: the entrypoint does not wait for a task's write to commit "
            "(next point), so its per-call latency leaves out the durable recording that the "
            "floor, onceonly and DBOS pay before a call returns."
        )
        obs.append(
            "W1 probe, LangGraph: a task's result is written by `checkpointer.put_writes` "
            "submitted to a background executor (`PregelLoop.put_writes` → `self.submit`), "
            'in `durability="sync"` as in `"async"` (`sync` governs the checkpoint at the '
            "end of a step), and the entrypoint gets the task's result without waiting for "
            "that write: a process that ends right after a call returns can lose that call's "
            "record, and the resumed run executes it again."
        )
    db = s1.get("dbos")
    if db and db.get("warm_extra", {}).get("launch_to_result_ms"):
        obs.append(
            f"W1 warm, DBOS: the recovered workflow's calls took {db['warm_total_s']:.2f} s "
            "(median over repetitions); from `DBOS.launch()` to the workflow's result, "
            f"{db['warm_extra']['launch_to_result_ms'] / 1e3:.2f} s in the first repetition "
            "(recovery runs on a background thread after launch)."
        )
    return obs


def _observations(
    results: dict[str, Any], s2: dict[str, Any] | None, s3: dict[str, Any] | None
) -> list[str]:
    obs: list[str] = []
    if s2 and "onceonly" in s2:
        o, f = s2["onceonly"], s2.get(results["w2"]["floor"], {})
        obs.append(
            f"onceonly's fresh-process load splits into open {ms(o['open_ms'])} + load "
            f"{ms(o['load_only_ms'])}; the floor's into open {ms(f.get('open_ms', math.nan))} + "
            f"load {ms(f.get('load_only_ms', math.nan))}."
        )
        kf = o.get("extra", {}).get("keyframe_seqs")
        if kf is not None:
            obs.append(
                f"onceonly wrote {o['extra'].get('checkpoints')} checkpoints in W2, keyframes at "
                f"seq {', '.join(map(str, kf))} (default `KeyframePolicy`)."
            )
    if s3 and "onceonly" in s3:
        parts = []
        for n, v in sorted(s3["onceonly"]["sizes"].items()):
            parts.append(f"{n:,}: open {ms(v['open_ms'])} + get_run/load {ms(v['load_ms'])}")
        obs.append("onceonly resume breakdown — " + "; ".join(parts) + ".")
    if s3 and "floor-latest" in s3:
        fl = s3["floor-latest"]
        if not math.isnan(fl["ratio"]):
            obs.append(
                f"The latest-only floor, which reads nothing but the live state, itself grows "
                f"{ratio(fl['ratio'])} from {fl['ratio_lo']:,} to {fl['ratio_hi']:,} steps: the "
                "state grows ≈ 33-fold over that range. A resume ratio ≤ 1.2 is reachable only "
                "while fixed costs dominate or if the resume does not materialise the whole "
                "message list."
            )
    for name in ("onceonly", "onceonly-lazy"):
        types = {
            r.get("extra", {}).get("messages_type")
            for r in results.get("w3", {}).get("runs", [])
            if r.get("system") == name and "error" not in r
        } - {None}
        if types:
            obs.append(
                f"{label(name)}: `messages` came back as "
                + ", ".join(f"`{t}`" for t in sorted(types))
                + " (compared element by element with the expected list after the timing, "
                "before the store was closed)."
            )
    for name in ("langgraph", "langgraph-delta"):
        extra = (s2 or {}).get(name, {}).get("extra", {})
        if extra:
            obs.append(
                f"{label(name)}: journal_mode={extra.get('journal_mode')}, "
                f"synchronous={extra.get('synchronous')} (2 = FULL, SQLite's default, read back "
                f"from the saver's connection); saver calls per step "
                f"{extra.get('saver_calls_per_step')}."
            )
            break
    return obs


def render(results: dict[str, Any], docs: Path) -> Path:
    """Write ``docs/performance.md`` and ``docs/img/*.png``; returns the markdown path."""
    docs.mkdir(parents=True, exist_ok=True)
    plots = plot(results, docs / IMG)
    meta = results["meta"]
    s2 = summary.summarize_w2(results["w2"]) if "w2" in results else None
    s3 = summary.summarize_w3(results["w3"]) if "w3" in results else None
    s1 = summary.summarize_w1(results["w1"]) if "w1" in results else None
    ts = summary.targets(s2, s3, s1)
    if "w4" in results:
        ts += w4.targets(w4.summarize(results["w4"]), results["w4"])
    ts += w2lg.targets(results)
    pk = meta["packages"]
    lines = [
        "# Performance",
        "",
        (
            "<!-- Generated by `python -m bench` (bench/report.py) from bench/results/latest.json; "
            "edits here are overwritten. -->"
        ),
        "",
        (
            f"Measured {meta['started_utc'][:10]} ({meta['started_utc']}) with "
            f"{meta['reps']} repetitions{' in `--quick` mode' if meta.get('quick') else ''}, "
            f"{meta['duration_s'] / 60:.1f} min in all. Reproduce with **`{COMMAND_TEXT}`** "
            "(installs the `bench` extra into `.venv`, then runs `python -m bench`; "
            "`python -m bench --quick` for a shorter check, `--only w1` for one workload). "
            "Workloads, floors and peers are defined in `bench/workload.py` and the phase "
            "modules `bench/w1.py` to `bench/w4.py`, targets in `bench/summary.py`; absolute "
            "times on these shared 2-core machines drift by ±15 %, ratios hold."
        ),
        "",
    ]
    for name, when in sorted(meta.get("earlier", {}).items()):
        lines += [
            (
                f"> {name.upper()} was not measured in this run: its figures are from the run "
                f"of {str(when.get('started_utc'))[:10]} (git {when.get('git_head')}, "
                f"{when.get('reps')} repetitions, load average at start "
                f"{_loadavg(when.get('loadavg_start'))}{_fsync_note(when.get('fsync_ms'))}), "
                "kept by `python -m bench --merge`."
            ),
            "",
        ]
    if meta.get("working_tree_sha256_after"):
        lines += [
            (
                "> `checkpoint/` changed in the working tree while this run was in progress; "
                "every phase ran from the copy taken at the start (checkpoint/ sha256 "
                f"{meta['checkpoint_src_sha256']})."
            ),
            "",
        ]
    if meta.get("ledger_working_tree_sha256_after"):
        lines += [
            (
                "> `ledger/` changed in the working tree while this run was in progress; "
                "every phase ran from the copy taken at the start (ledger/ sha256 "
                f"{meta['ledger_src_sha256']})."
            ),
            "",
        ]
    lines += _targets_section(ts)
    lines += [
        "## Machine",
        "",
        *_table(
            ["", ""],
            [
                ["CPUs (nproc)", f"{meta['nproc']} ({meta.get('cpu') or 'unknown CPU'})"],
                ["OS", meta["platform"]],
                ["Python", meta["python"]],
                ["SQLite", meta["sqlite"]],
                [
                    "fsync (4 KiB write + fdatasync in /tmp, median)",
                    _fsync(meta.get("fsync_ms")),
                ],
                [
                    "load average (1/5/15 min)",
                    (
                        f"start {_loadavg(meta.get('loadavg_start'))}, "
                        f"end {_loadavg(meta.get('loadavg_end'))} (the machine is shared)"
                    ),
                ],
                [
                    "onceonly",
                    (
                        f"{pk.get('onceonly')} (git {meta['git_head']}, checkpoint/ "
                        f"sha256 {meta['checkpoint_src_sha256']}"
                        + (
                            f", ledger/ sha256 {meta['ledger_src_sha256']}"
                            if meta.get("ledger_src_sha256")
                            else ""
                        )
                        + ")"
                    ),
                ],
                ["SQLAlchemy", pk.get("SQLAlchemy", "")],
                [
                    "LangGraph",
                    (
                        f"langgraph {pk.get('langgraph')}, langgraph-checkpoint "
                        f"{pk.get('langgraph-checkpoint')}, langgraph-checkpoint-sqlite "
                        f"{pk.get('langgraph-checkpoint-sqlite')}"
                    ),
                ],
                ["DBOS", f"dbos {pk.get('dbos', 'not recorded')}"],
            ],
            "ll",
        ),
        "",
    ]
    if s1 is not None:
        lines += _w1_section(results, s1, plots)
    if s2 is not None:
        lines += _w2_section(results, s2, plots)
    if s3 is not None:
        lines += _w3_section(results, s3, plots)
    if "w4" in results:
        lines += w4.section(results)
    if "w2lg" in results:
        lines += w2lg.section(results)
    if "bytes" in plots:
        lines += [
            "## Bytes stored versus steps",
            "",
            f"![Bytes stored versus steps, per system]({IMG}/{plots['bytes']})",
            "",
            (
                "Measured while building the W3 histories (after `wal_checkpoint(TRUNCATE)` at "
                "each point); dotted segments are the extrapolations behind the skipped runs."
            ),
            "",
        ]
    skipped = results.get("skipped", [])
    errors = [
        (wl, n, e)
        for wl, s in (("W1", s1 or {}), ("W2", s2 or {}), ("W3", s3 or {}))
        for n, r in s.items()
        for e in r["errors"]
    ]
    if skipped or errors:
        lines += ["## Skipped or failed", ""]
        for sk in skipped:
            if sk["workload"] == "W1":
                lines.append(f"- W1 {w1_label(sk['system'])}: skipped — {sk['reason']}.")
                continue
            size = f"{sk['size']:,} steps" if sk["size"] else "all sizes"
            lines.append(
                f"- {sk['workload']} {label(sk['system'])}, {size}: skipped — {sk['reason']}."
            )
        for wl, name, err in errors:
            first = err.splitlines()[0]
            shown = w1_label(name) if wl == "W1" else label(name)
            lines.append(f"- {wl} {shown}: failed — `{first}`")
        lines.append("")
    startup_json = Path(__file__).resolve().parent / "results" / "startup.json"
    if startup_json.exists():  # written by `python -m bench startup --json ...`
        lines += startup.section(json.loads(startup_json.read_text(encoding="utf-8")))
    agent_json = Path(__file__).resolve().parent / "results" / "agent.json"
    if agent_json.exists():  # written by `python -m bench agent --json ...`
        from . import agent

        lines += agent.section(json.loads(agent_json.read_text(encoding="utf-8")))
    engines_json = Path(__file__).resolve().parent / "results" / "engines.json"
    if engines_json.exists():  # written by `python -m bench engines --json ...`
        from . import engines  # imports temporalio: only when there are figures

        lines += engines.section(json.loads(engines_json.read_text(encoding="utf-8")))
    obs = _w1_observations(results, s1) + _observations(results, s2, s3)
    lines += [
        "## Method",
        "",
        (
            "- Each phase (a W1 cold, warm, async or probe run, a W2 write, a W2 load, a W3 "
            "build, a W3 resume) runs in a fresh process (`python -m bench.w1 …`, "
            "`python -m bench.w2 …`, `python -m bench.w3 …`) from a copy of `checkpoint/`, "
            "`ledger/` and `bench/` taken at the start; within a repetition the systems "
            "alternate in a fixed order: in W1 the cold runs of all systems, then their warm "
            "runs on the same databases, the async run, then the probes; in W2 the writes of "
            "all systems, then "
            f"{meta.get('samples', 1)} round(s) of their loads; in W3, for each size, "
            f"{meta.get('samples', 1)} round(s) of resumes. A repetition's figure for a load "
            "or resume is the median of its rounds."
        ),
        (
            "- Before its timed region every phase collects and freezes the heap its imports left "
            "(`gc.collect(); gc.freeze()`), for every system alike, so that a full collection of "
            "import-time objects does not land in one system's window by accident of allocation "
            "counts; collections of what the timed code allocates still count."
        ),
        (
            "- p99 is nearest-rank over the run's calls (W1) or steps (W2); the published p99 "
            "is the median over repetitions of each run's p99."
        ),
        (
            "- W1: every system runs the identical calls (`bench/workload.py`: `make_arg(i)`, "
            "`make_result(arg)`, the counter); results are compared with the expected ones "
            "after the timing, and the counter is checked (N after a cold run, 0 after a warm "
            "one). onceonly uses `Ledger(store, Keyring([Secret('k1', 32 bytes)]))`, one "
            "identity per call (`EffectIdentity(tenant, run, step, 0, 'send_email@1', "
            "ordinal=i)`), with its defaults otherwise. DBOS's and LangGraph's SQLite "
            "connections are read back: WAL and `synchronous=2` (FULL) for both."
        ),
        (
            "- Floors use stdlib `sqlite3` in WAL mode with `synchronous=FULL` (read back), one "
            "`BEGIN IMMEDIATE … COMMIT` per checkpoint, `pickle` protocol "
            f"{pickle.HIGHEST_PROTOCOL}."
        ),
        (
            "- onceonly runs with its defaults (`Durability.SYNC`, default `KeyframePolicy`); "
            'LangGraph with `durability="sync"` and `SqliteSaver` on a plain '
            "`sqlite3.connect()` (its `setup()` turns on WAL; `synchronous` stays SQLite's "
            "default FULL). DeltaChannel (beta in LangGraph 1.2) is used with its default "
            "`snapshot_frequency=100` and the same reducers in batched form."
        ),
        (
            "- W3 histories are written once per invocation by each system's fastest path that "
            "stores the same rows (onceonly: `Durability.EXIT` flushed every 1 000 steps; floors: "
            'batched transactions with `synchronous=NORMAL`; LangGraph: `durability="async"`; '
            "the latest-only floor writes the state once per size, since that table never holds "
            "anything else) and copied at each size after a TRUNCATE checkpoint. LangGraph's "
            "thread is left by an exception raised at the entry of the next step (a simulated "
            "crash) and resumed with `invoke(None, config)`. Every resume works on a pristine "
            "copy."
        ),
        (
            "- Every loaded or resumed state is compared with the expected state after the "
            "timing; a mismatch is flagged in the tables."
        ),
        "",
    ]
    if obs:
        lines += ["## Observations", "", *[f"- {o}" for o in obs], ""]
    lines += [
        (
            "Raw per-phase results, including every W2 per-step latency and W1 per-call "
            "latency quantiles: "
            "[`bench/results/latest.json`](../bench/results/latest.json)."
        ),
        "",
    ]
    path = docs / "performance.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


COMMAND_TEXT = "make bench"


def console_summary(results: dict[str, Any]) -> Table:
    """The headline figures as a rich table."""
    t = Table(title="onceonly bench: headline figures")
    t.add_column("workload")
    t.add_column("system")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column(f"{TIMES}floor", justify="right")
    if "w2" in results:
        s2 = summary.summarize_w2(results["w2"])
        for name, r in s2.items():
            t.add_row(
                "W2", name, "write median", ms(r["write_median_ms"]), ratio(r["x_write_median_ms"])
            )
            t.add_row("W2", name, "bytes", mbytes(r["bytes"]), ratio(r["x_bytes"]))
            t.add_row("W2", name, "fresh load", ms(r["load_ms"]), ratio(r["x_load_ms"]))
    if "w3" in results:
        s3 = summary.summarize_w3(results["w3"])
        for name, r in s3.items():
            for n, v in sorted(r["sizes"].items()):
                t.add_row("W3", name, f"resume @ {n:,}", ms(v["resume_ms"]), ratio(v["x_floor"]))
            t.add_row(
                "W3", name, f"ratio {r['ratio_hi']:,}/{r['ratio_lo']:,}", ratio(r["ratio"]), ""
            )
    s1 = summary.summarize_w1(results["w1"]) if "w1" in results else None
    if s1:
        for name, r in s1.items():
            t.add_row(
                "W1", name, "cold median", ms(r["cold_median_ms"]), ratio(r["x_cold_median_ms"])
            )
            t.add_row(
                "W1", name, "warm median", ms(r["warm_median_ms"]), ratio(r["x_warm_median_ms"])
            )
            if r["probe_recorded"]:
                t.add_row("W1", name, "probe recorded", _probe_cell(r).replace("*", ""), "")
            if "x_async" in r:
                t.add_row("W1", name, "async effects/s", per_s(r["async_per_s"]), "")
    if "w4" in results:
        for n, r in w4.summarize(results["w4"]).items():
            t.add_row("W4", f"{n} worker(s)", "effects/s", per_s(r["effects_per_s"]), "")
    if "w2lg" in results:
        for name, figure, value, x in w2lg.console_rows(results):
            t.add_row("W2-LG", name, figure, value, x + TIMES)
    w4_targets = w4.targets(w4.summarize(results["w4"]), results["w4"]) if "w4" in results else []
    w4_targets += w2lg.targets(results)
    for tg in (
        summary.targets(
            summary.summarize_w2(results["w2"]) if "w2" in results else None,
            summary.summarize_w3(results["w3"]) if "w3" in results else None,
            s1,
        )
        + w4_targets
    ):
        t.add_row(tg.workload, tg.system, tg.text, _target_value(tg), "met" if tg.met else "MISSED")
    return t
