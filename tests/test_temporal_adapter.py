"""Temporal activities against a real Temporal dev server and real worker processes.

The oracle is the fake provider's own count of applied writes (and raw requests). Each
scenario SIGKILLs a worker process between the provider's apply and the activity's
completion, or lets an attempt time out; Temporal retries the activity on a fresh
worker. Guarded: one delivery. The positive control (the same activity unguarded):
two.

The server comes from ``ONCEONLY_TEST_TEMPORAL`` (``.ci/run`` starts one) or is started
here once per session; a missing ``temporal`` program fails the tests, never skips them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
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
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import ActivityEnvironment

from onceonly.adapters import guard
from onceonly.adapters.temporal import activity_position, guarded_activity, temporal_error
from onceonly.checkpoint import Store
from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import (
    EffectIdentity,
    EffectInDoubt,
    EffectInFlight,
    InFlightPolicy,
    Keyring,
    LeaseLost,
    Ledger,
    LedgerError,
    Secret,
)

from . import engine_servers
from .http_fake import FakeProvider

ROOT = Path(__file__).resolve().parents[1]
SECRET_HEX = "5e" * 32
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def temporal_address() -> Iterator[str]:
    """The Temporal dev server's address (one per session)."""
    address = os.environ.get("ONCEONLY_TEST_TEMPORAL")
    if address:
        yield address
        return
    base = Path(tempfile.mkdtemp(prefix="onceonly-temporal-"))
    try:
        yield engine_servers.start("temporal", base)
    finally:
        engine_servers.stop(base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A provider that deduplicates a key when one is sent (none is required)."""
    fake = FakeProvider(dedup=True, require_key=False, sleep_s=6.0)
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
    """Worker processes of tests/temporal_worker.py on one task queue."""

    def __init__(self, address: str, db_url: str, provider: FakeProvider, tmp: Path) -> None:
        self.address = address
        self.db_url = db_url
        self.provider = provider
        self.queue = f"q-{uuid.uuid4().hex[:8]}"
        self.hang = tmp / "hang"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = dict(os.environ, ONCEONLY_SECRETS=f"k1:{SECRET_HEX}", PYTHONPATH=str(ROOT))

    def start(self, mode: str, owner: str, *, standby: bool = False) -> subprocess.Popen[bytes]:
        argv = [self.address, self.queue, self.db_url, self.provider.url, mode, str(self.hang)]
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.temporal_worker", *argv, owner),
                "standby" if standby else "now",
            ],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)


@pytest.fixture
def workers(
    temporal_address: str, db_url: str, provider: FakeProvider, tmp_path: Path
) -> Iterator[Workers]:
    """Worker processes sharing the test's ledger database (SQLite file or PostgreSQL)."""
    make_tables(db_url)
    w = Workers(temporal_address, db_url, provider, tmp_path)
    try:
        yield w
    finally:
        w.close()


def make_tables(db_url: str) -> None:
    """The ledger's tables, before the workers race to make them."""
    store = Store.open(db_url)
    Ledger(store, Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))])).close()
    store.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _start(address: str, queue: str, workflow_id: str, order: str, timeout_s: float) -> None:
    client = await Client.connect(address)
    await client.start_workflow(
        "PlaceOrder", args=[order, timeout_s], id=workflow_id, task_queue=queue
    )


async def _result(address: str, workflow_id: str) -> Any:
    client = await Client.connect(address)
    return await client.get_workflow_handle(workflow_id).result()


def start(w: Workers, workflow_id: str, order: str, timeout_s: float = 60.0) -> None:
    """Start a workflow (its id made unique on the server by the workers' queue)."""
    run(_start(w.address, w.queue, f"{w.queue}-{workflow_id}", order, timeout_s))


def result(w: Workers, workflow_id: str) -> Any:
    return run(asyncio.wait_for(_result(w.address, f"{w.queue}-{workflow_id}"), 120))


def kill_after_apply(w: Workers, mode: str, wid: str) -> Callable[[], None]:
    """Start worker 1 (hanging after the provider answered) and worker 2 (on standby),
    start the workflow; returns what SIGKILLs worker 1 once the provider applied (worker 2
    then takes over)."""
    w.hang.touch()
    first = w.start(mode, "worker-1")
    w.start(mode, "worker-2", standby=True)
    start(w, wid, "order-1")

    def kill() -> None:
        wait_until(w.hang.with_suffix(".hanging").exists, "the activity to hang")
        w.kill(first)
        w.hang.unlink()

    return kill


