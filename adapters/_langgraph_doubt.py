"""In-doubt tool calls as LangGraph interrupts (``ToolGuard(in_doubt="interrupt")``).

A call the guard cannot settle by evidence (class C, or a class A/B call whose window or
probe gives no answer) is in doubt: it may have happened. Instead of raising
:class:`~ledger.EffectInDoubt` out of ``invoke``, the guard interrupts the run with a
prompt (:func:`prompt`) that holds what a person needs to check the provider — the
tool, its arguments, the ledger entry's key id, epoch, provider key and class, and what
went wrong — and the choices. The run is resumed with a decision::

    Command(resume={"resolve": key_id, "epoch": epoch, "happened": True,
                    "actor": "ops@example.com", "evidence": "booking 7 in the console",
                    "result": {...}})          # "result" optional; only when it happened

:func:`decide` records it in the ledger (:meth:`Ledger.resolve`, with the actor and the
evidence in the audit chain); the guard then runs the call again, which replays the
recorded result (happened) or sends once more under a new epoch (did not happen).

A decision names the entry *and its epoch*: a task that re-runs replays the decisions
LangGraph stored for it, in order, and a decision about an earlier epoch (the call was
sent again after "did not happen" and is in doubt again) must not settle the new one.
A decision that does not fit (another key or epoch, no actor, ``happened`` not a bool)
is not applied, and the run is asked again, the prompt saying why.

Imports nothing from LangGraph (the guard calls ``interrupt``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from onceonly.ledger import (
    UNKNOWN_RESULT,
    EffectInDoubt,
    InvalidTransition,
    Ledger,
    ResultUnknown,
)

__all__ = ["CHOICES", "KIND", "Doubt", "decide", "doubt_of", "prompt", "unknown_result"]

KIND = "onceonly.in_doubt"
CHOICES = ("happened", "not_happened")


@dataclass(frozen=True)
class Doubt:
    """An in-doubt call's ledger entry, as the prompt shows it."""

    key_id: str
    epoch: int
    status: str
    provider_class: str
    provider_key: str
    attempts: int
    evidence: str


def doubt_of(ledger: Ledger, exc: BaseException) -> Doubt | None:
    """The in-doubt entry behind ``exc``; None when ``exc`` is not an in-doubt call."""
    if not isinstance(exc, EffectInDoubt):
        return None
    record = ledger.get(str(exc.key_id))
    cause = exc.__cause__
    seen = f"{type(cause).__name__} while acting" if cause is not None else "outcome not recorded"
    outcome = record.outcome_class.value if record.outcome_class is not None else "none"
    return Doubt(
        key_id=record.key_id,
        epoch=record.epoch,
        status=record.status.value,
        provider_class=record.provider_class.value,
        provider_key=record.provider_key,
        attempts=record.attempts,
        evidence=f"{seen}; last outcome: {outcome}; the guard has no evidence either way",
    )


def prompt(
    doubt: Doubt, tool: str, args: Any, tool_call_id: Any, refused: str = ""
) -> dict[str, Any]:
    """The interrupt's value: what a person needs to check the provider and decide."""
    value: dict[str, Any] = {
        "kind": KIND,
        "tool": tool,
        "args": args,
        "tool_call_id": tool_call_id,
        "key_id": doubt.key_id,
        "epoch": doubt.epoch,
        "status": doubt.status,
        "provider_class": doubt.provider_class,
        "provider_key": doubt.provider_key,
        "attempts": doubt.attempts,
        "evidence": doubt.evidence,
        "choices": list(CHOICES),
        "answer": {
            "resolve": doubt.key_id,
            "epoch": doubt.epoch,
            "happened": "true | false",
            "actor": "who decided",
            "evidence": "what was checked (optional)",
            "result": "the provider's answer (optional, when it happened)",
        },
    }
    if refused:
        value["refused_answer"] = refused
    return value


def decide(ledger: Ledger, doubt: Doubt, decision: Any, thread_id: str) -> str:
    """Record ``decision`` on ``doubt``'s entry; return why it was not taken ("" if it was).

    An entry settled meanwhile (from the console or the CLI) counts as taken: the guard
    then replays whatever the ledger holds.
    """
    if not isinstance(decision, Mapping):
        return f"the answer is a {type(decision).__name__}, not a mapping"
    if decision.get("resolve") != doubt.key_id:
        return "the answer's 'resolve' is not this call's key_id"
    if decision.get("epoch") != doubt.epoch:
        return (
            f"the answer is for epoch {decision.get('epoch')!r}, the entry is at epoch "
            f"{doubt.epoch}: it was sent again since"
        )
    happened = decision.get("happened")
    if not isinstance(happened, bool):
        return "'happened' must be true or false"
    actor = decision.get("actor")
    if not isinstance(actor, str) or not actor.strip():
        return "'actor' must name who decided (it is kept in the audit trail)"
    evidence = decision.get("evidence")
    if not isinstance(evidence, str) or not evidence.strip():
        evidence = f"decided through Command(resume=...) on thread {thread_id}"
    # An entry settled meanwhile: the call replays what the ledger holds now.
    with contextlib.suppress(InvalidTransition):
        ledger.resolve(
            doubt.key_id,
            happened=happened,
            evidence=evidence,
            actor=actor,
            result=decision.get("result", UNKNOWN_RESULT) if happened else UNKNOWN_RESULT,
        )
    return ""


def unknown_result(exc: BaseException, tool: str) -> str | None:
    """The answer to the model for a call resolved as happened without its result."""
    if not isinstance(exc, ResultUnknown):
        return None
    return (
        f"{tool} happened (a person confirmed it); its result was not recorded. Do not "
        "call it again for the same purpose."
    )
