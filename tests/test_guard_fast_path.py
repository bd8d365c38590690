"""The guard's per-call shortcuts keep its behaviour: key ids derived once per call, the
arguments bound without ``inspect`` when all are given by position, no span made when no
tracer provider is set, and a step's divergence check that costs what each call asks.

The provider is a list of raw deliveries (the oracle); every test also runs the variant
the shortcut must agree with.
"""

from __future__ import annotations

import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import StepDiverged, guard, step
from onceonly.checkpoint import ConfigurationError, Store
from onceonly.ledger import EffectIdentity, KeyRecipe, Keyring, Ledger, Secret
from tests.ledger_support import Ledgers


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


def test_key_ids_derived_once_agree_with_the_keyring(ledger: Ledger) -> None:
    ident = EffectIdentity("t", "run-1", "s", 0, "send@1", 3)
    first = ledger.key_ids(ident)
    again = ledger.key_ids(ident)
    direct = [(sid, ledger.keyring.key_id(sid, ident.parts())) for sid in ledger.keyring.ids]
    assert first == again == direct
    again.clear()  # a caller's list is its own: the remembered one is untouched
    assert ledger.key_ids(ident) == direct
    assert ledger.key_id(ident) == direct[0][1]
    # 1 and True are equal dictionary keys; only an int is a valid part, every time
    bad = EffectIdentity("t", "run-1", "s", 0, "send@1", ordinal=True)
    with pytest.raises(ConfigurationError, match="int"):
        ledger.keyring.key_id("k1", bad.parts())
    ledger.key_ids(EffectIdentity("t", "run-1", "s", 0, "send@1", 1))
    with pytest.raises(ConfigurationError, match="int"):
        ledger.key_ids(bad)
    # another keyring on the same ledger derives under its own secrets
    other = Keyring([Secret("k2", bytes(32))])
    ledger.keyring = other
    assert ledger.key_ids(ident) == [("k2", other.key_id("k2", ident.parts()))]


def test_positional_and_keyword_calls_bind_alike(ledger: Ledger) -> None:
    """A recipe key reads the bound arguments: a call by position (bound without
    ``inspect``) and the same call by keyword (bound by it, defaults applied) are one
    effect; a call with another default overridden is another."""
    deliveries: list[tuple[str, str]] = []

    @guard(ledger, effect="send@1", recipe=KeyRecipe(("to", "tag")), tenant="t")
    def send(to: str, tag: str = "a") -> str:
        deliveries.append((to, tag))
        return f"sent {to} {tag}"

    assert send("x", "a") == "sent x a"
    assert send(to="x") == "sent x a"  # replayed: same bound arguments
    assert send("x", tag="a") == "sent x a"
    assert deliveries == [("x", "a")]
    assert send("x", "b") == "sent x b"
    assert deliveries == [("x", "a"), ("x", "b")]


def test_untraced_guard_acts_once_and_replays(
    ledger: Ledger, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no tracer provider the guard makes no span; the calls act and replay as with
    one (the session's SDK provider is the control)."""
    guard_module = sys.modules["onceonly.adapters.guard"]  # the package exports the function
    deliveries: list[str] = []
    seen: list[trace.Span] = []

    @guard(ledger, effect="send@1")
    def send(to: str) -> str:
        seen.append(trace.get_current_span())
        deliveries.append(to)
        return f"sent {to}"

    with step("run-1", "s"):
        assert send("a") == "sent a"  # traced: the control
    assert len(spans.get_finished_spans()) == 1
    spans.clear()
    monkeypatch.setattr(guard_module, "_untraced", lambda: True)
    with step("run-1", "s"):
        assert send("a") == "sent a"  # replayed
        assert send("b") == "sent b"  # acts
    with step("run-1", "s"):
        assert [send("a"), send("b")] == ["sent a", "sent b"]
    assert deliveries == ["a", "b"]
    assert spans.get_finished_spans() == ()
    assert not seen[1].get_span_context().is_valid


def test_step_divergence_check_over_a_long_prefix(ledger: Ledger) -> None:
    """A resumed step with 60 recorded effects replays them in order and diverges at
    the first call out of order; an explicit key recorded later may come early."""
    deliveries: list[int] = []

    @guard(ledger, effect="send@1")
    def send(i: int) -> int:
        deliveries.append(i)
        return i

    with step("run-1", "s"):
        for i in range(60):
            send(i)
    recorded = [k for _, k in (ledger.key_ids(_ident(i))[0] for i in range(60))]
    with step("run-1", "s", recorded=recorded):
        assert [send(i) for i in range(60)] == list(range(60))
        assert send(60) == 60  # past the recorded prefix: new
    assert deliveries == [*range(60), 60]

    with pytest.raises(StepDiverged) as err, step("run-1", "s", recorded=recorded[1:]):
        send(0)  # the step asks for ordinal 0 where ordinal 1 was recorded first
    assert err.value.expected == recorded[1]
    assert len(err.value.remaining) == 59

    @guard(ledger, effect="book@1", key=lambda name: f"book-{name}")
    def book(name: str) -> str:
        deliveries.append(-1)
        return name

    with step("run-2", "s"):
        booked = [book(n) for n in ("a", "b", "c")]
    keys = [
        ledger.key_id(EffectIdentity("", "run-2", "s", 0, "book@1", 0, explicit=f"book-{n}"))
        for n in ("a", "b", "c")
    ]
    with step("run-2", "s", recorded=keys):  # explicit keys: any order
        assert [book("c"), book("a"), book("b")] == ["c", "a", "b"]
    assert booked == ["a", "b", "c"]
    assert deliveries.count(-1) == 3
    with pytest.raises(StepDiverged), step("run-2", "s", recorded=keys):
        book("a")  # finished without asking for b and c


def _ident(i: int) -> EffectIdentity:
    return EffectIdentity("", "run-1", "s", 0, "send@1", i)
