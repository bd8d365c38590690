"""The stored rows' columns, what their seals cover, and the fixed SQL of the hot paths."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .errors import CorruptRecord
from .records import CheckpointInfo, Source

_KEYFRAME, _DELTA = 0, 1  # a checkpoint row's kind


class _CheckpointRow(Protocol):
    """The columns of a checkpoint row (read back, or queued to be written)."""

    @property
    def seq(self) -> int: ...
    @property
    def kind(self) -> int: ...
    @property
    def keyframe_seq(self) -> int: ...
    @property
    def step(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def schema_version(self) -> int: ...
    @property
    def created_at(self) -> float: ...
    @property
    def digest(self) -> bytes: ...


def _row_key(row: _CheckpointRow) -> tuple[int, int, int, int, str, str, float]:
    """The columns of checkpoint ``row`` that its digest and its seal cover (with the run
    id, and its body or its digest), in their order."""
    return (
        row.seq,
        row.kind,
        row.keyframe_seq,
        row.schema_version,
        row.step,
        row.source,
        row.created_at,
    )


def _row_parts(run_id: str, row: _CheckpointRow) -> list[object]:
    """What the seal of checkpoint ``row`` of run ``run_id`` covers."""
    return _ckpt_parts(run_id, *_row_key(row), row.digest)


def _row_info(run_id: str, row: _CheckpointRow) -> CheckpointInfo:
    """The metadata of checkpoint ``row`` of run ``run_id``.

    Raises:
        CorruptRecord: Its source is one no writer produces (an edited row).
    """
    seq = int(row.seq)
    try:
        source = Source(row.source)
    except ValueError:
        raise CorruptRecord(
            f"checkpoint {seq} has an unknown source {row.source!r} (edited)",
            run_id=run_id,
            seq=seq,
        ) from None
    return CheckpointInfo(
        run_id=run_id,
        seq=seq,
        step=row.step,
        source=source,
        schema_version=int(row.schema_version),
        created_at=float(row.created_at),
        keyframe=row.kind == _KEYFRAME,
        keyframe_seq=int(row.keyframe_seq),
        digest=bytes(row.digest),
    )


def _ckpt_parts(
    run_id: str,
    seq: int,
    kind: int,
    keyframe_seq: int,
    schema_version: int,
    step: str,
    source: str,
    created_at: float,
    digest: bytes,
) -> list[object]:
    """What a checkpoint's seal covers: every column but the body, whose digest it holds."""
    return [
        run_id,
        int(seq),
        int(kind),
        int(keyframe_seq),
        int(schema_version),
        step,
        source,
        float(created_at),
        bytes(digest),
    ]


def _run_parts(values: Mapping[str, Any], head_digest: bytes | None) -> list[object]:
    """What a run's seal covers: everything a step or an operator acts on, and the head
    checkpoint's digest (the lease and the timestamps are operational)."""
    handoff = values["handoff"]
    head = values["head_seq"]
    return [
        values["run_id"],
        values["flow"],
        values["code_version"],
        int(values["state_version"]),
        values["status"],
        values["next_step"],
        None if handoff is None else bytes(handoff),
        None if head is None else int(head),
        b"" if head_digest is None else bytes(head_digest),
        # Only once the run has sealed waits (schema 5), so earlier seals still verify;
        # setting it back to NULL changes the parts as much as any other edit.
        *([] if values.get("waits_digest") is None else [bytes(values["waits_digest"])]),
        # The row's revision (schema 5; rows sealed before it have none).
        *([] if values.get("rev") is None else [int(values["rev"])]),
    ]


_RUN_COLS = (
    "run_id",
    "flow",
    "code_version",
    "state_version",
    "status",
    "next_step",
    "lease_owner",
    "lease_expires_at",
    "handoff",
    "head_seq",
    "created_at",
    "updated_at",
    "seal",
    "waits_digest",
    "rev",
)


_CKPT_COLS = "seq, kind, keyframe_seq, step, source, schema_version, created_at, body, digest, seal"


