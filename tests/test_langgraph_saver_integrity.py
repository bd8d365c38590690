"""OnceOnlySaver under deliberate edits (issue [8] item 8), on SQLite and PostgreSQL.

Every edit is one an attacker with database access but without the keyring's secret can
make: write any bytes, recompute the *unkeyed* digests (the algorithm is public), drop a
seal, write rows through the library without a key. The payload is the one reported: a
msgpack record that makes LangGraph's permissive decoder call ``os.system`` (here it
only creates a marker file, whose absence is the oracle). A positive control shows the
payload is live: read with LangGraph's permissive serializer and no keys, it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ormsgpack
import pydantic
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.serde.jsonplus import EXT_CONSTRUCTOR_SINGLE_ARG, JsonPlusSerializer
from langgraph.types import Command, Interrupt, Send
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from onceonly.adapters import _langgraph_schema as schema
from onceonly.adapters._langgraph_values import SerdeValue, register, seal, unseal
from onceonly.adapters.langgraph_saver import OnceOnlySaver, StrictSerializer, UnregisteredType
from onceonly.adapters.langgraph_saver import migrate as langgraph_migrate
from onceonly.checkpoint import (
    Codec,
    CodecError,
    ConfigurationError,
    CorruptRecord,
    SchemaVersionError,
    Store,
)
from onceonly.checkpoint import _delta as delta
from onceonly.ledger import Keyring, Ledger
from tests.dbutil import execute, fetch
from tests.ledger_support import K1, K2, keyring

THREAD = "t-forged"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url)
    try:
        yield eng
    finally:
        eng.dispose()


def _config(thread: str = THREAD) -> Any:
    return {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}


def _checkpoint(i: int, values: dict[str, Any]) -> Any:
    return {
        "v": 4,
        "id": f"1f000000-0000-6000-8000-{i:012d}",
        "ts": "2025-01-01T00:00:00+00:00",
        "channel_values": values,
        "channel_versions": {k: str(i + 1) for k in values},
        "versions_seen": {},
        "updated_channels": None,
    }


def _put(saver: OnceOnlySaver, thread: str = THREAD, i: int = 1) -> Any:
    """One checkpoint (a message channel, a plain one) with one pending write."""
    values = {"messages": [HumanMessage("hello", id="h1")], "n": i}
    stored = saver.put(_config(thread), _checkpoint(i, values), {"source": "input", "step": i}, {})
    saver.put_writes(stored, [("n", i + 1)], "task-1")
    return stored


def _evil(marker: Path) -> SerdeValue:
    """What LangGraph's permissive decoder turns into ``os.system("touch MARKER")``."""
    call = ormsgpack.packb(["os", "system", f"touch {shlex.quote(str(marker))}"])
    return SerdeValue("msgpack", ormsgpack.packb(ormsgpack.Ext(EXT_CONSTRUCTOR_SINGLE_ARG, call)))


def _codec() -> Codec:
    codec = Codec()
    register(codec)
    return codec


def _forge_record(engine: Engine, marker: Path) -> None:
    """Put the payload into the checkpoint record's metadata and recompute its digest."""
    ((tid, ns, cid, parent, rid, seq, lg_run, record),) = fetch(
        engine,
        "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, seq, "
        "lg_run_id, record FROM oo_lg_checkpoints WHERE thread_id = :t",
        t=THREAD,
    )
    codec = _codec()
    rec = codec.decode(unseal(bytes(record)))
    rec["m"]["note"] = _evil(marker)
    forged = seal(codec.encode(rec))
    parts = schema.checkpoint_parts(tid, ns, cid, parent, rid, seq, lg_run, forged)
    execute(
        engine,
        "UPDATE oo_lg_checkpoints SET record = :r, digest = :d WHERE thread_id = :t",
        r=forged,
        d=schema.checkpoint_digest(parts),
        t=THREAD,
    )


def _forge_write(engine: Engine, value: Any, thread: str = THREAD) -> None:
    """Replace the pending write's value and recompute its digest."""
    ((tid, ns, cid, task, idx, channel, path),) = fetch(
        engine,
        "SELECT thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, task_path "
        "FROM oo_lg_writes WHERE thread_id = :t",
        t=thread,
    )
    forged = seal(_codec().encode(value))
    parts = schema.write_parts(tid, ns, cid, task, idx, channel, path, forged)
    execute(
        engine,
        "UPDATE oo_lg_writes SET value = :v, digest = :d WHERE thread_id = :t",
        v=forged,
        d=schema.write_digest(parts),
        t=thread,
    )


