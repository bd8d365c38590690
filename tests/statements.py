"""Watch the statements a store's hot paths run (the raw DBAPI transactions).

One wrapper for the tests that need to see them: the query-plan check
(``test_query_plans``) and the flat-cost check (``test_flat_cost``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from onceonly.checkpoint._connections import _RawTxn

__all__ = ["Statement", "watch_statements"]

Statement = tuple[str, Any]
"""A statement as run: its SQL (the driver's parameter markers) and its parameters."""


class _Watched:
    """A DBAPI cursor that reports each statement before running it."""

    def __init__(self, cur: Any, seen: Callable[[str, Any], None]) -> None:
        self._cur = cur
        self._seen = seen

    def execute(self, sql: str, params: Any = None) -> Any:
        self._seen(sql, params)
        if params is None:
            return self._cur.execute(sql)
        return self._cur.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


def watch_statements(
    monkeypatch: pytest.MonkeyPatch,
    seen: Callable[[str, Any], None],
    *,
    entered: Callable[[_RawTxn], None] | None = None,
) -> None:
    """From now on (until the test ends), every statement of a raw store transaction is
    passed to ``seen(sql, params)`` before it runs; ``entered(txn)`` is called as each
    transaction begins (its connection is ``txn._conn``)."""
    enter = _RawTxn.__enter__

    def watched(txn: _RawTxn) -> Any:
        cur = enter(txn)
        if entered is not None:
            entered(txn)
        return _Watched(cur, seen)

    monkeypatch.setattr(_RawTxn, "__enter__", watched)
