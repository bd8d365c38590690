"""The Celery app of tests/test_celery_adapter.py, run by real ``celery worker`` processes.

Configured from the environment: ``ONCEONLY_TEST_REDIS_URL`` (broker and result backend),
``ONCEONLY_TEST_CELERY_DB`` (the ledger's database), ``ONCEONLY_SECRETS`` (its keys),
``ONCEONLY_TEST_CELERY_VISIBILITY_S`` (Redis's visibility timeout, if set).

Tasks (all ``acks_late=True``, ``reject_on_worker_lost=True``): ``place_order`` POSTs an
order to the fake provider as a guarded class A effect keyed by the task id;
``place_order_by_number`` the same keyed by the order number (a business key); and
``place_order_bare`` without a guard (the positive control). While the file ``hang`` names
exists, a task hangs after the provider answered (each task writes its process id to
``hang + ".pid"`` first), so the test can SIGKILL the pool process between the provider's apply
and the task's end.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import httpx
from celery import Celery

from onceonly.adapters.celery import guarded_task
from onceonly.adapters.http import GuardedHTTP
from onceonly.checkpoint import Store
from onceonly.ledger import Keyring, Ledger

__all__ = ["app", "make_app"]


def make_app(redis_url: str) -> Celery:
    """A Celery app on ``redis_url`` (broker in its db, results in the next db)."""
    base = redis_url.rsplit("/", 1)[0]
    celery = Celery("onceonly_tests", broker=f"{base}/0", backend=f"{base}/1")
    celery.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
    )
    visibility = os.environ.get("ONCEONLY_TEST_CELERY_VISIBILITY_S")
    if visibility:  # how long Redis keeps an unacked message from the other workers
        celery.conf.broker_transport_options = {
            "visibility_timeout": float(visibility),
            # sweep for abandoned messages every second (default: about every 100 s), and
            # let a sweep's lock held by a killed worker lapse soon (default: 300 s)
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        }
    return celery


app = make_app(os.environ.get("ONCEONLY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))


@functools.cache
def _client(pid: int, provider: str) -> GuardedHTTP:
    """This pool process's ledger and client (a connection does not survive fork)."""
    store = Store.open(os.environ["ONCEONLY_TEST_CELERY_DB"])
    ledger = Ledger(store, Keyring.from_env(), owner=f"celery-{pid}", lease_s=4.0)
    return GuardedHTTP(httpx.Client(base_url=provider, timeout=30.0), ledger)


def _started(hang: str) -> None:
    Path(hang + ".pid").write_text(str(os.getpid()))


def _hang_while_asked(hang: str) -> None:
    Path(hang + ".hanging").touch()  # the provider answered, the task has not returned
    while Path(hang).exists():  # the test SIGKILLs this process here
        time.sleep(0.05)


def _post(provider: str, order: str) -> Any:
    answer = _client(os.getpid(), provider).post(
        "/orders",
        effect="place_order@1",
        json={"order": order},
        provider_class="A",
        window_s=3600.0,
    )
    return answer["json"]


@app.task(name="place_order", acks_late=True, reject_on_worker_lost=True)
@guarded_task()
def place_order(provider: str, order: str, hang: str) -> Any:
    """Place ``order`` once per task id."""
    _started(hang)
    result = _post(provider, order)
    _hang_while_asked(hang)
    return result


@app.task(name="place_order_by_number", acks_late=True, reject_on_worker_lost=True)
@guarded_task(key=lambda provider, order, hang: f"order:{order}")
def place_order_by_number(provider: str, order: str, hang: str) -> Any:
    """Place ``order`` once, whichever task asks for it."""
    _started(hang)
    result = _post(provider, order)
    _hang_while_asked(hang)
    return result


@app.task(name="place_order_bare", acks_late=True, reject_on_worker_lost=True)
def place_order_bare(provider: str, order: str, hang: str) -> Any:
    """The control: no guard."""
    _started(hang)
    with httpx.Client(base_url=provider, timeout=30.0) as client:
        result = client.post("/orders", json={"order": order}).json()
    _hang_while_asked(hang)
    return result
