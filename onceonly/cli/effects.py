"""``onceonly effects ...`` and ``onceonly audit ...``: the effects ledger and its audit
trail."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from ._common import (
    AS_HELP,
    JSON,
    URL_HELP,
    emit_json,
    identity,
    keyring,
    ledger_on,
    make_console,
    open_store,
    operator,
    print_table,
    progress,
    record_json,
    styled,
)

if TYPE_CHECKING:
    from onceonly.ledger import EffectRecord, Ledger

# EffectStatus's values, spelled out so that `--help` does not import the ledger (a test
# keeps them equal).
EFFECT_STATUSES = ("claimed", "committed", "failed", "unknown", "not_happened", "needs_human")
# How many characters of a key id the tables show; any unique start is accepted.
SHORT_KEY = 16


class _Unset:
    """``--result`` left out (JSON ``null`` is a result)."""

    def __repr__(self) -> str:
        return "<unknown>"


UNSET: Any = _Unset()


def full_key_id(ledger: Ledger, key_id: str) -> str:
    """The key id ``key_id`` starts (the start the tables show is enough), or ``key_id``.

    Raises:
        ConfigurationError: More than one entry's key id starts so.
    """
    from onceonly.checkpoint.errors import ConfigurationError  # noqa: PLC0415

    text = key_id.strip().lower()
    if len(text) >= 64 or not text or any(c not in "0123456789abcdef" for c in text):
        return key_id
    store = ledger.store
    p = store.param

    def q(cur: Any) -> list[str]:
        cur.execute(
            f"SELECT key_id FROM oo_effects WHERE key_id >= {p} AND key_id < {p} "
            "ORDER BY key_id LIMIT 2",
            (text, text + "g"),  # every hex digit sorts before "g"
        )
        return [str(r[0]) for r in cur.fetchall()]

    found = store.read(q)
    if len(found) > 1:
        raise ConfigurationError(
            f"key id {key_id!r} is the start of more than one effect's key id "
            f"({found[0]}, {found[1]}, ...); give more of it"
        )
    return found[0] if found else key_id


__all__ = ["audit", "effects"]


@click.group("effects")
def effects() -> None:
    """Inspect and resolve effects in the ledger."""


@effects.command("list")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--run", "run_id", default=None, help="Only this run's effects.")
@click.option(
    "--status",
    type=click.Choice(EFFECT_STATUSES),
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
    print_table(
        "effects",
        ("key id", "effect", "run", "status", "class", "epoch", "attempts", "check"),
        [
            [
                # The start of the key id (any unique start is accepted where a key id is
                # asked for); --json has the whole one.
                r.key_id[:SHORT_KEY],
                r.effect,
                r.run_id or "-",
                r.status.value,
                r.provider_class.value,
                str(r.epoch),
                str(r.attempts),
                _mark(r.integrity),
            ]
            for r in rows
        ],
        fold=("effect", "run"),
        right=("epoch", "attempts"),
    )
    if rows and rows[0].integrity == "unverified":
        make_console(stderr=True).print(UNVERIFIED)


UNVERIFIED = "seals not checked: set ONCEONLY_SECRETS to check every row against its seal"


def _mark(integrity: str) -> str:
    return {"ok": "ok", "unverified": "-"}.get(integrity, integrity.upper())


@effects.command("show")
@click.argument("key_id")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--payload", is_flag=True, help="Decrypt arguments/result (needs ONCEONLY_SECRETS).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def effects_show(key_id: str, url: str | None, payload: bool, as_json: bool) -> None:
    """Show one effect, its audit events and (with --payload) its decrypted payload.

    KEY_ID may be the start of the key id that `onceonly effects list` shows."""
    with ledger_on(url, secrets=payload) as ledger:
        key_id = full_key_id(ledger, key_id)
        rec = ledger.get(key_id)
        events = [
            {k: (v.hex() if isinstance(v, bytes | memoryview) else v) for k, v in e.items()}
            for e in ledger.audit_events(_chain(rec), key_ids=[key_id])
        ]
        # Outcomes refused because their worker's claim was stale: what a worker paused
        # past its lease did after another settled the entry (a possible duplicate).
        late = [
            {k: e[k] for k in ("seq", "at", "actor", "epoch", "status", "detail")}
            for e in events
            if e["event"] == "late_outcome"
        ]
        doc: dict[str, object] = {"effect": record_json(rec), "events": events, "late": late}
        if payload:
            doc["payload"] = json.loads(ledger.codec.encode(ledger.payload(key_id)))
    bad = rec.integrity not in ("ok", "unverified")
    if as_json:
        click.echo(json.dumps(doc, default=str))
    else:
        con = make_console()
        con.print_json(json.dumps(doc, default=str))
        for e in late:
            con.print(styled("late outcome", "yellow"), f"from {e['actor']}: {e['detail']}")
        if bad:
            con.print(
                styled("NOT TRUSTED", "red"),
                f"this entry is {rec.integrity} (it does not verify against its seal or its "
                "audit trail); it is not acted on. Run `onceonly audit verify`",
                sep=": ",
            )
        elif rec.integrity == "unverified":
            make_console(stderr=True).print(UNVERIFIED)
    if bad:
        sys.exit(1)


def _chain(rec: EffectRecord) -> str:
    return rec.run_id or f"tenant:{rec.tenant}"


@effects.command("resolve")
@click.argument("key_id")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--happened/--not-happened", default=None, help="What the provider shows.")
@click.option("--evidence", required=True, help="What you checked (recorded in the audit).")
@click.option("--as", "--actor", "actor", default=None, metavar="ACTOR", help=AS_HELP)
@click.option(
    "--result",
    type=JSON,
    default=UNSET,
    show_default=False,
    help="The provider's result (JSON), replayed to the step. Left out: the result is unknown.",
)
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
    sent (--not-happened).

    --happened without --result records that the result is unknown: the step then gets
    ResultUnknown (after asking the adapter's lookup for it, where there is one) until
    `onceonly effects correct KEY --result JSON` records it. KEY_ID may be the start of
    the key id that `onceonly effects list` shows."""
    from onceonly.ledger import UNKNOWN_RESULT  # noqa: PLC0415

    if happened is None:
        raise click.UsageError("say --happened or --not-happened")
    if not happened and result is not UNSET:
        raise click.UsageError("--result goes with --happened (nothing happened, no result)")
    result = UNKNOWN_RESULT if result is UNSET else result
    who = identity(actor)
    with operator(url) as op:
        key_id = full_key_id(op.ledger, key_id)
        rec = op.resolve(key_id, happened=happened, evidence=evidence, actor=who, result=result)
    _decided(rec, who, "resolved", happened, result, as_json)


