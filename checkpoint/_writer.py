"""Writing queued checkpoints: the durability modes, group commits and the background writer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from . import _engine
from ._blobs import _Blobs
from ._connections import _RawTxn
from ._engine import classify, is_integrity_error, translate
from ._retry import NO_READ, retried
from ._sql import _row_parts
from ._state import _Barrier, _Pending
from .errors import ConcurrentWrite, CorruptRecord
from .failpoints import failpoint
from .integrity import _make_seal as seal
from .records import Durability

T = TypeVar("T")


class _Writer(_Blobs):
    """The write path under every durability mode: ``sync`` writes at once, ``exit``
    keeps checkpoints pending until the next barrier, ``async`` hands them to a
    background thread that group-commits them (one run's lost race isolated from the
    batch)."""

    def flush(self) -> None:
        """Write barrier: when this returns, every checkpoint saved before it is durable.

        Call it before any external effect. A no-op in ``sync`` mode.

        Raises:
            AsyncWriteError: A background write failed.
            StoreError: Writing the pending checkpoints failed (``exit`` mode).
        """
        if self._writer is not None and self._writer.is_alive():
            barrier = _Barrier()
            self._queue.put(barrier)
            barrier.done.wait()
        if self._pending:
            with self._lock:
                self._flush_locked_pending()
        self._check_open()

    def transact(
        self, fn: Callable[[Any], T], *, idempotent: bool = False, together: Iterable[str] = ()
    ) -> T:
        """Run ``fn(cursor)`` in a write transaction behind the write barrier.

        Every checkpoint saved before this call is committed in the same transaction as
        ``fn``'s statements (``exit`` mode), or in the same group commit (``async`` mode:
        concurrent callers share one durable commit), or before it (``sync``). When this
        returns, both are durable. ``fn`` runs inside a savepoint: if it raises, its own
        statements are rolled back, the checkpoints still commit, and the error is
        re-raised here. Upper layers (the effects ledger) write through this method.

        A transient failure (see :class:`DatabaseRetry`) that wrote nothing runs ``fn``
        again in a new transaction, so ``fn`` must keep no effects outside its cursor that
        a second run would repeat.

        Args:
            fn: Receives a DBAPI cursor (parameter marker :attr:`param`).
            idempotent: Running ``fn`` again after its COMMIT may have gone through is
                harmless: a lost COMMIT is retried too instead of raised.
            together: Run ids whose checkpoints waiting in ``exit`` mode (saved with
                ``durability="exit"``, on a store of any mode) commit together with
                ``fn``'s statements or not at all, without savepoints: if ``fn`` raises,
                or one of them cannot be written (another writer advanced its run:
                :class:`ConcurrentWrite`), nothing of this transaction commits, they are
                dropped (those runs' next save builds on the stored head) and the error
                is raised here. Other runs' waiting checkpoints are written first, in a
                transaction of their own, as always. On a store whose ``async`` writer
                runs, such a transaction is written by the caller's thread, as a
                ``sync`` save is (a group commit isolates its members); with nothing of
                ``together`` waiting, ``fn`` joins the group commit as usual.

        Returns:
            What ``fn`` returned.

        Raises:
            StoreError: The transaction could not be committed (nothing of it is durable),
                or, with ``may_have_committed`` set, its COMMIT's answer was lost.
        """
        return self.retry.call(
            "run a transaction",
            lambda: self._transact(fn, together),
            idempotent=idempotent,
            store=NO_READ,  # a write has its own transaction: it retries itself
        )

    def _transact(self, fn: Callable[[Any], T], together: Iterable[str] = ()) -> T:
        self._check_open()
        is_async = self._writer is not None
        runs = frozenset(together)
        if runs:
            with self._lock:
                if any(p.run_id in runs for p in self._pending):
                    # exit-mode checkpoints to commit with ``fn``, all or nothing: written
                    # here (on an async store as a sync save is, beside the writer's
                    # group commits)
                    barrier = _Barrier(fn, waits=False)
                    self._write_together(barrier, runs)
                    return barrier.outcome()  # type: ignore[no-any-return]
        barrier = _Barrier(fn, waits=is_async)
        if is_async:
            if self._pending:
                # exit-mode runs' checkpoints (runs of several modes share this store):
                # durable before ``fn``, in a commit of their own
                with self._lock:
                    self._flush_locked_pending()
            self._queue.put(barrier)
            barrier.done.wait()
            # Our work committed (or failed on its own): an unrelated background failure
            # surfaces on the next call, never as this call's error.
        else:
            with self._lock:
                if self.durability is Durability.EXIT or self._pending:
                    self._write_exit([barrier])
                else:
                    self._write_batch([], [barrier])
        return barrier.outcome()  # type: ignore[no-any-return]

    @retried("write checkpoints", idempotent=False)
    def _write_batch(
        self,
        batch: Sequence[_Pending],
        participants: Sequence[_Barrier] = (),
        *,
        isolate: bool = True,
    ) -> list[_Pending]:
        """Write checkpoints, then run participants' work, in one durable commit.

        A group commit isolates its members: each queued checkpoint is written in its
        own savepoint, so one that lost a race to another writer (ConcurrentWrite) is
        left out and the others, and every participant's work, still commit. Only a
        synchronous save, or a ``transact(together=True)`` (``isolate=False``: its caller
        waits for it), gets its ConcurrentWrite raised; then a participant runs without
        a savepoint too, and its error rolls back the whole transaction.

        The hot path uses the pooled DBAPI connection with fixed SQL: one statement per
        row, no ORM, no per-call statement compilation.

        Returns:
            The checkpoints that were left out (a lost race).
        """
        for part in participants:
            part.error = None  # from an earlier attempt of this batch
        lost: list[_Pending] = []
        lost_runs: set[str] = set()
        with translate("write checkpoints"), _RawTxn(self, write=True) as cur:
            for i, p in enumerate(batch):
                if p.run_id in lost_runs:
                    # Built on a checkpoint of this batch that was left out: left out too.
                    lost.append(p)
                    continue
                if not isolate:
                    self._write_pending(cur, p)
                    continue
                cur.execute(f"SAVEPOINT oo_c{i}")
                mark = self._revs_mark()
                try:
                    self._write_pending(cur, p)
                except (ConcurrentWrite, CorruptRecord):
                    # A lost race, or a run row that fails its seal (its next load says
                    # so): this member alone is left out.
                    cur.execute(f"ROLLBACK TO SAVEPOINT oo_c{i}")
                    self._revs_mark(mark)
                    lost.append(p)
                    lost_runs.add(p.run_id)
                cur.execute(f"RELEASE SAVEPOINT oo_c{i}")
            solo = not batch and len(participants) == 1
            for i, part in enumerate(participants):
                if part.fn is None:
                    continue
                if solo or not isolate:
                    # Alone in its transaction (an error rolls back just its own work), or
                    # committing together with the checkpoints (an error rolls back all).
                    part.result = part.fn(cur)
                    continue
                cur.execute(f"SAVEPOINT oo_p{i}")
                mark = self._revs_mark()
                try:
                    part.result = part.fn(cur)
                except Exception as exc:  # noqa: BLE001  (handed to that participant)
                    # Driver errors reach the participant translated, as they would
                    # outside a savepoint.
                    part.error = (
                        classify(exc, "run a transaction")
                        if isinstance(exc, _engine.DRIVER_ERRORS)
                        else exc
                    )
                    cur.execute(f"ROLLBACK TO SAVEPOINT oo_p{i}")
                    self._revs_mark(mark)
                cur.execute(f"RELEASE SAVEPOINT oo_p{i}")
            failpoint("checkpoint.commit.before")
        failpoint("checkpoint.commit.after")
        return lost

    def _write_pending(self, cur: Any, p: _Pending) -> None:
        """Write one checkpoint and advance its run's head, compare-and-set on the parent:
        the run's head must still be the exact checkpoint this one was built on (its
        sequence number *and* its digest), else :class:`ConcurrentWrite`."""
        sql = self._sql
        keys = self.integrity
        # Without keys a run row is left unsealed (never with a seal that no longer
        # matches it): a keyed reader then says plainly that it carries no seal.
        run_values = {**p.run_values, "seal": None} if keys is None else self._resealed(cur, p)
        if p.blobs:
            cur.executemany(sql.ins_blob, [(h, len(d), d) for h, d in p.blobs.items()])
        if p.refs:
            cur.executemany(sql.ins_ref, [(p.run_id, h) for h in p.refs])
        ckpt_seal = seal(keys, "checkpoints", _row_parts(p.run_id, p))
        row = (
            p.run_id,
            p.seq,
            p.kind,
            p.keyframe_seq,
            p.step,
            p.source,
            p.schema_version,
            p.created_at,
            p.body,
            p.digest,
            ckpt_seal,
        )
        cols = sorted(run_values)
        params: list[Any] = [p.seq, p.created_at, *(run_values[c] for c in cols), p.run_id]
        checked = p.seq > 0 and bool(p.parent_digest)
        if p.seq > 0:
            params.append(p.seq - 1)
            if checked:
                params.extend([p.run_id, p.seq - 1, p.parent_digest])
        advance = sql.advance(tuple(cols), first=p.seq == 0, parent=checked)
        folded = self._dialect != "sqlite"
        try:
            if folded:
                # One round trip: the head moves only if the checkpoint was inserted
                # (a taken sequence number raises, as the insert alone does).
                cur.execute(
                    f"WITH c AS ({sql.ins_ckpt} RETURNING 1) {advance} "
                    f"AND EXISTS (SELECT 1 FROM c)",
                    (*row, *params),
                )
            else:
                cur.execute(sql.ins_ckpt, row)
        except _engine.DRIVER_ERRORS as exc:
            if is_integrity_error(exc):
                raise ConcurrentWrite(p.run_id, p.seq - 1) from exc
            raise
        if not folded:
            cur.execute(advance, params)
        if cur.rowcount != 1:
            raise ConcurrentWrite(p.run_id, p.seq - 1)

    def _resealed(self, cur: Any, p: _Pending) -> dict[str, Any]:
        """The run columns a checkpoint writes, with the run's new seal: the run row is
        read (and its seal checked against the parent) in the writing transaction."""
        run = self.read_run_in(cur, p.run_id, lock=True)
        expected_head = None if p.seq == 0 else p.seq - 1
        if run is None or run.head_seq != expected_head:
            raise ConcurrentWrite(p.run_id, p.seq - 1)
        values = self._next_revision(run, {**p.run_values, "head_seq": p.seq}, p.digest)
        return {**p.run_values, **{c: values[c] for c in ("handoff", "rev", "seal")}}

    def _written(self, batch: Sequence[_Pending], lost: Sequence[_Pending]) -> None:
        """Bookkeeping after queued checkpoints were written (or left out): forget the
        cached heads of runs whose checkpoint lost a race. Called by whichever thread
        wrote them; takes only the small counting lock."""
        with self._count_lock:
            self._stale_runs.update(p.run_id for p in lost)
            for p in lost:
                if p.reported < self._reported.get(p.run_id, 0):
                    continue  # queued before a loss of its run was reported: said already
                self._lost[p.run_id] = min(self._lost.get(p.run_id, p.seq - 1), p.seq - 1)
            for p in batch:
                n = self._unwritten.get(p.run_id, 0) - 1
                if n > 0:
                    self._unwritten[p.run_id] = n
                else:
                    self._unwritten.pop(p.run_id, None)
                    self._queued_mode.pop(p.run_id, None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch: list[_Pending] = []
            barriers: list[_Barrier] = []
            stop = False
            while True:
                if isinstance(item, _Barrier):
                    barriers.append(item)
                elif item is None:
                    stop = True
                    break
                else:
                    batch.append(item)
                if len(batch) >= 512:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            work = [b for b in barriers if b.fn is not None]
            # Checkpoints queued in a generation whose write failed are deltas on top of
            # lost ones: drop them, even after the caller has been told of the failure.
            live = [p for p in batch if p.gen > self._dead_gen]
            if len(live) < len(batch):
                self._heads_stale = True
            lost: list[_Pending] = []
            if live or work:
                try:
                    lost = self._write_batch(live, work)
                except BaseException as exc:  # noqa: BLE001  (surfaced on the next call)
                    for b in work:
                        b.error = exc
                    if live:
                        self._dead_gen = max(p.gen for p in live)
                        self._async_error = exc
                        self._heads_stale = True
            self._written(batch, lost)
            for b in barriers:
                b.done.set()
            if stop:
                return

    def _flush_locked_pending(self) -> None:
        if self._pending:
            self._write_exit([])

    def _start_writer(self) -> None:
        """Start the background writer (under the lock), for the first ``async``
        checkpoint of a store whose own mode is another."""
        if self._writer is None and not self._closed:
            self._writer = threading.Thread(
                target=self._write_loop, name="onceonly-checkpoint-writer", daemon=True
            )
            self._writer.start()

    def _write_together(self, barrier: _Barrier, runs: frozenset[str]) -> None:
        """:meth:`transact` with ``together``, under the lock: other runs' pending
        checkpoints first (as :meth:`_write_exit` writes them), then those of ``runs``
        and ``barrier``'s work in one transaction, all or nothing."""
        ours = [p for p in self._pending if p.run_id in runs]
        others = [p for p in self._pending if p.run_id not in runs]
        if others:
            self._pending = others
            try:
                self._write_exit([])
            except BaseException:
                self._pending = ours  # still waiting, for a later transaction
                raise
        self._pending = []
        try:
            self._write_batch(ours, [barrier], isolate=False)
        except BaseException:
            for p in ours:
                self._heads.pop(p.run_id, None)
            self._written(ours, [])
            raise
        self._written(ours, [])

    def _write_exit(self, participants: Sequence[_Barrier]) -> None:
        """``exit`` mode: write every pending checkpoint (and ``participants``' work) in
        one transaction, under the lock."""
        pending, self._pending = self._pending, []
        try:
            lost = self._write_batch(pending, participants)
        except BaseException:
            if pending:
                self._heads.clear()
            self._written(pending, [])
            raise
        self._written(pending, lost)
        for p in lost:
            self._heads.pop(p.run_id, None)
