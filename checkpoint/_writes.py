"""Writing checkpoints: a run's first, then deltas on the cached head; loading through it."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _delta, _engine
from ._connections import _RawTxn
from ._engine import is_integrity_error, translate
from ._migrate import _upgrade
from ._reads import _Reads
from ._retry import retried
from ._sql import _DELTA, _KEYFRAME, _RUN_COLS
from ._state import _UNSET, _Head, _Pending
from .errors import CheckpointNotFound, ConcurrentWrite, ConfigurationError, RunExists, RunNotFound
from .failpoints import failpoint
from .records import (
    ENDED,
    CheckpointInfo,
    Durability,
    Handoff,
    Run,
    RunStatus,
    Snapshot,
    Source,
    StateMigrations,
)


@dataclass(frozen=True)
class _Change:
    """What a checkpoint changes on its run besides the state (written atomically with
    it); ``_UNSET`` / None: unchanged."""

    step: str
    next_step: Any = _UNSET
    status: RunStatus | str | None = None
    source: Source | str = Source.STEP
    schema_version: int | None = None
    handoff: Handoff | None = None
    durability: Durability | None = None
    # The dict channels of the new state found pageable (None: those of the parent's
    # that the change leaves alone).
    paged: frozenset[str] | None = None


class _Writes(_Reads):
    """Saving checkpoints (whole state or explicit changes) on the cached head, and
    loading a run's head into that cache (upgrading older state on the way)."""

    @retried("start a run", idempotent=False)
    def start_run(
        self,
        flow: str,
        state: Mapping[str, Any],
        *,
        run_id: str | None = None,
        step: str = "start",
        code_version: str = "0",
        state_version: int = 1,
        next_step: str | None = None,
        handoff: Handoff | None = None,
        status: RunStatus = RunStatus.RUNNING,
        source: Source | str = Source.STEP,
        key_run: str | None = None,
        also: Callable[[Any], Any] | None = None,
    ) -> tuple[Run, CheckpointInfo]:
        """Create a run and its first checkpoint in **one** transaction (durable on return,
        whatever the durability mode): a run never exists without its state.

        Args:
            flow, run_id, code_version, state_version, next_step, handoff: As in
                :meth:`create_run`.
            state: The first checkpoint's state (validated before anything is written).
            step: The first checkpoint's step name.
            status: The run's status once started.
            source: Who wrote the first checkpoint.
            key_run: The run whose effect keys this run shares (a fork's origin). It must
                exist when this commits (checked in the same transaction, so a fork never
                outlives its origin's removal by retention).
            also: More work ``also(cursor)`` for the same transaction (a fork's wait).

        Raises:
            RunExists: A run with ``run_id`` exists already; nothing was written.
            RunNotFound: ``key_run`` does not exist (any more); nothing was written.
            CodecError: A value cannot be encoded; nothing was written.
        """
        with self._lock:
            self._check_open()
            rid = run_id or uuid.uuid4().hex
            now = time.time()
            ops = _delta.diff({}, state, self.codec)
            # Written waiting: the first checkpoint moves it to ``status``.
            values = self._new_row(
                rid, flow, code_version, state_version, RunStatus.WAITING, next_step, handoff, now
            )
            base = self._run_from_row(values)
            change = _Change(step, next_step, status, source, state_version, handoff)
            pending, head = self._build(rid, None, ops, change, base)
            q = self._sql.q
            pg = self._dialect == "postgresql"

            def txn(cur: Any) -> None:
                if key_run is not None and key_run != rid:
                    # The origin must exist now, and stay while this commits: on
                    # PostgreSQL a share lock makes a concurrent retention delete of it
                    # wait (and then find this run's link); SQLite writers are serial.
                    lock = " FOR SHARE" if pg else ""
                    cur.execute(f"SELECT 1 FROM oo_runs WHERE run_id = {q}{lock}", (key_run,))
                    if cur.fetchone() is None:
                        raise RunNotFound(key_run)
                try:
                    cur.execute(
                        f"INSERT INTO oo_runs ({', '.join(_RUN_COLS)}) VALUES "
                        f"({', '.join([q] * len(_RUN_COLS))})",
                        tuple(values[c] for c in _RUN_COLS),
                    )
                except _engine.DRIVER_ERRORS as exc:
                    if is_integrity_error(exc):
                        raise RunExists(rid) from exc
                    raise
                if key_run is not None and key_run != rid:
                    cur.execute(
                        f"INSERT INTO oo_run_links (run_id, key_run, created_at) "
                        f"VALUES ({q}, {q}, {q})",
                        (rid, key_run, now),
                    )
                self._write_pending(cur, pending)
                if also is not None:
                    also(cur)

            failpoint("checkpoint.run.write")
            try:
                with translate("start a run"), _RawTxn(self, write=True) as cur:
                    txn(cur)
                    failpoint("checkpoint.commit.before")
            except BaseException:
                self._heads.pop(rid, None)
                raise
            failpoint("checkpoint.commit.after")
            self._remember(rid, head)
            assert head.run is not None
            return head.run, pending.info()

    def save(
        self,
        run_id: str,
        state: Mapping[str, Any],
        *,
        step: str,
        next_step: Any = _UNSET,
        status: RunStatus | str | None = None,
        source: Source | str = Source.STEP,
        schema_version: int | None = None,
        handoff: Handoff | None = None,
        parent: int | None = None,
        durability: Durability | str | None = None,
    ) -> CheckpointInfo:
        """Checkpoint the run's whole state; only what changed since the parent is stored.

        Dict channels are compared key by key and lists by appended suffix, so a step that
        changes five keys of a large dict or appends one message writes about that much.

        Args:
            run_id: The run.
            state: Mapping of channel name to value (any codec-encodable value).
            step: The step that produced this state.
            next_step: The run's next step, advanced atomically with the checkpoint.
            status: The run's new status, advanced atomically with the checkpoint.
            source: Who wrote it.
            schema_version: The state-schema version (default: the run's).
            handoff: The run's new handoff note, written atomically with the checkpoint.
            parent: The sequence number the caller built this state on (``-1``: the run
                must have no checkpoint yet); another head is a ``ConcurrentWrite``.
            durability: When this checkpoint becomes durable (default: the store's).
                Runs of different modes share one store: :meth:`flush` and every
                :meth:`transact` make all of them durable, whatever their mode. Give one
                run one mode (its checkpoints build on each other).

        Returns:
            The new checkpoint's metadata (durable on return in ``sync`` mode).

        Raises:
            CodecError: A value cannot be encoded; nothing was written.
            ConcurrentWrite: Another writer advanced the run (or its head is not
                ``parent``); nothing was written.
        """
        mode = self._mode(durability)
        with self._lock:
            head = self._parent_head(run_id, parent)
            old, known = (head.state, head.paged) if head is not None else ({}, frozenset())
            ops, paged = _delta.diff_known(old, state, self.codec, known)
            change = _Change(step, next_step, status, source, schema_version, handoff, mode, paged)
            return self._commit_ops(run_id, head, ops, change)

    def update(
        self,
        run_id: str,
        *,
        step: str,
        set: Mapping[str, Any] | None = None,
        merge: Mapping[str, Mapping[str, Any]] | None = None,
        append: Mapping[str, Sequence[Any]] | None = None,
        delete: Iterable[str] = (),
        next_step: Any = _UNSET,
        status: RunStatus | str | None = None,
        source: Source | str = Source.STEP,
        schema_version: int | None = None,
        handoff: Handoff | None = None,
        parent: int | None = None,
        durability: Durability | str | None = None,
    ) -> CheckpointInfo:
        """Checkpoint explicit changes: O(changed) work, no comparison with the parent.

        Args:
            set: Channels replaced by new values.
            merge: For dict channels, keys to set (to remove keys of a dict, use
                :meth:`save` with the whole state).
            append: For list channels, items to append.
            delete: Channels to remove.

        Other arguments and errors as in :meth:`save`.
        """
        mode = self._mode(durability)
        with self._lock:
            head = self._parent_head(run_id, parent)
            current = head.state if head else {}
            ops: dict[str, _delta.Op] = {}
            for ch, v in (set or {}).items():
                ops[ch] = ("s", v)
            for ch, kv in (merge or {}).items():
                if type(current.get(ch)) is not dict:
                    raise ConfigurationError(f"cannot merge into channel {ch!r}: not a dict")
                if not all(type(k) is str and k[:1] != "\x00" for k in kv):
                    raise ConfigurationError("merge keys must be strings not starting with NUL")
                ops[ch] = ("m", dict(kv), [])
            for ch, items in (append or {}).items():
                if type(current.get(ch)) not in (list, _delta.ChunkedList):
                    raise ConfigurationError(f"cannot append to channel {ch!r}: not a list")
                ops[ch] = ("a", list(items))
            for ch in delete:
                ops[ch] = ("x",)
            for ch in ops:
                _delta.check_channel(ch)
            change = _Change(step, next_step, status, source, schema_version, handoff, mode)
            return self._commit_ops(run_id, head, ops, change)

    def _mode(self, durability: Durability | str | None) -> Durability:
        """The durability of one save: ``durability``, or the store's."""
        if durability is None:
            return self.durability
        try:
            return Durability(durability)
        except ValueError:
            raise ConfigurationError(
                f"durability must be one of {[d.value for d in Durability]}, not {durability!r}"
            ) from None

    def _parent_head(self, run_id: str, parent: int | None) -> _Head | None:
        """The head a save builds on, under the lock: ``parent`` if given (else
        :class:`ConcurrentWrite`), after any loss of the run's queued checkpoints was
        reported (:class:`CheckpointLost`)."""
        self._check_open()
        self._take_lost(run_id)
        head = self._head(run_id)
        _check_parent(run_id, head, parent)
        return head

    def _commit_ops(
        self, run_id: str, head: _Head | None, ops: dict[str, _delta.Op], change: _Change
    ) -> CheckpointInfo:
        mode = change.durability or self.durability
        if self._unwritten.get(run_id) and (
            mode is Durability.SYNC or self._queued_mode.get(run_id, mode) is not mode
        ):
            # The run's earlier checkpoints wait in another mode's queue (an operator's
            # sync edit of an async run in this process): they are written first, in order.
            self.flush()
        base = self.get_run(run_id) if head is None else None
        pending, new_head = self._build(run_id, head, ops, change, base)
        self._remember(run_id, new_head)
        if mode is Durability.ASYNC:
            self._start_writer()
        if mode is Durability.SYNC:
            try:
                self._write_batch([pending], isolate=False)
            except BaseException:
                self._heads.pop(run_id, None)
                raise
            return pending.info()
        with self._count_lock:
            self._unwritten[run_id] = self._unwritten.get(run_id, 0) + 1
            self._queued_mode[run_id] = mode
        if mode is Durability.ASYNC:
            self._queue.put(pending)
        else:
            self._pending.append(pending)
        return pending.info()

    def _build(
        self,
        run_id: str,
        head: _Head | None,
        ops: dict[str, _delta.Op],
        change: _Change,
        base: Run | None,
    ) -> tuple[_Pending, _Head]:
        """Encode the checkpoint that applies ``ops`` and ``change`` on top of ``head``
        (None: the run's first, on top of the run row ``base``); returns it and the
        advanced head (the cached head object itself, changed in place)."""
        step, next_step, status, handoff = (
            change.step,
            change.next_step,
            change.status,
            change.handoff,
        )
        schema_version = change.schema_version
        src = Source(change.source).value
        run_values: dict[str, Any] = {}
        if handoff is not None:
            run_values["handoff"] = self._encode_handoff(handoff)
        if next_step is not _UNSET:
            run_values["next_step"] = next_step
        ended = status is not None and RunStatus(status) in ENDED
        if status is not None:
            run_values["status"] = RunStatus(status).value
        if ended:
            # An ended run holds no lease: cleared in the write that ends it, so no reader
            # sees a completed run still leased by the worker that completed it.
            run_values["lease_owner"] = None
            run_values["lease_expires_at"] = None
        # Encode the delta first: it validates every new value, so an unencodable one
        # fails here with nothing written and the cached head untouched.
        enc = _delta.encode_delta(self.codec, ops)
        if head is None:
            assert base is not None
            version = schema_version or base.state_version
            new_head = _Head(-1, 0, 0, 0, 0, version, {}, run=base)
            parent_digest = b""
        else:
            version = schema_version or head.schema_version
            new_head = head
            parent_digest = b"" if head.info is None else head.info.digest
        run_values["state_version"] = version
        seq = new_head.seq + 1
        policy = self.keyframes
        keyframe = (
            head is None
            or version != head.schema_version
            or new_head.deltas >= policy.max_deltas
            or new_head.delta_bytes >= policy.replay_ratio * max(new_head.keyframe_bytes, 1)
        )
        try:
            for ch, op in ops.items():
                if op[0] != "a":  # the sealed chunks remembered for it no longer apply
                    new_head.lists.pop(ch, None)
            _delta.apply(new_head.state, _copy_ops(ops), where="save")
            new_head.paged = new_head.paged - ops.keys() if change.paged is None else change.paged
            if keyframe:
                enc = _delta.encode_keyframe(self.codec, new_head.state, new_head.lists)
                kind, kf_seq = _KEYFRAME, seq
            else:
                kind, kf_seq = _DELTA, new_head.keyframe_seq
        except BaseException:
            self._heads.pop(run_id, None)  # the cached state may hold part of the change
            raise
        created = time.time()
        pending = _Pending(
            run_id=run_id,
            seq=seq,
            kind=kind,
            keyframe_seq=kf_seq,
            step=step,
            source=src,
            schema_version=version,
            created_at=created,
            body=_delta.pack(enc.raw),
            digest=_delta.row_digest(
                run_id, seq, kind, kf_seq, version, step, src, created, enc.raw
            ),
            blobs={h: _delta.pack(raw) for h, raw in enc.blobs.items()},
            refs=enc.refs,
            run_values=run_values,
            parent_digest=parent_digest,
            reported=self._reported.get(run_id, 0),
            gen=self._gen,
        )
        new_head.seq = seq
        new_head.schema_version = version
        new_head.info = pending.info()
        if new_head.run is not None:
            new_head.run = dataclasses.replace(
                new_head.run,
                status=RunStatus(status) if status is not None else new_head.run.status,
                next_step=new_head.run.next_step if next_step is _UNSET else next_step,
                handoff=new_head.run.handoff if handoff is None else handoff,
                state_version=version,
                head_seq=seq,
                updated_at=created,
            )
            if ended:
                new_head.run = dataclasses.replace(
                    new_head.run, lease_owner=None, lease_expires_at=None
                )
        if keyframe:
            new_head.keyframe_seq = seq
            new_head.deltas = 0
            new_head.delta_bytes = 0
            new_head.keyframe_bytes = enc.state_bytes
        else:
            new_head.deltas += 1
            new_head.delta_bytes += len(enc.raw)
        return pending, new_head

    def _head(self, run_id: str) -> _Head | None:
        head = self._heads.get(run_id)
        if head is not None:
            self._heads.move_to_end(run_id)
            return head
        # Not cached (new to this process, or evicted): whatever this process queued for
        # the run must be in the database before the head is read from there.
        self._flush_locked_pending()
        if self._writer is not None:
            self.flush()
        try:
            _, head = self._load(run_id, None, lazy=True)
        except CheckpointNotFound:
            return None
        self._remember(run_id, head)
        return head

    def load_each(
        self, run_id: str, seqs: Iterable[int]
    ) -> Iterator[tuple[CheckpointInfo, Mapping[str, Any]]]:
        """The states of several checkpoints of a run, oldest first, from one read: each
        row from the first one's keyframe to the last one is read and integrity-checked
        once, and the states are built walking forward (listing a history this way costs
        one walk, not one load per checkpoint).

        Each state is the walk's own and changes as the walk goes on: read (or copy)
        what you need before asking for the next one. Nothing is cached.

        Raises:
            CheckpointNotFound: A checkpoint is not there (before the first state).
            CorruptRecord: A row or blob failed its check (every row and blob is checked
                before the first state); or, during the walk, a checked body that cannot
                be applied.
        """
        want = {int(s) for s in seqs}
        if not want:
            return iter(())
        with self._lock:
            self._check_open()
            self.flush()
        rows, bodies, blobs = self._load_range(run_id, min(want), max(want))
        present = {row.seq for row in rows}
        missing = sorted(want - present)
        if missing:
            raise CheckpointNotFound(run_id, missing[0])
        return self._states_in(run_id, rows, bodies, blobs, want)

    def load(
        self,
        run_id: str,
        seq: int | None = None,
        *,
        lazy: bool = False,
        migrations: StateMigrations | None = None,
        report_lost: bool = True,
    ) -> Snapshot:
        """Load the latest checkpoint (or checkpoint ``seq``) of a run.

        Reads one keyframe and the deltas after it: the cost does not grow with the
        length of the run's history. Every row and blob read is integrity-checked.

        With ``lazy=True``, long list channels (message histories) come back as
        :class:`~checkpoint.ChunkedList`: their sealed chunks are read on first access, so
        resuming costs the same whatever the length of the history.

        When ``migrations`` (or the store's default) is given and the checkpoint's state
        is older, the upgrades run; loading the latest checkpoint then records the result
        as a new checkpoint with source ``migration``.

        A queued (``async`` / ``exit``) checkpoint of the run that lost its race to
        another writer is reported once, to the next load of the latest checkpoint, as
        :class:`CheckpointLost`. With ``report_lost=False`` the report is taken without
        being raised and the head that stands is read: for a caller that handles a lost
        race by reading again (the runtime runs the step again; an operator acts on the
        head that stands).

        Raises:
            RunNotFound / CheckpointNotFound: Nothing to load.
            CheckpointLost: As above (not with ``report_lost=False``).
            CorruptRecord: A row or blob failed its check; nothing is returned.
            StateVersionError: The checkpoint is newer than ``migrations.current``, or an
                upgrade is missing.
        """
        with self._lock:
            self._check_open()
            self.flush()
            if seq is None:
                self._take_lost(run_id, report_lost)
            snap, head = self._load(run_id, seq, lazy=lazy)
            if seq is None:
                self._remember(run_id, head)
                snap = Snapshot(_delta.private_copy(snap.state), snap.info)
            mig = migrations or self.migrations
            if mig is None or snap.info.schema_version == mig.current:
                return snap
            snap = Snapshot({k: _delta.plain(v) for k, v in snap.state.items()}, snap.info)
            upgraded = _upgrade(run_id, snap, mig)
            if seq is not None and seq != self._load_head_seq(run_id):
                return Snapshot(upgraded, snap.info)
            info = self.save(
                run_id,
                upgraded,
                step=snap.info.step,
                source=Source.MIGRATION,
                schema_version=mig.current,
                durability=Durability.SYNC,  # written (or its lost race raised) here
            )
            self.flush()
            return Snapshot(_delta.private_copy(upgraded), info)

    def load_run(
        self,
        run_id: str,
        *,
        lazy: bool = False,
        migrations: StateMigrations | None = None,
        report_lost: bool = True,
    ) -> tuple[Run, Snapshot | None]:
        """The run row and its latest checkpoint as **one consistent snapshot**.

        Status, next step, head and state all come from the same moment: read together in
        one statement from the database, or, while this process still has checkpoints of
        the run queued (``async`` / ``exit`` durability), this process's own view as of
        its last checkpoint (ahead of the database, and what the database will hold once
        they are written; a queued checkpoint that loses a race to another writer is
        dropped and the next call reads the database again). A caller that acts on the
        snapshot fences its effects on ``(head seq, digest)`` of the returned checkpoint.

        Args:
            run_id: The run.
            lazy: As in :meth:`load`.
            migrations: As in :meth:`load`: older state is upgraded and the upgrade is
                recorded as a checkpoint (source ``migration``) before it is returned.
            report_lost: As in :meth:`load`.

        Returns:
            The run and its latest checkpoint (None when it has none yet).

        Raises:
            RunNotFound: No such run.
            CorruptRecord: A row or blob failed its check; nothing is returned.
            StateVersionError: As in :meth:`load`.
            CheckpointLost: As in :meth:`load`.
        """
        with self._lock:
            self._check_open()
            self._take_lost(run_id, report_lost)
            head = self._heads.get(run_id)
            with self._count_lock:
                ahead = self._unwritten.get(run_id, 0) > 0 and run_id not in self._stale_runs
            if ahead and head is not None and head.run is not None and head.info is not None:
                run = head.run
                snap = Snapshot(_delta.private_copy(head.state), head.info)
            else:
                run, loaded = self._load_run_rows(run_id, lazy=lazy)
                if loaded is None:
                    return run, None
                snap, head = loaded
                head.run = run
                self._remember(run_id, head)
                snap = Snapshot(_delta.private_copy(snap.state), snap.info)
            mig = migrations or self.migrations
            if mig is None or snap.info.schema_version == mig.current:
                return run, snap
            plain = Snapshot({k: _delta.plain(v) for k, v in snap.state.items()}, snap.info)
            upgraded = _upgrade(run_id, plain, mig)
            info = self.save(
                run_id,
                upgraded,
                step=snap.info.step,
                source=Source.MIGRATION,
                schema_version=mig.current,
                parent=snap.info.seq,
                durability=Durability.SYNC,  # written (or its lost race raised) here
            )
            self.flush()
            run = dataclasses.replace(run, head_seq=info.seq, state_version=mig.current)
            return run, Snapshot(_delta.private_copy(upgraded), info)


def _copy_ops(ops: Mapping[str, _delta.Op]) -> dict[str, _delta.Op]:
    out: dict[str, _delta.Op] = {}
    for ch, op in ops.items():
        if op[0] == "s":
            out[ch] = ("s", _delta.private_copy(_delta.plain(op[1])))
        elif op[0] == "m":
            out[ch] = ("m", _delta.private_copy(op[1]), list(op[2]))
        elif op[0] == "a":
            out[ch] = ("a", _delta.private_copy(op[1]))
        else:
            out[ch] = op
    return out


def _check_parent(run_id: str, head: _Head | None, parent: int | None) -> None:
    """Refuse a checkpoint built on another head than ``parent`` (-1: no checkpoint yet).

    The head is the store's own (cached, or read under its lock), so a checkpoint written
    through this same Store object since the caller's load is caught here; another
    process's is caught by the commit's compare-and-set.
    """
    if parent is not None and (-1 if head is None else head.seq) != parent:
        raise ConcurrentWrite(run_id, parent)
