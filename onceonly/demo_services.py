"""The demo's world: real local servers on 127.0.0.1 that count every raw delivery.

* **Mail**: ``mail_devel`` (SMTP + IMAP, in memory) in a subprocess. Every message its
  SMTP port accepts lands in one INBOX: the IMAP count is the raw delivery count, and the
  e-mail adapter's probe searches it by Message-ID.
* **Screening** and **ERP**: HTTP APIs (Starlette under uvicorn, each in a thread) that
  keep what they did under the request's ``Idempotency-Key`` and answer
  ``GET /<collection>/<key>`` lookups, so the guarded client can ask "did my request
  happen?" after a crash (a class B provider). ``deliveries`` counts every raw POST.

These are fakes of genuinely external providers; nothing here is used by the library.
"""

from __future__ import annotations

import asyncio
import imaplib
import itertools
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from onceonly.checkpoint import ConfigurationError

HOST = "127.0.0.1"

__all__ = ["HOST", "HTTPService", "MailService"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((HOST, port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class MailService:
    """SMTP + IMAP (``mail_devel``) on 127.0.0.1; one INBOX receives every message."""

    user = "onboarding@demo.example"
    password = "demo-only"  # noqa: S105  (a throwaway local server)

    def __init__(self) -> None:
        self.smtp_port = _free_port()
        self.imap_port = _free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MailService:
        exe = Path(sys.executable).with_name("mail_devel")
        cmd = str(exe) if exe.exists() else shutil.which("mail_devel")
        if not cmd:
            raise ConfigurationError("the demo needs mail-devel: pip install 'onceonly[demo]'")
        self._proc = subprocess.Popen(  # noqa: S603  (our own fixed command line)
            [
                cmd,
                "--host",
                HOST,
                "--smtp-port",
                str(self.smtp_port),
                "--imap-port",
                str(self.imap_port),
                "--no-http",
                "--user",
                self.user,
                "--password",
                self.password,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_listening(self.smtp_port)
        _wait_listening(self.imap_port)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def deliveries(self) -> int:
        """Messages in the INBOX: every message the SMTP server accepted."""
        conn = imaplib.IMAP4(HOST, self.imap_port, timeout=5)
        try:
            conn.login(self.user, self.password)
            conn.select("INBOX", readonly=True)
            _, data = conn.search(None, "ALL")
            return sum(len(d.split()) for d in data if isinstance(d, bytes))
        finally:
            conn.logout()


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
        self._sock = socket.socket()
        self._sock.bind((HOST, 0))
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://{HOST}:{self.port}"
        self._server: Any = None
        self._thread: threading.Thread | None = None

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
        import uvicorn  # noqa: PLC0415

        config = uvicorn.Config(self._app(), log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._sock.listen(64)
        server = self._server

        def serve() -> None:
            asyncio.run(server.serve(sockets=[self._sock]))

        self._thread = threading.Thread(target=serve, name=f"demo-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the demo's {self.name} server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._sock.close()
