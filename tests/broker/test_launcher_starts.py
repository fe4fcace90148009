"""The launcher's process layer in-process (`broker.launcher.Launcher`), with real child
processes and a stand-in broker: a start that fails half-way (the child forked, a thread of
the launcher's refused: a pids limit reached) or an action that fails stays one worker's (or
one line's) failure; nothing else is stopped.  Every wait is for a log line or an exit, with
a bound; every child is gone at the end."""
from __future__ import annotations

import io
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from broker.config import LauncherConfig, PoolConfig
from broker.launcher import _PRELUDE, Launcher

# A worker stand-in: READY at once, then waits for its SIGTERM (the prelude makes it exit
# with this process's supervisor thread too, as a worker does).
WORKER = "import signal\nprint('READY', flush=True)\nsignal.pause()\n"


class Logged:
    """The broker.launcher logger's lines, in order, as they come (INFO and up)."""

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.lines: list[str] = []

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 20.0) -> re.Match:
        """The first line past index `start` that matches `pattern`; fails at once if the
        supervisor failed."""
        rx = re.compile(pattern)
        i = start
        while True:
            while i < len(self.lines):
                if "supervisor failed" in self.lines[i]:
                    raise AssertionError("the supervisor failed:\n" + "\n".join(self.lines[start:]))
                if m := rx.search(self.lines[i]):
                    return m
                i += 1
            try:
                self.lines.append(self.q.get(timeout=timeout))
            except queue.Empty:
                raise TimeoutError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(self.lines[start:])) from None


@pytest.fixture
def launcher():
    """make(pools, out=None) -> (Launcher, Logged), its supervisor running; at teardown it is
    shut down and every child it started has exited."""
    log = logging.getLogger("broker.launcher")
    level = log.level
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    made: list[Launcher] = []
    popens = []
    logged = Logged()

    class Handler(logging.Handler):
        def emit(self, record):
            logged.q.put(record.getMessage())

    handler = Handler()
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    def make(pools, out=None):
        broker = SimpleNamespace(
            cfg=SimpleNamespace(scheduler=SimpleNamespace(heartbeat_interval=0.2, heartbeat_liveness=3)),
            backend_ep="ipc:///nonexistent/be.ipc", frontend_ep="ipc:///nonexistent/fe.ipc",
            sched=SimpleNamespace(live=0, drain=lambda reason: None, config=SimpleNamespace(service_grace=0.0)),
            worker_pids=(frozenset(), {}, None))  # (no list of the broker's: nobody judged hung)
        deploy = LauncherConfig(pools=tuple(pools), restart_backoff_s=0.05, restart_backoff_max_s=0.4,
                                stop_timeout_s=10.0, drain_timeout_s=5.0)
        la = Launcher(broker, deploy, threading.Event(), out=out or io.StringIO(), err=io.StringIO())
        argv = [sys.executable, "-c", _PRELUDE, str(os.getpid()), "-c", WORKER]
        la._argv = lambda pool: argv
        real_start = la._start

        def start(a):  # every child it starts, to check at the end that each one exited
            real_start(a)
            if (child := la._children.get(a.wid)) is not None:
                popens.append(child.popen)

        la._start = start
        made.append(la)
        la.__enter__()
        return la, logged

    try:
        yield make
    finally:
        for la in made:
            if la._thread.is_alive():
                la.request_shutdown()
                la.request_shutdown()
                la._thread.join(30)
        leftover = []
        for p in popens:
            try:
                p.wait(5)  # (exited already, but for a launcher that failed and only told them to)
            except subprocess.TimeoutExpired:
                leftover.append(p.pid)
                p.kill()
                p.wait(10)
        log.removeHandler(handler)
        log.setLevel(level)
        for s, h in signals.items():
            signal.signal(s, h)
        assert not leftover, f"children still running after the launcher stopped: {leftover}"


def shut_down(la: Launcher) -> None:
    la.request_shutdown()
    assert la.stop.wait(30), "the launcher did not finish its shutdown"
    la._thread.join(10)
    assert not la._thread.is_alive()


def ready_pids(logged: Logged) -> dict[tuple[str, int], int]:
    out = {}
    for line in logged.lines:
        if m := re.search(r"pool (\S+) worker (\d+) pid (\d+) ready", line):
            out[(m.group(1), int(m.group(2)))] = int(m.group(3))
    return out


