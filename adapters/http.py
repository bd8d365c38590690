"""HTTP adapter: an ``httpx`` client whose requests are effects that happen once.

Every request goes through :func:`adapters.guard` (one claim/act/record path). Inside the
guarded call the request carries the claim's provider key as an IETF ``Idempotency-Key``
(a quoted string) and its fencing token as ``X-Onceonly-Fencing``. Outcomes are
classified by evidence:

* ``ConnectError`` / ``ConnectTimeout`` / ``PoolTimeout``: nothing left → *not sent*
  (retried with the same key);
* a 2xx answer → *succeeded*; the recorded result is ``{"status": code, "json": body}``;
* a 4xx answer other than 409 → *rejected* (:class:`HTTPRejected`, recorded as FAILED);
* 409 (the provider is still working on our key), 5xx, other statuses, read timeouts
  and broken connections after sending → *ambiguous* (:class:`HTTPAmbiguous` or the
  ``httpx`` error): class A re-sends with the same key while its window is open, class B
  asks the ``lookup`` endpoint (and re-sends what it proves did not happen), class C
  needs a human. The default retry policy makes every re-send this evidence allows.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import EffectRecord, Evidence, Ledger, OutcomeClass, ProviderClass

from . import _http_outcome
from .context import current_claim
from .guard import Probe, RetryPolicy, guard

__all__ = [
    "AsyncGuardedHTTP",
    "GuardedHTTP",
    "HTTPAmbiguous",
    "HTTPRejected",
    "Lookup",
    "classify_http",
]

Lookup = str | Probe
"""Class B: a URL template with ``{key}`` (the provider key, URL-quoted) that answers 200
with the effect's response body if it happened and 404/410 if it did not, or a probe."""

_FENCING_HEADER = "X-Onceonly-Fencing"
_IDEMPOTENCY_HEADER = "Idempotency-Key"


class HTTPRejected(_http_outcome.AnswerError):
    """The provider refused the request definitely (4xx other than 409).

    Attributes:
        status: The HTTP status.
        body: The response body (JSON if it parsed, else text).
    """

    message = "HTTP {status} rejected"


class HTTPAmbiguous(_http_outcome.AnswerError):
    """The provider answered, but the answer does not say whether the effect happened
    (409 still in flight, 5xx, or an unexpected status).

    Attributes:
        status: The HTTP status.
        body: The response body (JSON if it parsed, else text).
    """

    message = "HTTP {status}: outcome unknown"


_IN_FLIGHT = frozenset({409})  # the provider is still working on our key


def classify_http(exc: BaseException) -> OutcomeClass:
    """The outcome of a failed request, by evidence."""
    return _http_outcome.classify(exc, HTTPRejected)


def _outcome(resp: httpx.Response) -> dict[str, Any]:
    """The recorded result of a 2xx answer, or the typed error of any other."""
    status = resp.status_code
    outcome = _http_outcome.status_outcome(status, ambiguous_4xx=_IN_FLIGHT)
    if outcome is OutcomeClass.SUCCEEDED:
        return {"status": status, "json": _http_outcome.body(resp)}
    if outcome is OutcomeClass.REJECTED:
        raise HTTPRejected(status, _http_outcome.body(resp))
    raise HTTPAmbiguous(status, _http_outcome.body(resp))


def _headers(extra: dict[str, str] | None) -> dict[str, str]:
    claim = current_claim()
    headers = dict(extra or {})
    headers[_IDEMPOTENCY_HEADER] = f'"{claim.provider_key}"'
    headers[_FENCING_HEADER] = claim.fencing_token
    return headers


def _lookup_url(template: str, record: EffectRecord) -> str:
    return template.format(key=urllib.parse.quote(record.provider_key, safe=""))


def _probe_fence(record: EffectRecord) -> dict[str, str]:
    """The lookup of an in-doubt entry carries the fencing token of the epoch a re-send
    would use: a provider that checks tokens fences out the in-doubt attempt from then
    on, so a stale send still in flight (its worker paused or slow past its lease)
    cannot land between a "not found" answer and the re-send."""
    return {_FENCING_HEADER: f"{record.provider_key}:{record.epoch + 1}"}


def _evidence(resp: httpx.Response) -> tuple[Evidence, Any]:
    if 200 <= resp.status_code < 300:
        return Evidence.HAPPENED, {"status": resp.status_code, "json": _http_outcome.body(resp)}
    if resp.status_code in (404, 410):
        return Evidence.NOT_HAPPENED, None
    return Evidence.INCONCLUSIVE, None


def _check(
    provider_class: ProviderClass | str, window_s: float | None, lookup: Lookup | None
) -> ProviderClass:
    pclass = ProviderClass(provider_class)
    if pclass is ProviderClass.QUERYABLE and lookup is None:
        raise ConfigurationError("a class B HTTP effect needs lookup= (URL template or probe)")
    if pclass is not ProviderClass.QUERYABLE and lookup is not None:
        raise ConfigurationError("lookup= is only used by class B HTTP effects")
    return pclass


