"""The e-mail adapter against real servers: every failure mode ends in class B semantics.

The oracle is the SMTP server's raw DATA log (every DATA it received, filed or not) and
the IMAP mailbox mail-devel files accepted messages into; see ``tests/mail_fakes.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from email import message_from_bytes, policy
from email.message import EmailMessage
from email.utils import formatdate
from html import escape
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import RetryPolicy, step
from onceonly.adapters.email import (
    EmailNotSent,
    EmailRejected,
    GuardedSMTP,
    IMAPMailbox,
)
from onceonly.checkpoint import ConfigurationError, RunStatus, Store
from onceonly.checkpoint.failpoints import armed
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import (
    EffectFailed,
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    KeyReuseError,
    Ledger,
)
from onceonly.operator import Operator
from onceonly.runtime import Runtime
from tests.ledger_support import Ledgers
from tests.mail_fakes import HOST, Fault, FaultySMTP, MailDevel, free_port

NO_RETRY = RetryPolicy(max_attempts=1)
RETRY = RetryPolicy(max_attempts=3, initial_s=0.0)


@pytest.fixture(scope="module")
def mail() -> Iterator[MailDevel]:
    server = MailDevel()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def smtp(mail: MailDevel) -> Iterator[FaultySMTP]:
    with FaultySMTP(mail) as server:
        yield server


@pytest.fixture
def run_id() -> str:
    """A fresh run per test: Message-IDs never collide in the shared mailbox."""
    return "run-" + uuid.uuid4().hex


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


def adapter(
    ledger: Ledger,
    smtp: FaultySMTP,
    mail: MailDevel,
    *,
    retry: RetryPolicy = NO_RETRY,
    probe_mailbox: IMAPMailbox | None = None,
    **smtp_options: float,
) -> GuardedSMTP:
    return GuardedSMTP(
        ledger,
        smtp=smtp.endpoint(**smtp_options),
        probe_mailbox=probe_mailbox or mail.mailbox(),
        domain="mail.example.org",
        retry=retry,
    )


def check_span(spans: InMemorySpanExporter, outcome: str, rec: EffectRecord) -> None:
    """The last send's span: its outcome and ids, never the key or the message."""
    span = spans.get_finished_spans()[-1]
    attrs = dict(span.attributes or {})
    assert span.name == "execute_tool email.send@1"
    assert attrs["onceonly.effect.outcome"] == outcome
    assert attrs["onceonly.provider_class"] == "B"
    assert attrs["onceonly.effect.key_id"] == rec.key_id
    shown = " ".join(map(str, attrs.values()))
    for secret in (rec.provider_key, "ada@example.net", "Welcome", "Hello"):
        assert secret not in shown


def welcome(to: str = "ada@example.net") -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = "Shop <noreply@example.org>"
    msg["To"] = to
    msg["Subject"] = "Welcome"
    msg.set_content("Hello Ada.\n.\nA line with a lone dot above.\n")
    return msg


def test_a_send_happens_once_and_replays_after_a_restart(
    ledger: Ledger,
    ledgers: Ledgers,
    smtp: FaultySMTP,
    mail: MailDevel,
    run_id: str,
    spans: InMemorySpanExporter,
) -> None:
    mailer = adapter(ledger, smtp, mail)
    with step(run_id, "welcome"):
        sent = mailer.send(welcome())
    check_span(spans, "executed", ledger.effects()[0])
    with step(run_id, "welcome"):  # a resume of the same step
        assert mailer.send(welcome()) == sent
    check_span(spans, "replayed", ledger.effects()[0])
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail)  # a new process
    with step(run_id, "welcome"):
        assert restarted.send(welcome()) == sent

    [delivery] = smtp.deliveries
    [rec] = ledger.effects()
    assert rec.status is EffectStatus.COMMITTED
    assert sent == {
        "message_id": f"<{rec.provider_key}@mail.example.org>",
        "refused": [],
        "reconciled": False,
    }
    assert delivery.message_id == sent["message_id"]  # reaches the server unchanged
    assert delivery.header("X-Idempotency-Key") == rec.provider_key
    assert delivery.header("Date") is not None
    assert delivery.rcpt_tos == ("ada@example.net",)
    assert b"\r\n.\r\nA line" in delivery.raw  # a lone dot survives (dot-stuffed on the wire)
    assert mail.count(sent["message_id"]) == 1


