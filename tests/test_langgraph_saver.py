"""OnceOnlySaver under real LangGraph graphs, on SQLite and PostgreSQL: the sync path,
interrupts resumed in a fresh process, time travel, integrity, compact storage, deletion,
and copying threads over from ``SqliteSaver``."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command
from sqlalchemy import create_engine, text

from onceonly.adapters._langgraph_values import SerdeValue, register
from onceonly.adapters.langgraph_saver import OnceOnlySaver, copy_threads
from onceonly.checkpoint import (
    ConcurrentWrite,
    ConfigurationError,
    CorruptRecord,
    KeyframePolicy,
    Store,
)
from tests.conftest import _fresh_pg_database
from tests.langgraph_saver_graph import START_INPUT, build, config, summary
from tests.ledger_support import K1, keyring

ROOT = Path(__file__).resolve().parent.parent


def _first_run(saver: OnceOnlySaver, thread: str) -> Any:
    """Run to the interrupt in ``review``."""
    graph = build(saver)
    out = graph.invoke(START_INPUT, config(thread))
    assert "__interrupt__" in out
    return graph


def _sql(url: str, stmt: str, **params: Any) -> list[Any]:
    eng = create_engine(url)
    try:
        with eng.begin() as conn:
            res = conn.execute(text(stmt), params)
            return list(res.all()) if res.returns_rows else []
    finally:
        eng.dispose()


def test_sync_path_interrupt_resume_and_serde_values(db_url: str) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        graph = _first_run(saver, "t1")
        snap = graph.get_state(config("t1"))
        assert snap.next == ("review",)
        assert snap.tasks[0].interrupts[0].value["question"] == "publish?"
        # Messages come back as LangChain messages, stored message by message.
        assert [type(m) for m in snap.values["messages"]] == [HumanMessage, AIMessage]
        out = graph.invoke(Command(resume="yes"), config("t1"))
    assert summary(out)["trail"] == ["draft", "review:yes", "publish"]
    assert out["facts"] == {"version": "1.2", "component": "langgraph", "published": "yes"}
    # The message list is a list of serde leaves; plain channels are stored as themselves.
    with Store.open(db_url) as store:
        register(store.codec)  # the store's codec must know the serde leaves
        (run,) = store.list_runs(flow="langgraph")
        state = store.load(run.run_id).state
    assert all(type(m) is SerdeValue for m in state["messages"])
    assert state["trail"] == ["draft", "review:yes", "publish"]


def test_resume_from_a_fresh_process(db_url: str) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _first_run(saver, "t-fresh")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.langgraph_saver_graph", db_url, "t-fresh", "ship it"],
        cwd=ROOT,
        env=dict(os.environ, ONCEONLY_SECRETS=f"{K1.id}:{K1.value.hex()}"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # draft ran once (before the interrupt, in this process); review and publish once.
    assert out["trail"] == ["draft", "review:ship it", "publish"]
    assert out["messages"] == [["human", "Write the release note"], ["ai", out["messages"][1][1]]]
    assert out["facts"]["published"] == "ship it"


def test_time_travel(db_url: str) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        graph = _first_run(saver, "tt")
        graph.invoke(Command(resume="yes"), config("tt"))
        history = list(graph.get_state_history(config("tt")))
        assert [h.metadata["step"] for h in history if h.metadata] == [3, 2, 1, 0, -1]
        before_review = next(h for h in history if h.next == ("review",))
        # Replay from the earlier checkpoint: review interrupts again; answer differently.
        graph.invoke(None, before_review.config)
        out = graph.invoke(Command(resume="no"), config("tt"))
        assert out["trail"] == ["draft", "review:no", "publish"]
        assert out["facts"]["published"] == "no"
        # The original branch is still there.
        again = list(graph.get_state_history(config("tt")))
        assert len(again) > len(history)
        assert any(h.values.get("answer") == "yes" for h in again)
        # Reading a past checkpoint returns its state, not the latest.
        past = graph.get_state(before_review.config)
        assert past.values["trail"] == ["draft"]
        assert "answer" not in past.values


def test_async_path(db_url: str) -> None:
    async def go() -> dict[str, Any]:
        with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
            graph = build(saver)
            await graph.ainvoke(START_INPUT, config("ta"))
            out = await graph.ainvoke(Command(resume="async"), config("ta"))
            states = [s async for s in graph.aget_state_history(config("ta"))]
            assert len(states) == 5
            return dict(out)

    out = asyncio.run(go())
    assert out["trail"] == ["draft", "review:async", "publish"]


def _checkpoint(i: int) -> Any:
    return {
        "v": 4,
        "id": f"1f000000-0000-6000-8000-{i:012d}",
        "ts": "2025-01-01T00:00:00+00:00",
        "channel_values": {"n": i, "log": [f"line {j}" for j in range(i)]},
        "channel_versions": {"n": str(i + 1), "log": str(i + 1)},
        "versions_seen": {},
        "updated_channels": None,
    }


@pytest.mark.parametrize("mode", [None, "sync", "async", "exit"])
def test_a_put_commits_its_values_and_its_record_together_on_any_store(
    db_url: str, mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose record cannot be written leaves nothing behind, on a store the saver
    opens and on one passed in, in each durability mode (an ``async`` store refused
    every put; a ``sync`` one committed the values without the record)."""
    from onceonly.adapters.langgraph_saver import _storage

    if mode is None:
        saver = OnceOnlySaver.from_url(db_url, keyring=keyring())
        store = saver.store
    else:
        store = Store.open(db_url, durability=mode, integrity=keyring().row_keys())
        saver = OnceOnlySaver(store)
    real = _storage.Storage._upsert_row
    fail = {"put": 2}

    def upsert(self: Any, *args: Any) -> None:
        real(self, *args)
        if args[3] == _checkpoint(fail["put"])["id"]:
            raise OSError("the disk went away after the record's insert")

    monkeypatch.setattr(_storage.Storage, "_upsert_row", upsert)
    try:
        parent: Any = {"configurable": {"thread_id": "atomic", "checkpoint_ns": ""}}
        for i in range(2):
            parent = saver.put(parent, _checkpoint(i), {"source": "loop", "step": i}, {})
        with pytest.raises(OSError, match="disk went away"):
            saver.put(parent, _checkpoint(2), {"source": "loop", "step": 2}, {})
        store.flush()
        (run,) = store.list_runs(flow="langgraph")
        assert store.get_run(run.run_id).head_seq == 1  # checkpoint 2's values: gone too
        fail["put"] = -1
        parent = saver.put(parent, _checkpoint(3), {"source": "loop", "step": 3}, {})
        tup = saver.get_tuple({"configurable": {"thread_id": "atomic", "checkpoint_ns": ""}})
        assert tup is not None
        assert tup.checkpoint["id"] == _checkpoint(3)["id"]
        assert tup.checkpoint["channel_values"]["log"] == [f"line {j}" for j in range(3)]
        assert [t.checkpoint["id"] for t in saver.list(None)] == [
            _checkpoint(i)["id"] for i in (3, 1, 0)
        ]
        rows = _sql(
            db_url,
            "SELECT (SELECT COUNT(*) FROM oo_checkpoints WHERE run_id = :r), "
            "(SELECT COUNT(*) FROM oo_lg_checkpoints WHERE run_id = :r)",
            r=run.run_id,
        )
        assert rows == [(3, 3)]  # every stored checkpoint has its record
        assert saver.verify()[1] == []
    finally:
        saver.close()
        if mode is not None:
            store.close()


