"""The ASGI middleware over real HTTP: uvicorn on 127.0.0.1, httpx clients, concurrent
callers, a handler that crashes, and a server SIGKILLed in the middle of a request.

The oracle is the external provider's raw log (``FakeProvider.writes``): every order the
service placed with it, counted by the provider itself. Each harness has a control
without the middleware, which shows the duplicate the middleware prevents.
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine

from onceonly.adapters.asgi import IdempotencyMiddleware
from onceonly.checkpoint.errors import ConfigurationError
from onceonly.ledger import Ledger
from onceonly.testing.servers import AppServer, ProcessServer, free_port
from tests.asgi_service import build_app, client_of, open_ledger
from tests.http_fake import FakeProvider, running
from tests.ledger_support import all_values

ORDER = {"item": "espresso machine", "qty": 1}


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    """The external provider the service places orders with (one per module; each test
    counts from where it starts)."""
    with running(FakeProvider(dedup=False, require_key=False)) as fake:
        yield fake


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    led = open_ledger(db_url)
    try:
        yield led
    finally:
        led.close()
        led.store.close()


class Counted:
    """Deliveries to the provider since the test began."""

    def __init__(self, provider: FakeProvider) -> None:
        self.provider = provider
        self.start = len(provider.writes)

    def __call__(self) -> int:
        return len(self.provider.writes) - self.start


def serve(app: Any) -> AppServer:
    return AppServer(app, name="the user's service")


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def post(url: str, key: str | None, body: Any = ORDER, **named: str) -> httpx.Response:
    """POST an order; ``X_Client="acme"`` sends the header ``X-Client: acme``."""
    headers = {name.replace("_", "-"): value for name, value in named.items()}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{url}/orders", json=body, headers=headers, timeout=30)


def entry_of(response: httpx.Response) -> str:
    found = re.search(r"entry ([0-9a-f]{16,})", response.json()["detail"])
    assert found, response.text
    return found.group(1)


def test_replay_reuse_scope_and_pass_through(
    provider: FakeProvider, ledger: Ledger, db_url: str
) -> None:
    count = Counted(provider)
    app = IdempotencyMiddleware(build_app(provider.url), ledger, client=client_of, window_s=3600)
    with serve(app) as server:
        url = server.url
        first = post(url, "order-7f3a-secret-ish", X_Client="acme")
        assert first.status_code == 201
        assert first.headers["idempotency-key-retention"] == "3600"
        assert "idempotent-replayed" not in first.headers
        assert count() == 1

        # same key, same request: the stored response, not a second order
        for key in ("order-7f3a-secret-ish", '"order-7f3a-secret-ish"'):  # bare and sf-string
            again = post(url, key, X_Client="acme")
            assert again.status_code == 201
            assert again.json() == first.json()
            assert again.headers["location"] == first.headers["location"]
            assert again.headers["x-order"] == first.headers["x-order"]
            assert again.headers["idempotent-replayed"] == "true"
            assert again.headers["idempotency-key-retention"] == "3600"
        assert count() == 1

        # same key, another payload: 422, nothing placed
        other = post(url, "order-7f3a-secret-ish", {"item": "grinder"}, X_Client="acme")
        assert other.status_code == 422
        assert other.headers["content-type"] == "application/problem+json"
        assert "new key" in other.json()["detail"]
        assert count() == 1

        # keys are scoped: another client, or another path, is another request
        assert post(url, "order-7f3a-secret-ish", X_Client="globex").status_code == 201
        assert count() == 2
        elsewhere = httpx.post(
            f"{url}/other-orders",
            json=ORDER,
            headers={"Idempotency-Key": "order-7f3a-secret-ish", "X-Client": "acme"},
            timeout=30,
        )
        assert elsewhere.status_code == 201
        assert count() == 3
        # PATCH honours the key too
        patched = httpx.patch(
            f"{url}/orders", json=ORDER, headers={"Idempotency-Key": "p-1"}, timeout=30
        )
        assert (
            httpx.patch(
                f"{url}/orders", json=ORDER, headers={"Idempotency-Key": "p-1"}, timeout=30
            ).json()
            == patched.json()
        )
        assert count() == 4

        # malformed keys: 400, nothing placed
        for bad in ("", '""', "x" * 256, "caf\u00e9"):
            raw = bad.encode("utf-8")
            resp = httpx.post(
                f"{url}/orders", json=ORDER, headers=[(b"Idempotency-Key", raw)], timeout=30
            )
            assert resp.status_code == 400, bad
        two = httpx.post(
            f"{url}/orders",
            json=ORDER,
            headers=[(b"Idempotency-Key", b"a"), (b"Idempotency-Key", b"b")],
            timeout=30,
        )
        assert two.status_code == 400
        assert count() == 4

        # without a key: passes through (not required here); GET is never touched
        assert post(url, None).status_code == 201
        assert post(url, None).status_code == 201
        assert count() == 6
        assert httpx.get(f"{url}/orders", timeout=30).status_code == 200

    # the key the client sent is nowhere in the database in plain text
    engine = create_engine(db_url)
    try:
        values = all_values(engine)
    finally:
        engine.dispose()
    for _table, value in values:
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        assert "order-7f3a" not in text
        assert "espresso" not in text


def test_required_key_and_released_statuses(provider: FakeProvider, ledger: Ledger) -> None:
    count = Counted(provider)
    app = IdempotencyMiddleware(
        build_app(provider.url), ledger, required=True, not_applied_statuses={400}
    )
    with serve(app) as server:
        missing = post(server.url, None)
        assert missing.status_code == 400
        assert "requires an Idempotency-Key" in missing.json()["detail"]
        assert count() == 0
        # a "nothing changed" answer is released, not stored: the retry runs again
        assert post(server.url, "k-invalid", {"qty": 1}).status_code == 400
        assert post(server.url, "k-invalid", {"qty": 1}).status_code == 400
        assert count() == 0


def test_concurrent_clients_one_order(provider: FakeProvider, ledger: Ledger) -> None:
    count = Counted(provider)
    gate = threading.Event()
    body = {**ORDER, "wait": True}
    app = IdempotencyMiddleware(build_app(provider.url, gate=gate), ledger)
    with serve(app) as server, concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(post, server.url, "k-concurrent", body)
        wait_for(lambda: count() == 1, "the first request to reach the provider")
        # the key is in flight: every concurrent request is 409, none reaches the provider
        racing = list(pool.map(lambda _: post(server.url, "k-concurrent", body), range(7)))
        assert {r.status_code for r in racing} == {409}
        assert racing[0].headers["retry-after"] == "1"
        gate.set()
        assert first.result().status_code == 201
        after = list(pool.map(lambda _: post(server.url, "k-concurrent", body), range(8)))
        assert {r.status_code for r in after} == {201}
        assert {r.json()["order"] for r in after} == {first.result().json()["order"]}
    assert count() == 1


def test_control_without_middleware_places_every_retry(provider: FakeProvider) -> None:
    count = Counted(provider)
    with (
        serve(build_app(provider.url)) as server,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        answers = list(pool.map(lambda _: post(server.url, "k-control"), range(8)))
    assert {r.status_code for r in answers} == {201}
    assert count() == 8  # the duplicate the middleware prevents


def test_handler_crash_is_in_doubt_until_resolved(provider: FakeProvider, ledger: Ledger) -> None:
    count = Counted(provider)
    body = {**ORDER, "boom": True}
    app = IdempotencyMiddleware(build_app(provider.url), ledger)
    with serve(app) as server:
        assert post(server.url, "k-boom", body).status_code == 500
        assert count() == 1
        retry = post(server.url, "k-boom", body)
        assert retry.status_code == 409
        assert "onceonly effects resolve" in retry.json()["detail"]
        assert count() == 1  # not run blindly again
        # an operator who checked the provider says it did not happen: the retry runs
        ledger.resolve(
            entry_of(retry), happened=False, evidence="no order at the provider", actor="ops"
        )
        assert post(server.url, "k-boom", body).status_code == 500
        assert count() == 2


def test_configuration_errors(tmp_path: Any) -> None:
    ledger = open_ledger(f"sqlite:///{tmp_path / 'config.db'}")
    app = build_app("http://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="window_s"):
        IdempotencyMiddleware(app, ledger, window_s=0)
    with pytest.raises(ConfigurationError, match="method"):
        IdempotencyMiddleware(app, ledger, methods=())
    with pytest.raises(ConfigurationError, match="header name"):
        IdempotencyMiddleware(app, ledger, header="Idempotency Key")
    ledger.store.close()


def _server(db_url: str, provider: FakeProvider, *flags: str) -> tuple[ProcessServer, str]:
    """The service in its own process (not started yet), and its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.asgi_service", db_url, str(port), provider.url, *flags]
    return ProcessServer(argv, ports=[port], name="the user's service"), f"http://127.0.0.1:{port}"


