"""The effects ledger: the record that lets every external action happen once.

Every transition is one write transaction through the checkpoint store's write barrier
(:meth:`checkpoint.Store.transact`): pending checkpoints and the transition commit
together, and in ``async`` durability concurrent claims share one group commit. Every
transition is a compare-and-set on ``(key_id, epoch, status)``; a stale worker's outcome
changes nothing but is itself recorded (a ``late_outcome`` audit event, and a warning on
the ``onceonly.ledger`` logger) before :class:`~ledger.errors.LeaseLost` is raised. Every
transition appends a hash-chained audit event in the same transaction.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from onceonly.checkpoint import Codec, RowKeys, Store, ensure_schema
from onceonly.checkpoint.errors import CodecError, ConfigurationError, CorruptRecord, StoreError
from onceonly.checkpoint.failpoints import failpoint

from . import _schema
from ._integrity import (
    EVENT_COLS,
    StoreRolledBack,
    check_event,
    effect_parts,
    event_parts,
    head_of,
    head_parts,
    verify_chain,
    whole_since,
)
from ._queries import QueryMixin
from ._rows import SELECT, TERMINAL, Row, effect_record, effect_row
from .audit import GENESIS, event_hash, row_digest
from .crypto import Sealer
from .errors import (
    LEDGER_HINT,
    EffectFailed,
    EffectInDoubt,
    EffectInFlight,
    InvalidTransition,
    KeyReuseError,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    PayloadErased,
    ResultUnknown,
    SubjectErased,
    UnknownEffect,
)
from .fence import RunFence, check_fence, current_fence
from .keys import EffectIdentity, Keyring, canonical_args
from .records import (
    UNKNOWN_RESULT,
    Claim,
    EffectRecord,
    EffectStatus,
    Evidence,
    InFlightPolicy,
    OutcomeClass,
    ProviderClass,
    Replay,
)

__all__ = ["Ledger"]

T = TypeVar("T")
# How long a chain counted whole stays trusted below its head in this process before a
# claim counts it in full again (a delete made while a worker runs is caught this late).
_RECOUNT_S = 1.0
log = logging.getLogger("onceonly.ledger")
_COLS = _schema.COLUMNS
ERASED = b""  # an outcome recorded after its subject was erased: no payload
_SELECT = SELECT
_TERMINAL = TERMINAL
_row = effect_row
_record = effect_record
# Failpoints (before, after) around recording each kind of outcome, by its audit event.
_RECORD_POINTS = {
    "committed": ("ledger.commit.before", "ledger.commit.after"),
    "failed": ("ledger.fail.before", "ledger.fail.after"),
    "unknown": ("ledger.mark_unknown.before", "ledger.mark_unknown.after"),
    "not_sent": ("ledger.release.before", "ledger.release.after"),
}


# A finished row may be cached (and replayed from memory) only if its outcome can never
# change: one a worker recorded from the provider's answer. Outcomes settled by a probe or
# an operator may be corrected (:meth:`Ledger.correct`), so they are read afresh each time.
_SETTLED_BY_ANSWER = (OutcomeClass.SUCCEEDED.value, OutcomeClass.REJECTED.value)


def _cacheable(row: Row) -> bool:
    return row["status"] in _TERMINAL and row["outcome_class"] in _SETTLED_BY_ANSWER


def _interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` stops the process or task rather than reports how the call went
    (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError, ...)."""
    return not isinstance(exc, Exception)


@dataclass(frozen=True)
class _Outcome:
    """What a claim transaction decided (raised or returned after it commits)."""

    kind: str  # claim | replay | reuse | inflight | doubt
    row: Row
    claim: Claim | None = None
    cipher: tuple[str, ChaCha20Poly1305] | None = None


