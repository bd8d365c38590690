"""Which workers run, and which flow versions they serve: the worker registry.

A run stays on the version of its flow that started it, and a worker drives only the
versions its code serves (:attr:`Flow.served`). A run that no running worker serves
waits, perhaps for ever, without an error anywhere: after a deploy that dropped its
version, or before the workers of a new version are up. So every worker announces
itself in ``oo_workers`` (its owner name, host, pid and the versions it serves) when it
starts, refreshes the row while it runs and removes it when it stops;
:func:`unserved` lists the runs that no live worker serves (``onceonly runs list
--unserved``), and ``onceonly workers`` lists the workers.

The registry is what operators read, never what the acting path trusts: claims and
leases do not consult it, so a wrong or stale row can hide or show a run in the list,
never make a run act.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text
from sqlalchemy.schema import CreateTable

from onceonly.checkpoint import (
    ConfigurationError,
    Migration,
    Run,
    RunStatus,
    SchemaVersionError,
    Store,
    ensure_schema,
    migrate_component,
)

__all__ = ["WorkerInfo", "WorkerRegistry", "migrate", "unserved"]

COMPONENT = "runtime"

_metadata = MetaData()
workers = Table(
    "oo_workers",
    _metadata,
    Column("owner", String(200), primary_key=True),
    Column("served", Text, nullable=False),  # JSON: {flow: [versions]}
    Column("host", String(200), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("seen_at", Float, nullable=False),
    Column("beat_s", Float, nullable=False),  # how often it refreshes seen_at
)

RUNTIME_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "worker registry: each running worker, the flow versions it serves and when it "
        "was last seen (what `onceonly runs list --unserved` reads)",
        (CreateTable(workers),),
    ),
)

STALE_BEATS = 3
"""A worker not seen for this many of its refresh intervals counts as gone."""


def migrate(url_or_engine: Any, *, sql: bool = False) -> str:
    """Bring the runtime's schema (the worker registry) to this release's version (or
    return its SQL)."""
    return migrate_component(
        url_or_engine, COMPONENT, RUNTIME_MIGRATIONS, sql=sql, version_table=False
    )


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as it announced itself.

    Attributes:
        owner: Its owner name (the lease holder name of the runs it drives).
        served: The flow versions it serves, by flow name.
        host: Its host name.
        pid: Its process id.
        started_at: When it started (UNIX seconds).
        seen_at: When it last refreshed its row.
        beat_s: How often it refreshes it.
    """

    owner: str
    served: Mapping[str, tuple[str, ...]]
    host: str
    pid: int
    started_at: float
    seen_at: float
    beat_s: float

    def live(self, now: float) -> bool:
        """Seen within :data:`STALE_BEATS` of its refresh intervals."""
        return now - self.seen_at <= STALE_BEATS * self.beat_s

    def serves(self, flow: str, version: str) -> bool:
        return version in self.served.get(flow, ())


class WorkerRegistry:
    """The ``oo_workers`` table of a store (created with the first use).

    Args:
        store: The store.
        clock: Current UNIX time.
        create: Create the table when the database has none.
    """

    def __init__(
        self, store: Store, *, clock: Callable[[], float] = time.time, create: bool = True
    ) -> None:
        self.absent = False  # no worker has announced itself in this database yet
        try:
            # Under the store's retries (and a worker's stop): a worker creates the table
            # inside its claim loop, where a locked or restarting database is ridden out.
            store.retry.call(
                "open the worker registry",
                lambda: ensure_schema(store.engine, COMPONENT, RUNTIME_MIGRATIONS, create=create),
                idempotent=True,  # a second run finds the table and changes nothing
            )
        except SchemaVersionError as exc:
            if create or exc.found != 0:
                raise
            self.absent = True  # a reader that creates nothing: no table, no worker
        self.store = store
        self.clock = clock
        self._q = store.param

    def announce(self, owner: str, served: Mapping[str, Iterable[str]], *, beat_s: float) -> None:
        """Record (or replace) the worker ``owner`` and what it serves."""
        if not owner or beat_s <= 0:
            raise ConfigurationError("a worker announces its owner name and a beat_s > 0")
        doc = json.dumps({k: sorted(set(v)) for k, v in sorted(served.items())})
        now = self.clock()
        q = self._q

        def txn(cur: Any) -> None:
            cur.execute(f"DELETE FROM oo_workers WHERE owner = {q}", (owner,))
            cur.execute(
                "INSERT INTO oo_workers (owner, served, host, pid, started_at, seen_at, "
                f"beat_s) VALUES ({q}, {q}, {q}, {q}, {q}, {q}, {q})",
                (owner, doc, socket.gethostname(), os.getpid(), now, now, float(beat_s)),
            )

        self.store.transact(txn, idempotent=True)

    def beat(self, owner: str) -> bool:
        """Refresh the worker's row; False if it has none (removed: announce again)."""
        q = self._q

        def txn(cur: Any) -> bool:
            cur.execute(
                f"UPDATE oo_workers SET seen_at = {q} WHERE owner = {q}", (self.clock(), owner)
            )
            return bool(cur.rowcount)

        return bool(self.store.transact(txn, idempotent=True))

    def leave(self, owner: str) -> None:
        """Remove the worker's row (it stopped)."""
        q = self._q
        self.store.transact(
            lambda cur: cur.execute(f"DELETE FROM oo_workers WHERE owner = {q}", (owner,)),
            idempotent=True,
        )

    def workers(self) -> list[WorkerInfo]:
        """Every announced worker, live or not, by owner name."""
        if self.absent:
            return []

        def read(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(
                "SELECT owner, served, host, pid, started_at, seen_at, beat_s "
                "FROM oo_workers ORDER BY owner"
            )
            return list(cur.fetchall())

        out = []
        for owner, served, host, pid, started, seen, beat in self.store.read(read):
            try:
                doc = json.loads(served)
                versions = {str(k): tuple(map(str, v)) for k, v in doc.items()}
            except (ValueError, AttributeError, TypeError):
                versions = {}  # an unreadable row serves nothing
            out.append(
                WorkerInfo(
                    str(owner),
                    versions,
                    str(host),
                    int(pid),
                    float(started),
                    float(seen),
                    float(beat),
                )
            )
        return out

    def live(self) -> list[WorkerInfo]:
        """The workers seen lately (see :meth:`WorkerInfo.live`)."""
        now = self.clock()
        return [w for w in self.workers() if w.live(now)]


def unserved(store: Store, registry: WorkerRegistry) -> list[Run]:
    """The runs that are running or waiting on a flow version no live worker serves,
    oldest update first (a failed run waits for an operator, not a worker, and is left
    out). Each status is read through its index: ended runs cost nothing."""
    live = registry.live()
    out = [
        r
        for status in (RunStatus.RUNNING, RunStatus.WAITING)
        for r in store.list_runs(status=status)
        if not any(w.serves(r.flow, r.code_version) for w in live)
    ]
    return sorted(out, key=lambda r: (r.updated_at, r.run_id))