@effects.command("correct")
@click.argument("key_id")
@click.option("--url", default=None, help=URL_HELP)
@click.option(
    "--happened/--not-happened",
    default=True,
    help="What the provider shows (default: it happened).",
)
@click.option("--evidence", required=True, help="What you checked (recorded in the audit).")
@click.option("--as", "--actor", "actor", default=None, metavar="ACTOR", help=AS_HELP)
@click.option(
    "--result",
    type=JSON,
    default=UNSET,
    show_default=False,
    help="The provider's result (JSON). Left out: the result is unknown.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def effects_correct(
    key_id: str,
    url: str | None,
    happened: bool,
    evidence: str,
    actor: str | None,
    result: object,
    as_json: bool,
) -> None:
    """Correct an operator's resolution (recorded with your identity and evidence): give
    the result it left out or a better one, or say it did (not) happen after all.

    Only outcomes that `effects resolve` (or an earlier correction) decided can be
    corrected. A run whose step failed on the unknown result continues with
    `onceonly runs retry RUN`: the effect then replays the corrected result. KEY_ID may be
    the start of the key id that `onceonly effects list` shows."""
    from onceonly.ledger import UNKNOWN_RESULT  # noqa: PLC0415

    if not happened and result is not UNSET:
        raise click.UsageError("--result goes with --happened (nothing happened, no result)")
    result = UNKNOWN_RESULT if result is UNSET else result
    who = identity(actor)
    with ledger_on(url, secrets=True) as ledger:
        key_id = full_key_id(ledger, key_id)
        rec = ledger.correct(key_id, happened=happened, result=result, evidence=evidence, actor=who)
    _decided(rec, who, "corrected", happened, result, as_json)


