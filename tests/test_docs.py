"""Every page of docs/ and the README, run as a reader following it would.

Each page is one test: its snippets run in order in a fresh directory (see
:mod:`tests.docs_runner` for the rules and the markers), and the first one that fails or
prints other than the page shows fails the test with the page, the line, the block and the
diff.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .docs_runner import REPO, Block, DocError, normalise, parse_page, run_page
from .docs_signatures import check_signature, section_of

PAGES = sorted([*REPO.glob("docs/*.md"), REPO / "README.md"])

# Pages written for a PostgreSQL server: the reader has exported ONCEONLY_DATABASE_URL
# (the page's own `export` names a server we do not have, and is not run).
POSTGRESQL_PAGES = frozenset({"howto-postgresql.md", "howto-workers-postgresql.md"})


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

    try:
        stats = run_page(
            page,
            tmp_path,
            extra_env=extra,
            signatures=signature if page.name == "reference.md" else None,
        )
    except DocError as exc:
        problems.append(str(exc))
    else:
        request.node.user_properties.append(("docs", dataclasses.asdict(stats)))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


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
        "<!-- not run: it would fail -->\n```sh\nfalse\n```\n\n```text\nnever compared\n```\n",
    )
    stats = run_page(page, tmp_path / "work")
    assert (stats.run, stats.files, stats.compared, stats.skipped) == (3, 1, 2, 2)


def test_not_run_needs_a_reason(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- not run: -->\n```sh\nfalse\n```\n")
    with pytest.raises(DocError, match="needs a reason"):
        run_page(page, tmp_path / "work")


def test_normaliser_keeps_what_is_deterministic() -> None:
    assert normalise("at 2026-12-02 00:55:08,532 took 0.25 s") == "at <time> took <duration>"
    key = "4a48fe33d3beb2188d87f8f87abd458ede167768c708f84c288150dcfbd3db44"
    assert normalise(f"key {key}  ") == f"key {key}"  # key ids are compared exactly
    assert normalise("lease 30 s") == "lease 30 s"  # a configured value is not a duration
    assert normalise("expires in 23h58m, 2s ago") == "expires in <left>, <ago>"


def test_wrong_signature_fails(tmp_path: Path) -> None:
    page = _page(tmp_path, "```python\nStore.open(url: str = 'x', *, create: bool = False)\n```\n")
    (block,) = parse_page(page)
    with pytest.raises(DocError, match="not the code's"):
        check_signature(block, "Store")
