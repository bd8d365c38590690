"""One property of the checkpoint store, checked beside a plain dict model: **every
checkpoint loads exactly as it was saved**, whatever mix of deltas, keyframes, paged dicts,
chunked lists, explicit updates and process restarts produced it.

The machine changes a run's state in every way a step can (set, merge and delete keys of
dict channels, large dicts that are paged, appends that seal list chunks, list edits and
replacements, channel deletions), commits each change with ``Store.save`` or
``Store.update``, sometimes reopens the store (a new process's view), and after every step
loads the latest checkpoint and one earlier checkpoint and compares them with the model's
record, type for type. A small keyframe interval makes keyframes frequent.

Two positive controls run the same machine against deliberately broken stores and must
fail.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from onceonly.checkpoint import CheckpointInfo, KeyframePolicy, Snapshot, Store
from tests.values import strict_equal

POLICY = KeyframePolicy(max_deltas=3)
SMALL = ("a", "b", "c")
DICTS = ("docs", "big")
LISTS = ("log", "chat")
CHANNELS = SMALL + DICTS + LISTS

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.tuples(st.integers(0, 9), st.text(max_size=2))
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=6,
)
KEYS = st.integers(0, 300).map(lambda i: f"k{i}")

StoreFactory = Callable[..., Store]


def _items(seed: int, n: int) -> list[Any]:
    rng = random.Random(seed)
    return [(rng.randrange(1000), "m" * rng.randrange(4)) for _ in range(n)]


def _big_dict(seed: int, n: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        f"k{rng.randrange(400)}": [rng.randrange(100), "v" * rng.randrange(5)] for _ in range(n)
    }


class CheckpointModel(RuleBasedStateMachine):
    """A run's state kept in a dict beside the store, and every saved version of it."""

    def __init__(self, url: str, open_store: StoreFactory = Store.open) -> None:
        super().__init__()
        self._url = url
        self._open_store = open_store
        self.store = self._open()
        self.run_id = self.store.create_run("model").run_id
        self.model: dict[str, Any] = {}
        self.saved: list[dict[str, Any]] = []
        self.pick = random.Random(0)

    def teardown(self) -> None:
        self.store.close()

    # -- helpers ---------------------------------------------------------------------
    def _open(self) -> Store:
        return self._open_store(self._url, keyframes=POLICY)

    def _of_type(self, kind: type) -> list[str]:
        return sorted(ch for ch, v in self.model.items() if type(v) is kind)

    def _commit(self, *, via_update: bool, **changes: Any) -> None:
        step = f"step-{len(self.saved)}"
        info: CheckpointInfo
        if via_update:
            info = self.store.update(self.run_id, step=step, **changes)
        else:
            info = self.store.save(self.run_id, self.model, step=step)
        assert info.seq == len(self.saved)
        assert info.seq - info.keyframe_seq <= POLICY.max_deltas
        self.saved.append(copy.deepcopy(self.model))

    # -- rules -----------------------------------------------------------------------
    @initialize(seed=st.integers(0, 2**32 - 1))
    def choose_seed(self, seed: int) -> None:
        self.pick = random.Random(seed)

    @rule(ch=st.sampled_from(CHANNELS), value=VALUES, via_update=st.booleans())
    def set_channel(self, ch: str, value: Any, via_update: bool) -> None:
        self.model[ch] = copy.deepcopy(value)
        self._commit(via_update=via_update, set={ch: value})

    @rule(ch=st.sampled_from(DICTS), n=st.integers(65, 200), seed=st.integers(0, 2**16))
    def set_large_dict(self, ch: str, n: int, seed: int) -> None:
        self.model[ch] = _big_dict(seed, n)
        self._commit(via_update=False)

    @precondition(lambda self: bool(self._of_type(dict)))
    @rule(data=st.data(), kv=st.dictionaries(KEYS, SCALARS, max_size=8), via_update=st.booleans())
    def merge_keys(self, data: st.DataObject, kv: dict[str, Any], via_update: bool) -> None:
        ch = data.draw(st.sampled_from(self._of_type(dict)))
        if not all(type(k) is str for k in self.model[ch]):
            via_update = False
        self.model[ch].update(copy.deepcopy(kv))
        self._commit(via_update=via_update, merge={ch: kv})

    @precondition(lambda self: any(self.model[ch] for ch in self._of_type(dict)))
    @rule(data=st.data())
    def delete_keys(self, data: st.DataObject) -> None:
        ch = data.draw(st.sampled_from([c for c in self._of_type(dict) if self.model[c]]))
        keys = sorted(self.model[ch], key=repr)
        doomed = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=5, unique=True))
        for k in doomed:
            del self.model[ch][k]
        self._commit(via_update=False)

    @rule(ch=st.sampled_from(LISTS), n=st.integers(0, 150), seed=st.integers(0, 2**16))
    def replace_list(self, ch: str, n: int, seed: int) -> None:
        self.model[ch] = _items(seed, n)
        self._commit(via_update=False)

    @precondition(lambda self: bool(self._of_type(list)))
    @rule(
        data=st.data(), n=st.integers(1, 80), seed=st.integers(0, 2**16), via_update=st.booleans()
    )
    def append(self, data: st.DataObject, n: int, seed: int, via_update: bool) -> None:
        ch = data.draw(st.sampled_from(self._of_type(list)))
        new = _items(seed, n)
        self.model[ch].extend(copy.deepcopy(new))
        self._commit(via_update=via_update, append={ch: new})

    @precondition(lambda self: any(self.model[ch] for ch in self._of_type(list)))
    @rule(data=st.data(), value=SCALARS)
    def edit_list_item(self, data: st.DataObject, value: Any) -> None:
        ch = data.draw(st.sampled_from([c for c in self._of_type(list) if self.model[c]]))
        i = data.draw(st.integers(0, len(self.model[ch]) - 1))
        self.model[ch][i] = value
        self._commit(via_update=False)

    @precondition(lambda self: any(self.model[ch] for ch in self._of_type(list)))
    @rule(data=st.data())
    def truncate_list(self, data: st.DataObject) -> None:
        ch = data.draw(st.sampled_from([c for c in self._of_type(list) if self.model[c]]))
        del self.model[ch][data.draw(st.integers(0, len(self.model[ch]) - 1)) :]
        self._commit(via_update=False)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), via_update=st.booleans())
    def delete_channel(self, data: st.DataObject, via_update: bool) -> None:
        ch = data.draw(st.sampled_from(sorted(self.model)))
        del self.model[ch]
        self._commit(via_update=via_update, delete=[ch])

    @rule()
    def save_unchanged(self) -> None:
        self._commit(via_update=False)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = self._open()

    # -- the property ------------------------------------------------------------------
    @invariant()
    def every_checkpoint_loads_as_saved(self) -> None:
        if not self.saved:
            return
        assert strict_equal(self.saved[-1], self.model)
        latest = self.store.load(self.run_id)
        assert latest.info.seq == len(self.saved) - 1
        assert strict_equal(latest.state, self.saved[-1])
        seq = self.pick.randrange(len(self.saved))
        assert strict_equal(self.store.load(self.run_id, seq).state, self.saved[seq])


