"""Extras that match use: a base install imports the library, the harness and the demo
package, and ``onceonly demo`` without the ``demo`` extra says in one line what to install.

"Without the extra" is simulated in a child process: ``sys.modules[name] = None`` makes
``import name`` raise ImportError, as it would where the package is not installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from onceonly import demo

ROOT = Path(__file__).resolve().parents[1]
EXTRA_MODULES = ("httpx", "mail_devel", "starlette", "uvicorn")


def _without_extras(code: str) -> subprocess.CompletedProcess[str]:
    shim = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in EXTRA_MODULES)
    return subprocess.run(
        [sys.executable, "-c", shim + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_shim_makes_the_extras_unimportable() -> None:
    """Positive control: the child cannot import what the shim hides."""
    proc = _without_extras(
        "import importlib\n"
        f"for m in {EXTRA_MODULES!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError:\n"
        "        print('hidden', m)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == [f"hidden {m}" for m in EXTRA_MODULES]


def test_onceonly_demo_without_its_extra_says_which_in_one_line() -> None:
    proc = _without_extras(
        "sys.argv = ['onceonly', 'demo']\nfrom onceonly.cli import main\nmain()\n"
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pip install 'onceonly[demo]'" in lines[0]
    assert "httpx" in lines[0]


def test_a_base_install_imports_the_library_the_harness_and_the_demo_package() -> None:
    proc = _without_extras(
        "import onceonly, onceonly.cli, onceonly.demo, onceonly.testing\n"
        "import onceonly.testing.servers\n"
        "print(sorted(onceonly.demo.missing()))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(sorted(EXTRA_MODULES))


def test_the_demo_extra_installs_what_the_demo_checks_for() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def modules(extra: str) -> set[str]:
        return {re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0].replace("-", "_") for r in extras[extra]}

    assert modules("demo") == set(demo.REQUIRES) == set(EXTRA_MODULES)
    assert demo.missing() == []  # the dev install has it
    # The harness's fakes need their servers' packages, not the demo's runner.
    assert {"httpx", "starlette", "uvicorn"} <= modules("testing")
    assert modules("testing") <= modules("dev")
