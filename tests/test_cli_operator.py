"""The operator tools through the CLI: approve, reject, signal, edit, cancel, retry, fork,
gc and effects resolve, on SQLite and PostgreSQL.

Runs are set up in-process with the Runtime API (flows in ``tests/operator_flows.py``)
and driven in-process between CLI calls, as a worker would; a few tests drive the whole
thing through the installed ``onceonly`` console script and ``onceonly worker``. The
oracle for effects is the fake provider's outbox, never the ledger.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from onceonly.adapters import StepDiverged, guard, step
from onceonly.checkpoint import (
    CodecError,
    ConfigurationError,
    CorruptRecord,
    RunNotFound,
    RunStatus,
    Store,
    WaitNotFound,
    WaitRefused,
    subject_hash,
)
from onceonly.cli import cli
from onceonly.cli._common import format_duration, parse_duration
from onceonly.context import StepContext
from onceonly.errors import RunNotResumable
from onceonly.flow import Flow, Transition
from onceonly.ledger import (
    Claim,
    EffectIdentity,
    EffectInDoubt,
    EffectStatus,
    InvalidTransition,
    Keyring,
    LeaseLost,
    Ledger,
)
from onceonly.registry import WorkerRegistry
from onceonly.runtime import Runtime
from tests.dbutil import execute
from tests.ledger_support import K1, K2, Clock, Ledgers
from tests.operator_flows import FLOWS, deliveries

ROOT = Path(__file__).resolve().parent.parent
ONCEONLY = Path(sys.executable).parent / "onceonly"
SECRETS = f"k1:{K1.value.hex()}"
OTHER_HASH = "0" * 64


@dataclass
class Env:
    """A database with runs of the test flows, a runtime standing in for a worker, and
    the CLI pointed at the same database."""

    url: str
    store: Store
    runtime: Runtime
    outbox: Path

    def cli(self, *args: str, user: str = "ops", ok: bool = True) -> Result:
        env = {
            "ONCEONLY_DATABASE_URL": self.url,
            "ONCEONLY_SECRETS": SECRETS,
            "USER": user,
            "COLUMNS": "160",  # tables wide enough that cells do not wrap
        }
        result = CliRunner().invoke(cli, list(args), env=env)
        if ok:
            assert result.exit_code == 0, (result.output, result.exception)
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json").stdout)

    def publish(self, run_id: str, **state: Any) -> str:
        """A publish run, driven to its approval request (requested by alice)."""
        rid = self.runtime.start(
            "publish",
            {"to": "ann@x", "outbox": str(self.outbox), **state},
            run_id=run_id,
            started_by="alice",
        )
        assert self.drive(rid) is RunStatus.WAITING
        return rid

    def drive(self, run_id: str) -> RunStatus:
        return self.runtime.drive(run_id).status

    def hash_of(self, run_id: str, name: str = "send") -> str:
        (wait,) = [w for w in self.json("runs", "show", run_id)["waits"] if w["name"] == name]
        return str(wait["subject_hash"])

    def approve(self, run_id: str, user: str = "bob") -> Result:
        return self.cli("approve", run_id, "send", "--hash", self.hash_of(run_id), "--as", user)

    def sent(self) -> list[dict[str, Any]]:
        return deliveries(self.outbox)


@pytest.fixture
def env(db_url: str, store: Store, ledgers: Ledgers, tmp_path: Path) -> Env:
    ledger = ledgers.on(store, owner="w1", clock=time.time)
    return Env(db_url, store, Runtime(store, ledger, FLOWS, owner="w1"), tmp_path / "outbox")


# -- step retries ---------------------------------------------------------------------------


def test_runs_show_tells_a_step_being_retried_and_the_error_that_failed_a_run(env: Env) -> None:
    waiting = env.runtime.start("patient", {}, run_id="r-patient")
    assert env.drive(waiting) is RunStatus.WAITING
    shown = env.json("runs", "show", waiting)
    assert (shown["retry"]["step"], shown["retry"]["failed"], shown["retry"]["attempts"]) == (
        "quote",
        1,
        3,
    )
    assert shown["last_error"]["type"] == "TimeoutError"
    assert [w["name"] for w in shown["waits"]] == ["retry.quote.0.1"]
    text = env.cli("runs", "show", waiting, "--tables").output
    assert "retrying" in text
    assert "attempt 2 of 3 in 59m" in text or "attempt 2 of 3 in 1h" in text
    assert "TimeoutError: the quote service did not answer for r-patient" in text  # traceback
    assert "last error" in text

    failed = env.runtime.start("impatient", {}, run_id="r-impatient")
    assert env.drive(failed) is RunStatus.FAILED  # both attempts at once (no pause)
    shown = env.json("runs", "show", failed)
    assert (shown["error"]["type"], shown["error"]["attempt"]) == ("TimeoutError", 2)
    assert "in _times_out" in shown["error"]["traceback"]
    assert shown["retry"] is None
    text = env.cli("runs", "show", failed, "--tables").output
    assert "TimeoutError in quote (attempt 2)" in text
    assert "Traceback (most recent call last)" in text


def test_runs_show_tells_a_runs_deadline_and_its_path(env: Env) -> None:
    rid = env.runtime.start("deadlined", {}, run_id="r-deadlined")
    assert env.drive(rid) is RunStatus.WAITING
    shown = env.json("runs", "show", rid)
    assert shown["deadline"]["then"] == "give_up"
    assert shown["deadline"]["s"] == 7200
    assert shown["deadline"].get("passed") is None
    assert {w["name"]: w["kind"] for w in shown["waits"]} == {
        "deadline.run": "timer",
        "docs": "signal",
    }
    text = env.cli("runs", "show", rid, "--tables").output
    assert "deadline" in text
    assert "then give_up" in text


def test_runs_notes_shows_the_handoff_note_as_each_step_left_it(env: Env) -> None:
    rid = env.publish("r-notes")
    env.approve(rid)
    assert env.drive(rid) is RunStatus.WAITING  # sent; waits for the ack
    doc = env.json("runs", "notes", rid)
    assert [(d["step"], d["goal"], d["done"], d["next"]) for d in doc] == [
        ("start", "", [], []),
        ("draft", "send a greeting to ann@x", [], ["approve the draft"]),
        ("send", "send a greeting to ann@x", ["draft", "send"], ["wait for the ack"]),
    ]
    text = env.cli("runs", "notes", rid).output
    assert "ruled out" in text  # piped: the table's columns, one line a checkpoint
    assert "wait for the ack" in text
    missing = env.cli("runs", "notes", "nope", ok=False)
    assert missing.exit_code != 0


def test_runs_check_names_the_runs_a_deploy_would_strand(env: Env) -> None:
    env.publish("r-wait")  # waiting for approval "send"; a rejection goes to "rejected"
    done = env.runtime.start("lease", {}, run_id="r-done")
    assert env.drive(done) is RunStatus.COMPLETED
    same = env.cli("runs", "check", "--flows", "tests.operator_flows:FLOWS")
    assert "no run would be stranded" in same.output
    new = "tests.operator_flows:NEXT_RELEASE"
    found = env.cli("runs", "check", "--flows", new, ok=False)
    assert found.exit_code == 1
    assert "r-wait" in found.output
    assert "on rejection of wait 'send'" in found.output
    doc = json.loads(env.cli("runs", "check", "--flows", new, "--json", ok=False).stdout)
    assert doc == [
        {
            "run_id": "r-wait",
            "flow": "publish",
            "status": "waiting",
            "step": "rejected",
            "where": "on rejection of wait 'send'",
            "code_version": "1",
            "served": True,
        }
    ]
    bad = env.cli("runs", "check", "--flows", "no_such_module:X", ok=False)
    assert bad.exit_code != 0
    assert "no_such_module" in str(bad.exception)  # main() prints it as "error: ..."
    # a release that serves only its own version lists the run apart, and passes
    other = env.cli("runs", "check", "--flows", "tests.operator_flows:PUBLISH_V3")
    assert "no run would be stranded" in other.output
    (row,) = [line.split() for line in other.output.splitlines() if "r-wait" in line]
    assert row == ["r-wait", "publish", "waiting", "1"]


def test_runs_upgrade_and_the_runs_no_worker_serves(env: Env) -> None:
    env.publish("r-wait")
    assert "no worker has announced itself" in env.cli("workers").output
    nobody = env.cli("runs", "list", "--unserved", ok=False)
    assert nobody.exit_code == 1
    assert "r-wait" in nobody.output
    registry = WorkerRegistry(env.store)
    registry.announce("w-old", {"publish": ["1"]}, beat_s=30)
    assert env.json("runs", "list", "--unserved") == []
    (worker,) = env.json("workers")
    assert (worker["owner"], worker["served"], worker["live"]) == (
        "w-old",
        {"publish": ["1"]},
        True,
    )
    flows = "tests.operator_flows:PUBLISH_V3"
    wrong = env.cli(
        "runs", "upgrade", "r-wait", "--to", "9", "--flows", flows, "--reason", "x", ok=False
    )
    assert wrong.exit_code != 0
    assert "no version '9'" in str(wrong.exception)
    up = env.cli(
        "runs", "upgrade", "r-wait", "--to", "3", "--flows", flows, "--reason", "retire v1",
        "--as", "alice",
    )  # fmt: skip
    assert "upgraded r-wait from version 1 to 3 (by alice)" in up.output
    assert env.store.get_run("r-wait").code_version == "3"
    assert env.json("runs", "show", "r-wait")["waiting"]["on_reject"] == "declined"
    # the version 1 worker no longer serves it
    left = env.cli("runs", "list", "--unserved", "--json", ok=False)
    assert left.exit_code == 1
    assert [r["run_id"] for r in json.loads(left.stdout)] == ["r-wait"]


# -- approvals ------------------------------------------------------------------------------


def test_approving_the_right_hash_continues_the_run(env: Env) -> None:
    rid = env.publish("r1")
    shown = env.json("runs", "show", rid)
    (wait,) = shown["waits"]
    draft = {"to": "ann@x", "text": "Hello ann@x"}
    assert (wait["kind"], wait["status"], wait["subject"]) == ("approval", "open", draft)
    assert wait["subject_hash"] == subject_hash(env.store, draft)
    assert wait["requested_by"] == "alice"
    assert shown["waiting"]["name"] == "send"
    assert env.sent() == []

    out = env.cli(
        "approve", rid, "send", "--hash", wait["subject_hash"], "--as", "bob", "--reason", "ok"
    )
    assert "approved 'send' of run r1 as bob" in out.stdout
    assert env.store.get_run(rid).status is RunStatus.RUNNING  # woken, for any worker
    assert env.drive(rid) is RunStatus.WAITING  # sent, now waits for the ack
    assert [d["to"] for d in env.sent()] == ["ann@x"]
    (decided, ack) = env.json("runs", "show", rid)["waits"]
    assert (decided["status"], decided["decided_by"], decided["reason"]) == (
        "approved",
        "bob",
        "ok",
    )
    assert (ack["name"], ack["status"]) == ("ack", "open")


def test_a_wrong_hash_is_refused_and_nothing_is_recorded(env: Env) -> None:
    rid = env.publish("r1")
    before = env.json("runs", "show", rid)
    res = env.cli("approve", rid, "send", "--hash", OTHER_HASH, "--as", "bob", ok=False)
    assert res.exit_code == 1
    assert isinstance(res.exception, WaitRefused)
    assert res.exception.reason == "subject_changed"
    after = env.json("runs", "show", rid)
    assert after["waits"] == before["waits"]
    assert (after["status"], after["waits"][0]["decided_by"]) == ("waiting", None)
    assert env.drive(rid) is RunStatus.WAITING
    assert env.sent() == []


def test_the_requester_may_not_approve_their_own_request(env: Env) -> None:
    rid = env.publish("r1")
    res = env.cli("approve", rid, "send", "--hash", env.hash_of(rid), "--as", "alice", ok=False)
    assert res.exit_code == 1
    assert isinstance(res.exception, WaitRefused)
    assert res.exception.reason == "self_approval"
    # $USER is the identity when --as is not given: alice again, refused again
    res = env.cli("approve", rid, "send", "--hash", env.hash_of(rid), user="alice", ok=False)
    assert isinstance(res.exception, WaitRefused)
    assert env.json("runs", "show", rid)["waits"][0]["status"] == "open"
    env.cli("approve", rid, "send", "--hash", env.hash_of(rid), user="bob")  # $USER recorded
    assert env.json("runs", "show", rid)["waits"][0]["decided_by"] == "bob"


def test_an_expired_approval_is_refused(env: Env) -> None:
    before = time.time()
    rid = env.publish("r1", expires_in=0.3)
    shown = env.json("runs", "show", rid)
    assert before + 0.3 <= shown["waits"][0]["due_at"] <= time.time() + 0.3
    while time.time() <= shown["waits"][0]["due_at"]:
        time.sleep(0.05)
    res = env.cli("approve", rid, "send", "--hash", env.hash_of(rid), "--as", "bob", ok=False)
    assert isinstance(res.exception, WaitRefused)
    assert res.exception.reason == "expired"
    assert env.drive(rid) is RunStatus.FAILED  # no on_expire step: the run fails
    assert env.sent() == []


def test_a_decision_is_final(env: Env) -> None:
    rid = env.publish("r1")
    env.approve(rid)
    res = env.cli("reject", rid, "send", "--reason", "changed my mind", "--as", "carol", ok=False)
    assert isinstance(res.exception, WaitRefused)
    assert res.exception.reason == "decided"


def test_reject_takes_the_rejection_path(env: Env) -> None:
    rid = env.publish("r1")
    doc = env.json("reject", rid, "send", "--reason", "wrong recipient", "--as", "carol")
    assert (doc["status"], doc["decided_by"], doc["reason"]) == (
        "rejected",
        "carol",
        "wrong recipient",
    )
    assert env.drive(rid) is RunStatus.COMPLETED
    assert env.store.load(rid).state["result"] == "rejected"
    assert env.sent() == []


def test_reject_needs_a_reason(env: Env) -> None:
    rid = env.publish("r1")
    res = env.cli("reject", rid, "send", "--as", "carol", ok=False)
    assert res.exit_code == 2
    assert "--reason" in res.output


# -- signals ----------------------------------------------------------------------------------


def test_signal_delivers_its_payload_once(env: Env) -> None:
    rid = env.publish("r1")
    env.approve(rid)
    assert env.drive(rid) is RunStatus.WAITING
    out = env.cli("signal", rid, "ack", "--payload", '{"ok": true, "n": 3}', "--as", "dave")
    assert "signalled 'ack' to run r1 as dave" in out.stdout
    assert env.drive(rid) is RunStatus.COMPLETED
    result = env.store.load(rid).state["result"]
    assert result["ack"] == {"ok": True, "n": 3}
    again = env.cli("signal", rid, "ack", "--payload", "1", ok=False)
    assert isinstance(again.exception, WaitRefused)
    assert again.exception.reason == "decided"
    assert len(env.sent()) == 1


def test_a_signal_may_arrive_before_the_run_waits_for_it(env: Env) -> None:
    rid = env.publish("r1")
    doc = env.json("signal", rid, "ack")  # no payload: null, delivered, kept
    assert (doc["status"], doc["payload"], doc["decided_by"]) == ("delivered", None, "ops")
    env.approve(rid)
    assert env.drive(rid) is RunStatus.COMPLETED  # the ack was there already


def test_signals_to_unknown_runs_or_approvals_are_refused(env: Env) -> None:
    rid = env.publish("r1")
    res = env.cli("signal", "no-such-run", "ack", ok=False)
    assert res.exit_code == 1
    assert "no-such-run" in str(res.exception)
    res = env.cli("signal", rid, "send", ok=False)  # an approval is not signalled
    assert isinstance(res.exception, WaitRefused)
    assert res.exception.reason == "kind_mismatch"
    res = env.cli("approve", rid, "nope", "--hash", OTHER_HASH, "--as", "bob", ok=False)
    assert isinstance(res.exception, WaitNotFound)


# -- edit, retry, cancel, fork ----------------------------------------------------------------


def test_edit_then_retry_repairs_a_failed_run(env: Env) -> None:
    rid = env.runtime.start("repair", {"broken": True}, run_id="r2")
    assert env.drive(rid) is RunStatus.FAILED
    shown = env.json("runs", "show", rid)
    assert shown["error"]["message"] == "the input is broken"
    out = env.cli(
        "runs",
        "edit",
        rid,
        "broken",
        "--value",
        "false",
        "--reason",
        "fixed upstream",
        "--as",
        "erin",
    )
    assert "set 'broken' of run r2" in out.stdout
    shown = env.json("runs", "show", rid)
    assert shown["state"]["broken"] is False
    assert shown["status"] == "failed"  # an edit does not resume the run
    last = shown["history"][-1]
    assert (last["step"], last["source"]) == ("operator:edit", "operator")
    (entry,) = shown["operator_log"]
    assert (entry["by"], entry["action"], entry["channel"], entry["reason"]) == (
        "erin",
        "operator:edit",
        "broken",
        "fixed upstream",
    )
    doc = env.json("runs", "retry", rid, "--as", "erin")
    assert (doc["status"], doc["next_step"]) == ("running", "check")
    assert env.drive(rid) is RunStatus.COMPLETED
    assert env.store.load(rid).state["result"]["fixed"] is True
    log = env.json("runs", "show", rid)["operator_log"]
    assert [e["action"] for e in log] == ["operator:edit", "operator:retry"]


def test_retry_and_edit_refuse_what_they_cannot_do(env: Env) -> None:
    rid = env.publish("r1")
    res = env.cli("runs", "retry", rid, "--as", "erin", ok=False)
    assert isinstance(res.exception, RunNotResumable)
    assert res.exit_code == 1
    res = env.cli(
        "runs",
        "edit",
        rid,
        "_onceonly",
        "--value",
        "{}",
        "--reason",
        "x",
        "--as",
        "erin",
        ok=False,
    )
    assert isinstance(res.exception, ConfigurationError)
    res = env.cli("runs", "edit", rid, "to", "--value", '"x"', "--as", "erin", ok=False)
    assert res.exit_code == 2  # no --reason
    assert env.json("runs", "show", rid)["operator_log"] == []


def test_cancel_closes_the_waits_and_nothing_runs_again(env: Env) -> None:
    rid = env.publish("r1")
    doc = env.json("runs", "cancel", rid, "--as", "frank", "--reason", "customer left")
    assert doc == {"run_id": rid, "status": "cancelled", "by": "frank"}
    shown = env.json("runs", "show", rid)
    assert [(w["status"], w["decided_by"]) for w in shown["waits"]] == [("cancelled", "frank")]
    assert shown["operator_log"][-1]["reason"] == "customer left"
    assert env.drive(rid) is RunStatus.CANCELLED
    res = env.cli("approve", rid, "send", "--hash", env.hash_of(rid), "--as", "bob", ok=False)
    assert isinstance(res.exception, WaitRefused)
    res = env.cli("runs", "cancel", rid, ok=False)
    assert isinstance(res.exception, RunNotResumable)
    assert env.sent() == []


def test_a_fork_asks_again_and_replays_what_its_origin_sent(env: Env) -> None:
    rid = env.publish("r1")
    env.approve(rid)
    assert env.drive(rid) is RunStatus.WAITING
    env.cli("signal", rid, "ack", "--payload", '"thanks"')
    assert env.drive(rid) is RunStatus.COMPLETED
    assert len(env.sent()) == 1
    history = env.json("runs", "show", rid)["history"]
    (draft_seq,) = [h["seq"] for h in history if h["step"] == "draft"]

    doc = env.json(
        "runs",
        "fork",
        rid,
        "--seq",
        str(draft_seq),
        "--reason",
        "resend?",
        "--as",
        "gina",
        "--new-id",
        "r1-again",
    )
    assert doc["run_id"] == "r1-again"
    fork = env.json("runs", "show", "r1-again")
    assert fork["status"] == "waiting"
    assert fork["forked_from"] == {"run": rid, "seq": draft_seq, "by": "gina", "reason": "resend?"}
    assert [(w["name"], w["status"]) for w in fork["waits"]] == [("send", "open")]  # asks again
    env.approve("r1-again", user="hank")
    assert env.drive("r1-again") is RunStatus.WAITING
    assert len(env.sent()) == 1  # the origin's delivery replayed; nothing sent again
    origin_receipt = env.store.load(rid).state["receipt"]
    assert env.store.load("r1-again").state["receipt"] == origin_receipt
    env.cli("signal", "r1-again", "ack", "--payload", '"again"')
    assert env.drive("r1-again") is RunStatus.COMPLETED
    assert len(env.sent()) == 1


def test_a_restart_sends_again_in_a_new_run_and_cancels_the_old(env: Env) -> None:
    rid = env.publish("r9")
    env.approve(rid)
    assert env.drive(rid) is RunStatus.WAITING  # sent, waiting for the ack
    assert len(env.sent()) == 1
    doc = env.json("runs", "restart", rid, "--reason", "wrong recipient", "--as", "gina")
    assert doc == {
        "run_id": "r9.restart-1",
        "restarted_from": rid,
        "old_status": "cancelled",
        "by": "gina",
    }
    old, new = env.json("runs", "show", rid), env.json("runs", "show", "r9.restart-1")
    assert old["restarted_as"] == ["r9.restart-1"]
    assert (new["restarted_from"]["run"], new["restarted_from"]["reason"]) == (
        rid,
        "wrong recipient",
    )
    assert [e["status"] for e in old["effects"]] == ["committed"]  # still recorded
    assert env.drive("r9.restart-1") is RunStatus.WAITING  # asks again: a new approval
    env.approve("r9.restart-1", user="hank")
    assert env.drive("r9.restart-1") is RunStatus.WAITING
    assert len(env.sent()) == 2  # a new key space: sent again
    text = env.cli("runs", "restart", rid, "--reason", "and again").output
    assert text.startswith(f"restarted {rid} (cancelled) as r9.restart-2 (by ops);")
    shown = env.cli("runs", "show", "r9.restart-2", "--tables").output
    assert f"restarted from  {rid} by ops: and again" in shown


def test_a_fork_needs_a_next_step_and_a_reason(env: Env) -> None:
    rid = env.runtime.start("repair", {"broken": False}, run_id="r2")
    assert env.drive(rid) is RunStatus.COMPLETED
    last = env.json("runs", "show", rid)["history"][-1]["seq"]
    res = env.cli("runs", "fork", rid, "--seq", str(last), "--reason", "x", ok=False)
    assert isinstance(res.exception, ConfigurationError)
    assert env.cli("runs", "fork", rid, "--seq", "0", ok=False).exit_code == 2  # no reason
    assert env.cli("runs", "fork", rid, "--seq", "-1", "--reason", "x", ok=False).exit_code == 2
    assert [r.run_id for r in env.store.list_runs()] == [rid]


# -- effects resolve wakes a parked run -------------------------------------------------------


def _park(env: Env, mode: str) -> tuple[str, str]:
    """A publish run whose delivery timed out (``lose``: applied, ``drop``: not)."""
    rid = env.publish("r1")
    Path(f"{env.outbox}.{mode}").touch()
    env.approve(rid)
    assert env.drive(rid) is RunStatus.WAITING
    shown = env.json("runs", "show", rid)
    (effect,) = shown["effects"]
    assert effect["status"] == "needs_human"
    assert shown["waiting"]["effect"] == effect["key_id"]
    listed = env.json("runs", "list", "--status", "waiting")
    assert [w["name"] for w in listed[0]["waiting_on"]] == [shown["waiting"]["name"]]
    return rid, str(effect["key_id"])


def test_resolving_happened_wakes_the_run_and_replays_the_effect(env: Env) -> None:
    rid, key = _park(env, "lose")
    assert len(env.sent()) == 1  # the provider has it; the answer was lost
    doc = env.json(
        "effects",
        "resolve",
        key,
        "--happened",
        "--evidence",
        "in the outbox",
        "--as",
        "ivy",
        "--result",
        '{"id": 1, "to": "ann@x"}',
    )
    assert doc["status"] == EffectStatus.COMMITTED.value
    assert env.store.get_run(rid).status is RunStatus.RUNNING  # woken
    assert env.drive(rid) is RunStatus.WAITING  # now on the ack
    assert len(env.sent()) == 1
    assert env.store.load(rid).state["receipt"] == {"id": 1, "to": "ann@x"}


def test_resolving_not_happened_wakes_the_run_and_sends_once(env: Env) -> None:
    rid, key = _park(env, "drop")
    assert env.sent() == []
    out = env.cli(
        "effects",
        "resolve",
        key,
        "--not-happened",
        "--evidence",
        "not in the outbox",
        "--actor",
        "ivy",
    )
    assert "resolved by ivy" in out.stdout
    assert env.drive(rid) is RunStatus.WAITING
    assert len(env.sent()) == 1


def test_a_resolution_whose_process_died_before_waking_the_run_is_run_again(env: Env) -> None:
    rid, key = _park(env, "lose")
    args = ("effects", "resolve", key, "--happened", "--evidence", "in the outbox", "--as", "ivy")
    # the first `effects resolve` recorded the decision, then died before waking the run
    env.runtime.ledger.resolve(key, happened=True, evidence="in the outbox", actor="ivy")
    assert env.store.get_run(rid).status is RunStatus.WAITING
    env.cli(*args)  # run again: no error, and the run wakes
    assert env.store.get_run(rid).status is RunStatus.RUNNING
    assert env.cli(*args[:4], "--evidence", "other", "--as", "ivy", ok=False).exit_code == 1


def test_resolving_happened_without_a_result_tells_the_step_and_a_correction_repairs_it(
    env: Env,
) -> None:
    # [7] item 19: it used to replay None, fail the step with a TypeError, and fail it
    # again on every retry; the result could not be corrected.
    rid, key = _park(env, "lose")
    out = env.cli("effects", "resolve", key, "--happened", "--evidence", "in the outbox")
    assert "the step will see: ResultUnknown" in out.stdout
    assert f"onceonly effects correct {key} --result" in out.stdout
    assert env.drive(rid) is RunStatus.FAILED  # a typed error, nothing sent again
    shown = env.json("runs", "show", rid)
    assert shown["error"]["type"] == "ResultUnknown"
    assert f"onceonly effects correct {key}" in shown["error"]["message"]
    doc = env.json(
        "effects",
        "correct",
        key,
        "--result",
        '{"id": 1, "to": "ann@x"}',
        "--evidence",
        "delivery 1 in the outbox",
        "--as",
        "ivy",
    )
    assert (doc["status"], doc["result_known"]) == ("committed", True)
    env.cli("runs", "retry", rid, "--as", "ivy")
    assert env.drive(rid) is RunStatus.WAITING  # on the ack
    assert env.store.load(rid).state["receipt"] == {"id": 1, "to": "ann@x"}
    assert len(env.sent()) == 1
    trail = env.json("effects", "show", key)["events"]
    assert [(e["event"], e["actor"]) for e in trail[-2:]] == [
        ("resolved", "ops"),
        ("corrected", "ivy"),
    ]
    assert env.json("audit", "verify")["ok"] is True


def test_only_an_operators_resolution_is_corrected(env: Env) -> None:
    rid = env.publish("r1")
    env.approve(rid)
    env.drive(rid)
    (effect,) = env.json("effects", "list")  # committed by the worker from the answer
    res = env.cli(
        "effects", "correct", effect["key_id"], "--result", "1", "--evidence", "e", ok=False
    )
    assert res.exit_code == 1
    assert isinstance(res.exception, InvalidTransition)
    res = env.cli(
        "effects",
        "correct",
        effect["key_id"],
        "--not-happened",
        "--result",
        "1",
        "--evidence",
        "e",
        ok=False,
    )
    assert res.exit_code == 2
    assert "--result goes with --happened" in res.output
    assert env.json("effects", "show", effect["key_id"])["events"][-1]["event"] == "committed"


def test_effects_show_lists_a_stale_workers_late_outcome(
    env: Env, ledgers: Ledgers, clock: Clock
) -> None:
    # [7] item 20: worker "paused" claims, sleeps past its lease (SIGSTOP), another worker
    # settles the entry, then the paused one reports its outcome: refused, and shown.
    ident = EffectIdentity("", "r9", "s#0", 0, "deliver@1", 0)
    paused = ledgers.on(env.store, owner="paused", clock=clock)
    stale = paused.claim(ident, {"to": "ann@x"}, provider_class="B")
    assert isinstance(stale, Claim)
    clock.advance(60)
    other = ledgers.on(env.store, owner="other", clock=clock)
    with pytest.raises(EffectInDoubt):
        other.claim(ident, {"to": "ann@x"}, provider_class="B")
    other.reconcile(stale.key_id, "not_happened")
    fresh = other.claim(ident, {"to": "ann@x"}, provider_class="B")
    assert isinstance(fresh, Claim)
    other.commit(fresh, {"id": 2})
    with pytest.raises(LeaseLost):
        paused.commit(stale, {"id": 1})
    (late,) = env.json("effects", "show", stale.key_id)["late"]
    assert (late["actor"], late["epoch"], late["status"]) == ("paused", 1, "committed")
    assert "refused committed from stale epoch 1" in late["detail"]
    out = env.cli("effects", "show", stale.key_id).stdout
    assert "late outcome from paused" in out
    assert env.json("audit", "verify")["ok"] is True


def test_the_worker_takes_its_claim_lease_from_the_command_line(env: Env) -> None:
    rid = env.runtime.start("lease", {}, run_id="lease-1")
    worker = ("worker", "--flows", "tests.operator_flows:FLOWS", "--until-idle", "--poll-s", "0.1")
    env.cli(*worker, "--claim-lease", "45")
    assert env.store.load(rid).state["result"] == {"claim_lease_s": 45.0}
    res = env.cli(*worker, "--claim-lease", "0", ok=False)
    assert res.exit_code == 2
    assert "--claim-lease" in res.output


# -- gc ---------------------------------------------------------------------------------------


def test_gc_removes_only_old_finished_runs(env: Env, tmp_path: Path) -> None:
    done = env.runtime.start("repair", {"broken": False}, run_id="done")
    assert env.drive(done) is RunStatus.COMPLETED
    waiting = env.publish("r1")
    cancelled = env.publish("r3")
    env.cli("runs", "cancel", cancelled, "--reason", "x")
    nothing = env.json("gc", "--older-than", "30d")
    assert nothing["runs_deleted"] == 0
    time.sleep(0.05)
    archive = tmp_path / "archive.jsonl"
    report = env.json("gc", "--older-than", "0s", "--archive", str(archive))
    assert (report["runs_deleted"], report["runs_archived"]) == (2, 2)
    assert report["waits_deleted"] == 1  # the cancelled run's approval request
    assert [r.run_id for r in env.store.list_runs()] == [waiting]
    archived = [json.loads(line)["run"]["run_id"] for line in archive.read_text().splitlines()]
    assert sorted(archived) == sorted([done, cancelled])
    assert env.json("runs", "show", waiting)["waits"][0]["status"] == "open"
    env.approve(waiting)  # a waiting run and its open approval are untouched
    assert env.drive(waiting) is RunStatus.WAITING


def _finished_and_forked(env: Env) -> None:
    """Run r1 to its end (one email sent), then fork it as f1 from its draft step."""
    rid = env.publish("r1")
    env.approve(rid)
    env.drive(rid)
    env.cli("signal", rid, "ack")
    assert env.drive(rid) is RunStatus.COMPLETED
    history = env.json("runs", "show", rid)["history"]
    (seq,) = [h["seq"] for h in history if h["step"] == "draft"]
    env.cli("runs", "fork", rid, "--seq", str(seq), "--reason", "again", "--new-id", "f1")


def test_gc_keeps_what_a_live_fork_replays_from(env: Env, ledgers: Ledgers) -> None:
    _finished_and_forked(env)
    assert env.json("audit", "verify")["ok"] is True  # a fork and its link verify clean
    time.sleep(0.05)
    # The origin is finished and old enough, but the live fork replays from its entries.
    assert env.json("gc", "--older-than", "0s")["runs_deleted"] == 0
    env.approve("f1")
    fresh = ledgers.fresh(owner="w2", clock=time.time)  # another worker: no caches
    worker = Runtime(fresh.store, fresh, FLOWS, owner="w2")
    worker.drive("f1")
    assert len(env.sent()) == 1
    env.cli("signal", "f1", "ack")
    assert worker.drive("f1").status is RunStatus.COMPLETED
    time.sleep(0.05)
    # Once both are finished and old, one gc pass removes the fork and then its origin.
    assert env.json("gc", "--older-than", "0s")["runs_deleted"] == 2
    assert env.json("gc", "--older-than", "0s")["runs_deleted"] == 0


@pytest.mark.parametrize("edit", ["deleted", "edited"])
def test_a_fork_whose_link_was_removed_acts_on_nothing(
    env: Env, ledgers: Ledgers, edit: str
) -> None:
    """A fork's link row is what keeps its origin, and the effects the fork replays, from
    gc. With the row deleted or edited, gc removes the origin and its ledger entries; the
    fork then sent the origin's email again. It now refuses to act: its sealed checkpoint
    names the run whose keys it shares, and the link must agree."""
    _finished_and_forked(env)
    engine = ledgers.fresh(owner="w0").store.engine
    sql = {
        "deleted": "DELETE FROM oo_run_links WHERE run_id = 'f1'",
        "edited": "UPDATE oo_run_links SET key_run = 'elsewhere' WHERE run_id = 'f1'",
    }[edit]
    assert execute(engine, sql) == 1
    # `onceonly audit verify` reports it: the fork's sealed checkpoint names its origin.
    found = env.cli("audit", "verify", "--json", ok=False)
    assert found.exit_code == 1
    (problem,) = json.loads(found.stdout)["problems"]
    assert problem.startswith("run 'f1': a fork of run 'r1'")
    assert "oo_run_links" in problem
    time.sleep(0.05)
    assert env.json("gc", "--older-than", "0s")["runs_deleted"] == 1  # the origin went
    env.approve("f1")
    fresh = ledgers.fresh(owner="w2", clock=time.time)
    worker = Runtime(fresh.store, fresh, FLOWS, owner="w2")
    with pytest.raises(CorruptRecord, match="link row to that run is") as exc:
        worker.drive("f1")
    assert exc.value.run_id == "f1"
    assert len(env.sent()) == 1  # the origin's email only


def test_a_runs_only_wait_deleted_is_found_by_verify(env: Env) -> None:
    """The run row seals its waits; verify checked that only for runs that still had a
    wait, so deleting a run's only wait verified clean. Acting on it was, and is,
    refused: the approval cannot be found and nothing is sent."""
    rid = env.publish("r2")
    assert execute(env.store.engine, "DELETE FROM oo_waits WHERE run_id = :r", r=rid) == 1
    found = env.cli("audit", "verify", "--json", ok=False)
    assert found.exit_code == 1
    (problem,) = json.loads(found.stdout)["problems"]
    assert problem.startswith(f"run {rid!r}: its waits are not the ones its run row was sealed")
    with pytest.raises(WaitNotFound):
        env.drive(rid)
    assert env.sent() == []


def test_gc_human_output(env: Env) -> None:
    out = env.cli("gc", "--older-than", "1h30m").stdout
    assert "removed 0 run(s)" in out
    assert "older than 1h30m" in out


# -- values of types the CLI does not know -----------------------------------------------------
#
# The CLI has no registry of the user's dataclasses: it decodes them to placeholders and must
# write them back exactly, whatever it saves (a fork's first checkpoint, a keyframe written
# by an edit, a cancel or a retry), so that the worker, which knows the types, gets them back.


@dataclass(frozen=True)
class Line:
    sku: str
    qty: int
    price: Decimal


@dataclass(frozen=True)
class Invoice:
    number: str
    to: str
    lines: tuple[Line, ...]
    due: dt.date
    tags: frozenset[str]

    def total(self) -> Decimal:
        return sum((line.price * line.qty for line in self.lines), Decimal(0))


INVOICE = Invoice(
    "2041",
    "ann@x",
    (Line("a", 2, Decimal("12.50")), Line("b", 1, Decimal("0.10"))),
    dt.date(2031, 1, 31),
    frozenset({"eu", "net-30"}),
)
BILLING = Flow("billing")


@BILLING.step(start=True)
def prepare(ctx: StepContext) -> Transition:
    if ctx.state.get("broken"):
        return ctx.fail("the invoice is not ready")
    invoice: Invoice = ctx.state["invoice"]  # a dict here would fail the next line
    ctx.state["total"] = invoice.total()
    return ctx.wait_for_approval("bill", {"invoice": invoice}, then="bill")


@BILLING.step
def bill(ctx: StepContext) -> Transition:
    invoice: Invoice = ctx.state["invoice"]
    ctx.approved("bill", {"invoice": invoice})  # exactly what was approved, hash and all
    text = f"invoice {invoice.number}: {invoice.total()} due {invoice.due.isoformat()}"
    deliver = guard(ctx.ledger, effect="deliver@1")(_deliver)
    ctx.state["receipt"] = deliver(str(ctx.state["outbox"]), invoice.to, text)
    return ctx.end({"invoice": invoice, "receipt": ctx.state["receipt"]})


def _deliver(outbox: str, to: str, text: str) -> dict[str, Any]:
    with open(outbox, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"to": to, "text": text}) + "\n")
    return {"to": to}


@pytest.fixture
def billing(env: Env) -> Env:
    """``env`` whose worker runs the billing flow with a codec that knows its types."""
    env.store.codec.register(Line, name="tests.line.v1")
    env.store.codec.register(Invoice, name="tests.invoice.v1")
    env.runtime = Runtime(env.store, env.runtime.ledger, [BILLING], owner="w1")
    return env


def _start_billing(env: Env, run_id: str, **state: Any) -> str:
    rid = env.runtime.start(
        "billing", {"invoice": INVOICE, "outbox": str(env.outbox), **state}, run_id=run_id
    )
    env.drive(rid)
    return rid


def _approve_bill(env: Env, run_id: str) -> None:
    env.cli("approve", run_id, "bill", "--hash", env.hash_of(run_id, "bill"), "--as", "bob")


def _keyframe_next(env: Env, run_id: str) -> None:
    """An edit large enough that the CLI's next checkpoint of the run is a keyframe (the
    whole state, every value re-encoded by the CLI's codec)."""
    note = json.dumps(os.urandom(1900).hex())  # inline (under a blob's size), incompressible
    env.cli("runs", "edit", run_id, "note", "--value", note, "--reason", "r")


