"""Guarded e-mail: an SMTP send that happens once (a class B provider).

Every message gets a deterministic ``Message-ID: <{provider_key}@{domain}>`` and an
``X-Idempotency-Key: {provider_key}`` header, derived from the ledger key inside the
guarded call. SMTP servers do not deduplicate by either, but a mailbox can be asked for a
Message-ID: when the outcome of a send is lost (timeout or disconnect during or after
DATA), the guard's probe searches a configured IMAP mailbox (``SEARCH HEADER
Message-ID``) and records the send as committed if the message is there, or re-sends it
(next epoch, same Message-ID) only if it is not.

Outcomes are classified by where the conversation failed, not by exception type alone:

* before DATA (connect refused, DNS, greeting or EHLO failure, a disconnect, a 4xx on
  MAIL/RCPT, or a non-354 4xx answer to DATA): nothing was accepted → NOT_SENT;
* a 5xx on MAIL, on every RCPT, or on DATA / end of data → REJECTED (FAILED);
* a timeout or disconnect after DATA began, or a 4xx after the message body → AMBIGUOUS,
  reconciled by the probe.

The probe mailbox must be filled by *delivery* (the recipient's INBOX, a journal or Bcc
address), synchronously with the server's acceptance or within ``settle_s``. A copy the
client APPENDs to Sent itself after a success cannot witness a send whose reply was lost.

The ledger fingerprints what a send *means*, not its wire bytes (which hold a random MIME
boundary, and a ``Date``): the envelope sender, the set of envelope recipients, and the
message as a tree of parts, each with its meaningful headers (unfolded, RFC 2047 decoded,
addresses parsed; not ``Date``, ``Message-ID``, ``Bcc``, ``MIME-Version`` or the
transfer encoding), its content type and parameters (not the boundary), its disposition
and filename, and its decoded payload. A resumed or retried step that builds the same
e-mail again replays it; another body, recipient, subject or attachment under the same
key is a :class:`~ledger.KeyReuseError`.
"""

from __future__ import annotations

import copy
import imaplib
import re
import smtplib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email import policy
from email.headerregistry import AddressHeader, BaseHeader, ParameterizedMIMEHeader
from email.message import EmailMessage, Message
from email.parser import BytesHeaderParser
from email.utils import formatdate, getaddresses
from typing import Any, TypedDict

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import EffectRecord, Evidence, Ledger, OutcomeClass, ProviderClass

from .context import current_claim
from .guard import RetryPolicy, guard

__all__ = [
    "EmailNotSent",
    "EmailOutcomeUnknown",
    "EmailRejected",
    "EmailSendError",
    "GuardedSMTP",
    "IMAPMailbox",
    "SMTPServer",
    "SentEmail",
    "classify_smtp",
]

_DOMAIN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_OWN_HEADERS = ("Message-ID", "X-Idempotency-Key")
# Headers that say how a part is encoded or framed (its meaning is described apart).
_PART_FRAMING = frozenset(
    {"content-type", "content-transfer-encoding", "content-disposition", "mime-version"}
)
# Headers of the message itself that do not change what is sent: the adapter sets the
# first two, ``Date`` is when, and ``Bcc`` is never sent (its recipients are the envelope's).
_MESSAGE_OWN = frozenset({"message-id", "x-idempotency-key", "date", "bcc"})
_FOLD = re.compile(r"\r?\n(?=[ \t])")


class SentEmail(TypedDict):
    """The recorded result of a send (replayed on every later call with the same key).

    Attributes:
        message_id: The ``Message-ID`` sent, with angle brackets.
        refused: Recipients the server refused while accepting the others.
        reconciled: True when the outcome was lost and the probe found the message.
    """

    message_id: str
    refused: list[str]
    reconciled: bool


@dataclass(frozen=True)
class SMTPServer:
    """Where to send (plain SMTP; TLS and AUTH are not supported by this adapter yet).

    Attributes:
        host: Server host.
        port: Server port.
        timeout_s: Socket timeout of every SMTP operation.
        local_hostname: Name sent in EHLO (default: this host's FQDN).
    """

    host: str
    port: int = 25
    timeout_s: float = 30.0
    local_hostname: str | None = None


