"""S8: corruption and tamper (RELIABILITY.md, S8; invariant I4).

A store is populated with effects in every state (committed, failed, re-sent,
reconciled, resolved, unknown, a live claim, one outside a run, one in another run) and
checkpoints with blobs, and a witness of its audit heads is exported. Then, each case
on a fresh copy of that store:

* **bit flips** at random positions of every stored text and binary column but the
  leases: blobs and their references, checkpoint rows (bodies, digests, seals), run rows,
  effect rows (ciphertexts, seals, fingerprints, provider keys, status, step, subject,
  every key column), audit events (hashes, links, row digests, MACs, details), chain
  heads and data keys, text in any of its seven bits — CI: 150 positions per backend;
  deep: 2 000;
* **structured tampers**: every tamper of ``tests/test_ledger_audit.py`` (edit, delete,
  swap, duplicate, forge, move between runs), plus truncations, reordered and moved
  checkpoints, and the audit head rolled back (checked against the witness);
* **one row deleted**, from every table the store fills: CI, a seeded sample of 2 rows
  per table; deep: every row.

After each tamper a new worker (a fresh Store + Ledger, i.e. another process) drives a
guarded effect for every populated entry, with a counting provider, and loads every
checkpoint. The case is **detected** only if ``verify`` reports it, the provider
received nothing, every read returned the true value or raised a typed ``OnceOnlyError``
(a tampered record refused), and nothing else was raised. Otherwise it is **accepted**
(must be 0).

Positive controls: with the ledger's read-side row check disabled, a status edit must
reach the provider; with the store's blob check in ``verify`` disabled, a flipped blob
must go unreported; the harness must count both as accepted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from onceonly.checkpoint import OnceOnlyError, Store
from onceonly.ledger import (
    Claim,
    EffectIdentity,
    InFlightPolicy,
    Ledger,
    ProviderClass,
)
from property_tests.reliability import SuiteReport, scaled, seeds
from property_tests.s1_support import CountingProvider
from tests.dbutil import execute, fetch
from tests.ledger_support import Clock, Ledgers, ident, keyring
from tests.test_ledger_audit import TAMPERS, Populated, populate, table_names

FLIPS = scaled(ci=150, deep=2000)
REPORT = SuiteReport(suite="S8", seeds=seeds(1))

# the populated entries: (identity, arguments), as populate() made them
DRIVE: list[tuple[EffectIdentity, Any]] = [
    *[(ident(i), {"n": i}) for i in range(7)],
    (ident(run=None, explicit="inv-1", effect="charge@1"), {"n": 7}),
    (ident(0, run="run-2"), {"n": 8}),
]

# flip targets: table -> (key columns, binary columns, text columns)
# Every stored text and binary column of every table the populated store fills, keys
# included, but the lease columns (they change on every heartbeat and nothing is decided
# on them: DESIGN.md, integrity).
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "oo_blobs": (("hash",), ("data", "hash"), ()),
    "oo_blob_refs": (("owner", "hash"), ("hash",), ("owner",)),
    "oo_checkpoints": (
        ("run_id", "seq"),
        ("body", "digest", "seal"),
        ("step", "source", "run_id"),
    ),
    "oo_runs": (("run_id",), ("seal",), ("run_id", "flow", "code_version", "status", "handoff")),
    "oo_effects": (
        ("key_id",),
        ("args_ct", "result_ct", "error_ct", "seal"),
        (
            "fingerprint",
            "provider_key",
            "status",
            "step_id",
            "effect",
            "key_id",
            "tenant",
            "run_id",
            "chain",
            "subject",
            "secret_id",
            "outcome_class",
            "provider_class",
        ),
    ),
    "oo_audit": (
        ("chain", "seq"),
        ("hash", "prev_hash", "row_digest", "mac"),
        ("detail", "actor", "chain", "key_id", "event", "status"),
    ),
    "oo_chain_heads": (("chain",), ("hash", "seal"), ("chain",)),
    "oo_data_keys": (("subject",), ("wrapped",), ("subject", "secret_id")),
}


@dataclass
class Outcome:
    """What one tamper case came to."""

    name: str
    verify_found: bool = False
    sends: int = 0
    fresh_sent: int = 0
    wrong_reads: list[str] = field(default_factory=list)
    refused: int = 0
    unexplained: list[str] = field(default_factory=list)

    @property
    def detected(self) -> bool:
        return (
            self.verify_found and not self.sends and not self.wrong_reads and not self.unexplained
        )


class Bench:
    """A populated store, its snapshot, and the harness that judges one tamper."""

    def __init__(self, db_url: str, tmp: Path) -> None:
        self.db_url = db_url
        self.fresh = 0
        self.clock = Clock(1_800_000_000.0)
        self.lg = Ledgers(db_url, self.clock)
        self.led = self.lg.fresh(owner="worker-a")
        self.keys: Populated = populate(self.led, self.clock)
        self.engine: Engine = self.led.store.engine
        self.witness = str(tmp / "witness.json")
        self.led.export_witness(self.witness)
        self.states = {
            (run, seq): self.led.store.load(run, seq).state for run in ("run-1",) for seq in (0, 1)
        }
        self.tables = table_names(self.engine)
        for t in self.tables:
            execute(self.engine, f"DROP TABLE IF EXISTS snap_{t}")
            execute(self.engine, f"CREATE TABLE snap_{t} AS SELECT * FROM {t}")
        assert self.judge("clean", lambda: None).verify_found is False

    def close(self) -> None:
        self.lg.close()

    def restore(self) -> None:
        with self.engine.begin() as conn:
            for t in self.tables:
                conn.execute(text(f"DELETE FROM {t}"))
                conn.execute(text(f"INSERT INTO {t} SELECT * FROM snap_{t}"))

    def judge(self, name: str, tamper: Callable[[], object]) -> Outcome:
        """Restore the populated store, tamper, then drive and verify as a new process."""
        self.restore()
        tamper()
        out = Outcome(name)
        provider = CountingProvider()
        store = Store.open(self.db_url)
        led = Ledger(
            store,
            keyring(),
            owner="driver",
            in_flight=InFlightPolicy(wait_s=0),
            clock=self.clock,
        )
        try:
            for identity, args in DRIVE:

                def act(claim: Claim, args: Any = args) -> str:
                    return provider.send(claim.provider_key, args)

                try:
                    led.perform(identity, args, act, provider_class=ProviderClass.QUERYABLE)
                except OnceOnlyError:
                    out.refused += 1
                except Exception as exc:  # noqa: BLE001  (reported: must be typed)
                    out.unexplained.append(f"perform {identity}: {type(exc).__name__}: {exc}")
            out.sends = len(provider.raw)
            # a new effect of a run the tamper did not touch goes through: the provider
            # path works, so the silence above means something
            self.fresh += 1
            fresh = ident(0, run=f"fresh-{self.fresh}")
            led.perform(
                fresh,
                {"n": self.fresh},
                lambda c: provider.send(c.provider_key, "fresh"),
                provider_class=ProviderClass.QUERYABLE,
            )
            out.fresh_sent = len(provider.raw) - out.sends
            for (run, seq), state in self.states.items():
                try:
                    got = store.load(run, seq).state
                except OnceOnlyError:
                    out.refused += 1
                    continue
                except Exception as exc:  # noqa: BLE001
                    out.unexplained.append(f"load {run}@{seq}: {type(exc).__name__}: {exc}")
                    continue
                if got != state:
                    out.wrong_reads.append(f"{run}@{seq} loaded a changed state")
            try:
                out.verify_found = not led.verify(witness=self.witness).ok
            except Exception as exc:  # noqa: BLE001
                out.unexplained.append(f"verify: {type(exc).__name__}: {exc}")
        finally:
            led.close()
            store.close()
        return out

    # -- bit flips --------------------------------------------------------------------
    def cells(self) -> list[tuple[str, str, tuple[Any, ...], int, bool]]:
        """Every flippable stored value: (table, column, key, length, binary)."""
        self.restore()
        out = []
        for table, (keys, binary, texts) in TARGETS.items():
            cols = [*binary, *texts]
            rows = fetch(self.engine, f"SELECT {', '.join(keys + tuple(cols))} FROM {table}")
            for row in rows:
                key = tuple(bytes(v) if isinstance(v, memoryview) else v for v in row[: len(keys)])
                for col, value in zip(cols, row[len(keys) :], strict=True):
                    if value is None or len(value) == 0:
                        continue
                    out.append((table, col, key, len(value), col in binary))
        return out

    def flip(self, table: str, col: str, key: tuple[Any, ...], pos: int, bit: int) -> None:
        keys = TARGETS[table][0]
        where = " AND ".join(f"{k} = :k{i}" for i, k in enumerate(keys))
        params = {f"k{i}": v for i, v in enumerate(key)}
        [(value,)] = fetch(self.engine, f"SELECT {col} FROM {table} WHERE {where}", **params)
        if isinstance(value, str):
            chars = list(value)
            c = chars[pos]
            new = chr(ord(c) ^ (1 << bit))
            if not (0x20 <= ord(new) < 0x7F) or not c.isascii():
                new = "~" if c != "~" else "!"
            chars[pos] = new
            changed: Any = "".join(chars)
        else:
            data = bytearray(bytes(value))
            data[pos] ^= 1 << bit
            changed = bytes(data)
        n = execute(
            self.engine, f"UPDATE {table} SET {col} = :v WHERE {where}", v=changed, **params
        )
        assert n == 1


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[SuiteReport]:
    REPORT._started = time.monotonic()  # the suite's own wall time, not the session's
    yield REPORT
    REPORT.check()


@pytest.fixture
def bench(db_url: str, tmp_path: Path) -> Iterator[Bench]:
    b = Bench(db_url, tmp_path)
    try:
        yield b
    finally:
        b.close()


def _tally(report: SuiteReport, outcomes: list[Outcome]) -> list[str]:
    bad = [o for o in outcomes if not o.detected]
    assert all(o.fresh_sent == 1 for o in outcomes), "an untouched run's effect was not sent once"
    report.add(
        scenarios=len(outcomes),
        runs=len(outcomes),
        effects=len(outcomes) * (len(DRIVE) + 1),
        raw_deliveries=sum(o.sends + o.fresh_sent for o in outcomes),
        duplicates=sum(o.sends for o in outcomes),
        detected=len(outcomes) - len(bad),
        accepted=len(bad),
    )
    return [
        f"{o.name}: verify_found={o.verify_found} sends={o.sends} wrong={o.wrong_reads} "
        f"unexplained={o.unexplained}"
        for o in bad
    ]


@pytest.mark.slow
def test_bit_flips_are_refused_and_found(bench: Bench, report: SuiteReport) -> None:
    rng = random.Random(REPORT.seeds[0])
    cells = bench.cells()
    weights = [c[3] for c in cells]
    by_column: dict[tuple[str, str], list[Any]] = {}
    for c in cells:
        by_column.setdefault((c[0], c[1]), []).append(c)
    # every column at least once (a random cell of it), then cells weighted by size
    assert {(t, c) for t, (_, b, x) in TARGETS.items() for c in (*b, *x)} <= set(by_column)
    picks = [rng.choice(by_column[k]) for k in sorted(by_column)]
    picks += [rng.choices(cells, weights)[0] for _ in range(FLIPS)]
    outcomes = []
    for table, col, key, length, binary in picks:
        # text: any of the seven ASCII bits (the case bit too), kept printable
        pos, bit = rng.randrange(length), rng.randrange(8 if binary else 7)
        outcomes.append(
            bench.judge(
                f"flip {table}.{col}{key}[{pos}]^{1 << bit}",
                lambda: bench.flip(table, col, key, pos, bit),  # noqa: B023
            )
        )
    bad = _tally(report, outcomes)
    assert not bad, "\n".join(bad)


def _structured(e: Engine, k: Populated) -> dict[str, Callable[[], object]]:
    def q(sql: str, **params: Any) -> Callable[[], object]:
        return lambda: execute(e, sql, **params)

    def bind(apply: Callable[[Engine, Populated], str]) -> Callable[[], object]:
        return lambda: apply(e, k)

    cases: dict[str, Callable[[], object]] = {name: bind(apply) for name, apply in TAMPERS.items()}
    cases.update(
        {
            "truncate a blob": q(
                "UPDATE oo_blobs SET data = substr(data, 1, 40)"
                if e.dialect.name == "sqlite"
                else "UPDATE oo_blobs SET data = substring(data from 1 for 40)"
            ),
            "truncate a checkpoint body": q(
                "UPDATE oo_checkpoints SET body = substr(body, 1, 10) WHERE seq = 1"
                if e.dialect.name == "sqlite"
                else "UPDATE oo_checkpoints SET body = substring(body from 1 for 10) WHERE seq = 1"
            ),
            "truncate a result": q(
                "UPDATE oo_effects SET result_ct = substr(result_ct, 1, 20) WHERE key_id = :k"
                if e.dialect.name == "sqlite"
                else "UPDATE oo_effects SET result_ct = substring(result_ct from 1 for 20) "
                "WHERE key_id = :k",
                k=k.committed,
            ),
            "reorder two checkpoints": lambda: (
                execute(e, "UPDATE oo_checkpoints SET seq = 99 WHERE run_id = 'run-1' AND seq = 0"),
                execute(e, "UPDATE oo_checkpoints SET seq = 0 WHERE run_id = 'run-1' AND seq = 1"),
                execute(e, "UPDATE oo_checkpoints SET seq = 1 WHERE run_id = 'run-1' AND seq = 99"),
            ),
            "roll the audit head of run-1 back by 3 events": lambda: execute(
                e,
                "DELETE FROM oo_audit WHERE chain = 'run-1' AND seq > "
                "(SELECT max(seq) - 3 FROM snap_oo_audit WHERE chain = 'run-1')",
            ),
            "roll every chain back to its first event": q("DELETE FROM oo_audit WHERE seq > 1"),
            "duplicate an effect's audit trail into another run": lambda: execute(
                e,
                "INSERT INTO oo_audit (chain, seq, key_id, event, epoch, status, actor, detail, "
                "row_digest, at, prev_hash, hash) SELECT 'run-2', seq + 100, key_id, event, "
                "epoch, status, actor, detail, row_digest, at, prev_hash, hash FROM oo_audit "
                "WHERE chain = 'run-1' AND key_id = :k",
                k=k.committed,
            ),
            "forge a committed result from another entry": q(
                "UPDATE oo_effects SET result_ct = (SELECT result_ct FROM oo_effects "
                "WHERE key_id = :o), status = 'committed' WHERE key_id = :k",
                o=k.other_run,
                k=k.unknown,
            ),
            "delete the live claim": q("DELETE FROM oo_effects WHERE key_id = :k", k=k.live),
            "delete a committed entry": q(
                "DELETE FROM oo_effects WHERE key_id = :k", k=k.committed
            ),
        }
    )
    return cases


@pytest.mark.slow
def test_structured_tampers_are_refused_and_found(bench: Bench, report: SuiteReport) -> None:
    cases = _structured(bench.engine, bench.keys)
    outcomes = [bench.judge(name, apply) for name, apply in cases.items()]
    bad = _tally(report, outcomes)
    assert not bad, "\n".join(bad)


DELETIONS = scaled(ci=2, deep=10_000)  # rows deleted per table (a seeded sample; deep: all)
EMPTY = {"oo_waits", "oo_run_links"}  # the S8 store holds none (waits: tests/test_waits*)


def _deletions(bench: Bench) -> list[tuple[str, str, dict[str, Any]]]:
    """Single rows to delete: (table, WHERE clause, its parameters), a seeded sample of
    each table's rows by primary key (every row in the deep tier)."""
    from sqlalchemy import inspect

    bench.restore()
    rng = random.Random(seeds(1, base=20261207)[0])
    out = []
    for table in bench.tables:
        pk = inspect(bench.engine).get_pk_constraint(table)["constrained_columns"]
        assert pk, f"{table} has no primary key to delete one row by"
        rows = fetch(bench.engine, f"SELECT {', '.join(pk)} FROM {table}")
        for row in rng.sample(rows, min(DELETIONS, len(rows))):
            where = " AND ".join(f"{k} = :k{i}" for i, k in enumerate(pk))
            out.append((table, where, {f"k{i}": v for i, v in enumerate(row)}))
    return out


