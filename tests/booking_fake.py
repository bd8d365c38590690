"""A fake booking provider: Starlette under uvicorn, in a thread, on a pre-bound 127.0.0.1 port.

A plain class B provider: it ignores ``Idempotency-Key``; every raw ``POST`` that is
applied creates a hold (or a confirmation), duplicates included, and both can be looked
up by the client reference they were made with:

* ``POST /holds`` ``{client_reference, room, night}`` → 201 the hold
  (``{id, client_reference, room, night, status}``); 422 if a field is missing;
* ``POST /holds/{id}/confirm`` ``{client_reference}`` → 201 the confirmation
  (``{id, hold_id, client_reference}``); 404 for an unknown hold;
* ``GET /holds?client_reference=…`` and ``GET /confirmations?client_reference=…`` →
  ``{"items": [...]}`` (every match: a duplicate would show as two).

``log`` holds every raw request (the oracle); ``holds`` and ``confirmations`` every write
that took effect. Faults are queued in ``faults``; each ``POST`` pops one:

* ``"refuse"``: 503 before applying;
* ``"taken"``: 409 (the room is taken) before applying;
* ``"invalid"``: 422 before applying;
* ``"drop"``: apply, then sleep ``sleep_s`` (past the client's timeout) before answering;
* ``"cut"``: apply, then break the connection in the middle of the response.

``lookups_down`` makes every lookup answer 503 (the provider cannot be asked).

The socket is bound at construction but only listens after :meth:`start`: until then a
connection is refused (nothing is sent).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceonly.testing.servers import AppServer, cut_response

__all__ = ["BookingProvider", "RawRequest"]


@dataclass
class RawRequest:
    """One request as it reached the provider."""

    method: str
    path: str
    query: str
    fencing: str | None
    body: bytes
    status: int | None = None  # what the provider answered (None: connection broken)


@dataclass
class BookingProvider:
    """See the module docstring."""

    sleep_s: float = 0.4
    faults: list[str] = field(default_factory=list)
    log: list[RawRequest] = field(default_factory=list)
    holds: list[dict[str, Any]] = field(default_factory=list)
    confirmations: list[dict[str, Any]] = field(default_factory=list)
    lookups_down: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.app = Starlette(
            routes=[
                Route("/holds", self._lookup_holds, methods=["GET"]),
                Route("/confirmations", self._lookup_confirmations, methods=["GET"]),
                Route("/holds", self._hold, methods=["POST"]),
                Route("/holds/{hold_id}/confirm", self._confirm, methods=["POST"]),
            ]
        )
        self._http = AppServer(self.app, name="the fake booking provider")
        self.port: int = self._http.port
        self.url = self._http.url

    # -- oracle -----------------------------------------------------------------------

    @property
    def posts(self) -> list[RawRequest]:
        """Every write request that reached the provider."""
        with self._lock:
            return [r for r in self.log if r.method == "POST"]

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Listen and serve (in a thread) until :meth:`stop`."""
        self._http.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._http.stop()

    # -- handlers ---------------------------------------------------------------------

    async def _raw(self, request: Request) -> tuple[RawRequest, str | None]:
        raw = RawRequest(
            request.method,
            request.url.path,
            request.url.query,
            request.headers.get("x-onceonly-fencing"),
            await request.body(),
        )
        with self._lock:
            self.log.append(raw)
            fault = self.faults.pop(0) if self.faults and request.method == "POST" else None
        return raw, fault

    def _lookup(self, raw: RawRequest, items: list[dict[str, Any]], ref: str | None) -> Response:
        if self.lookups_down:
            raw.status = 503
            return JSONResponse({"error": "lookups unavailable"}, 503)
        with self._lock:
            found = [dict(i) for i in items if i["client_reference"] == ref]
        raw.status = 200
        return JSONResponse({"items": found}, 200)

    async def _lookup_holds(self, request: Request) -> Response:
        raw, _ = await self._raw(request)
        return self._lookup(raw, self.holds, request.query_params.get("client_reference"))

    async def _lookup_confirmations(self, request: Request) -> Response:
        raw, _ = await self._raw(request)
        return self._lookup(raw, self.confirmations, request.query_params.get("client_reference"))

    async def _apply(
        self, raw: RawRequest, fault: str | None, make: Any, required: tuple[str, ...]
    ) -> Response:
        def answer(status: int, payload: Any) -> Response:
            raw.status = status
            return JSONResponse(payload, status)

        if fault == "refuse":
            return answer(503, {"error": "unavailable"})
        if fault == "taken":
            return answer(409, {"error": "room taken"})
        if fault == "invalid":
            return answer(422, {"error": "invalid request"})
        try:
            body = json.loads(raw.body or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict) or any(not body.get(k) for k in required):
            return answer(422, {"error": f"required: {', '.join(required)}"})
        with self._lock:
            created = make(body)
        if created is None:
            return answer(404, {"error": "no such hold"})
        if fault == "drop":
            await asyncio.sleep(self.sleep_s)
        if fault == "cut":
            return cut_response()
        return answer(201, created)

    async def _hold(self, request: Request) -> Response:
        raw, fault = await self._raw(request)

        def make(body: dict[str, Any]) -> dict[str, Any]:
            hold = {
                "id": f"H-{len(self.holds) + 1}",
                "client_reference": body["client_reference"],
                "room": body["room"],
                "night": body["night"],
                "status": "held",
            }
            self.holds.append(hold)
            return dict(hold)

        return await self._apply(raw, fault, make, ("client_reference", "room", "night"))

    async def _confirm(self, request: Request) -> Response:
        raw, fault = await self._raw(request)
        hold_id = request.path_params["hold_id"]

        def make(body: dict[str, Any]) -> dict[str, Any] | None:
            holds = [h for h in self.holds if h["id"] == hold_id]
            if not holds:
                return None
            holds[0]["status"] = "confirmed"
            conf = {
                "id": f"C-{len(self.confirmations) + 1}",
                "hold_id": hold_id,
                "client_reference": body["client_reference"],
            }
            self.confirmations.append(conf)
            return dict(conf)

        return await self._apply(raw, fault, make, ("client_reference",))
