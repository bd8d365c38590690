"""The guard keeps the wrapped signature for type checkers (mypy --strict checks this file).

``assert_type`` fails the type check if a guarded function's return type was erased to
``Any``; each ``type: ignore[...]`` below must stay *needed* (``warn_unused_ignores`` is
on), so a call with wrong arguments must remain an error: erased parameters fail too. The
runtime assertions check the same wrappers at run time.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, assert_type

import pytest

from onceonly.adapters import guard, step
from onceonly.checkpoint import Store
from onceonly.ledger import Ledger
from tests.ledger_support import Ledgers


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


def _wrap(ledger: Ledger) -> tuple[Callable[[str, int], dict[str, int]], Any]:
    @guard(ledger, effect="charge@1")
    def charge(customer: str, cents: int) -> dict[str, int]:
        return {customer: cents}

    @guard(ledger, effect="acharge@1")
    async def acharge(customer: str, cents: int) -> dict[str, int]:
        return {customer: cents}

    def wrong_calls() -> None:  # type-checked, never called: wrong calls stay errors
        assert_type(charge("acme", 1), dict[str, int])
        started = acharge("acme", 1)
        assert_type(started, Coroutine[Any, Any, dict[str, int]]).close()
        charge("acme", "ten")  # type: ignore[arg-type]
        charge("acme")  # type: ignore[call-arg]
        _: str = charge("acme", 10)  # type: ignore[assignment]
        pending = acharge("acme", cents="ten")  # type: ignore[arg-type]
        pending.close()

    assert callable(wrong_calls)
    return charge, acharge


def test_a_guarded_function_keeps_its_signature_and_result(ledger: Ledger) -> None:
    charge, acharge = _wrap(ledger)
    assert list(inspect.signature(charge).parameters) == ["customer", "cents"]
    assert list(inspect.signature(acharge).parameters) == ["customer", "cents"]
    assert inspect.iscoroutinefunction(acharge)
    with step("run-typing", "charge"):
        assert charge("acme", 10) == {"acme": 10}
        assert asyncio.run(acharge("acme", 20)) == {"acme": 20}
