"""The MCP adapter against a real ``MCPServer`` (``tests.mcp_server``), in-process and over stdio.

For each provider class and failure mode the final state matches the class's semantics,
counted from the server's raw delivery log (never the ledger): applied once, failed
definitely, or needs-human; a restarted process (a fresh Ledger, a fresh client and, over
stdio, a fresh server process) replays without sending; and each guarded call leaves one
``execute_tool`` span saying what happened.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    REQUEST_TIMEOUT,
    CallToolResult,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from onceonly.adapters import RetryPolicy, step
from onceonly.adapters.mcp import (
    GuardedMCP,
    MCPNotSent,
    MCPToolError,
    MCPToolPolicy,
    MetaKey,
    classify_mcp,
)
from onceonly.checkpoint import ConfigurationError, Store
from onceonly.ledger import (
    EffectFailed,
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    KeyReuseError,
    Ledger,
    OutcomeClass,
)
from tests.ledger_support import Clock, Ledgers
from tests.mcp_server import FENCING_META, KEY_META, Provider, build_server

T = TypeVar("T")
Target = MCPServer | StdioServerParameters

WINDOW_S = 3600.0
HANG_TIMEOUT_S = 0.3
RETRY = RetryPolicy(max_attempts=3, initial_s=0.0)
POLICIES = {
    "pay_a": MCPToolPolicy("A", window_s=WINDOW_S),
    "book_b": MCPToolPolicy("B", lookup="find_booking"),
    "search": MCPToolPolicy(unguarded=True),
}
CALLS = {
    "A": ("pay_a", {"amount": 5}),
    "B": ("book_b", {"room": "r1"}),
    "C": ("notify_c", {"text": "hi"}),
}
NEEDS_HUMAN, NOT_HAPPENED, UNKNOWN = (
    EffectStatus.NEEDS_HUMAN,
    EffectStatus.NOT_HAPPENED,
    EffectStatus.UNKNOWN,
)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ledger(store: Store, ledgers: Ledgers) -> Ledger:
    return ledgers.on(store, owner="w1")


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider(tmp_path / "deliveries.jsonl")


@pytest.fixture(params=["A", "B", "C"])
def pclass(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def stdio(log: Path, *faults: str) -> StdioServerParameters:
    """A fresh server process on ``log`` (its state survives in the log), with faults."""
    return StdioServerParameters(
        command=sys.executable, args=["-m", "tests.mcp_server", str(log), *faults], cwd=str(ROOT)
    )


async def call(
    target: Target,
    ledger: Ledger,
    tool: str,
    arguments: Mapping[str, Any],
    **options: Any,
) -> CallToolResult:
    """One guarded call in step ``act`` of ``run-1``, on a client of its own.

    An error is raised after the client is closed: escaping ``async with Client`` it
    would come wrapped in the client's task-group ``ExceptionGroup``.
    """
    policies = options.pop("policies", POLICIES)
    retry = options.pop("retry", RETRY)
    outcome: CallToolResult | Exception
    async with Client(target) as client:
        guarded = GuardedMCP(client, ledger, policies=policies, retry=retry, timeout_s=10.0)
        with step("run-1", "act"):
            try:
                outcome = await guarded.call_tool(tool, arguments, **options)
            except Exception as exc:  # noqa: BLE001  (re-raised below, unwrapped)
                outcome = exc
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def run(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    return anyio.run(functools.partial(fn, *args, **kwargs))


def only(ledger: Ledger) -> EffectRecord:
    [rec] = ledger.effects()
    return rec


def ours(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    """The guard's spans (the SDK adds its own ``MCP send ...`` spans)."""
    return [s for s in spans.get_finished_spans() if s.name.startswith("execute_tool ")]


def outcomes(spans: InMemorySpanExporter) -> list[tuple[str, Any]]:
    """(span name, onceonly.effect.outcome) of the guarded calls, in order."""
    return [(s.name, (s.attributes or {}).get("onceonly.effect.outcome")) for s in ours(spans)]


# -- success, replay, restart ---------------------------------------------------------