def _written_by_the_cli(env: Env, run_id: str) -> list[str]:
    history = env.json("runs", "show", run_id)["history"]
    return [h["step"] for h in history if h["keyframe"] and h["source"] == "operator"]


def test_a_fork_through_the_cli_keeps_dataclasses_it_cannot_decode(billing: Env) -> None:
    env = billing
    rid = _start_billing(env, "b1")
    shown = env.json("runs", "show", rid)
    placeholder = {
        "$unknown": "tests.invoice.v1",
        "value": {
            "due": {"\u0000d": "2031-01-31"},
            "lines": {
                "\u0000t": [
                    {
                        "$unknown": "tests.line.v1",
                        "value": {"price": {"\u0000n": "12.50"}, "qty": 2, "sku": "a"},
                    },
                    {
                        "$unknown": "tests.line.v1",
                        "value": {"price": {"\u0000n": "0.10"}, "qty": 1, "sku": "b"},
                    },
                ]
            },
            "number": "2041",
            "tags": {"\u0000F": ["eu", "net-30"]},
            "to": "ann@x",
        },
    }
    assert shown["state"]["invoice"] == placeholder  # shown readably, not refused
    assert shown["waits"][0]["subject"] == {"invoice": placeholder}
    _approve_bill(env, rid)
    assert env.drive(rid) is RunStatus.COMPLETED
    assert len(env.sent()) == 1
    (seq,) = [h["seq"] for h in shown["history"] if h["step"] == "prepare"]

    env.cli("runs", "fork", rid, "--seq", str(seq), "--reason", "again", "--new-id", "b1-fork")
    assert _written_by_the_cli(env, "b1-fork") == ["operator:fork"]
    assert env.store.load("b1-fork").state["invoice"] == INVOICE  # the worker's codec
    assert env.hash_of("b1-fork", "bill") == env.hash_of(rid, "bill")  # the same subject
    _approve_bill(env, "b1-fork")
    assert env.drive("b1-fork") is RunStatus.COMPLETED
    result = env.store.load("b1-fork").state["result"]
    assert result["invoice"] == INVOICE
    assert type(result["invoice"].lines[0]) is Line
    assert len(env.sent()) == 1  # the origin's delivery replayed


