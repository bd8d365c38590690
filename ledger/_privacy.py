"""Data keys and sealed payloads: each data subject's key, sealing outcomes and errors,
opening them for replay, and erasing a subject (its payloads become unreadable while
key ids, fingerprints and outcomes stay)."""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from onceonly.checkpoint.errors import CorruptRecord, StoreError

from ._rows import Row
from ._state import LedgerState
from .crypto import Sealer
from .errors import LEDGER_HINT, LedgerUnavailable, PayloadErased, SubjectErased
from .records import Claim

__all__ = ["ERASED", "PrivacyMixin"]

ERASED = b""  # an outcome recorded after its subject was erased: no payload


class PrivacyMixin(LedgerState):
    """Data keys (wrapped by the keyring), sealing and opening payloads, erasure."""

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
        """The subject's data key; ``None`` if it was erased.

        Raises:
            CorruptRecord: The subject has no row: it is read only for effects that hold
                payloads, which were sealed with its key, and erasure keeps the row.
        """
        cur.execute(
            f"SELECT secret_id, wrapped FROM oo_data_keys WHERE subject = {self._q}", (subject,)
        )
        found = cur.fetchone()
        if found is None:
            raise CorruptRecord(
                f"data key of subject {subject!r} is missing (deleted or renamed: erasing a "
                f"subject keeps its row); its payloads cannot be read",
                hint=LEDGER_HINT,
            )
        if found[1] is None:
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
