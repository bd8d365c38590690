"""The flow of the console tests, importable by a worker subprocess
(``onceonly worker --flows tests.console_flows:FLOWS``): vendor onboarding that pauses
for a compliance officer's approval before the vendor record is created.

The record system is a counting fake: one JSON line per raw delivery in the file named
by the state channel ``outbox`` (the oracle, read directly, never through the ledger).
"""

from __future__ import annotations

import json
from email.message import EmailMessage
from typing import Any

from onceonly.adapters import current_claim, guard
from onceonly.adapters.email import GuardedSMTP, IMAPMailbox, SMTPServer
from onceonly.checkpoint import subject_hash
from onceonly.console import approval_link, link_key
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from tests.operator_flows import FLOWS as OPERATOR_FLOWS

__all__ = ["FLOWS", "LINKED", "VENDOR"]

VENDOR = Flow("vendor")
"""propose → (approval ``compliance`` of the vendor record) → create (a guarded record
creation, of exactly what was approved) → end; a rejection ends it as ``declined``."""


def _create(outbox: str, vendor: dict[str, Any]) -> dict[str, Any]:
    with open(outbox, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"key": current_claim().provider_key, "vendor": vendor}) + "\n")
    return {"created": vendor["name"]}


@VENDOR.step(start=True)
def propose(ctx: StepContext) -> Transition:
    vendor = ctx.state["vendor"]
    ctx.note(goal=f"onboard vendor {vendor['name']}", next=("compliance approval",))
    return ctx.wait_for_approval("compliance", vendor, then="create", on_reject="declined")


@VENDOR.step
def create(ctx: StepContext) -> Transition:
    # What the officer approved (perhaps edited): exactly that is created.
    vendor = dict(ctx.approved("compliance")["subject"])
    ctx.approved("compliance", vendor)
    make = guard(ctx.ledger, effect="vendor.create@1")(_create)
    ctx.state["record"] = make(str(ctx.state["outbox"]), vendor)
    ctx.note(done=("compliance approval", "vendor record"), next=())
    return ctx.end(ctx.state["record"])


@VENDOR.step
def declined(ctx: StepContext) -> Transition:
    return ctx.end("declined")


LINKED = Flow("linked")
"""vendor onboarding whose approval request goes to one approver by e-mail, with a
signed link (sent through GuardedSMTP: once), then as VENDOR."""


@LINKED.step(start=True)
def ask(ctx: StepContext) -> Transition:
    vendor = ctx.state["vendor"]
    mail = ctx.state["mail"]  # where the test's mail server listens
    link = approval_link(
        link_key(ctx.ledger.keyring),
        str(ctx.state["console_url"]),
        run_id=ctx.run_id,
        name="compliance",
        subject_hash=subject_hash(ctx.store, vendor),
        approver=str(ctx.state["approver"]),
        expires_at=float(ctx.state["link_expires_at"]),  # kept in the run: a re-run
    )  # builds the same message, which the ledger replays
    msg = EmailMessage()
    msg["From"] = "onceonly@example.org"
    msg["To"] = str(ctx.state["approver_email"])
    msg["Subject"] = f"Please approve vendor {vendor['name']}"
    msg.set_content(f"Review and approve (or reject) here:\n{link}\n")
    GuardedSMTP(
        ctx.ledger,
        smtp=SMTPServer("127.0.0.1", int(mail["smtp_port"])),
        probe_mailbox=IMAPMailbox(
            "127.0.0.1", str(mail["user"]), str(mail["password"]), port=int(mail["imap_port"])
        ),
        domain="mail.example.org",
    ).send(msg)
    return ctx.wait_for_approval("compliance", vendor, then="create", on_reject="declined")


LINKED.step(name="create")(create)
LINKED.step(name="declined")(declined)

FLOWS = [*OPERATOR_FLOWS, VENDOR, LINKED]