def test_a_refused_connection_is_not_sent_and_the_next_call_sends_once(
    ledger: Ledger, ledgers: Ledgers, smtp: FaultySMTP, mail: MailDevel, run_id: str
) -> None:
    mailer = adapter(ledger, smtp, mail)
    smtp.refuse_connections()
    with step(run_id, "s"), pytest.raises(EmailNotSent) as info:
        mailer.send(welcome())
    assert info.value.phase == "connect"
    assert "ConnectionRefusedError" in str(info.value)
    [rec] = ledger.effects()
    assert rec.status is EffectStatus.NOT_HAPPENED
    smtp.accept_connections()
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail)
    with step(run_id, "s"):
        sent = restarted.send(welcome())
    with step(run_id, "s"):
        assert restarted.send(welcome()) == sent
    assert [d.message_id for d in smtp.deliveries] == [sent["message_id"]]
    [rec] = ledger.effects()
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 2)


def test_a_temporary_refusal_before_data_is_retried_with_the_same_key(
    ledger: Ledger, smtp: FaultySMTP, mail: MailDevel, run_id: str
) -> None:
    smtp.fail_next(Fault.TEMPFAIL_RECIPIENT)
    mailer = adapter(ledger, smtp, mail, retry=RETRY)
    with step(run_id, "s"):
        sent = mailer.send(welcome())
    assert [d.message_id for d in smtp.deliveries] == [sent["message_id"]]
    [rec] = ledger.effects()
    assert (rec.status, rec.attempts) == (EffectStatus.COMMITTED, 2)


@pytest.mark.parametrize(
    ("fault", "phase", "code"),
    [(Fault.REJECT_SENDER, "mail", 553), (Fault.REJECT_RECIPIENT, "rcpt", 550)],
)
def test_a_5xx_before_data_fails_definitely_and_is_replayed(
    ledger: Ledger,
    ledgers: Ledgers,
    smtp: FaultySMTP,
    mail: MailDevel,
    run_id: str,
    fault: Fault,
    phase: str,
    code: int,
) -> None:
    smtp.fail_next(fault)
    mailer = adapter(ledger, smtp, mail, retry=RETRY)
    with step(run_id, "s"), pytest.raises(EmailRejected) as info:
        mailer.send(welcome())
    assert (info.value.phase, info.value.code) == (phase, code)
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail, retry=RETRY)
    with step(run_id, "s"), pytest.raises(EffectFailed) as failed:
        restarted.send(welcome())
    assert failed.value.error_type == "EmailRejected"
    assert smtp.deliveries == []
    [rec] = ledger.effects()
    assert (rec.status, rec.attempts) == (EffectStatus.FAILED, 1)


@pytest.mark.parametrize("fault", [Fault.DROP_AFTER_DATA, Fault.STALL_AFTER_DATA])
def test_a_lost_reply_after_data_is_reconciled_by_the_imap_probe(
    ledger: Ledger,
    ledgers: Ledgers,
    smtp: FaultySMTP,
    mail: MailDevel,
    run_id: str,
    fault: Fault,
    spans: InMemorySpanExporter,
) -> None:
    smtp.fail_next(fault)
    mailer = adapter(ledger, smtp, mail, retry=RETRY, timeout_s=0.5)
    with step(run_id, "s"):
        sent = mailer.send(welcome())
    assert sent["reconciled"] is True
    check_span(spans, "reconciled", ledger.effects()[0])
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail, retry=RETRY)
    with step(run_id, "s"):
        assert restarted.send(welcome()) == sent
    [delivery] = smtp.deliveries  # never re-sent
    assert delivery.message_id == sent["message_id"]
    assert mail.count(sent["message_id"]) == 1
    [rec] = ledger.effects()
    assert (rec.status, rec.attempts, rec.epoch) == (EffectStatus.COMMITTED, 1, 1)


def test_a_drop_before_the_message_was_filed_is_resent_once_the_probe_proves_it(
    ledger: Ledger, ledgers: Ledgers, smtp: FaultySMTP, mail: MailDevel, run_id: str
) -> None:
    smtp.fail_next(Fault.DROP_DURING_DATA)
    mailer = adapter(ledger, smtp, mail, retry=RETRY)
    with step(run_id, "s"):
        sent = mailer.send(welcome())
    assert sent["reconciled"] is False  # the re-send's own reply
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail, retry=RETRY)
    with step(run_id, "s"):
        assert restarted.send(welcome()) == sent
    log = smtp.deliveries
    assert [d.filed for d in log] == [False, True]  # the server saw DATA twice...
    assert {d.message_id for d in log} == {sent["message_id"]}  # ...with one Message-ID
    assert mail.count(sent["message_id"]) == 1  # and filed it once
    [rec] = ledger.effects()
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 2)


