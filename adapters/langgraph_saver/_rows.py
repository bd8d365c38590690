"""The saver's rows as read from its tables, and the small helpers around them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import RunnableConfig

from onceonly.adapters import _langgraph_schema as _schema
from onceonly.checkpoint import (
    ConfigurationError,
    OnceOnlyError,
    RowKeys,
)
from onceonly.ledger import Keyring

_FLOW = "langgraph"
_RUN_CACHE = 4096
_ATTEMPTS = 3
_WALK_ROWS = 4096  # rows and writes a saver remembers as verified for delta-channel walks
_WALK_SEEDS = 8  # delta-channel seeds a saver keeps built (stored form)
_CK_COLS = (
    "thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, seq, lg_run_id, "
    "record, digest, seal"
)
_WRITE_COLS = "task_id, idx, channel, task_path, value, digest, seal"


class _Stale(OnceOnlyError):
    """The store run this process remembered for a namespace is gone (deleted or
    rewritten by another saver): look it up again."""


@dataclass(frozen=True)
class _Row:
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str | None
    run_id: str
    seq: int
    lg_run_id: str | None
    record: bytes
    digest: bytes
    seal: bytes | None

    @classmethod
    def of(cls, r: Sequence[Any]) -> _Row:
        return cls(
            str(r[0]),
            str(r[1]),
            str(r[2]),
            None if r[3] is None else str(r[3]),
            str(r[4]),
            int(r[5]),
            None if r[6] is None else str(r[6]),
            bytes(r[7]),
            bytes(r[8]),
            None if r[9] is None else bytes(r[9]),
        )

    def parts(self) -> list[object]:
        return _schema.checkpoint_parts(
            self.thread_id,
            self.checkpoint_ns,
            self.checkpoint_id,
            self.parent_checkpoint_id,
            self.run_id,
            self.seq,
            self.lg_run_id,
            self.record,
        )


def _core_step(label: str, checkpoint_id: str) -> str:
    """The step label of the store checkpoint holding a LangGraph checkpoint's values:
    ``label@checkpoint_id``. Written (sealed) in the transaction that writes the
    checkpoint's row; a label without ``@`` is one an earlier version wrote, whose row
    may have been left out by a crash between two commits."""
    return f"{label[:200]}@{checkpoint_id}"


def _row_keys(keyring: Keyring | None, *, unkeyed: bool) -> RowKeys | None:
    """The keys a saver seals with: the keyring's, else ``ONCEONLY_SECRETS``'s; none
    only when asked for (``unkeyed``).

    Raises:
        ConfigurationError: No keyring, no ``ONCEONLY_SECRETS`` and not ``unkeyed``; or a
            keyring and ``unkeyed`` both; or ``ONCEONLY_SECRETS`` is malformed.
    """
    if keyring is not None and unkeyed:
        raise ConfigurationError("OnceOnlySaver: pass a keyring or unkeyed=True, not both")
    if keyring is not None:
        return keyring.row_keys()
    if unkeyed:
        return None
    if os.environ.get("ONCEONLY_SECRETS"):
        return Keyring.from_env().row_keys()
    raise ConfigurationError(_NO_KEYS)


_NO_KEYS = (
    "OnceOnlySaver: no integrity keys. Set ONCEONLY_SECRETS (as for the ledger), pass "
    "keyring=Keyring(...), or give it a store opened with integrity keys; or pass "
    "unkeyed=True to run without them: then a checkpoint, write or thread row edited by "
    "someone who recomputes its unkeyed digest is not detected"
)


def _conf(config: RunnableConfig) -> dict[str, Any]:
    return config.get("configurable") or {}