def _kill(server: ProcessServer) -> None:
    proc = server._proc
    assert proc is not None
    proc.kill()  # SIGKILL
    proc.wait(30)


def _kill_mid_request(
    db_url: str, provider: FakeProvider, *flags: str, then: Callable[[str], None] | None = None
) -> httpx.Response:
    """Place an order with a server that hangs after the provider applied it, SIGKILL the
    server there, restart it, and retry the same request; the retry's answer. ``then``
    is given the restarted server's URL before that server is SIGKILLed in turn."""
    count = Counted(provider)
    hanging, url = _server(db_url, provider, "--hang", *flags)
    hanging.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            lost = pool.submit(post, url, "k-killed", ORDER, X_Client="acme")
            wait_for(lambda: count() == 1, "the provider to apply the order")
            _kill(hanging)
            with pytest.raises(httpx.TransportError):
                lost.result()
    finally:
        hanging.stop()
    restarted, url = _server(db_url, provider, *flags)
    with restarted:
        retry = post(url, "k-killed", ORDER, X_Client="acme")
        if then is not None:
            then(url)
            _kill(restarted)
    return retry


@pytest.mark.slow
def test_sigkill_mid_request_then_retry(provider: FakeProvider, db_url: str) -> None:
    count = Counted(provider)
    first: list[httpx.Response] = []

    def answered_then_killed(url: str) -> None:
        first.append(post(url, "k-done", ORDER, X_Client="acme"))

    retry = _kill_mid_request(db_url, provider, then=answered_then_killed)
    assert retry.status_code == 409  # in doubt: the order may exist; never placed twice
    assert first[0].status_code == 201
    assert count() == 2

    # the request whose response was recorded: the server restarted again replays it
    server, url = _server(db_url, provider)
    with server:
        again = post(url, "k-done", ORDER, X_Client="acme")
    assert again.status_code == 201
    assert again.json() == first[0].json()
    assert again.headers["idempotent-replayed"] == "true"
    assert count() == 2


@pytest.mark.slow
def test_control_sigkill_without_middleware_places_twice(
    provider: FakeProvider, tmp_path: Any
) -> None:
    count = Counted(provider)
    retry = _kill_mid_request(f"sqlite:///{tmp_path / 'unused.db'}", provider, "--unguarded")
    assert retry.status_code == 201
    assert count() == 2  # the duplicate the middleware prevents
