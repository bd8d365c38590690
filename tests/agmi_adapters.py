"""Adapters that let the third-party tamper kit agent-memory-integrity 0.6.3 (``agmi``) edit
four onceonly stores behind the library's back, on SQLite and on PostgreSQL.

``agmi-check --adapter tests.agmi_adapters:EffectsSqlite --json out.json`` seeds a fresh
store through the public API, makes its nine edits (T1-T9) with raw SQL, and asks
``verify()`` whether the library still trusts what it reads. Every ``verify()`` here is
the path that *acts* (or, for the audit store, the audit): a fresh process's view (new
Store and Ledger, no caches), with the keyring, doing what a worker would do.

* :class:`EffectsSqlite` / :class:`EffectsPostgres` -- rows of ``oo_effects``. verify():
  a fresh ledger performs every seeded effect again through ``Ledger.perform`` (a
  recorded effect replays; an in-process recording provider counts sends), and replays
  any other row of the run (``Ledger.replay``, what a replayed step is handed). A typed
  refusal (``CorruptRecord``, ``StoreRolledBack``) is a rejection; a second call to the
  provider means the edit was accepted. A witness file (``witness=``, as
  ``ONCEONLY_WITNESS``) is configured: rollback of a whole store is detected only with
  one (docs/explanation-guarantees.md), and it lives outside the store, so T9 cannot
  restore it.
* :class:`CheckpointsSqlite` / :class:`CheckpointsPostgres` -- rows of ``oo_checkpoints``
  of one run. verify(): a fresh keyed Store loads the run (``load_run``) and every
  checkpoint its history lists (``load(run, seq)``, what a fork or resume-from does).
  The store keeps a witness (``Store.open(..., witness=)``, as a Ledger does with
  ``ONCEONLY_WITNESS``): run-row revisions, so a restored store is refused (T9).
* :class:`AuditSqlite` / :class:`AuditPostgres` -- events of ``oo_audit`` of one chain.
  ``detection_point = "audit"``: verify() is ``Ledger.verify(witness=...)``.
* :class:`WaitsSqlite` / :class:`WaitsPostgres` -- rows of ``oo_waits`` (approval
  requests of waiting runs). verify(): what a worker does when it resumes a waiting run
  (``Waits.fire_if_due`` of the wait its checkpoint names) and what the approver's inbox
  reads (``Waits.find``).

The second context (T6) is a second run. PostgreSQL comes from ``ONCEONLY_TEST_PG_URL``;
each ``setup()`` creates a fresh database and ``teardown()`` drops it. T9 copies every
table's rows to memory and puts them back (the same on both backends: a dump and
restore of the database).

:class:`EffectsSqliteUnchecked` and :class:`CheckpointsSqliteUnkeyed` are the positive
controls: a ledger whose read check is switched off (``_check_row`` a no-op) and without a
witness, and a checkpoint store opened without keys, must be caught accepting edits, or
the harness could not fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from typing import Any, ClassVar, cast

from agmi.adapters.base import MemoryAdapter, Record
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from onceonly.checkpoint import OnceOnlyError, RunStatus, Store, Waits
from onceonly.checkpoint import _delta as delta
from onceonly.context import StepContext
from onceonly.flow import Flow, Transition
from onceonly.ledger import EffectIdentity, InFlightPolicy, Ledger
from onceonly.runtime import Runtime
from tests.ledger_support import keyring

__all__ = [
    "AuditPostgres",
    "AuditSqlite",
    "CheckpointsPostgres",
    "CheckpointsSqlite",
    "CheckpointsSqliteUnkeyed",
    "EffectsPostgres",
    "EffectsSqlite",
    "EffectsSqliteUnchecked",
    "WaitsPostgres",
    "WaitsSqlite",
]

_TAMPER_MARK = "agmi_meta_tampered"


def _plain(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value


class _Database:
    """A fresh database on one backend, and raw SQL on it (no library code)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.dir = tempfile.mkdtemp(prefix="agmi-oo-")
        self._drop: str | None = None
        if backend == "sqlite":
            self.url = f"sqlite:///{os.path.join(self.dir, 'onceonly.db')}"
        else:
            server = os.environ.get("ONCEONLY_TEST_PG_URL")
            if not server:
                raise RuntimeError("the PostgreSQL adapters need ONCEONLY_TEST_PG_URL")
            name = "agmi_" + uuid.uuid4().hex[:16]
            admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
                # Integrity, not crash durability, is measured here: commits need not
                # wait for the disk of a shared CI server.
                conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
            admin.dispose()
            base, _, query = server.partition("?")
            self.url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
            self._server = server
            self._drop = name
        self.engine: Engine = create_engine(self.url, pool_size=1, max_overflow=1)

    def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            got = conn.execute(text(sql), params).mappings().all()
            conn.rollback()
        return [{k: _plain(v) for k, v in r.items()} for r in got]

    def execute(self, sql: str, **params: Any) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(text(sql), params).rowcount or 0)

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        """Every row of every table (a backup)."""
        tables = sorted(inspect(self.engine).get_table_names())
        return {t: self.rows(f'SELECT * FROM "{t}"') for t in tables}

    def restore(self, dump: dict[str, list[dict[str, Any]]]) -> None:
        """Put a backup back in place of every table's rows."""
        with self.engine.begin() as conn:
            for table, rows in dump.items():
                conn.execute(text(f'DELETE FROM "{table}"'))
                for row in rows:
                    cols = ", ".join(f'"{c}"' for c in row)
                    marks = ", ".join(f":{c}" for c in row)
                    conn.execute(text(f'INSERT INTO "{table}" ({cols}) VALUES ({marks})'), row)

    def close(self) -> None:
        self.engine.dispose()
        if self._drop is not None:
            admin = create_engine(self._server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self._drop}" WITH (FORCE)'))
            admin.dispose()
        shutil.rmtree(self.dir, ignore_errors=True)


