"""Effect identity: keyed idempotency keys, provider keys and argument fingerprints.

Keys must be the same in every process, hash seed and release (I5), separate every
identity field, never be an unkeyed hash of the arguments, and survive secret rotation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import blake3
import pytest

from onceonly.checkpoint import Codec, ConfigurationError, Store
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectIdentity,
    EffectInDoubt,
    EffectInFlight,
    KeyRecipe,
    KeyReuseError,
    Keyring,
    Ledger,
    Replay,
    Secret,
)
from onceonly.ledger.keys import canonical_args
from tests.dbutil import fetch
from tests.ledger_support import K1, K2, Ledgers, audit_rows, effect_row, ident

ROOT = Path(__file__).resolve().parents[1]

# Golden values for K1/K2 below. They pin the derivation across releases: if one of these
# changes, every stored effect's key changes with it and resumed runs would re-fire.
POSITION = EffectIdentity("acme", "run-1", "notify", 0, "send_email@1", 0)
EXPLICIT = EffectIdentity("acme", None, None, 0, "charge@2", 0, "invoice-4711")
ARGS: dict[str, Any] = {"to": "müller@example.com", "amount": 12, "items": [1, 2, (3, 4)]}
GOLDEN = {
    "k1": {
        "position": (
            "3bc4f0d1ff15adcc7bb5ef872e07648a1d63aa61d78220c0813f14af9c94fa6e",
            "oo-f1ff582e587a447813ef4995638f407966625e5132120d03",
        ),
        "explicit": (
            "e99e596c80f4a34a2460d680b80e786332281e74db3f502b5d9858c7d97e01ab",
            "oo-98d6791cdf7e13a4fc5c89b5ca55594388eaa5c744d0ff22",
        ),
        "fingerprint": "d3b8f4eb578394a85f68be814a54c76fa2cf9ffdb57658f768b56284cf5d4432",
    },
    "k2": {
        "position": (
            "35489b2852e68a49f9fae54a85c317428def8af7890efd5318fe09aa934c7759",
            "oo-c243463abb9278cce03701988f0d5145f6173d1b8b215907",
        ),
        "explicit": (
            "0894b89494439d62a0195d7308bf1d14d5ccdd379f7bb9a76527074c9bfee845",
            "oo-3d49371af78d93481815dd644b427801348b68276f8af9e5",
        ),
        "fingerprint": "d6a9b4fe0499e0c61f481b4ee935f5b498f7b1b3dd9fc37274ecca9e6b794a95",
    },
}

# Run in a fresh interpreter: derive keys and fingerprints of values whose in-memory
# order depends on the hash seed (sets, dicts built from sets).
PROBE = r"""
import json
from onceonly.checkpoint import Codec
from onceonly.ledger import EffectIdentity, Keyring, Secret
from onceonly.ledger.keys import canonical_args

ring = Keyring([Secret("k1", bytes(range(32))), Secret("k2", bytes(range(100, 148)))])
ids = {
    "position": EffectIdentity("acme", "run-1", "notify", 0, "send_email@1", 0),
    "explicit": EffectIdentity("acme", None, None, 0, "charge@2", 0, "invoice-4711"),
}
words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
seeded = {"tags": set(words), "frozen": frozenset(words), "map": {w: len(w) for w in set(words)}}
args = {"to": "müller@example.com", "amount": 12, "items": [1, 2, (3, 4)]}
out = {}
for sid in ("k1", "k2"):
    d = {}
    for name, ident in ids.items():
        kid = ring.key_id(sid, ident.parts())
        d[name] = [kid, ring.provider_key(sid, kid)]
    d["fingerprint"] = ring.fingerprint(sid, canonical_args(args, Codec()))
    d["seeded"] = ring.fingerprint(sid, canonical_args(seeded, Codec()))
    out[sid] = d
