"""Workers: many processes drain runs, every effect reaches the provider exactly once.

The multi-process tests run real ``onceonly worker`` processes (the console script) on
the flows of :mod:`tests.worker_flows`; the oracle is the counting provider's raw log
(every write that reached it; it deduplicates nothing), never the ledger. The in-process
tests drive :class:`onceonly.worker.Worker` directly on both backends.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from onceonly.checkpoint import RunStatus, Store, migrate, subject_hash
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectStatus, Keyring, Ledger, Secret
from onceonly.ledger import migrate as ledger_migrate
from onceonly.operator import Operator
from onceonly.runtime import META, Runtime
from onceonly.worker import Worker

from .worker_flows import FLOWS, CountingProvider, Delivery

ROOT = Path(__file__).resolve().parent.parent
ONCEONLY = Path(sys.executable).parent / "onceonly"
SECRET_HEX = "5a" * 32
KEYRING = Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))])


# -- fixtures and helpers -------------------------------------------------------------
@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database."""
    if os.environ.get("ONCEONLY_TEST_NO_PG") == "1":
        pytest.skip("ONCEONLY_TEST_NO_PG=1: the PostgreSQL worker tests do not run")
    server: str = request.getfixturevalue("pg_server_url")
    name = "w_" + uuid.uuid4().hex[:16]
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base, _, query = server.partition("?")
    url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
    _migrate(url)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh, migrated SQLite database."""
    url = f"sqlite:///{tmp_path / 'workers.db'}"
    _migrate(url)
    return url


@pytest.fixture
def any_url(db_url: str) -> str:
    """A fresh, migrated database on each backend."""
    _migrate(db_url)
    return db_url


@pytest.fixture
def provider() -> Iterator[CountingProvider]:
    """The counting provider (the oracle), serving on 127.0.0.1."""
    p = CountingProvider()
    p.start()
    try:
        yield p
    finally:
        p.stop()


def _migrate(url: str) -> None:
    migrate(url)
    ledger_migrate(url)


@contextlib.contextmanager
def runtime_on(
    url: str, flows: list[Flow] | None = None, *, owner: str = "tester", lease_s: float = 60.0
) -> Iterator[Runtime]:
    """A runtime in this process (it starts runs and inspects them; workers drive them)."""
    with Store.open(url) as store:
        ledger = Ledger(store, KEYRING, owner=owner)
        try:
            yield Runtime(store, ledger, flows or FLOWS, owner=owner, lease_s=lease_s)
        finally:
            ledger.close()


class Fleet:
    """Worker processes (``onceonly worker``) started by one test; each logs to a file."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url = url
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started: dict[str, int] = {}

    def spawn(
        self,
        owner: str,
        *,
        lease_s: float = 30.0,
        poll_s: float = 1.0,
        until_idle: bool = False,
        wait: bool = True,
    ) -> subprocess.Popen[bytes]:
        """Start a worker named ``owner`` and (with ``wait``) wait until it claims runs."""
        log = self.logs / f"{owner}.log"
        already = log.read_text() if log.exists() else ""
        cmd = [
            str(ONCEONLY),
            "worker",
            "--url",
            self.url,
            "--flows",
            "tests.worker_flows:FLOWS",
            "--owner",
            owner,
            "--lease-s",
            str(lease_s),
            "--poll-s",
            str(poll_s),
        ]
        if until_idle:
            cmd.append("--until-idle")
        env = dict(os.environ, ONCEONLY_SECRETS=f"k1:{SECRET_HEX}", PYTHONPATH=str(ROOT))
        with log.open("ab") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        self.procs[owner] = proc
        self._started[owner] = already.count("claiming runs") + 1
        if wait and not until_idle:
            self.wait_ready(owner)
        return proc

    def wait_ready(self, owner: str) -> None:
        """Wait until the worker ``owner`` (its latest start) claims runs."""
        log = self.logs / f"{owner}.log"
        wait_until(
            lambda: log.read_text().count("claiming runs") >= self._started[owner],
            30,
            f"worker {owner} did not start: {log.read_text()[-2000:]}",
        )

    def log(self, owner: str) -> str:
        """What the worker printed so far."""
        return (self.logs / f"{owner}.log").read_text()

    def stop(self, owner: str, timeout: float = 30) -> int:
        """SIGTERM (drain) the worker; its exit status."""
        proc = self.procs[owner]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout)

    def kill(self, owner: str) -> None:
        """SIGKILL the worker (a crash) and reap it."""
        proc = self.procs[owner]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        """Kill every worker of this test still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def fleet_on(tmp_path: Path) -> Iterator[Callable[[str], Fleet]]:
    """Start worker processes on a database; all are killed after the test."""
    fleets: list[Fleet] = []

    def make(url: str) -> Fleet:
        fleets.append(Fleet(url, tmp_path))
        return fleets[-1]

    try:
        yield make
    finally:
        for f in fleets:
            f.close()


def wait_until(pred: Callable[[], bool], timeout: float, what: str = "condition") -> None:
    """Poll ``pred`` every 20 ms until it holds.

    Raises:
        AssertionError: It did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {what}")
        time.sleep(0.02)


