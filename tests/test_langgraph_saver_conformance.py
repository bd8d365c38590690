"""LangGraph's own conformance suite (``langgraph-checkpoint-conformance``) against
:class:`~adapters.langgraph_saver.OnceOnlySaver`, on SQLite and on PostgreSQL.

Each capability suite gets a fresh saver on the same database, as the suite intends:
58 base tests (put, put_writes, get_tuple, list, delete_thread) and 23 for the optional
capabilities the saver implements (delete_for_runs, copy_thread, prune). Run in every
configuration: on a store the saver opens itself (``exit`` durability) and on a store the
caller passes in, in ``sync`` and in ``async`` durability (a put commits its values and
its record in one transaction whatever the store's mode), each with integrity keys
(every row sealed and checked) and without (``unkeyed=True``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import CapabilityReport

from onceonly.adapters.langgraph_saver import OnceOnlySaver
from onceonly.checkpoint import Store
from tests.ledger_support import keyring

OPTIONAL = ("copy_thread", "delete_for_runs", "prune")


def _run(url: str, *, store_mode: str | None, keyed: bool) -> CapabilityReport:
    name = (
        f"onceonly-{store_mode or 'own'}-{'keyed' if keyed else 'unkeyed'}-{url.split(':', 1)[0]}"
    )
    keys = keyring() if keyed else None

    @checkpointer_test(name=name)
    async def saver() -> AsyncIterator[OnceOnlySaver]:
        if store_mode is None:
            with OnceOnlySaver.from_url(url, keyring=keys, unkeyed=not keyed) as s:
                yield s
            return
        store = Store.open(
            url, durability=store_mode, integrity=None if keys is None else keys.row_keys()
        )
        try:
            yield OnceOnlySaver(store, unkeyed=not keyed)
        finally:
            store.close()

    return asyncio.run(validate(saver))


def _failures(report: CapabilityReport) -> list[str]:
    return [f for r in report.results.values() for f in r.failures]


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
@pytest.mark.parametrize(
    "store_mode", [None, "sync", "async"], ids=["from_url", "shared_sync", "shared_async"]
)
def test_conformance(db_url: str, *, store_mode: str | None, keyed: bool) -> None:
    report = _run(db_url, store_mode=store_mode, keyed=keyed)
    assert report.passed_all_base(), _failures(report)
    base = sum(
        report.results[c].tests_passed
        for c in ("put", "put_writes", "get_tuple", "list", "delete_thread")
    )
    assert base == 58
    for cap in OPTIONAL:
        result = report.results[cap]
        assert result.detected, cap
        assert result.passed is True, result.failures
    assert sum(report.results[c].tests_passed for c in OPTIONAL) == 23
    assert report.passed_all()
