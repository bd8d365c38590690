"""Replaying finished effects: a run's finished rows loaded in one scan (``prefetch``),
cached when their outcome can never change, and opened into a :class:`Replay`."""

from __future__ import annotations

from typing import Any

from ._integrity import IntegrityMixin
from ._privacy import PrivacyMixin
from ._rows import SELECT, TERMINAL, Row, effect_row
from .errors import EffectFailed, PayloadErased, ResultUnknown
from .records import EffectStatus, OutcomeClass, Replay

__all__ = ["ReplayMixin"]

# A finished row may be cached (and replayed from memory) only if its outcome can never
# change: one a worker recorded from the provider's answer. Outcomes settled by a probe or
# an operator may be corrected (:meth:`Ledger.correct`), so they are read afresh each time.
_SETTLED_BY_ANSWER = (OutcomeClass.SUCCEEDED.value, OutcomeClass.REJECTED.value)


def _cacheable(row: Row) -> bool:
    return row["status"] in TERMINAL and row["outcome_class"] in _SETTLED_BY_ANSWER


class ReplayMixin(IntegrityMixin, PrivacyMixin):
    """The replay cache and opening recorded outcomes."""

    def prefetched(self, run_id: str) -> bool:
        """Whether this ledger has loaded the run's finished effects already (they stay
        loaded: a finished outcome never changes; one finished since, by another
        process, is read from the database when its key is claimed)."""
        return run_id in self._prefetched

    def prefetch(self, run_id: str) -> int:
        """Load a run's finished effects into memory in one range scan, so replaying them
        is a lookup plus a fingerprint check. Returns how many were loaded."""

        def scan(cur: Any) -> list[Row]:
            q = self._q
            cur.execute(
                f"{SELECT} WHERE run_id = {q} AND status IN ({q}, {q})", (run_id, *TERMINAL)
            )
            return self._audited_rows(cur, [effect_row(r) for r in cur.fetchall()])

        rows = self.store.read(scan)
        with self._lock:
            for row in rows:
                if _cacheable(row):
                    self._terminal[row["key_id"]] = row
            self._prefetched.add(run_id)
        return len(rows)

    def _remember(self, row: Row) -> None:
        """Cache a finished row for replay from memory, if its outcome can never change."""
        if _cacheable(row):
            self._terminal[row["key_id"]] = row
        else:
            self._terminal.pop(row["key_id"], None)

    def _replay(self, row: Row) -> Replay:
        if row["result_ct"] is None and row["status"] == EffectStatus.COMMITTED.value:
            # Every recorded commit seals a value (None included): no ciphertext means an
            # operator said it happened without saying what the provider answered.
            raise ResultUnknown(row["key_id"])
        try:
            if row["status"] == EffectStatus.FAILED.value:
                info = self._open(row, "error")
                raise EffectFailed(
                    row["key_id"], str(info["type"]), str(info["message"]), info.get("info")
                )
            return Replay(self._open(row, "result"), row)
        except PayloadErased as exc:
            raise PayloadErased(row["key_id"], row["subject"]) from exc
