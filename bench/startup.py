"""Start-up cost: ``import onceonly`` and ``onceonly --help`` over a bare interpreter.

``python -m bench startup`` (or ``python -m bench.startup``) starts each command below in a
fresh process, ``--runs`` times, in turn (A B C D, A B C D, ...: a drift of the machine's
speed touches every command alike), and prints, per command, the median wall time and the
median of its excess over ``python -c pass`` started just before it, with the targets:

* ``import onceonly``: at most 0.3 s over a bare interpreter;
* ``onceonly --help`` (and ``onceonly runs --help``): at most 0.5 s.

It also checks that neither imports what only some commands need (the adapters,
SQLAlchemy, psycopg, httpx, langgraph, rich). ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PYTHON = sys.executable
ONCEONLY = str(Path(PYTHON).parent / "onceonly")
HEAVY = ("onceonly.adapters", "sqlalchemy", "psycopg", "httpx", "langgraph", "rich")
_PROBE = (
    "import sys\n{code}\n"
    "print(sorted({{m.split('.')[0] if not m.startswith('onceonly.') else m for m in "
    "sys.modules if m in {heavy!r} or m.split('.')[0] in {heavy!r}}}))"
)

# name, command, target excess over the bare interpreter (None: the baseline)
COMMANDS: tuple[tuple[str, list[str], float | None], ...] = (
    ("python -c pass", [PYTHON, "-c", "pass"], None),
    ("python -c 'import onceonly'", [PYTHON, "-c", "import onceonly"], 0.3),
    ("onceonly --help", [ONCEONLY, "--help"], 0.5),
    ("onceonly runs --help", [ONCEONLY, "runs", "--help"], 0.5),
)


def _wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def heavy_imports(code: str) -> list[str]:
    """What of :data:`HEAVY` a fresh interpreter has imported after running ``code``."""
    out = subprocess.run(
        [PYTHON, "-c", _PROBE.format(code=code, heavy=HEAVY)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return list(json.loads(out.strip().splitlines()[-1].replace("'", '"')))


def measure(runs: int) -> dict[str, object]:
    """Run every command ``runs`` times in turn (after one warm-up round)."""
    walls: dict[str, list[float]] = {name: [] for name, _, _ in COMMANDS}
    for round_ in range(runs + 1):
        for name, argv, _ in COMMANDS:
            wall = _wall(argv)
            if round_:
                walls[name].append(wall)
    base = walls[COMMANDS[0][0]]
    rows = []
    for name, _, target in COMMANDS:
        excess = [w - b for w, b in zip(walls[name], base, strict=True)]
        rows.append(
            {
                "command": name,
                "median_s": statistics.median(walls[name]),
                "min_s": min(walls[name]),
                "max_s": max(walls[name]),
                "excess_median_s": statistics.median(excess),
                "target_excess_s": target,
                "met": None if target is None else statistics.median(excess) <= target,
            }
        )
    help_code = "from onceonly.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass"
    return {
        "runs": runs,
        "python": sys.version.split()[0],
        "rows": rows,
        "heavy_imports": {
            "import onceonly": heavy_imports("import onceonly"),
            "onceonly --help": heavy_imports(help_code),
        },
    }


def table(doc: dict[str, object]) -> str:
    """The figures as a Markdown table."""
    lines = [
        (
            "| command | median wall | min to max | over `python -c pass` (median of pairs) "
            "| target | status |"
        ),
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in doc["rows"]:  # type: ignore[attr-defined]
        target = "—" if r["target_excess_s"] is None else f"≤ {r['target_excess_s']:.1f} s"
        status = "—" if r["met"] is None else ("**met**" if r["met"] else "**missed**")
        lines.append(
            f"| `{r['command']}` | {r['median_s']:.3f} s | {r['min_s']:.3f} to "
            f"{r['max_s']:.3f} s | {r['excess_median_s']:+.3f} s | {target} | {status} |"
        )
    return "\n".join(lines)


def section(doc: dict[str, Any]) -> list[str]:
    """The start-up section of docs/performance.md, from ``bench/results/startup.json``."""
    lines = [
        "## Start-up: `import onceonly` and `onceonly --help`",
        "",
        (
            "Targets: `import onceonly` at most 0.3 s and `onceonly --help` at most 0.5 s over a "
            "bare interpreter on this machine. The package's names are imported on first use "
            "(PEP 562) and the command line imports click alone until a command runs (each "
            "command imports the store, the ledger, rich or the demo itself; psycopg only for a "
            "PostgreSQL URL)."
        ),
        "",
        (
            f"Measured {doc.get('measured_at', '?')} ({doc.get('git', '?')}, Python "
            f"{doc['python']}) with **`python -m bench startup --runs {doc['runs']}`**: each "
            "command in a fresh process, the commands in turn; the excess is the median over "
            "rounds of a command's wall time minus that of `python -c pass` started just before "
            "it."
        ),
        "",
        table(doc),
        "",
        (
            "Modules that only some commands need (the adapters, SQLAlchemy, psycopg, httpx, "
            "langgraph, rich) imported by `import onceonly`: "
            f"{doc['heavy_imports']['import onceonly'] or 'none'}; by `onceonly --help`: "
            f"{doc['heavy_imports']['onceonly --help'] or 'none'} (also checked by "
            "`tests/test_cli.py`)."
        ),
        "",
    ]
    whole = doc.get("whole_process")
    if whole:

        def cell(r: dict[str, Any], when: str) -> str:
            if f"{when}_cpu_s" not in r:
                return "—"
            peak = r.get(f"{when}_peak_mib")
            return f"{r[f'{when}_cpu_s']:.3f} s / {r[f'{when}_wall_s']:.3f} s" + (
                f" / {peak:.1f} MiB" if peak is not None else ""
            )

        lines += [
            (
                f"Whole-process figures, before (`main` at 5a83bb0) and after: {whole['method']}; "
                "CPU / wall / peak memory. Wall times on this shared machine wander (other jobs "
                "run beside it); CPU time is the steadier figure."
            ),
            "",
            "| command | before: CPU / wall / peak | after: CPU / wall / peak |",
            "| --- | ---: | ---: |",
            *[
                f"| `{r['command']}` | {cell(r, 'before')} | {cell(r, 'after')} |"
                for r in whole["rows"]
            ],
            "",
            (
                "To check by hand: `python -X importtime -c 'import onceonly'` lists every module "
                "imported and its cost; `/usr/bin/time -v .venv/bin/onceonly --help` gives one "
                "run's CPU time and peak memory."
            ),
            "",
        ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table; exit 1 when a target is missed or a heavy module loads."""
    p = argparse.ArgumentParser(prog="python -m bench startup", description=__doc__)
    p.add_argument("--runs", type=int, default=10, help="rounds counted (default 10)")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the figures here (bench/results/startup.json feeds docs/performance.md)",
    )
    args = p.parse_args(argv)
    doc = measure(max(1, args.runs))
    print(table(doc))
    heavy = doc["heavy_imports"]
    print(f"\nmodules imported that only some commands need: {heavy}")
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    missed = any(r["met"] is False for r in doc["rows"])  # type: ignore[attr-defined]
    return 1 if missed or any(heavy.values()) else 0  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
