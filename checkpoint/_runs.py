"""Runs: the run row (its seal, its witnessed revision, its waits' digest) and leases."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import blake3
from sqlalchemy import and_, or_, select, update
from sqlalchemy import exc as sa_exc

from . import _schema
from ._connections import _Connections, _RawTxn
from ._engine import begin, translate
from ._retry import retried
from ._sql import _RUN_COLS, _run_parts
from ._state import _UNSET
from ._witness import Witness
from .errors import (
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    LeaseHeld,
    OnceOnlyError,
    RunExists,
    RunNotFound,
    RunRolledBack,
    StoreError,
)
from .failpoints import failpoint
from .integrity import RowKeys
from .integrity import _check_seal as check
from .integrity import _encode as _encode_parts
from .integrity import _make_seal as seal
from .records import Handoff, Run, RunStatus

_LEASE_TRIES = 5  # a lease that changes hands more often between two statements is held

log = logging.getLogger("onceonly.store")


class _Runs(_Connections):
    """Reading, creating and changing run rows; leases; the witness."""

    def attach_witness(self, path: str) -> Witness:
        """Keep a witness of every run row's revision in the file ``path`` (a Ledger
        with ``ONCEONLY_WITNESS`` does this with its own): each sealed run-row write is
        appended and fsynced after it commits, and a run row read back at a revision
        below the witnessed one (the store restored from an older copy) is refused
        (:class:`RunRolledBack`). Idempotent for the same path.

        Returns:
            The witness (shared with the caller).

        Raises:
            ConfigurationError: The store already has a witness at another path.
        """
        if self.witness is None:
            self.witness = Witness(path)
            self._behind = self._runs_behind()
        elif self.witness.path != path:
            raise ConfigurationError(
                f"this store already keeps its witness in {self.witness.path}; one witness "
                f"per store"
            )
        return self.witness

    def _runs_behind(self) -> RunRolledBack | None:
        """The first witnessed run the store has at an older revision, or not at all
        (a restore from an older copy), read when the witness is attached."""
        assert self.witness is not None
        if not self.witness.runs:
            return None
        have = self.run_revisions()
        for run_id, rev in sorted(self.witness.runs.items()):
            if have.get(run_id, -1) < rev:
                behind = RunRolledBack(run_id, have.get(run_id, 0), rev, self.witness.path)
                log.error("%s", behind)
                return behind
        return None

    def accept_restore(self) -> None:
        """Act on the store as it is (the witness was reset to it by
        :meth:`ledger.Ledger.accept_restore`)."""
        self._behind = None

    def run_revisions(self) -> dict[str, int]:
        """Every run's current row revision (what an accepted restore witnesses)."""

        def read(cur: Any) -> dict[str, int]:
            cur.execute("SELECT run_id, rev FROM oo_runs WHERE rev IS NOT NULL")
            return {str(r): int(v) for r, v in cur.fetchall()}

        return self.read(read)

    def attach_integrity(self, keys: RowKeys) -> None:
        """Seal and check rows with ``keys`` from now on (a Ledger does this with its
        keyring's row keys). Idempotent for the same keys.

        Raises:
            ConfigurationError: The store already has other keys.
        """
        if self.integrity is None:
            self.integrity = keys
        elif self.integrity.keys != keys.keys or self.integrity.current_id != keys.current_id:
            raise ConfigurationError(
                "this store already seals its rows with other keys; open one store per keyring"
            )

    @retried("create a run", idempotent=False)
    def create_run(
        self,
        flow: str,
        *,
        run_id: str | None = None,
        code_version: str = "0",
        state_version: int = 1,
        next_step: str | None = None,
        handoff: Handoff | None = None,
        status: RunStatus = RunStatus.RUNNING,
        key_run: str | None = None,
    ) -> Run:
        """Create a run (no checkpoint yet).

        Args:
            key_run: The run whose effect keys this run shares (a fork's origin):
                retention keeps that run, and so its ledger entries, while this one exists.

        Raises:
            RunExists: A run with ``run_id`` exists already.
        """
        self._check_open()
        rid = run_id or uuid.uuid4().hex
        now = time.time()
        values = self._new_row(
            rid, flow, code_version, state_version, RunStatus(status), next_step, handoff, now
        )
        try:
            failpoint("checkpoint.run.write")
            with translate("create a run"), begin(self.engine) as conn:
                conn.execute(_schema.runs.insert().values(**values))
                if key_run is not None and key_run != rid:
                    conn.execute(
                        _schema.run_links.insert().values(
                            run_id=rid, key_run=key_run, created_at=now
                        )
                    )
        except StoreError as exc:
            if isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise RunExists(rid) from exc.__cause__
            raise
        return self._run_from_row(values)

    @retried("read a run", idempotent=True)
    def get_run(self, run_id: str) -> Run:
        """The stored run (its seal checked, with integrity keys).

        Raises:
            RunNotFound: No such run.
            CorruptRecord: The run row fails its seal.
        """
        self._check_open()
        run = self.read(lambda cur: self.read_run_in(cur, run_id))
        if run is None:
            raise RunNotFound(run_id)
        return run

    @retried("read a run's link", idempotent=True)
    def key_run_of(self, run_id: str) -> str | None:
        """The run whose effect keys ``run_id`` shares, as its link row says (a fork's
        origin; ``create_run(key_run=...)``), or None when it has no link row."""
        self._check_open()
        sql = f"SELECT key_run FROM oo_run_links WHERE run_id = {self._sql.q}"

        def probe(cur: Any) -> str | None:
            cur.execute(sql, (run_id,))
            found = cur.fetchone()
            return None if found is None else str(found[0])

        return self.read(probe)

    @retried("read a run's forks", idempotent=True)
    def shares_keys(self, run_id: str) -> bool:
        """Whether another run uses ``run_id``'s effect keys (a fork of it, or of one of
        its forks): then effects under its keys may have been made by a run other than
        itself.
        """
        self._check_open()
        sql = f"SELECT 1 FROM oo_run_links WHERE key_run = {self._sql.q} LIMIT 1"

        def probe(cur: Any) -> bool:
            cur.execute(sql, (run_id,))
            return cur.fetchone() is not None

        return self.read(probe)

    def read_run_in(self, cur: Any, run_id: str, *, lock: bool = False) -> Run | None:
        """The run row read through ``cur`` (in the caller's transaction), its seal
        checked; None when there is no such run. ``lock``: ``FOR UPDATE`` on PostgreSQL.

        Raises:
            CorruptRecord: The run row fails its seal.
        """
        if lock and self._dialect != "sqlite":
            # Lock first, then read row and head in a statement of their own: a locking
            # join re-reads only the locked row after a wait (READ COMMITTED), and would
            # pair the new head with the old head's digest.
            q = self._sql.q
            cur.execute(f"SELECT 1 FROM oo_runs WHERE run_id = {q} FOR UPDATE", (run_id,))
        cur.execute(self._sql.run_row, (run_id,))
        found = cur.fetchone()
        if found is None:
            return None
        return self._checked_run(found)

    def run_head_in(self, cur: Any, run_id: str) -> tuple[Run, bytes | None] | None:
        """The run row (seal checked) and its head checkpoint's digest, read through
        ``cur`` in one statement; None when there is no such run. What a claim's fence
        reads in the claim's transaction.

        Raises:
            CorruptRecord: The run row fails its seal.
        """
        cur.execute(self._sql.run_row, (run_id,))
        found = cur.fetchone()
        if found is None:
            return None
        digest = found[len(_RUN_COLS)]
        return self._checked_run(found), None if digest is None else bytes(digest)

    def _checked_run(self, found: Sequence[Any]) -> Run:
        n = len(_RUN_COLS)
        values = dict(zip(_RUN_COLS, found[:n], strict=True))
        digest = found[n]
        check(
            self.integrity,
            "runs",
            _run_parts(values, None if digest is None else bytes(digest)),
            None if values["seal"] is None else bytes(values["seal"]),
            what=f"run {values['run_id']!r}",
            run_id=values["run_id"],
        )
        if self.witness is not None:
            self._check_witnessed(values["run_id"], int(values.get("rev") or 0))
        return self._run_from_row(values)

    def _check_witnessed(self, run_id: str, rev: int) -> None:
        """A run row read at ``rev`` is not behind its witnessed revision.

        A read whose snapshot began before another thread's write committed (and was
        witnessed) is merely stale, as any read may be: the run's revision is read
        again, outside the caller's transaction, before anything is refused.

        Raises:
            RunRolledBack: The store holds an older revision than the witness saw.
        """
        assert self.witness is not None
        if self._behind is not None:
            raise self._behind  # the store as a whole is behind: nothing is done with it
        seen = self.witness.runs.get(run_id, 0)
        if rev >= seen:
            return
        with self.engine.connect() as conn:
            now = conn.exec_driver_sql(
                f"SELECT rev FROM oo_runs WHERE run_id = {self._sql.q}", (run_id,)
            ).scalar()
        if now is not None and int(now) >= seen:
            return
        raise RunRolledBack(run_id, rev, seen, self.witness.path)

    @retried("list runs", idempotent=True)
    def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        flow: str | None = None,
        limit: int | None = None,
    ) -> list[Run]:
        """Runs, most recently updated first, optionally filtered (seals checked).

        Raises:
            CorruptRecord: A run row fails its seal.
        """
        self._check_open()
        q = self._sql.q
        where: list[str] = []
        params: list[Any] = []
        if status is not None:
            where.append(f"r.status = {q}")
            params.append(RunStatus(status).value)
        if flow is not None:
            where.append(f"r.flow = {q}")
            params.append(flow)
        sql = self._sql.runs_rows
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY r.updated_at DESC, r.run_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"

        def scan(cur: Any) -> list[Any]:
            cur.execute(sql, params)
            return list(cur.fetchall())

        return [self._checked_run(row) for row in self.read(scan)]

    @retried("update a run", idempotent=True)
    def update_run(
        self,
        run_id: str,
        *,
        status: RunStatus | str | None = None,
        next_step: Any = _UNSET,
        handoff: Handoff | None = None,
        code_version: str | None = None,
        expect_status: RunStatus | str | None = None,
        expect_head: int | None = None,
    ) -> Run:
        """Change a run's status, next step, handoff note or code version.

        Args:
            expect_status: Change it only if the run still has this status.
            expect_head: Change it only if the run's head is still this checkpoint.

        Raises:
            RunNotFound: No such run.
            ConcurrentWrite: An expectation does not hold (another writer changed the
                run); nothing was changed.
        """
        self._check_open()
        values: dict[str, Any] = {}
        if status is not None:
            values["status"] = RunStatus(status).value
        if next_step is not _UNSET:
            values["next_step"] = next_step
        if handoff is not None:
            values["handoff"] = self._encode_handoff(handoff)
        if code_version is not None:
            values["code_version"] = code_version

        def txn(cur: Any) -> None:
            run = self.read_run_in(cur, run_id, lock=True)
            if run is None:
                raise RunNotFound(run_id)
            if (expect_status is not None and run.status is not RunStatus(expect_status)) or (
                expect_head is not None and run.head_seq != expect_head
            ):
                raise ConcurrentWrite(run_id, -1 if expect_head is None else expect_head)
            self._update_run_in(cur, run, values)

        failpoint("checkpoint.run.write")
        with translate("update a run"), _RawTxn(self, write=True) as cur:
            txn(cur)
        with self._lock:
            self._heads.pop(run_id, None)  # the cached run row is no longer current
        return self.get_run(run_id)

    def _update_run_in(self, cur: Any, run: Run, changes: Mapping[str, Any]) -> None:
        """Change sealed columns of a run row read (and checked) in this transaction,
        sealing the result (the head stays: its digest is read again here)."""
        q = self._sql.q
        cur.execute(
            f"SELECT digest FROM oo_checkpoints WHERE run_id = {q} AND seq = {q}",
            (run.run_id, -1 if run.head_seq is None else run.head_seq),
        )
        found = cur.fetchone()
        values = self._next_revision(run, changes, None if found is None else bytes(found[0]))
        cols = ["status", "next_step", "handoff", "code_version", "seal", "waits_digest", "rev"]
        sets = ", ".join([f"{c} = {q}" for c in cols] + [f"updated_at = {q}"])
        cur.execute(
            f"UPDATE oo_runs SET {sets} WHERE run_id = {q}",
            [*(values[c] for c in cols), time.time(), run.run_id],
        )

    def _next_revision(
        self, run: Run, changes: Mapping[str, Any], head_digest: bytes | None
    ) -> dict[str, Any]:
        """The sealed columns of ``run`` with ``changes``, at its next revision, and their
        seal (``head_digest``: the head checkpoint's, after the change). The revision is
        noted for the witness: the caller writes it in this transaction."""
        values = {
            **_run_fields(run),
            "handoff": self._encode_handoff(run.handoff),
            "head_seq": run.head_seq,
            "waits_digest": run.waits_digest,
            **changes,
            "rev": run.rev + 1,
        }
        values["seal"] = seal(self.integrity, "runs", _run_parts(values, head_digest))
        self._note_rev(run.run_id, values["rev"])
        return values

    def _waits_digest_in(self, cur: Any, run_id: str) -> bytes:
        """The digest of a run's waits as they stand: every wait's name, instance and
        seal (a wait row put back to an earlier version has an earlier seal)."""
        q = self._sql.q
        cur.execute(
            f"SELECT name, instance, seal FROM oo_waits WHERE run_id = {q} ORDER BY name, instance",
            (run_id,),
        )
        h = blake3.blake3(b"onceonly.waits.v1")
        for name, instance, sealed in cur.fetchall():
            h.update(_encode_parts([name, int(instance), b"" if sealed is None else bytes(sealed)]))
        return h.digest()

    def _seal_waits_in(self, cur: Any, run_id: str) -> None:
        """After a wait of ``run_id`` was written in this transaction: record the digest
        of the run's waits in its (sealed) run row. The run row is locked first, so
        concurrent writers of two waits of one run cannot both record a stale digest."""
        if self.integrity is None:
            return
        run = self.read_run_in(cur, run_id, lock=True)
        if run is None:
            return
        # The cached head stays: a wait changes no checkpoint, and in async or exit mode
        # the cache is this process's own view, ahead of the database (dropping it would
        # build the next checkpoint on an older head). Sealed writes read the row afresh.
        self._update_run_in(cur, run, {"waits_digest": self._waits_digest_in(cur, run_id)})

    def _check_waits_in(self, cur: Any, run_id: str) -> None:
        """Before a wait of ``run_id`` is decided on: its waits are the ones its run row
        was sealed with.

        Raises:
            CorruptRecord: A wait was put back to an earlier version, deleted or added
                behind the store's back (or the run row fails its seal).
        """
        if self.integrity is None:
            return
        run = self.read_run_in(cur, run_id)
        if run is None or run.waits_digest is None:
            return  # no run (a fork's start in progress) or waits sealed before v5
        if not hmac.compare_digest(run.waits_digest, self._waits_digest_in(cur, run_id)):
            raise CorruptRecord(
                "its waits are not the ones its run row was sealed with (a wait put back "
                "to an earlier version, deleted or added behind the store's back); nothing "
                "is decided on them. Run `onceonly audit verify`",
                run_id=run_id,
                hint="",
            )

    @retried("take a lease", idempotent=True)
    def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Run:
        """Take (or renew) the run's lease for ``ttl_s`` seconds.

        Raises:
            LeaseHeld: Another owner holds a lease that has not expired.
            RunNotFound: No such run.
        """
        self._check_open()
        if ttl_s <= 0:
            raise ConfigurationError("lease ttl_s must be > 0")
        now = time.time()
        r = _schema.runs
        failpoint("checkpoint.run.write")
        with translate("take a lease"), begin(self.engine) as conn:
            # Under READ COMMITTED the UPDATE and the SELECT that explains a refusal see
            # two moments: a holder that lets go in between reads as a free lease (owner
            # NULL), so try again on what the SELECT saw rather than report it as held.
            for _ in range(_LEASE_TRIES):
                res = conn.execute(
                    update(r)
                    .where(r.c.run_id == run_id)
                    .where(
                        or_(
                            r.c.lease_owner.is_(None),
                            r.c.lease_owner == owner,
                            r.c.lease_expires_at < now,
                        )
                    )
                    .values(lease_owner=owner, lease_expires_at=now + ttl_s, updated_at=now)
                )
                if res.rowcount:
                    break
                row = conn.execute(
                    select(r.c.lease_owner, r.c.lease_expires_at).where(r.c.run_id == run_id)
                ).first()
                if row is None:
                    raise RunNotFound(run_id)
                held_by, until = row
                if held_by is not None and held_by != owner and until is not None and until >= now:
                    raise LeaseHeld(run_id, str(held_by), float(until))
            else:
                raise LeaseHeld(run_id, str(held_by), float(until or now))
        return self.get_run(run_id)

    @retried("release a lease", idempotent=True)
    def release_lease(self, run_id: str, owner: str) -> bool:
        """Give up the lease if ``owner`` holds it. Returns whether it was held."""
        self._check_open()
        r = _schema.runs
        failpoint("checkpoint.run.write")
        with translate("release a lease"), begin(self.engine) as conn:
            res = conn.execute(
                update(r)
                .where(and_(r.c.run_id == run_id, r.c.lease_owner == owner))
                .values(lease_owner=None, lease_expires_at=None)
            )
        return bool(res.rowcount)

    def _new_row(
        self,
        run_id: str,
        flow: str,
        code_version: str,
        state_version: int,
        status: RunStatus,
        next_step: str | None,
        handoff: Handoff | None,
        now: float,
    ) -> dict[str, Any]:
        """A new run's row (no checkpoint, no lease, revision 0), sealed."""
        values: dict[str, Any] = {
            "run_id": run_id,
            "flow": flow,
            "code_version": code_version,
            "state_version": state_version,
            "status": status.value,
            "next_step": next_step,
            "lease_owner": None,
            "lease_expires_at": None,
            "handoff": self._encode_handoff(handoff or Handoff()),
            "head_seq": None,
            "created_at": now,
            "updated_at": now,
            "waits_digest": None,
            "rev": 0,
        }
        values["seal"] = seal(self.integrity, "runs", _run_parts(values, None))
        return values

    def _encode_handoff(self, h: Handoff) -> bytes:
        if not isinstance(h, Handoff):
            raise ConfigurationError(f"handoff must be a Handoff, not {type(h).__name__}")
        return self.codec.encode(h.to_doc())

    def _run_from_row(self, row: Mapping[str, Any]) -> Run:
        handoff = Handoff()
        if row["handoff"] is not None:
            try:
                handoff = Handoff.from_doc(self.codec.decode(bytes(row["handoff"])))
            except (KeyError, TypeError, OnceOnlyError) as exc:
                raise CorruptRecord(
                    "the run's handoff note is unreadable", run_id=row["run_id"]
                ) from exc
        try:
            status = RunStatus(row["status"])
        except ValueError as exc:
            raise CorruptRecord(
                f"unknown run status {row['status']!r}", run_id=row["run_id"]
            ) from exc
        return Run(
            run_id=row["run_id"],
            flow=row["flow"],
            code_version=row["code_version"],
            state_version=int(row["state_version"]),
            status=status,
            next_step=row["next_step"],
            lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"],
            handoff=handoff,
            head_seq=row["head_seq"],
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
            waits_digest=None if row.get("waits_digest") is None else bytes(row["waits_digest"]),
            rev=int(row.get("rev") or 0),
        )


def _run_fields(run: Run) -> dict[str, Any]:
    """The run's columns that say what it is and where it stands (as stored)."""
    return {
        "run_id": run.run_id,
        "flow": run.flow,
        "code_version": run.code_version,
        "state_version": run.state_version,
        "status": run.status.value,
        "next_step": run.next_step,
    }
