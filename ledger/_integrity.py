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

import functools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import blake3

from onceonly.checkpoint import RowKeys
from onceonly.checkpoint.errors import CorruptRecord

from ._rows import Row, effect_row
from ._schema import COLUMNS
from ._state import LedgerState
from .errors import LEDGER_HINT, StoreRolledBack

__all__ = ["StoreRolledBack"]  # re-exported from .errors for the ledger's own use

# How long a chain counted whole stays trusted below its head in this process before a
# claim counts it in full again (a delete made while a worker runs is caught this late).
_RECOUNT_S = 1.0
# A recount's cost grows with the chain; the interval grows with it so that recounting
# takes at most 1/_RECOUNT_SHARE of a busy process's time (a long run's claims stay flat).
_RECOUNT_SHARE = 50.0

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


_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def _parts(values: Sequence[Any]) -> bytes:
    # Canonical and unambiguous: a JSON array keeps types apart ("1" vs 1 vs null), and
    # bytes are tagged hex strings.
    return _DUMPS(
        [
            v
            if type(v) in _PLAIN
            else {"b": bytes(v).hex()}
            if isinstance(v, bytes | bytearray | memoryview)
            else v
            for v in values
        ]
    ).encode("utf-8")


_PLAIN = frozenset({str, int, float, type(None)})


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
    return hash_of((chain, seq, key_id, event, epoch, status, actor, detail, digest, at, prev))


def hash_of(ev: Sequence[Any]) -> bytes:
    """An event's hash recomputed from its fields (``EVENT_COLS`` order, up to
    ``prev_hash``)."""
    (chain, seq, key_id, event, epoch, status, actor, detail, digest, at, prev) = ev[:11]
    body = _parts(
        [chain, int(seq), key_id, event, int(epoch), status, actor, detail, digest, float(at)]
    )
    return blake3.blake3(bytes(prev) + body).digest()


ACTION_EVENT = "operator"
"""The event name of a person's action in an audit chain (an operator's cancel, edit,
approval, ...): it belongs to no effect row."""

EVENT_COLS = (
    "chain, seq, key_id, event, epoch, status, actor, detail, row_digest, at, prev_hash, hash"
)


_MINE_MAX = 4096
"""Rows kept by :meth:`IntegrityMixin._remember_mine` at most (claims open at once)."""


@functools.lru_cache(maxsize=256)  # built once per shape, not per call
def last_event_sql(cols: str, q: str, ids: int = 1) -> str:
    """The statement reading the newest audit event of an entry (of any of ``ids`` key
    ids) in a chain; its parameters are ``(chain, chain, *key_ids)``.

    It finds the event through the ``(chain, key_id, seq)`` index in a few pages, however
    long the chain: ``... WHERE chain = ? AND key_id = ? ORDER BY seq DESC LIMIT 1`` is
    planned by SQLite as a walk of the chain's primary key backwards, which for a key
    with no events reads the whole chain (a run's cost quadratic in its length).
    """
    marks = ", ".join([q] * ids)
    return (
        f"SELECT {cols} FROM oo_audit WHERE chain = {q} AND seq = (SELECT MAX(seq) FROM "
        f"oo_audit WHERE chain = {q} AND key_id IN ({marks}))"
    )


@functools.lru_cache(maxsize=256)  # built once per shape, not per call
def row_and_last_sql(where: str, *, lock: bool) -> str:
    """Effect rows (``where`` on alias ``r``), each with its newest audit event in its
    chain (``EVENT_COLS`` and ``mac`` after the row's columns, NULL when it has none):
    the row and what :meth:`IntegrityMixin._check_row` compares it with, in one
    statement.

    ``lock`` (PostgreSQL): the rows alone, ``FOR UPDATE``. A locking read that waited
    for a concurrent writer returns the row as that writer committed it, but a joined
    event as it was before (READ COMMITTED re-reads only the locked row): the event is
    read after the lock is held, by :meth:`IntegrityMixin._check_row` itself.
    """
    rcols = ", ".join(f"r.{c}" for c in COLUMNS)
    if lock:
        return f"SELECT {rcols} FROM oo_effects r WHERE {where} FOR UPDATE"
    ecols = ", ".join(f"e.{c.strip()}" for c in EVENT_COLS.split(","))
    return (
        f"SELECT {rcols}, {ecols}, e.mac FROM oo_effects r LEFT JOIN oo_audit e ON "
        f"e.chain = r.chain AND e.seq = (SELECT MAX(m.seq) FROM oo_audit m WHERE "
        f"m.chain = r.chain AND m.key_id = r.key_id) WHERE {where}"
    )


