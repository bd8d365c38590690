"""S8: corruption and tamper (RELIABILITY.md, S8; invariant I4).

A store is populated with effects in every state (committed, failed, re-sent,
reconciled, resolved, unknown, a live claim, one outside a run, one in another run) and
checkpoints with blobs, and a witness of its audit heads is exported. Then, each case
on a fresh copy of that store:

* **bit flips** at random positions of stored blobs, checkpoint bodies and digests,
  effect rows (ciphertexts, fingerprints, provider keys, status, step) and audit events
  (hashes, links, row digests, details) — CI: 150 positions per backend; deep: 2 000;
* **structured tampers**: every tamper of ``tests/test_ledger_audit.py`` (edit, delete,
  swap, duplicate, forge, move between runs), plus truncations, reordered and moved
  checkpoints, and the audit head rolled back (checked against the witness).

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

from checkpoint import OnceOnlyError, Store
from ledger import (
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
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "oo_blobs": (("hash",), ("data", "hash"), ()),
    "oo_checkpoints": (("run_id", "seq"), ("body", "digest"), ("step",)),
    "oo_effects": (
        ("key_id",),
        ("args_ct", "result_ct", "error_ct"),
        ("fingerprint", "provider_key", "status", "step_id", "effect"),
    ),
    "oo_audit": (("chain", "seq"), ("hash", "prev_hash", "row_digest"), ("detail", "actor")),
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
    outcomes = []
    for _ in range(FLIPS):
        table, col, key, length, binary = rng.choices(cells, weights)[0]
        pos, bit = rng.randrange(length), rng.randrange(8 if binary else 5)
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


# -- positive controls ------------------------------------------------------------------------


@pytest.mark.slow
def test_control_a_ledger_without_its_row_check_is_caught(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Bench(f"sqlite:///{tmp_path / 'control.db'}", tmp_path)
    try:
        monkeypatch.setattr(Ledger, "_check_row", lambda self, cur, row: None)
        monkeypatch.setattr(Ledger, "_check_absent", lambda self, cur, chain, ids: None)
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
