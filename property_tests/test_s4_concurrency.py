"""S4: concurrency (../shared/RELIABILITY.md).

Four worker processes on PostgreSQL (three on SQLite), forked from the zygote of
:mod:`property_tests.s3_worker`, race on the same runs and keys with run *and* claim
leases of 200-500 ms, under three fault mixes:

* ``gc-pause``: a worker SIGSTOPs itself between the claim and the send (inside the
  guarded call, as the request leaves: the GC-pause case). Its leases lapse, another
  worker takes the run over, settles the claim (probe, dedup window or operator) and
  sends with the next epoch (or its class B lookup, which carries the next epoch's
  token, fenced the old one out); only then (or after 4 s) the test SIGCONTs the paused
  one, whose send must be refused by the provider's fencing check or be harmless. One
  worker (the last) never pauses itself: when every worker may pause, they are all
  paused most of the time at the control's pause rate, nobody is left to take a paused
  run over, and the 4 s cap resumes the paused worker before any take-over (one CI run of
  the control saw 24 pauses and not one take-over).
* ``kill-stop``: workers are SIGKILLed (and restarted) or SIGSTOPped for 0.3-1.5 s at
  random times.
* ``all``: both, plus (PostgreSQL) ``pg_terminate_backend`` of a random worker's
  connections.

Every mix runs its workers in all three durability modes against the same store (worker
``w<j>`` of mix ``i`` opens its store in ``MODES[(i + j) % 3]``, and keeps that mode when
it is restarted; the controller's store is in ``MODES[i % 3]``): a fleet of mixed modes
is a realistic deploy, and no mode escapes the suite without tripling its time. The
report's ``modes`` counts the worker processes started in each mode.

Paused workers are resumed by a timer thread of the test (:meth:`Chaos.resume_due`),
never by the test's main loop. A process stopped while one of its threads (the step, the
lease heartbeat, the async group-commit writer) is inside a write transaction keeps the
database's write lock (SQLite) or its row locks (PostgreSQL) until it is resumed; the
main loop makes operator calls (``Operator.resolve``, ``signal``) that wait for that
lock, so if only the main loop resumed workers, a worker stopped mid-transaction would
never be resumed and the operator call would fail after the store's retry budget
(``LedgerUnavailable``: "the database stayed locked by another writer longer than
busy_timeout"). That was the SQLite flake of this suite under load.

The fenced fake provider is the oracle: every intended effect applied exactly once, and
no request whose fencing epoch is lower than one the provider had already seen for the
key was applied (stale-token applies = 0; refused stale calls are reported as
``detected``). CI: 300 effects per mix on SQLite and PostgreSQL; deep: 2 000 per mix.

Positive control: the provider stops checking fencing tokens; the GC-pause mix, with only
``w0`` pausing itself (three workers free to take its run over), must then show a stale
apply or a duplicate. It is caught at the first take-over, usually the first pause.
"""

from __future__ import annotations

import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .reliability import SuiteReport, mode_of, scaled, seeds
from .s3_fakes import FencedAPI, tally
from .s3_harness import Controller, migrate_all
from .s3_procs import Zygote

pytestmark = pytest.mark.slow

MIXES = ["gc-pause", "kill-stop", "all"]
MAX_HOLD_S = 4.0  # a paused worker nobody took over is resumed after this long
RESUME_TICK_S = 0.02  # how often the resumer thread looks at paused workers


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in ``/proc`` is ``T``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] in ("T", "t")


@pytest.fixture(scope="module")
def report() -> Iterator[SuiteReport]:
    rep = SuiteReport(suite="S4")
    yield rep
    rep.check()


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path)
    try:
        yield z
    finally:
        z.close()


