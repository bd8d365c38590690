"""Effect identity: keyed idempotency keys, provider keys and argument fingerprints.

A key is ``blake3_keyed(subkey(secret), length-prefixed identity)``. The identity is
*where the call sits in the run* (tenant, run, step, step visit, effect@version, ordinal),
or an explicit key, or a :class:`KeyRecipe` over chosen argument fields — never a bare
hash of the arguments, and never an LLM ``tool_call_id`` alone.

Separate subkeys of the same secret derive, with domain separation:

* the **ledger key** (the entry's id),
* the **provider key** sent downstream (Idempotency-Key header, Message-ID, client
  reference) — derived from the ledger key, so it reveals nothing about the arguments,
* the **fingerprint** of the canonical arguments (same key, other fingerprint →
  :class:`~ledger.errors.KeyReuseError`),
* the key-encryption key that wraps per-subject data keys.

Each secret has an id stored on every entry; a :class:`Keyring` keeps old secrets so a
rotation never changes an existing effect's key.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from onceonly.checkpoint import Codec, RowKeys
from onceonly.checkpoint.errors import ConfigurationError

__all__ = [
    "EffectIdentity",
    "KeyRecipe",
    "Keyring",
    "Secret",
]

_CONTEXTS = {
    "key": "onceonly 2026-11 effect key",
    "provider": "onceonly 2026-11 provider key",
    "fingerprint": "onceonly 2026-11 argument fingerprint",
    "kek": "onceonly 2026-11 data key wrapping",
    "rows": "onceonly 2026-12 row seals",
}


def _encode_parts(parts: Sequence[object]) -> bytes:
    """Length-prefixed, type-tagged encoding: no two part lists encode alike."""
    out: list[bytes] = []
    for p in parts:
        if p is None:
            out.append(b"N")
        elif type(p) is str:
            data = p.encode("utf-8")
            out.append(b"s%d:%s" % (len(data), data))
        elif type(p) is int:
            data = str(p).encode("ascii")
            out.append(b"i%d:%s" % (len(data), data))
        else:
            raise ConfigurationError(f"identity parts are str, int or None, not {type(p).__name__}")
    return b"".join(out)


_HEADS = 64  # the steps of one moment, not a run's history


@dataclass(frozen=True, repr=False)
class Secret:
    """A key-derivation secret with a stable id (never logged or stored).

    Attributes:
        id: Stored on every entry derived with it (e.g. ``"2026-11"``).
        value: At least 32 bytes of secret randomness.
    """

    id: str
    value: bytes

    def __post_init__(self) -> None:
        if not self.id or len(self.id) > 64:
            raise ConfigurationError("a secret id is 1..64 characters")
        if len(self.value) < 32:
            raise ConfigurationError(
                "a secret must be at least 32 bytes of randomness "
                "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
            )

    def __repr__(self) -> str:
        return f"Secret(id={self.id!r}, value=<redacted>)"


class Keyring:
    """The secrets keys are derived with: the first is current, the rest are kept so
    entries derived with them still resolve after a rotation.

    Args:
        secrets: Current secret first, then older ones.
    """

    def __init__(self, secrets: Sequence[Secret]) -> None:
        if not secrets:
            raise ConfigurationError("a keyring needs at least one secret")
        ids = [s.id for s in secrets]
        if len(set(ids)) != len(ids):
            raise ConfigurationError(f"secret ids must be unique: {ids}")
        self._secrets = {s.id: s for s in secrets}
        self.current_id = secrets[0].id
        self.ids: tuple[str, ...] = tuple(ids)
        self._sub: dict[tuple[str, str], bytes] = {}
        # key_id: the keyed hash of an identity's parts but the last, by (secret, parts)
        self._heads: dict[tuple[str, tuple[object, ...], tuple[type, ...]], Any] = {}
        for s in secrets:
            for purpose, ctx in _CONTEXTS.items():
                self._sub[(s.id, purpose)] = blake3.blake3(s.value, derive_key_context=ctx).digest()

    @classmethod
    def from_env(cls, var: str = "ONCEONLY_SECRETS") -> Keyring:
        """Build a keyring from ``id:hex,id:hex`` (current first) in an environment variable.

        Raises:
            ConfigurationError: The variable is unset or malformed.
        """
        raw = os.environ.get(var)
        if not raw:
            raise ConfigurationError(
                f"set {var} to 'id:hexsecret' (current first, comma-separated older ones), e.g. "
                f"{var}=k1:$(python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        secrets = []
        for item in raw.split(","):
            sid, sep, hexval = item.strip().partition(":")
            if not sep:
                raise ConfigurationError(
                    f"{var}: each entry is id:hexsecret (an entry has no ':'; its text is not "
                    f"shown, as it may be a secret)"
                )
            try:
                secrets.append(Secret(sid, bytes.fromhex(hexval)))
            except ValueError as exc:
                raise ConfigurationError(f"{var}: secret {sid!r} is not hex") from exc
        return cls(secrets)

    def subkey(self, secret_id: str, purpose: str) -> bytes:
        """The 32-byte subkey of ``secret_id`` for ``purpose``.

        Raises:
            ConfigurationError: The secret is not in this keyring.
        """
        try:
            return self._sub[(secret_id, purpose)]
        except KeyError:
            raise ConfigurationError(
                f"secret {secret_id!r} is not in the keyring (have {list(self.ids)}); add the "
                f"retired secret back to ONCEONLY_SECRETS after the current one"
            ) from None

    def key_id(self, secret_id: str, parts: Sequence[object]) -> str:
        """The ledger key id (hex) for a length-prefixed identity.

        The calls of one step share every part but the last (the ordinal): the hash of
        those is kept (a few of them) and continued with the last part alone, which
        gives the same digest as hashing the whole encoding.
        """
        head = tuple(parts[:-1])
        # the types join the key: 1 and True are equal, but only an int is a valid part
        memo = (secret_id, head, tuple(map(type, head)))
        try:
            base = self._heads.get(memo) if head else None
        except TypeError:  # an unhashable part: refused by the encoding below
            base = None
            head = ()
        if not head:
            return blake3.blake3(
                _encode_parts(parts), key=self.subkey(secret_id, "key")
            ).hexdigest()
        if base is None:
            base = blake3.blake3(_encode_parts(head), key=self.subkey(secret_id, "key"))
            if len(self._heads) >= _HEADS:
                self._heads.clear()
            self._heads[memo] = base
        h = base.copy()
        h.update(_encode_parts(parts[-1:]))
        return h.hexdigest()

    def provider_key(self, secret_id: str, key_id: str) -> str:
        """The key sent downstream, derived from the ledger key (48 hex chars, ``oo-`` prefix)."""
        h = blake3.blake3(bytes.fromhex(key_id), key=self.subkey(secret_id, "provider"))
        return "oo-" + h.hexdigest(length=24)

    def row_keys(self) -> RowKeys:
        """The keys that seal the rows the runtime trusts (runs, checkpoints, waits, and
        the ledger's own rows): one subkey per secret, the current one sealing."""
        return RowKeys(self.current_id, {sid: self._sub[(sid, "rows")] for sid in self.ids})

    def fingerprint(self, secret_id: str, canonical: bytes) -> str:
        """Keyed fingerprint (hex) of canonical argument bytes."""
        return blake3.blake3(canonical, key=self.subkey(secret_id, "fingerprint")).hexdigest()


@dataclass(frozen=True)
class EffectIdentity:
    """Where an effect sits: the identity its key is derived from.

    Attributes:
        tenant: Tenant (keys of different tenants never collide).
        run_id: The run, or None for an explicit key outside a run.
        step_id: The step within the run.
        step_visit: How many times the run entered this step before (loops, retries of
            the step by the flow itself).
        effect: ``name@version``; bump the version when the effect's meaning changes.
        ordinal: The effect's position among the step's calls of this effect.
        explicit: An explicit key given by the caller (then run/step may be None).
    """

    tenant: str
    run_id: str | None
    step_id: str | None
    step_visit: int
    effect: str
    ordinal: int
    explicit: str | None = None

    def parts(self) -> tuple[object, ...]:
        if self.explicit is not None:
            return ("explicit", self.tenant, self.effect, self.explicit)
        return (
            "position",
            self.tenant,
            self.run_id,
            self.step_id,
            self.step_visit,
            self.effect,
            self.ordinal,
        )


@dataclass(frozen=True)
class KeyRecipe:
    """Derive the explicit key from chosen argument fields (like Powertools' JMESPath).

    Attributes:
        fields: Dotted paths into the arguments mapping, e.g. ``("invoice.id", "to")``.
    """

    fields: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.fields:
            raise ConfigurationError("a key recipe needs at least one field")

    def explicit_key(self, args: Mapping[str, Any], codec: Codec) -> str:
        """The explicit key string for ``args`` (canonical encoding of the chosen fields).

        Raises:
            ConfigurationError: A field is missing from the arguments.
        """
        picked = []
        for path in self.fields:
            cur: Any = args
            for part in path.split("."):
                if not isinstance(cur, Mapping) or part not in cur:
                    raise ConfigurationError(
                        f"key recipe field {path!r} is missing from the call's arguments"
                    )
                cur = cur[part]
            picked.append([path, cur])
        return codec.encode(picked).decode("utf-8")


def canonical_args(args: Any, codec: Codec) -> bytes:
    """Canonical bytes of call arguments for fingerprinting: dict order never matters and
    strings are NFC-normalised, so equivalent unicode spellings fingerprint alike.

    Raises:
        CodecError: An argument cannot be encoded.
    """
    raw = codec.encode(args)
    if raw.isascii():  # no string can change under NFC: skip the walk
        return raw
    return codec.encode(_nfc(args))


def _nfc(v: Any) -> Any:
    t = type(v)
    if t is str:
        return unicodedata.normalize("NFC", v)
    if t is dict:
        return {_nfc(k): _nfc(x) for k, x in v.items()}
    if t is list:
        return [_nfc(x) for x in v]
    if t is tuple:
        return tuple(_nfc(x) for x in v)
    return v
