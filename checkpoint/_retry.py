"""Riding out a database that is briefly unavailable: which failures pass, which
transactions may run again, and for how long the store keeps trying.

The store applies these rules to every transaction it runs, reads and writes alike
(:meth:`Store.transact`, :meth:`Store.read`, checkpoint writes, leases, run rows), so
the effects ledger, the waits, the runtime, the worker and every operator action ride
on them:

* **Transient failures are retried**: SQLite's lock held past ``busy_timeout`` (another
  writer, a paused process); a PostgreSQL connection refused, lost or terminated (a
  server restart, ``pg_terminate_backend``, an administrator shutdown, a server starting
  up, too many connections); a serialization failure or a deadlock. Everything else is
  raised at once: a disk I/O error, a full disk, a read-only database, a constraint
  violation, a SQLite file that cannot be opened, a record that fails its integrity
  check, and every error onceonly raises itself (``ConcurrentWrite``, ``CorruptRecord``,
  the ledger's ``LedgerError`` ...). :func:`~checkpoint._engine.classify` decides, and
  marks the error ``transient``.
* **A transaction runs again only when nothing of it can have been written**: the
  failure came before COMMIT was sent (``BEGIN IMMEDIATE`` found the lock held, a
  statement failed, the connection was lost mid-transaction), or the database answered
  the COMMIT with a refusal (SQLite busy, a serialization failure: rolled back). A COMMIT
  whose answer was lost (the connection dropped while committing) may or may not have
  been written: it is raised as ``DatabaseUnavailable`` with ``may_have_committed``, and
  run again only for a transaction declared idempotent (the lease and run-row updates;
  ``Store.transact(fn, idempotent=True)``). The effects ledger treats it as an outcome
  not recorded: the effect is in doubt and reconciled.
* **A connection that failed is discarded** before the next attempt (the store's pinned
  per-thread connection is invalidated; SQLAlchemy drops its pool on a lost connection),
  so the next attempt opens a fresh one.
* **Bounded backoff with jitter**: pauses grow from ``initial_s`` by ``multiplier`` up to
  ``max_s``, each plus a random ``0..jitter_s`` (workers reconnecting after a restart do
  not all knock at once). No attempt starts after ``budget_s`` from the start of the
  outermost call: a retried call inside another (a run read inside a lease update)
  shares its budget. Each retry is logged at WARNING on ``onceonly.store`` with the
  action, the attempt and the error, never the URL or a password. When the budget runs
  out the last error is raised, with a note saying how long it was retried, and an
  enclosing call does not retry it again.
* **Stopping**: inside :func:`interrupt_retries`, retries end as soon as the given event
  is set (an idle worker's ``stop()``): the last error is raised at once.

Opening a store does not wait: an unreachable database at open is more often a wrong
URL than a blip, so :meth:`Store.open` fails at once with ``DatabaseUnavailable``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import tenacity

from ._engine import redact
from .errors import ConfigurationError, StoreError

__all__ = ["DatabaseRetry", "interrupt_retries", "is_transient", "retried", "retryable"]

T = TypeVar("T")
P = ParamSpec("P")

log = logging.getLogger("onceonly.store")

_GAVE_UP = "_onceonly_retry_gave_up"


@dataclass(frozen=True)
class DatabaseRetry:
    """How long the store keeps trying while the database is briefly unavailable, and
    the pauses between attempts (see :mod:`checkpoint._retry` for what is retried).

    Attributes:
        budget_s: No attempt starts later than this after the call began (0: one
            attempt, never retry). An attempt itself may take up to SQLite's
            ``busy_timeout`` on top.
        initial_s: First pause.
        max_s: Longest pause.
        multiplier: Growth of the pause per attempt.
        jitter_s: Random extra per pause, up to this.
    """

    budget_s: float = 30.0
    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter_s: float = 0.2

    def __post_init__(self) -> None:
        if (
            self.budget_s < 0
            or self.initial_s < 0
            or self.max_s < self.initial_s
            or self.multiplier < 1
            or self.jitter_s < 0
        ):
            raise ConfigurationError(
                "DatabaseRetry needs budget_s >= 0, 0 <= initial_s <= max_s, multiplier >= 1 "
                "and jitter_s >= 0"
            )

    def wait(self) -> tenacity.wait.wait_base:
        """The tenacity wait strategy: exponential, capped, plus jitter."""
        return tenacity.wait_exponential(
            multiplier=self.initial_s, exp_base=self.multiplier, max=self.max_s
        ) + tenacity.wait_random(0, self.jitter_s)

    def pause(self, attempt: int) -> float:
        """Seconds to pause after failed attempt ``attempt`` (1, 2, ...), jitter included."""
        state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        state.attempt_number = max(attempt, 1)
        return float(self.wait()(state))

    def call(
        self, action: str, fn: Callable[[], T], *, idempotent: bool, store: object = None
    ) -> T:
        """Run ``fn`` (one transaction, or a call made of transactions), retrying it on
        transient failures per these rules.

        Args:
            action: What is being done, for the log (``take a lease``).
            fn: The work; it must be safe to run again after a failure that wrote
                nothing.
            idempotent: Running ``fn`` again after its COMMIT may have gone through is
                harmless, so a lost COMMIT is retried too.
            store: The store whose read transaction ``fn``'s reads would join: inside
                a read of that store on this thread or task, a failure has ended the
                read ``fn`` joined, so the outermost read retries instead of this call
                (None: a read of any store; :data:`NO_READ`: ``fn`` joins none, as a
                write transaction).

        Returns:
            What ``fn`` returned.

        Raises:
            StoreError: The last error, when it is not transient, or when the budget ran
                out (or :func:`interrupt_retries`' event was set) before an attempt
                succeeded.
        """
        reading = _in_read.get()
        if idempotent and reading and (store is None or id(store) in reading):
            # Inside a read transaction of this thread (a read nested in a read shares
            # it): a failure has ended that transaction, so the outermost read retries
            # the whole of it; an attempt here would only meet the same failed one.
            return fn()
        outer = _scope.get()
        scope = _Scope(time.monotonic() + self.budget_s, None, action)
        if outer is not None:
            # Nested: the outermost call's budget, stop event and name (for the log).
            scope = _Scope(min(scope.deadline, outer.deadline), outer.stop, outer.action or action)
        token = _scope.set(scope)
        started = time.monotonic()
        try:
            return self._attempts(fn, scope, action, idempotent)
        except _Interrupted:
            assert scope.last is not None
            _give_up(scope.last, started, scope.attempts, "the caller is stopping")
            raise scope.last from scope.last.__cause__
        except StoreError as exc:
            if retryable(exc, idempotent=idempotent):
                _give_up(exc, started, scope.attempts, "the retry budget ran out")
            raise
        finally:
            _scope.reset(token)

    def _attempts(self, fn: Callable[[], T], scope: _Scope, action: str, idempotent: bool) -> T:
        """Attempts until one succeeds, one fails for good, or the scope is done. A plain
        loop: the first attempt (nearly every call) costs one ``try``."""
        attempt = 0
        while True:
            attempt += 1
            scope.attempts = attempt
            try:
                return fn()
            except StoreError as exc:  # nothing else is retryable
                if not retryable(exc, idempotent=idempotent):
                    raise
                pause = self.pause(attempt)
                if scope.done(attempt, pause):
                    raise
                scope.last = exc
                _log_retry(scope.action or action, scope, exc, pause, attempt)
                scope.sleep(pause)


class _Interrupted(Exception):
    """The caller's stop event was set while a retry was pausing."""


@dataclass
class _Scope:
    """Per-call retry state, shared by the calls nested inside one (never in a policy)."""

    deadline: float
    stop: threading.Event | None
    action: str | None = None
    last: StoreError | None = None
    attempts: int = 0

    def done(self, attempt: int, pause: float) -> bool:
        """Whether to stop after failed attempt ``attempt`` rather than pause ``pause``."""
        self.attempts = attempt
        if self.stop is not None and self.stop.is_set():
            return True
        return time.monotonic() + pause > self.deadline

    def sleep(self, seconds: float) -> None:
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            raise _Interrupted


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "onceonly_retry_scope", default=None
)

