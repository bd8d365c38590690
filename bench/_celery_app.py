"""The Celery app of ``python -m bench engines``: a bare and a guarded task whose body
increments a counter (configured from ``BENCH_REDIS_URL``, ``BENCH_LEDGER_DB``,
``ONCEONLY_SECRETS``)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from celery import Celery

from onceonly.adapters import guard
from onceonly.adapters.celery import guarded_task
from onceonly.checkpoint import Store
from onceonly.ledger import Keyring, Ledger

__all__ = ["app", "make_app"]


def make_app(redis_url: str) -> Celery:
    """A Celery app on ``redis_url`` (broker in its db, results in the next db)."""
    base = redis_url.rsplit("/", 1)[0]
    celery = Celery("onceonly_bench", broker=f"{base}/0", backend=f"{base}/1")
    celery.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return celery


app = make_app(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
COUNTER = [0]


def _bump() -> int:
    COUNTER[0] += 1
    return COUNTER[0]


@functools.cache
def _guarded() -> Callable[[], int]:
    """The guarded effect, on this worker process's ledger (opened on first use)."""
    store = Store.open(f"sqlite:///{os.environ['BENCH_LEDGER_DB']}")
    ledger = Ledger(store, Keyring.from_env(), witness="")
    return guard(ledger, effect="bench_effect@1", provider_class="C")(_bump)


@app.task(name="bench_bare")
def bench_bare() -> int:
    """The unguarded task."""
    return _bump()


@app.task(name="bench_guarded")
@guarded_task()
def bench_guarded() -> int:
    """The guarded task."""
    return _guarded()()
