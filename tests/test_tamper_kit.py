"""The third-party tamper kit agent-memory-integrity 0.6.3 (``agmi-check``) against four
stores (effects, checkpoints, audit, waits), on SQLite and PostgreSQL.

Each store's adapter (``tests/agmi_adapters.py``) lets the kit make its nine edits (T1
content tamper .. T9 snapshot rollback) by raw SQL; its ``verify()`` is the path that acts
(the audit store: ``Ledger.verify``). The kit runs as its users run it, in a subprocess
with ``--json``; every cell is read from that file. Positive controls (a ledger whose
read check is switched off, a checkpoint store opened without keys) must be caught
accepting edits, so the harness can fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly.checkpoint import OnceOnlyError

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["sqlite"] if os.environ.get("ONCEONLY_TEST_NO_PG") == "1" else ["sqlite", "postgresql"]
STORES = {"effects": "Effects", "checkpoints": "Checkpoints", "audit": "Audit", "waits": "Waits"}
CLASS_SUFFIX = {"sqlite": "Sqlite", "postgresql": "Postgres"}
EDITS = [
    "tamper",
    "truncate",
    "delete_middle",
    "reorder",
    "forge",
    "cross_replay",
    "rollback_replay",
    "metadata_tamper",
    "snapshot_rollback",
]
CONTROLS = ("EffectsSqliteUnchecked", "CheckpointsSqliteUnkeyed")
# The typed refusals a rejection must name (not an incidental crash).
REFUSALS = ("CorruptRecord", "StoreRolledBack", "RunRolledBack", "WaitNotFound")

# Measured defects, kept failing on purpose (strict xfail: the day they are fixed, the
# test says so). None at present.
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


def _run_kit(adapter: str, out: Path, pg_url: str | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("ONCEONLY_WITNESS", None)  # the adapters configure their own
    if pg_url is not None:
        env["ONCEONLY_TEST_PG_URL"] = pg_url
    cmd = [
        sys.executable,
        "-m",
        "agmi.check",
        "--adapter",
        f"tests.agmi_adapters:{adapter}",
        "--json",
        str(out),
        "--fail-on",
        "none",
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@pytest.fixture(scope="module")
def kit(request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, Any]]]:
    """Every adapter's ``--json`` row, by adapter class name (the runs go in parallel)."""
    pg_url = request.getfixturevalue("pg_server_url") if "postgresql" in BACKENDS else None
    adapters = [s + CLASS_SUFFIX[b] for s in STORES.values() for b in BACKENDS] + list(CONTROLS)
    with tempfile.TemporaryDirectory(prefix="agmi-kit-") as tmp:
        procs = {a: _run_kit(a, Path(tmp) / f"{a}.json", pg_url) for a in adapters}
        results: dict[str, dict[str, Any]] = {}
        for a, proc in procs.items():
            output, _ = proc.communicate(timeout=240)
            # --fail-on none: 0, or 3 when an edit did not land (read from the JSON below)
            assert proc.returncode in (0, 3), output.decode(errors="replace")
            data = json.loads((Path(tmp) / f"{a}.json").read_text())
            results[a] = {"tool": data["tool"], "cells": {r["attack"]: r for r in data["edits"]}}
        yield results


def _cells(kit: dict[str, dict[str, Any]], store: str, backend: str) -> dict[str, Any]:
    cells: dict[str, Any] = kit[STORES[store] + CLASS_SUFFIX[backend]]["cells"]
    return cells


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("store", list(STORES))
def test_every_edit_is_evaluated(kit: dict[str, dict[str, Any]], store: str, backend: str) -> None:
    cells = _cells(kit, store, backend)
    assert sorted(cells) == sorted(EDITS)
    verdicts = {a: c["verdict"] for a, c in cells.items()}
    assert "NOT EVALUABLE" not in verdicts.values(), cells
    assert "ERROR" not in verdicts.values(), cells


def _cell_params() -> list[Any]:
    params = []
    for store in STORES:
        for backend in BACKENDS:
            for edit in EDITS:
                why = KNOWN_DEFECTS.get((store, edit))
                marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
                params.append(pytest.param(store, backend, edit, marks=marks))
    return params


