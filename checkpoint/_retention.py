"""Retention: finished runs deleted (archived first, if asked) once the policy allows."""

from __future__ import annotations

import json
import time

from sqlalchemy import delete, select

from . import _schema
from ._engine import translate
from ._retry import retried
from ._runs import _run_fields
from ._writes import _Writes
from .errors import CheckpointNotFound
from .records import RetentionPolicy, RetentionReport, RunStatus, Snapshot


class _Retention(_Writes):
    """Applying a :class:`~checkpoint.records.RetentionPolicy`."""

    # Idempotent: a run deleted already is not selected again (one archived but not yet
    # deleted when the database failed is archived a second time, in an identical line).
    @retried("apply retention", idempotent=True)
    def apply_retention(
        self, policy: RetentionPolicy, *, now: float | None = None
    ) -> RetentionReport:
        """Delete (optionally archiving first) finished runs older than the policy allows,
        then collect blobs no run refers to. Waiting and running runs are never touched,
        nor a run whose effect keys a remaining run shares (a live fork's origin).

        Returns:
            What was removed.
        """
        self._check_open()
        self.flush()
        cutoff = (time.time() if now is None else now) - policy.older_than_s
        r = _schema.runs
        statuses = [RunStatus(s).value for s in policy.statuses]
        links = _schema.run_links
        live = r.alias("live")
        # A run whose effect keys a remaining run shares (a live fork's origin) stays.
        shared = (
            select(links.c.run_id)
            .join(live, live.c.run_id == links.c.run_id)
            .where(links.c.key_run == r.c.run_id)
            .exists()
        )
        archived = 0
        deleted = 0
        seen: set[str] = set()
        # Rounds: a fork's origin becomes removable once the fork itself was removed.
        while True:
            with translate("select runs for retention"), self._reader() as conn:
                victims = [
                    row[0]
                    for row in conn.execute(
                        select(r.c.run_id)
                        .where(r.c.status.in_(statuses), r.c.updated_at < cutoff, ~shared)
                        .order_by(r.c.updated_at)
                    )
                    if row[0] not in seen
                ]
            if not victims:
                break
            seen.update(victims)
            for run_id in victims:
                archived, deleted = self._retire(
                    run_id, policy, statuses, cutoff, archived, deleted
                )
        collected = self.collect_garbage()
        return RetentionReport(deleted, archived, collected)

    def _retire(
        self,
        run_id: str,
        policy: RetentionPolicy,
        statuses: list[str],
        cutoff: float,
        archived: int,
        deleted: int,
    ) -> tuple[int, int]:
        """Archive and delete one run selected for retention, unless it was resumed or
        forked meanwhile. Returns the counters, advanced."""
        r = _schema.runs
        links = _schema.run_links
        if policy.archive_path is not None:
            self._archive(run_id, policy.archive_path)
            archived += 1
        with translate("delete a run"), self.engine.begin() as conn:
            # Re-check inside the write transaction: the run may have been resumed.
            # On PostgreSQL the row lock makes a fork that is starting on this run
            # (which share-locks it) either finish first, so its link is seen below,
            # or find the run gone; SQLite writers are serial anyway.
            still = conn.execute(
                select(r.c.run_id)
                .where(r.c.run_id == run_id, r.c.status.in_(statuses), r.c.updated_at < cutoff)
                .with_for_update()
            ).first()
            forked = conn.execute(
                select(links.c.run_id).where(
                    links.c.key_run == run_id,
                    links.c.run_id.in_(select(r.c.run_id).where(r.c.run_id != run_id)),
                )
            ).first()
            if still is None or forked is not None:
                return archived, deleted  # resumed or forked meanwhile (it stays)
            if self.witness is not None:
                self.witness.forget([run_id])  # before the removal commits
            conn.execute(delete(links).where(links.c.run_id == run_id))
            conn.execute(delete(_schema.checkpoints).where(_schema.checkpoints.c.run_id == run_id))
            conn.execute(delete(_schema.blob_refs).where(_schema.blob_refs.c.owner == run_id))
            conn.execute(delete(r).where(r.c.run_id == run_id))
            deleted += 1
        self._heads.pop(run_id, None)
        return archived, deleted

    def _archive(self, run_id: str, path: str) -> None:
        run = self.get_run(run_id)
        try:
            snap: Snapshot | None = self._load(run_id, None, lazy=False)[0]
        except CheckpointNotFound:
            snap = None
        record = {
            "run": {
                **_run_fields(run),
                "handoff": run.handoff.to_doc(),
                "created_at": run.created_at,
                "updated_at": run.updated_at,
            },
            "state": None if snap is None else json.loads(self.codec.encode(snap.state)),
            "history": [
                {
                    "seq": i.seq,
                    "step": i.step,
                    "source": i.source.value,
                    "schema_version": i.schema_version,
                    "created_at": i.created_at,
                }
                for i in self.history(run_id)
            ],
        }
        line = json.dumps(record, sort_keys=True, ensure_ascii=False)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            import os  # noqa: PLC0415

            os.fsync(fh.fileno())
