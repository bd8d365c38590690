"""The demo: a small vendor-onboarding flow, killed mid-run, resumed from its checkpoint.

The flow runs in a child process that SIGKILLs itself part-way through (no clean-up, no
flush, no atexit: what a deploy or an OOM kill does). A fresh process then opens the same
store, loads the latest checkpoint and continues at the run's next step. Every step
appends a line to a work log outside the store, so the demo can show from an independent
record that no completed step ran twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint import Handoff, RunStatus, Store

FLOW = "vendor-onboarding"
RUN_ID = "vendor-acme-001"

State = dict[str, Any]


def _collect_documents(state: State) -> State:
    state["documents"] = ["w9.pdf", "bank-letter.pdf", "incorporation.pdf"]
    return state


def _extract_details(state: State) -> State:
    state["vendor"] = {"name": "ACME Tooling Ltd", "tax_id": "XX-1234567", "iban": "GB00TEST"}
    return state


def _screen_sanctions(state: State) -> State:
    state["screening"] = {"list": "demo-sanctions-2026-11", "hits": 0, "result": "clear"}
    return state


def _record_approval(state: State) -> State:
    state["approval"] = {"by": "compliance@example.com", "decision": "approved"}
    return state


def _create_vendor_record(state: State) -> State:
    state["vendor_record"] = {"id": "V-000173", "status": "active"}
    return state


STEPS: list[tuple[str, Callable[[State], State]]] = [
    ("collect_documents", _collect_documents),
    ("extract_details", _extract_details),
    ("screen_sanctions", _screen_sanctions),
    ("record_approval", _record_approval),
    ("create_vendor_record", _create_vendor_record),
]
_NAMES = [name for name, _ in STEPS]


def run_flow(db_url: str, work_log: Path, kill_after: int | None) -> None:
    """Run (or resume) the demo run until done, or SIGKILL this process after
    ``kill_after`` steps have been checkpointed by this process."""
    with Store.open(db_url) as store:
        try:
            run = store.get_run(RUN_ID)
        except Exception:  # noqa: BLE001  (first start: the run does not exist yet)
            run = store.create_run(
                FLOW,
                run_id=RUN_ID,
                next_step=_NAMES[0],
                handoff=Handoff(goal="onboard ACME Tooling as an active vendor"),
            )
            store.save(RUN_ID, {"steps_done": []}, step="start", next_step=_NAMES[0])
        state = store.load(RUN_ID).state
        done_here = 0
        while run.next_step is not None:
            idx = _NAMES.index(run.next_step)
            name, fn = STEPS[idx]
            with work_log.open("a") as fh:  # the independent record of work done
                fh.write(f"{os.getpid()} {name}\n")
            state = fn(state)
            state["steps_done"] = [*state["steps_done"], name]
            nxt = _NAMES[idx + 1] if idx + 1 < len(_NAMES) else None
            store.save(
                RUN_ID,
                state,
                step=name,
                next_step=nxt,
                status=RunStatus.COMPLETED if nxt is None else RunStatus.RUNNING,
            )
            store.update_run(
                RUN_ID,
                handoff=Handoff(
                    goal="onboard ACME Tooling as an active vendor",
                    done=tuple(state["steps_done"]),
                    next=() if nxt is None else (nxt,),
                ),
            )
            run = store.get_run(RUN_ID)
            done_here += 1
            if kill_after is not None and done_here >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)


def main(db: str | None = None) -> int:
    """Run the demo and print what happened. Returns a process exit code."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="onceonly-demo-"))
    db_path = Path(db) if db else workdir / "demo.db"
    if db_path.exists():
        console.print(f"[red]{db_path} exists; the demo wants a fresh database[/red]")
        return 2
    url = f"sqlite:///{db_path}"
    work_log = workdir / "work.log"
    console.rule("[bold]onceonly demo: resume, not restart")
    console.print(f"store: {url}")

    def child(kill_after: int | None) -> int:
        cmd = [sys.executable, "-m", "onceonly.demo", url, str(work_log)]
        if kill_after is not None:
            cmd.append(str(kill_after))
        return subprocess.run(cmd, check=False).returncode

    console.print("\n[bold]1.[/bold] a worker starts the run and is SIGKILLed after 3 steps")
    rc = child(3)
    console.print(
        f"   worker exit status: {rc} ({'killed by SIGKILL' if rc == -9 else 'unexpected'})"
    )

    with Store.open(url) as store:
        run = store.get_run(RUN_ID)
        snap = store.load(RUN_ID)
        console.print(
            f"   saved: checkpoint {snap.info.seq} after step [cyan]{snap.info.step}[/cyan]; "
            f"next step [cyan]{run.next_step}[/cyan]; status {run.status.value}"
        )
        console.print(f"   handoff: done={list(run.handoff.done)} next={list(run.handoff.next)}")

    console.print("\n[bold]2.[/bold] a fresh worker process resumes from the checkpoint")
    rc2 = child(None)
    console.print(f"   worker exit status: {rc2}")

    with Store.open(url) as store:
        run = store.get_run(RUN_ID)
        snap = store.load(RUN_ID)
        table = Table(title=f"history of run {RUN_ID}")
        for col in ("seq", "step", "kind", "source"):
            table.add_column(col)
        for info in store.history(RUN_ID):
            table.add_row(
                str(info.seq), info.step, "keyframe" if info.keyframe else "delta", info.source
            )
        console.print(table)
        console.print(f"   final status: [bold]{run.status.value}[/bold]")
        console.print(f"   vendor record: {snap.state.get('vendor_record')}")

    lines = work_log.read_text().splitlines()
    ran = [line.split()[1] for line in lines]
    pids = {line.split()[0] for line in lines}
    dupes = sorted({s for s in ran if ran.count(s) > 1})
    console.print(
        f"\n   work log: {len(ran)} step executions in {len(pids)} processes; "
        f"steps run twice: {dupes or 'none'}"
    )
    ok = rc == -signal.SIGKILL and rc2 == 0 and not dupes and ran == _NAMES
    ok = ok and run.status is RunStatus.COMPLETED
    console.print(
        "[bold green]OK: resumed, not restarted[/bold green]"
        if ok
        else "[bold red]FAILED[/bold red]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    run_flow(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
