"""S9: bad input and I/O errors (RELIABILITY.md, S9; invariants I4 and I7).

**Bad input.** Hypothesis feeds the codec's decoder (arbitrary bytes, mutated valid
encodings, tag-shaped JSON), the stored-blob unpacker, ``Keyring.from_env`` strings, the
effect-row parser, sealed payloads and wrapped data keys, and the CLI's JSON arguments
(``signal --payload``, ``runs edit --value``). Only typed errors (``OnceOnlyError``
subclasses; a click usage error for the CLI) may come out: anything else fails.

**I/O errors.** A worker performs a run's effects against a counting provider (class B:
queryable by reference). A disk I/O error is injected at the k-th commit, for every k,
in three modes: once, forever, and after a commit that did reach the disk. The worker
must stop (a typed error), a restarted worker must recover from disk (reconciling the
effects in doubt with the provider's lookup), and the provider's raw log must show
every effect applied exactly once. Positive control: a "naive retry on I/O error" (the
outcome-commit failure swallowed and the effect re-sent) must show up as duplicates.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from onceonly.checkpoint import Codec, OnceOnlyError, Store
from onceonly.checkpoint._delta import pack, unpack
from onceonly.cli import cli
from onceonly.ledger import (
    Claim,
    EffectInDoubt,
    EffectStatus,
    Evidence,
    InFlightPolicy,
    Keyring,
    Ledger,
    LedgerUnavailable,
    ProviderClass,
    Replay,
)
from onceonly.ledger._rows import effect_record
from onceonly.ledger._schema import COLUMNS
from onceonly.ledger.crypto import Sealer
from property_tests.reliability import SuiteReport, scaled, seeds
from property_tests.s1_support import CountingProvider, wipe
from property_tests.s9_faults import CommitFaults
from tests.ledger_support import K1, Clock, ident, keyring

FUZZ = scaled(ci=300, deep=6000)  # examples per pure fuzz target
CLI_FUZZ = scaled(ci=40, deep=800)
EFFECTS = scaled(ci=4, deep=12)  # effects per I/O scenario
MODES = ("once", "forever", "after")
REPORT = SuiteReport(suite="S9", seeds=seeds(1))
CODEC = Codec()


def _settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=REPORT.tier == "ci",
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[SuiteReport]:
    REPORT._started = time.monotonic()  # the suite's own wall time, not the session's
    yield REPORT
    REPORT.check()


def only_typed(fn: Callable[[], object]) -> None:
    """Run ``fn``: it may return or raise an ``OnceOnlyError``; nothing else."""
    with contextlib.suppress(OnceOnlyError):
        fn()
    REPORT.add(scenarios=1)


# -- the codec and stored blobs -------------------------------------------------------------

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@given(data=st.binary(max_size=200))
@example(b"")
@example(b"\xff\xfe")
@_settings(FUZZ)
def test_decoding_arbitrary_bytes_raises_only_typed_errors(data: bytes) -> None:
    only_typed(lambda: CODEC.decode(data))
    only_typed(lambda: CODEC.decode(unpack(data)))
    only_typed(lambda: CODEC.decode(unpack(b"\x01" + zlib.compress(data))))
    # the stored forms' headers (zlib, zstd) followed by arbitrary, truncated or
    # extended frames
    only_typed(lambda: unpack(b"z" + data))
    only_typed(lambda: unpack(b"Z" + data))
    only_typed(lambda: unpack(b"C" + data))
    stored = pack(data * 8 + b"x" * 300)
    assert stored[:1] == b"C"  # a zstd frame after its 16-byte digest
    frame = stored[17:]
    only_typed(lambda: unpack(stored[: len(data) % len(stored)]))
    only_typed(lambda: unpack(stored + data[:3]))
    only_typed(lambda: unpack(b"Z" + frame[: len(data) % max(len(frame), 1)]))
    only_typed(lambda: unpack(b"Z" + frame + data[:3]))
    # a bare frame whose content size was edited: refused before any buffer is allocated
    only_typed(
        lambda: unpack(b"Z" + frame[:5] + bytes([frame[5] ^ (1 << (len(data) % 8))]) + frame[6:])
    )


@given(value=VALUES, cuts=st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3))))
@_settings(FUZZ)
def test_decoding_mutated_encodings_raises_only_typed_errors(
    value: Any, cuts: list[tuple[int, bytes]]
) -> None:
    try:
        raw = bytearray(CODEC.encode(value))
    except OnceOnlyError:
        return
    for pos, junk in cuts:
        at = pos % (len(raw) + 1)
        raw[at : at + len(junk)] = junk
    only_typed(lambda: CODEC.decode(bytes(raw)))


JSONABLE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
TAGGED = st.recursive(
    st.none() | st.integers() | st.text(max_size=4) | st.floats(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["$", "$b", "$t", "$d", "$s", "$f", "$i", "$dc", "$dt", "k", "$$"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)


@given(tree=TAGGED)
@_settings(FUZZ)
def test_decoding_tag_shaped_json_raises_only_typed_errors(tree: Any) -> None:
    try:
        text = json.dumps(tree)
    except ValueError:
        return
    only_typed(lambda: CODEC.decode(text.encode()))


# -- keys, rows and sealed payloads ---------------------------------------------------------


@given(raw=st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=200))
@example("k1:" + "ab" * 32)
@example("k1:" + "ab" * 32 + ",k1:" + "cd" * 32)
@example(":")
@_settings(FUZZ)
def test_keyring_strings_raise_only_typed_errors(raw: str) -> None:
    os.environ["S9_SECRETS"] = raw
    try:
        only_typed(lambda: Keyring.from_env("S9_SECRETS"))
    finally:
        del os.environ["S9_SECRETS"]


ROW_VALUE = st.none() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8)


@given(values=st.fixed_dictionaries(dict.fromkeys(COLUMNS, ROW_VALUE)))
@_settings(FUZZ)
def test_effect_rows_parse_or_raise_only_typed_errors(values: dict[str, Any]) -> None:
    only_typed(lambda: effect_record(values))


SEALER = Sealer(Keyring([K1]))
CIPHER = SEALER.new_wrapped_key("subject")[2]


@given(data=st.binary(max_size=80), prefix=st.sampled_from([b"", b"\x01"]))
@example(b"", b"\x01")
@example(b"abc", b"\x01")
@_settings(FUZZ)
def test_sealed_payloads_and_wrapped_keys_raise_only_typed_errors(
    data: bytes, prefix: bytes
) -> None:
    only_typed(lambda: Sealer.open(CIPHER, prefix + data, b"k|result"))
    only_typed(lambda: SEALER.unwrap("subject", "k1", prefix + data))


# -- the CLI's JSON arguments ---------------------------------------------------------------


@pytest.fixture
def cli_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with Store.open(url) as store:
        store.create_run("flow", run_id="run-1", next_step="go")
    return url


def test_cli_json_arguments_raise_only_typed_errors(cli_url: str) -> None:
    runner = CliRunner()

    @given(text=st.text(max_size=40) | st.builds(json.dumps, JSONABLE), which=st.booleans())
    @_settings(CLI_FUZZ)
    def prop(text: str, which: bool) -> None:
        if "\x00" in text:
            return
        if which:
            args = ["signal", "run-1", "s", "--payload", text, "--url", cli_url, "--as", "ops"]
        else:
            args = ["runs", "edit", "run-1", "ch", "--value", text, "--reason", "fuzz"]
            args += ["--url", cli_url, "--as", "ops"]
        result = runner.invoke(cli, args)
        exc = result.exception
        assert exc is None or isinstance(exc, SystemExit | OnceOnlyError), (
            f"{args}: {type(exc).__name__}: {exc}"
        )
        REPORT.add(scenarios=1)

    prop()


# -- a disk I/O error at every commit ---------------------------------------------------------


@dataclass
class Scenario:
    """One injected fault and what came of it."""

    mode: str
    at: int
    stopped_by: str = ""
    recovered_passes: int = 0


def _act(provider: CountingProvider, i: int) -> Callable[[Claim], str]:
    return lambda claim: provider.send(claim.provider_key, i)


def _open(db_url: str, clock: Clock) -> Ledger:
    store = Store.open(db_url, busy_timeout_ms=2000)
    return Ledger(store, keyring(), owner="worker", in_flight=InFlightPolicy(wait_s=0), clock=clock)


def _close(led: Ledger) -> None:
    led.close()
    led.store.close()


def _work(led: Ledger, provider: CountingProvider, run: str) -> str:
    """The worker: perform the run's effects in order; stop at the first ledger error."""
    for i in range(EFFECTS):
        try:
            led.perform(
                ident(i, run=run),
                {"n": i},
                _act(provider, i),
                provider_class=ProviderClass.QUERYABLE,
            )
        except OnceOnlyError as exc:
            return type(exc).__name__
    return ""