@dataclass
class Chaos:
    """The fleet of racing workers and the faults done to them."""

    url: str
    zyg: Zygote
    rng: random.Random
    n_workers: int
    pause_p: float
    pause_file: Path
    seed: int
    mix_index: int = 0
    pausers: int | None = None  # how many workers (w0, w1, ...) pause; None: all
    report: SuiteReport | None = None
    pids: dict[str, int] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)  # owner -> its store's durability
    leases: dict[str, float] = field(default_factory=dict)
    paused: dict[int, tuple[str, int, float]] = field(default_factory=dict)
    stopped: dict[int, float] = field(default_factory=dict)
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "pauses": 0,
            "kills": 0,
            "stops": 0,
            "terminations": 0,
            "restarts": 0,
        }
    )
    _pause_seen: int = 0
    _spawns: int = 0
    # The resumer thread and the main loop share paused / stopped / pids under _lock.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _halt: threading.Event = field(default_factory=threading.Event)
    _resumer: threading.Thread | None = None
    unrecorded_resumes: int = 0  # stopped workers resumed by the safety net
    last_thaw: float = 0.0  # when a stopped or paused worker was last resumed (monotonic)

    def spawn(self, owner: str) -> None:
        lease = self.leases.setdefault(owner, round(self.rng.uniform(0.2, 0.5), 3))
        mode = self.modes.setdefault(owner, mode_of(self.mix_index + int(owner[1:])))
        url = self.url
        if url.startswith("postgresql"):
            url += ("&" if "?" in url else "?") + f"application_name=s4-{owner}"
        self._spawns += 1
        if self.report is not None:
            self.report.mode(mode)
        pauses = self.pausers is None or int(owner[1:]) < self.pausers
        pid = self.zyg.spawn(
            [url, owner, str(lease), str(lease), "2", "0.05", mode],
            log=f"{owner}.log",
            mode="direct",
            env={
                "S4_PAUSE_P": str(self.pause_p if pauses else 0.0),
                "S4_PAUSE_FILE": str(self.pause_file),
                "S4_SEED": str(self.seed + self._spawns),
            },
        )
        with self._lock:
            self.pids[owner] = pid

    def start(self, api: FencedAPI) -> None:
        for i in range(self.n_workers):
            self.spawn(f"w{i}")
        self._resumer = threading.Thread(
            target=self._resume_loop, args=(api,), name="s4-resumer", daemon=True
        )
        self._resumer.start()

    def _resume_loop(self, api: FencedAPI) -> None:
        while not self._halt.wait(RESUME_TICK_S):
            self.resume_due(api)

    def _read_pauses(self) -> None:
        """Take the complete lines the self-pausing workers appended (under _lock)."""
        if not self.pause_file.exists():
            return
        text = self.pause_file.read_text()
        lines = text[: text.rfind("\n") + 1].splitlines()  # a line being written waits
        for line in lines[self._pause_seen :]:
            spid, key, sepoch = line.split()
            self.paused[int(spid)] = (key, int(sepoch or 0), time.monotonic())
            self.counts["pauses"] += 1
        self._pause_seen = len(lines)

    def resume_due(self, api: FencedAPI) -> None:
        """Resume paused and stopped workers whose time has come (the resumer thread).

        It makes no database call, so no lock a stopped worker holds can delay it: a
        worker stopped inside a write transaction holds up every writer that needs the
        lock (on SQLite: every writer) for at most its hold, ``MAX_HOLD_S`` or its stop.
        """
        with self._lock:
            self._read_pauses()
            now = time.monotonic()
            for pid, (key, epoch, since) in list(self.paused.items()):
                # Resumed once the take-over's send with a higher epoch reached the
                # provider: the stale send must then be refused (see the module
                # docstring for why it is not resumed earlier).
                if api.max_epoch(key) > epoch or now - since > MAX_HOLD_S:
                    self.zyg.signal(pid, signal.SIGCONT)
                    del self.paused[pid]
                    self.last_thaw = now
            for pid, until in list(self.stopped.items()):
                if now >= until:
                    self.zyg.signal(pid, signal.SIGCONT)
                    del self.stopped[pid]
                    self.last_thaw = now
            # A worker whose pause line was read and resumed before its own SIGSTOP
            # landed (the take-over had already happened) is stopped with nobody holding
            # it: resume it too.
            held = set(self.paused) | set(self.stopped)
            for pid in self.pids.values():
                if pid not in held and _is_stopped(pid) and self.zyg.signal(pid, signal.SIGCONT):
                    self.unrecorded_resumes += 1
                    self.last_thaw = now

    def tend(self, ctl: Controller) -> None:
        """Restart dead workers; tell the controller which keys paused workers hold."""
        with self._lock:
            dead = [(o, p) for o, p in self.pids.items() if not self.zyg.alive(p)]
            for _, pid in dead:
                self.paused.pop(pid, None)
                self.stopped.pop(pid, None)
                self.counts["restarts"] += 1
        for owner, _ in dead:
            self.spawn(owner)
        with self._lock:
            ctl.hold_keys = {key for key, _, _ in self.paused.values()}
            # A stopped worker (or one just resumed, on a loaded machine) may still send
            # a request it claimed: "it never arrived" is not known while one may be.
            ctl.frozen = bool(self.paused or self.stopped)
            ctl.thawed_at = self.last_thaw

    def strike(self, pg_admin: str | None) -> None:
        """One random fault of the kill-stop / all mixes."""
        with self._lock:
            owner = self.rng.choice(sorted(self.pids))
            pid = self.pids[owner]
        roll = self.rng.random()
        if pg_admin is not None and roll < 0.35:
            eng = create_engine(pg_admin, isolation_level="AUTOCOMMIT")
            with eng.connect() as conn:
                n = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = :app"
                    ),
                    {"app": f"s4-{owner}"},
                ).scalar()
            eng.dispose()
            self.counts["terminations"] += int(n or 0)
        elif roll < 0.7:
            self.zyg.kill(pid)
            with self._lock:
                self.paused.pop(pid, None)
                self.stopped.pop(pid, None)
            self.counts["kills"] += 1
            self.spawn(owner)
        else:
            hold = self.rng.uniform(0.3, 1.5)
            with self._lock:  # recorded before the resumer can see the stopped process
                if (
                    pid not in self.paused
                    and pid not in self.stopped
                    and self.zyg.signal(pid, signal.SIGSTOP)
                ):
                    self.stopped[pid] = time.monotonic() + hold
                    self.counts["stops"] += 1

    def close(self) -> None:
        self._halt.set()
        if self._resumer is not None:
            self._resumer.join(10)
        with self._lock:
            held = list(self.paused) + list(self.stopped)
            self.paused.clear()
            self.stopped.clear()
        for pid in held:
            self.zyg.signal(pid, signal.SIGCONT)
        for pid in self.pids.values():
            self.zyg.signal(pid, signal.SIGTERM)
        for pid in self.pids.values():
            if self.zyg.wait(pid, 10) is None:
                self.zyg.kill(pid)


