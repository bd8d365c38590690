"""The hash-chained audit trail as an operator checks it: whole-store verification and
witness files (event hashes and row digests are made in ``_integrity``, where the ledger
checks them as it acts).

Every ledger transition appends an event to its run's chain (effects outside a run use
the chain ``tenant:<tenant>``), in the same transaction as the transition. An event's
hash covers the previous event's hash and the event's fields, including a digest of the
effect row as the transition left it. Chains are per run, so many workers never
serialise on one global head; a witness file records every chain's head so a rollback of
the whole store is detected too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from onceonly.checkpoint import Store
from onceonly.checkpoint._witness import read_witness

from ._integrity import (
    ACTION_EVENT,
    EVENT_COLS,
    GENESIS,
    effect_parts,
    event_hash,
    hash_of,
    head_parts,
    row_digest,
    verify_chain,
)
from ._rows import SELECT as _SELECT_EFFECTS
from ._rows import effect_row as _effect_row

# GENESIS, event_hash and row_digest are defined with the checks that use them
# (``_integrity``), and stay importable from here.
__all__ = ["GENESIS", "AuditReport", "event_hash", "export_witness", "row_digest", "verify_store"]


@dataclass
class AuditReport:
    """What :meth:`Ledger.verify` found.

    Attributes:
        chains: Chains checked.
        events: Events checked.
        effects: Effect rows checked.
        blobs: Checkpoint blobs and rows checked.
        data_keys: Data keys checked (each unwrapped with the keyring; erased ones counted).
        problems: One line per problem found; empty means the store verifies.
    """

    chains: int = 0
    events: int = 0
    effects: int = 0
    blobs: int = 0
    data_keys: int = 0
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
                "data_keys": self.data_keys,
                "problems": self.problems,
            }
        )


def verify_store(store: Store, *, witness: str | None = None) -> AuditReport:
    """Verify every audit chain (each event's link, hash and keyed MAC; the sealed head),
    effect row (its keyed seal and its last audited state), blob, checkpoint, run and
    wait of a store. Without integrity keys on the store, only what unkeyed digests can
    show is checked."""
    report = AuditReport()
    retired: set[str] = set()
    keys = store.integrity

    def scan(cur: Any) -> None:
        cur.execute("SELECT chain, seq, hash, seal FROM oo_chain_heads")
        heads: dict[str, tuple[int, bytes]] = {}
        for c, s_, h, seal in cur.fetchall():
            heads[c] = (int(s_), bytes(h))
            if keys is not None and not keys.valid(
                "heads", head_parts(c, int(s_), bytes(h)), None if seal is None else bytes(seal)
            ):
                report.problems.append(f"chain {c!r}: its head fails its seal (edited or forged)")
        cur.execute(f"SELECT {EVENT_COLS}, mac FROM oo_audit ORDER BY chain, seq")
        events = cur.fetchall()
        cur.execute(_SELECT_EFFECTS)
        rows = [_effect_row(r) for r in cur.fetchall()]
        last: dict[str, tuple[str, bytes, str]] = {}
        by_chain: dict[str, list[Any]] = {}
        for ev in events:
            by_chain.setdefault(ev[0], []).append(ev)
        report.chains = len(set(heads) | set(by_chain))
        for chain in sorted(set(heads) | set(by_chain)):
            evs = by_chain.get(chain, [])
            report.problems.extend(verify_chain(keys, chain, evs, heads.get(chain)))
            for ev in evs:
                report.events += 1
                c, seq, key_id, event, digest, h = ev[0], ev[1], ev[2], ev[3], ev[8], ev[11]
                if hash_of(ev) != bytes(h):
                    report.problems.append(f"chain {c!r} event {seq}: edited (hash mismatch)")
                if event == ACTION_EVENT:
                    # a person's action: no row; its digest is that of its detail
                    if hashlib.sha256(str(ev[7]).encode()).digest() != bytes(digest):
                        report.problems.append(
                            f"chain {c!r} event {seq}: an operator action's detail differs "
                            f"from its digest (edited)"
                        )
                    continue
                last[key_id] = (c, bytes(digest), event)
                if event == "retired":
                    retired.add(key_id)
                elif key_id in retired:
                    retired.discard(key_id)
        seen = set()
        for row in rows:
            report.effects += 1
            seen.add(row["key_id"])
            parts = effect_parts(row)
            sealed = keys is None or keys.valid("effects", parts, row.get("seal"))
            info = last.get(row["key_id"])
            if info is None:
                report.problems.append(f"effect {row['key_id']}: row has no audit events (forged)")
                continue
            if info[0] != row["chain"]:
                report.problems.append(
                    f"effect {row['key_id']}: row moved from chain {info[0]!r} to {row['chain']!r}"
                )
            elif info[1] != parts[2]:
                report.problems.append(
                    f"effect {row['key_id']}: row differs from its last audited state (edited)"
                )
            elif not sealed:
                report.problems.append(f"effect {row['key_id']}: fails its keyed seal (edited)")
        for key_id in sorted(set(last) - seen - retired):
            report.problems.append(f"effect {key_id}: row deleted (its events remain)")
        if witness is not None:
            report.problems.extend(_check_witness(witness, heads, by_chain, store))

    store.read(scan)
    checked, problems = store.verify_integrity()
    report.blobs = checked
    report.problems.extend(problems)
    return report


def export_witness(store: Store, path: str, now: float) -> dict[str, Any]:
    """Write every chain's head and a digest over them to ``path``; return the document."""

    def scan(cur: Any) -> dict[str, list[Any]]:
        cur.execute(
            "SELECT a.chain, a.seq, a.hash FROM oo_audit a WHERE a.seq = "
            "(SELECT MAX(b.seq) FROM oo_audit b WHERE b.chain = a.chain) ORDER BY a.chain"
        )
        return {c: [int(s), bytes(h).hex()] for c, s, h in cur.fetchall()}

    heads = store.read(scan)
    digest = blake3.blake3(json.dumps(heads, sort_keys=True).encode()).hexdigest()
    doc = {"version": 1, "created_at": now, "heads": heads, "digest": digest}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, sort_keys=True)
    return doc


