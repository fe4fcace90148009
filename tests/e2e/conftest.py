"""Fixtures that run the real processes: `python -m broker` and `python -m gpu_worker`.

Each process prints a READY line once it serves; fixtures wait for that line (with a
timeout) instead of sleeping, and stop every process they started at teardown (SIGTERM, then
SIGKILL if it does not exit in time)."""
from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


class Proc:
    """``python *args`` (after ``prefix``: a command that execs it in place, keeping its pid,
    as ``ip netns exec NAME`` does).  ``tree``: the checkout whose code it runs (an older
    release's, from `old_tree`), instead of this one: its folder and its tests/e2e alone
    are on the path, and it is the working directory (``-m`` looks there first)."""

    def __init__(self, args: list[str], env: dict | None = None, prefix: list[str] | tuple = (), stdin: bool = False,
                 tree: Path | None = None):
        full_env = dict(os.environ)
        root = ROOT if tree is None else tree
        if tree is None:
            full_env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), full_env.get("PYTHONPATH", "")])
        else:
            full_env["PYTHONPATH"] = os.pathsep.join([str(tree / "tests" / "e2e"), str(tree)])
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self.args = args
        self.p = subprocess.Popen(
            [*prefix, sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, cwd=root,
            stdin=subprocess.PIPE if stdin else None,  # `stdin`: the test writes to it (p.stdin)
        )
        self.ready_line = ""
        self._err = b""  # stderr already read by wait_log

    def wait_ready(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.p.stdout.fileno()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.args} did not print READY within {timeout} s; stderr: {self.stderr()}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"{self.args} exited with {self.p.wait(5)}: {self.stderr()}")
                buf += chunk
        line = buf.split(b"\n", 1)[0].decode()
        assert line.startswith("READY"), line
        self.ready_line = line
        return line

    def stderr(self, tail: int | None = 3000) -> str:
        """What the process wrote to stderr, its last `tail` characters (None: all of it)."""
        if self.p.poll() is None:
            return "(still running)"
        # Read for at most a few seconds: a child of the process (a model's helper) that kept
        # the pipe open would hold a read to its end, and a failing test's message, forever.
        text = self._stderr_now(1 << 62, timeout=5.0)
        return text if tail is None else text[-tail:]

    def _stderr_now(self, tail: int, timeout: float = 2.0) -> str:
        """As `stderr`, but reading for at most ``timeout`` s: a child of the process that
        kept the pipe open (a model's subprocess) would hold a read to its end forever."""
        fd = self.p.stderr.fileno()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._err += chunk
        return self._err.decode(errors="replace")[-tail:]

    def pull(self) -> str:
        """What the process wrote to stderr so far, read without waiting (so its pipe never
        fills while a test runs on)."""
        fd = self.p.stderr.fileno()
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._err += chunk
        return self._err.decode(errors="replace")

    def wait_log(self, text: str, timeout: float = 15.0, after: int = 0) -> None:
        """Read stderr until it contains `text` (a condition, not a sleep), from its
        `after`th byte on (`logged`: what was read so far, to wait for a line logged again)."""
        deadline = time.monotonic() + timeout
        fd = self.p.stderr.fileno()
        while text.encode() not in self._err[after:]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.args} did not log {text!r} within {timeout} s: {self._err[-2000:]!r}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.args} exited with {self.p.wait(5)} before logging {text!r}: "
                                       f"{self._err[-2000:]!r}")
                self._err += chunk

    @property
    def logged(self) -> int:
        """How much of stderr `wait_log` has read."""
        return len(self._err)

    def field(self, name: str) -> str:
        for part in self.ready_line.split():
            if part.startswith(name + "="):
                return part.split("=", 1)[1]
        raise KeyError(name)

    def terminate(self, timeout: float = 15.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                return self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
        return self.p.wait(10)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)

    def close(self, say: bool = False) -> None:
        """Stop it (`terminate`) and close its pipes; ``say``: print its command line and the
        tail of its stderr first (a failed test's report shows them: a flake in CI is then
        read from its processes' own words)."""
        self.terminate()
        if say:
            print(f"--- {' '.join(self.args)} (pid {self.p.pid}, exit {self.p.returncode}); stderr:\n"
                  f"{self._stderr_now(6000)}")
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


