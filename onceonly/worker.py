"""The worker: claims ready runs with leases and drives them, in as many processes on as
many machines as share the database.

A run is ready when it is running with no live lease (new, woken by a decision or a
signal, or left by a crashed worker) or waiting with a due timer or an expired approval
(:meth:`checkpoint.Waits.claim_ready`: ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, the
write lock on SQLite). While a run is driven its lease is renewed in the background.
Idle workers sleep until PostgreSQL ``NOTIFY`` wakes them (a start, a decision, a
signal) or the poll interval passes (timers; SQLite).

:meth:`Worker.stop` (SIGTERM, SIGINT) drains: the current step finishes and checkpoints,
the lease is released, and :meth:`Worker.run` returns; a second signal stops the process
at once, as a crash would (the run resumes from its last checkpoint elsewhere).

A database that is briefly unavailable (a PostgreSQL restart or failover, a terminated
connection, a SQLite lock held past ``busy_timeout``) does not end the worker. Each
database call is retried by the store (:class:`checkpoint.DatabaseRetry`); when one still
fails, the worker logs it, pauses (growing, capped), and tries again for as long as it
takes, re-opening its ``LISTEN`` connection, and ``stop()`` still ends it promptly while
it is idle. A step stopped by such a failure has acted on nothing the ledger did not
record, or its effect is in doubt: the run's lease is released (or lapses), and before the
worker acts again its ledger starts again from what is on disk
(:meth:`ledger.Ledger.recover`), as a restarted worker would, so the step runs again, its
recorded effects replay and the unrecorded one is reconciled. Any other database error (a
disk I/O error, a full disk) stops the worker (fail closed); the next start recovers from
disk.

A worker claims only runs of the flows it was given: a run of another flow is left to a
worker that has it (never leased, not even briefly). A run this worker still cannot run
(its step or state version is unknown to this code, or a record of it fails its
integrity check) is logged and skipped: it is leased to ``<owner>:skipped`` until that
lease lapses, so the worker goes on with other runs and a worker with other code may take
it later.

Logs go to the ``onceonly.worker`` logger; each record carries structured fields as
attributes (``event``, and ``run_id``, ``status``, ``next_step``, ``command`` where they
apply) for a formatter to emit (``onceonly worker --log-format json``). A run parked for
a person (an approval to give, an effect in doubt to resolve) is logged at WARNING with
the exact command that settles it.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from onceonly.checkpoint import (
    CorruptRecord,
    LeaseHeld,
    OnceOnlyError,
    RunStatus,
    Store,
    StoreError,
    WaitKind,
    interrupt_retries,
    is_transient,
    redact,
)
from onceonly.checkpoint.waits import NOTIFY_CHANNEL
from onceonly.ledger import LedgerUnavailable

from .registry import WorkerRegistry
from .runtime import META, Runtime

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger("onceonly.worker")


@dataclass
class WorkerStats:
    """What a worker did.

    Attributes:
        runs_driven: Runs it claimed and drove.
        claim_conflicts: Runs it claimed but found leased by another worker.
        leases_lost: Leases it failed to renew (another worker took the run).
        runs_skipped: Runs it claimed but could not run (see the module docstring).
        outages: Database failures it rode out (paused, then carried on).
    """

    runs_driven: int = 0
    claim_conflicts: int = 0
    leases_lost: int = 0
    runs_skipped: int = 0
    outages: int = 0


class Worker:
    """Claims ready runs and drives them.

    Args:
        runtime: The runtime (its ``owner`` is this worker's identity).
        batch: Runs claimed per round.
        poll_s: Longest idle sleep between claim rounds.
    """

    def __init__(self, runtime: Runtime, *, batch: int = 1, poll_s: float = 1.0) -> None:
        self.runtime = runtime
        self.batch = batch
        self.poll_s = poll_s
        self.stats = WorkerStats()
        self._stop = threading.Event()
        self._failures = 0  # database failures in a row
        self._recover = False  # the ledger starts again from disk before acting again
        # how often the worker refreshes its row in the registry (oo_workers)
        self.beat_s = max(1.0, min(runtime.lease_s / 3, 30.0))
        self._registry: WorkerRegistry | None = None
        self._beat_at = 0.0

    def stop(self) -> None:
        """Drain: finish the current step, release the run, return from :meth:`run`."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """Drain on SIGTERM and SIGINT (call from the main thread)."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.stopping:
                log.warning("signal %s again: stopping at once", signum)
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
                return
            log.info("signal %s: draining (the current step finishes)", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self, *, until_idle: bool = False, max_runs: int | None = None) -> WorkerStats:
        """Claim and drive runs until stopped (or, with ``until_idle``, until none is
        ready; or after ``max_runs``). A database that is briefly unavailable is waited
        for (see the module docstring).

        Raises:
            StoreError / LedgerUnavailable: The database failed in a way that does not pass
                by itself (a disk I/O error); the worker stopped.
        """
        rt = self.runtime
        log.info(
            "worker %s: claiming runs of %s (lease %.1f s, poll %.1f s, batch %d)",
            rt.owner,
            ", ".join(
                f"{n} version{'s' if len(v) > 1 else ''} {', '.join(v)}"
                for n, v in rt.served.items()
            )
            or "no flow",
            rt.lease_s,
            self.poll_s,
            self.batch,
            extra={
                "event": "worker_started",
                "owner": rt.owner,
                "flows": sorted(rt.flows),
                "served": rt.served,
            },
        )
        try:
            self._serve(until_idle, max_runs)
        finally:
            if self._registry is not None:
                with contextlib.suppress(OnceOnlyError):
                    self._registry.leave(rt.owner)
        return self.stats

    def _announce(self) -> None:
        """Say in the registry which flow versions this worker serves, and refresh that
        while it runs (what ``onceonly runs list --unserved`` reads)."""
        now = time.monotonic()
        if now < self._beat_at:
            return
        rt = self.runtime
        try:
            if self._registry is None:
                self._registry = WorkerRegistry(rt.store, clock=rt.clock)
                self._registry.announce(rt.owner, rt.served, beat_s=self.beat_s)
            elif not self._registry.beat(rt.owner):
                self._registry.announce(rt.owner, rt.served, beat_s=self.beat_s)
        except OnceOnlyError as exc:
            if is_transient(exc):
                raise  # an outage: ridden out like a failed claim round
            # The registry is for operators, not for acting: a worker that cannot write
            # it (a role that may not create its table, a newer schema) still drives runs.
            log.warning(
                "worker %s cannot announce itself in the worker registry (%s): `onceonly "
                "runs list --unserved` will not count it; run `onceonly migrate`",
                rt.owner,
                exc,
                extra={"event": "registry_unavailable", "owner": rt.owner},
            )
            self._beat_at = float("inf")
            return
        self._beat_at = now + self.beat_s

    def _serve(self, until_idle: bool, max_runs: int | None) -> None:
        rt = self.runtime
        with contextlib.closing(_Listener(rt.store, self._stop)) as listener:
            while not self.stopping:
                if max_runs is not None and self.stats.runs_driven >= max_runs:
                    break
                try:
                    # Idle: the store's retries end at once when stop() is called.
                    with interrupt_retries(self._stop):
                        if self._recover:
                            rt.ledger.recover()
                            self._recover = False
                            log.info("the database answers again: carrying on from disk")
                        self._announce()
                        ids = rt.waits.claim_ready(
                            rt.owner, rt.lease_s, limit=self.batch, flows=rt.served
                        )
                except OnceOnlyError as exc:
                    if not is_transient(exc):
                        raise  # fail closed: the worker stops
                    self._outage("claiming runs", exc)
                    continue
                self._failures = 0
                if not ids:
                    if until_idle:
                        break
                    listener.wait(self.poll_s)
                    continue
                for rid in ids:
                    if self._recover:
                        # A database failure stopped an earlier run of this round: leave
                        # the rest under our lease (ours counts as free to us) until the
                        # ledger has started again.
                        continue
                    if self._stop.is_set():  # stopped while an earlier run was driven
                        self._release(rid)
                        continue
                    self._drive(rid)

    def _drive(self, run_id: str) -> None:
        rt = self.runtime
        _log_resume(rt, run_id)
        try:
            with self._renewing(run_id) as lost:
                run = rt.drive(run_id, should_stop=lambda: self.stopping or lost.is_set())
        except LeaseHeld:
            self.stats.claim_conflicts += 1
            return
        except OnceOnlyError as exc:
            if is_transient(exc):
                # Nothing was acted on that the ledger did not record, or the effect is
                # in doubt; the run's lease was released (or lapses).
                self._outage(f"run {run_id}", exc)
                return
            if isinstance(exc, StoreError | LedgerUnavailable):
                raise  # fail closed: the worker stops
            # This code cannot run the run (unknown flow, step or state version; a corrupt
            # record). Park it under a lease of another name until that lapses: a lease
            # under our own name would count as free and be claimed again at once, so
            # other runs go on, and a worker with other code may take it later.
            self.stats.runs_skipped += 1
            parked = f"{rt.owner}:skipped"
            log.error(
                "run %s skipped for %.0f s (lease %s): %s",
                run_id,
                rt.lease_s,
                parked,
                exc,
                extra={"event": "run_skipped", "run_id": run_id, "error": type(exc).__name__},
            )
            # Our own lease counts as free to us: give it up, then park the run under
            # the other name (a run that fails its seal still gets its lease row set).
            with contextlib.suppress(LeaseHeld, CorruptRecord):
                rt.store.release_lease(run_id, rt.owner)
                rt.store.acquire_lease(run_id, parked, rt.lease_s)
            return
        self.stats.runs_driven += 1
        log.info(
            "run %s: %s (next %s)",
            run_id,
            run.status.value,
            run.next_step,
            extra={
                "event": "run_driven",
                "run_id": run_id,
                "status": run.status.value,
                "next_step": run.next_step,
            },
        )
        if run.status is RunStatus.WAITING:
            _log_parked(rt, run_id)

    def _outage(self, what: str, exc: BaseException) -> None:
        """A transient database failure: log it, have the ledger start again from disk
        before anything is acted on again, and pause (growing, capped; stop() ends it)."""
        self.stats.outages += 1
        self._failures += 1
        self._recover = True
        pause = self.runtime.store.retry.pause(self._failures)
        log.warning(
            "%s: the database is unavailable (%s); trying again in %.1f s (failure %d in a "
            "row); nothing is acted on meanwhile",
            what,
            _describe(exc, self.runtime.store.engine.url.password),
            pause,
            self._failures,
        )
        self._stop.wait(pause)

    def _release(self, run_id: str) -> None:
        """Give a claimed run back; if the database does not answer, its lease lapses."""
        rt = self.runtime
        try:
            with interrupt_retries(self._stop):
                rt.store.release_lease(run_id, rt.owner)
        except StoreError as exc:
            if not exc.transient:
                raise
            log.warning(
                "run %s: lease not released (%s); it lapses",
                run_id,
                _describe(exc, rt.store.engine.url.password),
            )

    @contextlib.contextmanager
    def _renewing(self, run_id: str) -> Iterator[threading.Event]:
        """Renew the run's lease every third of its length; the yielded event is set if
        another worker took the run (then the drive stops after the current step)."""
        rt = self.runtime
        done = threading.Event()
        lost = threading.Event()

        def renew() -> None:
            while not done.wait(rt.lease_s / 3):
                try:
                    with interrupt_retries(done):  # the drive ended: stop retrying
                        rt.store.acquire_lease(run_id, rt.owner, rt.lease_s)
                except LeaseHeld:
                    self.stats.leases_lost += 1
                    lost.set()
                    log.warning("lost the lease of run %s; its ledger claims stay fenced", run_id)
                    return
                except Exception:  # the step's own writes will surface a real failure
                    log.exception("renewing the lease of run %s failed", run_id)

        thread = threading.Thread(target=renew, name=f"lease-{run_id[:8]}", daemon=True)
        thread.start()
        try:
            yield lost
        finally:
            done.set()
            thread.join()


class _Listener:
    """An idle worker's wake-up call: PostgreSQL ``LISTEN`` on a connection of its own
    (SQLite: none, the worker polls).

    A connection that fails (a server restart, ``pg_terminate_backend``) is closed and
    opened again on the next wait; until that succeeds the worker polls. Whether the
    database is gone for good (the password was changed) is for the claim rounds to find
    out: their store classifies the error and stops the worker.
    """

    def __init__(self, store: Store, stop: threading.Event) -> None:
        self._store = store
        self._stop = stop
        self._conn: Any = None
        self._failures = 0
        # The store's connection parameters as keywords, never a URL string with the
        # password in it (libpq echoes a URL it cannot parse in its error message).
        self._params: dict[str, Any] | None = None
        self._password: str | None = None
        if store.dialect == "postgresql":
            _, params = store.engine.dialect.create_connect_args(store.engine.url)
            params.pop("context", None)  # SQLAlchemy's adapters, not psycopg's
            self._params = {"connect_timeout": 10, **params}
            self._password = store.engine.url.password
            self._open()

    def close(self) -> None:
        """Close the connection (if any)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # it may be broken already
                conn.close()

    def _open(self) -> bool:
        import psycopg  # noqa: PLC0415  (PostgreSQL only)

        assert self._params is not None
        try:
            conn = psycopg.connect(autocommit=True, **self._params)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            self._failed(exc)
            return False
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            conn.close()
            self._failed(exc)
            return False
        if self._failures:
            log.info("listening for ready runs again")
        self._failures = 0
        self._conn = conn
        return True

    def _failed(self, exc: BaseException) -> None:
        self.close()
        self._failures += 1
        # The first failure of a streak is news; the rest are the same outage.
        log.log(
            logging.WARNING if self._failures == 1 else logging.DEBUG,
            "the LISTEN connection failed (%s); polling until it is open again",
            _describe(exc, self._password),
        )

    def wait(self, poll_s: float) -> None:
        """Sleep until a NOTIFY, stop(), or ``poll_s`` (timers; SQLite)."""
        if self._params is None:
            self._stop.wait(poll_s)
            return
        if self._conn is None and not self._open():
            self._stop.wait(min(poll_s, self._store.retry.pause(self._failures)))
            return
        # Wake on NOTIFY, on stop (checked every 0.25 s) or after poll_s (timers).
        listener = self._conn
        waited = 0.0
        try:
            while waited < poll_s and not self._stop.is_set():
                slice_s = min(0.25, poll_s - waited)
                with contextlib.closing(listener.notifies(timeout=slice_s, stop_after=1)) as got:
                    woken = next(got, None) is not None
                if woken:
                    # One claim round answers every notification queued while this worker
                    # was busy: drop them rather than run an empty round for each. (The
                    # generator above is closed first: it holds the connection's lock.)
                    for _ in listener.notifies(timeout=0):
                        pass
                    return
                waited += slice_s
        except Exception as exc:
            import psycopg  # noqa: PLC0415  (PostgreSQL only)

            if not isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                raise
            self._failed(exc)


def _settle_commands(rt: Runtime, run_id: str) -> list[str]:
    """The commands that settle what a waiting run waits on from a person: ``onceonly
    approve`` for an open approval (with its subject hash), ``onceonly effects resolve``
    for an effect in doubt (its whole key id). Empty for timers and other signals."""
    out: list[str] = []
    for wait in rt.waits.find(run_id=run_id, status="open"):
        if wait.kind is WaitKind.APPROVAL:
            out.append(
                shlex.join(
                    ["onceonly", "approve", run_id, wait.name, "--hash", str(wait.subject_hash)]
                )
            )
        elif wait.kind is WaitKind.SIGNAL and wait.name.startswith("effect:"):
            key_id = _in_doubt_key(rt, run_id) or wait.name.split(":")[1]
            out.append(
                shlex.join(["onceonly", "effects", "resolve", key_id])
                + " --happened|--not-happened --evidence 'WHAT YOU CHECKED'"
            )
    return out


def _in_doubt_key(rt: Runtime, run_id: str) -> str | None:
    try:
        state = rt.store.load(run_id).state
    except OnceOnlyError:
        return None
    waiting = (state.get(META) or {}).get("waiting") or {}
    return str(waiting["effect"]) if waiting.get("effect") else None


def _log_parked(rt: Runtime, run_id: str) -> None:
    """Say what a person must do for a run that waits on one, as the command to run."""
    try:
        commands = _settle_commands(rt, run_id)
    except OnceOnlyError:  # the log line is a courtesy; the run is parked either way
        return
    for command in commands:
        log.warning(
            "run %s waits for a person: %s",
            run_id,
            command,
            extra={"event": "run_parked", "run_id": run_id, "command": command},
        )


def _log_resume(rt: Runtime, run_id: str) -> None:
    """Show the run's handoff note when a worker takes it up after earlier steps."""
    try:
        run = rt.store.get_run(run_id)
    except OnceOnlyError:
        return
    if run.head_seq is None or run.head_seq < 1:
        return
    note = run.handoff
    log.info(
        "resume run %s at %s; goal: %s; done: %s; next: %s; ruled out: %s",
        run_id,
        run.next_step,
        note.goal or "-",
        "; ".join(note.done) or "-",
        "; ".join(note.next) or "-",
        "; ".join(note.ruled_out) or "-",
    )


def _describe(exc: BaseException, *secrets: str | None) -> str:
    """A failure in one line for the log: its type and the start of its message (driver
    messages name the host or socket; a password one echoes is masked)."""
    text = redact(" ".join(str(exc).split()), *secrets)
    return f"{type(exc).__name__}: {text[:200]}"
