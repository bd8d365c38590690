"""W2 through LangGraph — the W2 graph (a ``StateGraph``, one node looping S = 300 times
through a conditional edge, ``durability="sync"``) with onceonly's checkpointer
(``adapters.langgraph_saver.OnceOnlySaver``, SQLite) against LangGraph's ``SqliteSaver``,
each with plain reducer channels and with ``DeltaChannel``.

``python -m bench.w2lg write --system NAME --db PATH --steps S --out R.json``
    new database; S steps; per step, the checkpointer's time (its ``put`` and
    ``put_writes`` calls during the step) and the step's wall time; database bytes after
    ``wal_checkpoint(TRUNCATE)``. The graph is then stopped at the entry of step S + 1,
    as a crash would leave it.
``python -m bench.w2lg load --system NAME --db PATH --steps S --out R.json``
    fresh process: open the checkpointer and ``graph.get_state`` (verified equal to the
    expected state after S steps).
``python -m bench.w2lg resume --system NAME --db PATH --steps S --out R.json``
    fresh process: open and ``graph.invoke(None, config)`` until the node is entered
    again (with the verified state after S steps).
``python -m bench.w2lg history --system NAME --db PATH --steps S --out R.json``
    fresh process: open and list the thread's whole history
    (``graph.get_state_history(config)``, every checkpoint's state built); the newest
    state verified, the count checked.

The orchestrator (``python -m bench``, :func:`run`) alternates the systems within each
repetition, each phase in a fresh process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import shutil
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _util, workload

if TYPE_CHECKING:
    from rich.progress import Progress

    from .runner import Runner

STEPS = 300
SYSTEMS = ["sqlite", "sqlite-delta", "onceonly", "onceonly-delta"]
REFERENCE = "sqlite"
PHASES = ["write", "load", "resume", "history"]
LABELS = {
    "sqlite": "SqliteSaver, plain channels",
    "sqlite-delta": "SqliteSaver, DeltaChannel",
    "onceonly": "OnceOnlySaver, plain channels",
    "onceonly-delta": "OnceOnlySaver, DeltaChannel",
}
ROOT = Path(__file__).resolve().parent.parent


# -- one phase (a fresh process) -------------------------------------------------------
def _system(name: str) -> Any:
    from .systems.langgraph import LangGraph

    if name.startswith("onceonly"):
        # Imported here, as SqliteSaver is by systems.langgraph: outside the timed open.
        import onceonly.adapters.langgraph_saver  # noqa: F401

    class Graph(LangGraph):
        """The W2 LangGraph peer's graph and node, with either checkpointer."""

        def open_saver(self, db: Path, *, timed: bool) -> tuple[Any, Any]:
            """The checkpointer on ``db`` and a function closing it."""
            if name.startswith("onceonly"):
                from onceonly.adapters.langgraph_saver import OnceOnlySaver

                class TimedSaver(OnceOnlySaver):
                    calls: list[tuple[float, float]]

                    def put(self, *args: Any, **kwargs: Any) -> Any:
                        t0 = time.perf_counter()
                        try:
                            return super().put(*args, **kwargs)
                        finally:
                            self.calls.append((t0, time.perf_counter() - t0))

                    def put_writes(self, *args: Any, **kwargs: Any) -> None:
                        t0 = time.perf_counter()
                        try:
                            super().put_writes(*args, **kwargs)
                        finally:
                            self.calls.append((t0, time.perf_counter() - t0))

                from onceonly.ledger import Keyring, Secret

                # Sealed, as a saver with a keyring (ONCEONLY_SECRETS) is.
                keys = Keyring([Secret("k1", bytes(range(32)))])
                saver = (TimedSaver if timed else OnceOnlySaver).from_url(
                    f"sqlite:///{db}", keyring=keys
                )
                saver.calls = []
                return saver, saver.close
            from langgraph.checkpoint.sqlite import SqliteSaver

            from .systems.langgraph import TimedSqliteSaver

            conn = sqlite3.connect(db, check_same_thread=False)
            return (TimedSqliteSaver(conn) if timed else SqliteSaver(conn)), conn.close

    return Graph(delta=name.endswith("-delta"))


