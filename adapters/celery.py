"""Celery tasks whose effects happen once: keys from the task's identity, not its delivery.

With ``acks_late=True`` and ``task_reject_on_worker_lost=True`` Celery redelivers a task
whose worker process died mid-task, so no task is lost; but the e-mail or payment the
dead process already made is made again by the redelivery. :func:`guarded_task` closes
that gap: inside the decorated task every guarded call (:func:`adapters.guard`,
``GuardedHTTP``, ``GuardedSMTP``, ...) is keyed by::

    run  = "celery:{task name}/{task id}"   (or "/{your business key}", with key=)
    step = "task"                           + the effect's name and ordinal

The task id is the same in every delivery, redelivery and ``Task.retry`` of the task (the
delivery tag is not, and is never used), so a redelivered task replays what the first
delivery recorded instead of acting again. With ``key=`` the keys come from the task's
arguments instead (an order number): a second task sent for the same business then
replays too.

Outcomes of the ledger inside the task:

* ``EffectInFlight`` (another delivery of the task still holds a live claim: the broker
  redelivered while the first worker is alive, or its lease has not run out yet):
  ``Task.retry`` after the claim's lease, under the same task id.
* ``EffectInDoubt`` of a class A effect (the provider deduplicates our key inside its
  window): ``Task.retry``; the next attempt re-sends under the same key.
* Any other ``EffectInDoubt`` (class C, or past its window), ``ResultUnknown`` and the
  rest propagate: the task fails with a message that names the key id and the fix
  (``onceonly effects resolve KEY ...``). After an operator resolves it, send the task
  again under the same task id (``apply_async(..., task_id=ID)``) or the same business
  key: the effect replays the recorded result (or is sent, if it did not happen).

While a guarded call is in flight its claim's lease is renewed (every third of the
ledger's ``lease_s``), so a redelivery does not take a long call for abandoned. The
decorator refuses a task without ``acks_late`` and ``reject_on_worker_lost``: acked
early, a task whose worker died is lost, and its effect with it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

try:
    from celery import current_task
    from celery.app.task import Task
except ImportError as exc:  # pragma: no cover  (tests/test_extras.py runs it)
    raise ImportError(
        "onceonly.adapters.celery needs celery: pip install 'onceonly[celery]'"
    ) from exc

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import EffectInDoubt, EffectInFlight

from . import _leases
from .context import _watching, step

__all__ = ["guarded_task", "task_position"]

P = ParamSpec("P")
R = TypeVar("R")


def task_position(task: Task[Any, Any], business_key: str | None = None) -> tuple[str, str]:
    """The run and step a task's effects are keyed by.

    Args:
        task: The running task (``celery.current_task``).
        business_key: The task's business key, if it declares one.

    Returns:
        ``("celery:{task name}/{task id or business key}", "task")``.

    Raises:
        ConfigurationError: Not inside a task that Celery is running.
    """
    task_id = task.request.id
    if task_id is None:
        raise ConfigurationError(
            f"{task.name} was called directly, not run by Celery (it has no task id): call "
            f"it with .delay()/.apply_async(), or apply() in tests"
        )
    return f"celery:{task.name}/{business_key or task_id}", "task"


def _check(task: Task[Any, Any]) -> None:
    reject = task.reject_on_worker_lost
    if reject is None:
        reject = task.app.conf.task_reject_on_worker_lost
    if not task.acks_late or not reject:
        raise ConfigurationError(
            f"guarded task {task.name} needs acks_late=True and reject_on_worker_lost=True "
            f"(@app.task(acks_late=True, reject_on_worker_lost=True), or the task_acks_late "
            f"and task_reject_on_worker_lost settings): otherwise a task whose worker dies "
            f"is lost, and its effect with it"
        )


def guarded_task(
    *,
    key: Callable[..., str] | None = None,
    tenant: str = "",
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Key the guarded calls inside a Celery task by the task's identity.

    Put it under ``@app.task(acks_late=True, reject_on_worker_lost=True)`` (``bind=True``
    works too). The signature is preserved. The guarded calls use their own ledger; with
    the prefork pool, open it in each worker process (a database connection does not
    survive ``fork``): in a ``worker_process_init`` handler, or on first use.

    Args:
        key: The task's business key from its arguments (same signature as the task);
            default: the task id.
        tenant: The tenant the effects belong to.

    Returns:
        The decorator.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            task = current_task  # a proxy: false outside a task
            if not task or task.request.id is None:
                raise ConfigurationError(
                    f"guarded task {fn.__qualname__} called outside a Celery task: call it "
                    f"with .delay()/.apply_async(), or apply() in tests"
                )
            _check(task)
            run_id, step_id = task_position(task, None if key is None else key(*args, **kwargs))
            try:
                with step(run_id, step_id, tenant=tenant), _watching(_leases.LeaseKeeper()):
                    return fn(*args, **kwargs)
            except EffectInFlight as exc:
                wait = max(exc.expires_at - time.time(), 0.0) + 0.5
                raise task.retry(exc=exc, countdown=wait, max_retries=None) from exc
            except EffectInDoubt as exc:
                if exc.status == "unknown" and exc.provider_class == "A":
                    raise task.retry(exc=exc, countdown=1.0) from exc
                raise

        return wrapper

    return decorate
