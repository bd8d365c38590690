"""Blobs: large values stored once by content hash, verified on read, swept when unused."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, exists, text

from . import _delta, _schema
from ._engine import begin, translate
from ._retry import retried
from ._runs import _Runs
from .errors import CorruptRecord

BLOB_MISSING = "a blob the checkpoint refers to is missing"


class _Blobs(_Runs):
    """Reading and verifying blobs; collecting those no run refers to."""

    def _read_blobs(
        self, cur: Any, run_id: str, seq: int | None, wanted: set[bytes]
    ) -> tuple[dict[bytes, Any], dict[bytes, int]]:
        values: dict[bytes, Any] = {}
        sizes: dict[bytes, int] = {}
        if not wanted:
            return values, sizes
        want = list(wanted)
        for i in range(0, len(want), 500):
            part = want[i : i + 500]
            cur.execute(self._sql.blobs_in(len(part)), part)
            for h, data in cur.fetchall():
                key = bytes(h)
                values[key], sizes[key] = self._verify_blob(run_id, seq, key, bytes(data))
        missing = wanted - values.keys()
        if missing:
            raise CorruptRecord(
                BLOB_MISSING,
                run_id=run_id,
                seq=seq,
                blob=sorted(missing)[0].hex(),
            )
        return values, sizes

    def _verify_blob(
        self, run_id: str, seq: int | None, h: bytes, stored: bytes
    ) -> tuple[Any, int]:
        """The decoded value of a verified blob and its canonical (uncompressed) size."""
        try:
            raw = _delta.unpack(stored)
        except CorruptRecord as exc:
            raise CorruptRecord(exc.detail, run_id=run_id, seq=seq, blob=h.hex()) from exc
        if _delta.blob_hash(raw) != h:
            raise CorruptRecord(
                "blob content does not match its hash", run_id=run_id, seq=seq, blob=h.hex()
            )
        try:
            return self.codec.decode(raw), len(raw)
        except CorruptRecord as exc:
            raise type(exc)(exc.detail, run_id=run_id, seq=seq, blob=h.hex()) from exc

    @retried("collect unreferenced blobs", idempotent=True)
    def collect_garbage(self) -> int:
        """Delete blobs that no run refers to. Returns how many were deleted."""
        self._check_open()
        b, ref = _schema.blobs, _schema.blob_refs
        with translate("collect unreferenced blobs"), begin(self.engine) as conn:
            if self._dialect == "postgresql":
                # Writers insert blob + reference in one transaction; this lock makes the
                # sweep wait for them, so a blob is never swept between the two.
                conn.execute(text("LOCK TABLE oo_blobs IN SHARE ROW EXCLUSIVE MODE"))
            res = conn.execute(delete(b).where(~exists().where(ref.c.hash == b.c.hash)))
        return int(res.rowcount or 0)
