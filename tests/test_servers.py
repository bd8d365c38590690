"""The one server helper behind every fake (:mod:`onceonly.testing.servers`): a server
answers between start and stop, only on 127.0.0.1, and is gone after stop."""

from __future__ import annotations

import importlib
import socket
import sys

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from onceonly.testing.servers import (
    HOST,
    AppServer,
    ProcessServer,
    cut_response,
    free_port,
    wait_listening,
)


def _refused(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), 1.0).close()
    except ConnectionRefusedError:
        return True
    return False


def _pid(server: ProcessServer) -> int | None:
    return server.pid  # (a call: mypy keeps no narrowing of it across start and stop)


def _running(server: AppServer) -> bool:
    return server.running


async def _hello(request: Request) -> Response:
    return PlainTextResponse("hello")


async def _cut(request: Request) -> Response:
    return cut_response()


APP = Starlette(routes=[Route("/", _hello), Route("/cut", _cut, methods=["POST"])])


def test_an_app_server_answers_between_start_and_stop_only() -> None:
    server = AppServer(APP, name="hello")
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert _refused(server.port)  # bound, not listening: nothing reaches the app
    with server:
        assert _running(server)
        assert httpx.get(server.url + "/", timeout=5).text == "hello"
        with pytest.raises(httpx.RemoteProtocolError):  # the answer is lost half-way
            httpx.post(server.url + "/cut", timeout=5)
    assert not _running(server)
    assert _refused(server.port)


def test_a_process_server_is_waited_for_and_stopped_by_its_pid() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", HOST, str(port)]
    server = ProcessServer(argv, ports=[port], name="http.server")
    assert _pid(server) is None
    with server:
        pid = _pid(server)
        assert pid is not None
        assert httpx.get(f"http://{HOST}:{port}/", timeout=5).status_code == 200
    assert _pid(server) is None
    assert _refused(port)
    with pytest.raises(ConnectionRefusedError):
        wait_listening(port, timeout_s=0.0)


def test_a_process_server_that_exits_is_reported() -> None:
    server = ProcessServer([sys.executable, "-c", "raise SystemExit(3)"], ports=[free_port()])
    with pytest.raises(RuntimeError, match="exited with status 3"):
        server.start(timeout_s=20)
    assert _pid(server) is None


@pytest.mark.parametrize("name", ["onceonly.testing", "onceonly.testing.servers", "onceonly.demo"])
def test_all_is_unique_and_every_name_exists(name: str) -> None:
    """(Its order is ruff's RUF022: constants, classes, functions, each sorted.)"""
    module = importlib.import_module(name)
    names = module.__all__
    assert len(names) == len(set(names))
    assert [n for n in names if not hasattr(module, n)] == []