def _run(url: str, open_store: StoreFactory, **overrides: Any) -> None:
    options: dict[str, Any] = {
        "max_examples": 30,
        "stateful_step_count": 30,
        "deadline": None,
        "derandomize": True,
        "database": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    }
    options.update(overrides)

    class Bound(CheckpointModel):
        def __init__(self) -> None:
            super().__init__(url, open_store)

    run_state_machine_as_test(Bound, settings=settings(**options))


@pytest.fixture(autouse=True)
def _bounded_shrinking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop shrinking a failure after a minute (hypothesis' default is five, as long as
    the suite's per-test timeout): a partly shrunk example beats a timeout with none.
    Hypothesis documents this constant as the one to monkeypatch."""
    monkeypatch.setattr(
        "hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS", 60, raising=False
    )


@pytest.mark.slow
def test_every_checkpoint_loads_as_saved(db_url: str) -> None:
    _run(db_url, Store.open)


# -- positive controls: the harness must catch a planted bug ------------------------------


class _OffByOneHistory(Store):
    """Loads the checkpoint before the one asked for."""

    def load(self, run_id: str, seq: int | None = None, **kwargs: Any) -> Snapshot:
        if seq is not None and seq > 0:
            seq -= 1
        return super().load(run_id, seq, **kwargs)


class _DropsTheLastListItem(Store):
    """Saves every list channel without its last item (a torn tail)."""

    def save(self, run_id: str, state: Mapping[str, Any], **kwargs: Any) -> CheckpointInfo:
        torn = {ch: v[:-1] if type(v) is list else v for ch, v in state.items()}
        return super().save(run_id, torn, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [_OffByOneHistory, _DropsTheLastListItem])
def test_the_model_catches_a_planted_bug(db_url: str, broken: type[Store]) -> None:
    with pytest.raises(AssertionError):
        _run(
            db_url,
            broken.open,
            max_examples=60,
            phases=[Phase.generate],
            report_multiple_bugs=False,
        )
