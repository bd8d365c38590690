"""Who may use the console, and what they may do: accounts, roles, grants, API tokens
and snoozed approvals, in tables of the console's own (schema component ``console``).

Roles are ordered: ``viewer`` < ``approver`` < ``operator`` < ``admin``.

- **viewer**: reads every page (inbox, runs, effects in doubt); decides nothing.
- **approver**: also approves, rejects, snoozes and edits-then-approves the approvals of
  the flows (``flow``) or approval names (``flow:name``) they are granted (``*``: all).
- **operator**: also acts on runs (cancel, retry, fork, edit state) and resolves
  effects in doubt; decides every approval.
- **admin**: everything an operator does (accounts are managed with the CLI).

Passwords are hashed with argon2id (``argon2-cffi``); API tokens are stored as their
SHA-256 only and shown once. The tables are read by the console, never by the acting
path: a wrong row can refuse or allow a decision through the console, while every
decision is still bound to the subject hash and recorded with who made it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text
from sqlalchemy.schema import CreateTable

from onceonly.checkpoint import Migration, Store, ensure_schema, migrate_component

from .errors import AccountError

__all__ = ["Accounts", "Role", "Snooze", "User", "migrate"]

COMPONENT = "console"

_metadata = MetaData()
users = Table(
    "oo_console_users",
    _metadata,
    Column("name", String(200), primary_key=True),
    Column("role", String(20), nullable=False),
    Column("grants", Text, nullable=False),  # JSON list: "flow", "flow:approval", "*"
    Column("password_hash", Text, nullable=True),  # None: signs in through SSO only
    Column("created_at", Float, nullable=False),
)
tokens = Table(
    "oo_console_tokens",
    _metadata,
    Column("token_sha256", String(64), primary_key=True),
    Column("user_name", String(200), nullable=False, index=True),
    Column("label", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
)
snoozes = Table(
    "oo_console_snoozes",
    _metadata,
    Column("run_id", String(200), primary_key=True),
    Column("name", String(200), primary_key=True),
    Column("instance", Integer, primary_key=True),
    Column("until_at", Float, nullable=False, index=True),
    Column("by_user", String(200), nullable=False),
    Column("reason", Text, nullable=False),
    Column("at", Float, nullable=False),
)

link_uses = Table(
    "oo_console_link_uses",
    _metadata,
    Column("digest", String(64), primary_key=True),  # SHA-256 of the link's token
    Column("by_user", String(200), nullable=False),
    Column("decision", String(20), nullable=False),
    Column("at", Float, nullable=False),
)

CONSOLE_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "console: operator accounts (role, grants, argon2 password hash), API tokens "
        "(SHA-256), snoozed approvals and used approval links",
        (CreateTable(users), CreateTable(tokens), CreateTable(snoozes), CreateTable(link_uses)),
    ),
)

_NAME = re.compile(r"^[A-Za-z0-9_.@+-]{1,200}$")
_GRANT = re.compile(r"^(\*|[A-Za-z0-9_.-]{1,100}(:[^\s:]{1,200})?)$")
MIN_PASSWORD = 12


def migrate(url_or_engine: Any, *, sql: bool = False) -> str:
    """Bring the console's schema (accounts, tokens, snoozes) to this release's version
    (or return its SQL)."""
    return migrate_component(
        url_or_engine, COMPONENT, CONSOLE_MIGRATIONS, sql=sql, version_table=False
    )


class Role(enum.StrEnum):
    """What a console user may do (each role may do what the ones before it may)."""

    VIEWER = "viewer"
    APPROVER = "approver"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        """Position in viewer < approver < operator < admin."""
        return list(Role).index(self)

    def at_least(self, other: Role) -> bool:
        """Whether this role may do what ``other`` may."""
        return self.rank >= other.rank


@dataclass(frozen=True)
class User:
    """A console account.

    Attributes:
        name: The identity recorded with every action the user takes.
        role: What they may do.
        grants: Approvers: the flows (``flow``) or approvals (``flow:name``) they may
            decide; ``*`` for all.
    """

    name: str
    role: Role
    grants: tuple[str, ...] = ()

    def may_decide(self, flow: str, approval: str) -> bool:
        """Whether the user may approve or reject approval ``approval`` of a run of
        ``flow``."""
        if self.role.at_least(Role.OPERATOR):
            return True
        if self.role is not Role.APPROVER:
            return False
        return any(g in ("*", flow, f"{flow}:{approval}") for g in self.grants)


@dataclass(frozen=True)
class Snooze:
    """An approval hidden from the inbox until a time ("not now"; it stays open).

    Attributes:
        run_id: The run.
        name: The approval.
        instance: Which instance of it.
        until: Hidden until then (UNIX seconds).
        by: Who snoozed it.
        reason: Why.
        at: When.
    """

    run_id: str
    name: str
    instance: int
    until: float
    by: str
    reason: str
    at: float


class Accounts:
    """The console's accounts, tokens and snoozes in a store's database.

    Args:
        store: The store (the tables are created with the first use when ``create``).
        clock: Current UNIX time.
        create: Create the tables when the database has none.
        hasher: An ``argon2.PasswordHasher`` (default: argon2-cffi's defaults, argon2id;
            tests pass a cheaper one).
    """

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float] = time.time,
        create: bool = True,
        hasher: Any = None,
    ) -> None:
        store.retry.call(
            "open the console's accounts",
            lambda: ensure_schema(store.engine, COMPONENT, CONSOLE_MIGRATIONS, create=create),
            idempotent=True,
        )
        self.store = store
        self.clock = clock
        self._q = store.param
        self._hasher: Any = hasher
        self._dummy: str | None = None

    # -- users -------------------------------------------------------------------------
    def add(
        self,
        name: str,
        role: Role | str,
        password: str | None,
        *,
        grants: Iterable[str] = (),
    ) -> User:
        """Add a user.

        Args:
            name: Their identity (letters, digits, ``_.@+-``).
            role: viewer, approver, operator or admin.
            password: At least 12 characters; None for a user who signs in only through
                a trusted SSO proxy.
            grants: Approvers: ``flow`` or ``flow:approval`` names, or ``*``.

        Raises:
            AccountError: A malformed name, role, grant or password, or the user exists.
        """
        user = _user(name, role, grants)
        digest = None if password is None else self._hash(password)
        q = self._q

        def txn(cur: Any) -> bool:
            cur.execute(f"SELECT 1 FROM oo_console_users WHERE name = {q}", (name,))
            if cur.fetchone() is not None:
                return False
            cur.execute(
                "INSERT INTO oo_console_users (name, role, grants, password_hash, created_at) "
                f"VALUES ({q}, {q}, {q}, {q}, {q})",
                (name, user.role.value, json.dumps(list(user.grants)), digest, self.clock()),
            )
            return True

        if not self.store.transact(txn):
            raise AccountError(f"user {name!r} exists already; remove them first to change them")
        return user

    def remove(self, name: str) -> None:
        """Remove a user and their API tokens.

        Raises:
            AccountError: No such user.
        """
        q = self._q

        def txn(cur: Any) -> int:
            cur.execute(f"DELETE FROM oo_console_tokens WHERE user_name = {q}", (name,))
            cur.execute(f"DELETE FROM oo_console_users WHERE name = {q}", (name,))
            return int(cur.rowcount or 0)

        if not self.store.transact(txn):
            raise AccountError(f"no console user {name!r}")

    def get(self, name: str) -> User | None:
        """The user ``name``, or None."""
        row = self._row(name)
        return None if row is None else _from_row(row)

    def users(self) -> list[User]:
        """Every user, by name."""

        def read(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute("SELECT name, role, grants, password_hash FROM oo_console_users")
            return [tuple(r) for r in cur.fetchall()]

        return sorted((_from_row(r) for r in self.store.read(read)), key=lambda u: u.name)

    def authenticate(self, name: str, password: str) -> User | None:
        """The user whose name and password these are, else None (the same work is
        done for an unknown name, so timing does not tell names apart)."""
        from argon2.exceptions import VerificationError  # noqa: PLC0415

        row = self._row(name) if _NAME.match(name) else None
        stored = None if row is None else row[3]
        hasher = self._argon()
        if self._dummy is None:
            self._dummy = hasher.hash(secrets.token_hex(16))
        try:
            ok = bool(hasher.verify(stored or self._dummy, password))
        except (VerificationError, ValueError):
            ok = False
        if row is None or stored is None or not ok:
            return None
        return _from_row(row)

    # -- API tokens --------------------------------------------------------------------
    def add_token(self, name: str, label: str = "") -> str:
        """A new API token for user ``name`` (for a bot: it acts as that user). It is
        returned once and stored only as its SHA-256.

        Raises:
            AccountError: No such user.
        """
        if self.get(name) is None:
            raise AccountError(f"no console user {name!r}; add them first")
        token = "oo_" + secrets.token_urlsafe(32)
        q = self._q
        self.store.transact(
            lambda cur: cur.execute(
                "INSERT INTO oo_console_tokens (token_sha256, user_name, label, created_at) "
                f"VALUES ({q}, {q}, {q}, {q})",
                (_sha(token), name, label[:200], self.clock()),
            )
        )
        return token

    def token_user(self, token: str) -> User | None:
        """The user an API token acts as, else None."""
        if not token.startswith("oo_") or len(token) > 200:
            return None
        q = self._q

        def read(cur: Any) -> tuple[Any, ...] | None:
            cur.execute(
                "SELECT u.name, u.role, u.grants, u.password_hash, t.token_sha256 "
                "FROM oo_console_tokens t JOIN oo_console_users u ON u.name = t.user_name "
                f"WHERE t.token_sha256 = {q}",
                (_sha(token),),
            )
            row = cur.fetchone()
            return None if row is None else tuple(row)

        row = self.store.read(read)
        if row is None or not hmac.compare_digest(str(row[4]), _sha(token)):
            return None
        return _from_row(row)

    # -- snoozes -----------------------------------------------------------------------
    def snooze(
        self, run_id: str, name: str, instance: int, *, until: float, by: str, reason: str
    ) -> Snooze:
        """Hide an open approval from the inbox until ``until`` (replacing an earlier
        snooze of it). The approval stays open and can be decided meanwhile."""
        q = self._q
        now = self.clock()

        def txn(cur: Any) -> None:
            cur.execute(
                f"DELETE FROM oo_console_snoozes WHERE run_id = {q} AND name = {q} "
                f"AND instance = {q}",
                (run_id, name, instance),
            )
            cur.execute(
                "INSERT INTO oo_console_snoozes (run_id, name, instance, until_at, by_user, "
                f"reason, at) VALUES ({q}, {q}, {q}, {q}, {q}, {q}, {q})",
                (run_id, name, instance, until, by, reason, now),
            )

        self.store.transact(txn)
        return Snooze(run_id, name, instance, until, by, reason, now)

    def snoozes(self) -> dict[tuple[str, str, int], Snooze]:
        """Every snooze still in force, by (run, approval, instance)."""
        q = self._q

        def read(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(
                "SELECT run_id, name, instance, until_at, by_user, reason, at "
                f"FROM oo_console_snoozes WHERE until_at > {q}",
                (self.clock(),),
            )
            return [tuple(r) for r in cur.fetchall()]

        out = {}
        for r in self.store.read(read):
            s = Snooze(str(r[0]), str(r[1]), int(r[2]), float(r[3]), str(r[4]), str(r[5]), r[6])
            out[(s.run_id, s.name, s.instance)] = s
        return out

    # -- approval links ----------------------------------------------------------------
    def use_link(self, digest: str, *, by: str, decision: str) -> bool:
        """Record that the link ``digest`` decided; False if it was used before."""
        q = self._q

        def txn(cur: Any) -> bool:
            cur.execute(f"SELECT 1 FROM oo_console_link_uses WHERE digest = {q}", (digest,))
            if cur.fetchone() is not None:
                return False
            cur.execute(
                "INSERT INTO oo_console_link_uses (digest, by_user, decision, at) "
                f"VALUES ({q}, {q}, {q}, {q})",
                (digest, by, decision, self.clock()),
            )
            return True

        return bool(self.store.transact(txn))

    def link_used(self, digest: str) -> bool:
        """Whether the link ``digest`` decided already."""
        q = self._q

        def read(cur: Any) -> bool:
            cur.execute(f"SELECT 1 FROM oo_console_link_uses WHERE digest = {q}", (digest,))
            return cur.fetchone() is not None

        return bool(self.store.read(read))

    # -- internals ---------------------------------------------------------------------
    def _row(self, name: str) -> tuple[Any, ...] | None:
        q = self._q

        def read(cur: Any) -> tuple[Any, ...] | None:
            cur.execute(
                f"SELECT name, role, grants, password_hash FROM oo_console_users WHERE name = {q}",
                (name,),
            )
            row = cur.fetchone()
            return None if row is None else tuple(row)

        return self.store.read(read)

    def _argon(self) -> Any:
        if self._hasher is None:
            try:
                from argon2 import PasswordHasher  # noqa: PLC0415
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise AccountError(
                    "console accounts need argon2-cffi: pip install 'onceonly[console]'"
                ) from exc
            self._hasher = PasswordHasher()
        return self._hasher

    def _hash(self, password: str) -> str:
        if len(password) < MIN_PASSWORD:
            raise AccountError(f"a password has at least {MIN_PASSWORD} characters")
        return str(self._argon().hash(password))


def _user(name: str, role: Role | str, grants: Iterable[str]) -> User:
    if not _NAME.match(name):
        raise AccountError(
            "a user name is 1-200 letters, digits or _.@+- (it is recorded with every action)"
        )
    try:
        r = Role(role)
    except ValueError:
        raise AccountError(
            f"unknown role {role!r}; one of {', '.join(x.value for x in Role)}"
        ) from None
    gs = tuple(sorted(set(grants)))
    bad = [g for g in gs if not _GRANT.match(g)]
    if bad:
        raise AccountError(f"malformed grant(s) {bad}: use FLOW, FLOW:APPROVAL or *")
    return User(name, r, gs)


def _from_row(row: Sequence[Any]) -> User:
    try:
        grants = tuple(str(g) for g in json.loads(row[2]))
    except (ValueError, TypeError):
        grants = ()  # an unreadable row grants nothing
    try:
        role = Role(str(row[1]))
    except ValueError:
        role = Role.VIEWER  # an unknown role may only look
    return User(str(row[0]), role, grants)


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
