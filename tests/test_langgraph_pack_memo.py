"""The saver's pack memo: a message encoded at one step is reused at the next only while
it encodes to the same bytes. Every in-place edit a node can make to a message it was
handed (a field, a nested dict or list, a value replaced by an equal one of another
type, a key order) is encoded again, and a real graph whose node edits an earlier
message in place stores the edit, read back by a fresh saver."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.graph import START, MessagesState, StateGraph
from pydantic import BaseModel, ConfigDict, computed_field, field_serializer

from onceonly.adapters import _langgraph_values
from onceonly.adapters._langgraph_serde import StrictSerializer
from onceonly.adapters._langgraph_values import PackMemo, SerdeValue, pack
from onceonly.adapters.langgraph_saver import OnceOnlySaver
from onceonly.checkpoint import CodecError
from tests.ledger_support import keyring


def _ai() -> AIMessage:
    return AIMessage(
        "thinking",
        id="m1",
        tool_calls=[{"name": "lookup", "args": {"q": "a", "n": 1}, "id": "c1"}],
        usage_metadata={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        response_metadata={"model": "m", "temperature": 0.0, "stream": False},
    )


class Colour(enum.IntEnum):
    ONE = 1


def _set_tool_arg(m: Any) -> None:
    m.tool_calls[0]["args"]["q"] = "b"


def _reorder(m: Any) -> None:
    m.response_metadata["model"] = m.response_metadata.pop("model")


EDITS: dict[str, Callable[[Any], None]] = {
    "content": lambda m: setattr(m, "content", "thinking more"),
    "content to blocks": lambda m: setattr(m, "content", [{"type": "text", "text": "t"}]),
    "id": lambda m: setattr(m, "id", "m2"),
    "name from None": lambda m: setattr(m, "name", "bot"),
    "new additional kwarg": lambda m: m.additional_kwargs.update(x=1),
    "nested tool arg": _set_tool_arg,
    "tool call appended": lambda m: m.tool_calls.append(
        {"name": "lookup", "args": {}, "id": "c2", "type": "tool_call"}
    ),
    "int to bool": lambda m: m.tool_calls[0]["args"].update(n=True),
    "int to float": lambda m: m.tool_calls[0]["args"].update(n=1.0),
    "int to IntEnum": lambda m: m.tool_calls[0]["args"].update(n=Colour.ONE),
    "0.0 to -0.0": lambda m: m.response_metadata.update(temperature=-0.0),
    "float to int": lambda m: m.response_metadata.update(temperature=0),
    "False to 0": lambda m: m.response_metadata.update(stream=0),
    "False to None": lambda m: m.response_metadata.update(stream=None),
    "dict key order": _reorder,
    "list to tuple": lambda m: m.tool_calls[0].update(args={"q": ("a",), "n": 1}),
    "usage counted": lambda m: m.usage_metadata.update(output_tokens=5),
    "str to bytes": lambda m: m.response_metadata.update(model=b"m"),
    "field deleted": lambda m: m.response_metadata.clear(),
    # the model's own fields in another order: Pydantic dumps them in __dict__'s order
    "fields reordered": lambda m: object.__setattr__(
        m, "__dict__", dict(reversed(vars(m).items()))
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_in_place_edit_is_encoded_again(edit: str) -> None:
    serde = StrictSerializer().allowing(Colour)
    memo = PackMemo()
    msg = _ai()
    first = pack(msg, serde, memo)
    assert pack(msg, serde, memo) == first
    assert memo.hits == 1  # the unchanged message was reused
    EDITS[edit](msg)
    again = pack(msg, serde, memo)
    assert again == pack(msg, serde)  # what encoding it afresh gives
    assert again != first
    assert memo.hits == 1
    # the new encoding is memoised in turn (unless the edit put in a value of a type
    # the snapshot does not know: then it is encoded every time)
    assert pack(msg, serde, memo) == again
    assert memo.hits == (1 if edit == "int to IntEnum" else 2)


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_to_a_message_in_a_list_is_encoded_again(edit: str) -> None:
    """A list is packed in one pass over the memo (a message channel): the edited
    message is encoded again, its neighbours are reused, and the other items of the
    list (strings, numbers, dicts holding messages) are packed as they are alone."""
    serde = StrictSerializer().allowing(Colour)
    memo = PackMemo()
    tool = ToolMessage("r", tool_call_id="c1", id="t1")
    msgs: list[Any] = [HumanMessage("go", id="h"), _ai(), "plain", 7, {"k": tool}, [tool]]
    first = pack(msgs, serde, memo)
    assert first == pack(msgs, serde)
    assert pack(msgs, serde, memo) == first
    # the tool message, held twice, is reused at its second place already; then all
    assert memo.hits == 1 + 4
    EDITS[edit](msgs[1])
    again = pack(msgs, serde, memo)
    assert again == pack(msgs, serde)  # what encoding it afresh gives
    assert again[1] != first[1]
    assert again[0] is first[0]
    assert again[4]["k"] is first[4]["k"]
    assert memo.hits == 5 + 3


def test_equal_keys_of_other_objects_in_the_same_order_reuse_the_encoding() -> None:
    """Key order is checked by identity first, then by value: a dict rebuilt with equal
    keys (other string objects) in the same order is unchanged, in another order not."""
    serde = StrictSerializer()
    memo = PackMemo()
    msg = _ai()
    first = pack([msg], serde, memo)
    rebuilt = {"".join(k): v for k, v in msg.response_metadata.items()}
    assert all(a is not b for a, b in zip(rebuilt, msg.response_metadata, strict=True))
    msg.response_metadata = rebuilt
    assert pack([msg], serde, memo)[0] is first[0]
    assert memo.hits == 1
    msg.response_metadata = dict(reversed(rebuilt.items()))
    again = pack([msg], serde, memo)
    assert again[0] != first[0]
    assert again == pack([msg], serde)
    assert memo.hits == 1


def test_a_list_marks_the_messages_it_reused_as_recently_used() -> None:
    serde = StrictSerializer()
    memo = PackMemo(size=3)
    a, b, c, d = (HumanMessage(x, id=x) for x in "abcd")
    pack([a, b, c], serde, memo)
    pack([a, b], serde, memo)  # c is now the least recently used
    pack([d], serde, memo)  # evicts c, not a
    assert memo.hits == 2
    pack([a, b], serde, memo)
    assert memo.hits == 4
    pack([c], serde, memo)
    assert memo.hits == 4  # c was evicted: encoded again


def test_a_memoised_list_is_what_encoding_it_afresh_gives() -> None:
    serde = StrictSerializer()
    memo = PackMemo()
    msgs: list[Any] = [HumanMessage("go", id="h")]
    for n in range(20):
        msgs.append(
            AIMessage("t", id=f"a{n}", tool_calls=[{"name": "x", "args": {}, "id": f"c{n}"}])
        )
        msgs.append(ToolMessage("r", tool_call_id=f"c{n}", id=f"t{n}"))
        packed = pack({"messages": msgs, "n": n}, serde, memo)
        assert packed == pack({"messages": msgs, "n": n}, serde)
        assert all(type(v) is SerdeValue for v in packed["messages"])
    # every earlier message, at every step after the first
    assert memo.hits == sum(1 + 2 * n for n in range(1, 20))
    assert len(memo) == 41


class _Computed(BaseModel):
    a: int = 1

    @computed_field  # type: ignore[prop-decorator]
    @property
    def b(self) -> int:
        return self.a + 1


class _Serialized(BaseModel):
    a: str = "x"

    @field_serializer("a")
    def _upper(self, v: str) -> str:
        return v.upper()


class _OwnDump(BaseModel):
    a: int = 1

    def model_dump(self, **kw: Any) -> dict[str, Any]:
        return {"a": self.a, "when": 1}


class _Nested(BaseModel):
    inner: _Computed = _Computed()


class _Extra(BaseModel):
    model_config = ConfigDict(extra="allow")
    a: int = 1


@pytest.mark.parametrize("model", [_Computed, _Serialized, _OwnDump, _Nested])
def test_models_whose_dump_is_not_their_fields_alone_are_never_memoised(
    model: type[BaseModel],
) -> None:
    serde = StrictSerializer().allowing(model, _Computed)
    memo = PackMemo()
    obj = model()
    for _ in range(3):
        assert pack(obj, serde, memo) == pack(obj, serde)
    assert len(memo) == 0
    assert memo.hits == 0


def test_extras_are_part_of_the_snapshot() -> None:
    serde = StrictSerializer().allowing(_Extra)
    memo = PackMemo()
    obj = _Extra(z=1)  # type: ignore[call-arg]
    first = pack(obj, serde, memo)
    assert pack(obj, serde, memo) == first
    assert memo.hits == 1
    obj.y = 2  # type: ignore[attr-defined]  # a new extra
    assert pack(obj, serde, memo) == pack(obj, serde) != first
    assert memo.hits == 1


def test_a_value_of_a_type_the_snapshot_does_not_know_is_encoded_every_time() -> None:
    serde = StrictSerializer()
    memo = PackMemo()
    msg = AIMessage("t", additional_kwargs={"s": {1, 2}})  # a set inside
    for _ in range(3):
        assert pack(msg, serde, memo) == pack(msg, serde)
    assert len(memo) == 0


def test_another_serde_empties_the_memo_and_the_memo_is_bounded() -> None:
    memo = PackMemo(size=3)
    one, two = StrictSerializer(), StrictSerializer()
    msgs = [HumanMessage(str(i)) for i in range(5)]
    for m in msgs:
        pack(m, one, memo)
    assert len(memo) == 3  # the two least recently used went
    pack(msgs[-1], one, memo)
    assert memo.hits == 1
    pack(msgs[-1], two, memo)
    assert memo.hits == 1  # not reused across serdes
    assert len(memo) == 1


def test_the_memo_holds_at_most_its_bytes() -> None:
    serde = StrictSerializer()
    memo = PackMemo(max_bytes=2000)
    msgs = [HumanMessage(str(i) * 500) for i in range(6)]
    for m in msgs:
        pack(m, serde, memo)
        assert memo._bytes == sum(len(e[2].data) for e in memo._entries.values()) <= 2000
    assert 0 < len(memo) < 6
    pack(HumanMessage("x" * 5000), serde, memo)  # larger than the whole memo: not kept
    assert memo._bytes <= 2000
    assert len(memo) > 0


def _editing_graph(saver: OnceOnlySaver) -> Any:
    """``first`` answers; ``second`` edits that answer in place (and a nested dict of
    it) and adds one of its own. Run with ``durability="sync"``, the answer is packed
    (its write, then the checkpoint after ``first``) before ``second`` edits it."""

    def first(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage("draft", id="a1", response_metadata={"v": 1})]}

    def second(state: MessagesState) -> dict[str, Any]:
        answer = state["messages"][-1]
        answer.content = "final"
        answer.response_metadata["v"] = True
        return {"messages": [AIMessage("done", id="a2")]}

    g = StateGraph(MessagesState)
    g.add_node("first", first)
    g.add_node("second", second)
    g.add_edge(START, "first")
    g.add_edge("first", "second")
    return g.compile(checkpointer=saver)


def _run_then_read(db_url: str) -> list[Any]:
    """Run the editing graph, then read its last state with a fresh saver."""
    cfg: Any = {"configurable": {"thread_id": "edits"}}
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as saver:
        _editing_graph(saver).invoke(
            {"messages": [HumanMessage("go", id="h")]}, cfg, durability="sync"
        )
    with OnceOnlySaver.from_url(db_url, keyring=keyring()) as fresh:
        msgs: list[Any] = _editing_graph(fresh).get_state(cfg).values["messages"]
    return msgs


def test_a_node_editing_an_earlier_message_in_place_is_stored(db_url: str) -> None:
    msgs = _run_then_read(db_url)
    assert [m.content for m in msgs] == ["go", "final", "done"]
    assert msgs[1].response_metadata == {"v": True}
    assert type(msgs[1].response_metadata["v"]) is bool


def test_control_a_memo_that_trusts_identity_stores_the_stale_message(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph test above fails when an unchanged object is assumed, not checked."""
    monkeypatch.setattr(_langgraph_values, "_unchanged", lambda v, snap: True)
    msgs = _run_then_read(db_url)
    assert [m.content for m in msgs] == ["go", "draft", "done"]


def test_the_documented_blind_spot_an_object_claiming_equality() -> None:
    """What the how-to says goes unseen: a replacement whose own ``__eq__`` claims to
    equal the string it replaced (and which could not even be encoded)."""
    from unittest import mock

    serde = StrictSerializer()
    memo = PackMemo()
    msg = _ai()
    first = pack(msg, serde, memo)
    msg.content = mock.ANY
    assert pack(msg, serde, memo) == first  # taken as unchanged
    with pytest.warns(UserWarning, match="serializ"), pytest.raises(CodecError):
        pack(msg, serde)
