"""A database that is briefly unavailable ends nothing, and acts on nothing twice.

Against real servers: a throwaway PostgreSQL cluster of this module's own that the tests
stop and start again (never the shared one), ``pg_terminate_backend`` of a worker's
connections on the shared server, a SQLite write lock held by another connection for
longer than ``busy_timeout``, and a proxy that loses the answer to a COMMIT the server
has carried out. The oracle is the counting provider's raw log (every write that reached
it, never deduplicated) and the rows in the database, not the ledger's own account.

The rules under test are in :mod:`checkpoint._retry`: transient failures are retried
with backoff; a transaction whose COMMIT may have gone through is never run again unless
it is idempotent; a worker waits for the database as long as it takes, and a ledger that
could not record an outcome starts again from disk (the effect is reconciled as in
doubt) instead of acting through stale state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from onceonly.adapters.http import GuardedHTTP
from onceonly.checkpoint import (
    DatabaseRetry,
    DatabaseUnavailable,
    RunStatus,
    Store,
    is_transient,
)
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import (
    Claim,
    EffectInDoubt,
    EffectStatus,
    Evidence,
    Ledger,
    LedgerUnavailable,
    Replay,
)
from onceonly.operator import Operator
from onceonly.runtime import Runtime
from onceonly.worker import Worker

from . import pgserver
from .ledger_support import ident
from .test_record_adapter import CommitCutter
from .test_worker import KEYRING, Fleet, _migrate, assert_once, runtime_on, wait_until
from .worker_flows import FLOWS, CountingProvider

NO_PG = os.environ.get("ONCEONLY_TEST_NO_PG") == "1"


# -- fixtures ---------------------------------------------------------------------------
class Records(logging.Handler):
    """Every record logged under ``onceonly`` while installed (thread-safe enough: the
    list only grows)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self, *, thread: str | None = None, logger: str = "onceonly") -> list[str]:
        return [
            r.getMessage()
            for r in list(self.records)
            if r.levelno >= logging.WARNING
            and r.name.startswith(logger)
            and (thread is None or r.threadName == thread)
        ]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger("onceonly")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture
def provider() -> Iterator[CountingProvider]:
    p = CountingProvider()
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def own_pg() -> Iterator[Path]:
    """A PostgreSQL cluster of this module's own, which its tests stop and restart."""
    if NO_PG:
        pytest.skip("ONCEONLY_TEST_NO_PG=1: the PostgreSQL tests do not run")
    base = Path(tempfile.mkdtemp(prefix="oo-blip-"))
    pgserver.start(base)
    try:
        yield base
    finally:
        pgserver.stop(base)
        shutil.rmtree(base, ignore_errors=True)


def _database(server: str) -> tuple[str, Callable[[], None]]:
    name = "b_" + uuid.uuid4().hex[:16]
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    base, _, query = server.partition("?")
    url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
    _migrate(url)

    def drop() -> None:
        eng = create_engine(server, isolation_level="AUTOCOMMIT")
        with contextlib.suppress(Exception), eng.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        eng.dispose()

    return url, drop


@pytest.fixture
def own_db(own_pg: Path) -> Iterator[str]:
    """A fresh, migrated database on this module's own cluster (running)."""
    _up(own_pg)
    url, drop = _database((own_pg / "url").read_text())
    try:
        yield url
    finally:
        _up(own_pg)  # a failed test may have left it stopped
        drop()


def _up(base: Path) -> None:
    """Start the cluster under ``base`` unless it is running."""
    pidfile = base / "data" / "postmaster.pid"
    if pidfile.exists():
        with contextlib.suppress(ProcessLookupError, ValueError, IndexError):
            os.kill(int(pidfile.read_text().splitlines()[0]), 0)
            return
    pgserver.start(base)


@pytest.fixture
def pg_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database on the shared server (never restarted)."""
    if NO_PG:
        pytest.skip("ONCEONLY_TEST_NO_PG=1: the PostgreSQL tests do not run")
    url, drop = _database(request.getfixturevalue("pg_server_url"))
    try:
        yield url
    finally:
        drop()


class Background:
    """A call in a thread of a given name; :meth:`result` re-raises what it raised."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001  (handed to result())
                self.error = exc

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.thread.name} did not finish"
        if self.error is not None:
            raise self.error
        return self.value


