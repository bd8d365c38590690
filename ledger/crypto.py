"""Encryption at rest of effect payloads (arguments, results, errors).

Each data subject (by default the run) has its own random 256-bit data key, stored only
wrapped (ChaCha20-Poly1305) under a key-encryption key derived from the ledger secret.
Payloads are sealed with ChaCha20-Poly1305 under the subject's data key, with the entry's
key id and the field name as associated data, so a ciphertext cannot be moved to another
entry or field. ``erase(subject)`` destroys the wrapped data key: the entry keeps its key
id, fingerprint and outcome (deduplication still works), the payloads become unreadable.
"""

from __future__ import annotations

import os
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from onceonly.checkpoint.errors import CorruptRecord

from .keys import Keyring

_VERSION = b"\x01"
_NONCE = 12


class Sealer:
    """Seals and opens payloads with per-subject data keys (held unwrapped in memory)."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._keys: dict[str, ChaCha20Poly1305] = {}
        self._lock = threading.Lock()

    # -- data keys -------------------------------------------------------------------
    def new_wrapped_key(self, subject: str) -> tuple[str, bytes, ChaCha20Poly1305]:
        """A fresh data key for ``subject``: (wrapping secret id, wrapped bytes, cipher)."""
        dk = ChaCha20Poly1305.generate_key()
        sid = self._keyring.current_id
        kek = ChaCha20Poly1305(self._keyring.subkey(sid, "kek"))
        nonce = os.urandom(_NONCE)
        wrapped = _VERSION + nonce + kek.encrypt(nonce, dk, subject.encode("utf-8"))
        return sid, wrapped, ChaCha20Poly1305(dk)

    def unwrap(self, subject: str, secret_id: str, wrapped: bytes) -> ChaCha20Poly1305:
        """The cipher for a stored wrapped data key.

        Raises:
            CorruptRecord: The wrapped key does not open (tampered, or wrong secret).
        """
        kek = ChaCha20Poly1305(self._keyring.subkey(secret_id, "kek"))
        if wrapped[:1] != _VERSION or len(wrapped) < 1 + _NONCE + 16:
            raise CorruptRecord(f"data key of subject {subject!r} has an unknown format")
        try:
            dk = kek.decrypt(wrapped[1 : 1 + _NONCE], wrapped[1 + _NONCE :], subject.encode())
        except InvalidTag as exc:
            raise CorruptRecord(f"data key of subject {subject!r} does not open") from exc
        return ChaCha20Poly1305(dk)

    def cached(self, subject: str) -> ChaCha20Poly1305 | None:
        return self._keys.get(subject)

    def remember(self, subject: str, cipher: ChaCha20Poly1305) -> None:
        with self._lock:
            self._keys[subject] = cipher

    def forget(self, subject: str) -> None:
        with self._lock:
            self._keys.pop(subject, None)

    # -- payloads --------------------------------------------------------------------
    @staticmethod
    def seal(cipher: ChaCha20Poly1305, plaintext: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return _VERSION + nonce + cipher.encrypt(nonce, plaintext, aad)

    @staticmethod
    def open(cipher: ChaCha20Poly1305, sealed: bytes, aad: bytes) -> bytes:
        """Open a sealed payload.

        Raises:
            CorruptRecord: The ciphertext was altered or moved to another entry/field.
        """
        if sealed[:1] != _VERSION:
            raise CorruptRecord("sealed payload has an unknown format")
        if len(sealed) < 1 + _NONCE + 16:
            raise CorruptRecord("sealed payload is truncated")
        try:
            return cipher.decrypt(sealed[1 : 1 + _NONCE], sealed[1 + _NONCE :], aad)
        except InvalidTag as exc:
            raise CorruptRecord("sealed payload fails authentication (altered or moved)") from exc
