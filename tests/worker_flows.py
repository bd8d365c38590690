"""Flows and a counting provider for the worker tests (``tests/test_worker.py``).

Worker processes load the flows with ``onceonly worker --flows tests.worker_flows:FLOWS``.
Every effect is a class B HTTP request (the provider answers lookups by our key) to the
provider whose URL is in the run's state; the request carries the worker's owner name in
an ``X-Worker`` header (not part of the effect's fingerprint), so the provider's raw log
says which worker sent what.

:class:`CountingProvider` is the oracle: a Starlette app under uvicorn on 127.0.0.1 that
applies every write it receives (no deduplication) and logs it raw, and answers
``GET /lookup/{key}`` from what it applied. ``hold[label] = seconds`` makes it apply the
next write of that label and answer only after that long (a worker killed meanwhile has
acted without recording the outcome).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceonly.adapters.http import AsyncGuardedHTTP, GuardedHTTP
from onceonly.context import BranchContext, StepContext
from onceonly.flow import Flow, StepRetry, Transition
from onceonly.testing.servers import AppServer

__all__ = ["FLOWS", "CountingProvider", "Delivery"]

_clients: dict[int, httpx.Client] = {}


def _http(ctx: StepContext) -> GuardedHTTP:
    # One client per process (httpx clients are thread-safe); timeouts short enough that
    # a dead provider fails a test rather than hanging it.
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0))
    return GuardedHTTP(_clients[pid], ctx.ledger)


def _send(ctx: StepContext, label: str) -> dict[str, Any]:
    url = str(ctx.state["url"])
    return _http(ctx).post(
        f"{url}/deliver",
        effect="deliver@1",
        json={"run": ctx.run_id, "label": label},
        headers={"X-Worker": ctx.ledger.owner},
        provider_class="B",
        lookup=f"{url}/lookup/{{key}}",
    )


# -- batch: `effects` deliveries, `per_step` per visit of one looping step -------------
batch = Flow("batch", version="1")


@batch.step(start=True)
def send(ctx: StepContext) -> Transition:
    """Deliver the next ``per_step`` effects; loop until ``effects`` are delivered."""
    done = int(ctx.state.get("sent", 0))
    upto = min(done + int(ctx.state["per_step"]), int(ctx.state["effects"]))
    for i in range(done, upto):
        _send(ctx, f"e{i}")
    ctx.state["sent"] = upto
    return ctx.next("send") if upto < int(ctx.state["effects"]) else ctx.next("finish")


@batch.step
def finish(ctx: StepContext) -> Transition:
    """End with the number of deliveries."""
    return ctx.end({"sent": ctx.state["sent"]})


# -- pause: one effect, a pause inside the step (a kill lands there), one more ---------
pause = Flow("pause", version="1")


@pause.step(start=True)
def first(ctx: StepContext) -> Transition:
    """Deliver ``a``, pause ``pause_s`` seconds (still inside the step), deliver ``b``."""
    _send(ctx, "a")
    time.sleep(float(ctx.state["pause_s"]))
    _send(ctx, "b")
    ctx.state["first_by"] = ctx.ledger.owner
    return ctx.next("second")


@pause.step
def second(ctx: StepContext) -> Transition:
    """Deliver ``c`` and end."""
    _send(ctx, "c")
    return ctx.end({"first_by": ctx.state["first_by"], "second_by": ctx.ledger.owner})


# -- approval: wait (holding no worker) for a person, then act --------------------------
approval = Flow("approval", version="1")


@approval.step(start=True)
def ask(ctx: StepContext) -> Transition:
    """Ask for approval of the payout in the state."""
    return ctx.wait_for_approval("payout", ctx.state["payout"], then="pay", requested_by="alice")


@approval.step
def pay(ctx: StepContext) -> Transition:
    """Deliver the approved payout."""
    ctx.approved("payout", ctx.state["payout"])
    _send(ctx, "paid")
    return ctx.end("paid")


# -- timer: sleep (holding no worker), then act -----------------------------------------
timer = Flow("timer", version="1")


@timer.step(start=True)
def nap(ctx: StepContext) -> Transition:
    """Sleep ``nap_s`` seconds on a timer."""
    return ctx.sleep("nap", float(ctx.state["nap_s"]), then="wake")


@timer.step
def wake(ctx: StepContext) -> Transition:
    """Deliver one effect after the timer fired."""
    _send(ctx, "woke")
    return ctx.end("woke")


# -- flaky: an effect, then a dependency that fails its first calls (durable retries) ---
flaky = Flow("flaky", version="1")


class Unavailable(Exception):
    """The flaky dependency answered 503."""


@flaky.step(start=True, retry=StepRetry(attempts=4, backoff_s=0.5, on=(Unavailable,)))
def book(ctx: StepContext) -> Transition:
    """Deliver ``held`` (once, whatever the attempts), then ask the flaky dependency,
    which fails its first ``fail_first`` calls for this run."""
    ctx.state["receipt"] = _send(ctx, "held")
    got = _clients.get(os.getpid()) or httpx.Client(timeout=5.0)
    answer = got.get(f"{ctx.state['url']}/flaky/{ctx.run_id}/{ctx.state['fail_first']}")
    if answer.status_code == 503:
        raise Unavailable(f"the dependency answered 503 (call {answer.json()['call']})")
    return ctx.next("confirm")


@flaky.step
def confirm(ctx: StepContext) -> Transition:
    """Deliver ``confirmed`` and end."""
    _send(ctx, "confirmed")
    return ctx.end("confirmed")


# -- deadlined: a run that asks, then gives up on its deadline; a step with a timeout ----
deadlined = Flow("deadlined", version="1", on_deadline="chase")


@deadlined.step(start=True)
def request(ctx: StepContext) -> Transition:
    """Deliver ``asked``, then wait for an approval nobody gives."""
    _send(ctx, "asked")
    return ctx.wait_for_approval("go", {"run": ctx.run_id}, then="chase", requested_by="alice")


@deadlined.step
def chase(ctx: StepContext) -> Transition:
    """The deadline's path: deliver ``chased`` and end."""
    _send(ctx, "chased")
    return ctx.end("chased")


