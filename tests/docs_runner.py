"""Run the snippets of a markdown page as a reader following it would.

A page is cut into fenced blocks. In page order:

- a block right after the visible line ``*(Not run by the tests: REASON.)*`` is skipped
  (with the ``text`` block that shows its output, if any); the reason must not be empty;
- a ``python`` block right after ``<!-- file: NAME -->`` is written to ``NAME`` in the
  page's working directory (the page runs it later, e.g. ``python NAME``);
- any other ``python`` block runs in the page's Python session: one interpreter per page,
  one namespace, the working directory and the environment of the page's shell (top-level
  ``await`` runs on the session's event loop);
- an ``sh`` block (also ``bash``, ``shell``, ``console``) runs with ``bash`` in the
  page's working directory, with the venv's ``bin`` first on ``PATH``; the environment
  it ends with (``export``, ``cd``) is the next block's, so a page is one shell session.
  Its last command must succeed. A block whose output the page does not show runs under
  ``set -e`` (every command must succeed) unless it reads ``$?``; one whose output the
  page shows may have a command fail in the middle, as in a reader's shell, since the
  output (its ``error:`` line) is compared. A page shows a failing last command with
  ``echo "exit status: $?"``;
- a ``text`` block separated from the block before it by blank lines only is that block's
  expected output (stdout and stderr, interleaved), compared after :func:`normalise`;
  a line ``...`` (or ``…``) on the page stands for any lines; after
  ``<!-- output: loose -->`` hex runs of 16 digits or more are placeholders too (hashes
  of contents with a time in them), and each non-blank line of the page must appear in
  the output, in order;
- other blocks (``text`` elsewhere, ``sql``, ``ini``...) are illustrations;
- a ``file:`` block must be used by a later block of the page that runs (its name, or
  its module name, appears in it): a file written and never run is not checked.

With ``ONCEONLY_DOCS_REGENERATE=1`` (see :mod:`tests.test_docs`) a ``text`` block whose
output differs is rewritten in place with what the snippet printed (ids, times and paths
as they came out; the normaliser makes them placeholders on the next run). A block that
elides lines (``...``) or is compared loosely is not rewritten: its mismatch fails as
usual, to be edited by hand.

Each page starts in a fresh directory, with ``HOME`` inside it, nothing of the test
process's environment but the locale, and ``COLUMNS=200`` ("a terminal wide enough not to
wrap long lines"); :mod:`tests.test_docs` gives the PostgreSQL pages a fresh database in
``ONCEONLY_DATABASE_URL``.

``reference.md`` holds signatures, not programs: its ``python`` blocks are checked against
the code by :mod:`tests.docs_signatures`.

Run as a script, this module is the page's Python session (see :class:`PythonSession`).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import difflib
import io
import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
BLOCK_TIMEOUT_S = 120.0

SHELL_LANGS = frozenset({"sh", "bash", "shell", "console"})
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_HIDDEN_SKIP = re.compile(r"^\s*<!--\s*not run\b")
_MARKER = re.compile(
    r"^\s*(?:<!--\s*(?P<kind>file|output)\s*:\s*(?P<value>.*?)\s*-->"
    # The one a reader sees: a block the tests do not run says so on the page.
    r"|\*\((?P<skip>Not run by the tests)(?::\s*(?P<reason>.*?))?\.?\)\*)\s*$"
)


class DocError(AssertionError):
    """A snippet failed, or its output is not what the page shows."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    path: Path
    line: int  # of the opening fence, 1-based
    end_line: int  # of the closing fence
    lang: str
    code: str
    marker: tuple[str, str] | None  # ("not run" | "file" | "output", value) right before it
    follows_block: bool  # only blank lines since the previous block's closing fence

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def parse_page(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, in order, each with the marker right before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    last_end = -10
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        indent, lang = m.group("indent"), m.group("lang")
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise DocError(f"{path.name}:{i + 1}: unclosed ``` fence")
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]
        ]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = None
        if k >= 0 and _HIDDEN_SKIP.match(lines[k]):
            raise DocError(
                f"{path.name}:{k + 1}: a block the tests skip says so visibly: "
                f"*(Not run by the tests: REASON.)*"
            )
        if k >= 0 and (mm := _MARKER.match(lines[k])):
            if mm.group("skip"):
                marker = ("not run", mm.group("reason") or "")
            else:
                marker = (mm.group("kind"), mm.group("value"))
            if marker[0] == "not run" and not marker[1]:
                raise DocError(f"{path.name}:{k + 1}: a `not run` marker needs a reason")
        blocks.append(
            Block(
                path=path,
                line=i + 1,
                end_line=j + 1,
                lang=lang,
                code="\n".join(body) + "\n",
                marker=marker,
                follows_block=k == last_end - 1,
            )
        )
        last_end = j + 1
        i = j + 1
    return blocks