def race(
    url: str,
    tmp_path: Path,
    zyg: Zygote,
    *,
    mix: str,
    seed: int,
    effects: int,
    check_fencing: bool = True,
    classes: str = "aabbbc",
    pause_p: float = 0.04,
    pausers: int | None = None,
    pg_admin: str | None = None,
    timeout_s: float = 150,
    mix_index: int = 0,
    report: SuiteReport | None = None,
) -> tuple[dict[str, int], dict[str, int], Controller, float]:
    """Run one fault mix to completion; the fake's tally and the fault counts."""
    migrate_all(url)
    rng = random.Random(seed)
    api = FencedAPI(check_fencing=check_fencing).start()
    ctl = Controller(
        url, api, rng, classes=classes, settle_after_s=2.0, durability=mode_of(mix_index)
    )
    n_workers = 4 if url.startswith("postgresql") else 3
    if pausers is None:
        pausers = n_workers - 1  # one worker never pauses itself: a take-over is possible
    chaos = Chaos(
        url,
        zyg,
        rng,
        n_workers,
        pause_p=pause_p if mix in ("gc-pause", "all") else 0.0,
        pause_file=tmp_path / f"pauses-{mix}",
        seed=seed,
        mix_index=mix_index,
        pausers=pausers,
        report=report,
    )
    t0 = time.monotonic()
    try:
        while len(ctl.expected) < effects:
            ctl.start_gen(1)
        chaos.start(api)
        deadline = time.monotonic() + timeout_s
        next_strike = time.monotonic() + rng.uniform(0.1, 0.5)
        while time.monotonic() < deadline:
            chaos.tend(ctl)
            ctl.chores()
            if mix != "gc-pause" and time.monotonic() >= next_strike:
                chaos.strike(pg_admin if mix == "all" else None)
                next_strike = time.monotonic() + rng.uniform(0.1, 0.5)
            if ctl.open_runs() == 0:
                break
            if not check_fencing:
                seen = tally(api.log, ctl.expected)
                if seen["stale_applied"] or seen["duplicates"]:
                    break  # the positive control is caught
            time.sleep(0.05)
        chaos.close()
        got = tally(api.log, ctl.expected)
        print(f"modes {chaos.modes}, controller {ctl.durability}, ", end="")
        print(f"stopped workers resumed unrecorded: {chaos.unrecorded_resumes}")
        got["lookups"] = api.lookups
        got["unfinished"] = len(ctl.unfinished())
        for rid, _ in ctl.unfinished()[:5]:
            print("unfinished:", ctl.explain(rid))
        counts = api.counts()
        for r in api.log:
            if counts[(r.run, r.label)] > 1:
                print("duplicate:", r)
    finally:
        chaos.close()  # again after a failure: the resumer stops, nobody stays stopped
        ctl.close()
        api.stop()
    return got, chaos.counts, ctl, time.monotonic() - t0