def test_a_lost_reply_with_the_mailbox_unreachable_needs_a_human_and_is_never_resent(
    ledger: Ledger,
    ledgers: Ledgers,
    smtp: FaultySMTP,
    mail: MailDevel,
    run_id: str,
    spans: InMemorySpanExporter,
) -> None:
    smtp.fail_next(Fault.DROP_AFTER_DATA)
    dead = IMAPMailbox(HOST, mail.user, mail.password, port=free_port(), timeout_s=1.0)
    mailer = adapter(ledger, smtp, mail, retry=RETRY, probe_mailbox=dead)
    with step(run_id, "s"), pytest.raises(EffectInDoubt) as info:
        mailer.send(welcome())
    assert info.value.status == "needs_human"
    check_span(spans, "in_doubt", ledger.effects()[0])
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail, retry=RETRY)
    with step(run_id, "s"), pytest.raises(EffectInDoubt):
        restarted.send(welcome())
    assert len(smtp.deliveries) == 1
    [rec] = ledger.effects()
    assert rec.status is EffectStatus.NEEDS_HUMAN


def test_bcc_recipients_and_explicit_keys(
    ledger: Ledger, smtp: FaultySMTP, mail: MailDevel
) -> None:
    mailer = adapter(ledger, smtp, mail)
    msg = welcome()
    msg["Bcc"] = "audit@example.org"
    key = "invoice-" + uuid.uuid4().hex
    sent = mailer.send(msg, key=key)  # outside any step
    assert mailer.send(msg, key=key) == sent
    [delivery] = smtp.deliveries
    assert delivery.rcpt_tos == ("ada@example.net", "audit@example.org")
    assert delivery.header("Bcc") is None
    with pytest.raises(ConfigurationError):
        mailer.send(welcome())  # no step, no key


def test_the_adapter_owns_the_message_id(ledger: Ledger, smtp: FaultySMTP, mail: MailDevel) -> None:
    msg = welcome()
    msg["Message-ID"] = "<mine@example.org>"
    with pytest.raises(ConfigurationError, match="Message-ID"):
        adapter(ledger, smtp, mail).send(msg, key="k")
    with pytest.raises(ConfigurationError, match="domain"):
        GuardedSMTP(ledger, smtp=smtp.endpoint(), probe_mailbox=mail.mailbox(), domain="a b")
    assert smtp.deliveries == []


# -- the fingerprint is what the e-mail means, not its wire bytes ---------------------
#
# A multipart message gets a random MIME boundary each time it is serialised, and a step
# may set its own Date: a resumed or retried step that builds the same e-mail again must
# replay it, never be refused as a reuse of its key; a real change must still be refused.


class Crash(BaseException):
    """The process dies here: nothing after it runs, nothing catches it."""


PDF = b"%PDF-1.4 invoice 2041\x00\x01\x02" * 40


def invoice(
    *,
    to: str = "ada@example.net",
    subject: str = "Your invoice for März",
    text: str = "Hello Ada,\nyour invoice is attached.\n",
    html: str = "<p>Hello Ada,</p><p>your invoice is attached.</p>",
    attachment: bytes = PDF,
    filename: str = "Rechnung-2041 (März).pdf",
    subtype: str = "pdf",
    date: str | None = None,
    extra: dict[str, str] | None = None,
) -> EmailMessage:
    """Text + HTML alternatives and a PDF attachment (multipart/mixed, nested)."""
    msg = EmailMessage()
    msg["From"] = "Shop <noreply@example.org>"
    msg["To"] = to
    msg["Subject"] = subject
    if date is not None:
        msg["Date"] = date
    for name, value in (extra or {}).items():
        msg[name] = value
    msg.set_content(text)
    msg.add_alternative(html, subtype="html")
    msg.add_attachment(attachment, maintype="application", subtype=subtype, filename=filename)
    return msg


def wire(msg: EmailMessage) -> bytes:
    return msg.as_bytes(policy=policy.SMTP)


