"""A plain ``sqlite:///PATH`` is parsed without SQLAlchemy's URL pattern (a fresh
process's open is a third cheaper); the URL it gives must be the one SQLAlchemy would
have parsed, for every path, and anything else is left to SQLAlchemy."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import make_url

from onceonly.checkpoint import Store
from onceonly.checkpoint._engine import _plain_sqlite

_PATH_CHARS = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")


@given(st.text(_PATH_CHARS, min_size=1, max_size=40), st.booleans())
def test_a_plain_sqlite_url_parses_as_sqlalchemy_parses_it(path: str, absolute: bool) -> None:
    url = "sqlite:///" + ("/" if absolute else "") + path
    fast = _plain_sqlite(url)
    if fast is None:  # left to SQLAlchemy: only URLs with a query, fragment, escape or @
        assert any(c in url for c in "?#%@")
        return
    slow = make_url(url)
    assert fast == slow
    assert fast.render_as_string(hide_password=False) == slow.render_as_string(hide_password=False)


def test_other_urls_are_left_to_sqlalchemy() -> None:
    for url in (
        "sqlite:///db.sqlite?mode=ro",
        "sqlite+pysqlite:///db.sqlite",
        "sqlite:///a%20b.db",
        "postgresql+psycopg://u:p@h/db",
        "sqlite://",
    ):
        assert _plain_sqlite(url) is None, url


def test_a_store_opened_by_a_plain_url_is_the_file(tmp_path: Path) -> None:
    db = tmp_path / "x y.db"
    with Store.open(f"sqlite:///{db}") as store:
        assert store.engine.url.database == str(db)
        rid = store.create_run("flow").run_id
        store.save(rid, {"n": 1}, step="s")
    assert db.exists()
    with Store.open(f"sqlite:///{db}") as again:
        assert again.load(rid).state == {"n": 1}
