"""Reading checkpoints: a keyframe and its deltas, every row verified before it is decoded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from . import _delta, _schema
from ._blobs import BLOB_MISSING
from ._connections import _RawTxn
from ._engine import translate
from ._retry import retried
from ._sql import _KEYFRAME, _RUN_COLS, _row_info, _row_key, _row_parts
from ._state import _Head
from ._writer import _Writer
from .errors import CheckpointNotFound, ConfigurationError, CorruptRecord, RunNotFound
from .integrity import _check_seal as check
from .records import CheckpointInfo, Run, Snapshot


class _Reads(_Writer):
    """Loading and verifying checkpoint rows; a run's history."""

    @retried("load a run", idempotent=True)
    def _load_run_rows(
        self, run_id: str, *, lazy: bool
    ) -> tuple[Run, tuple[Snapshot, _Head] | None]:
        """Read the run row and its head checkpoint's rows in one statement (one
        snapshot on both databases), then its blobs in the same read transaction (blobs
        are immutable and referenced, so they cannot change under it)."""
        with translate("load a run"), _RawTxn(self, write=False) as cur:
            cur.execute(self._sql.run_and_head, (run_id,))
            found = cur.fetchall()
            if not found:
                raise RunNotFound(run_id)
            n = len(_RUN_COLS)
            rows = [_Row(*r[n:-1]) for r in found if r[n] is not None]
            head_digest = rows[-1].digest if rows else None
            run = self._checked_run([*found[0][:n], head_digest])
            _check_nothing_above(run_id, run.head_seq, found[0][-1])
            if run.head_seq is None:
                return run, None
            if not rows:
                raise CorruptRecord(
                    "the checkpoint, or the keyframe it depends on, is missing",
                    run_id=run_id,
                    seq=int(run.head_seq),
                )
            return run, self._materialise(cur, run_id, rows, int(run.head_seq), lazy=lazy)

    @retried("read a run", idempotent=True)
    def _load_head_seq(self, run_id: str) -> int | None:
        r = _schema.runs
        with translate("read a run"), self._reader() as conn:
            row = conn.execute(select(r.c.head_seq).where(r.c.run_id == run_id)).first()
        if row is None:
            raise RunNotFound(run_id)
        return None if row[0] is None else int(row[0])

    @retried("load a checkpoint", idempotent=True)
    def _load(self, run_id: str, seq: int | None, *, lazy: bool) -> tuple[Snapshot, _Head]:
        sql = self._sql
        with translate("load a checkpoint"), _RawTxn(self, write=False) as cur:
            if seq is None:
                cur.execute(sql.run_head_top, (run_id, run_id))
                found = cur.fetchone()
                if found is not None:
                    _check_nothing_above(run_id, found[0], found[1])
                cur.execute(sql.head_rows, (run_id, run_id, run_id, run_id))
            else:
                cur.execute(sql.seq_rows, (run_id, run_id, seq, seq))
            rows = [_Row(*r) for r in cur.fetchall()]
            if not rows:
                cur.execute(sql.run_head, (run_id,))
                found = cur.fetchone()
                if found is None:
                    raise RunNotFound(run_id)
                head_seq = found[0]
                asked = head_seq if seq is None else seq
                if head_seq is not None and 0 <= asked <= int(head_seq):
                    # The run says this checkpoint exists: it (or its keyframe) was lost,
                    # which must never read as "not saved yet" (a caller would restart).
                    raise CorruptRecord(
                        "the checkpoint, or the keyframe it depends on, is missing",
                        run_id=run_id,
                        seq=int(asked),
                    )
                raise CheckpointNotFound(run_id, seq)
            target = rows[-1].seq
            if seq is not None and target != seq:
                raise CheckpointNotFound(run_id, seq)
            return self._materialise(cur, run_id, rows, target, lazy=lazy)

    def _materialise(
        self, cur: Any, run_id: str, rows: Sequence[_Row], target: int, *, lazy: bool
    ) -> tuple[Snapshot, _Head]:
        """Verify a keyframe and its deltas up to ``target`` and build the state (blobs
        are read through ``cur``, in the caller's read transaction)."""
        if rows[-1].seq != target:
            raise CorruptRecord(
                "the run's head checkpoint is missing", run_id=run_id, seq=int(target)
            )
        bodies, raw_sizes = self._verify_rows(run_id, rows)
        wanted: set[bytes] = set()
        for body in bodies:
            wanted |= _delta.blob_refs_of(body, chunks=not lazy)
        blob_values, blob_sizes = self._read_blobs(cur, run_id, target, wanted)
        first = rows[0]
        if first.kind != _KEYFRAME or first.seq != rows[-1].keyframe_seq:
            raise CorruptRecord(
                "the keyframe this checkpoint depends on is missing", run_id=run_id, seq=target
            )
        expected = list(range(first.seq, target + 1))
        if [row.seq for row in rows] != expected:
            raise CorruptRecord("a delta in the chain is missing", run_id=run_id, seq=target)
        lists: dict[str, _delta.ListChunks] = {}
        try:
            fetch = self._chunk_fetcher(run_id) if lazy else None
            state = _delta.materialise_keyframe(bodies[0], blob_values, lists, fetch)
            delta_bytes = sum(raw_sizes[1:])
            for row, body in zip(rows[1:], bodies[1:], strict=True):
                ops = _delta.resolve_delta(body, blob_values)
                _delta.apply(state, ops, where=f"checkpoint {row.seq}")
                for ch, op in ops.items():
                    if op[0] != "a":
                        lists.pop(ch, None)
        except CorruptRecord as exc:
            raise CorruptRecord(exc.detail, run_id=run_id, seq=target) from exc
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"checkpoint body is malformed ({exc!r})", run_id=run_id, seq=target
            ) from exc
        info = _row_info(run_id, rows[-1])
        # Canonical (uncompressed) sizes, as the writer counts them: the keyframe policy
        # behaves the same whether or not the process was restarted.
        kf_bytes = raw_sizes[0] + sum(blob_sizes.values())
        head = _Head(
            seq=info.seq,
            keyframe_seq=info.keyframe_seq,
            deltas=len(rows) - 1,
            delta_bytes=delta_bytes,
            keyframe_bytes=kf_bytes,
            schema_version=info.schema_version,
            state=state,
            lists=lists,
            info=info,
        )
        # The snapshot shares the head's state: a caller that keeps the head (the cache)
        # hands out a private copy (see ``load``).
        return Snapshot(state, info), head

    @retried("load checkpoints", idempotent=True)
    def _load_range(
        self, run_id: str, low: int, high: int
    ) -> tuple[list[_Row], list[Any], dict[bytes, Any]]:
        """The rows from the keyframe of checkpoint ``low`` to checkpoint ``high``, each
        verified, their decoded bodies and the blobs they refer to (one read)."""
        with translate("load checkpoints"), _RawTxn(self, write=False) as cur:
            cur.execute(self._sql.seq_rows, (run_id, run_id, low, high))
            rows = [_Row(*r) for r in cur.fetchall()]
            if not rows or rows[-1].seq != high or rows[0].seq > low:
                raise CheckpointNotFound(run_id, high if rows and rows[0].seq <= low else low)
            if [row.seq for row in rows] != list(range(rows[0].seq, high + 1)):
                raise CorruptRecord("a delta in the chain is missing", run_id=run_id, seq=high)
            bodies, _ = self._verify_rows(run_id, rows)
            wanted: set[bytes] = set()
            for body in bodies:
                wanted |= _delta.blob_refs_of(body, chunks=True)
            blob_values, _ = self._read_blobs(cur, run_id, high, wanted)
        return rows, bodies, blob_values

    def _states_in(
        self, run_id: str, rows: Sequence[_Row], bodies: Sequence[Any], blobs: Any, want: set[int]
    ) -> Iterator[tuple[CheckpointInfo, dict[str, Any]]]:
        """Walk the rows of :meth:`_load_range` forward, keyframe by keyframe and delta
        by delta, and give the state at each checkpoint in ``want`` (updated in place by
        the next step of the walk)."""
        state: dict[str, Any] = {}
        keyframe = -1
        for row, body in zip(rows, bodies, strict=True):
            try:
                if row.kind == _KEYFRAME:
                    if row.keyframe_seq != row.seq:
                        raise CorruptRecord("a keyframe names another keyframe")
                    keyframe = row.seq
                    state = _delta.materialise_keyframe(body, blobs, {}, None)
                elif keyframe < 0 or row.keyframe_seq != keyframe:
                    raise CorruptRecord("the keyframe this checkpoint depends on is missing")
                else:
                    ops = _delta.resolve_delta(body, blobs)
                    _delta.apply(state, ops, where=f"checkpoint {row.seq}")
            except CorruptRecord as exc:
                raise CorruptRecord(exc.detail, run_id=run_id, seq=row.seq) from exc
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise CorruptRecord(
                    f"checkpoint body is malformed ({exc!r})", run_id=run_id, seq=row.seq
                ) from exc
            if row.seq in want:
                yield _row_info(run_id, row), state

    def _verify_rows(self, run_id: str, rows: Sequence[_Row]) -> tuple[list[Any], list[int]]:
        """Check every row against its seal (with integrity keys) and its digest, before
        anything of it is decoded; then decode all bodies in one pass."""
        raws = []
        for row in rows:
            self._check_seal(run_id, row)
            try:
                raw = _delta.unpack(row.body)
            except CorruptRecord as exc:
                raise CorruptRecord(exc.detail, run_id=run_id, seq=row.seq) from exc
            digest = _delta.row_digest(run_id, *_row_key(row), raw)
            if digest != bytes(row.digest):
                raise CorruptRecord(
                    "checkpoint row does not match its digest (edited, truncated or moved)",
                    run_id=run_id,
                    seq=row.seq,
                )
            raws.append(raw)
        try:
            bodies = self.codec.decode(b"[" + b",".join(raws) + b"]")
        except CorruptRecord:
            bodies = []
            for row, raw in zip(rows, raws, strict=True):  # find the culprit
                try:
                    bodies.append(self.codec.decode(raw))
                except CorruptRecord as exc:
                    raise type(exc)(exc.detail, run_id=run_id, seq=row.seq) from exc
        for row, body in zip(rows, bodies, strict=True):
            if not isinstance(body, dict) or not (("k" in body) ^ ("d" in body)):
                raise CorruptRecord("checkpoint body has no state", run_id=run_id, seq=row.seq)
        return list(bodies), [len(raw) for raw in raws]

    def _check_seal(self, run_id: str, row: Any) -> None:
        """Check checkpoint ``row`` (a :class:`_Row`, or one without its body) against
        its seal.

        Raises:
            CorruptRecord: It fails its seal (or has none, with integrity keys).
        """
        check(
            self.integrity,
            "checkpoints",
            _row_parts(run_id, row),
            None if row.seal is None else bytes(row.seal),
            what=f"checkpoint {row.seq} of run {run_id!r}",
            run_id=run_id,
            seq=int(row.seq),
        )

    def checkpoint_info_in(self, cur: Any, run_id: str, seq: int) -> CheckpointInfo | None:
        """Checkpoint ``seq``'s metadata read through ``cur`` (in the caller's
        transaction), its seal checked and nothing of its body read; None when the run
        has no such checkpoint.

        Raises:
            CorruptRecord: The row fails its seal, or names a source no writer produces.
        """
        cur.execute(self._sql.ckpt_meta, (run_id, seq))
        found = cur.fetchone()
        if found is None:
            return None
        n, kind, kf, step, source, version, created, digest, sealed = found
        row = _Row(n, kind, kf, step, source, version, created, b"", bytes(digest), sealed)
        self._check_seal(run_id, row)
        return _row_info(run_id, row)

    def _run_exists(self, cur: Any, run_id: str) -> bool:
        cur.execute(self._sql.run_head, (run_id,))
        return cur.fetchone() is not None

    def _chunk_fetcher(self, run_id: str) -> _delta.ChunkFetcher:
        def fetch(hexes: Sequence[str]) -> dict[str, list[Any]]:
            if self._closed:
                raise ConfigurationError(
                    "the store this list was loaded from is closed; read lazily loaded "
                    "lists before closing it, or load with lazy=False"
                )
            wanted = {bytes.fromhex(h) for h in hexes}

            def read() -> dict[bytes, Any]:
                with translate("read list chunks"), _RawTxn(self, write=False) as cur:
                    try:
                        return self._read_blobs(cur, run_id, None, wanted)[0]
                    except CorruptRecord as exc:
                        if exc.detail != BLOB_MISSING or self._run_exists(cur, run_id):
                            raise
                        # Not damage: the run went (retention, delete_run, a saver's
                        # prune) after the list was loaded, and its chunks with it.
                        gone = RunNotFound(run_id)
                        gone.add_note(
                            "it was deleted after this list was loaded with lazy=True, "
                            "and the chunks not read yet went with it; read a lazily "
                            "loaded list while its run exists, or load with lazy=False"
                        )
                        raise gone from None

            values = self.retry.call("read list chunks", read, idempotent=True, store=self)
            return {h.hex(): v for h, v in values.items()}

        return fetch

    @retried("read history", idempotent=True)
    def history(self, run_id: str, *, limit: int | None = None) -> list[CheckpointInfo]:
        """Metadata of a run's checkpoints, oldest first (the last ``limit`` if given).

        Raises:
            RunNotFound: No such run.
        """
        self._check_open()
        self.flush()
        c = _schema.checkpoints
        q = select(
            c.c.seq,
            c.c.kind,
            c.c.keyframe_seq,
            c.c.step,
            c.c.source,
            c.c.schema_version,
            c.c.created_at,
            c.c.digest,
            c.c.seal,
        ).where(c.c.run_id == run_id)
        q = q.order_by(c.c.seq.desc()).limit(limit) if limit is not None else q.order_by(c.c.seq)
        with translate("read history"), self._reader() as conn:
            rows = conn.execute(q).all()
            if not rows:
                r = _schema.runs
                if conn.execute(select(r.c.run_id).where(r.c.run_id == run_id)).first() is None:
                    raise RunNotFound(run_id)
        for row in rows:
            self._check_seal(run_id, row)
        infos = [_row_info(run_id, row) for row in rows]
        infos.sort(key=lambda i: i.seq)
        return infos


@dataclass(frozen=True)
class _Row:
    seq: int
    kind: int
    keyframe_seq: int
    step: str
    source: str
    schema_version: int
    created_at: float
    body: bytes
    digest: bytes
    seal: bytes | None = None


def _check_nothing_above(run_id: str, head: int | None, top: int | None) -> None:
    """Refuse a run whose row is older than its checkpoints: a checkpoint above the
    head is never written without moving the head to it in the same transaction, so
    one there means the run row was put back (an older, genuinely sealed version of
    it: a status, next step and head from before), or the history was cut back.

    Raises:
        CorruptRecord: A checkpoint of the run sits above its head.
    """
    if top is not None and (head is None or int(top) > int(head)):
        raise CorruptRecord(
            f"run {run_id!r} has checkpoint {int(top)} above its head "
            f"{'(none)' if head is None else int(head)}: its row was rolled back to an "
            f"older version (or its history cut back); it is not acted on. Run "
            f"`onceonly audit verify`",
            run_id=run_id,
            seq=int(top),
        )