def test_tampered_blob_raises_corrupt_record(db_url: str) -> None:
    big = "x" * 20_000  # encoded beyond the blob threshold: stored as a blob
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        cfg: Any = {"configurable": {"thread_id": "tamper", "checkpoint_ns": ""}}
        cp: Any = {
            "v": 4,
            "id": "1f000000-0000-6000-8000-000000000001",
            "ts": "2025-01-01T00:00:00+00:00",
            "channel_values": {"doc": big, "n": 1},
            "channel_versions": {"doc": "1", "n": "1"},
            "versions_seen": {},
            "updated_channels": None,
        }
        stored = saver.put(cfg, cp, {"source": "input", "step": -1}, {"doc": "1", "n": "1"})
        saver.put_writes(stored, [("n", 2)], "task-1")
        tup = saver.get_tuple(stored)
        assert tup is not None
        assert tup.checkpoint["channel_values"]["doc"] == big
        assert tup.pending_writes == [("task-1", "n", 2)]
    # Edit the blob behind the store's back: the next load refuses it.
    _sql(db_url, "UPDATE oo_blobs SET data = :d", d=b'j"tampered"')
    with (
        OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver,
        pytest.raises(CorruptRecord) as err,
    ):
        saver.get_tuple(stored)
    assert err.value.blob is not None
    # An edited checkpoint record or write is refused too.
    _sql(db_url, "DELETE FROM oo_blobs")
    _sql(db_url, "UPDATE oo_lg_writes SET value = :v", v=b"3")
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver, pytest.raises(CorruptRecord):
        saver.get_tuple(stored)
    _sql(db_url, "UPDATE oo_lg_checkpoints SET parent_checkpoint_id = 'elsewhere'")
    with (
        OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver,
        pytest.raises(CorruptRecord, match="keyed seal"),
    ):
        list(saver.list(None))
    # Without keys, the unkeyed digest still catches an edit that does not recompute it.
    with (
        OnceOnlySaver.from_url(db_url, unkeyed=True) as saver,
        pytest.raises(CorruptRecord, match="digest"),
    ):
        list(saver.list(None))