@functools.lru_cache(maxsize=64)  # built once per shape, not per call
def folded_claim_sql(q: str, ids: int) -> str:
    """A fresh claim's insert with its checks folded in (SQLite): the row is inserted
    only if no row and no audit event exists for any of the ``ids`` candidate key ids
    and the chain's head is exactly the one this process sealed last. Parameters: the
    row (``COLUMNS`` order), then ``(*key_ids, chain, *key_ids, chain, seq, hash,
    seal)``. It inserts nothing when any of that does not hold, and the claim then
    takes the full path."""
    marks = ", ".join([q] * ids)
    return (
        f"INSERT INTO oo_effects ({', '.join(COLUMNS)}) SELECT {', '.join([q] * len(COLUMNS))} "
        f"WHERE NOT EXISTS (SELECT 1 FROM oo_effects WHERE key_id IN ({marks})) "
        f"AND NOT EXISTS (SELECT 1 FROM oo_audit WHERE chain = {q} AND key_id IN ({marks})) "
        f"AND EXISTS (SELECT 1 FROM oo_chain_heads WHERE chain = {q} AND seq = {q} "
        f"AND hash = {q} AND seal = {q}) ON CONFLICT DO NOTHING"
    )


_EVENT_NAMES = [c.strip() for c in EVENT_COLS.split(",")] + ["mac"]


@functools.lru_cache(maxsize=64)  # built once per shape, not per call
def folded_transition_sql(q: str, changed: tuple[str, ...]) -> str:
    """An outcome's compare-and-set with the check of :meth:`IntegrityMixin._check_row`
    (``mine``) folded in (SQLite): the row is updated only if every column is exactly as
    this process sealed it, the key's event as it appended it is there, every field and
    MAC alike, and no later event of the key exists (it is the key's last). Parameters:
    the new values of ``changed`` and ``updated_at``, then the row as sealed
    (``COLUMNS`` order), then the event as appended (``EVENT_COLS`` and ``mac``), then
    ``(chain, key_id, seq)``."""
    sets = ", ".join(f"{c} = {q}" for c in (*changed, "updated_at"))
    # = on the key columns (the lookups), IS on the rest (NULL equals NULL)
    row = " AND ".join(f"{c} {'=' if c == 'key_id' else 'IS'} {q}" for c in COLUMNS)
    event = " AND ".join(f"{c} {'=' if c in ('chain', 'seq') else 'IS'} {q}" for c in _EVENT_NAMES)
    return (
        f"UPDATE oo_effects SET {sets} WHERE {row} AND EXISTS (SELECT 1 FROM oo_audit WHERE "
        f"{event}) AND NOT EXISTS (SELECT 1 FROM oo_audit WHERE chain = {q} AND key_id = {q} "
        f"AND seq > {q})"
    )


def split_row(found: Sequence[Any]) -> tuple[Row, Sequence[Any] | None]:
    """A :func:`row_and_last_sql` result: the row, and its last event (None: none;
    ``()``: not read with the row)."""
    n = len(COLUMNS)
    if len(found) == n:
        return effect_row(found), ()
    last = found[n:]
    return effect_row(found[:n]), (None if last[0] is None else last)


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


