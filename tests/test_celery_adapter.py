"""Celery tasks against a real Redis broker and real ``celery worker`` processes.

The oracle is the fake provider's own count of applied writes. A worker's pool process is
SIGKILLed after the provider applied and before the task returned; with ``acks_late`` and
``task_reject_on_worker_lost`` Celery redelivers the task (same task id). Guarded: one
delivery. The positive control (the same task unguarded): two.

Redis comes from ``ONCEONLY_TEST_REDIS_URL`` (``.ci/run`` starts one) or is started here
once per session; a missing ``redis-server`` fails the tests, never skips them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from onceonly.adapters import guard, step
from onceonly.adapters.celery import guarded_task, task_position
from onceonly.checkpoint import Store
from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import (
    EffectIdentity,
    InFlightPolicy,
    Keyring,
    LeaseLost,
    Ledger,
    LedgerError,
    Secret,
)

from . import engine_servers
from .celery_app import make_app
from .http_fake import FakeProvider

ROOT = Path(__file__).resolve().parents[1]
SECRET_HEX = "c3" * 32
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis server's URL (one per session)."""
    url = os.environ.get("ONCEONLY_TEST_REDIS_URL")
    if url:
        yield url
        return
    base = Path(tempfile.mkdtemp(prefix="onceonly-redis-"))
    try:
        yield engine_servers.start("redis", base)
    finally:
        engine_servers.stop(base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def app(redis_url: str) -> Iterator[Celery]:
    """The tests' Celery app, as a client (sends tasks, reads results)."""
    celery = make_app(redis_url)
    try:
        yield celery
    finally:
        celery.close()


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A provider that deduplicates a key when one is sent (none is required)."""
    fake = FakeProvider(dedup=True, require_key=False)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Workers:
    """``celery worker`` processes (prefork, one pool process each) on one queue."""

    def __init__(self, redis_url: str, db_url: str, tmp: Path) -> None:
        self.queue = f"q-{uuid.uuid4().hex[:8]}"
        self.hang = tmp / "hang"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = dict(
            os.environ,
            ONCEONLY_SECRETS=f"k1:{SECRET_HEX}",
            ONCEONLY_TEST_REDIS_URL=redis_url,
            ONCEONLY_TEST_CELERY_DB=db_url,
            PYTHONPATH=str(ROOT),
        )
        self.logs = tmp

    def start(self, name: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:
            proc = self._popen(log)
        self.procs.append(proc)
        return proc

    def _popen(self, log: Any) -> subprocess.Popen[bytes]:
        name = f"w{len(self.procs) + 1}"
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker"),
                *("--pool", "prefork", "--concurrency", "1", "-Q", self.queue),
                *("-n", f"{name}-{self.queue}@localhost", "--without-gossip", "--without-mingle"),
                *("--without-heartbeat", "--loglevel", "INFO"),
            ],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # its pool process exits with it
                proc.wait(30)


@pytest.fixture
def workers(redis_url: str, db_url: str, tmp_path: Path) -> Iterator[Workers]:
    """Worker processes sharing the test's ledger database (SQLite file or PostgreSQL)."""
    store = Store.open(db_url)  # the ledger's tables, before the workers race to make them
    Ledger(store, Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))])).close()
    store.close()
    w = Workers(redis_url, db_url, tmp_path)
    try:
        yield w
    finally:
        w.close()


def kill_pool_process_after_apply(
    app: Celery, w: Workers, provider: FakeProvider, task: str, *, after_answer: bool = True
) -> Callable[[], Any]:
    """Start a worker and send ``task``; returns what SIGKILLs the pool process running it
    once the provider applied it (and, ``after_answer``, the task got its answer) and
    returns the redelivered task's result."""
    w.hang.touch()
    w.start("w1")
    sent = app.send_task(task, args=[provider.url, "order-1", str(w.hang)], queue=w.queue)

    def kill() -> Any:
        pid_file = Path(str(w.hang) + ".pid")
        wait_until(lambda: len(provider.applied) == 1, "the provider to apply")
        wait_until(pid_file.exists, "the task's process id")
        if after_answer:  # the provider answered and the ledger recorded it: wait for that
            wait_until(Path(str(w.hang) + ".hanging").exists, "the task to hang")
        w.hang.unlink()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        return sent.get(timeout=90)

    return kill