def test_edit_and_retry_through_the_cli_keep_dataclasses_it_cannot_decode(billing: Env) -> None:
    env = billing
    rid = _start_billing(env, "b2", broken=True)
    assert env.store.get_run(rid).status is RunStatus.FAILED
    _keyframe_next(env, rid)
    env.cli("runs", "edit", rid, "broken", "--value", "false", "--reason", "fixed", "--as", "erin")
    env.cli("runs", "retry", rid, "--as", "erin")
    assert _written_by_the_cli(env, rid) == ["operator:edit"]
    assert env.store.load(rid).state["invoice"] == INVOICE
    assert env.drive(rid) is RunStatus.WAITING
    _approve_bill(env, rid)
    assert env.drive(rid) is RunStatus.COMPLETED
    assert env.store.load(rid).state["result"]["invoice"] == INVOICE
    assert [d["text"] for d in env.sent()] == ["invoice 2041: 25.10 due 2031-01-31"]


def test_cancel_through_the_cli_keeps_dataclasses_it_cannot_decode(billing: Env) -> None:
    env = billing
    rid = _start_billing(env, "b3")
    _keyframe_next(env, rid)
    env.cli("runs", "cancel", rid, "--reason", "customer left")
    assert _written_by_the_cli(env, rid) == ["operator:cancel"]
    state = env.store.load(rid).state
    assert (state["invoice"], state["total"]) == (INVOICE, Decimal("25.10"))
    assert env.store.get_run(rid).status is RunStatus.CANCELLED
    assert env.sent() == []


