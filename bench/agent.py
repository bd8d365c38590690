"""``python -m bench agent``: LangGraph checkpointers under a tool-calling agent.

The graph is the shape of an agent: a scripted ``model`` node (no LLM) asks for one
``lookup`` tool call per turn (an ``AIMessage`` of ~270 characters with its tool call),
a ``ToolNode`` answers it (a ``ToolMessage`` of ~300 characters), ``tools_condition``
loops back; after ``--turns`` turns the model answers and the run ends
(``durability="sync"``, 2 x turns + 3 checkpoints). The same graph runs with LangGraph's
``SqliteSaver``, its ``InMemorySaver`` and onceonly's ``OnceOnlySaver`` (SQLite, sealed
with a keyring), and on PostgreSQL with LangGraph's ``PostgresSaver`` and
``OnceOnlySaver`` (each repetition a new database per system, on the server of
``ONCEONLY_TEST_PG_URL`` or on a throwaway cluster started for the run; ``--no-pg``
leaves them out), systems alternating within each repetition, each phase a fresh process:

* ``run``: the whole conversation; wall and process CPU time per checkpoint (the
  invoke's time over the checkpoints it wrote), then ``get_state_history`` listed whole
  in the same process; database bytes after ``wal_checkpoint(TRUNCATE)``.
* ``fresh`` (the ones that persist): a new process opens the saver, compiles the graph
  and reads ``get_state`` (timed from before the open), then lists the history whole.
* ``concurrent`` (PostgreSQL): 16 conversations of 10 turns at once, asyncio tasks
  ``ainvoke``-ing the graph on 16 threads of one saver (``AsyncPostgresSaver`` over a
  pool of 16 connections; ``OnceOnlySaver``'s async methods): checkpoints per second.

Before each timed region the phase collects and freezes the heap (``_util.quiesce_gc``),
as every bench phase does: otherwise whether one full collection of the heap left by the
imports and the run (70-80 ms here) lands in one system's window depends on allocation
counts.

Figures are medians over repetitions; ratios are to SqliteSaver in the same repetition
(PostgreSQL systems: to PostgresSaver). Bytes on PostgreSQL are the tables' with their
indexes and TOAST (``pg_total_relation_size``).
``--json bench/results/agent.json`` feeds docs/performance.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import _util
from ._util import quiesce_gc

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["sqlite", "memory", "onceonly", "postgres", "onceonly-pg"]
LABELS = {
    "sqlite": "SqliteSaver",
    "memory": "InMemorySaver",
    "onceonly": "OnceOnlySaver (SQLite, sealed)",
    "postgres": "PostgresSaver",
    "onceonly-pg": "OnceOnlySaver (PostgreSQL, sealed)",
}
PERSISTENT = ["sqlite", "onceonly", "postgres", "onceonly-pg"]
ON_PG = ["postgres", "onceonly-pg"]
#: The system each one's ratios are to (its backend's LangGraph saver).
REFERENCE = {s: "postgres" if s in ON_PG else "sqlite" for s in SYSTEMS}


def _graph(saver: Any, turns: int) -> Any:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        return ("result for " + q + " ") * 20

    def model(state: MessagesState) -> dict[str, Any]:
        n = sum(1 for m in state["messages"] if isinstance(m, ToolMessage))
        if n >= turns:
            return {"messages": [AIMessage("done")]}
        call = {"name": "lookup", "args": {"q": f"q{n}"}, "id": f"c{n}"}
        return {"messages": [AIMessage("thinking " * 30, tool_calls=[call])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=saver)


def _saver(system: str, db: str) -> tuple[Any, Any]:
    if system == "postgres":
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row

        # as PostgresSaver.from_conn_string connects
        conn = psycopg.connect(
            _util.libpq_url(db), autocommit=True, prepare_threshold=0, row_factory=dict_row
        )
        pg_saver = PostgresSaver(conn)
        pg_saver.setup()
        return pg_saver, conn.close
    if system == "memory":
        from langgraph.checkpoint.memory import InMemorySaver

        return InMemorySaver(), lambda: None
    if system == "sqlite":
        import sqlite3

        from langgraph.checkpoint.sqlite import SqliteSaver

        conn = sqlite3.connect(db, check_same_thread=False)
        return SqliteSaver(conn), conn.close
    from onceonly.adapters.langgraph_saver import OnceOnlySaver
    from onceonly.ledger import Keyring, Secret

    keys = Keyring([Secret("k1", bytes(range(32)))])
    url = db if system == "onceonly-pg" else f"sqlite:///{db}"
    saver = OnceOnlySaver.from_url(url, keyring=keys)
    return saver, saver.close


def _imports(system: str) -> None:
    """What the phase imports before its clock starts (the graph's modules, the saver's)."""
    names = ["langgraph.graph", "langgraph.prebuilt"]
    if system == "sqlite":
        names.append("langgraph.checkpoint.sqlite")
    elif system == "postgres":
        names += ["langgraph.checkpoint.postgres", "psycopg"]
    elif system.startswith("onceonly"):
        names += ["onceonly.adapters.langgraph_saver", "onceonly.ledger"]
        if system == "onceonly-pg":
            names += ["psycopg", "sqlalchemy.dialects.postgresql.psycopg"]
    for name in names:
        importlib.import_module(name)


def _bytes(system: str, db: str) -> int:
    import sqlite3

    if system in ON_PG:
        return _util.pg_bytes(db)
    path = Path(db)
    if not path.exists():
        return 0
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


CONFIG: Any = {"configurable": {"thread_id": "agent-1"}}


def run_phase(system: str, db: str, turns: int) -> dict[str, Any]:
    _imports(system)
    saver, close = _saver(system, db)
    try:
        app = _graph(saver, turns)
        quiesce_gc()
        t0, c0 = time.perf_counter(), time.process_time()
        app.invoke({"messages": [("user", "go")]}, CONFIG, durability="sync")
        t1, c1 = time.perf_counter(), time.process_time()
        quiesce_gc()
        t1b = time.perf_counter()
        history = list(app.get_state_history(CONFIG))
        t2 = time.perf_counter()
        n = len(history)
        last = len(history[0].values["messages"])
    finally:
        close()
    return {
        "system": system,
        "phase": "run",
        "checkpoints": n,
        "messages": last,
        "step_ms": (t1 - t0) / n * 1e3,
        "step_cpu_ms": (c1 - c0) / n * 1e3,
        "history_ms": (t2 - t1b) * 1e3,
        "bytes": _bytes(system, db) if system in PERSISTENT else None,
        "verified": last == 2 * turns + 2,
    }


CONCURRENT = 16
CONCURRENT_TURNS = 10


async def _asaver(system: str, db: str) -> tuple[Any, Any]:
    """An async-capable saver on ``db`` and an async function closing it."""
    if system == "postgres":
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
        from psycopg.rows import dict_row
        from psycopg_pool import AsyncConnectionPool

        pool: Any = AsyncConnectionPool(
            _util.libpq_url(db),
            min_size=CONCURRENT,
            max_size=CONCURRENT,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
            open=False,
        )
        await pool.open()
        saver = AsyncPostgresSaver(pool)
        await saver.setup()
        return saver, pool.close
    saver, close = _saver(system, db)

    async def aclose() -> None:
        close()

    return saver, aclose


def concurrent_phase(system: str, db: str, turns: int) -> dict[str, Any]:
    """``CONCURRENT`` conversations at once (asyncio tasks), each on its own thread."""
    import asyncio

    del turns  # CONCURRENT_TURNS each
    _imports(system)
    if system == "postgres":
        importlib.import_module("langgraph.checkpoint.postgres.aio")
    configs = [{"configurable": {"thread_id": f"c{i}"}} for i in range(CONCURRENT)]

    async def main() -> tuple[float, float, bool]:
        saver, aclose = await _asaver(system, db)
        try:
            app = _graph(saver, CONCURRENT_TURNS)
            quiesce_gc()
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.gather(
                *(
                    app.ainvoke({"messages": [("user", "go")]}, cfg, durability="sync")
                    for cfg in configs
                )
            )
            t1, c1 = time.perf_counter(), time.process_time()
            states = [await app.aget_state(cfg) for cfg in configs]
        finally:
            await aclose()
        ok = all(len(st.values["messages"]) == 2 * CONCURRENT_TURNS + 2 for st in states)
        return t1 - t0, c1 - c0, ok

    wall, cpu, ok = asyncio.run(main())
    checkpoints = CONCURRENT * (2 * CONCURRENT_TURNS + 3)
    return {
        "system": system,
        "phase": "concurrent",
        "wall_s": wall,
        "cpu_s": cpu,
        "checkpoints_per_s": checkpoints / wall,
        "verified": ok,
    }


def fresh_phase(system: str, db: str, turns: int) -> dict[str, Any]:
    _imports(system)
    quiesce_gc()
    t0 = time.perf_counter()
    saver, close = _saver(system, db)
    try:
        app = _graph(saver, turns)
        state = app.get_state(CONFIG)
        t1 = time.perf_counter()
        quiesce_gc()  # outside both timed regions
        t1b = time.perf_counter()
        history = list(app.get_state_history(CONFIG))
        t2 = time.perf_counter()
    finally:
        close()
    return {
        "system": system,
        "phase": "fresh",
        "get_state_ms": (t1 - t0) * 1e3,
        "history_ms": (t2 - t1b) * 1e3,
        "checkpoints": len(history),
        "verified": len(state.values["messages"]) == 2 * turns + 2,
    }


def _child(phase: str, system: str, db: str, turns: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "bench.agent", "--phase", phase, "--system", system),
            *("--db", str(db), "--turns", str(turns)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        return {"system": system, "phase": phase, "error": out.stderr.strip()[-2000:]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _median(xs: Sequence[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else float("nan")


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: medians over repetitions, and ratios to SqliteSaver per repetition."""
    runs = [r for r in data["runs"] if "error" not in r]
    figures = {
        "run": ["step_ms", "step_cpu_ms", "history_ms", "bytes"],
        "fresh": ["get_state_ms", "history_ms"],
        "concurrent": ["wall_s", "cpu_s", "checkpoints_per_s"],
    }
    out: dict[str, dict[str, Any]] = {}
    for system in data["systems"]:
        row: dict[str, Any] = {"label": LABELS.get(system, system)}
        for phase, keys in figures.items():
            mine = [r for r in runs if r["system"] == system and r["phase"] == phase]
            ref = {
                r["rep"]: r
                for r in runs
                if r["system"] == REFERENCE.get(system, "sqlite") and r["phase"] == phase
            }
            for key in keys:
                name = f"{phase}_{key}"
                vals = [r[key] for r in mine if r.get(key) is not None]
                row[name] = _median(vals)
                row["x_" + name] = _median(
                    [
                        r[key] / ref[r["rep"]][key]
                        for r in mine
                        if r.get(key) and r["rep"] in ref and ref[r["rep"]].get(key)
                    ]
                )
            if mine:
                row["verified_" + phase] = all(r["verified"] for r in mine)
        row["errors"] = [
            r["error"].splitlines()[-1]
            for r in data["runs"]
            if r["system"] == system and "error" in r
        ]
        out[system] = row
    return out


