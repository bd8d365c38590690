"""``onceonly effects ...`` and ``onceonly audit ...``: the effects ledger and its audit
trail."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from ledger import EffectStatus

from ._cli_common import (
    AS_HELP,
    JSON,
    URL_HELP,
    emit_json,
    identity,
    ledger_on,
    operator,
    progress,
    record_json,
)

__all__ = ["audit", "effects"]


@click.group("effects")
def effects() -> None:
    """Inspect and resolve effects in the ledger."""


@effects.command("list")
@click.option("--url", default=None, help=URL_HELP)
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
    with ledger_on(url) as ledger:
        rows = ledger.effects(
            run_id=run_id, status=status, effect=effect, since=since, until=until, limit=limit
        )
    if as_json:
        click.echo(json.dumps([record_json(r) for r in rows]))
        return
    table = Table(title="effects")
    # The start of the key id (as in the docs); --json has the whole one.
    table.add_column("key id", no_wrap=True, overflow="ellipsis", max_width=17)
    for col in ("effect", "run", "status", "class", "epoch", "attempts"):
        table.add_column(col, overflow="fold")
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
@click.option("--url", default=None, help=URL_HELP)
@click.option("--payload", is_flag=True, help="Decrypt arguments/result (needs ONCEONLY_SECRETS).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def effects_show(key_id: str, url: str | None, payload: bool, as_json: bool) -> None:
    """Show one effect, its audit events and (with --payload) its decrypted payload."""
    with ledger_on(url, secrets=payload) as ledger:
        rec = ledger.get(key_id)
        events = [
            {k: (v.hex() if isinstance(v, bytes | memoryview) else v) for k, v in e.items()}
            for e in ledger.audit_events(rec.run_id or f"tenant:{rec.tenant}")
            if e["key_id"] == key_id
        ]
        doc: dict[str, object] = {"effect": record_json(rec), "events": events}
        if payload:
            doc["payload"] = json.loads(ledger.codec.encode(ledger.payload(key_id)))
    if as_json:
        click.echo(json.dumps(doc, default=str))
        return
    Console().print_json(json.dumps(doc, default=str))


@effects.command("resolve")
@click.argument("key_id")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--happened/--not-happened", default=None, help="What the provider shows.")
@click.option("--evidence", required=True, help="What you checked (recorded in the audit).")
@click.option("--as", "--actor", "actor", default=None, metavar="ACTOR", help=AS_HELP)
@click.option("--result", type=JSON, default=None, help="The provider's result (JSON).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def effects_resolve(
    key_id: str,
    url: str | None,
    happened: bool | None,
    evidence: str,
    actor: str | None,
    result: object,
    as_json: bool,
) -> None:
    """Resolve an in-doubt effect with evidence (recorded with your identity), and wake
    the run parked on it: its step runs again, and the effect replays (--happened) or is
    sent (--not-happened)."""
    if happened is None:
        raise click.UsageError("say --happened or --not-happened")
    who = identity(actor)
    with operator(url, secrets=True) as op:
        rec = op.resolve(key_id, happened=happened, evidence=evidence, actor=who, result=result)
    if as_json:
        emit_json(record_json(rec))
        return
    click.echo(f"{rec.key_id}: {rec.status.value} (epoch {rec.epoch}), resolved by {who}")


@click.group("audit")
def audit() -> None:
    """Verify and export the audit trail."""


@audit.command("verify")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--witness", type=click.Path(dir_okay=False), default=None, help="Witness file.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit_verify(url: str | None, witness: str | None, as_json: bool) -> None:
    """Check every chain, effect row, blob and checkpoint; exit 1 on any problem."""
    with ledger_on(url) as ledger, progress("verifying the audit trail"):
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
@click.option("--url", default=None, help=URL_HELP)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="JSONL file.")
@click.option(
    "--witness", type=click.Path(dir_okay=False), default=None, help="Also write a witness."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit_export(url: str | None, out: str, witness: str | None, as_json: bool) -> None:
    """Export every effect (metadata, no payloads) to JSONL, and optionally a witness."""
    with ledger_on(url) as ledger, progress(f"exporting effects to {out}"):
        n = ledger.export_jsonl(out)
        if witness:
            ledger.export_witness(witness)
    if as_json:
        emit_json({"exported": n, "out": out, "witness": witness})
        return
    click.echo(f"exported {n} effect(s) to {out}" + (f"; witness in {witness}" if witness else ""))
