"""Check the signatures of ``docs/reference.md`` against the code.

The reference's ``python`` blocks are not programs: each shows a signature, "copied from
the code", in one of two forms::

    Store.open(url: str, *, create: bool = True, ...) -> Store
    Store.dialect: str  # read-only property

A signature is checked against :func:`inspect.signature` of the object it names: the same
parameters, in the same order and of the same kinds, with a default where the code has
one, and the same default where the page shows a literal, an enum member, ``None`` or
``<unchanged>`` (a private sentinel). Annotations are not compared (the page spells them
for readers). An attribute is checked to exist. The object is looked up in the modules of
the page's section (``## Effects ledger`` names come from ``ledger``, and so on).
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

from .docs_runner import Block, DocError

_SECTION_MODULES: dict[str, tuple[str, ...]] = {
    "Effects ledger": ("onceonly.ledger",),
    "Adapters": (
        "onceonly.adapters",
        "onceonly.adapters.http",
        "onceonly.adapters.email",
        "onceonly.adapters.record",
        "onceonly.adapters.booking",
        "onceonly.adapters.mcp",
        "onceonly.adapters.langgraph",
        "onceonly.adapters.langgraph_saver",
        "onceonly.adapters.asgi",
        "onceonly.adapters.pydantic_ai",
        "onceonly.adapters.openai_agents",
        "onceonly.adapters.temporal",
        "onceonly.adapters.celery",
    ),
    "Runtime": (
        "onceonly.flow",
        "onceonly.context",
        "onceonly.runtime",
        "onceonly.operator",
        "onceonly.worker",
        "onceonly.errors",
        "onceonly.testing",
    ),
    "Console": ("onceonly.console",),
}
_DEFAULT_MODULES = ("onceonly.checkpoint",)
_ATTRIBUTE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*): .+$")
_HEAD = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\(", re.DOTALL)
_UNCHANGED = "_UNCHANGED_"


def section_of(lines: list[str], line: int) -> str:
    """The ``## `` heading above ``line`` (1-based)."""
    for text in reversed(lines[: line - 1]):
        if text.startswith("## "):
            return text[3:].strip()
    return ""


def _resolve(name: str, modules: tuple[str, ...]) -> Any:
    parts = name.split(".")
    found: list[Any] = []
    for mod_name in modules:
        obj: Any = importlib.import_module(mod_name)
        for part in parts:
            obj = (
                inspect.getattr_static(obj, part, None)
                if inspect.isclass(obj)
                else getattr(obj, part, None)
            )
            if obj is None:
                break
        if obj is not None:
            found.append(obj)
    if not found and "." in name:
        # a module-qualified name such as ledger.migrate
        mod_name, _, attr = name.rpartition(".")
        try:
            module = importlib.import_module(mod_name)
        except ImportError:
            module = None
        if module is not None and hasattr(module, attr):
            found.append(getattr(module, attr))
    if not found:
        raise LookupError(f"{name} is in none of {', '.join(modules)}")
    return found[0]


def _doc_parameters(code: str, name: str) -> tuple[list[ast.arg], ast.arguments]:
    body = code.strip()
    rest = body[len(name) :]
    source = f"def _signature{rest.replace('<unchanged>', _UNCHANGED)}:\n    pass\n"
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise DocError(f"not a signature: {exc}") from None
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    args = func.args
    ordered = [*args.posonlyargs, *args.args]
    if args.vararg:
        ordered.append(args.vararg)
    ordered.extend(args.kwonlyargs)
    if args.kwarg:
        ordered.append(args.kwarg)
    return ordered, args