def write_phase(name: str, db: Path, steps: int) -> dict[str, Any]:
    """S steps into the new database ``db``, then stop at the entry of step S + 1."""
    from .systems.langgraph import Crash

    system = _system(name)
    _util.quiesce_gc()
    saver, close = system.open_saver(db, timed=True)
    try:
        graph = system._graph(saver)
        system.limit = steps + 10**6
        system.crash_at = steps
        t_end = math.nan
        try:
            graph.invoke(workload.initial_state(), system._config(steps), durability="sync")
        except Crash:
            t_end = time.perf_counter()
    finally:
        close()
    if len(system.entries) != steps or math.isnan(t_end):
        raise RuntimeError(f"graph ran {len(system.entries)} steps instead of {steps}")
    size = _util.checkpoint_and_size(db)
    bounds = [*system.entries, t_end]
    step_s = [b - a for a, b in itertools.pairwise(bounds)]
    write_s = [0.0] * steps
    i = 0
    for start, dur in sorted(saver.calls):
        if start < bounds[0]:
            continue  # the input checkpoint, before step 1
        while i + 1 < steps and start >= bounds[i + 1]:
            i += 1
        write_s[i] += dur
    return {
        "system": name,
        "phase": "write",
        "steps": steps,
        "write": _util.latency_summary(write_s),
        "step": _util.latency_summary(step_s),
        "total_s": t_end - bounds[0],
        "bytes": size,
    }


def load_phase(name: str, db: Path, steps: int, *, resume: bool) -> dict[str, Any]:
    """Fresh process: open and read the latest state (``get_state``), or resume the
    graph until its node is entered (``invoke(None)``); verify the state."""
    from .systems.langgraph import _Stop

    clock = time.perf_counter
    ti = clock()
    system = _system(name)
    import_ms = (clock() - ti) * 1e3
    _util.quiesce_gc()
    t0 = clock()
    saver, close = system.open_saver(db, timed=False)
    try:
        graph = system._graph(saver)
        t1 = clock()
        if resume:
            system.limit = steps + 10**6
            system.stop_on_entry = True
            with contextlib.suppress(_Stop):
                graph.invoke(None, system._config(steps), durability="sync")
            if not system.entries or system.entry_state is None:
                raise RuntimeError("the resumed graph never reached its node")
            t2 = system.entries[0]
            state = dict(system.entry_state)
        else:
            state = dict(graph.get_state(system._config(steps)).values)
            t2 = clock()
        ok, why = workload.same_state(state, steps)
    finally:
        close()
    return {
        "system": name,
        "phase": "resume" if resume else "load",
        "steps": steps,
        "ms": (t2 - t0) * 1e3,
        "open_ms": (t1 - t0) * 1e3,
        "import_ms": import_ms,
        "verified": ok,
        "why": why,
    }


def history_phase(name: str, db: Path, steps: int) -> dict[str, Any]:
    """Fresh process: open and list the whole history (every state built)."""
    system = _system(name)
    _util.quiesce_gc()
    clock = time.perf_counter
    t0 = clock()
    saver, close = system.open_saver(db, timed=False)
    try:
        graph = system._graph(saver)
        t1 = clock()
        history = list(graph.get_state_history(system._config(steps)))
        t2 = clock()
        ok, why = workload.same_state(dict(history[0].values), steps)
        if ok and len(history) < steps:
            ok, why = False, f"{len(history)} checkpoints listed, fewer than {steps} steps"
    finally:
        close()
    return {
        "system": name,
        "phase": "history",
        "steps": steps,
        "ms": (t2 - t1) * 1e3,
        "open_ms": (t1 - t0) * 1e3,
        "checkpoints": len(history),
        "verified": ok,
        "why": why,
    }


# -- the orchestrator's part (called by bench.runner) ----------------------------------
def phase_count(reps: int, samples: int) -> int:
    """How many phases W2-through-LangGraph runs (for the progress bar)."""
    return reps * len(SYSTEMS) * (2 + 2 * samples)


