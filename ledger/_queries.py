"""Reading the ledger: entries, payloads, audit events, verification, retention.

Mixed into :class:`ledger.Ledger`; kept apart so the state machine reads on its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from onceonly.checkpoint import RowKeys
from onceonly.checkpoint.errors import ConfigurationError, CorruptRecord

from ._integrity import ACTION_EVENT, effect_parts, row_and_last_sql, split_row
from ._rows import SELECT, TERMINAL, Row, effect_record, effect_row
from ._transitions import TransitionMixin
from .audit import AuditReport, export_witness, verify_store
from .crypto import Sealer
from .errors import PayloadErased, UnknownEffect
from .records import EffectRecord, EffectStatus, RetentionPolicy

__all__: list[str] = []


def _flagged(record: EffectRecord, keys: RowKeys | None, row: Row) -> EffectRecord:
    """The record, flagged ``edited`` / ``unsealed`` when its row fails its seal, or
    ``unverified`` without keys (a read-only view)."""
    if keys is None:
        return dataclasses.replace(record, integrity="unverified")
    seal = row.get("seal")
    if seal is None:
        return dataclasses.replace(record, integrity="unsealed")
    if not keys.valid("effects", effect_parts(row), seal):
        return dataclasses.replace(record, integrity="edited")
    return record


class QueryMixin(TransitionMixin):
    """Read-side methods of the ledger, and retention (which appends ``retired`` events)."""

    def get(self, key_id: str) -> EffectRecord:
        """The entry with this key id, flagged if it does not verify (its seal, and its
        last audit event: see :attr:`EffectRecord.integrity`).

        Raises:
            UnknownEffect: No such entry.
        """
        row, last = self._row_and_last(key_id)
        record = _flagged(effect_record(row), self._keys, row)
        if record.integrity != "ok":
            return record
        try:
            self._check_row(None, row, last)
        except CorruptRecord:
            return dataclasses.replace(record, integrity="diverged")
        return record

    def _row_and_last(self, key_id: str) -> tuple[Row, Sequence[Any] | None]:
        """The entry's row and its newest audit event (None: none), read in one
        statement: of one moment, so a transition committed meanwhile never reads as a
        row that differs from its audit trail.

        Raises:
            UnknownEffect: No such entry.
        """

        def q(cur: Any) -> tuple[Row, Sequence[Any] | None] | None:
            cur.execute(row_and_last_sql(f"r.key_id = {self._q}", lock=False), (key_id,))
            found = cur.fetchone()
            return None if found is None else split_row(found)

        got = self.store.read(q)
        if got is None:
            raise UnknownEffect(key_id)
        return got

    def payload(self, key_id: str) -> dict[str, Any]:
        """The decrypted arguments (canonical form), result and error of an entry.

        Raises:
            PayloadErased: The subject's key was erased.
            CorruptRecord: A ciphertext fails authentication.
        """
        row, _ = self._row_and_last(key_id)
        try:
            args = None
            if row["args_ct"] is not None:
                cipher = self._cipher(row["subject"])
                args = self.codec.decode(
                    Sealer.open(cipher, row["args_ct"], f"{key_id}|args".encode())
                )
            return {
                "args": args,
                "result": self._open(row, "result"),
                "error": self._open(row, "error"),
            }
        except PayloadErased as exc:
            raise PayloadErased(key_id, row["subject"]) from exc

    def effects(
        self,
        *,
        run_id: str | None = None,
        status: EffectStatus | str | None = None,
        effect: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
        step_id: str | None = None,
    ) -> list[EffectRecord]:
        """Entries matching every given filter, newest first, each flagged if it fails
        its seal (:attr:`EffectRecord.integrity`)."""
        rows = self._query(run_id, status, effect, since, until, limit, step_id)
        return [_flagged(effect_record(r), self._keys, r) for r in rows]

    def _query(
        self,
        run_id: str | None,
        status: EffectStatus | str | None,
        effect: str | None,
        since: float | None,
        until: float | None,
        limit: int | None,
        step_id: str | None = None,
    ) -> list[Row]:
        q = self._q
        where, params = [], []
        for col, op, val in (
            ("run_id", "=", run_id),
            ("step_id", "=", step_id),
            ("status", "=", None if status is None else EffectStatus(status).value),
            ("effect", "=", effect),
            ("updated_at", ">=", since),
            ("updated_at", "<", until),
        ):
            if val is not None:
                where.append(f"{col} {op} {q}")
                params.append(val)
        sql = SELECT + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY updated_at DESC, key_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"

        def scan(cur: Any) -> list[Row]:
            cur.execute(sql, params)
            return [effect_row(r) for r in cur.fetchall()]

        return self.store.read(scan)

    def export_jsonl(self, path: str, **filters: Any) -> int:
        """Append matching entries (metadata only, never payloads) to a JSONL file.

        Returns:
            How many were written.
        """
        rows = self.effects(**filters)
        with open(path, "a", encoding="utf-8") as fh:
            for rec in rows:
                d = dict(rec.__dict__)
                for k in ("status", "provider_class", "outcome_class"):
                    d[k] = None if d[k] is None else str(d[k])
                fh.write(json.dumps(d, sort_keys=True) + "\n")
        return len(rows)

    def audit_events(
        self, chain: str, *, key_ids: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """The audit events of one chain (a run id, or ``tenant:<tenant>``), in order;
        with ``key_ids``, only those entries' events."""
        q = self._q
        where = f"chain = {q}"
        params: list[Any] = [chain]
        if key_ids is not None:
            if not key_ids:
                return []
            where += f" AND key_id IN ({', '.join([q] * len(key_ids))})"
            params.extend(key_ids)

        def scan(cur: Any) -> list[dict[str, Any]]:
            cur.execute(
                "SELECT chain, seq, key_id, event, epoch, status, actor, detail, row_digest, at, "
                f"prev_hash, hash FROM oo_audit WHERE {where} ORDER BY seq",
                params,
            )
            keys = (
                "chain",
                "seq",
                "key_id",
                "event",
                "epoch",
                "status",
                "actor",
                "detail",
                "row_digest",
                "at",
                "prev_hash",
                "hash",
            )
            return [dict(zip(keys, r, strict=True)) for r in cur.fetchall()]

        return self.store.read(scan)

    # -- operator actions in the audit chain -------------------------------------------
    def record_action(
        self, chain: str, ident: str, *, actor: str, detail: dict[str, Any]
    ) -> dict[str, Any]:
        """Append a person's action to an audit chain (a run id): an ``operator`` event,
        hash-chained and sealed like the effects' events, that belongs to no effect row
        (verification knows it by its event name). ``ident`` names the action within
        the chain: recording the same ``ident`` again (an interrupted action repeated)
        appends nothing and returns the event recorded first.

        Returns:
            The event (as :meth:`audit_events` gives it, ``detail`` decoded).

        Raises:
            ConfigurationError: The ledger is read-only.
        """
        key_id = "op:" + hashlib.sha256(f"{chain}\x1f{ident}".encode()).hexdigest()[:61]
        text = json.dumps(detail, sort_keys=True, separators=(",", ":"), default=str)
        q = self._q

        def txn(cur: Any) -> None:
            cur.execute(
                f"SELECT 1 FROM oo_audit WHERE chain = {q} AND key_id = {q} LIMIT 1",
                (chain, key_id),
            )
            if cur.fetchone() is not None:
                return
            row = {
                "chain": chain,
                "key_id": key_id,
                "status": ACTION_EVENT,
                "epoch": 0,
                "updated_at": self._clock(),
            }
            digest = hashlib.sha256(text.encode()).digest()
            self._append(cur, row, ACTION_EVENT, actor[:200], text, digest=digest)

        self._write(txn, outcome=False)
        (event,) = self.audit_events(chain, key_ids=[key_id])  # by the chain's key index
        return {**event, "detail": json.loads(event["detail"])}

    def operator_actions(self, chain: str) -> list[dict[str, Any]]:
        """The people's actions recorded in an audit chain (:meth:`record_action`), in
        order, each with ``detail`` decoded."""
        return [
            {**ev, "detail": json.loads(ev["detail"])}
            for ev in self.audit_events(chain)
            if ev["event"] == ACTION_EVENT
        ]

    # -- verification ------------------------------------------------------------------
    def verify(self, *, witness: str | None = None) -> AuditReport:
        """Check every audit chain, every effect row against its last event, every blob and
        checkpoint row, and (given a witness file, or with the ledger's own witness,
        ``ONCEONLY_WITNESS``) that no chain was rolled back.

        Detects edited, deleted, reordered or forged events and rows, rows moved between
        runs, and a store restored below the witnessed heads.
        """
        if witness is None and self.witness is not None:
            witness = self.witness.path  # the ledger's own (ONCEONLY_WITNESS)
        report = verify_store(self.store, witness=witness)
        report.data_keys, problems = self._verify_data_keys()
        report.problems.extend(problems)
        return report

    def _verify_data_keys(self) -> tuple[int, list[str]]:
        """Every data key opens with the keyring, bound to its subject; every subject
        whose effects hold payloads has one (erasure keeps the row, without its key)."""

        def scan(cur: Any) -> tuple[list[Any], set[str]]:
            cur.execute("SELECT subject, secret_id, wrapped FROM oo_data_keys")
            rows = cur.fetchall()
            cur.execute(
                "SELECT DISTINCT subject FROM oo_effects WHERE args_ct IS NOT NULL "
                "OR result_ct IS NOT NULL OR error_ct IS NOT NULL"
            )
            return rows, {str(r[0]) for r in cur.fetchall()}

        rows, used = self.store.read(scan)
        problems: list[str] = []
        have: set[str] = set()
        for subject, secret_id, wrapped in rows:
            have.add(str(subject))
            if wrapped is None:
                continue  # erased
            try:
                self._sealer.unwrap(str(subject), str(secret_id), bytes(wrapped))
            except (CorruptRecord, ConfigurationError) as exc:
                why = getattr(exc, "detail", str(exc))
                problems.append(
                    f"data key of subject {subject!r}: {why} (edited, moved to another "
                    f"subject, or wrapped by a secret no longer in the keyring)"
                )
        problems.extend(
            f"data key of subject {subject!r} is missing (deleted or renamed: erasing a "
            f"subject keeps its row): its effects' payloads cannot be read"
            for subject in sorted(used - have)
        )
        return len(rows), problems

    def export_witness(self, path: str) -> dict[str, Any]:
        """Write every chain's head (and a digest over them) to an external witness file.

        Keep the file outside the database (another host, object storage with versioning):
        :meth:`verify` with ``witness=path`` detects a store rolled back below it.
        """
        return export_witness(self.store, path, self._clock())

    # -- retention ---------------------------------------------------------------------
    def apply_retention(self, policy: RetentionPolicy) -> int:
        """Remove finished entries past their dedup window and age whose run is gone.

        Each removal appends a ``retired`` event to the chain first, so verification knows
        the row was removed on purpose. Returns how many entries were removed.
        """
        now = self._clock()
        cutoff = now - policy.older_than_s
        finished = (*TERMINAL, EffectStatus.NOT_HAPPENED.value)

        # An entry stays while its run exists, or any run that shares its run's effect
        # keys (a fork replays its origin's entries): checked again in each delete.
        gone = (
            "(run_id IS NULL OR (NOT EXISTS (SELECT 1 FROM oo_runs r WHERE r.run_id = "
            "oo_effects.run_id) AND NOT EXISTS (SELECT 1 FROM oo_run_links l WHERE "
            "l.key_run = oo_effects.run_id)))"
        )

        def pick(cur: Any) -> list[Row]:
            q = self._q
            cur.execute(
                f"{SELECT} WHERE status IN ({q}, {q}, {q}) AND updated_at < {q} AND {gone}",
                (*finished, cutoff),
            )
            return [
                r
                for r in (effect_row(x) for x in cur.fetchall())
                if r["window_s"] is None or (r["first_sent_at"] or 0) + float(r["window_s"]) < now
            ]

        victims = self.store.read(pick)
        if policy.archive_path is not None and victims:
            with open(policy.archive_path, "a", encoding="utf-8") as fh:
                for row in victims:
                    fh.write(
                        json.dumps(
                            {k: (v.hex() if isinstance(v, bytes) else v) for k, v in row.items()},
                            sort_keys=True,
                        )
                        + "\n"
                    )
                fh.flush()
                os.fsync(fh.fileno())  # the archive is durable before any entry is deleted
        removed = 0
        for row in victims:

            def txn(cur: Any, row: Row = row) -> int:
                q = self._q
                # The run (and its links) are read again in the delete itself: a run
                # started or forked since the pick keeps the entry.
                cur.execute(
                    f"DELETE FROM oo_effects WHERE key_id = {q} AND epoch = {q} AND status = {q} "
                    f"AND {gone}",
                    (row["key_id"], row["epoch"], row["status"]),
                )
                if cur.rowcount != 1:
                    return 0
                self._append(cur, {**row, "updated_at": self._clock()}, "retired", "retention", "")
                return 1

            removed += self._write(txn, outcome=False)
            self._terminal.pop(row["key_id"], None)
        return removed
