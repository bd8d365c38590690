"""Claiming: recording the intent to act, durably, before acting.

One transaction per attempt decides, under lock, between a new claim, a replay, a key
reused with other arguments, another worker's live claim (waited on, bounded) and an
entry in doubt. A claim is fenced (:mod:`~onceonly.ledger.fence`), checked against its
chain and witness, and advances the witness before it is handed out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from onceonly.checkpoint.errors import ConfigurationError, StoreError
from onceonly.checkpoint.failpoints import failpoint

from ._integrity import effect_parts, folded_claim_sql, row_and_last_sql, split_row
from ._replay import ReplayMixin
from ._rows import TERMINAL, Row
from ._schema import COLUMNS
from ._transitions import TransitionMixin
from .crypto import Sealer
from .errors import EffectInDoubt, EffectInFlight, KeyReuseError, LedgerUnavailable
from .fence import RunFence, check_fence, current_fence
from .keys import EffectIdentity, canonical_args
from .records import Claim, EffectStatus, ProviderClass, Replay

__all__ = ["ClaimMixin"]

#: Identities whose key ids are kept (a guarded call derives its key once, not per use).
_KEY_MEMO_SIZE = 1024


@dataclass(frozen=True)
class _Outcome:
    """What a claim transaction decided (raised or returned after it commits)."""

    kind: str  # claim | replay | reuse | inflight | doubt
    row: Row
    claim: Claim | None = None
    cipher: tuple[str, ChaCha20Poly1305] | None = None


class ClaimMixin(TransitionMixin, ReplayMixin):
    """Key ids and claims: the first half of the one claim/act/record path."""

    # -- identity -----------------------------------------------------------------------
    def key_ids(self, identity: EffectIdentity) -> list[tuple[str, str]]:
        """``(secret id, key id)`` candidates for an identity, current secret first."""
        parts = identity.parts()
        # the types join the memo's key: 1 and True are equal keys, but only an int is a
        # valid part (True is refused by the derivation, every time)
        memo_key = (parts, tuple(map(type, parts)))
        keyring = self.keyring
        memo = self._key_memo
        hit = memo.get(memo_key)
        if hit is not None and hit[0] is keyring:
            return list(hit[1])
        kids = [(sid, keyring.key_id(sid, parts)) for sid in keyring.ids]
        if len(memo) >= _KEY_MEMO_SIZE:  # the calls of one moment, not a run's history
            memo.clear()
        memo[memo_key] = (keyring, kids)
        return list(kids)

    def key_id(self, identity: EffectIdentity) -> str:
        """The key id this identity has under the current secret."""
        return self.key_ids(identity)[0][1]

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
        pclass = (
            provider_class
            if type(provider_class) is ProviderClass
            else ProviderClass(provider_class)
        )
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
        if self._pg and len(ids) > 1:
            # During a rotation, workers whose current secrets differ would each find no
            # row and insert their own key id: serialise on every candidate (in one order,
            # so two claimers never deadlock). SQLite writers are serialised already.
            for kid in sorted(ids):
                cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (kid,))
        if self._folds and not self._pg:
            folded = self._fold_claim(
                cur, identity, candidates, fps, canonical, pclass, window_s, subject, chain, fence
            )
            if folded is not None:
                return folded
        cur.execute(row_and_last_sql(f"r.key_id IN ({marks})", lock=self._pg), ids)
        found = cur.fetchall()
        if not found:
            self._check_fresh(cur, chain, ids)
            check_fence(cur, self.store, fence)
            row, parts, new_cipher = self._fresh_row(
                cur, identity, candidates[0], fps, canonical, pclass, window_s, subject, chain
            )
            cols, values = ", ".join(COLUMNS), ", ".join([q] * len(COLUMNS))
            sql = f"INSERT INTO oo_effects ({cols}) VALUES ({values}) ON CONFLICT DO NOTHING"
            insert = (sql, [row[c] for c in COLUMNS])
            appended = self._write_appending(
                cur, insert, row, "claimed", self.owner, "", digest=parts[2]
            )
            if appended is not None:
                self._remember_mine(row, appended)
                return _Outcome("claim", row, self._claim_of(row), new_cipher)
            # Lost an insert race (PostgreSQL): read the winner's row under lock.
            cur.execute(row_and_last_sql(f"r.key_id = {q}", lock=self._pg), (candidates[0][1],))
            found = cur.fetchall()
        row, last = split_row(found[0])
        self._check_row(cur, row, last)
        if row["status"] not in TERMINAL:
            self._check_chain(cur, row["chain"])  # a store behind its witness acts on nothing
        if row["fingerprint"] != fps.get(row["secret_id"]):
            return _Outcome("reuse", row)
        status = row["status"]
        if status in TERMINAL:
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
            moved = self._reclaim(cur, row, "reclaimed", resend=False, fence=fence, by=identity)
            if moved is None:
                return _Outcome("inflight", row)
            return _Outcome("claim", moved, self._claim_of(moved))
        return _Outcome("doubt", row)

    def _fresh_row(
        self,
        cur: Any,
        identity: EffectIdentity,
        candidate: tuple[str, str],
        fps: Mapping[str, str],
        canonical: bytes,
        pclass: ProviderClass,
        window_s: float | None,
        subject: str,
        chain: str,
    ) -> tuple[Row, list[object], tuple[str, ChaCha20Poly1305]]:
        """A new claim's row, sealed (with its seal's parts and the subject's cipher)."""
        now = self._clock()
        sid, kid = candidate
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
        parts = effect_parts(row)
        row["seal"] = self._seal("effects", parts)
        return row, parts, new_cipher

    def _fold_claim(
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
    ) -> _Outcome | None:
        """A fresh claim in one insert (SQLite), when this process sealed the chain's head
        last and counted the chain whole up to it: the checks the full path reads first
        (no row, no event of the key, the head as sealed: :func:`folded_claim_sql`) are
        the insert's condition. None (nothing written): the full path decides, reading
        and verifying everything, with the same verdict as if this had not been tried."""
        sealed = self._head_seals.get(chain)
        if sealed is None or self._heads.get(chain) != sealed[:2]:
            return None
        if self._chain_mark(chain)[0] != sealed[0]:
            return None  # not counted whole up to this head, or a full recount is due
        if self.witness is not None and sealed[0] < self.witness.heads.get(chain, 0):
            return None  # behind the witness: the full path says so
        if self._sealer.cached(subject) is None:
            return None  # the data key is read (or refused: erased) after the row is
        row, parts, new_cipher = self._fresh_row(
            cur, identity, candidates[0], fps, canonical, pclass, window_s, subject, chain
        )
        ids = [kid for _, kid in candidates]
        cur.execute(
            folded_claim_sql(self._q, len(ids)),
            [*(row[c] for c in COLUMNS), *ids, chain, *ids, chain, *sealed],
        )
        if cur.rowcount != 1:
            return None
        # after the chain's checks, as on the full path (a fenced claim raises, and the
        # transaction's savepoint takes the insert back)
        check_fence(cur, self.store, fence)
        appended = self._append(cur, row, "claimed", self.owner, "", digest=parts[2])
        self._remember_mine(row, appended)
        return _Outcome("claim", row, self._claim_of(row), new_cipher)

    def _reclaim(
        self,
        cur: Any,
        row: Row,
        event: str,
        *,
        resend: bool,
        fence: RunFence | None,
        by: EffectIdentity | None = None,
    ) -> Row | None:
        """Claim a settled entry again. ``by``: the claimer's identity; an explicit-key
        entry that another run of the tenant claims again belongs to that run from now
        on (its position, and retention: the entry stays while the run that acted on it
        last, or a run sharing its keys, lives; its audit chain stays where it began)."""
        check_fence(cur, self.store, fence)
        now = self._clock()
        changes: dict[str, Any] = {
            "status": EffectStatus.CLAIMED.value,
            "epoch": int(row["epoch"]) + 1,
            "attempts": int(row["attempts"]) + 1,
            "lease_owner": self.owner,
            "lease_expires_at": now + self.lease_s,
            "outcome_class": None,
        }
        if by is not None and by.run_id is not None and by.run_id != row["run_id"]:
            changes["run_id"] = by.run_id
            changes["step_id"] = by.step_id
        return self._transition(
            cur,
            row,
            event,
            changes,
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