def _recover(led: Ledger, provider: CountingProvider, run: str) -> int:
    """A restarted worker: perform again, reconciling effects in doubt with the
    provider's lookup by reference. Returns the passes it took."""
    for n in range(1, 4):
        doubt = False
        for i in range(EFFECTS):
            try:
                led.perform(
                    ident(i, run=run),
                    {"n": i},
                    _act(provider, i),
                    provider_class=ProviderClass.QUERYABLE,
                )
            except EffectInDoubt as exc:
                doubt = True
                kid = str(exc.key_id)
                if provider.happened(led.get(kid).provider_key):
                    led.reconcile(kid, Evidence.HAPPENED, result="probed")
                else:
                    led.reconcile(kid, Evidence.NOT_HAPPENED)
        if not doubt:
            return n
    raise AssertionError("recovery did not settle in 3 passes")


def _scenario(db_url: str, mode: str, at: int) -> tuple[Scenario, CountingProvider, Ledger]:
    wipe(db_url)
    clock = Clock(1_800_000_000.0)
    provider = CountingProvider()
    sc = Scenario(mode, at)
    led = _open(db_url, clock)
    faults = CommitFaults(led.store, at=at, mode=mode)
    try:
        sc.stopped_by = _work(led, provider, "run-io")
        assert faults.failed > 0 or at > faults.commits
    finally:
        faults.enabled = False
        _close(led)
    # the restart: a new process under the same worker name, recovering from disk
    led = _open(db_url, clock)
    sc.recovered_passes = _recover(led, provider, "run-io")
    return sc, provider, led