def labels(log: list[Delivery], run: str) -> list[str]:
    """The labels delivered for ``run``, in arrival order."""
    return [d.label for d in log if d.run == run]


def assert_once(log: list[Delivery], expected: dict[str, set[str]]) -> None:
    """Every expected (run, label) reached the provider exactly once, and nothing else."""
    counts = collections.Counter((d.run, d.label) for d in log)
    dupes = {k: n for k, n in counts.items() if n > 1}
    assert not dupes, f"delivered more than once: {dupes}"
    assert set(counts) == {(r, lb) for r, ls in expected.items() for lb in ls}
    keys = [d.key for d in log]
    assert None not in keys
    assert len(set(keys)) == len(keys)


# -- many worker processes ------------------------------------------------------------
@pytest.mark.slow
def test_three_workers_drain_runs_exactly_once(
    any_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    runs, effects = 12, 6
    fleet = fleet_on(any_url)
    for k in range(3):
        fleet.spawn(f"w{k}", lease_s=10, poll_s=0.2, wait=False)
    for k in range(3):
        fleet.wait_ready(f"w{k}")
    with runtime_on(any_url) as rt:
        ids = [
            rt.start("batch", {"url": provider.url, "effects": effects, "per_step": 2})
            for _ in range(runs)
        ]
        wait_until(
            lambda: all(rt.store.get_run(r).status is RunStatus.COMPLETED for r in ids),
            60,
            "every run completed",
        )
        for r in ids:
            run = rt.store.get_run(r)
            assert run.lease_owner is None
            assert rt.store.load(r).state["result"] == {"sent": effects}
    assert [fleet.stop(f"w{k}") for k in range(3)] == [0, 0, 0]
    log = provider.log
    assert len(log) == runs * effects
    assert_once(log, {r: {f"e{i}" for i in range(effects)} for r in ids})
    assert len({d.worker for d in log}) >= 2, "the runs were not shared between workers"
    for r in ids:  # each run's effects in the order its steps asked for them
        assert labels(log, r) == [f"e{i}" for i in range(effects)]


@pytest.mark.slow
def test_sigkill_mid_step_another_worker_takes_over_after_the_lease_lapses(
    pg_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    fleet = fleet_on(pg_url)
    lease_s = 1.5
    fleet.spawn("w1", lease_s=lease_s, poll_s=0.2)
    with runtime_on(pg_url) as rt:
        rid = rt.start("pause", {"url": provider.url, "pause_s": 2.0})
        provider.wait_for(1, 20)  # "a" is delivered; w1 now pauses inside the step
        time.sleep(0.3)  # past the ledger commit of "a"
        fleet.kill("w1")
        killed = time.monotonic()
        assert rt.store.get_run(rid).lease_owner == "w1"  # the dead worker's lease
        fleet.spawn("w2", lease_s=lease_s, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 30, "completed")
        took_over = min(d.at for d in provider.log if d.worker == "w2")
        result = rt.store.load(rid).state["result"]
    log = provider.log
    assert_once(log, {rid: {"a", "b", "c"}})
    assert [(d.label, d.worker) for d in log] == [("a", "w1"), ("b", "w2"), ("c", "w2")]
    assert result == {"first_by": "w2", "second_by": "w2"}  # w2 re-ran the step; "a" replayed
    # w2 waited for the lease to lapse, then redid the step's pause (2 s) before "b".
    assert time.monotonic() - killed >= 2.0
    assert took_over > 0


@pytest.mark.slow
def test_sigkill_during_an_effect_the_restarted_worker_settles_it_by_lookup(
    pg_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """The worker dies after the provider applied "a" but before the ledger recorded it.
    Restarted under the same owner name, it finds its predecessor's claim at once (no
    waiting out the claim's lease), asks the provider (class B lookup), and records "a"
    as delivered: "a" is not sent again."""
    fleet = fleet_on(pg_url)
    fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
    provider.hold["a"] = 3.0  # apply "a", then answer only after 3 s
    with runtime_on(pg_url) as rt:
        rid = rt.start("pause", {"url": provider.url, "pause_s": 0.0})
        provider.wait_for(1, 20)
        fleet.kill("w1")  # "a" applied, its answer never arrived
        (claimed,) = rt.ledger.effects(run_id=rid)
        assert claimed.status is EffectStatus.CLAIMED
        fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 30, "completed")
        (a_entry,) = [e for e in rt.ledger.effects(run_id=rid) if e.key_id == claimed.key_id]
        assert a_entry.status is EffectStatus.COMMITTED
    assert_once(provider.log, {rid: {"a", "b", "c"}})
    assert provider.lookups >= 1


@pytest.mark.slow
def test_sigkill_during_an_effect_another_worker_settles_it_once_the_claim_lapses(
    pg_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """As above, but the run is taken over by a worker under another name while the dead
    worker's claim on "a" is still live: the run must wait for the claim to lapse (the
    ledger's claim lease, 30 s) and then settle "a" by lookup, not fail."""
    fleet = fleet_on(pg_url)
    fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
    provider.hold["a"] = 3.0
    with runtime_on(pg_url) as rt:
        rid = rt.start("pause", {"url": provider.url, "pause_s": 0.0})
        provider.wait_for(1, 20)
        fleet.kill("w1")
        fleet.spawn("w2", lease_s=1.0, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is not RunStatus.RUNNING, 45, "settled")
        assert rt.store.get_run(rid).status is RunStatus.COMPLETED
    assert_once(provider.log, {rid: {"a", "b", "c"}})


@pytest.mark.slow
def test_sigterm_drains_the_current_step_and_another_worker_continues(
    pg_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    fleet = fleet_on(pg_url)
    # A long lease: were it not released on drain, w2 would wait 60 s for the run.
    fleet.spawn("w1", lease_s=60, poll_s=0.2)
    with runtime_on(pg_url) as rt:
        rid = rt.start("pause", {"url": provider.url, "pause_s": 1.5})
        provider.wait_for(1, 20)
        assert fleet.stop("w1") == 0  # returns once the step finished and checkpointed
        assert "stopped: 1 run(s) driven" in fleet.log("w1")
        run = rt.store.get_run(rid)
        assert (run.status, run.next_step, run.lease_owner) == (RunStatus.RUNNING, "second", None)
        assert [(d.label, d.worker) for d in provider.log] == [("a", "w1"), ("b", "w1")]
        t0 = time.monotonic()
        fleet.spawn("w2", lease_s=60, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 20, "completed")
        assert time.monotonic() - t0 < 15
        assert rt.store.load(rid).state["result"] == {"first_by": "w1", "second_by": "w2"}
    assert_once(provider.log, {rid: {"a", "b", "c"}})
    assert fleet.stop("w2") == 0


@pytest.mark.slow
def test_a_waiting_run_holds_no_worker_and_notify_wakes_it_promptly(
    pg_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    poll_s = 10.0
    fleet = fleet_on(pg_url)
    fleet.spawn("w1", lease_s=30, poll_s=poll_s)
    payout = {"to": "acct-7", "cents": 1250}
    with runtime_on(pg_url) as rt:
        waiting = rt.start("approval", {"url": provider.url, "payout": payout})
        wait_until(lambda: rt.store.get_run(waiting).status is RunStatus.WAITING, 20, "waiting")
        # The one worker is free: it drives another run while the first waits.
        other = rt.start("batch", {"url": provider.url, "effects": 3, "per_step": 3})
        wait_until(lambda: rt.store.get_run(other).status is RunStatus.COMPLETED, 20, "other")
        assert rt.store.get_run(waiting).status is RunStatus.WAITING
        assert rt.store.get_run(waiting).lease_owner is None
        time.sleep(0.5)  # the worker is idle, listening
        approved_at = time.time()
        Operator(rt.store, rt.ledger).approve(
            waiting, "payout", actor="bob", subject_hash=subject_hash(rt.store, payout)
        )
        (paid,) = [d for d in provider.wait_for(4, 10) if d.label == "paid"]
        latency = paid.at - approved_at
        wait_until(lambda: rt.store.get_run(waiting).status is RunStatus.COMPLETED, 10, "paid")
    print(f"approval to delivery: {latency * 1e3:.0f} ms (poll interval {poll_s:.0f} s)")
    assert latency < 1.5, f"woken after {latency:.2f} s: NOTIFY did not wake the idle worker"
    assert_once(provider.log, {waiting: {"paid"}, other: {"e0", "e1", "e2"}})


@pytest.mark.slow
def test_a_timer_wakes_a_run_on_sqlite_by_polling(
    sqlite_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    fleet = fleet_on(sqlite_url)
    fleet.spawn("w1", lease_s=30, poll_s=0.2)
    with runtime_on(sqlite_url) as rt:
        started = time.time()
        napping = rt.start("timer", {"url": provider.url, "nap_s": 1.5})
        wait_until(lambda: rt.store.get_run(napping).status is RunStatus.WAITING, 20, "asleep")
        other = rt.start("batch", {"url": provider.url, "effects": 2, "per_step": 1})
        wait_until(lambda: rt.store.get_run(other).status is RunStatus.COMPLETED, 20, "other")
        assert rt.store.get_run(napping).status is RunStatus.WAITING  # no worker held
        wait_until(lambda: rt.store.get_run(napping).status is RunStatus.COMPLETED, 20, "woke")
    (woke,) = [d for d in provider.log if d.label == "woke"]
    assert 1.5 <= woke.at - started < 1.5 + 2.0
    assert_once(provider.log, {napping: {"woke"}, other: {"e0", "e1"}})
    assert fleet.stop("w1") == 0


@pytest.mark.slow
def test_a_flaky_step_is_retried_on_timers_across_a_killed_worker(
    any_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """A step whose dependency fails its first two calls: each failure parks the run on
    a retry timer (no worker held); the worker that scheduled the first retry is killed
    and another runs the rest. The effect made before the failing call is delivered
    once over the three attempts, and the worker logs each failure with its traceback."""
    fleet = fleet_on(any_url)
    fleet.spawn("w1", lease_s=10, poll_s=0.2)
    with runtime_on(any_url) as rt:
        rid = rt.start("flaky", {"url": provider.url, "fail_first": 2})
        wait_until(
            lambda: (
                provider.flaky_calls[rid] >= 1 and rt.store.get_run(rid).status is RunStatus.WAITING
            ),
            20,
            "the first retry scheduled",
        )
        fleet.kill("w1")
        fleet.spawn("w2", lease_s=10, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 30, "completed")
        meta = rt.store.load(rid).state[META]
        assert [n for n in meta["waits"] if n.startswith("retry.")] == [
            "retry.book.0.1",
            "retry.book.0.2",
        ]
    assert fleet.stop("w2") == 0
    assert provider.flaky_calls[rid] == 3
    assert_once(provider.log, {rid: {"held", "confirmed"}})
    logs = fleet.log("w1") + fleet.log("w2")
    assert "step book failed (attempt 1 of 4)" in logs
    assert "Unavailable: the dependency answered 503 (call 1)" in logs
    assert "Traceback (most recent call last)" in logs


def test_a_waiting_run_takes_its_deadline_path_across_a_killed_worker(
    any_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """A run waits for an approval nobody gives; the worker that parked it is killed
    and another is started. At the run's deadline that worker wakes it (the deadline's
    timer, written with the run), the approval is cancelled and the deadline's path
    runs: every effect delivered once."""
    fleet = fleet_on(any_url)
    fleet.spawn("w1", lease_s=10, poll_s=0.2)
    with runtime_on(any_url) as rt:
        rid = rt.start("deadlined", {"url": provider.url}, deadline_s=2.0)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.WAITING, 20, "waiting")
        fleet.kill("w1")
        fleet.spawn("w2", lease_s=10, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 30, "completed")
        meta = rt.store.load(rid).state[META]
        assert meta["deadline"]["passed"] is True
        waits = {w.name: w.status.value for w in rt.waits.find(run_id=rid)}
        assert waits == {"deadline.run": "fired", "go": "cancelled"}
    assert fleet.stop("w2") == 0
    assert_once(provider.log, {rid: {"asked", "chased"}})


def test_a_step_past_its_timeout_in_a_worker_sends_nothing_more(
    any_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """A step that takes twice its ``timeout_s`` in a worker process: its effect after
    the time is up is refused before it is sent, and the run takes ``on_timeout``."""
    fleet = fleet_on(any_url)
    with runtime_on(any_url) as rt:
        rid = rt.start("dawdler", {"url": provider.url})
        fleet.spawn("w1", lease_s=10, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 30, "completed")
        meta = rt.store.load(rid).state[META]
        assert meta["last_error"]["type"] == "StepTimedOut"
    assert fleet.stop("w1") == 0
    assert_once(provider.log, {rid: {"started", "recovered"}})
    assert "step dawdle timed out after 0.5 s" in fleet.log("w1")


def test_runs_of_every_durability_mode_share_one_worker_across_a_kill(
    any_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """Three runs, one per durability mode, on one store and one worker process (its
    store in the default mode): the worker is killed while one effect is being sent,
    restarted under its name, and every run completes with each effect delivered once
    (the write barrier before each effect holds in each run's mode)."""
    fleet = fleet_on(any_url)
    provider.hold["e2"] = 2.0  # the first run to send e2 is killed in the middle of it
    with runtime_on(any_url) as rt:
        ids = {
            mode: rt.start(
                "batch", {"url": provider.url, "effects": 5, "per_step": 1}, durability=mode
            )
            for mode in ("sync", "async", "exit")
        }
        fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
        wait_until(lambda: any(d.label == "e2" for d in provider.log), 20, "e2 applied")
        fleet.kill("w1")
        fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
        wait_until(
            lambda: all(rt.store.get_run(r).status is RunStatus.COMPLETED for r in ids.values()),
            45,
            "completed",
        )
        for mode, rid in ids.items():
            assert rt.store.load(rid).state[META]["durability"] == mode
    assert fleet.stop("w1") == 0
    assert_once(provider.log, {rid: {f"e{i}" for i in range(5)} for rid in ids.values()})


def test_an_async_step_in_a_killed_worker_resumes_in_another_with_effects_once(
    any_url: str, provider: CountingProvider, fleet_on: Callable[[str], Fleet]
) -> None:
    """An ``async def`` step whose asyncio branches deliver ``x`` and ``y``; the worker
    is killed after them, and restarted under its name (it takes its predecessor's
    claims back at once) re-runs the step: what the branches recorded replays, and
    ``z`` and the sync step's ``w`` are delivered, each effect once."""
    fleet = fleet_on(any_url)
    fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
    with runtime_on(any_url) as rt:
        rid = rt.start("asynchronous", {"url": provider.url, "pause_s": 3.0})
        wait_until(lambda: {d.label for d in provider.log} >= {"x", "y"}, 20, "x and y")
        fleet.kill("w1")
        assert rt.store.get_run(rid).status is RunStatus.RUNNING  # killed mid-step
        fleet.spawn("w1", lease_s=1.0, poll_s=0.2)
        wait_until(lambda: rt.store.get_run(rid).status is RunStatus.COMPLETED, 45, "completed")
    assert fleet.stop("w1") == 0
    assert_once(provider.log, {rid: {"x", "y", "z", "w"}})


# -- one worker in this process (both backends) ---------------------------------------
def test_until_idle_drives_every_ready_run_and_returns(
    any_url: str, provider: CountingProvider
) -> None:
    with runtime_on(any_url, owner="solo") as rt:
        ids = [
            rt.start("batch", {"url": provider.url, "effects": 2, "per_step": 1}) for _ in range(3)
        ]
        stats = Worker(rt, batch=2, poll_s=0.1).run(until_idle=True)
        assert (stats.runs_driven, stats.claim_conflicts, stats.runs_skipped) == (3, 0, 0)
        assert all(rt.store.get_run(r).status is RunStatus.COMPLETED for r in ids)
        assert Worker(rt).run(until_idle=True).runs_driven == 0
    assert_once(provider.log, {r: {"e0", "e1"} for r in ids})


def test_the_lease_is_renewed_while_a_long_step_runs(
    any_url: str, provider: CountingProvider
) -> None:
    """The step outlasts its lease 2.5 times over: the heartbeat moves the lease's expiry
    on while it runs. Observed, not raced: a rival claiming at an unlucky moment of a
    loaded machine (a heartbeat late by more than a lease) would rightly win, so whether
    a rival gets in says nothing; that an unexpired lease is never taken is the store's
    lease test."""
    with runtime_on(any_url, owner="solo", lease_s=2.0) as rt:
        rid = rt.start("pause", {"url": provider.url, "pause_s": 5.0})
        worker = Worker(rt, poll_s=0.1)
        t = threading.Thread(target=worker.run, kwargs={"until_idle": True})
        t.start()
        provider.wait_for(1, 10)  # "a" is sent: the step is inside its pause
        first = rt.store.get_run(rid)
        assert first.lease_owner == "solo"
        assert first.lease_expires_at is not None
        expiries = [first.lease_expires_at]
        while t.is_alive():
            run = rt.store.get_run(rid)
            if run.lease_owner == "solo" and run.lease_expires_at is not None:
                expiries.append(run.lease_expires_at)
            time.sleep(0.05)
        t.join()
        renewed = sorted({e for e in expiries if e > first.lease_expires_at})
        assert renewed, "the lease was never renewed while the step ran"
        assert (worker.stats.runs_driven, worker.stats.leases_lost) == (1, 0)
        done = rt.store.get_run(rid)
        assert done.status is RunStatus.COMPLETED
        assert done.lease_owner is None
    assert_once(provider.log, {rid: {"a", "b", "c"}})


def test_a_worker_that_loses_its_lease_claims_nothing_more(
    any_url: str, provider: CountingProvider
) -> None:
    """The run's lease is part of every claim's fence: once another worker holds it, this
    worker's next effect is refused before it is sent, and its step is dropped."""
    with runtime_on(any_url, owner="solo", lease_s=0.6) as rt:
        rid = rt.start("pause", {"url": provider.url, "pause_s": 1.0})
        worker = Worker(rt, poll_s=0.1)
        t = threading.Thread(target=worker.run, kwargs={"max_runs": 1})
        t.start()
        provider.wait_for(1, 10)
        # Another worker takes the run (as after a long GC pause of this one).
        q = rt.store.param

        def steal(cur: object) -> None:
            cur.execute(  # type: ignore[attr-defined]
                f"UPDATE oo_runs SET lease_owner = {q}, lease_expires_at = {q} WHERE run_id = {q}",
                ("thief", time.time() + 60, rid),
            )

        rt.store.transact(steal)
        t.join(20)
        assert not t.is_alive()
        assert worker.stats.leases_lost == 1
        run = rt.store.get_run(rid)
        assert (run.next_step, run.lease_owner) == ("first", "thief")
    assert labels(provider.log, rid) == ["a"]  # "b" was refused: the thief runs the step


def test_a_run_of_an_unknown_flow_is_never_claimed(
    any_url: str, provider: CountingProvider
) -> None:
    # A worker with other flows (a wrong --flows) leaves the run unleased for a worker
    # that has its flow: it used to lease it for lease_s under "<owner>:skipped".
    with runtime_on(any_url) as starter:
        foreign = starter.start("timer", {"url": provider.url, "nap_s": 0.0})
        mine = starter.start("batch", {"url": provider.url, "effects": 1, "per_step": 1})
    batch_only = [f for f in FLOWS if f.name == "batch"]
    with runtime_on(any_url, batch_only, owner="solo", lease_s=30) as rt:
        worker = Worker(rt, poll_s=0.1)
        t = threading.Thread(target=worker.run, kwargs={"until_idle": True}, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the worker kept claiming the run it cannot run"
        assert (worker.stats.runs_driven, worker.stats.runs_skipped) == (1, 0)
        assert rt.store.get_run(mine).status is RunStatus.COMPLETED
        held = rt.store.get_run(foreign)
        assert (held.status, held.lease_owner) == (RunStatus.RUNNING, None)
    with runtime_on(any_url, owner="all") as rt:  # a worker with the flow takes it at once
        assert Worker(rt, poll_s=0.1).run(until_idle=True).runs_driven == 1
        assert rt.store.get_run(foreign).status is RunStatus.COMPLETED
    assert_once(provider.log, {mine: {"e0"}, foreign: {"woke"}})


def test_stop_releases_the_runs_claimed_but_not_yet_driven(
    any_url: str, provider: CountingProvider
) -> None:
    flow = Flow("stopper")
    workers: list[Worker] = []

    @flow.step(start=True)
    def only(ctx: StepContext) -> Transition:
        workers[0].stop()  # SIGTERM arrives while the first claimed run is driven
        return ctx.end()

    with runtime_on(any_url, [flow], owner="solo") as rt:
        ids = [rt.start("stopper") for _ in range(3)]
        workers.append(Worker(rt, batch=3, poll_s=0.1))
        stats = workers[0].run()
        assert stats.runs_driven == 1
        runs = [rt.store.get_run(r) for r in ids]
        assert sorted(r.status.value for r in runs) == ["completed", "running", "running"]
        assert [r.lease_owner for r in runs] == [None, None, None]
