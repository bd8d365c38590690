"""The operator console over HTTP (Starlette's TestClient), on SQLite and PostgreSQL:
who may do what (every route x every role), CSRF, hostile values rendered inert, the
approvals inbox (approve, reject, batch, snooze, decided elsewhere, self-approval, one
flow's approver denied another's), the run page and its actions (an upgrade to the
deployed version of a flow among them), effects in doubt, and the JSON API with bearer
tokens.

Runs are driven in-process as a worker would (``Runtime.drive``); the oracle for
"happened once" is the fake provider's outbox (``tests/operator_flows.py``)."""

from __future__ import annotations

import dataclasses
import email
import email.policy
import html
import imaplib
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from onceonly.checkpoint import RunStatus, WaitStatus
from onceonly.cli.console import is_loopback
from onceonly.console import (
    ConsoleConfig,
    RemoteBindRefused,
    approval_link,
    create_app,
    link_key,
    session_key,
)
from onceonly.flow import Flow
from onceonly.ledger import Keyring
from onceonly.runtime import Runtime
from tests.console_support import USERS, Console, close, csrf_of, lists, make_console
from tests.ledger_support import K1
from tests.mail_fakes import MailDevel
from tests.version_flows import V1, V2, V3, deliveries

ROLES = ("viewer", "approver", "operator", "admin")
RANK = {r: i for i, r in enumerate(ROLES)}
BY_ROLE = {"viewer": "vera", "approver": "abe", "operator": "otto", "admin": "ada"}


@pytest.fixture
def con(db_url: str, tmp_path: Path) -> Iterator[Console]:
    c = make_console(db_url, tmp_path)
    try:
        yield c
    finally:
        close(c)


# -- who may do what -------------------------------------------------------------------------


def test_pages_need_a_signed_in_user(con: Console) -> None:
    anon = con.client()
    for path in ("/inbox", "/runs", "/runs/x", "/effects"):
        r = anon.get(path)
        assert r.status_code == 303, path
        assert r.headers["location"].startswith("/login"), path
    token = csrf_of(anon)
    bad = anon.post("/login", data={"csrf": token, "username": "abe", "password": "wrong" * 4})
    assert bad.status_code == 401
    assert "wrong password" in bad.text
    unknown = anon.post("/login", data={"csrf": token, "username": "nobody", "password": "x" * 12})
    assert unknown.status_code == 401
    # a login form without its CSRF token is refused before the password is looked at
    forged = con.client().post("/login", data={"username": "abe", "password": "x"})
    assert forged.status_code == 403
    assert anon.get("/api/runs").status_code == 401
    assert con.client("abe").get("/api/runs").status_code == 401  # the API takes no cookie
    bearer = con.client()
    bearer.headers["Authorization"] = "Bearer oo_forged"
    assert bearer.get("/api/runs").status_code == 401
    # an open redirect is not offered after signing in
    c = con.client()
    r = c.post(
        "/login",
        data={
            "csrf": csrf_of(c),
            "username": "abe",
            "password": "correct horse battery staple",
            "next": "//evil.example/",
        },
    )
    assert r.headers["location"] == "/inbox"


def _routes(con: Console, rid: str, key: str) -> list[tuple[str, str, str, dict[str, str]]]:
    """(method, path, least role, form) of every route; forms valid enough to pass the
    role check (the action itself may then refuse, e.g. a missing confirmation)."""
    return [
        ("GET", "/inbox", "viewer", {}),
        ("GET", "/runs", "viewer", {}),
        ("GET", f"/runs/{rid}", "viewer", {}),
        ("GET", "/effects", "viewer", {}),
        ("POST", "/inbox/decide", "approver", {"run_id": rid, "name": "send"}),
        ("POST", "/inbox/batch", "approver", {}),
        ("POST", "/inbox/snooze", "approver", {"run_id": rid, "name": "send"}),
        ("GET", "/inbox/edit", "approver", {}),
        ("POST", "/inbox/edit", "approver", {"run_id": rid, "name": "send"}),
        ("POST", f"/runs/{rid}/cancel", "operator", {}),
        ("POST", f"/runs/{rid}/retry", "operator", {}),
        ("POST", f"/runs/{rid}/fork", "operator", {}),
        ("POST", f"/runs/{rid}/edit", "operator", {}),
        ("POST", f"/runs/{rid}/restart", "operator", {}),
        ("POST", f"/runs/{rid}/upgrade", "operator", {}),
        ("POST", f"/effects/{key}/resolve", "operator", {}),
    ]


def _api_routes(rid: str, key: str) -> list[tuple[str, str, str]]:
    return [
        ("GET", "/api/me", "viewer"),
        ("GET", "/api/approvals", "viewer"),
        ("GET", "/api/runs", "viewer"),
        ("GET", f"/api/runs/{rid}", "viewer"),
        ("GET", "/api/effects/in-doubt", "viewer"),
        ("POST", f"/api/approvals/{rid}/send/approve", "approver"),
        ("POST", f"/api/approvals/{rid}/send/reject", "approver"),
        ("POST", f"/api/approvals/{rid}/send/edit", "approver"),
        ("POST", f"/api/runs/{rid}/cancel", "operator"),
        ("POST", f"/api/runs/{rid}/retry", "operator"),
        ("POST", f"/api/runs/{rid}/fork", "operator"),
        ("POST", f"/api/runs/{rid}/edit", "operator"),
        ("POST", f"/api/runs/{rid}/restart", "operator"),
        ("POST", f"/api/runs/{rid}/upgrade", "operator"),
        ("POST", f"/api/effects/{key}/resolve", "operator"),
    ]


