"""The W1 floor: what a careful programmer writes with stdlib ``sqlite3`` and ``json``.

WAL, ``synchronous=FULL`` (read back): per call, one committed transaction records the
intent (``INSERT``), the body runs, a second committed transaction records the outcome
(``UPDATE``). The warm floor is one indexed ``SELECT`` + ``json.loads`` per call.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from bench import workload

from . import CallsResult, W1System
from .floors import connect

RUN_ID = "w1-run"
SCHEMA = """
    CREATE TABLE IF NOT EXISTS effects (
        run_id TEXT NOT NULL, call INTEGER NOT NULL, status TEXT NOT NULL,
        arg TEXT NOT NULL, result TEXT,
        PRIMARY KEY (run_id, call));
"""


class TwoCommitFloor(W1System):
    """Two commits per call; replay by primary-key lookup."""

    name = "floor"

    @staticmethod
    def _call(conn: sqlite3.Connection, i: int, arg: dict[str, Any]) -> dict[str, Any]:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO effects VALUES (?, ?, 'claimed', ?, NULL)",
            (RUN_ID, i, workload.to_json(arg)),
        )
        conn.execute("COMMIT")
        result = workload.send_email(arg)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE effects SET status = 'committed', result = ? WHERE run_id = ? AND call = ?",
            (workload.to_json(result), RUN_ID, i),
        )
        conn.execute("COMMIT")
        return result

    def _open(self, db: Path) -> sqlite3.Connection:
        conn = connect(db)
        conn.executescript(SCHEMA)
        return conn

    def cold(self, db: Path, calls: int) -> CallsResult:
        conn = self._open(db)
        args = [workload.make_arg(i) for i in range(calls)]
        call_s: list[float] = []
        results: list[Any] = []
        clock = time.perf_counter
        try:
            t_first = clock()
            for i, arg in enumerate(args):
                t0 = clock()
                results.append(self._call(conn, i, arg))
                call_s.append(clock() - t0)
            total = clock() - t_first
        finally:
            conn.close()
        extra = {"synchronous": "FULL", "journal": "wal", "commits_per_call": 2}
        return CallsResult(call_s, total, workload.EFFECT.executed, results, extra)

    def warm(self, db: Path, calls: int, *, tolerant: bool = False) -> CallsResult:
        conn = connect(db)
        sql = "SELECT result FROM effects WHERE run_id = ? AND call = ? AND status = 'committed'"
        call_s: list[float] = []
        results: list[Any] = []
        errors: dict[str, int] = {}
        clock = time.perf_counter
        try:
            t_first = clock()
            for i in range(calls):
                t0 = clock()
                row = conn.execute(sql, (RUN_ID, i)).fetchone()
                if row is None:
                    if not tolerant:
                        raise RuntimeError(f"call {i} has no recorded outcome")
                    # An unrecorded outcome: the call executes again (the counter shows it).
                    results.append(self._call_again(conn, i))
                else:
                    results.append(json.loads(row[0]))
                call_s.append(clock() - t0)
            total = clock() - t_first
        finally:
            conn.close()
        return CallsResult(call_s, total, workload.EFFECT.executed, results, errors=errors)

    def _call_again(self, conn: sqlite3.Connection, i: int) -> dict[str, Any]:
        arg = workload.make_arg(i)
        conn.execute("DELETE FROM effects WHERE run_id = ? AND call = ?", (RUN_ID, i))
        return self._call(conn, i, arg)

    def probe_child(self, db: Path, calls: int) -> None:
        conn = self._open(db)
        args = [workload.make_arg(i) for i in range(calls)]
        for i, arg in enumerate(args):
            self._call(conn, i, arg)
        os._exit(0)

    def recorded(self, db: Path, calls: int) -> int:
        conn = connect(db)
        try:
            (n,) = conn.execute(
                "SELECT count(*) FROM effects WHERE run_id = ? AND status = 'committed'",
                (RUN_ID,),
            ).fetchone()
        finally:
            conn.close()
        return int(n)
