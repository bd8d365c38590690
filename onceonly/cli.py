"""The ``onceonly`` command line."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from checkpoint import Codec, OnceOnlyError, RunStatus, Store, migrate
from checkpoint.errors import ConfigurationError
from ledger import EffectRecord, EffectStatus, Keyring, Ledger, Secret
from ledger import migrate as ledger_migrate

from .flow import Flow

DEFAULT_URL = "sqlite:///onceonly.db"
_URL_HELP = "Database URL (env ONCEONLY_DATABASE_URL; default sqlite:///onceonly.db)."


def _url(url: str | None) -> str:
    return url or os.environ.get("ONCEONLY_DATABASE_URL") or DEFAULT_URL


@click.group()
@click.version_option(package_name="onceonly")
def cli() -> None:
    """onceonly: durable runs that resume, not restart."""


@cli.command("demo")
@click.option("--db", type=click.Path(dir_okay=False), default=None, help="Fresh SQLite file.")
def demo_cmd(db: str | None) -> None:
    """Run a flow, SIGKILL it mid-run, resume it in a fresh process."""
    from . import demo  # noqa: PLC0415

    sys.exit(demo.main(db))


@cli.command("migrate")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
def migrate_cmd(url: str | None, sql: bool) -> None:
    """Create or upgrade the database schema (checkpoint core and effects ledger)."""
    target = _url(url)
    click.echo(migrate(target, sql=sql), nl=not sql)
    click.echo(ledger_migrate(target, sql=sql), nl=not sql)


def _keyring(required: bool) -> Keyring:
    try:
        return Keyring.from_env()
    except ConfigurationError:
        if required:
            raise
        # Listing, showing metadata and verifying need no secret; a throwaway keyring
        # keeps the Ledger usable for them and can decrypt nothing.
        import os as _os  # noqa: PLC0415

        return Keyring([Secret("read-only", _os.urandom(32))])


def _record_json(rec: EffectRecord) -> dict[str, object]:
    d = dict(rec.__dict__)
    for k in ("status", "provider_class", "outcome_class"):
        d[k] = None if d[k] is None else str(d[k])
    return d


@cli.group("effects")
def effects() -> None:
    """Inspect and resolve effects in the ledger."""


@effects.command("list")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--run", "run_id", default=None, help="Only this run's effects.")
@click.option(
    "--status",
    type=click.Choice([s.value for s in EffectStatus]),
    default=None,
    help="Only effects with this status.",
)
@click.option("--effect", default=None, help="Only this effect name@version.")
@click.option("--since", type=float, default=None, help="Updated at or after (UNIX seconds).")
@click.option("--until", type=float, default=None, help="Updated before (UNIX seconds).")
@click.option("--limit", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def effects_list(
    url: str | None,
    run_id: str | None,
    status: str | None,
    effect: str | None,
    since: float | None,
    until: float | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List effects, newest first."""
    with Store.open(_url(url), create=False) as store:
        ledger = Ledger(store, _keyring(required=False), create=False)
        rows = ledger.effects(
            run_id=run_id, status=status, effect=effect, since=since, until=until, limit=limit
        )
    if as_json:
        click.echo(json.dumps([_record_json(r) for r in rows]))
        return
    table = Table(title="effects")
    table.add_column("key id", no_wrap=True, overflow="fold")
    for col in ("effect", "run", "status", "class", "epoch", "attempts"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.key_id,
            r.effect,
            r.run_id or "-",
            r.status.value,
            r.provider_class.value,
            str(r.epoch),
            str(r.attempts),
        )
    Console().print(table)


@effects.command("show")
@click.argument("key_id")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--payload", is_flag=True, help="Decrypt arguments/result (needs ONCEONLY_SECRETS).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def effects_show(key_id: str, url: str | None, payload: bool, as_json: bool) -> None:
    """Show one effect, its audit events and (with --payload) its decrypted payload."""
    with Store.open(_url(url), create=False) as store:
        ledger = Ledger(store, _keyring(required=payload), create=False)
        rec = ledger.get(key_id)
        events = [
            {k: (v.hex() if isinstance(v, bytes | memoryview) else v) for k, v in e.items()}
            for e in ledger.audit_events(rec.run_id or f"tenant:{rec.tenant}")
            if e["key_id"] == key_id
        ]
        doc: dict[str, object] = {"effect": _record_json(rec), "events": events}
        if payload:
            doc["payload"] = json.loads(ledger.codec.encode(ledger.payload(key_id)))
    if as_json:
        click.echo(json.dumps(doc, default=str))
        return
    Console().print_json(json.dumps(doc, default=str))


