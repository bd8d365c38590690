"""Every public package and module has a sorted, complete ``__all__`` of names that exist,
and every error derives from ``OnceOnlyError``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

from onceonly import checkpoint
from onceonly.checkpoint import OnceOnlyError
from onceonly.checkpoint import errors as checkpoint_errors

PACKAGES = [
    "onceonly.checkpoint",
    "onceonly.ledger",
    "onceonly.adapters",
    "onceonly",
    "onceonly.console",
]


CHECKPOINT_MODULES = [
    f"onceonly.checkpoint.{info.name}"
    for info in pkgutil.iter_modules(checkpoint.__path__)
    if not info.name.startswith("_")
]


def _all(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    assert isinstance(names, list), f"{module.__name__} has no __all__ list"
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_declares_all(package: str) -> None:
    _all(importlib.import_module(package))


@pytest.mark.parametrize("name", PACKAGES + CHECKPOINT_MODULES)
def test_all_is_sorted_unique_and_every_name_exists(name: str) -> None:
    module = importlib.import_module(name)
    if not hasattr(module, "__all__"):
        pytest.fail(f"{name} has no __all__")
    names = _all(module)
    # ruff's RUF022 order: CONSTANTS, then Classes, then functions, each sorted
    order = sorted(names, key=lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n))
    assert names in (order, sorted(names)), f"{name}.__all__ is not sorted"
    assert len(names) == len(set(names)), f"{name}.__all__ has duplicates"
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("name", CHECKPOINT_MODULES)
def test_all_lists_every_public_class_and_function_defined_in_the_module(name: str) -> None:
    module = importlib.import_module(name)
    names = set(_all(module))
    defined = [
        attr
        for attr, obj in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == name
    ]
    assert sorted(set(defined) - names) == []


def test_the_checkpoint_package_exports_its_public_modules() -> None:
    exported = set(_all(checkpoint))
    assert {
        "onceonly.checkpoint.codec",
        "onceonly.checkpoint.errors",
        "onceonly.checkpoint.records",
    } <= set(CHECKPOINT_MODULES)
    for name in CHECKPOINT_MODULES:
        assert set(_all(importlib.import_module(name))) <= exported, name


def test_every_error_derives_from_onceonly_error() -> None:
    names = _all(checkpoint_errors)
    assert "OnceOnlyError" in names
    for name in names:
        obj = getattr(checkpoint_errors, name)
        assert inspect.isclass(obj), name
        assert issubclass(obj, OnceOnlyError), name
        assert issubclass(obj, Exception), name
    defined = [
        obj
        for obj in vars(checkpoint_errors).values()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == "onceonly.checkpoint.errors"
    ]
    assert all(issubclass(obj, OnceOnlyError) for obj in defined)
    assert {obj.__name__ for obj in defined} == set(names)


def test_every_exported_error_of_the_package_is_a_onceonly_error() -> None:
    for name in _all(checkpoint):
        obj = getattr(checkpoint, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert issubclass(obj, OnceOnlyError), name
