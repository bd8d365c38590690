"""Test your flows the way onceonly tests itself: provider fakes, a crash at every durable
point, and a provider fault at every call.

* :class:`HTTPProvider`: a fake HTTP API on 127.0.0.1 (Starlette under uvicorn, in a
  thread) that behaves like a provider of class A (honours ``Idempotency-Key``), B
  (answers lookups by key) or C (neither); checks the fencing token every guarded request
  carries and counts stale ones; keeps a raw log of every request that reached it (the
  oracle); and fails on request in each way a real provider does (:data:`FAULTS`).
* :func:`crash_at_every_point`: runs a :class:`Scenario` (a flow and its initial state)
  once to count the K failpoints it passes (:mod:`checkpoint.failpoints`), then for every
  k = 1..K runs it again on a fresh database, crashes it at the k-th, resumes it as a
  restarted worker would, and checks from the fakes' logs that nothing happened twice,
  nothing was lost, a resume never re-acted, and the run finished.
* :func:`fault_at_every_call`: the same checks with a provider failure injected at each
  call instead of a crash.
* :mod:`onceonly.testing.servers`: the one way every fake starts a real server on
  127.0.0.1, waits until it answers and stops it (for fakes of your own).

Both return a :class:`HarnessReport`; ``report.assert_ok()`` fails a test with what went
wrong. See ``docs/howto-test-with-the-crash-harness.md``. The fakes need the ``testing``
extra (httpx, Starlette, uvicorn).
"""

from __future__ import annotations

from ._explore import HarnessReport, crash_at_every_point, fault_at_every_call
from ._fakes import (
    FAULTS,
    Clock,
    Delivery,
    HTTPProvider,
    PostgresDatabases,
    ProviderFake,
    SQLiteDatabases,
)
from ._harness import Crash, Scenario

__all__ = [
    "FAULTS",
    "Clock",
    "Crash",
    "Delivery",
    "HTTPProvider",
    "HarnessReport",
    "PostgresDatabases",
    "ProviderFake",
    "SQLiteDatabases",
    "Scenario",
    "crash_at_every_point",
    "fault_at_every_call",
]