@pytest.fixture
def other(temporal_address: str, tmp_path: Path) -> Iterator[Workers]:
    """Workers of a second scenario run beside the first one (own queue and provider)."""
    fake = FakeProvider(dedup=True, require_key=False, sleep_s=6.0)
    fake.start()
    (tmp_path / "other").mkdir()
    db_url = f"sqlite:///{tmp_path / 'other.db'}"
    make_tables(db_url)
    w = Workers(temporal_address, db_url, fake, tmp_path / "other")
    try:
        yield w
    finally:
        w.close()
        fake.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: two workers
def test_a_worker_killed_after_the_provider_applied_delivers_once(
    workers: Workers, other: Workers
) -> None:
    """Guarded: one delivery; beside it the control, the same activity unguarded: two."""
    kills = [
        kill_after_apply(workers, "guarded-a", "wf-kill"),
        kill_after_apply(other, "bare", "wf-bare"),
    ]
    for kill in kills:
        kill()
    answer = result(workers, "wf-kill")
    result(other, "wf-bare")
    assert answer["request"] == {"order": "order-1"}
    assert len(workers.provider.applied) == 1  # the retry replayed the recorded result
    assert len(workers.provider.writes) == 1  # it did not even reach the provider
    assert len(other.provider.applied) == 2  # the control: the retry delivered again


def dropped_answer(w: Workers, mode: str, wid: str) -> Callable[[], None]:
    """The provider applies and holds its answer back; returns what SIGKILLs worker 1
    meanwhile (worker 2 takes over: the claim is left open, and its lease runs out)."""
    w.provider.faults.append("drop")
    w.hang.touch()  # only to hold worker 2 on standby: the answer never comes
    first = w.start(mode, "worker-1")
    w.start(mode, "worker-2", standby=True)
    start(w, wid, "order-1")

    def kill() -> None:
        wait_until(lambda: len(w.provider.applied) == 1, "the provider to apply")
        w.kill(first)
        w.hang.unlink()

    return kill


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_killed_while_the_answer_was_in_flight(
    workers: Workers, other: Workers, db_url: str
) -> None:
    """Class A: the retry re-sends under the same key, which the provider deduplicates.
    Class C: the effect is in doubt; the activity fails without retry, naming the key and
    the command; once resolved, the workflow run again replays the recorded result."""
    other.db_url = db_url
    kills = [
        dropped_answer(workers, "guarded-a", "wf-drop"),
        dropped_answer(other, "guarded-c", "wf-doubt"),
    ]
    for kill in kills:
        kill()

    assert result(workers, "wf-drop")["request"] == {"order": "order-1"}
    assert len(workers.provider.applied) == 1
    assert len(workers.provider.writes) == 2  # re-sent, and deduplicated by its key
    assert len({r.idempotency_key for r in workers.provider.writes}) == 1

    with pytest.raises(WorkflowFailureError) as failed:
        result(other, "wf-doubt")
    cause = failed.value.cause
    assert isinstance(cause, ActivityError)
    error = cause.cause
    assert isinstance(error, ApplicationError)
    assert error.type == "EffectInDoubt"
    assert error.non_retryable
    key_id = error.details[0]
    assert f"onceonly effects resolve {key_id}" in error.message
    assert len(other.provider.applied) == 1  # never re-sent blindly
    assert len(other.provider.writes) == 1

    recorded = {"status": 201, "json": other.provider.applied[0][1]}
    subprocess.run(
        [
            *(sys.executable, "-m", "onceonly", "effects", "resolve", key_id, "--url", db_url),
            *("--happened", "--result", json.dumps(recorded)),
            *("--evidence", "order 1 is in the provider's list", "--as", "ops@example.com"),
        ],
        env=other.env,
        check=True,
        capture_output=True,
    )
    start(other, "wf-doubt", "order-1")  # the workflow again, under the same id
    assert result(other, "wf-doubt") == other.provider.applied[0][1]
    assert len(other.provider.applied) == 1


