"""The ``onceonly`` command line: migrate, runs list/show, errors, and the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, inspect

from onceonly.checkpoint import Codec, Handoff, RunStatus, Store
from onceonly.cli import cli
from tests.values import Point, make_codec

ONCEONLY = Path(sys.executable).parent / "onceonly"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.db'}"


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _populate(url: str) -> dict[str, Any]:
    """Three runs; returns what the CLI should report about them."""
    with Store.open(url, codec=make_codec()) as store:
        a = store.create_run("onboarding", run_id="run-a", next_step="collect").run_id
        store.save(a, {"docs": ["w9.pdf"], "raw": b"\x00\x01"}, step="collect", next_step="review")
        store.save(
            a,
            {"docs": ["w9.pdf", "bank.pdf"], "raw": b"\x00\x01", "point": Point(1, 2)},
            step="review",
            next_step=None,
            status=RunStatus.COMPLETED,
        )
        store.update_run(
            a, handoff=Handoff(goal="onboard ACME", done=("collect", "review"), ruled_out=("x",))
        )
        time.sleep(0.01)
        b = store.create_run("billing", run_id="run-b", next_step="charge").run_id
        store.save(b, {"amount": 10}, step="quote", status=RunStatus.WAITING)
        time.sleep(0.01)
        c = store.create_run("billing", run_id="run-c").run_id
    return {"a": a, "b": b, "c": c}


# -- migrate -------------------------------------------------------------------------------


def test_migrate_sql_prints_the_ddl_and_creates_nothing(url: str) -> None:
    result = _invoke("migrate", "--url", url, "--sql")
    for table in ("onceonly_schema", "oo_runs", "oo_checkpoints", "oo_blobs", "oo_blob_refs"):
        assert f"CREATE TABLE {table}" in result.stdout
    assert _tables(url) == set()


def test_migrate_creates_the_schema_once(url: str) -> None:
    first = _invoke("migrate", "--url", url)
    assert "checkpoint schema: applied 5" in first.stdout
    assert {"oo_runs", "oo_checkpoints", "oo_blobs"} <= _tables(url)
    with Store.open(url, create=False) as store:
        store.create_run("f")
    second = _invoke("migrate", "--url", url)
    assert "checkpoint schema: applied 0" in second.stdout
    assert "CREATE TABLE oo_runs" not in _invoke("migrate", "--url", url, "--sql").stdout


def test_the_database_url_can_come_from_the_environment(url: str) -> None:
    _invoke("migrate", env={"ONCEONLY_DATABASE_URL": url})
    assert "oo_runs" in _tables(url)
    _populate(url)
    listed = json.loads(
        _invoke("runs", "list", "--json", env={"ONCEONLY_DATABASE_URL": url}).stdout
    )
    assert [r["run_id"] for r in listed] == ["run-c", "run-b", "run-a"]


# -- runs ------------------------------------------------------------------------------------


def test_runs_list_json(url: str) -> None:
    ids = _populate(url)
    listed = json.loads(_invoke("runs", "list", "--url", url, "--json").stdout)
    assert [r["run_id"] for r in listed] == [ids["c"], ids["b"], ids["a"]]
    by_id = {r["run_id"]: r for r in listed}
    assert by_id[ids["a"]] | {"updated_at": 0} == {
        "run_id": ids["a"],
        "flow": "onboarding",
        "status": "completed",
        "next_step": None,
        "head_seq": 1,
        "updated_at": 0,
        "waiting_on": [],
        "lease_owner": None,
        "lease_expires_at": None,
    }
    assert (by_id[ids["b"]]["status"], by_id[ids["b"]]["next_step"]) == ("waiting", "charge")
    assert by_id[ids["b"]]["head_seq"] == 0
    assert by_id[ids["c"]]["head_seq"] is None
    waiting = json.loads(
        _invoke("runs", "list", "--url", url, "--json", "--status", "waiting").stdout
    )
    assert [r["run_id"] for r in waiting] == [ids["b"]]


def test_runs_list_table(url: str) -> None:
    ids = _populate(url)
    out = _invoke("runs", "list", "--url", url).stdout
    for rid in ids.values():
        assert rid in out
    assert "onboarding" in out
    assert "waiting" in out


def test_runs_show_json(url: str) -> None:
    ids = _populate(url)
    doc = json.loads(_invoke("runs", "show", ids["a"], "--url", url, "--json").stdout)
    assert doc["run_id"] == ids["a"]
    assert (doc["flow"], doc["status"], doc["next_step"]) == ("onboarding", "completed", None)
    assert doc["handoff"] == {
        "goal": "onboard ACME",
        "done": ["collect", "review"],
        "next": [],
        "ruled_out": ["x"],
    }
    assert [(h["seq"], h["step"], h["source"]) for h in doc["history"]] == [
        (0, "collect", "step"),
        (1, "review", "step"),
    ]
    assert doc["history"][0]["keyframe"] is True
    state = doc["state"]
    assert state["docs"] == ["w9.pdf", "bank.pdf"]
    # tagged values stay in canonical codec form
    assert Codec().decode(json.dumps({"raw": state["raw"]})) == {"raw": b"\x00\x01"}
    # a dataclass this process has not registered is shown, not refused
    assert "tests.point.v1" in json.dumps(state["point"])
    empty = json.loads(_invoke("runs", "show", ids["c"], "--url", url, "--json").stdout)
    assert (empty["history"], empty["state"]) == ([], None)


def test_runs_show_pretty(url: str) -> None:
    ids = _populate(url)
    out = _invoke("runs", "show", ids["b"], "--url", url).stdout
    assert json.loads(out)["state"] == {"amount": 10}


# -- errors and the demo, through the installed console script ------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.pop("ONCEONLY_DATABASE_URL", None)
    return subprocess.run(
        [str(ONCEONLY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["runs", "list", "--url", "bad://x"], id="unknown-scheme"),
        pytest.param(["migrate", "--url", "nonsense"], id="malformed"),
        pytest.param(["runs", "list", "--url", "sqlite:///:memory:"], id="in-memory"),
        pytest.param(
            ["migrate", "--url", "postgresql+psycopg://u@/db?host=/nonexistent/dir"],
            id="unreachable",
        ),
        pytest.param(
            ["migrate", "--sql", "--url", "postgresql+psycopg://u@/db?host=/nonexistent/dir"],
            id="unreachable-sql",
        ),
    ],
)
def test_a_bad_url_is_one_line_and_exit_code_1(args: list[str]) -> None:
    proc = _run(*args)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")


@pytest.mark.slow
def test_a_missing_run_is_one_line_and_exit_code_1(url: str) -> None:
    _populate(url)
    proc = _run("runs", "show", "no-such-run", "--url", url)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no-such-run" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["approval", "random"])
def test_the_demo_resumes_not_restarts(tmp_path: Path, crash_at: str) -> None:
    db = tmp_path / "demo.db"
    proc = _run("demo", "--db", str(db), "--crash-at", crash_at, "--seed", "7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every effect happened once" in proc.stdout
    kills = int(proc.stdout.split("worker kills: ")[1].split(";")[0])
    assert kills >= 1
    with Store.open(f"sqlite:///{db}") as store:
        (run,) = store.list_runs()
        assert run.status is RunStatus.COMPLETED
        assert store.load(run.run_id).state["result"]["vendor_id"] == "V-000001"
    again = _run("demo", "--db", str(db))
    assert again.returncode == 2  # the demo wants a fresh database; nothing is touched