def _forge_channel_values(db_url: str, engine: Engine, marker: Path) -> None:
    """Replace the store checkpoint under the saver's row by a keyframe carrying the
    payload, written through the library without a key, its digest recomputed for the
    target row."""
    ((rid, seq, step, src, ver, at),) = fetch(
        engine,
        "SELECT c.run_id, c.seq, c.step, c.source, c.schema_version, c.created_at FROM "
        "oo_checkpoints c JOIN oo_lg_checkpoints l ON l.run_id = c.run_id AND l.seq = c.seq "
        "WHERE l.thread_id = :t",
        t=THREAD,
    )
    with Store.open(db_url, codec=_codec()) as scratch:  # no keys
        other = scratch.create_run("scratch").run_id
        scratch.save(other, {"messages": [_evil(marker)], "n": 1}, step="x")
    ((body,),) = fetch(engine, "SELECT body FROM oo_checkpoints WHERE run_id = :r", r=other)
    raw = delta.unpack(bytes(body))
    digest = delta.row_digest(rid, seq, 0, seq, ver, step, src, at, raw)
    execute(
        engine,
        "UPDATE oo_checkpoints SET body = :b, digest = :d, kind = 0, keyframe_seq = :s "
        "WHERE run_id = :r AND seq = :s",
        b=delta.pack(raw),
        d=digest,
        r=rid,
        s=seq,
    )


def _read_all(saver: OnceOnlySaver) -> None:
    """Both read paths; each must refuse."""
    with pytest.raises(CorruptRecord):
        saver.get_tuple(_config())
    with pytest.raises(CorruptRecord):
        list(saver.list(_config()))


# -- a forged record, write or channel value runs no code ---------------------------------


PERMISSIVE = JsonPlusSerializer(allowed_msgpack_modules=True)


@pytest.mark.parametrize(
    "where", ["record", "write", "channel_values", "record_without_seal"], ids=str
)
def test_with_keys_a_forged_row_is_refused_before_it_is_decoded(
    db_url: str, engine: Engine, tmp_path: Path, where: str
) -> None:
    marker = tmp_path / "ran"
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _put(saver)
    if where.startswith("record"):
        _forge_record(engine, marker)
        if where == "record_without_seal":
            execute(engine, "UPDATE oo_lg_checkpoints SET seal = NULL")
    elif where == "write":
        _forge_write(engine, _evil(marker))
    else:
        _forge_channel_values(db_url, engine, marker)
    # Even a permissive serializer is never reached: the seal is checked first.
    with OnceOnlySaver.from_url(db_url, keyring=keyring(), serde=PERMISSIVE) as saver:
        _read_all(saver)
        with pytest.raises(CorruptRecord, match="seal"):
            saver.get_tuple(_config())
    assert not marker.exists()


@pytest.mark.parametrize("where", ["record", "write", "channel_values"], ids=str)
def test_without_keys_the_strict_serializer_builds_nothing_it_does_not_allow(
    db_url: str, engine: Engine, tmp_path: Path, where: str
) -> None:
    marker = tmp_path / "ran"
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        _put(saver)
    if where == "record":
        _forge_record(engine, marker)
    elif where == "write":
        _forge_write(engine, _evil(marker))
    else:
        _forge_channel_values(db_url, engine, marker)
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        _read_all(saver)
        with pytest.raises(UnregisteredType) as err:
            saver.get_tuple(_config())
    assert err.value.type_name == "os.system"
    assert not marker.exists()
    # Positive control: the payload is live. LangGraph's permissive serializer, with no
    # keys to stop the row first, runs it.
    with OnceOnlySaver.from_url(db_url, unkeyed=True, serde=PERMISSIVE) as saver:
        saver.get_tuple(_config())
    assert marker.exists()


def test_an_edited_write_is_refused_with_keys_and_read_as_edited_without(
    db_url: str, engine: Engine
) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _put(saver, "keyed")
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        _put(saver, "unkeyed")
    _forge_write(engine, 99, "keyed")
    _forge_write(engine, 99, "unkeyed")
    with (
        OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver,
        pytest.raises(CorruptRecord, match=r"pending write .* keyed seal"),
    ):
        saver.get_tuple(_config("keyed"))
    # What unkeyed mode says it cannot detect: a recomputed digest passes.
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        tup = saver.get_tuple(_config("unkeyed"))
        assert saver.integrity_note is not None
        assert "not" in saver.integrity_note
    assert tup is not None
    assert tup.pending_writes == [("task-1", "n", 99)]


def test_a_moved_row_fails_its_seal(db_url: str, engine: Engine) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _put(saver, "a", 1)
        _put(saver, "b", 2)
        # A namespace pointed at another thread's store run (seal kept).
        (run_b,) = fetch(engine, "SELECT run_id FROM oo_lg_threads WHERE thread_id = 'b'")[0]
        execute(engine, "UPDATE oo_lg_threads SET run_id = :r WHERE thread_id = 'a'", r=run_b)
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        with pytest.raises(CorruptRecord, match="store run of LangGraph thread 'a'"):
            _put(saver, "a", 3)
        assert saver.get_tuple(_config("b")) is not None


