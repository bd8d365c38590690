"""Worker processes racing to claim the same keys (I1, I6): exactly one wins each key.

Four processes on PostgreSQL and three on SQLite (one file, one writer at a time) start
together and walk the same keys, half of them forwards and half backwards, so every key
is contended. Winners are counted from the processes' own reports; the ledger must show
each key committed once, at epoch 1, by the process that reported winning it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from onceonly.checkpoint import Store
from onceonly.ledger import EffectStatus, Keyring, Ledger
from tests.ledger_race_worker import RUNS, identity
from tests.ledger_support import K1, K2, sqlite_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rotating", "n_keys"),
    [pytest.param(False, 1000, id="one-secret"), pytest.param(True, 300, id="mid-rotation")],
)
def test_racing_workers_claim_each_key_exactly_once(
    db_url: str, tmp_path: Path, rotating: bool, n_keys: int
) -> None:
    """With ``rotating``, half the workers already derive new keys with the next secret
    (a rolling deploy of a rotation): an identity must still be claimed once."""
    workers = 3 if sqlite_path(db_url) is not None else 4
    Store.open(db_url).close()  # schema first, so the racers do not race to create it
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.ledger_race_worker",
                db_url,
                str(n_keys),
                str(i),
                str(go),
                "1" if rotating else "0",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        started = time.monotonic()
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
        wall = time.monotonic() - started
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))

    wins = Counter(i for r in reports for i in r["won"])
    assert sorted(wins) == list(range(n_keys)), "some key was never won"
    assert set(wins.values()) == {1}, {i: c for i, c in wins.items() if c > 1}
    # every worker saw every key once: won, replayed, or in flight at that moment
    for r in reports:
        assert len(r["won"]) + r["replayed"] + r["in_flight"] == n_keys
    # The race was a race: on PostgreSQL, claims run in parallel and several workers win
    # keys. SQLite admits one writer at a time and its busy handler lets a waiting writer
    # sleep up to 100 ms, so one worker may legitimately take every key before its rivals
    # wake; there the walk itself (every worker attempted every key) is the evidence.
    if sqlite_path(db_url) is None:
        assert sum(1 for r in reports if r["won"]) >= 2, reports

    winner_of = {i: w for w, r in enumerate(reports) for i in r["won"]}
    store = Store.open(db_url)
    try:
        ledger = Ledger(store, Keyring([K1, K2]))
        recs = {r.key_id: r for r in ledger.effects()}
        assert len(recs) == n_keys
        for rec in recs.values():
            assert (rec.status, rec.epoch, rec.attempts) == (EffectStatus.COMMITTED, 1, 1)
        for i in range(n_keys):
            [key] = [k for _, k in ledger.key_ids(identity(i)) if k in recs]
            assert recs[key].lease_owner is None
            assert ledger.payload(key)["result"] == {"winner": winner_of[i]}
        for run in range(RUNS):
            trail = ledger.audit_events(f"race-{run}")
            assert [e["seq"] for e in trail] == list(range(1, len(trail) + 1))
            assert Counter(e["event"] for e in trail) == {
                "claimed": n_keys // RUNS,
                "committed": n_keys // RUNS,
            }
        report = ledger.verify()
        assert report.ok, report.problems[:5]
        assert report.events == 2 * n_keys
    finally:
        store.close()
    assert wall < 90, f"the race took {wall:.1f} s"
