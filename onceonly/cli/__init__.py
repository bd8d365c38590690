"""The ``onceonly`` command line.

Commands: ``demo``, ``migrate``, ``worker``, ``runs list|show|edit|cancel|retry|fork``,
``approve``, ``reject``, ``signal``, ``effects list|show|resolve|correct``,
``audit verify|export`` and ``gc``. Typed errors print one line and exit with code 1;
malformed arguments are usage errors (exit code 2). With ``--json``, an error is also
one JSON document on stdout: ``{"error": {"type": ..., "message": ..., "exit_code": ...}}``.

The commands are in :mod:`onceonly.cli.runs` (runs and their waits) and
:mod:`onceonly.cli.effects` (the effects ledger and its audit trail); what they share in
``onceonly.cli._common``. Modules import click and nothing heavy at the top: each
command imports the store, the ledger, rich or the demo when it runs, so ``onceonly
--help`` starts fast.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ._common import (
    DURATION,
    URL_HELP,
    db_url,
    emit_json,
    format_duration,
    json_option,
    known_secrets,
    masked,
    open_ledger,
    operator,
    progress,
    sqlite_path,
    url_option,
)
from ._logging import LOG_FORMATS, LOG_LEVELS
from .console import console
from .effects import audit, effects
from .runs import approve_cmd, reject_cmd, runs, signal_cmd

if TYPE_CHECKING:
    from onceonly.flow import Flow

__all__ = ["cli", "load_flows", "main"]


@click.group()
@click.version_option(package_name="onceonly")
def cli() -> None:
    """onceonly: durable runs that resume, not restart."""


@cli.command("demo")
@click.option("--db", type=click.Path(dir_okay=False), default=None, help="Fresh SQLite file.")
@click.option(
    "--crash-at",
    type=click.Choice(["approval", "random"]),
    default="approval",
    show_default=True,
    help="Kill the worker during the approval wait, or at random lines, again and again.",
)
@click.option("--seed", type=int, default=None, help="Seed of --crash-at random (replay).")
def demo_cmd(db: str | None, crash_at: str, seed: int | None) -> None:
    """Vendor onboarding against local servers; the worker is SIGKILLed and resumed."""
    from onceonly.demo import main as demo_main  # noqa: PLC0415  (its servers: only here)

    sys.exit(demo_main(db, crash_at=crash_at, seed=seed))


@cli.command("migrate")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
@click.option("--langgraph", is_flag=True, help="Also the LangGraph checkpointer's tables.")
@click.option(
    "--console",
    is_flag=True,
    help="Also the operator console's tables (accounts, tokens, snoozes, used links).",
)
def migrate_cmd(url: str | None, sql: bool, langgraph: bool, console: bool) -> None:
    """Create or upgrade the database schema (checkpoint core, effects ledger and the
    worker registry; with --langgraph also the LangGraph checkpointer's tables, with
    --console the operator console's)."""
    from onceonly.checkpoint import migrate  # noqa: PLC0415
    from onceonly.ledger import migrate as ledger_migrate  # noqa: PLC0415
    from onceonly.registry import migrate as registry_migrate  # noqa: PLC0415

    target = db_url(url)
    sqlite_path(target, must_exist=False)
    click.echo(migrate(target, sql=sql), nl=not sql)
    click.echo(ledger_migrate(target, sql=sql), nl=not sql)
    click.echo(registry_migrate(target, sql=sql), nl=not sql)
    if langgraph:
        from onceonly.adapters._langgraph_schema import migrate as langgraph_migrate  # noqa: PLC0415

        click.echo(langgraph_migrate(target, sql=sql), nl=not sql)
    if console:
        from onceonly.console.accounts import migrate as console_migrate  # noqa: PLC0415

        click.echo(console_migrate(target, sql=sql), nl=not sql)


@cli.command("workers")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def workers_cmd(url: str | None, as_json: bool) -> None:
    """List the workers that announced themselves: the flow versions each serves, its
    host and pid, and when it was last seen (gone: not seen for three of its refresh
    intervals; a worker that stops cleanly removes itself)."""
    import time  # noqa: PLC0415

    from onceonly.registry import WorkerRegistry  # noqa: PLC0415

    from ._common import ago, emit_json, open_store, print_table  # noqa: PLC0415

    with open_store(url) as store:
        found = WorkerRegistry(store, create=False).workers()
    now = time.time()
    if as_json:
        emit_json(
            [
                {
                    "owner": w.owner,
                    "served": {k: list(v) for k, v in w.served.items()},
                    "host": w.host,
                    "pid": w.pid,
                    "started_at": w.started_at,
                    "seen_at": w.seen_at,
                    "live": w.live(now),
                }
                for w in found
            ]
        )
        return
    if not found:
        click.echo("no worker has announced itself")
        return
    print_table(
        "workers",
        ("owner", "serves", "host", "pid", "seen", "state"),
        [
            [
                w.owner,
                "\n".join(f"{k} {', '.join(v)}" for k, v in w.served.items()) or "-",
                w.host,
                str(w.pid),
                ago(w.seen_at, now),
                "live" if w.live(now) else "gone",
            ]
            for w in found
        ],
        fold=("owner", "serves"),
        right=("pid",),
    )


cli.add_command(effects)
cli.add_command(audit)
cli.add_command(runs)
cli.add_command(approve_cmd)
cli.add_command(reject_cmd)
cli.add_command(signal_cmd)
cli.add_command(console)


@cli.command("gc")
@url_option
@click.option(
    "--older-than",
    "older_than",
    type=DURATION,
    required=True,
    help="Only what was not updated for this long: 30d, 12h, 90m, 45s.",
)
@click.option(
    "--archive",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append removed runs to this JSONL file (and removed effects to FILE.effects).",
)
@json_option
def gc_cmd(url: str | None, older_than: float, archive: str | None, as_json: bool) -> None:
    """Remove completed, failed and cancelled runs not updated for --older-than, their
    waits, ledger entries past that age and their dedup windows, and unreferenced blobs.

    Waiting and running runs, open approvals and in-doubt effects are never removed.
    """
    phases = ("runs", "effects", "waits")
    with operator(url) as op, progress("garbage collection", total=len(phases)) as bar:
        task = bar.task_ids[0]

        def on_phase(name: str) -> None:
            bar.update(task, completed=phases.index(name), description=f"gc: {name}")

        report = op.gc(older_than_s=older_than, archive_path=archive, on_phase=on_phase)
        bar.update(task, completed=len(phases))
    if as_json:
        emit_json(dataclasses.asdict(report))
        return
    click.echo(
        f"removed {report.runs_deleted} run(s) ({report.runs_archived} archived), "
        f"{report.effects_deleted} effect(s), {report.waits_deleted} wait(s) and "
        f"{report.blobs_deleted} blob(s) older than {format_duration(older_than)}"
        + (f"; archive in {archive}" if archive else "")
    )


def load_flows(spec: str) -> list[Flow]:
    """Flows from ``module:attribute`` (a Flow, an iterable of them, or a callable
    returning either).

    Raises:
        ConfigurationError: The spec is malformed or names something else.
    """
    import importlib  # noqa: PLC0415

    from onceonly.checkpoint.errors import ConfigurationError  # noqa: PLC0415
    from onceonly.flow import Flow  # noqa: PLC0415

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


def _report_stranded(store: Any, flows: list[Flow]) -> None:
    """Log every run whose next step this code lacks (from the run rows alone: cheap at
    start; ``onceonly runs check`` also reads what each waiting run waits for)."""
    import logging  # noqa: PLC0415

    from onceonly.deploy import stranded  # noqa: PLC0415

    log = logging.getLogger("onceonly.worker")
    other: dict[tuple[str, str], int] = {}
    for s in stranded(store, flows, deep=False):
        if not s.served:
            other[s.flow, s.code_version] = other.get((s.flow, s.code_version), 0) + 1
            continue
        log.warning(
            "run %s (%s, %s) names step %r as its %s, which this code lacks: it cannot go "
            "on until a deploy has the step again or an operator forks it",
            s.run_id,
            s.flow,
            s.status.value,
            s.step,
            s.where,
            extra={"event": "run_stranded", "run_id": s.run_id, "step": s.step},
        )
    for (flow, version), n in sorted(other.items()):
        log.info(
            "%d run(s) of %s are on version %s, which this worker does not serve: workers of "
            "that version drive them (`onceonly runs list --unserved` lists those nobody "
            "serves; `onceonly runs upgrade` moves one)",
            n,
            flow,
            version,
            extra={"event": "runs_not_served", "flow": flow, "version": version, "runs": n},
        )


@cli.command("worker")
@click.option("--url", "--db", "url", default=None, help=URL_HELP)
@click.option("--flows", "flows_spec", required=True, help="module:attribute of your Flow(s).")
@click.option("--owner", default=None, help="Worker identity, stable across restarts.")
@click.option("--lease-s", type=float, default=30.0, show_default=True, help="Run lease.")
@click.option(
    "--claim-lease",
    "claim_lease_s",
    type=click.FloatRange(min=0.0, min_open=True),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="How long an effect's claim stays live without renewal (longer than your slowest "
    "provider call: a claim that lapses mid-call is in doubt).",
)
@click.option("--poll-s", type=float, default=1.0, show_default=True, help="Idle poll.")
@click.option("--batch", type=int, default=1, show_default=True, help="Runs claimed per round.")
@click.option("--until-idle", is_flag=True, help="Exit when no run is ready.")
@click.option(
    "--durability",
    type=click.Choice(["sync", "async", "exit"]),
    default="sync",
    show_default=True,
    help="When checkpoints become durable for runs without a mode of their own (the store's "
    "Durability; Runtime.start(durability=...) sets a run's): every ledger write is "
    "durable before it returns in every mode; async/exit batch the checkpoints.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="info",
    show_default=True,
    help="Least severe log line written (stderr).",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="text: one readable line per event; json: one JSON object per line (ts, level, "
    "logger, message, and fields such as event, run_id, command).",
)
def worker_cmd(
    url: str | None,
    flows_spec: str,
    owner: str | None,
    lease_s: float,
    claim_lease_s: float,
    poll_s: float,
    batch: int,
    until_idle: bool,
    durability: str,
    log_level: str,
    log_format: str,
) -> None:
    """Claim ready runs of the --flows and drive them; SIGTERM drains (the current step
    finishes). A run parked for a person is logged with the command that settles it."""
    from onceonly.checkpoint import Store  # noqa: PLC0415
    from onceonly.runtime import Runtime, default_owner  # noqa: PLC0415
    from onceonly.worker import Worker  # noqa: PLC0415

    from ._logging import configure  # noqa: PLC0415

    with configure(log_level.lower(), log_format):
        flows = load_flows(flows_spec)
        worker_owner = owner or default_owner()
        target = db_url(url)
        sqlite_path(target, must_exist=False)  # a worker may be the first to use a database
        with Store.open(target, durability=durability) as store:
            ledger = open_ledger(store, required=True, owner=worker_owner, lease_s=claim_lease_s)
            try:
                rt = Runtime(store, ledger, flows, owner=worker_owner, lease_s=lease_s)
                _report_stranded(store, flows)
                worker = Worker(rt, batch=batch, poll_s=poll_s)
                worker.install_signal_handlers()
                stats = worker.run(until_idle=until_idle)
            finally:
                ledger.close()
    click.echo(
        f"worker {worker_owner} stopped: {stats.runs_driven} run(s) driven, "
        f"{stats.claim_conflicts} claim conflict(s)"
    )


def main(args: Sequence[str] | None = None) -> None:
    """Console-script entry point: typed errors become one clear line and exit code 1
    (with ``--json``, also one JSON document on stdout); usage errors exit with code 2.

    No database password and no keyring secret is printed: messages are masked (the
    store masks them where they are made; this is the last line of defence), and so is
    the chain of an unexpected error before its traceback is shown.

    Args:
        args: The arguments (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if args is None else args)
    as_json = "--json" in argv
    try:
        rv = cli.main(argv, prog_name="onceonly", standalone_mode=False)
    except click.ClickException as exc:
        if as_json:  # and the usual usage text on stderr
            message = masked(exc.format_message(), argv)
            emit_json(
                {
                    "error": {
                        "type": type(exc).__name__,
                        "message": message,
                        "exit_code": exc.exit_code,
                    }
                }
            )
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except Exception as exc:
        # A typed error comes from the store, which is then imported (not for --help).
        errors = sys.modules.get("onceonly.checkpoint.errors")
        if errors is not None and isinstance(exc, errors.OnceOnlyError):
            _fail(type(exc).__name__, masked(str(exc), argv), 1, as_json=as_json)
        from onceonly.checkpoint import scrub  # noqa: PLC0415

        scrub(exc, *known_secrets(argv))
        raise
    sys.exit(rv if isinstance(rv, int) else 0)


def _fail(kind: str, message: str, code: int, *, as_json: bool) -> NoReturn:
    """Report an error and exit: one line on stderr (for a person), and with ``--json``
    the same as one JSON document on stdout (for the program reading it)."""
    if as_json:
        emit_json({"error": {"type": kind, "message": message, "exit_code": code}})
    from ._common import make_console, styled  # noqa: PLC0415

    # soft_wrap: one line, whatever the terminal width (scripts grep these); the message
    # is the user's text too (a run id), never markup.
    make_console(stderr=True).print(styled("error:", "red"), message)
    sys.exit(code)
