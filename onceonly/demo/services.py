"""The demo's world: real local servers on 127.0.0.1 that count every raw delivery.

* **Mail**: ``mail_devel`` (SMTP + IMAP, in memory) in a subprocess
  (:class:`onceonly.testing.servers.MailDevel`). Every message its SMTP port accepts
  lands in one INBOX: the IMAP count is the raw delivery count, and the e-mail adapter's
  probe searches it by Message-ID.
* **Screening** and **ERP**: HTTP APIs (Starlette under uvicorn, each in a thread: an
  :class:`onceonly.testing.servers.AppServer`) that keep what they did under the
  request's ``Idempotency-Key`` and answer ``GET /<collection>/<key>`` lookups, so the
  guarded client can ask "did my request happen?" after a crash (a class B provider).
  ``deliveries`` counts every raw POST.

These are fakes of genuinely external providers; nothing here is used by the library.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from onceonly.testing.servers import HOST, AppServer, MailDevel

__all__ = ["HOST", "HTTPService", "MailService"]


class MailService(MailDevel):
    """SMTP + IMAP (``mail_devel``) on 127.0.0.1; one INBOX receives every message."""

    def __init__(self) -> None:
        super().__init__(user="onboarding@demo.example", password="demo-only")  # noqa: S106  (a throwaway local server)

    def deliveries(self) -> int:
        """Messages in the INBOX: every message the SMTP server accepted."""
        return self.count()


class HTTPService:
    """A provider API on 127.0.0.1 that records each POST under its Idempotency-Key.

    Args:
        name: For logs.
        collection: The path, e.g. ``screenings``: ``POST /screenings`` acts,
            ``GET /screenings/{key}`` looks an earlier request up (200 or 404).
        respond: Builds the stored answer from the request body and a sequence number.
    """

    def __init__(self, name: str, collection: str, respond: Any) -> None:
        self.name = name
        self.collection = collection
        self.respond = respond
        self.deliveries = 0  # every raw POST, the oracle
        self.applied: dict[str, Any] = {}
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._http = AppServer(self._app(), name=f"the demo's {name} server")
        self.port = self._http.port
        self.url = self._http.url

    def _app(self) -> Any:
        from starlette.applications import Starlette  # noqa: PLC0415
        from starlette.requests import Request  # noqa: PLC0415
        from starlette.responses import JSONResponse  # noqa: PLC0415
        from starlette.routing import Route  # noqa: PLC0415

        async def create(request: Request) -> JSONResponse:
            body = await request.json()
            key = (request.headers.get("idempotency-key") or "").strip('"')
            with self._lock:
                self.deliveries += 1
                if not key:
                    return JSONResponse({"error": "Idempotency-Key required"}, status_code=400)
                if key not in self.applied:  # honours the key too (never applies twice)
                    self.applied[key] = self.respond(body, next(self._seq))
                answer = self.applied[key]
            return JSONResponse(answer, status_code=201)

        async def lookup(request: Request) -> JSONResponse:
            key = request.path_params["key"]
            with self._lock:
                found = self.applied.get(key)
            if found is None:
                return JSONResponse({"error": "unknown reference"}, status_code=404)
            return JSONResponse(found)

        return Starlette(
            routes=[
                Route(f"/{self.collection}", create, methods=["POST"]),
                Route(f"/{self.collection}/{{key}}", lookup, methods=["GET"]),
            ]
        )

    def start(self) -> HTTPService:
        """Serve (in a thread) until :meth:`stop`."""
        self._http.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._http.stop()
