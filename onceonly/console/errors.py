"""Errors of the operator console.

They extend the tree rooted in :class:`checkpoint.errors.OnceOnlyError`::

    OnceOnlyError
    └── ConsoleError              the console cannot do what was asked
        ├── AccountError          a user or token is unknown, exists already, or malformed
        ├── NotAllowed            the signed-in user's role or grants do not allow it
        ├── LinkRefused           an approval link is altered, expired, used or void
        └── RemoteBindRefused     a non-loopback address without --allow-remote
"""

from __future__ import annotations

from onceonly.checkpoint import OnceOnlyError

__all__ = ["AccountError", "ConsoleError", "LinkRefused", "NotAllowed", "RemoteBindRefused"]


class ConsoleError(OnceOnlyError):
    """The console cannot do what was asked."""


class AccountError(ConsoleError):
    """A console user or API token is unknown, exists already, or is malformed."""


class NotAllowed(ConsoleError):
    """The user's role or grants do not allow the action.

    Attributes:
        user: Who asked.
        action: What they asked to do.
    """

    def __init__(self, user: str, action: str, why: str) -> None:
        self.user = user
        self.action = action
        super().__init__(f"{user!r} may not {action}: {why}")


class LinkRefused(ConsoleError):
    """An approval link is altered, expired, used, or no longer matches its request."""


class RemoteBindRefused(ConsoleError):
    """The console was asked to listen on a non-loopback address without
    ``--allow-remote``."""

    def __init__(self, host: str) -> None:
        self.host = host
        super().__init__(
            f"refusing to listen on {host!r}: the console binds to loopback (127.0.0.1) by "
            f"default; pass --allow-remote to listen there, and put TLS (a reverse proxy) in "
            f"front of it"
        )
