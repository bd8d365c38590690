"""The systems under test, behind small interfaces.

Each system is a real implementation (onceonly, stdlib sqlite3 floors, LangGraph with its
SqliteSaver, DBOS); phases import only the system they run, so a onceonly process never
imports LangGraph. :class:`System` is the W2/W3 interface (checkpoints), :class:`W1System`
the W1 one (guarded effects).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class WriteResult:
    """Per-step timings of a W2 write phase (seconds), plus anything system-specific.

    ``write_s[i]`` is the checkpoint write of step i+1 (for LangGraph: the saver's
    ``put`` + ``put_writes`` calls made during that step); ``step_s[i]`` the step's wall
    time (computing the change, applying it, checkpointing it).
    """

    write_s: list[float]
    step_s: list[float]
    total_s: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadResult:
    """A fresh-process open + load (W2) or open + load + reach the next step (W3).

    ``state`` is verified against the expected state after the timing, before ``close``.
    """

    seconds: float
    state: Any
    breakdown: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Closes the store; called after the state is verified (a store may load lazily).
    close: Callable[[], None] | None = None


#: Called by a build at each measuring point, with the database quiescent.
AtPoint = Callable[[int], None]


class System(ABC):
    """One system: how it writes W2, builds W3 histories, loads and resumes."""

    name: str = ""
    label: str = ""

    @abstractmethod
    def write_w2(self, db: Path, steps: int) -> WriteResult:
        """Write ``steps`` steps with sync durability, one checkpoint per step, timed."""

    @abstractmethod
    def load_w2(self, db: Path, steps: int) -> LoadResult:
        """Open the database and load the latest state (timed)."""

    @abstractmethod
    def build(self, db: Path, points: Sequence[int], at_point: AtPoint) -> dict[str, Any]:
        """Write a history by the fastest path that stores the same rows, stopping at
        each of ``points`` (ascending) with the database quiescent to call ``at_point``."""

    @abstractmethod
    def resume(self, db: Path, steps: int) -> LoadResult:
        """Open, load the latest checkpoint and reach the start of the next step (timed)."""


_REGISTRY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "onceonly": ("bench.systems.onceonly", "OnceOnly", {"mode": "update"}),
    "onceonly-save": ("bench.systems.onceonly", "OnceOnly", {"mode": "save"}),
    "onceonly-lazy": ("bench.systems.onceonly", "OnceOnly", {"mode": "update", "lazy": True}),
    "floor-full": ("bench.systems.floors", "PickleFull", {}),
    "floor-delta": ("bench.systems.floors", "PickleDelta", {}),
    "floor-latest": ("bench.systems.floors", "PickleLatest", {}),
    "langgraph": ("bench.systems.langgraph", "LangGraph", {"delta": False}),
    "langgraph-delta": ("bench.systems.langgraph", "LangGraph", {"delta": True}),
}

LABELS: dict[str, str] = {
    "onceonly": "onceonly `update()` (merge/append/set)",
    "onceonly-save": "onceonly `save()` (full state, diffed)",
    "onceonly-lazy": "onceonly `update()`, resumed with `load(lazy=True)`",
    "floor-full": "floor: pickle full state per step",
    "floor-delta": "floor: pickle base + per-step delta rows",
    "floor-latest": "floor: pickle latest state only (one row, no history)",
    "langgraph": "LangGraph StateGraph + SqliteSaver",
    "langgraph-delta": "LangGraph StateGraph + SqliteSaver, DeltaChannel",
}


# -- W1: guarded effects ---------------------------------------------------------------


@dataclass
class CallsResult:
    """A W1 run of guarded calls, in call order.

    ``call_s[i]`` is call i's latency (the guarded call alone: the argument is made before
    the clock starts); ``total_s`` runs from the start of the first call to the return of
    the last; ``executed`` is how many guarded bodies ran (the process-global counter);
    ``results`` what the calls returned (verified after the timing). ``errors`` counts
    calls that raised (a tolerant resume only; otherwise the phase fails).
    """

    call_s: list[float]
    total_s: float
    executed: int
    results: list[Any]
    extra: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    #: The phase must end with ``os._exit`` after reporting (DBOS: a crash that leaves
    #: the workflow pending, to be recovered by the next process).
    hard_exit: bool = False


class W1System(ABC):
    """One W1 system: guarded calls with durable intent and outcome, and their replay."""

    name: str = ""

    @abstractmethod
    def cold(self, db: Path, calls: int) -> CallsResult:
        """New database: make ``calls`` guarded calls, every one executing (timed)."""

    @abstractmethod
    def warm(self, db: Path, calls: int, *, tolerant: bool = False) -> CallsResult:
        """Fresh process, same database, same run: every call should return its recorded
        result without executing. ``tolerant``: count a call that raises instead of
        failing (the probe's resume)."""

    @abstractmethod
    def probe_child(self, db: Path, calls: int) -> None:
        """New database: make ``calls`` guarded calls and ``os._exit(0)`` right after the
        last one returns (never returns)."""

    @abstractmethod
    def recorded(self, db: Path, calls: int) -> int:
        """How many outcomes the database holds after :meth:`probe_child` (read, no
        resume)."""

    def run_async(self, db: Path, calls: int, concurrency: int) -> CallsResult:
        """New database: ``concurrency`` concurrent guarded calls until ``calls`` are done."""
        raise NotImplementedError(f"{self.name} has no W1-async path")


_W1_REGISTRY: dict[str, tuple[str, str]] = {
    "onceonly": ("bench.systems.w1_onceonly", "LedgerCalls"),
    "onceonly-witness": ("bench.systems.w1_onceonly", "WitnessedLedgerCalls"),
    "onceonly-guard": ("bench.systems.w1_onceonly", "GuardCalls"),
    "floor": ("bench.systems.w1_floor", "TwoCommitFloor"),
    "langgraph": ("bench.systems.w1_langgraph", "LangGraphTasks"),
    "dbos": ("bench.systems.w1_dbos", "DbosSteps"),
}

W1_LABELS: dict[str, str] = {
    "onceonly": "onceonly `Ledger.perform` (sync durability)",
    "onceonly-witness": "onceonly `Ledger.perform`, sync, with a witness file",
    "onceonly-guard": "onceonly `guard` in a `step` (sync durability)",
    "floor": "floor: sqlite3 WAL FULL, 2 commits per call",
    "langgraph": "LangGraph `@entrypoint` + `@task`, SqliteSaver sync",
    "dbos": "DBOS `@DBOS.step` in a workflow, SQLite WAL",
}


def w1_names() -> list[str]:
    """Every W1 system name."""
    return list(_W1_REGISTRY)


def get_w1(name: str) -> W1System:
    """Instantiate W1 system ``name`` (importing only its module)."""
    module, cls = _W1_REGISTRY[name]
    system: W1System = getattr(importlib.import_module(module), cls)()
    return system


def names() -> list[str]:
    """Every known system name."""
    return list(_REGISTRY)


def get(name: str) -> System:
    """Instantiate system ``name`` (importing only its module)."""
    module, cls, kwargs = _REGISTRY[name]
    system: System = getattr(importlib.import_module(module), cls)(**kwargs)
    return system