@dataclass(frozen=True)
class IMAPMailbox:
    """The mailbox the probe searches for a Message-ID.

    Attributes:
        host: IMAP host.
        port: IMAP port.
        username: Login.
        password: Password.
        mailbox: The mailbox delivery files into (a journal, Bcc or recipient INBOX).
        timeout_s: Socket timeout.
        settle_s: Pause before searching, for servers that file asynchronously.
    """

    host: str
    username: str
    password: str
    port: int = 143
    mailbox: str = "INBOX"
    timeout_s: float = 30.0
    settle_s: float = 0.0


class EmailSendError(smtplib.SMTPException):
    """A send failed; ``outcome`` says what the evidence allows.

    Attributes:
        outcome: NOT_SENT, REJECTED or AMBIGUOUS.
        phase: Where the conversation stopped (connect, ehlo, mail, rcpt, data).
        code: The SMTP reply code, when the server answered.
    """

    outcome: OutcomeClass = OutcomeClass.AMBIGUOUS

    def __init__(self, message: str, *, phase: str, code: int | None = None) -> None:
        super().__init__(message)
        self.phase = phase
        self.code = code


class EmailNotSent(EmailSendError):
    """Nothing was accepted by the server: safe to send again with the same key."""

    outcome = OutcomeClass.NOT_SENT


class EmailRejected(EmailSendError):
    """The server refused the message definitely (5xx)."""

    outcome = OutcomeClass.REJECTED


class EmailOutcomeUnknown(EmailSendError):
    """The message may have been accepted (the reply was lost)."""

    outcome = OutcomeClass.AMBIGUOUS


def classify_smtp(exc: BaseException) -> OutcomeClass:
    """The guard's classifier: the adapter's own evidence, else ambiguous."""
    return exc.outcome if isinstance(exc, EmailSendError) else OutcomeClass.AMBIGUOUS


def _reply_error(
    phase: str, code: int, reply: bytes, *, after_body: bool = False
) -> EmailSendError:
    text = f"{phase.upper()} answered {code} {reply.decode('utf-8', 'replace')}"
    if code >= 500:
        return EmailRejected(text, phase=phase, code=code)
    if after_body:
        return EmailOutcomeUnknown(text, phase=phase, code=code)
    return EmailNotSent(text, phase=phase, code=code)