# Routes anyone may reach: signing in and out, the signed approval links (the link is the
# credential; tested on their own) and the static files.
PUBLIC = {("GET", "/"), ("GET", "/login"), ("POST", "/login"), ("POST", "/logout")}
PUBLIC |= {("GET", "/approve/{token}"), ("POST", "/approve/{token}")}


def _matrix_problems(con: Console, rid: str, key: str) -> tuple[int, list[str]]:
    """Every route of the matrix for every role: (requests made, one line per route whose
    answer disagrees with its least role, or that answered with a server error)."""
    problems: list[str] = []
    checked = 0

    def judge(role: str, method: str, path: str, least: str, status: int) -> None:
        allowed = RANK[role] >= RANK[least]
        if (status == 403) is allowed or status >= 500:
            problems.append(f"{role} {method} {path}: {status} (needs {least})")

    for role, user in BY_ROLE.items():
        c = con.client(user)
        token = csrf_of(c, "/inbox")
        for method, path, least, form in _routes(con, rid, key):
            r = c.get(path) if method == "GET" else c.post(path, data={"csrf": token, **form})
            judge(role, method, path, least, r.status_code)
            checked += 1
        api = con.api(user)
        for method, path, least in _api_routes(rid, key):
            r = api.get(path) if method == "GET" else api.post(path, json={})
            judge(role, method, path, least, r.status_code)
            checked += 1
    return checked, problems


def _unmatrixed(con: Console, rid: str, key: str) -> list[str]:
    """The app's routes that no row of the matrix requests (a new route must get one)."""

    rows = [(m, p) for m, p, _, _ in _routes(con, rid, key)]
    rows += [(m, p) for m, p, _ in _api_routes(rid, key)]
    missing = []
    for route in con.app.routes:
        if not isinstance(route, Route):
            continue  # the static files' mount
        for method in sorted((route.methods or set()) - {"HEAD"}):
            if (method, route.path) in PUBLIC:
                continue
            if not any(m == method and route.path_regex.match(p) for m, p in rows):
                missing.append(f"{method} {route.path}")
    return missing


def test_every_route_for_every_role(con: Console) -> None:
    rid = con.publish("r1")
    key = "0" * 64
    assert _unmatrixed(con, rid, key) == []
    checked, problems = _matrix_problems(con, rid, key)
    assert problems == []
    assert checked == 4 * 31
    # nothing above decided or changed the run: every allowed POST lacked what it needs
    assert con.op.waits.get(rid, "send").status is WaitStatus.OPEN
    assert con.store.get_run(rid).status is RunStatus.WAITING


