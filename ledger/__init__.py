"""onceonly's effects ledger: durable intent before acting, recorded outcomes after.

Built on the checkpoint core (``checkpoint``), in the same database; imports nothing from
``adapters`` or ``onceonly``.
"""

if __name__ != "onceonly.ledger":  # imported as a top-level module (from a checkout's root)
    raise ImportError(
        f"import onceonly.ledger, not {__name__}: the folder ledger/ is the package "
        f"onceonly.ledger (a second copy under another name would not share its state)"
    )


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
    ResultUnknown,
    RunFenced,
    StoreRolledBack,
    SubjectErased,
    UnknownEffect,
)
from .fence import RunFence, current_fence, run_fence
from .keys import EffectIdentity, KeyRecipe, Keyring, Secret
from .ledger import Ledger
from .records import (
    UNKNOWN_RESULT,
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

# Plain sorted, as tests/test_public_api.py checks (isort-style would put constants first).
__all__ = [  # noqa: RUF022
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
    "ResultUnknown",
    "RetentionPolicy",
    "RunFence",
    "RunFenced",
    "Secret",
    "StoreRolledBack",
    "SubjectErased",
    "UNKNOWN_RESULT",
    "UnknownEffect",
    "current_fence",
    "migrate",
    "run_fence",
]
