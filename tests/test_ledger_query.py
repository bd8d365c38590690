"""Reading the ledger: filters, export, lookup, prefetch, and the ledger's schema version."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect

from onceonly.checkpoint import SchemaVersionError, Store
from onceonly.ledger import (
    Claim,
    EffectRecord,
    EffectStatus,
    Ledger,
    Replay,
    RetentionPolicy,
    UnknownEffect,
)
from tests.dbutil import execute, fetch
from tests.ledger_support import Clock, Ledgers, ident, keyring


@pytest.fixture
def clock() -> Clock:
    return Clock(1_800_000_000.0)


@pytest.fixture
def ledgers(db_url: str, clock: Clock) -> Iterator[Ledgers]:
    lg = Ledgers(db_url, clock)
    try:
        yield lg
    finally:
        lg.close()


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store)


def claimed(out: Claim | Replay) -> Claim:
    assert isinstance(out, Claim), out
    return out


T0 = 1_800_000_000.0


def populate(led: Ledger, clock: Clock) -> dict[str, str]:
    """Five entries, updated 10 s apart (at T0 + 0, 10, 20, 30, 40)."""
    keys = {}
    c = claimed(led.claim(ident(0), {"n": 0}))
    led.commit(c, "zero")
    keys["committed"] = c.key_id
    clock.advance(10)
    c = claimed(led.claim(ident(1), {"n": 1}))
    led.fail(c, "E", "no")
    keys["failed"] = c.key_id
    clock.advance(10)
    c = claimed(led.claim(ident(0, run="run-2"), {"n": 2}))
    led.mark_unknown(c)
    keys["unknown"] = c.key_id
    clock.advance(10)
    c = claimed(led.claim(ident(0, effect="send_sms@1"), {"n": 3}))
    keys["claimed"] = c.key_id
    clock.advance(10)
    c = claimed(led.claim(ident(run=None, explicit="inv-1", effect="charge@1"), {"n": 4}))
    led.commit(c, "charged")
    keys["outside"] = c.key_id
    return keys


def ids(recs: list[EffectRecord]) -> list[str]:
    return [r.key_id for r in recs]


def test_effects_filters(ledger: Ledger, ledgers: Ledgers, clock: Clock) -> None:
    k = populate(ledger, clock)
    newest_first = [k["outside"], k["claimed"], k["unknown"], k["failed"], k["committed"]]
    for led in (ledger, ledgers.fresh()):
        assert ids(led.effects()) == newest_first
        assert [r.updated_at for r in led.effects()] == [T0 + 40, T0 + 30, T0 + 20, T0 + 10, T0]
        assert ids(led.effects(run_id="run-1")) == [k["claimed"], k["failed"], k["committed"]]
        assert ids(led.effects(run_id="run-2")) == [k["unknown"]]
        assert ids(led.effects(run_id="run-3")) == []
        assert ids(led.effects(status=EffectStatus.COMMITTED)) == [k["outside"], k["committed"]]
        assert ids(led.effects(status="unknown")) == [k["unknown"]]
        assert ids(led.effects(status=EffectStatus.NEEDS_HUMAN)) == []
        assert ids(led.effects(effect="send_sms@1")) == [k["claimed"]]
        assert ids(led.effects(effect="charge@1")) == [k["outside"]]
        assert ids(led.effects(since=T0 + 10)) == newest_first[:4]
        assert ids(led.effects(until=T0 + 20)) == [k["failed"], k["committed"]]
        assert ids(led.effects(since=T0 + 10, until=T0 + 30)) == [k["unknown"], k["failed"]]
        assert ids(led.effects(limit=2)) == newest_first[:2]
        assert ids(led.effects(limit=0)) == []
        assert ids(led.effects(run_id="run-1", limit=1)) == [k["claimed"]]
        assert ids(led.effects(run_id="run-1", status="committed")) == [k["committed"]]
        assert ids(led.effects(run_id="run-1", status="unknown")) == []
        assert ids(led.effects(status="committed", since=T0 + 1)) == [k["outside"]]
    with pytest.raises(ValueError, match="bogus"):
        ledger.effects(status="bogus")


def test_export_jsonl_writes_metadata_only(ledger: Ledger, clock: Clock, tmp_path: Path) -> None:
    k = populate(ledger, clock)
    out = tmp_path / "effects.jsonl"
    assert ledger.export_jsonl(str(out)) == 5
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    fields = {f.name for f in dataclasses.fields(EffectRecord)}
    assert [d["key_id"] for d in lines] == ids(ledger.effects())
    for d in lines:
        assert set(d) == fields
        rec = ledger.get(d["key_id"])
        assert d["status"] == rec.status.value
        assert d["provider_class"] == rec.provider_class.value
        assert d["outcome_class"] == (
            None if rec.outcome_class is None else rec.outcome_class.value
        )
        assert d["epoch"] == rec.epoch
        assert d["fingerprint"] == rec.fingerprint
        assert d["updated_at"] == rec.updated_at
    text = out.read_text()
    for secret_bearing in ("args", "result", "error", "_ct", "zero", "charged"):
        assert f'"{secret_bearing}' not in text
    # appends, and passes filters through
    assert ledger.export_jsonl(str(out), run_id="run-1", status="committed") == 1
    lines = out.read_text().splitlines()
    assert len(lines) == 6
    assert json.loads(lines[-1])["key_id"] == k["committed"]


def test_get_and_unknown_effect(ledger: Ledger, ledgers: Ledgers, clock: Clock) -> None:
    k = populate(ledger, clock)
    for led in (ledger, ledgers.fresh()):
        by_id = {r.key_id: r for r in led.effects()}
        for key in k.values():
            assert led.get(key) == by_id[key]
        rec = led.get(k["failed"])
        assert (rec.status, rec.run_id, rec.step_id, rec.effect) == (
            EffectStatus.FAILED,
            "run-1",
            "notify",
            "send_email@1",
        )
        assert rec.created_at == rec.updated_at == T0 + 10
        missing = "0" * 64
        with pytest.raises(UnknownEffect) as exc:
            led.get(missing)
        assert exc.value.key_id == missing
        assert missing in str(exc.value)
        with pytest.raises(UnknownEffect):
            led.payload(missing)


def test_prefetch_loads_a_runs_finished_effects(
    ledger: Ledger, ledgers: Ledgers, clock: Clock, store: Store
) -> None:
    k = populate(ledger, clock)
    extra = claimed(ledger.claim(ident(5), {"n": 5}))
    ledger.commit(extra, "five")
    other = ledgers.fresh()
    assert other.prefetch("run-1") == 3  # committed, failed, extra; not the live claim
    assert other.prefetch("run-2") == 0  # unknown only
    assert other.prefetch("no-such-run") == 0
    out = other.claim(ident(5), {"n": 5})
    assert isinstance(out, Replay)
    assert out.result == "five"
    assert other.payload(k["committed"])["result"] == "zero"
    # an effect finished after a prefetch is read from the database, not missed
    live = claimed(ledger.claim(ident(6), {"n": 6}))
    late = ledgers.fresh()
    assert late.prefetch("run-1") == 3
    ledger.commit(live, "six")
    out = late.claim(ident(6), {"n": 6})
    assert isinstance(out, Replay)
    assert out.result == "six"
    assert late.prefetch("run-1") == 4


# -- schema -------------------------------------------------------------------------------


def ledger_version(store: Store) -> int | None:
    rows = fetch(store.engine, "SELECT version FROM onceonly_schema WHERE component = 'ledger'")
    return int(rows[0][0]) if rows else None


def test_the_ledger_creates_its_schema_once(store: Store, ledgers: Ledgers) -> None:
    assert not inspect(store.engine).has_table("oo_effects")
    assert ledger_version(store) is None
    with pytest.raises(SchemaVersionError) as exc:
        Ledger(store, keyring(), create=False)
    assert (exc.value.component, exc.value.found) == ("ledger", 0)
    assert "migrate" in str(exc.value)
    assert not inspect(store.engine).has_table("oo_effects")

    first = ledgers.on(store)
    version = ledger_version(store)
    assert version is not None
    assert version >= 1
    assert exc.value.expected == version
    for table in ("oo_effects", "oo_audit", "oo_data_keys"):
        assert inspect(store.engine).has_table(table), table
    first.commit(claimed(first.claim(ident(), 1)), "kept")
    # opening again (create or not) neither re-creates nor loses anything
    again = ledgers.fresh(create=False)
    out = again.claim(ident(), 1)
    assert isinstance(out, Replay)
    assert out.result == "kept"
    assert ledger_version(store) == version


@pytest.mark.parametrize("delta", [1, 5, -1])
def test_a_recorded_version_other_than_this_codes_is_refused(
    store: Store, ledgers: Ledgers, delta: int
) -> None:
    led = ledgers.on(store)
    led.commit(claimed(led.claim(ident(), 1)), "kept")
    version = ledger_version(store)
    assert version is not None
    execute(
        store.engine,
        "UPDATE onceonly_schema SET version = :v WHERE component = 'ledger'",
        v=version + delta,
    )
    for create in (True, False) if delta > 0 else (False,):
        with pytest.raises(SchemaVersionError) as exc:
            ledgers.fresh(create=create)
        assert exc.value.component == "ledger"
        assert (exc.value.found, exc.value.expected) == (version + delta, version)
        assert ("newer" in str(exc.value)) is (delta > 0)
    # the checkpoint store itself is unaffected, and nothing of the ledger was touched
    assert ledgers.store().list_runs() == []
    assert ledger_version(store) == version + delta
    assert fetch(store.engine, "SELECT count(*) FROM oo_effects") == [(1,)]


# -- reads of one moment -------------------------------------------------------------------


def _after_first_read(led: Ledger, monkeypatch: pytest.MonkeyPatch, act: Any) -> None:
    """Run ``act`` (another process's write, committed) right after ``led``'s next store
    read returns, once: whatever a lookup reads in a later transaction sees it."""
    read = led.store.read
    done: list[bool] = []

    def racing(fn: Any) -> Any:
        out = read(fn)
        if not done:
            done.append(True)
            act()
        return out

    monkeypatch.setattr(led.store, "read", racing)


def test_get_reads_a_row_and_its_trail_of_one_moment(
    ledger: Ledger, ledgers: Ledgers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry another worker records an outcome for while it is looked up reads as it
    was or as it is, never as a row that differs from its audit trail ("diverged")."""
    claim = claimed(ledger.claim(ident(0), {"n": 0}))
    reader = ledgers.fresh()
    _after_first_read(reader, monkeypatch, lambda: ledger.commit(claim, "zero"))
    rec = reader.get(claim.key_id)
    assert rec.integrity == "ok"
    assert rec.status in (EffectStatus.CLAIMED, EffectStatus.COMMITTED)
    again = ledgers.fresh().get(claim.key_id)
    assert (again.status, again.integrity) == (EffectStatus.COMMITTED, "ok")


def test_replay_during_a_correction_is_either_result_never_tampering(
    ledger: Ledger, ledgers: Ledgers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator correcting a finished entry's result while another process replays
    it: the replay gives the old result or the new one, not a CorruptRecord."""
    claim = claimed(ledger.claim(ident(0), {"n": 0}))
    ledger.mark_unknown(claim)
    ledger.resolve(claim.key_id, happened=True, result="r1", evidence="portal", actor="ops")
    reader = ledgers.fresh()
    _after_first_read(
        reader,
        monkeypatch,
        lambda: ledger.correct(claim.key_id, result="r2", evidence="invoice", actor="ops"),
    )
    assert reader.replay(claim.key_id).result in ("r1", "r2")
    assert ledgers.fresh().replay(claim.key_id).result == "r2"


def test_replay_during_retention_is_the_outcome_or_unknown_never_tampering(
    ledger: Ledger, ledgers: Ledgers, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention removing a finished entry (its run gone) while another process replays
    it: the replay gives the recorded outcome or UnknownEffect, not a CorruptRecord."""
    claim = claimed(ledger.claim(ident(run=None, explicit="inv-9", effect="charge@1"), {"n": 9}))
    ledger.commit(claim, "charged")
    clock.advance(3600)
    reader = ledgers.fresh()
    removed: list[int] = []
    _after_first_read(
        reader,
        monkeypatch,
        lambda: removed.append(ledger.apply_retention(RetentionPolicy(older_than_s=60))),
    )
    try:
        out = reader.replay(claim.key_id)
    except UnknownEffect:
        pass
    else:
        assert out.result == "charged"
    assert removed == [1]
    with pytest.raises(UnknownEffect):
        ledgers.fresh().replay(claim.key_id)
