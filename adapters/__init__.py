"""Guarded adapters: wrap the clients agents already use so each effect happens once.

Built on the effects ledger (``ledger``); imports nothing from ``onceonly``. This release
has the guard itself and the email adapter (SMTP, probed by IMAP); the other adapters
(HTTP, records, bookings, MCP, LangGraph) build on the same guard.
"""

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
from .guard import Probe, RetryPolicy, guard
from .langgraph import ToolGuard, ToolPolicy

__all__ = [
    "EmailNotSent",
    "EmailOutcomeUnknown",
    "EmailRejected",
    "EmailSendError",
    "GuardedSMTP",
    "IMAPMailbox",
    "Probe",
    "RetryPolicy",
    "SMTPServer",
    "SentEmail",
    "StepDiverged",
    "ToolGuard",
    "ToolPolicy",
    "classify_smtp",
    "current_claim",
    "guard",
    "identity_for",
    "step",
]
