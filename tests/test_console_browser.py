"""The console in a real browser: Debian's Chromium driven by Playwright (never a
downloaded browser), the console served by uvicorn on 127.0.0.1, on SQLite and
PostgreSQL. A compliance officer signs in, approves from the inbox and the run resumes
in a real ``onceonly worker`` process; rejects, batch-approves, snoozes,
edits-then-approves; a second officer in another browser finds the request decided
elsewhere; an operator resolves an effect in doubt, forks and cancels. The oracle is
the fake record system's outbox.

``ONCEONLY_SCREENSHOTS=1`` writes the inbox and run page screenshots into docs/img/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly.checkpoint import RunStatus, WaitStatus
from onceonly.console import approval_link, link_key
from onceonly.ledger import Keyring
from onceonly.testing.servers import AppServer
from tests.console_support import PASSWORD, Console, close, make_console
from tests.ledger_support import K1
from tests.test_worker import wait_until

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_S = 60.0  # conditions on a busy machine: generous, never a sleep


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for this module. Missing, it fails with what to install (a skipped
    browser suite would pass for nothing). Not for the session: Playwright's sync API
    keeps an event loop running in the main thread while it is open, and every later
    test's ``asyncio.run`` would refuse to start."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"no {CHROMIUM}: apt-get install -y chromium (.ci/run does); the console's "
            "browser tests do not download a browser"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


class Site:
    """The console served on 127.0.0.1 and the means to use it."""

    def __init__(self, con: Console, server: AppServer, browser: Any) -> None:
        self.con = con
        self.server = server
        self.browser = browser
        self.contexts: list[Any] = []

    def page(self, user: str) -> Any:
        """A fresh browser context (its own cookies), signed in as ``user``."""
        ctx = self.browser.new_context(viewport={"width": 1280, "height": 900})
        ctx.set_default_timeout(WAIT_S * 1000)
        self.contexts.append(ctx)
        page = ctx.new_page()
        page.goto(self.server.url + "/inbox")
        assert "/login" in page.url  # no anonymous access
        page.fill("input[name=username]", user)
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/inbox")
        return page

    def item(self, page: Any, run_id: str, name: str) -> Any:
        return page.locator(f'article[data-run="{run_id}"][data-name="{name}"]')

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()


@pytest.fixture
def site(db_url: str, tmp_path: Path, browser: Any) -> Iterator[Site]:
    con = make_console(db_url, tmp_path, real_time=True)
    server = AppServer(con.app, name="console").start()
    s = Site(con, server, browser)
    try:
        yield s
    finally:
        s.close()
        server.stop()
        close(con)


def _shot(page: Any, name: str, tmp_path: Path) -> None:
    folder = ROOT / "docs" / "img" if os.environ.get("ONCEONLY_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=False)
    assert (folder / name).stat().st_size > 1000


def _worker(url: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, ONCEONLY_SECRETS=f"k1:{K1.value.hex()}", PYTHONPATH=str(ROOT))
    cmd = [
        str(Path(sys.executable).parent / "onceonly"),
        "worker",
        "--url",
        url,
        "--flows",
        "tests.console_flows:FLOWS",
        "--owner",
        "browser-worker",
        "--poll-s",
        "0.2",
    ]
    with log.open("ab") as fh:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)


def test_approve_in_the_browser_and_the_run_resumes_in_a_worker_process(
    site: Site, tmp_path: Path
) -> None:
    con = site.con
    rid = con.vendor("onboard-acme")
    log = tmp_path / "worker.log"
    worker = _worker(con.url, log)
    try:
        page = site.page("abe")
        item = site.item(page, rid, "compliance")
        assert "DE02120300000000202051" in item.inner_text()  # exactly the subject
        assert con.open_hash(rid, "compliance") in item.inner_text()  # and its hash
        _shot(page, "console-inbox.png", tmp_path)
        item.locator("input[name=reason][aria-label=reason]").fill(
            "vendor checked against the sanctions list"
        )
        item.get_by_role("button", name="Approve").click()
        page.wait_for_url("**/inbox?msg=*")
        assert "approved: compliance" in page.inner_text(".msg")
        wait_until(
            lambda: con.store.get_run(rid).status is RunStatus.COMPLETED,
            WAIT_S,
            f"the worker did not finish the run: {log.read_text()[-2000:]}",
        )
        assert [d["vendor"]["name"] for d in con.sent()] == ["ACME"]  # created once
        page.goto(f"{site.server.url}/runs/{rid}")
        assert page.inner_text("#status") == "completed"
        assert "vendor.create@1" in page.inner_text("main")
        _shot(page, "console-run.png", tmp_path)
    finally:
        worker.terminate()
        worker.wait(30)
    assert len(con.sent()) == 1


def test_reject_batch_snooze_and_edit_then_approve_in_the_browser(site: Site) -> None:
    con = site.con
    no, b1, b2, later, edit = (
        con.vendor(f"v-{n}", name=n.upper()) for n in ("no", "b1", "b2", "later", "edit")
    )
    page = site.page("abe")
    # reject, with a reason
    item = site.item(page, no, "compliance")
    item.locator("input[name=reason][aria-label=reason]").fill("not a real company")
    item.get_by_role("button", name="Reject").click()
    page.wait_for_url("**/inbox?msg=*")
    # snooze: hidden, still open
    site.item(page, later, "compliance").get_by_role("button", name="Not now").click()
    page.wait_for_url("**/inbox?msg=*")
    assert site.item(page, later, "compliance").count() == 0
    # batch: two ticked, one form, each bound to its own hash
    for rid in (b1, b2):
        site.item(page, rid, "compliance").locator("input[type=checkbox]").check()
    page.fill("#batch input[name=reason]", "quarterly batch")
    page.click("#batch button[type=submit]")
    page.wait_for_url("**/inbox/batch")
    assert page.inner_text("table").count("approved") == 2
    # edit, then approve
    page.goto(f"{site.server.url}/inbox")
    site.item(page, edit, "compliance").get_by_role("link", name="Edit, then approve").click()
    page.wait_for_url("**/inbox/edit?*")
    page.fill("textarea[name=subject]", '{"name": "EDIT Ltd", "iban": "GB33BUKB20201555555555"}')
    page.fill("input[name=reason]", "the registered name")
    page.click("button.approve")
    page.wait_for_url("**/inbox?msg=*")

    waits = {rid: con.op.waits.get(rid, "compliance") for rid in (no, b1, b2, later, edit)}
    assert {rid: w.status for rid, w in waits.items()} == {
        no: WaitStatus.REJECTED,
        b1: WaitStatus.APPROVED,
        b2: WaitStatus.APPROVED,
        later: WaitStatus.OPEN,
        edit: WaitStatus.APPROVED,
    }
    assert all(w.decided_by == "abe" for rid, w in waits.items() if rid != later)
    assert waits[no].reason == "not a real company"
    for rid in (no, b1, b2, edit):
        assert con.runtime.drive(rid).status is RunStatus.COMPLETED
    assert sorted(d["vendor"]["name"] for d in con.sent()) == ["B1", "B2", "EDIT Ltd"]
    (edited,) = [d["vendor"] for d in con.sent() if d["vendor"]["name"] == "EDIT Ltd"]
    assert edited["iban"] == "GB33BUKB20201555555555"


def test_decided_elsewhere_in_two_browsers(site: Site) -> None:
    con = site.con
    rid = con.vendor("v1")
    first = site.page("abe")
    second = site.page("otto")  # loaded the same request before the first decided
    site.item(first, rid, "compliance").get_by_role("button", name="Approve").click()
    first.wait_for_url("**/inbox?msg=*")
    item = site.item(second, rid, "compliance")
    item.locator("input[name=reason][aria-label=reason]").fill("too late")
    item.get_by_role("button", name="Reject").click()
    second.wait_for_load_state()
    text = second.inner_text("main")
    assert "Decided elsewhere" in text
    assert "approved by abe" in text
    w = con.op.waits.get(rid, "compliance")
    assert (w.status, w.decided_by) == (WaitStatus.APPROVED, "abe")


def test_an_operator_resolves_an_effect_in_doubt_forks_and_cancels_in_the_browser(
    site: Site,
) -> None:
    con = site.con
    rid = con.publish("p1")
    Path(f"{con.outbox}.drop").touch()  # the delivery is lost before it arrives
    con.op.approve(rid, "send", actor="abe", subject_hash=con.open_hash(rid))
    assert con.runtime.drive(rid).status is RunStatus.WAITING  # parked on the effect
    page = site.page("otto")
    page.goto(f"{site.server.url}/effects")
    page.check("input[value=not_happened]")
    page.fill("input[name=evidence]", "not in the provider's outbox")
    page.check("input[name=confirm]")
    page.click("text=Resolve")
    page.wait_for_url("**/effects?msg=*")
    assert "Nothing needs a person" in page.inner_text("main")
    assert con.runtime.drive(rid).status is RunStatus.WAITING  # sent now, on the ack
    assert len(con.sent()) == 1
    page.goto(f"{site.server.url}/runs/{rid}")
    fork = page.locator("form.fork")
    fork.locator("input[name=seq]").fill("0")
    fork.locator("input[name=reason]").fill("try with another text")
    fork.locator("input[name=confirm]").check()
    fork.get_by_role("button", name="Fork").click()
    page.wait_for_url("**/runs/*?msg=fork*")
    forked = page.url.split("/runs/")[1].split("?")[0]
    assert forked != rid
    cancel = page.locator("form.cancel")
    cancel.locator("input[name=reason]").fill("duplicate of p1")
    cancel.locator("input[name=confirm]").check()
    cancel.get_by_role("button", name="Cancel the run").click()
    page.wait_for_url("**/runs/*?msg=cancel*")
    assert page.inner_text("#status") == "cancelled"
    assert "otto operator:cancel: duplicate of p1" in page.inner_text(".oplog")
    assert con.store.get_run(forked).status is RunStatus.CANCELLED
    assert con.store.get_run(rid).status is RunStatus.WAITING
    assert len(con.sent()) == 1


def test_a_signed_link_in_the_browser_asks_then_decides(site: Site) -> None:
    con = site.con
    rid = con.vendor("v-link")
    url = approval_link(
        link_key(Keyring([K1])),
        site.server.url,
        run_id=rid,
        name="compliance",
        subject_hash=con.open_hash(rid, "compliance"),
        approver="abe",
        expires_at=con.clock() + 3600,
    )
    ctx = site.browser.new_context()
    site.contexts.append(ctx)
    page = ctx.new_page()
    page.goto(url)  # no sign-in: the link is the credential, and shows before it decides
    assert "DE02120300000000202051" in page.inner_text("pre.subject")
    assert con.op.waits.get(rid, "compliance").status is WaitStatus.OPEN
    page.click("button.approve")
    page.wait_for_selector("#done")
    assert "approved by abe" in page.inner_text("#done")
    page.goto(url)
    assert "used already" in page.inner_text("main")
    assert con.runtime.drive(rid).status is RunStatus.COMPLETED
    assert len(con.sent()) == 1
