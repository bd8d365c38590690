"""The operator console: an approvals inbox and the escape hatch on web pages.

``onceonly console --url URL`` serves it (extra ``console``: ``pip install
'onceonly[console]'``). Pages are rendered on the server and their forms work without
JavaScript; a JSON API under ``/api/`` does the same with bearer tokens. Everything is
done through :class:`onceonly.operator.Operator`, as the CLI does, with the signed-in
user as the actor.

This package imports without its extra; :func:`create_app` says what to install.
"""

from __future__ import annotations

from .accounts import Accounts, Role, Snooze, User, migrate
from .app import ConsoleConfig, create_app, session_key
from .errors import AccountError, ConsoleError, LinkRefused, NotAllowed, RemoteBindRefused
from .links import SignedLink, approval_link, link_key, read_link

__all__ = [
    "AccountError",
    "Accounts",
    "ConsoleConfig",
    "ConsoleError",
    "LinkRefused",
    "NotAllowed",
    "RemoteBindRefused",
    "Role",
    "SignedLink",
    "Snooze",
    "User",
    "approval_link",
    "create_app",
    "link_key",
    "migrate",
    "read_link",
    "session_key",
]
