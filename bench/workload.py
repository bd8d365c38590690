"""The shared, deterministic W2/W3 workload (see /work/shared/BENCH.md).

State: ``kv`` = 1000 keys ``k0000..k0999``, each a 100-char base64 string of seeded PRNG
bytes (nearly incompressible), ``messages`` = [], ``step`` = 0. Step ``s`` (1-based)
changes the 5 keys ``j = (37*s + 211*t) mod 1000`` for ``t = 0..4`` to new 100-char values
and appends one 500-char message.

Every system imports this module, so all of them run the identical workload; any step can
be computed on its own (each step seeds its own PRNG).
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

KEYS = 1000
CHANGED_PER_STEP = 5
VALUE_CHARS = 100  # base64 of 75 bytes
MESSAGE_CHARS = 500  # base64 of 375 bytes
_INIT_SEED = 20_240_601
_STEP_SEED = 1_000_003

State = dict[str, Any]


def key(j: int) -> str:
    """The name of key ``j``."""
    return f"k{j:04d}"


def _b64(rng: random.Random, chars: int) -> str:
    return base64.b64encode(rng.randbytes(chars * 3 // 4)).decode("ascii")


def initial_kv() -> dict[str, str]:
    """The 1000 initial values, in key order."""
    rng = random.Random(_INIT_SEED)
    return {key(j): _b64(rng, VALUE_CHARS) for j in range(KEYS)}


def initial_state() -> State:
    """A fresh copy of the state before step 1."""
    return {"kv": initial_kv(), "messages": [], "step": 0}


@dataclass(frozen=True)
class Step:
    """What step ``s`` changes."""

    s: int
    kv: dict[str, str]
    message: str


def step_changes(s: int) -> Step:
    """The changes of step ``s`` (1-based): 5 new values and one message."""
    rng = random.Random(_STEP_SEED * s + 17)
    kv = {key((37 * s + 211 * t) % KEYS): _b64(rng, VALUE_CHARS) for t in range(CHANGED_PER_STEP)}
    return Step(s, kv, _b64(rng, MESSAGE_CHARS))


def apply_step(state: State, step: Step) -> None:
    """Apply ``step`` to ``state`` in place."""
    state["kv"].update(step.kv)
    state["messages"].append(step.message)
    state["step"] = step.s


def expected_state(steps: int) -> State:
    """The state after ``steps`` steps."""
    state = initial_state()
    for s in range(1, steps + 1):
        apply_step(state, step_changes(s))
    return state


def same_state(got: Any, steps: int) -> tuple[bool, str]:
    """Whether ``got`` equals the expected state after ``steps`` steps, and why not."""
    want = expected_state(steps)
    if not isinstance(got, dict):
        return False, f"state is a {type(got).__name__}, not a dict"
    if set(got) != set(want):
        return False, f"channels {sorted(got)} != {sorted(want)}"
    for ch, value in want.items():
        have = got[ch]
        if ch == "messages":
            have = list(have)  # a store may hand back a lazy sequence
        elif ch == "kv":
            have = dict(have)
        if have != value:
            if ch == "messages":
                return False, f"messages differ (len {len(have)} vs {len(value)})"
            return False, f"channel {ch!r} differs"
    return True, "equal"


def live_state_bytes(steps: int) -> int:
    """Approximate payload of the live state after ``steps`` steps (keys + values)."""
    return KEYS * (len(key(0)) + VALUE_CHARS) + steps * MESSAGE_CHARS
