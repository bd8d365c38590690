"""The guard's decision core on its own: evidence in, the next action out, no I/O.

Each test walks one path of :class:`Attempts` by hand, answering every action as the
ledger, the provider or the probe would, and checks the action the core asks for next.
Together they take every transition of the loop; the guard's own tests drive the same
core through the sync and async drivers against real ledgers.
"""

from __future__ import annotations

from typing import Any

import pytest

from onceonly.adapters import _guard_core as core
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    OutcomeClass,
    ProviderClass,
    Replay,
    ResultUnknown,
)

KEY = "k" * 64
A, B, C = ProviderClass.DEDUPLICATING, ProviderClass.QUERYABLE, ProviderClass.OPAQUE


def a_claim(epoch: int = 1, *, resend: bool = False) -> Claim:
    return Claim(
        key_id=KEY,
        epoch=epoch,
        provider_key="pk",
        attempt=epoch,
        lease_owner="worker",
        lease_expires_at=0.0,
        provider_class=B,
        subject="run",
        chain="chain",
        resend=resend,
    )


def a_record(status: EffectStatus, pclass: ProviderClass = B) -> EffectRecord:
    return EffectRecord(
        key_id=KEY,
        tenant="",
        run_id=None,
        step_id=None,
        effect="send@1",
        fingerprint="f",
        provider_key="pk",
        provider_class=pclass,
        window_s=None,
        status=status,
        epoch=1,
        lease_owner=None,
        lease_expires_at=None,
        attempts=1,
        outcome_class=None,
        subject="run",
        secret_id="s",  # noqa: S106  (a record field, not a secret)
        first_sent_at=None,
        created_at=0.0,
        updated_at=0.0,
    )


def a_replay(result: Any) -> Replay:
    return Replay(result, row={})


def machine(pclass: ProviderClass = C, *, probe: bool = False, attempts: int = 3) -> core.Attempts:
    return core.Attempts(provider_class=pclass, has_probe=probe, max_attempts=attempts)


def walk(m: core.Attempts, *steps: tuple[Any, Any]) -> core.Action:
    """Start ``m``; each step is (the action expected, the answer to give); returns the
    action after the last answer."""
    action = m.start()
    for expected, answer in steps:
        assert action == expected
        action = m.send(answer)
    return action


def doubt() -> EffectInDoubt:
    return EffectInDoubt(KEY, EffectStatus.UNKNOWN.value, B.value)


# -- claiming --------------------------------------------------------------------------


def test_a_fresh_claim_acts_and_commits() -> None:
    claim = a_claim()
    m = machine()
    end = walk(
        m,
        (core.ClaimKey(), claim),
        (core.Act(claim), core.Succeeded("ok")),
        (core.Commit(claim, "ok"), None),
    )
    assert end == core.Settle("ok", "executed", claim)
    assert m.attempt == 1


def test_a_recorded_outcome_is_replayed() -> None:
    end = walk(machine(), (core.ClaimKey(), a_replay("before")))
    assert end == core.Settle("before", "replayed")


def test_an_in_doubt_entry_needing_a_human_raises_from_the_doubt() -> None:
    seen = doubt()
    end = walk(
        machine(B, probe=True),
        (core.ClaimKey(), seen),
        (core.Look(KEY), a_record(EffectStatus.NEEDS_HUMAN)),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, EffectInDoubt)
    assert end.error.status == EffectStatus.NEEDS_HUMAN.value
    assert end.error.__cause__ is seen


def test_class_a_in_doubt_is_re_sent_under_the_re_send_claim() -> None:
    resend = a_claim(2, resend=True)
    end = walk(
        machine(A),
        (core.ClaimKey(), doubt()),
        (core.Look(KEY), a_record(EffectStatus.UNKNOWN, A)),
        (core.Reconcile(KEY, Evidence.WINDOW_OPEN, actor="guard"), resend),
    )
    assert end == core.Act(resend, resend=True)


