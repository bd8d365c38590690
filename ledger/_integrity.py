"""Keyed integrity where the ledger acts: sealed rows, sealed events, whole chains.

Every effect row carries a **seal** (a keyed MAC over its audited fields, made with the
keyring's row keys, see :class:`checkpoint.RowKeys`), every audit event a **MAC** over all
its fields (its hash, so its place in the chain, included), and every chain's last event
is kept, sealed, in ``oo_chain_heads``. Without the secret none of them can be forged or
recomputed after an edit. On top of that, in the transaction of every claim:

* the row it would act on must match the last audit event of its key, and that event
  must verify (an edited row whose unkeyed digest was recomputed is refused);
* a key with no row must have no events (a deleted row), and its chain must be whole up
  to its sealed head: the chain's last event is the head (the newest events deleted are
  refused) and the events since the last time this process checked the chain are all
  there (a middle event deleted with its row is refused). A process checks a chain in
  full the first time it touches it (prefetching a run does that too), then only what
  was appended since: the cost of a claim does not grow with the length of its run;
* with a **witness** (a file outside the database, ``ONCEONLY_WITNESS``), the chain's head
  is not behind what the witness saw: a store restored from an older backup refuses to
  act until an operator accepts the restore (``onceonly audit accept-restore``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onceonly.checkpoint import RowKeys
from onceonly.checkpoint.errors import CorruptRecord

from .audit import GENESIS, row_digest
from .errors import LEDGER_HINT, StoreRolledBack

__all__ = ["StoreRolledBack"]  # re-exported from .errors for the ledger's own use

EVENT_COLS = (
    "chain, seq, key_id, event, epoch, status, actor, detail, row_digest, at, prev_hash, hash"
)


def event_parts(ev: Sequence[Any]) -> list[object]:
    """What an event's MAC covers: every field (``EVENT_COLS`` order)."""
    (chain, seq, key_id, event, epoch, status, actor, detail, digest, at, prev, h) = ev[:12]
    return [
        chain,
        int(seq),
        key_id,
        event,
        int(epoch),
        status,
        actor,
        detail,
        bytes(digest),
        float(at),
        bytes(prev),
        bytes(h),
    ]


def effect_parts(row: Mapping[str, Any]) -> list[object]:
    """What an effect row's seal covers: its audited fields (their digest)."""
    return [row["key_id"], row["chain"], row_digest(row)]


def head_parts(chain: str, seq: int, h: bytes) -> list[object]:
    return [chain, int(seq), bytes(h)]


def check_event(keys: RowKeys | None, ev: Sequence[Any], mac: bytes | None) -> bool:
    """Whether an event verifies (no keys: only what can be checked without them)."""
    if keys is None:
        return True
    return keys.valid("audit", event_parts(ev), None if mac is None else bytes(mac))


def head_of(cur: Any, q: str, keys: RowKeys | None, chain: str) -> tuple[int, bytes] | None:
    """The chain's sealed head (None: the chain has no head row).

    Raises:
        CorruptRecord: The head row fails its seal.
    """
    cur.execute(f"SELECT seq, hash, seal FROM oo_chain_heads WHERE chain = {q}", (chain,))
    found = cur.fetchone()
    if found is None:
        return None
    seq, h, seal = int(found[0]), bytes(found[1]), found[2]
    if keys is not None and not keys.valid(
        "heads", head_parts(chain, seq, h), None if seal is None else bytes(seal)
    ):
        raise CorruptRecord(
            f"the head of audit chain {chain!r} fails its seal (edited or forged); nothing "
            f"is acted on. Run `onceonly audit verify`",
            run_id=None if chain.startswith("tenant:") else chain,
            hint=LEDGER_HINT,
        )
    return seq, h