def _kinds(args: ast.arguments) -> Iterator[tuple[str, inspect._ParameterKind, ast.expr | None]]:
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults.extend(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if i < len(args.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        yield arg.arg, kind, default
    if args.vararg:
        yield args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        yield arg.arg, inspect.Parameter.KEYWORD_ONLY, kw_default
    if args.kwarg:
        yield args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None


def _default_matches(doc: ast.expr, actual: Any) -> bool:
    shown = ast.unparse(doc)
    if shown == _UNCHANGED:  # a private sentinel: a bare object() or a named one
        return type(actual) is object or "unchanged" in repr(actual).lower()
    if repr(actual) == "<factory>":  # a dataclass field(default_factory=...)
        try:
            return not ast.literal_eval(doc)  # shown as the empty value it makes
        except ValueError:
            return True
    if shown == "...":  # "a default, not spelled out"
        return True
    try:
        value = ast.literal_eval(doc)
    except ValueError:
        pass
    else:
        return bool(value == actual and type(value) is type(actual)) or (
            isinstance(actual, enum.Enum) and actual.value == value
        )
    if isinstance(actual, enum.Enum):
        return shown in (actual.name, f"{type(actual).__name__}.{actual.name}")
    if isinstance(doc, ast.Name | ast.Attribute) and not callable(actual):
        # a constant shown by name (UNKNOWN_RESULT): the code's repr names it
        return shown.rsplit(".", 1)[-1] in repr(actual)
    # an expression the page spells for readers (a constructor call, a function): only
    # its presence is checked
    return True


def _signature(obj: Any) -> inspect.Signature:
    target = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    if isinstance(target, property):
        raise DocError("shown as a call, but the code has a property")
    try:
        sig = inspect.signature(target)
    except ValueError:
        if inspect.isclass(target) and issubclass(target, BaseException):
            return inspect.signature(lambda *args: None)
        raise
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and not inspect.isclass(obj):
        params = params[1:]
    return sig.replace(parameters=params)


_CLASS = re.compile(r"^class (?P<name>[A-Za-z_][\w.]*)\((?P<bases>.*)\)$")


def check_signature(block: Block, section: str) -> None:
    """Raise :class:`DocError` if ``block`` does not show the code's signatures."""
    modules = _SECTION_MODULES.get(section, _DEFAULT_MODULES)
    lines = [line.split("  #")[0].rstrip() for line in block.code.splitlines()]
    chunks: list[list[str]] = []
    for line in lines:
        if not line:
            continue
        if re.match(r"^[A-Za-z_]", line) or not chunks:
            chunks.append([line])
        else:
            chunks[-1].append(line)
    for chunk in chunks:
        _check_one(block, "\n".join(chunk), modules)


def _check_one(block: Block, code: str, modules: tuple[str, ...]) -> None:
    cls = _CLASS.match(code)
    if cls:
        try:
            obj = _resolve(cls.group("name"), modules)
        except LookupError as exc:
            raise DocError(f"{block.where}: {exc}\n--- block\n{block.code}") from None
        bases = [b.strip().split("[")[0] for b in cls.group("bases").split(",")]
        names = {c.__name__ for c in inspect.getmro(obj)} if inspect.isclass(obj) else set()
        missing = [b for b in bases if b not in names]
        if missing:
            raise DocError(f"{block.where}: {cls.group('name')} is not a {missing}")
        return
    attr = _ATTRIBUTE.match(code)
    if attr and "(" not in attr.group("name") and "\n" not in code:
        name = attr.group("name")
        try:
            _resolve(name, modules)
        except LookupError as exc:
            raise DocError(f"{block.where}: {exc}\n--- block\n{block.code}") from None
        return
    head = _HEAD.match(code)
    if head is None:
        raise DocError(f"{block.where}: neither a signature nor an attribute\n{block.code}")
    name = head.group("name")
    prefix_only = bool(re.search(r",\s*\.\.\.\s*\)", code))
    if prefix_only:  # "(client, ledger, ...)": the first parameters, and more
        code = re.sub(r",\s*\.\.\.\s*\)", ")", code)
    try:
        obj = _resolve(name, modules)
        _, args = _doc_parameters(code, name)
        actual = _signature(obj)
    except (LookupError, DocError, ValueError, TypeError) as exc:
        raise DocError(f"{block.where}: {name}: {exc}\n--- block\n{block.code}") from None
    shown = list(_kinds(args))
    real = list(actual.parameters.values())
    if prefix_only:
        real = real[: len(shown)]
    problems: list[str] = []
    if [n for n, _, _ in shown] != [p.name for p in real]:
        problems.append(
            f"parameters: page {[n for n, _, _ in shown]}, code {[p.name for p in real]}"
        )
    else:
        for (pname, kind, default), param in zip(shown, real, strict=True):
            if kind != param.kind:
                problems.append(f"{pname}: page {kind.description}, code {param.kind.description}")
            if (default is None) != (param.default is inspect.Parameter.empty):
                page = "no default" if default is None else ast.unparse(default)
                code_default = (
                    "no default"
                    if param.default is inspect.Parameter.empty
                    else repr(param.default)
                )
                problems.append(f"{pname}: page {page}, code {code_default}")
            elif default is not None and not _default_matches(default, param.default):
                problems.append(
                    f"{pname}: page default {ast.unparse(default)}, code {param.default!r}"
                )
    if problems:
        raise DocError(
            f"{block.where}: the signature of {name} is not the code's: {'; '.join(problems)}"
            f"\n--- block\n{block.code}--- code\n{name}{actual}"
        )
