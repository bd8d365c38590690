"""Guarded adapters: wrap the clients agents already use so each effect happens once.

Built on the effects ledger (``ledger``); imports nothing from ``onceonly``. The guard
itself (:func:`guard`, keys from :func:`step`), and adapters for e-mail (SMTP, probed by
IMAP), rows in your own tables (``GuardedTable``) and LangGraph tool calls
(``ToolGuard``). Adapters with optional dependencies live in submodules: HTTP
(``adapters.http``), bookings (``adapters.booking``), MCP (``adapters.mcp``) and the
LangGraph checkpointer (``adapters.langgraph_saver``).
"""

if __name__ != "onceonly.adapters":  # imported as a top-level module (from a checkout's root)
    raise ImportError(
        f"import onceonly.adapters, not {__name__}: the folder adapters/ is the package "
        f"onceonly.adapters (a second copy under another name would not share its state)"
    )


from .context import StepDiverged, current_claim, identity_for, step
from .email import (
    EmailNotSent,
    EmailOutcomeUnknown,
    EmailRejected,
    EmailSendError,
    GuardedSMTP,
    IMAPMailbox,
    SentEmail,
    SMTPServer,
    classify_smtp,
)
from .guard import DEFAULT_RETRY, Probe, RetryPolicy, guard
from .langgraph import ToolGuard, ToolPolicy
from .record import (
    GuardedTable,
    RecordNotSent,
    RecordOutcomeUnknown,
    RecordRejected,
    RecordWriteError,
    ReferenceReuseError,
    classify_record,
)

__all__ = [
    "DEFAULT_RETRY",
    "EmailNotSent",
    "EmailOutcomeUnknown",
    "EmailRejected",
    "EmailSendError",
    "GuardedSMTP",
    "GuardedTable",
    "IMAPMailbox",
    "Probe",
    "RecordNotSent",
    "RecordOutcomeUnknown",
    "RecordRejected",
    "RecordWriteError",
    "ReferenceReuseError",
    "RetryPolicy",
    "SMTPServer",
    "SentEmail",
    "StepDiverged",
    "ToolGuard",
    "ToolPolicy",
    "classify_record",
    "classify_smtp",
    "current_claim",
    "guard",
    "identity_for",
    "step",
]
