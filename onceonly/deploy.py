"""Before a deploy: which stored runs the new code would strand.

A run that is not over names the steps it goes to next: its next step, and while it
waits, the step after the wait and its rejection and expiry paths; a run with a deadline
also names the deadline's path. Code that lacks one of them cannot drive the run past
that point (the worker refuses it with ``ConfigurationError`` and skips it): a deploy
that renamed or removed a step a run sits in would strand the run, perhaps days later,
when its approval comes. :func:`stranded` finds those runs from the code about to be
deployed, so that the deploy keeps the old step (or maps it) first;
``onceonly runs check --flows module:attribute`` prints them and fails, and a worker
logs them when it starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from onceonly.checkpoint import Run, RunStatus, Store

from .flow import Flow, flow_map
from .runtime import META

__all__ = ["Stranded", "stranded"]


@dataclass(frozen=True)
class Stranded:
    """A run the code cannot drive past a step it names.

    Attributes:
        run_id: The run.
        flow: Its flow.
        status: Its status.
        step: The step the code lacks.
        where: Where the run names it (``next step``, ``after wait 'x'``, ...).
        code_version: The flow version the run is on.
        served: False: the code does not serve the run's version at all (``step`` is
            empty): the run is left to workers of its version, or ``runs upgrade``.
    """

    run_id: str
    flow: str
    status: RunStatus
    step: str
    where: str
    code_version: str
    served: bool = True


def named_steps(run: Run, meta: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """The steps ``run`` goes to next, with where it names them."""
    if run.next_step:
        yield str(run.next_step), "next step"
    waiting = meta.get("waiting") or {}
    if waiting:
        name = waiting.get("name")
        for key, label in (
            ("then", "after"),
            ("on_reject", "on rejection of"),
            ("on_expire", "on expiry of"),
        ):
            if waiting.get(key):
                yield str(waiting[key]), f"{label} wait {name!r}"
    deadline = meta.get("deadline") or {}
    if deadline.get("then") and not deadline.get("passed"):
        yield str(deadline["then"]), "on its deadline"


def _not_over(store: Store, flow: str) -> list[Run]:
    """The runs of ``flow`` that are not over (each status read through its index, so
    ended runs, however many, cost nothing), oldest update first."""
    runs = [
        r
        for status in (RunStatus.RUNNING, RunStatus.WAITING, RunStatus.FAILED)
        for r in store.list_runs(status=status, flow=flow)
    ]
    return sorted(runs, key=lambda r: (r.updated_at, r.run_id))


def stranded(store: Store, flows: Iterable[Flow], *, deep: bool = True) -> list[Stranded]:
    """The runs of ``flows`` (by name) that are not over and name a step the given code
    lacks, oldest update first; and those on a version the code does not serve at all
    (``served=False``: they wait for a worker of their version, or an upgrade). Runs of
    other flows are not this code's to drive and are left out; so are ended runs. A
    failed run counts (an operator's retry resumes it at its next step). ``deep=False``
    checks only the next step, from the run rows (no checkpoint is read: what a worker
    checks when it starts).

    Raises:
        ConfigurationError: ``flows`` names a flow twice or one without steps.
        CorruptRecord: A run or its head checkpoint fails its seal.
    """
    code = flow_map(flows)
    out: list[Stranded] = []
    for name, flow in sorted(code.items()):
        for run in _not_over(store, name):
            if not flow.drives(run.code_version):
                where = f"version {run.code_version!r}, not served by this code"
                out.append(
                    Stranded(
                        run.run_id, name, run.status, "", where, run.code_version, served=False
                    )
                )
                continue
            meta: Mapping[str, Any] = {}
            if deep and run.head_seq is not None:
                meta = store.load(run.run_id, lazy=True).state.get(META) or {}
            seen: set[str] = set()
            for step, where in named_steps(run, meta):
                if step in flow.steps or step in seen:
                    continue
                seen.add(step)
                out.append(Stranded(run.run_id, name, run.status, step, where, run.code_version))
    return out
