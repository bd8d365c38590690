"""The guard's decision core: evidence in, the next action out, and no I/O.

:class:`Attempts` is the attempt loop of :func:`adapters.guard` as a small state machine,
in the spirit of h11 or httpcore under httpx: it never calls the ledger, the provider, the
probe or the clock. A driver asks it for an action (:meth:`Attempts.start`), carries the
action out and hands back what it saw (:meth:`Attempts.send`), until the core answers
:class:`Settle` (return a result) or :class:`Raise` (raise an error). The guard has two
thin drivers over this one core, sync and async; they differ only in how they wait, act
and reach the ledger.

The actions, and what each expects back:

========================= ===========================================================
action                    answer
========================= ===========================================================
:class:`ClaimKey`         the ledger's ``Claim`` or ``Replay``, or the
                          ``EffectInDoubt`` / ``ResultUnknown`` it raised
:class:`Look`             the in-doubt entry's ``EffectRecord``
:class:`AskProbe`         the probe's ``(evidence, result)``
:class:`AskProbeForResult` ``(evidence, result)``, or the ``Exception`` looking it up
                          or asking the probe raised (no answer is evidence too)
:class:`Reconcile`        what ``Ledger.reconcile`` returned (``Claim`` or record)
:class:`ReadReplay`       the ``Replay``
:class:`Correct`          ``None``
:class:`Classify`         the ``OutcomeClass`` of the attempt's error
:class:`Release`,         ``None`` (ledger writes)
:class:`Fail`,
:class:`MarkUnknown`,
:class:`GiveBack`,
:class:`Commit`
:class:`Pause`            ``None`` once the pause is over
:class:`Act`              :class:`Succeeded`, :class:`Raised` or :class:`Interrupted`
:class:`LeaveInDoubt`     ``None`` (the driver records an interrupt; never raises)
========================= ===========================================================

Actions that are a :class:`Call` are blocking calls (ledger, probe, classifier); the
async driver runs each consecutive run of them on the ledger's thread pool.

The rules (see :mod:`adapters.guard`): every attempt carries the same key; an attempt is
repeated only when the evidence allows it (not sent; class A inside its window; class B
proved not to have happened); an in-doubt entry found when claiming is reconciled by
evidence first, and reconciling it as not happened claims again at once (up to three
claims in one attempt, since nothing was sent); no claim outlives the attempt that took
it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeAlias

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

# -- actions ----------------------------------------------------------------------------


class Call:
    """A blocking call the driver makes for the core: to the ledger, the probe or the
    adapter's classifier."""


@dataclass(frozen=True)
class ClaimKey(Call):
    """Claim the effect's key (or get its replay)."""


@dataclass(frozen=True)
class Look(Call):
    """Read the in-doubt entry ``key_id``."""

    key_id: str


@dataclass(frozen=True)
class AskProbe(Call):
    """Ask the adapter's probe whether the in-doubt ``record`` happened."""

    record: EffectRecord


@dataclass(frozen=True)
class AskProbeForResult(Call):
    """Look up ``key_id`` and ask the probe for its result; a failure is an answer."""

    key_id: str


@dataclass(frozen=True)
class Reconcile(Call):
    """Move the in-doubt entry on by ``evidence`` (``Ledger.reconcile``)."""

    key_id: str
    evidence: Evidence | str
    actor: str
    result: Any = None


@dataclass(frozen=True)
class ReadReplay(Call):
    """Read the recorded result of ``key_id``."""

    key_id: str


@dataclass(frozen=True)
class Correct(Call):
    """Record the probe's ``result`` of an entry resolved as happened without one."""

    key_id: str
    result: Any


@dataclass(frozen=True)
class Classify(Call):
    """Classify the attempt's ``error`` by the adapter's evidence."""

    error: Exception


@dataclass(frozen=True)
class Release(Call):
    """The attempt never left: give the claim back (``Ledger.release``)."""

    claim: Claim
    detail: str
    error: Exception


@dataclass(frozen=True)
class Fail(Call):
    """The provider rejected the attempt: record it failed (``Ledger.fail``)."""

    claim: Claim
    error_type: str
    message: str


@dataclass(frozen=True)
class MarkUnknown(Call):
    """The attempt's outcome is ambiguous: leave the entry in doubt."""

    claim: Claim
    detail: str
    error: Exception


@dataclass(frozen=True)
class GiveBack(Call):
    """A re-send claim that will not be sent under: give it back unused."""

    claim: Claim
    reason: str


@dataclass(frozen=True)
class Commit(Call):
    """The attempt succeeded: record its ``result``."""

    claim: Claim
    result: Any


@dataclass(frozen=True)
class Pause:
    """Pause before ``attempt`` (2, 3, ...) as the retry policy says."""

    attempt: int


@dataclass(frozen=True)
class Act:
    """Call the guarded function under ``claim``; ``resend`` when it re-sends an in-doubt
    attempt under a re-send claim (class A, window open)."""

    claim: Claim
    resend: bool = False


