"""``onceonly runs ...``, ``approve``, ``reject`` and ``signal``: look at runs and act on
them. Every action goes through :class:`onceonly.operator.Operator` and is recorded with
the operator's identity."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import click

from ._common import (
    HASH,
    JSON,
    actor_option,
    ago,
    emit_json,
    identity,
    is_terminal,
    json_option,
    make_console,
    open_ledger,
    open_store,
    operator,
    plain,
    print_table,
    record_json,
    url_option,
)

if TYPE_CHECKING:
    from onceonly.checkpoint import Codec, Store, Wait
    from onceonly.operator import Operator, RunView

# RunStatus's values, spelled out so that `--help` does not import the store (a test
# keeps them equal).
RUN_STATUSES = ("running", "waiting", "completed", "failed", "cancelled")

__all__ = ["approve_cmd", "reject_cmd", "runs", "signal_cmd"]


# -- reading ---------------------------------------------------------------------------------


def _waiting_on(wait: Wait, now: float) -> str:
    from onceonly.checkpoint import WaitKind  # noqa: PLC0415

    text = f"{wait.kind.value} {wait.name}"
    if wait.due_at is not None:
        verb = "due" if wait.kind is WaitKind.TIMER else "expires"
        text += f" ({verb} {ago(wait.due_at, now)})"
    return text


def _wait_json(codec: Codec, w: Wait) -> dict[str, Any]:
    from onceonly.checkpoint import WaitKind  # noqa: PLC0415

    return {
        "name": w.name,
        "kind": w.kind.value,
        "status": w.status.value,
        "due_at": w.due_at,
        "subject": plain(codec, w.subject) if w.kind is WaitKind.APPROVAL else None,
        "subject_hash": w.subject_hash,
        "requested_by": w.requested_by,
        "allow_self": w.allow_self,
        "payload": plain(codec, w.payload),
        "decided_by": w.decided_by,
        "decided_at": w.decided_at,
        "reason": w.reason,
        "created_at": w.created_at,
    }


@click.group("runs")
def runs() -> None:
    """Inspect runs and act on them (edit, cancel, retry, fork)."""


@runs.command("list")
@url_option
@click.option(
    "--status",
    type=click.Choice(RUN_STATUSES),
    default=None,
    help="Only runs with this status.",
)
@click.option("--flow", default=None, help="Only runs of this flow.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many.")
@click.option(
    "--unserved",
    is_flag=True,
    help="Only running or waiting runs on a flow version no live worker serves.",
)
@json_option
def runs_list(
    url: str | None,
    status: str | None,
    flow: str | None,
    limit: int | None,
    unserved: bool,
    as_json: bool,
) -> None:
    """List runs, most recently updated first, with what each waits on and who holds it.

    With --unserved, the runs that wait for a worker nobody runs: running or waiting on
    a version of their flow that no live worker serves (workers announce the versions
    they serve; see `onceonly workers`), oldest first, with their version. Exits 1 if
    there is one.

    On a terminal, a table; piped, the same columns in a plain layout (one line a run).
    """
    from onceonly.checkpoint import Waits  # noqa: PLC0415

    with open_store(url) as store:
        if unserved:
            from onceonly.registry import WorkerRegistry  # noqa: PLC0415
            from onceonly.registry import unserved as unserved_runs  # noqa: PLC0415

            rows = [
                r
                for r in unserved_runs(store, WorkerRegistry(store, create=False))
                if (status is None or r.status.value == status) and flow in (None, r.flow)
            ][:limit]
        else:
            rows = store.list_runs(status=status, flow=flow, limit=limit)
        open_waits: dict[str, list[Wait]] = defaultdict(list)
        for w in Waits(store).find(status="open"):
            open_waits[w.run_id].append(w)
    now = time.time()
    if as_json:
        emit_json(
            [
                {
                    "run_id": r.run_id,
                    "flow": r.flow,
                    "status": r.status.value,
                    "next_step": r.next_step,
                    "head_seq": r.head_seq,
                    "updated_at": r.updated_at,
                    "waiting_on": [
                        {"name": w.name, "kind": w.kind.value, "due_at": w.due_at}
                        for w in open_waits.get(r.run_id, [])
                    ],
                    "lease_owner": r.lease_owner,
                    "lease_expires_at": r.lease_expires_at,
                    "code_version": r.code_version,
                }
                for r in rows
            ]
        )
        if unserved and rows:
            raise SystemExit(1)
        return
    table: list[list[str]] = []
    for r in rows:
        n = "0" if r.head_seq is None else str(r.head_seq + 1)
        waits = "\n".join(_waiting_on(w, now) for w in open_waits.get(r.run_id, [])) or "-"
        lease = "-"
        if r.lease_owner:
            lapsed = r.lease_expires_at is not None and r.lease_expires_at < now
            lease = f"{r.lease_owner} ({'lapsed' if lapsed else 'until'} {ago(r.lease_expires_at)})"
        table.append(
            [
                r.run_id,
                r.flow,
                *([r.code_version] if unserved else []),
                r.status.value,
                r.next_step or "-",
                waits,
                lease,
                n,
                ago(r.updated_at, now),
            ]
        )
    print_table(
        "runs on versions no live worker serves" if unserved else "runs",
        (
            "run id",
            "flow",
            *(["version"] if unserved else []),
            "status",
            "next step",
            "waiting on",
            "lease",
            "ckpts",
            "updated",
        ),
        table,
        fold=("flow", "version", "next step", "waiting on", "lease"),
        right=("ckpts",),
    )
    if unserved and rows:
        raise SystemExit(1)


def _view(store: Store, run_id: str) -> RunView:
    from onceonly.checkpoint import SchemaVersionError, Waits  # noqa: PLC0415
    from onceonly.operator import Operator, RunView  # noqa: PLC0415
    from onceonly.runtime import META  # noqa: PLC0415

    try:
        ledger = open_ledger(store, required=False, create=False)
    except SchemaVersionError as exc:
        if exc.component != "ledger" or exc.found != 0:
            raise
        # A database only the checkpoint core uses (no ledger): a run without effects.
        run = store.get_run(run_id)
        state = store.load(run_id).state if run.head_seq is not None else {}
        meta = dict(state.pop(META, None) or {})
        waits = Waits(store).find(run_id=run_id)
        return RunView(run, state, meta, store.history(run_id), waits, [])
    try:
        return Operator(store, ledger).show(run_id)
    finally:
        ledger.close()


def _show_doc(store: Store, v: RunView) -> dict[str, Any]:
    codec = store.codec
    r = v.run
    return {
        "run_id": r.run_id,
        "flow": r.flow,
        "code_version": r.code_version,
        "state_version": r.state_version,
        "status": r.status.value,
        "next_step": r.next_step,
        "lease": {"owner": r.lease_owner, "expires_at": r.lease_expires_at},
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "started_by": v.meta.get("started_by"),
        "handoff": {
            "goal": r.handoff.goal,
            "done": list(r.handoff.done),
            "next": list(r.handoff.next),
            "ruled_out": list(r.handoff.ruled_out),
        },
        "history": [
            {
                "seq": i.seq,
                "step": i.step,
                "source": i.source.value,
                "keyframe": i.keyframe,
                "created_at": i.created_at,
            }
            for i in v.history
        ],
        "state": None if r.head_seq is None else plain(codec, v.state),
        "waiting": plain(codec, v.meta.get("waiting")),
        "waits": [_wait_json(codec, w) for w in v.waits],
        "effects": [record_json(e) for e in v.effects],
        "operator_log": plain(codec, v.meta.get("operator_log") or []),
        "error": plain(codec, v.meta.get("error")),
        "retry": plain(codec, v.meta.get("retry")),
        "last_error": plain(codec, v.meta.get("last_error")),
        "deadline": plain(codec, v.meta.get("deadline")),
        "durability": v.meta.get("durability"),
        "forked_from": plain(codec, v.meta.get("forked_from")),
        "restarted_from": plain(codec, v.meta.get("restarted_from")),
        "restarted_as": plain(codec, v.meta.get("restarted_as") or []),
        "key_run": v.meta.get("key_run"),
    }


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _print_view(doc: dict[str, Any]) -> None:
    from rich.panel import Panel  # noqa: PLC0415
    from rich.syntax import Syntax  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    # Every cell and title is the user's text, never markup.
    con = make_console(soft_wrap=False)
    now = time.time()
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("flow", f"{doc['flow']} (code {doc['code_version']})")
    head.add_row("status", doc["status"])
    head.add_row("next step", doc["next_step"] or "-")
    if doc["durability"]:  # chosen for the run (else: the mode of the worker's store)
        head.add_row("durability", doc["durability"])
    lease = doc["lease"]
    if lease["owner"]:
        head.add_row("lease", f"{lease['owner']} (until {ago(lease['expires_at'], now)})")
    if doc["started_by"]:
        head.add_row("started by", str(doc["started_by"]))
    if doc["forked_from"]:
        f = doc["forked_from"]
        head.add_row("forked from", f"{f['run']} at checkpoint {f['seq']} by {f['by']}")
    if doc["restarted_from"]:
        f = doc["restarted_from"]
        head.add_row("restarted from", f"{f['run']} by {f['by']}: {f['reason']}")
    if doc["restarted_as"]:
        head.add_row("restarted as", ", ".join(doc["restarted_as"]))
    if doc["deadline"]:
        d = doc["deadline"]
        then = f"then {d['then']}" if d.get("then") else "then the run fails"
        if d.get("passed"):
            head.add_row("deadline", Text(f"passed {ago(d['at'], now)}", "yellow"))
        else:
            head.add_row("deadline", f"{ago(d['at'], now)}, {then}")
    if doc["error"]:
        e = doc["error"]
        after = f" (attempt {e['attempt']})" if e.get("attempt") else ""
        head.add_row(
            "error",
            Text(f"{e.get('type')} in {e.get('step')}{after}: {e.get('message')}", "red"),
        )
    if doc["retry"]:
        r, e = doc["retry"], doc["last_error"] or {}
        head.add_row(
            "retrying",
            Text(
                f"{r['step']}: attempt {r['failed'] + 1} of {r['attempts']} "
                f"{ago(r['due_at'], now)}, after {e.get('type')}: {e.get('message')}",
                "yellow",
            ),
        )
    h = doc["handoff"]
    for label, value in (
        ("goal", h["goal"]),
        ("done", "; ".join(h["done"])),
        ("next", "; ".join(h["next"])),
        ("ruled out", "; ".join(h["ruled_out"])),
    ):
        if value:
            head.add_row(label, value)
    con.print(Panel(head, title=Text(f"run {doc['run_id']}"), expand=False))
    for label, e in (("error", doc["error"]), ("last error", doc["last_error"])):
        if e and e.get("traceback"):
            con.print(Panel(Text(str(e["traceback"]).rstrip()), title=Text(label), expand=False))

    if doc["waits"]:
        waits = Table(title="waits")
        for col in ("name", "kind", "status", "details"):
            waits.add_column(col, overflow="fold")
        for w in doc["waits"]:
            details: list[str] = []
            if w["kind"] == "approval":
                details.append(f"subject_hash {w['subject_hash']}")
                details.append(f"requested by {w['requested_by'] or '-'}")
                if w["due_at"] is not None:
                    details.append(f"expires {ago(w['due_at'], now)}")
            elif w["kind"] == "timer":
                details.append(f"due {ago(w['due_at'], now)}")
            if w["status"] == "delivered":
                details.append(f"payload {json.dumps(w['payload'])}")
            if w["decided_by"]:
                by = f"{w['status']} by {w['decided_by']} at {_when(w['decided_at'])}"
                details.append(by + (f": {w['reason']}" if w["reason"] else ""))
            waits.add_row(w["name"], w["kind"], w["status"], "\n".join(details))
        con.print(waits)
        for w in doc["waits"]:
            if w["kind"] == "approval" and w["status"] == "open":
                body = Syntax(json.dumps(w["subject"], indent=2, ensure_ascii=False), "json")
                con.print(Panel(body, title=Text(f"to approve: {w['name']}"), expand=False))
                how = approve_command(doc["run_id"], w["name"], w["subject_hash"])
                con.print(Text(how, "bold"), soft_wrap=True)  # one line, to copy

    if doc["effects"]:
        effects = Table(title="effects")
        effects.add_column("key id", overflow="fold")
        for col in ("effect", "step", "status", "epoch", "attempts", "updated"):
            effects.add_column(col)
        for e in doc["effects"]:
            effects.add_row(
                e["key_id"],
                e["effect"],
                e["step_id"] or "-",
                e["status"],
                str(e["epoch"]),
                str(e["attempts"]),
                ago(e["updated_at"], now),
            )
        con.print(effects)

    history = Table(title="history")
    for col in ("seq", "step", "source", "at"):
        history.add_column(col)
    for i in doc["history"]:
        history.add_row(str(i["seq"]), i["step"], i["source"], _when(i["created_at"]))
    con.print(history)

    if doc["operator_log"]:
        log = Table(title="operator log")
        for col in ("at", "by", "action", "channel", "reason"):
            log.add_column(col, overflow="fold")
        for entry in doc["operator_log"]:
            log.add_row(
                _when(entry.get("at")),
                str(entry.get("by")),
                str(entry.get("action")),
                str(entry.get("channel") or "-"),
                str(entry.get("reason") or ""),
            )
        con.print(log)

    if doc["state"] is not None:
        state = json.dumps(doc["state"], indent=2, ensure_ascii=False)
        con.print(Panel(Syntax(state, "json"), title=Text("state"), expand=False))


@runs.command("show")
@click.argument("run_id")
@url_option
@json_option
@click.option(
    "--tables", is_flag=True, help="Tables even when stdout is not a terminal (default there)."
)
def runs_show(run_id: str, url: str | None, as_json: bool, tables: bool) -> None:
    """Show a run: status, handoff note, waits (approvals with their subject and hash),
    effects, history, operator log, error and latest state.

    On a terminal it prints tables; piped, the same document as ``--json`` (indented).
    """
    from onceonly.checkpoint import Codec  # noqa: PLC0415

    with open_store(url, codec=Codec(strict=False)) as store:
        doc = _show_doc(store, _view(store, run_id))
    if as_json:
        emit_json(doc)
    elif tables or is_terminal():
        _print_view(doc)
    else:
        click.echo(json.dumps(doc, indent=2, ensure_ascii=False, default=str))


@runs.command("notes")
@click.argument("run_id")
@url_option
@json_option
def runs_notes(run_id: str, url: str | None, as_json: bool) -> None:
    """How the run's handoff note changed, checkpoint by checkpoint: its goal, what was
    done, what comes next and what was ruled out, as each step left it."""
    from onceonly.operator import note_history  # noqa: PLC0415

    with open_store(url) as store:
        changes = note_history(store, run_id)
    if as_json:
        emit_json(
            [
                {
                    "seq": c.seq,
                    "step": c.step,
                    "at": c.at,
                    "goal": c.handoff.goal,
                    "done": list(c.handoff.done),
                    "next": list(c.handoff.next),
                    "ruled_out": list(c.handoff.ruled_out),
                }
                for c in changes
            ]
        )
        return
    print_table(
        f"handoff notes of {run_id}",
        ("ckpt", "step", "at", "goal", "done", "next", "ruled out"),
        [
            [
                str(c.seq),
                c.step,
                _when(c.at),
                c.handoff.goal or "-",
                "; ".join(c.handoff.done) or "-",
                "; ".join(c.handoff.next) or "-",
                "; ".join(c.handoff.ruled_out) or "-",
            ]
            for c in changes
        ],
        fold=("goal", "done", "next", "ruled out"),
        right=("ckpt",),
    )


@runs.command("check")
@click.option("--flows", "flows_spec", required=True, help="module:attribute of the new code.")
@url_option
@json_option
def runs_check(flows_spec: str, url: str | None, as_json: bool) -> None:
    """Before a deploy: list the runs the --flows code would strand.

    A run that is not over names the steps it goes to next: its next step, the step
    after the wait it is in and that wait's rejection and expiry paths, its deadline's
    path. A run naming a step the code lacks (renamed or removed) could not go on past
    it. Exits 1 if a running or waiting run would be stranded (keep the step, or fork
    those runs onto one the code has, first); failed runs are listed (a retry would
    strand them) but do not fail the check. Runs on versions the code does not serve
    are listed apart: they stay on their version (workers of it drive them) until
    `onceonly runs upgrade` moves them.
    """
    from onceonly.deploy import stranded  # noqa: PLC0415

    from . import load_flows  # noqa: PLC0415

    flows = load_flows(flows_spec)
    with open_store(url) as store:
        found = stranded(store, flows)
    if as_json:
        emit_json(
            [
                {
                    "run_id": s.run_id,
                    "flow": s.flow,
                    "status": s.status.value,
                    "step": s.step,
                    "where": s.where,
                    "code_version": s.code_version,
                    "served": s.served,
                }
                for s in found
            ]
        )
    else:
        lacking = [s for s in found if s.served]
        other = [s for s in found if not s.served]
        if not lacking:
            click.echo("no run would be stranded: every step the runs name is in the code")
        else:
            print_table(
                "runs this code would strand",
                ("run id", "flow", "status", "missing step", "named as"),
                [[s.run_id, s.flow, s.status.value, s.step, s.where] for s in lacking],
                fold=("missing step", "named as"),
            )
        if other:
            print_table(
                "runs on versions this code does not serve (a worker of their version "
                "drives them, or `onceonly runs upgrade RUN --to VERSION`)",
                ("run id", "flow", "status", "version"),
                [[s.run_id, s.flow, s.status.value, s.code_version] for s in other],
            )
    if any(s.served and s.status.value != "failed" for s in found):
        raise SystemExit(1)


def approve_command(run_id: str, name: str, digest: str) -> str:
    """The command that approves approval ``name`` of ``run_id`` (shell-quoted)."""
    import shlex  # noqa: PLC0415

    return shlex.join(["onceonly", "approve", run_id, name, "--hash", digest])


# -- acting ----------------------------------------------------------------------------------


def _run_line(op: Operator, run_id: str) -> str:
    run = op.store.get_run(run_id)
    return f"run {run_id} is {run.status.value}" + (
        f", next step {run.next_step}" if run.next_step else ""
    )


@runs.command("edit")
@click.argument("run_id")
@click.argument("channel")
@click.option("--value", type=JSON, required=True, help="The channel's new value (JSON).")
@click.option("--reason", required=True, help="Why (kept in the run's operator log).")
@actor_option
@url_option
@json_option
def runs_edit(
    run_id: str,
    channel: str,
    value: Any,
    reason: str,
    actor: str | None,
    url: str | None,
    as_json: bool,
) -> None:
    """Set a state channel: a new checkpoint (source operator), reason and identity in
    the run's operator log."""
    by = identity(actor)
    with operator(url) as op:
        info = op.edit(run_id, channel, value, actor=by, reason=reason)
        line = _run_line(op, run_id)
    if as_json:
        emit_json({"run_id": run_id, "seq": info.seq, "channel": channel, "by": by})
        return
    click.echo(f"set {channel!r} of run {run_id} (checkpoint {info.seq}) as {by}; {line}")


