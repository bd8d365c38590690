"""A demo worker process: ``python -m onceonly.demo._worker URL [--crash-after N FILE]``.

It drives the demo's runs as ``onceonly worker --flows onceonly.demo.flow:FLOWS`` would
(the same :class:`~onceonly.worker.Worker`, keyed from ``$ONCEONLY_SECRETS``), without
importing the command line. With ``--crash-after N FILE`` it SIGKILLs itself at the N-th
line it executes in onceonly's own code once it drives a run, after writing where to
FILE.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import onceonly
from onceonly.checkpoint import Store
from onceonly.ledger import Keyring, Ledger
from onceonly.runtime import Runtime
from onceonly.worker import Worker

from .flow import FLOWS

__all__ = ["main"]

OWNER = "demo-worker"


def _install_crash(after: int, where_file: str) -> None:
    """SIGKILL this process at the ``after``-th line executed in onceonly's own code once
    the worker drives a run (imports and idle polling are not counted)."""
    # The layers are linked under onceonly/: one root holds every module of ours.
    root = str(Path(onceonly.__file__).parent) + os.sep
    count = 0
    armed = False

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count, armed
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return None
        if not armed:
            if event == "call" and code.co_name == "drive":
                armed = True
            else:
                return tracer
        if event == "line":
            count += 1
            if count >= after:
                where = f"{Path(code.co_filename).name}:{frame.f_lineno} ({code.co_name})"
                Path(where_file).write_text(where + "\n")
                os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    threading.settrace(tracer)
    sys.settrace(tracer)


def main(argv: list[str]) -> int:
    """Drive the demo's runs on ``argv[0]`` until SIGTERM (which drains)."""
    url = argv[0]
    if len(argv) >= 4 and argv[1] == "--crash-after":
        _install_crash(int(argv[2]), argv[3])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per provider request
    with Store.open(url) as store:
        ledger = Ledger(store, Keyring.from_env(), owner=OWNER)
        try:
            rt = Runtime(store, ledger, FLOWS, owner=OWNER, lease_s=10)
            worker = Worker(rt, poll_s=0.1)
            worker.install_signal_handlers()
            stats = worker.run()
        finally:
            ledger.close()
    print(
        f"worker {OWNER} stopped: {stats.runs_driven} run(s) driven, "
        f"{stats.claim_conflicts} claim conflict(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
