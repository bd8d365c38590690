"""The floors: what a careful programmer writes with stdlib ``sqlite3`` and ``pickle``.

Every floor database runs in WAL mode with ``synchronous=FULL`` (read back and checked),
one ``BEGIN IMMEDIATE`` ... ``COMMIT`` per checkpoint in the timed W2 phase.
"""

from __future__ import annotations

import pickle
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import workload

from . import AtPoint, LoadResult, System, WriteResult

RUN_ID = "bench-run"
_PROTO = pickle.HIGHEST_PROTOCOL
_BATCH = 500  # build: checkpoints per transaction


def connect(db: Path, *, synchronous: str = "FULL") -> sqlite3.Connection:
    """A stdlib connection in WAL mode with the given ``synchronous`` level."""
    conn = sqlite3.connect(db, isolation_level=None)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    conn.execute(f"PRAGMA synchronous={synchronous}")
    level = conn.execute("PRAGMA synchronous").fetchone()[0]
    want = {"OFF": 0, "NORMAL": 1, "FULL": 2}[synchronous]
    if mode != "wal" or level != want:
        raise RuntimeError(f"sqlite refused WAL/synchronous={synchronous}: {mode}, {level}")
    return conn


class _Floor(System):
    """Shared loop: a floor defines its schema, its first row and its per-step row."""

    schema: str = ""

    def _first(self, conn: sqlite3.Connection, state: workload.State) -> None:
        raise NotImplementedError

    def _write(
        self, conn: sqlite3.Connection, s: int, state: workload.State, ch: workload.Step
    ) -> None:
        raise NotImplementedError

    def _read(self, conn: sqlite3.Connection) -> workload.State:
        raise NotImplementedError

    def _setup(self, conn: sqlite3.Connection) -> workload.State:
        conn.executescript(self.schema)
        state = workload.initial_state()
        conn.execute("BEGIN IMMEDIATE")
        self._first(conn, state)
        conn.execute("COMMIT")
        return state

    def write_w2(self, db: Path, steps: int) -> WriteResult:
        conn = connect(db)
        try:
            state = self._setup(conn)
            write_s: list[float] = []
            step_s: list[float] = []
            clock = time.perf_counter
            t_first = clock()
            for s in range(1, steps + 1):
                t0 = clock()
                ch = workload.step_changes(s)
                workload.apply_step(state, ch)
                t1 = clock()
                conn.execute("BEGIN IMMEDIATE")
                self._write(conn, s, state, ch)
                conn.execute("COMMIT")
                t2 = clock()
                write_s.append(t2 - t1)
                step_s.append(t2 - t0)
            total = clock() - t_first
        finally:
            conn.close()
        return WriteResult(write_s, step_s, total, {"synchronous": "FULL", "journal": "wal"})

    def load_w2(self, db: Path, steps: int) -> LoadResult:
        return self._timed_read(db)

    def resume(self, db: Path, steps: int) -> LoadResult:
        return self._timed_read(db)

    def _timed_read(self, db: Path) -> LoadResult:
        clock = time.perf_counter
        t0, c0 = clock(), time.process_time()
        conn = connect(db)
        t1 = clock()
        state = self._read(conn)
        t2, c2 = clock(), time.process_time()
        conn.close()
        return LoadResult(
            t2 - t0,
            state,
            {"open_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "cpu_ms": (c2 - c0) * 1e3},
        )

    def build(self, db: Path, points: Sequence[int], at_point: AtPoint) -> dict[str, Any]:
        # Same rows as the timed path, committed in batches with synchronous=NORMAL.
        conn = connect(db, synchronous="NORMAL")
        try:
            state = self._setup(conn)
            todo = sorted(points)
            conn.execute("BEGIN IMMEDIATE")
            for s in range(1, todo[-1] + 1):
                ch = workload.step_changes(s)
                workload.apply_step(state, ch)
                self._write(conn, s, state, ch)
                if s in todo or s % _BATCH == 0:
                    conn.execute("COMMIT")
                    if s in todo:
                        at_point(s)
                    conn.execute("BEGIN IMMEDIATE")
            conn.execute("COMMIT")
        finally:
            conn.close()
        return {"durability": f"synchronous=NORMAL, {_BATCH} checkpoints per transaction"}


class PickleFull(_Floor):
    """The whole state pickled into a new row per step (history kept)."""

    name = "floor-full"
    schema = """
        CREATE TABLE IF NOT EXISTS ckpt (
            run_id TEXT NOT NULL, seq INTEGER NOT NULL, state BLOB NOT NULL,
            PRIMARY KEY (run_id, seq));
    """

    def _first(self, conn: sqlite3.Connection, state: workload.State) -> None:
        conn.execute(
            "INSERT INTO ckpt VALUES (?, 0, ?)", (RUN_ID, pickle.dumps(state, protocol=_PROTO))
        )

    def _write(
        self, conn: sqlite3.Connection, s: int, state: workload.State, ch: workload.Step
    ) -> None:
        conn.execute(
            "INSERT INTO ckpt VALUES (?, ?, ?)", (RUN_ID, s, pickle.dumps(state, protocol=_PROTO))
        )

    def _read(self, conn: sqlite3.Connection) -> workload.State:
        row = conn.execute(
            "SELECT state FROM ckpt WHERE run_id = ? ORDER BY seq DESC LIMIT 1", (RUN_ID,)
        ).fetchone()
        state: workload.State = pickle.loads(row[0])
        return state


class PickleDelta(_Floor):
    """The initial state pickled once, then one pickled delta row per step; a load
    replays every delta (the cost grows with the history)."""

    name = "floor-delta"
    schema = """
        CREATE TABLE IF NOT EXISTS base (run_id TEXT PRIMARY KEY, state BLOB NOT NULL);
        CREATE TABLE IF NOT EXISTS delta (
            run_id TEXT NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,
            PRIMARY KEY (run_id, seq));
    """

    def _first(self, conn: sqlite3.Connection, state: workload.State) -> None:
        conn.execute(
            "INSERT INTO base VALUES (?, ?)", (RUN_ID, pickle.dumps(state, protocol=_PROTO))
        )

    def _write(
        self, conn: sqlite3.Connection, s: int, state: workload.State, ch: workload.Step
    ) -> None:
        body = pickle.dumps({"kv": ch.kv, "append": [ch.message], "step": s}, protocol=_PROTO)
        conn.execute("INSERT INTO delta VALUES (?, ?, ?)", (RUN_ID, s, body))

    def _read(self, conn: sqlite3.Connection) -> workload.State:
        row = conn.execute("SELECT state FROM base WHERE run_id = ?", (RUN_ID,)).fetchone()
        state: workload.State = pickle.loads(row[0])
        kv, messages = state["kv"], state["messages"]
        for (body,) in conn.execute(
            "SELECT body FROM delta WHERE run_id = ? ORDER BY seq", (RUN_ID,)
        ):
            d = pickle.loads(body)
            kv.update(d["kv"])
            messages.extend(d["append"])
            state["step"] = d["step"]
        return state


class PickleLatest(_Floor):
    """W3 only: the latest state in one row, overwritten (no history). The cost of just
    reading and unpickling the live state: a lower bound for any resume."""

    name = "floor-latest"
    schema = """
        CREATE TABLE IF NOT EXISTS latest (
            run_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, state BLOB NOT NULL);
    """

    def _first(self, conn: sqlite3.Connection, state: workload.State) -> None:
        self._put(conn, 0, state)

    def _put(self, conn: sqlite3.Connection, s: int, state: workload.State) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO latest VALUES (?, ?, ?)",
            (RUN_ID, s, pickle.dumps(state, protocol=_PROTO)),
        )

    def _write(
        self, conn: sqlite3.Connection, s: int, state: workload.State, ch: workload.Step
    ) -> None:
        self._put(conn, s, state)

    def _read(self, conn: sqlite3.Connection) -> workload.State:
        row = conn.execute("SELECT state FROM latest WHERE run_id = ?", (RUN_ID,)).fetchone()
        state: workload.State = pickle.loads(row[0])
        return state

    def build(self, db: Path, points: Sequence[int], at_point: AtPoint) -> dict[str, Any]:
        # The table only ever holds the latest state, so the database after N steps is the
        # state after N steps: compute it in memory and write it (once) at each point.
        conn = connect(db, synchronous="NORMAL")
        try:
            state = self._setup(conn)
            todo = sorted(points)
            for s in range(1, todo[-1] + 1):
                workload.apply_step(state, workload.step_changes(s))
                if s in todo:
                    conn.execute("BEGIN IMMEDIATE")
                    self._put(conn, s, state)
                    conn.execute("COMMIT")
                    at_point(s)
        finally:
            conn.close()
        return {"durability": "latest state written once per point (no history to write)"}
