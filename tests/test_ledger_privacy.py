"""Payload privacy: arguments and results are encrypted at rest, per data subject, and
erasable; the plaintext never reaches the database files, the audit trail, or errors.

Canaries stand for personal data: a tax id and an IBAN. They are searched for in the raw
bytes of the SQLite files (database, WAL, shared memory; while open and after closing)
and in every value of every PostgreSQL table.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from onceonly.checkpoint import CorruptRecord, OnceOnlyError, Store
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectInDoubt,
    EffectInFlight,
    EffectStatus,
    Evidence,
    InvalidTransition,
    KeyReuseError,
    LeaseLost,
    Ledger,
    OutcomeClass,
    PayloadErased,
    ProviderClass,
    Replay,
)
from tests.dbutil import execute, fetch
from tests.ledger_support import (
    Clock,
    Ledgers,
    all_values,
    audit_rows,
    effect_row,
    ident,
    sqlite_path,
)

TAX_ID = "DE-CANARY-813377"
IBAN = "GB33BUKB20201555555555"
# Pieces that would betray the canaries in any plaintext or simple encoding of them.
NEEDLES = [TAX_ID, IBAN, "CANARY-813377", "BUKB20201555", "813377", "20201555555555"]


def needles_in(blob: bytes) -> list[str]:
    return [
        f"{n} ({enc[:12]!r}...)"
        for n in NEEDLES
        for enc in (n.encode(), n.encode("utf-16-le"), n.encode().hex().encode())
        if enc in blob
    ]


def needles_in_text(s: str) -> list[str]:
    return [n for n in NEEDLES if n in s]


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store)


def claimed(out: Claim | Replay) -> Claim:
    assert isinstance(out, Claim), out
    return out


ARGS: dict[str, Any] = {
    "vendor": {"tax_id": TAX_ID, "iban": IBAN, "name": "Canary GmbH"},
    "memo": f"pay {IBAN} for {TAX_ID}",
    "lines": [TAX_ID, (IBAN, 1)],
}
RESULT: dict[str, Any] = {"accepted": True, "echo": {"iban": IBAN}, "ref": f"{TAX_ID}/1"}


def record_everything(led: Ledger, clock: Clock) -> dict[str, str]:
    """Effects in every state, with the canaries in their arguments and results; and every
    error the ledger raises about them. Returns the key ids; the errors' text is checked
    here too."""
    keys: dict[str, str] = {}
    errors: list[OnceOnlyError] = []
    c = claimed(led.claim(ident(0), ARGS))
    led.commit(c, RESULT)
    keys["committed"] = c.key_id
    try:
        led.claim(ident(0), {**ARGS, "memo": f"other {IBAN}"})
    except KeyReuseError as exc:
        errors.append(exc)
    f = claimed(led.claim(ident(1), ARGS))
    led.fail(f, "Rejected", "refused", {"iban": IBAN})
    keys["failed"] = f.key_id
    u = claimed(led.claim(ident(2), ARGS, provider_class=ProviderClass.QUERYABLE))
    led.mark_unknown(u, "read timeout")
    keys["reconciled"] = u.key_id
    try:
        led.claim(ident(2), ARGS)
    except EffectInDoubt as exc:
        errors.append(exc)
    led.reconcile(u.key_id, Evidence.HAPPENED, result=RESULT)
    h = claimed(led.claim(ident(3), ARGS))
    led.mark_unknown(h)
    led.resolve(h.key_id, happened=True, evidence="seen", actor="alice", result=RESULT)
    keys["resolved"] = h.key_id
    live = claimed(led.claim(ident(4), ARGS))
    keys["live"] = live.key_id
    try:
        led.claim(ident(4), ARGS)
    except EffectInFlight as exc:
        errors.append(exc)
    r = claimed(led.claim(ident(5), ARGS))
    led.release(r)
    r2 = claimed(led.claim(ident(5), ARGS))
    led.commit(r2, RESULT)
    keys["resent"] = r.key_id
    try:
        led.commit(r, RESULT)
    except LeaseLost as exc:
        errors.append(exc)
    try:
        led.reconcile(c.key_id, Evidence.HAPPENED, result=RESULT)
    except InvalidTransition as exc:
        errors.append(exc)
    try:
        led.claim(ident(1), ARGS)
    except EffectFailed as exc:
        errors.append(exc)
    x = claimed(led.claim(ident(run=None, explicit="inv-7", effect="pay@1"), ARGS))
    led.commit(x, RESULT)
    keys["outside"] = x.key_id
    assert len(errors) == 6
    for err in errors:
        assert needles_in_text(str(err)) == [], (type(err).__name__, str(err))
        assert needles_in_text(repr(err)) == [], repr(err)
    return keys


def assert_no_plaintext_in_database(led: Ledger) -> None:
    values = all_values(led.store.engine)
    assert len(values) > 50
    leaks = []
    for table, v in values:
        if v is None:
            continue
        blob = bytes(v) if isinstance(v, bytes | memoryview) else str(v).encode()
        if found := needles_in(blob):
            leaks.append((table, found))
    assert leaks == []


def sqlite_files(db_url: str) -> list[Path]:
    path = sqlite_path(db_url)
    assert path is not None
    return [Path(path + s) for s in ("", "-wal", "-shm") if os.path.exists(path + s)]


def assert_no_plaintext_in_files(files: list[Path]) -> None:
    assert files
    for f in files:
        assert needles_in(f.read_bytes()) == [], f


def test_payloads_are_never_stored_in_plaintext(
    db_url: str, ledger: Ledger, ledgers: Ledgers, clock: Clock, store: Store
) -> None:
    keys = record_everything(ledger, clock)
    assert_no_plaintext_in_database(ledger)
    for chain in ("run-1", "tenant:acme"):
        for ev in ledger.audit_events(chain):
            for v in ev.values():
                blob = bytes(v) if isinstance(v, bytes) else str(v).encode()
                assert needles_in(blob) == [], ev
    if sqlite_path(db_url) is not None:
        assert any(f.name.endswith("-wal") for f in sqlite_files(db_url))
        assert_no_plaintext_in_files(sqlite_files(db_url))
        ledgers.close()
        store.close()
        assert_no_plaintext_in_files(sqlite_files(db_url))
        reopened = Ledgers(db_url, clock)
        try:
            assert reopened.fresh().payload(keys["committed"])["result"] == RESULT
        finally:
            reopened.close()


def test_payload_decrypts_for_the_ledger(ledger: Ledger, ledgers: Ledgers, clock: Clock) -> None:
    keys = record_everything(ledger, clock)
    for led in (ledger, ledgers.fresh()):
        p = led.payload(keys["committed"])
        # arguments come back in their canonical form (tuples stay tuples)
        assert p == {"args": ARGS, "result": RESULT, "error": None}
        failed = led.payload(keys["failed"])
        assert failed["result"] is None
        assert failed["error"] == {"type": "Rejected", "message": "refused", "info": {"iban": IBAN}}
        assert led.payload(keys["reconciled"])["result"] == RESULT
        assert led.payload(keys["resolved"])["result"] == RESULT
        assert led.payload(keys["live"]) == {"args": ARGS, "result": None, "error": None}
        assert led.payload(keys["outside"])["result"] == RESULT
    with pytest.raises(EffectFailed) as exc:
        ledgers.fresh().claim(ident(1), ARGS)
    assert exc.value.info == {"iban": IBAN}


def test_export_jsonl_has_no_payloads(ledger: Ledger, clock: Clock, tmp_path: Path) -> None:
    record_everything(ledger, clock)
    out = tmp_path / "effects.jsonl"
    assert ledger.export_jsonl(str(out)) == 7
    assert needles_in(out.read_bytes()) == []


def test_erase_makes_payloads_unreadable_but_keeps_deduplicating(
    ledger: Ledger, ledgers: Ledgers, clock: Clock, store: Store
) -> None:
    keys = record_everything(ledger, clock)
    other_run = claimed(ledger.claim(ident(0, run="run-2"), ARGS))
    ledger.commit(other_run, RESULT)
    before = {k: effect_row(store.engine, v) for k, v in keys.items()}

    assert ledger.erase("run-1") == 6
    for led in (ledger, ledgers.fresh()):
        for name in ("committed", "failed", "reconciled", "resolved", "live", "resent"):
            with pytest.raises(PayloadErased) as exc:
                led.payload(keys[name])
            assert exc.value.key_id == keys[name]
            assert exc.value.subject == "run-1"
        # the same call is still recognised: never performed again, never a new claim
        with pytest.raises(PayloadErased) as erased:
            led.claim(ident(0), ARGS)
        assert erased.value.key_id == keys["committed"]
        with pytest.raises(PayloadErased):
            led.perform(ident(0), ARGS, lambda c: pytest.fail("acted on an erased effect"))
        with pytest.raises(KeyReuseError):
            led.claim(ident(0), {"other": "arguments"})
        with pytest.raises(EffectInFlight):
            led.claim(ident(4), ARGS)
        # other subjects are untouched
        assert led.payload(other_run.key_id)["result"] == RESULT
        assert led.payload(keys["outside"])["result"] == RESULT
    for name, row in before.items():
        after = effect_row(store.engine, keys[name])
        for col in ("fingerprint", "status", "epoch", "provider_key", "key_id", "subject"):
            assert after[col] == row[col], (name, col)
    assert ledger.get(keys["committed"]).status is EffectStatus.COMMITTED
    [(wrapped,)] = fetch(store.engine, "SELECT wrapped FROM oo_data_keys WHERE subject = 'run-1'")
    assert wrapped is None
    assert ledger.verify().ok


def test_a_ciphertext_moved_to_another_entry_fails_authentication(
    ledger: Ledger, ledgers: Ledgers, clock: Clock, store: Store
) -> None:
    keys = record_everything(ledger, clock)
    e = store.engine
    [(result_ct, args_ct)] = fetch(
        e, "SELECT result_ct, args_ct FROM oo_effects WHERE key_id = :k", k=keys["resent"]
    )
    # entries of the same subject (same data key): only the binding of a ciphertext to its
    # entry and field stops the move
    execute(
        e,
        "UPDATE oo_effects SET result_ct = :v WHERE key_id = :k",
        v=bytes(result_ct),
        k=keys["committed"],
    )
    execute(
        e,
        "UPDATE oo_effects SET result_ct = :v WHERE key_id = :k",
        v=bytes(args_ct),
        k=keys["reconciled"],
    )
    trail = audit_rows(e)
    for led in (ledger, ledgers.fresh()):
        with pytest.raises(CorruptRecord):
            led.payload(keys["committed"])
        with pytest.raises(CorruptRecord):
            led.payload(keys["reconciled"])
        assert led.payload(keys["resent"])["result"] == RESULT
    # a new process replaying the moved result refuses it and acts on nothing
    with pytest.raises(CorruptRecord):
        ledgers.fresh().perform(ident(0), ARGS, lambda c: pytest.fail("acted"))
    assert audit_rows(e) == trail


def test_exception_text_of_a_failed_call_is_not_stored_in_plaintext(
    ledger: Ledger, ledgers: Ledgers, store: Store
) -> None:
    """Provider errors often quote the request (an IBAN in a refusal, a recipient in an
    SMTP error). What perform() records about a failed call is payload too: it must be
    encrypted like the error of fail(), and go with erase()."""

    def timeout(_c: Claim) -> str:
        raise TimeoutError(f"no answer for transfer to {IBAN}")

    def refused(_c: Claim) -> str:
        raise ConnectionRefusedError(f"refused before sending {TAX_ID}")

    with pytest.raises(TimeoutError):
        ledger.perform(ident(0), ARGS, timeout)
    with pytest.raises(ConnectionRefusedError):
        ledger.perform(ident(1), ARGS, refused, classify=lambda _e: OutcomeClass.NOT_SENT)
    assert ledger.get(ledger.key_id(ident(0))).status is EffectStatus.UNKNOWN
    assert ledger.get(ledger.key_id(ident(1))).status is EffectStatus.NOT_HAPPENED
    assert_no_plaintext_in_database(ledger)


def test_a_data_key_moved_to_another_subject_does_not_open(
    ledger: Ledger, ledgers: Ledgers, store: Store
) -> None:
    first = claimed(ledger.claim(ident(0), ARGS))
    ledger.commit(first, RESULT)
    second = claimed(ledger.claim(ident(0, run="run-2"), ARGS))
    ledger.commit(second, RESULT)
    [(wrapped,)] = fetch(store.engine, "SELECT wrapped FROM oo_data_keys WHERE subject = 'run-2'")
    execute(
        store.engine,
        "UPDATE oo_data_keys SET wrapped = :w WHERE subject = 'run-1'",
        w=bytes(wrapped),
    )
    fresh = ledgers.fresh()
    with pytest.raises(CorruptRecord):
        fresh.payload(first.key_id)
    assert fresh.payload(second.key_id)["result"] == RESULT


def test_effects_in_flight_when_their_subject_is_erased_can_still_finish(
    ledger: Ledger, ledgers: Ledgers, clock: Clock
) -> None:
    """Erasure keeps deduplication; it must not make the outcome of a call that was
    already sent unrecordable (the entry would stay in doubt forever)."""
    sent = claimed(ledger.claim(ident(0), ARGS))
    probed = claimed(ledger.claim(ident(1), ARGS))
    ledger.mark_unknown(probed, "timeout")
    operator = claimed(ledger.claim(ident(2), ARGS))
    ledger.mark_unknown(operator, "timeout")
    ledger.erase("run-1")

    assert ledger.commit(sent, RESULT).status is EffectStatus.COMMITTED
    rec = ledger.reconcile(probed.key_id, Evidence.HAPPENED, result=RESULT)
    assert not isinstance(rec, Claim)
    assert rec.status is EffectStatus.COMMITTED
    done = ledger.resolve(
        operator.key_id, happened=True, evidence="seen in portal", actor="alice", result=RESULT
    )
    assert done.status is EffectStatus.COMMITTED
    fresh = ledgers.fresh()
    for i, c in enumerate((sent, probed, operator)):
        with pytest.raises(PayloadErased):
            fresh.claim(ident(i), ARGS)
        with pytest.raises(PayloadErased):
            fresh.payload(c.key_id)
    assert fresh.verify().ok


DATA_KEY_EDITS = {
    "wrapped key flipped": (
        "UPDATE oo_data_keys SET wrapped = :w WHERE subject = 'run-1'",
        "does not open",
    ),
    "subject renamed": ("UPDATE oo_data_keys SET subject = 'run-9' WHERE subject = 'run-1'", None),
    "secret id edited": (
        "UPDATE oo_data_keys SET secret_id = 'k9' WHERE subject = 'run-1'",
        "not in the keyring",
    ),
    "row deleted": ("DELETE FROM oo_data_keys WHERE subject = 'run-1'", "is missing"),
}


@pytest.mark.parametrize("edit", sorted(DATA_KEY_EDITS))
def test_an_edited_data_key_is_found_by_verify_and_refused_not_read_as_erased(
    ledger: Ledger, ledgers: Ledgers, store: Store, edit: str
) -> None:
    """A data key is what opens a subject's payloads: an edited, moved or deleted one is a
    problem ``verify`` names, and reading a payload under it is a typed refusal, never
    ``PayloadErased`` (an erasure keeps its row, without the key)."""
    first = claimed(ledger.claim(ident(0), ARGS))
    ledger.commit(first, RESULT)
    other = claimed(ledger.claim(ident(0, run="run-2"), ARGS))
    ledger.commit(other, RESULT)
    assert ledger.verify().ok
    assert ledger.verify().data_keys == 2
    [(wrapped,)] = fetch(store.engine, "SELECT wrapped FROM oo_data_keys WHERE subject = 'run-1'")
    flipped = bytearray(bytes(wrapped))
    flipped[20] ^= 4
    sql, needle = DATA_KEY_EDITS[edit]
    assert execute(store.engine, sql, w=bytes(flipped)) == 1
    fresh = ledgers.fresh()
    report = fresh.verify()
    assert not report.ok
    assert all("data key of subject" in p for p in report.problems)
    assert any("'run-1'" in p and (needle is None or needle in p) for p in report.problems)
    # CorruptRecord; for a secret id the keyring does not hold, the ConfigurationError
    # that names it (the keyring may have lost a retired secret)
    with pytest.raises(OnceOnlyError) as refused:
        fresh.payload(first.key_id)
    assert not isinstance(refused.value, PayloadErased)
    assert fresh.payload(other.key_id)["result"] == RESULT


def test_an_erased_subject_verifies_and_reads_as_erased(ledger: Ledger, ledgers: Ledgers) -> None:
    first = claimed(ledger.claim(ident(0), ARGS))
    ledger.commit(first, RESULT)
    assert ledger.erase("run-1") == 1
    fresh = ledgers.fresh()
    report = fresh.verify()
    assert report.ok, report.problems
    assert report.data_keys == 1
    with pytest.raises(PayloadErased):
        fresh.payload(first.key_id)
