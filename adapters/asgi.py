"""Idempotent endpoints of your own: an ASGI middleware that honours ``Idempotency-Key``.

Wrap a Starlette or FastAPI application (any ASGI application) in
:class:`IdempotencyMiddleware` and its POST and PATCH endpoints behave as Stripe's API and
the IETF httpapi *Idempotency-Key* draft describe:

* the same key with the same request (method, path, query, content type and body) gets
  the stored response again: status, the headers worth keeping and the body, with
  ``Idempotent-Replayed: true``; the handler does not run again;
* the same key with another request is ``422``;
* a request whose key is still in flight elsewhere (another worker, another connection)
  is ``409`` (after waiting up to the ledger's ``InFlightPolicy.wait_s`` for its outcome:
  if the first request finishes meanwhile, the second gets its replay);
* a request without the key passes through, or is ``400`` when ``required=True``;
* a malformed key (empty, longer than 255 characters, not printable ASCII, or given twice)
  is ``400``.

Each request is one effect on the one claim/commit path of the ledger
(:meth:`Ledger.aperform`): the claim is durable before the handler runs, and the response
is recorded before a byte of it reaches the client (so a client never sees a response a
retry could contradict). Keys are scoped: the entry's key is derived, keyed with the
ledger's secret, from the client's identity (the ``client`` callable, the entry's tenant),
the method, the path and the client's key; neither the key nor the path is stored in
plain text, and the request body only as a keyed fingerprint and an encrypted digest.

A handler that crashed mid-way (an exception, or the server killed) leaves its entry in
doubt: it may have applied its change. A retry with that key gets ``409`` with the
entry's key id, and is never run blindly; an operator who has looked resolves it
(``onceonly effects resolve KEY_ID --not-happened`` lets the next retry run,
``--happened`` answers it ``409`` with "happened, response unknown"). Responses with a
status in ``not_applied_statuses`` (your handlers' "nothing was changed" answers, such as
a validation error) are released instead of stored: a retry with the key runs again.

The retention window (``window_s``, default 24 h) is how long an entry is kept at least;
it is reported on every keyed response in the ``Idempotency-Key-Retention`` header (in
seconds). ``Ledger.apply_retention`` removes entries only after it; a key used again after
its entry was removed is a new request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import blake3

from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import (
    Claim,
    EffectFailed,
    EffectInDoubt,
    EffectInFlight,
    KeyReuseError,
    Ledger,
    LedgerUnavailable,
    OutcomeClass,
    ProviderClass,
    ResultUnknown,
)

from .context import _acting, explicit_identity

__all__ = ["IdempotencyMiddleware", "StoredResponse"]

log = logging.getLogger("onceonly.adapters")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MAX_KEY = 255
# Not replayed: they describe one connection or one moment, not the resource's answer.
_NOT_KEPT = frozenset(
    {
        "connection",
        "content-length",
        "date",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "server",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


@dataclass(frozen=True)
class StoredResponse:
    """A handler's response as the ledger keeps it (encrypted) for replays.

    Attributes:
        status: The HTTP status.
        headers: ``(name, value)`` pairs worth replaying (lower-case names, in order).
        body: The whole body.
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def to_record(self) -> dict[str, Any]:
        """The codec-encodable form stored as the effect's result."""
        return {
            "status": self.status,
            "headers": [list(h) for h in self.headers],
            "body": self.body,
        }

    @classmethod
    def from_record(cls, record: Any) -> StoredResponse:
        """The response of a stored result (see :meth:`to_record`)."""
        return cls(
            status=int(record["status"]),
            headers=tuple((str(n), str(v)) for n, v in record["headers"]),
            body=bytes(record["body"]),
        )


class _NotApplied(Exception):
    """The handler answered with a status its author declared as "nothing changed"."""

    def __init__(self, response: StoredResponse) -> None:
        super().__init__(f"status {response.status}: nothing was applied")
        self.response = response


def _classifier(
    user: Callable[[BaseException], OutcomeClass] | None,
) -> Callable[[BaseException], OutcomeClass]:
    def classify(exc: BaseException) -> OutcomeClass:
        if isinstance(exc, _NotApplied):
            return OutcomeClass.NOT_SENT
        return OutcomeClass.AMBIGUOUS if user is None else OutcomeClass(user(exc))

    return classify