def test_a_tool_call_happens_once_and_a_restart_replays_it(
    pclass: str, provider: Provider, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    tool, args = CALLS[pclass]
    first = run(call, build_server(provider), ledger, tool, args)
    again = run(call, build_server(provider), ledger, tool, args)
    restarted = Provider(provider.log_path)  # another server process on the same state
    later = run(call, build_server(restarted), ledgers.fresh(owner="w2"), tool, args)
    assert isinstance(first, CallToolResult)
    assert first == again == later
    assert repr(first) == repr(later)  # identical, key order included
    assert not first.is_error
    if pclass != "C":
        assert first.structured_content == provider.effects(tool)[0]["result"]
    [sent] = provider.deliveries()
    rec = only(ledger)
    assert (MetaKey.IDEMPOTENCY, MetaKey.FENCING) == (KEY_META, FENCING_META)  # the wire contract
    assert (sent["key"], sent["fencing"]) == (rec.provider_key, f"{rec.provider_key}:1")
    assert (rec.status, rec.provider_class.value) == (EffectStatus.COMMITTED, pclass)
    name = f"execute_tool mcp:{tool}@1"
    assert outcomes(spans) == [(name, "executed"), (name, "replayed"), (name, "replayed")]
    attrs = ours(spans)[0].attributes or {}
    assert attrs["onceonly.provider_class"] == pclass
    assert attrs["onceonly.effect.key_id"] == rec.key_id
    assert all(rec.provider_key not in str(v) for v in attrs.values())


def test_keys_come_from_the_step_or_are_explicit_and_divergence_is_refused(
    provider: Provider, ledger: Ledger
) -> None:
    run(call, build_server(provider), ledger, "pay_a", {"amount": 5})
    with pytest.raises(KeyReuseError):  # the same position with other arguments
        run(call, build_server(provider), ledger, "pay_a", {"amount": 6})

    async def outside_a_step() -> list[CallToolResult]:
        async with Client(build_server(provider)) as client:
            guarded = GuardedMCP(client, ledger, policies=POLICIES)
            return [
                await guarded.call_tool("pay_a", {"amount": 1}, key="invoice-7", meta={"x": 1})
                for _ in range(2)
            ]

    first, again = run(outside_a_step)
    assert first == again
    assert [d["args"]["amount"] for d in provider.deliveries()] == [5, 1]
    keys = {r.provider_key for r in ledger.effects()}
    assert {d["key"] for d in provider.deliveries()} == keys
    assert len(keys) == 2


# -- ambiguous ------------------------------------------------------------------------


def test_a_timeout_after_applying_is_settled_by_the_class(
    pclass: str, provider: Provider, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    tool, args = CALLS[pclass]
    provider.faults[tool] = ["hang"]
    server = build_server(provider)
    hang = {"timeout_s": HANG_TIMEOUT_S}
    name = f"execute_tool mcp:{tool}@1"
    if pclass == "C":  # never re-sent, by this process or another
        for led in (ledger, ledgers.fresh(owner="w2")):
            with pytest.raises(EffectInDoubt) as info:
                run(call, server, led, tool, args, **hang)
            assert info.value.status == "needs_human"
        assert len(provider.deliveries()) == 1
        assert only(ledger).status is EffectStatus.NEEDS_HUMAN
        assert [o for _, o in outcomes(spans)][:1] == ["in_doubt"]
        return
    result = run(call, server, ledger, tool, args, **hang)
    assert run(call, server, ledgers.fresh(owner="w2"), tool, args) == result
    [effect] = provider.effects(tool)
    assert result.structured_content == effect["result"]
    # A: re-sent once with the same key and answered from the server's store; B: one lookup.
    deliveries = provider.deliveries(tool)
    assert len(deliveries) == (2 if pclass == "A" else 1)
    assert len({d["key"] for d in deliveries}) == 1
    assert [d["fencing"][-2:] for d in deliveries] == [":1", ":2"][: len(deliveries)]
    assert only(ledger).status is EffectStatus.COMMITTED
    first = "executed" if pclass == "A" else "reconciled"
    assert outcomes(spans) == [(name, first), (name, "replayed")]


@pytest.mark.parametrize(("tool", "fault"), [("pay_a", "hang"), ("book_b", "stall")])
def test_the_default_policy_makes_the_resend_the_evidence_allows(
    provider: Provider, ledger: Ledger, tool: str, fault: str
) -> None:
    # No retry policy anywhere ([7] item 18): class A re-sends inside its window, class B
    # re-sends what its lookup proved did not happen; one timeout fails neither.
    provider.faults[tool] = [fault]
    args: dict[str, Any] = {"amount": 5} if tool == "pay_a" else {"room": "r1"}
    result = run(
        call, build_server(provider), ledger, tool, args, retry=None, timeout_s=HANG_TIMEOUT_S
    )
    [effect] = provider.effects(tool)
    assert result.structured_content == effect["result"]
    assert len(provider.deliveries(tool)) == 2
    assert only(ledger).status is EffectStatus.COMMITTED


def test_class_b_stalled_without_applying_is_probed_and_sent_again(
    provider: Provider, ledger: Ledger
) -> None:
    provider.faults["book_b"] = ["stall"]
    result = run(
        call, build_server(provider), ledger, "book_b", {"room": "r1"}, timeout_s=HANG_TIMEOUT_S
    )
    assert len(provider.deliveries("book_b")) == 2  # the lookup proved the first never applied
    [effect] = provider.effects("book_b")
    assert result.structured_content == effect["result"]
    assert [e["event"] for e in provider.lines() if e["event"] == "lookup"] == ["lookup"]
    rec = only(ledger)
    assert (rec.status, rec.epoch) == (EffectStatus.COMMITTED, 2)


def test_hints_never_change_the_guard_only_explicit_policies_do(
    provider: Provider, ledger: Ledger, spans: InMemorySpanExporter
) -> None:
    async def hints() -> Any:
        async with Client(build_server(provider)) as client:
            return (await client.list_tools()).tools

    [notify] = [t for t in run(hints) if t.name == "notify_c"]
    assert notify.annotations is not None
    assert notify.annotations.idempotent_hint  # it says so, and it is not
    assert notify.annotations.read_only_hint
    provider.faults["notify_c"] = ["hang"]
    with pytest.raises(EffectInDoubt):
        run(
            call,
            build_server(provider),
            ledger,
            "notify_c",
            {"text": "hi"},
            retry=RetryPolicy(max_attempts=5, initial_s=0.0),
            timeout_s=HANG_TIMEOUT_S,
        )
    assert len(provider.deliveries("notify_c")) == 1
    assert only(ledger).provider_class.value == "C"
    # An explicit opt-out: the read-only tool is called directly, every time.
    for _ in range(2):
        result = run(call, build_server(provider), ledger, "search", {"q": "x"})
        assert result.structured_content == {"result": ["x-1", "x-2"]}
    assert len(provider.deliveries("search")) == 2
    assert len(ledger.effects()) == 1
    assert [n for n, _ in outcomes(spans)] == ["execute_tool mcp:notify_c@1"]


def test_class_a_after_its_window_needs_a_human_not_a_resend(
    provider: Provider, ledger: Ledger, ledgers: Ledgers, clock: Clock
) -> None:
    provider.faults["pay_a"] = ["hang"]
    server = build_server(provider)
    one = RetryPolicy(max_attempts=1)
    with pytest.raises(EffectInDoubt) as info:  # one attempt: nothing left to re-send with
        run(call, server, ledger, "pay_a", {"amount": 5}, retry=one, timeout_s=HANG_TIMEOUT_S)
    assert isinstance(info.value.__cause__, MCPError)
    assert info.value.__cause__.code == REQUEST_TIMEOUT
    assert (info.value.status, only(ledger).lease_owner) == ("unknown", None)  # no claim left
    clock.advance(WINDOW_S + 60)
    with pytest.raises(EffectInDoubt) as doubt:
        run(call, server, ledgers.fresh(owner="w2"), "pay_a", {"amount": 5})
    assert doubt.value.status == "needs_human"
    assert len(provider.deliveries()) == 1
    assert only(ledger).status is EffectStatus.NEEDS_HUMAN


# -- rejected -------------------------------------------------------------------------


def test_refusals_fail_definitely_and_are_never_resent(
    provider: Provider, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    server = build_server(provider)
    with pytest.raises(MCPToolError) as info:  # the tool ran and answered isError
        run(call, server, ledger, "refuse", {"amount": 9})
    assert info.value.result.is_error
    assert "insufficient funds for 9" in str(info.value)
    with pytest.raises(MCPError) as refused:  # a JSON-RPC error (invalid params)
        run(call, server, ledger, "strict", {"amount": 9})
    assert refused.value.code == INVALID_PARAMS
    for led in (ledger, ledgers.fresh(owner="w2")):
        for tool, error_type in (("refuse", "MCPToolError"), ("strict", "MCPError")):
            with pytest.raises(EffectFailed) as failed:
                run(call, server, led, tool, {"amount": 9})
            assert failed.value.error_type == error_type
    assert [d["tool"] for d in provider.deliveries()] == ["refuse", "strict"]
    assert {r.status for r in ledger.effects()} == {EffectStatus.FAILED}
    names = [n for n, _ in outcomes(spans)]
    assert names == ["execute_tool mcp:refuse@1", "execute_tool mcp:strict@1"] * 3


def test_an_is_error_result_is_classified_per_tool(
    provider: Provider, ledger: Ledger, ledgers: Ledgers
) -> None:
    answer = {"refuse": MCPToolPolicy(is_error=OutcomeClass.SUCCEEDED)}
    server = build_server(provider)
    first = run(call, server, ledger, "refuse", {"amount": 9}, policies=answer)
    later = run(call, server, ledgers.fresh(owner="w2"), "refuse", {"amount": 9}, policies=answer)
    assert first == later
    assert first.is_error
    doubt = {"refuse": MCPToolPolicy(is_error="ambiguous", effect="refuse-doubt@1")}
    with pytest.raises(EffectInDoubt):
        run(call, server, ledger, "refuse", {"amount": 9}, policies=doubt)
    assert len(provider.deliveries()) == 2
    status = {r.effect: r.status for r in ledger.effects()}
    assert status == {"mcp:refuse@1": EffectStatus.COMMITTED, "refuse-doubt@1": NEEDS_HUMAN}


# -- not sent -------------------------------------------------------------------------


def test_a_client_that_is_not_connected_sends_nothing_and_is_retried_later(
    provider: Provider, ledger: Ledger, spans: InMemorySpanExporter
) -> None:
    async def main() -> CallToolResult:
        client = Client(build_server(provider))
        guarded = GuardedMCP(client, ledger, policies=POLICIES, retry=RETRY)
        with step("run-1", "act"), pytest.raises(MCPNotSent):
            await guarded.call_tool("notify_c", {"text": "hi"})
        rec = only(ledger)
        assert (rec.status, rec.attempts) == (EffectStatus.NOT_HAPPENED, RETRY.max_attempts)
        async with client:
            with step("run-1", "act"):
                return await guarded.call_tool("notify_c", {"text": "hi"})

    assert run(main).content[0].model_dump()["text"] == "sent: hi"
    assert len(provider.deliveries()) == 1
    assert only(ledger).status is EffectStatus.COMMITTED
    name = "execute_tool mcp:notify_c@1"
    assert outcomes(spans) == [(name, "failed"), (name, "executed")]


# -- configuration and classification -----------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"provider_class": "A"},
        {"provider_class": "B"},
        {"provider_class": "C", "lookup": "find"},
        {"provider_class": "A", "window_s": 60, "unguarded": True},
        {"is_error": OutcomeClass.NOT_SENT},
    ],
)
def test_a_policy_refuses_what_it_cannot_honour(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        MCPToolPolicy(**options)


def test_a_class_b_probe_may_be_a_callable(provider: Provider, ledger: Ledger) -> None:
    seen: list[str] = []

    def probe(record: EffectRecord) -> tuple[Evidence, Any]:
        seen.append(record.provider_key)
        found = provider.applied[f"book_b:{record.provider_key}"]
        return Evidence.HAPPENED, CallToolResult(content=[], structured_content=found)

    provider.faults["book_b"] = ["hang"]
    policies = {"book_b": MCPToolPolicy("B", lookup=probe)}
    result = run(
        call,
        build_server(provider),
        ledger,
        "book_b",
        {"room": "r1"},
        policies=policies,
        timeout_s=HANG_TIMEOUT_S,
    )
    assert seen == [only(ledger).provider_key]
    assert result.structured_content == provider.effects("book_b")[0]["result"]
    assert len(provider.deliveries()) == 1


def _raised(make: Callable[[], MCPError], context: BaseException | None) -> MCPError:
    """``make()`` raised as the SDK raises it (``from None`` inside ``except context``)."""
    try:
        if context is None:
            raise make()
        try:
            raise context
        except type(context):
            raise make() from None
    except MCPError as exc:
        return exc


@pytest.mark.parametrize(
    ("code", "context", "expected"),
    [
        (CONNECTION_CLOSED, anyio.BrokenResourceError(), OutcomeClass.NOT_SENT),
        (CONNECTION_CLOSED, anyio.ClosedResourceError(), OutcomeClass.NOT_SENT),
        (CONNECTION_CLOSED, None, OutcomeClass.AMBIGUOUS),  # died while waiting
        (REQUEST_TIMEOUT, None, OutcomeClass.AMBIGUOUS),
        (INTERNAL_ERROR, None, OutcomeClass.AMBIGUOUS),  # the handler crashed mid-way
        (-32010, None, OutcomeClass.AMBIGUOUS),
        (INVALID_PARAMS, None, OutcomeClass.REJECTED),
        (METHOD_NOT_FOUND, None, OutcomeClass.REJECTED),
    ],
)
def test_protocol_errors_are_classified_by_evidence(
    code: int, context: BaseException | None, expected: OutcomeClass
) -> None:
    exc = _raised(lambda: MCPError(code, "x"), context)
    assert classify_mcp(exc) is expected
    assert classify_mcp(MCPNotSent("t", "not connected")) is OutcomeClass.NOT_SENT
    assert classify_mcp(TimeoutError()) is OutcomeClass.AMBIGUOUS


# -- over stdio: a server process of its own ---------------------------------------------


@pytest.mark.slow
def test_over_stdio_a_and_c_are_settled_and_a_new_server_process_replays(
    tmp_path: Path, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    log = tmp_path / "stdio.jsonl"

    async def first() -> CallToolResult:
        async with Client(stdio(log, "pay_a=hang", "notify_c=crash")) as client:
            guarded = GuardedMCP(client, ledger, policies=POLICIES, retry=RETRY)
            with step("run-1", "act"):
                # A: the answer times out; re-sent with the same key, deduplicated.
                payment = await guarded.call_tool("pay_a", {"amount": 5}, timeout_s=1.0)
                # C: the server dies after acting, the connection is lost after sending.
                with pytest.raises(EffectInDoubt) as info:
                    await guarded.call_tool("notify_c", {"text": "hi"})
                assert info.value.status == "needs_human"
                return payment

    async def restart() -> CallToolResult:
        async with Client(stdio(log)) as client:
            guarded = GuardedMCP(client, ledgers.fresh(owner="w2"), policies=POLICIES)
            with step("run-1", "act"):
                with pytest.raises(EffectInDoubt):
                    await guarded.call_tool("notify_c", {"text": "hi"})
                return await guarded.call_tool("pay_a", {"amount": 5})

    payment = run(first)
    assert run(restart) == payment
    oracle = Provider(log)
    deliveries = oracle.deliveries("pay_a")
    assert len(deliveries) == 2
    keys = {r.effect: r.provider_key for r in ledger.effects()}
    assert {d["key"] for d in deliveries} == {keys["mcp:pay_a@1"]}
    assert payment.structured_content == oracle.effects("pay_a")[0]["result"]
    assert len(oracle.deliveries("notify_c")) == 1
    status = {r.effect: r.status for r in ledger.effects()}
    assert status == {"mcp:pay_a@1": EffectStatus.COMMITTED, "mcp:notify_c@1": NEEDS_HUMAN}
    assert [o for _, o in outcomes(spans)][:2] == ["executed", "in_doubt"]


@pytest.mark.slow
def test_over_stdio_a_server_that_dies_after_applying_is_settled_by_the_class(
    tmp_path: Path, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    log = tmp_path / "stdio.jsonl"

    async def crash() -> None:
        async with Client(stdio(log, "book_b=crash")) as client:
            guarded = GuardedMCP(client, ledger, policies=POLICIES, retry=RETRY)
            with step("run-1", "act"):
                # B: the connection is lost after sending; the lookup cannot be asked.
                with pytest.raises(EffectInDoubt) as doubt:
                    await guarded.call_tool("book_b", {"room": "r1"})
                assert doubt.value.status == "unknown"
                # The transport is closed now: nothing leaves, nothing is in doubt.
                with pytest.raises(MCPNotSent):
                    await guarded.call_tool("pay_a", {"amount": 5})

    async def restart() -> list[CallToolResult]:
        async with Client(stdio(log)) as client:
            guarded = GuardedMCP(client, ledgers.fresh(owner="w2"), policies=POLICIES)
            with step("run-1", "act"):
                return [
                    await guarded.call_tool("book_b", {"room": "r1"}),
                    await guarded.call_tool("pay_a", {"amount": 5}),
                ]

    run(crash)
    oracle = Provider(log)
    assert (len(oracle.deliveries("book_b")), len(oracle.deliveries("pay_a"))) == (1, 0)
    status = {r.effect: r.status for r in ledger.effects()}
    assert status == {"mcp:book_b@1": EffectStatus.UNKNOWN, "mcp:pay_a@1": NOT_HAPPENED}

    # Another process, another server: the lookup settles B, A is sent for the first time.
    booking, payment = run(restart)
    oracle = Provider(log)
    assert booking.structured_content == oracle.effects("book_b")[0]["result"]
    assert payment.structured_content == oracle.effects("pay_a")[0]["result"]
    assert (len(oracle.deliveries("book_b")), len(oracle.deliveries("pay_a"))) == (1, 1)
    assert {r.status for r in ledger.effects()} == {EffectStatus.COMMITTED}
    assert [e["tool"] for e in oracle.lines() if e["event"] == "lookup"] == ["find_booking"]
    assert outcomes(spans)[:2] == [
        ("execute_tool mcp:book_b@1", "in_doubt"),
        ("execute_tool mcp:pay_a@1", "failed"),
    ]


# -- class B lookups ------------------------------------------------------------------------


def unanswered_lookup_then_restart(provider: Provider, ledger: Ledger, later: Ledger) -> None:
    """Class B in doubt while its lookup is down; another process asks again later."""
    provider.faults["book_b"] = ["hang"]
    server = build_server(provider)
    down = {"book_b": MCPToolPolicy("B", lookup="lookup_down")}
    with pytest.raises(EffectInDoubt) as info:
        run(call, server, ledger, "book_b", {"room": "r1"}, policies=down, timeout_s=HANG_TIMEOUT_S)
    assert info.value.status == "unknown"
    assert [r.status for r in ledger.effects() if r.effect == "mcp:book_b@1"] == [UNKNOWN]
    result = run(call, server, later, "book_b", {"room": "r1"})
    assert result.structured_content == provider.effects("book_b")[0]["result"]


def test_class_b_whose_lookup_cannot_be_asked_stays_unknown_and_is_asked_later(
    provider: Provider, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    unanswered_lookup_then_restart(provider, ledger, ledgers.fresh(owner="w2"))
    assert len(provider.deliveries("book_b")) == 1
    lookups = [e["tool"] for e in provider.lines() if e["event"] == "lookup"]
    assert lookups == ["lookup_down", "find_booking"]
    assert only(ledger).status is EffectStatus.COMMITTED
    assert outcomes(spans)[0] == ("execute_tool mcp:book_b@1", "in_doubt")


# -- known gaps of the guard's spans ------------------------------------------------------


def test_every_guarded_span_says_how_it_settled(
    provider: Provider, ledger: Ledger, ledgers: Ledgers, spans: InMemorySpanExporter
) -> None:
    provider.faults["notify_c"] = ["hang"]
    for _ in range(2):  # C: needs a human, then its replay
        with pytest.raises(EffectInDoubt):
            run(
                call,
                build_server(provider),
                ledger,
                "notify_c",
                {"text": "hi"},
                timeout_s=HANG_TIMEOUT_S,
            )
    unanswered_lookup_then_restart(provider, ledger, ledgers.fresh(owner="w2"))
    assert [o for _, o in outcomes(spans)] == ["in_doubt", "in_doubt", "in_doubt", "reconciled"]
