"""Every page of docs/ and the README, run as a reader following it would.

Each page is one test: its snippets run in order in a fresh directory (see
:mod:`tests.docs_runner` for the rules and the markers), and the first one that fails or
prints other than the page shows fails the test with the page, the line, the block and the
diff.

``ONCEONLY_DOCS_REGENERATE=1`` rewrites the outputs a page shows with what its snippets
print now, in place (after a change of the CLI's tables, say); review the diff, then run
again without it. Every block a visible ``*(Not run by the tests: REASON.)*`` line skips
is listed in the test's ``docs`` property and counted by
``test_not_run_blocks_are_few_and_say_why``.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .docs_runner import (
    REPO,
    SHELL_LANGS,
    Block,
    DocError,
    normalise,
    parse_page,
    regenerate,
    run_page,
)
from .docs_signatures import check_signature, section_of

PAGES = sorted([*REPO.glob("docs/*.md"), REPO / "README.md"])

# Pages written for a PostgreSQL server: the reader has exported ONCEONLY_DATABASE_URL
# (the page's own `export` names a server we do not have, and is not run).
POSTGRESQL_PAGES = frozenset({"howto-postgresql.md", "howto-workers-postgresql.md"})
# How many blocks may carry a `not run` marker (templates with placeholders, servers we do
# not have, consoles that serve until stopped); lower it when one of them is made to run.
NOT_RUN_BUDGET = 36
REGENERATE = os.environ.get("ONCEONLY_DOCS_REGENERATE") == "1"


@pytest.fixture
def fresh_pg_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A new, empty PostgreSQL database on the test server, dropped afterwards."""
    server: str = request.getfixturevalue("pg_server_url")
    name = "docs_" + uuid.uuid4().hex[:12]
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        base, _, query = server.partition("?")
        yield base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    extra = {}
    if page.name in POSTGRESQL_PAGES:
        extra["ONCEONLY_DATABASE_URL"] = request.getfixturevalue("fresh_pg_url")
    lines = page.read_text(encoding="utf-8").splitlines()
    problems: list[str] = []

    def signature(block: Block) -> None:
        try:
            check_signature(block, section_of(lines, block.line))
        except DocError as exc:
            problems.append(str(exc))  # every wrong signature at once, not the first only

    outputs: list[tuple[Block, str]] = []
    try:
        stats = run_page(
            page,
            tmp_path,
            extra_env=extra,
            signatures=signature if page.name == "reference.md" else None,
            on_mismatch=(lambda block, output: outputs.append((block, output)))
            if REGENERATE
            else None,
        )
    except DocError as exc:
        problems.append(str(exc))
    else:
        request.node.user_properties.append(("docs", dataclasses.asdict(stats)))
    finally:
        if outputs:
            regenerate(page, outputs, tmp_path)
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_not_run_blocks_are_few_and_say_why() -> None:
    """Every Python and shell block runs, unless a marker says why not; the ones that do
    not are counted here, so that a new one is a visible change."""
    not_run: list[str] = []
    for page in PAGES:
        for block in parse_page(page):  # raises on a marker without a reason
            if block.marker is not None and block.marker[0] == "not run":
                assert block.lang in SHELL_LANGS | {"python", "ini"}, block.where
                not_run.append(f"{block.where}: {block.marker[1]}")
    assert len(not_run) <= NOT_RUN_BUDGET, "\n".join(not_run)


# -- positive controls: a page that is wrong must fail ---------------------------------------


def _page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    return path


def test_wrong_output_fails_with_line_command_and_diff(tmp_path: Path) -> None:
    page = _page(tmp_path, "Intro.\n\n```sh\necho hello\n```\n\n```text\ngoodbye\n```\n")
    with pytest.raises(DocError) as exc:
        run_page(page, tmp_path / "work")
    message = str(exc.value)
    assert "page.md:3: sh block printed other than page.md:7 shows" in message
    assert "echo hello" in message
    assert "-goodbye" in message
    assert "+hello" in message


def test_failing_command_fails(tmp_path: Path) -> None:
    page = _page(tmp_path, "```sh\ntrue\nfalse\ntrue\n```\n")
    with pytest.raises(DocError, match=r"page.md:1: sh block failed \(exit status 1\)"):
        run_page(page, tmp_path / "work")


def test_exit_status_is_compared(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        '```sh\nsh -c "exit 3"\necho "exit status: $?"\n```\n\n```text\nexit status: 2\n```\n',
    )
    with pytest.raises(DocError, match="exit status: 2"):
        run_page(page, tmp_path / "work")