def _cell(v: float, fmt: str, unit: str) -> str:
    return "—" if math.isnan(v) else f"{v:{fmt}}{unit}"  # NaN: not measured for this system


def _pair(r: dict[str, Any], key: str, fmt: str, unit: str, scale: float = 1.0) -> str:
    x = "\N{MULTIPLICATION SIGN}"
    return f"{_cell(r[key] * scale, fmt, unit)} ({_cell(r['x_' + key], '.2f', x)})"


def section(data: dict[str, Any]) -> list[str]:
    """The agent section of docs/performance.md."""
    s = summarize(data)
    m = data["meta"]
    x = "\N{MULTIPLICATION SIGN}"
    head = [
        "checkpointer",
        f"per checkpoint, wall ({x} ref)",
        f"per checkpoint, CPU ({x} ref)",
        f"list the history, same process ({x} ref)",
        f"fresh open + get_state ({x} ref)",
        f"list the history, fresh process ({x} ref)",
        f"bytes ({x} ref)",
        "verified",
    ]
    lines = [
        "## LangGraph checkpointers under a tool-calling agent",
        "",
        (
            f"Measured {m['started_utc']} with {m['runs']} repetitions of a {m['turns']}-turn "
            f"agent ({2 * m['turns'] + 3} checkpoints) in {m['duration_s'] / 60:.1f} min "
            f"(load average {m['loadavg_start']} at the start); `python -m bench agent --json "
            "bench/results/agent.json`. The graph and phases are described in "
            "`bench/agent.py`: a scripted model asking for one tool call per turn, a "
            '`ToolNode`, `durability="sync"`, each phase in a fresh process with the graph\'s '
            "and the saver's modules imported, and the heap collected and frozen, before each "
            "clock starts. Ratios (ref) are to the backend's LangGraph saver in the same "
            "repetition: SqliteSaver on SQLite, PostgresSaver on PostgreSQL (a server on this "
            "machine, unix socket; bytes: its tables with indexes and TOAST)."
        ),
    ]
    groups = [
        ("SQLite (and in memory)", [k for k in s if k not in ON_PG]),
        ("PostgreSQL", [k for k in s if k in ON_PG]),
    ]
    for title, systems in groups:
        if not systems:
            continue
        rows = []
        for name in systems:
            r = s[name]
            verified = all(v for k, v in r.items() if k.startswith("verified_")) and not r["errors"]
            rows.append(
                [
                    r["label"],
                    _pair(r, "run_step_ms", ".2f", " ms"),
                    _pair(r, "run_step_cpu_ms", ".2f", " ms"),
                    _pair(r, "run_history_ms", ".0f", " ms"),
                    _pair(r, "fresh_get_state_ms", ".1f", " ms"),
                    _pair(r, "fresh_history_ms", ".0f", " ms"),
                    _pair(r, "run_bytes", ".2f", " MB", 1e-6),
                    "yes" if verified else "NO",
                ]
            )
        lines += [
            "",
            f"**{title}**",
            "",
            "| " + " | ".join(head) + " |",
            "| --- | " + " | ".join("---:" for _ in head[1:-1]) + " | --- |",
            *["| " + " | ".join(r) + " |" for r in rows],
        ]
    conc = [s[k] for k in s if k in ON_PG and not math.isnan(s[k]["concurrent_wall_s"])]
    if conc:
        lines += [
            "",
            (
                f"**{CONCURRENT} conversations at once, PostgreSQL** ({CONCURRENT} asyncio tasks "
                f"`ainvoke`-ing the graph, {CONCURRENT_TURNS} turns each, on {CONCURRENT} "
                "threads of one saver: `AsyncPostgresSaver` over a pool of "
                f"{CONCURRENT} connections, `OnceOnlySaver` through its async methods)"
            ),
            "",
            (
                f"| checkpointer | wall ({x} ref) | process CPU ({x} ref) | "
                f"checkpoints per second ({x} ref) |"
            ),
            "| --- | ---: | ---: | ---: |",
            *[
                f"| {'AsyncPostgresSaver' if r is s.get('postgres') else r['label']} | "
                f"{_pair(r, 'concurrent_wall_s', '.2f', ' s')} | "
                f"{_pair(r, 'concurrent_cpu_s', '.2f', ' s')} | "
                f"{_pair(r, 'concurrent_checkpoints_per_s', ',.0f', '/s')} |"
                for r in conc
            ],
        ]
    lines.append("")
    lines += [f"- {n} failed: `{e}`" for n, r in s.items() for e in r["errors"]]
    return lines