print(json.dumps({"order": list(set(words)), "keys": out}))
"""


def probe(hashseed: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def ring() -> Keyring:
    return Keyring([K1, K2])


def fp(args: Any, sid: str = "k1", keys: Keyring | None = None) -> str:
    return (keys or ring()).fingerprint(sid, canonical_args(args, Codec()))


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store)


# -- stability ---------------------------------------------------------------------------


def test_keys_are_the_same_in_every_process_hash_seed_and_release() -> None:
    runs = {seed: probe(seed) for seed in ("0", "1", "4242", "random")}
    orders = {tuple(r["order"]) for r in runs.values()}
    assert len(orders) > 1, "the probe's set order did not vary with the hash seed"
    keys = [r["keys"] for r in runs.values()]
    assert all(k == keys[0] for k in keys)
    for sid, golden in GOLDEN.items():
        got = keys[0][sid]
        assert tuple(got["position"]) == golden["position"]
        assert tuple(got["explicit"]) == golden["explicit"]
        assert got["fingerprint"] == golden["fingerprint"]
        # and this process agrees
        r = ring()
        kid = r.key_id(sid, POSITION.parts())
        assert (kid, r.provider_key(sid, kid)) == golden["position"]
        assert fp(ARGS, sid) == golden["fingerprint"]
        words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
        seeded = {
            "tags": set(words),
            "frozen": frozenset(words),
            "map": {w: len(w) for w in reversed(words)},
        }
        assert fp(seeded, sid) == got["seeded"]


def test_the_ledger_stores_the_stable_key_and_fingerprint(ledger: Ledger) -> None:
    c = ledger.claim(POSITION, ARGS)
    assert isinstance(c, Claim)
    rec = ledger.get(c.key_id)
    assert (rec.key_id, rec.provider_key) == GOLDEN["k1"]["position"]
    assert rec.fingerprint == GOLDEN["k1"]["fingerprint"]
    assert rec.secret_id == K1.id
    assert c.provider_key == GOLDEN["k1"]["position"][1]
    e = ledger.claim(EXPLICIT, {"amount": 1})
    assert isinstance(e, Claim)
    assert (e.key_id, e.provider_key) == GOLDEN["k1"]["explicit"]


# -- domain separation -----------------------------------------------------------------------


def test_every_identity_field_separates_keys() -> None:
    base: dict[str, Any] = {
        "tenant": "acme",
        "run_id": "run-1",
        "step_id": "notify",
        "step_visit": 0,
        "effect": "send_email@1",
        "ordinal": 0,
    }
    variants: list[EffectIdentity] = [EffectIdentity(**base)]
    changes: list[dict[str, Any]] = [
        {"tenant": "globex"},
        {"run_id": "run-2"},
        {"run_id": None},
        {"run_id": "None"},
        {"run_id": ""},
        {"step_id": "notify2"},
        {"step_id": None},
        {"step_visit": 1},
        {"effect": "send_email@2"},
        {"effect": "send_sms@1"},
        {"ordinal": 1},
        {"explicit": "x"},
        {"explicit": "y"},
        {"explicit": ""},
        # a field boundary moved: length prefixes keep these apart
        {"run_id": "run-1n", "step_id": "otify"},
        {"tenant": "acmerun-1", "run_id": ""},
        # an integer field vs the same digits as text in the neighbouring field
        {"step_id": "notify0", "step_visit": 0, "ordinal": 0},
    ]
    variants += [EffectIdentity(**{**base, **c}) for c in changes]
    r = ring()
    for sid in ("k1", "k2"):
        keys = [r.key_id(sid, v.parts()) for v in variants]
        assert len(set(keys)) == len(variants), sid
        pks = [r.provider_key(sid, k) for k in keys]
        assert len(set(pks)) == len(pks)
        for k, pk in zip(keys, pks, strict=True):
            assert pk.startswith("oo-")
            assert len(pk) == 51
            assert pk[3:] not in k
            assert k[:48] != pk[3:]
    # the same identity under two secrets: different keys, provider keys and fingerprints
    k1 = r.key_id("k1", variants[0].parts())
    k2 = r.key_id("k2", variants[0].parts())
    assert k1 != k2
    assert r.provider_key("k1", k1) != r.provider_key("k2", k2)
    assert fp(ARGS, "k1") != fp(ARGS, "k2")
    assert fp(ARGS, "k1") not in (k1, k2)


def test_a_fingerprint_is_no_dictionary_oracle() -> None:
    """Without the secret, a fingerprint cannot be recomputed from guessed arguments."""
    guess = {"tax_id": "DE-000000001"}
    canonical = canonical_args(guess, Codec())
    unkeyed = {blake3.blake3(canonical).hexdigest(), blake3.blake3(b"").hexdigest()}
    assert fp(guess) not in unkeyed
    other = Keyring([Secret("k1", b"\x00" * 32)])
    assert fp(guess) != fp(guess, keys=other)


def test_identity_parts_must_be_text_or_integers() -> None:
    r = ring()
    for bad in (1.5, b"bytes", True, ["list"]):
        with pytest.raises(ConfigurationError):
            r.key_id("k1", ("position", "acme", bad))
        with pytest.raises(ConfigurationError):  # before the last part
            r.key_id("k1", ("position", bad, "x"))
    # 1 and True are equal (as keys of a memo too): only the int is a part
    r.key_id("k1", ("position", 1, "x"))
    with pytest.raises(ConfigurationError):
        r.key_id("k1", ("position", True, "x"))


def test_a_key_id_is_the_keyed_hash_of_the_whole_encoding_whatever_came_before() -> None:
    """key_id continues a kept hash of all parts but the last: every key it gives, in any
    order of identities (shared heads, new heads past the kept few, both secrets), is
    the keyed blake3 of the identity's whole encoding."""
    import random

    from onceonly.ledger.keys import _encode_parts

    r = ring()
    rng = random.Random(5)
    for _ in range(3000):
        sid = rng.choice(["k1", "k2"])
        parts = (
            "position",
            "acme",
            f"run-{rng.randrange(100)}",
            rng.choice(["a", "b", "é", ""]),
            rng.randrange(3),
            "send@1",
            rng.randrange(-2, 10**6),
        )[: rng.choice([7, 7, 7, 2, 1])]
        expect = blake3.blake3(_encode_parts(parts), key=r.subkey(sid, "key")).hexdigest()
        assert r.key_id(sid, parts) == expect, parts
        assert r.key_id(sid, list(parts)) == expect, parts