# What cannot be the same from one run to the next, replaced on both sides by a placeholder.
# Everything else is compared exactly (trailing blanks of lines aside).
_NORMALISE: tuple[tuple[re.Pattern[str], str], ...] = (
    # a shell's report of a child killed by SIGKILL: bash -c says "line 3: 123 Killed
    # cmd", an interactive shell "Killed"; pages show it or not
    (re.compile(r"^(?:.*line \d+: +\d+ )?Killed\b.*\n?", re.MULTILINE), ""),
    # ISO dates and times, with or without seconds, fraction and zone
    (
        re.compile(
            r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?)?(?:Z|[+-]\d{2}:?\d{2})?"
        ),
        "<time>",
    ),
    # UNIX times (seconds since 1970, with a fraction), as JSON output has them
    (re.compile(r"\b1[5-9]\d{8}\.\d+\b"), "<unixtime>"),
    # durations measured, not configured: a number with a fraction, in s or ms
    (re.compile(r"\b\d+\.\d+ ?m?s\b"), "<duration>"),
    # a worker's default name, host:pid
    (re.compile(r"(?<=worker )[\w.-]+:\w+\b"), "<host:pid>"),
    # ages and time left, relative to now, as tables show them ("3s ago", "in 23h59m")
    (re.compile(r"\b\d+[smhd] ago\b"), "<ago>"),
    (re.compile(r"(?<=in )\d+[dhms](?:\d+[hms])?\b"), "<left>"),
)
_TABLE_ROW = re.compile(r"[│┃┏┡└┗┌╭╰]")


def _table_line(line: str) -> str:
    """A line of a rich table, its column widths left out (they follow what the
    placeholders replaced): runs of blanks and of rules become one."""
    line = re.sub(r"━+", "━", line)
    line = re.sub(r"─+", "─", line)
    return re.sub(r" {2,}", " ", line).strip()


def _plain_line(line: str) -> str:
    """A line of anything else, the padding between its columns left out (a plain
    table pads each column to its widest cell, which follows the placeholders): inner
    runs of blanks become two; the indentation stays."""
    body = line.lstrip(" ")
    return line[: len(line) - len(body)] + re.sub(r" {2,}", "  ", body)


def normalise(text: str, *, workdir: Path | None = None) -> str:
    """``text`` with what differs between runs replaced by placeholders.

    Lines lose their trailing blanks, and the text its leading and trailing blank lines.
    """
    if workdir is not None:
        text = text.replace(str(workdir), "<workdir>")
    for pattern, placeholder in _NORMALISE:
        text = pattern.sub(placeholder, text)
    lines = [line.rstrip() for line in text.splitlines()]
    lines = [_table_line(line) if _TABLE_ROW.search(line) else _plain_line(line) for line in lines]
    # a table's title, centred over the table
    lines = [
        line.strip() if i + 1 < len(lines) and lines[i + 1].startswith(("┏", "┌")) else line
        for i, line in enumerate(lines)
    ]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _compare(expected: str, actual: str, *, loose: bool) -> str | None:
    """``None`` when ``actual`` matches ``expected``, else a diff saying how it does not."""
    if not loose:
        # a line "..." or "…" on the page stands for any lines (output the page leaves out)
        parts = [
            r"(?:[^\n]*\n)*?" if line.strip() in ("...", "…") else re.escape(line) + r"\n"
            for line in expected.splitlines()
        ]
        if re.fullmatch("".join(parts), actual + "\n"):
            return None
        diff = difflib.unified_diff(
            expected.splitlines(), actual.splitlines(), "page", "actual", lineterm=""
        )
        return "\n".join(diff)
    # loose: hashes and digests too (of contents with a time in them) are placeholders
    expected, actual = (re.sub(r"\b[0-9a-f]{16,}\b", "<hex>", t) for t in (expected, actual))
    got = iter(actual.splitlines())
    for want in (line for line in expected.splitlines() if line.strip()):
        if not any(line == want for line in got):
            return f"loose output: line not found (in order): {want!r}\n--- actual\n{actual}"
    return None


