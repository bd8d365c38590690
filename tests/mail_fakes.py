"""Real mail servers on 127.0.0.1 for the e-mail adapter tests.

* :class:`MailDevel` runs ``mail_devel`` (SMTP + IMAP, in memory, single mailbox) in a
  subprocess (the one server helper, :mod:`onceonly.testing.servers`): the IMAP side the
  adapter's probe searches.
* :class:`FaultySMTP` is the SMTP server the adapter talks to: an aiosmtpd server that
  logs every DATA it receives (the raw delivery oracle), then files the message into
  mail-devel by relaying it to mail-devel's SMTP port, and can be told to fail the next
  transactions in each way a real server does (:class:`Fault`), or to refuse connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import threading
from dataclasses import dataclass
from email import message_from_bytes, policy
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from onceonly.adapters.email import IMAPMailbox, SMTPServer
from onceonly.testing import servers
from onceonly.testing.servers import HOST, free_port

__all__ = ["HOST", "Delivery", "Fault", "FaultySMTP", "MailDevel", "free_port"]


class MailDevel(servers.MailDevel):
    """``mail_devel`` in a subprocess (:class:`onceonly.testing.servers.MailDevel`): every
    message its SMTP port accepts lands in the INBOX of ``user``, searchable over IMAP."""

    def mailbox(self, **overrides: Any) -> IMAPMailbox:
        """The adapter's probe configuration for this server's INBOX."""
        options: dict[str, Any] = {"timeout_s": 5.0, **overrides}
        return IMAPMailbox(HOST, self.user, self.password, port=self.imap_port, **options)


class Fault(enum.Enum):
    """How the server fails one transaction."""

    REJECT_SENDER = "553 on MAIL FROM"
    REJECT_RECIPIENT = "550 on every RCPT TO"
    TEMPFAIL_RECIPIENT = "450 on every RCPT TO"
    DROP_AFTER_DATA = "files the message, then drops the connection without a reply"
    DROP_DURING_DATA = "drops the connection at the end of DATA without filing it"
    STALL_AFTER_DATA = "files the message, then never replies (the client times out)"


@dataclass(frozen=True)
class Delivery:
    """One DATA the server received, as it arrived."""

    mail_from: str
    rcpt_tos: tuple[str, ...]
    raw: bytes
    filed: bool

    def header(self, name: str) -> str | None:
        value = message_from_bytes(self.raw, policy=policy.SMTP).get(name)
        return None if value is None else str(value)

    @property
    def message_id(self) -> str | None:
        return self.header("Message-ID")


class _Handler:
    def __init__(self, owner: FaultySMTP) -> None:
        self.owner = owner
        self.current: dict[int, Fault | None] = {}

    async def handle_MAIL(  # noqa: N802  (aiosmtpd hook name)
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        fault = self.owner.take_fault()
        self.current[id(session)] = fault
        if fault is Fault.REJECT_SENDER:
            return "553 5.7.1 sender not allowed"
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 OK"

    async def handle_RCPT(  # noqa: N802
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        fault = self.current.get(id(session))
        if fault is Fault.REJECT_RECIPIENT:
            return "550 5.1.1 no such user"
        if fault is Fault.TEMPFAIL_RECIPIENT:
            return "450 4.2.1 mailbox busy, try later"
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(options)
        return "250 OK"

    async def handle_DATA(  # noqa: N802
        self, server: SMTP, session: Session, envelope: Envelope
    ) -> str:
        fault = self.current.pop(id(session), None)
        raw = envelope.original_content or b""
        content = raw if isinstance(raw, bytes) else raw.encode()
        mail_from = str(envelope.mail_from)
        rcpts = [str(r) for r in envelope.rcpt_tos]
        filed = fault is not Fault.DROP_DURING_DATA
        self.owner.record(Delivery(mail_from, tuple(rcpts), content, filed))
        if filed:
            await asyncio.get_running_loop().run_in_executor(
                None, self.owner.mail.file, mail_from, rcpts, content
            )
        if fault in {Fault.DROP_AFTER_DATA, Fault.DROP_DURING_DATA}:
            assert isinstance(server.transport, asyncio.Transport)
            server.transport.abort()  # connection_lost cancels this handler
            await asyncio.sleep(30)
        if fault is Fault.STALL_AFTER_DATA:
            await asyncio.sleep(self.owner.stall_s)
        return "250 OK: queued"


class _Controller(Controller):
    """aiosmtpd's Controller on ``port=0``: it connects to ``self.port`` to trigger the
    server, so read the bound port first."""

    def _trigger_server(self) -> None:
        assert isinstance(self.server, asyncio.Server)
        self.port = int(self.server.sockets[0].getsockname()[1])
        with socket.create_connection((HOST, self.port), 1.0) as s:
            s.recv(1024)  # the greeting: the server's factory ran


class FaultySMTP:
    """The SMTP server under test: logs every DATA, files into ``mail``, fails on demand.

    Args:
        mail: Where accepted messages are filed.
        stall_s: How long :attr:`Fault.STALL_AFTER_DATA` withholds the reply.
    """

    def __init__(self, mail: MailDevel, *, stall_s: float = 5.0) -> None:
        self.mail = mail
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[Delivery] = []
        self._controller: _Controller | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        ctl = _Controller(_Handler(self), hostname=HOST, port=self.port, ready_timeout=10)
        ctl.start()
        self._controller = ctl
        self.port = ctl.port

    def stop(self) -> None:
        ctl, self._controller = self._controller, None
        if ctl is not None:
            ctl.stop()

    def refuse_connections(self) -> None:
        """Stop listening: connecting gets ECONNREFUSED until :meth:`accept_connections`."""
        self.stop()

    def accept_connections(self) -> None:
        """Listen again on the same port."""
        self.start()

    # -- faults and the oracle ---------------------------------------------------------

    def fail_next(self, *faults: Fault) -> None:
        """Fail the next transactions, one fault each, in order."""
        with self._lock:
            self._faults.extend(faults)

    def take_fault(self) -> Fault | None:
        with self._lock:
            return self._faults.pop(0) if self._faults else None

    def record(self, delivery: Delivery) -> None:
        with self._lock:
            self._log.append(delivery)

    @property
    def deliveries(self) -> list[Delivery]:
        """Every DATA received so far, filed or not (the raw delivery log)."""
        with self._lock:
            return list(self._log)

    def endpoint(self, **overrides: Any) -> SMTPServer:
        """The adapter's configuration for this server."""
        options: dict[str, Any] = {"timeout_s": 5.0, **overrides}
        return SMTPServer(HOST, port=self.port, **options)

    def __enter__(self) -> FaultySMTP:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop()