# -- canonical arguments -----------------------------------------------------------------------


def test_equivalent_arguments_fingerprint_alike() -> None:
    nfc = unicodedata.normalize("NFC", "Müller Straße, Zoë")
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfc != nfd
    pairs: list[tuple[Any, Any]] = [
        ({"a": 1, "b": 2, "c": {"x": 1, "y": 2}}, {"c": {"y": 2, "x": 1}, "b": 2, "a": 1}),
        ({"name": nfc}, {"name": nfd}),
        ({nfc: "key"}, {nfd: "key"}),
        ([nfc, (nfc, 1)], [nfd, (nfd, 1)]),
        ({"deep": [{"k": [nfc]}]}, {"deep": [{"k": [nfd]}]}),
        ({"s": {3, 1, 2}}, {"s": {2, 3, 1}}),
    ]
    for a, b in pairs:
        assert fp(a) == fp(b), (a, b)


def test_different_arguments_fingerprint_differently() -> None:
    pairs: list[tuple[Any, Any]] = [
        ({"a": 1}, {"a": 2}),
        ({"a": 1}, {"a": "1"}),
        ({"a": 1}, {"a": 1.0}),
        ({"a": 1}, {"a": True}),
        ({"a": [1, 2]}, {"a": (1, 2)}),
        ({"a": [1, 2]}, {"a": [2, 1]}),
        ({"a": None}, {}),
        ({"name": "Muller"}, {"name": "Müller"}),
    ]
    for a, b in pairs:
        assert fp(a) != fp(b), (a, b)


def test_equivalent_arguments_replay_and_changed_ones_are_refused(
    ledger: Ledger, ledgers: Ledgers, store: Store
) -> None:
    nfc = unicodedata.normalize("NFC", "Zoë Müller")
    nfd = unicodedata.normalize("NFD", nfc)
    c = ledger.claim(ident(), {"to": nfc, "cc": ["a", "b"], "amount": 12})
    assert isinstance(c, Claim)
    ledger.commit(c, "sent")
    for led in (ledger, ledgers.fresh()):
        out = led.claim(ident(), {"amount": 12, "cc": ["a", "b"], "to": nfd})
        assert isinstance(out, Replay)
        assert out.result == "sent"
    row, trail = effect_row(store.engine, c.key_id), audit_rows(store.engine)
    for led in (ledger, ledgers.fresh()):
        for changed in (
            {"to": nfc, "cc": ["a", "b"], "amount": 13},
            {"to": nfc, "cc": ["b", "a"], "amount": 12},
            {"to": nfc, "amount": 12},
        ):
            with pytest.raises(KeyReuseError) as exc:
                led.claim(ident(), changed)
            assert exc.value.key_id == c.key_id
            assert exc.value.effect == "send_email@1"
    assert effect_row(store.engine, c.key_id) == row
    assert audit_rows(store.engine) == trail


