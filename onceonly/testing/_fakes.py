"""Provider fakes and fresh databases for :mod:`onceonly.testing` (import them from there).

:class:`HTTPProvider` is a fake HTTP API on 127.0.0.1 (Starlette under uvicorn, in a
thread, an :class:`~onceonly.testing.servers.AppServer`); it needs the ``testing`` extra
(httpx, Starlette, uvicorn).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from onceonly.checkpoint import Store
from onceonly.ledger import Keyring, Ledger, ProviderClass, Secret

from .servers import AppServer, cut_response

if TYPE_CHECKING:
    import httpx
    from starlette.requests import Request
    from starlette.responses import Response

__all__ = [
    "FAULTS",
    "Clock",
    "Delivery",
    "HTTPProvider",
    "PostgresDatabases",
    "ProviderFake",
    "SQLiteDatabases",
]

FAULTS = ("refuse", "reject", "error", "cut", "timeout", "forget")
"""What :class:`HTTPProvider` can be told to do to a write request (``"ok"``: nothing):

* ``refuse``: the connection is refused; nothing reaches the provider (needs a client
  from :meth:`HTTPProvider.client`);
* ``reject``: a definite refusal (400) before applying;
* ``error``: a 500 before applying;
* ``cut``: apply, then break the connection before the answer;
* ``timeout``: apply, then answer only after ``sleep_s`` (past the client's timeout);
* ``forget``: apply, break the connection, and let the dedup window pass (the provider
  forgets the key and the shared :class:`Clock` moves past ``window_s``).
"""


class Clock:
    """A time source that stands still until told to move (leases never lapse by
    accident); share one between the harness and the fakes.

    Args:
        start: The starting UNIX time (default: now).
    """

    def __init__(self, start: float | None = None) -> None:
        self.start = time.time() if start is None else start
        self.now = self.start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move forward by ``seconds``."""
        self.now += seconds

    def reset(self) -> None:
        """Back to ``start`` (each harness run starts at the same time)."""
        self.now = self.start


# -- provider fakes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One write request as it reached a fake provider.

    Attributes:
        effect: What it asked for (``METHOD path body``): the oracle's identity of an
            effect, independent of our keys.
        key: The ``Idempotency-Key`` it carried (our provider key), if any.
        epoch: The fencing epoch it carried, if any.
        applied: Whether the provider performed it (False: deduplicated, refused,
            rejected, or a stale fencing token).
        status: What the provider answered (None: it broke the connection).
    """

    effect: str
    key: str | None
    epoch: int | None
    applied: bool
    status: int | None


class ProviderFake(Protocol):
    """What the harness needs of a fake provider (implement it for your own)."""

    @property
    def stale_token_calls(self) -> int:
        """Requests refused for carrying a stale fencing token."""
        ...

    def reset(self) -> None:
        """Forget everything (a fresh provider), re-arming the fault plan."""

    def deliveries(self) -> list[Delivery]:
        """Every write request that reached the provider, in arrival order."""
        ...

    def evidence(self, provider_key: str) -> tuple[bool, Any]:
        """Whether the effect sent with ``provider_key`` was performed, and the result
        the adapter would have recorded for it (an operator's look at the provider)."""
        ...


@dataclass
class _Stored:
    body: bytes
    response: Any
    at: float


class HTTPProvider:
    """A fake HTTP provider on 127.0.0.1 (see :mod:`onceonly.testing`).

    ``POST {url}/effects`` (any path; any write method) applies a request and answers 201
    with ``{"id": n, "request": <the JSON body>}``. A JSON body with ``"reject": true`` is
    refused definitely (400) without applying, to script definite failures. Class A
    replays the stored answer for a key seen within ``window_s`` (422 if it comes back
    with another body); class B answers ``GET {url}/lookup/{key}`` with 200
    and the stored answer, or 404 (lookups never forget). Every write must carry a quoted
    ``Idempotency-Key``; one whose ``X-Onceonly-Fencing`` epoch is lower than one already
    seen for its key is refused (412) and counted in :attr:`stale_token_calls`.

    Use as a context manager (``with HTTPProvider("B") as psp: ...``), or :meth:`start`
    and :meth:`stop`.

    Args:
        provider_class: ``"A"``, ``"B"`` or ``"C"``.
        window_s: Class A: how long keys are remembered, by ``clock``.
        clock: Time of the dedup window (share the harness's :class:`Clock`).
        sleep_s: How long a ``timeout`` fault holds the answer.

    Attributes:
        fault_plan: Faults for the write requests after each :meth:`reset`, in order
            (``"ok"`` for none; see :data:`FAULTS`).
        faults: What is left of the plan now.
    """

    def __init__(
        self,
        provider_class: ProviderClass | str = ProviderClass.QUERYABLE,
        *,
        window_s: float = 24 * 3600.0,
        clock: Clock | None = None,
        sleep_s: float = 0.8,
    ) -> None:
        from starlette.applications import Starlette  # noqa: PLC0415  (optional extra)
        from starlette.routing import Route  # noqa: PLC0415

        self.provider_class = ProviderClass(provider_class)
        self.window_s = window_s
        self.clock = clock or Clock()
        self.sleep_s = sleep_s
        self.fault_plan: list[str] = []
        self.faults: list[str] = []
        self._lock = threading.Lock()
        self._log: list[Delivery] = []
        self._lookups = 0
        self._stale = 0
        self._dedup: dict[str, _Stored] = {}
        self._done: dict[str, Any] = {}  # provider key -> answer, forever (lookups)
        self._epochs: dict[str, int] = {}
        self._applied = 0
        self.app = Starlette(
            routes=[
                Route("/lookup/{key}", self._lookup, methods=["GET"]),
                Route("/{path:path}", self._write, methods=["POST", "PUT", "PATCH", "DELETE"]),
            ]
        )
        self._http = AppServer(self.app, name="the fake provider")
        self.url = self._http.url

    # -- what the adapter configures ----------------------------------------------------
    @property
    def effects_url(self) -> str:
        """Where to send effects."""
        return f"{self.url}/effects"

    @property
    def lookup_url(self) -> str:
        """Class B: the lookup URL template for :class:`adapters.http.GuardedHTTP`."""
        return f"{self.url}/lookup/{{key}}"

    def client(self, *, timeout: float = 0.5) -> httpx.Client:
        """An ``httpx`` client for this provider whose ``refuse`` faults refuse the
        connection (nothing reaches the server). ``timeout`` is its read timeout; keep
        it below ``sleep_s`` so ``timeout`` faults time out."""
        import httpx  # noqa: PLC0415  (optional extra)

        provider = self

        class Refusing(httpx.BaseTransport):
            def __init__(self) -> None:
                self.inner = httpx.HTTPTransport()

            def handle_request(self, request: httpx.Request) -> httpx.Response:
                if request.method != "GET" and provider._take_refusal():
                    raise httpx.ConnectError("connection refused (fake)", request=request)
                return self.inner.handle_request(request)

            def close(self) -> None:
                self.inner.close()

        return httpx.Client(
            transport=Refusing(), timeout=httpx.Timeout(timeout, connect=5.0, pool=5.0)
        )

    # -- the oracle ---------------------------------------------------------------------
    @property
    def stale_token_calls(self) -> int:
        """Writes refused for a stale fencing token."""
        return self._stale

    @property
    def lookups(self) -> int:
        """Lookup requests received."""
        return self._lookups

    def deliveries(self) -> list[Delivery]:
        """Every write request that reached the provider, in arrival order."""
        with self._lock:
            return list(self._log)

    def applied(self) -> collections.Counter[str]:
        """How often each effect was performed."""
        return collections.Counter(d.effect for d in self.deliveries() if d.applied)

    def evidence(self, provider_key: str) -> tuple[bool, Any]:
        """Whether ``provider_key``'s effect was performed, and the recorded result of
        :class:`adapters.http.GuardedHTTP` for it."""
        with self._lock:
            if provider_key in self._done:
                return True, {"status": 201, "json": self._done[provider_key]}
        return False, None

    def reset(self) -> None:
        """A fresh provider: forget every request and key; re-arm :attr:`fault_plan`."""
        with self._lock:
            self._log.clear()
            self._dedup.clear()
            self._done.clear()
            self._epochs.clear()
            self._stale = 0
            self._lookups = 0
            self._applied = 0
            self.faults = list(self.fault_plan)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> HTTPProvider:
        """Serve (in a thread) until :meth:`stop`."""
        self._http.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._http.stop()

    def __enter__(self) -> HTTPProvider:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        self.stop()

    # -- handlers -----------------------------------------------------------------------
    def _take_refusal(self) -> bool:
        with self._lock:
            if self.faults and self.faults[0] == "refuse":
                self.faults.pop(0)
                return True
        return False

    def _forget_old(self) -> None:
        cutoff = self.clock() - self.window_s
        for key in [k for k, s in self._dedup.items() if s.at <= cutoff]:
            del self._dedup[key]

    async def _lookup(self, request: Request) -> Response:
        from starlette.responses import JSONResponse  # noqa: PLC0415

        key = request.path_params["key"]
        with self._lock:
            self._lookups += 1
            if self.provider_class is not ProviderClass.QUERYABLE:
                return JSONResponse({"error": "no lookups here"}, 405)
            if key not in self._done:
                return JSONResponse({"error": "unknown"}, 404)
            return JSONResponse(self._done[key], 200)

    async def _write(self, request: Request) -> Response:
        from starlette.responses import JSONResponse  # noqa: PLC0415

        body = await request.body()
        effect = f"{request.method} {request.url.path} {body.decode(errors='replace')}"
        header = request.headers.get("idempotency-key")
        fencing = request.headers.get("x-onceonly-fencing")
        key = (
            header[1:-1] if header and len(header) > 2 and header[0] == header[-1] == '"' else None
        )
        epoch: int | None = None
        if fencing and ":" in fencing:
            with contextlib.suppress(ValueError):
                epoch = int(fencing.rsplit(":", 1)[1])
        try:
            payload = json.loads(body or b"null")
        except ValueError:
            payload = None

        def answer(status: int, content: Any, *, applied: bool = False) -> Response:
            self._log.append(Delivery(effect, key, epoch, applied, status))
            return JSONResponse(content, status)

        with self._lock:
            fault = self.faults.pop(0) if self.faults else "ok"
            if key is None:
                return answer(400, {"error": "a quoted Idempotency-Key is required"})
            if epoch is not None:
                if epoch < self._epochs.get(key, 0):
                    self._stale += 1
                    return answer(412, {"error": "stale fencing token"})
                self._epochs[key] = epoch
            if fault == "reject" or (isinstance(payload, dict) and payload.get("reject") is True):
                return answer(400, {"error": "rejected"})
            if fault == "error":
                return answer(500, {"error": "internal error"})
            if self.provider_class is ProviderClass.DEDUPLICATING:
                self._forget_old()
                stored = self._dedup.get(key)
                if stored is not None:
                    if stored.body != body:
                        return answer(422, {"error": "key reused with another body"})
                    return answer(201, stored.response)
            self._applied += 1
            response = {"id": self._applied, "request": payload}
            self._done[key] = response
            if self.provider_class is ProviderClass.DEDUPLICATING:
                self._dedup[key] = _Stored(body, response, self.clock())
            broken = fault in ("cut", "forget", "timeout")
            self._log.append(
                Delivery(effect, key, epoch, applied=True, status=None if broken else 201)
            )
            if fault == "forget":
                self._dedup.pop(key, None)
                self.clock.advance(self.window_s + 1.0)
        if fault == "timeout":
            await asyncio.sleep(self.sleep_s)
        if fault in ("cut", "forget"):
            return cut_response()
        return JSONResponse(response, 201)


# -- databases ---------------------------------------------------------------------------


def create_schema(url: str) -> None:
    store = Store.open(url)
    try:
        Ledger(store, Keyring([Secret("schema", bytes(32))])).close()
    finally:
        store.close()


class SQLiteDatabases:
    """Fresh SQLite databases, each a copy of one with the schema (fast).

    Args:
        directory: Where to put them (default: a new temporary directory, removed by
            :meth:`close`). A tmpfs (``/dev/shm``) makes runs faster.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._own = directory is None
        self.directory = (
            tempfile.mkdtemp(prefix="onceonly-crash-")
            if directory is None
            else (os.fspath(directory))
        )
        self._template = os.path.join(self.directory, "template.db")
        self._n = 0
        self._last: str | None = None

    def __call__(self) -> str:
        """A fresh database URL (the previous one is deleted)."""
        if not os.path.exists(self._template):
            create_schema(f"sqlite:///{self._template}")
        self._drop_last()
        self._n += 1
        path = os.path.join(self.directory, f"run-{os.getpid()}-{self._n}.db")
        shutil.copyfile(self._template, path)
        self._last = path
        return f"sqlite:///{path}"

    def _drop_last(self) -> None:
        if self._last is not None:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._last + suffix)
            self._last = None

    def close(self) -> None:
        """Delete the databases (and the directory, if this object made it)."""
        self._drop_last()
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)


class PostgresDatabases:
    """A fresh PostgreSQL database per run: one database with the schema, emptied
    (``TRUNCATE``) before each run, which is much faster than creating one.

    Args:
        server_url: A URL of the server (``postgresql+psycopg://...``) whose user may
            create databases.
    """

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.name = "oo_crash_" + uuid.uuid4().hex[:12]
        base, _, query = server_url.partition("?")
        self.url = base.rsplit("/", 1)[0] + "/" + self.name + ("?" + query if query else "")
        self._engine: Any = None

    def _admin(self, sql: str) -> None:
        from sqlalchemy import create_engine, text  # noqa: PLC0415

        engine = create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text(sql))
        finally:
            engine.dispose()

    def __call__(self) -> str:
        """The database's URL, emptied of every run, effect and wait."""
        from sqlalchemy import create_engine, text  # noqa: PLC0415

        if self._engine is None:
            self._admin(f'CREATE DATABASE "{self.name}"')
            create_schema(self.url)
            self._engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        with self._engine.connect() as conn:
            tables = conn.execute(
                text(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
                    "AND tablename LIKE 'oo\\_%'"
                )
            ).scalars()
            conn.execute(text("TRUNCATE " + ", ".join(f'"{t}"' for t in tables)))
        return self.url

    def close(self) -> None:
        """Drop the database."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
            self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