class GuardedSMTP:
    """Send :class:`~email.message.EmailMessage` objects over SMTP, each once.

    Built on :func:`adapters.guard` as a class B provider: the key comes from the current
    step (or ``send(..., key=...)``), the outcome is classified by evidence, and an
    in-doubt send is settled by searching ``probe_mailbox`` for its Message-ID.

    Args:
        ledger: The effects ledger.
        smtp: The SMTP server.
        probe_mailbox: The IMAP mailbox delivery files into.
        domain: Right-hand side of the generated Message-IDs.
        effect: ``name@version`` of the effect.
        retry: Attempts (NOT_SENT and probe-proven not-happened sends are retried).
        tenant: Tenant for explicit keys.
        subject: Data subject whose key encrypts the payloads (default: the run).

    Raises:
        ConfigurationError: ``domain`` is not a host name.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        smtp: SMTPServer,
        probe_mailbox: IMAPMailbox,
        domain: str,
        effect: str = "email.send@1",
        retry: RetryPolicy | None = None,
        tenant: str = "",
        subject: str | None = None,
    ) -> None:
        if not _DOMAIN.match(domain):
            raise ConfigurationError(f"Message-ID domain must be a host name, got {domain!r}")
        self.smtp = smtp
        self.probe_mailbox = probe_mailbox
        self.domain = domain
        self.ledger = ledger
        self._options: dict[str, Any] = {
            "effect": effect,
            "provider_class": ProviderClass.QUERYABLE,
            "probe": self.probe,
            "classify": classify_smtp,
            "retry": retry,
            "tenant": tenant,
            "subject": subject,
        }

    def message_id(self, provider_key: str) -> str:
        """The Message-ID (with angle brackets) of the send with ``provider_key``."""
        return f"<{provider_key}@{self.domain}>"

    def send(
        self,
        message: EmailMessage,
        *,
        from_addr: str | None = None,
        to_addrs: Sequence[str] | None = None,
        key: str | None = None,
    ) -> SentEmail:
        """Send ``message`` once; later calls with the same key replay the result.

        Args:
            message: The message, without ``Message-ID`` / ``X-Idempotency-Key`` (the
                adapter sets both). ``Bcc`` recipients get it; the header is not sent.
            from_addr: Envelope sender (default: the ``From`` address).
            to_addrs: Envelope recipients (default: ``To``, ``Cc`` and ``Bcc``).
            key: An explicit key (outside a step, or when the position is not stable).

        Returns:
            The recorded :class:`SentEmail`.

        Raises:
            ConfigurationError: The message has its own Message-ID, or no sender or
                recipients, or no step is current and no key is given.
            EmailNotSent: Nothing was accepted (after the policy's attempts).
            EmailRejected: The server refused the message (replayed as EffectFailed).
            ledger.EffectInDoubt: The outcome was lost and the probe could not tell.
        """
        for name in _OWN_HEADERS:
            if name in message:
                raise ConfigurationError(f"GuardedSMTP sets {name} itself; remove it")
        sender = from_addr or _first_address(message, "From")
        listed = (
            list(to_addrs)
            if to_addrs is not None
            else [
                a
                for _, a in getaddresses(
                    message.get_all("To", [])
                    + message.get_all("Cc", [])
                    + message.get_all("Bcc", [])
                )
                if a
            ]
        )
        envelope = list(dict.fromkeys(listed))  # one RCPT per address, in the given order
        if not sender or not envelope:
            raise ConfigurationError("an e-mail needs a sender and at least one recipient")
        wire = _copy_without_bcc(message).as_bytes(policy=policy.SMTP)

        # The guarded call's arguments are what the ledger fingerprints and stores: what
        # the e-mail means. The wire bytes (a random boundary, perhaps a Date) are sent but
        # never fingerprinted, so the same e-mail built again by a resumed step replays.
        def deliver(message: dict[str, Any], sender: str, recipients: list[str]) -> SentEmail:
            return self._transmit(wire, sender, envelope)

        guarded = guard(
            self.ledger, key=None if key is None else (lambda *_a, **_k: key), **self._options
        )(deliver)
        return guarded(_meaning(message, top=True), sender, sorted(envelope))

    def probe(self, record: EffectRecord) -> tuple[Evidence, Any]:
        """The guard's class-B probe: is the Message-ID of ``record`` in the mailbox?"""
        mid = self.message_id(record.provider_key)
        box = self.probe_mailbox
        if box.settle_s > 0:
            time.sleep(box.settle_s)
        try:
            found = _imap_has(box, mid)
        except (OSError, imaplib.IMAP4.error):
            return Evidence.INCONCLUSIVE, None
        if found:
            return Evidence.HAPPENED, SentEmail(message_id=mid, refused=[], reconciled=True)
        return Evidence.NOT_HAPPENED, None

    # -- inside the guard ---------------------------------------------------------------

    def _transmit(self, raw: bytes, sender: str, recipients: list[str]) -> SentEmail:
        provider_key = current_claim().provider_key
        mid = self.message_id(provider_key)
        head = f"Message-ID: {mid}\r\nX-Idempotency-Key: {provider_key}\r\n"
        if BytesHeaderParser(policy=policy.SMTP).parsebytes(raw).get("Date") is None:
            head += f"Date: {formatdate(usegmt=True)}\r\n"
        refused = self._converse(head.encode("ascii") + raw, sender, recipients)
        return SentEmail(message_id=mid, refused=sorted(refused), reconciled=False)

    def _converse(self, data: bytes, sender: str, recipients: list[str]) -> list[str]:
        """One SMTP transaction; raises an :class:`EmailSendError` that says how far it got."""
        cfg = self.smtp
        phase = "connect"
        conn = smtplib.SMTP(local_hostname=cfg.local_hostname, timeout=cfg.timeout_s)
        try:
            conn.connect(cfg.host, cfg.port)
            phase = "ehlo"
            conn.ehlo_or_helo_if_needed()
            phase = "mail"
            code, reply = conn.mail(sender)
            if code != 250:
                raise _reply_error(phase, code, reply)
            phase = "rcpt"
            refused: dict[str, tuple[int, bytes]] = {}
            for rcpt in recipients:
                code, reply = conn.rcpt(rcpt)
                if code not in {250, 251}:
                    refused[rcpt] = (code, reply)
            if len(refused) == len(recipients):
                mildest = min(c for c, _ in refused.values())  # any 4xx: may pass later
                raise _reply_error(phase, mildest, b"every recipient refused") from (
                    smtplib.SMTPRecipientsRefused(refused)
                )
            phase = "data"
            code, reply = conn.data(data)
            if code != 250:
                raise _reply_error(phase, code, reply, after_body=True)
            _quit_quietly(conn)
            return list(refused)
        except EmailSendError:
            conn.close()
            raise
        except smtplib.SMTPDataError as exc:  # DATA answered without 354: no body was sent
            conn.close()
            raise _reply_error(phase, exc.smtp_code, _as_bytes(exc.smtp_error)) from exc
        except (OSError, smtplib.SMTPException) as exc:  # SMTPException is an OSError too
            conn.close()
            text = f"{type(exc).__name__} during {phase}: {exc}"
            if phase == "data":
                raise EmailOutcomeUnknown(text, phase=phase) from exc
            raise EmailNotSent(text, phase=phase) from exc


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "replace")