NO_READ = object()
"""``DatabaseRetry.call(store=NO_READ)``: the work joins no read transaction."""

# The stores (by id) whose read transaction this thread or task holds: nested reads of
# the same store join it; another store's calls retry on their own.
_in_read: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "onceonly_in_read", default=frozenset()
)


@contextlib.contextmanager
def interrupt_retries(stop: threading.Event) -> Iterator[None]:
    """Within the block (this thread or task), database retries end as soon as ``stop``
    is set: the last error is raised at once instead of after the retry budget."""
    token = _scope.set(_Scope(float("inf"), stop))
    try:
        yield
    finally:
        _scope.reset(token)


def retryable(exc: BaseException, *, idempotent: bool) -> bool:
    """Whether ``exc`` may be retried: a transient store error that wrote nothing (or
    whose transaction is idempotent) and that no inner retry has given up on."""
    if not isinstance(exc, StoreError) or not exc.transient:
        return False
    if getattr(exc, _GAVE_UP, False):
        return False
    return idempotent or not exc.may_have_committed


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc``, or the error it was raised from (``LedgerUnavailable`` from a
    ``DatabaseLocked``, ``AsyncWriteError`` from a lost connection), is a transient
    database failure: the first store error in its chain of causes decides."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, StoreError):
            return cur.transient
        cur = cur.__cause__ or cur.__context__
    return False


def describe(exc: BaseException) -> str:
    """A failure in one line for the log: its type and the driver's message (which names
    the host or socket; a password a driver echoes is masked; never the statement's
    parameters)."""
    raw: object = exc
    if isinstance(exc, StoreError) and exc.__cause__ is not None:
        raw = getattr(exc.__cause__, "orig", None) or exc.__cause__
    text = redact(" ".join(str(raw).split()))
    return f"{type(exc).__name__} ({text[:200]})"


def _log_retry(action: str, scope: _Scope, exc: StoreError, pause: float, attempt: int) -> None:
    left = max(scope.deadline - time.monotonic(), 0.0)
    log.warning(
        "%s: %s; retrying in %.2f s (attempt %d, %.1f s of the retry budget left)",
        action,
        describe(exc),
        pause,
        attempt,
        left,
    )


def _give_up(exc: StoreError, started: float, attempts: int, why: str) -> None:
    setattr(exc, _GAVE_UP, True)
    if attempts > 1:
        exc.add_note(
            f"onceonly retried this for {time.monotonic() - started:.1f} s "
            f"({attempts} attempts) and gave up: {why} (Store(retry=DatabaseRetry(...)))"
        )


class _Retrying(Protocol):
    @property
    def retry(self) -> DatabaseRetry: ...


S = TypeVar("S", bound=_Retrying)


def retried(
    action: str, *, idempotent: bool
) -> Callable[[Callable[Concatenate[S, P], T]], Callable[Concatenate[S, P], T]]:
    """Decorate a store method whose whole body may run again after a transient
    failure (one transaction, or reads and idempotent writes), with ``self.retry``."""

    def decorate(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
        @functools.wraps(method)
        def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
            return self.retry.call(
                action, lambda: method(self, *args, **kwargs), idempotent=idempotent, store=self
            )

        return wrapper

    return decorate
