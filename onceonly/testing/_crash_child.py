"""The crash harness's mode ``"exit"``: processes that ``os._exit`` at a failpoint.

``python -m onceonly.testing._crash_child`` is a small fork server. It imports onceonly (and each
scenario's flow module, once), opens nothing, and then for every request it reads (one
JSON object per line on stdin) forks a child that runs the scenario with a failpoint
handler which calls ``os._exit(137)`` at the k-th hit: the child dies without unwinding,
flushing or closing anything, as a killed worker does. The server answers each request
with the child's exit status (one JSON object per line on stdout). A child that fails
otherwise writes its traceback to the request's ``log`` file and exits 1.

Forking from this single-threaded server instead of the test process keeps the children
cheap (no interpreter start, no imports) and safe (the test process runs the fakes'
server threads, which a fork would copy mid-flight).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import sys
import traceback
from typing import Any

from onceonly.checkpoint import Codec
from onceonly.ledger import Keyring, Secret

from ._fakes import Clock, create_schema
from ._harness import EXIT_CODE, SECRET, Scenario, run_once

__all__ = ["main", "request"]


def request(
    flow_ref: str,
    state: Any,
    signals: Any,
    url: str,
    at: int,
    secrets: list[Secret],
    clock_start: float,
    log: str,
    durability: str = "sync",
) -> str:
    """One request line for the server: crash the scenario at hit ``at`` (its store in
    ``durability`` mode)."""
    codec = Codec()
    return json.dumps(
        {
            "flow": flow_ref,
            "state": base64.b64encode(codec.encode(state)).decode(),
            "signals": base64.b64encode(codec.encode(signals)).decode(),
            "url": url,
            "at": at,
            "secrets": [[s.id, s.value.hex()] for s in secrets],
            "clock": clock_start,
            "log": log,
            "durability": durability,
        }
    )


def _run(req: dict[str, Any]) -> None:  # pragma: no cover  (runs in a forked child)
    codec = Codec()
    module, _, name = str(req["flow"]).partition(":")
    flow = getattr(importlib.import_module(module), name)
    state = codec.decode(base64.b64decode(req["state"]))
    signals = codec.decode(base64.b64decode(req["signals"]))
    at = int(req["at"])
    count = 0

    def die(failpoint: str) -> None:
        nonlocal count
        count += 1
        if count == at:
            os._exit(EXIT_CODE)

    keyring = Keyring([Secret(i, bytes.fromhex(v)) for i, v in req["secrets"]])
    run_once(
        req["url"],
        Scenario(flow, state, signals),
        keyring,
        Clock(req["clock"]),
        die,
        None,
        str(req.get("durability", "sync")),
    )


def _warm() -> None:  # pragma: no cover  (runs in the server)
    """Do once, here, what every child would otherwise pay for on its first run (lazy
    imports, dialect set-up): a run of a one-step flow on a throwaway SQLite database,
    closed before any fork."""
    import contextlib  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from onceonly.flow import Flow  # noqa: PLC0415

    with contextlib.suppress(ImportError):
        importlib.import_module("sqlalchemy.dialects.postgresql.psycopg")
    flow = Flow("warm-up")
    flow.step(name="only")(lambda ctx: ctx.end())
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/warm.db"
        create_schema(url)
        run_once(url, Scenario(flow), Keyring([SECRET]), Clock(), lambda _: None, None)


_warmed: list[bool] = []


def _serve_one(req: dict[str, Any]) -> int:  # pragma: no cover  (runs in the server)
    if not _warmed:
        _warm()
        _warmed.append(True)
    module = str(req["flow"]).partition(":")[0]
    importlib.import_module(module)  # once, here: every child inherits it
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _run(req)
        except BaseException:  # noqa: BLE001  (reported through the log file)
            with open(req["log"], "a", encoding="utf-8") as fh:
                fh.write(traceback.format_exc())
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:  # pragma: no cover  (runs in the server)
    """Serve requests from stdin until it closes."""
    for line in sys.stdin:
        if not line.strip():
            continue
        code = _serve_one(json.loads(line))
        sys.stdout.write(json.dumps({"code": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
