"""The async adapters inside ``async def`` steps (issue [11]): ``AsyncGuardedBooking``
and ``GuardedMCP`` in one async step of a flow, against the booking fake (a real HTTP
server on 127.0.0.1) and a real MCP server. A crash after both acted and before the
step's checkpoint, then a resume by a fresh runtime ("another process"): each effect
reached its provider once, and the resumed step got the recorded answers. The control
makes the same calls without the guards, and the resume repeats them. Both backends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client

from onceonly.adapters import RetryPolicy
from onceonly.adapters.booking import AsyncGuardedBooking
from onceonly.adapters.mcp import GuardedMCP, MCPToolPolicy
from onceonly.checkpoint import RunStatus, Store
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from tests.booking_fake import BookingProvider
from tests.ledger_support import Clock, Ledgers
from tests.mcp_server import Provider, build_server
from tests.test_runtime import Crash, Env

TIMEOUT = httpx.Timeout(5.0)
RETRY = RetryPolicy(max_attempts=3, initial_s=0.0)
POLICIES = {"book_b": MCPToolPolicy("B", lookup="find_booking")}


@pytest.fixture
def env(store: Store, ledgers: Ledgers, clock: Clock) -> Env:
    return Env(store, ledgers, clock)


@pytest.fixture
def hotel() -> Iterator[BookingProvider]:
    provider = BookingProvider(sleep_s=0.0)
    provider.start()
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture
def mcp_provider(tmp_path: Path) -> Provider:
    return Provider(tmp_path / "deliveries.jsonl")


def _ref() -> str:
    return uuid.uuid4().hex


def _trip(hotel: BookingProvider, mcp: Provider, crash: list[bool], *, guarded: bool) -> Flow:
    flow = Flow("trip")
    server = build_server(mcp)

    @flow.step(start=True)
    async def book(ctx: StepContext) -> Transition:
        hold: Mapping[str, Any]
        conf: Mapping[str, Any]
        async with httpx.AsyncClient(base_url=hotel.url, timeout=TIMEOUT) as http:
            if guarded:
                booking = AsyncGuardedBooking(http, ctx.ledger, retry=RETRY)
                hold = await booking.reserve("101", "2026-12-24")
                conf = await booking.confirm(hold["hold_id"])
            else:  # the control: the same requests, unguarded (a fresh reference each)
                body = {"room": "101", "night": "2026-12-24", "client_reference": _ref()}
                raw = (await http.post("/holds", json=body)).json()
                hold = {"hold_id": raw["id"]}
                path = f"/holds/{raw['id']}/confirm"
                made = (await http.post(path, json={"client_reference": _ref()})).json()
                conf = {"confirmation_id": made["id"]}
        async with Client(server) as client:
            if guarded:
                table = await GuardedMCP(client, ctx.ledger, policies=POLICIES).call_tool(
                    "book_b", {"room": "table-4"}
                )
            else:
                table = await client.call_tool("book_b", {"room": "table-4"})
        ctx.state["booked"] = [hold["hold_id"], conf["confirmation_id"], table.structured_content]
        if crash:
            crash.pop()
            raise Crash("killed after booking, before the checkpoint")
        return ctx.next("done")

    @flow.step
    def done(ctx: StepContext) -> Transition:
        return ctx.end(ctx.state["booked"])

    return flow


def _crash_and_resume(
    env: Env, hotel: BookingProvider, mcp: Provider, *, guarded: bool
) -> dict[str, Any]:
    rt = env.runtime(_trip(hotel, mcp, [True], guarded=guarded))
    rid = rt.start("trip", {})
    with pytest.raises(Crash):
        rt.drive(rid)
    again = env.runtime(_trip(hotel, mcp, [], guarded=guarded), fresh=True)
    assert again.drive(rid).status is RunStatus.COMPLETED
    return env.state(rid)


def test_async_booking_and_mcp_in_an_async_step_happen_once_across_a_crash(
    env: Env, hotel: BookingProvider, mcp_provider: Provider
) -> None:
    state = _crash_and_resume(env, hotel, mcp_provider, guarded=True)
    assert len(hotel.holds) == 1
    assert len(hotel.confirmations) == 1
    assert len(mcp_provider.effects("book_b")) == 1
    assert len(mcp_provider.deliveries("book_b")) == 1
    # the resumed step got the recorded answers, not new ones
    assert state["result"] == [
        hotel.holds[0]["id"],
        hotel.confirmations[0]["id"],
        mcp_provider.effects("book_b")[0]["result"],
    ]


def test_control_the_same_calls_unguarded_happen_again_on_resume(
    env: Env, hotel: BookingProvider, mcp_provider: Provider
) -> None:
    _crash_and_resume(env, hotel, mcp_provider, guarded=False)
    assert len(hotel.holds) == 2
    assert len(mcp_provider.deliveries("book_b")) == 2
