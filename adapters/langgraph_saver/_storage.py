"""The saver's storage: LangGraph checkpoints and pending writes as rows of the saver's
tables over runs of the checkpoint store, written once. :class:`OnceOnlySaver` is the
sync and async face over it, and funnels every call through its one worker thread.
"""

from __future__ import annotations

import builtins
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from onceonly.adapters import _langgraph_schema as _schema
from onceonly.adapters._langgraph_values import PackMemo, pack, register, seal, unpack, unseal
from onceonly.checkpoint import (
    CheckpointNotFound,
    Codec,
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    Durability,
    Handoff,
    RowKeys,
    RunNotFound,
    Store,
)

from ._rows import (
    _ATTEMPTS,
    _CK_COLS,
    _FLOW,
    _RUN_CACHE,
    _WALK_ROWS,
    _WALK_SEEDS,
    _WRITE_COLS,
    _conf,
    _core_step,
    _Row,
    _Stale,
)


class Storage:
    """One saver's storage logic on ``store``.

    Args:
        store: The checkpoint store (its tables and the saver's already exist).
        serde: The serializer for values the codec cannot store exactly.
    """

    def __init__(self, store: Store, serde: SerializerProtocol) -> None:
        self.store = store
        self.serde = serde
        self._codec = Codec()
        register(self._codec)
        self._q = store.param
        self._lock = threading.RLock()
        self._runs: OrderedDict[tuple[str, str], str] = OrderedDict()
        # The serde's encodings of the messages of recent states and writes: a state
        # carries the same message objects from step to step (see PackMemo).
        self._memo = PackMemo()
        # Delta-channel walks (see delta_history): rows already verified, by their exact
        # content, and the seeds already built, by the exact row that names them.
        self._walk_keys: RowKeys | None = None
        self._walk_rows: OrderedDict[Any, Any] = OrderedDict()
        self._walk_seeds: OrderedDict[Any, Any] = OrderedDict()

    @property
    def keys(self) -> RowKeys | None:
        """The store's row keys, read at each use: a Ledger given the same store later
        attaches its keyring's keys there."""
        return self.store.integrity

    def verify_rows(self) -> tuple[int, list[str]]:
        """:meth:`OnceOnlySaver.verify`: every thread, checkpoint and write row checked."""
        problems: list[str] = []

        def scan(cur: Any) -> int:
            n = 0
            cur.execute("SELECT thread_id, checkpoint_ns, run_id, seal FROM oo_lg_threads")
            mapped = []
            for found in cur.fetchall():
                n += 1
                try:
                    mapped.append((str(found[0]), str(found[1]), self._mapped_run(found)))
                except CorruptRecord as exc:
                    problems.append(exc.detail)
            for thread_id, ns, run_id in mapped:
                # each namespace's newest checkpoint has its row
                try:
                    problem = self._newest_problem(cur, thread_id, ns, run_id, None)
                except CorruptRecord as exc:
                    problem = exc.detail
                if problem is not None:
                    problems.append(problem)
            cur.execute(f"SELECT {_CK_COLS} FROM oo_lg_checkpoints")
            for r in cur.fetchall():
                n += 1
                try:
                    self._verify(_Row.of(r))
                except CorruptRecord as exc:
                    problems.append(exc.detail)
            cur.execute(
                f"SELECT thread_id, checkpoint_ns, checkpoint_id, {_WRITE_COLS} FROM oo_lg_writes"
            )
            for r in cur.fetchall():
                n += 1
                try:
                    self._verified_write(str(r[0]), str(r[1]), str(r[2]), r[3:])
                except CorruptRecord as exc:
                    problems.append(exc.detail)
            return n

        with self._lock:
            checked = self.store.read(scan)
        return checked, problems

    def seal_unsealed(self, keys: RowKeys) -> int:
        """Seal the saver's unsealed rows and the store's (see
        :meth:`OnceOnlySaver.seal_unsealed`)."""
        with self._lock:
            return _schema.seal_unsealed(self.store, keys) + self.store.seal_unsealed()

    # -- write -------------------------------------------------------------------------
    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """:meth:`OnceOnlySaver.put`: the channel values as a delta on the namespace's
        previous checkpoint, and the record; nothing is visible if the database refuses."""
        conf = _conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        parent = conf.get("checkpoint_id")
        parent = None if parent is None else str(parent)
        cid = str(checkpoint["id"])
        serde = self.serde
        memo = self._memo
        values = {k: pack(v, serde, memo) for k, v in checkpoint["channel_values"].items()}
        rest = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        md = dict(get_serializable_checkpoint_metadata(config, metadata))
        # "k": the channels this checkpoint holds a value for, so that a delta-channel
        # walk finds its seed without building every ancestor's state.
        record = seal(self._codec.encode(pack({"c": rest, "m": md, "k": sorted(values)}, serde)))
        lg_run = None if md.get("run_id") is None else str(md["run_id"])
        step = _core_step(f"{md.get('source', '')}:{md.get('step', '')}", cid)
        with self._lock:
            for attempt in range(_ATTEMPTS):
                try:
                    run_id = self._run_for(thread_id, ns)
                    # Queued (whatever the store's own mode) for the transaction that
                    # writes the record: the values and the row commit together.
                    seq = self.store.save(run_id, values, step=step, durability=_TOGETHER).seq

                    def write(cur: Any, run_id: str = run_id, seq: int = seq) -> None:
                        self._upsert_row(
                            cur, thread_id, ns, cid, parent, run_id, seq, lg_run, record
                        )

                    # All or nothing: the values and the record, no savepoints.
                    self.store.transact(write, together=(run_id,))
                    break
                except (ConcurrentWrite, RunNotFound, _Stale):
                    self._runs.pop((thread_id, ns), None)
                    if attempt == _ATTEMPTS - 1:
                        raise
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}}

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's pending writes for a checkpoint.

        Regular writes are kept at their first version (a re-run task does not change
        them); writes to LangGraph's special channels (errors, interrupts, resumes) are
        replaced, as in LangGraph's own savers.
        """
        conf = _conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        cid = str(conf["checkpoint_id"])
        encoded = []
        for i, (channel, value) in enumerate(writes):
            idx = WRITES_IDX_MAP.get(channel, i)
            data = seal(self._codec.encode(pack(value, self.serde, self._memo)))
            encoded.append((str(task_id), idx, str(channel), str(task_path), data))
        if not encoded:
            return
        replace = all(w[0] in WRITES_IDX_MAP for w in writes)
        sql = self._insert_writes_sql(replace=replace)
        with self._lock:
            rows = [self._write_row(thread_id, ns, cid, *w) for w in encoded]
            self.store.transact(lambda cur: cur.executemany(sql, rows))

    # -- read --------------------------------------------------------------------------
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the namespace's latest without a
        ``checkpoint_id``; ``None`` when there is none.

        Raises:
            CorruptRecord: A row, delta, blob or write failed its integrity check.
        """
        conf = _conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        cid = get_checkpoint_id(config)
        sql, params = self._row_query(thread_id, ns, cid)

        def read(cur: Any) -> CheckpointTuple | None:
            cur.execute(sql, params)
            found = cur.fetchone()
            row = None if found is None else _Row.of(found)
            if row is not None:
                self._verify(row)
            if not cid:
                # The latest: the one a graph resumes from. Its row must be the newest
                # the namespace's store run holds values for (a deleted or moved newest
                # row would send the graph back to run its steps again).
                self._check_newest(cur, thread_id, ns, row)
            if row is None:
                return None
            # The channel values are loaded in this read too: the row, its writes and
            # the values it names are of one moment (a prune or delete committed in
            # between would otherwise read as values missing).
            return self._tuple(row, self._select_writes(cur, [row]), verified=True)

        with self._lock:
            return self.store.read(read)

    def _check_newest(self, cur: Any, thread_id: str, ns: str, row: _Row | None) -> None:
        """Refuse to read a namespace whose newest row (``row``; None: it has none) is
        not its store run's newest checkpoint, when that checkpoint was written with a
        row (see :func:`_core_step`) that is no longer there.

        Raises:
            CorruptRecord: That row is gone (deleted, or moved to another thread).
        """
        run_id = row.run_id if row is not None else self._mapped_run_at(cur, thread_id, ns)
        if run_id is None:
            return  # a new thread
        problem = self._newest_problem(cur, thread_id, ns, run_id, row)
        if problem is not None:
            raise CorruptRecord(problem, run_id=run_id)

    def _newest_problem(
        self, cur: Any, thread_id: str, ns: str, run_id: str, row: _Row | None
    ) -> str | None:
        """What is wrong when store run ``run_id`` of a namespace holds a checkpoint
        newer than the namespace's newest row ``row`` whose own row is gone; None when
        nothing is (a run or a head that is missing is the store's to report)."""
        found = self.store.run_head_in(cur, run_id)
        if found is None or found[0].head_seq is None:
            return None
        head = int(found[0].head_seq)
        if row is not None and row.seq == head:
            return None
        q = self._q
        cur.execute(
            f"SELECT 1 FROM oo_lg_checkpoints WHERE thread_id = {q} AND checkpoint_ns = {q} "
            f"AND run_id = {q} AND seq = {q}",
            (thread_id, ns, run_id, head),
        )
        if cur.fetchone() is not None:
            return None  # an older checkpoint id put again (its row moved to the head)
        info = self.store.checkpoint_info_in(cur, run_id, head)
        if info is None:
            return None
        _, marked, cid = info.step.rpartition("@")
        if not marked:
            return None  # an earlier version's values whose row a crash left out
        return (
            f"the newest checkpoint of LangGraph thread {thread_id!r} (namespace {ns!r}), "
            f"{cid!r}, has lost its record: its channel values are stored (checkpoint "
            f"{head} of store run {run_id!r}, written in one transaction with the record) "
            f"but its row in oo_lg_checkpoints is gone (deleted, or moved to another "
            f"thread). Nothing was read: the thread would go back to an older checkpoint "
            f"and run its steps again. Restore the row from a backup; or, to go on from "
            f"the newest checkpoint that still has its record, prune the thread "
            f"(saver.prune([{thread_id!r}]), which drops its history)"
        )

    def list_keys(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> builtins.list[_Key]:
        """Which checkpoints :meth:`OnceOnlySaver.list` gives, newest first, as
        (thread id, namespace, checkpoint id); with a ``filter``, not yet filtered (nor
        limited). Only the keys: :meth:`list_items` reads the rows."""
        q = self._q
        where: list[str] = []
        params: list[Any] = []
        conf = _conf(config) if config is not None else {}
        if conf.get("thread_id") is not None:
            where.append(f"thread_id = {q}")
            params.append(str(conf["thread_id"]))
        if "checkpoint_ns" in conf:
            where.append(f"checkpoint_ns = {q}")
            params.append(str(conf["checkpoint_ns"]))
        if conf.get("checkpoint_id"):
            where.append(f"checkpoint_id = {q}")
            params.append(str(conf["checkpoint_id"]))
        before_id = get_checkpoint_id(before) if before is not None else None
        if before_id:
            where.append(f"checkpoint_id < {q}")
            params.append(str(before_id))
        sql = "SELECT thread_id, checkpoint_ns, checkpoint_id FROM oo_lg_checkpoints"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY checkpoint_id DESC"
        if limit is not None and not filter:
            sql += f" LIMIT {int(limit)}"

        def read(cur: Any) -> list[_Key]:
            cur.execute(sql, params)
            return [(str(t), str(ns), str(c)) for t, ns, c in cur.fetchall()]

        return self.store.read(read)

    def list_items(
        self, keys: Sequence[_Key], filter: dict[str, Any] | None
    ) -> builtins.list[CheckpointTuple]:
        """The tuples of the checkpoints ``keys`` name (newest first) that match
        ``filter``: their rows, writes and values read in one read transaction, the
        channel values of each run's rows built in one forward walk
        (:meth:`Store.load_each`), not one load per checkpoint.

        ``keys`` were listed by an earlier read: a checkpoint deleted since is left
        out, and one rewritten since (a prune stores its values afresh) is taken as it
        is now, as a listing that began after them would."""
        if not keys:
            return []
        with self._lock:
            return self.store.read(lambda cur: self._items(cur, keys, filter))

    def _items(
        self, cur: Any, keys: Sequence[_Key], filter: dict[str, Any] | None
    ) -> builtins.list[CheckpointTuple]:
        """:meth:`list_items` in the read transaction of ``cur``."""
        rows = self._rows_now(cur, keys)
        if filter:
            kept = []
            for row in rows:
                md = self._record(row)["m"]
                if all(k in md and md[k] == v for k, v in filter.items()):
                    kept.append(row)
            rows = kept
        if not rows:
            return []
        writes = self._writes_of(cur, rows)
        for row in rows:
            self._verify(row)  # before anything of any row is decoded
        by_run: dict[str, builtins.list[_Row]] = {}
        for row in rows:
            by_run.setdefault(row.run_id, []).append(row)
        values: dict[tuple[str, int], dict[str, Any]] = {}
        serde = self.serde
        for run_id, run_rows in by_run.items():
            try:
                for info, state in self.store.load_each(run_id, [r.seq for r in run_rows]):
                    values[run_id, info.seq] = {k: unpack(v, serde) for k, v in state.items()}
            except (RunNotFound, CheckpointNotFound) as exc:
                raise CorruptRecord(
                    f"the channel values of a LangGraph checkpoint of thread "
                    f"{run_rows[0].thread_id!r} are missing",
                    run_id=run_id,
                ) from exc
        return [
            self._tuple(row, w, values=values[row.run_id, row.seq], verified=True)
            for row, w in zip(rows, writes, strict=True)
        ]

    def _rows_now(self, cur: Any, keys: Sequence[_Key]) -> builtins.list[_Row]:
        """The rows ``keys`` name as they are now, in their order: deleted ones left out
        (one statement per thread and namespace among them)."""
        now: dict[_Key, _Row] = {}
        for (thread_id, ns), ids in _by_namespace(keys).items():
            cur.execute(
                *self._in_namespace(f"SELECT {_CK_COLS} FROM oo_lg_checkpoints", thread_id, ns, ids)
            )
            for r in cur.fetchall():
                row = _Row.of(r)
                now[row.thread_id, row.checkpoint_ns, row.checkpoint_id] = row
        return [now[key] for key in keys if key in now]

    def _in_namespace(
        self, select: str, thread_id: str, ns: str, ids: Sequence[str]
    ) -> tuple[str, tuple[str, ...]]:
        """``select`` restricted to checkpoints ``ids`` of one thread and namespace, and
        its parameters."""
        q = self._q
        marks = ", ".join([q] * len(ids))
        where = f"WHERE thread_id = {q} AND checkpoint_ns = {q} AND checkpoint_id IN ({marks})"
        return f"{select} {where}", (thread_id, ns, *ids)

    def delta_history(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """:meth:`OnceOnlySaver.get_delta_channel_history`: LangGraph's walk up the parent
        chain (each ancestor's pending writes for the channels, until one holds the
        channel's value: the seed), with the same result as its default walk.

        The ancestors' rows are read in pages and each is verified (seal, digest) before
        it is used; which channels an ancestor holds is in its record, so only the seed's
        state is built. A row (or write) whose exact content was verified before is not
        verified again, and a seed already built for the exact row that names it is
        reused: LangGraph walks once per listed checkpoint, over mostly the same
        ancestors. Values are handed out as new objects on every call. For a
        checkpoint written before records named their channels, its state is loaded
        to learn them.

        Raises:
            CorruptRecord: A row, delta, blob or write failed its integrity check.
        """
        if not channels:
            return {}
        thread_id, ns, cid = _where(config)
        serde = self.serde

        def walk(cur: Any) -> dict[str, dict[str, Any]]:
            # Every read of the walk in one transaction: one snapshot of the chain (a
            # concurrent prune or delete is seen whole or not at all), one BEGIN.
            collected: dict[str, builtins.list[Any]] = {c: [] for c in channels}
            seed: dict[str, Any] = {}
            remaining = set(channels)
            target = self._row_at(cur, thread_id, ns, cid)
            if target is not None:
                self._walk_record(target)  # its parent link is followed: verified first
            cursor = None if target is None else target.parent_checkpoint_id
            size = 8
            while cursor and remaining:
                page = self._ancestor_page(cur, thread_id, ns, cursor, size)
                size = min(size * 4, 256)
                found_rows: builtins.list[Any] = []
                while cursor and cursor in page:
                    found_rows.append(page[cursor])
                    cursor = page[cursor][3]  # the parent's id
                if not found_rows:
                    break  # the parent's row is gone: the walk ends there, as LangGraph's
                chain: builtins.list[_Row] = []
                records: builtins.list[set[str]] = []
                unseeded = set(remaining)
                for r in found_rows:  # up to the last seed this page holds
                    row = _Row.of(r)
                    held = self._walk_record(row)
                    chain.append(row)
                    records.append(held)
                    unseeded -= held
                    if not unseeded:
                        break
                cursor = chain[-1].parent_checkpoint_id
                writes = self._walk_writes(cur, chain, remaining)
                for row, held in zip(chain, records, strict=True):
                    for task_id, channel, packed in reversed(writes.get(row.checkpoint_id, [])):
                        if channel in remaining:
                            collected[channel].append((task_id, channel, unpack(packed, serde)))
                    found = [c for c in channels if c in remaining and c in held]
                    if found:
                        for ch, packed in self._walk_seed(row, found).items():
                            seed[ch] = unpack(packed, serde)
                        remaining.difference_update(found)
                    if not remaining:
                        break
            return self._history_out(channels, collected, seed)

        with self._lock:
            if self._walk_keys is not self.keys:  # other keys: nothing verified holds
                self._walk_rows.clear()
                self._walk_seeds.clear()
                self._walk_keys = self.keys
            return self.store.read(walk)

    @staticmethod
    def _history_out(
        channels: Sequence[str], collected: dict[str, builtins.list[Any]], seed: dict[str, Any]
    ) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for ch in channels:
            entry: dict[str, Any] = {"writes": builtins.list(reversed(collected[ch]))}
            if ch in seed:
                entry["seed"] = seed[ch]
            out[ch] = entry
        return out

    def _ancestor_page(
        self, cur: Any, thread_id: str, ns: str, newest: str, size: int
    ) -> dict[str, Any]:
        """Up to ``size`` rows of the namespace from checkpoint ``newest`` down (ids are
        time-ordered: every ancestor of a checkpoint has a smaller id), as read, by id."""
        q = self._q
        cur.execute(
            f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} AND "
            f"checkpoint_ns = {q} AND checkpoint_id <= {q} ORDER BY checkpoint_id DESC "
            f"LIMIT {int(size)}",
            (thread_id, ns, newest),
        )
        return {str(r[2]): r for r in cur.fetchall()}

    def _remember(self, memo: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
        memo[key] = value
        while len(memo) > limit:
            memo.popitem(last=False)

    def _walk_record(self, row: _Row) -> set[str]:
        """The channels checkpoint ``row`` holds a value for, from its record (one that
        predates naming them: from its state, loaded); the row verified (seal, then
        digest) unless this exact content was."""
        memo = self._walk_rows
        if row in memo:
            memo.move_to_end(row)
            held: set[str] = memo[row]
            return held
        self._verify(row)
        # Decoded, not built: the names are plain strings; nothing else is used.
        rec = self._decoded(row, row.record, "the record")
        names = rec.get("k") if isinstance(rec, dict) and "c" in rec and "m" in rec else ()
        if names is None:
            held = set(self._load_state(row))
        elif type(names) is list and all(type(n) is str for n in names):
            held = set(names)
        else:
            raise CorruptRecord(
                f"the record of LangGraph checkpoint {row.checkpoint_id!r} is malformed",
                run_id=row.run_id,
                seq=row.seq,
            )
        self._remember(memo, row, held, _WALK_ROWS)
        return held

    def _walk_writes(
        self, cur: Any, chain: Sequence[_Row], channels: Iterable[str]
    ) -> dict[str, builtins.list[tuple[str, str, Any]]]:
        """The pending writes to ``channels`` of the ``chain``'s checkpoints (one
        statement), each verified unless its exact content was, their values decoded but
        not built (:func:`unpack` builds them). Writes to other channels are not read
        (a walk never uses them)."""
        first = chain[0]
        q = self._q
        ids = [row.checkpoint_id for row in chain]
        names = sorted(channels)
        rows_by_id = {row.checkpoint_id: row for row in chain}
        sql = (
            f"SELECT checkpoint_id, {_WRITE_COLS} FROM oo_lg_writes "
            f"WHERE thread_id = {q} AND checkpoint_ns = {q} AND checkpoint_id IN "
            f"({', '.join([q] * len(ids))}) AND channel IN ({', '.join([q] * len(names))}) "
            "ORDER BY checkpoint_id, task_path, task_id, idx"
        )
        cur.execute(sql, (first.thread_id, first.checkpoint_ns, *ids, *names))
        out: dict[str, builtins.list[tuple[str, str, Any]]] = {}
        memo = self._walk_rows
        for r in cur.fetchall():
            cid = str(r[0])
            key = ("w", first.thread_id, first.checkpoint_ns, *_hashable_row(r))
            if key in memo:
                memo.move_to_end(key)
                write = memo[key]
            else:
                row = rows_by_id[cid]
                task_id, channel, data = self._verified_write(
                    first.thread_id, first.checkpoint_ns, cid, r[1:], row
                )
                write = (task_id, channel, self._decoded(row, data, "a pending write"))
                self._remember(memo, key, write, _WALK_ROWS)
            out.setdefault(cid, []).append(write)
        return out

    def _decoded(self, row: _Row, data: bytes, what: str, *, build: bool = False) -> Any:
        """Stored canonical bytes of checkpoint ``row`` (its record, one of its writes)
        decoded; built too with ``build`` (else :func:`unpack` builds them)."""
        try:
            value = self._codec.decode(unseal(data))
            return unpack(value, self.serde) if build else value
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"{what} of LangGraph checkpoint {row.checkpoint_id!r} is unreadable",
                run_id=row.run_id,
                seq=row.seq,
            ) from exc

    def _walk_seed(self, row: _Row, channels: Sequence[str]) -> dict[str, Any]:
        """The stored (not built) values of ``channels`` at checkpoint ``row``, whose
        record says it holds them: its state loaded (every row verified) unless a seed
        was built before for this exact row.

        Raises:
            CorruptRecord: The state does not hold a channel its record names.
        """
        memo = self._walk_seeds
        key = (row, tuple(channels))
        if key in memo:
            memo.move_to_end(key)
            values: dict[str, Any] = memo[key]
            return values
        state = self._load_state(row)
        missing = [c for c in channels if c not in state]
        if missing:
            raise CorruptRecord(
                f"LangGraph checkpoint {row.checkpoint_id!r} holds no value for "
                f"{', '.join(map(repr, missing))}, which its record names",
                run_id=row.run_id,
                seq=row.seq,
            )
        values = {c: state[c] for c in channels}
        self._remember(memo, key, values, _WALK_SEEDS)
        return values

    def _row_query(
        self, thread_id: str, ns: str, checkpoint_id: str | None
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement reading checkpoint ``checkpoint_id``'s row, or the namespace's
        latest without one."""
        q = self._q
        sql = (
            f"SELECT {_CK_COLS} FROM oo_lg_checkpoints "
            f"WHERE thread_id = {q} AND checkpoint_ns = {q}"
        )
        if checkpoint_id:
            return f"{sql} AND checkpoint_id = {q}", (thread_id, ns, str(checkpoint_id))
        return f"{sql} ORDER BY checkpoint_id DESC LIMIT 1", (thread_id, ns)

    def _row_at(self, cur: Any, thread_id: str, ns: str, checkpoint_id: str | None) -> _Row | None:
        """Checkpoint ``checkpoint_id``'s row (the namespace's latest without one), read
        with ``cur``."""
        sql, params = self._row_query(thread_id, ns, checkpoint_id)
        cur.execute(sql, params)
        found = cur.fetchone()
        return None if found is None else _Row.of(found)

    # -- delete, copy, prune -----------------------------------------------------------
    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread (all namespaces), with the
        channel values and the blobs only they used."""
        tid = str(thread_id)
        q = self._q

        def runs_of(cur: Any) -> set[str]:
            cur.execute(f"SELECT run_id FROM oo_lg_threads WHERE thread_id = {q}", (tid,))
            runs = {str(r[0]) for r in cur.fetchall()}
            cur.execute(
                f"SELECT DISTINCT run_id FROM oo_lg_checkpoints WHERE thread_id = {q}", (tid,)
            )
            runs.update(str(r[0]) for r in cur.fetchall())
            return runs

        def delete(cur: Any) -> None:
            # The thread's store runs held first (a put into one holds it too), read
            # again until no new one appears: a put either committed before (its rows
            # are deleted here) or waits and then finds its run gone (it starts anew).
            runs: set[str] = set()
            while (found := runs_of(cur)) - runs:
                runs |= found
                self._hold_runs(cur, runs)
            for table in ("oo_lg_writes", "oo_lg_checkpoints", "oo_lg_threads"):
                cur.execute(f"DELETE FROM {table} WHERE thread_id = {q}", (tid,))
            _schema.drop_store_runs(cur, self.store.dialect, q, runs)

        with self._lock:
            self.store.transact(delete)
            self._forget(lambda key: key[0] == tid)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) whose metadata names one of
        ``run_ids``; the namespaces they were in are rewritten without their values."""
        ids = sorted({str(r) for r in run_ids})
        if not ids:
            return
        q = self._q
        marks = ", ".join([q] * len(ids))

        def affected(cur: Any) -> list[tuple[str, str]]:
            cur.execute(
                "SELECT DISTINCT thread_id, checkpoint_ns FROM oo_lg_checkpoints "
                f"WHERE lg_run_id IN ({marks})",
                ids,
            )
            return [(str(r[0]), str(r[1])) for r in cur.fetchall()]

        gone = set(ids)
        with self._lock:
            for thread_id, ns in self.store.read(affected):
                self._rewrite(
                    thread_id, ns, lambda rows: [r for r in rows if r.lg_run_id not in gone]
                )

    def prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        """Prune threads: ``"keep_latest"`` keeps the newest checkpoint of each
        namespace (and its writes), stored afresh as a keyframe; ``"delete"`` deletes
        the threads.

        Raises:
            ConfigurationError: Unknown strategy.
        """
        if strategy not in ("keep_latest", "delete"):
            raise ConfigurationError(
                f"prune strategy must be 'keep_latest' or 'delete', not {strategy!r}"
            )
        q = self._q
        for thread_id in thread_ids:
            tid = str(thread_id)
            if strategy == "delete":
                self.delete_thread(tid)
                continue

            def namespaces(cur: Any, tid: str = tid) -> list[str]:
                cur.execute(
                    f"SELECT DISTINCT checkpoint_ns FROM oo_lg_checkpoints WHERE thread_id = {q}",
                    (tid,),
                )
                return [str(r[0]) for r in cur.fetchall()]

            with self._lock:
                for ns in self.store.read(namespaces):
                    self._rewrite(tid, ns, lambda rows: [max(rows, key=lambda r: r.checkpoint_id)])

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint (all namespaces, same ids) and write of a thread to
        another thread. A source without checkpoints copies nothing."""
        src, dst = str(source_thread_id), str(target_thread_id)
        q = self._q

        def read(cur: Any) -> tuple[list[_Row], list[Any], list[dict[str, Any]]]:
            cur.execute(
                f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} "
                "ORDER BY checkpoint_ns, seq",
                (src,),
            )
            rows = [_Row.of(r) for r in cur.fetchall()]
            cur.execute(
                f"SELECT checkpoint_ns, checkpoint_id, {_WRITE_COLS} FROM oo_lg_writes "
                f"WHERE thread_id = {q}",
                (src,),
            )
            found = cur.fetchall()
            for row in rows:
                self._verify(row)
            # The values in the same read: of the same moment as the rows naming them.
            return rows, found, [self._load_state(row) for row in rows]

        with self._lock:
            rows, found, states = self.store.read(read)
            if not rows:
                return
            # Nothing unverified is sealed afresh under the target thread.
            writes = []
            for ns, cid, *cols in found:
                self._verified_write(src, str(ns), str(cid), cols)
                task_id, idx, channel, path, value = cols[:5]
                writes.append((str(ns), str(cid), str(task_id), int(idx), channel, path, value))
            placed: list[tuple[_Row, str, int]] = []
            for row, state in zip(rows, states, strict=True):
                run_id = self._run_for(dst, row.checkpoint_ns)
                step = _core_step("copy", row.checkpoint_id)
                info = self.store.save(run_id, state, step=step, durability=_TOGETHER)
                placed.append((row, run_id, info.seq))
            sql = self._insert_writes_sql(replace=False)

            def write(cur: Any) -> None:
                for row, run_id, seq in placed:
                    self._upsert_row(
                        cur,
                        dst,
                        row.checkpoint_ns,
                        row.checkpoint_id,
                        row.parent_checkpoint_id,
                        run_id,
                        seq,
                        row.lg_run_id,
                        row.record,
                    )
                copied = [
                    self._write_row(dst, ns, cid, task_id, idx, str(channel), str(path), bytes(v))
                    for ns, cid, task_id, idx, channel, path, v in writes
                ]
                if copied:
                    cur.executemany(sql, copied)

            try:
                # The copies' values commit with their rows or not at all.
                self.store.transact(write, together={r for _, r, _ in placed})
            except (ConcurrentWrite, _Stale):
                self._forget(lambda key: key[0] == dst)
                raise

    # -- internals ---------------------------------------------------------------------
    def _run_for(self, thread_id: str, ns: str) -> str:
        """The store run of a namespace, created (with its mapping row) if new."""
        key = (thread_id, ns)
        run_id = self._runs.get(key)
        if run_id is not None:
            self._runs.move_to_end(key)
            return run_id
        q = self._q
        run_id = self.store.read(lambda cur: self._mapped_run_at(cur, thread_id, ns))
        if run_id is None:
            fresh = uuid.uuid4().hex
            self.store.create_run(
                _FLOW,
                run_id=fresh,
                handoff=Handoff(goal=f"LangGraph thread {thread_id!r}, namespace {ns!r}"),
            )

            def claim(cur: Any) -> str:
                cur.execute(
                    "INSERT INTO oo_lg_threads (thread_id, checkpoint_ns, run_id, created_at, "
                    f"seal) VALUES ({q}, {q}, {q}, {q}, {q}) ON CONFLICT DO NOTHING",
                    (thread_id, ns, fresh, time.time(), self._thread_seal(thread_id, ns, fresh)),
                )
                winner = self._mapped_run_at(cur, thread_id, ns)
                assert winner is not None  # inserted, or another saver's stands
                if winner != fresh:  # another saver created the namespace first
                    _schema.drop_store_runs(cur, self.store.dialect, q, [fresh])
                return winner

            run_id = self.store.transact(claim)
        self._runs[key] = run_id
        while len(self._runs) > _RUN_CACHE:
            self._runs.popitem(last=False)
        return run_id

    def _mapped_run_at(self, cur: Any, thread_id: str, ns: str) -> str | None:
        """The store run a namespace's thread row names (its seal checked), read with
        ``cur``; None when the namespace has none."""
        q = self._q
        cur.execute(
            f"SELECT thread_id, checkpoint_ns, run_id, seal FROM oo_lg_threads WHERE "
            f"thread_id = {q} AND checkpoint_ns = {q}",
            (thread_id, ns),
        )
        found = cur.fetchone()
        return None if found is None else self._mapped_run(found)

    def _thread_seal(self, thread_id: str, ns: str, run_id: str) -> bytes | None:
        return _schema.make_seal(
            self.keys, _schema.THREADS, _schema.thread_parts(thread_id, ns, run_id)
        )

    def _mapped_run(self, found: Sequence[Any]) -> str:
        """The store run of a thread row (thread, namespace, run, seal), its seal checked."""
        thread_id, ns, run_id, sealed = found
        _schema.check(
            self.keys,
            _schema.THREADS,
            _schema.thread_parts(thread_id, ns, run_id),
            None if sealed is None else bytes(sealed),
            what=f"the store run of LangGraph thread {thread_id!r} (namespace {ns!r})",
            run_id=str(run_id),
        )
        return str(run_id)

    def _forget(self, match: Any) -> None:
        for key in [k for k in self._runs if match(k)]:
            del self._runs[key]

    def _upsert_row(
        self,
        cur: Any,
        thread_id: str,
        ns: str,
        cid: str,
        parent: str | None,
        run_id: str,
        seq: int,
        lg_run: str | None,
        record: bytes,
    ) -> None:
        """Write a checkpoint's row, naming the store checkpoint ``(run_id, seq)``.

        Raises:
            _Stale: That store checkpoint is not there. The row is written only for
                values that are: in the same transaction (exit durability) or committed
                before it (sync); the check is the insert's own condition.
        """
        q = self._q
        parts = _schema.checkpoint_parts(thread_id, ns, cid, parent, run_id, seq, lg_run, record)
        dg = _schema.checkpoint_digest(parts)
        sealed = _schema.make_seal(self.keys, _schema.CHECKPOINTS, parts)
        cur.execute(
            f"INSERT INTO oo_lg_checkpoints ({_CK_COLS}, created_at) SELECT "
            f"{', '.join([q] * 11)} WHERE EXISTS (SELECT 1 FROM oo_checkpoints "
            f"WHERE run_id = {q} AND seq = {q}) "
            "ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id) "
            "DO UPDATE SET parent_checkpoint_id = excluded.parent_checkpoint_id, "
            "run_id = excluded.run_id, seq = excluded.seq, lg_run_id = excluded.lg_run_id, "
            "record = excluded.record, digest = excluded.digest, seal = excluded.seal, "
            "created_at = excluded.created_at",
            (
                *(thread_id, ns, cid, parent, run_id, seq, lg_run, record, dg, sealed),
                time.time(),
                run_id,
                seq,
            ),
        )
        if cur.rowcount != 1:
            raise _Stale(f"store run {run_id!r} has no checkpoint {seq}")

    def _insert_writes_sql(self, *, replace: bool) -> str:
        q = self._q
        action = (
            "DO UPDATE SET channel = excluded.channel, task_path = excluded.task_path, "
            "value = excluded.value, digest = excluded.digest, seal = excluded.seal"
            if replace
            else "DO NOTHING"
        )
        return (
            "INSERT INTO oo_lg_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, "
            f"channel, task_path, value, digest, seal) VALUES ({', '.join([q] * 10)}) "
            f"ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id, task_id, idx) {action}"
        )

    def _writes_of(self, cur: Any, rows: Sequence[_Row]) -> builtins.list[builtins.list[Any]]:
        """The pending-write rows of each of ``rows`` (as :meth:`_select_writes` orders
        them), one statement per thread and namespace among them."""
        keys = [(row.thread_id, row.checkpoint_ns, row.checkpoint_id) for row in rows]
        found: dict[_Key, builtins.list[Any]] = {}
        for (thread_id, ns), ids in _by_namespace(keys).items():
            sql, params = self._in_namespace(
                f"SELECT checkpoint_id, {_WRITE_COLS} FROM oo_lg_writes", thread_id, ns, ids
            )
            cur.execute(sql + " ORDER BY checkpoint_id, task_path, task_id, idx", params)
            for r in cur.fetchall():
                found.setdefault((thread_id, ns, str(r[0])), []).append(tuple(r[1:]))
        return [found.get(key, []) for key in keys]

    def _select_writes(self, cur: Any, rows: Sequence[_Row]) -> builtins.list[Any]:
        q = self._q
        out: builtins.list[Any] = []
        for row in rows:
            cur.execute(
                f"SELECT {_WRITE_COLS} FROM oo_lg_writes "
                f"WHERE thread_id = {q} AND checkpoint_ns = {q} AND checkpoint_id = {q} "
                "ORDER BY task_path, task_id, idx",
                (row.thread_id, row.checkpoint_ns, row.checkpoint_id),
            )
            out.extend(cur.fetchall())
        return out

    def _verify(self, row: _Row) -> None:
        """Check a checkpoint row's seal (with keys), then its digest; nothing of it is
        decoded before."""
        parts = row.parts()
        _schema.check(
            self.keys,
            _schema.CHECKPOINTS,
            parts,
            row.seal,
            what=f"the record of LangGraph checkpoint {row.checkpoint_id!r} (thread "
            f"{row.thread_id!r}, namespace {row.checkpoint_ns!r})",
            run_id=row.run_id,
            seq=row.seq,
        )
        if _schema.checkpoint_digest(parts) != row.digest:
            raise CorruptRecord(
                f"the record of LangGraph checkpoint {row.checkpoint_id!r} (thread "
                f"{row.thread_id!r}, namespace {row.checkpoint_ns!r}) does not match its "
                f"digest (edited, truncated or moved)",
                run_id=row.run_id,
                seq=row.seq,
            )

    def _verified_write(
        self, thread_id: str, ns: str, cid: str, found: Sequence[Any], row: _Row | None = None
    ) -> tuple[str, str, bytes]:
        """A write row's (task id, channel, stored value), its seal (with keys) and digest
        checked; nothing of it is decoded."""
        task_id, idx, channel, path, value, dg, sealed = found
        parts = _schema.write_parts(thread_id, ns, cid, task_id, idx, channel, path, value)
        where = f"a pending write of LangGraph checkpoint {cid!r} (thread {thread_id!r})"
        run_id, seq = (None, None) if row is None else (row.run_id, row.seq)
        _schema.check(
            self.keys,
            _schema.WRITES,
            parts,
            None if sealed is None else bytes(sealed),
            what=where,
            run_id=run_id,
            seq=seq,
        )
        if _schema.write_digest(parts) != bytes(dg):
            raise CorruptRecord(f"{where} fails its digest", run_id=run_id, seq=seq)
        return str(task_id), str(channel), bytes(value)

    def _write_row(
        self,
        thread_id: str,
        ns: str,
        cid: str,
        task_id: str,
        idx: int,
        channel: str,
        path: str,
        data: bytes,
    ) -> tuple[Any, ...]:
        """The columns of a write row to insert (digest and seal computed)."""
        parts = _schema.write_parts(thread_id, ns, cid, task_id, idx, channel, path, data)
        return (
            thread_id,
            ns,
            cid,
            task_id,
            idx,
            channel,
            path,
            data,
            _schema.write_digest(parts),
            _schema.make_seal(self.keys, _schema.WRITES, parts),
        )

    def _record(self, row: _Row) -> dict[str, Any]:
        self._verify(row)
        return self._decode_record(row)

    def _decode_record(self, row: _Row) -> dict[str, Any]:
        """The record of a row :meth:`_verify` accepted."""
        rec = self._decoded(row, row.record, "the record", build=True)
        if not isinstance(rec, dict) or "c" not in rec or "m" not in rec:
            raise CorruptRecord(
                f"the record of LangGraph checkpoint {row.checkpoint_id!r} is malformed",
                run_id=row.run_id,
                seq=row.seq,
            )
        return rec

    def _load_state(self, row: _Row) -> dict[str, Any]:
        try:
            return self.store.load(row.run_id, row.seq).state
        except (RunNotFound, CheckpointNotFound) as exc:
            raise CorruptRecord(
                f"the channel values of LangGraph checkpoint {row.checkpoint_id!r} are missing",
                run_id=row.run_id,
                seq=row.seq,
            ) from exc

    def _tuple(
        self,
        row: _Row,
        writes: Iterable[Any],
        *,
        values: dict[str, Any] | None = None,
        verified: bool = False,
    ) -> CheckpointTuple:
        """``values``: the channel values, already built (else loaded here);
        ``verified``: the caller checked ``row`` (else it is checked here)."""
        # Every row is checked (seal, then digest) before anything of any is decoded.
        if not verified:
            self._verify(row)
        checked = [
            self._verified_write(row.thread_id, row.checkpoint_ns, row.checkpoint_id, w, row)
            for w in writes
        ]
        rec = self._decode_record(row)
        serde = self.serde
        if values is None:
            values = {k: unpack(v, serde) for k, v in self._load_state(row).items()}
        checkpoint = cast(Checkpoint, {**rec["c"], "channel_values": values})
        pending = []
        for task_id, channel, data in checked:
            value = self._decoded(row, data, "a pending write", build=True)
            pending.append((task_id, channel, value))
        config: RunnableConfig = {
            "configurable": {
                "thread_id": row.thread_id,
                "checkpoint_ns": row.checkpoint_ns,
                "checkpoint_id": row.checkpoint_id,
            }
        }
        parent: RunnableConfig | None = None
        if row.parent_checkpoint_id:
            parent = {
                "configurable": {
                    "thread_id": row.thread_id,
                    "checkpoint_ns": row.checkpoint_ns,
                    "checkpoint_id": row.parent_checkpoint_id,
                }
            }
        return CheckpointTuple(
            config, checkpoint, cast(CheckpointMetadata, rec["m"]), parent, pending
        )

    def _rewrite(self, thread_id: str, ns: str, keep: Any) -> None:
        """Store a namespace's surviving checkpoints (``keep(rows)``, rows in history
        order) in a new store run and drop the old one with everything else; read and
        rewritten again when another writer changed the namespace in between.

        Raises:
            ConcurrentWrite: The namespace kept changing under every attempt.
        """
        for attempt in range(_ATTEMPTS):
            try:
                self._rewrite_once(thread_id, ns, keep)
                return
            except ConcurrentWrite as exc:
                if attempt == _ATTEMPTS - 1:
                    exc.add_note(
                        f"LangGraph thread {thread_id!r} (namespace {ns!r}) changed under "
                        f"each of {_ATTEMPTS} attempts to rewrite it: another saver is "
                        f"putting into it. Nothing of it was removed; run this again when "
                        f"the thread is idle."
                    )
                    raise

    def _rewrite_once(self, thread_id: str, ns: str, keep: Any) -> None:
        """:meth:`_rewrite`, one attempt.

        Raises:
            ConcurrentWrite: The namespace's rows or its store run changed after they
                were read (a put from another saver): nothing was written.
        """
        q = self._q

        def read(cur: Any) -> tuple[list[_Row], list[str], list[_Row], list[dict[str, Any]]]:
            cur.execute(
                f"SELECT {_CK_COLS} FROM oo_lg_checkpoints WHERE thread_id = {q} AND "
                f"checkpoint_ns = {q} ORDER BY seq",
                (thread_id, ns),
            )
            rows = [_Row.of(r) for r in cur.fetchall()]
            cur.execute(
                "SELECT thread_id, checkpoint_ns, run_id, seal FROM oo_lg_threads WHERE "
                f"thread_id = {q} AND checkpoint_ns = {q}",
                (thread_id, ns),
            )
            mapped = [self._mapped_run(r) for r in cur.fetchall()]
            keep_rows = keep(rows) if rows else []
            if len(keep_rows) == len(rows):
                return rows, mapped, keep_rows, []
            keep_rows = sorted(keep_rows, key=lambda r: r.seq)
            for row in keep_rows:
                self._verify(row)
            # The survivors' values in the same read: of the same moment as their rows.
            return rows, mapped, keep_rows, [self._load_state(row) for row in keep_rows]

        rows, mapped, keep_rows, states = self.store.read(read)
        if len(keep_rows) == len(rows) and rows:
            return
        old_runs = {r.run_id for r in rows} | set(mapped)
        keep_ids = {r.checkpoint_id for r in keep_rows}
        placed: list[tuple[_Row, int]] = []
        new_run = uuid.uuid4().hex
        if keep_rows:
            self.store.create_run(
                _FLOW,
                run_id=new_run,
                handoff=Handoff(goal=f"LangGraph thread {thread_id!r}, namespace {ns!r}"),
            )
            for row, state in zip(keep_rows, states, strict=True):
                step = _core_step("rewrite", row.checkpoint_id)
                info = self.store.save(new_run, state, step=step, durability=_TOGETHER)
                placed.append((row, info.seq))
        dropped = [r.checkpoint_id for r in rows if r.checkpoint_id not in keep_ids]

        def write(cur: Any) -> None:
            # A put into the namespace holds its store run's row (PostgreSQL; SQLite
            # has one writer at a time): with the old runs held, the namespace is
            # checked to be as read, and no put can land in a run about to be dropped.
            self._hold_runs(cur, old_runs)
            cur.execute(
                f"SELECT checkpoint_id, run_id, seq FROM oo_lg_checkpoints WHERE "
                f"thread_id = {q} AND checkpoint_ns = {q}",
                (thread_id, ns),
            )
            now = {(str(c), str(r), int(n)) for c, r, n in cur.fetchall()}
            cur.execute(
                f"SELECT run_id FROM oo_lg_threads WHERE thread_id = {q} AND checkpoint_ns = {q}",
                (thread_id, ns),
            )
            mapped_now = sorted(str(r[0]) for r in cur.fetchall())
            if now != {(r.checkpoint_id, r.run_id, r.seq) for r in rows} or mapped_now != sorted(
                mapped
            ):
                newest = max(rows, key=lambda r: r.seq, default=None)
                raise ConcurrentWrite(
                    newest.run_id if newest else "", -1 if newest is None else newest.seq
                )
            where = f"thread_id = {q} AND checkpoint_ns = {q} AND checkpoint_id = {q}"
            for cid in dropped:
                cur.execute(f"DELETE FROM oo_lg_writes WHERE {where}", (thread_id, ns, cid))
                cur.execute(f"DELETE FROM oo_lg_checkpoints WHERE {where}", (thread_id, ns, cid))
            if placed:
                for row, seq in placed:
                    self._upsert_row(
                        cur,
                        thread_id,
                        ns,
                        row.checkpoint_id,
                        row.parent_checkpoint_id,
                        new_run,
                        seq,
                        row.lg_run_id,
                        row.record,
                    )
                cur.execute(
                    f"UPDATE oo_lg_threads SET run_id = {q}, seal = {q} WHERE thread_id = {q} "
                    f"AND checkpoint_ns = {q}",
                    (new_run, self._thread_seal(thread_id, ns, new_run), thread_id, ns),
                )
            else:
                cur.execute(
                    f"DELETE FROM oo_lg_threads WHERE thread_id = {q} AND checkpoint_ns = {q}",
                    (thread_id, ns),
                )
            _schema.drop_store_runs(cur, self.store.dialect, q, old_runs)

        try:
            # The new run's checkpoints commit with the rewrite or not at all.
            self.store.transact(write, together=(new_run,) if keep_rows else ())
        except BaseException:
            if keep_rows:  # its run row was committed on its own: not left behind
                self.store.transact(
                    lambda cur: _schema.drop_store_runs(cur, self.store.dialect, q, [new_run])
                )
            raise
        finally:
            self._runs.pop((thread_id, ns), None)

    def _hold_runs(self, cur: Any, run_ids: Iterable[str]) -> None:
        """Lock store runs' rows until the transaction ends (PostgreSQL; a SQLite writer
        holds the whole database already), in one order (no deadlock between two)."""
        ids = sorted(set(run_ids))
        if ids and self.store.dialect == "postgresql":
            q = self._q
            cur.execute(
                f"SELECT run_id FROM oo_runs WHERE run_id IN ({', '.join([q] * len(ids))}) "
                "ORDER BY run_id FOR UPDATE",
                ids,
            )
            cur.fetchall()