def _judge(led: Ledger, provider: CountingProvider) -> tuple[int, int]:
    """(duplicates, lost) from the provider's raw log, per effect of the run."""
    dup = lost = 0
    for i in range(EFFECTS):
        kid = led.key_id(ident(i, run="run-io"))
        applied = provider.applied[led.get(kid).provider_key]
        dup += max(0, applied - 1)
        lost += int(applied == 0)
    return dup, lost


def _clean_commits(db_url: str) -> int:
    wipe(db_url)
    led = _open(db_url, Clock(1_800_000_000.0))
    faults = CommitFaults(led.store)
    try:
        assert _work(led, CountingProvider(), "run-io") == ""
    finally:
        _close(led)
    return faults.commits


@pytest.mark.slow
def test_an_io_error_at_every_commit_stops_the_worker_and_the_restart_recovers(
    db_url: str, report: SuiteReport
) -> None:
    k = _clean_commits(db_url)
    assert k >= 2 * EFFECTS
    problems = []
    for mode in MODES:
        for at in range(1, k + 1):
            sc, provider, led = _scenario(db_url, mode, at)
            try:
                dup, lost = _judge(led, provider)
                statuses = {r.status for r in led.effects(run_id="run-io")}
                clean = led.verify().ok
            finally:
                _close(led)
            report.add(
                crash_points=1,
                scenarios=1,
                runs=2,
                effects=EFFECTS,
                raw_deliveries=len(provider.raw),
                duplicates=dup,
                lost=lost,
            )
            if not sc.stopped_by:
                problems.append(f"{mode}@{at}: the worker did not stop on an I/O error")
            if dup or lost or statuses != {EffectStatus.COMMITTED} or not clean:
                problems.append(f"{mode}@{at}: dup={dup} lost={lost} {statuses} verify={clean}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_failed_outcome_commit_stops_the_ledger_for_good(db_url: str) -> None:
    wipe(db_url)
    led = _open(db_url, Clock(1_800_000_000.0))
    faults = CommitFaults(led.store, at=2, mode="once")  # commit 2: the first outcome
    provider = CountingProvider()
    try:
        assert _work(led, provider, "run-io") == "LedgerUnavailable"
        assert len(provider.raw) == 1
        # the fault is gone, but this ledger refuses everything until it is restarted
        with pytest.raises(LedgerUnavailable):
            led.perform(ident(50, run="run-io"), 1, _act(provider, 50))
        assert len(provider.raw) == 1
    finally:
        faults.enabled = False
        _close(led)


# -- positive control: a naive retry on I/O error ---------------------------------------------


def _naive_perform(
    self: Ledger, identity: Any, args: Any, act: Callable[[Claim], Any], **kw: Any
) -> Any:
    """The broken build: an outcome that could not be recorded is retried by acting
    again (the I/O error swallowed), instead of stopping."""
    kw.pop("classify", None)
    out = self.claim(identity, args, **kw)
    if isinstance(out, Replay):
        return out.result
    for _ in range(3):
        result = act(out)
        try:
            self.commit(out, result)
        except LedgerUnavailable:
            self._poisoned = None
            continue
        return result
    raise LedgerUnavailable("gave up")


@pytest.mark.slow
def test_control_a_naive_retry_on_io_error_is_caught(
    tmp_path: Path, report: SuiteReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Ledger, "perform", _naive_perform)
    url = f"sqlite:///{tmp_path / 'control.db'}"
    Store.open(url).close()
    _open(url, Clock()).close()
    dups = 0
    for at in range(1, 2 * EFFECTS + 1):
        _sc, provider, led = _scenario(url, "once", at)
        try:
            dups += _judge(led, provider)[0]
        finally:
            _close(led)
    report.control(dups > 0)
    assert dups > 0, "a naive retry on I/O error went unnoticed"