def run(reps: int, samples: int, runner: Runner, progress: Progress, task: Any) -> dict[str, Any]:
    """Per repetition: a write phase per system, then load and resume phases per system
    (``samples`` rounds), then a history listing per system, alternating systems."""
    # Phases run from the runner's copy of the sources: add the adapters layer.
    if not (runner.src / "adapters").exists():
        shutil.copytree(
            ROOT / "adapters", runner.src / "adapters", ignore=shutil.ignore_patterns("__pycache__")
        )
    started = time.time()
    load0 = list(__import__("os").getloadavg())
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        repdir = runner.tmp / "w2lg" / f"rep{rep}"
        repdir.mkdir(parents=True)
        rounds = [("write", 0)] + [(p, k) for k in range(samples) for p in ("load", "resume")]
        rounds.append(("history", 0))
        for phase, sample in rounds:
            for name in SYSTEMS:
                progress.update(task, description=f"W2-LG rep {rep + 1}/{reps} {phase} {name}")
                res = runner.phase(
                    "bench.w2lg",
                    [phase, "--system", name, "--db", str(repdir / f"{name}.db")],
                    timeout=600,
                )
                runs.append({"rep": rep, "sample": sample, "system": name, "phase": phase, **res})
                progress.advance(task)
        line = [
            f"{r['system']} {r['write']['median_ms']:.2f} ms, {r['bytes'] / 1e6:.2f} MB"
            for r in runs
            if r["rep"] == rep and r["phase"] == "write" and "error" not in r
        ]
        progress.console.print(f"W2-LG rep {rep + 1}: write median " + "; ".join(line))
        shutil.rmtree(repdir)
    import datetime as dt

    return {
        "steps": STEPS,
        "systems": SYSTEMS,
        "reference": REFERENCE,
        "runs": runs,
        "meta": {
            "started_utc": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
            "duration_s": time.perf_counter() - t0,
            "reps": reps,
            "samples": samples,
            "loadavg_start": load0,
            "loadavg_end": list(__import__("os").getloadavg()),
        },
    }


