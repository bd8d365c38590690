"""The console's ASGI app: server-rendered pages (forms that work without JavaScript)
and a JSON API under ``/api/``, both on :class:`onceonly.operator.Operator`.

Every request is made by a known user: a signed session cookie (pages), a bearer token
(the API), or a trusted SSO proxy's identity header (pages; only from the configured
client addresses). Every POST form carries the session's CSRF token. Every decision and
action goes to the Operator API with the user's name as the actor, so it is recorded
as theirs (on the wait row, in the run's operator log, or in the ledger's audit chain).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .accounts import Accounts
from .errors import ConsoleError

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from onceonly.flow import Flow
    from onceonly.operator import Operator

__all__ = ["ConsoleConfig", "create_app", "session_key"]


@dataclass(frozen=True)
class ConsoleConfig:
    """How the console authenticates and pages.

    Attributes:
        session_key: HMAC key of the session cookies (:func:`session_key` derives it
            from the keyring).
        session_ttl_s: How long a sign-in lasts.
        trusted_header: The identity header an SSO proxy sets (e.g.
            ``X-Forwarded-User``); None: no SSO.
        trusted_proxies: The client addresses the header is accepted from (the proxy's);
            from any other address it is ignored.
        secure_cookies: Mark cookies ``Secure`` (behind TLS).
        page_size: Rows per page of the inbox and the run list.
        link_key: HMAC key of signed approval links (:func:`link_key`); None: the
            ``/approve/`` links are not served.
    """

    session_key: bytes
    session_ttl_s: float = 8 * 3600.0
    trusted_header: str | None = None
    trusted_proxies: frozenset[str] = field(default_factory=frozenset)
    secure_cookies: bool = False
    page_size: int = 50
    link_key: bytes | None = None


def session_key(keyring: Any) -> bytes:
    """The session cookies' HMAC key, derived from a keyring's current secret (every
    console process of a deployment shares it; rotating the secret signs everyone out)."""
    sub = keyring.subkey(keyring.current_id, "rows")
    return hmac.new(sub, b"onceonly console session v1", hashlib.sha256).digest()


def create_app(
    operator: Operator,
    config: ConsoleConfig,
    *,
    accounts: Accounts | None = None,
    clock: Callable[[], float] = time.time,
    flows: Iterable[Flow] = (),
) -> Starlette:
    """The console as an ASGI app.

    Args:
        operator: The Operator API on the store (actions are recorded with the signed-in
            user's name).
        config: Authentication and paging.
        accounts: The accounts (default: on the operator's store, tables created).
        clock: Current UNIX time.
        flows: The deployed flows (``onceonly console --flows``): a run of an older or
            newer version of one of them is offered an upgrade to its version. None:
            upgrades are done with ``onceonly runs upgrade``.

    Raises:
        ConsoleError: The console's extra is not installed (one line says what to
            install).
        ConfigurationError: ``flows`` names a flow twice or an invalid one (checked as
            a worker checks its flows).
    """
    try:
        from ._routes import build  # noqa: PLC0415  (starlette and jinja2: the extra)
    except ImportError as exc:
        raise ConsoleError(
            f"the console needs its extra ({exc.name} is missing): pip install 'onceonly[console]'"
        ) from exc
    from onceonly.flow import flow_map  # noqa: PLC0415

    deployed = flow_map(flows)
    return build(
        operator, accounts or Accounts(operator.store, clock=clock), config, clock, deployed
    )
