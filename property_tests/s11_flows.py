"""The flows S11 generates, the recording provider they deliver to, and the plain model of
what a run of them must have delivered.

A :class:`FlowSpec` is a linear chain of steps (each a :class:`StepSpec`):

* ``plain``: positional guarded effects (``send@1``, ordinals 0..n-1);
* ``explicit``: one positional effect and one with an explicit key (``invoice@1``, the key
  names the effect, so it deduplicates across the runs of a tenant, never across tenants);
* ``parallel``: two ``ctx.parallel`` calls in one visit; the second call reuses the first
  call's first branch name (repeated names across calls);
* ``async``: the ``async def`` sibling of ``parallel``: the same two calls as
  ``await ctx.aparallel({...})`` with async branches, then one positional effect of the
  step itself, each sent through the guard on an ``async`` function (the guard's async
  driver: its ledger calls run on the ledger's thread pool);
* ``slow``: a step with a time limit (``timeout_s``, ``on_timeout`` the next step) that
  sends its first effect and then takes longer than its limit on the runtime's clock (the
  model's: the step moves it on, no wall-clock time is involved), so its second effect
  is refused by the run fence every time and the run takes the ``on_timeout`` path;
  that effect is never delivered;
* ``loop``: the step is revisited ``times`` times, with an approval, a signal, a timer or
  nothing between visits;
* ``approval`` / ``signal`` / ``timer``: a wait before the next step (a rejection fails
  the run: nothing after it may be paid out).

Every effect carries a stable label (``what``) that survives a deploy renaming its step or
branch or moving it; the payload of a delivery is its *identity*:
``tenant|lineage|what|visit`` for positional effects (``lineage`` is the run a fork's
effect keys come from) and ``tenant|X|what`` for explicit keys. The provider logs every
raw delivery (payload, the run that sent it, the claim's key id and provider key): that
log, not the ledger, is the oracle.

The module is importable by name: the SIGKILL child (:mod:`property_tests.s11_child`)
builds the same flows from the same JSON spec.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from onceonly.adapters import current_claim, guard
from onceonly.checkpoint.failpoints import failpoint
from onceonly.context import BranchContext, StepContext
from onceonly.flow import Flow, Transition

__all__ = [
    "AFTER_EFFECTS",
    "BRANCHED",
    "TENANTS",
    "FileProvider",
    "FlowSpec",
    "Provider",
    "StepSpec",
    "build_flows",
    "flow_name",
    "predicted",
]

TENANTS = ("acme", "globex")
AFTER_EFFECTS = "s11.step.after_effects"
"""A failpoint of the generated steps: every effect of the visit is done, its checkpoint
is not written yet (a crash here leaves a step whose effects all replay)."""

EFFECT_KINDS = ("plain", "explicit", "parallel", "async", "slow", "loop")
SLOW_LIMIT_S = 1.0
"""A ``slow`` step's ``timeout_s``; it takes twice as long (on the runtime's clock)."""
BRANCHED = ("parallel", "async")
"""The kinds whose step runs branches (two calls, a branch name repeated across them):
``whats[:3]`` are the branches' effects, in the order of ``branches``."""
WAIT_KINDS = ("approval", "signal", "timer")


@dataclass(frozen=True)
class StepSpec:
    """One step of a generated flow (see the module docstring)."""

    name: str
    kind: str
    whats: tuple[str, ...] = ()
    branches: tuple[str, ...] = ("x", "y", "x")
    times: int = 1
    gate: str = ""

    def sent(self) -> tuple[str, ...]:
        """The effects a visit of this step may deliver (a ``slow`` step's last one is
        past its time limit: never)."""
        return self.whats[:-1] if self.kind == "slow" else self.whats

    def wait_name(self) -> str:
        """The wait this step opens (a gate's, or a loop's between visits)."""
        return {"approval": "ok", "signal": "sig", "timer": "t"}.get(
            self.gate or self.kind, "w"
        ) + ("-" + self.name)


@dataclass(frozen=True)
class FlowSpec:
    """A generated flow: its steps in order, and its code version."""

    steps: tuple[StepSpec, ...]
    version: int = 1

    def to_json(self) -> str:
        return json.dumps(
            {"version": self.version, "steps": [s.__dict__ for s in self.steps]}, sort_keys=True
        )

    @staticmethod
    def from_json(text: str) -> FlowSpec:
        data = json.loads(text)
        steps = tuple(
            StepSpec(
                name=s["name"],
                kind=s["kind"],
                whats=tuple(s["whats"]),
                branches=tuple(s["branches"]),
                times=int(s["times"]),
                gate=s["gate"],
            )
            for s in data["steps"]
        )
        return FlowSpec(steps, int(data["version"]))

    def step(self, name: str) -> StepSpec | None:
        return next((s for s in self.steps if s.name == name), None)

    def bumped(self, steps: tuple[StepSpec, ...]) -> FlowSpec:
        return replace(self, steps=steps, version=self.version + 1)


def flow_name(tenant: str) -> str:
    return f"s11-{tenant}"


def positional(tenant: str, lineage: str, what: str, visit: int) -> str:
    return f"{tenant}|{lineage}|{what}|{visit}"