def test_class_b_in_doubt_asks_the_probe_and_settles_as_happened() -> None:
    record = a_record(EffectStatus.UNKNOWN)
    end = walk(
        machine(B, probe=True),
        (core.ClaimKey(), doubt()),
        (core.Look(KEY), record),
        (core.AskProbe(record), (Evidence.HAPPENED, "theirs")),
        (
            core.Reconcile(KEY, Evidence.HAPPENED, actor="probe", result="theirs"),
            a_record(EffectStatus.COMMITTED),
        ),
        (core.ReadReplay(KEY), a_replay("theirs")),
    )
    assert end == core.Settle("theirs", "reconciled")


def test_without_a_probe_the_evidence_is_inconclusive_and_a_human_must_look() -> None:
    seen = doubt()
    end = walk(
        machine(C),
        (core.ClaimKey(), seen),
        (core.Look(KEY), a_record(EffectStatus.UNKNOWN, C)),
        (
            core.Reconcile(KEY, Evidence.INCONCLUSIVE, actor="guard"),
            a_record(EffectStatus.NEEDS_HUMAN, C),
        ),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, EffectInDoubt)
    assert end.error.__cause__ is seen


def not_happened_round(seen: EffectInDoubt, record: EffectRecord) -> list[tuple[Any, Any]]:
    return [
        (core.ClaimKey(), seen),
        (core.Look(KEY), record),
        (core.AskProbe(record), (Evidence.NOT_HAPPENED, None)),
        (
            core.Reconcile(KEY, Evidence.NOT_HAPPENED, actor="probe"),
            a_record(EffectStatus.NOT_HAPPENED),
        ),
    ]


def test_proved_not_happened_claims_again_at_once_three_times_per_attempt() -> None:
    seen, record = doubt(), a_record(EffectStatus.UNKNOWN)
    claim = a_claim(2)
    m = machine(B, probe=True, attempts=2)
    rounds = not_happened_round(seen, record) * 3
    end = walk(m, *rounds, (core.Pause(2), None), (core.ClaimKey(), claim))
    assert end == core.Act(claim)
    assert m.attempt == 2


def test_proved_not_happened_on_every_claim_raises_the_doubt_when_attempts_run_out() -> None:
    seen, record = doubt(), a_record(EffectStatus.UNKNOWN)
    end = walk(machine(B, probe=True, attempts=1), *not_happened_round(seen, record) * 3)
    assert end == core.Raise(seen)


def test_a_result_unknown_without_a_probe_is_raised_as_it_is() -> None:
    unknown = ResultUnknown(KEY)
    assert walk(machine(B), (core.ClaimKey(), unknown)) == core.Raise(unknown)


def test_a_result_unknown_is_learned_from_the_probe_and_recorded() -> None:
    end = walk(
        machine(B, probe=True),
        (core.ClaimKey(), ResultUnknown(KEY)),
        (core.AskProbeForResult(KEY), (Evidence.HAPPENED, "found")),
        (core.Correct(KEY, "found"), None),
        (core.ReadReplay(KEY), a_replay("found")),
    )
    assert end == core.Settle("found", "reconciled")


@pytest.mark.parametrize("answer", [(Evidence.NOT_HAPPENED, None), (Evidence.INCONCLUSIVE, None)])
def test_a_result_unknown_stays_unknown_when_the_probe_does_not_find_it(
    answer: tuple[Evidence, Any],
) -> None:
    end = walk(
        machine(B, probe=True),
        (core.ClaimKey(), ResultUnknown(KEY)),
        (core.AskProbeForResult(KEY), answer),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, ResultUnknown)
    assert answer[0].value in str(end.error)


def test_a_failing_probe_is_no_answer() -> None:
    failure = ConnectionError("down")
    end = walk(
        machine(B, probe=True),
        (core.ClaimKey(), ResultUnknown(KEY)),
        (core.AskProbeForResult(KEY), failure),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, ResultUnknown)
    assert end.error.__cause__ is failure