@runs.command("cancel")
@click.argument("run_id")
@click.option("--reason", default="", help="Why (kept in the run's operator log).")
@actor_option
@url_option
@json_option
def runs_cancel(
    run_id: str, reason: str, actor: str | None, url: str | None, as_json: bool
) -> None:
    """Cancel a run: its open waits close and no step of it runs again."""
    by = identity(actor)
    with operator(url) as op:
        run = op.cancel(run_id, actor=by, reason=reason)
    if as_json:
        emit_json({"run_id": run_id, "status": run.status.value, "by": by})
        return
    click.echo(f"run {run_id} is {run.status.value} (by {by})")


@runs.command("retry")
@click.argument("run_id")
@click.option("--reason", default="", help="Why (kept in the run's operator log).")
@actor_option
@url_option
@json_option
def runs_retry(run_id: str, reason: str, actor: str | None, url: str | None, as_json: bool) -> None:
    """Make a failed run ready again at the step that failed (its recorded effects
    replay; a worker picks it up)."""
    by = identity(actor)
    with operator(url) as op:
        run = op.retry(run_id, actor=by, reason=reason)
    if as_json:
        emit_json(
            {"run_id": run_id, "status": run.status.value, "next_step": run.next_step, "by": by}
        )
        return
    click.echo(f"run {run_id} is {run.status.value} at step {run.next_step} (retried by {by})")


