"""``python -m bench console``: how long the console's pages take with many waiting runs
and many effects, on SQLite and (given ``--pg URL``) PostgreSQL.

It fills a fresh database with ``--runs`` waiting runs, each with an open approval, and
``--effects`` committed effects spread over them (through the store's and the ledger's
own APIs: sealed rows, as a worker writes them), then signs in through the real app
(Starlette's TestClient, in-process: the server's work, without a network) and times
each page ``--repeat`` times. Target: every page under 300 ms (the median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGET_MS = 300.0
PAGES = (
    ("inbox, page 1", "operator", "/inbox"),
    ("inbox, last page", "operator", "/inbox?page=100000"),
    ("inbox, filtered by flow", "operator", "/inbox?flow=vendor&name=compliance"),
    ("inbox of a flow's approver", "approver", "/inbox"),
    ("API approvals", None, "/api/approvals"),
    ("runs, page 1", "operator", "/runs"),
    ("runs, waiting, last page", "operator", "/runs?status=waiting&page=100000"),
    ("runs, search", "operator", "/runs?q=run-0042"),
    ("run page", "operator", "/runs/run-000042"),
    ("effects in doubt", "operator", "/effects"),
)


def populate(url: str, runs: int, effects: int, progress: Any) -> None:
    """``runs`` waiting runs with an open approval each; ``effects`` committed effects."""
    from onceonly.checkpoint import RunStatus, Store, WaitKind, Waits
    from onceonly.ledger import EffectIdentity, Keyring, Ledger, ProviderClass, Secret

    store = Store.open(url)
    ledger = Ledger(store, Keyring([Secret("k1", bytes(32))]))
    waits = Waits(store)
    try:
        for i in range(runs):
            rid = f"run-{i:06d}"
            vendor = {"name": f"Vendor {i}", "iban": f"DE{i:020d}"}
            store.start_run(
                "vendor",
                {"vendor": vendor},
                run_id=rid,
                next_step="create",
                status=RunStatus.WAITING,
                also=waits.opening(
                    rid,
                    "compliance",
                    WaitKind.APPROVAL,
                    subject=vendor,
                    requested_by="alice",
                    opened_by="propose#0",
                ),
            )
            if i % 500 == 0:
                progress(f"runs {i}/{runs}")
        for j in range(effects):
            rid = f"run-{j % max(runs, 1):06d}"
            where = EffectIdentity("t", rid, "create#0", 0, "erp.create@1", j // max(runs, 1))
            ledger.perform(
                where, {"n": j}, lambda claim: {"ok": True}, provider_class=ProviderClass.QUERYABLE
            )
            if j % 5000 == 0:
                progress(f"effects {j}/{effects}")
    finally:
        ledger.close()
        store.close()


def measure(url: str, repeat: int) -> dict[str, float]:
    """Median milliseconds per page."""
    from argon2 import PasswordHasher
    from starlette.testclient import TestClient

    from onceonly.checkpoint import Codec, Store
    from onceonly.console import Accounts, ConsoleConfig, create_app, session_key
    from onceonly.ledger import Keyring, Ledger, Secret
    from onceonly.operator import Operator

    ring = Keyring([Secret("k1", bytes(32))])
    store = Store.open(url, codec=Codec(strict=False))
    op = Operator(store, Ledger(store, ring))
    accounts = Accounts(store, hasher=PasswordHasher(time_cost=1, memory_cost=64))
    pw = "bench password 123"
    accounts.add("otto", "operator", pw)
    accounts.add("abe", "approver", pw, grants=["vendor:compliance"])
    token = accounts.add_token("otto")
    app = create_app(op, ConsoleConfig(session_key=session_key(ring)), accounts=accounts)
    clients: dict[str | None, TestClient] = {}
    for role, name in (("operator", "otto"), ("approver", "abe")):
        c = TestClient(app, base_url="http://127.0.0.1", follow_redirects=False)
        csrf = c.get("/login").text.split('name="csrf" value="')[1].split('"')[0]
        r = c.post("/login", data={"csrf": csrf, "username": name, "password": pw})
        assert r.status_code == 303, r.text
        clients[role] = c
    api = TestClient(app, base_url="http://127.0.0.1")
    api.headers["Authorization"] = f"Bearer {token}"
    clients[None] = api
    out: dict[str, float] = {}
    try:
        for label, role, path in PAGES:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                r = clients[role].get(path)
                times.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
            out[label] = statistics.median(times)
    finally:
        op.ledger.close()
        store.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Fill, measure, print; exit 1 when a page misses the target."""
    p = argparse.ArgumentParser(prog="python -m bench console", description=__doc__)
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--effects", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pg", default=None, help="a PostgreSQL URL (an empty database)")
    p.add_argument("--no-sqlite", action="store_true", help="only the --pg database")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)

    def progress(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        targets = [] if args.no_sqlite else [("sqlite", f"sqlite:///{tmp}/console.db")]
        if args.pg:
            targets.append(("postgresql", args.pg))
        for backend, url in targets:
            print(f"{backend}: {args.runs} waiting runs, {args.effects} effects", flush=True)
            t0 = time.perf_counter()
            populate(url, args.runs, args.effects, progress)
            print(f"  filled in {time.perf_counter() - t0:.0f} s", flush=True)
            results[backend] = measure(url, args.repeat)
    missed = 0
    print(f"\n{'page':32}" + "".join(f"{b:>14}" for b in results))
    for label, _role, _path in PAGES:
        cells = []
        for backend in results:
            ms = results[backend][label]
            missed += ms > TARGET_MS
            cells.append(f"{ms:11.0f} ms" + ("!" if ms > TARGET_MS else " "))
        print(f"{label:32}" + "".join(f"{c:>14}" for c in cells))
    if args.json:
        doc = {"runs": args.runs, "effects": args.effects, "target_ms": TARGET_MS, **results}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{'every page under' if not missed else f'{missed} page(s) over'} {TARGET_MS:.0f} ms")
    return 1 if missed else 0