def _first_address(message: EmailMessage, header: str) -> str:
    found = [a for _, a in getaddresses(message.get_all(header, [])) if a]
    return found[0] if found else ""


def _meaning(part: Message, *, top: bool = False) -> dict[str, Any]:
    """A deterministic description of what ``part`` says, recursively: its meaningful
    headers (names lower-cased and sorted, values parsed as one policy reads them), its
    content type and parameters without the boundary, its disposition with parameters,
    and its decoded payload, or its sub-parts in order (a ``message/rfc822`` part's one
    sub-part is the enclosed message, all of whose headers count)."""
    skip = _PART_FRAMING | _MESSAGE_OWN if top else _PART_FRAMING
    headers = sorted(
        (
            [name.lower(), _header_value(name, value)]
            for name, value in part.items()
            if name.lower() not in skip
        ),
        key=lambda pair: str(pair[0]),
    )
    ctype = _parsed("Content-Type", part.get("Content-Type", part.get_default_type()))
    described: dict[str, Any] = {
        "headers": headers,
        "type": part.get_content_type(),
        "params": _params(ctype, skip="boundary"),
    }
    disposition = part.get("Content-Disposition")
    if disposition is not None:
        described["disposition"] = [
            part.get_content_disposition(),
            _params(_parsed("Content-Disposition", disposition)),
        ]
    if part.is_multipart():
        described["parts"] = [_meaning(p) for p in part.get_payload() if isinstance(p, Message)]
    else:
        payload = part.get_payload(decode=True)
        if isinstance(payload, bytes) and part.get_content_maintype() == "text":
            # text travels with CRLF line ends whatever the message was built with
            payload = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        described["payload"] = payload
    return described


def _parsed(name: str, value: Any) -> Any:
    """``value`` as the default policy parses it: a header object of any policy as it
    is, a raw or compat32 value unfolded and decoded (RFC 2047, RFC 2231)."""
    if isinstance(value, BaseHeader):
        return value
    return policy.default.header_factory(name, _FOLD.sub("", str(value)))


def _params(header: Any, *, skip: str = "") -> list[list[str]]:
    """The parameters of a MIME header, decoded, names lower-cased, sorted."""
    params: Mapping[str, Any] = header.params if isinstance(header, ParameterizedMIMEHeader) else {}
    return sorted([k.lower(), str(v)] for k, v in params.items() if k.lower() != skip)


def _header_value(name: str, value: Any) -> Any:
    header = _parsed(name, value)
    if isinstance(header, AddressHeader):
        return [
            [g.display_name, [[a.display_name, a.addr_spec] for a in g.addresses]]
            for g in header.groups
        ]
    return str(header)


def _copy_without_bcc(message: EmailMessage) -> EmailMessage:
    if "Bcc" not in message:
        return message
    clone = copy.deepcopy(message)
    del clone["Bcc"]
    return clone


def _quit_quietly(conn: smtplib.SMTP) -> None:
    """The message was accepted: a failing QUIT changes nothing."""
    try:
        conn.quit()
    except (OSError, smtplib.SMTPException):
        conn.close()


def _imap_has(box: IMAPMailbox, message_id: str) -> bool:
    conn = imaplib.IMAP4(box.host, box.port, timeout=box.timeout_s)
    try:
        conn.login(box.username, box.password)
        typ, data = conn.select(_quote(box.mailbox), readonly=True)
        if typ != "OK":
            raise imaplib.IMAP4.error(f"cannot select {box.mailbox!r}: {data!r}")
        typ, data = conn.search(None, "HEADER", "Message-ID", _quote(message_id))
        if typ != "OK":
            raise imaplib.IMAP4.error(f"SEARCH failed: {data!r}")
        return any(isinstance(d, bytes) and d.split() for d in data)
    finally:
        try:
            conn.logout()
        except (OSError, imaplib.IMAP4.error):
            conn.shutdown()


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
