"""The launcher: `python -m broker --config deploy.toml` with `[[pool]]` tables runs the broker
and its worker pools in one command (docs/operations.md, "One launcher").

Two parts, as in the broker itself:

- :class:`Supervisor`, a pure state machine (no process, no clock, no thread: time is passed
  in, like `broker.state`): events in (start, a worker printed READY, a worker exited with a
  code, SIGHUP, SIGTERM, the broker went idle, time), actions out (start worker i of pool p,
  SIGTERM it, SIGKILL it, all ready, give up, finished).  It keeps one worker per slot
  (pool, index) running, restarts a crashed one with exponential backoff, rolls a pool one
  worker at a time (start the replacement, wait for its READY, then stop the old one, wait
  for it to exit, next), and shuts down in order: drain the broker, stop the workers, done.
- :class:`Launcher`, the thin process layer: runs `python -m gpu_worker --broker <backend>`
  children, reads their READY lines and exit codes, forwards their stderr, and turns the
  signals it gets into events.  It runs the supervisor on a thread of its own; the broker
  loop keeps the main thread, as without pools.

Workers never outlive the launcher: each is started through a two-line prelude that sets
PR_SET_PDEATHSIG to SIGTERM (Linux) and then execs `python -m gpu_worker`, so a launcher that
dies, even by SIGKILL, takes its workers with it (they drain and exit 0; nothing is left for
the next launcher to double).  The signal follows the *thread* that started the child: every
child is started by the supervisor thread, which ends only after its children have exited.
Workers run in sessions of their own, so a Ctrl-C in the terminal reaches the launcher only,
which stops them in order.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from broker.config import LauncherConfig, PoolConfig
from broker.protocol import logs

__all__ = [
    "Backoff", "Supervisor", "Launcher",
    "StartWorker", "StopWorker", "KillWorker", "AllReady", "GiveUp", "WorkerGone", "RollDone", "Notice", "Finished",
]

log = logging.getLogger("broker.launcher")

# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class StartWorker:
    """Start a worker process for slot (pool, index); ``wid`` names it in later events."""

    pool: str
    index: int
    wid: int
    reason: str


@dataclass(frozen=True, slots=True)
class StopWorker:
    """SIGTERM worker ``wid``: it drains (finishes what it holds, DISCONNECT) and exits 0.
    Sent again to a worker already stopping: skip the wait for its outputs' release."""

    wid: int


@dataclass(frozen=True, slots=True)
class KillWorker:
    """SIGKILL worker ``wid``: it was told to stop ``stop_timeout`` ago and is still there, or
    it is hung: not READY ``ready_timeout`` after its start, or READY but not registered with
    the broker for ``hang_timeout`` (stopped, wedged with the GIL held, or refused)."""

    wid: int


@dataclass(frozen=True, slots=True)
class AllReady:
    """Every slot's first worker printed READY: the launcher is ready (its READY line)."""

    workers: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """A worker exited before its first READY while the launcher was starting: the pool cannot
    start (a bad model, device or flag; the worker said why on stderr).  Everything stops."""

    pool: str
    index: int
    wid: int
    code: int


@dataclass(frozen=True, slots=True)
class WorkerGone:
    """Worker ``wid`` exited with ``code``; ``expected``: after our StopWorker.  ``restart_in``:
    seconds until its slot starts a new one (None: no restart, e.g. during shutdown)."""

    pool: str
    index: int
    wid: int
    code: int
    expected: bool
    restart_in: float | None


@dataclass(frozen=True, slots=True)
class RollDone:
    """Every worker of ``pool`` was replaced by a rolling restart."""

    pool: str


@dataclass(frozen=True, slots=True)
class Notice:
    """Something the log should say (level: a logging level)."""

    level: int
    message: str


@dataclass(frozen=True, slots=True)
class Finished:
    """Every worker is gone after a shutdown: stop the broker and exit."""


# ------------------------------------------------------------------------- supervisor


