"""A Temporal worker process for tests/test_temporal_adapter.py.

``python -m tests.temporal_worker ADDRESS QUEUE DB_URL PROVIDER_URL MODE HANG_FILE OWNER STANDBY``

Its one activity, ``place_order``, POSTs an order to the fake provider: guarded as class A
(``guarded-a``: the provider deduplicates our key), class C (``guarded-c``) or not at all
(``bare``: the positive control). While ``HANG_FILE`` exists, the activity hangs after the
provider answered, heartbeating, so the test can SIGKILL this process between the
provider's apply and the activity's completion; a worker started with ``standby`` starts
polling only once ``HANG_FILE`` is gone (it is the one that takes over after the kill).
Keys come from ``$ONCEONLY_SECRETS``.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from onceonly.adapters.http import AsyncGuardedHTTP
from onceonly.adapters.temporal import guarded_activity
from onceonly.checkpoint import Store
from onceonly.ledger import Keyring, Ledger

__all__ = ["PlaceOrder", "main"]


@workflow.defn
class PlaceOrder:
    """One activity: place the order; its result is the workflow's."""

    @workflow.run
    async def run(self, order: str, timeout_s: float = 60.0) -> Any:
        """Place ``order``; Temporal retries the activity up to 20 times."""
        return await workflow.execute_activity(
            "place_order",
            order,
            start_to_close_timeout=timedelta(seconds=timeout_s),
            heartbeat_timeout=timedelta(seconds=2),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(milliseconds=200),
                backoff_coefficient=1.0,
                maximum_attempts=20,
            ),
        )


def _activity(mode: str, provider: str, hang: Path, ledger: Ledger) -> Any:
    client = httpx.AsyncClient(base_url=provider, timeout=60.0)
    guarded = AsyncGuardedHTTP(client, ledger)

    async def hang_while_asked() -> None:
        if hang.exists():  # the provider answered (and the guard recorded it)
            hang.with_suffix(".hanging").touch()
        while hang.exists():  # the test SIGKILLs us here
            activity.heartbeat()
            await asyncio.sleep(0.2)

    if mode == "bare":

        @activity.defn(name="place_order")
        async def bare(order: str) -> Any:
            resp = await client.post("/orders", json={"order": order})
            await hang_while_asked()
            return resp.json()

        return bare

    pclass = "A" if mode == "guarded-a" else "C"

    @activity.defn(name="place_order")
    @guarded_activity(ledger)
    async def place_order(order: str) -> Any:
        answer = await guarded.post(
            "/orders",
            effect="place_order@1",
            json={"order": order},
            provider_class=pclass,
            window_s=3600.0 if pclass == "A" else None,
        )
        await hang_while_asked()
        return answer["json"]

    return place_order


async def main(argv: list[str]) -> None:
    """Run the worker until killed."""
    address, queue, db_url, provider, mode, hang, owner, standby = argv
    ledger = Ledger(Store.open(db_url), Keyring.from_env(), owner=owner, lease_s=3.0)
    client = await Client.connect(address)
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[PlaceOrder],
        activities=[_activity(mode, provider, Path(hang), ledger)],
        workflow_runner=UnsandboxedWorkflowRunner(),
        # No sticky queue: a killed worker's workflow tasks go to the others at once.
        max_cached_workflows=0,
    )
    while standby == "standby" and Path(hang).exists():  # ready, and waiting for the kill
        await asyncio.sleep(0.05)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