# -- PostgreSQL restarts ------------------------------------------------------------------
@pytest.mark.slow
def test_a_worker_process_rides_out_restarts_of_its_postgresql(
    own_pg: Path, own_db: str, provider: CountingProvider, tmp_path: Path
) -> None:
    """Restarted while the worker is idle (listening), then while it is inside a step:
    the worker keeps running, re-opens its LISTEN connection, and every effect of the
    runs started before, between and after reaches the provider once."""
    fleet = Fleet(own_db, tmp_path)
    try:
        fleet.spawn("w1", lease_s=10, poll_s=0.2)
        with runtime_on(own_db) as rt:
            before = [
                rt.start("batch", {"url": provider.url, "effects": 2, "per_step": 1})
                for _ in range(2)
            ]
            wait_until(lambda: _all_completed(rt, before), 60, "runs before the restart")

            # Idle: the LISTEN connection and the claim rounds lose the server.
            seen = len(fleet.log("w1"))
            pgserver.stop(own_pg)
            wait_until(
                lambda: any(
                    s in fleet.log("w1")[seen:]
                    for s in ("the LISTEN connection failed", "retrying")
                ),
                30,
                "the worker notices",
            )
            _up(own_pg)
            after = [
                rt.start("batch", {"url": provider.url, "effects": 2, "per_step": 1})
                for _ in range(2)
            ]
            wait_until(lambda: _all_completed(rt, after), 90, "runs after the restart")
            wait_until(
                lambda: "listening for ready runs again" in fleet.log("w1"), 30, "re-listened"
            )
            assert "the LISTEN connection failed" in fleet.log("w1")

            # Inside a step: "a" is delivered, the step pauses, the server goes away.
            mid = rt.start("pause", {"url": provider.url, "pause_s": 1.0})
            wait_until(lambda: any(d.run == mid for d in provider.log), 30, "a delivered")
            pgserver.stop(own_pg)
            _up(own_pg)
            wait_until(lambda: _all_completed(rt, [mid]), 90, "the run driven across it")
            assert fleet.procs["w1"].poll() is None, fleet.log("w1")[-3000:]
        assert fleet.stop("w1") == 0, fleet.log("w1")[-3000:]
    finally:
        fleet.close()
    expected = {r: {"e0", "e1"} for r in before + after}
    expected[mid] = {"a", "b", "c"}
    assert_once(provider.log, expected)


