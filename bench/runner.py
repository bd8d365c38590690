"""The orchestrator behind ``python -m bench``: runs every phase in a fresh process,
alternating systems within each repetition, shows progress, writes the raw results
(``bench/results/latest.json``) and renders ``docs/performance.md`` with its plots."""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from . import w1, w2, w2lg, w3, w4, workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "latest.json"
DOCS = ROOT / "docs"
COMMAND = "make bench"
PHASE_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 1800


@dataclass
class Plan:
    """What one invocation runs."""

    reps: int
    quick: bool
    workloads: list[str]
    samples: int = 1  # fresh-process load/resume samples per cell and repetition
    w1_calls: int = w1.CALLS
    w1_probe_calls: int = w1.PROBE_CALLS
    w1_concurrency: int = w1.CONCURRENCY
    w1_systems: list[str] = field(default_factory=lambda: list(w1.SYSTEMS))
    w1_async_systems: list[str] = field(default_factory=lambda: list(w1.ASYNC_SYSTEMS))
    w1_probe_reps: int = 0  # repetitions that run the probe (the first ones)
    w1_profile: bool = True
    w2_steps: int = w2.STEPS
    w2_systems: list[str] = field(default_factory=lambda: list(w2.SYSTEMS))
    w3_sizes: dict[str, list[int]] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)


def make_plan(
    reps: int,
    samples: int,
    *,
    quick: bool,
    workloads: Sequence[str],
    lazy: bool,
    missing: dict[str, str] | None = None,
) -> Plan:
    """The systems and sizes to run, and what is skipped and why.

    ``missing``: W1 peer -> why it cannot run here (its package does not import).
    """
    plan = Plan(reps=reps, quick=quick, workloads=list(workloads), samples=samples)
    plan.w1_probe_reps = min(reps, 3)
    for name, why in (missing or {}).items():
        if name in plan.w1_systems:
            plan.w1_systems.remove(name)
            plan.skipped.append({"workload": "W1", "system": name, "size": 0, "reason": why})
    if quick:
        plan.w1_probe_reps = 1
        plan.w1_profile = False
        plan.skipped.append(
            {
                "workload": "W1",
                "system": "probe",
                "size": 0,
                "reason": "--quick: the durable-before-return probe runs in the first "
                "repetition only (otherwise in the first three), and there is no cProfile run",
            }
        )
    growing = (
        "every checkpoint stores the whole state, which grows by one 500-char message per "
        "step, so the database grows quadratically: for 10 000 steps, about {est}"
    )
    for name in w3.SYSTEMS:
        sizes = list(w3.SIZES)
        if name == "onceonly-lazy" and not lazy:
            plan.skipped.append(
                {
                    "workload": "W3",
                    "system": name,
                    "size": 0,
                    "reason": "this checkpoint/ has no `Store.load(lazy=...)`",
                }
            )
            continue
        if name in ("floor-full", "langgraph"):
            sizes = [100, 1000]
            plan.skipped.append(
                {"workload": "W3", "system": name, "size": 10_000, "reason": growing}
            )
        if quick and name in ("floor-full", "langgraph"):
            sizes = [100]
            plan.skipped.append(
                {
                    "workload": "W3",
                    "system": name,
                    "size": 1000,
                    "reason": "--quick (a 1 000-step history is ~365 MB, ~6-10 s to write)",
                }
            )
        if quick and name == "langgraph-delta":
            sizes = [100, 1000]
            plan.skipped.append(
                {
                    "workload": "W3",
                    "system": name,
                    "size": 10_000,
                    "reason": "--quick (building 10 000 LangGraph steps takes ~30-60 s)",
                }
            )
        plan.w3_sizes[name] = sizes
    plan.skipped = [s for s in plan.skipped if s["workload"].lower() in plan.workloads]
    return plan