def _where(config: RunnableConfig) -> tuple[str, str, str | None]:
    """The thread, namespace and checkpoint id (None: the latest) ``config`` names."""
    conf = _conf(config)
    cid = get_checkpoint_id(config)
    return str(conf["thread_id"]), str(conf.get("checkpoint_ns", "")), cid and str(cid)


def _hashable_row(r: Sequence[Any]) -> tuple[Any, ...]:
    """A row's column values as a dict key (drivers may return a buffer for a blob)."""
    if _BUFFERS.isdisjoint(map(type, r)):
        return tuple(r)
    return tuple(bytes(v) if isinstance(v, memoryview | bytearray) else v for v in r)


_BUFFERS = frozenset({memoryview, bytearray})
# A saver's checkpoints wait for the transaction that writes their rows, on a store of
# any mode: a checkpoint's values never commit without its row, nor its row without them.
_TOGETHER = Durability.EXIT

_Key = tuple[str, str, str]
"""A checkpoint's (thread id, namespace, checkpoint id)."""


def _by_namespace(keys: Iterable[_Key]) -> dict[tuple[str, str], builtins.list[str]]:
    """The checkpoint ids of ``keys`` by thread and namespace (one statement each)."""
    groups: dict[tuple[str, str], builtins.list[str]] = {}
    for thread_id, ns, cid in keys:
        groups.setdefault((thread_id, ns), []).append(cid)
    return groups