@runs.command("fork")
@click.argument("run_id")
@click.option(
    "--seq", type=click.IntRange(min=0), required=True, help="The checkpoint to start from."
)
@click.option("--reason", required=True, help="Why (kept in the new run).")
@click.option("--new-id", default=None, help="The new run's id (default: generated).")
@actor_option
@url_option
@json_option
def runs_fork(
    run_id: str,
    seq: int,
    reason: str,
    new_id: str | None,
    actor: str | None,
    url: str | None,
    as_json: bool,
) -> None:
    """Start a new run from checkpoint SEQ of RUN. It shares RUN's effect keys: a step it
    repeats replays RUN's recorded effects, never sends them again."""
    by = identity(actor)
    with operator(url) as op:
        new = op.fork(run_id, seq, actor=by, reason=reason, new_run_id=new_id)
        line = _run_line(op, new)
    if as_json:
        emit_json({"run_id": new, "forked_from": {"run": run_id, "seq": seq}, "by": by})
        return
    click.echo(f"forked {run_id} at checkpoint {seq} as {new} (by {by}); {line}")


@runs.command("restart")
@click.argument("run_id")
@click.option("--reason", required=True, help="Why the run starts over (kept in both runs).")
@click.option("--new-id", default=None, help="The new run's id (default: RUN.restart-N).")
@actor_option
@url_option
@json_option
def runs_restart(
    run_id: str,
    reason: str,
    new_id: str | None,
    actor: str | None,
    url: str | None,
    as_json: bool,
) -> None:
    """Start RUN over, for a plan that was wrong: a new run from the state RUN began with,
    in a key space of its own, so its effects happen again. RUN's effects stay recorded;
    RUN is cancelled unless it has ended. Repeated after an interruption, it finishes the
    same restart."""
    by = identity(actor)
    with operator(url) as op:
        new = op.restart(run_id, actor=by, reason=reason, new_run_id=new_id)
        line = _run_line(op, new)
        old = op.store.get_run(run_id).status.value
    if as_json:
        emit_json({"run_id": new, "restarted_from": run_id, "old_status": old, "by": by})
        return
    click.echo(f"restarted {run_id} ({old}) as {new} (by {by}); {line}")


