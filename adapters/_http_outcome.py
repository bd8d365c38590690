"""What an HTTP answer says about an effect: the status → outcome classification that the
HTTP adapter (:mod:`adapters.http`) and the booking adapter (:mod:`adapters.booking`)
share, and the lookup probe both build on.

By evidence:

* ``ConnectError`` / ``ConnectTimeout`` / ``PoolTimeout``: nothing left → *not sent*;
* a 2xx answer → *succeeded*;
* a 4xx answer → *rejected*, except the statuses a provider uses for "not applied yet,
  maybe later" (each adapter names its own: 409 in flight for HTTP, 408/429 for
  bookings) → *ambiguous*;
* any other answer, and errors after sending → *ambiguous*.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import httpx

from onceonly.checkpoint.errors import OnceOnlyError
from onceonly.ledger import EffectRecord, Evidence, OutcomeClass

from .guard import Probe

NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""The ``httpx`` errors raised before a request left."""


class AnswerError(OnceOnlyError):
    """An answer other than success; each adapter's errors say what kind.

    Attributes:
        status: The HTTP status.
        body: The response body (JSON if it parsed, else text).
    """

    message: ClassVar[str] = "HTTP {status}"

    def __init__(self, status: int, body: Any = None) -> None:
        self.status = status
        self.body = body
        super().__init__(self.message.format(status=status))


def classify(exc: BaseException, rejected: type[Exception]) -> OutcomeClass:
    """The outcome of a failed request by evidence: not sent, ``rejected`` (the adapter's
    refusal error) or ambiguous."""
    if isinstance(exc, NOT_SENT):
        return OutcomeClass.NOT_SENT
    if isinstance(exc, rejected):
        return OutcomeClass.REJECTED
    return OutcomeClass.AMBIGUOUS


def status_outcome(status: int, *, ambiguous_4xx: frozenset[int]) -> OutcomeClass:
    """The outcome an answer's ``status`` is evidence of.

    Args:
        status: The HTTP status.
        ambiguous_4xx: The 4xx statuses that do not say the request was refused.
    """
    if 200 <= status < 300:
        return OutcomeClass.SUCCEEDED
    if 400 <= status < 500 and status not in ambiguous_4xx:
        return OutcomeClass.REJECTED
    return OutcomeClass.AMBIGUOUS


def body(resp: httpx.Response, *, empty: Any = None) -> Any:
    """The response body: JSON if it parses, else text; ``empty`` when there is none."""
    if not resp.content:
        return empty
    try:
        return resp.json()
    except ValueError:
        return resp.text


def lookup_probe(
    get: Callable[[EffectRecord], httpx.Response],
    evidence: Callable[[httpx.Response], tuple[Evidence, Any]],
) -> Probe:
    """A probe that fetches the lookup of an in-doubt entry with ``get`` and reads the
    ``evidence`` of its answer; a failed fetch is inconclusive."""

    def probe(record: EffectRecord) -> tuple[Evidence, Any]:
        try:
            resp = get(record)
        except httpx.HTTPError:
            return Evidence.INCONCLUSIVE, None
        return evidence(resp)

    return probe


def async_lookup_probe(
    get: Callable[[EffectRecord], Awaitable[httpx.Response]],
    evidence: Callable[[httpx.Response], tuple[Evidence, Any]],
    loop: asyncio.AbstractEventLoop,
) -> Probe:
    """:func:`lookup_probe` for an async client: the guard calls probes on the ledger's
    thread pool while ``loop`` awaits it, so the fetch runs on ``loop``."""

    async def fetch(record: EffectRecord) -> httpx.Response:
        return await get(record)

    def get_on_loop(record: EffectRecord) -> httpx.Response:
        return asyncio.run_coroutine_threadsafe(fetch(record), loop).result()

    return lookup_probe(get_on_loop, evidence)
