"""The effects ledger: the record that lets every external action happen once.

Every transition is one write transaction through the checkpoint store's write barrier
(:meth:`checkpoint.Store.transact`): pending checkpoints and the transition commit
together, and in ``async`` durability concurrent claims share one group commit. Every
transition is a compare-and-set on ``(key_id, epoch, status)``; a stale worker's outcome
changes nothing but is itself recorded (a ``late_outcome`` audit event, and a warning on
the ``onceonly.ledger`` logger) before :class:`~ledger.errors.LeaseLost` is raised. Every
transition appends a hash-chained audit event in the same transaction.

:class:`Ledger` is the facade: opening, the one claim/act/record path (:meth:`perform`,
:meth:`aperform`), replay, and recovery live here; the rooms it is assembled from are
named in ``_state``.
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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from onceonly.checkpoint import Codec, RowKeys, Store, ensure_schema
from onceonly.checkpoint.errors import ConfigurationError, StoreError
from onceonly.checkpoint.failpoints import failpoint

from . import _schema
from ._integrity import EVENT_COLS, StoreRolledBack, effect_parts, event_parts, head_parts
from ._queries import QueryMixin
from ._reconcile import ReconcileMixin
from ._rows import SELECT, TERMINAL, Row, effect_row
from .crypto import Sealer
from .errors import InvalidTransition, LedgerUnavailable
from .keys import EffectIdentity, Keyring
from .records import Claim, InFlightPolicy, OutcomeClass, ProviderClass, Replay

__all__ = ["Ledger"]

log = logging.getLogger("onceonly.ledger")

T = TypeVar("T")


class Ledger(ReconcileMixin, QueryMixin):
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
        self._key_memo = {}
        self._prefetched: set[str] = set()
        self._poisoned: BaseException | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._live: set[tuple[str, int]] = set()  # claims this object handed out, open
        self._mine: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
        self._head_seals: dict[str, tuple[int, bytes, bytes]] = {}
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
        self._recount_cost: dict[str, float] = {}
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
            cur.execute(f"{SELECT} WHERE seal IS NULL")
            for found in cur.fetchall():
                row = effect_row(found)
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
        self._mine.clear()
        self._head_seals.clear()
        self._verified.clear()
        self._poisoned = None

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
        row, last = self._row_and_last(key_id)  # one moment: a transition meanwhile is no tamper
        self._check_row(None, row, last)
        if row["status"] not in TERMINAL:
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
