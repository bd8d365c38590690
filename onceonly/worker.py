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
at once, as a crash would (the run resumes from its last checkpoint elsewhere). A
database error stops the worker (fail closed); the next start recovers from disk. A run
this worker cannot run (its flow, step or state version is unknown to this code, or a
record of it fails its integrity check) is logged and skipped: it is leased to
``<owner>:skipped`` until that lease lapses, so the worker goes on with other runs and a
worker with other code may take it later.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from checkpoint import LeaseHeld, OnceOnlyError, StoreError
from checkpoint.waits import NOTIFY_CHANNEL
from ledger import LedgerUnavailable

from .runtime import Runtime

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
    """

    runs_driven: int = 0
    claim_conflicts: int = 0
    leases_lost: int = 0
    runs_skipped: int = 0


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
        ready; or after ``max_runs``).

        Raises:
            StoreError / LedgerUnavailable: The database failed; the worker stopped.
        """
        rt = self.runtime
        log.info(
            "worker %s: claiming runs (lease %.1f s, poll %.1f s, batch %d)",
            rt.owner,
            rt.lease_s,
            self.poll_s,
            self.batch,
        )
        with self._listener() as listener:
            while not self.stopping:
                if max_runs is not None and self.stats.runs_driven >= max_runs:
                    break
                ids = rt.waits.claim_ready(rt.owner, rt.lease_s, limit=self.batch)
                if not ids:
                    if until_idle:
                        break
                    self._idle(listener)
                    continue
                for rid in ids:
                    if self._stop.is_set():  # stopped while an earlier run was driven
                        rt.store.release_lease(rid, rt.owner)
                        continue
                    self._drive(rid)
        return self.stats

    def _drive(self, run_id: str) -> None:
        rt = self.runtime
        _log_resume(rt, run_id)
        try:
            with self._renewing(run_id) as lost:
                run = rt.drive(run_id, should_stop=lambda: self.stopping or lost.is_set())
        except LeaseHeld:
            self.stats.claim_conflicts += 1
            return
        except (StoreError, LedgerUnavailable):
            raise  # fail closed: the worker stops
        except OnceOnlyError as exc:
            # This code cannot run the run (unknown flow, step or state version; a corrupt
            # record). Park it under a lease of another name until that lapses: a lease
            # under our own name would count as free and be claimed again at once, so
            # other runs go on, and a worker with other code may take it later.
            self.stats.runs_skipped += 1
            parked = f"{rt.owner}:skipped"
            log.error("run %s skipped for %.0f s (lease %s): %s", run_id, rt.lease_s, parked, exc)
            with contextlib.suppress(LeaseHeld):
                rt.store.acquire_lease(run_id, parked, rt.lease_s)
            return
        self.stats.runs_driven += 1
        log.info("run %s: %s (next %s)", run_id, run.status.value, run.next_step)

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

    @contextlib.contextmanager
    def _listener(self) -> Iterator[Any]:
        store = self.runtime.store
        if store.dialect != "postgresql":
            yield None
            return
        import psycopg  # noqa: PLC0415  (PostgreSQL only)

        url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        conn = psycopg.connect(url, autocommit=True)
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            yield conn
        finally:
            conn.close()

    def _idle(self, listener: Any) -> None:
        if listener is None:
            self._stop.wait(self.poll_s)
            return
        # Wake on NOTIFY, on stop (checked every 0.25 s) or after poll_s (timers).
        waited = 0.0
        while waited < self.poll_s and not self.stopping:
            slice_s = min(0.25, self.poll_s - waited)
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
