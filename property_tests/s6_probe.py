"""S6 helper: derive keys, provider keys and fingerprints of a generated corpus, in
whatever process and hash seed runs it (``python -m property_tests.s6_probe N SEED``
prints one JSON document). The corpus holds values whose in-memory order depends on
the hash seed (sets, dicts built from sets) and non-ASCII text."""

from __future__ import annotations

import json
import random
import sys
import unicodedata
from typing import Any, Literal

from onceonly.checkpoint import Codec
from onceonly.ledger import EffectIdentity, Keyring, Secret
from onceonly.ledger.keys import canonical_args

RING = Keyring([Secret("k1", bytes(range(32))), Secret("k2", bytes(range(100, 148)))])
WORDS = ("alpha", "beta", "gamma", "délta", "ünïcode", "zeta", "東京", "eta", "θ", "x y")


def corpus(n: int, seed: int) -> list[tuple[EffectIdentity, Any]]:
    """``n`` (identity, arguments) pairs, the same in every process for a seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.sample(WORDS, rng.randrange(1, len(WORDS)))
        form: Literal["NFC", "NFD"] = rng.choice(("NFC", "NFD"))
        args = {
            "to": unicodedata.normalize(form, f"{rng.choice(WORDS)}@example.com"),
            "tags": set(words),
            "frozen": frozenset(words[::-1]),
            "map": {w: len(w) for w in set(words)},
            "amount": rng.randrange(-(2**40), 2**40),
            "items": [rng.random(), (rng.randrange(9), None), b"\x00\xff"],
        }
        if rng.random() < 0.3:
            ident = EffectIdentity(
                rng.choice(("acme", "globex")), None, None, 0, f"charge@{i % 3}", 0, f"inv-{i}"
            )
        else:
            ident = EffectIdentity(
                rng.choice(("acme", "globex")),
                f"run-{rng.randrange(50)}",
                rng.choice(WORDS),
                rng.randrange(3),
                f"{rng.choice(('send_email', 'book'))}@{rng.randrange(1, 3)}",
                rng.randrange(4),
            )
        out.append((ident, args))
    return out


def derive(n: int, seed: int) -> dict[str, Any]:
    codec = Codec()
    rows = []
    for ident, args in corpus(n, seed):
        canonical = canonical_args(args, codec)
        row = []
        for sid in RING.ids:
            kid = RING.key_id(sid, ident.parts())
            row.append([kid, RING.provider_key(sid, kid), RING.fingerprint(sid, canonical)])
        rows.append(row)
    return {"order": list(set(WORDS)), "rows": rows}


if __name__ == "__main__":
    print(json.dumps(derive(int(sys.argv[1]), int(sys.argv[2]))))