@dataclass(frozen=True)
class LeaveInDoubt:
    """An interrupt arrived while acting under ``claim``: leave the entry in doubt."""

    claim: Claim
    error: BaseException


@dataclass(frozen=True)
class Settle:
    """Done: return ``result``; ``outcome`` is the span's (executed, replayed,
    reconciled), ``claim`` the claim it was executed under, if any."""

    result: Any
    outcome: str
    claim: Claim | None = None


@dataclass(frozen=True)
class Raise:
    """Done: raise ``error``."""

    error: BaseException

    @property
    def outcome(self) -> str:
        """The span outcome of ending with this error."""
        return outcome_of(self.error)


Action: TypeAlias = (
    ClaimKey
    | Look
    | AskProbe
    | AskProbeForResult
    | Reconcile
    | ReadReplay
    | Correct
    | Classify
    | Release
    | Fail
    | MarkUnknown
    | GiveBack
    | Commit
    | Pause
    | Act
    | LeaveInDoubt
    | Settle
    | Raise
)

# -- evidence from acting -----------------------------------------------------------------


@dataclass(frozen=True)
class Succeeded:
    """The guarded call returned ``result``."""

    result: Any


@dataclass(frozen=True)
class Raised:
    """The guarded call raised ``error`` (an ``Exception``)."""

    error: Exception


@dataclass(frozen=True)
class Interrupted:
    """An interrupt (a ``BaseException`` that is not an ``Exception``) while acting."""

    error: BaseException


def acting_failed(exc: BaseException) -> Raised | Interrupted:
    """The evidence of a guarded call that raised ``exc``: an ``Exception`` is recorded by
    evidence; any other ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``, a
    cancelled task) is an interrupt."""
    return Raised(exc) if isinstance(exc, Exception) else Interrupted(exc)


def outcome_of(exc: BaseException) -> str:
    """The span outcome of a call that ends with ``exc``."""
    if isinstance(exc, EffectInDoubt) or not isinstance(exc, Exception):
        return "in_doubt"  # an interrupt leaves the entry in doubt
    if isinstance(exc, EffectFailed | ResultUnknown):
        return "replayed"  # a recorded outcome, raised again
    return "failed"


def _chained(error: BaseException, cause: BaseException) -> BaseException:
    """``error`` as ``raise error from cause`` would raise it."""
    error.__cause__ = cause  # sets __suppress_context__ too, as ``from`` does
    return error