dawdler = Flow("dawdler", version="1")


@dawdler.step(start=True, timeout_s=0.5, on_timeout="recover")
def dawdle(ctx: StepContext) -> Transition:
    """Deliver ``started``, take twice the step's time, then try ``finished`` (refused:
    the time is up)."""
    _send(ctx, "started")
    time.sleep(1.0)
    _send(ctx, "finished")
    return ctx.end("finished")


@dawdler.step
def recover(ctx: StepContext) -> Transition:
    """The timeout's path: deliver ``recovered`` and end."""
    _send(ctx, "recovered")
    return ctx.end("recovered")


# -- asynchronous: async steps and asyncio branches, a pause a kill lands in ---------------
asynchronous = Flow("asynchronous", version="1")


async def _asend(ctx: StepContext | BranchContext, label: str, run_id: str, url: str) -> Any:
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=2.0)) as client:
        return await AsyncGuardedHTTP(client, ctx.ledger).post(
            f"{url}/deliver",
            effect="deliver@1",
            json={"run": run_id, "label": label},
            headers={"X-Worker": ctx.ledger.owner},
            provider_class="B",
            lookup=f"{url}/lookup/{{key}}",
        )


@asynchronous.step(start=True)
async def fan_out(ctx: StepContext) -> Transition:
    """Deliver ``x`` and ``y`` from two asyncio branches, pause ``pause_s`` seconds,
    then deliver ``z``."""
    url, rid = str(ctx.state["url"]), ctx.run_id

    def branch(label: str) -> Any:
        async def run(bctx: BranchContext) -> Any:
            return (await _asend(bctx, label, rid, url))["status"]

        return run

    await ctx.aparallel({"x": branch("x"), "y": branch("y")})
    await asyncio.sleep(float(ctx.state["pause_s"]))
    await _asend(ctx, "z", rid, url)
    return ctx.next("wrap_up")


@asynchronous.step
def wrap_up(ctx: StepContext) -> Transition:
    """A sync step after the async one: deliver ``w`` and end."""
    _send(ctx, "w")
    return ctx.end("done")


FLOWS = [batch, pause, approval, timer, flaky, deadlined, dawdler, asynchronous]


# -- the oracle ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Delivery:
    """One write request as it reached the provider."""

    run: str
    label: str
    key: str | None
    worker: str | None
    at: float


class CountingProvider:
    """Applies and logs every write; answers lookups by idempotency key (class B)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[Delivery] = []
        self._by_key: dict[str, Any] = {}
        self.lookups = 0
        self.hold: dict[str, float] = {}
        self.flaky_calls: collections.Counter[str] = collections.Counter()
        self.app = Starlette(
            routes=[
                Route("/lookup/{key}", self._lookup, methods=["GET"]),
                Route("/deliver", self._deliver, methods=["POST"]),
                Route("/flaky/{run}/{fail_first:int}", self._flaky, methods=["GET"]),
            ]
        )
        self._http = AppServer(self.app, name="the counting provider")
        self.url = self._http.url

    @property
    def log(self) -> list[Delivery]:
        """Every write that reached the provider, in arrival order."""
        with self._lock:
            return list(self._log)

    def count(self) -> int:
        """How many writes reached the provider."""
        with self._lock:
            return len(self._log)

    def wait_for(self, n: int, timeout: float) -> list[Delivery]:
        """Wait until at least ``n`` writes arrived; return the log.

        Raises:
            TimeoutError: Fewer arrived within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while self.count() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.count()} of {n} deliveries after {timeout} s")
            time.sleep(0.01)
        return self.log

    def start(self) -> None:
        """Serve in a thread."""
        self._http.start()

    def stop(self) -> None:
        """Stop serving."""
        self._http.stop()

    async def _deliver(self, request: Request) -> Response:
        body = await request.json()
        header = request.headers.get("idempotency-key")
        key = header.strip('"') if header else None
        d = Delivery(
            str(body["run"]), str(body["label"]), key, request.headers.get("x-worker"), time.time()
        )
        with self._lock:
            self._log.append(d)
            response = {"id": len(self._log), "label": d.label}
            if key is not None:
                self._by_key[key] = response
            hold = self.hold.pop(d.label, 0.0)
        if hold:
            await asyncio.sleep(hold)
        return JSONResponse(response, 201)

    async def _flaky(self, request: Request) -> Response:
        run = str(request.path_params["run"])
        with self._lock:
            self.flaky_calls[run] += 1
            call = self.flaky_calls[run]
        status = 503 if call <= int(request.path_params["fail_first"]) else 200
        return JSONResponse({"call": call}, status)

    async def _lookup(self, request: Request) -> Response:
        with self._lock:
            self.lookups += 1
            found = self._by_key.get(request.path_params["key"])
        if found is None:
            return JSONResponse({"error": "unknown"}, 404)
        return JSONResponse(found, 200)