def test_the_cli_refuses_to_store_the_lossy_placeholder_as_data(billing: Env) -> None:
    env = billing
    rid = _start_billing(env, "b4")
    shown = env.json("runs", "show", rid)["state"]["invoice"]  # copied from the display
    res = env.cli(
        "runs", "edit", rid, "invoice", "--value", json.dumps(shown), "--reason", "r", ok=False
    )
    assert isinstance(res.exception, CodecError)
    assert env.store.load(rid).state["invoice"] == INVOICE
    assert env.json("runs", "show", rid)["operator_log"] == []


# -- reading ----------------------------------------------------------------------------------


def test_runs_list_shows_what_runs_wait_on_and_who_holds_them(env: Env) -> None:
    rid = env.publish("r1")
    other = env.runtime.start("repair", {"broken": False}, run_id="held")
    env.store.acquire_lease(other, "worker-9", 60)
    listed = {r["run_id"]: r for r in env.json("runs", "list")}
    assert listed[rid]["waiting_on"] == [{"name": "send", "kind": "approval", "due_at": None}]
    assert listed[other]["lease_owner"] == "worker-9"
    assert listed[other]["lease_expires_at"] > time.time()
    assert [r["run_id"] for r in env.json("runs", "list", "--flow", "repair")] == [other]
    assert [r["run_id"] for r in env.json("runs", "list", "--status", "waiting")] == [rid]
    table = env.cli("runs", "list").stdout
    assert "approval send" in table
    assert "worker-9" in table