def test_unchanged_channels_are_not_rewritten(db_url: str) -> None:
    big = "y" * 50_000
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        parent: Any = {"configurable": {"thread_id": "compact", "checkpoint_ns": ""}}
        for i in range(40):
            cp: Any = {
                "v": 4,
                "id": f"1f000000-0000-6000-8000-{i:012d}",
                "ts": "2025-01-01T00:00:00+00:00",
                "channel_values": {"doc": big, "n": i, "log": [f"line {j}" for j in range(i)]},
                "channel_versions": {"doc": "1", "n": str(i + 1), "log": str(i + 1)},
                "versions_seen": {},
                "updated_channels": None,
            }
            parent = saver.put(parent, cp, {"source": "loop", "step": i}, {"n": str(i + 1)})
        tup = saver.get_tuple(parent)
        assert tup is not None
        assert tup.checkpoint["channel_values"]["log"][-1] == "line 38"
    ((body, blobs),) = _sql(
        db_url,
        "SELECT (SELECT SUM(LENGTH(body)) FROM oo_checkpoints), "
        "(SELECT SUM(LENGTH(data)) FROM oo_blobs)",
    )
    # 40 checkpoints of a 50 kB channel: the value is stored once (as a compressed
    # content-addressed blob), each checkpoint costs its small delta.
    assert int(blobs) < 10_000
    assert int(body) < 20_000


def test_delete_and_prune_remove_stored_values(db_url: str) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        for thread in ("keep", "gone"):
            graph = _first_run(saver, thread)
            graph.invoke(Command(resume="yes"), config(thread))
        saver.delete_thread("gone")
        assert saver.get_tuple(config("gone")) is None
        saver.prune(["keep"], strategy="keep_latest")
        (only,) = list(saver.list(config("keep")))
        assert only.checkpoint["channel_values"]["trail"] == ["draft", "review:yes", "publish"]
        with pytest.raises(ConfigurationError):
            saver.prune(["keep"], strategy="sometimes")
        runs = _sql(db_url, "SELECT run_id FROM oo_runs")
        assert len(runs) == 1  # the pruned namespace's one run; "gone"'s run is dropped
        (count,) = _sql(db_url, "SELECT COUNT(*) FROM oo_checkpoints")
        assert count[0] == 1  # the latest checkpoint, stored afresh as a keyframe
        saver.delete_thread("keep")
    rows = _sql(
        db_url,
        "SELECT (SELECT COUNT(*) FROM oo_blobs), (SELECT COUNT(*) FROM oo_blob_refs), "
        "(SELECT COUNT(*) FROM oo_runs), (SELECT COUNT(*) FROM oo_lg_checkpoints)",
    )
    assert tuple(rows[0]) == (0, 0, 0, 0)


def test_copy_threads_from_sqlite_saver(db_url: str, tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "langgraph.db", check_same_thread=False)
    try:
        source = SqliteSaver(conn)
        graph = build(source)
        for thread in ("m1", "m2"):
            graph.invoke(START_INPUT, config(thread))
        graph.invoke(Command(resume="before"), config("m2"))
        src_history = {t: list(graph.get_state_history(config(t))) for t in ("m1", "m2")}
        with OnceOnlySaver.from_url(db_url, keyring=keyring()) as target:
            assert copy_threads(source, target) == sum(len(h) for h in src_history.values())
            moved = build(target)
            for thread, hist in src_history.items():
                got = list(moved.get_state_history(config(thread)))
                assert [h.config["configurable"]["checkpoint_id"] for h in got] == [
                    h.config["configurable"]["checkpoint_id"] for h in hist
                ]
                assert [summary(h.values) for h in got] == [summary(h.values) for h in hist]
            # m1 waits at its interrupt on the new saver, and resumes there.
            assert moved.get_state(config("m1")).next == ("review",)
            out = moved.invoke(Command(resume="after"), config("m1"))
            assert out["trail"] == ["draft", "review:after", "publish"]
            # Copying again overwrites with equal checkpoints.
            assert copy_threads(source, target, thread_ids=["m2"]) == len(src_history["m2"])
            assert len(list(target.list(config("m2")))) == len(src_history["m2"])
    finally:
        conn.close()


def _looping_graph(saver: OnceOnlySaver, turns: int) -> Any:
    """One node that appends a message per super-step until ``turns`` were made."""

    def speak(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(f"turn {len(state['messages'])}")]}

    def more(state: MessagesState) -> str:
        return "speak" if len(state["messages"]) <= turns else END

    graph = StateGraph(MessagesState)
    graph.add_node("speak", speak)
    graph.add_edge(START, "speak")
    graph.add_conditional_edges("speak", more)
    return graph.compile(checkpointer=saver)