class _SQL:
    """Fixed SQL for the hot paths, in the driver's parameter style."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        q = "?" if dialect == "sqlite" else "%s"
        self.q = q
        self.ins_blob = (
            f"INSERT INTO oo_blobs (hash, size, data) VALUES ({q}, {q}, {q}) ON CONFLICT DO NOTHING"
        )
        self.ins_ref = (
            f"INSERT INTO oo_blob_refs (owner, hash) VALUES ({q}, {q}) ON CONFLICT DO NOTHING"
        )
        self.ins_ckpt = (
            "INSERT INTO oo_checkpoints (run_id, seq, kind, keyframe_seq, step, source, "
            "schema_version, created_at, body, digest, seal) VALUES (" + ", ".join([q] * 11) + ")"
        )
        rcols0 = ", ".join(f"r.{c}" for c in _RUN_COLS)
        # One run row with its head checkpoint's digest (what its seal covers).
        self.run_row = (
            f"SELECT {rcols0}, c.digest FROM oo_runs r LEFT JOIN oo_checkpoints c "
            f"ON c.run_id = r.run_id AND c.seq = r.head_seq WHERE r.run_id = {q}"
        )
        self.runs_rows = (
            f"SELECT {rcols0}, c.digest FROM oo_runs r LEFT JOIN oo_checkpoints c "
            f"ON c.run_id = r.run_id AND c.seq = r.head_seq"
        )
        head = f"(SELECT head_seq FROM oo_runs WHERE run_id = {q})"
        self.head_rows = (
            f"SELECT {_CKPT_COLS} FROM oo_checkpoints WHERE run_id = {q} AND seq >= "
            f"(SELECT keyframe_seq FROM oo_checkpoints WHERE run_id = {q} AND seq = {head}) "
            f"AND seq <= {head} ORDER BY seq"
        )
        self.seq_rows = (
            f"SELECT {_CKPT_COLS} FROM oo_checkpoints WHERE run_id = {q} AND seq >= "
            f"(SELECT keyframe_seq FROM oo_checkpoints WHERE run_id = {q} AND seq = {q}) "
            f"AND seq <= {q} ORDER BY seq"
        )
        self.run_head = f"SELECT head_seq FROM oo_runs WHERE run_id = {q}"
        self.ckpt_meta = (
            "SELECT seq, kind, keyframe_seq, step, source, schema_version, created_at, "
            f"digest, seal FROM oo_checkpoints WHERE run_id = {q} AND seq = {q}"
        )
        # The head and the highest checkpoint, in one statement (one snapshot).
        top = f"(SELECT MAX(m.seq) FROM oo_checkpoints m WHERE m.run_id = {q})"
        self.run_head_top = f"SELECT head_seq, {top} FROM oo_runs WHERE run_id = {q}"
        # The run row and its head checkpoint's keyframe + deltas, in one statement (one
        # snapshot even under READ COMMITTED); a run without checkpoints gives one row
        # of NULL checkpoint columns.
        rcols = ", ".join(f"r.{c}" for c in _RUN_COLS)
        ccols = ", ".join(f"c.{c.strip()}" for c in _CKPT_COLS.split(","))
        self.run_and_head = (
            f"SELECT {rcols}, {ccols}, (SELECT MAX(m.seq) FROM oo_checkpoints m WHERE "
            f"m.run_id = r.run_id) FROM oo_runs r LEFT JOIN oo_checkpoints c "
            f"ON c.run_id = r.run_id AND c.seq <= r.head_seq AND c.seq >= "
            f"(SELECT k.keyframe_seq FROM oo_checkpoints k WHERE k.run_id = r.run_id "
            f"AND k.seq = r.head_seq) WHERE r.run_id = {q} ORDER BY c.seq"
        )
        self._advance: dict[tuple[tuple[str, ...], bool, bool], str] = {}
        self._blobs_in: dict[int, str] = {}

    def advance(self, cols: tuple[str, ...], *, first: bool, parent: bool = False) -> str:
        """The run-head compare-and-set: ``head_seq`` must be NULL (``first``) or the
        parent's sequence number, and with ``parent`` the checkpoint there must be the
        exact parent (its digest), so a checkpoint built on one that lost a race to
        another writer at the same sequence number never lands on the winner's."""
        key = (cols, first, parent)
        sql = self._advance.get(key)
        if sql is None:
            q = self.q
            sets = ", ".join(
                [f"head_seq = {q}", f"updated_at = {q}"] + [f"{c} = {q}" for c in cols]
            )
            cond = "head_seq IS NULL" if first else f"head_seq = {q}"
            if parent:
                cond += (
                    f" AND EXISTS (SELECT 1 FROM oo_checkpoints WHERE run_id = {q} "
                    f"AND seq = {q} AND digest = {q})"
                )
            sql = f"UPDATE oo_runs SET {sets} WHERE run_id = {q} AND {cond}"
            self._advance[key] = sql
        return sql

    def blobs_in(self, n: int) -> str:
        sql = self._blobs_in.get(n)
        if sql is None:
            marks = ", ".join([self.q] * n)
            sql = f"SELECT hash, data FROM oo_blobs WHERE hash IN ({marks})"
            self._blobs_in[n] = sql
        return sql
