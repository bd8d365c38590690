"""The explorers of :mod:`onceonly.testing`: :func:`crash_at_every_point` and
:func:`fault_at_every_call`, their :class:`HarnessReport`, and the fork server of crash
mode ``"exit"`` (import them from :mod:`onceonly.testing`)."""

from __future__ import annotations

import atexit
import collections
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from onceonly.checkpoint import Durability, RunStatus, Store
from onceonly.checkpoint.failpoints import KNOWN_FAILPOINTS
from onceonly.flow import Flow
from onceonly.ledger import EffectStatus, Keyring, Ledger, Secret

from . import _crash_child
from ._fakes import (
    FAULTS,
    Clock,
    Delivery,
    HTTPProvider,
    ProviderFake,
    SQLiteDatabases,
)
from ._harness import (
    DEFINITE,
    EXIT_CODE,
    SECRET,
    TERMINAL,
    Counter,
    Crash,
    Outcome,
    Scenario,
    run_once,
)

__all__ = ["HarnessReport", "crash_at_every_point", "fault_at_every_call"]


@dataclass
class HarnessReport:
    """What a harness saw, counted from the fakes' logs.

    Attributes:
        scenario: The flow's name.
        mode: ``raise`` / ``exit`` (crash harness) or ``faults``.
        crash_points: K, the failpoint hits of one undisturbed run (or the calls).
        distinct_points: How many of them leave distinct states (see ``points``).
        hits: The failpoint names of the undisturbed run, in order.
        runs: Runs made (the undisturbed one included).
        effects: Effects the scenario intends per run, times the runs.
        deliveries: Effects the fakes performed, over all runs.
        raw_requests: Write requests that reached the fakes, over all runs.
        duplicates: Performances beyond what the undisturbed run intends.
        lost: Intended effects neither performed, failed definitely nor left to a human.
        needs_human: In-doubt effects handed to a human (and resolved from the fakes).
        failed: Effects that ended failed definitely (the ledger's FAILED entries).
        skipped: Intended effects never attempted because an earlier one failed
            definitely and failed the run.
        re_acts: Requests a resume sent for an effect already recorded before the crash.
        stale_token_calls: Requests the fakes refused for a stale fencing token.
        stuck: Runs that did not end the way the undisturbed one did.
        not_reached: Crash points a run ended before reaching (a scenario whose runs
            pass different numbers of failpoints: parallel branches, retries).
        seen: Every failpoint name any run passed.
        crashed_at: How many crashes were aimed at each failpoint name (the name of
            the k-th hit of the undisturbed run, for each k crashed at).
        modes: Runs made per durability mode of the driven worker's store (``sync``,
            ``async``, ``exit``).
        cells: :func:`fault_at_every_call`: ``(fault, call, outcome)`` per run, where
            the outcome says how the effect of the failed call ended: ``applied-once``,
            ``needs-human`` (then resolved from the fakes and applied once),
            ``failed-definitely``, or ``broken`` (a duplicate, loss or stuck run).
        problems: One line per failure, with the crash point or the fault.
    """

    scenario: str
    mode: str
    crash_points: int = 0
    distinct_points: int = 0
    hits: tuple[str, ...] = ()
    runs: int = 0
    effects: int = 0
    deliveries: int = 0
    raw_requests: int = 0
    duplicates: int = 0
    lost: int = 0
    needs_human: int = 0
    failed: int = 0
    skipped: int = 0
    re_acts: int = 0
    stale_token_calls: int = 0
    stuck: int = 0
    not_reached: int = 0
    seen: set[str] = field(default_factory=set)
    crashed_at: collections.Counter[str] = field(default_factory=collections.Counter)
    modes: dict[str, int] = field(default_factory=dict)
    cells: list[tuple[str, int, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def never_hit(self) -> tuple[str, ...]:
        """Known failpoints no run of this scenario passed."""
        return tuple(n for n in KNOWN_FAILPOINTS if n not in self.seen)

    @property
    def ok(self) -> bool:
        """No duplicate, loss, re-act, stale token, stuck run or other problem."""
        return not self.problems

    def assert_ok(self) -> None:
        """Raise AssertionError listing the problems, if any."""
        if self.problems:
            shown = "\n  ".join(self.problems[:20])
            more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
            raise AssertionError(
                f"{self.scenario} ({self.mode}): {len(self.problems)} problem(s):\n  {shown}{more}"
            )


# -- mode "exit": a child process that os._exit()s at the failpoint --------------------------


def _flow_ref(flow: Flow) -> str:
    for fn in flow.steps.values():
        module = importlib.import_module(fn.__module__)
        for name, value in vars(module).items():
            if value is flow:
                return f"{fn.__module__}:{name}"
    raise ValueError(
        f"crash mode 'exit' needs flow {flow.name!r} at module level of an importable module "
        f"(a child process imports it)"
    )


class _ForkServer:
    """``python -m onceonly.testing._crash_child``, started once per test process (and stopped at
    its exit): it forks the children that crash."""

    _lock = threading.Lock()
    _proc: subprocess.Popen[str] | None = None

    @classmethod
    def run(cls, line: str) -> int:
        with cls._lock:
            proc = cls._proc
            if proc is None or proc.poll() is not None:
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "onceonly.testing._crash_child"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                cls._proc = proc
                atexit.register(cls.stop)
            stdin: IO[str] | None = proc.stdin
            stdout: IO[str] | None = proc.stdout
            assert stdin is not None
            assert stdout is not None
            stdin.write(line + "\n")
            stdin.flush()
            answer = stdout.readline()
        if not answer:
            raise RuntimeError("the crash harness's fork server died")
        return int(json.loads(answer)["code"])

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            proc, cls._proc = cls._proc, None
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(30)


# -- checking one run -------------------------------------------------------------------------


@dataclass
class _Reference:
    intended: collections.Counter[str]
    keys: dict[str, str | None]  # effect -> provider key of its performance
    status: RunStatus | None
    hits: list[str]
    failed: set[str]  # effects the undisturbed run saw fail definitely


def _collect(providers: Sequence[ProviderFake]) -> list[Delivery]:
    return [d for p in providers for d in p.deliveries()]


def _evidence(providers: Sequence[ProviderFake]) -> Callable[[str], tuple[bool, Any]]:
    def ask(provider_key: str) -> tuple[bool, Any]:
        for p in providers:
            happened, result = p.evidence(provider_key)
            if happened:
                return True, result
        return False, None

    return ask


def _ledger_view(
    url: str, keyring: Keyring, *, verify: bool = False
) -> tuple[dict[str, EffectStatus], str | None]:
    """Provider key -> status of every ledger entry, as a new process reads it; with
    ``verify``, also what :meth:`Ledger.verify` found wrong (None: nothing)."""
    store = Store.open(url)
    try:
        ledger = Ledger(store, keyring, owner="crash-harness-reader", create=False)
        statuses = {r.provider_key: r.status for r in ledger.effects()}
        if not verify:
            return statuses, None
        audit = ledger.verify()
        return statuses, None if audit.ok else f"the ledger does not verify: {audit.to_json()}"
    finally:
        store.close()


def _check(
    report: HarnessReport,
    where: str,
    ref: _Reference,
    out: Outcome,
    providers: Sequence[ProviderFake],
    url: str,
    keyring: Keyring,
    recorded: set[str],
    marks: Sequence[int],
) -> None:
    """Count one finished run against the undisturbed one, from the fakes' logs."""
    deliveries = _collect(providers)
    got = collections.Counter(d.effect for d in deliveries if d.applied)
    statuses, bad = _ledger_view(url, keyring, verify=True)
    report.runs += 1
    report.effects += sum(ref.intended.values())
    report.deliveries += sum(got.values())
    report.raw_requests += len(deliveries)
    report.needs_human += out.needs_human
    stale = sum(p.stale_token_calls for p in providers)
    report.stale_token_calls += stale
    if stale:
        report.problems.append(f"{where}: {stale} request(s) with a stale fencing token")
    failed = {k for k, s in statuses.items() if s is EffectStatus.FAILED}
    report.failed += len(failed)
    # A run may end FAILED where the undisturbed one did not only because an effect was
    # refused definitely (and the flow let that fail the run): the effects after it were
    # never attempted.
    definite = (
        out.status is RunStatus.FAILED and out.error in DEFINITE and bool(failed - ref.failed)
    )
    for effect in sorted(set(got) | set(ref.intended)):
        extra = got[effect] - ref.intended[effect]
        if extra > 0:
            report.duplicates += extra
            report.problems.append(f"{where}: DUPLICATE x{extra}: {effect}")
        elif extra < 0:
            key = ref.keys.get(effect)
            if key is not None and key in failed:
                pass  # failed definitely (counted above)
            elif key is not None and statuses.get(key) is EffectStatus.NEEDS_HUMAN:
                pass  # left to a human (counted when the harness resolved it)
            elif definite and (key is None or key not in statuses):
                report.skipped += -extra
            else:
                report.lost += -extra
                report.problems.append(f"{where}: LOST x{-extra}: {effect}")
    # I3: a resume must not send again what the ledger recorded before the crash.
    late = [d for p, mark in zip(providers, marks, strict=True) for d in p.deliveries()[mark:]]
    again = [d for d in late if d.key is not None and d.key in recorded]
    if again:
        report.re_acts += len(again)
        report.problems.append(
            f"{where}: the resume re-acted {len(again)} time(s) on recorded effects: "
            f"{sorted({d.effect for d in again})}"
        )
    if out.status is not ref.status and not definite:
        report.stuck += 1
        report.problems.append(
            f"{where}: the run ended {out.status} ({out.error or 'no error'}), "
            f"the undisturbed run {ref.status}"
        )
    if bad is not None:
        report.problems.append(f"{where}: {bad}")


def _reference(
    scenario: Scenario,
    providers: Sequence[ProviderFake],
    database: Callable[[], str],
    keyring: Keyring,
    clock: Clock,
    report: HarnessReport,
    durability: str = "sync",
) -> _Reference:
    url = database()
    for p in providers:
        p.reset()
    clock.reset()
    counter = Counter()
    out = run_once(url, scenario, keyring, clock, counter, _evidence(providers), durability)
    _count_mode(report, durability)
    deliveries = _collect(providers)
    applied = [d for d in deliveries if d.applied]
    statuses, _ = _ledger_view(url, keyring)
    ref = _Reference(
        intended=collections.Counter(d.effect for d in applied),
        keys={d.effect: d.key for d in deliveries},
        status=out.status,
        hits=counter.names,
        failed={k for k, s in statuses.items() if s is EffectStatus.FAILED},
    )
    report.runs += 1
    report.effects += sum(ref.intended.values())
    report.deliveries += len(applied)
    report.raw_requests += len(deliveries)
    report.needs_human += out.needs_human
    report.failed += len(ref.failed)
    report.seen.update(counter.names)
    report.crash_points = len(counter.names)
    report.hits = tuple(counter.names)
    if out.status not in TERMINAL:
        report.stuck += 1
        report.problems.append(f"undisturbed run: ended {out.status} ({out.error})")
    dup = [e for e, n in collections.Counter(d.effect for d in applied).items() if n > 1]
    if dup:
        report.problems.append(f"undisturbed run: performed more than once: {dup}")
    if not applied and not ref.failed:
        report.problems.append("undisturbed run: the providers performed nothing")
    return ref


# A failpoint after which something durable or external happens before the next one: the
# transaction's COMMIT, a write to a run's row, the provider call.
_CHANGE_FOLLOWS = frozenset(
    {"checkpoint.commit.before", "checkpoint.run.write", "adapters.act.before"}
)


def _choose(points: Iterable[int] | str, hits: Sequence[str]) -> list[int]:
    if points == "all":
        return list(range(1, len(hits) + 1))
    if points == "distinct":
        return [k for k in range(1, len(hits) + 1) if k == 1 or hits[k - 2] in _CHANGE_FOLLOWS]
    if isinstance(points, str):
        raise ValueError(f"points must be 'all', 'distinct' or crash point numbers, not {points!r}")
    return sorted({k for k in points if 1 <= k <= len(hits)})


def _modes(durability: Durability | str | Sequence[Durability | str]) -> list[str]:
    """The durability modes to cycle through, validated (one mode: a list of one)."""
    given = [durability] if isinstance(durability, str) else list(durability)
    if not given:
        raise ValueError("durability: give at least one mode")
    try:
        return [Durability(d).value for d in given]
    except ValueError:
        raise ValueError(
            f"durability must be among {[d.value for d in Durability]}, not {durability!r}"
        ) from None


def _count_mode(report: HarnessReport, mode: str) -> None:
    report.modes[mode] = report.modes.get(mode, 0) + 1


def _recorded_keys(url: str, keyring: Keyring) -> set[str]:
    done = (EffectStatus.COMMITTED, EffectStatus.FAILED)
    return {k for k, s in _ledger_view(url, keyring)[0].items() if s in done}


def crash_at_every_point(
    scenario: Scenario,
    providers: Sequence[ProviderFake],
    *,
    mode: str = "raise",
    points: Iterable[int] | str = "all",
    sample: int | None = None,
    seed: int = 0,
    database: Callable[[], str] | None = None,
    secrets: Sequence[Secret] = (SECRET,),
    clock: Clock | None = None,
    durability: Durability | str = Durability.SYNC,
) -> HarnessReport:
    """Crash ``scenario`` at every failpoint it passes, resume it, and check it.

    An undisturbed run counts the K failpoint hits and records what the fakes performed.
    Then for each k, on a fresh database and fresh fakes: run until the k-th hit and
    crash there, resume as a restarted worker (same owner name) until the run ends, and
    compare the fakes' logs with the undisturbed run: no effect performed more often
    (I1), none lost unless it failed definitely or was left to a human (I2), no request
    sent by the resume for an effect recorded before the crash (I3), the run ended as
    the undisturbed one did (liveness), and the ledger's audit chain verifies.

    Args:
        scenario: The run to crash.
        providers: Every fake the scenario's effects reach (reset before each run).
        mode: ``"raise"``: :class:`Crash` is raised at the k-th hit in this process
            (and at every hit after it, in every thread). ``"exit"``: a child process
            runs the scenario and calls ``os._exit(137)`` at the k-th hit.
        points: Which k to crash at: ``"all"`` (1..K), ``"distinct"`` (the first of each
            run of hits with no durable write or provider call between them: a crash
            anywhere in such a run leaves the same database and the same provider
            state), or the numbers themselves.
        sample: Crash at a random sample of this many of the chosen points (long
            scenarios); ``seed`` makes it repeatable.
        seed: The sample's seed.
        database: Returns a fresh database URL per run (default: SQLite copies in a
            temporary directory; see :class:`SQLiteDatabases`, :class:`PostgresDatabases`).
        secrets: The keyring's secrets (default: a fixed test secret).
        clock: The clock of the ledger, the waits and the fakes' windows (default: a new
            :class:`Clock`); reset at the start of every run.
        durability: The durability mode of the worker's store, in every run (the
            undisturbed one, the crashed one and its resume). In ``async`` and ``exit``
            mode the checkpoint writes pass their failpoints at other moments (in the
            background writer's group commits, or with the next ledger transition and at
            close), so K and the points differ from ``sync``; in ``async`` mode they may
            also differ from run to run (counted in ``not_reached``).

    Returns:
        What the runs did; ``report.assert_ok()`` fails a test if anything went wrong.
    """
    if mode not in ("raise", "exit"):
        raise ValueError(f"mode must be 'raise' or 'exit', not {mode!r}")
    [store_mode] = _modes(durability)
    own_db = database is None
    db: Callable[[], str] = database or SQLiteDatabases()
    keyring = Keyring(list(secrets))
    clock = clock or Clock()
    report = HarnessReport(scenario.flow.name, mode)
    ref_of_flow = _flow_ref(scenario.flow) if mode == "exit" else ""
    try:
        ref = _reference(scenario, providers, db, keyring, clock, report, store_mode)
        chosen = _choose(points, ref.hits)
        if sample is not None and sample < len(chosen):
            rng = random.Random(seed)  # noqa: S311  (a repeatable sample, not a secret)
            chosen = sorted(rng.sample(chosen, sample))
        report.distinct_points = len(_choose("distinct", ref.hits))
        evidence = _evidence(providers)
        for k in chosen:
            where = f"crash at hit {k} ({ref.hits[k - 1]})"
            report.crashed_at[ref.hits[k - 1]] += 1
            url = db()
            for p in providers:
                p.reset()
            clock.reset()
            if mode == "raise":
                counter = Counter(k)
                try:
                    run_once(url, scenario, keyring, clock, counter, evidence, store_mode)
                except Crash:
                    pass
                else:
                    # A scenario whose runs differ (threads, retries) may pass fewer
                    # failpoints this time: not a failure, but counted.
                    report.not_reached += 1
                report.seen.update(counter.names)
            else:
                with tempfile.NamedTemporaryFile("r", suffix=".log", encoding="utf-8") as log:
                    code = _ForkServer.run(
                        _crash_child.request(
                            ref_of_flow,
                            dict(scenario.state),
                            dict(scenario.signals),
                            url,
                            k,
                            list(secrets),
                            clock.start,
                            log.name,
                            store_mode,
                        )
                    )
                    why = log.read().strip().splitlines()[-1:] or [""]
                if code == 0:
                    report.not_reached += 1
                elif code != EXIT_CODE:
                    report.problems.append(f"{where}: the child exited {code}: {why[0]}")
                    continue
            recorded = _recorded_keys(url, keyring)
            marks = [len(p.deliveries()) for p in providers]
            resume = Counter()
            out = run_once(url, scenario, keyring, clock, resume, evidence, store_mode)
            _count_mode(report, store_mode)
            report.seen.update(resume.names)
            _check(report, where, ref, out, providers, url, keyring, recorded, marks)
    finally:
        if own_db and isinstance(db, SQLiteDatabases):
            db.close()
    return report


def _cell(
    ref: _Reference,
    provider: HTTPProvider,
    out: Outcome,
    report: HarnessReport,
    before: tuple[int, int, int],
    call: int,
) -> str:
    """How the effect whose call met the fault ended."""
    if (report.duplicates, report.lost, report.stuck) != before:
        return "broken"
    log = provider.deliveries()
    if not log:
        return "not-attempted"
    faulted = log[min(len(log), call) - 1]
    effect = faulted.effect
    performed = sum(1 for d in log if d.applied and d.effect == effect)
    if performed > ref.intended[effect]:
        return "duplicate"
    if performed < ref.intended[effect]:
        return "failed-definitely"
    if faulted.key in out.resolved:
        return "needs-human"
    return "applied-once"


def fault_at_every_call(
    scenario: Scenario,
    provider: HTTPProvider,
    others: Sequence[ProviderFake] = (),
    *,
    faults: Sequence[str] = FAULTS,
    calls: Iterable[int] | None = None,
    database: Callable[[], str] | None = None,
    secrets: Sequence[Secret] = (SECRET,),
    clock: Clock | None = None,
    durability: Durability | str | Sequence[Durability | str] = Durability.SYNC,
) -> HarnessReport:
    """Inject each fault at each write call the scenario makes to ``provider``.

    An undisturbed run counts the N write calls. Then for every fault and every call
    i = 1..N, on a fresh database and fresh fakes: the i-th request meets the fault, the
    run is driven to its end (an effect left to a human is resolved from the fakes, as
    an operator would), and every effect must end performed once, failed definitely, or
    handed to a human, with nothing performed twice.

    Args:
        scenario: The run.
        provider: The fake that fails (its client must come from
            :meth:`HTTPProvider.client` for ``refuse``).
        others: Other fakes the scenario reaches.
        faults: Which faults (default: all of :data:`FAULTS`).
        calls: Which calls to fail (default: all).
        database: Fresh database URLs (default: temporary SQLite copies).
        secrets: The keyring's secrets (default: a fixed test secret).
        clock: Shared with ``provider`` (``forget`` moves it past the window).
        durability: The durability mode of the worker's store, or several: the runs
            cycle through them (the undisturbed run takes the first, the i-th faulted
            run the i-th after it), so every mode meets the faults without running the
            matrix once per mode. ``report.modes`` counts the runs per mode.

    Returns:
        The report (mode ``faults``).
    """
    modes = _modes(durability)
    own_db = database is None
    db: Callable[[], str] = database or SQLiteDatabases()
    keyring = Keyring(list(secrets))
    clock = clock or provider.clock
    providers: list[ProviderFake] = [provider, *others]
    report = HarnessReport(scenario.flow.name, "faults")
    plan = list(provider.fault_plan)
    try:
        provider.fault_plan = []
        ref = _reference(scenario, providers, db, keyring, clock, report, modes[0])
        n = len(provider.deliveries())
        report.crash_points = n
        evidence = _evidence(providers)
        for fault in faults:
            for i in sorted(set(range(1, n + 1) if calls is None else calls)):
                where = f"{fault} at call {i}"
                url = db()
                provider.fault_plan = ["ok"] * (i - 1) + [fault]
                for p in providers:
                    p.reset()
                clock.reset()
                counter = Counter()
                store_mode = modes[report.runs % len(modes)]
                out = run_once(url, scenario, keyring, clock, counter, evidence, store_mode)
                _count_mode(report, store_mode)
                report.seen.update(counter.names)
                before = (report.duplicates, report.lost, report.stuck)
                _check(
                    report, where, ref, out, providers, url, keyring, set(), [0] * len(providers)
                )
                report.cells.append((fault, i, _cell(ref, provider, out, report, before, i)))
    finally:
        provider.fault_plan = plan
        if own_db and isinstance(db, SQLiteDatabases):
            db.close()
    return report