def summarize(w: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: medians over repetitions of the per-run figures, and ratios to
    ``SqliteSaver`` (plain channels) within the same repetition."""
    ok = [r for r in w["runs"] if "error" not in r]

    def fig(r: dict[str, Any]) -> float:
        if r["phase"] == "write":
            return float(r["write"]["median_ms"])
        return float(r["ms"])

    out: dict[str, dict[str, Any]] = {}
    for name in w["systems"]:
        row: dict[str, Any] = {"label": LABELS.get(name, name)}
        for phase, key in (
            ("write", "write_median_ms"),
            ("load", "load_ms"),
            ("resume", "resume_ms"),
            ("history", "history_ms"),
        ):
            mine = [r for r in ok if r["system"] == name and r["phase"] == phase]
            ref = {
                (r["rep"], r["sample"]): r
                for r in ok
                if r["system"] == w["reference"] and r["phase"] == phase
            }
            row[key] = _util.median([fig(r) for r in mine])
            row["x_" + key] = _util.median(
                [
                    fig(r) / fig(ref[(r["rep"], r["sample"])])
                    for r in mine
                    if (r["rep"], r["sample"]) in ref
                ]
            )
            if phase == "write":
                row["write_p99_ms"] = _util.median([r["write"]["p99_ms"] for r in mine])
                row["step_median_ms"] = _util.median([r["step"]["median_ms"] for r in mine])
                row["bytes"] = _util.median([r["bytes"] for r in mine])
                refb = {r["rep"]: r["bytes"] for r in ref.values()}
                row["x_bytes"] = _util.median(
                    [r["bytes"] / refb[r["rep"]] for r in mine if r["rep"] in refb]
                )
            elif mine:  # (a merged earlier run may have no history phase)
                row["verified_" + phase] = all(r["verified"] for r in mine)
        row["errors"] = [
            r["error"].splitlines()[0] for r in w["runs"] if r["system"] == name and "error" in r
        ]
        out[name] = row
    return out


def section(results: dict[str, Any]) -> list[str]:
    """The W2-through-LangGraph section of docs/performance.md."""
    w = results["w2lg"]
    s = summarize(w)
    times = "\N{MULTIPLICATION SIGN}"
    m = w["meta"]
    head = [
        "checkpointer",
        "bytes on disk",
        f"{times} SqliteSaver",
        "checkpointer time per step (median / p99)",
        f"{times} SqliteSaver",
        "step wall time (median)",
        "fresh-process get_state",
        f"{times} SqliteSaver",
        "fresh-process resume",
        f"{times} SqliteSaver",
        "list the history",
        f"{times} SqliteSaver",
        "state verified",
    ]
    rows = [
        [
            r["label"],
            f"{r['bytes'] / 1e6:.2f} MB",
            f"{r['x_bytes']:.3f}{times}",
            f"{r['write_median_ms']:.2f} / {r['write_p99_ms']:.2f} ms",
            f"{r['x_write_median_ms']:.2f}{times}",
            f"{r['step_median_ms']:.2f} ms",
            f"{r['load_ms']:.1f} ms",
            f"{r['x_load_ms']:.2f}{times}",
            f"{r['resume_ms']:.1f} ms",
            f"{r['x_resume_ms']:.2f}{times}",
            _ms(r.get("history_ms")),
            _x(r.get("x_history_ms")),
            "yes"
            if all(r.get(f"verified_{p}", True) for p in ("load", "resume", "history"))
            and r.get("verified_load")
            else "NO",
        ]
        for r in s.values()
    ]
    align = "lrrrrrrrrrrrl"
    seps = ["---:" if a == "r" else "---" for a in align]
    lines = [
        "## W2 through LangGraph — onceonly as LangGraph's checkpointer",
        "",
        (
            f"Measured {m['started_utc']} with {m['reps']} repetitions and {m['samples']} "
            f"fresh-process sample(s) per repetition in {m['duration_s'] / 60:.1f} min "
            f"(load average {_load(m.get('loadavg_start'))} at the start, "
            f"{_load(m.get('loadavg_end'))} at the end); `python -m bench --only w2lg`."
        ),
        "",
        (
            f"The W2 graph ({w['steps']} steps of one node looping through a conditional "
            'edge, `durability="sync"`, channels `kv` and `messages` as in W2) compiled '
            'with `OnceOnlySaver.from_url("sqlite:///...")` '
            "(`adapters.langgraph_saver`) and with LangGraph's `SqliteSaver`, each with "
            "plain reducer channels and with `DeltaChannel`, in the same invocation, "
            "alternating, each phase in a fresh process. Checkpointer time is the time "
            "spent in the saver's `put` and `put_writes` during a step; bytes are the "
            "database after `wal_checkpoint(TRUNCATE)`; get_state and resume include opening "
            "the saver and compiling the graph, and resume runs `invoke(None, config)` "
            "until the node is entered again; the history is `get_state_history(config)` "
            "listed whole in a fresh process (every checkpoint's state built), timed after "
            "the open. Ratios are to SqliteSaver with plain channels in the same repetition."
        ),
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(seps) + " |",
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
    ]
    errors = [(n, e) for n, r in s.items() for e in r["errors"]]
    lines += [f"- W2-LG {n} failed: `{e}`" for n, e in errors]
    if errors:
        lines.append("")
    return lines


def targets(results: dict[str, Any]) -> list[Any]:
    """The saver's targets (issues [10] and [13]): per step, get_state and the history
    no slower than SqliteSaver with plain channels, bytes at most a tenth."""
    from .summary import Target

    if "w2lg" not in results:
        return []
    s = summarize(results["w2lg"])
    times = "\N{MULTIPLICATION SIGN}"
    out = []
    for name in ("onceonly", "onceonly-delta"):
        r = s.get(name)
        if r is None:
            continue
        label = r["label"]
        out += [
            Target(
                "W2-LG",
                f"checkpointer time per step ≤ 1{times} SqliteSaver's",
                label,
                r["x_write_median_ms"],
                times,
                1.0,
            ),
            Target(
                "W2-LG",
                f"fresh-process get_state ≤ 1{times} SqliteSaver's",
                label,
                r["x_load_ms"],
                times,
                1.0,
            ),
            Target("W2-LG", f"bytes ≤ 0.1{times} SqliteSaver's", label, r["x_bytes"], times, 0.1),
        ]
        if not math.isnan(r.get("x_history_ms", math.nan)):
            out.append(
                Target(
                    "W2-LG",
                    f"listing the history ≤ 1{times} SqliteSaver's",
                    label,
                    r["x_history_ms"],
                    times,
                    1.0,
                )
            )
    return out


def console_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Headline rows for the console summary: (system, figure, value, ratio)."""
    out = []
    for name, r in summarize(results["w2lg"]).items():
        out.append(
            (
                name,
                "checkpointer/step",
                f"{r['write_median_ms']:.2f} ms",
                f"{r['x_write_median_ms']:.2f}",
            )
        )
        out.append((name, "bytes", f"{r['bytes'] / 1e6:.2f} MB", f"{r['x_bytes']:.3f}"))
        out.append((name, "resume", f"{r['resume_ms']:.1f} ms", f"{r['x_resume_ms']:.2f}"))
    return out


def _ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "not measured"
    return f"{v:.1f} ms"


def _x(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:.2f}\N{MULTIPLICATION SIGN}"


def _load(xs: Sequence[float] | None) -> str:
    return "/".join(f"{x:.1f}" for x in xs) if xs else "?"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w2lg", description=__doc__)
    p.add_argument("phase", choices=PHASES)
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--db", required=True, type=Path)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.phase == "write":
        result = write_phase(a.system, a.db, a.steps)
    elif a.phase == "history":
        result = history_phase(a.system, a.db, a.steps)
    else:
        result = load_phase(a.system, a.db, a.steps, resume=a.phase == "resume")
    _util.emit(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
