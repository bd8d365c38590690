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


from typing import TYPE_CHECKING, Any

from .context import StepDiverged, current_claim, identity_for, step
from .guard import DEFAULT_RETRY, Probe, RetryPolicy, guard

if TYPE_CHECKING:
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

# The adapters are imported on first use (PEP 562): ``import onceonly.adapters`` costs the
# guard and its keys only, not smtplib/imaplib, SQLAlchemy's PostgreSQL dialect or the
# tool guard.
_LAZY = {
    name: module
    for module, names in (
        ("email", "EmailNotSent EmailOutcomeUnknown EmailRejected EmailSendError GuardedSMTP"),
        ("email", "IMAPMailbox SMTPServer SentEmail classify_smtp"),
        ("langgraph", "ToolGuard ToolPolicy"),
        ("record", "GuardedTable RecordNotSent RecordOutcomeUnknown RecordRejected"),
        ("record", "RecordWriteError ReferenceReuseError classify_record"),
    )
    for name in names.split()
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415  (only on first use of a lazy name)

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