def explicit(tenant: str, what: str) -> str:
    return f"{tenant}|X|{what}"


@dataclass
class Delivery:
    """One raw delivery as the provider saw it."""

    payload: str
    run: str
    key_id: str
    provider_key: str


@dataclass
class Provider:
    """Records every request that reached it (the raw log, the oracle).

    ``fault`` makes the next request fail ambiguously, once: ``lose`` applies it and
    loses the answer (a timeout after the provider acted); ``drop`` loses the request
    before it arrives (not applied, not logged).
    """

    log: list[Delivery] = field(default_factory=list)
    fault: str | None = None
    delay_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def deliver(self, payload: str, run: str) -> dict[str, Any]:
        claim = current_claim()
        with self._lock:
            fault, self.fault = self.fault, None
        if fault == "drop":
            raise TimeoutError("the request never reached the provider")
        self._record(Delivery(payload, run, claim.key_id, claim.provider_key))
        if self.delay_s:
            time.sleep(self.delay_s)
        if fault == "lose":
            raise TimeoutError("read timeout (the provider applied it and the answer was lost)")
        return {"ok": True}

    def _record(self, d: Delivery) -> None:
        with self._lock:
            self.log.append(d)


class FileProvider(Provider):
    """The provider of a child process: one JSON line per delivery, appended with one
    ``write`` (a SIGKILL never leaves half a line) before the answer goes back."""

    def __init__(self, path: str, delay_s: float = 0.0) -> None:
        super().__init__(delay_s=delay_s)
        self.path = path

    def _record(self, d: Delivery) -> None:
        line = json.dumps(d.__dict__, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    @staticmethod
    def read(path: str) -> list[Delivery]:
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as fh:
            return [Delivery(**json.loads(x)) for x in fh.read().splitlines() if x.strip()]


def _send(ctx: StepContext | BranchContext, provider: Provider, payload: str) -> None:
    run = ctx.run_id
    guard(ctx.ledger, effect="send@1")(lambda p: provider.deliver(p, run))(payload)


async def _asend(ctx: StepContext | BranchContext, provider: Provider, payload: str) -> None:
    run = ctx.run_id

    async def deliver(p: str) -> dict[str, Any]:
        await asyncio.sleep(0)  # a real suspension point before the provider is called
        return provider.deliver(p, run)

    await guard(ctx.ledger, effect="send@1")(deliver)(payload)


def _send_explicit(ctx: StepContext, provider: Provider, tenant: str, what: str) -> None:
    # The request is the same for every tenant (an invoice number): only the key, which
    # takes the step's tenant, keeps two tenants' invoices apart.
    run = ctx.run_id
    guard(ctx.ledger, effect="invoice@1", key=lambda w: f"inv-{w}")(
        lambda w: provider.deliver(explicit(tenant, w), run)
    )(what)


Ran = Callable[[str, str], None]
"""A hook the steps call with their kind and run: at the start of a visit (``KIND``), and
once its effects are all done (``KIND:acted``; ``slow:late``: past its time limit)."""
Elapse = Callable[[float], None]
"""Moves the runtime's clock on (a ``slow`` step taking its time)."""


def _step_fn(
    spec: StepSpec,
    nxt: str | None,
    tenant: str,
    provider: Provider,
    ran: Ran | None,
    elapse: Elapse | None = None,
) -> Callable[[StepContext], Transition]:
    def fn(ctx: StepContext) -> Transition:
        if ran is not None:
            ran(spec.kind, ctx.run_id)
        lin = str(ctx.state["lineage"])
        v = ctx.visit
        did: list[str] = []
        if spec.kind in ("plain", "loop"):
            for w in spec.whats:
                did.append(positional(tenant, lin, w, v))
                _send(ctx, provider, did[-1])
        elif spec.kind == "explicit":
            did.append(positional(tenant, lin, spec.whats[0], v))
            _send(ctx, provider, did[-1])
            did.append(explicit(tenant, spec.whats[1]))
            _send_explicit(ctx, provider, tenant, spec.whats[1])
        elif spec.kind == "parallel":

            def branch(what: str) -> Callable[[BranchContext], str]:
                def run(b: BranchContext) -> str:
                    _send(b, provider, positional(tenant, lin, what, v))
                    return what

                return run

            b0, b1, b2 = spec.branches
            w0, w1, w2 = spec.whats
            first = ctx.parallel({b0: branch(w0), b1: branch(w1)})
            second = ctx.parallel({b2: branch(w2)})
            did += [positional(tenant, lin, w, v) for w in (first[b0], first[b1], second[b2])]
        elif spec.kind == "slow":
            assert elapse is not None, "a slow step needs the runtime's clock"
            did.append(positional(tenant, lin, spec.whats[0], v))
            _send(ctx, provider, did[-1])
            elapse(2 * SLOW_LIMIT_S)
            if ran is not None:
                ran("slow:late", ctx.run_id)
            # refused by the run fence (the step's time is up): the step ends here
            _send(ctx, provider, positional(tenant, lin, spec.whats[1], v))
            raise AssertionError("a claim after the step's time was up was granted")
        return _done(ctx, spec, nxt, did, ran)

    fn.__name__ = spec.name
    return fn


def _async_step_fn(
    spec: StepSpec, nxt: str | None, tenant: str, provider: Provider, ran: Ran | None
) -> Callable[[StepContext], Awaitable[Transition]]:
    """The ``async`` kind: ``parallel``'s two calls as ``ctx.aparallel`` with async
    branches, then the step's own positional effects (``whats[3:]``)."""

    async def fn(ctx: StepContext) -> Transition:
        if ran is not None:
            ran(spec.kind, ctx.run_id)
        lin = str(ctx.state["lineage"])
        v = ctx.visit

        def branch(what: str) -> Callable[[BranchContext], Awaitable[str]]:
            async def run(b: BranchContext) -> str:
                await _asend(b, provider, positional(tenant, lin, what, v))
                return what

            return run

        b0, b1, b2 = spec.branches
        w0, w1, w2, *own = spec.whats
        first = await ctx.aparallel({b0: branch(w0), b1: branch(w1)})
        second = await ctx.aparallel({b2: branch(w2)})
        did = [positional(tenant, lin, w, v) for w in (first[b0], first[b1], second[b2])]
        for w in own:
            did.append(positional(tenant, lin, w, v))
            await _asend(ctx, provider, did[-1])
        return _done(ctx, spec, nxt, did, ran)

    fn.__name__ = spec.name
    return fn


def _done(
    ctx: StepContext, spec: StepSpec, nxt: str | None, did: list[str], ran: Ran | None
) -> Transition:
    """The end of a visit (sync or async step): the failpoint after its effects, its
    trail, its transition."""
    v = ctx.visit
    if did:
        failpoint(AFTER_EFFECTS)
        if ran is not None:
            ran(spec.kind + ":acted", ctx.run_id)
    ctx.state["trail"] = [*ctx.state.get("trail", []), *did]
    if spec.kind == "loop" and v + 1 < spec.times:
        return _wait(ctx, spec, spec.gate, spec.name) if spec.gate else ctx.next(spec.name)
    if spec.kind in WAIT_KINDS:
        assert nxt is not None, "a wait step is never last"
        return _wait(ctx, spec, spec.kind, nxt)
    return ctx.next(nxt) if nxt is not None else ctx.end({"trail": len(ctx.state["trail"])})


def _wait(ctx: StepContext, spec: StepSpec, kind: str, then: str) -> Transition:
    name = spec.wait_name()
    if kind == "approval":
        return ctx.wait_for_approval(name, {"go": spec.name}, then=then, requested_by="bot")
    if kind == "signal":
        return ctx.wait_for_signal(name, then=then)
    return ctx.sleep(name, 60.0, then=then)


def build_flows(
    spec: FlowSpec,
    provider: Provider,
    upgrades: dict[str, dict[str, str]] | None = None,
    ran: Ran | None = None,
    elapse: Elapse | None = None,
) -> list[Flow]:
    """One flow per tenant (the same steps; each tenant's effect keys are its own).
    ``upgrades``: per older version, its renamed steps (for ``Operator.upgrade``);
    ``ran``: told of every visit a step begins and of every one whose effects are done;
    ``elapse``: moves the runtime's clock on (needed by ``slow`` steps)."""
    flows = []
    for tenant in TENANTS:
        # Every deploy of the model drives the runs its predecessors started (a run stays
        # on its version: the new code declares that it serves the older ones).
        older = tuple(str(v) for v in range(1, spec.version))
        flow = Flow(
            flow_name(tenant),
            version=str(spec.version),
            tenant=tenant,
            serves=older,
            upgrades=upgrades,
        )
        names = [s.name for s in spec.steps]
        for i, s in enumerate(spec.steps):
            nxt = names[i + 1] if i + 1 < len(names) else None
            if s.kind == "async":
                fn: Callable[[StepContext], Any] = _async_step_fn(s, nxt, tenant, provider, ran)
            else:
                fn = _step_fn(s, nxt, tenant, provider, ran, elapse)
            if s.kind == "slow":
                assert nxt is not None, "a slow step is never last"
                flow.step(name=s.name, start=i == 0, timeout_s=SLOW_LIMIT_S, on_timeout=nxt)(fn)
            else:
                flow.step(name=s.name, start=i == 0)(fn)
        flows.append(flow)
    return flows


def predicted(spec: FlowSpec, tenant: str, lineage: str) -> set[str]:
    """Every identity a run of ``spec`` that completed must have had delivered (by itself,
    its origin, or, for explicit keys, any run of its tenant)."""
    out: set[str] = set()
    for s in spec.steps:
        if s.kind in ("plain", "slow", *BRANCHED):
            out |= {positional(tenant, lineage, w, 0) for w in s.sent()}
        elif s.kind == "loop":
            out |= {positional(tenant, lineage, w, v) for w in s.whats for v in range(s.times)}
        elif s.kind == "explicit":
            out.add(positional(tenant, lineage, s.whats[0], 0))
            out.add(explicit(tenant, s.whats[1]))
    return out
