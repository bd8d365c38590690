"""A throwaway PostgreSQL server for tests and CI: unix socket only, never TCP.

Usage from the shell (``.ci/run``)::

    python -m tests.pgserver start DIR   # prints the database URL, writes DIR/url
    python -m tests.pgserver stop DIR    # fast shutdown by the pid in postmaster.pid

``initdb`` and ``pg_ctl`` refuse to run as root, so as root the server runs as the
``postgres`` user through ``runuser``.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _bindir() -> Path:
    env = os.environ.get("ONCEONLY_PG_BINDIR")
    if env:
        return Path(env)
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(cand, "initdb").exists():
            return Path(cand)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise RuntimeError(
        "PostgreSQL binaries not found; install them (apt-get install -y postgresql) or set "
        "ONCEONLY_TEST_PG_URL to an existing server"
    )


def _as_owner(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def start(base: Path) -> str:
    """Initialise (unless it was before: a restart after :func:`stop`) and start a
    cluster under ``base``; return its SQLAlchemy URL."""
    base.mkdir(parents=True, exist_ok=True)
    data, sock = base / "data", base / "sock"
    sock.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
        shutil.chown(sock, "postgres", "postgres")
        base.chmod(0o700)
    bindir = _bindir()
    if not (data / "PG_VERSION").exists():
        subprocess.run(
            _as_owner(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
    subprocess.run(
        _as_owner(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(base / "log"),
                "-w",
                "start",
                "-o",
                f"-c listen_addresses='' -k {sock} -c fsync=on -c max_connections=200",
            ]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    url = f"postgresql+psycopg://postgres@/postgres?host={sock}"
    (base / "url").write_text(url)
    return url


def stop(base: Path) -> None:
    """Fast shutdown (SIGINT) of the cluster under ``base``, by its pid file."""
    pidfile = base / "data" / "postmaster.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text().splitlines()[0])
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("start", "stop"):
        print("usage: python -m tests.pgserver start|stop DIR", file=sys.stderr)
        return 2
    base = Path(argv[2]).resolve()
    if argv[1] == "start":
        print(start(base))
    else:
        stop(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
