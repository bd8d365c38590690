"""S3: a real SIGKILL soak (../shared/RELIABILITY.md).

Worker processes (the ``onceonly worker`` command line, forked from a zygote that has
imported it once, see :mod:`property_tests.s3_worker`) drive generated flows (steps of
1-4 effects over provider classes A, B and C, with timers) and the vendor-onboarding
demo flow (mail-devel SMTP + IMAP, the screening and ERP APIs) while the test SIGKILLs
the worker at uniform random times and starts the next one (same stable owner name, as
a restarted deployment would). The test plays the supplier, the compliance officer and
the operator (an effect that needs a human is settled with the provider's evidence).
After the last kill, one worker finishes everything.

The worker processes take the three durability modes in turn (``onceonly worker
--durability``: the k-th worker ``MODES[k % 3]``, the one that finishes ``MODES[kills %
3]``), so a run is often resumed by a worker in another mode than the one killed under it,
on the same database; the report's ``modes`` counts the workers started in each mode.

Counted from the fakes only: every intended effect applied exactly once (the fenced
fake's raw log; the mail server's INBOX; the screening and ERP servers' raw POSTs),
nothing else applied. CI: 100 kills on SQLite and 50 on PostgreSQL; deep: x20.

Positive control: the same soak against a build whose class B probe always answers "did
not happen" (an in-doubt delivery is re-sent) must show a duplicate.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .reliability import SuiteReport, mode_of, scaled, seeds
from .s3_fakes import FencedAPI, tally
from .s3_harness import Controller, Onboarding, migrate_all
from .s3_procs import Zygote

pytestmark = pytest.mark.slow

OWNER = "s3-worker"
KILL_WINDOW_S = 0.6  # each kill lands uniformly within this long after the worker's start


@pytest.fixture(scope="module")
def report() -> Iterator[SuiteReport]:
    rep = SuiteReport(suite="S3")
    yield rep
    rep.check()


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path)
    try:
        yield z
    finally:
        z.close()


def _worker_argv(url: str, durability: str) -> list[str]:
    return [
        "worker",
        "--url",
        url,
        "--flows",
        "property_tests.s3_flows:FLOWS",
        "--owner",
        OWNER,
        "--poll-s",
        "0.05",
        "--batch",
        "4",
        "--durability",
        durability,
    ]


def soak(
    ctl: Controller,
    zyg: Zygote,
    rng: random.Random,
    *,
    kills: int,
    backlog: int,
    env: dict[str, str] | None = None,
    stop_when_duplicate: bool = False,
    report: SuiteReport | None = None,
) -> int:
    """SIGKILL ``kills`` workers at uniform random times, keeping ``backlog`` runs open;
    then let one worker finish. Returns the kills that landed on a live worker. Worker
    ``k`` runs in durability mode ``mode_of(k)`` (counted in ``report``)."""
    landed = 0
    for k in range(kills):
        if ctl.open_runs() < backlog:
            ctl.start_gen(backlog - ctl.open_runs())
        if report is not None:
            report.mode(mode_of(k))
        pid = zyg.spawn(_worker_argv(ctl.url, mode_of(k)), log=f"worker-{k}.log", env=env)
        deadline = time.monotonic() + rng.uniform(0.0, KILL_WINDOW_S)
        while time.monotonic() < deadline:
            ctl.chores()
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        landed += int(zyg.alive(pid))
        zyg.kill(pid)
        if stop_when_duplicate and tally(ctl.api.log, ctl.expected)["duplicates"]:
            return landed
    if report is not None:
        report.mode(mode_of(kills))
    pid = zyg.spawn(_worker_argv(ctl.url, mode_of(kills)), log="worker-last.log", env=env)
    ctl.finish(120)
    zyg.signal(pid, 15)
    zyg.wait(pid, 30)
    return landed


def test_s3_sigkill_soak(db_url: str, tmp_path: Path, zygote: Zygote, report: SuiteReport) -> None:
    backend = db_url.partition(":")[0].partition("+")[0]
    [seed] = seeds(1, base=3_000 + (0 if backend == "sqlite" else 1))
    report.seeds.append(seed)
    rng = random.Random(seed)
    kills = scaled(100, 2000) if backend == "sqlite" else scaled(50, 1000)
    migrate_all(db_url)
    api = FencedAPI().start()
    world = Onboarding()
    ctl = Controller(db_url, api, rng, onboarding=world)
    t0 = time.monotonic()
    try:
        ctl.start_onboarding(scaled(4, 40))
        landed = soak(ctl, zygote, rng, kills=kills, backlog=scaled(8, 16), report=report)
        unfinished = ctl.unfinished()
        gen = tally(api.log, ctl.expected)
        ob = world.judge(ctl.suppliers)
    finally:
        ctl.close()
        world.stop()
        api.stop()
    wall = time.monotonic() - t0
    print(
        f"S3 {backend}: seed {seed}, {landed}/{kills} kills on a live worker, "
        f"{len(ctl.runs)} runs, generated {gen}, onboarding {ob}, "
        f"needs-human {ctl.needs_human}, {wall:.1f} s"
    )
    report.add(
        crash_points=landed,
        scenarios=len(ctl.runs),
        runs=len(ctl.runs) - len(unfinished),
        effects=gen["effects"] + ob["effects"],
        raw_deliveries=gen["raw"] + ob["raw"],
        duplicates=gen["duplicates"] + gen["stale_applied"] + gen["unexpected"] + ob["duplicates"],
        lost=gen["lost"] + ob["lost"] + len(unfinished),
        needs_human=ctl.needs_human,
    )
    assert not unfinished, f"runs that did not complete: {unfinished[:10]}"
    assert gen["duplicates"] == gen["lost"] == gen["unexpected"] == gen["stale_applied"] == 0, gen
    assert ob["duplicates"] == ob["lost"] == 0, ob
    assert gen["raw"] > 0
    assert ob["raw"] > 0


def test_s3_control_probe_that_always_says_not_happened(
    tmp_path: Path, zygote: Zygote, report: SuiteReport
) -> None:
    """S10 positive control: class B treated as re-sendable must be caught."""
    url = f"sqlite:///{tmp_path / 'control.db'}"
    migrate_all(url)
    rng = random.Random(7)
    api = FencedAPI().start()
    ctl = Controller(url, api, rng, classes="b")
    try:
        soak(
            ctl,
            zygote,
            rng,
            kills=80,
            backlog=6,
            env={"S3_BROKEN": "probe"},
            stop_when_duplicate=True,
        )
        got = tally(api.log, ctl.expected)
    finally:
        ctl.close()
        api.stop()
    caught = got["duplicates"] > 0
    print(f"S3 control (broken probe): {got}; caught: {caught}")
    report.control(caught)
    assert caught, f"the soak did not catch a probe that always says not happened: {got}"