def test_a_multipart_email_built_again_replays_whatever_its_boundary_and_date(
    ledger: Ledger, ledgers: Ledgers, smtp: FaultySMTP, mail: MailDevel, run_id: str
) -> None:
    mailer = adapter(ledger, smtp, mail)
    with step(run_id, "bill"):
        sent = mailer.send(invoice(date=formatdate(1_700_000_000)))
    again = invoice(date=formatdate(1_800_000_000))  # a resume, a minute or a year later
    assert wire(again) != wire(invoice(date=formatdate(1_800_000_000)))  # random boundaries
    with step(run_id, "bill"):
        assert mailer.send(again) == sent
    with step(run_id, "bill"):  # no Date of its own: the adapter adds one at send time
        assert mailer.send(invoice()) == sent
    restarted = adapter(ledgers.fresh(owner="w2"), smtp, mail)  # a new process
    with step(run_id, "bill"):
        assert restarted.send(invoice(date=formatdate(1_900_000_000))) == sent

    [delivery] = smtp.deliveries
    assert delivery.message_id == sent["message_id"]
    assert mail.count(sent["message_id"]) == 1
    [rec] = ledger.effects()
    assert (rec.status, rec.attempts) == (EffectStatus.COMMITTED, 1)
    received = message_from_bytes(delivery.raw, policy=policy.default)
    assert isinstance(received, EmailMessage)
    attached = next(received.iter_attachments())
    assert attached.get_filename() == "Rechnung-2041 (März).pdf"
    assert attached.get_content() == PDF


def test_a_multipart_send_whose_process_died_after_sending_is_reconciled_not_refused(
    ledger: Ledger, ledgers: Ledgers, smtp: FaultySMTP, mail: MailDevel, run_id: str
) -> None:
    def crash(name: str) -> None:
        if name == "adapters.act.after":  # sent, its outcome not recorded yet
            raise Crash

    mailer = adapter(ledger, smtp, mail)
    with armed(crash), step(run_id, "bill"), pytest.raises(Crash):
        mailer.send(invoice(date=formatdate(1_700_000_000)))
    assert ledger.effects()[0].status is EffectStatus.CLAIMED
    # the worker comes back under its own name, builds the e-mail again (another
    # boundary, another Date) and the probe finds the first one in the mailbox
    restarted = adapter(ledgers.fresh(owner="w1"), smtp, mail, retry=RETRY)
    with step(run_id, "bill"):
        sent = restarted.send(invoice(date=formatdate(1_700_000_060)))
    assert sent["reconciled"] is True
    with step(run_id, "bill"):
        assert restarted.send(invoice()) == sent
    [delivery] = smtp.deliveries  # never sent twice
    assert delivery.message_id == sent["message_id"]
    assert mail.count(sent["message_id"]) == 1
    [rec] = ledger.effects()
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 1)


def test_a_multipart_step_crashed_then_retried_by_an_operator_sends_once(
    store: Store, ledger: Ledger, ledgers: Ledgers, smtp: FaultySMTP, mail: MailDevel
) -> None:
    faults = ["crash", "fail"]
    flow = Flow("billing")

    @flow.step(start=True)
    def bill(ctx: StepContext) -> Transition:
        mailer = adapter(ctx.ledger, smtp, mail)
        sent = mailer.send(invoice(date=formatdate()))  # a fresh Date and boundary each time
        fault = faults.pop(0) if faults else None
        if fault == "crash":
            raise Crash
        if fault == "fail":
            raise RuntimeError("the ERP is down")
        ctx.state["sent"] = sent
        return ctx.end()

    rid = Runtime(store, ledger, [flow], owner="rt").start("billing")
    with pytest.raises(Crash):
        Runtime(store, ledger, [flow], owner="rt").drive(rid)
    resumed = ledgers.fresh(owner="w1")  # another process resumes the step
    runtime = Runtime(resumed.store, resumed, [flow], owner="rt")
    assert runtime.drive(rid).status is RunStatus.FAILED
    operator = Operator(resumed.store, resumed)
    assert operator.show(rid).meta["error"]["type"] == "RuntimeError"  # not KeyReuseError
    operator.retry(rid, actor="ops", reason="ERP back")
    assert runtime.drive(rid).status is RunStatus.COMPLETED

    [delivery] = smtp.deliveries
    sent = operator.show(rid).state["sent"]
    assert delivery.message_id == sent["message_id"]
    assert mail.count(sent["message_id"]) == 1


_CHANGES: dict[str, dict[str, Any]] = {
    "text body": {"text": "Hello Ada,\nyour invoice is attached. Pay now.\n"},
    "html body": {"html": "<p>Hello Ada,</p><p>pay now.</p>"},
    "attachment bytes": {"attachment": b"%PDF-1.4 invoice 2042\x00\x01\x02" * 40},
    "attachment filename": {"filename": "Rechnung-2042 (März).pdf"},
    "attachment type": {"subtype": "octet-stream"},
    "recipient": {"to": "bob@example.net"},
    "another recipient": {"to": "ada@example.net, bob@example.net"},
    "subject": {"subject": "Your invoice for April"},
    "a Bcc": {"extra": {"Bcc": "audit@example.org"}},
    "a Reply-To": {"extra": {"Reply-To": "billing@example.org"}},
}


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_a_changed_multipart_email_under_the_same_key_is_refused(
    ledger: Ledger, smtp: FaultySMTP, mail: MailDevel, run_id: str, change: str
) -> None:
    mailer = adapter(ledger, smtp, mail)
    with step(run_id, "bill"):
        mailer.send(invoice())
    with step(run_id, "bill"), pytest.raises(KeyReuseError):
        mailer.send(invoice(**_CHANGES[change]))
    assert len(smtp.deliveries) == 1


