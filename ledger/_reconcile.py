"""Moving an in-doubt effect on: by an adapter's evidence (:meth:`reconcile`), by an
operator's decision (:meth:`resolve`), and correcting such a decision (:meth:`correct`)."""

from __future__ import annotations

from typing import Any

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.checkpoint.failpoints import failpoint

from ._claims import ClaimMixin
from ._integrity import last_event_sql
from ._rows import Row, effect_record
from .errors import InvalidTransition
from .fence import current_fence
from .keys import EffectIdentity
from .records import UNKNOWN_RESULT, Claim, EffectRecord, EffectStatus, Evidence, ProviderClass

__all__ = ["ReconcileMixin"]


class ReconcileMixin(ClaimMixin):
    """Reconciliation and operators' decisions on in-doubt entries."""

    def reconcile(
        self,
        key_id: str,
        evidence: Evidence | str,
        *,
        result: Any = None,
        actor: str = "probe",
        detail: str = "",
        by: EffectIdentity | None = None,
    ) -> EffectRecord | Claim:
        """Move an in-doubt effect on, by the adapter's evidence.

        * ``HAPPENED`` → COMMITTED with ``result``;
        * ``NOT_HAPPENED`` → NOT_HAPPENED (the next claim re-sends with epoch + 1);
        * ``WINDOW_OPEN`` (class A, window not yet closed) → CLAIMED again, epoch + 1:
          the returned :class:`Claim` re-sends with the same provider key;
        * ``INCONCLUSIVE`` (or a window that has closed) → NEEDS_HUMAN.

        Only UNKNOWN entries, or CLAIMED ones whose lease expired, are reconciled.
        ``by``: the identity of the call that re-sends (a guard's); an explicit-key entry
        another run re-sends belongs to that run from then on, as with a claim.

        Raises:
            InvalidTransition: The entry is not in doubt.
            UnknownEffect: No such entry.
        """
        ev = Evidence(evidence)
        fence = current_fence()  # a re-send claim acts: fenced like any claim

        def txn(cur: Any) -> tuple[Row, bool]:
            row = self._locked_row(cur, key_id)
            now = self._clock()
            status = row["status"]
            expired = status == EffectStatus.CLAIMED.value and (row["lease_expires_at"] or 0) <= now
            if status != EffectStatus.UNKNOWN.value and not expired:
                raise InvalidTransition(key_id, status, f"reconcile with {ev.value}")
            base = {"lease_owner": None, "lease_expires_at": None}
            event = "reconciled"
            if ev is Evidence.HAPPENED:
                sealed = self._seal_outcome(row["subject"], key_id, "result", result, cur)
                changes = {**base, "status": EffectStatus.COMMITTED.value, "result_ct": sealed}
                why = detail or "probe: happened"
            elif ev is Evidence.NOT_HAPPENED:
                changes = {**base, "status": EffectStatus.NOT_HAPPENED.value}
                why = detail or "probe: did not happen"
            elif (
                ev is Evidence.WINDOW_OPEN
                and row["provider_class"] == ProviderClass.DEDUPLICATING.value
                and row["window_s"] is not None
                and (row["first_sent_at"] or 0) + float(row["window_s"]) > now
            ):
                resend = self._reclaim(cur, row, "resend", resend=True, fence=fence, by=by)
                return self._must(resend, key_id), True
            else:
                event = "needs_human"
                changes = {**base, "status": EffectStatus.NEEDS_HUMAN.value}
                if ev is not Evidence.WINDOW_OPEN:
                    why = detail or "no evidence either way"
                elif row["provider_class"] != ProviderClass.DEDUPLICATING.value:
                    why = detail or "window evidence, but the provider does not deduplicate"
                else:
                    why = detail or "dedup window closed"
            moved = self._transition(
                cur, row, event, changes, expect=status, actor=actor, detail=why
            )
            return self._must(moved, key_id), False

        failpoint("ledger.reconcile.before")
        row, resend = self._write(txn, outcome=False)
        failpoint("ledger.reconcile.after")
        self._remember(row)
        if resend:
            self._witness_claim(row["chain"])
            return self._claim_of(row, resend=True)
        return effect_record(row)

    def resolve(
        self,
        key_id: str,
        *,
        happened: bool,
        evidence: str,
        actor: str,
        result: Any = UNKNOWN_RESULT,
    ) -> EffectRecord:
        """An operator's decision on an in-doubt effect, recorded with evidence and identity.

        Args:
            key_id: The entry.
            happened: Whether the provider shows the effect.
            evidence: What the operator checked (kept in the audit trail).
            actor: Who decided.
            result: What the provider answered (any codec-encodable value, ``None``
                included), replayed to the step. Left out (:data:`UNKNOWN_RESULT`), the
                entry is "happened, result unknown": a replay raises
                :class:`ResultUnknown` (the guard first asks the adapter's probe) until
                :meth:`correct` records the result. Ignored when it did not happen.

        Running the same resolution again (the same decision, evidence and actor) returns
        the entry and changes nothing: an operator action whose answer was lost can be
        retried.

        Raises:
            InvalidTransition: The entry is not UNKNOWN, NEEDS_HUMAN or an expired claim
                (and not already resolved by this very decision).
            ConfigurationError: No evidence or actor given.
        """
        if not evidence.strip() or not actor.strip():
            raise ConfigurationError("resolve needs the evidence and the operator's identity")

        def txn(cur: Any) -> Row:
            row = self._locked_row(cur, key_id)
            status = row["status"]
            expired = (
                status == EffectStatus.CLAIMED.value
                and (row["lease_expires_at"] or 0) <= self._clock()
            )
            if (
                status not in (EffectStatus.UNKNOWN.value, EffectStatus.NEEDS_HUMAN.value)
                and not expired
            ):
                if self._resolved_already(cur, row, happened, result, evidence, actor):
                    return row  # this very decision, run again (its answer was lost)
                raise InvalidTransition(key_id, status, "resolve")
            changes: Row = {"lease_owner": None, "lease_expires_at": None}
            changes.update(self._decided(cur, row, happened, result))
            return self._must(
                self._transition(
                    cur, row, "resolved", changes, expect=status, actor=actor, detail=evidence
                ),
                key_id,
            )

        row = self._write(txn, outcome=False)
        self._remember(row)
        return effect_record(row)

    def _resolved_already(
        self, cur: Any, row: Row, happened: bool, result: Any, evidence: str, actor: str
    ) -> bool:
        """Whether the entry's last event is this very resolution (same decision, evidence
        and actor): an operator action whose answer was lost (the process died after the
        commit, before waking the run) may then be run again."""
        want = EffectStatus.COMMITTED.value if happened else EffectStatus.NOT_HAPPENED.value
        if row["status"] != want:
            return False
        if happened and (row["result_ct"] is None) != (result is UNKNOWN_RESULT):
            return False
        cur.execute(
            last_event_sql("event, actor, detail", self._q),
            (row["chain"], row["chain"], row["key_id"]),
        )
        last = cur.fetchone()
        return last is not None and tuple(map(str, last)) == ("resolved", actor, evidence)

    def correct(
        self,
        key_id: str,
        *,
        happened: bool = True,
        result: Any = UNKNOWN_RESULT,
        evidence: str,
        actor: str,
    ) -> EffectRecord:
        """Correct an operator's resolution: record the result it left out, or a better
        one, or that the effect did (not) happen after all. Recorded as a ``corrected``
        audit event with the evidence and the actor.

        Only outcomes that came from :meth:`resolve` (or an earlier correction) can be
        corrected: an outcome the provider answered or a probe found is evidence, not a
        decision. Once the entry was sent again after a "did not happen", the new
        attempt's outcome stands. Correcting to "did not happen" lets the next claim send
        the effect again; a run that replayed the old result keeps what it did with it.

        Args:
            key_id: The entry.
            happened: Whether the effect happened.
            result: What the provider answered (see :meth:`resolve`); left out, the result
                is unknown. Only with ``happened``.
            evidence: What was checked (kept in the audit trail).
            actor: Who corrects.

        Returns:
            The corrected entry.

        Raises:
            InvalidTransition: The entry's outcome did not come from an operator.
            ConfigurationError: No evidence or actor given, or a result for an effect that
                did not happen.
            UnknownEffect: No such entry.
        """
        if not evidence.strip() or not actor.strip():
            raise ConfigurationError("correct needs the evidence and the operator's identity")
        if not happened and result is not UNKNOWN_RESULT:
            raise ConfigurationError("an effect that did not happen has no result to record")

        def txn(cur: Any) -> Row:
            row = self._locked_row(cur, key_id)
            status = row["status"]
            cur.execute(last_event_sql("event", self._q), (row["chain"], row["chain"], key_id))
            last = cur.fetchone()
            decided = last is not None and str(last[0]) in ("resolved", "corrected")
            if not decided or status not in (
                EffectStatus.COMMITTED.value,
                EffectStatus.NOT_HAPPENED.value,
            ):
                raise InvalidTransition(
                    key_id,
                    status if last is None else f"{status} (by {last[0]})",
                    "correct an outcome that no operator decided (only `effects resolve` "
                    "outcomes are corrected)",
                )
            return self._must(
                self._transition(
                    cur,
                    row,
                    "corrected",
                    self._decided(cur, row, happened, result),
                    expect=status,
                    actor=actor,
                    detail=evidence,
                ),
                key_id,
            )

        row = self._write(txn, outcome=False)
        self._remember(row)
        return effect_record(row)

    def _decided(self, cur: Any, row: Row, happened: bool, result: Any) -> Row:
        """The changes of an operator's decision (resolve, correct)."""
        if not happened:
            return {"status": EffectStatus.NOT_HAPPENED.value, "result_ct": None}
        sealed = (
            None
            if result is UNKNOWN_RESULT
            else self._seal_outcome(row["subject"], row["key_id"], "result", result, cur)
        )
        return {"status": EffectStatus.COMMITTED.value, "result_ct": sealed}