def test_list_gives_what_get_tuple_gives_across_keyframes(db_url: str) -> None:
    """``list`` builds its checkpoints' values in batches walking forward from a keyframe
    (one read, each row checked once): every tuple equals ``get_tuple``'s for the same
    checkpoint, with limits, ``before`` and filters, across several keyframes."""
    saver = OnceOnlySaver.from_url(
        db_url, keyring=keyring(), keyframes=KeyframePolicy(max_deltas=3)
    )
    with saver:
        app = _looping_graph(saver, 20)
        cfg: Any = config("walk")
        app.invoke({"messages": [HumanMessage("go")]}, cfg)
        listed = list(saver.list(cfg))
        assert len(listed) == 22  # the input and 21 turns
        for tup in listed:
            own = saver.get_tuple(tup.config)
            assert own is not None
            assert tup.config == own.config
            assert tup.parent_config == own.parent_config
            assert tup.metadata == own.metadata
            assert tup.checkpoint == own.checkpoint
            assert tup.pending_writes == own.pending_writes
        ids = [t.config["configurable"]["checkpoint_id"] for t in listed]

        def listed_ids(**kwargs: Any) -> list[str]:
            return [t.config["configurable"]["checkpoint_id"] for t in saver.list(cfg, **kwargs)]

        assert listed_ids(limit=5) == ids[:5]
        assert listed_ids(before=listed[3].config, limit=9) == ids[4:13]
        assert listed_ids(filter={"step": 7}) == [
            t.config["configurable"]["checkpoint_id"] for t in listed if t.metadata["step"] == 7
        ]
        history = list(app.get_state_history(cfg))
        assert [len(s.values["messages"]) for s in history[:3]] == [21, 20, 19]


def _concat_batch(current: list[str], writes: Any) -> list[str]:
    out = list(current)
    for w in writes:
        out.extend(w)
    return out


class _DeltaState(TypedDict):
    log: Annotated[list[str], DeltaChannel(_concat_batch, snapshot_frequency=7)]
    n: int


def _delta_graph(saver: OnceOnlySaver, turns: int) -> Any:
    def step(state: _DeltaState) -> dict[str, Any]:
        return {"log": [f"line {state['n']}"], "n": state["n"] + 1}

    def more(state: _DeltaState) -> str:
        return "step" if state["n"] < turns else END

    graph = StateGraph(_DeltaState)
    graph.add_node("step", step)
    graph.add_edge(START, "step")
    graph.add_conditional_edges("step", more)
    return graph.compile(checkpointer=saver)


def test_delta_channel_history_matches_langgraphs_walk(db_url: str) -> None:
    """``get_delta_channel_history`` (only the seed's state built) gives what LangGraph's
    default walk (one ``get_tuple`` per ancestor) gives, for every checkpoint of a
    ``DeltaChannel`` thread across snapshots and keyframes; the states read back agree."""
    saver = OnceOnlySaver.from_url(
        db_url, keyring=keyring(), keyframes=KeyframePolicy(max_deltas=3)
    )
    with saver:
        app = _delta_graph(saver, 30)
        cfg: Any = config("delta")
        app.invoke({"log": [], "n": 0}, cfg)
        history = list(app.get_state_history(cfg))
        assert len(history) == 32
        assert _walks_agree(saver, app, cfg, ["log", "n"]) == 32
        assert history[0].values["log"] == [f"line {i}" for i in range(30)]
        assert [len(s.values.get("log", [])) for s in history[:3]] == [30, 29, 28]
        assert saver.get_delta_channel_history(config=cfg, channels=[]) == {}
        ours = asyncio.run(saver.aget_delta_channel_history(config=cfg, channels=["log"]))
        assert ours == saver.get_delta_channel_history(config=cfg, channels=["log"])


def _walks_agree(saver: OnceOnlySaver, app: Any, cfg: Any, channels: list[str]) -> int:
    """Every checkpoint of the thread (all branches): our walk equals LangGraph's."""
    from langgraph.checkpoint.base import BaseCheckpointSaver

    n = 0
    for snap in app.get_state_history(cfg):
        ours = saver.get_delta_channel_history(config=snap.config, channels=channels)
        default = BaseCheckpointSaver.get_delta_channel_history(
            saver, config=snap.config, channels=channels
        )
        assert ours == default, snap.config
        n += 1
    return n


def test_delta_channel_walk_across_forks_with_fresh_values_and_old_records(
    db_url: str,
) -> None:
    """The walk follows parent links through a thread whose branches interleave (a fork
    taken mid-thread and run on); what it hands out is new on every call (a reducer
    that changes its input changes nothing stored or remembered); checkpoints whose
    records predate naming their channels take the batched walk, with the same result."""
    from onceonly.adapters import _langgraph_schema as schema
    from onceonly.adapters._langgraph_values import seal, unseal
    from onceonly.checkpoint import Codec

    saver = OnceOnlySaver.from_url(
        db_url, keyring=keyring(), keyframes=KeyframePolicy(max_deltas=3)
    )
    with saver:
        app = _delta_graph(saver, 24)
        cfg: Any = config("forked")
        app.invoke({"log": [], "n": 0}, cfg)
        history = list(app.get_state_history(cfg))
        fork = app.update_state(history[15].config, {"n": 40})
        app.invoke(None, fork)
        assert _walks_agree(saver, app, cfg, ["log", "n"]) > len(history)

        latest = app.get_state(cfg).config
        first = saver.get_delta_channel_history(config=latest, channels=["log"])
        expected = saver.get_delta_channel_history(config=latest, channels=["log"])
        assert first == expected
        first["log"]["seed"].value.append("changed")
        for write in first["log"]["writes"]:
            write[2].append("changed")
        assert saver.get_delta_channel_history(config=latest, channels=["log"]) == expected
        assert "changed" not in str(app.get_state(cfg).values)

        # Records as written before they named their channels (resealed with the key).
        keys = saver._storage.keys
        codec = Codec()
        register(codec)
        rows = _sql(
            db_url,
            "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, "
            "seq, lg_run_id, record FROM oo_lg_checkpoints WHERE thread_id = 'forked'",
        )
        for tid, ns, cid, parent, rid, seq, lg_run, record in rows:
            rec = codec.decode(unseal(bytes(record)))
            del rec["k"]
            old = seal(codec.encode(rec))
            parts = schema.checkpoint_parts(tid, ns, cid, parent, rid, seq, lg_run, old)
            _sql(
                db_url,
                "UPDATE oo_lg_checkpoints SET record = :r, digest = :d, seal = :s "
                "WHERE thread_id = :t AND checkpoint_ns = :n AND checkpoint_id = :c",
                r=old,
                d=schema.checkpoint_digest(parts),
                s=schema.make_seal(keys, schema.CHECKPOINTS, parts),
                t=tid,
                n=ns,
                c=cid,
            )
        assert _walks_agree(saver, app, cfg, ["log", "n"]) > len(history)