def _decided(
    rec: EffectRecord, who: str, verb: str, happened: bool, result: object, as_json: bool
) -> None:
    """Print an operator's decision, and what a step replaying the effect will see."""
    from onceonly.ledger import UNKNOWN_RESULT  # noqa: PLC0415

    if not happened:
        sees = "no outcome: its next attempt sends the effect (with the same key)"
    elif result is UNKNOWN_RESULT:
        sees = (
            "ResultUnknown, after asking the adapter's lookup for the result where there is "
            f"one; record it with `onceonly effects correct {rec.key_id} --result JSON "
            "--evidence TEXT`"
        )
    else:
        sees = "the given result, replayed"
    if as_json:
        emit_json({**record_json(rec), "result_known": happened and result is not UNKNOWN_RESULT})
        return
    click.echo(f"{rec.key_id}: {rec.status.value} (epoch {rec.epoch}), {verb} by {who}")
    click.echo(f"the step will see: {sees}")


@click.group("audit")
def audit() -> None:
    """Verify and export the audit trail."""


@audit.command("verify")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--witness", type=click.Path(dir_okay=False), default=None, help="Witness file.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit_verify(url: str | None, witness: str | None, as_json: bool) -> None:
    """Check every chain, effect row, blob and checkpoint; exit 1 on any problem."""
    saver_rows: tuple[int, list[str]] | None
    if _saver_only(url):
        # A database of the LangGraph saver alone (``OnceOnlySaver.from_url``): no
        # ledger to open, and nothing to migrate; its checkpoints and rows are checked.
        if witness is not None:
            raise click.UsageError(
                "--witness: this database holds no ledger (only the LangGraph saver's "
                "tables), so it has no audit chains to compare with a witness"
            )
        with open_store(url) as store, progress("verifying the LangGraph saver's rows"):
            report, note, saver_rows = _verify_saver_database(store)
        ledger_found = False
    else:
        with ledger_on(url) as ledger, progress("verifying the audit trail"):
            report = ledger.verify(witness=witness)
            note = ledger.store.integrity_note
            saver_rows = _verify_saver_rows(ledger.store)
            if saver_rows is not None:
                report.problems.extend(saver_rows[1])
            report.problems.extend(_verify_fork_links(url))
        ledger_found = True
    if as_json:
        doc = json.loads(report.to_json())
        doc["note"] = note
        doc["langgraph_rows"] = None if saver_rows is None else saver_rows[0]
        doc["ledger"] = ledger_found
        click.echo(json.dumps(doc))
    else:
        con = make_console()
        if note is not None:
            con.print(styled("note:", "yellow"), note)
        if not ledger_found:
            con.print("no ledger tables: a database of the LangGraph saver alone")
        con.print(
            (
                f"chains {report.chains}, events {report.events}, effects {report.effects}, "
                f"blobs and checkpoints {report.blobs}, data keys {report.data_keys}"
                if ledger_found
                else f"blobs and checkpoints {report.blobs}"
            )
            + ("" if saver_rows is None else f", LangGraph saver rows {saver_rows[0]}")
        )
        for p in report.problems:
            con.print(styled("problem:", "red"), p)
        con.print(
            styled("OK", "green")
            if report.ok
            else styled(f"{len(report.problems)} problem(s)", "red")
        )
    if not report.ok:
        sys.exit(1)


def _verify_fork_links(url: str | None) -> list[str]:
    """Every fork's link row agrees with the key space its latest checkpoint names: the
    row is what keeps the origin's ledger entries, which the fork replays, from gc, and
    it has no seal of its own. A run whose checkpoint does not load is skipped here
    (``verify_integrity`` reports it)."""
    from onceonly.checkpoint import Codec, OnceOnlyError  # noqa: PLC0415
    from onceonly.runtime import META  # noqa: PLC0415

    problems: list[str] = []
    # A lenient codec: the user's dataclasses are not registered in this process.
    with open_store(url, codec=Codec(strict=False)) as store:

        def scan(cur: Any) -> tuple[list[str], dict[str, str]]:
            cur.execute("SELECT run_id FROM oo_runs WHERE head_seq IS NOT NULL")
            runs = [str(r[0]) for r in cur.fetchall()]
            cur.execute("SELECT run_id, key_run FROM oo_run_links")
            return runs, {str(r): str(k) for r, k in cur.fetchall()}

        runs, links = store.read(scan)
        for run_id in sorted(runs):
            try:
                state = store.load(run_id, lazy=True).state
            except OnceOnlyError:
                continue
            meta = state.get(META)
            key_run = meta.get("key_run") if isinstance(meta, dict) else None
            if not key_run or key_run == run_id or links.get(run_id) == key_run:
                continue
            found = "missing" if run_id not in links else f"names run {links[run_id]!r}"
            problems.append(
                f"run {run_id!r}: a fork of run {key_run!r} (its checkpoint says so), but "
                f"its link row in oo_run_links is {found}: gc would remove the effects the "
                f"fork replays (the fork refuses to act until the row is put back)"
            )
    return problems