# -- keys: rotation, the unkeyed mode, sealing older rows -----------------------------------


def test_a_row_sealed_under_an_older_key_loads_after_rotation(db_url: str, engine: Engine) -> None:
    with OnceOnlySaver.from_url(db_url, keyring=keyring(K1)) as saver:
        _put(saver, "old", 1)
    with OnceOnlySaver.from_url(db_url, keyring=keyring(K2, K1)) as saver:
        tup = saver.get_tuple(_config("old"))
        assert tup is not None
        assert tup.checkpoint["channel_values"]["n"] == 1
        assert tup.pending_writes == [("task-1", "n", 2)]
        _put(saver, "new", 2)
    for table in ("oo_lg_threads", "oo_lg_checkpoints", "oo_lg_writes"):
        seals = {
            str(tid): bytes(s).split(b":")[0]
            for tid, s in fetch(engine, f"SELECT thread_id, seal FROM {table}")
        }
        assert seals == {"old": b"k1", "new": b"k2"}, table
    # Once the old secret is retired, its rows no longer verify (and are not read).
    with OnceOnlySaver.from_url(db_url, keyring=keyring(K2)) as saver:
        assert saver.get_tuple(_config("new")) is not None
        with pytest.raises(CorruptRecord, match="seal"):
            saver.get_tuple(_config("old"))


