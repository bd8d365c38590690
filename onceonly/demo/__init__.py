"""``onceonly demo``: vendor onboarding against real local servers, with a worker killed
mid-run and resumed.

* :mod:`onceonly.demo.flow`: the flow (the example to copy), ``FLOWS`` for a worker;
* :mod:`onceonly.demo.services`: the servers it talks to, each counting raw deliveries;
* :func:`main`: the runner behind ``onceonly demo``.

The demo needs the ``demo`` extra (mail-devel, httpx, Starlette, uvicorn). Without it,
:func:`main` says so in one line and returns 2; nothing else is imported until then.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["EXTRA", "REQUIRES", "main", "missing"]

REQUIRES = ("httpx", "mail_devel", "starlette", "uvicorn")
"""The modules the demo imports (its flow, its servers), from the ``demo`` extra."""

EXTRA = "pip install 'onceonly[demo]'"
"""What installs them."""


def missing() -> list[str]:
    """The modules of :data:`REQUIRES` that are not installed here (found, not imported)."""
    return [name for name in REQUIRES if importlib.util.find_spec(name) is None]


def main(db: str | None = None, crash_at: str = "approval", seed: int | None = None) -> int:
    """Run the demo; returns the process exit code.

    Args:
        db: A SQLite file to create (default: one in a temporary directory).
        crash_at: ``"approval"`` (kill the worker while the run waits for approval) or
            ``"random"`` (kill workers at random lines, again and again).
        seed: The seed of ``"random"`` (to replay a sequence of kills).

    Returns:
        0 when every effect happened once; 1 when not; 2 when the demo cannot run (an
        existing ``db``, or the ``demo`` extra is not installed: one line says which).
    """
    gone = missing()
    if gone:
        print(
            f"onceonly demo needs the demo extra ({', '.join(gone)} missing): {EXTRA}",
            file=sys.stderr,
        )
        return 2
    from ._runner import run  # noqa: PLC0415  (imports the extra)

    return run(db, crash_at=crash_at, seed=seed)
