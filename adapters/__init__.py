"""Guarded adapters: wrap the clients agents already use so each effect happens once.

Built on the effects ledger (``ledger``); imports nothing from ``onceonly``. This release
has the guard itself; the concrete adapters (HTTP, email, records, bookings, MCP,
LangGraph) build on it.
"""

from .context import current_claim, identity_for, step
from .guard import Probe, RetryPolicy, guard

__all__ = ["Probe", "RetryPolicy", "current_claim", "guard", "identity_for", "step"]