class Cluster:
    """A broker and workers on ipc endpoints in a private temp dir.

    Heartbeats every 0.2 s, and by default a peer is presumed dead after 3 silent intervals
    (0.6 s: tests of a death found by silence see it soon).  ``liveness`` (the
    `heartbeat_liveness` marker of the `cluster` fixture) widens that window for tests that
    do not look at silence: a loaded CI box that stalls a process for 0.6 s otherwise reads
    it as a death (its requests retried elsewhere, its leases ended).  The broker's
    liveness is the workers' too: its WELCOME sets it."""

    def __init__(self, tmp: Path, liveness: int | None = None):
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.frontend = f"ipc://{tmp}/fe.ipc"
        self.backend = f"ipc://{tmp}/be.ipc"
        self.liveness = liveness

    def broker(self, *extra: str, tree: Path | None = None) -> Proc:
        wide = () if self.liveness is None else ("--heartbeat-liveness", str(self.liveness))
        p = Proc(["-m", "broker", "--frontend", self.frontend, "--backend", self.backend,
                  "--heartbeat-interval", "0.2", *wide, *extra], tree=tree)
        self.procs.append(p)
        p.wait_ready()
        return p

    def worker(self, model: str = "echo", *extra: str, env: dict | None = None, wait: bool = True,
               prefix: list[str] | tuple = (), tree: Path | None = None) -> Proc:
        p = Proc(["-m", "gpu_worker", "--broker", self.backend, "--model", model,
                  "--heartbeat-interval", "0.2", "--out-capacity-mb", "160", *extra], env=env, prefix=prefix,
                 tree=tree)
        self.procs.append(p)
        if wait:
            p.wait_ready()
        return p

    def close(self, say: bool = False) -> None:
        # Every gate opened wide first: a worker stopped with a call held at a gate drains
        # it, and `held` (which keeps its FIFO open read-write) never sees the test's end of
        # it, so a failed test's teardown waited out each such worker's 15 s.
        for g in list(Gate.live):
            g.open_wide()
        # Workers first, so they can DISCONNECT from a live broker.
        for p in reversed(self.procs):
            p.close(say)


@pytest.fixture(scope="session")
def old_tree(tmp_path_factory):
    """``old_tree(commit)``: a checkout of an earlier commit of this repository (a release
    users still run), for tests of mixed versions: a git worktree in a temp folder, made once
    a session per commit and removed at its end (`git worktree remove --force`).  Skips the
    test when git or the commit is missing (a shallow clone, an exported tarball)."""
    made: dict[str, Path] = {}

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)

    def tree(commit: str) -> Path:
        if commit not in made:
            try:
                found = git("cat-file", "-e", f"{commit}^{{commit}}")
            except (OSError, subprocess.TimeoutExpired) as e:
                pytest.skip(f"no git to check out {commit}: {e}")
            if found.returncode != 0:
                pytest.skip(f"commit {commit} is not in this clone (shallow?): {found.stderr.strip()}")
            path = tmp_path_factory.mktemp("old") / commit
            added = git("worktree", "add", "--detach", str(path), commit)
            if added.returncode != 0:
                pytest.skip(f"cannot check out {commit}: {added.stderr.strip()}")
            made[commit] = path
        return made[commit]

    yield tree
    for path in made.values():
        git("worktree", "remove", "--force", str(path))


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Notes on the test item whether its call failed, for `cluster`'s teardown."""
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


def pytest_configure(config):
    config.addinivalue_line("markers", "heartbeat_liveness(n): the `cluster` broker's --heartbeat-liveness "
                                       "(silent 0.2 s intervals before a peer is presumed dead; default 3)")


@pytest.fixture
def cluster(tmp_path, request):
    """A `Cluster`; its processes are stopped at teardown, and when the test failed their
    stderr is printed (the report's "Captured stdout teardown").  A `heartbeat_liveness(n)`
    marker on the test (or its module) widens the liveness window (`Cluster`)."""
    mark = request.node.get_closest_marker("heartbeat_liveness")
    c = Cluster(tmp_path, liveness=None if mark is None else int(mark.args[0]))
    try:
        yield c
    finally:
        c.close(say=request.node.stash.get(_FAILED, False))


class RunLog:
    """The $RUN_LOG of tests/e2e/gate_model.py's `counted` and `counted_batch`: the tags
    of the requests its model ran, in run order."""

    def __init__(self, path: Path):
        self.path = path

    def order(self) -> list[int]:
        return [int(line.split()[1]) for line in self.path.read_text().splitlines()] if self.path.exists() else []

    def until(self, n: int, timeout: float = 20.0) -> None:
        """Until `n` runs are logged (polling a file: a condition, not a delay)."""
        deadline = time.monotonic() + timeout
        while len(self.order()) < n:
            assert time.monotonic() < deadline, f"{self.order()}: waited for {n} runs"
            time.sleep(0.005)


