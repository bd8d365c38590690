"""Worker processes for the process suites S3 and S4, started from a *zygote*.

Starting a Python worker costs 1-2 s of imports on a busy CI machine; a soak of 150+
SIGKILLs cannot afford that per kill. ``python -m property_tests.s3_worker`` imports
everything a worker needs once (single-threaded, no database connection), then forks one
child per request it reads on stdin, as JSON lines::

    {"argv": [...], "env": {...}, "log": "/path/worker.log", "mode": "cli" | "direct"}

and answers ``spawned <pid>`` on stdout; when a child ends it prints ``exit <pid> <rc>``
(``rc`` negative: killed by that signal). Each child is a real, separate worker process
(its own database connections, threads, leases) that the test SIGKILLs, SIGSTOPs and
SIGCONTs by pid, exactly as it would a freshly exec'd one:

* ``mode=cli``: the child runs the ``onceonly worker`` command line (``argv`` are its
  arguments): the code path users run;
* ``mode=direct`` (S4): ``argv`` is ``[url, owner, lease_s, claim_lease_s, batch,
  poll_s, durability]``; the child builds the same Store (in that durability mode) /
  Ledger / Runtime / Worker, but with the ledger's claim lease short too (the CLI keeps
  it at 30 s), so a paused worker's claim lapses within the test.
"""

from __future__ import annotations

import json
import os
import select
import sys
from typing import Any

# Everything a worker imports, loaded once before any fork.
import httpx  # noqa: F401
import sqlalchemy  # noqa: F401

import onceonly.cli
import property_tests.s3_flows
from onceonly.checkpoint import Store
from onceonly.ledger import Keyring, Ledger, Secret
from onceonly.runtime import Runtime
from onceonly.worker import Worker

SECRET_HEX = "5a" * 32


def _direct(argv: list[str]) -> int:
    url, owner, lease_s, claim_lease_s, batch, poll_s, durability = argv
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    keyring = Keyring([Secret("k1", bytes.fromhex(SECRET_HEX))])
    with Store.open(url, durability=durability) as store:
        ledger = Ledger(store, keyring, owner=owner, lease_s=float(claim_lease_s))
        try:
            rt = Runtime(
                store, ledger, property_tests.s3_flows.FLOWS, owner=owner, lease_s=float(lease_s)
            )
            worker = Worker(rt, batch=int(batch), poll_s=float(poll_s))
            worker.install_signal_handlers()
            worker.run()
        finally:
            ledger.close()
    return 0


def _child(req: dict[str, Any]) -> None:
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(req.get("env") or {})
    code = 1
    try:
        if req.get("mode") == "direct":
            code = _direct(list(req["argv"]))
        else:
            onceonly.cli.cli.main(list(req["argv"]), standalone_mode=False)
            code = 0
    except BaseException as exc:  # noqa: BLE001  (a worker that stops: its exit code says so)
        import traceback

        traceback.print_exc()
        code = 3 if not isinstance(exc, SystemExit) else int(exc.code or 0)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"exit {pid} {rc}", flush=True)


def main() -> int:
    print("ready", flush=True)
    buf = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return 0  # the test closed our stdin: children are its to kill
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(req)
            print(f"spawned {pid}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