@runs.command("upgrade")
@click.argument("run_id")
@click.option("--to", "version", required=True, help="The flow version to move RUN to.")
@click.option(
    "--flows", "flows_spec", required=True, help="module:attribute of that version's code."
)
@click.option("--reason", required=True, help="Why the run moves (kept in its operator log).")
@actor_option
@url_option
@json_option
def runs_upgrade(
    run_id: str,
    version: str,
    flows_spec: str,
    reason: str,
    actor: str | None,
    url: str | None,
    as_json: bool,
) -> None:
    """Move RUN on purpose to version VERSION of its flow (the --flows code).

    A run stays on the version that started it. This applies the code's state
    migrations and its step mapping for RUN's version (Flow(upgrades=...)), as an
    operator checkpoint and a record in the run's audit chain; then workers of VERSION
    drive it. Refused, with nothing changed, when a step the run names is missing from
    the code, its state cannot be upgraded, a worker holds it, or its current step acted
    and would act again under a new name.
    """
    from onceonly.checkpoint import ConfigurationError  # noqa: PLC0415

    from . import load_flows  # noqa: PLC0415

    by = identity(actor)
    with operator(url) as op:
        name = op.store.get_run(run_id).flow
        target = [f for f in load_flows(flows_spec) if f.name == name]
        if not target or target[0].version != version:
            have = ", ".join(f"{f.name} {f.version}" for f in load_flows(flows_spec))
            raise ConfigurationError(
                f"{flows_spec} has no version {version!r} of flow {name!r} (it has: "
                f"{have or 'no flow'})"
            )
        before = op.store.get_run(run_id).code_version
        run = op.upgrade(run_id, target[0], actor=by, reason=reason)
        line = _run_line(op, run_id)
    if as_json:
        emit_json({"run_id": run_id, "from": before, "to": run.code_version, "by": by})
        return
    if before == run.code_version:
        click.echo(f"{run_id} is on version {version} already; {line}")
        return
    click.echo(f"upgraded {run_id} from version {before} to {run.code_version} (by {by}); {line}")