@pytest.mark.slow
def test_any_single_row_deleted_is_found(bench: Bench, report: SuiteReport) -> None:
    """Deleting one row of any table is a tamper like an edit: refused
    where it is read, found by ``verify``. A checkpoint deleted below its run's head, or
    a run row with its checkpoints left, was once reported by nothing but the load that
    failed on it."""
    cases = _deletions(bench)
    tables = {t for t, _, _ in cases}
    assert tables == set(bench.tables) - EMPTY, "a table with no row"

    def deleting(table: str, where: str, params: dict[str, Any]) -> Callable[[], None]:
        def delete() -> None:
            assert execute(bench.engine, f"DELETE FROM {table} WHERE {where}", **params) == 1

        return delete

    outcomes = [
        bench.judge(f"delete {table} row {tuple(params.values())!r}", deleting(*case))
        for case in cases
        for table, _, params in [case]
    ]
    bad = _tally(report, outcomes)
    assert not bad, "\n".join(bad)


# -- positive controls ------------------------------------------------------------------------


@pytest.mark.slow
def test_control_a_ledger_without_its_row_check_is_caught(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Bench(f"sqlite:///{tmp_path / 'control.db'}", tmp_path)
    try:
        monkeypatch.setattr(Ledger, "_check_row", lambda self, cur, row, *last, **mine: None)
        monkeypatch.setattr(Ledger, "_check_absent", lambda self, cur, chain, ids, *last: None)
        monkeypatch.setattr(Ledger, "_audited_rows", lambda self, cur, rows: rows)
        out = b.judge(
            "status edit",
            lambda: execute(
                b.engine,
                "UPDATE oo_effects SET status = 'not_happened' WHERE key_id = :k",
                k=b.keys.committed,
            ),
        )
    finally:
        b.close()
    caught = not out.detected and out.sends > 0
    report.control(caught)
    assert caught, out


@pytest.mark.slow
def test_control_a_verify_without_its_blob_check_is_caught(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Bench(f"sqlite:///{tmp_path / 'control.db'}", tmp_path)
    try:
        monkeypatch.setattr(Store, "verify_integrity", lambda self: (0, []))
        [(h, n)] = fetch(b.engine, "SELECT hash, length(data) FROM oo_blobs LIMIT 1")
        out = b.judge("blob flip", lambda: b.flip("oo_blobs", "data", (bytes(h),), n // 2, 0))
    finally:
        b.close()
    caught = not out.detected and not out.verify_found
    report.control(caught)
    assert caught, out


# -- directed edits (the tamper issue, item by item) on the path that acts -----------------
#
# Each case is an edit an attacker with database access but without the keyring's secret
# makes to a live store, varied by seed (which effects, how many, how far back). A case
# is detected only if the provider received exactly what it had before the edit, the
# path that acts raised a typed error, and ``verify`` (or the saver's read) names it.

DIRECTED_VARIANTS = scaled(ci=2, deep=20)


@dataclass
class Directed:
    """What one directed edit came to."""

    name: str
    expected: int = 0
    sent: int = 0
    refused: bool = False
    verify_found: bool = False
    unexplained: list[str] = field(default_factory=list)

    @property
    def detected(self) -> bool:
        return (
            self.sent == self.expected
            and self.refused
            and self.verify_found
            and not self.unexplained
        )


def _refused(out: Directed, act: Callable[[], object]) -> None:
    """Run one acting call; a typed refusal counts, anything untyped is unexplained."""
    try:
        act()
    except OnceOnlyError:
        out.refused = True
    except Exception as exc:  # noqa: BLE001  (reported: must be typed)
        out.unexplained.append(f"{type(exc).__name__}: {exc}")


def _found(out: Directed, led: Ledger, needle: str = "", **kwargs: Any) -> None:
    report = led.verify(**kwargs)
    out.verify_found = not report.ok and any(needle in p for p in report.problems)


def _d_forged_approval(w: Any, rng: random.Random, variant: int) -> Directed:
    from tests.test_tamper_acting import _work

    decided = "rejected" if variant % 2 else None
    out = Directed(f"forged approval (over {decided or 'an open wait'})")
    rid = w.waiting_run()
    if decided:
        w.operator.reject(rid, "cfo", actor="bob", reason="no")
        w.runtime().drive(rid)
    execute(
        w.store.engine,
        "UPDATE oo_waits SET status = 'approved', decided_by = :who, decided_at = 1 "
        "WHERE run_id = :r",
        who=rng.choice(["cfo", "ceo", "bob"]),
        r=rid,
    )
    execute(w.store.engine, "UPDATE oo_runs SET status = 'running' WHERE run_id = :r", r=rid)
    _work(w)
    _refused(out, lambda: w.runtime().drive(rid))
    out.sent = len(w.provider.sent)
    _found(out, w.ledger, "wait 'cfo'")
    return out


def _d_subject_swap(w: Any, rng: random.Random, variant: int) -> Directed:
    out = Directed("subject swapped under its approval")
    rid = w.waiting_run()
    execute(
        w.store.engine,
        "UPDATE oo_waits SET subject = :s WHERE run_id = :r",
        s=w.store.codec.encode({"amount": rng.randrange(1, 899)}),
        r=rid,
    )
    _refused(out, lambda: w.operator.approve(rid, "cfo", actor="bob", subject_hash="0" * 64))
    _refused(out, lambda: w.runtime().drive(rid))
    out.sent = len(w.provider.sent)
    _found(out, w.ledger, "wait 'cfo'")
    return out


def _d_run_flipped(w: Any, rng: random.Random, variant: int) -> Directed:
    from tests.test_tamper_acting import _work

    out = Directed("finished run flipped back to running", expected=1)
    rid = w.waiting_run()
    [wait] = [x for x in w.operator.show(rid).waits if x.name == "cfo"]
    w.operator.approve(rid, "cfo", actor="bob", subject_hash=wait.subject_hash)
    w.runtime().drive(rid)
    execute(
        w.store.engine,
        "UPDATE oo_runs SET status = :s, next_step = 'pay' WHERE run_id = :r",
        s=rng.choice(["running", "waiting"]),
        r=rid,
    )
    _work(w)
    _refused(out, lambda: w.runtime().drive(rid))
    out.sent = len(w.provider.sent)
    _found(out, w.ledger, f"run {rid!r}")
    return out


def _d_checkpoint_digest(w: Any, rng: random.Random, variant: int) -> Directed:
    from onceonly.checkpoint import _delta as delta
    from tests.dbutil import fetch as fetch_rows

    out = Directed("checkpoint body edited, its unkeyed digest recomputed")
    rt = w.runtime()
    amount = rng.randrange(100, 999)
    rid = rt.start("payment", {"amount": amount}, started_by="alice")
    [(seq, kind, kf, ver, step, src, at, body)] = fetch_rows(
        w.store.engine,
        "SELECT seq, kind, keyframe_seq, schema_version, step, source, created_at, body "
        "FROM oo_checkpoints WHERE run_id = :r",
        r=rid,
    )
    raw = delta.unpack(bytes(body))
    forged = raw.replace(str(amount).encode(), b"1")
    execute(
        w.store.engine,
        "UPDATE oo_checkpoints SET body = :b, digest = :d WHERE run_id = :r",
        b=delta.pack(forged),
        d=delta.row_digest(rid, seq, kind, kf, ver, step, src, at, forged),
        r=rid,
    )
    _refused(out, lambda: w.runtime().drive(rid))
    out.sent = len(w.provider.sent)
    _found(out, w.ledger, "seal")
    return out


def _d_cut_back(w: Any, rng: random.Random, variant: int) -> Directed:
    from onceonly.runtime import Runtime
    from tests.test_tamper_acting import loop_flow

    flow = loop_flow()
    led = w.ledgers.fresh(owner="w3")
    rid = Runtime(led.store, led, [flow], owner="w3").start("steps", {})
    Runtime(led.store, led, [flow], owner="w3").drive(rid)
    cut = 1 + variant % 3
    out = Directed(f"history cut back by {cut} and the head moved")
    [(head,)] = fetch(w.store.engine, "SELECT head_seq FROM oo_runs WHERE run_id = :r", r=rid)
    execute(
        w.store.engine,
        "DELETE FROM oo_checkpoints WHERE run_id = :r AND seq > :h",
        r=rid,
        h=head - cut,
    )
    execute(
        w.store.engine,
        "UPDATE oo_runs SET head_seq = :h, status = 'running' WHERE run_id = :r",
        r=rid,
        h=head - cut,
    )
    fresh = w.ledgers.fresh(owner="w4")
    _refused(out, lambda: Runtime(fresh.store, fresh, [flow], owner="w4").drive(rid))
    _found(out, w.ledger, f"run {rid!r}")
    return out


def _effects(w: Any, led: Ledger, chain: str, ns: range) -> list[Any]:
    def one(n: int) -> Any:
        identity = EffectIdentity("t", chain, "s", 0, f"send{n}@1", 0)
        return led.perform(
            identity, {"n": n}, lambda c: w.provider.sent.append((chain, n, c.provider_key))
        )

    return [one(n) for n in ns]


def _d_deleted(w: Any, rng: random.Random, variant: int) -> Directed:
    n = rng.randrange(3, 7)
    victims = sorted(rng.sample(range(n), rng.randrange(1, n)))
    if variant == 0:
        victims = [n - 1]  # the newest
    out = Directed(f"effects {victims} of {n} deleted with their events", expected=n)
    chain = f"run-d{variant}"
    led = w.ledgers.fresh(owner="w1")
    _effects(w, led, chain, range(n))
    keys = {r.effect: r.key_id for r in led.effects(run_id=chain)}
    for v in victims:
        execute(w.store.engine, "DELETE FROM oo_audit WHERE key_id = :k", k=keys[f"send{v}@1"])
        execute(w.store.engine, "DELETE FROM oo_effects WHERE key_id = :k", k=keys[f"send{v}@1"])
    other = w.ledgers.fresh(owner="w2")  # another process: replays nothing from memory
    for v in victims:

        def again(v: int = v) -> object:
            return _effects(w, other, chain, range(v, v + 1))

        _refused(out, again)
    _refused(out, lambda: _effects(w, other, chain, range(n, n + 1)))
    out.sent = len(w.provider.sent)
    out.refused = out.refused and out.sent == n
    _found(out, w.ledger, f"chain {chain!r}")
    return out


def _d_recomputed(w: Any, rng: random.Random, variant: int) -> Directed:
    from onceonly.ledger.audit import event_hash, row_digest
    from tests.ledger_support import effect_row

    n = rng.randrange(1, 5)
    pick = rng.randrange(n)
    chain = f"run-r{variant}"
    out = Directed(f"effect {pick} of {n} set to not_happened, unkeyed digests redone", expected=n)
    led = w.ledgers.fresh(owner="w1")
    _effects(w, led, chain, range(n))
    [key] = [r.key_id for r in led.effects(run_id=chain) if r.effect == f"send{pick}@1"]
    e = w.store.engine
    row = effect_row(e, key)
    row["status"] = "not_happened"
    digest = row_digest(row)
    [(seq, event, epoch, actor, detail, at, prev)] = fetch(
        e,
        "SELECT seq, event, epoch, actor, detail, at, prev_hash FROM oo_audit "
        "WHERE key_id = :k ORDER BY seq DESC LIMIT 1",
        k=key,
    )
    h = event_hash(
        bytes(prev), chain, seq, key, event, epoch, "not_happened", actor, detail, digest, at
    )
    execute(e, "UPDATE oo_effects SET status = 'not_happened' WHERE key_id = :k", k=key)
    execute(
        e,
        "UPDATE oo_audit SET status = 'not_happened', row_digest = :d, hash = :h "
        "WHERE key_id = :k AND seq = :s",
        d=digest,
        h=h,
        k=key,
        s=seq,
    )
    if seq == max(s for (s,) in fetch(e, "SELECT seq FROM oo_audit WHERE chain = :c", c=chain)):
        execute(e, "UPDATE oo_chain_heads SET hash = :h WHERE chain = :c", h=h, c=chain)
    other = w.ledgers.fresh(owner="w2")
    _refused(out, lambda: _effects(w, other, chain, range(pick, pick + 1)))
    out.sent = len(w.provider.sent)
    # operator reads flag it too (item 7)
    if other.get(key).integrity != "edited":
        out.unexplained.append(f"Ledger.get served the edited row as {other.get(key).integrity}")
    _found(out, w.ledger, key)
    return out


_LEDGER_TABLES = ("oo_effects", "oo_audit", "oo_chain_heads", "oo_data_keys")


def _d_rollback(w: Any, rng: random.Random, variant: int) -> Directed:
    before = rng.randrange(1, 4)
    after = rng.randrange(1, 3)
    chain = f"run-b{variant}"
    path = str(w.tmp / f"witness-{variant}")
    out = Directed(
        f"whole ledger restored {after} effect(s) back, witness kept", expected=before + after
    )
    led = w.ledgers.fresh(owner="w1", witness=path)
    _effects(w, led, chain, range(before))
    e = w.store.engine
    for t in _LEDGER_TABLES:
        execute(e, f"DROP TABLE IF EXISTS snap_{t}")
        execute(e, f"CREATE TABLE snap_{t} AS SELECT * FROM {t}")
    _effects(w, led, chain, range(before, before + after))
    for t in _LEDGER_TABLES:
        execute(e, f"DELETE FROM {t}")
        execute(e, f"INSERT INTO {t} SELECT * FROM snap_{t}")
    other = w.ledgers.fresh(owner="w2", witness=path)
    _refused(out, lambda: _effects(w, other, chain, range(before, before + 1)))
    out.sent = len(w.provider.sent)
    _found(out, other, "", witness=path)
    return out


def _d_saver(w: Any, rng: random.Random, variant: int) -> Directed:
    from onceonly.adapters.langgraph_saver import OnceOnlySaver
    from tests.ledger_support import keyring as ring
    from tests.test_langgraph_saver_integrity import (
        PERMISSIVE,
        _config,
        _evil,
        _forge_record,
        _forge_write,
        _put,
    )

    where = ("record", "write")[variant % 2]
    out = Directed(f"LangGraph saver {where} forged with a code-running payload")
    marker = w.tmp / f"ran-{variant}"
    with OnceOnlySaver.from_url(w.ledgers.db_url, keyring=ring()) as saver:
        _put(saver)
    if where == "record":
        _forge_record(w.store.engine, marker)
    else:
        _forge_write(w.store.engine, _evil(marker))
    with OnceOnlySaver.from_url(w.ledgers.db_url, keyring=ring(), serde=PERMISSIVE) as saver:
        _refused(out, lambda: saver.get_tuple(_config()))
    out.verify_found = out.refused
    if marker.exists():
        out.sent = 1  # code ran from stored bytes
    return out


DIRECTED: dict[str, Callable[[Any, random.Random, int], Directed]] = {
    "forged approval": _d_forged_approval,
    "subject swap": _d_subject_swap,
    "run flipped back": _d_run_flipped,
    "checkpoint digest recomputed": _d_checkpoint_digest,
    "history cut back": _d_cut_back,
    "effects deleted with their events": _d_deleted,
    "effect digests recomputed": _d_recomputed,
    "store rolled back behind its witness": _d_rollback,
    "saver row forged": _d_saver,
}


def _directed_world(ledgers: Any, tmp: Path) -> Any:
    from tests.test_tamper_acting import World

    w: Any = World(ledgers)
    w.tmp = tmp
    return w


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DIRECTED), ids=str)
def test_directed_edits_are_refused_where_they_act(
    case: str, db_url: str, tmp_path: Path, report: SuiteReport
) -> None:
    bad = []
    for variant in range(DIRECTED_VARIANTS):
        lg = Ledgers(db_url, Clock(1_800_000_000.0))
        rng = random.Random(seeds(1)[0] * 31 + variant)
        try:
            w = _directed_world(lg, tmp_path / f"v{variant}")
            w.tmp.mkdir()
            out = DIRECTED[case](w, rng, variant)
        finally:
            lg.close()
        report.add(
            scenarios=1,
            runs=1,
            effects=max(out.expected, 1),
            raw_deliveries=out.sent,
            duplicates=max(out.sent - out.expected, 0),
            detected=int(out.detected),
            accepted=int(not out.detected),
        )
        if not out.detected:
            bad.append(out)
    assert not bad, bad


@pytest.mark.slow
def test_control_a_ledger_that_does_not_check_its_chain_is_caught(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ledger as it was before sealed heads: a chain's head is its last event.
    def last_event(cur: Any, q: str, keys: Any, chain: str) -> tuple[int, bytes] | None:
        cur.execute(
            f"SELECT seq, hash FROM oo_audit WHERE chain = {q} ORDER BY seq DESC LIMIT 1",
            (chain,),
        )
        found = cur.fetchone()
        return None if found is None else (int(found[0]), bytes(found[1]))

    for home in ("_transitions", "_integrity"):  # appending, and prefetch's scan
        monkeypatch.setattr(f"onceonly.ledger.{home}.head_of", last_event)
    monkeypatch.setattr(Ledger, "_advance_head", lambda self, cur, chain, old, seq, h: None)
    monkeypatch.setattr(Ledger, "_check_chain", lambda self, cur, chain, *read: None)
    monkeypatch.setattr(Ledger, "_check_absent", lambda self, cur, chain, ids, *last: None)
    lg = Ledgers(f"sqlite:///{tmp_path / 'control.db'}", Clock(1_800_000_000.0))
    try:
        w = _directed_world(lg, tmp_path)
        out = _d_deleted(w, random.Random(1), 0)  # the newest effect deleted
    finally:
        lg.close()
    caught = not out.detected and out.sent > out.expected
    report.control(caught)
    assert caught, out


@pytest.mark.slow
def test_control_a_store_that_checks_no_seals_is_caught(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    from onceonly.checkpoint.waits import Waits

    # a store that checks no seals: neither its waits' nor its run rows'
    monkeypatch.setattr(Waits, "_checked", lambda self, row: tuple(row[:16]))
    for part in ("_runs", "_reads", "_audit"):  # every part of the store that checks seals
        monkeypatch.setattr(f"onceonly.checkpoint.{part}.check", lambda *args, **kwargs: None)
    lg = Ledgers(f"sqlite:///{tmp_path / 'control.db'}", Clock(1_800_000_000.0))
    try:
        w = _directed_world(lg, tmp_path)
        out = _d_forged_approval(w, random.Random(1), 0)
    finally:
        lg.close()
    caught = not out.detected and out.sent > out.expected
    report.control(caught)
    assert caught, out