@effects.command("resolve")
@click.argument("key_id")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--happened/--not-happened", default=None, help="What the provider shows.")
@click.option("--evidence", required=True, help="What you checked (recorded in the audit).")
@click.option("--actor", default=None, help="Your identity (default: $USER).")
@click.option("--result", default=None, help="The provider's result as JSON (--happened).")
def effects_resolve(
    key_id: str,
    url: str | None,
    happened: bool | None,
    evidence: str,
    actor: str | None,
    result: str | None,
) -> None:
    """Resolve an in-doubt effect with evidence (recorded with your identity)."""
    if happened is None:
        raise click.UsageError("say --happened or --not-happened")
    try:
        value = None if result is None else json.loads(result)
    except ValueError as exc:
        raise click.UsageError(f"--result is not JSON: {exc}") from exc
    who = actor or os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"
    with Store.open(_url(url), create=False) as store:
        ledger = Ledger(store, _keyring(required=True), create=False)
        rec = ledger.resolve(key_id, happened=happened, evidence=evidence, actor=who, result=value)
    click.echo(f"{rec.key_id}: {rec.status.value} (epoch {rec.epoch}), resolved by {who}")


@cli.group("audit")
def audit() -> None:
    """Verify and export the audit trail."""


@audit.command("verify")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--witness", type=click.Path(dir_okay=False), default=None, help="Witness file.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit_verify(url: str | None, witness: str | None, as_json: bool) -> None:
    """Check every chain, effect row, blob and checkpoint; exit 1 on any problem."""
    with Store.open(_url(url), create=False) as store:
        ledger = Ledger(store, _keyring(required=False), create=False)
        report = ledger.verify(witness=witness)
    if as_json:
        click.echo(report.to_json())
    else:
        con = Console(soft_wrap=True)
        con.print(
            f"chains {report.chains}, events {report.events}, effects {report.effects}, "
            f"blobs and checkpoints {report.blobs}"
        )
        for p in report.problems:
            con.print(f"[red]problem:[/red] {p}")
        con.print(
            "[green]OK[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"
        )
    if not report.ok:
        sys.exit(1)


@audit.command("export")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="JSONL file.")
@click.option(
    "--witness", type=click.Path(dir_okay=False), default=None, help="Also write a witness."
)
def audit_export(url: str | None, out: str, witness: str | None) -> None:
    """Export every effect (metadata, no payloads) to JSONL, and optionally a witness."""
    with Store.open(_url(url), create=False) as store:
        ledger = Ledger(store, _keyring(required=False), create=False)
        n = ledger.export_jsonl(out)
        if witness:
            ledger.export_witness(witness)
    click.echo(f"exported {n} effect(s) to {out}" + (f"; witness in {witness}" if witness else ""))


@cli.group("runs")
def runs() -> None:
    """Inspect runs."""


@runs.command("list")
@click.option("--url", default=None, help=_URL_HELP)
@click.option(
    "--status",
    type=click.Choice([s.value for s in RunStatus]),
    default=None,
    help="Only runs with this status.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def runs_list(url: str | None, status: str | None, as_json: bool) -> None:
    """List runs, most recently updated first."""
    with Store.open(_url(url), create=False) as store:
        rows = store.list_runs(status=status)
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "run_id": r.run_id,
                        "flow": r.flow,
                        "status": r.status.value,
                        "next_step": r.next_step,
                        "head_seq": r.head_seq,
                        "updated_at": r.updated_at,
                    }
                    for r in rows
                ]
            )
        )
        return
    table = Table(title="runs")
    for col in ("run id", "flow", "status", "next step", "checkpoints"):
        table.add_column(col)
    for r in rows:
        n = "0" if r.head_seq is None else str(r.head_seq + 1)
        table.add_row(r.run_id, r.flow, r.status.value, r.next_step or "-", n)
    Console().print(table)


