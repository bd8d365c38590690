"""Real servers on the loopback interface, for provider fakes: one way to start them, wait
until they answer, and stop them.

* :class:`AppServer`: an ASGI application (a Starlette app) under uvicorn, in a daemon
  thread of this process, on a 127.0.0.1 socket bound when the object is made: until
  :meth:`AppServer.start` a connection is refused (nothing reaches the application).
* :class:`ProcessServer`: a server program in a subprocess, listening on loopback ports it
  is told; :meth:`ProcessServer.start` returns once every port accepts a connection, and
  :meth:`ProcessServer.stop` ends that process by its pid (SIGTERM, then SIGKILL).
* :func:`cut_response`: an answer that breaks the connection half-way (the provider
  acted; its answer is lost), for a fake's ``cut`` fault.
* :class:`MailDevel`: ``mail_devel`` (SMTP + IMAP, in memory, one INBOX) as a
  :class:`ProcessServer`; every message its SMTP port accepts can be counted over IMAP.

Everything binds 127.0.0.1 only: a fake is never reachable from another machine. The
applications need Starlette and uvicorn, :class:`MailDevel` needs mail-devel (the
``testing`` extra).
"""

from __future__ import annotations

import abc
import imaplib
import shutil
import smtplib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from starlette.responses import Response

__all__ = [
    "HOST",
    "AppServer",
    "MailDevel",
    "ProcessServer",
    "cut_response",
    "free_port",
    "wait_listening",
]

HOST = "127.0.0.1"
"""The only interface a fake listens on."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a program that binds its
    own ports; an :class:`AppServer` binds its socket itself and needs none)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout_s: float = 20.0) -> None:
    """Wait until 127.0.0.1:``port`` accepts a connection.

    Raises:
        OSError: Nothing accepted within ``timeout_s`` seconds (the last error).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((HOST, port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def cut_response(status: int = 201) -> Response:
    """A Starlette response that starts (``status``, a promised body), then breaks the
    connection: the provider acted, and its answer is lost on the way (a fake's ``cut``
    fault). Raising in the ASGI app aborts the connection; uvicorn logs nothing at
    ``critical``."""
    from starlette.responses import Response  # noqa: PLC0415  (the testing extra)

    class Cut(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-length", b"64")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"id":', "more_body": True})
            raise ConnectionAbortedError("connection cut by the fake provider")

    return Cut()


class _Server(abc.ABC):
    """A server that :meth:`start` starts (and returns) and :meth:`stop` stops; as a
    context manager, it serves inside the ``with`` block."""

    @abc.abstractmethod
    def start(self, timeout_s: float = 10.0) -> Self:
        """Start; returns once it answers."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop; its ports are free again."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class AppServer(_Server):
    """An ASGI application served by uvicorn in a daemon thread, on 127.0.0.1.

    The socket is bound here (``port`` and ``url`` are known at once) and listens from
    :meth:`start` to :meth:`stop`. It is made with ``IPPROTO_TCP`` because asyncio sets
    ``TCP_NODELAY`` only on sockets that say so (without it every answer waits ~40 ms for
    the client's delayed ACK).

    Args:
        app: The ASGI application.
        name: What it is, for errors and the thread's name.
        backlog: The listen backlog (many workers connecting at once need a long one).
        graceful_s: How long :meth:`stop` lets open requests finish.
    """

    def __init__(
        self, app: Any, *, name: str = "fake", backlog: int = 2048, graceful_s: int = 2
    ) -> None:
        self.app = app
        self.name = name
        self.backlog = backlog
        self.graceful_s = graceful_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind((HOST, 0))
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://{HOST}:{self.port}"
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether it serves now."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 10.0) -> Self:
        """Serve until :meth:`stop`; returns once uvicorn has started.

        Raises:
            RuntimeError: The server did not start within ``timeout_s`` seconds.
        """
        import uvicorn  # noqa: PLC0415  (the testing extra)

        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level="critical",
            lifespan="off",
            backlog=self.backlog,
            timeout_graceful_shutdown=self.graceful_s,
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self._sock]}, name=self.name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"{self.name} did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (the port is free again)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(10 + self.graceful_s)
        self._sock.close()


class ProcessServer(_Server):
    """A server program in a subprocess, listening on 127.0.0.1 ``ports``.

    Args:
        argv: Its command line (it must bind ``ports`` on 127.0.0.1).
        ports: The ports it listens on; :meth:`start` waits for each.
        name: What it is, for errors.
        env: Its environment (default: this process's).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        ports: Sequence[int],
        name: str = "server",
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.ports = list(ports)
        self.name = name
        self.env = env
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs."""
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 20.0) -> Self:
        """Start the program; returns once every port accepts a connection.

        Raises:
            RuntimeError: It exited, or a port did not answer within ``timeout_s``
                seconds (the process is stopped).
        """
        self._proc = subprocess.Popen(  # noqa: S603  (a fixed command line of a test server)
            self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        try:
            for port in self.ports:
                while True:
                    if self._proc.poll() is not None:
                        raise RuntimeError(
                            f"{self.name} exited with status {self._proc.returncode}"
                        )
                    try:
                        wait_listening(port, timeout_s=0.0)
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise RuntimeError(
                                f"{self.name} did not listen on {HOST}:{port}"
                            ) from None
                        time.sleep(0.02)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the process: SIGTERM, then SIGKILL if it has not exited in ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)


def _mail_devel() -> str | None:
    """The ``mail_devel`` program beside this interpreter, else on ``$PATH``."""
    beside = Path(sys.executable).with_name("mail_devel")
    return str(beside) if beside.exists() else shutil.which("mail_devel")


class MailDevel(ProcessServer):
    """``mail_devel`` (SMTP + IMAP, in memory) on 127.0.0.1: every message its SMTP port
    accepts lands in the INBOX of ``user``, searchable over IMAP.

    Args:
        user: The mailbox's login.
        password: Its password (a throwaway local server's).

    Raises:
        FileNotFoundError: mail-devel is not installed.
    """

    def __init__(self, user: str = "probe@example.org", password: str = "probe-pw") -> None:  # noqa: S107  (a throwaway local server)
        program = _mail_devel()
        if program is None:
            raise FileNotFoundError("mail_devel is not installed: pip install mail-devel")
        self.user = user
        self.password = password
        self.smtp_port = free_port()
        self.imap_port = free_port()
        super().__init__(
            [
                program,
                "--host",
                HOST,
                "--smtp-port",
                str(self.smtp_port),
                "--imap-port",
                str(self.imap_port),
                "--no-http",
                "--user",
                user,
                "--password",
                password,
            ],
            ports=[self.smtp_port, self.imap_port],
            name="mail_devel",
        )

    def file(self, mail_from: str, rcpt_tos: list[str], raw: bytes) -> None:
        """Deliver ``raw`` into the INBOX (through mail-devel's own SMTP port)."""
        with smtplib.SMTP(HOST, self.smtp_port, timeout=10) as conn:
            conn.sendmail(mail_from, rcpt_tos, raw)

    def count(self, message_id: str | None = None) -> int:
        """How many messages the INBOX holds (with ``message_id``, if given)."""
        criteria = ("ALL",) if message_id is None else ("HEADER", "Message-ID", f'"{message_id}"')
        conn = imaplib.IMAP4(HOST, self.imap_port, timeout=5)
        try:
            conn.login(self.user, self.password)
            conn.select("INBOX", readonly=True)
            _, data = conn.search(None, *criteria)
            return sum(len(d.split()) for d in data if isinstance(d, bytes))
        finally:
            conn.logout()
