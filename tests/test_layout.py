"""The house's shape: one namespace, imports that only point down, an install that adds
one top-level module.

The layers, bottom up: ``onceonly.checkpoint`` → ``onceonly.ledger`` →
``onceonly.adapters`` → the runtime (every other ``onceonly`` module). A module may import
its own layer and the layers below, never above. Nothing in the repository imports the
top-level folders by their bare names (``checkpoint``, ``ledger``, ``adapters``): they are
the packages ``onceonly.checkpoint`` etc. (linked under ``onceonly/``), and a second name
would be a second copy of every module, with its own state.
"""

from __future__ import annotations

import ast
import glob
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"checkpoint": 0, "ledger": 1, "adapters": 2}
RUNTIME = 3
BARE = set(LAYERS)


def _layer(module: str) -> int | None:
    """The layer of an ``onceonly`` module (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "onceonly":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    return RUNTIME


def _sources() -> list[tuple[Path, str]]:
    """Every package module with its dotted name (the real files, once each)."""
    out: list[tuple[Path, str]] = []
    for folder in ("checkpoint", "ledger", "adapters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            out.append((path, "onceonly." + ".".join(rel.parts)))
    for path in sorted((ROOT / "onceonly").rglob("*.py")):
        rel = path.relative_to(ROOT / "onceonly")
        if rel.parts[0] in LAYERS:  # the links to the folders above
            continue
        out.append((path, ".".join(("onceonly", *rel.with_suffix("").parts))))
    return [(p, m.removesuffix(".__init__")) for p, m in out]


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports (relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def test_the_sources_are_found() -> None:
    """Positive control: the walk sees every layer."""
    layers = {_layer(m) for _, m in _sources()}
    assert layers == {0, 1, 2, RUNTIME}
    assert len(_sources()) > 50


def test_imports_only_point_down() -> None:
    upward = []
    for path, module in _sources():
        own = _layer(module)
        assert own is not None
        for line, name in _imports(path, module):
            target = _layer(name)
            if target is not None and target > own:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {name}")
    assert upward == []


def test_the_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    """Positive control: an upward import in a low layer is reported."""
    bad = tmp_path / "store.py"
    bad.write_text("from onceonly.runtime import Runtime\nfrom ..ledger import Ledger\n")
    names = [n for _, n in _imports(bad, "onceonly.checkpoint.store")]
    assert names == ["onceonly.runtime", "onceonly.ledger"]
    assert [_layer(n) for n in names] == [RUNTIME, 1]


def test_nothing_imports_the_folders_by_their_bare_names() -> None:
    """Sources, tests, benchmarks, and the Python blocks of the docs."""
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "build") or (
            rel.parts[0] == "onceonly" and len(rel.parts) > 1 and rel.parts[1] in LAYERS
        ):
            continue
        for line, name in _imports(path, "tests.x"):
            if name.split(".")[0] in BARE:
                bare.append(f"{rel}:{line}: {name}")
    # Code run in a child process (``python -c "..."``) is a string to the parser.
    in_strings = re.compile(r"(?:\\n|[\"';])\s*(?:from|import)\s+(?:checkpoint|ledger|adapters)\b")
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "build") or (
            rel.parts[0] == "onceonly" and len(rel.parts) > 1 and rel.parts[1] in LAYERS
        ):
            continue
        if rel == Path("tests/test_layout.py"):
            continue  # its own refused import
        bare.extend(f"{rel}: {m.group(0).strip()}" for m in in_strings.finditer(path.read_text()))
    statement = re.compile(r"^\s*(?:from|import)\s+(checkpoint|ledger|adapters)\b", re.M)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        bare.extend(
            f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in statement.finditer(text)
        )
    assert bare == []


def test_a_bare_import_from_a_checkout_is_refused_with_the_right_name() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import ledger"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "import onceonly.ledger, not ledger" in out.stderr


def test_the_editable_install_serves_one_namespace(tmp_path: Path) -> None:
    """Outside the checkout (what a tutorial's script sees): onceonly and its layers
    import, the bare names do not exist."""
    code = (
        "import importlib.util as u, onceonly.checkpoint, onceonly.ledger, onceonly.adapters\n"
        "print([u.find_spec(n) is None for n in ('checkpoint', 'ledger', 'adapters')])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[True, True, True]"


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    # From a copy: setuptools reuses build/ in the source tree, and files moved away
    # since an earlier build would still be in it.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "reports", ".*_cache"
        ),
    )
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = glob.glob(str(out / "*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"onceonly", "onceonly-0.1.0.dist-info"}
    for layer in LAYERS:
        assert f"onceonly/{layer}/__init__.py" in names
        assert f"onceonly/{layer}/py.typed" in names
    sources = {n for n in names if n.endswith(".py")}
    assert len(sources) == len(_sources())
