"""The hash-chained audit trail: event hashing, row digests, verification, witnesses.

Every ledger transition appends an event to its run's chain (effects outside a run use
the chain ``tenant:<tenant>``), in the same transaction as the transition. An event's
hash covers the previous event's hash and the event's fields, including a digest of the
effect row as the transition left it. Chains are per run, so many workers never
serialise on one global head; a witness file records every chain's head so a rollback of
the whole store is detected too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

__all__ = ["AuditReport", "event_hash", "row_digest"]

GENESIS = bytes(32)

# Operational fields (the lease, timestamps) change without an event and are excluded.
_DIGEST_FIELDS = (
    "key_id",
    "tenant",
    "run_id",
    "step_id",
    "effect",
    "fingerprint",
    "provider_key",
    "provider_class",
    "window_s",
    "status",
    "epoch",
    "attempts",
    "outcome_class",
    "subject",
    "secret_id",
    "chain",
    "args_ct",
    "result_ct",
    "error_ct",
    "first_sent_at",
)


def _parts(values: Sequence[Any]) -> bytes:
    out = bytearray()
    for v in values:
        if v is None:
            out += b"N"
            continue
        if isinstance(v, bytes | bytearray | memoryview):
            data = bytes(v)
            tag = b"b"
        elif isinstance(v, float):
            data = repr(v).encode()
            tag = b"f"
        else:
            data = str(v).encode("utf-8")
            tag = b"s"
        out += tag + len(data).to_bytes(4, "big") + data
    return bytes(out)


def row_digest(row: Mapping[str, Any]) -> bytes:
    """Digest of an effect row's audited fields."""
    return blake3.blake3(_parts([row[f] for f in _DIGEST_FIELDS])).digest(length=16)


def event_hash(
    prev: bytes,
    chain: str,
    seq: int,
    key_id: str,
    event: str,
    epoch: int,
    status: str,
    actor: str,
    detail: str,
    digest: bytes,
    at: float,
) -> bytes:
    """Hash of one audit event, chained to ``prev``."""
    body = _parts([chain, seq, key_id, event, epoch, status, actor, detail, digest, float(at)])
    return blake3.blake3(prev + body).digest()


@dataclass
class AuditReport:
    """What :meth:`Ledger.verify` found.

    Attributes:
        chains: Chains checked.
        events: Events checked.
        effects: Effect rows checked.
        blobs: Checkpoint blobs and rows checked.
        problems: One line per problem found; empty means the store verifies.
    """

    chains: int = 0
    events: int = 0
    effects: int = 0
    blobs: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing was found."""
        return not self.problems

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "chains": self.chains,
                "events": self.events,
                "effects": self.effects,
                "blobs": self.blobs,
                "problems": self.problems,
            }
        )