def machine() -> dict[str, Any]:
    """Where and with what the benchmark ran."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "packages": {
            p: version(p)
            for p in (
                "onceonly",
                "SQLAlchemy",
                "langgraph",
                "langgraph-checkpoint",
                "langgraph-checkpoint-sqlite",
                "dbos",
                "matplotlib",
            )
        },
        "git_head": rev,
        "loadavg_start": list(os.getloadavg()),
    }


def fsync_latency_ms(directory: Path, rounds: int = 100) -> float | None:
    """The median time of ``fdatasync`` after a 4 KiB write, in ``directory`` (where the
    databases go; None: could not be measured): what a durable commit waits for at
    least. W1's cold figures and W1-async's gain over sync depend on it (where it is
    fast, both are CPU-bound)."""
    try:
        fd, path = tempfile.mkstemp(prefix="onceonly-fsync-", dir=directory)
    except OSError:
        return None
    try:
        times = []
        for i in range(rounds):
            os.pwrite(fd, os.urandom(4096), (i % 16) * 4096)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return round(times[len(times) // 2], 4)
    finally:
        os.close(fd)
        os.unlink(path)


def source_digest(root: Path = ROOT, package: str = "checkpoint") -> str:
    """A digest of ``<package>/*.py`` (``checkpoint`` or ``ledger``): ties the figures to
    the code measured (the working tree may hold uncommitted changes)."""
    h = hashlib.sha256()
    for p in sorted((root / package).glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def snapshot_sources(tmp: Path) -> Path:
    """Copy ``checkpoint/``, ``ledger/`` and ``bench/`` as they are now; every phase runs
    from the copy (its working directory comes first on ``sys.path``), so all phases of one
    invocation measure the same code even if the working tree changes meanwhile."""
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for pkg in ("checkpoint", "ledger", "bench"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip)
    return src


def probe_lazy(src: Path) -> bool:
    """Whether the checkpoint core the phases import (``onceonly.checkpoint``, from the
    phases' working directory) offers ``Store.load(lazy=...)``.

    Raises:
        RuntimeError: It does not import at all (say so, rather than skip the lazy row).
    """
    code = (
        "import inspect; from onceonly import checkpoint; "
        "print('lazy' in inspect.signature(checkpoint.Store.load).parameters)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"onceonly.checkpoint does not import: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip() == "True"


#: What each W1 peer needs to import (the ``bench`` extra installs them).
W1_PEER_IMPORTS = {
    "langgraph": "import langgraph.func, langgraph.checkpoint.sqlite",
    "dbos": "import dbos",
}


def probe_peers(src: Path) -> dict[str, str]:
    """W1 peers whose packages do not import here, with the exact error."""
    missing: dict[str, str] = {}
    for name, code in W1_PEER_IMPORTS.items():
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            last = lines[-1] if lines else f"exit {proc.returncode}"
            missing[name] = f"`{code}` failed in the benchmark environment: {last}"
    return missing


class Runner:
    """Runs phases as child processes and collects their JSON results."""

    def __init__(self, tmp: Path, src: Path, console: Console) -> None:
        self.tmp = tmp
        self.src = src
        self.console = console
        self._n = 0

    def phase(self, module: str, args: Sequence[str], *, timeout: float) -> dict[str, Any]:
        """Run ``python -m module args --out X`` in a fresh process; its result or an error."""
        self._n += 1
        out = self.tmp / f"result-{self._n}.json"
        cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                check=False,
                cwd=self.src,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s: {' '.join(cmd[2:])}"}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            msg = f"exit {proc.returncode}: {' '.join(cmd[2:])}\n" + "\n".join(tail)
            self.console.print(f"[red]phase failed[/red] {msg}")
            return {"error": msg}
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        out.unlink()
        result["process_wall_s"] = wall
        return result


IO_CALLS = 500  # calls of each W1 I/O profile (counts, not timings: 500 are plenty)


def _remove_db(db: Path) -> None:
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        p.unlink(missing_ok=True)


def w1_phase_count(plan: Plan) -> int:
    """How many phases W1 runs (for the progress bar)."""
    per_rep = 2 * len(plan.w1_systems) + len(plan.w1_async_systems)
    return (
        plan.reps * per_rep
        + plan.w1_probe_reps * len(plan.w1_systems)
        + plan.w1_profile
        + len(plan.w1_systems)  # the I/O profiles
    )


def run_w1(plan: Plan, runner: Runner, progress: Progress, task: Any) -> dict[str, Any]:
    """W1: per repetition, a cold phase per system, a warm phase per system (same
    databases), the async phase, then the durable-before-return probe per system; at the
    end, one cold onceonly run under cProfile."""
    runs: list[dict[str, Any]] = []
    calls = str(plan.w1_calls)

    def phase(rep: int, name: str, kind: str, args: list[str]) -> dict[str, Any]:
        progress.update(task, description=f"W1 rep {rep + 1}/{plan.reps} {kind} {name}")
        res = runner.phase("bench.w1", [kind, "--system", name, *args], timeout=PHASE_TIMEOUT_S)
        run = {"rep": rep, "system": name, "phase": kind, **res}
        runs.append(run)
        progress.advance(task)
        return run

    for rep in range(plan.reps):
        repdir = runner.tmp / "w1" / f"rep{rep}"
        repdir.mkdir(parents=True)
        for kind in ("cold", "warm"):
            for name in plan.w1_systems:
                phase(rep, name, kind, ["--db", str(repdir / f"{name}.db"), "--calls", calls])
        for name in plan.w1_async_systems:
            db = repdir / f"{name}-async.db"
            conc = str(plan.w1_concurrency)
            phase(rep, name, "async", ["--db", str(db), "--calls", calls, "--concurrency", conc])
        if rep < plan.w1_probe_reps:
            for name in plan.w1_systems:
                db = repdir / f"{name}-probe.db"
                phase(rep, name, "probe", ["--db", str(db), "--calls", str(plan.w1_probe_calls)])
        this = {(r["system"], r["phase"]): r for r in runs if r["rep"] == rep and "error" not in r}
        floor = this.get((w1.FLOOR, "cold"), {}).get("call", {}).get("median_ms")
        line = []
        for name in plan.w1_systems:
            cold = this.get((name, "cold"))
            if cold is None:
                line.append(f"{name} failed")
                continue
            med = cold["call"]["median_ms"]
            x = f" ({med / floor:.2f}x)" if floor else ""
            line.append(f"{name} {med:.3f} ms{x}")
        probes = [
            f"{r['system']} {r['recorded']}/{r['calls']}"
            for (_n, kind), r in this.items()
            if kind == "probe"
        ]
        progress.console.print(
            f"W1 rep {rep + 1}: cold median "
            + ", ".join(line)
            + (f"; probe {', '.join(probes)}" if probes else "")
        )
        shutil.rmtree(repdir)
    profile: dict[str, Any] = {}
    if plan.w1_profile:
        progress.update(task, description="W1 cProfile of onceonly cold")
        db = runner.tmp / "w1" / "profile.db"
        profile = runner.phase(
            "bench.w1",
            ["profile", "--system", "onceonly", "--db", str(db), "--calls", calls],
            timeout=PHASE_TIMEOUT_S,
        )
        _remove_db(db)
        progress.advance(task)
    io: dict[str, Any] = {}
    for name in plan.w1_systems:
        # not a timing: what each call makes SQLite do (statements, commits, WAL frames)
        progress.update(task, description=f"W1 I/O profile of {name}")
        db = runner.tmp / "w1" / f"io-{name}.db"
        io[name] = runner.phase(
            "bench.w1",
            ["io", "--system", name, "--db", str(db), "--calls", str(min(plan.w1_calls, IO_CALLS))],
            timeout=PHASE_TIMEOUT_S,
        )
        for p in db.parent.glob(f"io-{name}*"):
            p.unlink(missing_ok=True)
        progress.advance(task)
    return {
        "io": io,
        "calls": plan.w1_calls,
        "probe_calls": plan.w1_probe_calls,
        "concurrency": plan.w1_concurrency,
        "systems": plan.w1_systems,
        "async_systems": plan.w1_async_systems,
        "floor": w1.FLOOR,
        "runs": runs,
        "profile": profile,
    }


def run_w2(plan: Plan, runner: Runner, progress: Progress, task: Any) -> dict[str, Any]:
    """W2: per repetition, a write phase per system, then a load phase per system."""
    runs: list[dict[str, Any]] = []
    for rep in range(plan.reps):
        repdir = runner.tmp / "w2" / f"rep{rep}"
        repdir.mkdir(parents=True)
        rounds = [("write", 0)] + [("load", k) for k in range(plan.samples)]
        for phase, sample in rounds:
            for name in plan.w2_systems:
                progress.update(task, description=f"W2 rep {rep + 1}/{plan.reps} {phase} {name}")
                db = repdir / f"{name}.db"
                res = runner.phase(
                    "bench.w2",
                    [phase, "--system", name, "--db", str(db), "--steps", str(plan.w2_steps)],
                    timeout=PHASE_TIMEOUT_S,
                )
                runs.append({"rep": rep, "sample": sample, "system": name, "phase": phase, **res})
                progress.advance(task)
        line = [
            f"{r['system']} {r['write']['median_ms']:.2f} ms"
            for r in runs
            if r["rep"] == rep and r["phase"] == "write" and "error" not in r
        ]
        progress.console.print(f"W2 rep {rep + 1}: write median " + ", ".join(line))
        shutil.rmtree(repdir)
    return {"steps": plan.w2_steps, "systems": plan.w2_systems, "floor": w2.FLOOR, "runs": runs}


def run_w3(plan: Plan, runner: Runner, progress: Progress, task: Any) -> dict[str, Any]:
    """W3: one build per system, then per repetition a fresh-process resume per size and
    system, alternating systems."""
    builds: dict[str, dict[str, Any]] = {}
    root = runner.tmp / "w3"
    for name, sizes in plan.w3_sizes.items():
        if name in w3.BUILD_AS:
            continue
        progress.update(task, description=f"W3 build {name} ({max(sizes)} steps)")
        res = runner.phase(
            "bench.w3",
            [
                "build",
                "--system",
                name,
                "--workdir",
                str(root / name),
                "--sizes",
                ",".join(map(str, sizes)),
            ],
            timeout=BUILD_TIMEOUT_S,
        )
        builds[name] = res
        progress.advance(task)
        if "error" not in res:
            progress.console.print(
                f"W3 build {name}: {max(sizes)} steps in {res['build_s']:.1f} s, "
                f"{res['bytes_at'][str(max(sizes))] / 1e6:.2f} MB"
            )
    for name, source in w3.BUILD_AS.items():
        if name in plan.w3_sizes:
            builds[name] = {**builds.get(source, {"error": f"no {source} build"}), "as": source}
    runs: list[dict[str, Any]] = []
    sizes_all = sorted({n for s in plan.w3_sizes.values() for n in s})
    for rep in range(plan.reps):
        for n, sample, (name, sizes) in itertools.product(
            sizes_all, range(plan.samples), plan.w3_sizes.items()
        ):
            if n not in sizes or "error" in builds[name]:
                continue
            progress.update(task, description=f"W3 rep {rep + 1}/{plan.reps} resume {name} @ {n}")
            # A pristine copy per phase: a resume may write (LangGraph records the
            # interrupted task), and every system starts from the same kind of file.
            work = root / "work" / f"{name}-{n}.db"
            work.parent.mkdir(parents=True, exist_ok=True)
            built = root / w3.BUILD_AS.get(name, name)
            shutil.copyfile(w3.snapshot_path(built, n), work)
            res = runner.phase(
                "bench.w3",
                ["resume", "--system", name, "--db", str(work), "--steps", str(n)],
                timeout=PHASE_TIMEOUT_S,
            )
            _remove_db(work)
            runs.append({"rep": rep, "sample": sample, "system": name, "steps": n, **res})
            progress.advance(task)
        line = [
            f"{r['steps']}: {r['resume_ms']:.1f} ms"
            for r in runs
            if r["rep"] == rep and r["system"] == "onceonly" and "error" not in r
        ]
        progress.console.print(f"W3 rep {rep + 1}: onceonly resume " + ", ".join(line))
    return {
        "sizes": plan.w3_sizes,
        "systems": list(plan.w3_sizes),
        "floor": w3.FLOOR,
        "builds": builds,
        "runs": runs,
    }


def _estimate_skips(plan: Plan, w3res: dict[str, Any] | None) -> None:
    """Fill the size estimate into the quadratic-growth skip reasons."""

    def cumulative(n: int) -> int:
        return sum(workload.live_state_bytes(s) for s in range(1, n + 1))

    for skip in plan.skipped:
        if "{est}" not in skip["reason"]:
            continue
        gb = cumulative(10_000) / 1e9
        est = f"{gb:.0f} GB (sum of the live state over the steps)"
        build = (w3res or {}).get("builds", {}).get(skip["system"], {})
        measured = build.get("bytes_at", {}).get("1000")
        if measured:
            gb = measured * cumulative(10_000) / cumulative(1000) / 1e9
            est = f"{gb:.0f} GB (extrapolated from the measured 1 000-step size)"
            skip["estimated_bytes"] = int(gb * 1e9)
        skip["reason"] = skip["reason"].format(est=est)


def _show(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def merge_earlier(results: dict[str, Any], earlier: dict[str, Any]) -> None:
    """Keep the workloads this run did not measure from an earlier results file, noting
    in ``meta["earlier"]`` when, at which commit and how each kept one was measured."""
    old_meta = earlier.get("meta", {})
    kept = results["meta"].setdefault("earlier", {})
    for name in ("w1", "w2", "w3", "w4", "w2lg"):
        if name in results or name not in earlier:
            continue
        results[name] = earlier[name]
        kept[name] = old_meta.get("earlier", {}).get(name) or {
            key: old_meta.get(key)
            for key in (
                "started_utc",
                "reps",
                "samples",
                "quick",
                "git_head",
                "loadavg_start",
                "fsync_ms",
            )
        }
    results["meta"]["workloads"] = [w for w in ("w1", "w2", "w3", "w4", "w2lg") if w in results]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="onceonly benchmarks W1 (guarded effects), W2 (incremental checkpoints), "
        "W3 (resume cost versus history length) against floors, LangGraph and DBOS, and W4 "
        "(many workers on PostgreSQL); targets in bench/summary.py; `python -m bench startup` "
        "for the start-up cost.",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 3 quick)")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="fresh-process load/resume samples per repetition (default 3; 1 quick)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions, smaller W3 histories, one W1 probe round",
    )
    p.add_argument(
        "--only",
        choices=["w1", "w2", "w3", "w4", "w2lg"],
        action="append",
        help="run one workload",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="raw results JSON")
    p.add_argument("--docs", type=Path, default=DOCS, help="where performance.md goes")
    p.add_argument(
        "--render-only", action="store_true", help="re-render the docs from --out, run nothing"
    )
    p.add_argument("--keep-tmp", action="store_true", help="keep the databases under /tmp")
    p.add_argument(
        "--merge",
        action="store_true",
        help="with --only: keep the other workloads' results from --out (the docs say when "
        "and at which commit each was measured)",
    )
    a = p.parse_args(argv)

    from . import report  # matplotlib is only needed once results exist

    console = Console()
    if a.render_only:
        results = json.loads(a.out.read_text(encoding="utf-8"))
        report.render(results, a.docs)
        console.print(f"rendered {a.docs / 'performance.md'}")
        return 0
    reps = a.reps if a.reps is not None else (3 if a.quick else 5)
    samples = a.samples if a.samples is not None else (1 if a.quick else 3)
    if reps < 3:
        console.print("[yellow]fewer than 3 repetitions: fine for a try, not for publishing")
    meta = machine()
    started = dt.datetime.now(dt.UTC)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="onceonly-bench-", dir="/tmp"))
    src = snapshot_sources(tmp)
    meta["fsync_ms"] = fsync_latency_ms(tmp)
    meta["checkpoint_src_sha256"] = source_digest(src)
    meta["ledger_src_sha256"] = source_digest(src, "ledger")
    lazy = probe_lazy(src)
    every = ["w1", "w2", "w3", "w4", "w2lg"]
    workloads = [w for w in every if w in (a.only or every)]
    missing = probe_peers(src) if "w1" in workloads else {}
    plan = make_plan(reps, samples, quick=a.quick, workloads=workloads, lazy=lazy, missing=missing)
    runner = Runner(tmp, src, console)
    n_w1 = w1_phase_count(plan) if "w1" in plan.workloads else 0
    n_w2 = reps * (1 + samples) * len(plan.w2_systems) if "w2" in plan.workloads else 0
    n_w3 = 0
    if "w3" in plan.workloads:
        n_builds = len([n for n in plan.w3_sizes if n not in w3.BUILD_AS])
        n_w3 = n_builds + reps * samples * sum(len(s) for s in plan.w3_sizes.values())
    results: dict[str, Any] = {
        "meta": {
            **meta,
            "started_utc": started.isoformat(timespec="seconds"),
            "reps": reps,
            "samples": samples,
            "quick": a.quick,
            "workloads": plan.workloads,
            "command": COMMAND + (" (python -m bench --quick)" if a.quick else ""),
            "tmp": str(tmp),
        },
        "skipped": plan.skipped,
    }
    console.print(
        f"[bold]onceonly bench[/bold]: {', '.join(plan.workloads).upper()}, {reps} repetitions"
        f"{' (quick)' if a.quick else ''}; {meta['nproc']} CPUs, Python {meta['python']}, "
        f"SQLite {meta['sqlite']}; databases in {tmp}"
    )
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description:<52}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            n_w4 = w4.phase_count(reps) if "w4" in plan.workloads else 0
            n_lg = w2lg.phase_count(reps, samples) if "w2lg" in plan.workloads else 0
            total = progress.add_task("all phases", total=n_w1 + n_w2 + n_w3 + n_w4 + n_lg)
            if "w1" in plan.workloads:
                results["w1"] = run_w1(plan, runner, progress, total)
            if "w2" in plan.workloads:
                results["w2"] = run_w2(plan, runner, progress, total)
            if "w3" in plan.workloads:
                results["w3"] = run_w3(plan, runner, progress, total)
            if "w4" in plan.workloads:
                results["w4"] = w4.run(reps, a.quick, runner, progress, total)
            if "w2lg" in plan.workloads:
                results["w2lg"] = w2lg.run(reps, samples, runner, progress, total)
    finally:
        if not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    _estimate_skips(plan, results.get("w3"))
    results["meta"]["duration_s"] = time.perf_counter() - t0
    results["meta"]["loadavg_end"] = list(os.getloadavg())
    after = source_digest()
    if after != meta["checkpoint_src_sha256"]:
        results["meta"]["working_tree_sha256_after"] = after
        console.print(
            "[yellow]checkpoint/ changed in the working tree while the benchmark ran; the "
            f"figures are for the copy taken at the start (sha256 {meta['checkpoint_src_sha256']})"
        )
    after = source_digest(package="ledger")
    if after != meta["ledger_src_sha256"]:
        results["meta"]["ledger_working_tree_sha256_after"] = after
        console.print(
            "[yellow]ledger/ changed in the working tree while the benchmark ran; the "
            f"figures are for the copy taken at the start (sha256 {meta['ledger_src_sha256']})"
        )
    if a.merge and a.out.exists():
        merge_earlier(results, json.loads(a.out.read_text(encoding="utf-8")))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = a.out.with_name(a.out.name + ".tmp")
    tmp_out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    tmp_out.replace(a.out)
    report.render(results, a.docs)
    console.print(report.console_summary(results))
    console.print(
        f"wrote {_show(a.out)} and {_show(a.docs / 'performance.md')} "
        f"in {results['meta']['duration_s'] / 60:.1f} min"
    )
    return 0
