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
from onceonly.console import Accounts, Role
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


def test_migrate_console_creates_the_consoles_tables_for_a_role_that_cannot(url: str) -> None:
    """A DBA applies the console's tables with the rest (or prints them with --sql); the
    console then opens a database it may not create tables in."""
    _invoke("migrate", "--url", url)
    assert not {t for t in _tables(url) if t.startswith("oo_console_")}
    printed = _invoke("migrate", "--url", url, "--console", "--sql").stdout
    for table in ("users", "tokens", "snoozes", "link_uses"):
        assert f"CREATE TABLE oo_console_{table}" in printed
    assert "CREATE TABLE oo_runs" not in printed  # current already
    assert "console schema: applied 1" in _invoke("migrate", "--url", url, "--console").stdout
    assert {"oo_console_users", "oo_console_tokens"} <= _tables(url)
    with Store.open(url, create=False) as store:
        accounts = Accounts(store, create=False)
        accounts.add("olivia", Role.VIEWER, "a long passphrase 2026")
        assert [u.name for u in accounts.users()] == ["olivia"]
    assert "console schema: applied 0" in _invoke("migrate", "--url", url, "--console").stdout


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
        "code_version": "0",
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


# -- a CLI that reads well --------------------------------------------------------------------


def _run_in(url: str, *args: str, tty: bool = False, columns: int = 80) -> tuple[int, str, str]:
    """The console script with stdout a pipe, or (``tty``) a terminal ``columns`` wide."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.pop("ONCEONLY_DATABASE_URL", None)
    env.pop("ONCEONLY_SECRETS", None)
    if not tty:
        proc = subprocess.run(
            [str(ONCEONLY), *args, "--url", url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        return proc.returncode, proc.stdout, proc.stderr
    import pty

    env.update(COLUMNS=str(columns), LINES="50", TERM="xterm")
    leader, follower = pty.openpty()
    proc2 = subprocess.Popen(
        [str(ONCEONLY), *args, "--url", url],
        stdout=follower,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(follower)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the command exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc2.stderr is not None
    with proc2.stderr:
        err = proc2.stderr.read().decode()
    code = proc2.wait(timeout=120)
    out = b"".join(chunks).decode().replace("\r\n", "\n")
    return code, out, err


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


MARKUP_IDS = ["po[/x]", "po[bold]9", "[red]x[/red]"]


def _markup_runs(url: str) -> None:
    with Store.open(url) as store:
        for rid in MARKUP_IDS:
            store.create_run("f[/b]", run_id=rid, next_step="s[i]")
            store.save(rid, {"note": "[bold]hi"}, step="s[i]", next_step="s[i]")


@pytest.mark.slow
@pytest.mark.parametrize("tty", [False, True], ids=["piped", "terminal"])
def test_user_text_is_never_read_as_markup(url: str, tty: bool) -> None:
    _markup_runs(url)
    code, out, err = _run_in(url, "runs", "list", tty=tty)
    assert code == 0, out + err
    out = _strip_ansi(out)
    for rid in MARKUP_IDS:
        assert rid in out
    assert "f[/b]" in out
    for rid in MARKUP_IDS:
        code, out, err = _run_in(url, "runs", "show", rid, tty=tty)
        assert code == 0, out + err
        assert f"run {rid}" in _strip_ansi(out) if tty else json.loads(out)["run_id"] == rid
    code, out, err = _run_in(url, "runs", "show", "po[/x]", "--tables")
    assert code == 0, out + err
    assert "run po[/x]" in out
    code, out, err = _run_in(url, "runs", "show", "no[/such]run")
    assert code == 1
    assert "no[/such]run" in err


def test_a_piped_list_is_one_plain_line_a_run(url: str) -> None:
    long_id = "run-" + "0123456789abcdef" * 4  # wider than a shared 80-column row
    with Store.open(url) as store:
        store.create_run("a-flow-with-a-long-name", run_id=long_id, next_step="step-one")
        store.create_run("short", run_id="r2")
    env = {"COLUMNS": "80"}
    out = CliRunner().invoke(cli, ["runs", "list", "--url", url], env=env).stdout
    lines = out.splitlines()
    assert lines[0].split() == [
        "run", "id", "flow", "status", "next", "step", "waiting", "on", "lease", "ckpts", "updated"
    ]  # fmt: skip
    assert len(lines) == 3  # a heading and a line a run: nothing wrapped
    assert lines[2].split()[:3] == [long_id, "a-flow-with-a-long-name", "running"]
    assert not set(out) & set("┏━┃│┡└─")  # no borders


@pytest.mark.slow
def test_a_terminal_table_at_80_columns_keeps_ids_whole(url: str) -> None:
    ids = [uuid_hex(i) for i in range(3)]
    with Store.open(url) as store:
        for rid in ids:
            store.create_run("vendor-onboarding", run_id=rid, next_step="collect_documents")
    code, out, err = _run_in(url, "runs", "list", tty=True, columns=80)
    assert code == 0, err
    text = _strip_ansi(out)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for rid in ids:
        assert rid in text  # on one line, to copy


def uuid_hex(i: int) -> str:
    return f"{i:032x}"


def test_the_status_choices_are_the_stores() -> None:
    from onceonly.cli.effects import EFFECT_STATUSES
    from onceonly.cli.runs import RUN_STATUSES
    from onceonly.ledger import EffectStatus

    assert tuple(s.value for s in RunStatus) == RUN_STATUSES
    assert tuple(s.value for s in EffectStatus) == EFFECT_STATUSES


@pytest.mark.slow
def test_errors_under_json_are_json(url: str) -> None:
    _populate(url)
    code, out, err = _run_in(url, "runs", "show", "no-such-run", "--json")
    assert code == 1
    assert err.startswith("error:")  # a person still reads it on stderr
    doc = json.loads(out)
    assert doc["error"]["type"] == "RunNotFound"
    assert "no-such-run" in doc["error"]["message"]
    assert doc["error"]["exit_code"] == 1
    code, out, _err = _run_in(url, "runs", "list", "--status", "nope", "--json")
    assert code == 2
    assert json.loads(out)["error"]["exit_code"] == 2


@pytest.mark.slow
def test_a_missing_sqlite_directory_is_named(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"
    for args in (["runs", "list"], ["migrate"]):
        code, _out, err = _run_in(url, *args)
        assert code == 1
        assert "no directory" in err
        assert str(tmp_path / "no-such-dir") in err
        assert "server" not in err.replace("needs no server", "")


def test_runs_list_on_a_mistyped_sqlite_path_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "typo.db"
    result = CliRunner().invoke(cli, ["runs", "list", "--url", f"sqlite:///{path}"])
    assert result.exit_code == 1
    assert "no SQLite database at" in str(result.exception)
    assert not path.exists()


# -- a fast start -----------------------------------------------------------------------------

HEAVY = ("onceonly.adapters", "sqlalchemy", "psycopg", "httpx", "langgraph", "rich")


@pytest.mark.slow
@pytest.mark.parametrize(
    "code",
    [
        "import onceonly",
        "import onceonly.cli",
        # main(), as the console script calls it
        "from onceonly.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass",
        "from onceonly.cli import main\ntry: main(['runs', '--help'])\nexcept SystemExit: pass",
        "from onceonly.cli import main\ntry: main(['effects', '--help'])\nexcept SystemExit: pass",
    ],
)
def test_import_and_help_load_no_heavy_module(code: str) -> None:
    heavy = f"[m for m in sys.modules if m in {HEAVY!r} or m.split('.')[0] in {HEAVY!r}]"
    probe = f"import sys\n{code}\nprint({heavy})"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_the_public_names_load_on_first_use() -> None:
    probe = (
        "import sys, onceonly\n"
        "assert 'onceonly.runtime' not in sys.modules\n"
        "from onceonly import Flow, Worker\n"
        "assert Worker.__module__ == 'onceonly.worker' and Flow.__module__ == 'onceonly.flow'\n"
        "assert set(onceonly.__all__) <= set(dir(onceonly))\n"
        "try:\n    onceonly.NoSuchName\nexcept AttributeError:\n    print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.slow
def test_commands_on_sqlite_do_not_import_the_postgresql_driver(tmp_path: Path) -> None:
    """psycopg is for PostgreSQL only: a store, a ledger and the read commands on SQLite
    run without it (it is not even imported)."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    probe = (
        "import sys\n"
        "from onceonly.checkpoint import Store\n"
        "from onceonly.ledger import Keyring, Ledger, Secret\n"
        f"s = Store.open({url!r}); Ledger(s, Keyring([Secret('k', bytes(32))])).close()\n"
        "s.close()\n"
        "from onceonly.cli import main\n"
        "for args in (['runs', 'list'], ['effects', 'list']):\n"
        "    try: main([*args, '--url', sys.argv[1]])\n"
        "    except SystemExit as e: assert not e.code, e.code\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'psycopg'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "ONCEONLY_SECRETS": "k:" + "00" * 32},
    )
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