@runs.command("show")
@click.argument("run_id")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def runs_show(run_id: str, url: str | None, as_json: bool) -> None:
    """Show a run: status, handoff note, history and latest state."""
    # A lenient codec: show values of dataclasses this process has not registered.
    with Store.open(_url(url), create=False, codec=Codec(strict=False)) as store:
        run = store.get_run(run_id)
        history = store.history(run_id)
        state = store.load(run_id).state if history else None
        state_json = None if state is None else json.loads(store.codec.encode(state))
    doc = {
        "run_id": run.run_id,
        "flow": run.flow,
        "status": run.status.value,
        "next_step": run.next_step,
        "handoff": {
            "goal": run.handoff.goal,
            "done": list(run.handoff.done),
            "next": list(run.handoff.next),
            "ruled_out": list(run.handoff.ruled_out),
        },
        "history": [
            {"seq": i.seq, "step": i.step, "source": i.source.value, "keyframe": i.keyframe}
            for i in history
        ],
        "state": state_json,
    }
    if as_json:
        click.echo(json.dumps(doc, ensure_ascii=False))
        return
    Console().print_json(json.dumps(doc, ensure_ascii=False))


def load_flows(spec: str) -> list[Flow]:
    """Flows from ``module:attribute`` (a Flow, an iterable of them, or a callable
    returning either).

    Raises:
        ConfigurationError: The spec is malformed or names something else.
    """
    import importlib  # noqa: PLC0415

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"--flows {spec!r}: use module:attribute, e.g. myapp.flows:FLOWS")
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--flows {spec!r}: {exc}") from exc
    if callable(obj) and not isinstance(obj, Flow):
        obj = obj()
    flows = [obj] if isinstance(obj, Flow) else list(obj)
    if not flows or not all(isinstance(f, Flow) for f in flows):
        raise ConfigurationError(f"--flows {spec!r} does not name a Flow or Flows")
    return flows


@cli.command("worker")
@click.option("--url", "--db", "url", default=None, help=_URL_HELP)
@click.option("--flows", "flows_spec", required=True, help="module:attribute of your Flow(s).")
@click.option("--owner", default=None, help="Worker identity, stable across restarts.")
@click.option("--lease-s", type=float, default=30.0, show_default=True, help="Run lease.")
@click.option("--poll-s", type=float, default=1.0, show_default=True, help="Idle poll.")
@click.option("--batch", type=int, default=1, show_default=True, help="Runs claimed per round.")
@click.option("--until-idle", is_flag=True, help="Exit when no run is ready.")
def worker_cmd(
    url: str | None,
    flows_spec: str,
    owner: str | None,
    lease_s: float,
    poll_s: float,
    batch: int,
    until_idle: bool,
) -> None:
    """Claim ready runs and drive them; SIGTERM drains (the current step finishes)."""
    import logging  # noqa: PLC0415

    from .runtime import Runtime, default_owner  # noqa: PLC0415
    from .worker import Worker  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    flows = load_flows(flows_spec)
    worker_owner = owner or default_owner()
    with Store.open(_url(url)) as store:
        ledger = Ledger(store, _keyring(required=True), owner=worker_owner)
        try:
            rt = Runtime(store, ledger, flows, owner=worker_owner, lease_s=lease_s)
            worker = Worker(rt, batch=batch, poll_s=poll_s)
            worker.install_signal_handlers()
            stats = worker.run(until_idle=until_idle)
        finally:
            ledger.close()
    click.echo(
        f"worker {worker_owner} stopped: {stats.runs_driven} run(s) driven, "
        f"{stats.claim_conflicts} claim conflict(s)"
    )


def main() -> None:
    """Console-script entry point: typed errors become one clear line and exit code 1."""
    try:
        cli(standalone_mode=True)
    except OnceOnlyError as exc:
        # soft_wrap: one line, whatever the terminal width (scripts grep these).
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {exc}", markup=True)
        sys.exit(1)
