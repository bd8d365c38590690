"""Settling an attempt and every transition's audit event.

An outcome (:meth:`commit`, :meth:`fail`, :meth:`mark_unknown`, :meth:`release`) is a
compare-and-set on the claim's ``(key_id, epoch, status)``; a stale claim's outcome is
refused and the refusal recorded. Every transition appends a sealed event to its chain,
linked to the chain's sealed head, in the same transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from onceonly.checkpoint.errors import CodecError, CorruptRecord, StoreError
from onceonly.checkpoint.failpoints import failpoint

from ._integrity import (
    EVENT_COLS,
    GENESIS,
    IntegrityMixin,
    effect_parts,
    event_parts,
    folded_transition_sql,
    hash_of,
    head_of,
    head_parts,
    last_event_sql,
    row_and_last_sql,
    row_digest,
    split_row,
)
from ._privacy import PrivacyMixin
from ._rows import Row, effect_record
from ._schema import COLUMNS
from .errors import LEDGER_HINT, InvalidTransition, LeaseLost, UnknownEffect
from .records import Claim, EffectRecord, EffectStatus, OutcomeClass

__all__ = ["TransitionMixin"]

log = logging.getLogger("onceonly.ledger")

# Failpoints (before, after) around recording each kind of outcome, by its audit event.
_RECORD_POINTS = {
    "committed": ("ledger.commit.before", "ledger.commit.after"),
    "failed": ("ledger.fail.before", "ledger.fail.after"),
    "unknown": ("ledger.mark_unknown.before", "ledger.mark_unknown.after"),
    "not_sent": ("ledger.release.before", "ledger.release.after"),
}


# An audit event's insert: its values (placeholders) and its guard (the chain's last event
# is the one it links to).
_INSERT_EVENT = (
    "INSERT INTO oo_audit (" + EVENT_COLS + ", mac) SELECT {} WHERE {} ON CONFLICT DO NOTHING"
)


class TransitionMixin(IntegrityMixin, PrivacyMixin):
    """Outcomes of attempts, and the compare-and-set transitions and audit appends that
    every state change goes through."""

    # -- outcomes -----------------------------------------------------------------------
    def commit(self, claim: Claim, result: Any) -> EffectRecord:
        """Record success; durable before this returns (a caller never sees a result the
        ledger could lose).

        Raises:
            LeaseLost: The claim is stale: the outcome was refused, and the refusal is
                recorded in the entry's audit chain (a ``late_outcome`` event) and logged.
            LedgerUnavailable: Not recorded; this ledger now refuses further work.
        """
        return effect_record(self._commit_row(claim, result))

    def _commit_row(self, claim: Claim, result: Any) -> Row:
        try:
            encoded = self.codec.encode(result)
        except CodecError as exc:
            # The effect happened but its result cannot be recorded: in doubt, not lost.
            self.mark_unknown(claim, "result could not be encoded", error=exc)
            raise
        sealed = self._seal_outcome(claim.subject, claim.key_id, "result", encoded=encoded)
        row = self._finish(
            claim,
            "committed",
            {
                "status": EffectStatus.COMMITTED.value,
                "result_ct": sealed,
                "outcome_class": OutcomeClass.SUCCEEDED.value,
                "lease_owner": None,
                "lease_expires_at": None,
            },
            "",
        )
        self._terminal[row["key_id"]] = row
        return row

    def fail(
        self, claim: Claim, error_type: str, message: str, info: Mapping[str, Any] | None = None
    ) -> EffectRecord:
        """Record a definite failure (the provider refused; nothing happened). Replayed as
        :class:`EffectFailed` forever after, never retried.

        Raises:
            LeaseLost / LedgerUnavailable: As in :meth:`commit`.
        """
        payload = {"type": error_type, "message": message, "info": dict(info or {})}
        sealed = self._seal_outcome(claim.subject, claim.key_id, "error", payload)
        row = self._finish(
            claim,
            "failed",
            {
                "status": EffectStatus.FAILED.value,
                "error_ct": sealed,
                "outcome_class": OutcomeClass.REJECTED.value,
                "lease_owner": None,
                "lease_expires_at": None,
            },
            "",
        )
        self._terminal[row["key_id"]] = row
        return effect_record(row)

    def mark_unknown(
        self, claim: Claim, detail: str = "", *, error: BaseException | None = None
    ) -> EffectRecord:
        """Record that the attempt's outcome is ambiguous (sent, no answer): UNKNOWN.

        Args:
            claim: The live claim.
            detail: A short plaintext note for the audit trail (no personal data).
            error: The exception seen; its message is stored encrypted.

        Raises:
            LeaseLost / LedgerUnavailable: As in :meth:`commit`.
        """
        return self._settle(
            claim, "unknown", EffectStatus.UNKNOWN, OutcomeClass.AMBIGUOUS, detail, error
        )

    def release(
        self, claim: Claim, detail: str = "not sent", *, error: BaseException | None = None
    ) -> EffectRecord:
        """Record that the attempt provably never left (connect refused): NOT_HAPPENED, so
        a later claim may send it again with the next epoch.

        Args:
            claim: The live claim.
            detail: A short plaintext note for the audit trail (no personal data).
            error: The exception seen; its message is stored encrypted.

        Raises:
            LeaseLost / LedgerUnavailable: As in :meth:`commit`.
        """
        return self._settle(
            claim, "not_sent", EffectStatus.NOT_HAPPENED, OutcomeClass.NOT_SENT, detail, error
        )

    def _settle(
        self,
        claim: Claim,
        event: str,
        status: EffectStatus,
        outcome: OutcomeClass,
        detail: str,
        error: BaseException | None,
    ) -> EffectRecord:
        changes: Row = {
            "status": status.value,
            "outcome_class": outcome.value,
            "lease_owner": None,
            "lease_expires_at": None,
        }
        if error is not None:
            changes["error_ct"] = self._seal_error(claim, error)
        return effect_record(self._finish(claim, event, changes, detail))

    def renew(self, claim: Claim) -> Claim:
        """Extend a live claim's lease (for long calls).

        Raises:
            LeaseLost: The claim is stale.
        """

        def txn(cur: Any) -> float:
            q = self._q
            until = self._clock() + self.lease_s
            cur.execute(
                f"UPDATE oo_effects SET lease_expires_at = {q} WHERE key_id = {q} AND epoch = {q} "
                f"AND status = {q} AND lease_owner = {q}",
                (until, claim.key_id, claim.epoch, EffectStatus.CLAIMED.value, claim.lease_owner),
            )
            if cur.rowcount != 1:
                raise self._lost(cur, claim)
            return until

        until = self._write(txn, outcome=False)
        return Claim(**{**claim.__dict__, "lease_expires_at": until})

    def _finish(self, claim: Claim, event: str, changes: Row, detail: str) -> Row:
        """Record an attempt's outcome: compare-and-set on the claim's epoch.

        The transaction is idempotent: run again after a commit whose result was lost
        (the connection dropped at COMMIT), it finds its own outcome and returns it. A
        stale claim's outcome is refused, and the refusal itself is recorded (a
        ``late_outcome`` event, committed) before :class:`LeaseLost` is raised.
        """

        def txn(cur: Any) -> tuple[Row, LeaseLost | None]:
            mine = self._mine.pop(claim.key_id, None)
            if mine is not None and self._folds and not self._pg:
                folded = self._fold_outcome(cur, mine, claim, event, changes, detail)
                if folded is not None:
                    return folded, None
            cur.execute(row_and_last_sql(f"r.key_id = {self._q}", lock=self._pg), (claim.key_id,))
            found = cur.fetchone()
            if found is None:
                raise UnknownEffect(claim.key_id)
            row, last = split_row(found)
            self._check_row(cur, row, last, mine=mine)
            if int(row["epoch"]) == claim.epoch and row["status"] == EffectStatus.CLAIMED.value:
                moved = self._transition(
                    cur,
                    row,
                    event,
                    changes,
                    expect=EffectStatus.CLAIMED.value,
                    actor=claim.lease_owner,
                    detail=detail,
                    epoch=claim.epoch,
                )
                if moved is not None:
                    return moved, None
            if self._recorded_already(cur, row, claim, event, changes):
                return row, None
            now = self._clock()
            status, epoch = row["status"], int(row["epoch"])
            reported = f"{event} ({detail})" if detail else event
            self._append(
                cur,
                {**row, "updated_at": now},
                "late_outcome",
                claim.lease_owner,
                f"refused {reported} from stale epoch {claim.epoch}; the entry is {status} "
                f"at epoch {epoch}",
                epoch=claim.epoch,
            )
            return row, LeaseLost(claim.key_id, claim.epoch, epoch, status)

        failpoint(_RECORD_POINTS[event][0])
        try:
            row, lost = self._write(txn, outcome=True)
        finally:
            self._live.discard((claim.key_id, claim.epoch))
        if lost is not None:
            log.warning(
                "late outcome refused: %s of effect %s… by %s at stale epoch %d (the entry is "
                "%s at epoch %d); recorded in the audit chain of %s as late_outcome",
                event,
                claim.key_id[:16],
                claim.lease_owner,
                claim.epoch,
                lost.status,
                lost.current_epoch,
                claim.chain,
            )
            raise lost
        failpoint(_RECORD_POINTS[event][1])
        return row

    def _fold_outcome(
        self,
        cur: Any,
        mine: tuple[tuple[Any, ...], tuple[Any, ...]],
        claim: Claim,
        event: str,
        changes: Row,
        detail: str,
    ) -> Row | None:
        """An outcome's compare-and-set with its row check folded in (SQLite), for a claim
        this process sealed: the update applies only to the row and last event exactly as
        this process wrote them (:func:`folded_transition_sql`), which is what
        :meth:`_check_row` with ``mine`` accepts without verifying again. None (nothing
        written): the full path reads, verifies and decides."""
        sealed, appended = mine
        row = dict(zip(COLUMNS, sealed, strict=True))
        if int(row["epoch"]) != claim.epoch or row["status"] != EffectStatus.CLAIMED.value:
            return None
        now = self._clock()
        new = {**row, **changes, "updated_at": now}
        parts = effect_parts(new)
        changed = {**changes, "seal": self._seal("effects", parts)}
        new["seal"] = changed["seal"]
        cur.execute(
            folded_transition_sql(self._q, tuple(changed)),
            [
                *changed.values(),
                now,
                *sealed,
                *appended,
                row["chain"],
                row["key_id"],
                appended[1],
            ],
        )
        if cur.rowcount != 1:
            return None
        self._append(cur, new, event, claim.lease_owner, detail, digest=parts[2])
        return new

    def _recorded_already(self, cur: Any, row: Row, claim: Claim, event: str, changes: Row) -> bool:
        """Whether the row holds exactly this outcome, recorded by this claim (its last
        event is ours at this epoch): an earlier run of the same outcome transaction
        committed. The sealed payloads carry random nonces, so equal ciphertexts can
        only be this transaction's own."""
        if int(row["epoch"]) != claim.epoch or any(row[c] != v for c, v in changes.items()):
            return False
        q = self._q
        cur.execute(
            last_event_sql("event, actor, epoch", q), (row["chain"], row["chain"], row["key_id"])
        )
        last = cur.fetchone()
        return last is not None and (str(last[0]), str(last[1]), int(last[2])) == (
            event,
            claim.lease_owner,
            claim.epoch,
        )

    def _lost(self, cur: Any, claim: Claim) -> LeaseLost:
        cur.execute(
            f"SELECT epoch, status FROM oo_effects WHERE key_id = {self._q}", (claim.key_id,)
        )
        found = cur.fetchone()
        if found is None:
            return LeaseLost(claim.key_id, claim.epoch, -1, "missing")
        return LeaseLost(claim.key_id, claim.epoch, int(found[0]), str(found[1]))

    def _must(self, row: Row | None, key_id: str) -> Row:
        if row is None:
            raise InvalidTransition(key_id, "changed concurrently", "apply the transition")
        return row

    def _locked_row(self, cur: Any, key_id: str) -> Row:
        cur.execute(row_and_last_sql(f"r.key_id = {self._q}", lock=self._pg), (key_id,))
        found = cur.fetchone()
        if found is None:
            raise UnknownEffect(key_id)
        row, last = split_row(found)
        self._check_row(cur, row, last)
        return row

    # -- transitions and the audit chain --------------------------------------------------
    def _transition(
        self,
        cur: Any,
        row: Row,
        event: str,
        changes: Row,
        *,
        expect: str,
        actor: str,
        detail: str,
        epoch: int | None = None,
    ) -> Row | None:
        """Compare-and-set on (key, epoch, status); append the audit event. None if lost."""
        q = self._q
        now = self._clock()
        new = {**row, **changes, "updated_at": now}
        parts = effect_parts(new)
        changes = {**changes, "seal": self._seal("effects", parts)}
        new["seal"] = changes["seal"]
        sets = ", ".join(f"{c} = {q}" for c in [*changes, "updated_at"])
        update = (
            f"UPDATE oo_effects SET {sets} WHERE key_id = {q} AND epoch = {q} AND status = {q}",
            [
                *changes.values(),
                now,
                row["key_id"],
                row["epoch"] if epoch is None else epoch,
                expect,
            ],
        )
        appended = self._write_appending(cur, update, new, event, actor, detail, digest=parts[2])
        if appended is None:
            return None
        if new["status"] == EffectStatus.CLAIMED.value:
            self._remember_mine(new, appended)
        return new

    def _append(
        self,
        cur: Any,
        row: Row,
        event: str,
        actor: str,
        detail: str,
        *,
        epoch: int | None = None,
        digest: Any = None,
    ) -> tuple[Any, ...]:
        """Append a sealed event to the row's chain (see :meth:`_write_appending`)."""
        appended = self._write_appending(
            cur, None, row, event, actor, detail, epoch=epoch, digest=digest
        )
        assert appended is not None  # only a lead that wrote nothing returns None
        return appended

    def _write_appending(
        self,
        cur: Any,
        lead: tuple[str, Sequence[Any]] | None,
        row: Row,
        event: str,
        actor: str,
        detail: str,
        *,
        epoch: int | None = None,
        digest: Any = None,
    ) -> tuple[Any, ...] | None:
        """Write a row with ``lead``, then append a sealed event to the row's chain,
        linked to the chain's sealed head, and advance the head; returns the event as
        stored (``EVENT_COLS`` and ``mac``).

        ``lead``: the statement (SQL and arguments) that writes the row this event
        records, an insert or compare-and-set update that may write nothing (or None:
        the row is written already). The event is appended only if the lead wrote the
        row; None is returned if it did not. On PostgreSQL the row's write, the event
        and the head's move are one statement (one round trip instead of three; each
        part runs only if the one before it wrote), unless folds are off.

        The event records the row's state (status, digest); ``epoch`` overrides the
        event's epoch (a refused late outcome names the stale epoch it came from);
        ``digest``: the row's digest when the caller has just computed it.

        The insert only succeeds if the event it links to is still the last one (and its
        sequence number is free), so a stale cached head, a rolled-back transaction or a
        concurrent appender on another worker can never fork or gap the chain; on a miss
        the head is re-read and the append retried. The head is read from
        ``oo_chain_heads`` (sealed), never from the last event alone: an append never
        papers over deleted events.
        """
        q = self._q
        chain = row["chain"]
        digest = row_digest(row) if digest is None else digest
        at = float(row["updated_at"])
        event_epoch = int(row["epoch"]) if epoch is None else epoch
        head = self._heads.get(chain)
        select = ", ".join([q] * 13)
        missed: tuple[int, bytes] | None = None  # a head read from the store that missed
        if lead is not None and not (self._pg and self._folds):
            cur.execute(*lead)
            if cur.rowcount != 1:
                return None
            lead = None
        for _ in range(64):
            fresh = head is None
            if head is None:
                head = head_of(cur, q, self._keys, chain)
                if head is None:
                    head = (0, GENESIS)
                if head == missed:
                    # Read again, the head has not moved, yet the event it names is not
                    # the chain's last: not a concurrent appender, a deleted event.
                    raise CorruptRecord(
                        f"audit chain {chain!r}: its sealed head (event {head[0]}) is not "
                        f"its last event (events deleted or added behind the ledger's "
                        f"back); nothing is acted on. Run `onceonly audit verify`",
                        run_id=None if chain.startswith("tenant:") else chain,
                        hint=LEDGER_HINT,
                    )
            seq = head[0] + 1
            # EVENT_COLS order; the hash covers every field before it
            fields = (
                chain,
                seq,
                row["key_id"],
                event,
                event_epoch,
                row["status"],
                actor,
                detail,
                digest,
                at,
                head[1],
            )
            h = hash_of(fields)
            values = (*fields, h)
            mac = self._seal("audit", event_parts(values))
            if head[0] == 0:
                guard = f"NOT EXISTS (SELECT 1 FROM oo_audit WHERE chain = {q})"
                guard_args: tuple[Any, ...] = (chain,)
            else:
                guard = (
                    f"EXISTS (SELECT 1 FROM oo_audit WHERE chain = {q} AND seq = {q} "
                    f"AND hash = {q})"
                )
                guard_args = (chain, head[0], head[1])
            args = (*values, mac, *guard_args)
            if lead is not None:
                # the event's guard also waits for the lead's write
                insert = _INSERT_EVENT.format(select, f"EXISTS (SELECT 1 FROM lead) AND {guard}")
                wrote, appended = self._lead_append(cur, lead, insert, args, chain, head, seq, h)
                lead = None
                if not wrote:
                    return None
            else:
                cur.execute(_INSERT_EVENT.format(select, guard), args)
                appended = cur.rowcount == 1
                if appended:
                    self._advance_head(cur, chain, head, seq, h)
            if appended:
                self._heads[chain] = (seq, h)
                known = self._verified.get(chain)
                if known is not None and known[0] == head[0]:
                    self._verified[chain] = (seq, known[1])
                return (*values, mac)
            # A stale cached head or a concurrent appender: re-read and retry.
            missed = head if fresh else None
            head = None
        raise StoreError(f"could not append to audit chain {chain!r}: its head kept moving")

    def _advance_head(
        self, cur: Any, chain: str, old: tuple[int, bytes], seq: int, h: bytes
    ) -> None:
        """Move the chain's sealed head from ``old`` to ``(seq, h)`` (compare-and-set).

        Raises:
            CorruptRecord: The head is not where the chain's last event is (events or
                the head were deleted behind the ledger's back).
        """
        sql, params, seal = self._head_sql(chain, old, seq, h, "")
        cur.execute(sql, params)
        self._head_moved(chain, seq, h, seal, cur.rowcount == 1)

    def _head_sql(
        self, chain: str, old: tuple[int, bytes], seq: int, h: bytes, cond: str
    ) -> tuple[str, tuple[Any, ...], bytes]:
        """The statement moving the chain's sealed head from ``old`` to ``(seq, h)``
        (compare-and-set; ``cond``: a further SQL condition), its arguments and the seal."""
        q = self._q
        seal = self._seal("heads", head_parts(chain, seq, h))
        if old[0] == 0:
            # (SQLite reads ON CONFLICT after a SELECT without WHERE as a join's ON)
            source = (
                f"SELECT {q}, {q}, {q}, {q} WHERE {cond}"
                if cond
                else f"VALUES ({q}, {q}, {q}, {q})"
            )
            sql = (
                f"INSERT INTO oo_chain_heads (chain, seq, hash, seal) {source} "
                f"ON CONFLICT DO NOTHING"
            )
            return sql, (chain, seq, h, seal), seal
        where = f" AND {cond}" if cond else ""
        sql = (
            f"UPDATE oo_chain_heads SET seq = {q}, hash = {q}, seal = {q} "
            f"WHERE chain = {q} AND seq = {q} AND hash = {q}{where}"
        )
        return sql, (seq, h, seal, chain, old[0], old[1]), seal

    def _lead_append(
        self,
        cur: Any,
        lead: tuple[str, Sequence[Any]],
        insert: str,
        insert_args: Sequence[Any],
        chain: str,
        head: tuple[int, bytes],
        seq: int,
        h: bytes,
    ) -> tuple[bool, bool]:
        """PostgreSQL: the row's write, the event's insert (``insert``, its guard
        conditional on ``lead``) and the head's move in one statement, each part
        conditional on the one before it having written. Returns
        whether the lead wrote and whether the event was appended (the head moved, or
        :class:`CorruptRecord` was raised)."""
        lead_sql, lead_args = lead
        head_sql, head_args, seal = self._head_sql(chain, head, seq, h, "EXISTS (SELECT 1 FROM ev)")
        cur.execute(
            f"WITH lead AS ({lead_sql} RETURNING 1), ev AS ({insert} RETURNING 1), "
            f"hd AS ({head_sql} RETURNING 1) SELECT (SELECT COUNT(*) FROM lead), "
            f"(SELECT COUNT(*) FROM ev), (SELECT COUNT(*) FROM hd)",
            (*lead_args, *insert_args, *head_args),
        )
        wrote, appended, moved = (int(n) for n in cur.fetchone())
        if not wrote:
            return False, False
        if appended:
            self._head_moved(chain, seq, h, seal, moved == 1)
        return True, bool(appended)

    def _head_moved(self, chain: str, seq: int, h: bytes, seal: bytes, moved: bool) -> None:
        self._head_seals[chain] = (seq, h, seal)
        if not moved:
            self._head_seals.pop(chain, None)
            raise CorruptRecord(
                f"audit chain {chain!r}: its sealed head is not its last event (events or "
                f"the head deleted); nothing is acted on. Run `onceonly audit verify`",
                run_id=None if chain.startswith("tenant:") else chain,
                hint=LEDGER_HINT,
            )