@pytest.mark.slow
def test_an_outcome_write_that_outlasts_the_retry_budget_is_reconciled_not_resent(
    own_pg: Path, own_db: str, provider: CountingProvider, records: Records
) -> None:
    """The server goes away after the provider applied "a" and before the ledger
    recorded it, for longer than the store retries (0.5 s here). The ledger stops; the
    worker does not: it waits for the database, starts its ledger again from disk, finds
    "a" in doubt, asks the provider (class B lookup) and goes on. "a" is sent once."""
    answered = threading.Event()

    def hold_first_answer(response: httpx.Response) -> None:
        if response.request.url.path == "/deliver" and not answered.is_set():
            answered.wait(60)  # "a" is applied; its answer waits for the outage

    client = httpx.Client(
        timeout=httpx.Timeout(120.0), event_hooks={"response": [hold_first_answer]}
    )
    flow = Flow("blip", version="1")

    @flow.step(start=True)
    def send(ctx: StepContext) -> Transition:
        url = str(ctx.state["url"])
        http = GuardedHTTP(client, ctx.ledger)
        for label in ("a", "b"):
            http.post(
                f"{url}/deliver",
                effect="deliver@1",
                json={"run": ctx.run_id, "label": label},
                provider_class="B",
                lookup=f"{url}/lookup/{{key}}",
            )
        return ctx.end("sent")

    store = Store.open(own_db, retry=DatabaseRetry(budget_s=0.5))
    ledger = Ledger(store, KEYRING, owner="w1")
    try:
        rt = Runtime(store, ledger, [flow], owner="w1", lease_s=5.0)
        rid = rt.start("blip", {"url": provider.url})
        worker = Worker(rt, poll_s=0.2)
        running = Background("worker", worker.run)
        provider.wait_for(1, 30)
        pgserver.stop(own_pg)
        answered.set()
        wait_until(lambda: worker.stats.outages >= 2, 60, "the worker waits for the database")
        assert running.thread.is_alive()
        _up(own_pg)
        wait_until(lambda: store.get_run(rid).status is RunStatus.COMPLETED, 60, "completed")
        worker.stop()
        stats = running.result()
        (a,) = [e for e in ledger.effects(run_id=rid) if e.provider_key == provider.log[0].key]
        events = [e["event"] for e in ledger.audit_events(rid)]
    finally:
        ledger.close()
        store.close()
        client.close()
    assert [d.label for d in provider.log] == ["a", "b"]
    assert_once(provider.log, {rid: {"a", "b"}})
    assert provider.lookups >= 1  # "a" was settled by asking, not by sending again
    assert a.status is EffectStatus.COMMITTED
    assert "reconciled" in events
    assert stats.runs_driven == 1
    assert stats.outages >= 2
    assert any("could not record this effect's outcome" in m for m in records.warnings()), (
        records.warnings()
    )


def _all_completed(rt: Runtime, ids: list[str]) -> bool:
    return all(rt.store.get_run(r).status is RunStatus.COMPLETED for r in ids)


# -- terminated connections -----------------------------------------------------------------
@pytest.mark.slow
def test_terminated_connections_of_a_worker_mid_run_duplicate_nothing(
    pg_db: str, provider: CountingProvider, tmp_path: Path
) -> None:
    """``pg_terminate_backend`` of every connection to the database, again and again
    while a worker process drives runs: its transactions fail (mid-transaction, or at
    COMMIT), it retries or recovers, keeps running, and every effect is sent once."""
    runs, effects = 4, 6
    admin = create_engine(pg_db, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    fleet = Fleet(pg_db, tmp_path)
    done = threading.Event()
    kills: list[int] = []

    def terminate() -> None:
        while not done.wait(0.15):
            with admin.connect() as conn:
                n = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
            kills.append(int(n))

    try:
        fleet.spawn("w1", lease_s=10, poll_s=0.2)
        with runtime_on(pg_db) as rt:
            ids = [
                rt.start("batch", {"url": provider.url, "effects": effects, "per_step": 2})
                for _ in range(runs)
            ]
            provider.wait_for(1, 30)  # the worker is at work: it has more to write
            killer = threading.Thread(target=terminate, daemon=True)
            killer.start()
            try:
                wait_until(lambda: _all_completed(rt, ids), 120, "every run completed")
            finally:
                done.set()
                killer.join(10)
            assert fleet.procs["w1"].poll() is None, fleet.log("w1")[-3000:]
            for r in ids:
                assert rt.store.load(r).state["result"] == {"sent": effects}
        assert fleet.stop("w1") == 0, fleet.log("w1")[-3000:]
    finally:
        fleet.close()
        admin.dispose()
    assert sum(kills) > 0
    assert "retrying" in fleet.log("w1")  # its own connection was among those terminated
    assert_once(provider.log, {r: {f"e{i}" for i in range(effects)} for r in ids})


# -- a SQLite lock held past busy_timeout ---------------------------------------------------
def test_a_sqlite_lock_held_past_busy_timeout_makes_a_worker_and_a_resolve_wait(
    tmp_path: Path, provider: CountingProvider, records: Records
) -> None:
    """Another connection holds the write lock far longer than ``busy_timeout`` (100 ms)
    while a worker is inside a step and an operator resolves an effect: both wait (their
    retries are logged) and both succeed once the lock is gone; the worker never stops."""
    path = tmp_path / "locked.db"
    url = f"sqlite:///{path}"
    _migrate(url)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(Store.open(url, busy_timeout_ms=100))
        ledger = Ledger(store, KEYRING, owner="w1")
        stack.callback(ledger.close)
        rt = Runtime(store, ledger, FLOWS, owner="w1", lease_s=30.0)
        # An effect in doubt, for the operator (another process's store and ledger).
        ops_store = stack.enter_context(Store.open(url, busy_timeout_ms=100))
        ops_ledger = Ledger(ops_store, KEYRING, owner="ops")
        stack.callback(ops_ledger.close)
        doubtful = ops_ledger.claim(ident(run=None, explicit="inv-7", effect="charge@1"), 7)
        assert isinstance(doubtful, Claim)
        ops_ledger.mark_unknown(doubtful, "timeout")

        rid = rt.start("pause", {"url": provider.url, "pause_s": 0.5})
        worker = Worker(rt, poll_s=0.1)
        running = Background("worker", worker.run)
        provider.wait_for(1, 30)  # "a" sent; the step pauses, then writes again
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)
        holder.execute("BEGIN IMMEDIATE")
        try:
            resolving = Background(
                "operator",
                lambda: Operator(ops_store, ops_ledger).resolve(
                    doubtful.key_id, happened=True, evidence="provider log", actor="alice"
                ),
            )
            wait_until(
                lambda: bool(
                    records.warnings(thread="worker", logger="onceonly.store")
                    and records.warnings(thread="operator", logger="onceonly.store")
                ),
                60,
                "both wait for the lock",
            )
            assert running.thread.is_alive()
            assert resolving.thread.is_alive()
        finally:
            holder.rollback()
            holder.close()
        resolved = resolving.result()
        wait_until(lambda: store.get_run(rid).status is RunStatus.COMPLETED, 60, "completed")
        worker.stop()
        stats = running.result()
    assert resolved.status is EffectStatus.COMMITTED
    assert (stats.runs_driven, stats.outages) == (1, 0)
    assert "DatabaseLocked" in records.warnings(thread="worker")[0]
    assert_once(provider.log, {rid: {"a", "b", "c"}})


