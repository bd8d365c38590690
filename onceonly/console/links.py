"""Signed approval links: an approval request a flow e-mails to one approver.

A link names the run, the approval, the hash of exactly the subject it asks about, the
approver and an expiry, signed with a key derived from the keyring. Following it shows
the subject and asks for a confirmation (a GET never decides); the confirmation decides
as that approver, for that hash, once (a used link is recorded and refused after).
A changed subject, another approver's grants, an expired or altered link: refused.

The link is deterministic for its fields, so a step that e-mails it through
:class:`onceonly.adapters.email.GuardedSMTP` and is re-run after a crash builds the same
message (the ledger replays it; nothing is sent twice): pass an ``expires_at`` the run
keeps (the approval's own expiry, or a time saved in its state), not "now + a day".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from .errors import LinkRefused

__all__ = ["SignedLink", "approval_link", "link_key", "read_link"]


@dataclass(frozen=True)
class SignedLink:
    """What an approval link says.

    Attributes:
        run_id: The run.
        name: The approval.
        subject_hash: The hash of exactly the subject the link asks about.
        approver: The console user who decides through it.
        expires_at: Refused after (UNIX seconds).
        digest: The link's identity (SHA-256 of its signed text): used once.
    """

    run_id: str
    name: str
    subject_hash: str
    approver: str
    expires_at: float
    digest: str


def link_key(keyring: Any) -> bytes:
    """The links' HMAC key, derived from a keyring's current secret (the console and the
    flow that sends links share ``$ONCEONLY_SECRETS``; rotating it voids open links)."""
    sub = keyring.subkey(keyring.current_id, "rows")
    return hmac.new(sub, b"onceonly console approval link v1", hashlib.sha256).digest()


def approval_link(
    key: bytes,
    base_url: str,
    *,
    run_id: str,
    name: str,
    subject_hash: str,
    approver: str,
    expires_at: float,
) -> str:
    """The URL of a signed approval link (``{base_url}/approve/{token}``).

    Args:
        key: :func:`link_key` of the deployment's keyring.
        base_url: Where approvers reach the console (``https://console.example``).
        run_id: The run.
        name: The approval.
        subject_hash: ``checkpoint.subject_hash(store, subject)`` of what is asked.
        approver: The console user the link is for.
        expires_at: Refused after this time (keep it in the run: see the module).
    """
    body = json.dumps(
        {"r": run_id, "n": name, "h": subject_hash, "a": approver, "e": float(expires_at)},
        separators=(",", ":"),
        sort_keys=True,
    ).encode()
    token = _b64(body) + "." + _b64(hmac.new(key, body, hashlib.sha256).digest())
    return base_url.rstrip("/") + "/approve/" + urllib.parse.quote(token, safe=".")


def read_link(key: bytes, token: str, now: float) -> SignedLink:
    """The fields of a link's token, checked (signature, then expiry).

    Raises:
        LinkRefused: Altered or malformed, or expired.
    """
    body_b64, sep, mac_b64 = token.partition(".")
    if not sep or len(token) > 4096:
        raise LinkRefused("this approval link is malformed (was it cut when copied?)")
    try:
        body, mac = _unb64(body_b64), _unb64(mac_b64)
    except ValueError:
        raise LinkRefused("this approval link is malformed (was it cut when copied?)") from None
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise LinkRefused("this approval link is not one the console signed (altered?)")
    doc = json.loads(body)
    link = SignedLink(
        str(doc["r"]),
        str(doc["n"]),
        str(doc["h"]),
        str(doc["a"]),
        float(doc["e"]),
        hashlib.sha256(token.encode()).hexdigest(),
    )
    if link.expires_at <= now:
        raise LinkRefused("this approval link has expired; ask for the request again")
    return link


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError("malformed") from exc
