"""The ``onceonly`` command line."""

from __future__ import annotations

import json
import os
import sys

import click
from rich.console import Console
from rich.table import Table

from checkpoint import OnceOnlyError, Store, migrate

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
    """Create or upgrade the database schema."""
    click.echo(migrate(_url(url), sql=sql), nl=not sql)


@cli.group("runs")
def runs() -> None:
    """Inspect runs."""


@runs.command("list")
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--status", default=None, help="Only runs with this status.")
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
    with Store.open(_url(url), create=False) as store:
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


def main() -> None:
    """Console-script entry point: typed errors become one clear line and exit code 1."""
    try:
        cli(standalone_mode=True)
    except OnceOnlyError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        sys.exit(1)
