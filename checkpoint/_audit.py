"""The integrity audit: every blob, checkpoint, run and wait against its hash, digest and seal."""

from __future__ import annotations

import json
from typing import Any

from . import _delta
from ._retention import _Retention
from ._sql import _RUN_COLS, _ckpt_parts, _run_parts
from .errors import ConfigurationError, CorruptRecord
from .integrity import UNKEYED_LIMITS
from .integrity import _check_seal as check
from .waits import _COLS as WAIT_COLS
from .waits import _READ as WAIT_READ
from .waits import Waits, _wait_parts


class _Audit(_Retention):
    """Verifying a whole store, and sealing what carries no seal."""

    def verify_integrity(self) -> tuple[int, list[str]]:
        """Check every stored blob against its hash, every checkpoint row against its
        digest, and (with integrity keys) every run, checkpoint and wait against its
        seal; every run's history for checkpoints missing below its head or left above
        it (a cut-back history), and checkpoints whose run row is gone; every blob a
        checkpoint names or a run references for being stored, and referenced by the
        run that names it; all without loading any state. Without keys,
        :attr:`integrity_note` says what cannot be detected.

        Returns:
            (records checked, one line per problem found).
        """
        self.flush()
        problems: list[str] = []
        checked = 0

        def scan(cur: Any) -> None:
            nonlocal checked
            cur.execute("SELECT hash, data FROM oo_blobs")
            stored: set[bytes] = set()
            for h, data in cur.fetchall():
                checked += 1
                stored.add(bytes(h))
                try:
                    raw = _delta.unpack(bytes(data))
                except CorruptRecord as exc:
                    problems.append(f"blob {bytes(h).hex()}: {exc.detail}")
                    continue
                if _delta.blob_hash(raw) != bytes(h):
                    problems.append(f"blob {bytes(h).hex()}: content does not match its hash")
            cur.execute(
                "SELECT run_id, seq, kind, keyframe_seq, schema_version, step, source, "
                "created_at, body, digest FROM oo_checkpoints"
            )
            seqs: dict[str, list[int]] = {}
            needed: dict[str, dict[bytes, int]] = {}  # run -> blob -> a checkpoint naming it
            for run_id, seq, kind, kf, ver, step, src, at, body, digest in cur.fetchall():
                checked += 1
                seqs.setdefault(run_id, []).append(int(seq))
                try:
                    raw = _delta.unpack(bytes(body))
                except CorruptRecord as exc:
                    problems.append(f"run {run_id!r} checkpoint {seq}: {exc.detail}")
                    continue
                calc = _delta.row_digest(run_id, seq, kind, kf, ver, step, src, at, raw)
                if calc != bytes(digest):
                    problems.append(f"run {run_id!r} checkpoint {seq}: row fails its digest")
                    continue
                # The blob hashes a body names are plain JSON (a channel's values may hold
                # types this process never registered: they are not decoded).
                try:
                    decoded = json.loads(raw)
                except ValueError:
                    problems.append(f"run {run_id!r} checkpoint {seq}: body is not JSON")
                    continue
                try:
                    named = _delta.blob_refs_of(decoded, chunks=True)
                except (AttributeError, IndexError, KeyError, TypeError, ValueError):
                    problems.append(
                        f"run {run_id!r} checkpoint {seq}: body names its blobs in a form no "
                        f"writer produces"
                    )
                    continue
                for h in named:
                    needed.setdefault(run_id, {}).setdefault(h, int(seq))
            # Every blob a run's checkpoints name must be referenced by that run: an
            # unreferenced blob is deleted by the next collect_garbage.
            cur.execute("SELECT owner, hash FROM oo_blob_refs")
            refs: dict[str, set[bytes]] = {}
            for owner, h in cur.fetchall():
                refs.setdefault(str(owner), set()).add(bytes(h))
            # Every blob named or referenced must be stored: a deleted one fails every
            # load of the checkpoints naming it.
            missing: set[bytes] = set()
            for run_id, blobs in sorted(needed.items()):
                for h, seq in sorted(blobs.items(), key=lambda item: item[1]):
                    if h not in stored and h not in missing:
                        missing.add(h)
                        problems.append(
                            f"run {run_id!r} checkpoint {seq}: blob {h.hex()} is missing (deleted)"
                        )
            for owner, hashes in sorted(refs.items()):
                for h in sorted(hashes - stored - missing):
                    missing.add(h)
                    problems.append(
                        f"blob {h.hex()}, referenced by run {owner!r}: missing (deleted)"
                    )
            for run_id, blobs in needed.items():
                have_refs = refs.get(run_id, set())
                for h, seq in sorted(blobs.items(), key=lambda item: item[1]):
                    if h not in have_refs:
                        problems.append(
                            f"run {run_id!r} checkpoint {seq}: blob {h.hex()} has no reference "
                            f"from its run (a deleted or edited reference: the next garbage "
                            f"collection would delete the blob)"
                        )
            cur.execute(
                "SELECT run_id, seq, kind, keyframe_seq, schema_version, step, source, "
                "created_at, digest, seal FROM oo_checkpoints"
            )
            for run_id, seq, kind, kf, ver, step, src, at, digest, sealed in cur.fetchall():
                try:
                    check(
                        self.integrity,
                        "checkpoints",
                        _ckpt_parts(run_id, seq, kind, kf, ver, step, src, at, bytes(digest)),
                        None if sealed is None else bytes(sealed),
                        what=f"checkpoint {seq}",
                    )
                except CorruptRecord as exc:
                    problems.append(f"run {run_id!r} checkpoint {seq}: {exc.detail}")
            cur.execute(self._sql.runs_rows)
            with_rows: set[str] = set()
            for found in cur.fetchall():
                checked += 1
                values = dict(zip(_RUN_COLS, found[: len(_RUN_COLS)], strict=True))
                run_id, head = values["run_id"], values["head_seq"]
                with_rows.add(str(run_id))
                try:
                    self._checked_run(found)
                except CorruptRecord as exc:
                    problems.append(f"run {run_id!r}: {exc.detail}")
                have = sorted(seqs.get(run_id, []))
                if head is None:
                    if have:
                        problems.append(f"run {run_id!r}: checkpoints {have} but no head")
                    continue
                above = [x for x in have if x > int(head)]
                if above:
                    problems.append(
                        f"run {run_id!r}: checkpoints {above} above its head {head} (a cut-back "
                        f"history, or a head moved back)"
                    )
                if int(head) not in have:
                    problems.append(f"run {run_id!r}: its head checkpoint {head} is missing")
                # A run's checkpoints are 0..head, every one: retention and rewrites remove
                # whole runs, never part of a history. One missing below the head fails
                # every load of it and of the deltas built on it.
                gaps = sorted(set(range(int(head))) - set(have))
                if gaps:
                    problems.append(
                        f"run {run_id!r}: checkpoints {_spans(gaps)} below its head {head} "
                        f"are missing (deleted)"
                    )
            problems.extend(
                f"run {run_id!r}: checkpoints {_spans(sorted(seqs[run_id]))} but no run row "
                f"(deleted)"
                for run_id in sorted(set(seqs) - with_rows)
            )
            waits = Waits(self)
            cur.execute(f"SELECT {WAIT_READ} FROM oo_waits")
            for row in cur.fetchall():
                checked += 1
                try:
                    waits._checked(row)
                except CorruptRecord as exc:
                    problems.append(f"run {row[0]!r} wait {row[1]!r}#{row[14]}: {exc.detail}")
            if self.integrity is not None:
                # Every run whose row seals its waits, not only runs that still have one:
                # a run's only wait deleted leaves it out of oo_waits altogether.
                cur.execute(
                    "SELECT run_id FROM oo_runs WHERE waits_digest IS NOT NULL UNION "
                    "SELECT run_id FROM oo_waits ORDER BY run_id"
                )
                for (rid,) in cur.fetchall():
                    try:
                        self._check_waits_in(cur, rid)
                    except CorruptRecord as exc:
                        problems.append(f"run {rid!r}: {exc.detail}")

        self.read(scan)
        return checked, problems

    def seal_unsealed(self) -> int:
        """Seal every run, checkpoint and wait that carries no seal (a store created
        before sealing, or written by a store without keys), as they stand: an
        operator's decision to trust the current contents, taken after ``verify``.

        Returns:
            How many rows were sealed.

        Raises:
            ConfigurationError: This store has no integrity keys.
        """
        keys = self.integrity
        if keys is None:
            raise ConfigurationError(f"nothing to seal with: {UNKEYED_LIMITS}")
        q = self._sql.q

        def txn(cur: Any) -> int:
            n = 0
            cur.execute(
                "SELECT run_id, seq, kind, keyframe_seq, schema_version, step, source, "
                "created_at, digest FROM oo_checkpoints WHERE seal IS NULL"
            )
            for rid, seq, kind, kf, ver, step, src, at, digest in cur.fetchall():
                parts = _ckpt_parts(rid, seq, kind, kf, ver, step, src, at, bytes(digest))
                cur.execute(
                    f"UPDATE oo_checkpoints SET seal = {q} WHERE run_id = {q} AND seq = {q}",
                    (keys.seal("checkpoints", parts), rid, seq),
                )
                n += 1
            cur.execute(self._sql.runs_rows + " WHERE r.seal IS NULL")
            for found in cur.fetchall():
                values = dict(zip(_RUN_COLS, found[: len(_RUN_COLS)], strict=True))
                digest = found[len(_RUN_COLS)]
                parts = _run_parts(values, None if digest is None else bytes(digest))
                cur.execute(
                    f"UPDATE oo_runs SET seal = {q} WHERE run_id = {q}",
                    (keys.seal("runs", parts), values["run_id"]),
                )
                n += 1
            cur.execute(f"SELECT {WAIT_COLS} FROM oo_waits WHERE seal IS NULL")
            for row in cur.fetchall():
                cur.execute(
                    f"UPDATE oo_waits SET seal = {q} WHERE run_id = {q} AND name = {q} "
                    f"AND instance = {q}",
                    (keys.seal("waits", _wait_parts(tuple(row))), row[0], row[1], row[14]),
                )
                n += 1
            # Bind every run's waits to its run row (runs sealed before schema 5 too).
            cur.execute(
                "SELECT DISTINCT w.run_id FROM oo_waits w JOIN oo_runs r ON r.run_id = "
                "w.run_id WHERE r.waits_digest IS NULL ORDER BY w.run_id"
            )
            for (rid,) in cur.fetchall():
                self._seal_waits_in(cur, rid)
                n += 1
            return n

        return self.transact(txn)

    @property
    def integrity_note(self) -> str | None:
        """What this store cannot detect (None when it seals its rows)."""
        return None if self.integrity is not None else UNKEYED_LIMITS


def _spans(seqs: list[int]) -> str:
    """Sorted sequence numbers, runs of consecutive ones as ``a-b``: ``1-3, 7``."""
    out: list[str] = []
    start = prev = seqs[0]
    for x in seqs[1:]:
        if x != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = x
        prev = x
    out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)