@click.command("approve")
@click.argument("run_id")
@click.argument("name")
@click.option(
    "--hash",
    "digest",
    type=HASH,
    required=True,
    help="The subject_hash shown by `onceonly runs show` (binds the approval to it).",
)
@click.option("--reason", default="", help="Recorded with the decision.")
@actor_option
@url_option
@json_option
def approve_cmd(
    run_id: str,
    name: str,
    digest: str,
    reason: str,
    actor: str | None,
    url: str | None,
    as_json: bool,
) -> None:
    """Approve exactly what approval NAME of RUN asks for; wakes the run.

    Refused, with nothing recorded, when the hash is not that of the request, the
    request was decided or expired, or you requested it yourself.
    """
    by = identity(actor)
    with operator(url) as op:
        wait = op.approve(run_id, name, actor=by, subject_hash=digest, reason=reason)
        line = _run_line(op, run_id)
        doc = _wait_json(op.store.codec, wait)
    if as_json:
        emit_json(doc)
        return
    click.echo(f"approved {name!r} of run {run_id} as {by}; {line}")


@click.command("reject")
@click.argument("run_id")
@click.argument("name")
@click.option("--reason", required=True, help="Recorded with the decision.")
@actor_option
@url_option
@json_option
def reject_cmd(
    run_id: str, name: str, reason: str, actor: str | None, url: str | None, as_json: bool
) -> None:
    """Reject approval NAME of RUN; the run takes its rejection path (or fails)."""
    by = identity(actor)
    with operator(url) as op:
        wait = op.reject(run_id, name, actor=by, reason=reason)
        line = _run_line(op, run_id)
        doc = _wait_json(op.store.codec, wait)
    if as_json:
        emit_json(doc)
        return
    click.echo(f"rejected {name!r} of run {run_id} as {by}; {line}")


@click.command("signal")
@click.argument("run_id")
@click.argument("name")
@click.option("--payload", type=JSON, default=None, help="The signal's payload (JSON).")
@actor_option
@url_option
@json_option
def signal_cmd(
    run_id: str, name: str, payload: Any, actor: str | None, url: str | None, as_json: bool
) -> None:
    """Deliver signal NAME to RUN (kept until the run waits for it); delivered once."""
    by = identity(actor)
    with operator(url) as op:
        wait = op.signal(run_id, name, payload, actor=by)
        line = _run_line(op, run_id)
        doc = _wait_json(op.store.codec, wait)
    if as_json:
        emit_json(doc)
        return
    click.echo(f"signalled {name!r} to run {run_id} as {by}; {line}")
