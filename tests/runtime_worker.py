"""A runtime worker process for the crash tests (``tests/test_runtime_crash.py``).

``python -m tests.runtime_worker run URL FLOW RUN_ID DELIVERIES`` starts (idempotently) a
run of ``FLOW`` and drives it until it waits or ends, then prints ``status <status>``.
``python -m tests.runtime_worker approve URL RUN_ID NAME ACTOR`` approves what the run
asked for, from a process that runs no steps.

Every effect goes to a provider that survives the worker: the file ``DELIVERIES``, one
line appended per raw delivery (``O_APPEND``, fsynced before the call returns), with the
effect, the provider key and the payload. The provider can be asked whether a key was
delivered (class B), which is how a resumed worker settles a delivery it made but did not
record before it died.

``KILL_AT=<step>:<point>`` makes the worker SIGKILL itself the first time it reaches that
point: ``start`` and ``end`` of the step, ``sent-N`` (the provider has the N-th delivery
of the step, the ledger does not know yet) and ``after-N`` (the N-th effect returned).
The worker's name is fixed, as a restarted worker's would be: its successor takes the run
lease at once and finds the dead one's open claim in doubt without waiting for it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from onceonly.adapters import current_claim, guard
from onceonly.checkpoint import RunStatus, Store, WaitStatus
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectRecord, Evidence, InFlightPolicy, Keyring, Ledger, Secret
from onceonly.operator import Operator
from onceonly.runtime import Runtime

__all__ = ["FLOWS", "KILL_POINTS", "OWNER", "deliveries", "open_ledger"]

OWNER = "crash-worker"
SECRET = Secret("k1", bytes(range(32)))

KILL_POINTS = [
    "prepare:start",
    "prepare:sent-1",
    "prepare:after-1",
    "prepare:end",
    "notify:start",
    "notify:sent-1",
    "notify:after-1",
    "notify:sent-2",
    "notify:after-2",
    "notify:end",
    "finish:start",
    "finish:sent-1",
    "finish:after-1",
    "finish:end",
]
"""Every kill point of the ``crash`` flow, in the order a run reaches them."""


def deliveries(path: str | Path) -> list[tuple[str, str, Any]]:
    """The provider's raw deliveries: ``(effect, provider key, payload)``."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        effect, key, payload = line.split("\t", 2)
        out.append((effect, key, json.loads(payload)))
    return out


def open_ledger(url: str) -> Ledger:
    """The ledger (on a new store) every process of these tests uses."""
    return Ledger(
        Store.open(url), Keyring([SECRET]), owner=OWNER, in_flight=InFlightPolicy(wait_s=0)
    )


def _kill_at(step: str, point: str) -> None:
    if os.environ.get("KILL_AT") == f"{step}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


class _FileProvider:
    """The provider: appends each delivery to a file and answers lookups from it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def deliver(self, step: str, n: int, effect: str, payload: Any) -> dict[str, Any]:
        key = current_claim().provider_key
        line = f"{effect}\t{key}\t{json.dumps(payload)}\n".encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        _kill_at(step, f"sent-{n}")
        return {"effect": effect, "payload": payload}

    def lookup(self, record: EffectRecord) -> tuple[Evidence, Any]:
        for effect, key, payload in deliveries(self.path):
            if key == record.provider_key:
                return Evidence.HAPPENED, {"effect": effect, "payload": payload}
        return Evidence.NOT_HAPPENED, None


def _send(ctx: StepContext, n: int, effect: str, payload: Any) -> dict[str, Any]:
    provider = _FileProvider(str(ctx.state["deliveries"]))

    @guard(ctx.ledger, effect=effect, provider_class="B", probe=provider.lookup)
    def deliver(payload: Any) -> dict[str, Any]:
        return provider.deliver(ctx.step, n, effect, payload)

    result = deliver(payload)
    _kill_at(ctx.step, f"after-{n}")
    return result


# -- crash: three steps, four effects, one recorded read ---------------------------------
crash = Flow("crash")


@crash.step(start=True)
def prepare(ctx: StepContext) -> Transition:
    """Read a quote (recorded) and reserve the stock."""
    _kill_at("prepare", "start")
    ctx.state["quote"] = ctx.recorded("quote@1", lambda sku: {"sku": sku, "price": 42}, "X1")
    ctx.state["reserved"] = _send(ctx, 1, "reserve@1", {"sku": "X1"})
    _kill_at("prepare", "end")
    return ctx.next("notify")


@crash.step
def notify(ctx: StepContext) -> Transition:
    """Tell two people."""
    _kill_at("notify", "start")
    for n, to in enumerate(("a@example.com", "b@example.com"), start=1):
        _send(ctx, n, "email@1", {"to": to, "price": ctx.state["quote"]["price"]})
    _kill_at("notify", "end")
    return ctx.next("finish")


@crash.step
def finish(ctx: StepContext) -> Transition:
    """Charge, and end."""
    _kill_at("finish", "start")
    charged = _send(ctx, 1, "charge@1", {"amount": ctx.state["quote"]["price"]})
    _kill_at("finish", "end")
    return ctx.end(charged)


# -- approval: reserve, wait for a person, charge ----------------------------------------
approval = Flow("approval")


@approval.step(start=True, name="prepare")
def reserve(ctx: StepContext) -> Transition:
    """Reserve, then ask."""
    _send(ctx, 1, "reserve@1", {"sku": "X1"})
    return ctx.wait_for_approval("charge", {"amount": 42}, then="finish")


@approval.step(name="finish")
def charge(ctx: StepContext) -> Transition:
    """Charge exactly what was approved."""
    ctx.approved("charge", {"amount": 42})
    return ctx.end(_send(ctx, 1, "charge@1", {"amount": 42}))


FLOWS = [crash, approval]


def main(argv: list[str]) -> int:
    """Run or approve; see the module docstring."""
    if argv[0] == "run":
        url, flow, run_id, path = argv[1:]
        ledger = open_ledger(url)
        rt = Runtime(ledger.store, ledger, FLOWS, owner=OWNER, lease_s=30)
        rt.start(flow, {"deliveries": path}, run_id=run_id, started_by="alice")
        run = rt.drive(run_id)
        print(f"status {run.status.value}", flush=True)
        return 0 if run.status in (RunStatus.COMPLETED, RunStatus.WAITING) else 1
    if argv[0] == "approve":
        url, run_id, name, actor = argv[1:]
        ledger = open_ledger(url)
        op = Operator(ledger.store, ledger)
        [wait] = [w for w in op.show(run_id).waits if w.name == name]
        assert wait.status is WaitStatus.OPEN
        assert wait.subject_hash is not None
        op.approve(run_id, name, actor=actor, subject_hash=wait.subject_hash)
        print("approved", flush=True)
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