@pytest.fixture
def control(redis_url: str, tmp_path: Path) -> Iterator[tuple[Workers, FakeProvider]]:
    """Workers and a provider for the positive control, run beside the guarded case."""
    fake = FakeProvider(dedup=True, require_key=False)
    fake.start()
    (tmp_path / "control").mkdir()
    w = Workers(redis_url, f"sqlite:///{tmp_path / 'unused.db'}", tmp_path / "control")
    try:
        yield w, fake
    finally:
        w.close()
        fake.stop()


def test_a_pool_process_killed_after_the_provider_applied_delivers_once(
    app: Celery,
    workers: Workers,
    provider: FakeProvider,
    control: tuple[Workers, FakeProvider],
    db_url: str,
) -> None:
    """Guarded: one delivery; beside it (on SQLite) the control, unguarded: two."""
    kills = [kill_pool_process_after_apply(app, workers, provider, "place_order")]
    bare, bare_provider = control
    if db_url.startswith("sqlite"):
        kills.append(kill_pool_process_after_apply(app, bare, bare_provider, "place_order_bare"))
    answer, *_ = [kill() for kill in kills]
    assert answer["request"] == {"order": "order-1"}
    assert len(provider.applied) == 1  # the redelivered task replayed the recorded result
    assert len(provider.writes) == 1
    assert "WorkerLostError" in (workers.logs / "w1.log").read_text()  # it really died
    if db_url.startswith("sqlite"):
        assert len(bare_provider.applied) == 2  # the control: delivered again


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_killed_while_the_answer_was_in_flight_the_redelivery_resends_under_the_same_key(
    app: Celery, workers: Workers, provider: FakeProvider
) -> None:
    """The provider applied and holds its answer back; the pool process dies with its claim
    open. The redelivered task waits out the claim's lease, then (class A) re-sends under
    the same key, which the provider deduplicates."""
    provider.faults.append("drop")  # popped by the request: the kill comes before the answer
    provider.sleep_s = 8.0
    answer = kill_pool_process_after_apply(
        app, workers, provider, "place_order", after_answer=False
    )()
    assert answer["request"] == {"order": "order-1"}
    assert len(provider.applied) == 1
    assert len(provider.writes) == 2
    assert len({r.idempotency_key for r in provider.writes}) == 1


def kill_whole_worker_after_apply(
    app: Celery, w: Workers, provider: FakeProvider, task: str
) -> Callable[[], Any]:
    """Start two workers, send ``task``; returns what SIGKILLs the worker running it (its
    main process and its pool process) once the task got the provider's answer, and
    returns the result of the task as Redis redelivers it to the other worker (after the
    visibility timeout)."""
    w.env["ONCEONLY_TEST_CELERY_VISIBILITY_S"] = "3"
    w.hang.touch()
    w.start("w1")
    sent = app.send_task(task, args=[provider.url, "order-1", str(w.hang)], queue=w.queue)

    def kill() -> Any:
        wait_until(Path(str(w.hang) + ".hanging").exists, "the task to hang")
        w.start("w2")  # started now: it cannot have taken the task
        w.procs[0].send_signal(signal.SIGKILL)
        w.procs[0].wait(30)
        os.kill(int(Path(str(w.hang) + ".pid").read_text()), signal.SIGKILL)
        w.hang.unlink()
        return sent.get(timeout=90)

    return kill


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_whole_worker_killed_the_task_redelivered_to_another_delivers_once(
    app: Celery,
    workers: Workers,
    provider: FakeProvider,
    control: tuple[Workers, FakeProvider],
) -> None:
    """Guarded: one delivery; beside it the control, unguarded: two."""
    bare, bare_provider = control
    kills = [
        kill_whole_worker_after_apply(app, workers, provider, "place_order"),
        kill_whole_worker_after_apply(app, bare, bare_provider, "place_order_bare"),
    ]
    answer, _ = [kill() for kill in kills]
    assert answer["request"] == {"order": "order-1"}
    assert len(provider.applied) == 1
    assert len(bare_provider.applied) == 2


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_business_key_makes_two_tasks_for_one_order_deliver_once(
    app: Celery, workers: Workers, provider: FakeProvider
) -> None:
    workers.start("w1")
    sent = [
        app.send_task(
            "place_order_by_number",
            args=[provider.url, "order-7", str(workers.hang)],
            queue=workers.queue,
        )
        for _ in range(2)
    ]
    answers = [s.get(timeout=90) for s in sent]
    assert answers[0] == answers[1]
    assert len(provider.applied) == 1


# -- in process -------------------------------------------------------------------------