# -- after an attempt failed -------------------------------------------------------------


def test_not_sent_is_released_and_retried_with_a_pause() -> None:
    first, second = a_claim(), a_claim()
    error = OSError("refused")
    m = machine(attempts=2)
    end = walk(
        m,
        (core.ClaimKey(), first),
        (core.Act(first), core.Raised(error)),
        (core.Classify(error), OutcomeClass.NOT_SENT),
        (core.Release(first, "OSError", error), None),
        (core.Pause(2), None),
        (core.ClaimKey(), second),
        (core.Act(second), core.Raised(error)),
        (core.Classify(error), OutcomeClass.NOT_SENT),
        (core.Release(second, "OSError", error), None),
    )
    assert end == core.Raise(error)  # attempts ran out: the last error
    assert m.attempt == 2


def test_rejected_is_recorded_failed_and_raised() -> None:
    claim, error = a_claim(), ValueError("no such room")
    end = walk(
        machine(),
        (core.ClaimKey(), claim),
        (core.Act(claim), core.Raised(error)),
        (core.Classify(error), OutcomeClass.REJECTED),
        (core.Fail(claim, "ValueError", "no such room"), None),
    )
    assert end == core.Raise(error)


def ambiguous(claim: Claim, error: Exception) -> list[tuple[Any, Any]]:
    return [
        (core.ClaimKey(), claim),
        (core.Act(claim), core.Raised(error)),
        (core.Classify(error), OutcomeClass.AMBIGUOUS),
        (core.MarkUnknown(claim, type(error).__name__, error), None),
    ]


def test_class_a_ambiguous_is_re_sent_by_the_next_attempt() -> None:
    claim, error = a_claim(), TimeoutError("read")
    end = walk(machine(A), *ambiguous(claim, error))
    assert end == core.Pause(2)


def test_class_a_ambiguous_on_the_last_attempt_is_left_in_doubt() -> None:
    claim, error = a_claim(), TimeoutError("read")
    end = walk(machine(A, attempts=1), *ambiguous(claim, error))
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, EffectInDoubt)
    assert end.error.status == EffectStatus.UNKNOWN.value
    assert end.error.__cause__ is error


def test_class_b_ambiguous_asks_the_probe_on_the_next_attempt() -> None:
    claim, error = a_claim(), TimeoutError("read")
    assert walk(machine(B, probe=True), *ambiguous(claim, error)) == core.Pause(2)


def last_class_b(claim: Claim, error: Exception, moved: Any) -> list[tuple[Any, Any]]:
    record = a_record(EffectStatus.UNKNOWN)
    return [
        *ambiguous(claim, error),
        (core.Look(KEY), record),
        (core.AskProbe(record), (Evidence.HAPPENED, "r")),
        (core.Reconcile(KEY, Evidence.HAPPENED, actor="probe", result="r"), moved),
    ]


def test_the_last_class_b_attempt_asks_the_probe_at_once_and_settles() -> None:
    claim, error = a_claim(), TimeoutError("read")
    end = walk(
        machine(B, probe=True, attempts=1),
        *last_class_b(claim, error, a_record(EffectStatus.COMMITTED)),
        (core.ReadReplay(KEY), a_replay("r")),
    )
    assert end == core.Settle("r", "reconciled")


def test_the_last_class_b_attempt_proved_not_happened_raises_its_error() -> None:
    claim, error = a_claim(), TimeoutError("read")
    end = walk(
        machine(B, probe=True, attempts=1),
        *last_class_b(claim, error, a_record(EffectStatus.NOT_HAPPENED)),
    )
    assert end == core.Raise(error)


def test_the_last_class_b_attempt_left_without_evidence_raises_in_doubt() -> None:
    claim, error = a_claim(), TimeoutError("read")
    end = walk(
        machine(B, probe=True, attempts=1),
        *last_class_b(claim, error, a_record(EffectStatus.NEEDS_HUMAN)),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, EffectInDoubt)
    assert end.error.__cause__ is error


