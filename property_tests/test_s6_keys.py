"""S6: keys (RELIABILITY.md, S6; invariant I5 and the privacy of keys).

* The same corpus of identities and arguments derives the same ledger keys, provider
  keys and fingerprints in 3 fresh processes with different ``PYTHONHASHSEED`` values
  and in this one.
* Canonical equivalences: dict order and unicode normalisation (NFC/NFD) never change a
  fingerprint; different canonical arguments always do.
* Domain separation: identities that differ in any field, explicit vs positional
  identities, and the four purposes (key, provider key, fingerprint, data-key wrapping)
  never collide.
* Reuse of a key with other arguments is refused (``KeyReuseError``) and nothing is
  sent; equivalent arguments replay; the counting provider is the oracle.
* No plaintext from a key without the secret: a dictionary attack over a small domain
  (4-digit tax ids) against stored fingerprints and provider keys fails without the
  secret and succeeds with it (so the attack is real). Positive control: a build whose
  fingerprint is an unkeyed hash must let the attack through, and the harness says so.

CI: ~2 000 hypothesis examples in all (deep: x20).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceonly.checkpoint import Codec, Store
from onceonly.ledger import (
    Claim,
    EffectIdentity,
    KeyRecipe,
    KeyReuseError,
    Keyring,
    Ledger,
    ProviderClass,
    Replay,
    Secret,
)
from onceonly.ledger.keys import canonical_args
from property_tests import s6_probe
from property_tests.reliability import SuiteReport, scaled, seeds
from property_tests.s1_support import CountingProvider
from tests.ledger_support import K1, K2, keyring

ROOT = Path(__file__).resolve().parents[1]
CORPUS = scaled(ci=300, deep=6000)
PURE = scaled(ci=500, deep=10_000)  # examples per pure property (x3 properties)
WITH_DB = scaled(ci=60, deep=1200)  # examples per backend of the reuse property
REPORT = SuiteReport(suite="S6", seeds=seeds(1))
RING = Keyring([K1, K2])
CODEC = Codec()


def _settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=REPORT.tier == "ci",
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[SuiteReport]:
    REPORT._started = time.monotonic()  # the suite's own wall time, not the session's
    yield REPORT
    REPORT.check()


def fp(args: Any, ring: Keyring = RING, sid: str = "k1") -> str:
    return ring.fingerprint(sid, canonical_args(args, CODEC))


# -- stability across processes and hash seeds ----------------------------------------------


def test_keys_are_stable_across_processes_and_hash_seeds(report: SuiteReport) -> None:
    seed = REPORT.seeds[0]
    here = s6_probe.derive(CORPUS, seed)
    orders = set()
    for hashseed in ("0", "4242", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        res = subprocess.run(
            [sys.executable, "-m", "property_tests.s6_probe", str(CORPUS), str(seed)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        there = json.loads(res.stdout)
        orders.add(tuple(there["order"]))
        mismatched = sum(a != b for a, b in zip(here["rows"], there["rows"], strict=True))
        report.add(runs=1, scenarios=CORPUS)
        assert mismatched == 0, (
            f"{mismatched} of {CORPUS} keys differ under PYTHONHASHSEED={hashseed}"
        )
    assert len(orders) > 1, "set order did not vary with the hash seed: the probe proves nothing"


# -- canonical equivalences -------------------------------------------------------------------

TEXT = st.text(alphabet=st.sampled_from("aeiouAé́ñ̃üÅΩ東ß ̈"), max_size=6)
LEAF = st.none() | st.booleans() | st.integers() | TEXT | st.binary(max_size=4)
VALUE = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)


def _respell(v: Any, form: Literal["NFC", "NFD"], flip: bool) -> Any:
    """The same value with strings in normal form ``form`` and dicts in reversed
    insertion order when ``flip``."""
    if type(v) is str:
        return unicodedata.normalize(form, v)
    if type(v) is dict:
        items = [(_respell(k, form, flip), _respell(x, form, flip)) for k, x in v.items()]
        return dict(reversed(items) if flip else items)
    if type(v) is list:
        return [_respell(x, form, flip) for x in v]
    return v


def _nfc_collides(v: Any) -> bool:
    """Whether a dict holds two keys that are one key after NFC (their merge is
    last-wins, so no respelling is equivalent)."""
    if type(v) is dict:
        keys = [unicodedata.normalize("NFC", k) if type(k) is str else k for k in v]
        return len(set(keys)) != len(keys) or any(_nfc_collides(x) for x in v.values())
    if type(v) is list:
        return any(_nfc_collides(x) for x in v)
    return False


@given(value=VALUE, form=st.sampled_from(["NFC", "NFD"]), flip=st.booleans())
@_settings(PURE)
def test_equivalent_spellings_fingerprint_alike(
    value: Any, form: Literal["NFC", "NFD"], flip: bool
) -> None:
    if _nfc_collides(value):
        return
    other = _respell(value, form, flip)
    try:
        base = fp(_respell(value, "NFC", flip=False))
    except Exception:  # noqa: BLE001  (two keys that are equal after NFC: not encodable)
        return
    assert fp(other) == base
    REPORT.add(scenarios=1)


@given(a=VALUE, b=VALUE)
@_settings(PURE)
def test_different_arguments_fingerprint_differently(a: Any, b: Any) -> None:
    ca = canonical_args(a, CODEC)
    cb = canonical_args(b, CODEC)
    assert (ca == cb) == (RING.fingerprint("k1", ca) == RING.fingerprint("k1", cb))
    REPORT.add(scenarios=1)


# -- domain separation ------------------------------------------------------------------------

PART = st.text(max_size=8)
IDENT = st.builds(
    EffectIdentity,
    tenant=PART,
    run_id=st.none() | PART,
    step_id=st.none() | PART,
    step_visit=st.integers(0, 3),
    effect=PART,
    ordinal=st.integers(0, 3),
    explicit=st.none() | PART,
)


@given(a=IDENT, b=IDENT)
@_settings(PURE)
def test_distinct_identities_and_purposes_never_collide(
    a: EffectIdentity, b: EffectIdentity
) -> None:
    ka, kb = RING.key_id("k1", a.parts()), RING.key_id("k1", b.parts())
    assert (ka == kb) == (a.parts() == b.parts())
    # another secret, another key; provider key and fingerprint live in other domains
    assert RING.key_id("k2", a.parts()) != ka
    pk = RING.provider_key("k1", ka)
    assert pk != RING.provider_key("k2", ka)
    assert pk[3:] != ka[: len(pk) - 3]
    raw = bytes.fromhex(ka)
    domains = {
        ka,
        RING.fingerprint("k1", raw),
        RING.subkey("k1", "kek").hex(),
        blake3.blake3(raw).hexdigest(),
    }
    assert len(domains) == 4
    REPORT.add(scenarios=1)


# -- reuse with another payload is refused -----------------------------------------------------


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    store = Store.open(db_url)
    led = Ledger(store, keyring(), owner="s6")
    try:
        yield led
    finally:
        led.close()
        store.close()


def test_reuse_with_another_payload_is_refused(ledger: Ledger, report: SuiteReport) -> None:
    provider = CountingProvider()
    counter = iter(range(10**9))
    sends = 0

    @given(a=VALUE, b=VALUE, form=st.sampled_from(["NFC", "NFD"]))
    @_settings(WITH_DB)
    def prop(a: Any, b: Any, form: Literal["NFC", "NFD"]) -> None:
        nonlocal sends
        n = next(counter)
        ident = EffectIdentity("acme", "run-s6", "step", 0, "send@1", n)

        def act(claim: Claim) -> str:
            return provider.send(claim.provider_key, a)

        if _nfc_collides(a):
            return
        first = ledger.perform(ident, {"v": a}, act, provider_class=ProviderClass.QUERYABLE)
        sends += 1
        # an equivalent spelling replays; nothing is sent
        assert ledger.perform(ident, {"v": _respell(a, form, flip=True)}, act) == first
        same = canonical_args({"v": a}, CODEC) == canonical_args({"v": b}, CODEC)
        if same:
            out = ledger.claim(ident, {"v": b})
            assert isinstance(out, Replay)
        else:
            with pytest.raises(KeyReuseError):
                ledger.perform(ident, {"v": b}, act)
        report.add(scenarios=1, effects=1)

    prop()
    report.add(raw_deliveries=len(provider.raw), duplicates=provider.duplicates())
    assert len(provider.raw) == sends, "a replay or a refused reuse reached the provider"


# -- no plaintext from a key without the secret ------------------------------------------------

DOMAIN = [f"DE{n:04d}" for n in range(10_000)]


def _attack(target_fp: str, target_pk: str, ring: Keyring | None) -> str | None:
    """A dictionary attack over every 4-digit tax id: with ``ring`` (the secret), by
    recomputing keyed values; without it, by every unkeyed derivation an attacker could
    try (plain blake3 of the canonical bytes, of the recipe's explicit key, and keyed
    derivations under a guessed secret)."""
    guess = Keyring([Secret("k1", bytes(32))])
    recipe = KeyRecipe(("tax_id",))
    for tax in DOMAIN:
        args = {"tax_id": tax}
        canonical = canonical_args(args, CODEC)
        explicit = recipe.explicit_key(args, CODEC)
        ident = EffectIdentity("acme", None, None, 0, "file@1", 0, explicit)
        if ring is not None:
            kid = ring.key_id("k1", ident.parts())
            if ring.fingerprint("k1", canonical) == target_fp:
                return tax
            if ring.provider_key("k1", kid) == target_pk:
                return tax
            continue
        candidates = {
            blake3.blake3(canonical).hexdigest(),
            blake3.blake3(explicit.encode()).hexdigest(),
            guess.fingerprint("k1", canonical),
            guess.provider_key("k1", guess.key_id("k1", ident.parts())),
        }
        if target_fp in candidates or target_pk in candidates:
            return tax
    return None


def _stored(ring: Keyring, tax: str) -> tuple[str, str]:
    """What the ledger stores and sends for a recipe-keyed call on ``tax``."""
    args = {"tax_id": tax}
    explicit = KeyRecipe(("tax_id",)).explicit_key(args, CODEC)
    ident = EffectIdentity("acme", None, None, 0, "file@1", 0, explicit)
    kid = ring.key_id("k1", ident.parts())
    return ring.fingerprint("k1", canonical_args(args, CODEC)), ring.provider_key("k1", kid)


def test_no_plaintext_is_recoverable_without_the_secret(report: SuiteReport) -> None:
    ring = Keyring([K1])
    for tax in ("DE0000", "DE4711", "DE9999")[: scaled(ci=2, deep=3)]:
        target_fp, target_pk = _stored(ring, tax)
        assert _attack(target_fp, target_pk, None) is None, "recovered without the secret"
        assert _attack(target_fp, target_pk, ring) == tax, "the attack itself does not work"
        report.add(scenarios=1, detected=1)


def test_control_an_unkeyed_fingerprint_is_caught(
    report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken build: fingerprints are a bare hash of the arguments."""
    monkeypatch.setattr(
        Keyring, "fingerprint", lambda self, sid, canonical: blake3.blake3(canonical).hexdigest()
    )
    ring = Keyring([K1])
    target_fp, target_pk = _stored(ring, "DE4711")
    caught = _attack(target_fp, target_pk, None) == "DE4711"
    report.control(caught)
    assert caught, "the harness did not notice an unkeyed fingerprint"


def test_control_a_seed_dependent_key_is_caught(
    report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken build: the identity is hashed with Python's ``hash`` (seeded per
    process). The cross-process comparison must notice."""
    seed = REPORT.seeds[0]
    here = s6_probe.derive(20, seed)
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    code = (
        "import json, sys\n"
        "from onceonly.ledger import keys\n"
        "orig = keys.Keyring.key_id\n"
        "keys.Keyring.key_id = lambda self, sid, parts: orig(self, sid, (hash(parts),))\n"
        "from property_tests import s6_probe\n"
        f"print(json.dumps(s6_probe.derive(20, {seed})))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    there = json.loads(res.stdout)
    caught = here["rows"] != there["rows"]
    report.control(caught)
    assert caught
    _ = K2  # both golden secrets are exercised by the probe's ring