class _Again(Exception):
    """This attempt may be repeated with the same key; carries what it saw."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


_Steps: TypeAlias = Generator[Action, Any, Any]
_CLAIMS_PER_ATTEMPT = 3  # an in-doubt entry proved not to have happened is claimed anew


class Attempts:
    """The attempt loop of one guarded call, as a state machine with no I/O.

    Args:
        provider_class: What the provider can tell us about a call whose outcome was lost.
        has_probe: Whether the adapter has a probe.
        max_attempts: Attempts in all (the retry policy's).

    Attributes:
        attempt: The current attempt (0 before the first).
    """

    def __init__(self, *, provider_class: ProviderClass, has_probe: bool, max_attempts: int):
        self.provider_class = provider_class
        self.has_probe = has_probe
        self.max_attempts = max_attempts
        self.attempt = 0
        self._steps: _Steps = self._loop()
        self._done = False

    def start(self) -> Action:
        """The first action."""
        return self._next(None)

    def send(self, answer: Any) -> Action:
        """Hand back what the last action saw; get the next action.

        Raises:
            RuntimeError: The loop is already done (the last action was terminal).
        """
        if self._done:
            raise RuntimeError("the attempt loop is done; nothing more to send")
        return self._next(answer)

    def _next(self, answer: Any) -> Action:
        try:
            return self._steps.send(answer)
        except StopIteration as stop:
            self._done = True
            end: Settle | Raise = stop.value
            return end

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> _Steps:
        last: BaseException | None = None
        for attempt in range(1, self.max_attempts + 1):
            self.attempt = attempt
            if attempt > 1:
                yield Pause(attempt)
            try:
                out = yield from self._claim()
            except _Again as again:  # reconciled as not happened: claim anew
                last = again.cause
                continue
            if not isinstance(out, tuple):
                return out  # settled or raised while claiming
            claim, resend = out
            answer = yield Act(claim, resend)
            if isinstance(answer, Succeeded):
                yield Commit(claim, answer.result)
                return Settle(answer.result, "executed", claim)
            if isinstance(answer, Interrupted):  # in doubt, and stop
                yield LeaveInDoubt(claim, answer.error)
                return Raise(answer.error)
            assert isinstance(answer, Raised)
            try:
                return (yield from self._after_error(claim, answer.error))
            except _Again as again:
                last = again.cause
        assert last is not None
        return Raise(last)

    def _claim(self) -> _Steps:
        """``(claim, resend)`` to act under, or a terminal action; raises :class:`_Again`
        when reconciliation proved the in-doubt entry did not happen, every time."""
        for tries in range(1, _CLAIMS_PER_ATTEMPT + 1):
            try:
                return (yield from self._claim_once())
            except _Again:
                if tries == _CLAIMS_PER_ATTEMPT:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _claim_once(self) -> _Steps:
        out = yield ClaimKey()
        if isinstance(out, Claim):
            return out, False
        if isinstance(out, Replay):
            return Settle(out.result, "replayed")
        if isinstance(out, EffectInDoubt):
            moved = yield from self._reconcile(str(out.key_id), out)
            return (moved, True) if isinstance(moved, Claim) else moved
        if isinstance(out, ResultUnknown):
            return (yield from self._learn_result(out))
        raise TypeError(f"ClaimKey answered {type(out).__name__}")

    def _reconcile(self, key_id: str, cause: BaseException) -> _Steps:
        """Settle an in-doubt entry by evidence: a re-send claim (class A, window open),
        a terminal action (happened: settle; no evidence: raise), or raise
        :class:`_Again` (did not happen)."""
        record = yield Look(key_id)
        if record.status is EffectStatus.NEEDS_HUMAN:
            doubt = EffectInDoubt(key_id, record.status.value, record.provider_class.value)
            return Raise(_chained(doubt, cause))
        if self.provider_class is ProviderClass.DEDUPLICATING:
            moved = yield Reconcile(key_id, Evidence.WINDOW_OPEN, actor="guard")
        elif self.has_probe:
            evidence, result = yield AskProbe(record)
            moved = yield Reconcile(key_id, evidence, actor="probe", result=result)
        else:
            moved = yield Reconcile(key_id, Evidence.INCONCLUSIVE, actor="guard")
        if isinstance(moved, Claim):
            return moved
        if moved.status is EffectStatus.COMMITTED:
            replay = yield ReadReplay(key_id)
            return Settle(replay.result, "reconciled")
        if moved.status is EffectStatus.NOT_HAPPENED:
            raise _Again(cause)
        doubt = EffectInDoubt(key_id, moved.status.value, moved.provider_class.value)
        return Raise(_chained(doubt, cause))

    def _learn_result(self, unknown: ResultUnknown) -> _Steps:
        """An operator resolved the entry as happened without its result: ask the probe
        for it, record what it found as an audited correction, and replay that."""
        key_id = str(unknown.key_id)
        if not self.has_probe:
            return Raise(unknown)
        answer = yield AskProbeForResult(key_id)
        if isinstance(answer, Exception):  # not asked is no answer: a person looks
            failed = ResultUnknown(key_id, f"the probe failed: {type(answer).__name__}")
            return Raise(_chained(failed, answer))
        evidence, result = answer
        if Evidence(evidence) is not Evidence.HAPPENED:
            return Raise(ResultUnknown(key_id, f"the probe answered {Evidence(evidence).value}"))
        yield Correct(key_id, result)
        replay = yield ReadReplay(key_id)
        return Settle(replay.result, "reconciled")

    def _after_error(self, claim: Claim, exc: Exception) -> _Steps:
        """Record a failed attempt by evidence; raise :class:`_Again` when it may be
        repeated, else return the terminal action."""
        last = self.attempt == self.max_attempts
        outcome = yield Classify(exc)
        detail = type(exc).__name__
        if outcome is OutcomeClass.NOT_SENT:
            yield Release(claim, detail, exc)
            raise _Again(exc)
        if outcome is OutcomeClass.REJECTED:
            yield Fail(claim, detail, str(exc))
            return Raise(exc)
        yield MarkUnknown(claim, detail, exc)
        if self.provider_class is ProviderClass.DEDUPLICATING:
            if last:  # a re-send claim now would be left unused, blocking the next call
                doubt = EffectInDoubt(
                    claim.key_id,
                    EffectStatus.UNKNOWN.value,
                    ProviderClass.DEDUPLICATING.value,
                    "no attempt left to re-send it; the next call re-sends it with the same "
                    "key while the provider's dedup window is open",
                )
                return Raise(_chained(doubt, exc))
            raise _Again(exc)  # the next attempt re-sends it, after its pause
        if self.has_probe and not last:
            raise _Again(exc)  # the next attempt asks the probe, after its pause
        # The last class B attempt asks its probe now; class C needs a human. Proved not
        # to have happened raises _Again (the next call sends it).
        moved = yield from self._reconcile(claim.key_id, exc)
        if isinstance(moved, Claim):  # only class A re-sends
            yield GiveBack(moved, "re-send claim not used")
            doubt = EffectInDoubt(
                moved.key_id, EffectStatus.UNKNOWN.value, self.provider_class.value
            )
            doubt.__context__ = exc  # as raised while handling it
            return Raise(doubt)
        return moved
