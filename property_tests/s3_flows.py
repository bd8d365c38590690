"""Generated flows for the process suites S3 and S4, run by real worker processes
(``onceonly worker --flows property_tests.s3_flows:FLOWS`` or
``python -m property_tests.s4_worker``), plus the vendor-onboarding demo flow.

A ``gen`` run's state holds a *plan*: a list of steps, each a list of effects
``[cls, label]`` (cls ``a``/``b``/``c``: the provider class, see
:mod:`property_tests.s3_fakes`) or the string ``"nap"`` (a short durable timer). The
step ``work`` performs step ``i`` of the plan and moves on; the run ends after the last.
Every effect is a guarded HTTP POST to the fenced fake provider at ``state["url"]``,
carrying the worker's name in ``X-Worker`` (not part of the fingerprint).

Test-only switches, read from the environment of the worker process (a deliberately
broken build for the positive controls, and the GC-pause fault of S4):

* ``S3_BROKEN=probe``: the class B probe answers "did not happen" without asking, so an
  in-doubt delivery is re-sent (class B treated as re-sendable);
* ``S4_PAUSE_P=<p>`` and ``S4_PAUSE_FILE=<path>``: with probability ``p``, between the
  claim and the send (inside the guarded call, as the request leaves), the worker
  appends ``<pid> <provider key> <epoch>`` to the file and SIGSTOPs itself: a GC pause.
  The test resumes it with SIGCONT.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import httpx

from onceonly.adapters.http import GuardedHTTP
from onceonly.context import StepContext
from onceonly.demo.flow import onboarding
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectRecord, Evidence

__all__ = ["FLOWS", "gen"]

WINDOW_S = 24 * 3600.0  # class A: the fake deduplicates forever

_clients: dict[int, httpx.Client] = {}
_rng = random.Random()


def _pause_hook(request: httpx.Request) -> None:
    p = float(os.environ.get("S4_PAUSE_P", "0") or 0)
    if p <= 0 or request.method != "POST" or _rng.random() >= p:
        return
    token = request.headers.get("x-onceonly-fencing", "")
    key, _, epoch = token.rpartition(":")
    path = os.environ["S4_PAUSE_FILE"]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()} {key} {epoch}\n".encode())
    finally:
        os.close(fd)
    os.kill(os.getpid(), signal.SIGSTOP)


def _client() -> httpx.Client:
    pid = os.getpid()
    if pid not in _clients:
        _rng.seed(pid ^ int(os.environ.get("S4_SEED", "0") or 0))
        _clients[pid] = httpx.Client(
            timeout=httpx.Timeout(5.0, connect=2.0), event_hooks={"request": [_pause_hook]}
        )
    return _clients[pid]


def _broken_probe(record: EffectRecord) -> tuple[Evidence, Any]:
    return Evidence.NOT_HAPPENED, None


def deliver(ctx: StepContext, cls: str, label: str) -> dict[str, Any]:
    """One guarded delivery of ``label`` to the provider of class ``cls``."""
    url = str(ctx.state["url"])
    options: dict[str, Any] = {"provider_class": cls.upper()}
    if cls == "a":
        options["window_s"] = WINDOW_S
    elif cls == "b":
        broken = os.environ.get("S3_BROKEN") == "probe"
        options["lookup"] = _broken_probe if broken else f"{url}/b/lookup/{{key}}"
    return GuardedHTTP(_client(), ctx.ledger).post(
        f"{url}/{cls}/deliver",
        effect=f"deliver.{cls}@1",
        json={"run": ctx.run_id, "label": label},
        headers={"X-Worker": ctx.ledger.owner},
        **options,
    )


gen = Flow("gen", version="1")


@gen.step(start=True)
def work(ctx: StepContext) -> Transition:
    """Perform step ``i`` of the plan; then the next, or the end."""
    plan = ctx.state["plan"]
    i = int(ctx.state.get("i", 0))
    item = plan[i]
    ctx.state["i"] = i + 1
    more = i + 1 < len(plan)
    if item == "nap":
        if more:
            return ctx.sleep(f"nap{i}", 0.05, then="work")
        return ctx.end({"steps": len(plan)})
    for cls, label in item:
        deliver(ctx, str(cls), str(label))
    return ctx.next("work") if more else ctx.end({"steps": len(plan)})


def plan_for(rng: random.Random, n_steps: int, per_step: int, classes: str = "aabbbc") -> list[Any]:
    """A random plan: ``n_steps`` steps of 1..``per_step`` effects (classes drawn from
    ``classes``), with an occasional nap."""
    plan: list[Any] = []
    n = 0
    for _ in range(n_steps):
        if plan and rng.random() < 0.1:
            plan.append("nap")
        step = []
        for _ in range(rng.randint(1, per_step)):
            step.append([rng.choice(classes), f"e{n}"])
            n += 1
        plan.append(step)
    return plan


def labels_of(plan: list[Any]) -> list[str]:
    """Every effect label of a plan."""
    return [str(label) for item in plan if item != "nap" for _, label in item]


FLOWS = [gen, onboarding]