@functools.lru_cache(maxsize=256)  # built once per shape, not per call
def whole_since_sql(q: str, absent: int = 0) -> str:
    """The statement :func:`whole_since` reads (parameters ``(verified, chain, chain)``);
    with ``absent`` key ids, it also reads the newest event of any of them in the chain
    (two more columns; parameters ``(verified, chain, chain, chain, chain, *key_ids)``):
    a fresh claim's two checks in one statement."""
    sql = (
        f"SELECT h.seq, h.hash, h.seal, (SELECT COUNT(*) FROM oo_audit a WHERE a.chain = "
        f"h.chain AND a.seq > {q} AND a.seq <= h.seq), (SELECT MAX(a.seq) FROM oo_audit a "
        f"WHERE a.chain = h.chain), (SELECT 1 FROM oo_audit e WHERE e.chain = {q} LIMIT 1)"
    )
    if not absent:
        return f"{sql} FROM (SELECT 1 AS one) d LEFT JOIN oo_chain_heads h ON h.chain = {q}"
    marks = ", ".join([q] * absent)
    return (
        f"{sql}, x.key_id, x.event FROM (SELECT 1 AS one) d LEFT JOIN oo_chain_heads h "
        f"ON h.chain = {q} LEFT JOIN oo_audit x ON x.chain = {q} AND x.seq = (SELECT "
        f"MAX(m.seq) FROM oo_audit m WHERE m.chain = {q} AND m.key_id IN ({marks}))"
    )


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
    # One statement (one snapshot under READ COMMITTED): the head, the events since and
    # whether the chain has any event. Read in two statements, a chain whose first event
    # and head a concurrent claim commits between them reads as "events but no head".
    cur.execute(whole_since_sql(q), (verified, chain, chain))
    return judge_whole(cur, q, keys, chain, verified, cur.fetchone())


