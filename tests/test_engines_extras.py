"""The engine adapters without their extras: ``onceonly.adapters`` still imports, and
importing ``onceonly.adapters.temporal`` / ``.celery`` says in one line what to install.

"Without the extra" is simulated in a child process (``sys.modules[name] = None`` makes
``import name`` raise ImportError, as where the package is not installed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "hidden", "extra"),
    [("temporal", "temporalio", "temporal"), ("celery", "celery", "celery")],
)
def test_an_engine_adapter_without_its_extra_says_what_to_install(
    module: str, hidden: str, extra: str
) -> None:
    code = (
        f"import sys\nsys.modules[{hidden!r}] = None\n"
        "import onceonly.adapters\n"
        "try:\n"
        f"    import onceonly.adapters.{module}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert f"pip install 'onceonly[{extra}]'" in lines[0]
