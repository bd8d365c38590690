"""More live threads than the engine's pool holds: every one of them still gets a connection.

A store pins one connection to each thread that uses it, for as long as the thread lives
(a thread pool's workers live for ever). A ledger's executor has 64 workers and the
engine's pool holds 15 connections: on a loaded machine, where each claim runs longer and
the executor starts more workers, the sixteenth worker waited for a connection that no
live thread returns, and 32 concurrent ``aperform`` callers failed after the pool's 30 s
timeout (CI, PostgreSQL, load 5). Here the threads are all kept alive at once, so the
count does not depend on timing: each must read, and read again, while all the others
hold on to theirs.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

from onceonly.checkpoint import Store
from onceonly.ledger import Claim, InFlightPolicy

from .ledger_support import Ledgers, ident


def _capacity(store: Store) -> int:
    pool: Any = store.engine.pool
    return int(pool.size()) + int(pool._max_overflow)


def test_more_live_threads_than_the_pool_holds_all_read(store: Store) -> None:
    threads = _capacity(store) + 5
    together = threading.Barrier(threads, timeout=120)
    answers: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            first = store.read(lambda cur: cur.execute("SELECT 1").fetchone()[0])
            together.wait()  # every thread is alive and has read once
            second = store.read(lambda cur: cur.execute("SELECT 2").fetchone()[0])
            together.wait()  # ... and has read again while all the others live
            with lock:
                answers.extend([first, second])
        except BaseException as exc:  # noqa: BLE001  (reported below, with its type)
            with lock:
                errors.append(exc)
            together.abort()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=180)
    assert errors == []
    assert sorted(answers) == [1] * threads + [2] * threads


def test_many_concurrent_aperform_callers_on_a_wide_executor(ledgers: Ledgers) -> None:
    """The ledger's own thread pool, held wide open: 48 callers whose claims overlap."""
    led = ledgers.fresh(in_flight=InFlightPolicy(wait_s=60.0))
    started = threading.Barrier(48, timeout=120)
    calls: Counter[str] = Counter()

    def claim_slowly(*args: Any, **kwargs: Any) -> Any:
        started.wait()  # 48 executor workers are alive before any claim goes on
        return real_claim(*args, **kwargs)

    real_claim = led.claim
    led.claim = claim_slowly  # type: ignore[method-assign]

    async def act(claim: Claim) -> str:
        calls[claim.key_id] += 1
        return claim.key_id

    async def main() -> list[str]:
        return await asyncio.gather(*(led.aperform(ident(i), {"n": i}, act) for i in range(48)))

    results = asyncio.run(main())
    assert len(set(results)) == 48
    assert sorted(calls.values()) == [1] * 48
