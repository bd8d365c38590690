"""Booking adapter: holds and confirmations that happen once (a class B provider).

A booking API that does not deduplicate requests, but stores a client reference with
every hold and confirmation and can be asked for it (``GET /holds?client_reference=…``,
``GET /confirmations?client_reference=…``). :class:`GuardedBooking` (around an
``httpx.Client``) and :class:`AsyncGuardedBooking` (around an ``httpx.AsyncClient``) make
``reserve`` and ``confirm`` two guarded effects: each request carries the claim's
provider key as its ``client_reference`` (and the fencing token as
``X-Onceonly-Fencing``). Outcomes are classified by evidence:

* ``ConnectError`` / ``ConnectTimeout`` / ``PoolTimeout``: nothing left → *not sent*
  (retried with the same reference);
* 201/200 → *succeeded*;
* 4xx other than 408 and 429 (409 room taken, 422 invalid, 404 unknown hold) →
  *rejected* (:class:`BookingRejected`, recorded as FAILED, never re-sent);
* 5xx, 408, 429, read timeouts and broken connections → *ambiguous*: the lookup is asked
  for the reference. One match → committed with it (never re-sent); none → re-sent with
  the same reference if the retry policy allows; the lookup failing, or two matches (a
  duplicate made elsewhere) → needs a human.

The provider API it speaks is described in ``docs/howto-booking.md``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from collections.abc import Callable
from typing import Any, Generic, TypedDict, TypeVar

import httpx

from onceonly.ledger import EffectRecord, Evidence, Ledger, OutcomeClass, ProviderClass

from . import _http_outcome
from .context import current_claim
from .guard import Probe, RetryPolicy, guard

__all__ = [
    "AsyncGuardedBooking",
    "BookingAmbiguous",
    "BookingRejected",
    "Confirmation",
    "GuardedBooking",
    "Hold",
    "classify_booking",
]

_FENCING_HEADER = "X-Onceonly-Fencing"
_MAYBE_LATER = frozenset({408, 429})  # timed out, or throttled: not refused


class Hold(TypedDict):
    """The recorded result of :meth:`GuardedBooking.reserve`.

    Attributes:
        hold_id: The provider's hold id.
        room: The room held.
        night: The night held (ISO date).
        client_reference: The reference the hold was made with (the provider key).
    """

    hold_id: str
    room: str
    night: str
    client_reference: str


class Confirmation(TypedDict):
    """The recorded result of :meth:`GuardedBooking.confirm`.

    Attributes:
        confirmation_id: The provider's confirmation id.
        hold_id: The hold confirmed.
        client_reference: The reference the confirmation was made with.
    """

    confirmation_id: str
    hold_id: str
    client_reference: str


class BookingRejected(_http_outcome.AnswerError):
    """The provider refused definitely (a 4xx other than 408/429: taken, invalid, unknown);
    ``status`` and ``body`` (JSON if it parsed, else text) are its answer's."""

    message = "booking refused: HTTP {status}"


class BookingAmbiguous(_http_outcome.AnswerError):
    """The provider answered, but not whether the request was applied (5xx, 408, 429);
    ``status`` and ``body`` (JSON if it parsed, else text) are its answer's."""

    message = "booking answered HTTP {status}: outcome unknown"


def classify_booking(exc: BaseException) -> OutcomeClass:
    """The outcome of a failed booking request, by evidence."""
    return _http_outcome.classify(exc, BookingRejected)


def _body(resp: httpx.Response) -> Any:
    return _http_outcome.body(resp, empty="")


def _answer(resp: httpx.Response) -> dict[str, Any]:
    """The JSON object of a 2xx answer, or the typed error of any other (a 2xx answer
    that is not a JSON object says nothing certain)."""
    status = resp.status_code
    body = _body(resp)
    outcome = _http_outcome.status_outcome(status, ambiguous_4xx=_MAYBE_LATER)
    if outcome is OutcomeClass.SUCCEEDED and isinstance(body, dict):
        return body
    if outcome is OutcomeClass.REJECTED:
        raise BookingRejected(status, body)
    raise BookingAmbiguous(status, body)


def _hold(item: dict[str, Any]) -> Hold:
    return Hold(
        hold_id=str(item["id"]),
        room=str(item["room"]),
        night=str(item["night"]),
        client_reference=str(item["client_reference"]),
    )


def _confirmation(item: dict[str, Any]) -> Confirmation:
    return Confirmation(
        confirmation_id=str(item["id"]),
        hold_id=str(item["hold_id"]),
        client_reference=str(item["client_reference"]),
    )


def _evidence(
    resp: httpx.Response, result: Callable[[dict[str, Any]], Any]
) -> tuple[Evidence, Any]:
    """Exactly one match happened; none did not; anything else a human must see."""
    body = _body(resp) if resp.status_code == 200 else None
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list) or len(items) > 1:
        return Evidence.INCONCLUSIVE, None
    if not items:
        return Evidence.NOT_HAPPENED, None
    return Evidence.HAPPENED, result(items[0])


def _reference(record: EffectRecord) -> dict[str, str]:
    return {"client_reference": record.provider_key}


def _night(night: dt.date | str) -> str:
    return (
        night.isoformat()
        if isinstance(night, dt.date)
        else dt.date.fromisoformat(night).isoformat()
    )


def _headers() -> dict[str, str]:
    return {_FENCING_HEADER: current_claim().fencing_token}


_Client = TypeVar("_Client", bound=httpx.Client | httpx.AsyncClient)