def test_python_error_fails(tmp_path: Path) -> None:
    page = _page(tmp_path, "```python\nx = 1\n```\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(DocError, match=r"page.md:5: python block raised(.|\n)*AssertionError"):
        run_page(page, tmp_path / "work")


def test_session_env_and_files_carry_over(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "```sh\nexport GREETING=hi\nmkdir sub && cd sub\n```\n\n"
        "<!-- file: hello.py -->\n```python\nimport os\nprint(os.environ['GREETING'])\n```\n\n"
        "```sh\npython hello.py\n```\n\n```text\nhi\n```\n\n"
        "```python\nimport os\nprint(os.getcwd().endswith('sub'), os.environ['GREETING'])\n```"
        "\n\n```text\nTrue hi\n```\n\n"
        "*(Not run by the tests: it would fail.)*\n```sh\nfalse\n```\n\n"
        "```text\nnever compared\n```\n",
    )
    stats = run_page(page, tmp_path / "work")
    assert (stats.run, stats.files, stats.compared, stats.skipped) == (3, 1, 2, 2)


def test_regenerate_rewrites_the_shown_output(tmp_path: Path) -> None:
    text = "```sh\necho hello; echo\necho world\n```\n\n```text\ngoodbye\n```\n\nEnd.\n"
    page = _page(tmp_path, text)
    outputs: list[tuple[Block, str]] = []
    stats = run_page(page, tmp_path / "work", on_mismatch=lambda b, o: outputs.append((b, o)))
    assert stats.regenerated == 1
    regenerate(page, outputs, tmp_path / "work")
    assert page.read_text() == text.replace("goodbye", "hello\n\nworld")
    run_page(page, tmp_path / "work")  # now it matches


def test_regenerate_keeps_lines_that_differ_only_in_placeholders(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "```sh\necho 'at 2026-01-01 10:00'; echo b\n```\n\n```text\nat 2025-05-05 09:00\nc\n```\n",
    )
    outputs: list[tuple[Block, str]] = []
    run_page(page, tmp_path / "work", on_mismatch=lambda b, o: outputs.append((b, o)))
    regenerate(page, outputs, tmp_path / "work")
    assert "```text\nat 2025-05-05 09:00\nb\n```" in page.read_text()


def test_elided_output_is_not_regenerated(tmp_path: Path) -> None:
    page = _page(tmp_path, "```sh\necho a; echo b\n```\n\n```text\nc\n...\n```\n")
    with pytest.raises(DocError, match="printed other than"):
        run_page(page, tmp_path / "work", on_mismatch=lambda b, o: None)


def test_unused_file_fails(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- file: app.py -->\n```python\nx = 1\n```\n\n```sh\ntrue\n```\n")
    with pytest.raises(DocError, match=r"app\.py is written but no later block"):
        run_page(page, tmp_path / "work")


def test_bash_and_shell_blocks_run(tmp_path: Path) -> None:
    page = _page(tmp_path, "```bash\necho one\n```\n\n```text\none\n```\n\n```shell\nfalse\n```\n")
    with pytest.raises(DocError, match=r"page.md:9: shell block failed"):
        run_page(page, tmp_path / "work")


def test_not_run_needs_a_reason(tmp_path: Path) -> None:
    page = _page(tmp_path, "*(Not run by the tests.)*\n```sh\nfalse\n```\n")
    with pytest.raises(DocError, match="needs a reason"):
        run_page(page, tmp_path / "work")


def test_normaliser_keeps_what_is_deterministic() -> None:
    assert normalise("at 2026-12-02 00:55:08,532 took 0.25 s") == "at <time> took <duration>"
    key = "4a48fe33d3beb2188d87f8f87abd458ede167768c708f84c288150dcfbd3db44"
    assert normalise(f"key {key}  ") == f"key {key}"  # key ids are compared exactly
    assert normalise("lease 30 s") == "lease 30 s"  # a configured value is not a duration
    assert normalise("expires in 23h58m, 2s ago") == "expires in <left>, <ago>"
    assert normalise("expires in 1d)") == "expires in <left>)"  # at exactly a day left
    # a plain table's padding follows its widest cell: the columns, not the blanks, count
    assert normalise("id     flow\nr-1    refund") == normalise("id  flow\nr-1  refund")
    assert normalise("    indented  code") == "    indented  code"


def test_wrong_signature_fails(tmp_path: Path) -> None:
    page = _page(tmp_path, "```python\nStore.open(url: str = 'x', *, create: bool = False)\n```\n")
    (block,) = parse_page(page)
    with pytest.raises(DocError, match="not the code's"):
        check_signature(block, "Store")


def test_a_hidden_skip_marker_is_refused(tmp_path: Path) -> None:
    """A reader must see which blocks the tests do not run: an HTML comment hides it."""
    page = _page(tmp_path, "<!-- not run: hidden -->\n```sh\nfalse\n```\n")
    with pytest.raises(DocError, match="says so visibly"):
        run_page(page, tmp_path / "work")