def test_stop_ends_an_idle_workers_wait_for_the_database_at_once(
    tmp_path: Path, records: Records
) -> None:
    """While the lock is held (and would be for the whole retry budget) an idle worker
    keeps trying; stop() ends its wait at once, not after the budget."""
    path = tmp_path / "idle.db"
    url = f"sqlite:///{path}"
    _migrate(url)
    with Store.open(url, busy_timeout_ms=200) as store:
        ledger = Ledger(store, KEYRING, owner="w1")
        try:
            worker = Worker(Runtime(store, ledger, FLOWS, owner="w1"), poll_s=0.1)
            holder = sqlite3.connect(path, isolation_level=None, timeout=30)
            holder.execute("BEGIN IMMEDIATE")
            try:
                running = Background("worker", worker.run)
                wait_until(
                    lambda: bool(records.warnings(thread="worker", logger="onceonly.store")),
                    30,
                    "the claim round waits for the lock",
                )
                worker.stop()
                running.thread.join(store.retry.budget_s / 2)
                assert not running.thread.is_alive(), "stop() waited out the retry budget"
                stats = running.result()
            finally:
                holder.rollback()
                holder.close()
        finally:
            ledger.close()
    assert stats.runs_driven == 0


# -- a COMMIT whose answer is lost ----------------------------------------------------------
def test_a_lost_commit_is_raised_as_maybe_written_and_never_retried_blindly(pg_db: str) -> None:
    """The proxy forwards COMMIT, the server commits, the answer is lost. The store says
    so (``may_have_committed``) and does not run the transaction again: one row. The
    control, the same transaction declared idempotent, is retried: a second row, the
    duplicate a blind retry makes."""
    engine = create_engine(pg_db, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("CREATE TABLE blip_rows (id serial PRIMARY KEY, note text)"))
    proxy = CommitCutter(pg_db)
    proxy.armed = False
    store = Store.open(proxy.url)

    def insert(cur: Any) -> None:
        cur.execute("INSERT INTO blip_rows (note) VALUES (%s)", ("once",))

    def rows() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM blip_rows")).scalar_one())

    try:
        proxy.armed = True
        with pytest.raises(DatabaseUnavailable) as info:
            store.transact(insert)
        assert not proxy.armed  # the cut happened
        assert info.value.may_have_committed
        assert info.value.transient
        assert "may or may not have been written" in str(info.value)
        assert rows() == 1  # the server had committed it

        # The store goes on (a fresh connection), and a checkpoint whose COMMIT answer is
        # lost is not written twice either: it is there once, and the run is not torn.
        run = store.create_run("flow", next_step="one")
        proxy.armed = True
        with pytest.raises(DatabaseUnavailable) as saved:
            store.save(run.run_id, {"n": 1}, step="one", next_step="two")
        assert saved.value.may_have_committed
        assert [h.seq for h in store.history(run.run_id)] == [0]
        assert store.load(run.run_id).state == {"n": 1}
        assert store.get_run(run.run_id).next_step == "two"

        # Control: declared idempotent, the lost COMMIT is retried, and it duplicates.
        proxy.armed = True
        store.transact(insert, idempotent=True)
        assert not proxy.armed
        assert rows() == 3
    finally:
        store.close()
        proxy.close()
        engine.dispose()