class _RowStore(MemoryAdapter):
    """Rows of one table, one context of them (a run or a chain), addressed by slot.

    A record's slot is its identity columns (kept in seed order by the adapter, so a
    content swap cannot reorder the view); its content is every other column but the
    owner and metadata columns.
    """

    backend: ClassVar[str] = "sqlite"
    table: ClassVar[str]
    identity_cols: ClassVar[tuple[str, ...]]
    owner_col: ClassVar[str]
    meta_cols: ClassVar[tuple[str, ...]]
    supports_replay = True
    supports_metadata = True
    supports_snapshot = True
    verify_detail: str | None = None

    def __init__(self) -> None:
        self.db: _Database | None = None
        self.slots: list[tuple[Any, ...]] = []
        self.other_slots: list[tuple[Any, ...]] = []
        self.verify_detail = None

    # -- what subclasses provide ------------------------------------------------------
    def _open(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _seed(self, context: str, n: int) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------
    def setup(self) -> None:
        self.db = _Database(self.backend)
        self.slots, self.other_slots = [], []
        self.verify_detail = None
        self._open()

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self._close()
        if self.db is not None:
            self.db.close()
            self.db = None

    def seed(self, n: int) -> None:
        self.slots = self._seed("a", n)

    def reload(self) -> None:
        self._close()
        self._open()

    def seed_other(self, n: int) -> None:
        self.other_slots = self._seed("b", n)

    # -- raw rows -------------------------------------------------------------------
    @property
    def _db(self) -> _Database:
        assert self.db is not None
        return self.db

    def _where(self, slot: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
        cond = " AND ".join(f"{c} = :w_{c}" for c in self.identity_cols)
        return cond, {f"w_{c}": v for c, v in zip(self.identity_cols, slot, strict=True)}

    def _row(self, slot: tuple[Any, ...]) -> dict[str, Any] | None:
        cond, params = self._where(slot)
        got = self._db.rows(f"SELECT * FROM {self.table} WHERE {cond}", **params)
        return got[0] if got else None

    def _extra_filter(self) -> tuple[str, dict[str, Any]]:
        """Rows of the first context beyond the seeded slots (forged ones)."""
        raise NotImplementedError

    def _records(self, slots: list[tuple[Any, ...]], extras: bool) -> list[Record]:
        found = self._db.rows(f"SELECT * FROM {self.table}")  # a few dozen rows
        by_slot = {tuple(r[c] for c in self.identity_cols): r for r in found}
        rows = [by_slot[s] for s in slots if s in by_slot]
        if extras:
            known = set(slots)
            cond, params = self._extra_filter()
            more = self._db.rows(f"SELECT * FROM {self.table} WHERE {cond}", **params)
            rows += sorted(
                (r for r in more if tuple(r[c] for c in self.identity_cols) not in known),
                key=lambda r: repr(tuple(r[c] for c in self.identity_cols)),
            )
        return [Record(seq=i, fields=r) for i, r in enumerate(rows)]

    def read_all_raw(self) -> list[Record]:
        return self._records(self.slots, extras=True)

    def read_other_raw(self) -> list[Record]:
        return self._records(self.other_slots, extras=False)

    def _update(self, slot: tuple[Any, ...], values: dict[str, Any]) -> None:
        cond, params = self._where(slot)
        sets = ", ".join(f'"{c}" = :v_{c}' for c in values)
        params.update({f"v_{c}": v for c, v in values.items()})
        assert self._db.execute(f"UPDATE {self.table} SET {sets} WHERE {cond}", **params) == 1

    def write_raw(self, record: Record) -> None:
        fields = dict(record.fields)
        if record.seq < len(self.slots):
            slot = self.slots[record.seq]
            self._update(slot, {k: v for k, v in fields.items() if k not in self.identity_cols})
            return
        cols = ", ".join(f'"{c}"' for c in fields)
        marks = ", ".join(f":{c}" for c in fields)
        self._db.execute(f"INSERT INTO {self.table} ({cols}) VALUES ({marks})", **fields)

    def delete_raw(self, seq: int) -> None:
        slot = self.slots.pop(seq)
        cond, params = self._where(slot)
        assert self._db.execute(f"DELETE FROM {self.table} WHERE {cond}", **params) == 1

    def replay_onto(self, victim_seq: int, donor: Record) -> None:
        keep = {*self.identity_cols, self.owner_col, *self.meta_cols}
        self._update(
            self.slots[victim_seq], {k: v for k, v in donor.fields.items() if k not in keep}
        )

    def read_meta(self, seq: int) -> dict[str, Any]:
        row = self._row(self.slots[seq])
        assert row is not None
        return {c: row[c] for c in self.meta_cols}

    def write_meta(self, seq: int, meta: dict[str, Any]) -> None:
        values = {c: meta[c] for c in self.meta_cols}
        if meta.get(_TAMPER_MARK):
            # The kit marks the edit with a key no table has: make it a real one.
            values = {c: self._edited(c, v) for c, v in values.items()}
        self._update(self.slots[seq], values)

    @staticmethod
    def _edited(col: str, value: Any) -> Any:
        if isinstance(value, float):
            return value - 3600.0  # an hour earlier
        if isinstance(value, int):
            return value + 1
        return "mallory" if value is None else f"{value}-mallory"

    def snapshot_store(self) -> object:
        return (self._db.dump(), list(self.slots), self._known())

    def restore_store(self, token: object) -> None:
        dump, slots, known = cast(
            "tuple[dict[str, list[dict[str, Any]]], list[Any], object]", token
        )
        self._close()
        self._db.restore(dump)
        self.slots = list(slots)
        self._restore_known(known)
        self._open()

    def _known(self) -> object:
        """What a worker knows from the store itself (rolled back with it)."""
        return None

    def _restore_known(self, known: object) -> None:
        return None

    # -- what the guard compares ----------------------------------------------------
    def identity_of(self, record: Record) -> str:
        return repr(tuple(record.fields.get(c) for c in self.identity_cols))

    def owner_of(self, record: Record) -> str | None:
        value = record.fields.get(self.owner_col)
        return None if value is None else str(value)

    def payload_of(self, record: Record) -> str:
        import json

        skip = {*self.identity_cols, self.owner_col, *self.meta_cols}
        body = {k: v for k, v in record.fields.items() if k not in skip}
        return json.dumps(body, sort_keys=True, default=repr)

    def _refused(self, exc: BaseException) -> bool:
        self.verify_detail = f"{type(exc).__name__}: {exc}"[:300]
        return False


# -- effects ---------------------------------------------------------------------------


class _Provider:
    """In-process recording provider: nothing is ever sent anywhere."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, str]] = []


class EffectsSqlite(_RowStore):
    """Rows of ``oo_effects``; verify() performs the run's effects again."""

    name = "onceonly effects (sqlite)"
    table = "oo_effects"
    identity_cols: ClassVar[tuple[str, ...]] = ("key_id",)
    owner_col = "run_id"
    meta_cols: ClassVar[tuple[str, ...]] = ("tenant", "step_id", "first_sent_at")
    with_witness: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.provider = _Provider()
        self.calls: list[tuple[EffectIdentity, dict[str, Any]]] = []
        self.versions: dict[str, dict[str, Any]] = {}
        self.ledger: Ledger | None = None
        self._n = 0

    def _ledger_class(self) -> type[Ledger]:
        return Ledger

    def _open(self) -> None:
        store = Store.open(self._db.url)
        witness = os.path.join(self._db.dir, "witness") if self.with_witness else ""
        self.ledger = self._ledger_class()(
            store,
            keyring(),
            owner=f"w-{uuid.uuid4().hex[:6]}",
            in_flight=InFlightPolicy(wait_s=0),
            witness=witness,
        )

    def _close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
            self.ledger.store.close()
            self.ledger = None

    def _act(self, args: dict[str, Any]) -> Any:
        def act(claim: Any) -> dict[str, Any]:
            # The row as claimed (durable before acting): an older genuine version.
            row = self._db.rows("SELECT * FROM oo_effects WHERE key_id = :k", k=claim.key_id)
            self.versions.setdefault(claim.key_id, row[0])
            self.provider.sent.append((args, claim.provider_key))
            return {"sent": args["n"]}

        return act

    def _perform(self, context: str) -> tuple[Any, ...]:
        assert self.ledger is not None
        n = self._n
        self._n += 1
        ident = EffectIdentity("acme", f"run-{context}", "notify", 0, f"send{n}@1", 0)
        args = {"n": n, "to": f"{context}{n}@example.com"}
        self.ledger.perform(ident, args, self._act(args))
        if context == "a":
            self.calls.append((ident, args))
        return (self.ledger.key_id(ident),)

    def _seed(self, context: str, n: int) -> list[tuple[Any, ...]]:
        if context == "a":
            self.calls = []
            self.provider.sent = []
        return [self._perform(context) for _ in range(n)]

    def append_genuine(self) -> None:
        self.slots.append(self._perform("a"))

    def _extra_filter(self) -> tuple[str, dict[str, Any]]:
        return "run_id = :r", {"r": "run-a"}

    def mutate_payload(self, record: Record) -> Record:
        # The edit that matters: "it did not happen", so a claim would send it again.
        record.fields["status"] = "not_happened"
        return record

    def forge_record(self, template: Record) -> Record:
        fields = dict(template.fields)
        fields["key_id"] = "k" + uuid.uuid4().hex
        fields["result_ct"] = bytes(len(template.fields["result_ct"] or b"x"))
        return Record(seq=template.seq + 1, fields=fields)

    def verify(self) -> bool:
        self.verify_detail = None
        assert self.ledger is not None
        led = self.ledger
        before = len(self.provider.sent)
        try:
            for ident, args in self.calls:
                led.perform(ident, args, self._act(args))
            known = {led.key_id(i) for i, _ in self.calls}
            for row in self._db.rows("SELECT key_id FROM oo_effects WHERE run_id = 'run-a'"):
                if row["key_id"] not in known:
                    led.replay(row["key_id"])
        except OnceOnlyError as exc:
            return self._refused(exc)
        sent = len(self.provider.sent) - before
        if sent:
            self.verify_detail = f"the provider was called {sent} more time(s)"
        return True


class EffectsPostgres(EffectsSqlite):
    """:class:`EffectsSqlite` on PostgreSQL."""

    name = "onceonly effects (postgresql)"
    backend = "postgresql"


class _UncheckedLedger(Ledger):
    """A ledger whose read check is switched off: the planted bug of the positive control."""

    def _check_row(self, cur: Any, row: Any, last: Any = (), *, mine: Any = None) -> None:
        return None


class EffectsSqliteUnchecked(EffectsSqlite):
    """Positive control: no read check, no witness. Must score ACCEPTED somewhere."""

    name = "onceonly effects, read check off (sqlite)"
    with_witness = False

    def _ledger_class(self) -> type[Ledger]:
        return _UncheckedLedger


# -- audit -----------------------------------------------------------------------------


class AuditSqlite(EffectsSqlite):
    """Events of ``oo_audit`` of one chain; verify() is ``Ledger.verify``."""

    name = "onceonly audit (sqlite)"
    table = "oo_audit"
    identity_cols = ("chain", "seq")
    owner_col = "chain"
    meta_cols = ("actor", "at")
    detection_point = "audit"

    def _seed(self, context: str, n: int) -> list[tuple[Any, ...]]:
        # n events: every perform appends two (claimed, committed).
        super()._seed(context, (n + 1) // 2)
        return self._chain(f"run-{context}")

    def _chain(self, chain: str) -> list[tuple[Any, ...]]:
        sql = "SELECT chain, seq FROM oo_audit WHERE chain = :c ORDER BY seq"
        return [(r["chain"], int(r["seq"])) for r in self._db.rows(sql, c=chain)]

    def append_genuine(self) -> None:
        # One event: a claim (its outcome would be a second).
        assert self.ledger is not None
        ident = EffectIdentity("acme", "run-a", "notify", 0, "last@1", 0)
        self.ledger.claim(ident, {"n": "last"})
        self.slots = self._chain("run-a")

    def _extra_filter(self) -> tuple[str, dict[str, Any]]:
        return "chain = :c", {"c": "run-a"}

    def mutate_payload(self, record: Record) -> Record:
        record.fields["status"] = "not_happened"
        return record

    def forge_record(self, template: Record) -> Record:
        fields = dict(template.fields)
        fields["seq"] = int(template.fields["seq"]) + 1000
        fields["event"] = "resolved"
        fields["status"] = "not_happened"
        return Record(seq=template.seq + 1, fields=fields)

    def verify(self) -> bool:
        self.verify_detail = None
        assert self.ledger is not None
        witness = self.ledger.witness.path if self.ledger.witness is not None else None
        report = self.ledger.verify(witness=witness)
        if report.ok:
            return True
        self.verify_detail = "; ".join(report.problems)[:300]
        return False


class AuditPostgres(AuditSqlite):
    """:class:`AuditSqlite` on PostgreSQL."""

    name = "onceonly audit (postgresql)"
    backend = "postgresql"


# -- checkpoints -----------------------------------------------------------------------


class CheckpointsSqlite(_RowStore):
    """Rows of ``oo_checkpoints`` of one run; verify() loads the run as a worker does."""

    name = "onceonly checkpoints (sqlite)"
    table = "oo_checkpoints"
    identity_cols = ("run_id", "seq")
    owner_col = "run_id"
    meta_cols = ("step", "source", "created_at")

    def __init__(self) -> None:
        super().__init__()
        self.store: Store | None = None
        self.runs: dict[str, str] = {}

    def _open(self) -> None:
        # The documented configuration against a restore: a witness outside the store.
        self.store = Store.open(
            self._db.url,
            integrity=keyring().row_keys(),
            witness=os.path.join(self._db.dir, "witness"),
        )

    def _close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def _save(self, context: str, i: int) -> tuple[Any, ...]:
        assert self.store is not None
        rid = self.runs[context]
        info = self.store.save(
            rid, {"ctx": context, "i": i, "note": f"step {i} of {context}"}, step=f"s{i}"
        )
        return (rid, info.seq)

    def _seed(self, context: str, n: int) -> list[tuple[Any, ...]]:
        assert self.store is not None
        self.runs[context] = self.store.create_run("agmi", next_step="s0").run_id
        return [self._save(context, i) for i in range(n)]

    def append_genuine(self) -> None:
        self.slots.append(self._save("a", len(self.slots)))

    def _extra_filter(self) -> tuple[str, dict[str, Any]]:
        return "run_id = :r", {"r": self.runs["a"]}

    def mutate_payload(self, record: Record) -> Record:
        # As an attacker would: change the state and recompute the (unkeyed) digest.
        f = record.fields
        raw = delta.unpack(bytes(f["body"]))
        forged = raw.replace(b"step", b"STEP")
        assert forged != raw
        f["body"] = delta.pack(forged)
        f["digest"] = delta.row_digest(
            f["run_id"], f["seq"], f["kind"], f["keyframe_seq"], f["schema_version"],
            f["step"], f["source"], f["created_at"], forged,
        )  # fmt: skip
        return record

    def forge_record(self, template: Record) -> Record:
        forged = Record(seq=template.seq + 1, fields=dict(template.fields))
        forged.fields["seq"] = int(template.fields["seq"]) + 1
        return self.mutate_payload(forged)

    @staticmethod
    def _edited(col: str, value: Any) -> Any:
        if col == "source":  # a value a writer produces: "an operator wrote this"
            return "operator" if value != "operator" else "step"
        return _RowStore._edited(col, value)

    def verify(self) -> bool:
        self.verify_detail = None
        assert self.store is not None
        rid = self.runs["a"]
        try:
            self.store.load_run(rid)
            for info in self.store.history(rid):
                self.store.load(rid, info.seq)
        except OnceOnlyError as exc:
            return self._refused(exc)
        return True


class CheckpointsSqliteUnkeyed(CheckpointsSqlite):
    """Positive control: a store opened without integrity keys (what a user who forgets
    the keyring gets). Its digests are unkeyed, so a recomputed one passes."""

    name = "onceonly checkpoints, no keys (sqlite)"

    def _open(self) -> None:
        self.store = Store.open(self._db.url)


class CheckpointsPostgres(CheckpointsSqlite):
    """:class:`CheckpointsSqlite` on PostgreSQL."""

    name = "onceonly checkpoints (postgresql)"
    backend = "postgresql"


# -- waits -----------------------------------------------------------------------------


def _approval_flow(provider: _Provider) -> Flow:
    flow = Flow("payment")

    @flow.step(start=True)
    def ask(ctx: StepContext) -> Transition:
        return ctx.wait_for_approval(
            "cfo", {"amount": ctx.state["amount"]}, then="pay", requested_by="alice"
        )

    @flow.step
    def pay(ctx: StepContext) -> Transition:
        ctx.approved("cfo", {"amount": ctx.state["amount"]})
        provider.sent.append((ctx.state["amount"], ""))
        return ctx.end("paid")

    return flow


class WaitsSqlite(_RowStore):
    """Rows of ``oo_waits``: one approval request per waiting run; verify() is what a
    worker does when it resumes a waiting run, and what the approver's inbox reads."""

    name = "onceonly waits (sqlite)"
    table = "oo_waits"
    identity_cols = ("run_id", "name", "instance")
    owner_col = "run_id"
    meta_cols = ("requested_by", "opened_by", "created_at")

    def __init__(self) -> None:
        super().__init__()
        self.provider = _Provider()
        self.runtime: Runtime | None = None
        self.expected: list[tuple[Any, ...]] = []
        self._n = 0

    def _open(self) -> None:
        store = Store.open(self._db.url)
        witness = os.path.join(self._db.dir, "witness")  # documented: chains and run rows
        ledger = Ledger(store, keyring(), in_flight=InFlightPolicy(wait_s=0), witness=witness)
        self.runtime = Runtime(store, ledger, [_approval_flow(self.provider)], owner="w")

    def _close(self) -> None:
        if self.runtime is not None:
            self.runtime.ledger.close()
            self.runtime.store.close()
            self.runtime = None

    def _waiting_run(self, context: str) -> tuple[Any, ...]:
        assert self.runtime is not None
        rt = self.runtime
        rid = rt.start("payment", {"amount": 100 + self._n}, run_id=f"{context}-{self._n}")
        self._n += 1
        assert rt.drive(rid).status is RunStatus.WAITING
        [wait] = Waits(rt.store).find(run_id=rid)
        return (rid, wait.name, wait.instance)

    def _seed(self, context: str, n: int) -> list[tuple[Any, ...]]:
        slots = [self._waiting_run(context) for _ in range(n)]
        if context == "a":
            self.expected = list(slots)
        return slots

    def append_genuine(self) -> None:
        self.slots.append(self._waiting_run("a"))
        self.expected.append(self.slots[-1])

    # The runs waiting are in the store (oo_runs and their checkpoints name their
    # waits): a restored store rolls them back too.
    def _known(self) -> object:
        return list(self.expected)

    def _restore_known(self, known: object) -> None:
        self.expected = list(known)  # type: ignore[call-overload]

    def _extra_filter(self) -> tuple[str, dict[str, Any]]:
        return "run_id LIKE 'a-%'", {}

    def mutate_payload(self, record: Record) -> Record:
        # A forged decision: the request reads as approved by the CFO.
        record.fields.update(status="approved", decided_by="cfo", decided_at=1.0)
        return record

    def forge_record(self, template: Record) -> Record:
        forged = Record(seq=template.seq + 1, fields=dict(template.fields))
        forged.fields["instance"] = int(template.fields["instance"]) + 1
        return self.mutate_payload(forged)

    def verify(self) -> bool:
        self.verify_detail = None
        assert self.runtime is not None
        waits = Waits(self.runtime.store)
        try:
            for rid, name, instance in self.expected:
                waits.fire_if_due(rid, name, instance)
            for rid in sorted({s[0] for s in self.expected}):
                waits.find(run_id=rid)
        except OnceOnlyError as exc:
            return self._refused(exc)
        return True


class WaitsPostgres(WaitsSqlite):
    """:class:`WaitsSqlite` on PostgreSQL."""

    name = "onceonly waits (postgresql)"
    backend = "postgresql"
