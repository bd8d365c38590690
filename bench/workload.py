"""The shared, deterministic W1, W2 and W3 workloads (the targets are in bench/summary.py).

W1: call ``i`` of a run of guarded effects takes ``make_arg(i)`` (a dict whose compact
JSON is 200 bytes) and returns ``make_result(arg)`` (a 200-byte dict derived from the
sha256 of the argument's JSON).

W2/W3 state: ``kv`` = 1000 keys ``k0000..k0999``, each a 100-char base64 string of seeded PRNG
bytes (nearly incompressible), ``messages`` = [], ``step`` = 0. Step ``s`` (1-based)
changes the 5 keys ``j = (37*s + 211*t) mod 1000`` for ``t = 0..4`` to new 100-char values
and appends one 500-char message.

Every system imports this module, so all of them run the identical workload; any step can
be computed on its own (each step seeds its own PRNG).
"""

from __future__ import annotations

import base64
import hashlib
import json
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


# -- W1: guarded effects --------------------------------------------------------------

W1_CALLS = 2000
W1_ARG_BYTES = 200
W1_RESULT_BYTES = 200
_BODY = (
    "Dear customer, please find attached the invoice for this month's services. "
    "Payment is due within thirty days of the date shown on the invoice. "
) * 4


def to_json(value: Any) -> str:
    """The compact, key-sorted JSON the W1 sizes are measured in."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _pad(value: dict[str, Any], field: str, size: int, text: str) -> dict[str, Any]:
    value[field] = ""
    need = size - len(to_json(value))
    if need < 0 or need > len(text):
        raise ValueError(f"cannot pad {value!r} to {size} bytes")
    value[field] = text[:need]
    return value


def make_arg(i: int) -> dict[str, Any]:
    """The argument of W1 call ``i``: its JSON is exactly 200 bytes."""
    arg = {
        "call": i,
        "op": "send_email",
        "to": f"user{i:06d}@example.com",
        "subject": f"invoice {i:06d}",
    }
    return _pad(arg, "body", W1_ARG_BYTES, _BODY)


def make_result(arg: dict[str, Any]) -> dict[str, Any]:
    """What the guarded body returns for ``arg``: 200 bytes of JSON, from its sha256."""
    digest = hashlib.sha256(to_json(arg).encode()).hexdigest()
    result = {
        "call": arg["call"],
        "status": "sent",
        "message_id": f"<{digest[:24]}@mail.example.com>",
        "sha256": digest,
    }
    return _pad(result, "trace", W1_RESULT_BYTES, digest * 2)


class EffectCounter:
    """The W1 external effect: how many times a guarded body ran in this process."""

    def __init__(self) -> None:
        self.executed = 0


#: The process-global counter every W1 system's guarded body increments.
EFFECT = EffectCounter()


def send_email(arg: dict[str, Any]) -> dict[str, Any]:
    """The guarded body of W1: count the external effect, return its result."""
    EFFECT.executed += 1
    return make_result(arg)