PHASES = {"run": run_phase, "fresh": fresh_phase, "concurrent": concurrent_phase}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench agent", description=__doc__)
    p.add_argument("--phase", choices=list(PHASES), help="one phase (a child process)")
    p.add_argument("--system", choices=SYSTEMS)
    p.add_argument("--db", help="the database: a file (SQLite) or a URL (PostgreSQL)")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--runs", type=int, default=5, help="repetitions")
    p.add_argument("--no-pg", action="store_true", help="leave the PostgreSQL systems out")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    if a.phase:
        print(json.dumps(PHASES[a.phase](a.system, a.db, a.turns)))
        return 0
    systems = [s for s in SYSTEMS if not (a.no_pg and s in ON_PG)]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load0 = "/".join(f"{x:.1f}" for x in os.getloadavg())
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    server, stop = _util.pg_server("onceonly-agent-pg-") if not a.no_pg else ("", lambda: None)
    try:
        with tempfile.TemporaryDirectory(prefix="onceonly-bench-agent-") as tmp:
            for rep in range(a.runs):
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
                dbs = {
                    s: _util.pg_database(server) if s in ON_PG else str(Path(tmp) / f"{rep}-{s}.db")
                    for s in order
                }
                phases = [("run", s) for s in order]
                phases += [("fresh", s) for s in order if s in PERSISTENT]
                phases += [("concurrent", s) for s in order if s in ON_PG]
                try:
                    runs.extend(
                        {"rep": rep, **_child(phase, system, dbs[system], a.turns)}
                        for phase, system in phases
                    )
                finally:
                    for system in ON_PG:
                        if system in dbs:
                            _util.pg_drop(dbs[system])
                print(f"agent rep {rep + 1}/{a.runs} done", file=sys.stderr)
    finally:
        stop()
    data = {
        "systems": systems,
        "runs": runs,
        "meta": {
            "started_utc": started,
            "runs": a.runs,
            "turns": a.turns,
            "duration_s": time.perf_counter() - t0,
            "loadavg_start": load0,
            "python": platform.python_version(),
        },
    }
    for line in section(data):
        print(line)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
