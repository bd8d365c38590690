"""The LangGraph peer: a ``StateGraph`` with one node looping through a conditional edge,
checkpointed by ``SqliteSaver`` (langgraph-checkpoint-sqlite) with ``durability="sync"``.

Channels: ``kv: Annotated[dict, merge]``, ``messages: Annotated[list, operator.add]`` and
``step: int``; or, for the ``DeltaChannel`` variant, the same reducers in their batched
form inside ``DeltaChannel`` (LangGraph >= 1.2, beta), which stores writes and periodic
snapshots instead of the whole channel value per checkpoint.

This module deliberately does not use ``from __future__ import annotations``: LangGraph
reads the state schema's annotations at run time.
"""

import contextlib
import itertools
import operator
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.channels import DeltaChannel
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from bench import workload

from . import AtPoint, LoadResult, System, WriteResult

THREAD = "bench-thread"


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The dict reducer of the plain variant."""
    return {**a, **b}


def merge_batch(a: dict[str, Any], writes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``merge`` over a batch of writes (DeltaChannel's reducer signature)."""
    out = dict(a)
    for w in writes:
        out.update(w)
    return out


def concat_batch(a: list[Any], writes: Sequence[list[Any]]) -> list[Any]:
    """``operator.add`` over a batch of writes (DeltaChannel's reducer signature)."""
    out = list(a)
    for w in writes:
        out.extend(w)
    return out


class PlainState(TypedDict):
    kv: Annotated[dict[str, str], merge]
    messages: Annotated[list[str], operator.add]
    step: int


class DeltaState(TypedDict):
    kv: Annotated[dict[str, str], DeltaChannel(merge_batch)]
    messages: Annotated[list[str], DeltaChannel(concat_batch)]
    step: int


class Crash(Exception):
    """Raised at the entry of a step to leave the thread where a crash would."""


class _Stop(Exception):
    pass


class TimedSqliteSaver(SqliteSaver):
    """The real ``SqliteSaver``; records when each ``put``/``put_writes`` ran and for how
    long, so a step's checkpoint write can be told apart from its wall time."""

    calls: list[tuple[float, float]]

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        self.calls = []

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


