"""``import onceonly.adapters`` stays cheap: the adapters with optional or heavy
dependencies are imported on first use, and their names still resolve."""

from __future__ import annotations

import subprocess
import sys

import onceonly.adapters

HEAVY = ["httpx", "mcp", "langgraph", "langchain_core", "smtplib", "imaplib"]


def test_importing_the_adapters_imports_no_heavy_dependency() -> None:
    probe = (
        "import sys, onceonly.adapters\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('onceonly.adapters.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == ""
    assert set(out[1].split(",")) <= {
        "onceonly.adapters._guard_core",
        "onceonly.adapters.context",
        "onceonly.adapters.guard",
    }


def test_every_lazy_name_resolves_and_is_listed() -> None:
    for name in onceonly.adapters.__all__:
        assert getattr(onceonly.adapters, name) is not None
        assert name in dir(onceonly.adapters)
    from onceonly.adapters import GuardedTable, ToolGuard

    assert GuardedTable.__module__ == "onceonly.adapters.record"
    assert ToolGuard.__module__ == "onceonly.adapters.langgraph"
