"""A fake HTTP provider: Starlette under uvicorn, in a thread, on a pre-bound 127.0.0.1 port.

It honours the IETF Idempotency-Key draft when ``dedup`` is on (class A): the header is a
quoted string; 400 when missing (``require_key``), 409 while the first request with the
key is in flight, 422 when the key comes back with another body, the stored response
otherwise. ``GET /lookup/{key}`` answers the stored response of a key (class B): 200, 404
if unknown, 409 while in flight. ``log`` holds every raw request (the oracle) and
``applied`` every write that took effect.

Faults are queued in ``faults``; each write request pops one:

* ``"refuse"``: 503 before applying;
* ``"error"``: 500 before applying;
* ``"reject"``: 402 (a definite refusal) before applying;
* ``"drop"``: apply, then sleep ``sleep_s`` (past the client's timeout) before answering;
* ``"cut"``: apply, then break the connection in the middle of the response;
* ``"slow"``: hold the key in flight for ``sleep_s``, then apply;
* ``"held"``: hold the key in flight until a request with the same key has been answered
  409 (at most ``hold_s``), then apply: an in-flight conflict on a loaded machine too.

``forget_after_s`` makes the provider forget keys (dedup and lookups) after that long.

The socket is bound at construction but only listens after :meth:`start`: until then a
connection is refused (nothing is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceonly.testing.servers import AppServer, cut_response

__all__ = ["FakeProvider", "RawRequest"]


@dataclass
class RawRequest:
    """One request as it reached the provider."""

    method: str
    path: str
    idempotency_key: str | None
    fencing: str | None
    body: bytes
    status: int | None = None  # what the provider answered (None: connection broken)


@dataclass
class _Stored:
    body: bytes
    status: int
    response: Any
    at: float


@dataclass
class FakeProvider:
    """See the module docstring."""

    dedup: bool = True
    require_key: bool = True
    forget_after_s: float | None = None
    sleep_s: float = 0.4
    hold_s: float = 120.0
    faults: list[str] = field(default_factory=list)
    log: list[RawRequest] = field(default_factory=list)
    applied: list[tuple[str | None, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[str, _Stored] = {}
        self._in_flight: set[str] = set()
        self._conflicts: dict[str, int] = {}  # 409s answered, by key
        self.app = Starlette(
            routes=[
                Route("/lookup/{key}", self._lookup, methods=["GET"]),
                Route("/{path:path}", self._write, methods=["POST", "PUT", "PATCH", "DELETE"]),
            ]
        )
        self._http = AppServer(self.app, name="the fake provider")
        self.port: int = self._http.port
        self.url = self._http.url

    # -- oracle -----------------------------------------------------------------------

    @property
    def writes(self) -> list[RawRequest]:
        """Every write request that reached the provider."""
        with self._lock:
            return [r for r in self.log if r.method != "GET"]

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Listen and serve (in a thread) until :meth:`stop`."""
        self._http.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._http.stop()

    # -- handlers ---------------------------------------------------------------------

    def _forget(self) -> None:
        if self.forget_after_s is None:
            return
        cutoff = time.monotonic() - self.forget_after_s
        for k in [k for k, s in self._stored.items() if s.at <= cutoff]:
            del self._stored[k]

    async def _lookup(self, request: Request) -> Response:
        key = request.path_params["key"]
        raw = RawRequest("GET", request.url.path, key, None, b"")
        with self._lock:
            self.log.append(raw)
            self._forget()
            stored = self._stored.get(key)
            if key in self._in_flight:
                raw.status = 409
            elif stored is None:
                raw.status = 404
            else:
                raw.status = 200
        if raw.status == 200 and stored is not None:
            return JSONResponse(stored.response, 200)
        return JSONResponse({"error": "in flight" if raw.status == 409 else "unknown"}, raw.status)

    async def _write(self, request: Request) -> Response:
        body = await request.body()
        header = request.headers.get("idempotency-key")
        raw = RawRequest(
            request.method,
            request.url.path,
            header,
            request.headers.get("x-onceonly-fencing"),
            body,
        )
        with self._lock:
            self.log.append(raw)
            fault = self.faults.pop(0) if self.faults else None

        def answer(status: int, payload: Any) -> Response:
            raw.status = status
            return JSONResponse(payload, status)

        key: str | None = None
        if header is None:
            if self.require_key:
                return answer(400, {"error": "Idempotency-Key required"})
        elif len(header) < 3 or header[0] != '"' or header[-1] != '"':
            return answer(400, {"error": "Idempotency-Key must be a quoted string"})
        else:
            key = header[1:-1]
        if fault == "refuse":
            return answer(503, {"error": "unavailable"})
        if fault == "error":
            return answer(500, {"error": "internal"})
        if fault == "reject":
            return answer(402, {"error": "payment required"})
        if key is not None:
            with self._lock:
                self._forget()
                stored = self._stored.get(key)
                if self.dedup and key in self._in_flight:
                    self._conflicts[key] = self._conflicts.get(key, 0) + 1
                    return answer(409, {"error": "a request with this key is in flight"})
                if self.dedup and stored is not None:
                    if stored.body != body:
                        return answer(422, {"error": "key reused with another body"})
                    return answer(stored.status, stored.response)
                self._in_flight.add(key)  # lookups answer 409 until it is applied
        try:
            if fault == "slow":
                await asyncio.sleep(self.sleep_s)
            if fault == "held" and key is not None:
                until = time.monotonic() + self.hold_s
                while not self._conflicts.get(key) and time.monotonic() < until:
                    await asyncio.sleep(0.01)
            with self._lock:
                response = {"id": len(self.applied) + 1, "request": json.loads(body or b"null")}
                self.applied.append((key, response))
                if key is not None:
                    self._stored[key] = _Stored(body, 201, response, time.monotonic())
        finally:
            if key is not None:
                with self._lock:
                    self._in_flight.discard(key)
        if fault == "drop":
            await asyncio.sleep(self.sleep_s)
        if fault == "cut":
            return cut_response()
        return answer(201, response)


@contextlib.contextmanager
def running(provider: FakeProvider) -> Iterator[FakeProvider]:
    """Serve ``provider`` for the block, then stop it."""
    try:
        provider.start()
        yield provider
    finally:
        provider.stop()