@pytest.mark.parametrize(("store", "backend", "edit"), _cell_params())
def test_the_edit_is_refused_where_it_would_act(
    kit: dict[str, dict[str, Any]], store: str, backend: str, edit: str
) -> None:
    cell = _cells(kit, store, backend)[edit]
    expected = "REPORTED" if store == "audit" else "REJECTED"
    assert cell["verdict"] == expected, cell
    if store != "audit":
        assert any(f"{name}:" in cell["detail"] for name in REFUSALS), cell


def test_the_harness_catches_a_ledger_that_does_not_check_what_it_reads(
    kit: dict[str, dict[str, Any]],
) -> None:
    cells = kit["EffectsSqliteUnchecked"]["cells"]
    accepted = {a for a, c in cells.items() if c["verdict"] == "ACCEPTED"}
    # An effect flipped to "not happened" is sent again; a witness-less store restores.
    assert {"tamper", "snapshot_rollback"} <= accepted, cells


def test_the_harness_catches_a_checkpoint_store_opened_without_keys(
    kit: dict[str, dict[str, Any]],
) -> None:
    cells = kit["CheckpointsSqliteUnkeyed"]["cells"]
    # A state edited with its unkeyed digest recomputed loads as genuine.
    assert cells["tamper"]["verdict"] == "ACCEPTED", cells


# -- T7 as the library meets it: an older genuine version of the same row ----------------
# The kit's T7 copies the oldest record over the newest; a row put back to an earlier
# version of *itself* carries a seal that verifies, which is the harder case.


@pytest.fixture
def pg_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    if backend == "postgresql":
        monkeypatch.setenv("ONCEONLY_TEST_PG_URL", request.getfixturevalue("pg_server_url"))


@pytest.mark.usefixtures("pg_env")
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_effect_put_back_to_its_claimed_version_is_not_sent_again(backend: str) -> None:
    from tests import agmi_adapters

    adapter: agmi_adapters.EffectsSqlite = getattr(
        agmi_adapters, "Effects" + CLASS_SUFFIX[backend]
    )()
    adapter.setup()
    try:
        adapter.seed(3)
        assert adapter.verify()
        slot = adapter.slots[-1]
        older = adapter.versions[slot[0]]
        assert older["status"] == "claimed"
        adapter._update(slot, {k: v for k, v in older.items() if k != "key_id"})
        adapter.reload()
        sent = len(adapter.provider.sent)
        assert not adapter.verify()
        assert adapter.verify_detail is not None
        assert adapter.verify_detail.startswith("CorruptRecord:"), adapter.verify_detail
        assert len(adapter.provider.sent) == sent
    finally:
        adapter.teardown()


@pytest.mark.usefixtures("pg_env")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rejected_approval_put_back_to_open_is_not_acted_on(backend: str) -> None:
    from onceonly.checkpoint import Waits
    from tests import agmi_adapters

    adapter: agmi_adapters.WaitsSqlite = getattr(agmi_adapters, "Waits" + CLASS_SUFFIX[backend])()
    adapter.setup()
    try:
        adapter.seed(1)
        [(rid, name, _instance)] = adapter.slots
        older = adapter._row(adapter.slots[0])
        assert older is not None
        assert older["status"] == "open"
        assert adapter.runtime is not None
        Waits(adapter.runtime.store).reject(rid, name, actor="bob", reason="no")
        adapter._update(adapter.slots[0], {k: v for k, v in older.items() if k != "run_id"})
        adapter.reload()
        assert adapter.runtime is not None
        rt = adapter.runtime
        with contextlib.suppress(OnceOnlyError):
            wait = Waits(rt.store).get(rid, name)
            assert wait.subject_hash is not None
            Waits(rt.store).approve(rid, name, actor="carol", subject_hash=wait.subject_hash)
        with contextlib.suppress(OnceOnlyError):
            rt.drive(rid)
        assert adapter.provider.sent == []
    finally:
        adapter.teardown()