class LangGraph(System):
    """The LangGraph peer (plain reducers or DeltaChannel)."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self.name = "langgraph-delta" if delta else "langgraph"
        # Node behaviour, set per phase (each phase is its own process).
        self.limit = 0  # the conditional edge ends the graph after this step
        self.crash_at: int | None = None  # raise Crash at the entry of step crash_at + 1
        self.stop_on_entry = False  # resume: record the entry and stop
        self.entries: list[float] = []
        self.entry_state: dict[str, Any] | None = None
        self.entry_cpu = 0.0

    def _node(self, state: dict[str, Any]) -> dict[str, Any]:
        now = time.perf_counter()
        if self.stop_on_entry:
            self.entry_cpu = time.process_time()
            self.entries.append(now)
            self.entry_state = state
            raise _Stop
        if self.crash_at is not None and state["step"] >= self.crash_at:
            raise Crash
        self.entries.append(now)
        ch = workload.step_changes(state["step"] + 1)
        return {"kv": ch.kv, "messages": [ch.message], "step": ch.s}

    def _route(self, state: dict[str, Any]) -> str:
        return "step" if state["step"] < self.limit else END

    def _graph(self, saver: SqliteSaver) -> Any:
        schema: Any = DeltaState if self.delta else PlainState
        builder = StateGraph(schema)
        builder.add_node("step", self._node)
        builder.add_edge(START, "step")
        builder.add_conditional_edges("step", self._route, ["step", END])
        return builder.compile(checkpointer=saver)

    @staticmethod
    def _config(steps: int) -> Any:
        return {"configurable": {"thread_id": THREAD}, "recursion_limit": steps + 100}

    @staticmethod
    def _pragmas(conn: sqlite3.Connection) -> dict[str, Any]:
        return {
            "journal_mode": conn.execute("PRAGMA journal_mode").fetchone()[0],
            "synchronous": conn.execute("PRAGMA synchronous").fetchone()[0],
        }

    def write_w2(self, db: Path, steps: int) -> WriteResult:
        conn = sqlite3.connect(db, check_same_thread=False)
        try:
            saver = TimedSqliteSaver(conn)
            graph = self._graph(saver)
            self.limit = steps
            out = graph.invoke(workload.initial_state(), self._config(steps), durability="sync")
            t_end = time.perf_counter()
            pragmas = self._pragmas(conn)
        finally:
            conn.close()
        if out["step"] != steps or len(self.entries) != steps:
            raise RuntimeError(f"graph ran {len(self.entries)} steps, ended at {out['step']}")
        bounds = [*self.entries, t_end]
        step_s = [b - a for a, b in itertools.pairwise(bounds)]
        write_s = [0.0] * steps
        calls_per_step = [0] * steps
        i = 0
        for start, dur in sorted(saver.calls):
            if start < bounds[0]:
                continue  # the input checkpoint, before step 1
            while i + 1 < steps and start >= bounds[i + 1]:
                i += 1
            write_s[i] += dur
            calls_per_step[i] += 1
        return WriteResult(
            write_s,
            step_s,
            t_end - bounds[0],
            {
                **pragmas,
                "saver_calls_per_step": sorted(set(calls_per_step)),
                "write_is": "SqliteSaver put + put_writes during the step",
            },
        )

    def load_w2(self, db: Path, steps: int) -> LoadResult:
        clock = time.perf_counter
        t0, c0 = clock(), time.process_time()
        conn = sqlite3.connect(db, check_same_thread=False)
        graph = self._graph(SqliteSaver(conn))
        t1 = clock()
        snap = graph.get_state(self._config(steps))
        values = dict(snap.values)
        t2, c2 = clock(), time.process_time()
        conn.close()
        return LoadResult(
            t2 - t0,
            values,
            {"open_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "cpu_ms": (c2 - c0) * 1e3},
        )

    def build(self, db: Path, points: Sequence[int], at_point: AtPoint) -> dict[str, Any]:
        # durability="async" writes the same checkpoints in the background; the run
        # "crashes" at the entry of the step after each point, so the thread is left as a
        # killed process leaves it, then resumes with invoke(None) as LangGraph documents.
        conn = sqlite3.connect(db, check_same_thread=False)
        try:
            graph = self._graph(SqliteSaver(conn))
            todo = sorted(points)
            self.limit = todo[-1] + 10**6  # never ends by itself
            config = self._config(todo[-1])
            inp: Any = workload.initial_state()
            for n in todo:
                self.crash_at = n
                try:
                    graph.invoke(inp, config, durability="async")
                except Crash:
                    pass
                else:
                    raise RuntimeError("the graph ended instead of crashing")
                inp = None
                at_point(n)
            pragmas = self._pragmas(conn)
        finally:
            conn.close()
        return {**pragmas, "durability": "async (same checkpoints, background writes)"}

    def resume(self, db: Path, steps: int) -> LoadResult:
        self.limit = steps + 10**6
        self.stop_on_entry = True
        clock = time.perf_counter
        t0, c0 = clock(), time.process_time()
        conn = sqlite3.connect(db, check_same_thread=False)
        graph = self._graph(SqliteSaver(conn))
        t1 = clock()
        with contextlib.suppress(_Stop):
            graph.invoke(None, self._config(steps), durability="sync")
        conn.close()
        if not self.entries or self.entry_state is None:
            raise RuntimeError("the resumed graph never reached the next step")
        t2, c2 = self.entries[0], self.entry_cpu
        return LoadResult(
            t2 - t0,
            dict(self.entry_state),
            {"open_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "cpu_ms": (c2 - c0) * 1e3},
        )
