"""Two releases of one flow, for worker processes of two versions side by side
(``tests/test_versioned_workers.py``).

``ship`` prepares (a guarded delivery), waits for the signal ``go``, then sends (a
second guarded delivery). Version 2 renamed ``send`` to ``deliver`` and maps version 1's
runs onto it for ``onceonly runs upgrade``; it does not serve version 1 itself. Version 3
has the same steps but no such mapping: an upgrade of a version 1 run to it is refused.

Each delivery is a raw line appended to the run's ``outbox`` file (the fake provider,
``O_APPEND``): the effect, the code version and the worker process that sent it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from onceonly.adapters import guard
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from tests.operator_flows import deliveries  # the same raw outbox lines

__all__ = ["V1", "V2", "V3", "deliveries"]

V1 = Flow("ship", version="1")
V2 = Flow("ship", version="2", upgrades={"1": {"send": "deliver"}})
V3 = Flow("ship", version="3")  # ``send`` renamed, version 1's runs not mapped


def _deliver(outbox: str, what: str, version: str) -> dict[str, Any]:
    line = {"what": what, "version": version, "pid": os.getpid()}
    with open(outbox, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return line


def _prepare(version: str) -> Any:
    def prepare(ctx: StepContext) -> Transition:
        out = guard(ctx.ledger, effect="prepare@1")(_deliver)
        ctx.state["prepared"] = out(str(ctx.state["outbox"]), "prepare", version)
        return ctx.wait_for_signal("go", then="send" if version == "1" else "deliver")

    return prepare


def _send(version: str) -> Any:
    def send(ctx: StepContext) -> Transition:
        out = guard(ctx.ledger, effect="send@1")(_deliver)
        sent = out(str(ctx.state["outbox"]), "send", version)
        return ctx.end({"sent_by": sent["version"], "run_version": ctx.version})

    return send


V1.step(name="prepare", start=True)(_prepare("1"))
V1.step(name="send")(_send("1"))
V2.step(name="prepare", start=True)(_prepare("2"))
V2.step(name="deliver")(_send("2"))
V3.step(name="prepare", start=True)(_prepare("3"))
V3.step(name="deliver")(_send("3"))
