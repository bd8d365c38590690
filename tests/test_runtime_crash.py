"""Runs resume across real processes killed with SIGKILL, on SQLite and PostgreSQL.

A worker process (``tests/runtime_worker.py``) drives a run whose effects go to a
provider that outlives it (an fsynced append-only file: the oracle). One run is driven
by a chain of workers, each killed at the next kill point of the flow (every step start
and end, every delivery before and after the ledger records it), then a last worker
finishes it. Every effect must have reached the provider exactly once, the run must be
complete, and the ledger's audit chains must verify.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from onceonly.checkpoint import RunStatus, Store
from tests.runtime_worker import KILL_POINTS, deliveries, open_ledger

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def worker(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("KILL_AT", None)
    if kill_at is not None:
        env["KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "tests.runtime_worker", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def check_once(path: Path, expected: dict[str, int]) -> None:
    got = deliveries(path)
    keys = [k for _, k, _ in got]
    assert len(keys) == len(set(keys)), f"a provider key was delivered twice: {got}"
    assert collections.Counter(e for e, _, _ in got) == expected


def check_ledger(db_url: str, run_id: str) -> None:
    ledger = open_ledger(db_url)
    try:
        report = ledger.verify()
        assert report.ok, report.to_json()
        assert ledger.store.get_run(run_id).status is RunStatus.COMPLETED
    finally:
        ledger.close()
        ledger.store.close()


def test_a_run_killed_at_every_point_completes_with_each_effect_once(
    db_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "deliveries"
    Store.open(db_url).close()  # the schema exists before the first worker
    for point in KILL_POINTS:
        done = worker("run", db_url, "crash", "run-1", str(path), kill_at=point)
        assert done.returncode == -signal.SIGKILL, (point, done.stdout, done.stderr)
    last = worker("run", db_url, "crash", "run-1", str(path))
    assert last.returncode == 0, last.stderr
    assert last.stdout.strip() == "status completed"
    check_once(path, {"reserve@1": 1, "email@1": 2, "charge@1": 1})
    payloads = sorted(p["to"] for e, _, p in deliveries(path) if e == "email@1")
    assert payloads == ["a@example.com", "b@example.com"]
    check_ledger(db_url, "run-1")
    again = worker("run", db_url, "crash", "run-1", str(path))  # a completed run stays so
    assert again.stdout.strip() == "status completed"
    check_once(path, {"reserve@1": 1, "email@1": 2, "charge@1": 1})


def test_an_approval_from_another_process_resumes_in_a_fresh_worker(
    db_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "deliveries"
    Store.open(db_url).close()
    first = worker("run", db_url, "approval", "run-2", str(path))
    assert first.stdout.strip() == "status waiting", first.stderr
    check_once(path, {"reserve@1": 1})
    denied = worker("approve", db_url, "run-2", "charge", "alice")  # the requester
    assert denied.returncode != 0
    assert "WaitRefused" in denied.stderr
    approved = worker("approve", db_url, "run-2", "charge", "bob")
    assert approved.stdout.strip() == "approved", approved.stderr
    killed = worker("run", db_url, "approval", "run-2", str(path), kill_at="finish:sent-1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    last = worker("run", db_url, "approval", "run-2", str(path))
    assert last.stdout.strip() == "status completed", last.stderr
    check_once(path, {"reserve@1": 1, "charge@1": 1})
    check_ledger(db_url, "run-2")
