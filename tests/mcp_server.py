"""A fake MCP provider: a real ``MCPServer`` whose tools log every raw delivery.

The log (a JSON-lines file) is the oracle the MCP adapter tests count from, never the
ledger: one ``delivered`` line per ``tools/call`` that reached a tool, one ``applied`` line
per effect that took place, one ``lookup`` line per class B lookup. The provider rebuilds
what it applied from the log when it starts, so a restarted server process still
deduplicates (class A) and answers lookups (class B).

Tools:

* ``pay_a(amount)``: class A, deduplicates by the idempotency key in the request ``_meta``;
* ``book_b(room)`` + ``find_booking(key)``: class B, a booking under the key as reference,
  and the lookup that answers ``{"found": bool, "result": ...}``; ``lookup_down(key)``
  is a lookup whose backend is down (an internal error);
* ``notify_c(text)``: class C, acts on every delivery; its annotations claim it is
  read-only and idempotent (lies an adapter must not trust);
* ``refuse(amount)``: runs and says no (an ``isError`` result);
* ``strict(amount)``: refuses with a JSON-RPC error (invalid params);
* ``search(q)``: read-only, honestly annotated.

Faults are queued per tool; each delivery pops one: ``"hang"`` (apply, then sleep past
the client's timeout), ``"stall"`` (sleep past the timeout without applying), ``"crash"``
(apply, then exit the process: the connection is lost after sending).

Run over stdio: ``python -m tests.mcp_server LOG [TOOL=FAULT ...]``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import INTERNAL_ERROR, INVALID_PARAMS, ToolAnnotations

__all__ = ["KEY_META", "Booking", "Payment", "Provider", "build_server"]

KEY_META = "onceonly/idempotency-key"
FENCING_META = "onceonly/fencing-token"
HANG_S = 30.0


class Payment(TypedDict):
    """A payment receipt (structured content)."""

    payment: int
    amount: int


class Booking(TypedDict):
    """A booking receipt (structured content)."""

    booking: int
    room: str


@dataclass
class Provider:
    """The provider's state; every change is appended to ``log_path`` first.

    Attributes:
        log_path: The JSON-lines log (the oracle).
        faults: Per tool, the faults the next deliveries meet.
    """

    log_path: Path
    faults: dict[str, list[str]] = field(default_factory=dict)
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for line in self.lines():
            if line["event"] == "applied":
                self.applied[f"{line['tool']}:{line['key']}"] = line["result"]

    def lines(self) -> list[dict[str, Any]]:
        """Every logged event, oldest first."""
        if not self.log_path.exists():
            return []
        text = self.log_path.read_text()
        return [json.loads(raw) for raw in text.splitlines() if raw.strip()]

    def deliveries(self, tool: str | None = None) -> list[dict[str, Any]]:
        """Raw ``tools/call`` deliveries (of ``tool``)."""
        return [e for e in self.lines() if e["event"] == "delivered" and tool in (None, e["tool"])]

    def effects(self, tool: str | None = None) -> list[dict[str, Any]]:
        """Effects that took place (of ``tool``)."""
        return [e for e in self.lines() if e["event"] == "applied" and tool in (None, e["tool"])]

    def _log(self, **event: Any) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def deliver(self, tool: str, ctx: Context, args: dict[str, Any]) -> tuple[str | None, str]:
        """Log a delivery; return its key and the fault it meets (``""``: none)."""
        meta: dict[str, Any] = dict(ctx.request_context.meta or {})
        key = meta.get(KEY_META)
        self._log(event="delivered", tool=tool, key=key, fencing=meta.get(FENCING_META), args=args)
        queue = self.faults.get(tool, [])
        return key, queue.pop(0) if queue else ""

    def apply(self, tool: str, key: str | None, result: dict[str, Any]) -> dict[str, Any]:
        """Log an effect taking place."""
        self._log(event="applied", tool=tool, key=key, result=result)
        self.applied[f"{tool}:{key}"] = result
        return result

    async def after_apply(self, fault: str) -> None:
        """Act out a fault that strikes after the effect took place."""
        if fault == "hang":
            await anyio.sleep(HANG_S)
        elif fault == "crash":
            os._exit(3)  # the connection is lost after the request was sent


def build_server(provider: Provider) -> MCPServer:
    """An ``MCPServer`` whose tools act on ``provider``."""
    server = MCPServer("onceonly-fake")

    @server.tool()
    async def pay_a(amount: int, ctx: Context) -> Payment:
        key, fault = provider.deliver("pay_a", ctx, {"amount": amount})
        stored = provider.applied.get(f"pay_a:{key}") if key else None
        if stored is not None:  # class A: the same key is answered from the store
            return Payment(payment=stored["payment"], amount=stored["amount"])
        done = provider.apply(
            "pay_a", key, {"payment": len(provider.effects("pay_a")) + 1, "amount": amount}
        )
        await provider.after_apply(fault)
        return Payment(payment=done["payment"], amount=done["amount"])

    @server.tool()
    async def book_b(room: str, ctx: Context) -> Booking:
        key, fault = provider.deliver("book_b", ctx, {"room": room})
        if fault == "stall":
            await anyio.sleep(HANG_S)
        done = provider.apply(
            "book_b", key, {"booking": len(provider.effects("book_b")) + 1, "room": room}
        )
        await provider.after_apply(fault)
        return Booking(booking=done["booking"], room=done["room"])

    @server.tool()
    def find_booking(key: str) -> dict[str, Any]:
        provider._log(event="lookup", tool="find_booking", key=key)
        found = provider.applied.get(f"book_b:{key}")
        return {"found": False} if found is None else {"found": True, "result": found}

    @server.tool()
    def lookup_down(key: str) -> dict[str, Any]:
        provider._log(event="lookup", tool="lookup_down", key=key)
        raise MCPError(INTERNAL_ERROR, "the booking index is unavailable")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
    async def notify_c(text: str, ctx: Context) -> str:
        key, fault = provider.deliver("notify_c", ctx, {"text": text})
        provider.apply("notify_c", key, {"text": text})
        await provider.after_apply(fault)
        return f"sent: {text}"

    @server.tool()
    def refuse(amount: int, ctx: Context) -> str:
        provider.deliver("refuse", ctx, {"amount": amount})
        raise ToolError(f"insufficient funds for {amount}")

    @server.tool()
    def strict(amount: int, ctx: Context) -> str:
        provider.deliver("strict", ctx, {"amount": amount})
        raise MCPError(INVALID_PARAMS, f"amount {amount} is not allowed")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def search(q: str, ctx: Context) -> list[str]:
        provider.deliver("search", ctx, {"q": q})
        return [f"{q}-1", f"{q}-2"]

    return server


def main(argv: list[str]) -> None:
    """``LOG [TOOL=FAULT ...]``: serve over stdio."""
    faults: dict[str, list[str]] = {}
    for spec in argv[1:]:
        tool, _, fault = spec.partition("=")
        faults.setdefault(tool, []).append(fault)
    build_server(Provider(Path(argv[0]), faults)).run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
