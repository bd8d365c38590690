"""onceonly's effects ledger: durable intent before acting, recorded outcomes after.

Built on the checkpoint core (``checkpoint``), in the same database; imports nothing from
``adapters`` or ``onceonly``.
"""

from ._schema import migrate
from .audit import AuditReport
from .errors import (
    EffectFailed,
    EffectInDoubt,
    EffectInFlight,
    InvalidTransition,
    KeyReuseError,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    PayloadErased,
    RunFenced,
    SubjectErased,
    UnknownEffect,
)
from .fence import RunFence, current_fence, run_fence
from .keys import EffectIdentity, KeyRecipe, Keyring, Secret
from .ledger import Ledger
from .records import (
    Claim,
    EffectRecord,
    EffectStatus,
    Evidence,
    InFlightPolicy,
    OutcomeClass,
    ProviderClass,
    Replay,
    RetentionPolicy,
)

__all__ = [
    "AuditReport",
    "Claim",
    "EffectFailed",
    "EffectIdentity",
    "EffectInDoubt",
    "EffectInFlight",
    "EffectRecord",
    "EffectStatus",
    "Evidence",
    "InFlightPolicy",
    "InvalidTransition",
    "KeyRecipe",
    "KeyReuseError",
    "Keyring",
    "LeaseLost",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "OutcomeClass",
    "PayloadErased",
    "ProviderClass",
    "Replay",
    "RetentionPolicy",
    "RunFence",
    "RunFenced",
    "Secret",
    "SubjectErased",
    "UnknownEffect",
    "current_fence",
    "migrate",
    "run_fence",
]