class Ledger(QueryMixin):
    """The durable effects ledger, in the same database as the checkpoints.

    Example::

        ledger = Ledger(store, Keyring.from_env())
        ident = EffectIdentity("acme", run_id, "notify", 0, "send_email@1", 0)
        out = ledger.claim(ident, {"to": "a@example.com"}, provider_class=ProviderClass.QUERYABLE)
        if isinstance(out, Replay):
            return out.result                     # recorded: never act again
        try:
            result = send(out.provider_key, ...)   # act, carrying the provider key
        except TimeoutError:
            ledger.mark_unknown(out, "timeout after send")
            raise
        ledger.commit(out, result)                 # durable before returning

    Args:
        store: The checkpoint store (its database holds the ledger too).
        keyring: Secrets for keys, fingerprints and data-key wrapping.
        owner: This worker's name in leases (default host:pid:random). Give each worker a
            stable name (``"worker-3"``) and a restarted worker finds the claims its dead
            predecessor left open in doubt at once, instead of waiting out their leases.
        lease_s: How long a claim stays live without renewal.
        in_flight: What to do when another worker holds a live claim.
        create: Create the ledger's tables in a database that has none.
        clock: Time source (UNIX seconds), for tests.
        witness: A witness file outside the database (default ``$ONCEONLY_WITNESS``;
            ``""`` for none): every claim advances it before acting, the store records
            its run rows' revisions in it, and a store behind it refuses to act.
        read_only: Open for reading only (no keys of its own: rows read are marked
            ``unverified``); every write raises.
    """

    def __init__(
        self,
        store: Store,
        keyring: Keyring,
        *,
        owner: str | None = None,
        lease_s: float = 30.0,
        in_flight: InFlightPolicy | None = None,
        create: bool = True,
        clock: Callable[[], float] = time.time,
        witness: str | None = None,
        read_only: bool = False,
    ) -> None:
        if lease_s <= 0:
            raise ConfigurationError("lease_s must be > 0")
        self.store = store
        self.keyring = keyring
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_s = lease_s
        self.in_flight = in_flight or InFlightPolicy()
        self.codec = Codec()
        self._clock = clock
        self._sealer = Sealer(keyring)
        self._q = store.param
        self._pg = store.dialect == "postgresql"
        self._lock = threading.Lock()
        self._heads: dict[str, tuple[int, bytes]] = {}
        self._terminal: dict[str, Row] = {}
        self._prefetched: set[str] = set()
        self._poisoned: BaseException | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._live: set[tuple[str, int]] = set()  # claims this object handed out, open
        ensure_schema(store.engine, "ledger", _schema.LEDGER_MIGRATIONS, create=create)
        # The store seals (and checks) its runs, checkpoints and waits with this keyring;
        # the ledger seals its rows, events and chain heads with the same keys.
        # A read-only ledger (an operator's view without the secret) checks no seals and
        # writes nothing: what it shows is flagged ``unverified``.
        self.read_only = read_only
        self._keys: RowKeys | None = None if read_only else keyring.row_keys()
        if self._keys is not None:
            store.attach_integrity(self._keys)
        # chain -> (head known whole in this process, when it was last counted in full)
        self._verified: dict[str, tuple[int, float]] = {}
        path = (witness if witness is not None else os.environ.get("ONCEONLY_WITNESS", "")) or None
        self.witness = None if path is None else store.attach_witness(path)
        self._behind: StoreRolledBack | None = None
        if self.witness is not None:
            self._behind = self._behind_witness()

    # -- fail closed --------------------------------------------------------------------
    def _chain_heads(self) -> dict[str, int]:
        """Every audit chain's head sequence number, as the store holds it."""

        def heads(cur: Any) -> dict[str, int]:
            cur.execute("SELECT chain, seq FROM oo_chain_heads")
            return {str(c): int(s_) for c, s_ in cur.fetchall()}

        return self.store.read(heads)

    def _behind_witness(self) -> StoreRolledBack | None:
        """The first chain the store is behind its witness on (read at open)."""
        assert self.witness is not None
        witnessed = dict(self.witness.heads)
        if not witnessed:
            return None

        have = self._chain_heads()
        for chain, seq in sorted(witnessed.items()):
            if have.get(chain, 0) < seq:
                behind = StoreRolledBack(chain, have.get(chain, 0), seq, self.witness.path)
                log.error("%s", behind)
                return behind
        return None

    def accept_restore(self, *, actor: str, reason: str) -> dict[str, int]:
        """Accept the store as it is after a restore: the witness is reset to the store's
        current chain heads (the reset, with who and why, is appended to the witness
        file and logged), and this ledger acts again.

        Call it only after reconciling what the providers did since the backup: effects
        made after it are no longer in the ledger.

        Returns:
            The chain heads the witness now holds.

        Raises:
            ConfigurationError: No witness is configured, or no actor or reason given.
        """
        if self.witness is None:
            raise ConfigurationError("accept_restore needs a witness (ONCEONLY_WITNESS)")
        if not actor.strip() or not reason.strip():
            raise ConfigurationError("accepting a restore needs the operator and a reason")

        have = self._chain_heads()
        note = f"accepted by {actor} at {self._clock():.3f}: {' '.join(reason.split())}"
        self.witness.reset(have, note, self.store.run_revisions())
        log.warning("restore accepted (witness %s reset): %s", self.witness.path, note)
        self._behind = None
        self.store.accept_restore()
        self._verified.clear()
        self._heads.clear()
        return have

    def seal_unsealed(self) -> int:
        """Seal every ledger row that carries no seal (effect rows, audit events, chain
        heads), and the store's runs, checkpoints and waits, as they stand: for a store
        created before sealing, after checking it (``verify``). Returns how many rows
        were sealed.

        Raises:
            ConfigurationError: The ledger is read-only.
        """
        self._check()
        keys = self._keys
        assert keys is not None
        q = self._q

        def txn(cur: Any) -> int:
            n = 0
            cur.execute(f"{_SELECT} WHERE seal IS NULL")
            for found in cur.fetchall():
                row = _row(found)
                cur.execute(
                    f"UPDATE oo_effects SET seal = {q} WHERE key_id = {q}",
                    (keys.seal("effects", effect_parts(row)), row["key_id"]),
                )
                n += 1
            cur.execute(f"SELECT {EVENT_COLS} FROM oo_audit WHERE mac IS NULL")
            for ev in cur.fetchall():
                cur.execute(
                    f"UPDATE oo_audit SET mac = {q} WHERE chain = {q} AND seq = {q}",
                    (keys.seal("audit", event_parts(ev)), ev[0], ev[1]),
                )
                n += 1
            cur.execute(
                "SELECT a.chain, a.seq, a.hash FROM oo_audit a WHERE a.seq = (SELECT "
                "MAX(b.seq) FROM oo_audit b WHERE b.chain = a.chain) AND NOT EXISTS "
                "(SELECT 1 FROM oo_chain_heads h WHERE h.chain = a.chain)"
            )
            for chain, seq, h in cur.fetchall():
                cur.execute(
                    f"INSERT INTO oo_chain_heads (chain, seq, hash, seal) VALUES "
                    f"({q}, {q}, {q}, {q})",
                    (chain, seq, bytes(h), keys.seal("heads", head_parts(chain, seq, bytes(h)))),
                )
                n += 1
            return n

        n = self._write(txn, outcome=False)
        self._verified.clear()
        self._heads.clear()
        return n + self.store.seal_unsealed()

    def _check(self) -> None:
        if self.read_only:
            raise ConfigurationError(
                "this ledger was opened read-only (no keyring): it writes nothing; set "
                "ONCEONLY_SECRETS to act"
            )
        if self._behind is not None:
            raise self._behind
        if self._poisoned is not None:
            raise LedgerUnavailable(
                "this ledger stopped after an outcome could not be recorded "
                f"({self._poisoned}); nothing more is acted on through it. Once the database "
                "answers again, Ledger.recover() (a Worker calls it by itself after a "
                "transient failure) or a new process starts again from what is on disk, and "
                "the unrecorded effect is reconciled as in doubt."
            ) from self._poisoned

    def recover(self) -> None:
        """Start again from what is on disk, as a restarted process would.

        Forgets everything this object cached and the claims it handed out, and accepts
        work again if it had stopped (an outcome that could not be recorded). An effect
        whose outcome went unrecorded is then found in doubt by its next claim (a claim of
        this worker's name that this object did not hand out) and reconciled, by the
        adapter's probe or an operator, exactly as after a restart.

        Call it only while nothing is done through this ledger (no step is running), and
        only once the cause is gone: a :class:`~onceonly.worker.Worker` calls it by itself
        after a transient database failure, once the database answers again; after a
        disk error, fix the disk first.

        Raises:
            LedgerUnavailable: The database does not answer yet; the ledger stays as it
                was (the store has retried for its retry budget).
        """
        try:
            self.store.read(lambda cur: cur.execute("SELECT 1"))
        except StoreError as exc:
            raise LedgerUnavailable(
                f"the ledger cannot start again yet: the database does not answer ({exc})"
            ) from exc
        self._heads.clear()
        self._terminal.clear()
        self._prefetched.clear()
        self._live.clear()
        self._verified.clear()
        self._poisoned = None

    def _write(self, fn: Callable[[Any], T], *, outcome: bool) -> T:
        self._check()
        try:
            return self.store.transact(fn)
        except LedgerError:
            raise  # the state machine's own answers (LeaseLost, InvalidTransition, ...)
        except CorruptRecord:
            raise  # a tampered entry, refused before anything was written (I4)
        except Exception as exc:
            # Anything else (a store or driver error, a background write failure, a bug)
            # means the transition is not known to be recorded: fail closed.
            if outcome:
                self._poisoned = exc
                raise LedgerUnavailable(
                    f"the ledger could not record this effect's outcome ({exc}); the effect "
                    f"was performed and will be reconciled as in doubt. This ledger now "
                    f"refuses further work until Ledger.recover() or a restart."
                ) from exc
            raise LedgerUnavailable(
                f"the ledger could not be written ({exc}); nothing was acted on for this call"
            ) from exc

    # -- identity -----------------------------------------------------------------------
    def key_ids(self, identity: EffectIdentity) -> list[tuple[str, str]]:
        """``(secret id, key id)`` candidates for an identity, current secret first."""
        parts = identity.parts()
        return [(sid, self.keyring.key_id(sid, parts)) for sid in self.keyring.ids]

    def key_id(self, identity: EffectIdentity) -> str:
        """The key id this identity has under the current secret."""
        return self.keyring.key_id(self.keyring.current_id, identity.parts())

    # -- claim --------------------------------------------------------------------------
    def claim(
        self,
        identity: EffectIdentity,
        args: Any,
        *,
        provider_class: ProviderClass | str = ProviderClass.OPAQUE,
        window_s: float | None = None,
        subject: str | None = None,
    ) -> Claim | Replay:
        """Record the intent to act, durably, before acting — or return the recorded outcome.

        Args:
            identity: Where the call sits (or its explicit key).
            args: The call's arguments (any codec-encodable value); fingerprinted and
                stored encrypted.
            provider_class: What the provider can tell us when the outcome is lost.
            window_s: Class A: how long the provider deduplicates our key.
            subject: The data subject whose key encrypts the payloads (default: the run,
                or the tenant outside a run).

        Returns:
            A :class:`Claim` (act now, with ``claim.provider_key``) or a :class:`Replay`
            (the effect already happened: return ``replay.result``).

        Raises:
            KeyReuseError: The key was recorded with other arguments.
            EffectFailed: The effect failed definitely before; its error is replayed.
            EffectInFlight: Another worker holds a live claim (after waiting per policy).
            EffectInDoubt: The effect is UNKNOWN or NEEDS_HUMAN: reconcile it first.
            ResultUnknown: It happened (an operator said so) but its result is unknown;
                not performed again (:meth:`correct` records the result).
            PayloadErased: Recorded, but the payload was erased; not performed again.
            LedgerUnavailable: The intent could not be recorded; do not act.
        """
        self._check()
        pclass = ProviderClass(provider_class)
        # the database returns a float: audit the row as it will be read back
        window_s = None if window_s is None else float(window_s)
        if pclass is ProviderClass.DEDUPLICATING and (window_s is None or window_s <= 0):
            raise ConfigurationError("a class A (deduplicating) provider needs window_s > 0")
        canonical = canonical_args(args, self.codec)
        candidates = self.key_ids(identity)
        fps = {sid: self.keyring.fingerprint(sid, canonical) for sid, _ in candidates}
        subj = subject or identity.run_id or f"tenant:{identity.tenant}"
        chain = identity.run_id or f"tenant:{identity.tenant}"
        if identity.run_id is not None and identity.run_id not in self._prefetched:
            try:
                self.prefetch(identity.run_id)
            except StoreError as exc:
                raise LedgerUnavailable(
                    f"the ledger could not be read ({exc}); nothing was acted on for this call"
                ) from exc
        for _sid, kid in candidates:
            cached = self._terminal.get(kid)
            if cached is not None:
                if cached["fingerprint"] != fps[cached["secret_id"]]:
                    raise KeyReuseError(kid, cached["effect"])
                return self._replay(cached)

        deadline = self._clock() + self.in_flight.wait_s
        backoff = self.in_flight.initial_backoff_s
        # Read here, in the caller's context: the transaction may run on the store's
        # background writer thread (async durability).
        fence = current_fence()
        while True:
            failpoint("ledger.claim.before")
            out = self._write(
                lambda cur: self._claim_txn(
                    cur, identity, candidates, fps, canonical, pclass, window_s, subj, chain, fence
                ),
                outcome=False,
            )
            failpoint("ledger.claim.after")
            if out.cipher is not None:
                self._sealer.remember(*out.cipher)
            if out.kind == "claim":
                assert out.claim is not None
                self._witness_claim(out.row["chain"])
                return out.claim
            if out.kind == "replay":
                self._remember(out.row)
                return self._replay(out.row)
            if out.kind == "reuse":
                raise KeyReuseError(out.row["key_id"], out.row["effect"])
            if out.kind == "doubt":
                raise EffectInDoubt(out.row["key_id"], out.row["status"], out.row["provider_class"])
            # in flight: wait for the other worker's outcome, bounded, with backoff
            now = self._clock()
            if now >= deadline:
                raise EffectInFlight(
                    out.row["key_id"],
                    str(out.row["lease_owner"]),
                    float(out.row["lease_expires_at"]),
                )
            time.sleep(min(backoff, max(deadline - now, 0.0)))
            backoff = min(backoff * 2, self.in_flight.max_backoff_s)

    def _claim_txn(
        self,
        cur: Any,
        identity: EffectIdentity,
        candidates: list[tuple[str, str]],
        fps: Mapping[str, str],
        canonical: bytes,
        pclass: ProviderClass,
        window_s: float | None,
        subject: str,
        chain: str,
        fence: RunFence | None,
    ) -> _Outcome:
        q = self._q
        now = self._clock()
        ids = [kid for _, kid in candidates]
        marks = ", ".join([q] * len(ids))
        lock = " FOR UPDATE" if self._pg else ""
        if self._pg and len(ids) > 1:
            # During a rotation, workers whose current secrets differ would each find no
            # row and insert their own key id: serialise on every candidate (in one order,
            # so two claimers never deadlock). SQLite writers are serialised already.
            for kid in sorted(ids):
                cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (kid,))
        cur.execute(f"{_SELECT} WHERE key_id IN ({marks}){lock}", ids)
        found = cur.fetchall()
        if not found:
            self._check_absent(cur, chain, ids)
            self._check_chain(cur, chain)
            check_fence(cur, self.store, fence)
            sid, kid = candidates[0]
            new_cipher = self._cipher_in_txn(cur, subject)
            row: Row = {
                "key_id": kid,
                "tenant": identity.tenant,
                "run_id": identity.run_id,
                "step_id": identity.step_id,
                "effect": identity.effect,
                "fingerprint": fps[sid],
                "provider_key": self.keyring.provider_key(sid, kid),
                "provider_class": pclass.value,
                "window_s": window_s,
                "status": EffectStatus.CLAIMED.value,
                "epoch": 1,
                "lease_owner": self.owner,
                "lease_expires_at": now + self.lease_s,
                "attempts": 1,
                "outcome_class": None,
                "subject": subject,
                "secret_id": sid,
                "chain": chain,
                "args_ct": Sealer.seal(new_cipher[1], canonical, f"{kid}|args".encode()),
                "result_ct": None,
                "error_ct": None,
                "first_sent_at": now,
                "created_at": now,
                "updated_at": now,
            }
            row["seal"] = self._seal("effects", effect_parts(row))
            cols = ", ".join(_COLS)
            cur.execute(
                f"INSERT INTO oo_effects ({cols}) VALUES ({', '.join([q] * len(_COLS))}) "
                f"ON CONFLICT DO NOTHING",
                [row[c] for c in _COLS],
            )
            if cur.rowcount == 1:
                self._append(cur, row, "claimed", self.owner, "")
                return _Outcome("claim", row, self._claim_of(row), new_cipher)
            # Lost an insert race (PostgreSQL): read the winner's row under lock.
            cur.execute(f"{_SELECT} WHERE key_id = {q}{lock}", (kid,))
            found = cur.fetchall()
        row = _row(found[0])
        self._check_row(cur, row)
        if row["status"] not in _TERMINAL:
            self._check_chain(cur, row["chain"])  # a store behind its witness acts on nothing
        if row["fingerprint"] != fps.get(row["secret_id"]):
            return _Outcome("reuse", row)
        status = row["status"]
        if status in _TERMINAL:
            return _Outcome("replay", row)
        if status == EffectStatus.CLAIMED.value:
            live = row["lease_expires_at"] is not None and row["lease_expires_at"] > now
            # A live claim under this worker's own name that this process never handed
            # out was made by an earlier incarnation that died: in doubt now, no need to
            # wait out its lease.
            orphan = (
                row["lease_owner"] == self.owner
                and (
                    row["key_id"],
                    int(row["epoch"]),
                )
                not in self._live
            )
            if live and not orphan:
                return _Outcome("inflight", row)
            why = (
                "the claiming worker restarted before recording an outcome"
                if live
                else "claim lease expired before an outcome was recorded"
            )
            moved = self._transition(
                cur,
                row,
                "lease_expired",
                {
                    "status": EffectStatus.UNKNOWN.value,
                    "lease_owner": None,
                    "lease_expires_at": None,
                },
                expect=EffectStatus.CLAIMED.value,
                actor=self.owner,
                detail=why,
            )
            return _Outcome("doubt", moved or row)
        if status == EffectStatus.NOT_HAPPENED.value:
            moved = self._reclaim(cur, row, "reclaimed", resend=False, fence=fence)
            if moved is None:
                return _Outcome("inflight", row)
            return _Outcome("claim", moved, self._claim_of(moved))
        return _Outcome("doubt", row)

    def _reclaim(
        self, cur: Any, row: Row, event: str, *, resend: bool, fence: RunFence | None
    ) -> Row | None:
        check_fence(cur, self.store, fence)
        now = self._clock()
        return self._transition(
            cur,
            row,
            event,
            {
                "status": EffectStatus.CLAIMED.value,
                "epoch": int(row["epoch"]) + 1,
                "attempts": int(row["attempts"]) + 1,
                "lease_owner": self.owner,
                "lease_expires_at": now + self.lease_s,
                "outcome_class": None,
            },
            expect=row["status"],
            actor=self.owner,
            detail="re-send inside the provider's dedup window" if resend else "",
        )

    def _claim_of(self, row: Row, *, resend: bool = False) -> Claim:
        self._live.add((row["key_id"], int(row["epoch"])))
        return Claim(
            key_id=row["key_id"],
            epoch=int(row["epoch"]),
            provider_key=row["provider_key"],
            attempt=int(row["attempts"]),
            lease_owner=str(row["lease_owner"]),
            lease_expires_at=float(row["lease_expires_at"]),
            provider_class=ProviderClass(row["provider_class"]),
            subject=row["subject"],
            chain=row["chain"],
            resend=resend,
        )

    # -- the one claim/act/record path ------------------------------------------------
    def perform(
        self,
        identity: EffectIdentity,
        args: Any,
        act: Callable[[Claim], T],
        *,
        provider_class: ProviderClass | str = ProviderClass.OPAQUE,
        window_s: float | None = None,
        subject: str | None = None,
        classify: Callable[[BaseException], OutcomeClass] | None = None,
    ) -> T:
        """Claim, act once, record the outcome; or return the recorded result.

        ``act`` receives the :class:`Claim` (send ``claim.provider_key`` downstream). If it
        raises, ``classify`` decides by evidence: NOT_SENT releases the claim (a later
        call may send), REJECTED records a definite failure, anything else (the default:
        we cannot know whether it happened) records UNKNOWN. The exception is re-raised.
        An interrupt (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, a
        cancelled task: any ``BaseException`` that is not an ``Exception``) is not
        classified: the entry is left in doubt (UNKNOWN, or the claim lapses if the
        ledger cannot be written) and the interrupt itself is re-raised.

        Raises:
            Everything :meth:`claim` raises, and whatever ``act`` raised.
        """
        out = self.claim(
            identity, args, provider_class=provider_class, window_s=window_s, subject=subject
        )
        if isinstance(out, Replay):
            return out.result  # type: ignore[no-any-return]
        failpoint("adapters.act.before")
        try:
            result = act(out)
        except Exception as exc:
            self._record_failure(out, exc, classify)
            raise
        except BaseException as exc:
            self._record_interrupt(out, exc)
            raise
        failpoint("adapters.act.after")
        self._commit_row(out, result)
        return result

    async def aperform(
        self,
        identity: EffectIdentity,
        args: Any,
        act: Callable[[Claim], Awaitable[T]],
        *,
        provider_class: ProviderClass | str = ProviderClass.OPAQUE,
        window_s: float | None = None,
        subject: str | None = None,
        classify: Callable[[BaseException], OutcomeClass] | None = None,
    ) -> T:
        """:meth:`perform` for coroutines. Ledger writes run on a thread pool, so with
        ``async`` store durability concurrent calls share group commits; each runs in a
        copy of the caller's context (context variables reach the ledger).

        A cancellation while the act runs is an interrupt (see :meth:`perform`): the entry
        is left in doubt, as if the process had been killed there. A cancellation while
        the claim is being recorded gives the claim back once it is (nothing was sent).
        """
        out = await self._claim_in_thread(
            lambda: self.claim(
                identity, args, provider_class=provider_class, window_s=window_s, subject=subject
            )
        )
        if isinstance(out, Replay):
            return out.result  # type: ignore[no-any-return]
        failpoint("adapters.act.before")
        try:
            result = await act(out)
        except Exception as exc:
            await self._in_thread(functools.partial(self._record_failure, out, exc, classify))
            raise
        except BaseException as exc:
            await self._in_thread_to_the_end(functools.partial(self._record_interrupt, out, exc))
            raise
        failpoint("adapters.act.after")
        await self._in_thread(lambda: self.commit(out, result))
        return result

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the ledger's thread pool, in a copy of the caller's context."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor(), contextvars.copy_context().run, fn)

    async def _in_thread_to_the_end(self, fn: Callable[[], None]) -> None:
        """:meth:`_in_thread`, awaited to its end even if the task is cancelled (again)
        meanwhile: the write finishes on its thread regardless, and the caller is about
        to re-raise its own interrupt."""
        done = self.executor().submit(contextvars.copy_context().run, fn)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(asyncio.wrap_future(done))

    async def _claim_in_thread(self, fn: Callable[[], Claim | Replay]) -> Claim | Replay:
        """:meth:`_in_thread` for a claim: cancelled while it is being recorded, the claim
        (taken on its thread regardless) is given back as soon as it is taken."""
        done = self.executor().submit(contextvars.copy_context().run, fn)
        try:
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            done.add_done_callback(self._give_back_unused)
            raise

    def _give_back_unused(self, done: concurrent.futures.Future[Claim | Replay]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        out = done.result()
        if isinstance(out, Claim):
            self.give_back(out, "cancelled before acting")

    def replay(self, key_id: str) -> Replay:
        """The recorded outcome of a finished entry, without acting.

        Raises:
            EffectFailed: The entry failed definitely (its recorded error).
            ResultUnknown: The entry happened, but its result was never recorded.
            InvalidTransition: The entry has no definite outcome yet.
            UnknownEffect: No such entry.
        """
        row = self._get_row(key_id)
        self.store.read(lambda cur: self._check_row(cur, row))
        if row["status"] not in _TERMINAL:
            raise InvalidTransition(key_id, row["status"], "replay an unfinished effect")
        return self._replay(row)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread pool async callers run ledger writes on (shared, created lazily)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=64, thread_name_prefix="onceonly-ledger"
                )
            return self._pool

    def close(self) -> None:
        """Stop the async helper threads (the store is closed by its owner)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def give_back(self, claim: Claim, detail: str = "not used") -> None:
        """Return a claim nothing was sent under: a first claim or a re-claim of an entry
        that did not happen is released (NOT_HAPPENED); a re-send claim goes back to
        UNKNOWN (an earlier attempt may have happened), for the next call to reconcile.
        Never raises: if the ledger cannot be written, the claim lapses with its lease.

        Args:
            claim: A live claim of this ledger's that was not acted on.
            detail: A short plaintext note for the audit trail (no personal data).
        """
        try:
            if claim.resend:
                self.mark_unknown(claim, detail)
            else:
                self.release(claim, detail)
        except Exception:  # noqa: BLE001  (the claim lapses with its lease instead)
            log.warning("could not give back the unused claim on %s…", claim.key_id[:16])

    def _record_interrupt(self, claim: Claim, exc: BaseException) -> None:
        """An interrupt arrived while acting: in doubt (UNKNOWN) if the ledger can be
        written, else the claim lapses; never reconciled here, and never raises."""
        try:
            self.mark_unknown(claim, f"interrupted: {type(exc).__name__}")
        except Exception:  # noqa: BLE001  (the claim lapses with its lease instead)
            log.warning(
                "interrupted while acting on %s…; the ledger could not record it in doubt, "
                "so its claim lapses with its lease",
                claim.key_id[:16],
            )

    def _record_failure(
        self,
        claim: Claim,
        exc: BaseException,
        classify: Callable[[BaseException], OutcomeClass] | None,
    ) -> None:
        try:
            outcome = OutcomeClass.AMBIGUOUS if classify is None else OutcomeClass(classify(exc))
        except Exception:  # no evidence: in doubt (the claim is never left open)
            log.exception("classifying %s failed; the attempt is in doubt", type(exc).__name__)
            outcome = OutcomeClass.AMBIGUOUS
        # Exception messages may carry personal data: only the type goes into the
        # (plaintext) audit detail; the message is sealed with the entry's payloads.
        detail = type(exc).__name__
        if outcome is OutcomeClass.NOT_SENT:
            self.release(claim, detail, error=exc)
        elif outcome is OutcomeClass.REJECTED:
            self.fail(claim, type(exc).__name__, str(exc))
        else:  # AMBIGUOUS, or SUCCEEDED for an exception, which cannot be: in doubt
            self.mark_unknown(claim, detail, error=exc)

    # -- outcomes -----------------------------------------------------------------------
    def commit(self, claim: Claim, result: Any) -> EffectRecord:
        """Record success; durable before this returns (a caller never sees a result the
        ledger could lose).

        Raises:
            LeaseLost: The claim is stale: the outcome was refused, and the refusal is
                recorded in the entry's audit chain (a ``late_outcome`` event) and logged.
            LedgerUnavailable: Not recorded; this ledger now refuses further work.
        """
        return _record(self._commit_row(claim, result))

    def _commit_row(self, claim: Claim, result: Any) -> Row:
        try:
            encoded = self.codec.encode(result)
        except CodecError as exc:
            # The effect happened but its result cannot be recorded: in doubt, not lost.
            self.mark_unknown(claim, "result could not be encoded", error=exc)
            raise
        sealed = self._seal_outcome(claim.subject, claim.key_id, "result", encoded=encoded)
        row = self._finish(
            claim,
            "committed",
            {
                "status": EffectStatus.COMMITTED.value,
                "result_ct": sealed,
                "outcome_class": OutcomeClass.SUCCEEDED.value,
                "lease_owner": None,
                "lease_expires_at": None,
            },
            "",
        )
        self._terminal[row["key_id"]] = row
        return row

    def fail(
        self, claim: Claim, error_type: str, message: str, info: Mapping[str, Any] | None = None
    ) -> EffectRecord:
        """Record a definite failure (the provider refused; nothing happened). Replayed as
        :class:`EffectFailed` forever after, never retried.

        Raises:
            LeaseLost / LedgerUnavailable: As in :meth:`commit`.
        """
        payload = {"type": error_type, "message": message, "info": dict(info or {})}
        sealed = self._seal_outcome(claim.subject, claim.key_id, "error", payload)
        row = self._finish(
            claim,
            "failed",
            {
                "status": EffectStatus.FAILED.value,
                "error_ct": sealed,
                "outcome_class": OutcomeClass.REJECTED.value,
                "lease_owner": None,
                "lease_expires_at": None,
            },
            "",
        )
        self._terminal[row["key_id"]] = row
        return _record(row)

    def mark_unknown(
        self, claim: Claim, detail: str = "", *, error: BaseException | None = None
    ) -> EffectRecord:
        """Record that the attempt's outcome is ambiguous (sent, no answer): UNKNOWN.

        Args:
            claim: The live claim.
            detail: A short plaintext note for the audit trail (no personal data).
            error: The exception seen; its message is stored encrypted.

        Raises:
            LeaseLost / LedgerUnavailable: As in :meth:`commit`.
        """
        return self._settle(
            claim, "unknown", EffectStatus.UNKNOWN, OutcomeClass.AMBIGUOUS, detail, error
        )

    def release(
        self, claim: Claim, detail: str = "not sent", *, error: BaseException | None = None
    ) -> EffectRecord:
        """Record that the attempt provably never left (connect refused): NOT_HAPPENED, so
        a later claim may send it again with the next epoch.

        Args:
            claim: The live claim.
            detail: A short plaintext note for the audit trail (no personal data).
            error: The exception seen; its message is stored encrypted.

        Raises:
            LeaseLost / LedgerUnavailable: As in :meth:`commit`.
        """
        return self._settle(
            claim, "not_sent", EffectStatus.NOT_HAPPENED, OutcomeClass.NOT_SENT, detail, error
        )

    def _settle(
        self,
        claim: Claim,
        event: str,
        status: EffectStatus,
        outcome: OutcomeClass,
        detail: str,
        error: BaseException | None,
    ) -> EffectRecord:
        changes: Row = {
            "status": status.value,
            "outcome_class": outcome.value,
            "lease_owner": None,
            "lease_expires_at": None,
        }
        if error is not None:
            changes["error_ct"] = self._seal_error(claim, error)
        return _record(self._finish(claim, event, changes, detail))

    def _seal_error(self, claim: Claim, error: BaseException) -> bytes:
        info = {"type": type(error).__name__, "message": str(error)[:2000], "info": {}}
        return self._seal_outcome(claim.subject, claim.key_id, "error", info)

    def _seal_outcome(
        self,
        subject: str,
        key_id: str,
        field: str,
        value: Any = None,
        cur: Any = None,
        *,
        encoded: bytes | None = None,
    ) -> bytes:
        """Seal an outcome payload. An erased subject yields the empty marker: the outcome
        is still recorded (and deduplicates), its payload is gone. A data key that cannot
        be read stops this ledger, as any unrecordable outcome does."""
        try:
            if cur is not None:
                cipher = self._cipher_in_txn(cur, subject)[1]
            else:
                cipher = self._cipher(subject)
        except (PayloadErased, SubjectErased):
            return ERASED
        except StoreError as exc:
            self._poisoned = exc
            raise LedgerUnavailable(
                f"the ledger could not read the data key to record an outcome ({exc}); this "
                f"ledger now refuses further work"
            ) from exc
        plain = self.codec.encode(value) if encoded is None else encoded
        return Sealer.seal(cipher, plain, f"{key_id}|{field}".encode())

    def renew(self, claim: Claim) -> Claim:
        """Extend a live claim's lease (for long calls).

        Raises:
            LeaseLost: The claim is stale.
        """

        def txn(cur: Any) -> float:
            q = self._q
            until = self._clock() + self.lease_s
            cur.execute(
                f"UPDATE oo_effects SET lease_expires_at = {q} WHERE key_id = {q} AND epoch = {q} "
                f"AND status = {q} AND lease_owner = {q}",
                (until, claim.key_id, claim.epoch, EffectStatus.CLAIMED.value, claim.lease_owner),
            )
            if cur.rowcount != 1:
                raise self._lost(cur, claim)
            return until

        until = self._write(txn, outcome=False)
        return Claim(**{**claim.__dict__, "lease_expires_at": until})

    def _finish(self, claim: Claim, event: str, changes: Row, detail: str) -> Row:
        """Record an attempt's outcome: compare-and-set on the claim's epoch.

        The transaction is idempotent: run again after a commit whose result was lost
        (the connection dropped at COMMIT), it finds its own outcome and returns it. A
        stale claim's outcome is refused, and the refusal itself is recorded (a
        ``late_outcome`` event, committed) before :class:`LeaseLost` is raised.
        """

        def txn(cur: Any) -> tuple[Row, LeaseLost | None]:
            q = self._q
            lock = " FOR UPDATE" if self._pg else ""
            cur.execute(f"{_SELECT} WHERE key_id = {q}{lock}", (claim.key_id,))
            found = cur.fetchone()
            if found is None:
                raise UnknownEffect(claim.key_id)
            row = _row(found)
            self._check_row(cur, row)
            if int(row["epoch"]) == claim.epoch and row["status"] == EffectStatus.CLAIMED.value:
                moved = self._transition(
                    cur,
                    row,
                    event,
                    changes,
                    expect=EffectStatus.CLAIMED.value,
                    actor=claim.lease_owner,
                    detail=detail,
                    epoch=claim.epoch,
                )
                if moved is not None:
                    return moved, None
            if self._recorded_already(cur, row, claim, event, changes):
                return row, None
            now = self._clock()
            status, epoch = row["status"], int(row["epoch"])
            reported = f"{event} ({detail})" if detail else event
            self._append(
                cur,
                {**row, "updated_at": now},
                "late_outcome",
                claim.lease_owner,
                f"refused {reported} from stale epoch {claim.epoch}; the entry is {status} "
                f"at epoch {epoch}",
                epoch=claim.epoch,
            )
            return row, LeaseLost(claim.key_id, claim.epoch, epoch, status)

        failpoint(_RECORD_POINTS[event][0])
        try:
            row, lost = self._write(txn, outcome=True)
        finally:
            self._live.discard((claim.key_id, claim.epoch))
        if lost is not None:
            log.warning(
                "late outcome refused: %s of effect %s… by %s at stale epoch %d (the entry is "
                "%s at epoch %d); recorded in the audit chain of %s as late_outcome",
                event,
                claim.key_id[:16],
                claim.lease_owner,
                claim.epoch,
                lost.status,
                lost.current_epoch,
                claim.chain,
            )
            raise lost
        failpoint(_RECORD_POINTS[event][1])
        return row

    def _recorded_already(self, cur: Any, row: Row, claim: Claim, event: str, changes: Row) -> bool:
        """Whether the row holds exactly this outcome, recorded by this claim (its last
        event is ours at this epoch): an earlier run of the same outcome transaction
        committed. The sealed payloads carry random nonces, so equal ciphertexts can
        only be this transaction's own."""
        if int(row["epoch"]) != claim.epoch or any(row[c] != v for c, v in changes.items()):
            return False
        q = self._q
        cur.execute(
            f"SELECT event, actor, epoch FROM oo_audit WHERE chain = {q} AND key_id = {q} "
            f"ORDER BY seq DESC LIMIT 1",
            (row["chain"], row["key_id"]),
        )
        last = cur.fetchone()
        return last is not None and (str(last[0]), str(last[1]), int(last[2])) == (
            event,
            claim.lease_owner,
            claim.epoch,
        )

    def _lost(self, cur: Any, claim: Claim) -> LeaseLost:
        cur.execute(
            f"SELECT epoch, status FROM oo_effects WHERE key_id = {self._q}", (claim.key_id,)
        )
        found = cur.fetchone()
        if found is None:
            return LeaseLost(claim.key_id, claim.epoch, -1, "missing")
        return LeaseLost(claim.key_id, claim.epoch, int(found[0]), str(found[1]))

    # -- reconciliation ------------------------------------------------------------------
    def reconcile(
        self,
        key_id: str,
        evidence: Evidence | str,
        *,
        result: Any = None,
        actor: str = "probe",
        detail: str = "",
    ) -> EffectRecord | Claim:
        """Move an in-doubt effect on, by the adapter's evidence.

        * ``HAPPENED`` → COMMITTED with ``result``;
        * ``NOT_HAPPENED`` → NOT_HAPPENED (the next claim re-sends with epoch + 1);
        * ``WINDOW_OPEN`` (class A, window not yet closed) → CLAIMED again, epoch + 1:
          the returned :class:`Claim` re-sends with the same provider key;
        * ``INCONCLUSIVE`` (or a window that has closed) → NEEDS_HUMAN.

        Only UNKNOWN entries, or CLAIMED ones whose lease expired, are reconciled.

        Raises:
            InvalidTransition: The entry is not in doubt.
            UnknownEffect: No such entry.
        """
        ev = Evidence(evidence)
        fence = current_fence()  # a re-send claim acts: fenced like any claim

        def txn(cur: Any) -> tuple[Row, bool]:
            row = self._locked_row(cur, key_id)
            now = self._clock()
            status = row["status"]
            expired = status == EffectStatus.CLAIMED.value and (row["lease_expires_at"] or 0) <= now
            if status != EffectStatus.UNKNOWN.value and not expired:
                raise InvalidTransition(key_id, status, f"reconcile with {ev.value}")
            base = {"lease_owner": None, "lease_expires_at": None}
            if ev is Evidence.HAPPENED:
                sealed = self._seal_outcome(row["subject"], key_id, "result", result, cur)
                changes = {**base, "status": EffectStatus.COMMITTED.value, "result_ct": sealed}
                return self._must(
                    self._transition(
                        cur,
                        row,
                        "reconciled",
                        changes,
                        expect=status,
                        actor=actor,
                        detail=detail or "probe: happened",
                    ),
                    key_id,
                ), False
            if ev is Evidence.NOT_HAPPENED:
                changes = {**base, "status": EffectStatus.NOT_HAPPENED.value}
                return self._must(
                    self._transition(
                        cur,
                        row,
                        "reconciled",
                        changes,
                        expect=status,
                        actor=actor,
                        detail=detail or "probe: did not happen",
                    ),
                    key_id,
                ), False
            window_open = (
                ev is Evidence.WINDOW_OPEN
                and row["provider_class"] == ProviderClass.DEDUPLICATING.value
                and row["window_s"] is not None
                and (row["first_sent_at"] or 0) + float(row["window_s"]) > now
            )
            if window_open:
                resend = self._reclaim(cur, row, "resend", resend=True, fence=fence)
                return self._must(resend, key_id), True
            changes = {**base, "status": EffectStatus.NEEDS_HUMAN.value}
            if ev is not Evidence.WINDOW_OPEN:
                why = detail or "no evidence either way"
            elif row["provider_class"] != ProviderClass.DEDUPLICATING.value:
                why = detail or "window evidence, but the provider does not deduplicate"
            else:
                why = detail or "dedup window closed"
            return self._must(
                self._transition(
                    cur, row, "needs_human", changes, expect=status, actor=actor, detail=why
                ),
                key_id,
            ), False

        failpoint("ledger.reconcile.before")
        row, resend = self._write(txn, outcome=False)
        failpoint("ledger.reconcile.after")
        self._remember(row)
        if resend:
            self._witness_claim(row["chain"])
            return self._claim_of(row, resend=True)
        return _record(row)

    def resolve(
        self,
        key_id: str,
        *,
        happened: bool,
        evidence: str,
        actor: str,
        result: Any = UNKNOWN_RESULT,
    ) -> EffectRecord:
        """An operator's decision on an in-doubt effect, recorded with evidence and identity.

        Args:
            key_id: The entry.
            happened: Whether the provider shows the effect.
            evidence: What the operator checked (kept in the audit trail).
            actor: Who decided.
            result: What the provider answered (any codec-encodable value, ``None``
                included), replayed to the step. Left out (:data:`UNKNOWN_RESULT`), the
                entry is "happened, result unknown": a replay raises
                :class:`ResultUnknown` (the guard first asks the adapter's probe) until
                :meth:`correct` records the result. Ignored when it did not happen.

        Running the same resolution again (the same decision, evidence and actor) returns
        the entry and changes nothing: an operator action whose answer was lost can be
        retried.

        Raises:
            InvalidTransition: The entry is not UNKNOWN, NEEDS_HUMAN or an expired claim
                (and not already resolved by this very decision).
            ConfigurationError: No evidence or actor given.
        """
        if not evidence.strip() or not actor.strip():
            raise ConfigurationError("resolve needs the evidence and the operator's identity")

        def txn(cur: Any) -> Row:
            row = self._locked_row(cur, key_id)
            status = row["status"]
            expired = (
                status == EffectStatus.CLAIMED.value
                and (row["lease_expires_at"] or 0) <= self._clock()
            )
            if (
                status not in (EffectStatus.UNKNOWN.value, EffectStatus.NEEDS_HUMAN.value)
                and not expired
            ):
                if self._resolved_already(cur, row, happened, result, evidence, actor):
                    return row  # this very decision, run again (its answer was lost)
                raise InvalidTransition(key_id, status, "resolve")
            changes: Row = {"lease_owner": None, "lease_expires_at": None}
            changes.update(self._decided(cur, row, happened, result))
            return self._must(
                self._transition(
                    cur, row, "resolved", changes, expect=status, actor=actor, detail=evidence
                ),
                key_id,
            )

        row = self._write(txn, outcome=False)
        self._remember(row)
        return _record(row)

    def _resolved_already(
        self, cur: Any, row: Row, happened: bool, result: Any, evidence: str, actor: str
    ) -> bool:
        """Whether the entry's last event is this very resolution (same decision, evidence
        and actor): an operator action whose answer was lost (the process died after the
        commit, before waking the run) may then be run again."""
        want = EffectStatus.COMMITTED.value if happened else EffectStatus.NOT_HAPPENED.value
        if row["status"] != want:
            return False
        if happened and (row["result_ct"] is None) != (result is UNKNOWN_RESULT):
            return False
        cur.execute(
            f"SELECT event, actor, detail FROM oo_audit WHERE chain = {self._q} "
            f"AND key_id = {self._q} ORDER BY seq DESC LIMIT 1",
            (row["chain"], row["key_id"]),
        )
        last = cur.fetchone()
        return last is not None and tuple(map(str, last)) == ("resolved", actor, evidence)

    def correct(
        self,
        key_id: str,
        *,
        happened: bool = True,
        result: Any = UNKNOWN_RESULT,
        evidence: str,
        actor: str,
    ) -> EffectRecord:
        """Correct an operator's resolution: record the result it left out, or a better
        one, or that the effect did (not) happen after all. Recorded as a ``corrected``
        audit event with the evidence and the actor.

        Only outcomes that came from :meth:`resolve` (or an earlier correction) can be
        corrected: an outcome the provider answered or a probe found is evidence, not a
        decision. Once the entry was sent again after a "did not happen", the new
        attempt's outcome stands. Correcting to "did not happen" lets the next claim send
        the effect again; a run that replayed the old result keeps what it did with it.

        Args:
            key_id: The entry.
            happened: Whether the effect happened.
            result: What the provider answered (see :meth:`resolve`); left out, the result
                is unknown. Only with ``happened``.
            evidence: What was checked (kept in the audit trail).
            actor: Who corrects.

        Returns:
            The corrected entry.

        Raises:
            InvalidTransition: The entry's outcome did not come from an operator.
            ConfigurationError: No evidence or actor given, or a result for an effect that
                did not happen.
            UnknownEffect: No such entry.
        """
        if not evidence.strip() or not actor.strip():
            raise ConfigurationError("correct needs the evidence and the operator's identity")
        if not happened and result is not UNKNOWN_RESULT:
            raise ConfigurationError("an effect that did not happen has no result to record")

        def txn(cur: Any) -> Row:
            row = self._locked_row(cur, key_id)
            status = row["status"]
            cur.execute(
                f"SELECT event FROM oo_audit WHERE chain = {self._q} AND key_id = {self._q} "
                f"ORDER BY seq DESC LIMIT 1",
                (row["chain"], key_id),
            )
            last = cur.fetchone()
            decided = last is not None and str(last[0]) in ("resolved", "corrected")
            if not decided or status not in (
                EffectStatus.COMMITTED.value,
                EffectStatus.NOT_HAPPENED.value,
            ):
                raise InvalidTransition(
                    key_id,
                    status if last is None else f"{status} (by {last[0]})",
                    "correct an outcome that no operator decided (only `effects resolve` "
                    "outcomes are corrected)",
                )
            return self._must(
                self._transition(
                    cur,
                    row,
                    "corrected",
                    self._decided(cur, row, happened, result),
                    expect=status,
                    actor=actor,
                    detail=evidence,
                ),
                key_id,
            )

        row = self._write(txn, outcome=False)
        self._remember(row)
        return _record(row)

    def _decided(self, cur: Any, row: Row, happened: bool, result: Any) -> Row:
        """The changes of an operator's decision (resolve, correct)."""
        if not happened:
            return {"status": EffectStatus.NOT_HAPPENED.value, "result_ct": None}
        sealed = (
            None
            if result is UNKNOWN_RESULT
            else self._seal_outcome(row["subject"], row["key_id"], "result", result, cur)
        )
        return {"status": EffectStatus.COMMITTED.value, "result_ct": sealed}

    def _must(self, row: Row | None, key_id: str) -> Row:
        if row is None:
            raise InvalidTransition(key_id, "changed concurrently", "apply the transition")
        return row

    def _locked_row(self, cur: Any, key_id: str) -> Row:
        lock = " FOR UPDATE" if self._pg else ""
        cur.execute(f"{_SELECT} WHERE key_id = {self._q}{lock}", (key_id,))
        found = cur.fetchone()
        if found is None:
            raise UnknownEffect(key_id)
        row = _row(found)
        self._check_row(cur, row)
        return row

    # -- integrity of rows on read (I4) ----------------------------------------------------
    def _check_row(self, cur: Any, row: Row) -> None:
        """Refuse a row that fails its seal, or differs from the state its last audit
        event recorded, or whose last event fails its MAC.

        Raises:
            CorruptRecord: The row was edited (its unkeyed digest recomputed or not),
                forged, rolled back alone, or moved to another run's chain.
        """
        q = self._q
        if self._keys is not None and not self._keys.valid(
            "effects", effect_parts(row), row.get("seal")
        ):
            raise CorruptRecord(
                f"effect {row['key_id']} fails its keyed seal (edited, forged or written "
                f"without the keyring); it is not acted on. Run `onceonly audit verify`",
                run_id=row["run_id"],
                hint=LEDGER_HINT,
            )
        cur.execute(
            f"SELECT {EVENT_COLS}, mac FROM oo_audit WHERE chain = {q} AND key_id = {q} "
            f"ORDER BY seq DESC LIMIT 1",
            (row["chain"], row["key_id"]),
        )
        found = cur.fetchone()
        if (
            found is None
            or bytes(found[8]) != row_digest(row)
            or not check_event(self._keys, found, found[12])
        ):
            raise CorruptRecord(
                f"effect {row['key_id']} differs from its audit trail (edited, forged or "
                f"moved); it is not acted on. Run `onceonly audit verify` and resolve it by hand",
                run_id=row["run_id"],
                hint=LEDGER_HINT,
            )

    def _seal(self, table: str, parts: list[object]) -> bytes:
        if self._keys is None:  # pragma: no cover  (read-only ledgers refuse writes first)
            raise ConfigurationError("a read-only ledger seals nothing")
        return self._keys.seal(table, parts)

    def _check_chain(self, cur: Any, chain: str) -> None:
        """Before a claim acts: the chain is whole up to its sealed head (what was
        appended since this process last checked it), and not behind the witness.

        Raises:
            CorruptRecord: Events are missing, the head is missing or was replaced.
            StoreRolledBack: The chain is behind its witness.
        """
        seen, counted = self._verified.get(chain, (0, 0.0))
        now = time.monotonic()
        if now - counted > _RECOUNT_S:
            seen, counted = 0, now  # count the whole chain again now and then
        head = whole_since(cur, self._q, self._keys, chain, seen)
        self._verified[chain] = (head, counted)
        if self.witness is not None:
            seen = self.witness.heads.get(chain, 0)
            if head < seen:
                raise StoreRolledBack(chain, head, seen, self.witness.path)

    def _witness_claim(self, chain: str) -> None:
        """Advance the witness to the chain's head, durably, before the claim acts."""
        if self.witness is not None:
            head = self._heads.get(chain)
            if head is not None:
                self.witness.advance(chain, head[0])

    def _check_absent(self, cur: Any, chain: str, ids: list[str]) -> None:
        """Refuse to claim a key whose row is gone while its audit events remain (a
        deleted row would otherwise let the effect happen again); a row removed by
        retention ends with a ``retired`` event.

        Raises:
            CorruptRecord: The entry's row was deleted.
        """
        q = self._q
        marks = ", ".join([q] * len(ids))
        cur.execute(
            f"SELECT key_id, event FROM oo_audit WHERE chain = {q} AND key_id IN ({marks}) "
            f"ORDER BY seq DESC LIMIT 1",
            (chain, *ids),
        )
        found = cur.fetchone()
        if found is not None and found[1] != "retired":
            # Under READ COMMITTED (PostgreSQL) a concurrent claimer may have committed its
            # row and first event between our read of the row and this read of the events:
            # its row is visible now (they commit together), and the insert below then
            # loses the race as usual. Only a row that is still missing was deleted.
            cur.execute(f"SELECT 1 FROM oo_effects WHERE key_id IN ({marks})", tuple(ids))
            if cur.fetchone() is not None:
                return
            raise CorruptRecord(
                f"effect {found[0]} has audit events but no row (deleted); it is not acted "
                f"on. Run `onceonly audit verify` and resolve it by hand",
                run_id=None if chain.startswith("tenant:") else chain,
                hint=LEDGER_HINT,
            )

    def _audited_rows(self, cur: Any, rows: list[Row]) -> list[Row]:
        """The rows that match their chains' last audited states, in chains that verify
        whole (one scan per chain: every event's MAC and link, the sealed head); the
        others are left out, to be refused one by one when a claim reads them."""
        last: dict[tuple[str, str], bytes] = {}
        q = self._q
        for chain in sorted({r["chain"] for r in rows}):
            cur.execute(
                f"SELECT {EVENT_COLS}, mac FROM oo_audit WHERE chain = {q} ORDER BY seq",
                (chain,),
            )
            events = cur.fetchall()
            try:
                head = head_of(cur, q, self._keys, chain)
            except CorruptRecord:
                continue
            if verify_chain(self._keys, chain, events, head):
                continue  # not trusted: every claim in it goes through the checks
            self._verified[chain] = (0 if head is None else head[0], time.monotonic())
            for ev in events:
                last[(chain, str(ev[2]))] = bytes(ev[8])
        return [
            r
            for r in rows
            if last.get((r["chain"], r["key_id"])) == row_digest(r)
            and (self._keys is None or self._keys.valid("effects", effect_parts(r), r.get("seal")))
        ]

    # -- transitions and the audit chain --------------------------------------------------
    def _transition(
        self,
        cur: Any,
        row: Row,
        event: str,
        changes: Row,
        *,
        expect: str,
        actor: str,
        detail: str,
        epoch: int | None = None,
    ) -> Row | None:
        """Compare-and-set on (key, epoch, status); append the audit event. None if lost."""
        q = self._q
        now = self._clock()
        new = {**row, **changes, "updated_at": now}
        changes = {**changes, "seal": self._seal("effects", effect_parts(new))}
        new["seal"] = changes["seal"]
        sets = ", ".join(f"{c} = {q}" for c in [*changes, "updated_at"])
        cur.execute(
            f"UPDATE oo_effects SET {sets} WHERE key_id = {q} AND epoch = {q} AND status = {q}",
            [
                *changes.values(),
                now,
                row["key_id"],
                row["epoch"] if epoch is None else epoch,
                expect,
            ],
        )
        if cur.rowcount != 1:
            return None
        self._append(cur, new, event, actor, detail)
        return new

    def _append(
        self,
        cur: Any,
        row: Row,
        event: str,
        actor: str,
        detail: str,
        *,
        epoch: int | None = None,
    ) -> None:
        """Append a sealed event to the row's chain, linked to the chain's sealed head,
        and advance the head.

        The event records the row's state (status, digest); ``epoch`` overrides the
        event's epoch (a refused late outcome names the stale epoch it came from).

        The insert only succeeds if the event it links to is still the last one (and its
        sequence number is free), so a stale cached head, a rolled-back transaction or a
        concurrent appender on another worker can never fork or gap the chain; on a miss
        the head is re-read and the append retried. The head is read from
        ``oo_chain_heads`` (sealed), never from the last event alone: an append never
        papers over deleted events.
        """
        q = self._q
        chain = row["chain"]
        digest = row_digest(row)
        at = float(row["updated_at"])
        event_epoch = int(row["epoch"]) if epoch is None else epoch
        head = self._heads.get(chain)
        select = ", ".join([q] * 13)
        missed: tuple[int, bytes] | None = None  # a head read from the store that missed
        for _ in range(64):
            fresh = head is None
            if head is None:
                head = head_of(cur, q, self._keys, chain)
                if head is None:
                    head = (0, GENESIS)
                if head == missed:
                    # Read again, the head has not moved, yet the event it names is not
                    # the chain's last: not a concurrent appender, a deleted event.
                    raise CorruptRecord(
                        f"audit chain {chain!r}: its sealed head (event {head[0]}) is not "
                        f"its last event (events deleted or added behind the ledger's "
                        f"back); nothing is acted on. Run `onceonly audit verify`",
                        run_id=None if chain.startswith("tenant:") else chain,
                        hint=LEDGER_HINT,
                    )
            seq = head[0] + 1
            h = event_hash(
                head[1],
                chain,
                seq,
                row["key_id"],
                event,
                event_epoch,
                row["status"],
                actor,
                detail,
                digest,
                at,
            )
            values = (
                chain,
                seq,
                row["key_id"],
                event,
                event_epoch,
                row["status"],
                actor,
                detail,
                digest,
                at,
                head[1],
                h,
            )
            mac = self._seal("audit", event_parts(values))
            if head[0] == 0:
                guard = f"NOT EXISTS (SELECT 1 FROM oo_audit WHERE chain = {q})"
                guard_args: tuple[Any, ...] = (chain,)
            else:
                guard = (
                    f"EXISTS (SELECT 1 FROM oo_audit WHERE chain = {q} AND seq = {q} "
                    f"AND hash = {q})"
                )
                guard_args = (chain, head[0], head[1])
            cur.execute(
                f"INSERT INTO oo_audit ({EVENT_COLS}, mac) SELECT {select} WHERE {guard} "
                f"ON CONFLICT DO NOTHING",
                (*values, mac, *guard_args),
            )
            if cur.rowcount == 1:
                self._advance_head(cur, chain, head, seq, h)
                self._heads[chain] = (seq, h)
                known = self._verified.get(chain)
                if known is not None and known[0] == head[0]:
                    self._verified[chain] = (seq, known[1])
                return
            # A stale cached head or a concurrent appender: re-read and retry.
            missed = head if fresh else None
            head = None
        raise StoreError(f"could not append to audit chain {chain!r}: its head kept moving")

    def _advance_head(
        self, cur: Any, chain: str, old: tuple[int, bytes], seq: int, h: bytes
    ) -> None:
        """Move the chain's sealed head from ``old`` to ``(seq, h)`` (compare-and-set).

        Raises:
            CorruptRecord: The head is not where the chain's last event is (events or
                the head were deleted behind the ledger's back).
        """
        q = self._q
        seal = self._seal("heads", head_parts(chain, seq, h))
        if old[0] == 0:
            cur.execute(
                f"INSERT INTO oo_chain_heads (chain, seq, hash, seal) VALUES ({q}, {q}, {q}, "
                f"{q}) ON CONFLICT DO NOTHING",
                (chain, seq, h, seal),
            )
        else:
            cur.execute(
                f"UPDATE oo_chain_heads SET seq = {q}, hash = {q}, seal = {q} "
                f"WHERE chain = {q} AND seq = {q} AND hash = {q}",
                (seq, h, seal, chain, old[0], old[1]),
            )
        if cur.rowcount != 1:
            raise CorruptRecord(
                f"audit chain {chain!r}: its sealed head is not its last event (events or "
                f"the head deleted); nothing is acted on. Run `onceonly audit verify`",
                run_id=None if chain.startswith("tenant:") else chain,
                hint=LEDGER_HINT,
            )

    # -- data keys ----------------------------------------------------------------------
    def _cipher(self, subject: str) -> ChaCha20Poly1305:
        cipher = self._sealer.cached(subject)
        if cipher is not None:
            return cipher
        got = self.store.read(lambda cur: self._load_key(cur, subject))
        if got is None:
            raise PayloadErased("-", subject)
        self._sealer.remember(subject, got)
        return got

    def _load_key(self, cur: Any, subject: str) -> ChaCha20Poly1305 | None:
        cur.execute(
            f"SELECT secret_id, wrapped FROM oo_data_keys WHERE subject = {self._q}", (subject,)
        )
        found = cur.fetchone()
        if found is None or found[1] is None:
            return None
        return self._sealer.unwrap(subject, str(found[0]), bytes(found[1]))

    def _cipher_in_txn(self, cur: Any, subject: str) -> tuple[str, ChaCha20Poly1305]:
        cached = self._sealer.cached(subject)
        if cached is not None:
            return subject, cached
        q = self._q
        cur.execute(f"SELECT secret_id, wrapped FROM oo_data_keys WHERE subject = {q}", (subject,))
        found = cur.fetchone()
        if found is not None:
            if found[1] is None:
                raise SubjectErased(subject)
            return subject, self._sealer.unwrap(subject, str(found[0]), bytes(found[1]))
        sid, wrapped, cipher = self._sealer.new_wrapped_key(subject)
        cur.execute(
            f"INSERT INTO oo_data_keys (subject, secret_id, wrapped, created_at, erased_at) "
            f"VALUES ({q}, {q}, {q}, {q}, NULL) ON CONFLICT DO NOTHING",
            (subject, sid, wrapped, self._clock()),
        )
        if cur.rowcount != 1:
            cur.execute(
                f"SELECT secret_id, wrapped FROM oo_data_keys WHERE subject = {q}", (subject,)
            )
            again = cur.fetchone()
            if again is None or again[1] is None:
                raise SubjectErased(subject)
            return subject, self._sealer.unwrap(subject, str(again[0]), bytes(again[1]))
        return subject, cipher

    def erase(self, subject: str) -> int:
        """Destroy a data subject's key: its effects' arguments, results and errors become
        unreadable, while key ids, fingerprints and outcomes stay (dedup keeps working).

        Returns:
            How many ledger entries were affected.
        """

        def txn(cur: Any) -> int:
            q = self._q
            cur.execute(
                f"UPDATE oo_data_keys SET wrapped = NULL, erased_at = {q} WHERE subject = {q}",
                (self._clock(), subject),
            )
            cur.execute(f"SELECT COUNT(*) FROM oo_effects WHERE subject = {q}", (subject,))
            return int(cur.fetchone()[0])

        n = self._write(txn, outcome=False)
        self._sealer.forget(subject)
        return n

    # -- replay and reads --------------------------------------------------------------
    def prefetch(self, run_id: str) -> int:
        """Load a run's finished effects into memory in one range scan, so replaying them
        is a lookup plus a fingerprint check. Returns how many were loaded."""

        def scan(cur: Any) -> list[Row]:
            q = self._q
            cur.execute(
                f"{_SELECT} WHERE run_id = {q} AND status IN ({q}, {q})", (run_id, *_TERMINAL)
            )
            return self._audited_rows(cur, [_row(r) for r in cur.fetchall()])

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

    def _open(self, row: Row, field: str) -> Any:
        sealed = row[f"{field}_ct"]
        if sealed is None:
            return None
        if sealed == ERASED:
            raise PayloadErased(row["key_id"], row["subject"])
        cipher = self._cipher(row["subject"])
        try:
            plain = Sealer.open(cipher, sealed, f"{row['key_id']}|{field}".encode())
        except CorruptRecord as exc:
            raise CorruptRecord(
                f"effect {row['key_id']} {field}: {exc.detail}",
                run_id=row["run_id"],
                hint=LEDGER_HINT,
            ) from exc
        return self.codec.decode(plain)
