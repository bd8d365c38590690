"""Record adapter: a row in your own database table, created once (a class B provider).

The row carries the claim's provider key in a unique client-reference column. The insert
is ``INSERT ... ON CONFLICT (reference) DO NOTHING RETURNING ...`` through your own
SQLAlchemy engine (PostgreSQL or SQLite; it may be another database than the ledger's),
so the table itself deduplicates a re-send: if the reference is already there, the
existing row is the result, provided its values are the requested ones (compared by the
database, ``IS NOT DISTINCT FROM``); otherwise the reference was reused for other values
and the insert fails with :class:`ReferenceReuseError`.

Outcomes are classified by where the write failed, not by exception type alone:

* opening the connection failed (refused, unknown database, authentication): nothing was
  sent → NOT_SENT (retried with the same reference);
* an integrity error other than the reference conflict (a check, not-null, foreign key or
  other unique constraint), a data error (value too long, out of range), a programming
  error (missing column, no privilege) or a client-side statement error → REJECTED;
* anything else once the statement was sent — a lost connection, a statement timeout, a
  terminated backend, a lock timeout, a failed ``COMMIT`` — → AMBIGUOUS, settled by the
  probe: ``SELECT`` by reference (happened, with the row; or not happened, then re-sent
  if the retry policy allows). This does not rely on the engine's transaction mode: an
  autocommit engine may have committed the row before the connection died.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Column, Index, String, Table, UniqueConstraint, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    ProgrammingError,
    SQLAlchemyError,
    StatementError,
)
from sqlalchemy.sql import ColumnElement, Select

from onceonly.checkpoint.errors import ConfigurationError, OnceOnlyError
from onceonly.ledger import EffectRecord, Evidence, Ledger, OutcomeClass, ProviderClass

from .context import current_claim
from .guard import Probe, RetryPolicy, guard

__all__ = [
    "GuardedTable",
    "RecordNotSent",
    "RecordOutcomeUnknown",
    "RecordRejected",
    "RecordWriteError",
    "ReferenceReuseError",
    "classify_record",
]

_PROVIDER_KEY_CHARS = 51  # "oo-" + 48 hex characters
_SAME = "_oo_same_"


class RecordWriteError(OnceOnlyError):
    """An insert failed; ``outcome`` says what the evidence allows.

    The message names the driver's error (its first line, without the statement's
    parameters); the driver's exception is chained as ``__cause__``.

    Attributes:
        outcome: NOT_SENT, REJECTED or AMBIGUOUS.
        phase: Where it failed: ``connect``, ``execute`` or ``commit``.
        reference: The client reference of the row.
        code: The database's error code (PostgreSQL SQLSTATE, SQLite error name), if any.
    """

    outcome: OutcomeClass = OutcomeClass.AMBIGUOUS

    def __init__(
        self, message: str, *, phase: str, reference: str, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.reference = reference
        self.code = code


class RecordNotSent(RecordWriteError):
    """The connection could not be opened: nothing was sent."""

    outcome = OutcomeClass.NOT_SENT


class RecordRejected(RecordWriteError):
    """The database refused the row definitely (constraint, data or statement error)."""

    outcome = OutcomeClass.REJECTED


class RecordOutcomeUnknown(RecordWriteError):
    """The statement was sent and the answer was lost: the row may exist."""

    outcome = OutcomeClass.AMBIGUOUS


class ReferenceReuseError(RecordRejected):
    """A row with this effect's reference exists with other values.

    Nothing was written. The reference belongs to another write: the row was changed
    since, or a ledger that lost its history (a restored backup, a second ledger with the
    same secret) re-derived the key for different arguments.

    Attributes:
        columns: The requested columns whose stored values differ.
    """

    def __init__(self, reference: str, columns: Sequence[str], *, phase: str) -> None:
        self.columns = list(columns)
        super().__init__(
            f"a row with reference {reference} exists with other values in "
            f"{', '.join(self.columns)}; nothing was written. Check the row: if it is the "
            f"effect's, resolve the effect with `onceonly effects resolve`; if not, the "
            f"ledger lost its history (restored backup?) and the run must be checked by hand",
            phase=phase,
            reference=reference,
            code="reference_reuse",
        )


def classify_record(exc: BaseException) -> OutcomeClass:
    """The guard's classifier: the adapter's own evidence, else ambiguous."""
    return exc.outcome if isinstance(exc, RecordWriteError) else OutcomeClass.AMBIGUOUS


def _error(phase: str, reference: str, exc: SQLAlchemyError) -> RecordWriteError:
    orig = getattr(exc, "orig", None)
    cause = orig if isinstance(orig, BaseException) else exc
    first = (str(cause).strip().splitlines() or [""])[0]
    code = getattr(cause, "sqlstate", None) or getattr(cause, "sqlite_errorname", None)
    text = f"{phase}: {type(cause).__name__}: {first}"
    kind: type[RecordWriteError]
    if phase == "connect":
        kind = RecordNotSent
    elif isinstance(exc, (IntegrityError, DataError, ProgrammingError)) or not isinstance(
        exc, DBAPIError
    ):  # a StatementError that is not a DBAPIError failed in the client, before sending
        kind = RecordRejected
    else:
        kind = RecordOutcomeUnknown
    return kind(text, phase=phase, reference=reference, code=None if code is None else str(code))


def _unique(table: Table, column: Column[Any]) -> bool:
    if column.unique or list(table.primary_key.columns) == [column]:
        return True
    sets: list[list[Column[Any]]] = [
        list(c.columns) for c in table.constraints if isinstance(c, UniqueConstraint)
    ]
    sets += [list(i.columns) for i in table.indexes if isinstance(i, Index) and i.unique]
    return [column] in sets


class GuardedTable:
    """Insert rows into your own table, each once.

    Args:
        ledger: The effects ledger.
        engine: Your engine (PostgreSQL or SQLite; any database, not only the ledger's).
        table: Your table. Its ``reference`` column must be unique (``unique=True``, a
            one-column ``UniqueConstraint`` or unique ``Index``, or the primary key) and
            a string of at least 51 characters; the database must have that constraint.
        effect: ``name@version`` of the effect (e.g. ``"invoice.create@1"``).
        reference: The client-reference column; the adapter fills it.
        returning: Columns of the recorded result (default: every column). Their values
            must be encodable by the ledger's codec.
        retry: Attempts (not-sent inserts and probe-proven not-happened ones are retried).
        tenant: Tenant for explicit keys.
        subject: Data subject whose key encrypts the payloads (default: the run).

    Raises:
        ConfigurationError: Not PostgreSQL or SQLite, or the reference column is missing,
            not unique, or too short for a provider key.
    """

    def __init__(
        self,
        ledger: Ledger,
        engine: Engine,
        table: Table,
        *,
        effect: str,
        reference: str = "client_reference",
        returning: Sequence[str] | None = None,
        retry: RetryPolicy | None = None,
        tenant: str = "",
        subject: str | None = None,
    ) -> None:
        dialect = engine.dialect.name
        if dialect not in ("postgresql", "sqlite"):
            raise ConfigurationError(f"GuardedTable supports PostgreSQL and SQLite, not {dialect}")
        if reference not in table.c:
            raise ConfigurationError(f"table {table.name} has no column {reference!r}")
        ref = table.c[reference]
        if not _unique(table, ref):
            raise ConfigurationError(
                f"{table.name}.{reference} must be unique (Column(..., unique=True)): the "
                f"table deduplicates re-sends by it"
            )
        length = getattr(ref.type, "length", None)
        if not isinstance(ref.type, String) or (length is not None and length < 51):
            raise ConfigurationError(
                f"{table.name}.{reference} must be a string of at least "
                f"{_PROVIDER_KEY_CHARS} characters (it holds the provider key)"
            )
        names = list(returning) if returning is not None else [c.name for c in table.columns]
        missing = [n for n in names if n not in table.c]
        if missing:
            raise ConfigurationError(f"table {table.name} has no columns {missing}")
        self.ledger = ledger
        self.engine = engine
        self.table = table
        self.effect = effect
        self.reference = reference
        self.retry = retry
        self.tenant = tenant
        self.subject = subject
        self._insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        self._returning = [table.c[n] for n in names]

    def insert(self, values: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
        """Insert one row once; later calls with the same key replay the result.

        Args:
            values: Column values, without the reference column (the adapter sets it).
            key: An explicit key (outside a step, or when the position is not stable).

        Returns:
            The row's ``returning`` columns, as inserted (or as found by the probe).

        Raises:
            ConfigurationError: Unknown columns, or the reference column given, or no
                step is current and no key is given.
            RecordNotSent: The connection could not be opened (after the policy's attempts).
            RecordRejected: The database refused the row (replayed as ``EffectFailed``);
                :class:`ReferenceReuseError` if the reference holds other values.
            RecordOutcomeUnknown: The probe proved the row absent on every attempt.
            ledger.EffectInDoubt: The outcome was lost and the probe could not tell.
            ledger.KeyReuseError: The key was recorded with other values.
        """
        unknown = sorted(set(values) - set(self.table.c.keys()))
        if unknown:
            raise ConfigurationError(f"table {self.table.name} has no columns {unknown}")
        if self.reference in values:
            raise ConfigurationError(f"GuardedTable sets {self.reference} itself; remove it")
        row = dict(values)
        guarded: Callable[[dict[str, Any]], dict[str, Any]] = guard(
            self.ledger,
            effect=self.effect,
            provider_class=ProviderClass.QUERYABLE,
            key=None if key is None else (lambda *_a, **_k: key),
            tenant=self.tenant,
            retry=self.retry,
            classify=classify_record,
            probe=self._probe(row),
            subject=self.subject,
        )(self._write)
        return guarded(row)

    def lookup(self, reference: str, values: Mapping[str, Any]) -> dict[str, Any] | None:
        """The row with ``reference``, or None.

        Raises:
            ReferenceReuseError: The row exists with other values.
            sqlalchemy.exc.SQLAlchemyError: The database could not be asked.
        """
        with self.engine.connect() as conn:
            found = conn.execute(self._match(reference, values)).mappings().first()
            conn.rollback()
        return None if found is None else self._result(reference, found, "probe")

    # -- inside the guard ---------------------------------------------------------------

    def _probe(self, values: dict[str, Any]) -> Probe:
        def probe(record: EffectRecord) -> tuple[Evidence, Any]:
            try:
                found = self.lookup(record.provider_key, values)
            except ReferenceReuseError:
                return Evidence.INCONCLUSIVE, None  # not ours to claim: a human decides
            except SQLAlchemyError:
                return Evidence.INCONCLUSIVE, None
            if found is None:
                return Evidence.NOT_HAPPENED, None
            return Evidence.HAPPENED, found

        return probe

    def _write(self, values: dict[str, Any]) -> dict[str, Any]:
        reference = current_claim().provider_key
        stmt = (
            self._insert(self.table)
            .values({**values, self.reference: reference})
            .on_conflict_do_nothing(index_elements=[self.table.c[self.reference]])
            .returning(*self._returning)
        )
        phase = "connect"
        try:
            with self.engine.connect() as conn:
                phase = "execute"
                with conn.begin():
                    row = conn.execute(stmt).mappings().first()
                    found = None
                    if row is None:  # the reference exists: a re-send, or a reuse
                        found = conn.execute(self._match(reference, values)).mappings().first()
                    phase = "commit"
        except StatementError as exc:
            raise _error(phase, reference, exc) from exc
        except SQLAlchemyError as exc:
            if phase == "connect":
                raise _error(phase, reference, exc) from exc
            raise
        if row is not None:
            return {str(c.name): row[c.name] for c in self._returning}
        if found is None:  # deleted between the conflict and the read
            raise RecordOutcomeUnknown(
                f"reference {reference} conflicted but no row was found",
                phase="execute",
                reference=reference,
            )
        return self._result(reference, found, "execute")

    def _match(self, reference: str, values: Mapping[str, Any]) -> Select[Any]:
        """The row by reference, with one ``IS NOT DISTINCT FROM`` flag per requested
        column: the database compares with its own type coercion."""
        same: list[ColumnElement[Any]] = [
            self.table.c[name].is_not_distinct_from(value).label(f"{_SAME}{name}")
            for name, value in values.items()
        ]
        return select(*self._returning, *same).where(self.table.c[self.reference] == reference)

    def _result(self, reference: str, found: Mapping[Any, Any], phase: str) -> dict[str, Any]:
        differ = [k[len(_SAME) :] for k, v in found.items() if k.startswith(_SAME) and not v]
        if differ:
            raise ReferenceReuseError(reference, differ, phase=phase)
        return {str(c.name): found[c.name] for c in self._returning}