def test_s4_concurrency(
    db_url: str, tmp_path: Path, zygote: Zygote, report: SuiteReport, pg_server_url: str
) -> None:
    backend = db_url.partition(":")[0].partition("+")[0]
    pg_admin = pg_server_url if backend == "postgresql" else None
    for i, mix in enumerate(MIXES):
        [seed] = seeds(1, base=4_000 + 10 * i + (0 if backend == "sqlite" else 1))
        report.seeds.append(seed)
        url = db_url
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path / f'{mix}.db'}"
        else:
            url = _fresh_pg(pg_server_url, f"s4_{mix.replace('-', '_')}")
        got, faults, ctl, wall = race(
            url,
            tmp_path,
            zygote,
            mix=mix,
            seed=seed,
            effects=scaled(300, 2000),
            pg_admin=pg_admin,
            mix_index=i,
            report=report,
        )
        unfinished = got.pop("unfinished")
        print(
            f"S4 {backend} {mix}: seed {seed}, {len(ctl.runs)} runs, {got}, faults {faults}, "
            f"needs-human {ctl.needs_human}, unfinished {unfinished}, {wall:.1f} s"
        )
        report.add(
            crash_points=sum(faults.values()) - faults["restarts"],
            scenarios=1,
            runs=len(ctl.runs) - unfinished,
            effects=got["effects"],
            raw_deliveries=got["raw"],
            duplicates=got["duplicates"] + got["unexpected"],
            lost=got["lost"] + unfinished,
            needs_human=ctl.needs_human,
            detected=got["stale_refused"],
            accepted=got["stale_applied"],
        )
        assert not unfinished, f"{mix}: {unfinished} run(s) did not complete"
        assert got["duplicates"] == got["lost"] == got["unexpected"] == 0, (mix, got)
        assert got["stale_applied"] == 0, (mix, got)


def test_s4_control_fencing_not_checked(
    tmp_path: Path, zygote: Zygote, report: SuiteReport, pg_server_url: str
) -> None:
    """S10 positive control: a provider that does not check fencing tokens must let a
    paused worker's stale send through, and the suite must see it.

    Only ``w0`` pauses, so three workers are free to take its run over: every pause whose
    worker holds no database lock is taken over well before the 4 s cap, and the first
    take-over is a stale send the provider applies.
    """
    url = _fresh_pg(pg_server_url, "s4_control")
    got, faults, _ctl, _wall = race(
        url,
        tmp_path,
        zygote,
        mix="gc-pause",
        seed=99,
        effects=240,
        check_fencing=False,
        classes="b",
        pause_p=0.15,
        pausers=1,
        timeout_s=90,
    )
    caught = got["stale_applied"] > 0 or got["duplicates"] > 0
    print(f"S4 control (fencing not checked): {got}, faults {faults}; caught: {caught}")
    report.control(caught)
    assert caught, f"no stale apply or duplicate without fencing: {got} {faults}"


_CREATED: list[tuple[str, str]] = []


def _fresh_pg(server_url: str, prefix: str) -> str:
    """A fresh PostgreSQL database (dropped by :func:`_drop_created`)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    _CREATED.append((server_url, name))
    base, _, query = server_url.partition("?")
    return base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")


@pytest.fixture(autouse=True)
def _drop_created() -> Iterator[None]:
    yield
    while _CREATED:
        server_url, name = _CREATED.pop()
        admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
