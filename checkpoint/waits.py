"""Waits: what a waiting run waits for, and the records that wake it.

A run waits for an **approval** (bound to a hash of exactly what is to be approved, with an
expiry and the requester's identity), an inbound **signal** with a payload, or a
**timer**. A waiting run holds no process, thread or connection: its wait is a row in
``oo_waits`` and its status is ``waiting``. A decision or a signal, from any process,
records itself on the row and makes the run ``running`` again in the same transaction;
a due timer or an expired approval is found by :meth:`Waits.claim_ready`.

A wait belongs to the step visit that opened it (``opened_by``, e.g. ``"pay#2"``): the
same step visit opening it again (after a crash) gets the same wait, while another visit
or step opening a wait of the same name (a loop that asks for approval on every pass)
gets a new *instance* of it, open and undecided. Decisions and signals by name go to the
latest instance. A signal may arrive before the run waits for it: it is kept
(``delivered``) and the next wait of its name, when it opens, is settled at once.

The waiting run and the open wait are written in two transactions, in an order that
keeps every interleaving safe: the wait is opened first (a crash before the checkpoint
leaves a running run that re-runs its step and finds its wait open), the run is marked
waiting, and then :meth:`Waits.wake_if_settled` catches a decision that landed in
between.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3

from .errors import ConfigurationError, CorruptRecord, WaitNotFound, WaitRefused
from .failpoints import failpoint
from .integrity import _check_seal as check_seal
from .records import RunStatus

if TYPE_CHECKING:
    # What waits use of a store: the layers of it below its facade (the facade's audit
    # reads waits, so waits import nothing of store.py).
    from ._writer import _Writer as Store

__all__ = [
    "Wait",
    "WaitKind",
    "WaitStatus",
    "Waits",
    "notify_ready",
    "subject_hash",
]


class WaitKind(enum.StrEnum):
    """What a run waits for."""

    APPROVAL = "approval"
    SIGNAL = "signal"
    TIMER = "timer"


class WaitStatus(enum.StrEnum):
    """Where a wait is in its life."""

    OPEN = "open"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    DELIVERED = "delivered"
    FIRED = "fired"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Wait:
    """One wait of a run.

    Attributes:
        run_id: The run.
        name: Unique within the run.
        kind: Approval, signal or timer.
        status: Open, or how it was settled.
        due_at: A timer's due time, or an approval's expiry (UNIX seconds).
        subject_hash: Approvals: hash of exactly what is to be approved.
        subject: Approvals: what is to be approved (shown to the approver).
        requested_by: Approvals: who asked (may not approve unless ``allow_self``).
        allow_self: Approvals: the requester may approve their own request.
        payload: Signals: the delivered payload.
        decided_by: Who approved, rejected, signalled or cancelled.
        decided_at: When (UNIX seconds).
        reason: The decider's reason.
        created_at: When the wait (or an early signal) was recorded.
        instance: Which wait of this name in the run (0, 1, ...: one per step visit).
        opened_by: The step visit that opened it (``step#visit``); None for a signal
            kept before any wait took it, or a wait opened outside the runtime.
    """

    run_id: str
    name: str
    kind: WaitKind
    status: WaitStatus
    due_at: float | None
    subject_hash: str | None
    subject: Any
    requested_by: str | None
    allow_self: bool
    payload: Any
    decided_by: str | None
    decided_at: float | None
    reason: str | None
    created_at: float
    instance: int = 0
    opened_by: str | None = None

    @property
    def settled(self) -> bool:
        """Whether the wait has an outcome (anything but open)."""
        return self.status is not WaitStatus.OPEN


def subject_hash(store: Store, subject: Any) -> str:
    """The hash an approval is bound to: blake3 of the canonical encoding of ``subject``."""
    return blake3.blake3(store.codec.encode(subject)).hexdigest()


_COLS = (
    "run_id, name, kind, status, due_at, subject_hash, subject, requested_by, allow_self, "
    "payload, decided_by, decided_at, reason, created_at, instance, opened_by"
)
_READ = _COLS + ", seal"  # rows are read with their seal and written, then sealed
_TERMINAL_RUN = ("completed", "failed", "cancelled")
NOTIFY_CHANNEL = "onceonly_runs"
"""The PostgreSQL ``LISTEN`` channel on which idle workers are woken."""


class Waits:
    """The waits of a store's runs.

    Args:
        store: The checkpoint store.
        clock: Current UNIX time (tests pass a settable clock).
    """

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    # -- reading -----------------------------------------------------------------------
    def get(self, run_id: str, name: str, instance: int | None = None) -> Wait:
        """The wait ``name`` of ``run_id``: its latest instance, or ``instance``.

        Raises:
            WaitNotFound: No such wait.
        """
        row = self.store.read(lambda cur: self._select(cur, run_id, name, instance))
        if row is None:
            raise WaitNotFound(run_id, name)
        return self._wait(row)

    def find(
        self, *, run_id: str | None = None, status: WaitStatus | str | None = None
    ) -> list[Wait]:
        """Waits, oldest first, optionally of one run or in one status."""
        q = self.store.param
        where: list[str] = []
        params: list[Any] = []
        if run_id is not None:
            where.append(f"run_id = {q}")
            params.append(run_id)
        if status is not None:
            where.append(f"status = {q}")
            params.append(WaitStatus(status).value)
        sql = f"SELECT {_READ} FROM oo_waits"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at, run_id, name, instance"

        def read(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(sql, params)
            return [tuple(r) for r in cur.fetchall()]

        return [self._wait(self._checked(r)) for r in self.store.read(read)]

    # -- the waiting run ---------------------------------------------------------------
    def open(
        self,
        run_id: str,
        name: str,
        kind: WaitKind | str,
        *,
        due_at: float | None = None,
        subject: Any = None,
        requested_by: str | None = None,
        allow_self: bool = False,
        opened_by: str | None = None,
    ) -> Wait:
        """Open a wait for the step visit ``opened_by``.

        Idempotent for that step visit: a wait of this name it opened before is
        returned as is (a step re-run after a crash finds its wait, decided or not). A
        wait of this name opened by another step visit (a loop's earlier pass) is left
        alone and a new instance is opened. A signal kept before any wait of its name
        opened is taken by this wait (returned ``delivered``). Without ``opened_by``
        (outside the runtime) an existing wait of the name is returned as is.

        Raises:
            WaitRefused: The wait this step visit opened has another kind
                (``kind_mismatch``), or is an approval of another subject
                (``subject_changed``).
        """
        kind = WaitKind(kind)
        txn = self.opening(
            run_id,
            name,
            kind,
            due_at=due_at,
            subject=subject,
            requested_by=requested_by,
            allow_self=allow_self,
            opened_by=opened_by,
        )
        digest = subject_hash(self.store, subject) if kind is WaitKind.APPROVAL else None
        failpoint("waits.open.before")
        wait = self._wait(self.store.transact(txn))
        failpoint("waits.open.after")
        if wait.kind is not kind:
            raise WaitRefused(
                run_id,
                name,
                "kind_mismatch",
                f"run {run_id!r} already has a {wait.kind.value} wait named {name!r} for "
                f"this step; wait names are unique within a step",
            )
        if kind is WaitKind.APPROVAL and wait.subject_hash != digest:
            raise WaitRefused(
                run_id,
                name,
                "subject_changed",
                f"run {run_id!r} already asked for approval {name!r} of something else "
                f"(hash {wait.subject_hash}); what is to be approved changed since",
            )
        return wait

    def opening(
        self,
        run_id: str,
        name: str,
        kind: WaitKind | str,
        *,
        due_at: float | None = None,
        subject: Any = None,
        requested_by: str | None = None,
        allow_self: bool = False,
        opened_by: str | None = None,
    ) -> Callable[[Any], tuple[Any, ...]]:
        """The transaction work of :meth:`open`, to run inside another transaction (a
        fork starts its run and opens its wait in one); returns the wait's row."""
        kind = WaitKind(kind)
        if kind is WaitKind.TIMER and due_at is None:
            raise ConfigurationError("a timer wait needs due_at")
        q = self.store.param
        digest = subject_hash(self.store, subject) if kind is WaitKind.APPROVAL else None
        encoded = self.store.codec.encode(subject) if kind is WaitKind.APPROVAL else None
        now = self.clock()

        def insert(cur: Any, instance: int) -> tuple[Any, ...]:
            cur.execute(
                f"INSERT INTO oo_waits ({_COLS}) VALUES ({q}, {q}, {q}, {q}, {q}, {q}, {q}, "
                f"{q}, {q}, NULL, NULL, NULL, NULL, {q}, {q}, {q})",
                (
                    run_id,
                    name,
                    kind.value,
                    WaitStatus.OPEN.value,
                    due_at,
                    digest,
                    encoded,
                    requested_by,
                    int(allow_self),
                    now,
                    instance,
                    opened_by,
                ),
            )
            self._reseal(cur, run_id, name, instance)
            found = self._select(cur, run_id, name, instance)
            assert found is not None
            return found

        def txn(cur: Any) -> tuple[Any, ...]:
            row = self._select(cur, run_id, name, None)
            if row is None:
                return insert(cur, 0)
            latest_by, latest = row[15], int(row[14])
            if opened_by is None or latest_by == opened_by:
                return row  # this step visit's own wait (or no visit to tell them apart)
            if latest_by is None and row[2] == WaitKind.SIGNAL.value and kind is WaitKind.SIGNAL:
                # A signal kept for the next wait of its name: this one takes it.
                cur.execute(
                    f"UPDATE oo_waits SET opened_by = {q} WHERE run_id = {q} AND name = {q} "
                    f"AND instance = {q}",
                    (opened_by, run_id, name, latest),
                )
                self._reseal(cur, run_id, name, latest)
                found = self._select(cur, run_id, name, latest)
                assert found is not None
                return found
            if latest_by is None and row[3] == WaitStatus.OPEN.value:
                # An open wait from before waits were kept per step visit (or opened
                # outside the runtime): this step visit adopts it.
                cur.execute(
                    f"UPDATE oo_waits SET opened_by = {q} WHERE run_id = {q} AND name = {q} "
                    f"AND instance = {q}",
                    (opened_by, run_id, name, latest),
                )
                self._reseal(cur, run_id, name, latest)
                found = self._select(cur, run_id, name, latest)
                assert found is not None
                return found
            return insert(cur, latest + 1)  # another visit's wait: a new one

        return txn

    def wake_if_settled(self, run_id: str, name: str, instance: int | None = None) -> bool:
        """Make a waiting run ready if its wait ``name`` (the latest, or ``instance``) is
        settled or due.

        Returns:
            Whether the wait is settled or due (the run is ready, or was already).
        """
        now = self.clock()

        def txn(cur: Any) -> bool:
            row = self._select(cur, run_id, name, instance)
            if row is None:
                raise WaitNotFound(run_id, name)
            ready = row[3] != WaitStatus.OPEN.value or (row[4] is not None and row[4] <= now)
            if ready:
                self._wake(cur, run_id, now)
            return ready

        return self.store.transact(txn)

    def fire_if_due(self, run_id: str, name: str, instance: int | None = None) -> Wait:
        """Settle an open wait (the latest of its name, or ``instance``) whose time has
        come: a timer ``fired``, an approval or a signal ``expired``. Returns the wait as
        it now is."""
        q = self.store.param
        now = self.clock()

        def txn(cur: Any) -> int:
            row = self._select(cur, run_id, name, instance)
            if row is None:
                raise WaitNotFound(run_id, name)
            cur.execute(
                f"UPDATE oo_waits SET status = CASE kind WHEN 'timer' THEN 'fired' "
                f"ELSE 'expired' END, decided_at = {q}, decided_by = 'clock' "
                f"WHERE run_id = {q} AND name = {q} AND instance = {q} AND status = 'open' "
                f"AND due_at IS NOT NULL AND due_at <= {q}",
                (now, run_id, name, row[14], now),
            )
            if cur.rowcount:
                self._reseal(cur, run_id, name, int(row[14]))
                # Wake the run in the same transaction: a worker that dies after this
                # commit and before its checkpoint leaves a running (claimable) run, not
                # a waiting one whose timer is no longer open (that no worker would claim).
                self._wake(cur, run_id, now)
            return int(row[14])

        failpoint("waits.settle.before")
        which = self.store.transact(txn)
        failpoint("waits.settle.after")
        return self.get(run_id, name, which)

    # -- decisions from any process ----------------------------------------------------
    def approve(
        self, run_id: str, name: str, *, actor: str, subject_hash: str, reason: str = ""
    ) -> Wait:
        """Approve exactly the subject whose hash is ``subject_hash``; wakes the run.

        Raises:
            WaitNotFound: No such wait.
            WaitRefused: Already decided, expired, another subject, self-approval, or
                not an approval. Nothing was recorded.
        """
        return self._decide(run_id, name, WaitStatus.APPROVED, actor, reason, subject_hash)

    def approve_edited(
        self,
        run_id: str,
        name: str,
        *,
        actor: str,
        subject_hash: str,
        subject: Any,
        reason: str = "",
    ) -> Wait:
        """Edit, then approve: the approver changes what was requested (shown to them
        with ``subject_hash``) and approves the changed subject, in one transaction. The
        wait is then bound to the new subject's hash (the step's ``ctx.approved`` checks
        it), and its reason records the hash of what was requested.

        Raises:
            WaitNotFound: No such wait.
            WaitRefused: As :meth:`approve` (``subject_hash`` must be the hash of what
                was requested). Nothing was recorded.
            CodecError: The new subject cannot be encoded.
        """
        encoded = self.store.codec.encode(subject)
        note = (
            f"edited (requested {subject_hash[:16]}): {reason}"
            if reason
            else (f"edited (requested {subject_hash[:16]})")
        )
        return self._decide(
            run_id, name, WaitStatus.APPROVED, actor, note, subject_hash, edited=encoded
        )

    def reject(self, run_id: str, name: str, *, actor: str, reason: str = "") -> Wait:
        """Reject an open approval request; wakes the run.

        Raises:
            WaitNotFound: No such wait.
            WaitRefused: Already decided, expired, or not an approval.
        """
        return self._decide(run_id, name, WaitStatus.REJECTED, actor, reason, None)

    def signal(self, run_id: str, name: str, payload: Any = None, *, actor: str = "") -> Wait:
        """Deliver a signal: to the open wait of its name (waking the run), or, when none
        is open (or it is past its expiry: it expires), keep it for the next wait of that
        name (one kept signal at a time).

        Raises:
            RunNotFound: No such run.
            WaitRefused: ``name`` is another kind of wait (``kind_mismatch``), or the
                signal was delivered already and no wait has taken it since, or the run
                has ended (``decided``): a signal is delivered once.
        """
        self.store.get_run(run_id)  # RunNotFound before anything is written
        encoded = self.store.codec.encode(payload)
        q = self.store.param
        now = self.clock()

        def keep(cur: Any, instance: int) -> None:
            cur.execute(
                f"INSERT INTO oo_waits ({_COLS}) VALUES ({q}, {q}, 'signal', 'delivered', "
                f"NULL, NULL, NULL, NULL, 0, {q}, {q}, {q}, NULL, {q}, {q}, NULL)",
                (run_id, name, encoded, actor, now, now, instance),
            )
            self._reseal(cur, run_id, name, instance)

        def txn(cur: Any) -> tuple[str, tuple[Any, ...]] | None:
            row = self._select(cur, run_id, name, None)
            if row is None:
                keep(cur, 0)
                return None
            if row[2] != WaitKind.SIGNAL.value:
                return "kind_mismatch", row
            if row[3] == WaitStatus.OPEN.value:
                if row[4] is not None and float(row[4]) <= now:
                    # Past its expiry (not yet settled by a worker): it expires, and the
                    # signal is kept for the next wait of its name (an on_expire step
                    # that waits again takes it), never lost and never taken late.
                    cur.execute(
                        f"UPDATE oo_waits SET status = 'expired', decided_by = 'clock', "
                        f"decided_at = {q} WHERE run_id = {q} AND name = {q} "
                        f"AND instance = {q} AND status = 'open'",
                        (now, run_id, name, row[14]),
                    )
                    self._reseal(cur, run_id, name, int(row[14]))
                    self._wake(cur, run_id, now)
                    keep(cur, int(row[14]) + 1)
                    return None
                cur.execute(
                    f"UPDATE oo_waits SET status = 'delivered', payload = {q}, decided_by = {q}, "
                    f"decided_at = {q} WHERE run_id = {q} AND name = {q} AND instance = {q} "
                    f"AND status = 'open'",
                    (encoded, actor, now, run_id, name, row[14]),
                )
                self._reseal(cur, run_id, name, int(row[14]))
                self._wake(cur, run_id, now)
                return None
            if row[15] is None:
                return "decided", row  # kept already, and no wait has taken it yet
            cur.execute(f"SELECT status FROM oo_runs WHERE run_id = {q}", (run_id,))
            status = cur.fetchone()
            if status is None or status[0] in _TERMINAL_RUN:
                return "decided", row  # nothing will ever take it
            keep(cur, int(row[14]) + 1)  # for the next pass of a loop
            return None

        clash = self.store.transact(txn)
        if clash is not None:
            reason, row = clash
            found = self._wait(row)
            raise WaitRefused(
                run_id,
                name,
                reason,
                f"signal {name!r} of run {run_id!r} refused: "
                + (
                    f"{name!r} is a {found.kind.value} wait"
                    if reason == "kind_mismatch"
                    else f"it was delivered already by {found.decided_by!r}"
                ),
            )
        return self.get(run_id, name)

    def cancel_open(self, run_id: str, *, actor: str, reason: str = "") -> int:
        """Cancel every open wait of a run (the run is being cancelled). Returns how many."""
        q = self.store.param
        now = self.clock()

        def txn(cur: Any) -> int:
            cur.execute(
                f"SELECT {_READ} FROM oo_waits WHERE run_id = {q} AND status = 'open'", (run_id,)
            )
            rows = [self._checked(r) for r in cur.fetchall()]
            for row in rows:
                cur.execute(
                    f"UPDATE oo_waits SET status = 'cancelled', decided_by = {q}, "
                    f"decided_at = {q}, reason = {q} WHERE run_id = {q} AND name = {q} "
                    f"AND instance = {q} AND status = 'open'",
                    (actor, now, reason, run_id, row[1], row[14]),
                )
                self._reseal(cur, run_id, row[1], int(row[14]))
            return len(rows)

        return self.store.transact(txn)

    # -- workers -----------------------------------------------------------------------
    def claim_ready(
        self,
        owner: str,
        ttl_s: float,
        *,
        limit: int = 1,
        flows: Sequence[str] | Mapping[str, Iterable[str]] | None = None,
    ) -> list[str]:
        """Lease up to ``limit`` ready runs to ``owner`` for ``ttl_s`` seconds (with
        ``flows``, only runs of those flows; a mapping gives the versions of each flow's
        runs: a worker never leases a run it cannot drive).

        Ready: ``running`` with no live lease (new, woken, or left by a crashed worker),
        or ``waiting`` with a due timer or an expired approval. A lease held by ``owner``
        itself counts as free (a restarted worker takes its own runs back at once; two
        live workers must never share an owner name). On PostgreSQL concurrent
        workers skip each other's rows (``FOR UPDATE SKIP LOCKED``); on SQLite the write
        transaction (``BEGIN IMMEDIATE``) serialises them.

        Returns:
            The leased run ids, oldest update first (runs it held already last).
        """
        if ttl_s <= 0 or limit < 1:
            raise ConfigurationError("claim_ready needs ttl_s > 0 and limit >= 1")
        q = self.store.param
        pg = self.store.dialect == "postgresql"
        lock = " FOR UPDATE SKIP LOCKED" if pg else ""
        # A lease is free when nobody holds it, it lapsed, or it is our own: a restarted
        # worker with a stable owner name takes its dead predecessor's runs back at once.
        free = f"(r.lease_owner IS NULL OR r.lease_expires_at < {q} OR r.lease_owner = {q})"
        only, names = _flow_filter(flows, q)
        if names == []:
            return []
        pick = (
            f"SELECT r.run_id FROM oo_runs r WHERE {only}("
            f"(r.status = 'running' AND {free}) "
            f"OR (r.status = 'waiting' AND {free} "
            f"AND EXISTS (SELECT 1 FROM oo_waits w WHERE w.run_id = r.run_id "
            f"AND w.status = 'open' AND w.due_at IS NOT NULL AND w.due_at <= {q}))) "
            # Runs it holds already come last: a worker holding ``limit`` runs (skipped,
            # or being driven) must still see the others.
            f"ORDER BY CASE WHEN r.lease_owner = {q} THEN 1 ELSE 0 END, r.updated_at, "
            f"r.run_id LIMIT {int(limit)}{lock}"
        )

        def txn(cur: Any) -> list[str]:
            now = self.clock()  # in the transaction: a retried round sees the time it runs
            cur.execute(pick, (*(names or ()), now, owner, now, owner, now, owner))
            ids = [str(r[0]) for r in cur.fetchall()]
            for rid in ids:
                cur.execute(
                    f"UPDATE oo_runs SET lease_owner = {q}, lease_expires_at = {q} "
                    f"WHERE run_id = {q}",
                    (owner, now + ttl_s, rid),
                )
            return ids

        # Idempotent: run again after a lost COMMIT, it leases the same runs to the same
        # owner (whose own leases count as free).
        return self.store.transact(txn, idempotent=True)

    # -- internals ---------------------------------------------------------------------
    def _decide(
        self,
        run_id: str,
        name: str,
        status: WaitStatus,
        actor: str,
        reason: str,
        digest: str | None,
        *,
        edited: bytes | None = None,
    ) -> Wait:
        if not actor:
            raise ConfigurationError("an approval or rejection needs the actor's identity")
        wait = self.get(run_id, name)
        now = self.clock()
        refusal = _refusal(wait, status, actor, digest, now)
        if refusal is not None:
            raise WaitRefused(run_id, name, refusal[0], refusal[1])
        q = self.store.param

        def txn(cur: Any) -> bool:
            # The row is checked again (its seal) in the deciding transaction.
            if self._select(cur, run_id, name, wait.instance) is None:
                return False
            # CAS on the open state of the instance that was checked: two approvers
            # racing, one wins; a new instance opened meanwhile is not decided blind.
            if edited is None:
                cur.execute(
                    f"UPDATE oo_waits SET status = {q}, decided_by = {q}, decided_at = {q}, "
                    f"reason = {q} WHERE run_id = {q} AND name = {q} AND instance = {q} "
                    f"AND status = 'open' AND (due_at IS NULL OR due_at > {q})",
                    (status.value, actor, now, reason, run_id, name, wait.instance, now),
                )
            else:  # edit-then-approve: the new subject and its hash with the decision
                cur.execute(
                    f"UPDATE oo_waits SET status = {q}, decided_by = {q}, decided_at = {q}, "
                    f"reason = {q}, subject = {q}, subject_hash = {q} WHERE run_id = {q} "
                    f"AND name = {q} AND instance = {q} AND subject_hash = {q} "
                    f"AND status = 'open' AND (due_at IS NULL OR due_at > {q})",
                    (
                        status.value,
                        actor,
                        now,
                        reason,
                        edited,
                        blake3.blake3(edited).hexdigest(),
                        run_id,
                        name,
                        wait.instance,
                        digest,
                        now,
                    ),
                )
            if not cur.rowcount:
                return False
            self._reseal(cur, run_id, name, wait.instance)
            self._wake(cur, run_id, now)
            return True

        if not self.store.transact(txn):
            raise WaitRefused(
                run_id,
                name,
                "decided",
                f"approval {name!r} of run {run_id!r} was decided or expired meanwhile",
            )
        return self.get(run_id, name, wait.instance)

    def _select(
        self, cur: Any, run_id: str, name: str, instance: int | None
    ) -> tuple[Any, ...] | None:
        """The row of wait ``name`` of ``run_id`` (its latest instance, or ``instance``),
        its seal checked before anything decides on it."""
        q = self.store.param
        if instance is None:
            cur.execute(
                f"SELECT {_READ} FROM oo_waits WHERE run_id = {q} AND name = {q} "
                f"ORDER BY instance DESC LIMIT 1",
                (run_id, name),
            )
        else:
            cur.execute(
                f"SELECT {_READ} FROM oo_waits WHERE run_id = {q} AND name = {q} "
                f"AND instance = {q}",
                (run_id, name, instance),
            )
        row = cur.fetchone()
        if row is None:
            return None
        checked = self._checked(row)
        self.store._check_waits_in(cur, run_id)  # and the run's waits are as sealed
        return checked

    def _checked(self, row: Sequence[Any]) -> tuple[Any, ...]:
        """A wait row without its seal, after checking the seal (with integrity keys)
        and that an approval's subject is the one its hash names."""
        keys = self.store.integrity
        values = tuple(row[:16])
        if keys is not None:
            check_seal(
                keys,
                "waits",
                _wait_parts(values),
                None if row[16] is None else bytes(row[16]),
                what=f"wait {values[1]!r} of run {values[0]!r}",
                run_id=values[0],
            )
            subject = values[6]
            if subject is not None and blake3.blake3(bytes(subject)).hexdigest() != values[5]:
                raise CorruptRecord(
                    f"wait {values[1]!r} of run {values[0]!r}: the subject is not the one its "
                    f"approval is bound to (edited)",
                    run_id=values[0],
                )
        return values

    def _reseal(self, cur: Any, run_id: str, name: str, instance: int) -> None:
        """Seal a wait row this transaction just wrote (no keys: nothing to do)."""
        keys = self.store.integrity
        if keys is None:
            return
        q = self.store.param
        cur.execute(
            f"SELECT {_COLS} FROM oo_waits WHERE run_id = {q} AND name = {q} AND instance = {q}",
            (run_id, name, instance),
        )
        row = cur.fetchone()
        if row is None:
            return
        cur.execute(
            f"UPDATE oo_waits SET seal = {q} WHERE run_id = {q} AND name = {q} AND instance = {q}",
            (keys.seal("waits", _wait_parts(tuple(row))), run_id, name, instance),
        )
        self.store._seal_waits_in(cur, run_id)

    def _wake(self, cur: Any, run_id: str, now: float) -> None:
        q = self.store.param
        if self.store.integrity is None:
            cur.execute(
                f"UPDATE oo_runs SET status = 'running', updated_at = {q} "
                f"WHERE run_id = {q} AND status = 'waiting'",
                (now, run_id),
            )
        else:
            # The run row is checked and sealed again with its new status.
            run = self.store.read_run_in(cur, run_id, lock=True)
            if run is not None and run.status is RunStatus.WAITING:
                self.store._update_run_in(cur, run, {"status": RunStatus.RUNNING.value})
        if self.store.dialect == "postgresql":
            cur.execute(f"NOTIFY {NOTIFY_CHANNEL}")

    def _wait(self, row: tuple[Any, ...]) -> Wait:
        codec = self.store.codec
        subject = None if row[6] is None else codec.decode(bytes(row[6]))
        payload = None if row[9] is None else codec.decode(bytes(row[9]))
        return Wait(
            run_id=row[0],
            name=row[1],
            kind=WaitKind(row[2]),
            status=WaitStatus(row[3]),
            due_at=row[4],
            subject_hash=row[5],
            subject=subject,
            requested_by=row[7],
            allow_self=bool(row[8]),
            payload=payload,
            decided_by=row[10],
            decided_at=row[11],
            reason=row[12],
            created_at=row[13],
            instance=int(row[14]),
            opened_by=row[15],
        )


def _wait_parts(row: Sequence[Any]) -> list[object]:
    """What a wait's seal covers: every column, the payload by its hash."""
    payload = row[9]
    return [
        row[0],
        row[1],
        int(row[14]),
        row[2],
        row[3],
        None if row[4] is None else float(row[4]),
        row[5],
        row[7],
        int(row[8]),
        None if payload is None else blake3.blake3(bytes(payload)).digest(),
        row[10],
        None if row[11] is None else float(row[11]),
        row[12],
        row[15],
        float(row[13]),
    ]


def _refusal(
    wait: Wait, status: WaitStatus, actor: str, digest: str | None, now: float
) -> tuple[str, str] | None:
    where = f"approval {wait.name!r} of run {wait.run_id!r}"
    if wait.kind is not WaitKind.APPROVAL:
        return "not_approval", f"{wait.name!r} of run {wait.run_id!r} is a {wait.kind.value} wait"
    if wait.status is not WaitStatus.OPEN:
        by = f" by {wait.decided_by}" if wait.decided_by else ""
        return "decided", f"{where} is {wait.status.value}{by} already; a decision is final"
    if wait.due_at is not None and wait.due_at <= now:
        return "expired", f"{where} expired; the run will take its expiry path"
    if status is WaitStatus.APPROVED and digest != wait.subject_hash:
        return (
            "subject_changed",
            (
                f"{where} refused: the hash you approved ({digest}) is not the hash of what "
                f"was requested ({wait.subject_hash}); review `onceonly runs show "
                f"{wait.run_id}` again"
            ),
        )
    if status is WaitStatus.APPROVED and actor == wait.requested_by and not wait.allow_self:
        return "self_approval", f"{where}: {actor!r} requested it and may not approve it"
    return None


def notify_ready(cur: Any, dialect: str) -> None:
    """Wake idle workers (PostgreSQL ``NOTIFY``; a no-op on SQLite, where they poll)."""
    if dialect == "postgresql":
        cur.execute(f"NOTIFY {NOTIFY_CHANNEL}")


def _flow_filter(
    flows: Sequence[str] | Mapping[str, Iterable[str]] | None, q: str
) -> tuple[str, list[str] | None]:
    """The claim's condition on a run's flow (and version), and its parameters: None for
    every flow, an empty list for none."""
    if flows is None:
        return "", None
    if not isinstance(flows, Mapping):
        names = sorted(set(flows))
        return f"r.flow IN ({', '.join([q] * len(names))}) AND ", names
    terms: list[str] = []
    params: list[str] = []
    for name, versions in sorted(flows.items()):
        vs = sorted(set(versions))
        if not vs:
            continue
        terms.append(f"(r.flow = {q} AND r.code_version IN ({', '.join([q] * len(vs))}))")
        params += [name, *vs]
    if not terms:
        return "", []
    return f"({' OR '.join(terms)}) AND ", params
