"""Schema versions (checked, created, migrated) and state migrations (upgrades on load)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Engine

from . import _schema
from ._engine import make_engine, open_checks, translate
from .errors import StateVersionError
from .records import Snapshot, StateMigrations


def _upgrade(run_id: str, snap: Snapshot, mig: StateMigrations) -> dict[str, Any]:
    version = snap.info.schema_version
    if version > mig.current:
        raise StateVersionError(
            run_id,
            version,
            mig.current,
            f"run {run_id!r} checkpoint {snap.info.seq} has state version {version}, newer "
            f"than this code's {mig.current}; it was written by newer code. Run it with that "
            f"code; nothing was changed.",
        )
    state = snap.state
    while version < mig.current:
        fn = mig.upgrades.get(version)
        if fn is None:
            raise StateVersionError(
                run_id,
                version,
                mig.current,
                f"no upgrade registered from state version {version} to {version + 1}; add "
                f"it to StateMigrations.upgrades. Nothing was changed.",
            )
        state = fn(state)
        if not isinstance(state, dict):
            raise StateVersionError(
                run_id, version, mig.current, f"upgrade from version {version} returned no dict"
            )
        version += 1
    return state


def _check_schema(engine: Engine, *, create: bool) -> None:
    ensure_schema(engine, "checkpoint", _schema.CHECKPOINT_MIGRATIONS, create=create)


def ensure_schema(
    engine: Engine, component: str, migrations: Sequence[_schema.Migration], *, create: bool
) -> None:
    """Check a component's schema version; create it in an empty database if asked.

    Raises:
        SchemaVersionError: Older (run ``onceonly migrate``) or newer (upgrade onceonly).
    """
    have = open_checks(engine, component)
    want = migrations[-1].version
    if have == want:
        return
    if have > want:
        raise _schema.newer_schema_error(component, have, want)
    if have == 0 and create:
        with translate("create the schema"):
            _schema.apply_migrations(engine, component, migrations)
        return
    raise _schema.older_schema_error(component, have, want)


def migrate(url_or_engine: str | Engine, *, sql: bool = False) -> str:
    """Bring the checkpoint schema to this release's version (or return the SQL).

    Args:
        url_or_engine: The database.
        sql: Return the SQL that would run instead of running it.

    Returns:
        The SQL (``sql=True``) or a one-line summary of what was applied.

    Raises:
        SchemaVersionError: The database is newer than this release.
        DatabaseUnavailable: The database cannot be reached.
    """
    return migrate_component(url_or_engine, "checkpoint", _schema.CHECKPOINT_MIGRATIONS, sql=sql)


def migrate_component(
    url_or_engine: str | Engine,
    component: str,
    migrations: Sequence[_schema.Migration],
    *,
    sql: bool = False,
    version_table: bool = True,
) -> str:
    """:func:`migrate` for any schema component (upper layers register their own)."""
    engine = (
        make_engine(url_or_engine, busy_timeout_ms=5000)
        if isinstance(url_or_engine, str)
        else url_or_engine
    )
    try:
        if sql:
            with translate("read the schema version"):
                return _schema.pending_sql(
                    engine, component, migrations, version_table=version_table
                )
        with translate("migrate the schema"):
            n = _schema.apply_migrations(engine, component, migrations)
        return (
            f"{component} schema: applied {n} migration(s); now at version {migrations[-1].version}"
        )
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()