def test_a_task_acked_early_is_refused_with_the_fix() -> None:
    local = Celery("refuse", broker="memory://", backend="cache+memory://")

    @local.task(name="early")
    @guarded_task()
    def early() -> str:
        return "sent"

    outcome = early.apply()
    assert isinstance(outcome.result, ConfigurationError)
    assert "acks_late=True and reject_on_worker_lost=True" in str(outcome.result)

    @local.task(name="late", acks_late=True, reject_on_worker_lost=True)
    @guarded_task(key=lambda order: f"order:{order}")
    def late(order: str) -> tuple[str, str]:
        from celery import current_task

        return task_position(current_task, f"order:{order}")

    assert tuple(late.apply(args=["9"], task_id="t-1").get()) == ("celery:late/order:9", "task")
    local.close()


def test_a_guarded_task_called_directly_says_how_to_call_it() -> None:
    @guarded_task()
    def plain() -> str:
        return "sent"

    with pytest.raises(ConfigurationError, match="outside a Celery task"):
        plain()


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "control-not-kept"])
def test_a_long_call_keeps_its_claim_alive(store: Store, kept: bool) -> None:
    """While a guarded call in a task is in flight, its claim's lease is renewed: another
    worker sees it live past its first lease. The control (the same call keyed by hand,
    without the task guard) shows that worker taking the claim for abandoned."""
    keyring = Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))])
    ledger = Ledger(store, keyring, witness="", lease_s=0.6)
    other = Ledger(
        store, keyring, witness="", owner="another-worker", in_flight=InFlightPolicy(wait_s=0)
    )
    ident = EffectIdentity("", "celery:long/t-1", "task", 0, "long_call@1", 0)
    seen: list[str] = []

    def long_call(order: str) -> str:
        time.sleep(1.0)  # past the first lease: live only if it was renewed
        try:
            other.claim(ident, {"order": order}, provider_class="C")
        except LedgerError as exc:  # EffectInFlight: the claim is live, not expired
            seen.append(type(exc).__name__)
        return order

    call = guard(ledger, effect="long_call@1", provider_class="C")(long_call)
    local = Celery("long", broker="memory://", backend="cache+memory://")

    @local.task(name="long", acks_late=True, reject_on_worker_lost=True)
    @guarded_task()
    def long(order: str) -> str:
        return call(order)

    try:
        if kept:
            assert long.apply(args=["o-1"], task_id="t-1").get() == "o-1"
            assert seen == ["EffectInFlight"]
            assert ledger.get(ledger.key_id(ident)).status == "committed"
        else:
            with step("celery:long/t-1", "task"), pytest.raises(LeaseLost):
                call("o-1")  # the entry was moved on under it
            assert seen == ["EffectInDoubt"]
    finally:
        local.close()
        other.close()
        ledger.close()


def test_an_effect_in_doubt_fails_the_task_and_replays_once_resolved(store: Store) -> None:
    """Class C, the answer lost: the task fails with EffectInDoubt naming the key and the
    command, nothing is re-sent; resolved by a person, the task sent again under the same
    task id replays the recorded result."""
    ledger = Ledger(store, Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))]), witness="")
    charged: list[str] = []

    def charge(order: str) -> str:
        charged.append(order)
        if len(charged) == 1:
            raise TimeoutError("the provider did not answer")  # it did charge
        return f"charge-{len(charged)}"

    pay = guard(ledger, effect="charge@1", provider_class="C")(charge)
    local = Celery("doubt", broker="memory://", backend="cache+memory://")

    @local.task(name="charge", acks_late=True, reject_on_worker_lost=True)
    @guarded_task()
    def charge_task(order: str) -> str:
        return pay(order)

    try:
        failed = charge_task.apply(args=["o-1"], task_id="t-9")
        # Celery rebuilds the error from its message for the caller (EffectInDoubt's
        # fields do not survive that): the message names the key and the command.
        key_id = ledger.key_id(EffectIdentity("", "celery:charge/t-9", "task", 0, "charge@1", 0))
        assert failed.failed()
        assert "is in doubt" in str(failed.result)
        assert f"onceonly effects resolve {key_id}" in str(failed.result)
        assert charge_task.apply(args=["o-1"], task_id="t-9").failed()  # still in doubt
        assert charged == ["o-1"]
        ledger.resolve(
            key_id,
            happened=True,
            evidence="the charge is on the statement",
            actor="ops@example.com",
            result="charge-1",
        )
        assert charge_task.apply(args=["o-1"], task_id="t-9").get() == "charge-1"
        assert charged == ["o-1"]
    finally:
        local.close()
        ledger.close()