def test_a_lost_outcome_commit_stops_the_ledger_and_recover_replays_it(pg_db: str) -> None:
    """The answer to the COMMIT of an effect's outcome is lost (the server had
    committed it): the ledger stops rather than act again; after ``recover()`` the
    effect replays from what is on disk and is not performed a second time."""
    proxy = CommitCutter(pg_db)
    proxy.armed = False
    store = Store.open(proxy.url)
    ledger = Ledger(store, KEYRING, owner="w1")
    calls: list[int] = []

    def act(claim: Claim) -> str:
        calls.append(claim.epoch)
        proxy.armed = True  # the next COMMIT is the outcome's
        return "sent"

    try:
        with pytest.raises(LedgerUnavailable) as info:
            ledger.perform(ident(0), {"n": 0}, act)
        assert is_transient(info.value)
        assert isinstance(info.value.__cause__, DatabaseUnavailable)
        assert info.value.__cause__.may_have_committed
        with pytest.raises(LedgerUnavailable):  # stopped: nothing more through it
            ledger.perform(ident(1), {"n": 1}, act)
        assert calls == [1]
        ledger.recover()
        again = ledger.perform(ident(0), {"n": 0}, act)
        assert again == "sent"  # replayed from the committed row
        assert calls == [1]
        claimed = ledger.claim(ident(0), {"n": 0})
        assert isinstance(claimed, Replay)
        assert ledger.get(ledger.key_id(ident(0))).status is EffectStatus.COMMITTED
        assert ledger.verify().ok
    finally:
        ledger.close()
        store.close()
        proxy.close()


def test_recover_refuses_while_the_database_does_not_answer(own_pg: Path, own_db: str) -> None:
    store = Store.open(own_db, retry=DatabaseRetry(budget_s=0.3))
    ledger = Ledger(store, KEYRING, owner="w1")
    try:
        claim = ledger.claim(ident(0), {"n": 0})
        assert isinstance(claim, Claim)
        pgserver.stop(own_pg)
        with pytest.raises(LedgerUnavailable):
            ledger.commit(claim, "sent")
        with pytest.raises(LedgerUnavailable) as info:
            ledger.recover()
        assert is_transient(info.value)
        with pytest.raises(LedgerUnavailable):  # still stopped
            ledger.claim(ident(1), {"n": 1})
        _up(own_pg)
        ledger.recover()
        # The unrecorded outcome is in doubt now, as after a restart, and is reconciled.
        with pytest.raises(EffectInDoubt):
            ledger.claim(ident(0), {"n": 0})
        record = ledger.reconcile(claim.key_id, Evidence.HAPPENED, result="probed")
        assert not isinstance(record, Claim)
        assert record.status is EffectStatus.COMMITTED
    finally:
        ledger.close()
        store.close()