def timed_out_attempt(w: Workers, mode: str) -> Callable[[], int]:
    """The provider is slower than the activity's start-to-close timeout: Temporal starts
    another attempt while the first one's request is still being applied. Returns what
    waits for the workflow and every request's answer and counts the applied writes."""
    w.provider.faults.append("slow")  # holds the key in flight for sleep_s, then applies
    w.provider.sleep_s = 4.0
    w.start(mode, "worker-1")
    start(w, "wf-timeout", "order-1", timeout_s=1.5)

    def applied() -> int:
        assert result(w, "wf-timeout")["request"] == {"order": "order-1"}
        wait_until(lambda: all(r.status is not None for r in w.provider.writes), "every answer")
        return len(w.provider.applied)

    return applied


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_attempt_that_times_out_is_retried_without_a_second_delivery(
    workers: Workers, other: Workers
) -> None:
    """Guarded: one delivery; beside it the control, unguarded: two."""
    guarded, control = timed_out_attempt(workers, "guarded-a"), timed_out_attempt(other, "bare")
    assert guarded() == 1
    assert control() == 2


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_workers_one_killed_every_order_once(workers: Workers) -> None:
    workers.hang.touch()
    first = workers.start("guarded-a", "worker-1")
    second = workers.start("guarded-a", "worker-2")
    orders = [f"order-{i}" for i in range(6)]
    for order in orders:
        start(workers, f"wf-{order}", order)
    wait_until(lambda: len(workers.provider.applied) == len(orders), "every order applied")
    workers.kill(first)
    workers.hang.unlink()
    for order in orders:
        assert result(workers, f"wf-{order}")["request"] == {"order": order}
    assert second.poll() is None
    assert sorted(r["request"]["order"] for _, r in workers.provider.applied) == orders


def reset_after_completion(w: Workers, mode: str) -> Callable[[], int]:
    """Run the workflow to completion, then reset it to its first workflow task: the new
    run schedules the activity again, at the same position. Returns what waits for the
    new run and counts the provider's applied writes."""
    w.start(mode, "worker-1")
    start(w, "wf-reset", "order-1")

    def applied() -> int:
        first = result(w, "wf-reset")
        subprocess.run(
            [
                *(engine_servers.temporal_cli(), "workflow", "reset", "--address", w.address),
                *("-w", f"{w.queue}-wf-reset", "-t", "FirstWorkflowTask"),
                *("--reason", "replay the order"),
            ],
            check=True,
            capture_output=True,
        )
        again = result(w, "wf-reset")  # the new run's result
        assert again["request"] == first["request"]
        if mode != "bare":
            assert again == first  # replayed
        return len(w.provider.applied)

    return applied


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_workflow_reset_replays_the_effect(workers: Workers, other: Workers) -> None:
    """Guarded: one delivery; beside it the control, unguarded: two."""
    guarded, control = (
        reset_after_completion(workers, "guarded-a"),
        reset_after_completion(other, "bare"),
    )
    assert guarded() == 1
    assert control() == 2


async def _attempts(address: str, workflow_id: str) -> int:
    client = await Client.connect(address)
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return max(
        e.activity_task_started_event_attributes.attempt
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    )


def slow_provider(w: Workers, mode: str) -> Callable[[], int]:
    """The provider takes 5 s, longer than the activity's 2 s heartbeat timeout. Returns
    what waits for the workflow and counts the attempts Temporal started."""
    w.provider.faults.append("slow")
    w.provider.sleep_s = 5.0
    w.start(mode, "worker-1")
    start(w, "wf-slow", "order-1")

    def attempts() -> int:
        assert result(w, "wf-slow")["request"] == {"order": "order-1"}
        return int(run(_attempts(w.address, f"{w.queue}-wf-slow")))

    return attempts


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_activity_heartbeats_while_its_effect_is_in_flight(
    workers: Workers, other: Workers
) -> None:
    """Guarded: the slow call heartbeats, and the first attempt completes; beside it the
    control, unguarded (no heartbeat): the attempt times out and is retried."""
    guarded, control = slow_provider(workers, "guarded-a"), slow_provider(other, "bare")
    assert guarded() == 1
    assert len(workers.provider.applied) == 1
    assert control() > 1


# -- without a server -------------------------------------------------------------------


def test_ledger_errors_become_temporal_errors_that_say_what_to_do() -> None:
    doubt = temporal_error(EffectInDoubt("ab" * 32, "needs_human", "C"))
    assert doubt is not None
    assert doubt.non_retryable
    assert doubt.type == "EffectInDoubt"
    assert doubt.details == ("ab" * 32,)
    assert f"onceonly effects resolve {'ab' * 32}" in doubt.message
    a_in_window = temporal_error(EffectInDoubt("cd" * 32, "unknown", "A"))
    assert a_in_window is not None
    assert not a_in_window.non_retryable
    busy = temporal_error(EffectInFlight("ef" * 32, "worker-1", 0.0))
    assert busy is not None
    assert not busy.non_retryable
    assert busy.type == "EffectInFlight"
    assert temporal_error(ValueError("not ours")) is None


def test_beat_s_must_be_positive(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'l.db'}")
    ledger = Ledger(store, Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))]), witness="")
    with pytest.raises(ConfigurationError, match="beat_s"):
        guarded_activity(ledger, beat_s=0)
    ledger.close()
    store.close()
    assert callable(activity_position)


