"""Helpers shared by the reliability suites S1, S8 and S9: emptying a test database
between hypothesis examples (a fresh database per example would cost more than the
example), and a counting provider whose raw log is the oracle."""

from __future__ import annotations

import sqlite3
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import create_engine, make_url, text

__all__ = ["CountingProvider", "wipe"]


def wipe(db_url: str) -> None:
    """Delete every row of every onceonly table (the schema and its version stay)."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        conn = sqlite3.connect(str(url.database), isolation_level=None, timeout=30)
        try:
            names = [
                str(r[0])
                for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'oo_%'"
                )
            ]
            conn.execute("PRAGMA foreign_keys = OFF")
            conn.execute("BEGIN IMMEDIATE")
            for name in names:
                conn.execute(f'DELETE FROM "{name}"')
            conn.execute("COMMIT")
        finally:
            conn.close()
        return
    engine = create_engine(db_url)
    try:
        with engine.begin() as pg:
            names = [
                str(r[0])
                for r in pg.execute(
                    text(
                        "SELECT table_name FROM information_schema.tables WHERE "
                        "table_schema = current_schema() AND table_name LIKE 'oo_%'"
                    )
                )
            ]
            if names:
                pg.execute(text("TRUNCATE " + ", ".join(f'"{n}"' for n in names)))
    finally:
        engine.dispose()


@dataclass
class CountingProvider:
    """A provider that records every request that reached it (the raw log), whether it
    applied it or not, and can be asked whether a reference was applied (class B).

    Attributes:
        raw: Every request, as ``(provider key, payload)``, in arrival order.
        applied: How many times each provider key was applied.
    """

    raw: list[tuple[str, object]] = field(default_factory=list)
    applied: Counter[str] = field(default_factory=Counter)

    def send(self, provider_key: str, payload: object, *, apply: bool = True) -> str:
        self.raw.append((provider_key, payload))
        if apply:
            self.applied[provider_key] += 1
        return f"ok:{provider_key[-6:]}:{self.applied[provider_key]}"

    def void(self, provider_key: str) -> None:
        """The last request under this key was refused or never left (not applied)."""
        if self.applied[provider_key] > 0:
            self.applied[provider_key] -= 1

    def happened(self, provider_key: str) -> bool:
        return self.applied[provider_key] > 0

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.applied.values() if n > 1)
