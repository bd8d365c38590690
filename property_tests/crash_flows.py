"""The flow the S2 and S7 suites crash and fail: a plan of steps, carried in the run's state.

A plan is a list of items, one per step visit of the looping step ``work``:

* ``{"op": "effects", "effects": [[cls, label, reject], ...]}``: guarded HTTP requests
  in one step, to the fake of class ``cls`` (``A``, ``B`` or ``C``); ``reject`` asks the
  fake to refuse it definitely (the step notes the failure and goes on);
* ``{"op": "branches", "branches": {name: [[cls, label, reject], ...]}}``: parallel
  branches (``ctx.parallel``), each sending its effects;
* ``{"op": "choose", "label": l, "options": [[cls, label, reject], ...]}``: a recorded
  read picks one option, which is sent (a branch in the flow that must replay the same
  way);
* ``{"op": "approval" | "signal" | "sleep", "name": n}``: a wait.

Every effect's JSON body names its label, so the fakes' logs identify it without our
keys. The module is importable by name: the crash harness's child processes load it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx

from onceonly.adapters.guard import RetryPolicy
from onceonly.adapters.http import GuardedHTTP, HTTPRejected
from onceonly.context import BranchContext, StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectFailed, Ledger

__all__ = ["CLIENTS", "WINDOW_S", "plan_flow"]

WINDOW_S = 7 * 24 * 3600.0
"""Class A providers' dedup window (the harness clock jumps by minutes at most)."""

CLIENTS: dict[str, httpx.Client] = {}
"""Clients by provider URL (set by a test to a fake's refusing client); others get a
plain one per process."""

_RETRY = RetryPolicy(max_attempts=3, initial_s=0.0, max_s=0.0)
# Made at import, before the crash harness's fork server forks (children inherit it with
# no connection open): building a client costs more than a whole crash run otherwise.
_PLAIN = httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0))


def _client(url: str) -> httpx.Client:
    return CLIENTS.get(url, _PLAIN)


def send(ledger: Ledger, urls: dict[str, str], item: list[Any]) -> str:
    """Send one planned effect; return ``"ok"`` or ``"rejected"``."""
    cls, label, reject = str(item[0]), str(item[1]), bool(item[2])
    url = urls[cls]
    http = GuardedHTTP(_client(url), ledger, retry=_RETRY)
    try:
        http.post(
            f"{url}/effects",
            effect=f"send-{cls}@1",
            json={"label": label, "reject": reject},
            provider_class=cls,
            window_s=WINDOW_S if cls == "A" else None,
            lookup=f"{url}/lookup/{{key}}" if cls == "B" else None,
        )
    except (HTTPRejected, EffectFailed):
        return "rejected"
    return "ok"


def _pick(label: str, n: int) -> int:
    return hashlib.blake2b(label.encode(), digest_size=4).digest()[0] % n


plan_flow = Flow("crash-plan")


@plan_flow.step(start=True)
def work(ctx: StepContext) -> Transition:
    """Carry out the next item of the plan."""
    plan: list[dict[str, Any]] = ctx.state["plan"]
    at = int(ctx.state.get("at", 0))
    if at >= len(plan):
        return ctx.end({"steps": at, "outcomes": ctx.state.get("outcomes", [])})
    item = plan[at]
    ctx.state["at"] = at + 1
    urls: dict[str, str] = ctx.state["urls"]
    op = item["op"]
    outcomes: list[str] = list(ctx.state.get("outcomes", []))
    if op == "effects":
        outcomes += [send(ctx.ledger, urls, e) for e in item["effects"]]
    elif op == "branches":

        def branch(effects: list[list[Any]]) -> Any:
            def run(b: BranchContext) -> list[str]:
                return [send(b.ledger, urls, e) for e in effects]

            return run

        done = ctx.parallel({name: branch(e) for name, e in sorted(item["branches"].items())})
        outcomes += [o for name in sorted(done) for o in done[name]]
    elif op == "choose":
        options = item["options"]
        i = ctx.recorded("choose@1", _pick, str(item["label"]), len(options))
        outcomes.append(send(ctx.ledger, urls, options[i]))
    elif op == "approval":
        return ctx.wait_for_approval(
            str(item["name"]), {"plan_step": at}, then="work", requested_by="planner"
        )
    elif op == "signal":
        return ctx.wait_for_signal(str(item["name"]), then="work")
    elif op == "sleep":
        return ctx.sleep(str(item["name"]), 60.0, then="work")
    else:
        return ctx.fail(f"unknown plan item {op!r}")
    ctx.state["outcomes"] = outcomes
    return ctx.next("work")