def test_key_reuse_is_refused_for_an_effect_in_any_state(ledger: Ledger) -> None:
    live = ledger.claim(ident(0), {"n": 0})
    assert isinstance(live, Claim)
    doubt = ledger.claim(ident(1), {"n": 1})
    assert isinstance(doubt, Claim)
    ledger.mark_unknown(doubt)
    released = ledger.claim(ident(2), {"n": 2})
    assert isinstance(released, Claim)
    ledger.release(released)
    for i in range(3):
        with pytest.raises(KeyReuseError):
            ledger.claim(ident(i), {"n": 99})
    # the right arguments still get the right answers
    with pytest.raises(EffectInFlight):
        ledger.claim(ident(0), {"n": 0})
    with pytest.raises(EffectInDoubt):
        ledger.claim(ident(1), {"n": 1})
    again = ledger.claim(ident(2), {"n": 2})
    assert isinstance(again, Claim)
    assert again.epoch == 2


# -- key recipes --------------------------------------------------------------------------


def test_key_recipe_picks_fields() -> None:
    codec = Codec()
    recipe = KeyRecipe(("invoice.id", "to"))
    a = {"invoice": {"id": 4711, "lines": [1, 2]}, "to": "a@example.com", "note": "x"}
    b = {"note": "y", "to": "a@example.com", "invoice": {"lines": [], "id": 4711}}
    c = {"invoice": {"id": 4712}, "to": "a@example.com"}
    assert recipe.explicit_key(a, codec) == recipe.explicit_key(b, codec)
    assert recipe.explicit_key(a, codec) != recipe.explicit_key(c, codec)
    assert "4711" in recipe.explicit_key(a, codec)
    assert KeyRecipe(("to",)).explicit_key(a, codec) != recipe.explicit_key(a, codec)
    for args in ({"to": "a"}, {"invoice": {"number": 1}, "to": "a"}, {"invoice": 5, "to": "a"}):
        with pytest.raises(ConfigurationError, match=r"invoice\.id"):
            recipe.explicit_key(args, codec)
    with pytest.raises(ConfigurationError):
        KeyRecipe(())


def test_recipe_keys_deduplicate_outside_a_run(ledger: Ledger) -> None:
    recipe = KeyRecipe(("invoice.id",))
    first = {"invoice": {"id": 4711}, "amount": 100}
    key = recipe.explicit_key(first, ledger.codec)

    def by_recipe(run: str | None) -> EffectIdentity:
        return ident(run=run, step=None, effect="charge@1", explicit=key)

    c = ledger.claim(by_recipe(None), first)
    assert isinstance(c, Claim)
    assert c.chain == "tenant:acme"
    ledger.commit(c, "charged")
    # the explicit key is the identity: where the call sits does not matter
    out = ledger.claim(by_recipe("another-run"), {"amount": 100, "invoice": {"id": 4711}})
    assert isinstance(out, Replay)
    assert out.result == "charged"
    # same picked fields, other arguments: the call diverged
    with pytest.raises(KeyReuseError):
        ledger.claim(by_recipe(None), {"invoice": {"id": 4711}, "amount": 200})


# -- secrets and keyrings -------------------------------------------------------------------