def test_the_saver_needs_keys_or_says_it_has_none(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ONCEONLY_SECRETS", raising=False)
    with pytest.raises(ConfigurationError, match=r"ONCEONLY_SECRETS.*unkeyed=True"):
        OnceOnlySaver.from_url(db_url)
    with pytest.raises(ConfigurationError, match="not both"):
        OnceOnlySaver.from_url(db_url, keyring=keyring(), unkeyed=True)
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        assert saver.integrity_note == schema.UNKEYED_LIMITS
        assert "not" in saver.integrity_note
        assert "recomputes" in saver.integrity_note
    with Store.open(db_url) as store:
        with pytest.raises(ConfigurationError, match="unkeyed=True"):
            OnceOnlySaver(store)
        # A ledger on the same store gives it its keyring's keys.
        ledger = Ledger(store, keyring())
        try:
            assert OnceOnlySaver(store).integrity_note is None
        finally:
            ledger.close()
    # ONCEONLY_SECRETS is the default keyring.
    monkeypatch.setenv("ONCEONLY_SECRETS", f"{K1.id}:{K1.value.hex()}")
    with OnceOnlySaver.from_url(db_url) as saver:
        assert saver.integrity_note is None
        _put(saver, "env", 1)
    with OnceOnlySaver.from_url(db_url, keyring=Keyring([K1])) as saver:
        assert saver.get_tuple(_config("env")) is not None


def test_rows_of_an_unkeyed_saver_are_refused_until_sealed(db_url: str, engine: Engine) -> None:
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        _put(saver, "before", 1)
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        with pytest.raises(CorruptRecord, match="no seal"):
            saver.get_tuple(_config("before"))
        # An unsealed row that fails its digest is not sealed, and then nothing is.
        execute(engine, "UPDATE oo_lg_writes SET task_path = 'moved'")
        with pytest.raises(CorruptRecord, match="nothing was sealed"):
            saver.seal_unsealed()
        execute(engine, "UPDATE oo_lg_writes SET task_path = ''")
        assert saver.seal_unsealed() > 3  # saver rows and the store's run and checkpoint
        tup = saver.get_tuple(_config("before"))
        assert tup is not None
        assert tup.pending_writes == [("task-1", "n", 2)]
        assert saver.seal_unsealed() == 0
    with (
        OnceOnlySaver.from_url(db_url, unkeyed=True) as saver,
        pytest.raises(ConfigurationError, match="nothing to seal with"),
    ):
        saver.seal_unsealed()


# -- the strict serializer: only allowed types are built ----------------------------------


BUILT: list[str] = []


@dataclasses.dataclass
class Order:
    sku: str
    qty: int

    def __post_init__(self) -> None:
        BUILT.append(f"Order({self.sku})")


@dataclasses.dataclass
class Basket:
    orders: list[Order]

    def __post_init__(self) -> None:
        BUILT.append("Basket")


class Status(enum.Enum):
    OPEN = "open"


class Invoice(pydantic.BaseModel):
    number: int
    status: Status


def test_langgraph_values_need_no_registration() -> None:
    serde = StrictSerializer()
    values: list[Any] = [
        HumanMessage("hi", id="h"),
        AIMessage("ok", id="a", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c1"}]),
        Send("node", {"k": 1}),
        Interrupt(value={"question": "publish?"}, id="i1"),
        Command(resume="yes"),
        uuid.UUID(int=7),
        {1, 2},
        None,
        b"raw",
    ]
    langgraph = JsonPlusSerializer()
    for value in values:
        stored = serde.dumps_typed(value)
        assert stored == langgraph.dumps_typed(value)  # LangGraph's encoding
        assert serde.loads_typed(stored) == langgraph.loads_typed(stored)  # built alike
        assert type(serde.loads_typed(stored)) is type(value)


def test_an_unregistered_type_is_refused_before_any_constructor_runs() -> None:
    permissive = JsonPlusSerializer(allowed_msgpack_modules=True)
    stored = permissive.dumps_typed(Basket([Order("a", 1)]))
    BUILT.clear()
    with pytest.raises(UnregisteredType) as err:
        StrictSerializer().loads_typed(stored)
    assert err.value.type_name == f"{Order.__module__}.Order, {Basket.__module__}.Basket"
    assert isinstance(err.value, CorruptRecord)
    assert "register it" in str(err.value)
    # The outer type allowed, an inner one not: nothing is built, the outer included.
    with pytest.raises(UnregisteredType, match="Order"):
        StrictSerializer(allow=[Basket]).loads_typed(stored)
    assert BUILT == []
    # Refused again by the same serializer (only accepted encodings are remembered).
    basket_only = StrictSerializer(allow=[Basket])
    for _ in range(2):
        with pytest.raises(UnregisteredType, match="Order"):
            basket_only.loads_typed(stored)
    assert BUILT == []
    # Registered, both are built, each time (an encoding checked before is not checked
    # again, but its value is always built anew).
    both = StrictSerializer(allow=[Basket, Order])
    built = both.loads_typed(stored)
    assert BUILT == ["Order(a)", "Basket"]
    assert built == Basket([Order("a", 1)])
    BUILT.clear()
    again = both.loads_typed(stored)
    assert BUILT == ["Order(a)", "Basket"]
    assert again == built
    assert again is not built
    # Formats that may construct anything are refused outright.
    for fmt in ("json", "pickle"):
        with pytest.raises(UnregisteredType, match=fmt):
            both.loads_typed((fmt, b"{}"))


def test_a_list_of_stored_values_is_built_as_one_by_one() -> None:
    """``loads_many`` (a list of messages in one decoding pass) gives what
    ``loads_typed`` gives item by item: equal values of the same types, new objects each
    time; and an item that carries bytes after its value, or one that fails, makes it
    decode one by one, with that path's value or error."""
    serde = StrictSerializer()
    values: list[Any] = [
        HumanMessage("hi", id="h"),
        AIMessage("ok", id="a", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c1"}]),
        Send("node", {"k": 1}),
        uuid.UUID(int=7),
        {1, 2},
        [HumanMessage("nested", id="n")],
    ]
    datas = [serde.dumps_typed(v)[1] for v in values]
    assert all(serde.dumps_typed(v)[0] == "msgpack" for v in values)
    one_by_one = [serde.loads_typed(("msgpack", d)) for d in datas]
    many = serde.loads_many(datas)
    assert many == one_by_one == values
    assert [type(x) for x in many] == [type(x) for x in values]
    assert serde.loads_many(datas)[0] is not many[0]
    assert serde.loads_many([]) == []
    # A value with bytes after it (one_by_one reads the value and ignores them): in one
    # array they would become the next item; the marker says so and each is read alone.
    trailing = [datas[0] + ormsgpack.packb("stray"), datas[1], datas[2]]
    assert serde.loads_many(trailing) == [serde.loads_typed(("msgpack", d)) for d in trailing]
    assert serde.loads_many(trailing)[1] == values[1]
    # Bytes after a value that name a type not allowed: pass 1 never looked at them and
    # loads_typed never reads them; in one array they would be built. They are not.
    permissive = JsonPlusSerializer(allowed_msgpack_modules=True)
    refused = permissive.dumps_typed(Basket([Order("a", 1)]))[1]
    smuggled = [datas[0] + refused, datas[1]]
    BUILT.clear()
    assert serde.loads_many(smuggled) == [values[0], values[1]]
    assert BUILT == []
    # A failing item raises what loads_typed raises for it.
    with pytest.raises(UnregisteredType, match="Order"):
        serde.loads_many([datas[0], refused])
    assert BUILT == []
    with pytest.raises(CorruptRecord):
        serde.loads_many([datas[0], b"\xc1"])  # never valid msgpack


def test_a_list_of_messages_is_read_in_one_pass_and_as_stored() -> None:
    """The list of a state's messages is built by the serializer's one pass (a history
    listing builds it once per checkpoint); its items keep their places among values
    stored as themselves and values in another of the serde's formats, and a serializer
    without the pass builds them one by one."""
    from onceonly.adapters._langgraph_values import pack, unpack

    serde = StrictSerializer()
    calls: list[int] = []
    real = serde.loads_many

    def counted(datas: Any) -> list[Any]:
        calls.append(len(datas))
        return real(datas)

    serde.loads_many = counted  # type: ignore[method-assign]
    state = ["plain", HumanMessage("a", id="1"), 3, AIMessage("b", id="2"), None, {7}]
    packed = [*pack(state, serde), SerdeValue("bytes", b"raw")]
    state.append(b"raw")
    assert [type(x).__name__ for x in packed] == [
        "str",
        "SerdeValue",
        "int",
        "SerdeValue",
        "NoneType",
        "SerdeValue",
        "SerdeValue",
    ]
    assert unpack(packed, serde) == state
    assert calls == [3]  # the messages and the set; not the value in the bytes format

    class OneByOne:
        def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
            return serde.dumps_typed(obj)

        def loads_typed(self, data: tuple[str, bytes]) -> Any:
            return serde.loads_typed(data)

    assert unpack(packed, OneByOne()) == state
    assert calls == [3]


def test_writing_an_unregistered_type_fails_at_once(db_url: str) -> None:
    invoice = Invoice(number=7, status=Status.OPEN)
    # Every type to register is named at once.
    with pytest.raises(CodecError, match=r"Status, .*Invoice.*allow=\[Status, Invoice\]"):
        StrictSerializer().dumps_typed(invoice)
    with pytest.raises(CodecError, match="Status"):
        StrictSerializer(allow=[Invoice]).dumps_typed(invoice)
    serde = StrictSerializer(allow=[Invoice, Status])
    assert serde.loads_typed(serde.dumps_typed(invoice)) == invoice
    # Through the saver: put refuses, registered types round-trip.
    with (
        OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver,
        pytest.raises(CodecError, match="Invoice"),
    ):
        saver.put(_config(), _checkpoint(1, {"inv": invoice}), {"step": 1}, {})
    with OnceOnlySaver.from_url(db_url, keyring=keyring(), serde=serde) as saver:
        stored = saver.put(_config(), _checkpoint(1, {"inv": invoice}), {"step": 1}, {})
        tup = saver.get_tuple(stored)
    assert tup is not None
    assert tup.checkpoint["channel_values"]["inv"] == invoice


def test_langgraph_strict_mode_extends_the_allow_list() -> None:
    serde = StrictSerializer()
    extended = serde.with_msgpack_allowlist([(Order.__module__, "Order")])
    assert isinstance(extended, StrictSerializer)
    assert (Order.__module__, "Order") in extended.allowed
    assert (Order.__module__, "Order") not in serde.allowed
    assert extended.with_msgpack_allowlist([(Order.__module__, "Order")]) is extended
    with pytest.raises(ConfigurationError):
        StrictSerializer(allow=["Order"])  # type: ignore[list-item]


def test_a_version_1_database_is_migrated_then_sealed(db_url: str, engine: Engine) -> None:
    with OnceOnlySaver.from_url(db_url, unkeyed=True) as saver:
        _put(saver, "v1", 1)
    # The saver's tables as version 1 had them: no seal column.
    for table in ("oo_lg_threads", "oo_lg_checkpoints", "oo_lg_writes"):
        execute(engine, f"ALTER TABLE {table} DROP COLUMN seal")
    execute(engine, "UPDATE onceonly_schema SET version = 1 WHERE component = 'langgraph'")
    with pytest.raises(SchemaVersionError, match="migrate"):
        OnceOnlySaver.from_url(db_url, keyring=keyring())
    assert "applied 1 migration" in langgraph_migrate(db_url)
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        with pytest.raises(CorruptRecord, match="seal_unsealed"):
            saver.get_tuple(_config("v1"))
        saver.seal_unsealed()
        tup = saver.get_tuple(_config("v1"))
    assert tup is not None
    assert tup.checkpoint["channel_values"]["n"] == 1


def test_a_put_whose_record_fails_leaves_no_values_behind(
    db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put is one transaction without savepoints: when writing the checkpoint's record
    fails, its channel values are not committed either (no store checkpoint without a
    LangGraph row), and the next put builds on the last stored one."""
    from onceonly.adapters.langgraph_saver._storage import Storage

    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _put(saver, i=1)
        before = fetch(engine, "SELECT count(*) FROM oo_checkpoints")[0][0]
        real = Storage._upsert_row

        def refuse(self: Storage, cur: Any, *args: Any) -> None:
            real(self, cur, *args)
            raise RuntimeError("the database refused the record")

        monkeypatch.setattr(Storage, "_upsert_row", refuse)
        with pytest.raises(RuntimeError, match="refused the record"):
            _put(saver, i=2)
        assert fetch(engine, "SELECT count(*) FROM oo_checkpoints")[0][0] == before
        assert fetch(engine, "SELECT count(*) FROM oo_lg_checkpoints")[0][0] == 1
        monkeypatch.setattr(Storage, "_upsert_row", real)
        _put(saver, i=3)
        tup = saver.get_tuple(_config())
        assert tup is not None
        assert tup.checkpoint["channel_values"]["n"] == 3
        assert fetch(engine, "SELECT count(*) FROM oo_checkpoints")[0][0] == before + 1


def test_a_record_is_never_written_for_values_that_are_not_stored(
    db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record names a store checkpoint; the insert's own condition is that the
    checkpoint is there. A save whose values went missing (here: a store that answers
    with a sequence number it never wrote) leaves no record, and the put fails after
    its retries instead of naming nothing."""
    from onceonly.adapters.langgraph_saver._rows import _Stale
    from onceonly.checkpoint import Store

    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _put(saver, i=1)
        real = Store.save

        def elsewhere(self: Store, run_id: str, *args: Any, **kwargs: Any) -> Any:
            saved = real(self, run_id, *args, **kwargs)
            return type(saved)(**{**saved.__dict__, "seq": saved.seq + 1000})

        monkeypatch.setattr(Store, "save", elsewhere)
        with pytest.raises(_Stale, match="has no checkpoint"):
            _put(saver, i=2)
        monkeypatch.setattr(Store, "save", real)
        assert fetch(engine, "SELECT count(*) FROM oo_lg_checkpoints")[0][0] == 1
        _put(saver, i=3)
        tup = saver.get_tuple(_config())
        assert tup is not None
        assert tup.checkpoint["channel_values"]["n"] == 3


# -- verify: every row of every thread ------------------------------------------------------

_SAVER_COLUMNS = {
    "oo_lg_threads": (("thread_id", "checkpoint_ns"), ("thread_id", "run_id", "seal")),
    "oo_lg_checkpoints": (
        ("thread_id", "checkpoint_ns", "checkpoint_id"),
        ("thread_id", "checkpoint_id", "run_id", "record", "digest", "seal"),
    ),
    "oo_lg_writes": (
        ("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"),
        ("thread_id", "checkpoint_id", "task_id", "channel", "value", "digest", "seal"),
    ),
}


def _flip_one(value: Any, pos: int) -> Any:
    if isinstance(value, str):
        c = chr(ord(value[pos]) ^ 0x20) if value[pos].isalpha() else "~"
        return value[:pos] + (c if c != value[pos] else "!") + value[pos + 1 :]
    data = bytearray(bytes(value))
    data[pos] ^= 0x10
    return bytes(data)


@pytest.mark.parametrize(
    ("table", "column"),
    [(t, c) for t, (_, cols) in _SAVER_COLUMNS.items() for c in cols],
    ids=str,
)
def test_verify_finds_a_flip_in_any_row_of_any_thread(
    db_url: str, engine: Engine, table: str, column: str
) -> None:
    """A read meets the edited rows of the thread it reads; a row moved to another
    thread or checkpoint (a key column edited) leaves its own thread, and a thread's
    mapping is read at its next put only. ``verify`` checks every row, wherever it is."""
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        for i in (1, 2):
            _put(saver, i=i)
        _put(saver, thread="other")
        checked, problems = saver.verify()
        assert problems == []
        assert checked == 2 + 3 + 3  # threads, checkpoints, writes
    keys, _ = _SAVER_COLUMNS[table]
    rows = fetch(engine, f"SELECT {', '.join(keys)}, {column} FROM {table}")
    *key, value = rows[0]
    where = " AND ".join(f"{k} = :k{i}" for i, k in enumerate(keys))
    changed = _flip_one(value, len(value) // 2)
    params = {f"k{i}": v for i, v in enumerate(key)}
    assert execute(engine, f"UPDATE {table} SET {column} = :v WHERE {where}", v=changed, **params)
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as fresh:
        checked, problems = fresh.verify()
    assert checked == 8
    lost = [p for p in problems if "has lost its record" in p]
    assert len(problems) - len(lost) == 1, problems
    # a checkpoint row moved away from its thread (or its run) that was the newest
    # there is also its namespace's lost record
    assert len(lost) <= (table == "oo_lg_checkpoints" and column in ("thread_id", "run_id"))


def _two_puts_verified(db_url: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Two checkpoints put by a sealed saver, then ``onceonly audit verify --json``,
    which must pass: its environment and its document."""
    from click.testing import CliRunner

    from onceonly.cli import cli

    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        for i in (1, 2):
            _put(saver, i=i)
    env = {"ONCEONLY_DATABASE_URL": db_url, "ONCEONLY_SECRETS": f"k1:{K1.value.hex()}"}
    clean = CliRunner().invoke(cli, ["audit", "verify", "--json"], env=env)
    assert clean.exit_code == 0, clean.output
    return env, json.loads(clean.output)


def test_audit_verify_checks_the_savers_rows(db_url: str, engine: Engine, ledgers: Any) -> None:
    """``onceonly audit verify`` on a database holding the saver's tables checks them too:
    a checkpoint row moved to another thread is a problem, exit status 1."""
    from click.testing import CliRunner

    from onceonly.cli import cli

    ledgers.fresh().close()  # the ledger's schema beside the saver's
    env, doc = _two_puts_verified(db_url)
    assert (doc["ok"], doc["langgraph_rows"]) == (True, 1 + 2 + 2)
    assert execute(
        engine,
        "UPDATE oo_lg_checkpoints SET thread_id = 'elsewhere' WHERE checkpoint_id = :c",
        c=_checkpoint(2, {})["id"],
    )
    moved = CliRunner().invoke(cli, ["audit", "verify"], env=env)
    assert moved.exit_code == 1
    assert "problem:" in moved.output
    assert "'elsewhere'" in moved.output


def test_audit_verify_on_a_database_of_the_saver_alone(db_url: str, engine: Engine) -> None:
    """A database only ``OnceOnlySaver.from_url`` wrote to has no ledger: ``onceonly audit
    verify`` checks its checkpoints, blobs and saver rows (keyed with the secrets, and
    unkeyed with a note without them) instead of asking for ``onceonly migrate``."""
    from click.testing import CliRunner

    from onceonly.cli import cli

    env, doc = _two_puts_verified(db_url)
    assert (doc["ok"], doc["ledger"], doc["langgraph_rows"]) == (True, False, 1 + 2 + 2)
    assert doc["blobs"] >= 2
    assert doc["effects"] == 0
    assert doc["note"] is None
    printed = CliRunner().invoke(cli, ["audit", "verify"], env=env)
    assert printed.exit_code == 0, printed.output
    assert "LangGraph saver alone" in printed.output
    assert "OK" in printed.output
    unkeyed = CliRunner().invoke(
        cli, ["audit", "verify", "--json"], env={**env, "ONCEONLY_SECRETS": ""}
    )
    assert unkeyed.exit_code == 0, unkeyed.output
    assert json.loads(unkeyed.output)["note"]
    refused = CliRunner().invoke(cli, ["audit", "verify", "--witness", "w.json"], env=env)
    assert refused.exit_code == 2
    assert "holds no ledger" in refused.output
    # A saver row moved, then a checkpoint body edited: the saver's check finds the
    # first, the checkpoint core's the second.
    assert execute(
        engine,
        "UPDATE oo_lg_checkpoints SET thread_id = 'elsewhere' WHERE checkpoint_id = :c",
        c=_checkpoint(2, {})["id"],
    )
    moved = CliRunner().invoke(cli, ["audit", "verify"], env=env)
    assert moved.exit_code == 1, moved.output
    assert "'elsewhere'" in moved.output
    (body,) = fetch(engine, "SELECT body FROM oo_checkpoints ORDER BY seq DESC LIMIT 1")[0]
    changed = _flip_one(bytes(body), len(bytes(body)) // 2)
    assert execute(
        engine,
        "UPDATE oo_checkpoints SET body = :b WHERE seq = (SELECT MAX(seq) FROM oo_checkpoints)",
        b=changed,
    )
    doc = json.loads(CliRunner().invoke(cli, ["audit", "verify", "--json"], env=env).output)
    assert doc["ok"] is False
    # the moved row (which was its thread's newest: also a lost record), the edited body
    assert len(doc["problems"]) == 3, doc["problems"]
    assert sum("has lost its record" in p for p in doc["problems"]) == 1


# -- the newest checkpoint's record: deleted or moved, never silently gone back from --------


def _cid(i: int) -> str:
    return str(_checkpoint(i, {})["id"])


def _edit_newest(engine: Engine, edit: str, newest: int) -> None:
    """Delete (or move to another thread) the record of checkpoint ``newest`` (with
    ``every``: of every checkpoint of the thread), as someone with database access can."""
    if edit == "every":
        assert execute(engine, "DELETE FROM oo_lg_writes WHERE thread_id = :t", t=THREAD)
        assert execute(engine, "DELETE FROM oo_lg_checkpoints WHERE thread_id = :t", t=THREAD)
        return
    where = "thread_id = :t AND checkpoint_id = :c"
    if edit == "delete":
        assert execute(engine, f"DELETE FROM oo_lg_writes WHERE {where}", t=THREAD, c=_cid(newest))
        assert execute(
            engine, f"DELETE FROM oo_lg_checkpoints WHERE {where}", t=THREAD, c=_cid(newest)
        )
    else:
        assert execute(
            engine,
            f"UPDATE oo_lg_checkpoints SET thread_id = 'elsewhere' WHERE {where}",
            t=THREAD,
            c=_cid(newest),
        )


@pytest.mark.parametrize("store_mode", [None, "sync", "async"], ids=lambda m: m or "from_url")
@pytest.mark.parametrize("edit", ["delete", "move", "every"])
def test_a_newest_record_that_is_gone_is_refused_not_gone_back_from(
    db_url: str, engine: Engine, edit: str, store_mode: str | None
) -> None:
    """The newest checkpoint's record deleted, or moved to another thread, or every
    record of the thread deleted: reading the latest (what a graph resumes from) would
    go back to an older checkpoint, or start the thread anew, and run its steps again.
    The store run still holds the newest values, written with their record in one
    transaction: the read is refused, ``verify`` names it, and pruning the thread is
    the way on from what is left. An explicitly named older checkpoint still reads."""

    @contextlib.contextmanager
    def open_saver() -> Iterator[OnceOnlySaver]:
        if store_mode is None:
            with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
                yield saver
            return
        with (
            Store.open(db_url, durability=store_mode, integrity=keyring().row_keys()) as store,
            OnceOnlySaver(store) as saver,
        ):
            yield saver

    with open_saver() as saver:
        for i in (1, 2, 3):
            _put(saver, i=i)
        tup = saver.get_tuple(_config())
        assert tup is not None  # positive control: the intact thread reads
        assert tup.config["configurable"]["checkpoint_id"] == _cid(3)
        assert saver.verify()[1] == []
    _edit_newest(engine, edit, 3)
    with open_saver() as fresh:
        with pytest.raises(CorruptRecord, match="has lost its record") as lost:
            fresh.get_tuple(_config())
        assert _cid(3) in str(lost.value)
        with pytest.raises(CorruptRecord, match="has lost its record"):
            asyncio.run(fresh.aget_tuple(_config()))
        if edit != "every":
            older = fresh.get_tuple(
                {
                    "configurable": {
                        "thread_id": THREAD,
                        "checkpoint_ns": "",
                        "checkpoint_id": _cid(2),
                    }
                }
            )
            assert older is not None
            assert older.checkpoint["channel_values"]["n"] == 2
        _, problems = fresh.verify()
        named = [p for p in problems if "has lost its record" in p]
        assert len(named) == 1, problems
        assert _cid(3) in named[0]
        if edit == "every":
            return
        fresh.prune([THREAD], strategy="keep_latest")
        again = fresh.get_tuple(_config())
        assert again is not None
        assert again.config["configurable"]["checkpoint_id"] == _cid(2)
        assert again.checkpoint["channel_values"]["n"] == 2
        assert [p for p in fresh.verify()[1] if "has lost its record" in p] == []


def test_values_an_earlier_version_left_without_their_record_are_not_refused(
    db_url: str, engine: Engine
) -> None:
    """Before every put was one transaction, a saver on a store passed in ``sync`` mode
    committed the values, then the record: a crash between the two left values without a
    record (their label has no checkpoint id). That is not an edit: the thread reads
    from its newest record, and the next put goes on from there."""
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        for i in (1, 2):
            _put(saver, i=i)
        ((run_id,),) = fetch(
            engine, "SELECT run_id FROM oo_lg_threads WHERE thread_id = :t", t=THREAD
        )
        saver.store.save(run_id, {"n": 99}, step="loop:3")  # as an earlier version's put did
        tup = saver.get_tuple(_config())
        assert tup is not None
        assert tup.config["configurable"]["checkpoint_id"] == _cid(2)
        assert saver.verify()[1] == []
        _put(saver, i=3)
        tup = saver.get_tuple(_config())
        assert tup is not None
        assert tup.checkpoint["channel_values"]["n"] == 3


def test_an_older_checkpoint_put_again_is_not_a_lost_record(db_url: str) -> None:
    """A put of a checkpoint id the thread already has moves that record to the newest
    values: the newest record by id is then not the newest values', and nothing is
    lost."""
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        for i in (1, 2):
            _put(saver, i=i)
        values = {"messages": [HumanMessage("again", id="h2")], "n": 7}
        saver.put(_config(), _checkpoint(1, values), {"source": "update", "step": 3}, {})
        tup = saver.get_tuple(_config())
        assert tup is not None
        assert tup.config["configurable"]["checkpoint_id"] == _cid(2)
        assert saver.verify()[1] == []


def test_a_lost_record_cannot_be_passed_off_as_an_earlier_versions(
    db_url: str, engine: Engine
) -> None:
    """The label that tells a lost record from an earlier version's crash residue is
    sealed with the values: editing it away (with the newest row deleted) is refused."""
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        for i in (1, 2):
            _put(saver, i=i)
    _edit_newest(engine, "delete", 2)
    ((run_id,),) = fetch(engine, "SELECT run_id FROM oo_lg_threads WHERE thread_id = :t", t=THREAD)
    assert execute(
        engine,
        "UPDATE oo_checkpoints SET step = 'loop:2' WHERE run_id = :r AND seq = "
        "(SELECT MAX(seq) FROM oo_checkpoints WHERE run_id = :r)",
        r=run_id,
    )
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as fresh:
        with pytest.raises(CorruptRecord, match="seal"):
            fresh.get_tuple(_config())
        assert fresh.verify()[1] != []
