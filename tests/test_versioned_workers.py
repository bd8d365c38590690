"""Worker processes of two flow versions side by side, on SQLite and PostgreSQL.

Real ``onceonly worker`` processes, one per release (``tests/version_flows.py``), drive
runs started under either version on one database: every run is driven, end to end, by
the worker of its own version (each raw delivery names the process that made it). Then
the version 1 worker is stopped, as a deploy that retires it would: a run it left
waiting and a run started afterwards under version 1 are listed by ``runs list
--unserved``; ``runs upgrade`` moves them to version 2, whose worker finishes them. The
waiting run's first effect, sent by the old worker, is not sent again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly.checkpoint import RunStatus, Store, migrate
from onceonly.ledger import Ledger
from onceonly.ledger import migrate as ledger_migrate
from onceonly.registry import migrate as registry_migrate
from onceonly.runtime import Runtime
from tests.ledger_support import K1, keyring
from tests.test_cli_operator import _script
from tests.test_worker import wait_until
from tests.version_flows import V1, V2, deliveries

ROOT = Path(__file__).resolve().parent.parent
ONCEONLY = Path(sys.executable).parent / "onceonly"
SECRETS = f"k1:{K1.value.hex()}"
SETTLE_S = 120  # generous: a loaded machine drives these in well under a second


def _env(url: str, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(
        ONCEONLY_DATABASE_URL=url,
        ONCEONLY_SECRETS=SECRETS,
        USER="ops",
        PYTHONPATH=str(ROOT),
        ONCEONLY_WORKER_NAME=name,
    )
    return env


def _cli(url: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = _script(url, *args)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


class _Worker:
    """An ``onceonly worker`` process serving one release."""

    def __init__(self, url: str, spec: str, name: str, log: Path) -> None:
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen(
            [str(ONCEONLY), "worker", "--flows", spec, "--poll-s", "0.1"],
            cwd=ROOT,
            env=_env(url, name),
            stdout=self._fh,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int:
        """SIGTERM (drain), and its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=SETTLE_S)
        finally:
            self._fh.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._fh.close()


@pytest.fixture
def url(db_url: str) -> str:
    migrate(db_url)
    ledger_migrate(db_url)
    registry_migrate(db_url)
    return db_url


@pytest.fixture
def workers(url: str) -> Iterator[dict[str, _Worker]]:
    started: dict[str, _Worker] = {}
    yield started
    for w in started.values():
        w.kill()


def _starter(store: Store, flow: Any) -> Runtime:
    """Starts runs of one release from this process (it drives none)."""
    return Runtime(store, Ledger(store, keyring(), owner="starter"), [flow], owner="starter")


def _status(store: Store, rid: str) -> RunStatus:
    return store.get_run(rid).status


def _log_of(w: _Worker) -> str:
    return w.log.read_text(encoding="utf-8", errors="replace")


def test_two_releases_drive_their_own_runs_and_an_upgrade_moves_the_rest(
    url: str, tmp_path: Path, workers: dict[str, _Worker]
) -> None:
    outbox = tmp_path / "outbox"
    with Store.open(url) as store:
        v1, v2 = _starter(store, V1), _starter(store, V2)
        runs = {}
        for rid, starter in [("a0", v1), ("a1", v1), ("a2", v1), ("b0", v2), ("b1", v2)]:
            runs[rid] = starter.start("ship", {"outbox": f"{outbox}-{rid}"}, run_id=rid)
        version = {rid: "1" if rid.startswith("a") else "2" for rid in runs}
        workers["v1"] = _Worker(url, "tests.version_flows:V1", "w-v1", tmp_path / "w1.log")
        workers["v2"] = _Worker(url, "tests.version_flows:V2", "w-v2", tmp_path / "w2.log")
        pid = {"1": workers["v1"].pid, "2": workers["v2"].pid}
        wait_until(
            lambda: all(_status(store, r) is RunStatus.WAITING for r in runs),
            SETTLE_S,
            "every run prepared and waiting for go",
        )
        live = json.loads(_cli(url, "workers", "--json").stdout)
        assert sorted((w["served"]["ship"], w["live"]) for w in live) == [
            (["1"], True),
            (["2"], True),
        ]
        assert json.loads(_cli(url, "runs", "list", "--unserved", "--json").stdout) == []
        for rid in runs:
            _cli(url, "signal", rid, "go")
        wait_until(
            lambda: all(_status(store, r) is RunStatus.COMPLETED for r in runs),
            SETTLE_S,
            "every run completed",
        )
        for rid in runs:
            v = version[rid]
            got = deliveries(f"{outbox}-{rid}")
            assert [(d["what"], d["version"], d["pid"]) for d in got] == [
                ("prepare", v, pid[v]),
                ("send", v, pid[v]),
            ], rid
            assert store.load(rid).state["result"] == {"sent_by": v, "run_version": v}

        # version 1 retired: one of its runs left waiting, one started after it stopped
        v1.start("ship", {"outbox": f"{outbox}-late"}, run_id="late")
        wait_until(lambda: _status(store, "late") is RunStatus.WAITING, SETTLE_S, "late prepared")
        assert workers["v1"].stop() == 0
        v1.start("ship", {"outbox": f"{outbox}-new"}, run_id="new")
        unserved = _cli(url, "runs", "list", "--unserved", "--json", ok=False)
        assert unserved.returncode == 1
        assert sorted(r["run_id"] for r in json.loads(unserved.stdout)) == ["late", "new"]
        assert json.loads(_cli(url, "workers", "--json").stdout)[0]["served"] == {"ship": ["2"]}

        _cli(url, "signal", "late", "go")
        for rid in ("late", "new"):
            up = _cli(
                url, "runs", "upgrade", rid, "--to", "2", "--flows", "tests.version_flows:V2",
                "--reason", "retire version 1",
            )  # fmt: skip
            assert f"upgraded {rid} from version 1 to 2" in up.stdout
        wait_until(
            lambda: _status(store, "new") is RunStatus.WAITING, SETTLE_S, "new prepared by v2"
        )
        _cli(url, "signal", "new", "go")
        wait_until(
            lambda: all(_status(store, r) is RunStatus.COMPLETED for r in ("late", "new")),
            SETTLE_S,
            "the upgraded runs completed",
        )
        late = deliveries(f"{outbox}-late")
        assert [(d["what"], d["version"]) for d in late] == [("prepare", "1"), ("send", "2")]
        assert (late[0]["pid"], late[1]["pid"]) == (pid["1"], pid["2"])
        new = deliveries(f"{outbox}-new")
        assert [(d["what"], d["version"], d["pid"]) for d in new] == [
            ("prepare", "2", pid["2"]),
            ("send", "2", pid["2"]),
        ]
        assert store.load("late").state["result"] == {"sent_by": "2", "run_version": "2"}
        sources = [str(c.source) for c in store.history("late")]
        assert any("operator" in s for s in sources), sources
    assert workers["v2"].stop() == 0
