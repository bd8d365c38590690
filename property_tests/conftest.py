"""The property suites use the fixtures of ``tests/``: a fresh database per test, on
SQLite and on PostgreSQL."""

from tests.conftest import db_url, pg_server_url  # noqa: F401  (fixtures, found by name)