def test_a_changed_envelope_under_the_same_key_is_refused(
    ledger: Ledger, smtp: FaultySMTP, mail: MailDevel
) -> None:
    mailer = adapter(ledger, smtp, mail)
    key = "invoice-" + uuid.uuid4().hex
    mailer.send(invoice(), to_addrs=["ada@example.net", "audit@example.org"], key=key)
    # the envelope recipients are a set: their order and repeats are not a change
    again = ["audit@example.org", "ada@example.net", "ada@example.net"]
    assert mailer.send(invoice(), to_addrs=again, key=key)["refused"] == []
    with pytest.raises(KeyReuseError):
        mailer.send(invoice(), to_addrs=["ada@example.net"], key=key)
    with pytest.raises(KeyReuseError):
        mailer.send(
            invoice(),
            from_addr="billing@example.org",
            to_addrs=["ada@example.net", "audit@example.org"],
            key=key,
        )
    [delivery] = smtp.deliveries
    assert delivery.rcpt_tos == ("ada@example.net", "audit@example.org")


_filenames = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "Zs", "Pd"]), min_size=1, max_size=24
).map(lambda s: s.strip() + ".bin")
_words = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "P", "Zs"]), min_size=1, max_size=30
).map(str.strip)
_bodies = st.lists(_words, max_size=6).map(lambda lines: "\n".join(lines) + "\n")


@st.composite
def _messages(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A recipe of a message (built by :func:`_build`): any alternatives, attachments."""
    recipe: dict[str, Any] = {
        "subject": draw(_words.filter(bool)),
        "text": draw(_bodies),
        "html": draw(st.none() | _bodies.map(lambda b: f"<pre>{escape(b)}</pre>")),
        "attachments": draw(st.lists(st.tuples(st.binary(max_size=300), _filenames), max_size=3)),
        "cc": draw(st.booleans()),
    }
    return draw(st.sampled_from(sorted(recipe))), recipe


def _build(recipe: dict[str, Any], date: str | None = None) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = "Shop <noreply@example.org>"
    msg["To"] = "Ada Lovelace <ada@example.net>"
    if recipe["cc"]:
        msg["Cc"] = "audit@example.org"
    msg["Subject"] = recipe["subject"]
    if date is not None:
        msg["Date"] = date
    msg.set_content(recipe["text"])
    if recipe["html"] is not None:
        msg.add_alternative(recipe["html"], subtype="html")
    for data, name in recipe["attachments"]:
        msg.add_attachment(data, maintype="application", subtype="octet-stream", filename=name)
    return msg


def _changed(recipe: dict[str, Any], field: str) -> dict[str, Any]:
    new = dict(recipe)
    if field == "attachments":
        new[field] = [*recipe[field], (b"more", "more.bin")]
    elif field == "html":
        new[field] = "<p>other</p>" if recipe[field] is None else None
    elif field == "cc":
        new[field] = not recipe[field]
    else:
        new[field] = recipe[field] + " (changed)"
    return new


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=_messages())
def test_any_message_replays_when_rebuilt_or_read_back_and_refuses_any_change(
    ledger: Ledger, smtp: FaultySMTP, mail: MailDevel, drawn: tuple[str, dict[str, Any]]
) -> None:
    field, recipe = drawn
    mailer = adapter(ledger, smtp, mail)
    key = "prop-" + uuid.uuid4().hex
    before = len(smtp.deliveries)
    sent = mailer.send(_build(recipe, formatdate(1_700_000_000)), key=key)
    # rebuilt (another boundary and Date), and read back from its own wire bytes (another
    # policy, folded and encoded headers, base64 parts): the same e-mail each time
    read_back = message_from_bytes(wire(_build(recipe)), policy=policy.compat32)
    for same in (_build(recipe, formatdate(1_800_000_000)), read_back):
        assert mailer.send(same, key=key) == sent  # type: ignore[arg-type]
    with pytest.raises(KeyReuseError):
        mailer.send(_build(_changed(recipe, field)), key=key)
    assert len(smtp.deliveries) == before + 1
