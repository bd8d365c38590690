"""What the console tests share: a database with console users of every role, runs of
the operator-test flows (``tests/operator_flows.py``) driven in-process as a worker would,
and HTTP clients signed in as each user."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from argon2 import PasswordHasher
from starlette.testclient import TestClient

from onceonly.checkpoint import Codec, RunStatus, Store
from onceonly.console import Accounts, ConsoleConfig, create_app, link_key, session_key
from onceonly.ledger import Keyring, Ledger
from onceonly.operator import Operator
from onceonly.runtime import Runtime
from tests.console_flows import FLOWS
from tests.ledger_support import K1, Clock
from tests.operator_flows import deliveries

PASSWORD = "correct horse battery staple"  # noqa: S105 - the test users' password
# name -> (role, grants)
USERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vera": ("viewer", ()),
    "abe": ("approver", ("linked", "publish", "vendor:compliance")),
    "olga": ("approver", ("repair",)),  # another flow's approver
    "alice": ("approver", ("*",)),  # the requester of every publish run
    "otto": ("operator", ()),
    "ada": ("admin", ()),
}
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Console:
    """A database with runs, the console app on it, and a worker stand-in."""

    url: str
    store: Store
    runtime: Runtime
    op: Operator
    accounts: Accounts
    clock: Clock
    outbox: Path
    app: Any
    tokens: dict[str, str] = field(default_factory=dict)

    def client(self, user: str | None = None) -> TestClient:
        """An HTTP client, signed in as ``user`` (None: anonymous)."""
        c = TestClient(self.app, base_url="http://127.0.0.1", follow_redirects=False)
        if user is not None:
            r = c.post(
                "/login",
                data={"csrf": csrf_of(c), "username": user, "password": PASSWORD},
            )
            assert r.status_code == 303, r.text
        return c

    def api(self, user: str) -> TestClient:
        """A client with ``user``'s API token (no cookies)."""
        return TestClient(
            self.app,
            base_url="http://127.0.0.1",
            headers={"Authorization": f"Bearer {self.tokens[user]}"},
        )

    def publish(self, run_id: str, **state: Any) -> str:
        """A publish run, driven to its approval request ``send`` (requested by alice)."""
        rid = self.runtime.start(
            "publish",
            {"to": "ann@x", "outbox": str(self.outbox), **state},
            run_id=run_id,
            started_by="alice",
        )
        assert self.runtime.drive(rid).status is RunStatus.WAITING
        return rid

    def vendor(self, run_id: str, **vendor: Any) -> str:
        """A vendor run, driven to its approval request ``compliance``."""
        doc = {"name": "ACME", "iban": "DE02120300000000202051", **vendor}
        rid = self.runtime.start(
            "vendor",
            {"vendor": doc, "outbox": str(self.outbox)},
            run_id=run_id,
            started_by="alice",
        )
        assert self.runtime.drive(rid).status is RunStatus.WAITING
        return rid

    def open_hash(self, run_id: str, name: str = "send") -> str:
        return str(self.op.waits.get(run_id, name).subject_hash)

    def sent(self) -> list[dict[str, Any]]:
        """The fake provider's raw deliveries (the oracle)."""
        return deliveries(self.outbox)


def csrf_of(client: TestClient, path: str = "/login") -> str:
    """The CSRF token of ``client``'s session (from a page's form)."""
    r = client.get(path)
    m = CSRF.search(r.text)
    assert m is not None, (path, r.status_code, r.text[:300])
    return m.group(1)


def make_console(url: str, tmp: Path, *, real_time: bool = False, **config: Any) -> Console:
    """Users of every role (and their API tokens), a runtime and the console app on the
    database at ``url`` (the console on its own store, as `onceonly console` opens it).
    The console's clock is settable, or (``real_time``) follows the real time."""
    clock = Clock(time.time())
    now: Callable[[], float] = time.time if real_time else clock
    worker_store = Store.open(url)
    ledger = Ledger(worker_store, Keyring([K1]), lease_s=30.0)
    runtime = Runtime(worker_store, ledger, FLOWS, owner="w1")
    store = Store.open(url, codec=Codec(strict=False))
    op = Operator(store, Ledger(store, Keyring([K1])))
    # a cheap argon2id: the tests sign in often (the default costs ~50 ms a hash)
    accounts = Accounts(store, clock=now, hasher=PasswordHasher(time_cost=1, memory_cost=64))
    for name, (role, grants) in USERS.items():
        accounts.add(name, role, PASSWORD, grants=grants)
    app = create_app(
        op,
        ConsoleConfig(
            session_key=session_key(Keyring([K1])), link_key=link_key(Keyring([K1])), **config
        ),
        accounts=accounts,
        clock=now,
    )
    con = Console(url, store, runtime, op, accounts, clock, tmp / "outbox", app)
    con.tokens = {name: accounts.add_token(name, "test") for name in USERS}
    return con


def close(con: Console) -> None:
    con.op.ledger.close()
    con.runtime.ledger.close()
    con.store.close()
    con.runtime.store.close()


def lists(html: str, run_id: str) -> bool:
    """Whether a page links ``run_id``'s run page (inbox, run list, batch). A bare
    ``run_id in html`` is no test: a short id also turns up inside the page's random
    CSRF token now and then."""
    return f'href="/runs/{quote(run_id, safe="/")}"' in html
