"""onceonly's checkpoint store, through its public API only."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import workload
from onceonly.checkpoint import Durability, KeyframePolicy, Store

from . import AtPoint, LoadResult, System, WriteResult

RUN_ID = "bench-run"
_FLUSH_EVERY = 1000  # build: bound the queued checkpoints of the ``exit`` mode


def _url(db: Path) -> str:
    return f"sqlite:///{db}"


class OnceOnly(System):
    """``mode="update"``: ``update(merge=..., append=..., set=...)``, the natural API for
    a step that knows what it changed; ``mode="save"``: ``save(state)`` of the whole
    state, which onceonly diffs against its cached head. ``lazy``: resume with
    ``load(lazy=True)`` (list channels read chunk by chunk on first access)."""

    def __init__(self, mode: str, *, lazy: bool = False) -> None:
        if mode not in ("update", "save"):
            raise ValueError(mode)
        self.mode = mode
        self.lazy = lazy  # W3 resume: ``load(lazy=True)``, where the store offers it
        self.name = "onceonly-lazy" if lazy else "onceonly" if mode == "update" else "onceonly-save"

    def _step(self, store: Store, state: workload.State, ch: workload.Step) -> None:
        if self.mode == "update":
            store.update(
                RUN_ID,
                step=str(ch.s),
                merge={"kv": ch.kv},
                append={"messages": [ch.message]},
                set={"step": ch.s},
            )
        else:
            workload.apply_step(state, ch)
            store.save(RUN_ID, state, step=str(ch.s))

    def _start(self, store: Store) -> workload.State:
        store.create_run("bench", run_id=RUN_ID, next_step="1")
        state = workload.initial_state()
        store.save(RUN_ID, state, step="0")
        return state

    def write_w2(self, db: Path, steps: int) -> WriteResult:
        store = Store.open(_url(db), durability=Durability.SYNC, keyframes=KeyframePolicy())
        try:
            state = self._start(store)
            write_s: list[float] = []
            step_s: list[float] = []
            clock = time.perf_counter
            t_first = clock()
            for s in range(1, steps + 1):
                t0 = clock()
                ch = workload.step_changes(s)
                t1 = clock()
                self._step(store, state, ch)
                t2 = clock()
                write_s.append(t2 - t1)
                step_s.append(t2 - t0)
            total = clock() - t_first
            history = store.history(RUN_ID)
        finally:
            store.close()
        keyframes = [i.seq for i in history if i.keyframe]
        return WriteResult(
            write_s,
            step_s,
            total,
            extra={"checkpoints": len(history), "keyframe_seqs": keyframes},
        )

    def load_w2(self, db: Path, steps: int) -> LoadResult:
        clock = time.perf_counter
        t0, c0 = clock(), time.process_time()
        store = Store.open(_url(db))
        t1 = clock()
        snap = store.load(RUN_ID)
        t2, c2 = clock(), time.process_time()
        return LoadResult(
            t2 - t0,
            snap.state,
            {"open_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "cpu_ms": (c2 - c0) * 1e3},
            {
                "seq": snap.info.seq,
                "keyframe_seq": snap.info.keyframe_seq,
                "messages_type": type(snap.state.get("messages")).__name__,
            },
            close=store.close,
        )

    def build(self, db: Path, points: Sequence[int], at_point: AtPoint) -> dict[str, Any]:
        # ``exit`` durability queues checkpoints and writes them in one transaction at
        # ``flush``: the same rows (keyframe choices do not depend on durability), fewer
        # fsyncs.
        store = Store.open(_url(db), durability=Durability.EXIT, keyframes=KeyframePolicy())
        try:
            state = self._start(store)
            store.flush()
            todo = sorted(points)
            for s in range(1, todo[-1] + 1):
                self._step(store, state, workload.step_changes(s))
                if s in todo or s % _FLUSH_EVERY == 0:
                    store.flush()
                if s in todo:
                    at_point(s)
            history = store.history(RUN_ID)
        finally:
            store.close()
        return {
            "checkpoints": len(history),
            "keyframes": sum(1 for i in history if i.keyframe),
            "durability": "exit (flushed every 1000 steps and at each point)",
        }

    def resume(self, db: Path, steps: int) -> LoadResult:
        clock = time.perf_counter
        t0, c0 = clock(), time.process_time()
        store = Store.open(_url(db))
        t1 = clock()
        run = store.get_run(RUN_ID)
        snap = store.load(RUN_ID, lazy=True) if self.lazy else store.load(RUN_ID)
        next_step = int(snap.state["step"]) + 1  # where the next step starts
        t2, c2 = clock(), time.process_time()
        return LoadResult(
            t2 - t0,
            snap.state,
            {"open_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "cpu_ms": (c2 - c0) * 1e3},
            {
                "next_step": next_step,
                "run_status": str(run.status),
                "seq": snap.info.seq,
                "keyframe_seq": snap.info.keyframe_seq,
                "deltas_replayed": snap.info.seq - snap.info.keyframe_seq,
                "messages_type": type(snap.state.get("messages")).__name__,
            },
            close=store.close,
        )