class _Base(Generic[_Client]):
    def __init__(
        self,
        client: _Client,
        ledger: Ledger,
        *,
        retry: RetryPolicy | None = None,
        tenant: str = "",
        subject: str | None = None,
        reserve_effect: str = "booking.reserve@1",
        confirm_effect: str = "booking.confirm@1",
    ) -> None:
        self.client: _Client = client
        self.ledger = ledger
        self.retry = retry
        self.tenant = tenant
        self.subject = subject
        self.reserve_effect = reserve_effect
        self.confirm_effect = confirm_effect

    def _guard(
        self, effect: str, key: str | None, probe: Probe
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return guard(
            self.ledger,
            effect=effect,
            provider_class=ProviderClass.QUERYABLE,
            key=None if key is None else (lambda *_a, **_k: key),
            tenant=self.tenant,
            retry=self.retry,
            classify=classify_booking,
            probe=probe,
            subject=self.subject,
        )


class GuardedBooking(_Base[httpx.Client]):
    """Holds and confirmations through an ``httpx.Client``, each once.

    Args:
        client: The client (base URL of the booking API, timeouts and auth are its own).
        ledger: The effects ledger.
        retry: Attempts (not-sent requests and lookup-proven not-happened ones are
            retried with the same reference; default :data:`adapters.DEFAULT_RETRY`).
        tenant: Tenant for explicit keys.
        subject: Data subject whose key encrypts the payloads (default: the run).
        reserve_effect: ``name@version`` of the hold effect.
        confirm_effect: ``name@version`` of the confirmation effect.
    """

    def reserve(self, room: str, night: dt.date | str, *, key: str | None = None) -> Hold:
        """Hold ``room`` for ``night`` once; later calls with the same key replay the hold.

        Args:
            room: The room.
            night: The night (a date or an ISO date string).
            key: An explicit key (outside a step, or when the position is not stable).

        Returns:
            The recorded :class:`Hold`.

        Raises:
            BookingRejected: The provider refused (replayed as ``EffectFailed``).
            ledger.EffectInDoubt: The outcome was lost and the lookup could not tell.
            httpx.HTTPError / BookingAmbiguous: Retries exhausted.
        """

        def send(room: str, night: str) -> Hold:
            ref = current_claim().provider_key
            payload = {"client_reference": ref, "room": room, "night": night}
            return _hold(_answer(self.client.post("/holds", json=payload, headers=_headers())))

        guarded = self._guard(self.reserve_effect, key, self._lookup("/holds", _hold))
        result: Hold = guarded(send)(room, _night(night))
        return result

    def confirm(self, hold_id: str, *, key: str | None = None) -> Confirmation:
        """Confirm a hold once; later calls with the same key replay the confirmation.

        Args:
            hold_id: The hold (from :meth:`reserve`).
            key: An explicit key (outside a step, or when the position is not stable).

        Returns:
            The recorded :class:`Confirmation`.

        Raises:
            BookingRejected: The provider refused (e.g. 404 unknown hold).
            ledger.EffectInDoubt: The outcome was lost and the lookup could not tell.
            httpx.HTTPError / BookingAmbiguous: Retries exhausted.
        """

        def send(hold_id: str) -> Confirmation:
            payload = {"client_reference": current_claim().provider_key}
            resp = self.client.post(f"/holds/{hold_id}/confirm", json=payload, headers=_headers())
            return _confirmation(_answer(resp))

        probe = self._lookup("/confirmations", _confirmation)
        result: Confirmation = self._guard(self.confirm_effect, key, probe)(send)(hold_id)
        return result

    def _lookup(self, path: str, result: Callable[[dict[str, Any]], Any]) -> Probe:
        def get(record: EffectRecord) -> httpx.Response:
            return self.client.get(path, params=_reference(record))

        return _http_outcome.lookup_probe(get, functools.partial(_evidence, result=result))


class AsyncGuardedBooking(_Base[httpx.AsyncClient]):
    """:class:`GuardedBooking` around an ``httpx.AsyncClient``. The lookup of an in-doubt
    request runs with the same client, on the caller's event loop, while the ledger's
    worker thread waits for it."""

    async def reserve(self, room: str, night: dt.date | str, *, key: str | None = None) -> Hold:
        """Hold ``room`` for ``night`` once; see :meth:`GuardedBooking.reserve`."""

        async def send(room: str, night: str) -> Hold:
            ref = current_claim().provider_key
            payload = {"client_reference": ref, "room": room, "night": night}
            resp = await self.client.post("/holds", json=payload, headers=_headers())
            return _hold(_answer(resp))

        probe = self._lookup("/holds", _hold, asyncio.get_running_loop())
        result: Hold = await self._guard(self.reserve_effect, key, probe)(send)(room, _night(night))
        return result

    async def confirm(self, hold_id: str, *, key: str | None = None) -> Confirmation:
        """Confirm a hold once; see :meth:`GuardedBooking.confirm`."""

        async def send(hold_id: str) -> Confirmation:
            payload = {"client_reference": current_claim().provider_key}
            path = f"/holds/{hold_id}/confirm"
            return _confirmation(
                _answer(await self.client.post(path, json=payload, headers=_headers()))
            )

        probe = self._lookup("/confirmations", _confirmation, asyncio.get_running_loop())
        result: Confirmation = await self._guard(self.confirm_effect, key, probe)(send)(hold_id)
        return result

    def _lookup(
        self,
        path: str,
        result: Callable[[dict[str, Any]], Any],
        loop: asyncio.AbstractEventLoop,
    ) -> Probe:
        async def get(record: EffectRecord) -> httpx.Response:
            return await self.client.get(path, params=_reference(record))

        evidence = functools.partial(_evidence, result=result)
        return _http_outcome.async_lookup_probe(get, evidence, loop)