def listening_port(pid: int, timeout: float = 30.0) -> int:
    """The TCP port that process ``pid`` listens on (one it bound with port 0, the kernel's
    pick), once it listens: read from the kernel (its socket descriptors, /proc/net/tcp and
    tcp6), for a process that reports its port late or not at all (a launcher says READY
    only once its pools are).  A port picked by the test and bound by the process later
    (`bench.peers.free_port`) may be taken meanwhile by another process of a busy machine."""
    deadline = time.monotonic() + timeout
    while True:
        inodes = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except FileNotFoundError:
            raise RuntimeError(f"process {pid} exited before it listened on a TCP port") from None
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, one of its sockets
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        if len(ports) == 1:
            return ports.pop()
        assert len(ports) < 2, f"process {pid} listens on several TCP ports: {sorted(ports)}"
        assert time.monotonic() < deadline, f"process {pid} did not listen on a TCP port within {timeout} s"
        time.sleep(0.01)  # polling /proc (a condition, not a delay)


def until_stopped(pid: int, timeout: float = 20.0) -> None:
    """Until process `pid` is stopped (SIGSTOP: state T in /proc; polling, a condition)."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)  # polling /proc (a condition, not a delay)


def wait_service(client, service: str, timeout: float = 20.0) -> None:
    """Poll MMI until the broker knows a live worker for `service` (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not client.mmi_service(service):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker for {service!r} after {timeout} s")
        time.sleep(0.01)


class Gate:
    """A FIFO at `path` for tests/e2e/gate_model.py (the `gate` fixture's; a test that needs
    a second one, to release one worker's calls and not another's, makes its own).  Gates
    open for writing are in `live`, which `Cluster.close` opens wide before it stops the
    processes."""

    live: "weakref.WeakSet[Gate]" = weakref.WeakSet()

    def __init__(self, path: Path, entered_log: Path):
        os.mkfifo(path)
        self.path = path
        self.entered_log = entered_log
        self.env = {"GATE_FIFO": str(path), "GATE_ENTERED": str(entered_log)}
        self.fd = None

    def entered(self) -> int:
        """How many gated calls reached the gate so far."""
        return self.entered_log.read_text().count("\n") if self.entered_log.exists() else 0

    def wait_entered(self, n: int = 1, timeout: float = 20.0) -> None:
        """Until `n` gated calls reached the gate: the worker read them and runs them.
        Wait for this, not for the broker's word, before a signal meant to find a request
        held at the worker: an MMI answer, the broker's in_flight or a busy worker prove
        only that the broker dispatched it, and under load the worker read it after the
        signal (a stopping worker sends a request it reads then back to the broker, 503)."""
        deadline = time.monotonic() + timeout
        while self.entered() < n:
            assert time.monotonic() < deadline, f"{self.entered()} of {n} gated calls reached the gate"
            time.sleep(0.005)  # polling a file (a condition, not a delay)

    def open(self, timeout: float = 60.0):
        # The write end opens once the worker opened the read end: tried without blocking
        # (ENXIO: no reader yet) until then, so that a worker that failed to start fails
        # the test here, with a message, rather than block it until pytest's timeout.
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            assert time.monotonic() < deadline, f"no worker opened the gate within {timeout} s"
            time.sleep(0.01)  # polling for the reader (a condition, not a delay)
        os.set_blocking(fd, True)
        self.fd = fd
        Gate.live.add(self)

    def release(self, n=1):
        os.write(self.fd, b"x" * n)

    def open_wide(self) -> None:
        """Release every call held at the gate, and those to come (as many bytes as the
        FIFO takes: 64 KiB), without blocking: for the end of a test, passed or failed."""
        if self.fd is None:
            return
        os.set_blocking(self.fd, False)
        try:
            while os.write(self.fd, b"x" * 4096):
                pass
        except (BlockingIOError, BrokenPipeError):
            pass

    def close(self):
        """Open wide (`open_wide`: a `gate_model:held` worker keeps the FIFO open itself, so
        only bytes end its held calls) and close the write end."""
        if self.fd is not None:
            self.open_wide()
            os.close(self.fd)
            self.fd = None
        Gate.live.discard(self)


@pytest.fixture
def gate(tmp_path):
    """A FIFO for tests/e2e/gate_model.py: `open()` once the worker started (it returns
    when the worker opened the read end), then each byte `release()`s one gated call.
    `wait_entered(n)`: until n calls of `gate_model:factory` or `:copying` reached the gate
    ($GATE_ENTERED), the proof that a worker holds a request (see its docstring)."""
    g = Gate(tmp_path / "gate.fifo", tmp_path / "gate.entered")
    yield g
    g.close()