def judge_whole(
    cur: Any,
    q: str,
    keys: RowKeys | None,
    chain: str,
    verified: int,
    found: Sequence[Any],
    sealed: tuple[int, bytes, bytes] | None = None,
) -> int:
    """:func:`whole_since`'s verdict on the row its statement read. ``sealed``: the head
    (seq, hash, seal) as this process sealed it last; a head read back equal to it is
    not verified again (a full verification would accept it)."""
    where = None if chain.startswith("tenant:") else chain
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
    mine = sealed is not None and seal is not None and (seq, h, bytes(seal)) == sealed
    if (
        keys is not None
        and not mine
        and not keys.valid(
            "heads", head_parts(chain, seq, h), None if seal is None else bytes(seal)
        )
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


class IntegrityMixin(LedgerState):
    """The checks a claim makes before it acts, and the seals rows are checked against."""

    def _remember_mine(self, row: Row, event: tuple[Any, ...]) -> None:
        """Keep the row this process just sealed and the event it appended for it, so
        that the outcome's read of the same row (:meth:`_check_row`, ``mine``) can tell
        them apart from any other content by comparison alone."""
        if len(self._mine) >= _MINE_MAX:
            self._mine.clear()  # claims never finished (their act raised through)
        self._mine[row["key_id"]] = (tuple(row[c] for c in COLUMNS), event)

    def _check_row(
        self,
        cur: Any,
        row: Row,
        last: Sequence[Any] | None = (),
        *,
        mine: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None,
    ) -> None:
        """Refuse a row that fails its seal, or differs from the state its last audit
        event recorded, or whose last event fails its MAC. ``last``: the row's newest
        event (None: none) when it was read with the row (:func:`row_and_last_sql`).

        ``mine``: the row and event as this process sealed and appended them
        (:meth:`_remember_mine`). A row (or event) read back equal to it, every column,
        seal and MAC included, is what a full verification would accept: it is not
        verified again. Anything else, a single changed byte, is verified in full.

        Raises:
            CorruptRecord: The row was edited (its unkeyed digest recomputed or not),
                forged, rolled back alone, or moved to another run's chain.
        """
        q = self._q
        same_row = mine is not None and tuple(row[c] for c in COLUMNS) == mine[0]
        if same_row and last is not None and last != () and tuple(last) == mine[1]:  # type: ignore[index]
            return
        parts = effect_parts(row)
        if (
            not same_row
            and self._keys is not None
            and not self._keys.valid("effects", parts, row.get("seal"))
        ):
            raise CorruptRecord(
                f"effect {row['key_id']} fails its keyed seal (edited, forged or written "
                f"without the keyring); it is not acted on. Run `onceonly audit verify`",
                run_id=row["run_id"],
                hint=LEDGER_HINT,
            )
        found: Sequence[Any] | None
        if last == ():
            cur.execute(
                last_event_sql(f"{EVENT_COLS}, mac", q),
                (row["chain"], row["chain"], row["key_id"]),
            )
            found = cur.fetchone()
        else:
            found = last
        if same_row and found is not None and tuple(found) == mine[1]:  # type: ignore[index]
            return
        if (
            found is None
            or bytes(found[8]) != parts[2]
            or not check_event(self._keys, found, found[12])
        ):
            raise CorruptRecord(
                f"effect {row['key_id']} differs from its audit trail (edited, forged or "
                f"moved); it is not acted on. Run `onceonly audit verify` and resolve it by hand",
                run_id=row["run_id"],
                hint=LEDGER_HINT,
            )

    def _check_chain(
        self, cur: Any, chain: str, found: Any = None, mark: tuple[int, float] | None = None
    ) -> None:
        """Before a claim acts: the chain is whole up to its sealed head (what was
        appended since this process last checked it), and not behind the witness.
        ``found``: the row :meth:`_check_fresh` read already (the chain part of it),
        counted from ``mark`` (:meth:`_chain_mark` when it was read).

        Raises:
            CorruptRecord: Events are missing, the head is missing or was replaced.
            StoreRolledBack: The chain is behind its witness.
        """
        seen, counted = self._chain_mark(chain) if mark is None else mark
        if found is None:
            head = whole_since(cur, self._q, self._keys, chain, seen)
        else:
            head = judge_whole(
                cur, self._q, self._keys, chain, seen, found, self._head_seals.get(chain)
            )
        self._counted(chain, (seen, counted))
        self._verified[chain] = (head, counted)
        if self.witness is not None:
            seen = self.witness.heads.get(chain, 0)
            if head < seen:
                raise StoreRolledBack(chain, head, seen, self.witness.path)

    def _chain_mark(self, chain: str) -> tuple[int, float]:
        """Up to which event this process has counted ``chain`` whole, and when it last
        counted it in full (0 now and then: the whole chain is counted again)."""
        seen, counted = self._verified.get(chain, (0, 0.0))
        now = time.monotonic()
        if now - counted > max(_RECOUNT_S, self._recount_cost.get(chain, 0.0) * _RECOUNT_SHARE):
            return 0, now
        return seen, counted

    def _counted(self, chain: str, mark: tuple[int, float]) -> None:
        """Note how long a recount of ``chain`` begun at ``mark`` took (the next one
        waits in proportion: :data:`_RECOUNT_SHARE`)."""
        if mark[0] == 0:
            self._recount_cost[chain] = max(time.monotonic() - mark[1], 0.0)

    def _check_fresh(self, cur: Any, chain: str, ids: list[str]) -> None:
        """A claim of a key with no row: :meth:`_check_absent` and :meth:`_check_chain`,
        read in one statement."""
        # one mark for the statement and its verdict (read twice, the recount could
        # start between them: events counted from one point, judged from another)
        mark = self._chain_mark(chain)
        q = self._q
        cur.execute(
            whole_since_sql(q, absent=len(ids)), (mark[0], chain, chain, chain, chain, *ids)
        )
        found = cur.fetchone()
        self._check_absent(cur, chain, ids, None if found[6] is None else found[6:8])
        self._check_chain(cur, chain, found, mark)

    def _witness_claim(self, chain: str) -> None:
        """Advance the witness to the chain's head, durably, before the claim acts."""
        if self.witness is not None:
            head = self._heads.get(chain)
            if head is not None:
                self.witness.advance(chain, head[0])

    def _check_absent(
        self, cur: Any, chain: str, ids: list[str], last: Sequence[Any] | None = ()
    ) -> None:
        """Refuse to claim a key whose row is gone while its audit events remain (a
        deleted row would otherwise let the effect happen again); a row removed by
        retention ends with a ``retired`` event. ``last``: the newest event of the key
        (``(key_id, event)``, None for none) when :meth:`_check_fresh` read it already.

        Raises:
            CorruptRecord: The entry's row was deleted.
        """
        q = self._q
        marks = ", ".join([q] * len(ids))
        found: Sequence[Any] | None
        if last == ():
            cur.execute(last_event_sql("key_id, event", q, len(ids)), (chain, chain, *ids))
            found = cur.fetchone()
        else:
            found = last
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
        keys = self._keys
        return [
            r
            for r, parts in ((r, effect_parts(r)) for r in rows)
            if last.get((r["chain"], r["key_id"])) == parts[2]
            and (keys is None or keys.valid("effects", parts, r.get("seal")))
        ]
