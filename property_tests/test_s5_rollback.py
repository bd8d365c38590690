"""S5: rollback of the store (../shared/RELIABILITY.md).

A run of a generated flow (effects over provider classes A, B and C, to the fenced fake
provider) is driven to completion in this process while every committed write
transaction of the store is followed by a snapshot of the whole database (SQLite: the
backup API; PostgreSQL: ``pg_dump``). At the end the ledger's heads are exported to an
external witness file. Then every earlier snapshot is restored into a fresh database (the
world, i.e. the provider, is *not* rolled back) and judged:

* ``verify(witness=...)`` must flag the rollback whenever resuming from that snapshot
  would act again: a snapshot that resumes into a re-send and is not flagged is an
  *accepted* rollback (a failure);
* the guarded procedure (verify against the witness, refuse to resume a flagged store,
  resume an unflagged one) must apply nothing twice and complete the run (counted from
  the fake's raw log).

Positive control (S10): the same restores resumed by a ledger that trusts the snapshot
(no witness check) must re-send an effect the provider already applied, and the fake's
log must show it.
"""

from __future__ import annotations

import collections
import glob
import random
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text

from onceonly.checkpoint import RunStatus, Store, _connections
from onceonly.ledger import EffectStatus, Ledger
from onceonly.operator import Operator
from onceonly.runtime import Runtime

from .reliability import SuiteReport, scaled, seeds
from .s3_fakes import FencedAPI
from .s3_flows import FLOWS, labels_of, plan_for
from .s3_harness import KEYRING, migrate_all

pytestmark = pytest.mark.slow

OWNER = "s5-worker"


@pytest.fixture(scope="module")
def report() -> Iterator[SuiteReport]:
    rep = SuiteReport(suite="S5")
    yield rep
    rep.check()


@pytest.fixture(scope="module")
def api() -> Iterator[FencedAPI]:
    a = FencedAPI().start()
    yield a
    a.stop()


# -- snapshots ------------------------------------------------------------------------
def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None
    )
    if found is None:
        raise RuntimeError(f"{name} not found")
    return found


def _libpq(url: str) -> str:
    u = make_url(url)
    host = u.query.get("host")
    return f"postgresql://{u.username or 'postgres'}@/{u.database}?host={host}"


class Snapshots:
    """Snapshots of one database, and restores of them into fresh databases."""

    def __init__(self, url: str, work: Path, server_url: str | None) -> None:
        self.url = url
        self.work = work
        self.server_url = server_url
        self.files: list[Path] = []
        self.created: list[str] = []

    def take(self) -> None:
        path = self.work / f"snap-{len(self.files):04d}"
        if self.url.startswith("sqlite"):
            src = sqlite3.connect(make_url(self.url).database or "")
            dst = sqlite3.connect(path)
            try:
                src.backup(dst)
            finally:
                dst.close()
                src.close()
        else:
            subprocess.run(
                [_pg_bin("pg_dump"), "-Fc", "-f", str(path), "-d", _libpq(self.url)],
                check=True,
                capture_output=True,
            )
        self.files.append(path)

    def restore(self, k: int) -> str:
        """A fresh database holding snapshot ``k``; its URL."""
        if self.url.startswith("sqlite"):
            target = self.work / f"restored-{k:04d}-{uuid.uuid4().hex[:6]}.db"
            shutil.copyfile(self.files[k], target)
            return f"sqlite:///{target}"
        assert self.server_url is not None
        name = f"s5_r{k}_{uuid.uuid4().hex[:8]}"
        admin = create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        self.created.append(name)
        base, _, query = self.server_url.partition("?")
        url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
        subprocess.run(
            [_pg_bin("pg_restore"), "--no-owner", "-d", _libpq(url), str(self.files[k])],
            check=True,
            capture_output=True,
        )
        return url

    def drop(self, url: str) -> None:
        if url.startswith("sqlite") or self.server_url is None:
            return
        name = make_url(url).database
        admin = create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@dataclass
class Judged:
    detected: bool
    duplicates: int
    lost: int
    completed: bool
    problems: list[str]


def _open(url: str) -> tuple[Store, Ledger, Runtime, Operator]:
    store = Store.open(url)
    ledger = Ledger(store, KEYRING, owner=OWNER)
    return store, ledger, Runtime(store, ledger, FLOWS, owner=OWNER), Operator(store, ledger)


def drive(url: str, run_id: str, api: FencedAPI, rounds: int = 30) -> bool:
    """Resume the run in a fresh process's view and drive it to its end, settling an
    effect that needs a human with the provider's evidence. Whether it completed."""
    store, ledger, rt, ops = _open(url)
    try:
        for _ in range(rounds):
            run = rt.drive(run_id)
            for rec in ledger.effects(run_id=run_id, status=EffectStatus.NEEDS_HUMAN):
                happened = api.applied_key(rec.provider_key)
                ops.resolve(  # the flows do not use a delivery's result
                    rec.key_id, happened=happened, evidence="provider log", actor="op", result=None
                )
            run = store.get_run(run_id)
            if run.status is RunStatus.COMPLETED:
                return True
            if run.status is RunStatus.WAITING:
                time.sleep(0.06)  # a nap timer
        return False
    finally:
        ledger.close()
        store.close()