def test_runs_show_tables_show_the_approval_to_give(env: Env) -> None:
    rid = env.publish("r1")
    out = env.cli("runs", "show", rid, "--tables").stdout
    digest = env.hash_of(rid)
    assert f"onceonly approve {rid} send --hash {digest}" in out  # one line, to copy
    for text in ("send a greeting to ann@x", "approval", "Hello ann@x", "history", "alice"):
        assert text in out
    env.approve(rid)
    env.drive(rid)
    out = env.cli("runs", "show", rid, "--tables").stdout
    assert "deliver@1" in out
    assert "approved by bob" in out


def test_every_read_command_has_json(env: Env, tmp_path: Path) -> None:
    rid = env.publish("r1")
    env.approve(rid)
    env.drive(rid)
    assert env.json("runs", "list")[0]["run_id"] == rid
    assert env.json("runs", "show", rid)["effects"][0]["effect"] == "deliver@1"
    (effect,) = env.json("effects", "list")
    assert env.json("effects", "show", effect["key_id"])["effect"]["key_id"] == effect["key_id"]
    assert env.json("audit", "verify")["ok"] is True
    exported = env.json("audit", "export", "--out", str(tmp_path / "audit.jsonl"))
    assert exported["exported"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["signal", "r1", "ack", "--payload", "{nope"], "is not JSON", id="payload"),
        pytest.param(
            ["runs", "edit", "r1", "to", "--value", "x", "--reason", "r"], "is not JSON", id="value"
        ),
        pytest.param(["approve", "r1", "send", "--hash", "abc"], "not a subject hash", id="hash"),
        pytest.param(["gc", "--older-than", "30"], "not a duration", id="bare-number"),
        pytest.param(["gc", "--older-than", "30x"], "not a duration", id="unit"),
        pytest.param(
            ["runs", "fork", "r1", "--seq", "x", "--reason", "r"], "'x' is not a valid", id="seq"
        ),
        pytest.param(["runs", "list", "--status", "asleep"], "'asleep' is not one of", id="status"),
        pytest.param(
            ["effects", "resolve", "k", "--evidence", "e"], "--happened or", id="resolve-which"
        ),
        pytest.param(
            ["effects", "resolve", "k", "--not-happened", "--evidence", "e", "--result", "1"],
            "--result goes with --happened",
            id="resolve-result",
        ),
    ],
)
def test_malformed_arguments_are_usage_errors(env: Env, args: list[str], message: str) -> None:
    env.publish("r1")
    res = env.cli(*args, ok=False)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert env.json("runs", "show", "r1")["operator_log"] == []