class _LongDeltaState(TypedDict):
    log: Annotated[list[str], DeltaChannel(_concat_batch, snapshot_frequency=60)]
    n: int


def test_delta_channel_walk_reads_its_chain_in_one_transaction(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk up a long chain (several pages of ancestors and their writes) reads them all
    in one read transaction, so in one snapshot: a concurrent prune or delete is seen
    whole or not at all. Its result is still LangGraph's default walk's."""
    from langgraph.checkpoint.base import BaseCheckpointSaver

    from onceonly.checkpoint import _connections

    def step(state: _LongDeltaState) -> dict[str, Any]:
        return {"log": [f"line {state['n']}"], "n": state["n"] + 1}

    graph = StateGraph(_LongDeltaState)
    graph.add_node("step", step)
    graph.add_edge(START, "step")
    graph.add_conditional_edges("step", lambda s: "step" if s["n"] < 50 else END)
    saver = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with saver:
        app = graph.compile(checkpointer=saver)
        cfg: Any = config("long-walk")
        app.invoke({"log": [], "n": 0}, cfg)
        latest = app.get_state(cfg).config
        first = saver.get_delta_channel_history(config=latest, channels=["log"])
        assert len(first["log"]["writes"]) > 40  # 8 + 32 ancestors are not enough

        reads: list[bool] = []
        enter = _connections._RawTxn.__enter__

        def counted(txn: Any) -> Any:
            reads.append(txn._write)
            return enter(txn)

        monkeypatch.setattr(_connections._RawTxn, "__enter__", counted)
        again = saver.get_delta_channel_history(config=latest, channels=["log"])
        assert reads == [False]  # its seed was built by the first walk: nothing else read
        monkeypatch.undo()
        assert again == first
        assert first == BaseCheckpointSaver.get_delta_channel_history(
            saver, config=latest, channels=["log"]
        )


def test_delta_channel_walk_refuses_rows_edited_after_it_read_them(db_url: str) -> None:
    """A walk reuses what it verified only for rows whose content is unchanged: a write
    or a checkpoint row edited (digest recomputed, no key) after earlier walks read it
    is refused by the next walk."""
    from onceonly.adapters import _langgraph_schema as schema
    from onceonly.adapters._langgraph_values import seal
    from onceonly.checkpoint import Codec

    saver = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with saver:
        app = _delta_graph(saver, 12)
        cfg: Any = config("edited")
        app.invoke({"log": [], "n": 0}, cfg)
        latest = app.get_state(cfg).config
        before = saver.get_delta_channel_history(config=latest, channels=["log"])
        assert len(before["log"]["writes"]) >= 2
        codec = Codec()
        register(codec)
        ((tid, ns, cid, task, idx, channel, path),) = _sql(
            db_url,
            "SELECT thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, task_path "
            "FROM oo_lg_writes WHERE thread_id = 'edited' AND channel = 'log' "
            "ORDER BY checkpoint_id DESC LIMIT 1",
        )
        forged = seal(codec.encode(["forged line"]))
        parts = schema.write_parts(tid, ns, cid, task, idx, channel, path, forged)
        _sql(
            db_url,
            "UPDATE oo_lg_writes SET value = :v, digest = :d WHERE thread_id = :t AND "
            "checkpoint_id = :c AND task_id = :k AND idx = :i",
            v=forged,
            d=schema.write_digest(parts),
            t=tid,
            c=cid,
            k=task,
            i=idx,
        )
        with pytest.raises(CorruptRecord, match="keyed seal"):
            saver.get_delta_channel_history(config=latest, channels=["log"])

        # A checkpoint row pointed at another parent: refused, not followed.
        cfg = config("moved")
        app.invoke({"log": [], "n": 0}, cfg)
        latest = app.get_state(cfg).config
        assert saver.get_delta_channel_history(config=latest, channels=["log"])["log"]["writes"]
        rows = _sql(
            db_url,
            "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, "
            "seq, lg_run_id, record FROM oo_lg_checkpoints WHERE thread_id = 'moved' "
            "ORDER BY checkpoint_id",
        )
        tid, ns, cid, _parent, rid, seq, lg_run, record = rows[-3]
        moved = rows[0][2]
        parts = schema.checkpoint_parts(tid, ns, cid, moved, rid, seq, lg_run, bytes(record))
        _sql(
            db_url,
            "UPDATE oo_lg_checkpoints SET parent_checkpoint_id = :p, digest = :d "
            "WHERE thread_id = :t AND checkpoint_id = :c",
            p=moved,
            d=schema.checkpoint_digest(parts),
            t=tid,
            c=cid,
        )
        with pytest.raises(CorruptRecord, match="keyed seal"):
            saver.get_delta_channel_history(config=latest, channels=["log"])


def _thread_with_checkpoints(saver: OnceOnlySaver, thread: str) -> Any:
    app = build(saver)
    cfg = config(thread)
    app.invoke(START_INPUT, cfg)
    return cfg


@pytest.mark.parametrize("action", ["delete", "prune"])
def test_get_tuple_reads_row_and_values_of_one_moment(
    db_url: str, action: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another saver deleting or pruning the thread after this one read a checkpoint's
    row but before it read the values the row names: the read still gives the state as
    it was (one snapshot), never a false "values missing" alarm; the next read sees the
    change."""
    reader = OnceOnlySaver.from_url(db_url, keyring=keyring())
    other = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with reader, other:
        cfg = _thread_with_checkpoints(reader, "skew")
        before = reader.get_tuple(cfg)
        assert before is not None
        load = reader.store.load
        done: list[str] = []

        def racing_load(*args: Any, **kwargs: Any) -> Any:
            if not done:  # the row is read: now the other saver commits its change
                done.append(action)
                if action == "delete":
                    other.delete_thread("skew")
                else:
                    other.prune(["skew"], strategy="keep_latest")
            return load(*args, **kwargs)

        monkeypatch.setattr(reader.store, "load", racing_load)
        during = reader.get_tuple(cfg)
        assert done == [action]
        assert during is not None
        assert during.checkpoint["channel_values"] == before.checkpoint["channel_values"]
        assert during.config == before.config
        after = reader.get_tuple(cfg)
        if action == "delete":
            assert after is None
        else:  # the latest checkpoint survives a prune, stored afresh
            assert after is not None
            assert after.checkpoint["channel_values"] == before.checkpoint["channel_values"]


@pytest.mark.parametrize("action", ["delete", "prune"])
def test_list_leaves_out_what_was_deleted_after_it_began(
    db_url: str, action: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing whose rows were read before another saver deleted or pruned the thread
    gives what is there when it reads their values (nothing, or the pruned thread's
    survivor as it is stored now), never a false "values missing" alarm."""
    reader = OnceOnlySaver.from_url(db_url, keyring=keyring())
    other = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with reader, other:
        cfg = _thread_with_checkpoints(reader, "skew")
        listed = list(reader.list(cfg))
        assert len(listed) > 2
        list_keys = reader._storage.list_keys

        def racing_keys(*args: Any) -> Any:
            keys = list_keys(*args)
            if action == "delete":
                other.delete_thread("skew")
            else:
                other.prune(["skew"], strategy="keep_latest")
            return keys

        monkeypatch.setattr(reader._storage, "list_keys", racing_keys)
        during = list(reader.list(cfg))
        if action == "delete":
            assert during == []
        else:
            assert [t.config for t in during] == [listed[0].config]
            assert during[0].checkpoint["channel_values"] == listed[0].checkpoint["channel_values"]


def test_copy_thread_copies_one_moment_of_its_source(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another saver deleting the source thread while it is being copied (after its rows
    were read, before their values): the copy is the source as it was when the copy read
    it, whole."""
    reader = OnceOnlySaver.from_url(db_url, keyring=keyring())
    other = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with reader, other:
        cfg = _thread_with_checkpoints(reader, "skew")
        source = list(reader.list(cfg))
        load = reader.store.load
        done: list[bool] = []

        def racing_load(*args: Any, **kwargs: Any) -> Any:
            if not done:
                done.append(True)
                other.delete_thread("skew")
            return load(*args, **kwargs)

        monkeypatch.setattr(reader.store, "load", racing_load)
        reader.copy_thread("skew", "copy")
        monkeypatch.undo()
        assert done == [True]
        assert reader.get_tuple(cfg) is None
        copied = list(reader.list(config("copy")))
        assert [t.config["configurable"]["checkpoint_id"] for t in copied] == [
            t.config["configurable"]["checkpoint_id"] for t in source
        ]
        assert [t.checkpoint["channel_values"] for t in copied] == [
            t.checkpoint["channel_values"] for t in source
        ]


def test_prune_keeps_a_checkpoint_put_while_it_was_pruning(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another saver's put into the thread after ``prune(keep_latest)`` read the thread
    but before it rewrote it: the put is not lost (its values are not dropped with the
    old store run), and the thread's latest checkpoint is the put's."""
    pruner = OnceOnlySaver.from_url(db_url, keyring=keyring())
    other = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with pruner, other:
        cfg = _thread_with_checkpoints(pruner, "race")
        assert len(list(pruner.list(cfg))) > 2
        create_run = pruner.store.create_run
        raced: list[Any] = []

        def racing_create_run(*args: Any, **kwargs: Any) -> Any:
            if not raced:  # the thread is read: now the other saver puts into it
                raced.append(build(other).update_state(cfg, {"answer": "raced"}))
            return create_run(*args, **kwargs)

        monkeypatch.setattr(pruner.store, "create_run", racing_create_run)
        pruner.prune(["race"], strategy="keep_latest")
        monkeypatch.undo()
        assert len(raced) == 1
        latest = pruner.get_tuple(cfg)
        assert latest is not None
        assert (
            latest.config["configurable"]["checkpoint_id"]
            == (raced[0]["configurable"]["checkpoint_id"])
        )
        assert latest.checkpoint["channel_values"]["answer"] == "raced"
        listed = list(pruner.list(cfg))  # every row left names values that are there
        assert listed[0].checkpoint["channel_values"]["answer"] == "raced"
        # The attempt that found the namespace changed left no store run behind.
        runs = _sql(db_url, "SELECT run_id FROM oo_runs")
        assert sorted(r[0] for r in runs) == sorted(
            r[0] for r in _sql(db_url, "SELECT run_id FROM oo_lg_threads")
        )


def test_prune_raced_on_every_attempt_gives_up_and_loses_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another saver puts into the thread between the read and the write of every
    attempt: ``prune`` raises ``ConcurrentWrite`` saying the thread kept changing, and
    every checkpoint is still there, the puts included, with no store run left over."""
    pruner = OnceOnlySaver.from_url(db_url, keyring=keyring())
    other = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with pruner, other:
        cfg = _thread_with_checkpoints(pruner, "busy")
        before = len(list(pruner.list(cfg)))
        create_run = pruner.store.create_run
        raced: list[Any] = []

        def racing_create_run(*args: Any, **kwargs: Any) -> Any:
            raced.append(build(other).update_state(cfg, {"answer": f"raced {len(raced)}"}))
            return create_run(*args, **kwargs)

        monkeypatch.setattr(pruner.store, "create_run", racing_create_run)
        with pytest.raises(ConcurrentWrite) as caught:
            pruner.prune(["busy"], strategy="keep_latest")
        monkeypatch.undo()
        assert "busy" in " ".join(caught.value.__notes__)
        listed = list(pruner.list(cfg))
        assert len(listed) == before + len(raced)
        assert listed[0].checkpoint["channel_values"]["answer"] == f"raced {len(raced) - 1}"
        runs = _sql(db_url, "SELECT run_id FROM oo_runs")
        assert sorted(r[0] for r in runs) == sorted(
            r[0] for r in _sql(db_url, "SELECT run_id FROM oo_lg_threads")
        )


@pytest.fixture
def pg_db_url(pg_server_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database (SQLite has one writer at a time: nothing of another
    writer is ever in flight beside a transaction there)."""
    if os.environ.get("ONCEONLY_TEST_NO_PG") == "1":
        pytest.skip("ONCEONLY_TEST_NO_PG=1: the PostgreSQL tests do not run")
    url, drop = _fresh_pg_database(pg_server_url)
    try:
        yield url
    finally:
        drop()


def test_delete_thread_waits_for_a_put_in_flight_and_deletes_it_too(pg_db_url: str) -> None:
    """A put into the thread that holds its store run when ``delete_thread`` starts (here
    a transaction that locked the run row and inserted a checkpoint row, as a put does) is
    waited for, and its row is deleted with the rest: no checkpoint row is left naming a
    dropped store run."""
    import threading

    db_url = pg_db_url

    saver = OnceOnlySaver.from_url(db_url, keyring=keyring())
    with saver:
        _thread_with_checkpoints(saver, "inflight")
        ((run_id,),) = _sql(db_url, "SELECT run_id FROM oo_lg_threads WHERE thread_id = 'inflight'")
        eng = create_engine(db_url)
        put = eng.connect()
        try:
            txn = put.begin()
            put.execute(text("SELECT 1 FROM oo_runs WHERE run_id = :r FOR UPDATE"), {"r": run_id})
            put.execute(
                text(
                    "INSERT INTO oo_lg_checkpoints (thread_id, checkpoint_ns, checkpoint_id, "
                    "parent_checkpoint_id, run_id, seq, lg_run_id, record, digest, seal, "
                    "created_at) VALUES ('inflight', '', 'zzz-in-flight', NULL, :r, 999, "
                    "NULL, :b, :b, NULL, 0)"
                ),
                {"r": run_id, "b": b"x"},
            )
            errors: list[BaseException] = []

            def delete() -> None:
                try:
                    saver.delete_thread("inflight")
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            worker = threading.Thread(target=delete)
            worker.start()
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            for _ in range(6000):  # until the delete waits for the put's lock (<= 60 s)
                if _sql(db_url, waiting)[0][0]:
                    break
                worker.join(0.01)
            else:
                raise AssertionError("delete_thread never waited for the put in flight")
            txn.commit()
        finally:
            put.close()
            eng.dispose()
        worker.join(120)
        assert not worker.is_alive()
        assert errors == []
        assert _sql(db_url, "SELECT checkpoint_id FROM oo_lg_checkpoints") == []
        assert _sql(db_url, "SELECT run_id FROM oo_runs WHERE run_id = :r", r=run_id) == []


# -- one saver, many threads: sync calls run on the caller's thread, one at a time -------


def test_more_threads_than_the_pool_holds_share_one_saver(db_url: str) -> None:
    """24 threads, more than the store's pool holds (5 + 10 overflow), each run a
    conversation to its interrupt and resume it at once, while an event loop drives two
    more through the async methods. On SQLite the sync calls run on those threads (the
    store pins a connection to each up to its pool's capacity, lends one per transaction
    past it); on PostgreSQL on the saver's worker. No call fails (a thread left waiting
    for a connection would time out), and every history is whole, in order."""
    import threading

    threads = [f"many-{i}" for i in range(24)]
    barrier = threading.Barrier(len(threads) + 1)
    errors: list[BaseException] = []
    outs: dict[str, Any] = {}

    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        graph = build(saver)

        def converse(thread: str) -> None:
            try:
                barrier.wait(60)
                graph.invoke(START_INPUT, config(thread))
                outs[thread] = graph.invoke(Command(resume=thread), config(thread))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        async def converse_async(thread: str) -> None:
            await graph.ainvoke(START_INPUT, config(thread))
            outs[thread] = await graph.ainvoke(Command(resume=thread), config(thread))

        async def both() -> None:
            await asyncio.gather(converse_async("async-a"), converse_async("async-b"))

        workers = [threading.Thread(target=converse, args=(t,)) for t in threads]
        for w in workers:
            w.start()
        barrier.wait(60)
        asyncio.run(both())
        for w in workers:
            w.join(300)
        assert not any(w.is_alive() for w in workers)
        assert errors == []
        for thread in [*threads, "async-a", "async-b"]:
            assert outs[thread]["trail"] == ["draft", f"review:{thread}", "publish"]
            history = list(graph.get_state_history(config(thread)))
            assert [h.metadata["step"] for h in history if h.metadata] == [3, 2, 1, 0, -1]


@pytest.mark.parametrize("owned", [True, False])
def test_close_waits_for_the_call_under_way_then_refuses_calls(db_url: str, owned: bool) -> None:
    """``close()`` while a put is under way on another thread returns after it (the put
    is stored); afterwards every call, sync or async, is refused with a clear error. A
    saver on a store it was given leaves that store open."""
    import threading

    from langgraph.checkpoint.base import copy_checkpoint, empty_checkpoint

    store = None if owned else Store.open(db_url, integrity=keyring().row_keys())
    saver = (
        OnceOnlySaver.from_url(db_url, keyring=keyring())
        if owned
        else OnceOnlySaver(store, keyring=keyring())  # type: ignore[arg-type]
    )
    build(saver).invoke(START_INPUT, config("closing"))
    tup = saver.get_tuple(config("closing"))
    assert tup is not None
    later = copy_checkpoint(tup.checkpoint)
    later["id"] = empty_checkpoint()["id"]
    inside, release = threading.Event(), threading.Event()
    real_put = saver._storage.put

    def slow_put(*args: Any) -> Any:
        inside.set()
        assert release.wait(60)
        return real_put(*args)

    saver._storage.put = slow_put  # type: ignore[method-assign,assignment]
    stored: list[Any] = []
    runner = threading.Thread(
        target=lambda: stored.append(saver.put(tup.config, later, tup.metadata, {}))
    )
    runner.start()
    assert inside.wait(60)
    closer = threading.Thread(target=saver.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the put under way
    release.set()
    closer.join(60)
    runner.join(60)
    assert not closer.is_alive()
    assert not runner.is_alive()
    assert stored
    assert stored[0]["configurable"]["checkpoint_id"] == later["id"]
    with pytest.raises(ConfigurationError, match="saver is closed"):
        saver.get_tuple(config("closing"))
    with pytest.raises(ConfigurationError, match="saver is closed"):
        saver.put(tup.config, later, tup.metadata, {})
    with pytest.raises(ConfigurationError, match="saver is closed"):
        asyncio.run(saver.aget_tuple(config("closing")))
    saver.close()  # a second close does nothing
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as again:
        latest = again.get_tuple(config("closing"))
        assert latest is not None
        assert latest.checkpoint["id"] == later["id"]
    if store is not None:
        assert store.list_runs(flow="langgraph")  # still open: the saver did not own it
        store.close()