def _check_witness(
    path: str,
    heads: Mapping[str, tuple[int, bytes]],
    by_chain: Mapping[str, list[Any]],
    store: Store,
) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        yield f"witness {path}: unreadable ({exc})"
        return
    try:
        witnessed = json.loads(text)["heads"]  # an exported witness (export_witness)
    except (ValueError, KeyError, TypeError):
        # The append-only witness (ONCEONLY_WITNESS, checkpoint._witness): chain heads
        # and run revisions, "#reset" where an operator accepted a restore.
        seqs, revs, bad = read_witness(text.splitlines())
        if bad is not None:
            yield f"witness {path}: unreadable (line {bad} is neither JSON nor a head)"
            return
        if revs:
            have = store.run_revisions()
            for run_id, rev in sorted(revs.items()):
                # A run that is gone (retention) acts on nothing; its effects' chain is
                # checked above.
                if run_id in have and have[run_id] < rev:
                    yield (
                        f"run {run_id!r}: its row is at revision {have[run_id]}, behind the "
                        f"witnessed {rev} (rolled back)"
                    )
        for chain, seq in sorted(seqs.items()):
            head = heads.get(chain)
            if head is None or head[0] < seq:
                at = 0 if head is None else head[0]
                yield (
                    f"chain {chain!r}: store is at event {at}, behind the witnessed {seq} "
                    f"(rolled back)"
                )
        return
    for chain, (seq, hexhash) in sorted(witnessed.items()):
        head = heads.get(chain)
        if head is None:
            yield f"chain {chain!r}: witnessed at event {seq} but gone from the store (rolled back)"
            continue
        if head[0] < int(seq):
            yield (
                f"chain {chain!r}: store is at event {head[0]}, below the witnessed {seq} "
                f"(rolled back)"
            )
            continue
        evs = by_chain.get(chain, [])
        match = [e for e in evs if int(e[1]) == int(seq)]
        if not match or bytes(match[0][11]).hex() != hexhash:
            yield f"chain {chain!r}: event {seq} differs from the witnessed one (history rewritten)"
