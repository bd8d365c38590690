"""What the ``onceonly`` commands share: the database URL, the keyring, the operator's
identity, typed parameters (durations, JSON, hashes), JSON output, tables and progress.

Only click is imported here at module level: ``onceonly --help`` must not pay for the
store, the ledger or rich (each is imported by the command that uses it)."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from onceonly.checkpoint import Codec, Store
    from onceonly.ledger import EffectRecord, Keyring, Ledger
    from onceonly.operator import Operator

DEFAULT_URL = "sqlite:///onceonly.db"
URL_HELP = "Database URL (env ONCEONLY_DATABASE_URL; default sqlite:///onceonly.db)."
AS_HELP = "Your identity, recorded with the action (default: $USER)."

url_option = click.option("--url", default=None, help=URL_HELP)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
actor_option = click.option("--as", "actor", default=None, metavar="ACTOR", help=AS_HELP)


def db_url(url: str | None) -> str:
    """The database URL: the option, else ``$ONCEONLY_DATABASE_URL``, else the default."""
    return url or os.environ.get("ONCEONLY_DATABASE_URL") or DEFAULT_URL


def known_secrets(argv: Sequence[str]) -> tuple[str, ...]:
    """What must never be printed: the passwords of the database URLs this command may
    use (``--url`` / ``--db`` in ``argv``, ``$ONCEONLY_DATABASE_URL``) and the secrets of
    ``$ONCEONLY_SECRETS`` (every entry's text after its id, and any malformed entry)."""
    urls = [os.environ.get("ONCEONLY_DATABASE_URL") or ""]
    for i, arg in enumerate(argv):
        for flag in ("--url", "--db"):
            if arg == flag and i + 1 < len(argv):
                urls.append(argv[i + 1])
            elif arg.startswith(flag + "="):
                urls.append(arg[len(flag) + 1 :])
    out = [pw for u in urls if u and (pw := _password(u))]
    for item in (os.environ.get("ONCEONLY_SECRETS") or "").split(","):
        _, sep, value = item.strip().partition(":")
        out.append(value if sep else item.strip())
    return tuple(s for s in out if s)


def _password(url: str) -> str | None:
    from onceonly.checkpoint._engine import url_password  # noqa: PLC0415

    # a URL's or a libpq connection string's; redact() masks an unparsable one by shape
    return url_password(url)


def masked(text: str, argv: Sequence[str]) -> str:
    """``text`` with database passwords and keyring secrets masked (see
    :func:`checkpoint.redact` and :func:`known_secrets`)."""
    from onceonly.checkpoint import redact  # noqa: PLC0415

    return redact(text, *known_secrets(argv))


def keyring(required: bool) -> Keyring | None:
    """The keyring from ``$ONCEONLY_SECRETS``; when not ``required`` and unset, None (a
    read-only view: listing and showing metadata need no secret, but then nothing is
    checked against its seal, and nothing can be written)."""
    from onceonly.checkpoint.errors import ConfigurationError  # noqa: PLC0415
    from onceonly.ledger import Keyring  # noqa: PLC0415

    try:
        return Keyring.from_env()
    except ConfigurationError:
        if required:
            raise
        return None


def open_ledger(store: Store, *, required: bool, **kwargs: Any) -> Ledger:
    """A ledger on ``store``: keyed from ``$ONCEONLY_SECRETS``, or read-only without it
    (when not ``required``)."""
    from onceonly.ledger import Keyring, Ledger, Secret  # noqa: PLC0415

    ring = keyring(required=required)
    if ring is None:
        return Ledger(
            store, Keyring([Secret("read-only", os.urandom(32))]), read_only=True, **kwargs
        )
    return Ledger(store, ring, **kwargs)


def identity(given: str | None) -> str:
    """The operator's identity: ``--as``, else ``$USER``, else the login name.

    Raises:
        ConfigurationError: Neither is known (an action is never recorded anonymously).
    """
    from onceonly.checkpoint.errors import ConfigurationError  # noqa: PLC0415

    if given is not None:
        if not given.strip():
            raise ConfigurationError("--as: the identity is empty")
        return given
    if os.environ.get("USER", "").strip():
        return os.environ["USER"]
    with contextlib.suppress(Exception):  # getpass raises OSError or KeyError without one
        name = getpass.getuser()  # $LOGNAME, $LNAME, $USERNAME, then the user database
        if name:
            return name
    raise ConfigurationError("cannot tell who you are: pass --as ACTOR (or set $USER)")


@contextlib.contextmanager
def open_store(url: str | None, **kwargs: Any) -> Iterator[Store]:
    """A :class:`checkpoint.Store` on an existing database (the schema is never created,
    and neither is a SQLite file: a mistyped path is refused, not made)."""
    from onceonly.checkpoint import Store  # noqa: PLC0415

    target = db_url(url)
    sqlite_path(target, must_exist=True)
    with Store.open(target, create=False, **kwargs) as store:
        yield store


def sqlite_path(url: str, *, must_exist: bool) -> str | None:
    """The file of a ``sqlite:///PATH`` URL (None for other URLs), checked: its directory
    exists, and with ``must_exist`` the file too (SQLite would create an empty one, and
    the command would then report a missing schema instead of a mistyped path).

    Raises:
        ConfigurationError: The directory or the file is missing.
    """
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy import make_url  # noqa: PLC0415
    from sqlalchemy.exc import ArgumentError  # noqa: PLC0415

    from onceonly.checkpoint.errors import ConfigurationError  # noqa: PLC0415

    try:
        path = make_url(url).database
    except (ArgumentError, ValueError):
        return None  # the store reports a malformed URL
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigurationError(
            f"no directory {folder!r} for the SQLite database {path!r} (SQLite needs no "
            "server: check the path in the URL); nothing was written"
        )
    if must_exist and not os.path.exists(path):
        raise ConfigurationError(
            f"no SQLite database at {path!r} (a mistyped path? nothing was created); "
            f"create one with `onceonly migrate --url {url}`"
        )
    return path


@contextlib.contextmanager
def operator(url: str | None) -> Iterator[Operator]:
    """An :class:`Operator` on an existing database (the schema is never created here).
    Operators write sealed rows: ``$ONCEONLY_SECRETS`` is required.

    The store's codec is lenient, so values of dataclasses this process has not
    registered are shown rather than refused, and written back exactly as they were
    stored (as :class:`checkpoint.Opaque` values) by every action that saves a state.
    """
    from onceonly.checkpoint import Codec  # noqa: PLC0415
    from onceonly.operator import Operator  # noqa: PLC0415

    with open_store(url, codec=Codec(strict=False)) as store:
        ledger = open_ledger(store, required=True, create=False)
        try:
            yield Operator(store, ledger)
        finally:
            ledger.close()


@contextlib.contextmanager
def ledger_on(url: str | None, *, secrets: bool = False) -> Iterator[Ledger]:
    """The effects ledger on an existing database."""
    with open_store(url) as store:
        ledger = open_ledger(store, required=secrets, create=False)
        try:
            yield ledger
        finally:
            ledger.close()


def emit_json(doc: Any) -> None:
    """Print ``doc`` as one line of JSON on stdout."""
    click.echo(json.dumps(doc, ensure_ascii=False, default=str))


def plain(codec: Codec, value: Any) -> Any:
    """A stored value as JSON: tagged values in the codec's canonical JSON form, values
    of types this process does not know as ``{"$unknown": tag, "value": ...}``."""
    return codec.readable(value)


def record_json(rec: EffectRecord) -> dict[str, object]:
    """An effect's metadata as JSON."""
    d = dict(rec.__dict__)
    for k in ("status", "provider_class", "outcome_class"):
        d[k] = None if d[k] is None else str(d[k])
    return d


def ago(t: float | None, now: float | None = None) -> str:
    """``t`` relative to now: ``in 5m``, ``3h ago``, ``-``."""
    if t is None:
        return "-"
    delta = t - (time.time() if now is None else now)
    text = format_duration(abs(delta))
    return f"in {text}" if delta >= 0 else f"{text} ago"


def format_duration(seconds: float) -> str:
    """``90061`` → ``1d1h``; the two largest units."""
    s = round(seconds)
    parts: list[str] = []
    for unit, size in _UNITS:
        if s >= size or (unit == "s" and not parts):
            parts.append(f"{s // size}{unit}")
            s %= size
        if len(parts) == 2:
            break
    return "".join(parts)


_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_SIZES = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a sum like ``1h30m``.

    Raises:
        ValueError: Anything else (a bare number is refused: say its unit).
    """
    t = text.strip().lower()
    if not t or _DURATION.sub("", t):
        raise ValueError(f"{text!r} is not a duration; use e.g. 30d, 12h, 90m, 45s or 1h30m")
    return sum(float(n) * _SIZES[u] for n, u in _DURATION.findall(t))


if TYPE_CHECKING:  # generic since click 8.4; plain classes before (click>=8.1 is supported)
    _FloatParam = click.ParamType[float]
    _AnyParam = click.ParamType[Any]
    _StrParam = click.ParamType[str]
else:
    _FloatParam = _AnyParam = _StrParam = click.ParamType


class Duration(_FloatParam):
    """A duration such as ``30d`` (seconds as a float)."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class JsonValue(_AnyParam):
    """A JSON document (its parsed value)."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except ValueError as exc:
            self.fail(f"{value!r} is not JSON ({exc}); quote strings: '\"text\"'", param, ctx)


class Hash(_StrParam):
    """A subject hash: 64 hex digits, as ``onceonly runs show`` prints it."""

    name = "hash"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", text):
            self.fail(
                f"{value!r} is not a subject hash (64 hex digits); copy it from "
                f"`onceonly runs show RUN`",
                param,
                ctx,
            )
        return text


DURATION = Duration()
JSON = JsonValue()
HASH = Hash()


@contextlib.contextmanager
def progress(description: str, total: float | None = None) -> Iterator[Progress]:
    """A progress display on stderr (stdout stays clean for ``--json`` and pipes);
    silent when stderr is not a terminal."""
    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = make_console(stderr=True)
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),  # it may hold a path
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with bar:
        bar.add_task(description, total=total)
        yield bar


def make_console(*, stderr: bool = False, soft_wrap: bool = True) -> Console:
    """A console that never reads what it prints as markup: run ids, flow names, reasons
    and paths are the user's text (``po[/x]`` is printed as it is, not parsed). Styles are
    given as :class:`rich.text.Text` styles instead. Lines are not wrapped at the terminal
    width (``soft_wrap``: a command to copy stays one line) unless told otherwise."""
    from rich.console import Console  # noqa: PLC0415

    return Console(stderr=stderr, markup=False, highlight=False, soft_wrap=soft_wrap)


def styled(text: str, style: str) -> Any:
    """``text`` in ``style`` (a :class:`rich.text.Text`; never parsed as markup)."""
    from rich.text import Text  # noqa: PLC0415

    return Text(text, style)


def is_terminal() -> bool:
    """Whether stdout is a terminal (tables), or a pipe or file (the plain layout)."""
    return sys.stdout.isatty()


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], **layout: Any
) -> None:
    """Print rows under their column headings on stdout.

    On a terminal: a table fitted to its width; the columns named in ``fold`` may wrap,
    the others never do (ids stay whole on one line, to copy). Piped or redirected: a
    plain layout, one line per row with the columns padded and separated by two spaces;
    no borders, no colour, nothing wrapped or shortened (a line break in a cell becomes
    ``; ``, an empty cell ``-``), for ``grep``, ``cut`` and ``less``.

    Args:
        title: The table's title (not printed in the plain layout).
        columns: The column headings.
        rows: The cells, as plain text (never read as markup).
        layout: ``fold`` (headings of columns that may wrap), ``right`` (right-aligned).
    """
    if not is_terminal():
        _plain_table(columns, rows)
        return
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    fold = set(layout.get("fold", ()))
    right = set(layout.get("right", ()))
    table: Table = Table(title=Text(title), title_justify="left")
    for col in columns:
        table.add_column(
            Text(col),
            no_wrap=col not in fold,
            overflow="fold",
            justify="right" if col in right else "left",
        )
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    make_console(soft_wrap=False).print(table)


def _plain_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    cells = [list(columns)]
    cells += [[(c.replace("\n", "; ") or "-") for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        line = "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
        click.echo(line.rstrip())
