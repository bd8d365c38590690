"""The property suites use the fixtures of ``tests/``: a fresh database per test, on
SQLite and on PostgreSQL."""

import pytest

from property_tests.reliability import depth
from tests.conftest import db_url, pg_server_url  # noqa: F401  (fixtures, found by name)

# The deep tier multiplies sizes x20-x100: a test held to the CI tier's 300 s per test
# (pyproject's pytest-timeout) would be stopped part-way, not proven. Each test without
# a timeout of its own gets two hours there; the CI tier keeps the default.
DEEP_TIMEOUT_S = 7200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if depth() != "deep":
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEEP_TIMEOUT_S))