class IdempotencyMiddleware:
    """ASGI middleware: the wrapped application's POST/PATCH endpoints honour
    ``Idempotency-Key`` with the effects ledger (see the module docstring).

    Example::

        app = Starlette(routes=[...])
        app = IdempotencyMiddleware(app, ledger, client=lambda scope: scope["state"]["account"])

    Inside a handler, :func:`adapters.current_claim` gives the request's claim: pass its
    ``provider_key`` on to the providers the handler calls, so a retried request reaches
    them with the same key.

    Args:
        app: The ASGI application.
        ledger: The effects ledger the requests are recorded in. Its ``InFlightPolicy``
            says how long a concurrent request with the same key waits before ``409``
            (``wait_s=0``: at once, as Stripe does), and its ``lease_s`` how long a claim
            lives without renewal (the middleware renews it while the handler runs).
        methods: The methods that honour the key (others pass through untouched).
        required: Answer ``400`` to a request of those methods without the key.
        window_s: Retention window: how long an entry is kept at least (reported in the
            ``Idempotency-Key-Retention`` header).
        client: The caller's identity from the ASGI scope (an account or API-client id,
            not a secret): keys of different clients never meet. Default: one scope for
            every caller, right only when the service has a single client.
        header: The request header carrying the key.
        effect: ``name@version`` of the entries (bump the version when the endpoints'
            meaning changes).
        not_applied_statuses: Response statuses your handlers return only when they
            changed nothing: released, not stored (a retry runs again).
        classify: Outcome of an exception the handler raised, by evidence (default:
            ambiguous, so the entry is in doubt; ``OutcomeClass.NOT_SENT`` lets a retry
            run again).

    Raises:
        ConfigurationError: No methods, a window that is not positive, or a header name
            that is not a token.
    """

    def __init__(
        self,
        app: ASGIApp,
        ledger: Ledger,
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool = False,
        window_s: float = 86_400.0,
        client: Callable[[Scope], str] | None = None,
        header: str = "Idempotency-Key",
        effect: str = "http-endpoint@1",
        not_applied_statuses: Collection[int] = (),
        classify: Callable[[BaseException], OutcomeClass] | None = None,
    ) -> None:
        self.methods = frozenset(m.upper() for m in methods)
        if not self.methods:
            raise ConfigurationError("IdempotencyMiddleware needs at least one method")
        if window_s <= 0:
            raise ConfigurationError("IdempotencyMiddleware needs window_s > 0 (seconds)")
        if not header or not all(c.isalnum() or c in "-_" for c in header):
            raise ConfigurationError(f"header {header!r} is not a header name (letters, digits, -)")
        self.app = app
        self.ledger = ledger
        self.required = required
        self.window_s = float(window_s)
        self.client = client
        self.header = header.lower().encode("latin-1")
        self.header_name = header
        self.effect = effect
        self.not_applied = frozenset(int(s) for s in not_applied_statuses)
        self._classify = _classifier(classify)
        self._retention = str(int(self.window_s)).encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope."""
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        values = [v for n, v in scope["headers"] if n.lower() == self.header]
        if not values:
            if self.required:
                await self._problem(send, 400, "Idempotency-Key missing", self._missing())
                return
            await self.app(scope, receive, send)
            return
        key = _parse_key(values)
        if key is None:
            detail = (
                f"send one {self.header_name} header whose value is 1 to {_MAX_KEY} printable "
                f'ASCII characters (a quoted string, "...", as the IETF draft says, or bare)'
            )
            await self._problem(send, 400, "Idempotency-Key malformed", detail)
            return
        body = await _read_body(receive)
        if body is None:  # the client went away before its request was complete
            return
        await self._keyed(scope, receive, send, key, body)

    # -- one keyed request ------------------------------------------------------------

    async def _keyed(
        self, scope: Scope, receive: Receive, send: Send, key: str, body: bytes
    ) -> None:
        tenant = self.client(scope) if self.client is not None else ""
        method, path = scope["method"], scope.get("root_path", "") + scope["path"]
        ident = explicit_identity(self.effect, json.dumps([method, path, key]), tenant)
        args = {
            "method": method,
            "path": path,
            "query": scope.get("query_string", b"").decode("latin-1"),
            "content_type": _header(scope, b"content-type"),
            "body": blake3.blake3(body).hexdigest(),
        }

        ran = False

        async def act(claim: Claim) -> dict[str, Any]:
            nonlocal ran
            ran = True
            response = await self._handle(scope, receive, body, claim)
            if response.status in self.not_applied:
                raise _NotApplied(response)
            return response.to_record()

        try:
            try:
                record = await self.ledger.aperform(
                    ident,
                    args,
                    act,
                    provider_class=ProviderClass.OPAQUE,
                    window_s=self.window_s,
                    classify=self._classify,
                )
            except _NotApplied as released:
                await self._respond(send, released.response, replayed=False)
                return
        except KeyReuseError as exc:
            detail = (
                f"this {self.header_name} was used with another request (method, path, query "
                f"or body); use a new key for a new request (entry {exc.key_id})"
            )
            await self._problem(send, 422, "Idempotency-Key reused", detail)
            return
        except EffectInFlight as exc:
            detail = (
                f"a request with this {self.header_name} is still being processed; retry "
                f"later to get its response (entry {exc.key_id})"
            )
            await self._problem(send, 409, "Request in flight", detail, retry_after=True)
            return
        except (EffectInDoubt, ResultUnknown) as exc:
            detail = (
                f"the first request with this {self.header_name} did not finish and may have "
                f"been applied; it is not run again until an operator resolves entry "
                f"{exc.key_id} (`onceonly effects resolve {exc.key_id} --happened|"
                f"--not-happened --evidence TEXT`)"
            )
            await self._problem(send, 409, "Request in doubt", detail)
            return
        except EffectFailed as exc:
            detail = f"the first request with this key failed ({exc.error_type}); use a new key"
            await self._problem(send, 500, "Request failed", detail)
            return
        except LedgerUnavailable:
            detail = "the idempotency ledger cannot be written; nothing was done, retry later"
            await self._problem(send, 503, "Ledger unavailable", detail, retry_after=True)
            return
        await self._respond(send, StoredResponse.from_record(record), replayed=not ran)

    async def _handle(
        self, scope: Scope, receive: Receive, body: bytes, claim: Claim
    ) -> StoredResponse:
        """Run the application on the buffered request under ``claim``; its response is
        captured (not sent) so it can be recorded first."""
        delivered = False

        async def replay_receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status = 500
        headers: list[tuple[str, str]] = []
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers.extend(
                    (n.decode("latin-1").lower(), v.decode("latin-1"))
                    for n, v in message.get("headers", [])
                )
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        renewing = asyncio.create_task(self._renew(claim))
        try:
            with _acting(claim, self.ledger):
                await self.app(scope, replay_receive, capture)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
        kept = tuple((n, v) for n, v in headers if n not in _NOT_KEPT)
        return StoredResponse(status, kept, b"".join(chunks))

    async def _renew(self, claim: Claim) -> None:
        """Keep the claim's lease alive while the handler runs (a slow handler is not
        taken for a dead one); a lost lease is left for the commit to report."""
        pause = self.ledger.lease_s / 3
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(pause)
            try:
                claim = await loop.run_in_executor(self.ledger.executor(), self.ledger.renew, claim)
            except Exception:  # noqa: BLE001  (the commit's compare-and-set decides)
                log.warning("could not renew the lease of request entry %s…", claim.key_id[:16])
                return

    # -- answers ----------------------------------------------------------------------

    async def _respond(self, send: Send, response: StoredResponse, *, replayed: bool) -> None:
        headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in response.headers]
        headers.append((b"content-length", str(len(response.body)).encode("ascii")))
        headers.append((b"idempotency-key-retention", self._retention))
        if replayed:
            headers.append((b"idempotent-replayed", b"true"))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})

    async def _problem(
        self, send: Send, status: int, title: str, detail: str, *, retry_after: bool = False
    ) -> None:
        """An RFC 9457 problem response."""
        body = json.dumps(
            {"type": "about:blank", "title": title, "status": status, "detail": detail}
        )
        headers = [(b"content-type", b"application/problem+json")]
        if retry_after:
            headers.append((b"retry-after", b"1"))
        response = StoredResponse(
            status, tuple((n.decode(), v.decode()) for n, v in headers), body.encode("utf-8")
        )
        await self._respond(send, response, replayed=False)

    def _missing(self) -> str:
        return (
            f"this endpoint requires an {self.header_name} header: send a unique value per "
            f"intended request, and the same value when retrying it"
        )


def _parse_key(values: list[bytes]) -> str | None:
    """The key of the header's one value, or None when it is malformed."""
    if len(values) != 1:
        return None
    try:
        raw = values[0].decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':  # an sf-string, as the draft writes it
        raw = raw[1:-1]
    if not 0 < len(raw) <= _MAX_KEY or not all(" " <= c <= "~" for c in raw):
        return None
    return raw


def _header(scope: Scope, name: bytes) -> str:
    for n, v in scope["headers"]:
        if n.lower() == name:
            return str(v.decode("latin-1"))
    return ""


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(bytes(message.get("body", b"")))
        if not message.get("more_body", False):
            return b"".join(chunks)
