"""Flows for the operator-tool tests, importable by a worker subprocess
(``onceonly worker --flows tests.operator_flows:FLOWS``).

The provider is a counting fake that appends one JSON line per raw delivery to the file
named in the run's state channel ``outbox`` (the oracle: it is read directly, never
through the ledger). When a file ``<outbox>.lose`` exists, the next delivery is applied
and its answer lost; when ``<outbox>.drop`` exists, the next request is lost before it
arrives (either file is removed once used). The guard sees an ambiguous timeout in both
cases: only the outbox tells them apart, as only the provider could.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from onceonly.adapters import current_claim, guard
from onceonly.context import StepContext
from onceonly.flow import Flow, StepRetry, Transition

__all__ = ["FLOWS", "LEASE", "PUBLISH", "REPAIR", "deliveries"]

PUBLISH = Flow("publish")
"""draft → (approval ``send``) → send (a guarded delivery) → (signal ``ack``) → finish."""

REPAIR = Flow("repair")
"""check fails while the state channel ``broken`` is true; an operator edits it and
retries the run."""

LEASE = Flow("lease")
"""report: keeps the worker's effect-claim lease (``Ledger.lease_s``) in the state."""


def deliveries(outbox: str | Path) -> list[dict[str, Any]]:
    """Every raw delivery the fake provider received, in order."""
    path = Path(outbox)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _deliver(outbox: str, to: str, text: str) -> dict[str, Any]:
    key = current_claim().provider_key
    drop = Path(outbox + ".drop")
    if drop.exists():
        drop.unlink()
        raise TimeoutError("timeout (the request never reached the fake)")
    with open(outbox, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"key": key, "to": to, "text": text}) + "\n")
    lose = Path(outbox + ".lose")
    if lose.exists():
        lose.unlink()
        raise TimeoutError("read timeout (the fake applied the delivery and lost the answer)")
    return {"id": len(deliveries(outbox)), "to": to}


@PUBLISH.step(start=True)
def draft(ctx: StepContext) -> Transition:
    to = str(ctx.state["to"])
    ctx.state["draft"] = {"to": to, "text": f"Hello {to}"}
    ctx.note(goal=f"send a greeting to {to}", next=("approve the draft",))
    expires = ctx.state.get("expires_in")
    return ctx.wait_for_approval(
        "send",
        ctx.state["draft"],
        then="send",
        on_reject="rejected",
        expires_in=None if expires is None else float(expires),
    )


@PUBLISH.step
def send(ctx: StepContext) -> Transition:
    msg = ctx.state["draft"]
    ctx.approved("send", msg)  # acts only on exactly what was approved
    deliver = guard(ctx.ledger, effect="deliver@1")(_deliver)
    ctx.state["receipt"] = deliver(str(ctx.state["outbox"]), msg["to"], msg["text"])
    ctx.note(done=("draft", "send"), next=("wait for the ack",))
    return ctx.wait_for_signal("ack", then="finish")


@PUBLISH.step
def finish(ctx: StepContext) -> Transition:
    return ctx.end({"receipt": ctx.state["receipt"], "ack": ctx.signal("ack")})


@PUBLISH.step
def rejected(ctx: StepContext) -> Transition:
    return ctx.end("rejected")


@REPAIR.step(start=True)
def check(ctx: StepContext) -> Transition:
    if ctx.state.get("broken"):
        return ctx.fail("the input is broken")
    return ctx.end({"fixed": True, "pid": os.getpid()})


@LEASE.step(start=True)
def report(ctx: StepContext) -> Transition:
    return ctx.end({"claim_lease_s": ctx.ledger.lease_s})


# Steps whose dependency always times out: retried on an hour's timer, or at once.
PATIENT = Flow("patient")
IMPATIENT = Flow("impatient")


def _times_out(ctx: StepContext) -> Transition:
    raise TimeoutError(f"the quote service did not answer for {ctx.run_id}")


PATIENT.step(name="quote", retry=StepRetry(attempts=3, backoff_s=3600))(_times_out)
IMPATIENT.step(name="quote", retry=StepRetry(attempts=2, backoff_s=0))(_times_out)

# A run with two hours to get its documents, which goes to ``give_up`` when they pass.
DEADLINED = Flow("deadlined", deadline_s=7200, on_deadline="give_up")


@DEADLINED.step(start=True)
def ask_for_docs(ctx: StepContext) -> Transition:
    return ctx.wait_for_signal("docs", then="give_up")


@DEADLINED.step
def give_up(ctx: StepContext) -> Transition:
    return ctx.end("gave up")


FLOWS = [PUBLISH, REPAIR, LEASE, PATIENT, IMPATIENT, DEADLINED]

# The next release, as ``onceonly runs check`` sees it: publish's ``rejected`` step is
# renamed ``declined``, which strands a run waiting for its approval (its rejection path).
PUBLISH_V2 = Flow("publish", version="2", serves=("1",))
PUBLISH_V2.step(name="draft", start=True)(draft)
PUBLISH_V2.step(name="send")(send)
PUBLISH_V2.step(name="finish")(finish)
PUBLISH_V2.step(name="declined")(rejected)
NEXT_RELEASE = [PUBLISH_V2, REPAIR, LEASE, PATIENT, IMPATIENT, DEADLINED]

# A release that serves only its own version and maps version 1's runs onto it, for
# ``onceonly runs upgrade``.
PUBLISH_V3 = Flow("publish", version="3", upgrades={"1": {"rejected": "declined"}})
PUBLISH_V3.step(name="draft", start=True)(draft)
PUBLISH_V3.step(name="send")(send)
PUBLISH_V3.step(name="finish")(finish)
PUBLISH_V3.step(name="declined")(rejected)