def environment(
    workflow_id: str = "wf-1", activity_id: str = "1", **info: Any
) -> ActivityEnvironment:
    """Temporal's in-process activity environment, as attempt 1 of activity ``activity_id``
    of workflow ``workflow_id`` (``info`` replaces more fields)."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        ActivityEnvironment.default_info(),
        workflow_id=workflow_id,
        activity_id=activity_id,
        activity_type="mail",
        **info,
    )
    return env


def test_keys_come_from_the_workflow_and_the_activity_never_the_attempt_or_run(
    store: Store,
) -> None:
    ledger = Ledger(store, Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))]), witness="")
    sent: list[str] = []

    def deliver(to: str) -> int:
        sent.append(to)
        return len(sent)

    send = guard(ledger, effect="mail@1", provider_class="C")(deliver)

    @activity.defn(name="mail")
    @guarded_activity(ledger)
    def mail(to: str) -> int:
        return send(to)

    # retries (attempts), a reset or a new run of the same workflow id: one delivery
    for attempt, run_id in ((1, "run-1"), (2, "run-1"), (1, "run-2")):
        env = environment(attempt=attempt, workflow_run_id=run_id)
        assert env.run(mail, "ada@example.com") == 1
    assert sent == ["ada@example.com"]
    # another activity of the workflow, or another workflow: their own effects
    assert environment(activity_id="2").run(mail, "ada@example.com") == 2
    assert environment(workflow_id="wf-2").run(mail, "ada@example.com") == 3

    # run_key names the run instead of the workflow id (continue-as-new)
    @activity.defn(name="mail")
    @guarded_activity(ledger, run_key=lambda info: f"{info.workflow_id}/{info.heartbeat_timeout}")
    def mail_by_run_key(to: str) -> int:
        return send(to)

    assert environment().run(mail_by_run_key, "ada@example.com") == 4
    assert environment().run(mail_by_run_key, "ada@example.com") == 4
    assert activity_position(environment().info) == ("temporal:default/wf-1", "mail#1")
    ledger.close()


@pytest.mark.parametrize("renewed", [True, False], ids=["beats", "control-no-renewal"])
def test_an_async_activity_heartbeats_the_key_id_while_its_effect_is_in_flight(
    store: Store, renewed: bool
) -> None:
    """While the effect is in flight, the activity heartbeats its key id and renews the
    claim's lease: another worker sees the claim live past its first lease. The control
    (beats too rare to renew) shows that worker taking the claim for expired."""
    ledger = Ledger(
        store, Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))]), witness="", lease_s=0.6
    )

    other = Ledger(
        store,
        Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))]),
        witness="",
        owner="another-worker",
        in_flight=InFlightPolicy(wait_s=0),
    )
    seen: list[str] = []

    async def slow(order: str) -> str:
        await asyncio.sleep(1.0)  # past the first lease: live only if it was renewed
        try:
            other.claim(identity_of(ledger), {"order": order}, provider_class="C")
        except LedgerError as exc:  # EffectInFlight: the claim is live, not expired
            seen.append(type(exc).__name__)
        return order

    place = guard(ledger, effect="order@1", provider_class="C")(slow)

    @activity.defn(name="mail")
    @guarded_activity(ledger, beat_s=0.05 if renewed else 100.0)
    async def place_order(order: str) -> str:
        before = await place(order)
        await asyncio.sleep(0.2)  # no effect in flight: no heartbeat
        return before

    beats: list[tuple[Any, ...]] = []
    env = environment()
    env.on_heartbeat = lambda *details: beats.append(details)
    key_id = ledger.key_id(identity_of(ledger))
    try:
        if not renewed:
            with pytest.raises(LeaseLost):  # the entry was moved on under it
                asyncio.run(env.run(place_order, "o-1"))
            assert seen == ["EffectInDoubt"]  # the other worker took it for abandoned
            return
        assert asyncio.run(env.run(place_order, "o-1")) == "o-1"
        assert len(beats) >= 2  # when the call started, and while it was in flight
        assert all(b == (key_id,) for b in beats)
        assert seen == ["EffectInFlight"]
        assert ledger.get(key_id).status == "committed"
    finally:
        other.close()
        ledger.close()


def identity_of(ledger: Ledger) -> EffectIdentity:
    """The identity of the first ``order@1`` effect of activity 1 of workflow wf-1."""
    return EffectIdentity("", "temporal:default/wf-1", "mail#1", 0, "order@1", 0)