class GuardedHTTP:
    """An ``httpx.Client`` whose requests are guarded effects.

    Args:
        client: The client (timeouts, base URL, auth, transport are its own).
        ledger: The effects ledger.
        retry: Attempts and pauses (default: :data:`adapters.DEFAULT_RETRY`: every re-send
            the evidence allows, a bounded number of times).
    """

    def __init__(
        self, client: httpx.Client, ledger: Ledger, *, retry: RetryPolicy | None = None
    ) -> None:
        self.client = client
        self.ledger = ledger
        self.retry = retry

    def _probe(self, lookup: Lookup) -> Probe:
        if not isinstance(lookup, str):
            return lookup
        template = lookup

        def get(record: EffectRecord) -> httpx.Response:
            return self.client.get(_lookup_url(template, record), headers=_probe_fence(record))

        return _http_outcome.lookup_probe(get, _evidence)

    def request(
        self,
        method: str,
        url: str,
        *,
        effect: str,
        json: Any = None,
        headers: dict[str, str] | None = None,
        provider_class: ProviderClass | str = ProviderClass.OPAQUE,
        window_s: float | None = None,
        lookup: Lookup | None = None,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Send a request once; return ``{"status": code, "json": body}``.

        The effect's identity comes from the current :func:`adapters.step` (or ``key``);
        the method, URL and JSON body are its fingerprinted arguments (headers are not).

        Args:
            method: HTTP method.
            url: URL (absolute, or relative to the client's base URL).
            effect: ``name@version``.
            json: The JSON body.
            headers: Extra headers.
            provider_class: ``A`` (honours Idempotency-Key for ``window_s``), ``B``
                (queryable through ``lookup``) or ``C`` (neither).
            window_s: Class A: the provider's retention of our key.
            lookup: Class B: URL template with ``{key}``, or a probe.
            key: An explicit key, for calls outside a step.

        Raises:
            HTTPRejected: Definite refusal (recorded; replayed as ``EffectFailed``).
            ledger.EffectInDoubt: The outcome is unknown and no evidence settles it (class
                A: no attempt was left to re-send it; the next call re-sends it while the
                window is open).
            ledger.EffectFailed: Replay of an earlier definite failure.
            httpx.HTTPError / HTTPAmbiguous: Retries exhausted.
        """
        pclass = _check(provider_class, window_s, lookup)

        def send(method: str, url: str, json: Any) -> dict[str, Any]:
            resp = self.client.request(method, url, json=json, headers=_headers(headers))
            return _outcome(resp)

        guarded = guard(
            self.ledger,
            effect=effect,
            provider_class=pclass,
            window_s=window_s,
            key=None if key is None else (lambda *_a, **_k: key),
            retry=self.retry,
            classify=classify_http,
            probe=None if lookup is None else self._probe(lookup),
        )(send)
        return guarded(method.upper(), url, json)

    def post(self, url: str, **options: Any) -> dict[str, Any]:
        """``request("POST", url, **options)``."""
        return self.request("POST", url, **options)


class AsyncGuardedHTTP:
    """An ``httpx.AsyncClient`` whose requests are guarded effects (see
    :class:`GuardedHTTP`). A class B lookup URL is fetched with the same client, on the
    caller's event loop, while the ledger's worker thread waits for it.
    """

    def __init__(
        self, client: httpx.AsyncClient, ledger: Ledger, *, retry: RetryPolicy | None = None
    ) -> None:
        self.client = client
        self.ledger = ledger
        self.retry = retry

    def _probe(self, lookup: Lookup, loop: asyncio.AbstractEventLoop) -> Probe:
        if not isinstance(lookup, str):
            return lookup
        template = lookup

        async def get(record: EffectRecord) -> httpx.Response:
            return await self.client.get(
                _lookup_url(template, record), headers=_probe_fence(record)
            )

        return _http_outcome.async_lookup_probe(get, _evidence, loop)

    async def request(
        self,
        method: str,
        url: str,
        *,
        effect: str,
        json: Any = None,
        headers: dict[str, str] | None = None,
        provider_class: ProviderClass | str = ProviderClass.OPAQUE,
        window_s: float | None = None,
        lookup: Lookup | None = None,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Send a request once; see :meth:`GuardedHTTP.request`."""
        pclass = _check(provider_class, window_s, lookup)
        loop = asyncio.get_running_loop()

        async def send(method: str, url: str, json: Any) -> dict[str, Any]:
            resp = await self.client.request(method, url, json=json, headers=_headers(headers))
            return _outcome(resp)

        guarded: Callable[[str, str, Any], Any] = guard(
            self.ledger,
            effect=effect,
            provider_class=pclass,
            window_s=window_s,
            key=None if key is None else (lambda *_a, **_k: key),
            retry=self.retry,
            classify=classify_http,
            probe=None if lookup is None else self._probe(lookup, loop),
        )(send)
        result: dict[str, Any] = await guarded(method.upper(), url, json)
        return result

    async def post(self, url: str, **options: Any) -> dict[str, Any]:
        """``await request("POST", url, **options)``."""
        return await self.request("POST", url, **options)