def scenario(
    url: str,
    work: Path,
    api: FencedAPI,
    rng: random.Random,
    server_url: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[Judged], int, int]:
    """One run, snapshotted after every commit, then every earlier snapshot restored and
    judged. Returns the judgements, the run's effect count and the snapshots."""
    migrate_all(url)
    snaps = Snapshots(url, work, server_url)
    plan = plan_for(rng, rng.randint(2, 4), 2, "abbc")
    labels = labels_of(plan)
    active = [False]
    original: Callable[..., Any] = _connections._RawTxn.__exit__

    def exit_then_snapshot(self: Any, exc_type: object, exc: object, tb: object) -> None:
        original(self, exc_type, exc, tb)
        if active[0] and exc_type is None and self._write:
            snaps.take()

    with monkeypatch.context() as mp:
        mp.setattr(_connections._RawTxn, "__exit__", exit_then_snapshot)
        store, ledger, rt, _ops = _open(url)
        try:
            active[0] = True
            run_id = rt.start("gen", {"url": api.url, "plan": plan})
            active[0] = False
        finally:
            ledger.close()
            store.close()
        active[0] = True
        try:
            assert drive(url, run_id, api), "the original run did not complete"
        finally:
            active[0] = False
    witness = str(work / "witness.json")
    store, ledger, _rt, _ops = _open(url)
    try:
        ledger.export_witness(witness)
        assert ledger.verify(witness=witness).ok
    finally:
        ledger.close()
        store.close()
    world = api.mark()
    base = api.counts()
    assert all(base[(run_id, label)] == 1 for label in labels), base
    judged = []
    for k in range(len(snaps.files) - 1):  # the last snapshot is the final state
        api.rewind(world)
        restored = snaps.restore(k)
        try:
            store, ledger, _rt, _ops = _open(restored)
            try:
                problems = ledger.verify(witness=witness).problems
            finally:
                ledger.close()
                store.close()
            completed = drive(restored, run_id, api)
        finally:
            snaps.drop(restored)
        after = api.counts()
        dup = sum(max(after[(run_id, label)] - 1, 0) for label in labels)
        lost = sum(1 for label in labels if after[(run_id, label)] == 0)
        judged.append(Judged(bool(problems), dup, lost, completed, problems))
    api.rewind(world)
    return judged, len(labels), len(snaps.files)


def test_s5_rollback(
    db_url: str,
    tmp_path: Path,
    api: FencedAPI,
    report: SuiteReport,
    pg_server_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = db_url.partition(":")[0].partition("+")[0]
    n = scaled(4, 80) if backend == "sqlite" else scaled(1, 20)
    server = pg_server_url if backend == "postgresql" else None
    totals: collections.Counter[str] = collections.Counter()
    for i, seed in enumerate(seeds(n, base=5_000 + (0 if backend == "sqlite" else 500))):
        report.seeds.append(seed)
        work = tmp_path / f"s{i}"
        work.mkdir()
        url = db_url if i == 0 else _another(db_url, work, server)
        raw_before = len(api.log)
        judged, n_effects, n_snaps = scenario(
            url, work, api, random.Random(seed), server, monkeypatch
        )
        detected = [j for j in judged if j.detected]
        trusted = [j for j in judged if not j.detected]
        accepted = [j for j in trusted if j.duplicates]
        would_dup = [j for j in detected if j.duplicates]
        totals["snapshots"] += n_snaps
        totals["would_dup"] += len(would_dup)
        report.add(
            crash_points=len(judged),
            scenarios=1,
            runs=1 + sum(1 for j in trusted if j.completed),
            effects=n_effects * (1 + len(trusted)),
            raw_deliveries=len(api.log) - raw_before,
            duplicates=sum(j.duplicates for j in trusted),
            lost=sum(j.lost + int(not j.completed) for j in trusted),
            detected=len(detected),
            accepted=len(accepted),
        )
        print(
            f"S5 {backend} seed {seed}: {n_effects} effects, {n_snaps} snapshots, "
            f"{len(detected)} rollbacks detected ({len(would_dup)} of them re-send when "
            f"trusted), {len(trusted)} undetected (all resumed; duplicates "
            f"{sum(j.duplicates for j in trusted)})"
        )
        assert not accepted, [j.problems for j in accepted]
        assert all(j.completed and not j.lost for j in trusted)
    # S10: a ledger that trusts the restored snapshot (no witness check) re-sent an effect
    # the provider had applied, and the fake's raw log shows it.
    report.control(totals["would_dup"] > 0)
    assert totals["would_dup"] > 0, "no trusted restore re-sent: the positive control failed"


def _another(db_url: str, work: Path, server: str | None) -> str:
    if server is None:
        return f"sqlite:///{work / 'onceonly.db'}"
    name = f"s5_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    _CREATED.append((server, name))
    base, _, query = server.partition("?")
    return base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")


_CREATED: list[tuple[str, str]] = []


@pytest.fixture(autouse=True)
def _drop_created() -> Iterator[None]:
    yield
    while _CREATED:
        server, name = _CREATED.pop()
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