#: a worker that exits 0 unasked after serving this long (seconds) left on its own: no crash
#: (one that exits 0 at once, again and again, is a crash loop and backs off as one)
_LEFT_AFTER = 1.0


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``initial`` after the first crash, doubling to ``maximum``; a worker
    that served ``reset_after`` seconds after its READY counts as healthy (it is replaced at
    once, and the next crash is a first again; so is the first crash after a rolling restart
    of a slot that served that long)."""

    initial: float = 0.5
    maximum: float = 30.0
    reset_after: float = 60.0

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.maximum, self.initial * 2.0 ** min(failures - 1, 64))


class _Run:
    __slots__ = ("wid", "slot", "gen", "started_at", "ready", "ready_at", "missing_since", "stopping", "kill_at",
                 "killed")

    def __init__(self, wid, slot, gen, now):
        self.wid = wid
        self.slot = slot
        self.gen = gen
        self.started_at = now
        self.ready = False
        self.ready_at = None  # when it said READY: how long it served counts, not how long it loaded
        self.missing_since = None  # the time of the first list of the broker's that lacked it, in a row
        self.stopping = False
        self.kill_at = None
        self.killed = False


class _Slot:
    __slots__ = ("pool", "index", "gen", "runs", "failures", "restart_at", "reason", "ready_once", "vacated")

    def __init__(self, pool, index):
        self.pool = pool
        self.index = index
        self.gen = 0  # the generation it wants running; a rolling restart moves it on
        self.runs: dict[int, _Run] = {}
        self.failures = 0  # crashes in a row
        self.restart_at = None  # a crashed worker's successor starts then
        self.reason = "start"
        self.ready_once = False
        self.vacated = False  # its worker left on its own during the shutdown's drain: no successor


class _Roll:
    __slots__ = ("todo", "current")

    def __init__(self, count):
        self.todo = collections.deque(range(count))
        self.current = None


NEW, STARTING, RUNNING, DRAINING, STOPPING, STOPPED = "new", "starting", "running", "draining", "stopping", "stopped"


class Supervisor:
    """Worker pools as a pure state machine.  ``pools``: (name, count) pairs.  Every event
    method takes ``now`` (monotonic seconds) and returns a list of actions; call
    :meth:`tick` at :meth:`next_wakeup`.

    Phases: new -> starting (until every slot's first worker is READY: AllReady) -> running
    -> draining (shutdown: the broker refuses new requests and finishes the admitted ones;
    ends at broker_idle or after ``drain_timeout``) -> stopping (every worker SIGTERMed,
    SIGKILLed ``stop_timeout`` later) -> stopped (Finished).  A worker that exits before its
    first READY while starting ends it all (GiveUp, then stopping).  While running or
    draining, any other exit that was not asked for is a crash: the slot starts a new worker
    after the backoff."""

    def __init__(self, pools: Sequence[tuple[str, int]], *, backoff: Backoff = Backoff(),
                 stop_timeout: float = 40.0, drain_timeout: float = 30.0, ready_timeout: float = 600.0,
                 hang_timeout: float = 30.0):
        self.backoff = backoff
        self.stop_timeout = float(stop_timeout)
        self.drain_timeout = float(drain_timeout)
        # A worker not READY this long after its start is hung (a model load that never
        # ends): SIGKILLed, and its exit is a crash like any other (at start: the launch
        # gives up).  Otherwise a rolling restart waiting for it would wait for good.
        self.ready_timeout = float(ready_timeout)
        # A READY worker the broker has not listed as registered for this long (0: never
        # checked) is hung as well: SIGSTOPped, frozen, wedged in C with the GIL held (its
        # heartbeat thread cannot run either), or refused by the broker.  The broker dropped
        # it long ago and serves without it; only its exit gives its slot a new worker.
        self.hang_timeout = float(hang_timeout)
        self.phase = NEW
        self.gave_up: GiveUp | None = None
        self._pools = {name: [_Slot(name, i) for i in range(count)] for name, count in pools}
        self._runs: dict[int, _Run] = {}
        self._next_wid = 1
        self._rolls: dict[str, _Roll] = {}
        self._queued: list[str] = []  # pools whose next roll waits (for the start, or for their roll)
        self._drain_deadline = None

    # ---------------------------------------------------------------- introspection

    @property
    def finished(self) -> bool:
        return self.phase == STOPPED

    def workers(self) -> list[tuple[str, int, int, bool, bool]]:
        """(pool, index, wid, ready, stopping) of every worker process there is."""
        return [(r.slot.pool, r.slot.index, r.wid, r.ready, r.stopping) for r in self._runs.values()]

    @property
    def rolling(self) -> bool:
        return bool(self._rolls)

    # ---------------------------------------------------------------- events

    def start(self, now: float) -> list:
        if self.phase != NEW:
            return []
        self.phase = STARTING
        out: list = []
        for slot in self._slots():
            self._reconcile(slot, now, out)
        if not self._runs:  # no pool at all
            self.phase = RUNNING
            out.append(AllReady(0))
        return out

    def worker_ready(self, wid: int, now: float) -> list:
        run = self._runs.get(wid)
        if run is None or run.ready or run.killed:
            return []  # (killed: a READY read after the hung-worker SIGKILL went out: it is dying)
        run.ready = True
        run.ready_at = now
        slot = run.slot
        out: list = []
        slot.ready_once = True
        if self.phase in (STOPPING, STOPPED):
            return out
        if not run.stopping:
            self._reconcile(slot, now, out)
            self._advance(slot.pool, now, out)
        if self.phase == STARTING and all(s.ready_once for s in self._slots()):
            self.phase = RUNNING
            out.append(AllReady(sum(1 for _ in self._slots())))
            for name in [n for n in self._queued if n not in self._rolls]:
                self._queued.remove(name)
                self._start_roll(name, now, out)
        return out

    def worker_exited(self, wid: int, code: int, now: float) -> list:
        run = self._runs.pop(wid, None)
        if run is None:
            return []
        slot = run.slot
        slot.runs.pop(wid, None)
        out: list = []
        served = None if run.ready_at is None else now - run.ready_at
        if run.stopping or self.phase in (STOPPING, STOPPED):
            out.append(WorkerGone(slot.pool, slot.index, wid, code, run.stopping, None))
            if self.phase == STOPPING:
                self._maybe_finished(out)
            else:
                self._reconcile(slot, now, out)
                self._advance(slot.pool, now, out)
            return out
        if self.phase == STARTING and not run.ready and not slot.ready_once:
            out.append(WorkerGone(slot.pool, slot.index, wid, code, False, None))
            self.gave_up = GiveUp(slot.pool, slot.index, wid, code)
            out.append(self.gave_up)
            self._begin_stop(now, out)
            return out
        restart_in = None
        if run.gen == slot.gen and code == 0 and served is not None and served >= _LEFT_AFTER \
                and self.phase == DRAINING:
            # Stopped by someone else while we drain: a stop of the whole service signals
            # every process at once (systemd's KillMode=control-group, a pod's deletion with
            # a shared pid namespace).  A successor would only start, take memory (a GPU's)
            # beside workers still finishing admitted requests, and be stopped.
            self._vacate(slot, out)
            out.append(WorkerGone(slot.pool, slot.index, wid, code, True, None))
            return out
        if run.gen == slot.gen and code == 0 and served is not None and served >= _LEFT_AFTER:
            # Exit 0 unasked, after serving: it left on its own (an operator's SIGTERM to an idle
            # worker drains and exits before the broker's list says it left).  Not a crash:
            # its successor starts now, and the crash count stays as it was.
            restart_in = 0.0
            slot.restart_at = None
            slot.reason = "its worker left on its own (exit 0)"
            out.append(Notice(logging.INFO, f"pool {slot.pool} worker {slot.index} left on its own (exit 0); "
                                            "starting its successor"))
            out.append(WorkerGone(slot.pool, slot.index, wid, code, True, restart_in))
            self._reconcile(slot, now, out)
            self._advance(slot.pool, now, out)
            return out
        if run.gen == slot.gen:
            # The slot's current worker crashed.  A healthy one (it served `reset_after`
            # since its READY: a model that loads for minutes and crashes at once is not)
            # is replaced at once: its crash is most likely a one-off (a request that killed
            # it, a fault of the moment), and the pool's capacity is short meanwhile (a pool
            # of one is out: its service's requests fail once `--service-grace` passes, and
            # the first backoff made that outage 0.5 s longer, the stalls hunt).  A crash in
            # a row after that waits the backoff, as a crash of a worker that never served.
            if served is not None and served >= self.backoff.reset_after:
                slot.failures = 0
                restart_in = 0.0
                slot.reason = f"restart after exit code {code} (at once: it had served {served:.0f} s)"
            else:
                slot.failures += 1
                restart_in = self.backoff.delay(slot.failures)
                slot.reason = (f"restart after exit code {code} (crash {slot.failures} in a row, "
                               f"after {restart_in:g} s)")
            slot.restart_at = now + restart_in
        # else: a worker of an older generation (being rolled out) crashed: its successor
        # is starting or serving already.
        out.append(WorkerGone(slot.pool, slot.index, wid, code, False, restart_in))
        self._reconcile(slot, now, out)
        self._advance(slot.pool, now, out)
        return out

    def roll(self, now: float, pools: Iterable[str] | None = None) -> list:
        """A rolling restart of ``pools`` (default: all), each one worker at a time; pools
        roll side by side.  Asked for while the launcher starts, or while the pool rolls
        already, it is queued (one at most per pool): it runs once every pool is ready, or
        once the roll under way is done.  Workers that roll loaded the files of their start,
        and one already replaced may predate what the new request is for (a deploy that
        changed the files twice)."""
        if self.phase not in (STARTING, RUNNING):
            return [Notice(logging.WARNING, f"rolling restart ignored: the launcher is {self.phase}")]
        out: list = []
        names = list(self._pools) if pools is None else list(pools)
        for name in names:
            if name not in self._pools:
                out.append(Notice(logging.WARNING, f"rolling restart: no pool named {name!r}"))
            elif name in self._queued:
                out.append(Notice(logging.INFO, f"pool {name}: a rolling restart is queued already"))
            elif self.phase == STARTING or name in self._rolls:
                self._queued.append(name)
                why = "the launcher is starting" if self.phase == STARTING else "a rolling restart is under way"
                out.append(Notice(logging.INFO, f"pool {name}: rolling restart queued ({why}; it follows)"))
            else:
                self._start_roll(name, now, out)
        return out

    def _start_roll(self, name: str, now: float, out: list) -> None:
        out.append(Notice(logging.INFO, f"pool {name}: rolling restart of {len(self._pools[name])} workers"))
        self._rolls[name] = _Roll(len(self._pools[name]))
        self._advance(name, now, out)

    def shutdown(self, now: float) -> list:
        """SIGTERM or SIGINT.  The first: drain (the caller makes the broker refuse new
        requests and reports broker_idle once the admitted ones are done).  A second: stop
        the workers now.  A third: tell them again (they skip waiting for their outputs)."""
        out: list = []
        if self.phase == NEW:
            self.phase = STOPPED
            out.append(Finished())
        elif self.phase in (STARTING, RUNNING):
            self.phase = DRAINING
            self._rolls.clear()
            self._queued.clear()
            self._drain_deadline = now + self.drain_timeout
            out.append(Notice(logging.INFO, f"shutting down: finishing the requests already admitted "
                                            f"(at most {self.drain_timeout:g} s), then stopping the workers "
                                            f"(SIGKILL to any still there {self.stop_timeout:g} s after its SIGTERM)"))
        elif self.phase == DRAINING:
            out.append(Notice(logging.WARNING, "second signal: stopping the workers now"))
            self._begin_stop(now, out)
        elif self.phase == STOPPING:
            out.append(Notice(logging.WARNING, "signal again: telling the workers to hurry"))
            out.extend(StopWorker(r.wid) for r in self._runs.values() if not r.killed)
        return out

    def broker_idle(self, now: float) -> list:
        """The broker holds no admitted request any more."""
        out: list = []
        if self.phase == DRAINING:
            self._begin_stop(now, out)
        return out

    def broker_sees(self, wids, at: float, leaving=None) -> list:
        """The broker's list of registered workers (``wids``: of ours), as of ``at`` on the
        broker's clock (monotonic seconds, the clock ``now`` is on), and ``leaving``, {wid:
        when} of ours that said goodbye (DISCONNECT) to it.

        A READY worker not stopping, absent from the lists for ``hang_timeout`` (from the
        first list that lacked it, every list since lacking it too), is SIGKILLed: a crash,
        restarted after the backoff.  Only the lists' own times count, and lists made before
        its READY do not, so a broker loop that stalls gets nobody killed.  A worker that said
        goodbye since its READY leaves on its own (an operator's SIGTERM: it waits for its
        outputs' release, up to its drain grace): it counts as stopping (SIGKILLed
        ``stop_timeout`` later, as any) and its slot starts its successor now."""
        out: list = []
        if self.phase not in (STARTING, RUNNING, DRAINING):
            return out
        for run in list(self._runs.values()):
            if not run.ready or run.stopping or run.killed or at < run.ready_at:
                continue
            left = None if leaving is None else leaving.get(run.wid)
            if left is not None and left >= run.ready_at:
                if self.phase == DRAINING and run.gen == run.slot.gen:
                    self._vacate(run.slot, out)
                else:
                    out.append(Notice(logging.INFO, f"pool {run.slot.pool} worker {run.slot.index} is leaving on "
                                                    "its own (it said goodbye to the broker); starting its successor"))
                self._stop(run, at, out, signal=False)
                self._reconcile(run.slot, at, out)
                self._advance(run.slot.pool, at, out)
                continue
            if self.hang_timeout <= 0:
                continue
            if run.wid in wids:
                run.missing_since = None
            elif run.missing_since is None:
                run.missing_since = at
            elif at - run.missing_since >= self.hang_timeout:
                run.killed = True
                out.append(Notice(logging.WARNING, f"pool {run.slot.pool} worker {run.slot.index} not registered "
                                                   f"with the broker for {at - run.missing_since:.3g} s (stopped, hung, "
                                                   "or refused: the broker says why): SIGKILL"))
                out.append(KillWorker(run.wid))
        return out

    @property
    def watching(self) -> bool:
        """Whether :meth:`broker_sees` has anyone to judge (the caller then reads the
        broker's lists about once a second)."""
        return self.phase in (STARTING, RUNNING, DRAINING) and any(
            r.ready and not r.stopping and not r.killed for r in self._runs.values())

    def tick(self, now: float) -> list:
        out: list = []
        if self.phase == DRAINING and self._drain_deadline is not None and now >= self._drain_deadline:
            out.append(Notice(logging.WARNING, f"requests still unfinished after {self.drain_timeout:g} s; "
                                               "stopping the workers anyway"))
            self._begin_stop(now, out)
        for run in list(self._runs.values()):
            if run.stopping and not run.killed and run.kill_at is not None and now >= run.kill_at:
                run.killed = True
                out.append(Notice(logging.WARNING, f"pool {run.slot.pool} worker {run.slot.index} still there "
                                                   f"{self.stop_timeout:g} s after SIGTERM: SIGKILL"))
                out.append(KillWorker(run.wid))
            elif (not run.ready and not run.stopping and not run.killed
                  and now >= run.started_at + self.ready_timeout):
                run.killed = True
                out.append(Notice(logging.WARNING, f"pool {run.slot.pool} worker {run.slot.index} not READY "
                                                   f"{self.ready_timeout:g} s after its start: SIGKILL"))
                out.append(KillWorker(run.wid))
        if self.phase in (STARTING, RUNNING, DRAINING):
            for slot in self._slots():
                if slot.restart_at is not None and now >= slot.restart_at:
                    self._reconcile(slot, now, out)
        return out

    def next_wakeup(self) -> float | None:
        times = []
        if self.phase in (STARTING, RUNNING, DRAINING):
            times.extend(s.restart_at for s in self._slots() if s.restart_at is not None)
        if self.phase == DRAINING and self._drain_deadline is not None:
            times.append(self._drain_deadline)
        times.extend(r.kill_at for r in self._runs.values() if r.stopping and not r.killed and r.kill_at is not None)
        times.extend(r.started_at + self.ready_timeout for r in self._runs.values()
                     if not r.ready and not r.stopping and not r.killed)
        return min(times) if times else None

    # ---------------------------------------------------------------- internals

    def _slots(self):
        for slots in self._pools.values():
            yield from slots

    def _reconcile(self, slot: _Slot, now: float, out: list) -> None:
        """One worker of the slot's generation, started once any backoff has passed; once it
        is READY, workers of older generations are told to stop."""
        if self.phase not in (STARTING, RUNNING, DRAINING):
            return
        live = [r for r in slot.runs.values() if not r.stopping]
        current = [r for r in live if r.gen == slot.gen]
        if not current:
            if slot.vacated:
                return
            if slot.restart_at is None or now >= slot.restart_at:
                slot.restart_at = None
                wid = self._next_wid
                self._next_wid += 1
                run = _Run(wid, slot, slot.gen, now)
                slot.runs[wid] = run
                self._runs[wid] = run
                out.append(StartWorker(slot.pool, slot.index, wid, slot.reason))
                slot.reason = "start"
            return
        if any(r.ready for r in current):
            for r in live:
                if r.gen != slot.gen:
                    self._stop(r, now, out)

    def _vacate(self, slot: _Slot, out: list) -> None:
        """The slot's worker left on its own while the shutdown drains: no successor."""
        if not slot.vacated:
            slot.vacated = True
            slot.restart_at = None
            out.append(Notice(logging.INFO, f"pool {slot.pool} worker {slot.index} is leaving on its own during the "
                                            "shutdown; not replaced"))

    def _stop(self, run: _Run, now: float, out: list, signal: bool = True) -> None:
        run.stopping = True
        run.kill_at = now + self.stop_timeout
        if signal:  # (else it stops on its own)
            out.append(StopWorker(run.wid))

    def _advance(self, pool: str, now: float, out: list) -> None:
        """Move a rolling restart of ``pool`` on: a slot is done when its only workers are of
        its new generation and one of them is READY (its old one has exited)."""
        roll = self._rolls.get(pool)
        while roll is not None:
            if roll.current is None:
                if not roll.todo:
                    del self._rolls[pool]
                    out.append(RollDone(pool))
                    if pool in self._queued and self.phase == RUNNING:
                        self._queued.remove(pool)
                        self._start_roll(pool, now, out)
                    return
                roll.current = roll.todo.popleft()
                slot = self._pools[pool][roll.current]
                if any(r.ready_at is not None and now - r.ready_at >= self.backoff.reset_after
                       for r in slot.runs.values()):
                    # It served long enough to count as healthy, whatever crashed before: a
                    # replacement that crashes (a bad deploy) is a first crash again.
                    slot.failures = 0
                slot.gen += 1
                slot.reason = "rolling restart"
                self._reconcile(slot, now, out)
            slot = self._pools[pool][roll.current]
            runs = slot.runs.values()
            if not (all(r.gen == slot.gen for r in runs) and any(r.ready for r in runs)):
                return
            roll.current = None

    def _begin_stop(self, now: float, out: list) -> None:
        self.phase = STOPPING
        self._rolls.clear()
        self._queued.clear()
        for slot in self._slots():
            slot.restart_at = None
        for run in self._runs.values():
            if not run.stopping:
                self._stop(run, now, out)
        self._maybe_finished(out)

    def _maybe_finished(self, out: list) -> None:
        if self.phase == STOPPING and not self._runs:
            self.phase = STOPPED
            out.append(Finished())


# ------------------------------------------------------------------------ process layer

# Run in each child before the worker: the parent-death signal (Linux prctl
# PR_SET_PDEATHSIG = 1) is SIGTERM, then exec the worker (the setting survives exec).  A
# launcher that died before the prctl is caught by the parent check.
_PRELUDE = (
    "import ctypes, os, signal, sys\n"
    "try: ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "except Exception: pass\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(0)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
_LINE = 8192  # longest line read from a child at once (a longer one arrives in pieces)
_TAIL = 20  # stderr lines kept per child for the give-up message
_REAP_TIMEOUT = 5.0  # seconds to wait for the SIGKILLed child of a failed start to exit
_DRAIN_POLL = 0.02  # seconds between looks at the broker's admitted requests while draining
_WATCH_POLL = 1.0  # seconds between looks at the broker's list of registered workers
_DRAIN_REASON = "the broker is shutting down (its launcher was told to stop); send the request elsewhere or later"


class _Child:
    __slots__ = ("wid", "pool", "index", "popen", "pid", "tail", "threads", "lock", "exited")

    def __init__(self, wid, pool, index, popen):
        self.wid = wid
        self.pool = pool
        self.index = index
        self.popen = popen
        self.pid = popen.pid
        self.tail = collections.deque(maxlen=_TAIL)
        self.threads: list[threading.Thread] = []
        # Signals and the reaping take turns under it: a signal goes only to a process not
        # yet reaped, whose pid (and process group id) is still its own.
        self.lock = threading.Lock()
        self.exited = False

    @property
    def tag(self) -> str:
        return f"pool {self.pool} worker {self.index} pid {self.pid}"


class Launcher:
    """The broker's worker pools as child processes, supervised on a thread of their own.

    Made before the broker loop runs (it installs the SIGTERM, SIGINT and SIGHUP handlers)::

        launcher = Launcher(broker, deploy, stop)
        with broker, launcher:          # __enter__ starts the supervisor thread
            broker.serve(stop)          # `stop` is set once the workers are gone
        sys.exit(launcher.exit_code)

    It prints ``READY frontend=<ep> backend=<ep> workers=<n>`` on stdout once every pool's
    first workers printed READY, and logs each worker's start, READY, exit and restart
    (``pool NAME worker I pid P ...``) on the ``broker.launcher`` logger.  Worker stderr
    lines are copied to stderr, each prefixed ``[NAME/I pid P]``.
    """

    def __init__(self, broker, deploy: LauncherConfig, stop: threading.Event, *, out=None, err=None):
        self.broker = broker
        broker.pools_ready = False  # readiness waits for every pool (AllReady)
        self.deploy = deploy
        self.stop = stop
        self.exit_code = 0
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._writer = logs.line_writer(self._err)
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from signal handlers
        self._children: dict[int, _Child] = {}
        self._pools = {p.name: p for p in deploy.pools}
        self._thread: threading.Thread | None = None
        sched = broker.cfg.scheduler
        self._hb = (sched.heartbeat_interval, sched.heartbeat_liveness)
        self._link = self._link_args()
        self.sup = Supervisor(
            [(p.name, p.count) for p in deploy.pools],
            backoff=Backoff(deploy.restart_backoff_s, deploy.restart_backoff_max_s, deploy.restart_reset_s),
            stop_timeout=deploy.stop_timeout, drain_timeout=deploy.drain_timeout_s,
            ready_timeout=deploy.ready_timeout_s, hang_timeout=deploy.hang_timeout_s)
        self._seen_at = None  # the time of the broker's last list of registered workers read
        for sig, ev in ((signal.SIGTERM, "term"), (signal.SIGINT, "term"), (signal.SIGHUP, "hup")):
            signal.signal(sig, lambda *_, ev=ev: self._events.put((ev,)))

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Launcher":
        if not sys.platform.startswith("linux"):
            log.warning("no parent-death signal on %s: workers would outlive a launcher that is killed", sys.platform)
        self._thread = threading.Thread(target=self._supervise, name="launcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # The broker loop has returned: normally because the supervisor set `stop`; if the loop
        # died instead, stop the workers now (they get no drain from a dead broker anyway).
        if self._thread is not None and self._thread.is_alive():
            self._events.put(("term",))
            self._events.put(("term",))
            self._thread.join(self.deploy.stop_timeout + 5.0)
            if exc and exc[0] is not None:
                self.exit_code = self.exit_code or 1

    def request_roll(self) -> None:
        """A rolling restart of every pool (what SIGHUP does)."""
        self._events.put(("hup",))

    def request_shutdown(self) -> None:
        """What SIGTERM does."""
        self._events.put(("term",))

    # ---------------------------------------------------------------- the supervisor thread

    def _supervise(self) -> None:
        try:
            self._do(self.sup.start(time.monotonic()))
            while not self.sup.finished:
                wake = self.sup.next_wakeup()
                now = time.monotonic()
                timeout = None if wake is None else max(0.0, wake - now)
                if self.sup.phase == "draining":
                    timeout = _DRAIN_POLL if timeout is None else min(timeout, _DRAIN_POLL)
                if self.sup.watching:  # the broker's list of registered workers: once a second
                    timeout = _WATCH_POLL if timeout is None else min(timeout, _WATCH_POLL)
                try:
                    ev = self._events.get(timeout=timeout)
                except queue.Empty:
                    ev = None
                now = time.monotonic()
                if ev is None:
                    pass
                elif ev[0] == "ready":
                    self._do(self.sup.worker_ready(ev[1], now))
                elif ev[0] == "exited":
                    self._on_exit(ev[1], ev[2], now)
                elif ev[0] == "term":
                    actions = self.sup.shutdown(now)
                    # Refuse new requests before anything is logged, so that whoever reads
                    # "shutting down" knows a request sent now is refused, not admitted.
                    self.broker.sched.drain(_DRAIN_REASON)
                    self._do(actions)
                elif ev[0] == "hup":
                    self._do(self.sup.roll(now))
                if self.sup.phase == "draining" and self.broker.sched.live == 0:
                    self._do(self.sup.broker_idle(now))
                self._watch()
                self._do(self.sup.tick(time.monotonic()))
            self._settle_broker()
        except BaseException:
            log.exception("the launcher's supervisor failed; its workers are told to stop")
            self.exit_code = 1
            self._terminate_all()
            raise
        finally:
            self.stop.set()

    def _watch(self) -> None:
        """Hand the supervisor the broker's latest lists of registered and leaving workers
        (made on the broker's loop once a second), if they are new, as our children's wids."""
        pids, leaving, at = self.broker.worker_pids
        if at == self._seen_at or not self.sup.watching:
            return
        self._seen_at = at
        kids = self._children.values()
        self._do(self.sup.broker_sees({c.wid for c in kids if c.pid in pids}, at,
                                      {c.wid: leaving[c.pid] for c in kids if c.pid in leaving}))

    def _settle_broker(self) -> None:
        """After the workers are gone: give requests the broker still holds (put back by a
        worker's DISCONNECT after a drain timeout) their SERVICE_UNAVAILABLE, boundedly."""
        sched = self.broker.sched
        sched.drain(_DRAIN_REASON)
        deadline = time.monotonic() + sched.config.service_grace + 1.0
        while sched.live and time.monotonic() < deadline:
            time.sleep(_DRAIN_POLL)

    def _do(self, actions) -> None:
        # One action that fails (for one worker, or a line that cannot be written) is logged
        # and the rest carried out: it stops no other worker.  (A failure of the supervisor
        # itself, its state machine or the loop, still stops everything: _supervise.)
        for a in actions:
            try:
                self._act(a)
            except Exception:
                log.exception("the launcher could not carry out %r; carrying on", a)

    def _act(self, a) -> None:
        t = type(a)
        if t is StartWorker:
            self._start(a)
        elif t is StopWorker:
            self._signal(a.wid, signal.SIGTERM)
        elif t is KillWorker:
            self._signal(a.wid, signal.SIGKILL)
        elif t is WorkerGone:
            self._gone(a)
        elif t is AllReady:
            b = self.broker
            b.pools_ready = True
            http = f" http={b.http_address}" if getattr(b, "http", None) is not None else ""
            # (stdout /dev/full, a pipe nobody reads any more, closed: a WARNING; UTF-8
            # whatever the locale, as the workers' READY lines)
            logs.announce(f"READY frontend={b.frontend_ep} backend={b.backend_ep}{http} workers={a.workers}",
                          self._out, log)
            log.info("every pool is ready: %s", ", ".join(f"{p.name} x{p.count}" for p in self.deploy.pools))
        elif t is GiveUp:
            child = self._children.get(a.wid)
            said = child.tail[-1] if child is not None and child.tail else "(it wrote nothing on stderr)"
            p = self._pools[a.pool]
            self.exit_code = 2 if a.code == 2 else 1
            line = (f"python -m broker: pool {a.pool!r} (model {p.model!r}) worker {a.index} exited with code "
                    f"{a.code} before it was ready: {said}")
            if logs.configured_format() == "json":
                log.error("%s", line)  # one JSON object, like every other line on stderr
            else:
                self._say(line)
        elif t is RollDone:
            log.info("pool %s: rolling restart done", a.pool)
        elif t is Notice:
            log.log(a.level, "%s", a.message)
        elif t is Finished:
            log.info("every worker has exited")

    def _on_exit(self, wid: int, code: int, now: float) -> None:
        self._do(self.sup.worker_exited(wid, code, now))
        self._children.pop(wid, None)

    def _gone(self, a: WorkerGone) -> None:
        child = self._children.get(a.wid)
        tag = child.tag if child is not None else f"pool {a.pool} worker {a.index}"
        if a.expected:
            log.info("%s exited with code %d", tag, a.code)
        elif a.restart_in is not None:
            log.warning("%s exited with code %d; restarting it in %g s", tag, a.code, a.restart_in)
        else:
            log.warning("%s exited with code %d", tag, a.code)

    # ---------------------------------------------------------------- children

    def _link_args(self) -> tuple[str, ...]:
        """Flags for the workers' broker connection: none over ipc; over tcp, --insecure for a
        plain backend, else the broker's public key (the worker's own secret key comes from
        extra_args --worker-key or $ZMQ_INFER_WORKER_KEY)."""
        be = self.broker.backend_ep
        if not be.startswith("tcp://"):
            return ()
        sec = self.broker.cfg.security
        if sec.insecure or not sec.curve_secret:
            return ("--insecure",)
        from broker.security import load_server_secret

        public, _ = load_server_secret(sec.curve_secret)
        # One argument, "--server-key=KEY": a z85 key may start with '-' (one in 85 do),
        # which as a separate argument the worker's parser took for an option (exit 2).
        return ("--server-key=" + public.decode(),)

    def _argv(self, pool: PoolConfig) -> list[str]:
        args = pool.worker_args(self.broker.backend_ep, heartbeat_interval=self._hb[0],
                                heartbeat_liveness=self._hb[1], link=self._link)
        # The launcher's log format (first: a pool's extra_args may override it; its level is
        # the worker's own, WARNING unless extra_args say --log-level).
        fmt = ["--log-format", logs.configured_format()] if logs.configured_format() != "text" else []
        return [sys.executable, "-c", _PRELUDE, str(os.getpid()), "-m", "gpu_worker", *fmt, *args]

    def _start(self, a: StartWorker) -> None:
        """Start worker ``a.wid``.  A start that fails (a fork or exec refused, a reader thread
        that cannot start: a pids, memory or descriptor limit reached) is that worker's alone:
        a child already forked is killed and reaped, and the supervisor hears at once of an
        exit with code 127, a crash like any other (restarted after the pool's backoff; at the
        launch, before its first READY, it gives up as a worker that cannot load does)."""
        pool = self._pools[a.pool]
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        popen = None
        readers: list[threading.Thread] = []
        try:
            popen = subprocess.Popen(self._argv(pool), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
            child = _Child(a.wid, a.pool, a.index, popen)
            self._children[a.wid] = child
            log.info("%s started%s", child.tag, "" if a.reason == "start" else f" ({a.reason})")
            readers = [
                threading.Thread(target=self._read_stdout, args=(child,), name=f"{a.pool}/{a.index}-out", daemon=True),
                threading.Thread(target=self._read_stderr, args=(child,), name=f"{a.pool}/{a.index}-err", daemon=True),
            ]
            child.threads = readers
            for t in readers:
                t.start()
            threading.Thread(target=self._wait, args=(child,), name=f"{a.pool}/{a.index}-wait", daemon=True).start()
        except Exception as e:
            self._children.pop(a.wid, None)
            what = f"pool {a.pool} worker {a.index}" + ("" if popen is None else f" pid {popen.pid}")
            if popen is not None:
                self._discard(popen, readers)
            # (a traceback only for what no exhausted resource explains: a bug)
            log.error("%s: cannot start python -m gpu_worker: %s%s", what, str(e) or type(e).__name__,
                      "" if popen is None else " (its process was killed)",
                      exc_info=not isinstance(e, (OSError, RuntimeError, MemoryError)))
            self._events.put(("exited", a.wid, 127))

    def _discard(self, popen: subprocess.Popen, readers: list[threading.Thread]) -> None:
        """Kill and reap the child of a start that failed half-way, and close the pipes that
        no reader took (a reader that did start closes its own at the child's exit)."""
        try:
            popen.kill()
        except OSError:
            pass
        try:
            popen.wait(_REAP_TIMEOUT)
        except subprocess.TimeoutExpired:  # (subprocess reaps it at a later Popen)
            log.warning("pid %d of a failed start still there %g s after SIGKILL", popen.pid, _REAP_TIMEOUT)
        for i, f in enumerate((popen.stdout, popen.stderr)):
            if i >= len(readers) or readers[i].ident is None:
                try:
                    f.close()
                except OSError:
                    pass

    def _read_stdout(self, child: _Child) -> None:
        f = child.popen.stdout
        ready = False
        try:
            for line in iter(lambda: f.readline(_LINE), b""):
                text = line.decode(errors="replace").rstrip("\n")
                if not ready and text.startswith("READY"):
                    ready = True
                    log.info("%s ready: %s", child.tag, text)
                    self._events.put(("ready", child.wid))
                else:
                    self._forward(child, text)
        except (OSError, ValueError):
            pass
        finally:
            f.close()

    def _read_stderr(self, child: _Child) -> None:
        f = child.popen.stderr
        try:
            for line in iter(lambda: f.readline(_LINE), b""):
                text = line.decode(errors="replace").rstrip("\n")
                child.tail.append(text)
                self._forward(child, text)
        except (OSError, ValueError):
            pass
        finally:
            f.close()

    def _wait(self, child: _Child) -> None:
        try:  # until it exits, without reaping it: its pid and process group id stay its own
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            unreaped = True
        except (ChildProcessError, AttributeError):  # (reaped already; no waitid here)
            unreaped = False
        with child.lock:
            if unreaped:
                # What it leaves in its process group (each worker leads one: a session of
                # its own) goes with it: its model's processes, a helper holding device
                # memory, a shell pipeline, that would otherwise outlive it, reparented
                # away, one set more at each crash or restart.  (`killpg` while the exited
                # worker is a zombie not yet reaped: the group's id cannot name anyone else's.)
                _kill_group(child.pid)
            child.exited = True
            code = child.popen.wait()
        # Its last lines (READY first of all) are reported before its exit; a grandchild that
        # kept the pipes open does not hold the exit up for long.
        for t in child.threads:
            t.join(1.0)
        self._events.put(("exited", child.wid, code))

    def _forward(self, child: _Child, text: str) -> None:
        if logs.configured_format() == "json":
            self._say(logs.tag_json_line(text, pool=child.pool, index=child.index, pid=child.pid))
            return
        self._say(f"[{child.pool}/{child.index} pid {child.pid}] {text}")

    def _say(self, line: str) -> None:
        # Through the stream's writer thread, in one order with the log lines: a stderr that
        # is not read (a pipe, a paused terminal) drops lines instead of blocking the
        # threads that drain the workers' pipes (and, through them, the workers).
        self._writer.put(line)

    def _signal(self, wid: int, sig: int) -> None:
        child = self._children.get(wid)
        if child is not None:
            self._send(child, sig)

    @staticmethod
    def _send(child: _Child, sig: int) -> None:
        """``sig`` to a worker not reaped yet; SIGKILL (hung, or past its stop timeout) to its
        whole process group, what its model started included."""
        with child.lock:
            if child.exited:
                return
            try:
                if sig == signal.SIGKILL:
                    _kill_group(child.pid)
                else:
                    os.kill(child.pid, sig)
            except OSError:
                pass

    def _terminate_all(self) -> None:
        for child in list(self._children.values()):
            self._send(child, signal.SIGTERM)


def _kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a worker's: it leads it), or the process alone when it
    leads none (a group of its own could not be made)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except OSError:
        try:
            os.kill(pgid, signal.SIGKILL)
        except OSError:
            pass
