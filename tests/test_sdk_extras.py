"""The ASGI middleware and the agent SDK guards import without their SDKs; using an SDK
guard without its extra says in one line what to install."""

from __future__ import annotations

import subprocess
import sys

HIDDEN = ("pydantic_ai", "agents", "starlette", "uvicorn", "httpx")


def _without(code: str) -> subprocess.CompletedProcess[str]:
    shim = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in HIDDEN)
    return subprocess.run(
        [sys.executable, "-c", shim + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_modules_import_without_their_sdks_and_name_the_extra() -> None:
    proc = _without(
        "import onceonly.adapters.asgi, onceonly.adapters.pydantic_ai\n"
        "from onceonly.adapters.openai_agents import AgentsToolGuard\n"
        "try:\n"
        "    AgentsToolGuard(None).hooks\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "guarding Agents SDK tools needs the extra: pip install 'onceonly[openai-agents]'"
    ]


def test_control_the_shim_hides_the_sdks() -> None:
    proc = _without("import agents\n")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr or "ModuleNotFoundError" in proc.stderr
