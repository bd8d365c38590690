"""The store's in-process records: the head cache's entries, queued checkpoints, barriers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from . import _delta
from ._sql import _row_info
from .records import CheckpointInfo, Run

_UNSET: Final = object()  # an argument not given (None is a value: "no next step")
_HEAD_CACHE = 1024  # runs whose head this process keeps (least recently used dropped)


@dataclass
class _Head:
    """What this process knows of a run's latest checkpoint (a private copy).

    ``run`` is the run row as of this checkpoint when this process read it together with
    the checkpoint, or wrote the checkpoint itself (with the status, next step and handoff
    written atomically with it); None when only the checkpoint was read.
    """

    seq: int
    keyframe_seq: int
    deltas: int
    delta_bytes: int
    keyframe_bytes: int
    schema_version: int
    state: dict[str, Any]
    lists: dict[str, _delta.ListChunks] = field(default_factory=dict)
    info: CheckpointInfo | None = None
    run: Run | None = None
    # Dict channels of ``state`` known to be pageable (see ``_delta.diff_known``).
    paged: frozenset[str] = frozenset()


@dataclass
class _Pending:
    """A checkpoint encoded and waiting to be written."""

    run_id: str
    seq: int
    kind: int
    keyframe_seq: int
    step: str
    source: str
    schema_version: int
    created_at: float
    body: bytes  # stored form
    digest: bytes
    blobs: dict[bytes, bytes]  # hash -> stored form
    refs: set[bytes]
    run_values: dict[str, Any]
    parent_digest: bytes = b""  # the checkpoint this one was built on (seq - 1)
    reported: int = 0  # losses of its run reported when it was queued
    gen: int = 0  # async mode: the error generation it was queued in

    def info(self) -> CheckpointInfo:
        return _row_info(self.run_id, self)


_NO_WAIT = threading.Event()


class _Barrier:
    """A write barrier, optionally carrying work to run in the same transaction."""

    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[Any], Any] | None = None, *, waits: bool = True) -> None:
        # Only barriers handed to the background writer are waited on.
        self.done = threading.Event() if waits else _NO_WAIT
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        """The work's result, or its error raised."""
        if self.error is not None:
            raise self.error
        return self.result
