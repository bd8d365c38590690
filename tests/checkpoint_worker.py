"""A worker process for the crash and multi-process tests.

``python -m tests.checkpoint_worker URL RUN_ID DURABILITY STEPS FLUSH_EVERY`` saves the
states of a deterministic model, ``model_state(0)``, ``model_state(1)``, ..., one
checkpoint per step, so checkpoint ``seq`` of the run must always equal
``model_state(seq)``. When the run already has checkpoints it resumes after the latest
one (and checks that the state it resumes from is the model's).

It prints ``ready <first seq> ok|mismatch`` once it is about to save, ``flushed <seq>``
after every flush barrier (that checkpoint and all before it are durable), and ``done``.
"""

from __future__ import annotations

import sys
from typing import Any

from onceonly.checkpoint import CheckpointNotFound, KeyframePolicy, RunNotFound, Store

__all__ = ["KEYFRAMES", "model_state"]

KEYFRAMES = KeyframePolicy(max_deltas=8)


def model_state(i: int) -> dict[str, Any]:
    """The state after step ``i``: appends to a list, changes keys of a growing dict
    (paged once it is large), replaces a blob-sized value every ten steps, sets and
    deletes a channel."""
    state: dict[str, Any] = {
        "step": i,
        "log": [f"event {j}" for j in range(i)],
        "table": {f"k{j % 97}": j for j in range(i)},
        "big": "b" * 5000 + str(i // 10),
    }
    if i % 3:
        state["phase"] = ("odd" if i % 2 else "even", i)
    return state


def main(argv: list[str]) -> int:
    url, run_id, durability, steps, flush_every = argv
    with Store.open(url, durability=durability, keyframes=KEYFRAMES) as store:
        try:
            store.get_run(run_id)
        except RunNotFound:
            store.create_run("model", run_id=run_id)
        try:
            snap = store.load(run_id)
        except CheckpointNotFound:
            start, ok = 0, True
        else:
            start, ok = snap.info.seq + 1, snap.state == model_state(snap.info.seq)
        print(f"ready {start} {'ok' if ok else 'mismatch'}", flush=True)
        every = int(flush_every)
        for i in range(start, start + int(steps)):
            store.save(run_id, model_state(i), step=f"step-{i}")
            if every and (i + 1) % every == 0:
                store.flush()
                print(f"flushed {i}", flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
