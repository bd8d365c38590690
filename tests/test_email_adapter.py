"""The e-mail adapter against real servers: every failure mode ends in class B semantics.

The oracle is the SMTP server's raw DATA log (every DATA it received, filed or not) and
the IMAP mailbox mail-devel files accepted messages into; see ``tests/mail_fakes.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from email.message import EmailMessage

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from adapters import RetryPolicy, step
from adapters.email import (
    EmailNotSent,
    EmailRejected,
    GuardedSMTP,
    IMAPMailbox,
)
from checkpoint import ConfigurationError, Store
from ledger import EffectFailed, EffectInDoubt, EffectRecord, EffectStatus, Ledger
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
