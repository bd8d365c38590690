"""S9 helper: a disk I/O error injected at the n-th COMMIT of a store, the way a failing
disk or file system reports it to the driver.

The store's DBAPI connections are wrapped (its connection check-out is replaced on the
instance): SQLite commits with ``COMMIT`` on a cursor, PostgreSQL with
``connection.commit()``; both are intercepted. Modes:

* ``once``: the n-th commit fails (the transaction is rolled back), later ones succeed;
* ``forever``: the n-th and every later commit fails;
* ``after``: the n-th commit is durable, then the driver reports an I/O error anyway
  (an fsync error after the write: the caller cannot know it committed).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

from onceonly.checkpoint import Store

__all__ = ["CommitFaults"]


def _io_error(dialect: str) -> BaseException:
    if dialect == "sqlite":
        return sqlite3.OperationalError("disk I/O error (injected at commit)")
    import psycopg

    return psycopg.OperationalError("could not fsync file: Input/output error (injected)")


class CommitFaults:
    """Counts a store's write commits and fails the ``at``-th per ``mode``.

    Args:
        store: The store whose connections are wrapped (from now on).
        at: Which commit fails (1-based); 0 never.
        mode: ``once``, ``forever`` or ``after``.
    """

    def __init__(self, store: Store, *, at: int = 0, mode: str = "once") -> None:
        self.store = store
        self.at = at
        self.mode = mode
        self.commits = 0
        self.failed = 0
        self.enabled = True
        original = store._checkout
        faults = self

        def checkout() -> tuple[Any, bool]:
            conn, pinned = original()
            return _Conn(conn, faults), pinned

        store._checkout = checkout  # type: ignore[method-assign]

    def commit(self, do: Callable[[], object]) -> None:
        self.commits += 1
        n = self.commits
        hit = (
            self.enabled
            and self.at > 0
            and (n == self.at if self.mode in ("once", "after") else n >= self.at)
        )
        if not hit:
            do()
            return
        self.failed += 1
        if self.mode == "after":
            do()
        raise _io_error(self.store.dialect)


class _Cursor:
    def __init__(self, cur: Any, faults: CommitFaults) -> None:
        self._cur = cur
        self._faults = faults

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            self._faults.commit(lambda: self._cur.execute(sql))
            return self
        return self._cur.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Conn:
    def __init__(self, conn: Any, faults: CommitFaults) -> None:
        self._conn = conn
        self._faults = faults

    def cursor(self) -> _Cursor:
        return _Cursor(self._conn.cursor(), self._faults)

    def commit(self) -> None:
        self._faults.commit(self._conn.commit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)
