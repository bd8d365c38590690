"""A racing worker process for ``test_ledger_race``: claims the same keys as its rivals.

Run as ``python -m tests.ledger_race_worker URL N_KEYS INDEX GO_FILE [ROTATING]``. It opens
its own store and ledger, prints ``ready``, waits until ``GO_FILE`` exists, then walks all
keys ``0..N_KEYS-1`` from an offset of its own (forwards for even indexes, backwards for
odd ones) and tries to claim each; a claim it wins is committed with its index as the
result. Finally it prints one JSON line:
``{"won": [...], "replayed": n, "in_flight": n, "wall_s": s}``.

Workers derive keys with K1. With ``ROTATING`` = ``1`` they are in the middle of a rolling
secret rotation: all know K1 and K2, workers 1 and 2 (mod 4) already derive new keys with
K2, the others still with K1, so each direction of the walk has one worker of each kind.
"""

from __future__ import annotations

import json
import os
import sys
import time

from onceonly.checkpoint import Store
from onceonly.ledger import Claim, EffectIdentity, EffectInFlight, InFlightPolicy, Keyring, Ledger
from tests.ledger_support import K1, K2

RUNS = 4


def identity(i: int) -> EffectIdentity:
    """Key ``i`` of the race: four runs, so chains are shared and contended."""
    return EffectIdentity("acme", f"race-{i % RUNS}", "pay", 0, "transfer@1", i)


def main(argv: list[str]) -> int:
    url, n_keys, index, go = argv[1], int(argv[2]), int(argv[3]), argv[4]
    rotating = len(argv) > 5 and argv[5] == "1"
    mid = index % 4 in (1, 2)
    secrets = ([K2, K1] if mid else [K1, K2]) if rotating else [K1]
    store = Store.open(url, busy_timeout_ms=30_000)
    ledger = Ledger(
        store,
        Keyring(secrets),
        owner=f"racer-{index}",
        lease_s=600.0,
        in_flight=InFlightPolicy(wait_s=0),
    )
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.002)
    started = time.monotonic()
    # Each worker starts at its own offset (so a worker the scheduler favours cannot take
    # every key before its rivals wake up) and walks the whole range, alternating
    # directions, so every key is still contended by several workers.
    start = index * n_keys // 4
    steps = range(n_keys) if index % 2 == 0 else range(0, -n_keys, -1)
    order = [(start + k) % n_keys for k in steps]
    won: list[int] = []
    replayed = in_flight = 0
    for i in order:
        try:
            out = ledger.claim(identity(i), {"i": i})
        except EffectInFlight:
            in_flight += 1
            continue
        if isinstance(out, Claim):
            ledger.commit(out, {"winner": index})
            won.append(i)
        else:
            replayed += 1
    wall = time.monotonic() - started
    print(json.dumps({"won": won, "replayed": replayed, "in_flight": in_flight, "wall_s": wall}))
    ledger.close()
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
