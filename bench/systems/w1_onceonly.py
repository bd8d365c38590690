"""onceonly's effects ledger in W1, through its public API only.

``Ledger(store, Keyring([Secret("k1", 32 bytes)]))`` on ``Store.open("sqlite:///…")``;
each call is ``Ledger.perform(EffectIdentity(tenant, run, step, visit, "send_email@1",
ordinal=i), arg, act)``: the intent is durable before ``act`` runs and the outcome before
``perform`` returns (sync durability); a resumed run replays recorded results. W1-async:
``Ledger.aperform`` on a ``durability="async"`` store, whose concurrent transactions share
group commits. ``onceonly-witness``: the same, with a witness file beside the database
(``Ledger(..., witness=PATH)``, as ``ONCEONLY_WITNESS`` sets it): every claim first
appends its chain's head to the witness and fsyncs it. ``onceonly-guard``: the same calls
through ``adapters.guard`` inside ``adapters.step(run, step)`` (the key comes from the
step and the call's ordinal, as a runtime's guarded tool call gets it), so the guard's
own per-call work (argument binding, key derivation, the step's divergence check, the
span) shows beside ``perform``'s.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from bench import workload
from onceonly.adapters import guard, step
from onceonly.checkpoint import Store
from onceonly.ledger import (
    Claim,
    EffectIdentity,
    EffectStatus,
    InFlightPolicy,
    Keyring,
    Ledger,
    Secret,
)

from . import CallsResult, W1System

TENANT = "bench"
RUN_ID = "w1-run"
STEP = "send-invoices"
EFFECT = "send_email@1"
SECRET = Secret("k1", bytes(range(32)))


def _url(db: Path) -> str:
    return f"sqlite:///{db}"


def identity(i: int) -> EffectIdentity:
    """Where call ``i`` sits in the run: its idempotency key is derived from this."""
    return EffectIdentity(TENANT, RUN_ID, STEP, 0, EFFECT, ordinal=i)


def act_for(arg: dict[str, Any]) -> Any:
    def act(_claim: Claim) -> dict[str, Any]:
        return workload.send_email(arg)

    return act


class LedgerCalls(W1System):
    """``Ledger.perform`` per call (``aperform`` for W1-async)."""

    name = "onceonly"
    #: Keep a witness of the chain heads outside the database (rollback detection).
    witnessed = False

    def _open(
        self, db: Path, durability: str = "sync", *, wait: bool = True
    ) -> tuple[Store, Ledger]:
        store = Store.open(_url(db), durability=durability)
        # A tolerant resume does not wait out a crashed worker's lease on a claim whose
        # outcome was never recorded: it counts it (EffectInFlight) and moves on.
        policy = None if wait else InFlightPolicy(wait_s=0)
        witness = f"{db}.witness" if self.witnessed else ""
        return store, Ledger(store, Keyring([SECRET]), in_flight=policy, witness=witness)

    def _run(self, db: Path, calls: int, *, tolerant: bool) -> CallsResult:
        clock = time.perf_counter
        t0 = clock()
        store, led = self._open(db, wait=not tolerant)
        open_s = clock() - t0
        args = [workload.make_arg(i) for i in range(calls)]
        idents = [identity(i) for i in range(calls)]
        acts = [act_for(a) for a in args]
        call_s: list[float] = []
        results: list[Any] = []
        errors: dict[str, int] = {}
        try:
            t_first = clock()
            for i in range(calls):
                t0 = clock()
                try:
                    results.append(led.perform(idents[i], args[i], acts[i]))
                except Exception as exc:
                    if not tolerant:
                        raise
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    results.append(None)
                call_s.append(clock() - t0)
            total = clock() - t_first
        finally:
            led.close()
            store.close()
        return CallsResult(
            call_s,
            total,
            workload.EFFECT.executed,
            results,
            {"open_ms": open_s * 1e3, "durability": "sync"},
            errors,
        )

    def cold(self, db: Path, calls: int) -> CallsResult:
        return self._run(db, calls, tolerant=False)

    def warm(self, db: Path, calls: int, *, tolerant: bool = False) -> CallsResult:
        return self._run(db, calls, tolerant=tolerant)

    def probe_child(self, db: Path, calls: int) -> None:
        _store, led = self._open(db)
        args = [workload.make_arg(i) for i in range(calls)]
        for i, arg in enumerate(args):
            led.perform(identity(i), arg, act_for(arg))
        os._exit(0)

    def recorded(self, db: Path, calls: int) -> int:
        store, led = self._open(db)
        try:
            recs = led.effects(run_id=RUN_ID)
        finally:
            led.close()
            store.close()
        return sum(1 for r in recs if r.status is EffectStatus.COMMITTED)

    def run_async(self, db: Path, calls: int, concurrency: int) -> CallsResult:
        store, led = self._open(db, "async")
        args = [workload.make_arg(i) for i in range(calls)]
        idents = [identity(i) for i in range(calls)]
        call_s = [0.0] * calls
        results: list[Any] = [None] * calls
        clock = time.perf_counter

        async def main() -> float:
            todo = iter(range(calls))

            async def worker() -> None:
                for i in todo:
                    arg = args[i]

                    async def act(_claim: Claim, arg: dict[str, Any] = arg) -> dict[str, Any]:
                        return workload.send_email(arg)

                    t0 = clock()
                    results[i] = await led.aperform(idents[i], arg, act)
                    call_s[i] = clock() - t0

            t_first = clock()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return clock() - t_first

        try:
            total = asyncio.run(main())
        finally:
            led.close()
            store.close()
        return CallsResult(
            call_s,
            total,
            workload.EFFECT.executed,
            results,
            {"durability": "async", "concurrency": concurrency},
        )


class WitnessedLedgerCalls(LedgerCalls):
    """``Ledger.perform`` per call with a witness file (``ONCEONLY_WITNESS``)."""

    name = "onceonly-witness"
    witnessed = True


class GuardCalls(LedgerCalls):
    """The same calls through ``adapters.guard`` inside ``adapters.step`` (the key from the
    step and the call's ordinal: the identities are ``perform``'s)."""

    name = "onceonly-guard"

    def _run(self, db: Path, calls: int, *, tolerant: bool) -> CallsResult:
        clock = time.perf_counter
        t0 = clock()
        store, led = self._open(db, wait=not tolerant)
        open_s = clock() - t0

        @guard(led, effect=EFFECT, tenant=TENANT)
        def send(arg: dict[str, Any]) -> dict[str, Any]:
            return workload.send_email(arg)

        args = [workload.make_arg(i) for i in range(calls)]
        call_s: list[float] = []
        results: list[Any] = []
        errors: dict[str, int] = {}
        try:
            with step(RUN_ID, STEP, tenant=TENANT):
                t_first = clock()
                for i in range(calls):
                    t0 = clock()
                    try:
                        results.append(send(args[i]))
                    except Exception as exc:
                        if not tolerant:
                            raise
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                        results.append(None)
                    call_s.append(clock() - t0)
                total = clock() - t_first
        finally:
            led.close()
            store.close()
        return CallsResult(
            call_s,
            total,
            workload.EFFECT.executed,
            results,
            {"open_ms": open_s * 1e3, "durability": "sync"},
            errors,
        )

    def probe_child(self, db: Path, calls: int) -> None:
        _store, led = self._open(db)

        @guard(led, effect=EFFECT, tenant=TENANT)
        def send(arg: dict[str, Any]) -> dict[str, Any]:
            return workload.send_email(arg)

        with step(RUN_ID, STEP, tenant=TENANT):
            for i in range(calls):
                send(workload.make_arg(i))
        os._exit(0)