def _saver_only(url: str | None) -> bool:
    """Whether the database holds the LangGraph saver's tables and no ledger's."""
    from sqlalchemy import inspect  # noqa: PLC0415

    with open_store(url) as store:
        tables = inspect(store.engine)
        return tables.has_table("oo_lg_checkpoints") and not tables.has_table("oo_effects")


def _verify_saver_database(store: Any) -> tuple[Any, str | None, tuple[int, list[str]]]:
    """A saver-only database checked: its checkpoints and blobs (``verify_integrity``),
    then every saver row (``OnceOnlySaver.verify``), keyed from ``$ONCEONLY_SECRETS``
    when it is set."""
    from onceonly.ledger import AuditReport  # noqa: PLC0415

    report = AuditReport()
    try:
        from onceonly.adapters.langgraph_saver import OnceOnlySaver  # noqa: PLC0415
    except ImportError:
        report.problems.append(
            "the LangGraph saver's rows were not checked: langgraph is not installed "
            "(pip install 'onceonly[langgraph]')"
        )
        return report, None, (0, [])
    ring = keyring(required=False)
    saver = OnceOnlySaver(store, create=False, keyring=ring, unkeyed=ring is None)
    try:
        note = saver.integrity_note
        # The saver attached the keyring's row keys: the checkpoints are checked keyed.
        report.blobs, problems = store.verify_integrity()
        report.problems.extend(problems)
        rows = saver.verify()
    finally:
        saver.close()
    report.problems.extend(rows[1])
    return report, note, rows


def _verify_saver_rows(store: Any) -> tuple[int, list[str]] | None:
    """The LangGraph saver's rows checked (``OnceOnlySaver.verify``), when the database
    has its tables; ``None`` when it has none."""
    from sqlalchemy import inspect  # noqa: PLC0415

    if not inspect(store.engine).has_table("oo_lg_checkpoints"):
        return None
    try:
        from onceonly.adapters.langgraph_saver import OnceOnlySaver  # noqa: PLC0415
    except ImportError:
        return 0, [
            (
                "the LangGraph saver's rows were not checked: langgraph is not installed "
                "(pip install 'onceonly[langgraph]')"
            )
        ]
    saver = OnceOnlySaver(store, create=False, unkeyed=store.integrity is None)
    try:
        return saver.verify()
    finally:
        saver.close()


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


@audit.command("seal")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--as", "--actor", "actor", default=None, metavar="ACTOR", help=AS_HELP)
@click.option("--reason", required=True, help="Why the store's contents are trusted.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit_seal(url: str | None, actor: str | None, reason: str, as_json: bool) -> None:
    """Seal every row written before sealing (or without the keyring), as it stands.

    Run `onceonly audit verify` first: this trusts what is there now.
    """
    who = identity(actor)
    with ledger_on(url, secrets=True) as ledger:
        n = ledger.seal_unsealed()
    if as_json:
        emit_json({"sealed": n, "by": who, "reason": reason})
        return
    click.echo(f"sealed {n} row(s) as {who}: {reason}")


@audit.command("accept-restore")
@click.option("--url", default=None, help=URL_HELP)
@click.option("--as", "--actor", "actor", default=None, metavar="ACTOR", help=AS_HELP)
@click.option("--reason", required=True, help="What was restored and reconciled.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit_accept_restore(url: str | None, actor: str | None, reason: str, as_json: bool) -> None:
    """Accept a store that is behind its witness (ONCEONLY_WITNESS) after a restore.

    Reconcile first what the providers did after the backup: the ledger no longer
    knows those effects. The reset, with who and why, is appended to the witness.
    """
    who = identity(actor)
    with ledger_on(url, secrets=True) as ledger:
        heads = ledger.accept_restore(actor=who, reason=reason)
    if as_json:
        emit_json({"accepted": len(heads), "by": who, "reason": reason})
        return
    click.echo(f"restore accepted by {who}: the witness now holds {len(heads)} chain head(s)")