@dataclasses.dataclass
class PageStats:
    """What a page run did."""

    run: int = 0
    skipped: int = 0
    files: int = 0
    compared: int = 0
    checked_signatures: int = 0
    regenerated: int = 0
    not_run: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    """(line, language, reason) of each block a ``not run`` marker skips."""


def _fail(block: Block, what: str, detail: str) -> DocError:
    return DocError(f"{block.where}: {block.lang} block {what}\n--- block\n{block.code}{detail}")


class PythonSession:
    """One interpreter for a page's inline ``python`` blocks (a reader's REPL)."""

    def __init__(self, cwd: Path) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--session"],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_base_env(cwd),
        )

    def run(self, code: str, *, cwd: Path, env: dict[str, str], where: str) -> tuple[bool, str]:
        """Run ``code``; return whether it raised nothing, and what it printed."""
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        request = {"code": code, "cwd": str(cwd), "env": env, "where": where}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(BLOCK_TIMEOUT_S):
                self.close()
                return False, f"timed out after {BLOCK_TIMEOUT_S} s"
        line = self._proc.stdout.readline()
        if not line:
            return False, f"the session died (exit status {self._proc.wait()})"
        reply = json.loads(line)
        return bool(reply["ok"]), str(reply["output"])

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()


def _base_env(cwd: Path) -> dict[str, str]:
    """A reader's environment: the project's venv first on PATH, nothing of the test's."""
    keep = ("LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "TERM")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.setdefault("LANG", "C.UTF-8")
    home = cwd / ".home"
    home.mkdir(exist_ok=True)
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
        VIRTUAL_ENV=str(VENV_BIN.parent),
        HOME=str(home),
        TMPDIR=str(cwd / ".tmp"),
        PYTHONDONTWRITEBYTECODE="1",
        # "a terminal wide enough not to wrap long lines" (rich reads it for its tables)
        COLUMNS="200",
    )
    (cwd / ".tmp").mkdir(exist_ok=True)
    return env


_SHELL_STATE_SKIP = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})