TWO_POOLS = (PoolConfig(name="a", model="echo", count=2), PoolConfig(name="b", model="echo", count=1))


@pytest.mark.parametrize("which", ["out", "err", "wait"])
def test_a_thread_that_cannot_start_fails_that_start_alone_and_it_is_retried(launcher, monkeypatch, which):
    # Under a pids limit a restart's fork succeeded and then its reader thread could not
    # start (RuntimeError, not the OSError a failed fork is): the supervisor failed, every
    # worker of every pool was stopped and the launcher exited 1.
    la, logged = launcher(TWO_POOLS)
    logged.wait_for(r"every pool is ready")
    before = ready_pids(logged)
    others = {(c.pool, c.index): c for c in la._children.values() if (c.pool, c.index) != ("a", 0)}
    assert sorted(others) == [("a", 1), ("b", 0)]

    real = threading.Thread.start
    refused = []

    def start(self):
        if self.name == f"a/0-{which}" and not refused:
            refused.append(self._args[0].popen)  # the child it was started for
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    mark = len(logged.lines)
    os.kill(before[("a", 0)], signal.SIGKILL)
    logged.wait_for(rf"pool a worker 0 pid {before[('a', 0)]} exited with code -9; restarting it in 0.05 s", mark)
    m = logged.wait_for(r"pool a worker 0 pid (\d+): cannot start python -m gpu_worker: can't start new thread "
                        r"\(its process was killed\)", mark)
    (child,) = refused
    assert int(m.group(1)) == child.pid
    # Killed and reaped before the line was logged: no process left, no zombie.
    assert child.returncode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{child.pid}")
    # The pipes no reader took are closed (a reader that started closes its own).
    assert child.stderr.closed or which == "wait"
    assert child.stdout.closed or which != "out"
    # A crash at once, the second in a row: the backoff doubled.
    logged.wait_for(r"pool a worker 0 exited with code 127; restarting it in 0.1 s", mark)
    m = logged.wait_for(r"pool a worker 0 pid (\d+) ready", mark)
    assert int(m.group(1)) not in (before[("a", 0)], child.pid)
    # Nobody else was stopped, or restarted.
    assert all(c.popen.poll() is None for c in others.values())
    assert {s: p for s, p in ready_pids(logged).items() if s != ("a", 0)} == \
        {s: p for s, p in before.items() if s != ("a", 0)}
    assert la.sup.phase == "running" and la.exit_code == 0
    shut_down(la)
    assert la.exit_code == 0


def test_a_fork_refused_is_a_failed_start_retried_after_the_backoff(launcher, monkeypatch):
    la, logged = launcher(TWO_POOLS)
    logged.wait_for(r"every pool is ready")
    victim = ready_pids(logged)[("b", 0)]
    real = subprocess.Popen
    refused = []

    def popen(*args, **kw):
        if not refused:
            refused.append(1)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real(*args, **kw)

    monkeypatch.setattr("broker.launcher.subprocess.Popen", popen)
    mark = len(logged.lines)
    os.kill(victim, signal.SIGKILL)
    logged.wait_for(r"pool b worker 0: cannot start python -m gpu_worker: \[Errno 11\]", mark)
    logged.wait_for(r"pool b worker 0 exited with code 127; restarting it in 0.1 s", mark)
    logged.wait_for(r"pool b worker 0 pid (\d+) ready", mark)
    assert la.sup.phase == "running"
    shut_down(la)
    assert la.exit_code == 0


def test_a_ready_line_that_cannot_be_written_stops_no_worker(launcher):
    # One action that fails (here: stdout closed under the launcher) is logged and carried
    # past; it stopped every worker (the supervisor failed).  The READY line is a WARNING of
    # its own now (broker.protocol.logs.announce's twin).
    out = io.StringIO()
    out.close()
    la, logged = launcher(TWO_POOLS, out=out)
    m = logged.wait_for(r"could not print the READY line on stdout")
    mark = len(logged.lines)
    victim = ready_pids(logged)[("a", 1)]
    os.kill(victim, signal.SIGKILL)  # and it still restarts a crashed worker
    logged.wait_for(r"pool a worker 1 pid (\d+) ready", mark)
    assert m and la.sup.phase == "running"
    shut_down(la)
    assert la.exit_code == 0
