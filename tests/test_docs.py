"""Every page of docs/ and the README, run as a reader following it would.

Each page is one test: its snippets run in order in a fresh directory (see
:mod:`tests.docs_runner` for the rules and the markers), and the first one that fails or
prints other than the page shows fails the test with the page, the line, the block and the
diff.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .docs_runner import REPO, Block, DocError, run_page
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
    signatures = None
    if page.name == "reference.md":
        problems: list[str] = []

        def signatures(block: Block) -> None:
            try:
                check_signature(block, section_of(lines, block.line))
            except DocError as exc:
                problems.append(str(exc))

    failure = None
    try:
        run_page(page, tmp_path, extra_env=extra, signatures=signatures)
    except DocError as exc:
        failure = str(exc)
    if page.name == "reference.md" and problems:
        failure = "\n\n".join([*problems, *([failure] if failure else [])])
    if failure:
        pytest.fail(failure, pytrace=False)
