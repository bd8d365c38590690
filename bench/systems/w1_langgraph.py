"""The LangGraph peer in W1: the functional API, one ``@task`` per guarded call inside an
``@entrypoint`` checkpointed by ``SqliteSaver`` with ``durability="sync"``.

Cold: the entrypoint makes N task calls, then raises (a crash after call N: the thread is
left with the tasks' recorded writes). Warm: a fresh process resumes the thread with
``invoke(None, config)``; the entrypoint runs again and every task call returns its
recorded result. The probe ``os._exit``s inside the entrypoint right after the 50th task
call returns.
"""

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.func import entrypoint, task

from bench import workload

from . import CallsResult, W1System

THREAD = "w1-thread"


class Crash(Exception):
    """Raised by the entrypoint after call N: leaves the thread where a crash would."""


@task
def send_email(arg: dict[str, Any]) -> dict[str, Any]:
    """The guarded call: one LangGraph task."""
    return workload.send_email(arg)


class LangGraphTasks(W1System):
    name = "langgraph"

    def __init__(self) -> None:
        self.mode = "cold"  # cold | warm | probe: what the entrypoint does after call N
        self.call_s: list[float] = []
        self.results: list[Any] = []
        self.total_s = 0.0

    def _body(self, calls: int) -> int:
        clock = time.perf_counter
        args = [workload.make_arg(i) for i in range(calls)]
        t_first = clock()
        for arg in args:
            t0 = clock()
            result = send_email(arg).result()
            if self.mode == "probe" and len(self.results) + 1 == calls:
                os._exit(0)
            self.call_s.append(clock() - t0)
            self.results.append(result)
        self.total_s = clock() - t_first
        if self.mode == "cold":
            raise Crash
        return calls

    def _flow(self, conn: sqlite3.Connection) -> Any:
        return entrypoint(checkpointer=SqliteSaver(conn))(self._body)

    @staticmethod
    def _config() -> Any:
        return {"configurable": {"thread_id": THREAD}}

    @staticmethod
    def _pragmas(conn: sqlite3.Connection) -> dict[str, Any]:
        return {
            "journal_mode": conn.execute("PRAGMA journal_mode").fetchone()[0],
            "synchronous": conn.execute("PRAGMA synchronous").fetchone()[0],
        }

    def _result(self, extra: dict[str, Any]) -> CallsResult:
        return CallsResult(self.call_s, self.total_s, workload.EFFECT.executed, self.results, extra)

    def cold(self, db: Path, calls: int) -> CallsResult:
        self.mode = "cold"
        conn = sqlite3.connect(db, check_same_thread=False)
        try:
            flow = self._flow(conn)
            try:
                flow.invoke(calls, self._config(), durability="sync")
            except Crash:
                pass
            else:
                raise RuntimeError("the entrypoint returned instead of crashing")
            pragmas = self._pragmas(conn)
        finally:
            conn.close()
        return self._result(pragmas)

    def warm(self, db: Path, calls: int, *, tolerant: bool = False) -> CallsResult:
        # A re-executed task is counted by the effect counter; nothing raises here.
        self.mode = "warm"
        conn = sqlite3.connect(db, check_same_thread=False)
        try:
            flow = self._flow(conn)
            t0 = time.perf_counter()
            out = flow.invoke(None, self._config(), durability="sync")
            wall = time.perf_counter() - t0
        finally:
            conn.close()
        if out != calls:
            raise RuntimeError(f"the resumed entrypoint returned {out!r}")
        return self._result({"resume_invoke_ms": wall * 1e3})

    def probe_child(self, db: Path, calls: int) -> None:
        self.mode = "probe"
        conn = sqlite3.connect(db, check_same_thread=False)
        self._flow(conn).invoke(calls, self._config(), durability="sync")
        raise RuntimeError("the probe's entrypoint returned")  # os._exit never ran

    def recorded(self, db: Path, calls: int) -> int:
        # The tasks' results are pending writes on the thread's checkpoint, one
        # ``__return__`` write per finished task.
        conn = sqlite3.connect(db)
        try:
            (n,) = conn.execute(
                "SELECT count(DISTINCT task_id) FROM writes "
                "WHERE thread_id = ? AND channel = '__return__'",
                (THREAD,),
            ).fetchone()
        finally:
            conn.close()
        return int(n)
