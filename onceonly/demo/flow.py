"""Vendor onboarding: the flow ``onceonly demo`` runs, and the example to copy.

Four steps and two waits. Every external action goes through a guarded adapter, so a
worker killed anywhere (a deploy, an OOM kill) resumes without acting twice:

1. ``request_documents`` e-mails the supplier (``GuardedSMTP``: a deterministic
   Message-ID, probed over IMAP after a crash), then waits for their documents (a signal).
2. ``extract_details`` reads the tax ID and bank details out of the documents.
3. ``screen_sanctions`` asks the screening API once (``GuardedHTTP``, class B: looked up
   by its reference after a crash), then waits for a compliance officer's approval of
   exactly the vendor and the screening result.
4. ``create_vendor`` checks that what it is about to create is what was approved, then
   creates the vendor record in the ERP once.

Run it with ``onceonly worker --flows onceonly.demo.flow:FLOWS``; the endpoints come from
the run's ``services`` state channel.
"""

from __future__ import annotations

import re
from email.message import EmailMessage
from typing import Any

import httpx

from onceonly.adapters import GuardedSMTP, IMAPMailbox, SMTPServer
from onceonly.adapters.http import GuardedHTTP
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition

__all__ = ["FLOWS", "onboarding"]

onboarding = Flow("vendor-onboarding", version="2026.11")


@onboarding.step(start=True)
def request_documents(ctx: StepContext) -> Transition:
    svc, supplier = ctx.state["services"], ctx.state["supplier"]
    mail = GuardedSMTP(
        ctx.ledger,
        smtp=SMTPServer("127.0.0.1", svc["smtp_port"], timeout_s=10),
        probe_mailbox=IMAPMailbox(
            "127.0.0.1", svc["imap_user"], svc["imap_password"], port=svc["imap_port"]
        ),
        domain="onboarding.demo.example",
    )
    msg = EmailMessage()
    msg["From"] = "onboarding@demo.example"
    msg["To"] = supplier["email"]
    msg["Subject"] = f"Documents needed to onboard {supplier['name']}"
    msg.set_content("Please reply with your tax ID and the bank letter for your IBAN.")
    mail.send(msg)
    ctx.note(
        goal=f"onboard {supplier['name']} as a vendor",
        done=["asked the supplier for documents"],
        next=["wait for the documents"],
    )
    return ctx.wait_for_signal("documents", then="extract_details")


@onboarding.step
def extract_details(ctx: StepContext) -> Transition:
    text = ctx.signal("documents")["text"]
    tax_id = re.search(r"Tax ID:\s*(\S+)", text)
    iban = re.search(r"IBAN:\s*([A-Z0-9 ]+)", text)
    if tax_id is None or iban is None:
        return ctx.fail("the documents lack a tax ID or an IBAN")
    ctx.state["vendor"] = {
        "name": ctx.state["supplier"]["name"],
        "tax_id": tax_id.group(1),
        "iban": iban.group(1).replace(" ", ""),
    }
    return ctx.next("screen_sanctions")


@onboarding.step
def screen_sanctions(ctx: StepContext) -> Transition:
    vendor = ctx.state["vendor"]
    with httpx.Client(base_url=ctx.state["services"]["screening"], timeout=10) as client:
        answer = GuardedHTTP(client, ctx.ledger).post(
            "/screenings",
            effect="sanctions.screen@1",
            json={"name": vendor["name"], "tax_id": vendor["tax_id"]},
            provider_class="B",
            lookup="/screenings/{key}",
        )
    ctx.state["screening"] = answer["json"]
    if answer["json"]["hit"]:
        return ctx.fail(f"sanctions hit on {vendor['name']}")
    ctx.note(done=[*ctx.handoff.done, "documents read", "sanctions screening clear"])
    return ctx.wait_for_approval(
        "compliance",
        _approval_subject(ctx.state),
        then="create_vendor",
        requested_by="onboarding-agent",
        expires_in=3 * 24 * 3600,
    )


@onboarding.step
def create_vendor(ctx: StepContext) -> Transition:
    ctx.approved("compliance", _approval_subject(ctx.state))  # exactly what was approved
    with httpx.Client(base_url=ctx.state["services"]["erp"], timeout=10) as client:
        record = GuardedHTTP(client, ctx.ledger).post(
            "/vendors",
            effect="erp.vendor.create@1",
            json=ctx.state["vendor"],
            provider_class="B",
            lookup="/vendors/{key}",
        )
    ctx.note(done=[*ctx.handoff.done, "approved", "vendor record created"], next=[])
    return ctx.end({"vendor_id": record["json"]["id"]})


def _approval_subject(state: dict[str, Any]) -> dict[str, Any]:
    return {"vendor": state["vendor"], "screening": state["screening"]}


FLOWS = [onboarding]