def test_the_matrix_catches_a_route_without_its_role_check(con: Console) -> None:
    """Positive control: a cancel route that forgets the role check (planted ahead of
    the real one) is reported for the viewer and the approver, and a route no row of
    the matrix requests is reported as such."""

    rid = con.publish("r1")
    key = "0" * 64

    async def careless_cancel(request: object) -> PlainTextResponse:
        return PlainTextResponse("cancelled")

    async def forgotten(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    con.app.router.routes.insert(
        0, Route("/runs/{run_id}/cancel", careless_cancel, methods=["POST"])
    )
    con.app.router.routes.append(Route("/runs/{run_id}/purge", forgotten, methods=["DELETE"]))
    _, problems = _matrix_problems(con, rid, key)
    assert problems == [
        f"viewer POST /runs/{rid}/cancel: 200 (needs operator)",
        f"approver POST /runs/{rid}/cancel: 200 (needs operator)",
    ]
    assert _unmatrixed(con, rid, key) == ["DELETE /runs/{run_id}/purge"]


def test_csrf_missing_wrong_or_from_another_session_is_refused(con: Console) -> None:
    rid = con.publish("r1")
    form = {
        "run_id": rid,
        "name": "send",
        "instance": "0",
        "subject_hash": con.open_hash(rid),
        "decision": "approve",
    }
    abe = con.client("abe")
    other = con.client("otto")
    for csrf in (None, "", "forged", csrf_of(other, "/inbox")):
        data = dict(form) if csrf is None else {**form, "csrf": csrf}
        r = abe.post("/inbox/decide", data=data)
        assert r.status_code == 403, csrf
        assert "security token" in r.text
    assert con.op.waits.get(rid, "send").status is WaitStatus.OPEN
    ok = abe.post("/inbox/decide", data={**form, "csrf": csrf_of(abe, "/inbox")})
    assert ok.status_code == 303
    assert con.op.waits.get(rid, "send").decided_by == "abe"


def test_a_flows_approver_is_denied_another_flows_items(con: Console) -> None:
    rid = con.publish("r1")
    olga = con.client("olga")  # approver of flow "repair" only
    assert not lists(olga.get("/inbox").text, rid)
    r = olga.post(
        "/inbox/decide",
        data={
            "csrf": csrf_of(olga, "/inbox"),
            "run_id": rid,
            "name": "send",
            "subject_hash": con.open_hash(rid),
            "decision": "approve",
        },
    )
    assert r.status_code == 403
    assert "no grant for flow 'publish'" in html.unescape(r.text)
    api = con.api("olga").post(
        f"/api/approvals/{rid}/send/approve", json={"subject_hash": con.open_hash(rid)}
    )
    assert api.status_code == 403
    assert con.op.waits.get(rid, "send").status is WaitStatus.OPEN
    assert lists(con.client("abe").get("/inbox").text, rid)  # publish's approver sees it


# -- the inbox ---------------------------------------------------------------------------------


def _decide(c: Console, user: str, rid: str, decision: str, **extra: str) -> tuple[int, str]:
    client = c.client(user)
    data = {
        "csrf": csrf_of(client, "/inbox"),
        "run_id": rid,
        "name": "send",
        "instance": "0",
        "subject_hash": c.open_hash(rid),
        "decision": decision,
        **extra,
    }
    r = client.post("/inbox/decide", data=data)
    return r.status_code, html.unescape(r.text)


def test_approve_from_the_inbox_resumes_the_run_and_a_second_decision_shows_who(
    con: Console,
) -> None:
    rid = con.publish("r1")
    page = html.unescape(con.client("abe").get("/inbox").text)
    assert '"text": "Hello ann@x"' in page  # exactly the subject, readable
    assert con.open_hash(rid) in page  # and the hash it is bound to
    assert "alice" in page  # who asked
    status, _ = _decide(con, "abe", rid, "approve", reason="looks right")
    assert status == 303
    assert con.runtime.drive(rid).status is RunStatus.WAITING  # sent, now on the ack
    assert len(con.sent()) == 1
    # a second approver, from a page loaded before: decided elsewhere, not an error
    status, text = _decide(con, "otto", rid, "reject", reason="too late")
    assert status == 200
    assert "Decided elsewhere" in text
    assert "approved" in text
    assert "abe" in text
    assert con.op.waits.get(rid, "send").decided_by == "abe"
    api = con.api("ada").post(
        f"/api/approvals/{rid}/send/approve", json={"subject_hash": con.open_hash(rid)}
    )
    assert api.status_code == 200
    assert api.json()["outcome"] == "decided"
    assert api.json()["decided_by"] == "abe"
    assert len(con.sent()) == 1


def test_reject_needs_a_reason_and_takes_the_reject_path(con: Console) -> None:
    rid = con.publish("r1")
    status, text = _decide(con, "abe", rid, "reject")
    assert status == 400
    assert "needs a reason" in text
    status, _ = _decide(con, "abe", rid, "reject", reason="wrong recipient")
    assert status == 303
    w = con.op.waits.get(rid, "send")
    assert (w.status, w.decided_by, w.reason) == (WaitStatus.REJECTED, "abe", "wrong recipient")
    assert con.runtime.drive(rid).status is RunStatus.COMPLETED
    assert con.sent() == []


def test_a_changed_subject_hash_and_self_approval_are_refused(con: Console) -> None:
    rid = con.publish("r1")
    status, text = _decide(con, "abe", rid, "approve", subject_hash="0" * 64)
    assert status == 409
    assert "is not the hash of what was requested" in text
    status, text = _decide(con, "alice", rid, "approve")  # alice requested it
    assert status == 409
    assert "may not approve" in text
    assert con.op.waits.get(rid, "send").status is WaitStatus.OPEN


def test_batch_approve_binds_each_item_to_its_own_hash(con: Console) -> None:
    r1, r2, r3 = (con.publish(f"r{i}", to=f"p{i}@x") for i in (1, 2, 3))
    abe = con.client("abe")
    items = [
        json.dumps([r1, "send", 0, con.open_hash(r1)]),
        json.dumps([r2, "send", 0, con.open_hash(r1)]),  # r1's hash: not what r2 asks
        json.dumps([r3, "send", 0, con.open_hash(r3)]),
    ]
    r = abe.post(
        "/inbox/batch", data={"csrf": csrf_of(abe, "/inbox"), "item": items, "reason": "ok"}
    )
    assert r.status_code == 200
    assert [con.op.waits.get(x, "send").status for x in (r1, r2, r3)] == [
        WaitStatus.APPROVED,
        WaitStatus.OPEN,
        WaitStatus.APPROVED,
    ]
    assert "refused" in r.text
    for x in (r1, r3):
        con.runtime.drive(x)
    assert sorted(d["to"] for d in con.sent()) == ["p1@x", "p3@x"]


def test_edit_then_approve_binds_the_run_to_the_edited_subject(con: Console) -> None:
    rid = con.vendor("v1")
    requested = con.open_hash(rid, "compliance")
    abe = con.client("abe")
    page = html.unescape(abe.get(f"/inbox/edit?run_id={rid}&name=compliance").text)
    assert "DE02120300000000202051" in page
    assert requested in page
    edited = {"name": "ACME GmbH", "iban": "DE02120300000000202051"}
    form = {
        "csrf": csrf_of(abe, "/inbox"),
        "run_id": rid,
        "name": "compliance",
        "instance": "0",
        "subject_hash": requested,
        "subject": json.dumps(edited),
        "reason": "legal name",
    }
    r = abe.post("/inbox/edit", data={**form, "subject": "{not json"})
    assert r.status_code == 400
    assert con.op.waits.get(rid, "compliance").status is WaitStatus.OPEN
    r = abe.post("/inbox/edit", data={**form, "subject_hash": "0" * 64})
    assert r.status_code == 409  # the edit of something not shown: refused, nothing recorded
    r = abe.post("/inbox/edit", data=form)
    assert r.status_code == 303
    w = con.op.waits.get(rid, "compliance")
    assert (w.status, w.decided_by, w.subject) == (WaitStatus.APPROVED, "abe", edited)
    assert w.subject_hash != requested
    assert w.reason is not None
    assert requested[:16] in w.reason
    assert "legal name" in w.reason
    assert con.runtime.drive(rid).status is RunStatus.COMPLETED
    assert [d["vendor"] for d in con.sent()] == [edited]  # exactly what was approved
    # a second edit of the same request, from a page loaded before: decided elsewhere
    otto = con.client("otto")
    r = otto.post("/inbox/edit", data={**form, "csrf": csrf_of(otto, "/inbox")})
    assert r.status_code == 200
    assert "Decided elsewhere" in r.text
    assert len(con.sent()) == 1


def test_snooze_hides_an_approval_until_its_time_and_keeps_it_open(con: Console) -> None:
    rid = con.publish("r1")
    abe = con.client("abe")
    form = {"csrf": csrf_of(abe, "/inbox"), "run_id": rid, "name": "send"}
    for bad in ("0", "-1", "nan", "9000", "x"):
        assert abe.post("/inbox/snooze", data={**form, "hours": bad}).status_code == 400, bad
    r = abe.post("/inbox/snooze", data={**form, "hours": "72"})
    assert r.status_code == 303
    assert not lists(abe.get("/inbox").text, rid)
    assert lists(abe.get("/inbox?snoozed=1").text, rid)
    (snooze,) = con.accounts.snoozes().values()
    assert (snooze.by, snooze.reason) == ("abe", "not now")
    con.clock.advance(72 * 3600 + 1)
    assert lists(con.client("abe").get("/inbox").text, rid)  # (signed in again: 8 h sessions)
    assert con.op.waits.get(rid, "send").status is WaitStatus.OPEN


def test_inbox_filters(con: Console) -> None:
    rid = con.publish("r1")
    otto = con.client("otto")
    assert lists(otto.get("/inbox?flow=publish&name=send&requester=alice").text, rid)
    assert not lists(otto.get("/inbox?flow=repair").text, rid)
    assert not lists(otto.get("/inbox?requester=bob").text, rid)
    assert not lists(otto.get("/inbox?min_age_h=1").text, rid)
    con.clock.advance(0)  # ages are by the wait's own creation time
    assert [i["run_id"] for i in con.api("vera").get("/api/approvals?flow=publish").json()] == [rid]


def test_the_inbox_and_the_run_list_are_paged_in_the_database(db_url: str, tmp_path: Path) -> None:
    con = make_console(db_url, tmp_path, page_size=2)
    try:
        rids = [con.publish(f"r{i}") for i in range(5)]
        v = con.vendor("v-1")  # abe may decide it (vendor:compliance)
        otto = con.client("otto")
        seen = []
        for page in (1, 2, 3, 4):
            text = otto.get(f"/inbox?page={page}").text
            assert "6 open" in text
            seen += [r for r in [*rids, v] if f'data-run="{r}"' in text]
        assert seen == [*rids, v, rids[4], v]  # oldest first; past the end: the last page
        repair = con.client("olga")  # approver of flow "repair": nothing of these
        assert "0 open" in repair.get("/inbox").text
        assert "6 open" in con.client("abe").get("/inbox").text
        assert [i["run_id"] for i in con.api("abe").get("/api/approvals?page=3").json()] == [
            rids[4],
            v,
        ]
        listed = otto.get("/runs?page=1").text
        assert "<small>6</small>" in listed
        assert sum(f">{r}</a>" in listed for r in [*rids, v]) == 2
        assert "<small>1</small>" in otto.get("/runs?q=v-").text
        assert "<small>0</small>" in otto.get("/runs?q=%25").text  # LIKE's % is literal
    finally:
        close(con)


# -- signed approval links ------------------------------------------------------------------


def _link(con: Console, rid: str, *, approver: str = "abe", expires_in: float = 3600.0) -> str:
    url = approval_link(
        link_key(Keyring([K1])),
        "http://127.0.0.1",
        run_id=rid,
        name="compliance",
        subject_hash=con.open_hash(rid, "compliance"),
        approver=approver,
        expires_at=con.clock() + expires_in,
    )
    return url.removeprefix("http://127.0.0.1")


def test_a_signed_link_shows_the_subject_and_decides_only_on_confirmation_once(
    con: Console,
) -> None:
    rid = con.vendor("v1")
    path = _link(con, rid)
    browser = con.client()  # the link is the credential: no sign-in
    page = html.unescape(browser.get(path).text)
    assert "DE02120300000000202051" in page
    assert con.open_hash(rid, "compliance") in page
    assert "For <strong>abe</strong>" in page
    assert con.op.waits.get(rid, "compliance").status is WaitStatus.OPEN  # GET decided nothing
    assert browser.post(path, data={"decision": "approve"}).status_code == 403  # no CSRF
    r = browser.post(path, data={"csrf": csrf_of(browser, path), "decision": "approve"})
    assert r.status_code == 200
    assert "approved" in r.text
    w = con.op.waits.get(rid, "compliance")
    assert (w.status, w.decided_by) == (WaitStatus.APPROVED, "abe")
    again = browser.post(path, data={"csrf": csrf_of(browser), "decision": "reject", "reason": "x"})
    assert again.status_code == 410
    assert "used already" in again.text
    assert con.runtime.drive(rid).status is RunStatus.COMPLETED
    assert len(con.sent()) == 1


def test_a_signed_link_is_refused_altered_expired_for_another_subject_or_approver(
    con: Console,
) -> None:
    rid = con.vendor("v1")
    anon = con.client()
    path = _link(con, rid)
    body, mac = path.removeprefix("/approve/").split(".")
    forged = "/approve/" + body[:-2] + ("AA" if body[-2:] != "AA" else "BB") + "." + mac
    assert anon.get(forged).status_code == 410
    assert anon.get("/approve/nonsense").status_code == 410
    assert anon.get(_link(con, rid, expires_in=-1)).status_code == 410  # expired
    assert anon.get(_link(con, rid, approver="olga")).status_code == 403  # no grant
    assert anon.get(_link(con, rid, approver="nobody")).status_code == 403
    stale = _link(con, rid)
    con.op.approve_edited(
        rid,
        "compliance",
        actor="otto",
        subject_hash=con.open_hash(rid, "compliance"),
        subject={"name": "ACME", "iban": "X"},
        reason="fixed",
    )
    r = anon.get(stale)  # decided elsewhere meanwhile: who and when, not an error
    assert r.status_code == 200
    assert "Decided elsewhere" in r.text
    assert "otto" in r.text


@pytest.fixture(scope="module")
def mail() -> Iterator[MailDevel]:
    with MailDevel() as server:
        yield server


def test_a_flow_emails_a_signed_link_once_and_the_approver_decides_through_it(
    con: Console, mail: MailDevel
) -> None:
    rid = "linked-" + uuid.uuid4().hex[:8]  # one mailbox for the module: ids apart
    con.runtime.start(
        "linked",
        {
            "vendor": {"name": "ACME", "iban": "DE02120300000000202051"},
            "outbox": str(con.outbox),
            "mail": {
                "smtp_port": mail.smtp_port,
                "imap_port": mail.imap_port,
                "user": mail.user,
                "password": mail.password,
            },
            "console_url": "http://console.example",
            "approver": "abe",
            "approver_email": "abe@example.org",
            "link_expires_at": con.clock() + 86400,
        },
        run_id=rid,
        started_by="alice",
    )
    assert con.runtime.drive(rid).status is RunStatus.WAITING
    (effect,) = con.op.show(rid).effects
    message_id = f"<{effect.provider_key}@mail.example.org>"
    assert mail.count(message_id) == 1  # the provider's own count: sent once
    body = _fetch(mail, message_id)
    (url,) = re.findall(r"http://console\.example(/approve/\S+)", body)
    browser = con.client()
    assert "ACME" in browser.get(url).text
    r = browser.post(url, data={"csrf": csrf_of(browser, url), "decision": "approve"})
    assert r.status_code == 200
    assert con.op.waits.get(rid, "compliance").decided_by == "abe"
    assert con.runtime.drive(rid).status is RunStatus.COMPLETED
    assert [d["vendor"]["name"] for d in con.sent()] == ["ACME"]
    assert mail.count(message_id) == 1


def _fetch(mail: MailDevel, message_id: str) -> str:
    conn = imaplib.IMAP4("127.0.0.1", mail.imap_port, timeout=5)
    try:
        conn.login(mail.user, mail.password)
        conn.select("INBOX", readonly=True)
        _, found = conn.search(None, "HEADER", "Message-ID", f'"{message_id}"')
        (num,) = found[0].split()
        _, data = conn.fetch(num, "(RFC822)")
        raw = data[0][1] if isinstance(data[0], tuple) else b""
    finally:
        conn.logout()
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    part = msg.get_body(preferencelist=("plain",))
    assert part is not None
    return str(part.get_content())


# -- hostile values ------------------------------------------------------------------------------


def test_hostile_values_are_rendered_inert(con: Console) -> None:
    deep: object = "bottom"
    for _ in range(60):
        deep = {"d": deep}
    script = "<script>alert('x')</script><img src=x onerror=alert(1)>"
    rid = con.publish("r1", to=script, long="A" * 200_000, deep=deep)
    otto = con.client("otto")
    for path in ("/inbox", f"/runs/{rid}", "/runs"):
        r = otto.get(path)
        assert r.status_code == 200, path
        assert "<script>" not in r.text, path
        assert "<img src=x" not in r.text, path
        assert "script-src" not in r.headers["content-security-policy"]  # no script at all
    page = otto.get(f"/runs/{rid}").text
    assert "&lt;script&gt;" in page
    assert "more characters" in page  # the long value cut on the run page
    assert '"bottom"' in html.unescape(page)  # the deep value shown to its bottom
    inbox = html.unescape(otto.get("/inbox").text)
    assert script in inbox  # the subject in full, as text


# -- runs ---------------------------------------------------------------------------------------


def test_run_page_shows_the_run_and_actions_need_confirmation(con: Console) -> None:
    rid = con.publish("r1")
    otto = con.client("otto")
    page = html.unescape(otto.get(f"/runs/{rid}").text)
    for text in ("waiting", "send a greeting to ann@x", "approve the draft", "draft", "publish"):
        assert text in page, text
    assert "The audit chain verifies" in otto.get(f"/runs/{rid}?verify=1").text
    token = csrf_of(otto, "/inbox")
    r = otto.post(f"/runs/{rid}/edit", data={"csrf": token, "channel": "to", "value": "x"})
    assert r.status_code == 400
    assert "confirmation" in r.text
    data = {"csrf": token, "channel": "to", "value": "{bad", "reason": "r", "confirm": "yes"}
    r = otto.post(f"/runs/{rid}/edit", data=data)
    assert r.status_code == 400
    assert "not JSON" in r.text
    r = otto.post(f"/runs/{rid}/edit", data={**data, "value": '"bob@x"'})
    assert r.status_code == 303
    assert con.store.load(rid).state["to"] == "bob@x"
    r = otto.post(
        f"/runs/{rid}/fork",
        data={"csrf": token, "seq": "0", "reason": "try again", "confirm": "yes"},
    )
    assert r.status_code == 303
    forked = r.headers["location"].split("/runs/")[1].split("?")[0]
    assert forked != rid
    assert con.store.get_run(forked).flow == "publish"
    r = otto.post(
        f"/runs/{rid}/cancel", data={"csrf": token, "reason": "wrong customer", "confirm": "yes"}
    )
    assert r.status_code == 303
    assert con.store.get_run(rid).status is RunStatus.CANCELLED
    assert "wrong customer" in otto.get(f"/runs/{rid}").text  # the operator log shown
    log = con.op.show(rid).meta["operator_log"]
    assert [(e["by"], e["action"]) for e in log] == [
        ("otto", "operator:edit"),
        ("otto", "operator:cancel"),
    ]
    r = otto.post(f"/runs/{rid}/retry", data={"csrf": token, "reason": "r", "confirm": "yes"})
    assert r.status_code == 409  # a cancelled run is not retried; the page says why
    r = otto.post(
        f"/runs/{rid}/restart", data={"csrf": token, "reason": "wrong plan", "confirm": "yes"}
    )
    assert r.status_code == 303
    restarted = r.headers["location"].split("/runs/")[1].split("?")[0]
    assert restarted not in (rid, forked)
    assert con.store.get_run(restarted).flow == "publish"
    listed = otto.get("/runs?status=cancelled").text
    assert rid in listed
    assert forked not in listed
    assert lists(otto.get(f"/runs?q={rid[:2]}").text, rid)
    # no worker has announced itself: every waiting run is unserved, and shown so
    assert "unserved" in otto.get(f"/runs/{forked}").text
    assert lists(otto.get("/runs?unserved=1").text, forked)


# -- upgrades ------------------------------------------------------------------------------


def _deployed(con: Console, *flows: Flow) -> Console:
    """The console of ``con``'s database started with ``--flows`` naming ``flows``."""
    config = ConsoleConfig(session_key=session_key(Keyring([K1])))
    app = create_app(con.op, config, accounts=con.accounts, clock=con.clock, flows=flows)
    return dataclasses.replace(con, app=app)


def _shipping(con: Console, tmp_path: Path, run_id: str = "s1") -> tuple[str, Path]:
    """A run of version 1 of ``ship``: prepared (one delivery), waiting for ``go`` to
    send; and its outbox."""
    outbox = tmp_path / f"ship-{run_id}"
    rt = Runtime(con.runtime.store, con.runtime.ledger, [V1], owner="w1")
    rid = rt.start("ship", {"outbox": str(outbox)}, run_id=run_id)
    assert rt.drive(rid).status is RunStatus.WAITING
    return rid, outbox


def test_an_upgrade_from_the_run_page_maps_the_renamed_step_and_sends_each_effect_once(
    con: Console, tmp_path: Path
) -> None:
    rid, outbox = _shipping(con, tmp_path)
    up = _deployed(con, V2)  # `onceonly console --flows tests.version_flows:V2`
    form = {"to": "2", "reason": "retire version 1", "confirm": "yes"}
    for user in ("vera", "abe"):  # a viewer and an approver: no form, and denied
        c = up.client(user)
        assert "Upgrade to version" not in c.get(f"/runs/{rid}").text
        r = c.post(f"/runs/{rid}/upgrade", data={**form, "csrf": csrf_of(c, "/inbox")})
        assert r.status_code == 403, user
        assert "operator role" in r.text
        assert up.api(user).post(f"/api/runs/{rid}/upgrade", json=form).status_code == 403
    assert con.store.get_run(rid).code_version == "1"
    otto = up.client("otto")
    assert "Upgrade to version 2" in otto.get(f"/runs/{rid}").text
    token = csrf_of(otto, "/inbox")
    r = otto.post(f"/runs/{rid}/upgrade", data={**form, "csrf": token, "confirm": ""})
    assert r.status_code == 400  # no confirmation: nothing done
    assert con.store.get_run(rid).code_version == "1"
    r = otto.post(f"/runs/{rid}/upgrade", data={**form, "csrf": token})
    assert r.status_code == 303
    page = html.unescape(otto.get(r.headers["location"]).text)
    assert "upgrade: from version 1 to 2" in page
    assert "The run is on the deployed version of its flow (2)" in page
    assert "Upgrade to version" not in page
    assert "operator:upgrade" in page  # in the operator log, with the reason
    assert "retire version 1" in page
    run = con.store.get_run(rid)
    assert (run.code_version, run.status) == ("2", RunStatus.WAITING)
    meta = con.op.show(rid).meta
    assert meta["waiting"]["then"] == "deliver"  # the renamed step, mapped
    (entry,) = [e for e in meta["operator_log"] if e["action"] == "operator:upgrade"]
    assert (entry["by"], entry["from"], entry["to"], entry["steps"]) == (
        "otto",
        "1",
        "2",
        {"send": "deliver"},
    )
    # a worker of version 2 drives it to its end: each effect delivered once
    con.op.signal(rid, "go", actor="otto")
    v2 = Runtime(con.runtime.store, con.runtime.ledger, [V2], owner="w2")
    assert v2.drive(rid).status is RunStatus.COMPLETED
    got = [(d["what"], d["version"]) for d in deliveries(outbox)]
    assert got == [("prepare", "1"), ("send", "2")]
    assert con.op.ledger.verify().ok


def test_a_refused_upgrade_changes_nothing_and_the_page_says_why(
    con: Console, tmp_path: Path
) -> None:
    rid, outbox = _shipping(con, tmp_path)
    history = len(con.store.history(rid))
    # without --flows: the page says the command line does upgrades
    otto = con.client("otto")
    page = html.unescape(otto.get(f"/runs/{rid}").text)
    assert "started without flow code" in page
    assert "onceonly runs upgrade" in page
    form = {"to": "2", "reason": "retire version 1", "confirm": "yes"}
    r = otto.post(f"/runs/{rid}/upgrade", data={**form, "csrf": csrf_of(otto, "/inbox")})
    assert r.status_code == 409
    assert "started without flow code" in r.text
    # version 3 renamed `send` without mapping version 1's runs onto it: refused
    up = _deployed(con, V3)
    otto = up.client("otto")
    assert "Upgrade to version 3" in otto.get(f"/runs/{rid}").text
    token = csrf_of(otto, "/inbox")
    r = otto.post(f"/runs/{rid}/upgrade", data={**form, "csrf": token})
    assert r.status_code == 409  # a page from another deployment: not version 3
    assert "version '3' of 'ship', not '2'" in html.unescape(r.text)
    r = otto.post(f"/runs/{rid}/upgrade", data={**form, "to": "3", "csrf": token})
    assert r.status_code == 409
    page = html.unescape(r.text)
    assert f"run {rid!r} is not upgraded: version '3' of 'ship' has no step 'send'" in page
    assert "Nothing was changed" in page
    assert f"Run <code>{rid}</code>" in page  # on the run's own page
    api = up.api("otto").post(
        f"/api/runs/{rid}/upgrade", json={"to": "3", "reason": "retire version 1"}
    )
    assert api.status_code == 409
    assert api.json()["error"] == "UpgradeRefused"
    assert "has no step 'send'" in api.json()["message"]
    run = con.store.get_run(rid)
    assert (run.code_version, run.status, run.lease_owner) == ("1", RunStatus.WAITING, None)
    assert len(con.store.history(rid)) == history
    assert not con.op.show(rid).meta.get("operator_log")
    assert [d["what"] for d in deliveries(outbox)] == ["prepare"]


def test_the_api_upgrades_a_run(con: Console, tmp_path: Path) -> None:
    rid, _outbox = _shipping(con, tmp_path)
    api = _deployed(con, V2).api("ada")
    assert api.post(f"/api/runs/{rid}/upgrade", json={"to": "2"}).status_code == 400
    assert api.post(f"/api/runs/{rid}/upgrade", json={"reason": "r"}).status_code == 400
    r = api.post(f"/api/runs/{rid}/upgrade", json={"to": "2", "reason": "retire version 1"})
    assert r.status_code == 200
    assert (r.json()["from"], r.json()["to"], r.json()["status"]) == ("1", "2", "waiting")
    assert con.op.show(rid).meta["operator_log"][-1]["by"] == "ada"


def test_console_flows_are_checked_as_a_workers_are(con: Console) -> None:
    from click.testing import CliRunner

    from onceonly.checkpoint import ConfigurationError
    from onceonly.cli import cli

    with pytest.raises(ConfigurationError, match="given twice"):
        _deployed(con, V1, V2)
    r = CliRunner().invoke(cli, ["console", "--flows", "no_such_module:X", "--url", con.url])
    assert isinstance(r.exception, ConfigurationError)
    assert "no_such_module" in str(r.exception)


def test_effects_in_doubt_are_queued_and_resolved_with_evidence(con: Console) -> None:
    rid = con.publish("r1")
    Path(f"{con.outbox}.drop").touch()  # the request is lost before it arrives
    _decide(con, "abe", rid, "approve")
    assert con.runtime.drive(rid).status is RunStatus.WAITING  # parked on the effect
    (effect,) = con.op.show(rid).effects
    otto = con.client("otto")
    page = otto.get("/effects").text
    assert effect.key_id in page
    assert "needs_human" in page
    assert "Resolve" not in con.client("vera").get("/effects").text
    token = csrf_of(otto, "/inbox")
    r = otto.post(
        f"/effects/{effect.key_id}/resolve",
        data={"csrf": token, "outcome": "not_happened", "evidence": "not in the outbox"},
    )
    assert r.status_code == 400  # no confirmation
    r = otto.post(
        f"/effects/{effect.key_id}/resolve",
        data={
            "csrf": token,
            "outcome": "not_happened",
            "evidence": "not in the outbox",
            "confirm": "yes",
        },
    )
    assert r.status_code == 303
    assert effect.key_id not in otto.get("/effects").text
    assert con.runtime.drive(rid).status is RunStatus.WAITING  # sent once, on the ack now
    assert len(con.sent()) == 1


def test_the_api_acts_for_bots(con: Console) -> None:
    rid = con.publish("r1")
    api = con.api("abe")
    (item,) = api.get("/api/approvals").json()
    assert item["subject"] == {"to": "ann@x", "text": "Hello ann@x"}
    wrong = api.post(f"/api/approvals/{rid}/send/approve", json={"subject_hash": "0" * 64})
    assert wrong.status_code == 409
    assert wrong.json()["error"] == "subject_changed"
    ok = api.post(
        f"/api/approvals/{rid}/send/approve",
        json={"subject_hash": item["subject_hash"], "reason": "bot"},
    )
    assert ok.status_code == 200
    assert ok.json()["decided_by"] == "abe"
    con.runtime.drive(rid)
    doc = con.api("vera").get(f"/api/runs/{rid}").json()
    assert doc["status"] == "waiting"
    assert doc["effects"][0]["status"] == "committed"
    r = con.api("otto").post(f"/api/runs/{rid}/cancel", json={"reason": "done"})
    assert r.status_code == 200
    assert r.json()["status"] == "cancelled"
    assert len(con.sent()) == 1


# -- SSO and the command line ----------------------------------------------------------------


def test_the_sso_header_is_believed_only_from_the_trusted_proxy(con: Console) -> None:
    def app(proxies: set[str]) -> TestClient:
        config = ConsoleConfig(
            session_key=session_key(Keyring([K1])),
            trusted_header="X-Forwarded-User",
            trusted_proxies=frozenset(proxies),
        )
        made = create_app(con.op, config, accounts=con.accounts, clock=con.clock)
        return TestClient(made, base_url="http://127.0.0.1", follow_redirects=False)

    # the TestClient's address is "testclient": here not the proxy's
    r = app({"10.9.9.9"}).get("/inbox", headers={"X-Forwarded-User": "ada"})
    assert r.status_code == 303  # the header was ignored: sign in
    proxied = app({"testclient"})
    r = proxied.get("/inbox", headers={"X-Forwarded-User": "ada"})
    assert r.status_code == 200
    assert "ada (admin)" in r.text
    r = proxied.get("/inbox", headers={"X-Forwarded-User": "mallory"})
    assert r.status_code == 303  # no account: no access
    r = proxied.get("/inbox", headers={"X-Forwarded-User": "vera"})
    assert "vera (viewer)" in r.text
    assert "Approve" not in r.text


def test_console_refuses_a_remote_address_without_allow_remote() -> None:
    from click.testing import CliRunner

    from onceonly.cli import cli

    anywhere = "0.0.0.0"  # noqa: S104 - the address the console refuses
    r = CliRunner().invoke(cli, ["console", "--host", anywhere, "--url", "sqlite:///x.db"])
    assert isinstance(r.exception, RemoteBindRefused)
    assert "--allow-remote" in str(r.exception)
    assert "TLS" in str(r.exception)
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback(anywhere)
    assert not is_loopback("example.com")


def test_user_add_reads_the_password_from_stdin_never_an_argument(
    db_url: str, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from onceonly.checkpoint import Store
    from onceonly.cli import cli
    from onceonly.console import AccountError, Accounts, Role

    Store.open(db_url).close()
    env = {"ONCEONLY_DATABASE_URL": db_url}
    r = CliRunner().invoke(
        cli,
        ["console", "user", "add", "carol", "--role", "approver", "--flows", "publish"],
        input="a long enough password\n",
        env=env,
    )
    assert r.exit_code == 0, r.output
    assert "a long enough password" not in r.output
    short = CliRunner().invoke(
        cli, ["console", "user", "add", "dan", "--role", "viewer"], input="short\n", env=env
    )
    assert isinstance(short.exception, AccountError)
    assert "at least 12 characters" in str(short.exception)
    with Store.open(db_url) as store:
        acc = Accounts(store)
        user = acc.authenticate("carol", "a long enough password")
        assert user is not None
        assert (user.role, user.grants) == (Role.APPROVER, ("publish",))
        assert acc.authenticate("carol", "a long enough passworD") is None
    assert set(USERS) >= {"abe"}


def test_the_console_package_imports_without_its_extra_and_says_what_to_install() -> None:
    from tests.test_extras import _without_extras

    proc = _without_extras(
        "sys.modules['jinja2'] = None\n"
        "import onceonly.console as c\n"
        "from onceonly.cli import cli\n"  # the command line loads without it too
        "try:\n"
        "    c.create_app(None, c.ConsoleConfig(session_key=b'k'), accounts=object())\n"
        "except c.ConsoleError as exc:\n"
        "    print(exc)\n"
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert "pip install 'onceonly[console]'" in line
