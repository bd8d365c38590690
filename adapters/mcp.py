"""MCP adapter: an ``mcp.Client`` whose tool calls are effects that happen once.

Every ``tools/call`` goes through :func:`adapters.guard` (one claim/act/record path).
Inside the guarded call the request ``_meta`` carries the claim's provider key under
``onceonly/idempotency-key`` and its fencing token under ``onceonly/fencing-token``
(:class:`MetaKey`); a server may deduplicate by the first (class A), file its effects
under it and answer a lookup by it (class B), and refuse a stale epoch by the second.

The MCP spec has no idempotency key, and tool annotations (``idempotentHint``,
``destructiveHint``, ``readOnlyHint``) are untrusted hints: they are never read. What
a tool guarantees is configured per tool with a :class:`MCPToolPolicy`; a tool without one
is class C (guarded; an in-doubt call needs a human). Only an explicit
``MCPToolPolicy(unguarded=True)`` lets a tool you trust to be read-only bypass the ledger.

Outcomes are classified by evidence:

* the client is not connected, or its transport closed before the request was written
  → *not sent* (:class:`MCPNotSent`, or the SDK's connection-closed error raised by the
  failed write): retried with the same key;
* a JSON-RPC refusal (parse error, invalid request, method not found, invalid params,
  header mismatch, missing capability, unsupported version, elicitation required)
  → *rejected* (the SDK's ``MCPError``, recorded as FAILED);
* a result with ``isError`` → *rejected* by default (:class:`MCPToolError`: the tool
  ran and said no); per tool, ``is_error=SUCCEEDED`` records it as the call's result
  and ``is_error=AMBIGUOUS`` treats it as in doubt;
* a timeout, the connection lost after sending, an internal error or any other code,
  a result the client could not validate → *ambiguous*: class A re-sends with the same
  key while its window is open, class B asks its lookup, class C needs a human. A
  lookup that cannot be asked (closed connection, timeout, error) leaves the entry
  UNKNOWN (``EffectInDoubt`` with status ``unknown``): the next call asks again.

The recorded result is the JSON form ``{"content": [...], "structuredContent": ...,
"isError": bool}``. :meth:`GuardedMCP.call_tool` returns a ``CallToolResult`` rebuilt
from it, on the first call and on every replay alike (so the first call already drops
the server's result ``_meta``). A definite failure raises the typed error the first
time and :class:`ledger.EffectFailed` on replay, as in every adapter.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import anyio
import anyio.from_thread
import anyio.lowlevel
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    PARSE_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
    URL_ELICITATION_REQUIRED,
    CallToolResult,
    RequestParamsMeta,
)

from onceonly.checkpoint.errors import ConfigurationError, OnceOnlyError
from onceonly.ledger import (
    EffectInDoubt,
    EffectRecord,
    EffectStatus,
    Evidence,
    Ledger,
    OutcomeClass,
    ProviderClass,
)

from .context import current_claim
from .guard import Probe, RetryPolicy, guard

__all__ = ["GuardedMCP", "MCPNotSent", "MCPToolError", "MCPToolPolicy", "MetaKey", "classify_mcp"]


class MetaKey(enum.StrEnum):
    """The request ``_meta`` entries a guarded ``tools/call`` carries.

    * ``IDEMPOTENCY``: the claim's provider key (deduplicate by it, file effects under it);
    * ``FENCING``: ``<provider key>:<epoch>`` (refuse an epoch older than one seen).
    """

    IDEMPOTENCY = "onceonly/idempotency-key"
    FENCING = "onceonly/fencing-token"


_REFUSALS = frozenset(
    {
        PARSE_ERROR,
        INVALID_REQUEST,
        METHOD_NOT_FOUND,
        INVALID_PARAMS,
        HEADER_MISMATCH,
        MISSING_REQUIRED_CLIENT_CAPABILITY,
        UNSUPPORTED_PROTOCOL_VERSION,
        URL_ELICITATION_REQUIRED,
    }
)
_IS_ERROR_OUTCOMES = (OutcomeClass.REJECTED, OutcomeClass.SUCCEEDED, OutcomeClass.AMBIGUOUS)


class MCPNotSent(OnceOnlyError):
    """The client was not connected: the request never left.

    Attributes:
        tool: The tool's name.
    """

    def __init__(self, tool: str, reason: str) -> None:
        self.tool = tool
        super().__init__(f"tools/call {tool} not sent: {reason}")


class MCPToolError(OnceOnlyError):
    """The tool ran and answered with ``isError``.

    Attributes:
        tool: The tool's name.
        result: The tool's result (as recorded: content, structured content, isError).
        outcome: How the tool's policy classifies it (rejected or ambiguous).
    """

    def __init__(self, tool: str, result: CallToolResult, outcome: OutcomeClass) -> None:
        self.tool = tool
        self.result = result
        self.outcome = outcome
        text = " ".join(getattr(block, "text", "") for block in result.content).strip()
        super().__init__(f"tool {tool} answered isError: {text or '(no text)'}")


def classify_mcp(exc: BaseException) -> OutcomeClass:
    """The outcome of a failed ``tools/call``, by evidence (see the module docstring)."""
    if isinstance(exc, MCPNotSent):
        return OutcomeClass.NOT_SENT
    if isinstance(exc, MCPToolError):
        return exc.outcome
    if isinstance(exc, MCPError):
        if exc.code in _REFUSALS:
            return OutcomeClass.REJECTED
        # The SDK raises CONNECTION_CLOSED both when the write failed and when the
        # connection died while waiting; only the former (a closed or broken stream,
        # raised ``from None``) proves that nothing left.
        if (
            exc.code == CONNECTION_CLOSED
            and exc.__suppress_context__
            and isinstance(exc.__context__, anyio.BrokenResourceError | anyio.ClosedResourceError)
        ):
            return OutcomeClass.NOT_SENT
    return OutcomeClass.AMBIGUOUS


@dataclass(frozen=True)
class MCPToolPolicy:
    """What one tool guarantees, and how its calls are guarded.

    Attributes:
        provider_class: ``A`` (the server deduplicates by the idempotency key in
            ``_meta`` for ``window_s``), ``B`` (queryable through ``lookup``) or ``C``
            (neither: an in-doubt call needs a human).
        window_s: Class A: how long the server deduplicates our key.
        lookup: Class B: the name of a lookup tool, called with
            ``{lookup_argument: provider_key}``, that answers structured content
            ``{"found": false}`` or ``{"found": true, "result": ...}``; or a probe.
        lookup_argument: The lookup tool's argument that takes the provider key.
        is_error: How an ``isError`` result is classified: ``REJECTED`` (default,
            raises :class:`MCPToolError`), ``SUCCEEDED`` (recorded and returned) or
            ``AMBIGUOUS`` (in doubt, settled by the class).
        effect: ``name@version`` (default ``mcp:<tool>@1``).
        timeout_s: The read timeout of this tool's calls (default: the wrapper's).
        retry: Attempts and pauses (default: the wrapper's).
        unguarded: Call the tool directly, without the ledger: only for tools you
            trust to have no effect. Never inferred from annotations.
    """

    provider_class: ProviderClass | str = ProviderClass.OPAQUE
    window_s: float | None = None
    lookup: str | Probe | None = None
    lookup_argument: str = "key"
    is_error: OutcomeClass | str = OutcomeClass.REJECTED
    effect: str | None = None
    timeout_s: float | None = None
    retry: RetryPolicy | None = None
    unguarded: bool = False

    def __post_init__(self) -> None:
        pclass = ProviderClass(self.provider_class)
        object.__setattr__(self, "provider_class", pclass)
        if pclass is ProviderClass.DEDUPLICATING and (self.window_s is None or self.window_s <= 0):
            raise ConfigurationError("a class A MCP tool needs window_s > 0")
        if (pclass is ProviderClass.QUERYABLE) != (self.lookup is not None):
            raise ConfigurationError("lookup= is needed by, and only used by, class B tools")
        object.__setattr__(self, "is_error", OutcomeClass(self.is_error))
        if self.is_error not in _IS_ERROR_OUTCOMES:
            raise ConfigurationError("is_error must be REJECTED, SUCCEEDED or AMBIGUOUS")
        if self.unguarded and (pclass is not ProviderClass.OPAQUE or self.effect or self.retry):
            raise ConfigurationError("an unguarded tool takes no class, effect or retry")


_CLASS_C = MCPToolPolicy()


def _recorded(result: CallToolResult) -> dict[str, Any]:
    """The JSON form of a result that the ledger records and replays.

    Object keys are sorted, as the ledger's canonical codec stores them, so the first
    call's result is the replay's, key order included.
    """
    wire = result.model_dump(mode="json", by_alias=True)
    return {
        "content": [
            b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content
        ],
        "structuredContent": json.loads(json.dumps(wire.get("structuredContent"), sort_keys=True)),
        "isError": result.is_error,
    }


def _result(recorded: Any) -> CallToolResult:
    return CallToolResult.model_validate(recorded)


def _not_connected(client: Client) -> str | None:
    """Why ``client`` cannot send now, or None if it can (or we cannot tell)."""
    try:
        session = client.session
    except RuntimeError:
        return "the client is not connected (enter `async with client` first)"
    # mcp has no public flag; its dispatchers (JSON-RPC and in-process) keep ``_closed``.
    # No await separates this check from the SDK's own, so it sees the same state.
    if getattr(getattr(session, "_dispatcher", None), "_closed", False) is True:
        return "the connection is closed"
    return None


def _evidence(answer: CallToolResult) -> tuple[Evidence, Any]:
    data = answer.structured_content
    if answer.is_error or not isinstance(data, dict) or not isinstance(data.get("found"), bool):
        return Evidence.INCONCLUSIVE, None
    if not data["found"]:
        return Evidence.NOT_HAPPENED, None
    found = data.get("result")
    text = {"type": "text", "text": json.dumps(found, indent=2)}
    return Evidence.HAPPENED, {"content": [text], "structuredContent": found, "isError": False}


class GuardedMCP:
    """An ``mcp.Client`` whose tool calls are guarded effects.

    Args:
        client: The client (transport, timeouts, callbacks are its own); enter it
            (``async with client``) before calling tools.
        ledger: The effects ledger.
        policies: Per tool name, what it guarantees; other tools are class C.
        retry: Attempts and pauses (default: :data:`adapters.DEFAULT_RETRY`: every re-send
            the evidence allows, a bounded number of times).
        timeout_s: Read timeout of each call (default: the client's).
    """

    def __init__(
        self,
        client: Client,
        ledger: Ledger,
        *,
        policies: Mapping[str, MCPToolPolicy] | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.ledger = ledger
        self.policies = dict(policies or {})
        self.retry = retry
        self.timeout_s = timeout_s

    def policy(self, tool: str) -> MCPToolPolicy:
        """The policy of ``tool``: its configured one, else class C."""
        return self.policies.get(tool, _CLASS_C)

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        meta: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> CallToolResult:
        """Call a tool once; return its (recorded) result.

        The effect's identity comes from the current :func:`adapters.step` (or ``key``);
        the tool's name and arguments are its fingerprinted arguments (``meta`` is not).

        Args:
            name: The tool.
            arguments: Its arguments (JSON values).
            key: An explicit key, for calls outside a step.
            meta: Extra request ``_meta`` entries (the onceonly entries win).
            timeout_s: Read timeout of this call.

        Raises:
            MCPToolError: The tool answered ``isError`` (first call; its policy rejects).
            mcp.MCPError: A JSON-RPC refusal, or the last attempt's timeout or lost
                connection once retries are exhausted.
            MCPNotSent: The client was not connected (retries exhausted).
            ledger.EffectInDoubt: The outcome is unknown and no evidence settles it.
            ledger.EffectFailed: Replay of an earlier definite failure.
        """
        policy = self.policy(name)
        timeout = next(
            (t for t in (timeout_s, policy.timeout_s, self.timeout_s) if t is not None), None
        )
        if policy.unguarded:
            return await self.client.call_tool(
                name, dict(arguments or {}), read_timeout_seconds=timeout, meta=_meta(meta)
            )

        async def send(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
            reason = _not_connected(self.client)
            if reason is not None:
                raise MCPNotSent(name, reason)
            claim = current_claim()
            wire_meta = {
                **(meta or {}),
                MetaKey.IDEMPOTENCY.value: claim.provider_key,
                MetaKey.FENCING.value: claim.fencing_token,
            }
            answer = await self.client.call_tool(
                name, arguments, read_timeout_seconds=timeout, meta=_meta(wire_meta)
            )
            recorded = _recorded(answer)
            if answer.is_error and policy.is_error is not OutcomeClass.SUCCEEDED:
                raise MCPToolError(name, _result(recorded), OutcomeClass(policy.is_error))
            return recorded

        guarded: Callable[[str, dict[str, Any]], Any] = guard(
            self.ledger,
            effect=policy.effect or f"mcp:{name}@1",
            provider_class=policy.provider_class,
            window_s=policy.window_s,
            key=None if key is None else (lambda *_a, **_k: key),
            retry=policy.retry or self.retry,
            classify=classify_mcp,
            probe=self._probe(policy, timeout),
        )(send)
        return _result(await guarded(name, dict(arguments or {})))

    def _probe(self, policy: MCPToolPolicy, timeout: float | None) -> Probe | None:
        """Class B: the policy's probe, or one that calls its lookup tool on this loop."""
        lookup = policy.lookup
        if lookup is None:
            return None
        if not isinstance(lookup, str):
            return _normalised(lookup)
        token = anyio.lowlevel.current_token()
        tool = lookup

        async def ask(record: EffectRecord) -> tuple[Evidence, Any]:
            try:
                reason = _not_connected(self.client)
                if reason is not None:
                    raise MCPNotSent(tool, reason)
                answer = await self.client.call_tool(
                    tool,
                    {policy.lookup_argument: record.provider_key},
                    read_timeout_seconds=timeout,
                )
            except Exception as exc:  # any failure to ask; chained below
                # Not asked is not "no evidence": leave the entry UNKNOWN for the next
                # call (or another process) to ask again, instead of needing a human.
                detail = f"lookup {tool} unavailable: {type(exc).__name__}"
                raise EffectInDoubt(
                    record.key_id, EffectStatus.UNKNOWN.value, ProviderClass.QUERYABLE.value, detail
                ) from exc
            return _evidence(answer)

        def probe(record: EffectRecord) -> tuple[Evidence, Any]:
            # Called on the ledger's thread pool while the caller's loop awaits it.
            return anyio.from_thread.run(ask, record, token=token)

        return probe


def _normalised(probe: Probe) -> Probe:
    """A user probe whose found result may be a ``CallToolResult`` (recorded as JSON)."""

    def normalised(record: EffectRecord) -> tuple[Evidence, Any]:
        evidence, found = probe(record)
        return evidence, _recorded(found) if isinstance(found, CallToolResult) else found

    return normalised


def _meta(entries: Mapping[str, Any] | None) -> RequestParamsMeta | None:
    return None if entries is None else cast(RequestParamsMeta, dict(entries))
