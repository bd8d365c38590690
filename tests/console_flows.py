"""The flow of the console tests, importable by a worker subprocess
(``onceonly worker --flows tests.console_flows:FLOWS``): vendor onboarding that pauses
for a compliance officer's approval before the vendor record is created.

The record system is a counting fake: one JSON line per raw delivery in the file named
by the state channel ``outbox`` (the oracle, read directly, never through the ledger).
"""

from __future__ import annotations

import json
from typing import Any

from onceonly.adapters import current_claim, guard
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from tests.operator_flows import FLOWS as OPERATOR_FLOWS

__all__ = ["FLOWS", "VENDOR"]

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


FLOWS = [*OPERATOR_FLOWS, VENDOR]