def run_sh(
    code: str, *, cwd: Path, env: dict[str, str], every_command: bool
) -> tuple[int, str, Path, dict[str, str]]:
    """Run ``code`` with bash (under ``set -e`` if ``every_command`` must succeed); return
    its status, output, and the directory and environment it ended with."""
    state = Path(tempfile.mkdtemp(prefix="sh-", dir=env.get("TMPDIR")))
    prologue = "set -e\n" if every_command else ""
    script = (
        f"trap 'env -0 > {state}/env; pwd > {state}/cwd' EXIT\n"
        f"cd {json.dumps(str(cwd))}\n{prologue}{code}"
    )
    try:
        proc = subprocess.run(
            ["bash", "-c", script],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return -1, out + f"\n[timed out after {BLOCK_TIMEOUT_S} s]", cwd, env
    new_env = dict(env)
    if (state / "env").exists():
        pairs = (item.partition("=") for item in (state / "env").read_text().split("\0") if item)
        new_env = {k: v for k, _, v in pairs if k not in _SHELL_STATE_SKIP}
    new_cwd = Path((state / "cwd").read_text().strip()) if (state / "cwd").exists() else cwd
    return proc.returncode, proc.stdout, new_cwd, new_env


def _regenerable(block: Block) -> bool:
    """Whether regenerating may rewrite ``block`` (it shows every line, compared exactly)."""
    elides = any(line.strip() in ("...", "…") for line in block.code.splitlines())
    return not elides and block.marker != ("output", "loose")


def _check_used(block: Block, later: list[Block]) -> None:
    """Raise :class:`DocError` unless a later block that runs uses the file ``block`` writes."""
    assert block.marker is not None
    name = block.marker[1]
    stem = Path(name).with_suffix("").as_posix()
    names = {name, stem.replace("/", "."), Path(stem).name}
    for other in later:
        if other.marker is not None and other.marker[0] == "not run":
            continue
        if other.marker is not None and other.marker == ("file", name):
            break  # rewritten: this version had to be used before
        if other.lang not in SHELL_LANGS | {"python"}:
            continue
        if any(re.search(rf"(?<![\w/.-]){re.escape(n)}(?![\w-])", other.code) for n in names):
            return
    raise DocError(
        f"{block.where}: the file {name} is written but no later block that runs uses it"
    )


def regenerate(path: Path, outputs: list[tuple[Block, str]], workdir: Path) -> None:
    """Rewrite the ``text`` blocks of ``outputs`` in ``path`` with the output each got."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for block, output in sorted(outputs, key=lambda bo: bo[0].line, reverse=True):
        fence = lines[block.line - 1]
        indent = fence[: len(fence) - len(fence.lstrip())]
        text = output.replace(str(workdir), "<workdir>")
        body = [line.rstrip() for line in text.strip("\n").splitlines()]
        # a line that differs only in what the normaliser replaces (a time, an age) is
        # kept as the page has it, so that a regeneration changes what changed only
        shown = block.code.splitlines()
        body = [
            shown[i] if i < len(shown) and normalise(shown[i]) == normalise(line) else line
            for i, line in enumerate(body)
        ]
        new = [f"{indent}{line}\n" if line else "\n" for line in body]
        lines[block.line : block.end_line - 1] = new
    path.write_text("".join(lines), encoding="utf-8")


def _shows_output(block: Block) -> bool:
    return block.lang == "text" and block.follows_block


def run_page(
    path: Path,
    workdir: Path,
    *,
    extra_env: dict[str, str] | None = None,
    signatures: Callable[[Block], None] | None = None,
    on_mismatch: Callable[[Block, str], None] | None = None,
) -> PageStats:
    """Run every snippet of ``path`` in ``workdir``; raise :class:`DocError` at the first
    one that fails or prints other than the page shows."""
    blocks = parse_page(path)
    stats = PageStats()
    env = _base_env(workdir) | (extra_env or {})
    cwd = workdir
    session: PythonSession | None = None
    try:
        skip_output = False
        last_output: tuple[Block, str] | None = None
        for i, block in enumerate(blocks):
            if block.lang == "text":
                if block.follows_block and skip_output:
                    stats.skipped += 1
                elif block.follows_block and last_output is not None:
                    ran, output = last_output
                    loose = block.marker == ("output", "loose")
                    diff = _compare(
                        normalise(block.code), normalise(output, workdir=workdir), loose=loose
                    )
                    if diff is not None and on_mismatch is not None and _regenerable(block):
                        on_mismatch(block, output)
                        stats.regenerated += 1
                    elif diff is not None:
                        raise _fail(ran, f"printed other than {block.where} shows", "\n" + diff)
                    stats.compared += 1
                last_output, skip_output = None, False
                continue
            last_output, skip_output = None, False
            if block.marker is not None and block.marker[0] == "not run":
                stats.skipped += 1
                stats.not_run.append((block.line, block.lang, block.marker[1]))
                skip_output = True
                continue
            if block.lang == "python" and block.marker is not None and block.marker[0] == "file":
                target = cwd / block.marker[1]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.code, encoding="utf-8")
                stats.files += 1
                _check_used(block, blocks[i + 1 :])
                continue
            if block.lang == "python" and signatures is not None:
                signatures(block)
                stats.checked_signatures += 1
                continue
            if block.lang == "python":
                if session is None:
                    session = PythonSession(workdir)
                ok, output = session.run(block.code, cwd=cwd, env=env, where=block.where)
                if not ok:
                    raise _fail(block, "raised", f"--- output\n{output}")
            elif block.lang in SHELL_LANGS:
                shown = i + 1 < len(blocks) and _shows_output(blocks[i + 1])
                every = not shown and "$?" not in block.code
                status, output, cwd, env = run_sh(block.code, cwd=cwd, env=env, every_command=every)
                if status != 0:
                    raise _fail(block, f"failed (exit status {status})", f"--- output\n{output}")
            else:
                continue
            stats.run += 1
            last_output = (block, output)
    finally:
        if session is not None:
            session.close()
    return stats


# --- the session side -------------------------------------------------------------------------


@contextlib.contextmanager
def _captured_fds() -> Iterator[io.StringIO]:
    """Capture fds 1 and 2 (so that child processes' output is caught too)."""
    sink = io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(1), os.dup(2)
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield sink
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            sink.write(tmp.read().decode("utf-8", "replace"))


def _serve() -> None:
    """Read requests from stdin, one JSON line each; answer on the original stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    sys.path[0] = ""  # the working directory, as in an interactive session
    namespace: dict[str, Any] = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        request = json.loads(line)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        ok = True
        with _captured_fds() as out:
            try:
                code = compile(
                    request["code"],
                    request["where"],
                    "exec",
                    flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                )
                result = eval(code, namespace)  # noqa: S307 - the page's own snippet
                if asyncio.iscoroutine(result):
                    loop.run_until_complete(result)
            except BaseException:  # noqa: BLE001 - any failure of the block is reported
                ok = False
                traceback.print_exc()
        replies.write(json.dumps({"ok": ok, "output": out.getvalue()}) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--session"]:
    _serve()
