"""A user's own service for the ASGI middleware tests: a Starlette app whose POST and PATCH
endpoints place an order with an external provider (the counting fake, whose raw log is
the oracle) and answer 201 with the order.

Run as a program (``python -m tests.asgi_service DB_URL PORT PROVIDER_URL [--hang]
[--unguarded]``) it serves on 127.0.0.1:PORT under uvicorn, so a test can SIGKILL it in the
middle of a request; ``--hang`` makes every order wait forever after the provider applied
it (the test kills the server there).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceonly.adapters import current_claim
from onceonly.adapters.asgi import IdempotencyMiddleware
from onceonly.checkpoint import Store
from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import InFlightPolicy, Ledger
from tests.ledger_support import keyring

__all__ = ["build_app", "open_ledger"]

OWNER = "asgi-service-1"  # a stable worker name: a restart finds its open claims in doubt


def open_ledger(db_url: str) -> Ledger:
    """The service's ledger: its stable owner name, requests in flight answered 409 at once."""
    return Ledger(Store.open(db_url), keyring(), owner=OWNER, in_flight=InFlightPolicy(wait_s=0))


def build_app(
    provider_url: str,
    *,
    hang: bool = False,
    gate: threading.Event | None = None,
) -> Starlette:
    """The user's application, unguarded (wrap it in the middleware to guard it).

    Args:
        provider_url: The counting fake the orders are placed with.
        hang: Wait forever after the provider applied each order.
        gate: Orders whose body says ``"wait": true`` wait for it after the provider
            applied them (a request held in flight).
    """
    numbers = itertools.count(1)

    async def place(request: Request) -> Response:
        order = await request.json()
        if "item" not in order:  # validated before anything is done
            return JSONResponse({"error": "item is required"}, status_code=400)
        try:
            key = current_claim().provider_key
        except ConfigurationError:  # unguarded: no claim, no key to pass on
            key = None
        headers = {"Idempotency-Key": f'"{key}"'} if key else {}
        async with httpx.AsyncClient(timeout=30) as client:
            sent = await client.post(f"{provider_url}/orders", json=order, headers=headers)
            sent.raise_for_status()
        if hang:
            await asyncio.Event().wait()  # the test SIGKILLs the server here
        if gate is not None and order.get("wait"):
            await asyncio.to_thread(gate.wait, 60)
        if order.get("boom"):
            raise RuntimeError("the handler crashed after the provider applied the order")
        number = next(numbers)
        return JSONResponse(
            {"order": number, "item": order["item"]},
            status_code=201,
            headers={"Location": f"/orders/{number}", "X-Order": str(number)},
        )

    async def read(request: Request) -> Response:
        return JSONResponse({"orders": "listed"})

    return Starlette(
        routes=[
            Route("/orders", place, methods=["POST", "PATCH"]),
            Route("/orders", read, methods=["GET"]),
            Route("/other-orders", place, methods=["POST"]),
        ]
    )


def client_of(scope: Any) -> str:
    """The caller's identity: the ``X-Client`` header (a real service takes it from its
    authentication)."""
    for name, value in scope["headers"]:
        if name == b"x-client":
            return str(value.decode("latin-1"))
    return "anonymous"


def main() -> None:
    """Serve the app on 127.0.0.1 until killed."""
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("db_url")
    parser.add_argument("port", type=int)
    parser.add_argument("provider_url")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--unguarded", action="store_true")
    args = parser.parse_args()
    app: Any = build_app(args.provider_url, hang=args.hang)
    if not args.unguarded:
        app = IdempotencyMiddleware(app, open_ledger(args.db_url), client=client_of)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="critical", lifespan="off")


if __name__ == "__main__":
    main()