def whole_since(
    cur: Any,
    q: str,
    keys: RowKeys | None,
    chain: str,
    verified: int,
) -> int:
    """Check that ``chain`` is whole from event ``verified`` + 1 up to its sealed head;
    returns the head's sequence number (0 for a chain without events).

    Raises:
        CorruptRecord: Events are missing (deleted, newest included), the head is
            missing while events remain, or the last event is not the sealed head.
    """
    where = None if chain.startswith("tenant:") else chain
    # One statement (one snapshot under READ COMMITTED): the head, the events since and
    # whether the chain has any event. Read in two statements, a chain whose first event
    # and head a concurrent claim commits between them reads as "events but no head".
    cur.execute(
        f"SELECT h.seq, h.hash, h.seal, (SELECT COUNT(*) FROM oo_audit a WHERE a.chain = "
        f"h.chain AND a.seq > {q} AND a.seq <= h.seq), (SELECT MAX(a.seq) FROM oo_audit a "
        f"WHERE a.chain = h.chain), (SELECT 1 FROM oo_audit e WHERE e.chain = {q} LIMIT 1) "
        f"FROM (SELECT 1 AS one) d LEFT JOIN oo_chain_heads h ON h.chain = {q}",
        (verified, chain, chain),
    )
    found = cur.fetchone()
    if found is None or found[0] is None:
        if found is not None and found[5] is not None:
            raise CorruptRecord(
                f"audit chain {chain!r} has events but no head (its head was deleted); "
                f"nothing is acted on. Run `onceonly audit verify`",
                run_id=where,
                hint=LEDGER_HINT,
            )
        return 0
    seq, h, seal, count, last = int(found[0]), bytes(found[1]), found[2], found[3], found[4]
    if keys is not None and not keys.valid(
        "heads", head_parts(chain, seq, h), None if seal is None else bytes(seal)
    ):
        raise CorruptRecord(
            f"the head of audit chain {chain!r} fails its seal (edited or forged); nothing "
            f"is acted on. Run `onceonly audit verify`",
            run_id=where,
            hint=LEDGER_HINT,
        )
    if seq <= verified:
        return seq
    if int(last or 0) < seq or int(count or 0) < seq - verified:
        raise CorruptRecord(
            f"audit chain {chain!r} is missing events below its head {seq} (events and "
            f"their effects deleted); nothing is acted on. Run `onceonly audit verify`",
            run_id=where,
            hint=LEDGER_HINT,
        )
    if int(last or 0) > seq:
        raise CorruptRecord(
            f"audit chain {chain!r} has events past its sealed head {seq} (forged or "
            f"its head rolled back); nothing is acted on. Run `onceonly audit verify`",
            run_id=where,
            hint=LEDGER_HINT,
        )
    cur.execute(
        f"SELECT {EVENT_COLS}, mac FROM oo_audit WHERE chain = {q} AND seq = {q}", (chain, seq)
    )
    ev = cur.fetchone()
    if ev is None or bytes(ev[11]) != h or not check_event(keys, ev, ev[12]):
        raise CorruptRecord(
            f"the last event of audit chain {chain!r} is not its sealed head (replaced); "
            f"nothing is acted on. Run `onceonly audit verify`",
            run_id=where,
            hint=LEDGER_HINT,
        )
    return seq


def verify_chain(
    keys: RowKeys | None,
    chain: str,
    events: Sequence[Sequence[Any]],
    head: tuple[int, bytes] | None,
) -> list[str]:
    """Problems of one chain's events (in sequence order) against its head."""
    problems: list[str] = []
    prev = GENESIS
    expect = 1
    for ev in events:
        seq = int(ev[1])
        if seq != expect:
            problems.append(f"chain {chain!r}: event {expect} missing or out of order ({seq})")
            expect = seq
        if bytes(ev[10]) != prev:
            problems.append(f"chain {chain!r} event {seq}: does not link to the event before it")
        if not check_event(keys, ev, ev[12] if len(ev) > 12 else None):
            problems.append(f"chain {chain!r} event {seq}: fails its keyed MAC (edited or forged)")
        prev = bytes(ev[11])
        expect += 1
    last = (int(events[-1][1]), bytes(events[-1][11])) if events else None
    if head is None and last is not None:
        problems.append(f"chain {chain!r}: has events but no head (deleted)")
    elif head is not None and last != head:
        at = 0 if last is None else last[0]
        problems.append(
            f"chain {chain!r}: its last event ({at}) is not its sealed head ({head[0]}): "
            f"events deleted or the head moved"
        )
    return problems
