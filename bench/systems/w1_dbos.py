"""The DBOS peer in W1: one ``@DBOS.step`` per guarded call inside a ``@DBOS.workflow``,
on a SQLite system database created beforehand in WAL mode.

Cold: the workflow (started with a fixed id) makes N step calls, tells the phase it is
done and blocks; the phase reports and ends the process with ``os._exit`` (a crash: the
workflow stays PENDING). Warm: a fresh process launches DBOS, which recovers the pending
workflow; it runs again from the start and every step returns its recorded output. The
probe ``os._exit``s inside the workflow right after the 50th step returns.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from dbos import DBOS, SetWorkflowID

from bench import workload

from . import CallsResult, W1System

WORKFLOW_ID = "w1-workflow"
APP_VERSION = "onceonly-bench-w1"  # fixed, so the relaunch recovers the cold run's workflow
RECOVERY_TIMEOUT_S = 300


class _State:
    """What the workflow does after call N, and what it measured (one per process)."""

    def __init__(self) -> None:
        self.mode = "cold"
        self.call_s: list[float] = []
        self.results: list[Any] = []
        self.total_s = 0.0
        self.done = threading.Event()
        self.error: BaseException | None = None


STATE = _State()


@DBOS.step()
def send_email(arg: dict[str, Any]) -> dict[str, Any]:
    """The guarded call: one DBOS step."""
    return workload.send_email(arg)


@DBOS.workflow()
def send_invoices(calls: int) -> int:
    """N guarded calls in one workflow."""
    st = STATE
    try:
        clock = time.perf_counter
        args = [workload.make_arg(i) for i in range(calls)]
        t_first = clock()
        for arg in args:
            t0 = clock()
            result = send_email(arg)
            if st.mode == "probe" and len(st.results) + 1 == calls:
                os._exit(0)
            st.call_s.append(clock() - t0)
            st.results.append(result)
        st.total_s = clock() - t_first
    except BaseException as exc:
        st.error = exc
        st.done.set()
        raise
    st.done.set()
    if st.mode == "cold":
        threading.Event().wait()  # the phase ends the process: a crash after call N
    return calls


def _launch(db: Path, *, create: bool) -> float:
    if create:
        if db.exists():
            raise FileExistsError(db)
        conn = sqlite3.connect(db)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        conn.close()
        if mode != "wal":
            raise RuntimeError(f"sqlite refused WAL: {mode}")
    t0 = time.perf_counter()
    DBOS(
        config={
            "name": "onceonly-bench-w1",
            "system_database_url": f"sqlite:///{db}",
            "application_version": APP_VERSION,
            "log_level": "WARNING",
        }
    )
    DBOS.launch()
    return time.perf_counter() - t0


def _pragmas() -> dict[str, Any]:
    """journal_mode and synchronous as DBOS's own connections see them."""
    try:
        from dbos._dbos import _get_dbos_instance

        engine = _get_dbos_instance()._sys_db.engine
        with engine.connect() as conn:
            drv = conn.connection.driver_connection
            return {
                "journal_mode": drv.execute("PRAGMA journal_mode").fetchone()[0],
                "synchronous": drv.execute("PRAGMA synchronous").fetchone()[0],
            }
    except Exception as exc:  # noqa: BLE001  (a report detail, not a figure)
        return {"pragmas": f"unreadable: {exc!r}"}


class DbosSteps(W1System):
    name = "dbos"

    @staticmethod
    def _wait() -> None:
        if not STATE.done.wait(RECOVERY_TIMEOUT_S):
            raise TimeoutError("the workflow did not finish its calls")
        if STATE.error is not None:
            raise STATE.error

    def cold(self, db: Path, calls: int) -> CallsResult:
        STATE.mode = "cold"
        launch_s = _launch(db, create=True)
        with SetWorkflowID(WORKFLOW_ID):
            DBOS.start_workflow(send_invoices, calls)
        self._wait()
        extra = {"launch_ms": launch_s * 1e3, **_pragmas()}
        return CallsResult(
            STATE.call_s,
            STATE.total_s,
            workload.EFFECT.executed,
            STATE.results,
            extra,
            hard_exit=True,
        )

    def warm(self, db: Path, calls: int, *, tolerant: bool = False) -> CallsResult:
        # A re-executed step is counted by the effect counter; nothing raises here.
        STATE.mode = "warm"
        t0 = time.perf_counter()
        launch_s = _launch(db, create=False)  # recovers the pending workflow
        out = DBOS.retrieve_workflow(WORKFLOW_ID).get_result(polling_interval_sec=0.01)
        wall = time.perf_counter() - t0
        self._wait()
        DBOS.destroy()
        if out != calls:
            raise RuntimeError(f"the recovered workflow returned {out!r}")
        return CallsResult(
            STATE.call_s,
            STATE.total_s,
            workload.EFFECT.executed,
            STATE.results,
            {"launch_ms": launch_s * 1e3, "launch_to_result_ms": wall * 1e3},
        )

    def probe_child(self, db: Path, calls: int) -> None:
        STATE.mode = "probe"
        _launch(db, create=True)
        with SetWorkflowID(WORKFLOW_ID):
            DBOS.start_workflow(send_invoices, calls)
        self._wait()  # the workflow os._exits after the last call; this only reports errors
        raise RuntimeError("the probe's workflow finished instead of exiting")

    def recorded(self, db: Path, calls: int) -> int:
        conn = sqlite3.connect(db)
        try:
            (n,) = conn.execute(
                "SELECT count(*) FROM operation_outputs WHERE workflow_uuid = ? "
                "AND function_name LIKE '%send_email' AND error IS NULL",
                (WORKFLOW_ID,),
            ).fetchone()
        finally:
            conn.close()
        return int(n)
