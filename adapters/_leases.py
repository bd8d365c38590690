"""Keeping the claims of guarded calls alive while the calls are in flight.

A claim's lease tells other workers that its call is still being made; a call longer than
the ledger's ``lease_s`` would otherwise be taken for abandoned (in doubt) while it runs.
The engine adapters watch the calls below them (``context._watching``) and renew the
leases of those in flight: Temporal's activity guard as it heartbeats, Celery's task
guard with :class:`LeaseKeeper`.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Sequence

from onceonly.ledger import Claim, LeaseLost, Ledger

log = logging.getLogger("onceonly.adapters")


def renew(claims: Sequence[tuple[Claim, Ledger]]) -> None:
    """Renew each claim's lease with its ledger; never raises (the guard decides the
    call's outcome: a claim that was moved on is refused when it records)."""
    for claim, ledger in claims:
        try:
            ledger.renew(claim)
        except LeaseLost:
            pass  # the entry moved on: the guard's outcome is refused and says so
        except Exception:  # the call goes on; the guard decides its outcome
            log.warning(
                "renewing the lease of effect %s… failed; its claim may lapse while the "
                "call is in flight",
                claim.key_id[:16],
                exc_info=True,
            )


class LeaseKeeper:
    """A watcher that renews, from a thread, the leases of the calls in flight below it:
    every third of their ledger's ``lease_s``."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[Claim, Ledger]] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None

    def started(self, claim: Claim, ledger: Ledger) -> None:
        """A call began acting under ``claim``."""
        with self._lock:
            self._live[claim.key_id] = (claim, ledger)
            if self._stop is not None:
                return
            self._stop = stop = threading.Event()
        period = max(ledger.lease_s / 3, 0.05)
        run = contextvars.copy_context().run
        threading.Thread(
            target=run, args=(self._keep, stop, period), daemon=True, name="onceonly-lease"
        ).start()

    def stopped(self, claim: Claim) -> None:
        """The call under ``claim`` has ended."""
        with self._lock:
            self._live.pop(claim.key_id, None)
            if self._live or self._stop is None:
                return
            self._stop.set()
            self._stop = None

    def _keep(self, stop: threading.Event, period: float) -> None:
        while not stop.wait(period):
            with self._lock:
                claims = list(self._live.values())
            renew(claims)
