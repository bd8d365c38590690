"""The test side of :mod:`property_tests.s3_worker`: start the zygote, spawn worker
processes from it, signal them by pid, learn how they ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "Zygote"]


class Zygote:
    """A zygote process and the worker processes forked from it (all killed by
    :meth:`close`, by pid)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        env = dict(os.environ, PYTHONPATH=str(ROOT), ONCEONLY_SECRETS="k1:" + "5a" * 32)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "property_tests.s3_worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        if first != "ready":
            raise RuntimeError(f"zygote did not start: {first!r}")
        self._lock = threading.Condition()
        self._spawned: list[int] = []
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            with self._lock:
                if parts and parts[0] == "spawned":
                    self._spawned.append(int(parts[1]))
                elif parts and parts[0] == "exit":
                    self.exits[int(parts[1])] = int(parts[2])
                    self.children.discard(int(parts[1]))
                self._lock.notify_all()

    def spawn(
        self, argv: list[str], *, log: str, env: dict[str, str] | None = None, mode: str = "cli"
    ) -> int:
        """Fork a worker; its pid."""
        req: dict[str, Any] = {
            "argv": argv,
            "env": env or {},
            "log": str(self.logs / log),
            "mode": mode,
        }
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            if not self._lock.wait_for(lambda: bool(self._spawned), 10):
                raise RuntimeError("zygote did not fork")
            pid = self._spawned.pop(0)
            self.children.add(pid)
        return pid

    def alive(self, pid: int) -> bool:
        with self._lock:
            return pid in self.children

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit code once the worker ended (None: still running after ``timeout``)."""
        with self._lock:
            self._lock.wait_for(lambda: pid in self.exits, timeout)
            return self.exits.get(pid)

    def signal(self, pid: int, sig: int) -> bool:
        """Send ``sig`` to a live worker of ours; False if it already ended."""
        if not self.alive(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self, pid: int) -> None:
        """SIGKILL a worker (a crash) and wait until it is reaped."""
        if self.signal(pid, signal.SIGKILL):
            self.wait(pid, 10)

    def close(self) -> None:
        with self._lock:
            pids = list(self.children)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self._lock:
                if not self.children:
                    break
            time.sleep(0.02)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