def test_keyring_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCEONLY_SECRETS", f" k2:{K2.value.hex()} , k1:{K1.value.hex()}")
    r = Keyring.from_env()
    assert r.current_id == "k2"
    assert r.ids == ("k2", "k1")
    assert r.key_id("k1", POSITION.parts()) == GOLDEN["k1"]["position"][0]
    assert r.key_id("k2", POSITION.parts()) == GOLDEN["k2"]["position"][0]
    monkeypatch.setenv("MY_SECRETS", f"only:{K1.value.hex()}")
    assert Keyring.from_env("MY_SECRETS").ids == ("only",)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        K1.value.hex(),  # no id
        "k1:not-hex-at-all",
        "k1:" + "ab" * 31,  # 31 bytes
        f"k1:{K1.value.hex()},k1:{K2.value.hex()}",  # duplicate ids
        f":{K1.value.hex()}",  # empty id
        f"k1:{K1.value.hex()},",  # trailing empty item
    ],
)
def test_keyring_from_env_refuses_bad_values(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("ONCEONLY_SECRETS", raising=False)
    else:
        monkeypatch.setenv("ONCEONLY_SECRETS", value)
    with pytest.raises(ConfigurationError) as exc:
        Keyring.from_env()
    assert "ONCEONLY_SECRETS" in str(exc.value) or "secret" in str(exc.value)
    assert K1.value.hex() not in str(exc.value)
    assert K2.value.hex() not in str(exc.value)


def test_keyring_errors_never_echo_secret_material(monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret pasted without its ``id:`` prefix must not be echoed, not even in part:
    the message ends up in logs."""
    monkeypatch.setenv("ONCEONLY_SECRETS", f"k1:{K1.value.hex()},{K2.value.hex()}")
    with pytest.raises(ConfigurationError) as exc:
        Keyring.from_env()
    shown = str(exc.value)
    for secret in (K1, K2):
        for start in range(64 - 8 + 1):
            assert secret.value.hex()[start : start + 8] not in shown, shown


def test_secrets_are_long_enough_and_never_shown() -> None:
    with pytest.raises(ConfigurationError, match="32 bytes"):
        Secret("k", b"x" * 31)
    with pytest.raises(ConfigurationError):
        Secret("", b"x" * 32)
    with pytest.raises(ConfigurationError):
        Secret("i" * 65, b"x" * 32)
    with pytest.raises(ConfigurationError):
        Keyring([])
    with pytest.raises(ConfigurationError):
        Keyring([K1, Secret("k1", K2.value)])
    s = Secret("prod-2026", bytes(range(200, 240)))
    for shown in (repr(s), str(s), f"{s}", repr([s]), repr(Keyring([s]))):
        assert s.value.hex() not in shown
        assert repr(s.value) not in shown
        assert s.value[:8].hex() not in shown
    assert "prod-2026" in repr(s)
    assert "redacted" in repr(s)


# -- rotation ----------------------------------------------------------------------------


def test_rotation_keeps_old_keys_and_uses_the_new_secret_for_new_effects(
    ledger: Ledger, ledgers: Ledgers, store: Store
) -> None:
    done = ledger.claim(ident(0), {"n": 0})
    assert isinstance(done, Claim)
    ledger.commit(done, "sent-0")
    failed = ledger.claim(ident(1), {"n": 1})
    assert isinstance(failed, Claim)
    ledger.fail(failed, "Rejected", "no")
    doubt = ledger.claim(ident(2), {"n": 2})
    assert isinstance(doubt, Claim)
    ledger.mark_unknown(doubt)
    live = ledger.claim(ident(3), {"n": 3})
    assert isinstance(live, Claim)

    rotated = ledgers.fresh(keyring=Keyring([K2, K1]))
    assert rotated.key_id(ident(0)) != done.key_id
    replay = rotated.claim(ident(0), {"n": 0})
    assert isinstance(replay, Replay)
    assert replay.result == "sent-0"
    assert (replay.record.key_id, replay.record.secret_id) == (done.key_id, "k1")
    with pytest.raises(EffectFailed):
        rotated.claim(ident(1), {"n": 1})
    with pytest.raises(EffectInDoubt):
        rotated.claim(ident(2), {"n": 2})
    with pytest.raises(EffectInFlight):
        rotated.claim(ident(3), {"n": 3})
    with pytest.raises(KeyReuseError) as exc:
        rotated.claim(ident(0), {"n": "other"})
    assert exc.value.key_id == done.key_id
    # the claim made before the rotation is still committed by its owner
    ledger.commit(live, "sent-3")
    assert rotated.payload(live.key_id)["result"] == "sent-3"

    new = rotated.claim(ident(4), {"n": 4})
    assert isinstance(new, Claim)
    assert new.key_id == Keyring([K2]).key_id("k2", ident(4).parts())
    assert new.provider_key == Keyring([K2]).provider_key("k2", new.key_id)
    rotated.commit(new, "sent-4")
    assert rotated.get(new.key_id).secret_id == K2.id
    assert rotated.get(new.key_id).fingerprint == fp({"n": 4}, "k2")
    # a new data subject's key is wrapped with the current secret
    other_run = rotated.claim(ident(0, run="run-2"), {"n": 0})
    assert isinstance(other_run, Claim)
    wrapped = dict(fetch(store.engine, "SELECT subject, secret_id FROM oo_data_keys"))
    assert wrapped == {"run-1": "k1", "run-2": "k2"}
    # the old ledger (k1 only) cannot open what k2 wrapped, and says which secret is missing
    old_view = ledgers.fresh()
    assert old_view.payload(done.key_id)["result"] == "sent-0"
    with pytest.raises(ConfigurationError, match="k2"):
        old_view.payload(other_run.key_id)
    # dropping the retired secret too early is refused loudly, never guessed around
    without_k1 = ledgers.fresh(keyring=Keyring([K2]))
    with pytest.raises(ConfigurationError, match="k1"):
        without_k1.payload(done.key_id)