def test_a_re_send_claim_after_the_last_attempt_is_given_back() -> None:
    claim, error, unused = a_claim(), TimeoutError("read"), a_claim(2, resend=True)
    end = walk(
        machine(B, probe=True, attempts=1),
        *last_class_b(claim, error, unused),
        (core.GiveBack(unused, "re-send claim not used"), None),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, EffectInDoubt)
    assert end.error.status == EffectStatus.UNKNOWN.value


def test_class_c_ambiguous_needs_a_human_at_once() -> None:
    claim, error = a_claim(), TimeoutError("read")
    end = walk(
        machine(C),
        *ambiguous(claim, error),
        (core.Look(KEY), a_record(EffectStatus.UNKNOWN, C)),
        (
            core.Reconcile(KEY, Evidence.INCONCLUSIVE, actor="guard"),
            a_record(EffectStatus.NEEDS_HUMAN, C),
        ),
    )
    assert isinstance(end, core.Raise)
    assert isinstance(end.error, EffectInDoubt)
    assert end.error.__cause__ is error


def test_an_interrupt_while_acting_leaves_the_entry_in_doubt_and_is_re_raised() -> None:
    claim, interrupt = a_claim(), KeyboardInterrupt()
    end = walk(
        machine(A),
        (core.ClaimKey(), claim),
        (core.Act(claim), core.Interrupted(interrupt)),
        (core.LeaveInDoubt(claim, interrupt), None),
    )
    assert end == core.Raise(interrupt)
    assert end.outcome == "in_doubt"


# -- the loop's edges ----------------------------------------------------------------------


def test_nothing_more_is_taken_once_the_loop_is_done() -> None:
    m = machine()
    assert walk(m, (core.ClaimKey(), a_replay(1))) == core.Settle(1, "replayed")
    with pytest.raises(RuntimeError):
        m.send(None)


def test_an_answer_the_claim_cannot_give_is_refused() -> None:
    m = machine()
    assert m.start() == core.ClaimKey()
    with pytest.raises(TypeError):
        m.send("not a claim")


def test_the_blocking_calls_are_the_ledger_probe_and_classifier_ones() -> None:
    claim = a_claim()
    calls = [
        core.ClaimKey(),
        core.Look(KEY),
        core.AskProbe(a_record(EffectStatus.UNKNOWN)),
        core.AskProbeForResult(KEY),
        core.Reconcile(KEY, Evidence.HAPPENED, actor="probe"),
        core.ReadReplay(KEY),
        core.Correct(KEY, 1),
        core.Classify(ValueError()),
        core.Release(claim, "", ValueError()),
        core.Fail(claim, "", ""),
        core.MarkUnknown(claim, "", ValueError()),
        core.GiveBack(claim, ""),
        core.Commit(claim, 1),
    ]
    driver_side = [
        core.Pause(2),
        core.Act(claim),
        core.LeaveInDoubt(claim, KeyboardInterrupt()),
        core.Settle(1, "executed"),
        core.Raise(ValueError()),
    ]
    assert all(isinstance(c, core.Call) for c in calls)
    assert not any(isinstance(d, core.Call) for d in driver_side)


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (doubt(), "in_doubt"),
        (KeyboardInterrupt(), "in_doubt"),
        (EffectFailed(KEY, "ValueError", "no"), "replayed"),
        (ResultUnknown(KEY), "replayed"),
        (ValueError("x"), "failed"),
    ],
)
def test_the_span_outcome_of_an_error(error: BaseException, outcome: str) -> None:
    assert core.outcome_of(error) == outcome
    assert core.Raise(error).outcome == outcome


def test_an_exception_is_evidence_and_any_other_base_exception_an_interrupt() -> None:
    error, interrupt = ValueError("x"), KeyboardInterrupt()
    assert core.acting_failed(error) == core.Raised(error)
    assert core.acting_failed(interrupt) == core.Interrupted(interrupt)
