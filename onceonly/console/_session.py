"""Sessions in signed cookies, and the CSRF token each one carries.

A session is ``base64url(json) "." base64url(HMAC-SHA256)``: the user's name (None before
signing in), a random CSRF token and an expiry. Nothing secret is in it; the HMAC key
is derived from the keyring (``$ONCEONLY_SECRETS``), so every console process of one
deployment accepts the others' sessions and a changed secret signs everyone out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

COOKIE = "oo_console"


@dataclass(frozen=True)
class Session:
    """What a session cookie says."""

    user: str | None
    csrf: str
    expires_at: float


def new_session(user: str | None, now: float, ttl_s: float) -> Session:
    """A fresh session (a new CSRF token: signing in never keeps the anonymous one)."""
    return Session(user, secrets.token_urlsafe(24), now + ttl_s)


def dump(key: bytes, session: Session) -> str:
    """The cookie value of ``session``."""
    body = json.dumps(
        {"u": session.user, "c": session.csrf, "e": session.expires_at}, separators=(",", ":")
    ).encode()
    mac = hmac.new(key, body, hashlib.sha256).digest()
    return _b64(body) + "." + _b64(mac)


def load(key: bytes, value: str | None, now: float) -> Session | None:
    """The session in a cookie value; None if absent, forged, malformed or expired."""
    if not value or len(value) > 4096 or "." not in value:
        return None
    body_b64, _, mac_b64 = value.partition(".")
    try:
        body = _unb64(body_b64)
        mac = _unb64(mac_b64)
    except ValueError:
        return None
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        return None
    try:
        doc = json.loads(body)
        user = doc["u"]
        session = Session(None if user is None else str(user), str(doc["c"]), float(doc["e"]))
    except (ValueError, KeyError, TypeError):
        return None
    return session if session.expires_at > now else None


def csrf_ok(session: Session | None, given: str | None) -> bool:
    """Whether a form's CSRF token is the session's."""
    if session is None or not given:
        return False
    return hmac.compare_digest(session.csrf.encode(), given.encode())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError("malformed") from exc
