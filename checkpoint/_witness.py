"""A witness: what the store had reached, kept outside the database, so a store
restored from an older copy is refused instead of served as current.

One append-only file (``ONCEONLY_WITNESS``), shared by every process of a deployment:
each appends whole lines and fsyncs them; each reads every line when it opens the file.
Two kinds of line:

* ``<chain>\\t<seq>``: the effects ledger's audit chain ``chain`` reached event ``seq``
  (appended before a claim acts);
* ``run\\t<run id>\\t<rev>``: the store wrote revision ``rev`` of the run's sealed row
  (appended after the write commits; every sealed run-row write is a new revision:
  checkpoints, status changes, wait decisions); ``run\\t<run id>\\t-``: the run is
  removed by retention (appended before the removal commits).

``#reset\\t<note>`` starts over: an operator accepted the store as it is after a restore
(``onceonly audit accept-restore``), with who and why in the note.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping

__all__ = ["Witness", "read_witness"]


def read_witness(lines: Iterable[str]) -> tuple[dict[str, int], dict[str, int], int | None]:
    """Parse witness lines: (chain heads, run revisions, the number of the first line that
    is none of the known kinds, or None). A ``#reset`` line starts over."""
    heads: dict[str, int] = {}
    runs: dict[str, int] = {}
    bad: int | None = None
    for n, line in enumerate(lines, 1):
        parts = line.rstrip("\n").split("\t")
        if len(parts) == 2 and parts[1].isdigit():
            heads[parts[0]] = max(heads.get(parts[0], 0), int(parts[1]))
        elif len(parts) == 3 and parts[0] == "run" and parts[2].isdigit():
            runs[parts[1]] = max(runs.get(parts[1], 0), int(parts[2]))
        elif len(parts) == 3 and parts[0] == "run" and parts[2] == "-":
            runs.pop(parts[1], None)  # removed by retention
        elif parts and parts[0] == "#reset":
            heads.clear()
            runs.clear()
        elif line.strip() and bad is None:
            bad = n
    return heads, runs, bad


class Witness:
    """The witness file at ``path`` (created if missing).

    Attributes:
        path: The file.
        heads: Audit chain -> the highest event seen.
        runs: Run id -> the highest revision of its row seen.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.heads: dict[str, int] = {}
        self.runs: dict[str, int] = {}
        try:
            with open(path, encoding="utf-8") as fh:
                self.heads, self.runs, _ = read_witness(fh)
        except FileNotFoundError:
            pass
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _append(self, lines: list[str]) -> None:
        if lines:
            os.write(self._fd, "".join(lines).encode())
            os.fsync(self._fd)

    def advance(self, chain: str, seq: int) -> None:
        """Record that ``chain`` reached ``seq`` (durably, before returning)."""
        with self._lock:
            if seq <= self.heads.get(chain, 0):
                return
            self._append([f"{chain}\t{seq}\n"])
            self.heads[chain] = seq

    def advance_runs(self, revs: Iterable[tuple[str, int]]) -> None:
        """Record the run-row revisions a transaction committed (one fsync)."""
        with self._lock:
            lines = []
            for run_id, rev in revs:
                if rev > self.runs.get(run_id, 0) and _plain(run_id):
                    lines.append(f"run\t{run_id}\t{rev}\n")
                    self.runs[run_id] = rev
            self._append(lines)

    def forget(self, run_ids: Iterable[str]) -> None:
        """Record that these runs are being removed on purpose (retention), before the
        removal commits: a run gone from the store is then not taken for a restore."""
        with self._lock:
            lines = [f"run\t{r}\t-\n" for r in run_ids if r in self.runs and _plain(r)]
            self._append(lines)
            for r in run_ids:
                self.runs.pop(r, None)

    def reset(
        self, heads: Mapping[str, int], note: str, runs: Mapping[str, int] | None = None
    ) -> None:
        """Accept the store as it is (an operator accepted a restore)."""
        runs = runs or {}
        with self._lock:
            lines = [
                f"#reset\t{' '.join(note.split())}\n",
                *(f"{c}\t{s}\n" for c, s in sorted(heads.items())),
                *(f"run\t{r}\t{v}\n" for r, v in sorted(runs.items()) if _plain(r) and v),
            ]
            self._append(lines)
            self.heads = dict(heads)
            self.runs = {r: v for r, v in runs.items() if _plain(r) and v}

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


def _plain(name: str) -> bool:
    """Whether a run id can be written on a witness line (no tab, no newline)."""
    return "\t" not in name and "\n" not in name and "\r" not in name
