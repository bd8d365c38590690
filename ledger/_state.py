"""What every room of the ledger shares: its configuration, its caches, and the one way
it writes (fail closed).

:class:`~onceonly.ledger.Ledger` is assembled from mixins over :class:`LedgerState`:
claiming (``_claims``), settling outcomes and the audit chain (``_transitions``),
reconciliation (``_reconcile``), replay from memory (``_replay``), integrity checks where
the ledger acts (``_integrity``), data keys and sealed payloads (``_privacy``) and the read
side (``_queries``). The attributes are set by ``Ledger.__init__``; they are declared here
so each room type-checks on its own.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from onceonly.checkpoint import Codec, RowKeys, Store
from onceonly.checkpoint._witness import Witness
from onceonly.checkpoint.errors import ConfigurationError, CorruptRecord

from ._rows import Row
from .crypto import Sealer
from .errors import LedgerError, LedgerUnavailable, StoreRolledBack
from .keys import Keyring
from .records import InFlightPolicy

__all__ = ["LedgerState"]

T = TypeVar("T")


class LedgerState:
    """The ledger's state and its fail-closed write (the rooms provide the rest)."""

    store: Store
    keyring: Keyring
    owner: str
    lease_s: float
    in_flight: InFlightPolicy
    codec: Codec
    read_only: bool
    witness: Witness | None
    _clock: Callable[[], float]
    _sealer: Sealer
    _q: str  # the driver's parameter marker
    _pg: bool
    _lock: threading.Lock
    _keys: RowKeys | None  # None: read-only, no seals checked or made
    # chain -> (last event's seq, hash) as this process appended it
    _heads: dict[str, tuple[int, bytes]]
    # chain -> (head known whole in this process, when it was last counted in full)
    _verified: dict[str, tuple[int, float]]
    _recount_cost: dict[str, float]
    _terminal: dict[str, Row]  # finished rows replayed from memory, by key id
    # identity parts -> (keyring, its (secret id, key id) candidates): a guarded call asks
    # for its key ids up to three times (divergence check, span, claim); derived once
    _key_memo: dict[
        tuple[tuple[object, ...], tuple[type, ...]], tuple[Keyring, list[tuple[str, str]]]
    ]
    _prefetched: set[str]  # runs whose finished effects were loaded
    _live: set[tuple[str, int]]  # claims this object handed out, open
    # key id -> (the row as this process sealed it, its event as appended): a read
    # that finds exactly these needs no second verification (see _check_row)
    _mine: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]]
    # chain -> (seq, hash, seal) of the head this process sealed last
    _head_seals: dict[str, tuple[int, bytes, bytes]]
    #: Fold the checks into the writing statements where this process's memory allows
    #: (SQLite; a statement that finds anything else writes nothing and the full path
    #: decides): see ``ClaimMixin._fold_claim`` and ``TransitionMixin._fold_outcome``.
    #: On PostgreSQL, fold a row's write, its event and the head's move into one
    #: statement (``TransitionMixin._write_appending``).
    _folds: bool = True
    _poisoned: BaseException | None
    _pool: concurrent.futures.ThreadPoolExecutor | None
    _behind: StoreRolledBack | None

    def _check(self) -> None:
        if self.read_only:
            raise ConfigurationError(
                "this ledger was opened read-only (no keyring): it writes nothing; set "
                "ONCEONLY_SECRETS to act"
            )
        if self._behind is not None:
            raise self._behind
        if self._poisoned is not None:
            raise LedgerUnavailable(
                "this ledger stopped after an outcome could not be recorded "
                f"({self._poisoned}); nothing more is acted on through it. Once the database "
                "answers again, Ledger.recover() (a Worker calls it by itself after a "
                "transient failure) or a new process starts again from what is on disk, and "
                "the unrecorded effect is reconciled as in doubt."
            ) from self._poisoned

    def _write(self, fn: Callable[[Any], T], *, outcome: bool) -> T:
        self._check()
        try:
            return self.store.transact(fn)
        except LedgerError:
            raise  # the state machine's own answers (LeaseLost, InvalidTransition, ...)
        except CorruptRecord:
            raise  # a tampered entry, refused before anything was written (I4)
        except Exception as exc:
            # Anything else (a store or driver error, a background write failure, a bug)
            # means the transition is not known to be recorded: fail closed.
            if outcome:
                self._poisoned = exc
                raise LedgerUnavailable(
                    f"the ledger could not record this effect's outcome ({exc}); the effect "
                    f"was performed and will be reconciled as in doubt. This ledger now "
                    f"refuses further work until Ledger.recover() or a restart."
                ) from exc
            raise LedgerUnavailable(
                f"the ledger could not be written ({exc}); nothing was acted on for this call"
            ) from exc

    def _seal(self, table: str, parts: list[object]) -> bytes:
        if self._keys is None:  # pragma: no cover  (read-only ledgers refuse writes first)
            raise ConfigurationError("a read-only ledger seals nothing")
        return self._keys.seal(table, parts)
