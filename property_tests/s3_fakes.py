"""The oracle of suites S3-S5: a fake provider API that checks fencing tokens and logs
every raw request (see ../shared/RELIABILITY.md, "Provider fakes").

One Starlette app under uvicorn, in a thread of the test process, on 127.0.0.1. It
outlives every worker process, so its log is the ground truth of what reached the world.
Three provider classes, by path:

* ``POST /a/deliver`` (class A): honours ``Idempotency-Key``; a key seen before gets the
  stored answer (a *replay*, logged but not applied again);
* ``POST /b/deliver`` (class B): applies every request; ``GET /b/lookup/{key}`` answers
  200 if a request with that key was applied, else 404;
* ``POST /c/deliver`` (class C): applies every request; nothing to ask.

Every write must carry ``X-Onceonly-Fencing: <provider key>:<epoch>`` (as
``adapters.http`` sends it). The fake keeps the highest epoch it has seen per key and,
while ``check_fencing`` is on, refuses (409, nothing applied) a token whose epoch is
lower: a *stale* call. A class B lookup that carries a token fences too (epochs below
it are stale from then on: the in-doubt attempt cannot land after the "not found"
answer that licenses its re-send). With ``check_fencing`` off (a positive control) it applies them,
and counts each as a *stale apply*.

Counting is by logical effect, the ``(run, label)`` in the request body: an effect
applied twice is a duplicate whatever keys its requests carried.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import threading
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceonly.testing.servers import AppServer

__all__ = ["FencedAPI", "Raw"]


@dataclass(frozen=True)
class Raw:
    """One write request as it reached the provider, and what the provider did with it.

    ``outcome``: ``applied``, ``replayed`` (class A, key seen before), ``stale`` (refused
    by the fencing check) or ``refused`` (no key or no fencing token).
    """

    cls: str
    run: str
    label: str
    key: str | None
    epoch: int | None
    worker: str | None
    outcome: str
    stale: bool
    at: float


@dataclass
class _State:
    log: list[Raw]
    applied_keys: dict[str, dict[str, Any]]
    max_epoch: dict[str, int]
    lookups: int
    applied_n: int = 0


class FencedAPI:
    """See the module docstring. ``start()`` serves; ``stop()`` stops."""

    def __init__(self, *, check_fencing: bool = True) -> None:
        self.check_fencing = check_fencing
        self._lock = threading.Lock()
        self._s = _State([], {}, {}, 0)
        self.app = Starlette(
            routes=[
                Route("/b/lookup/{key}", self._lookup, methods=["GET"]),
                Route("/{cls}/deliver", self._deliver, methods=["POST"]),
            ]
        )
        self._http = AppServer(self.app, name="the fenced fake provider")
        self.url = self._http.url

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> FencedAPI:
        self._http.start()
        return self

    def stop(self) -> None:
        self._http.stop()

    # -- the oracle ---------------------------------------------------------------------
    @property
    def log(self) -> list[Raw]:
        """Every write request that reached the provider, in arrival order."""
        with self._lock:
            return list(self._s.log)

    @property
    def lookups(self) -> int:
        with self._lock:
            return self._s.lookups

    def max_epoch(self, key: str) -> int:
        """The highest epoch seen for a provider key (0: none)."""
        with self._lock:
            return self._s.max_epoch.get(key, 0)

    def applied_key(self, key: str) -> bool:
        """Whether a request with this provider key was applied (operator evidence)."""
        with self._lock:
            return key in self._s.applied_keys

    def mark(self) -> _State:
        """The provider's whole state now (to :meth:`rewind` to: S5 rolls our store back,
        never the world, but each restored snapshot is judged against the same world)."""
        with self._lock:
            return copy.deepcopy(self._s)

    def rewind(self, state: _State) -> None:
        with self._lock:
            self._s = copy.deepcopy(state)

    def counts(self, log: list[Raw] | None = None) -> collections.Counter[tuple[str, str]]:
        """Applications per logical effect ``(run, label)``."""
        entries = self.log if log is None else log
        return collections.Counter((r.run, r.label) for r in entries if r.outcome == "applied")

    # -- handlers -----------------------------------------------------------------------
    async def _deliver(self, request: Request) -> Response:
        cls = request.path_params["cls"]
        body = await request.json()
        header = request.headers.get("idempotency-key")
        key = header.strip('"') if header else None
        token = request.headers.get("x-onceonly-fencing")
        epoch: int | None = None
        if token is not None and key is not None and token.rpartition(":")[0] == key:
            try:
                epoch = int(token.rpartition(":")[2])
            except ValueError:
                epoch = None
        worker = request.headers.get("x-worker")
        with self._lock:
            s = self._s
            stale = False
            answer: dict[str, Any]
            if key is None or epoch is None or cls not in ("a", "b", "c"):
                outcome, status, answer = "refused", 400, {"error": "key and fencing required"}
            else:
                stale = epoch < s.max_epoch.get(key, 0)
                s.max_epoch[key] = max(s.max_epoch.get(key, 0), epoch)
                if stale and self.check_fencing:
                    outcome, status = "stale", 409
                    answer = {"error": "stale fencing token", "epoch": epoch}
                elif cls == "a" and key in s.applied_keys:
                    outcome, status, answer = "replayed", 201, s.applied_keys[key]
                else:
                    s.applied_n += 1
                    answer = {"id": s.applied_n, "label": str(body["label"])}
                    s.applied_keys[key] = answer
                    outcome, status = "applied", 201
            s.log.append(
                Raw(
                    cls,
                    str(body.get("run")),
                    str(body.get("label")),
                    key,
                    epoch,
                    worker,
                    outcome,
                    stale,
                    time.time(),
                )
            )
        return JSONResponse(answer, status)

    async def _lookup(self, request: Request) -> Response:
        key = request.path_params["key"]
        token = request.headers.get("x-onceonly-fencing", "")
        with self._lock:
            self._s.lookups += 1
            if self.check_fencing and token.rpartition(":")[0] == key:
                # A lookup fences: epochs below the token's are stale from now on.
                with contextlib.suppress(ValueError):
                    epoch = int(token.rpartition(":")[2])
                    self._s.max_epoch[key] = max(self._s.max_epoch.get(key, 0), epoch)
            found = self._s.applied_keys.get(key)
        if found is None:
            return JSONResponse({"error": "unknown"}, 404)
        return JSONResponse(found, 200)


def tally(log: list[Raw], expected: set[tuple[str, str]]) -> dict[str, int]:
    """Counters of a raw log against the logical effects that should each be applied
    once: ``effects``, ``raw``, ``duplicates``, ``lost``, ``stale_refused``,
    ``stale_applied``, ``unexpected`` (applied but never intended)."""
    applied = collections.Counter((r.run, r.label) for r in log if r.outcome == "applied")
    return {
        "effects": len(expected),
        "raw": len(log),
        "duplicates": sum(n - 1 for n in applied.values() if n > 1),
        "lost": sum(1 for e in expected if applied[e] == 0),
        "stale_refused": sum(1 for r in log if r.outcome == "stale"),
        "stale_applied": sum(1 for r in log if r.stale and r.outcome == "applied"),
        "unexpected": sum(1 for e in applied if e not in expected),
    }