def test_an_empty_identity_is_refused(env: Env) -> None:
    rid = env.publish("r1")
    res = env.cli("runs", "cancel", rid, "--as", " ", ok=False)
    assert isinstance(res.exception, ConfigurationError)
    assert env.store.get_run(rid).status is RunStatus.WAITING


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30d", 30 * 86400.0),
        ("12h", 43200.0),
        ("90m", 5400.0),
        ("45s", 45.0),
        ("1h30m", 5400.0),
        ("2w", 1209600.0),
        ("0s", 0.0),
        ("1.5h", 5400.0),
        (" 10M ", 600.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "d", "30 d", "-1d", "1y", "1h 30m", "h1"])
def test_malformed_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 45, 5400, 90061, 30 * 86400)] == [
        "0s",
        "45s",
        "1h30m",
        "1d1h",
        "30d",
    ]


# -- through the installed console script and a worker ----------------------------------------


def _script(url: str, *args: str, user: str = "ops") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(
        ONCEONLY_DATABASE_URL=url,
        ONCEONLY_SECRETS=SECRETS,
        USER=user,
        PYTHONPATH=str(ROOT),
        ONCEONLY_WORKER_NAME="cli-test",
    )
    return subprocess.run(
        [str(ONCEONLY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=env,
    )


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error:")
    for n in needles:
        assert n in line


@pytest.mark.slow
def test_the_console_script_drives_a_run_with_a_worker(env: Env) -> None:
    rid = env.publish("r1")
    env.store.close()  # from here on, only other processes touch the database
    worker = ("worker", "--flows", "tests.operator_flows:FLOWS", "--until-idle", "--poll-s", "0.1")
    shown = json.loads(_ok(_script(env.url, "runs", "show", rid, "--json")))
    digest = shown["waits"][0]["subject_hash"]

    _one_line_error(
        _script(env.url, "approve", rid, "send", "--hash", OTHER_HASH, "--as", "bob"),
        "is not the hash of what was requested",
    )
    _one_line_error(
        _script(env.url, "approve", rid, "send", "--hash", digest, user="alice"),
        "may not approve",
        "alice",
    )

    _ok(_script(env.url, "approve", rid, "send", "--hash", digest, user="bob"))
    _ok(_script(env.url, *worker))
    assert len(env.sent()) == 1
    _ok(_script(env.url, "signal", rid, "ack", "--payload", '{"ok": 1}'))
    _ok(_script(env.url, *worker))
    shown = json.loads(_ok(_script(env.url, "runs", "show", rid, "--json")))
    assert shown["status"] == "completed"
    assert shown["state"]["result"]["ack"] == {"ok": 1}
    assert [(w["name"], w["decided_by"]) for w in shown["waits"]] == [
        ("send", "bob"),
        ("ack", "ops"),
    ]
    assert len(env.sent()) == 1


@pytest.mark.slow
def test_the_console_script_resolves_a_parked_run(env: Env) -> None:
    rid, key = _park(env, "lose")
    env.store.close()
    worker = ("worker", "--flows", "tests.operator_flows:FLOWS", "--until-idle", "--poll-s", "0.1")
    assert len(env.sent()) == 1
    _one_line_error(
        _script(env.url, "effects", "resolve", key, "--happened", "--evidence", " "),
        "evidence",
    )
    _ok(
        _script(
            env.url,
            "effects",
            "resolve",
            key,
            "--happened",
            "--evidence",
            "seen in the outbox",
            "--result",
            '{"id": 1, "to": "ann@x"}',
            user="ivy",
        )
    )
    _ok(_script(env.url, *worker))
    shown = json.loads(_ok(_script(env.url, "runs", "show", rid, "--json")))
    assert (shown["status"], shown["waiting"]["name"]) == ("waiting", "ack")
    assert shown["state"]["receipt"] == {"id": 1, "to": "ann@x"}
    assert len(env.sent()) == 1


# -- messages, key-id prefixes, the worker's log ----------------------------------------------


def test_approving_or_rejecting_a_missing_run_says_the_run_is_missing(env: Env) -> None:
    env.publish("r1")
    for args in (
        ("approve", "no-such-run", "send", "--hash", OTHER_HASH, "--as", "bob"),
        ("reject", "no-such-run", "send", "--reason", "no", "--as", "bob"),
    ):
        res = env.cli(*args, ok=False)
        assert isinstance(res.exception, RunNotFound), res.exception
        assert "no-such-run" in str(res.exception)


def test_the_start_of_a_key_id_the_list_shows_is_accepted(env: Env) -> None:
    rid, key = _park(env, "lose")
    listed = env.cli("effects", "list")  # piped: the plain layout
    (line,) = [ln for ln in listed.stdout.splitlines() if rid in ln]
    short = line.split()[0]
    assert len(short) < len(key)
    assert key.startswith(short)
    assert env.json("effects", "show", short)["effect"]["key_id"] == key
    doc = env.json(
        "effects", "resolve", short, "--happened", "--evidence", "in the outbox", "--as", "ivy"
    )
    assert doc["key_id"] == key
    assert env.store.get_run(rid).status is RunStatus.RUNNING  # woken, as with the whole id


def _worker_log(result: Result) -> list[dict[str, Any]]:
    return [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]


WORKER = ("worker", "--until-idle", "--poll-s", "0.1", "--log-format", "json")


def test_the_worker_logs_a_parked_run_with_the_command_that_settles_it(env: Env) -> None:
    rid = env.runtime.start(
        "publish", {"to": "ann@x", "outbox": str(env.outbox)}, run_id="r1", started_by="alice"
    )
    res = env.cli(*WORKER, "--flows", "tests.operator_flows:FLOWS")
    parked = [e for e in _worker_log(res) if e.get("event") == "run_parked"]
    assert [(e["level"], e["run_id"]) for e in parked] == [("warning", rid)]
    command = parked[0]["command"]
    assert command == f"onceonly approve {rid} send --hash {env.hash_of(rid)}"
    env.cli(*shlex.split(command)[1:], "--as", "bob")  # the command, as logged, works
    assert env.store.get_run(rid).status is RunStatus.RUNNING


def test_the_worker_logs_an_effect_in_doubt_with_the_resolve_command(env: Env) -> None:
    rid = env.publish("r1")
    Path(f"{env.outbox}.lose").touch()
    env.approve(rid)
    res = env.cli(*WORKER, "--flows", "tests.operator_flows:FLOWS")
    (parked,) = [e for e in _worker_log(res) if e.get("event") == "run_parked"]
    key = env.json("runs", "show", rid)["waiting"]["effect"]
    assert parked["command"].startswith(f"onceonly effects resolve {key} --happened")


def test_worker_log_level_and_json_lines(env: Env) -> None:
    env.runtime.start("lease", {}, run_id="lease-1")
    res = env.cli(*WORKER, "--flows", "tests.operator_flows:FLOWS", "--log-level", "warning")
    assert _worker_log(res) == []  # the info lines are below the level
    env.runtime.start("lease", {}, run_id="lease-2")
    res = env.cli(*WORKER, "--flows", "tests.operator_flows:FLOWS")
    events = _worker_log(res)
    assert {"ts", "level", "logger", "message"} <= set(events[0])
    driven = [e for e in events if e.get("event") == "run_driven"]
    assert [(e["run_id"], e["status"]) for e in driven] == [("lease-2", "completed")]


def test_a_worker_with_other_flows_leaves_runs_unleased(env: Env) -> None:
    rid = env.runtime.start("lease", {}, run_id="lease-1")
    res = env.cli(*WORKER, "--flows", "tests.worker_flows:FLOWS")
    assert "0 run(s) driven" in res.stdout
    run = env.store.get_run(rid)
    assert (run.status, run.lease_owner) == (RunStatus.RUNNING, None)  # free for the right one
    env.cli(*WORKER, "--flows", "tests.operator_flows:FLOWS")
    assert env.store.get_run(rid).status is RunStatus.COMPLETED


def test_a_step_resumed_under_another_secret_says_so(store: Store, ledgers: Ledgers) -> None:
    sent: list[str] = []

    def note_on(ledger: Ledger) -> Any:
        @guard(ledger, effect="note@1")
        def note(to: str) -> dict[str, str]:
            sent.append(to)
            return {"to": to}

        return note

    first = ledgers.on(store, owner="w1")
    with step("run-1", "notify"):
        note_on(first)("a@x")
    recorded = [e["key_id"] for e in first.audit_events("run-1") if e["event"] == "claimed"]
    # The same code, resumed by a worker started with another secret.
    other = ledgers.fresh(owner="w2", keyring=Keyring([K2]))
    with pytest.raises(StepDiverged) as caught, step("run-1", "notify", recorded=recorded):
        note_on(other)("a@x")
    assert sent == ["a@x"]  # nothing sent again
    message = str(caught.value)
    assert "keyring differs from the one the run was started with" in message
    assert "ONCEONLY_SECRETS" in message
