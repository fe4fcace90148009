"""The launcher with real processes: `python -m broker --config deploy.toml` with `[[pool]]`
tables (broker.launcher, docs/operations.md "One launcher").  Endpoints are ipc sockets in
tmp_path; every wait is for a line, a result or a process exit, with a bound."""
from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client
from client_sdk.errors import ServiceUnavailable
from tests.e2e.conftest import ROOT, Proc

TWO_POOLS = """
    [[pool]]
    model = "echo"
    count = 2
    [[pool]]
    name = "other"
    model = "echo"
    service = "echo2"
    max_batch = 4
"""
READY_LOG = re.compile(r"pool (\S+) worker (\d+) pid (\d+) ready")


class Launcher(Proc):
    """`python -m broker --config FILE` on ipc endpoints in `tmp`, with 0.2 s heartbeats."""

    def __init__(self, tmp, pools: str, env: dict | None = None, prefix=()):
        self.frontend = f"ipc://{tmp}/fe.ipc"
        path = tmp / "deploy.toml"
        path.write_text(f'frontend = "{self.frontend}"\nbackend = "ipc://{tmp}/be.ipc"\n'
                        "[scheduler]\nheartbeat_interval = 0.2\n" + textwrap.dedent(pools))
        super().__init__(["-m", "broker", "--config", str(path), "--log-level", "INFO"], env=env, prefix=prefix)

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 20.0) -> re.Match:
        """The first match of `pattern` in stderr past offset `start` (read as it comes)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        fd = self.p.stderr.fileno()
        while (m := rx.search(self._err.decode("latin-1"), start)) is None:  # offsets = bytes
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {pattern!r} within {timeout} s: {self._err[-3000:]!r}")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"launcher exited with {self.p.wait(5)} before {pattern!r}: {self._err[-3000:]!r}")
                self._err += chunk
        return m

    def ready_pids(self) -> dict[tuple[str, int], int]:
        """The latest READY pid of each slot, from the log read so far."""
        out = {}
        for m in READY_LOG.finditer(self._err.decode(errors="replace")):
            out[(m.group(1), int(m.group(2)))] = int(m.group(3))
        return out

    def read_all_stderr(self, timeout: float = 20.0) -> str:
        """After exit: the whole of stderr."""
        self.p.wait(timeout)
        self._err += self.p.stderr.read()
        return self._err.decode(errors="replace")


@pytest.fixture
def launchers():
    started = []

    def start(tmp, pools, env=None, wait=True, prefix=()):
        proc = Launcher(tmp, pools, env, prefix)
        started.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    yield start
    for proc in started:
        proc.close()


def pidfds(pids) -> dict[int, int]:
    return {pid: os.pidfd_open(pid) for pid in pids}


def _describe(pid: int) -> str:
    """What a process that should have exited is doing (for the failure message)."""
    out = [str(pid)]
    for name in ("status", "wchan", "cmdline"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                text = f.read().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if name == "status":
            text = " ".join(line for line in text.splitlines() if line.startswith(("State", "PPid", "SigPnd", "ShdPnd")))
        out.append(f"{name}: {text.strip()[:200]}")
    return ", ".join(out)


def wait_gone(fds: dict[int, int], timeout: float) -> None:
    """Wait until every process exits (its pidfd turns readable; no parent needed), bounded."""
    deadline = time.monotonic() + timeout
    left = dict(fds)
    try:
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise AssertionError(f"processes still running {timeout} s on: "
                                     + "; ".join(_describe(p) for p in sorted(left)))
            for fd in select.select(list(left.values()), [], [], wait)[0]:
                left = {p: f for p, f in left.items() if f != fd}
    finally:
        for fd in fds.values():
            os.close(fd)


async def traffic(c: AsyncClient, service: str, stop: asyncio.Event, streams: int = 3) -> int:
    """Requests until `stop`, `streams` at a time; each must come back with its own input.
    Paced (a pause of 2 ms after each), so that the workers starting meanwhile get the CPU."""
    done = 0

    async def one(k: int):
        nonlocal done
        i = 0
        while not stop.is_set():
            x = np.full(8, k * 100_000 + i, np.int64)
            out = await c.infer(service, {"x": x}, timeout=20)
            np.testing.assert_array_equal(out["x"], x)
            out.release()
            done += 1
            i += 1
            await asyncio.sleep(0.002)  # pacing, not waiting for anything

    await asyncio.gather(*(one(k) for k in range(streams)))
    return done


# ------------------------------------------------------------------------- config errors


def run_broker(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "e2e"), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "broker", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("text, key", [
    ("[[pool]]\nmodel = 'echo'\ncuont = 2\n", "'cuont'"),
    ("[[pool]]\nmodel = 'echo'\ncount = 0\n", "count must be an integer from 1 to 1024"),
    ("fronted = 'ipc:///tmp/x.ipc'\n[[pool]]\nmodel = 'echo'\n", "'fronted'"),
])
def test_a_bad_key_or_value_is_one_line_and_exit_2(tmp_path, text, key):
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    r = run_broker("--config", str(path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and str(path) in lines[0], r.stderr
    assert r.stdout == ""


def test_an_endpoint_that_cannot_be_bound_is_one_line_and_exit_2(tmp_path):
    import socket

    # A directory that does not exist (as the example config's /run/zmq-infer on a host
    # without it), and a tcp port in use.
    r = run_broker("--frontend", f"ipc://{tmp_path}/nope/fe.ipc", "--backend", f"ipc://{tmp_path}/be.ipc")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot bind ipc://{tmp_path}/nope/fe.ipc" in lines[0], r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_broker("--frontend", f"tcp://127.0.0.1:{port}", "--backend", f"ipc://{tmp_path}/be.ipc",
                       "--insecure")
    assert r.returncode == 2 and f"cannot bind tcp://127.0.0.1:{port}" in r.stderr.strip().splitlines()[-1], r.stderr
    # A backend that cannot be bound, after the frontend was: the frontend's socket file
    # stayed behind.
    r = run_broker("--frontend", f"ipc://{tmp_path}/fe.ipc", "--backend", f"ipc://{tmp_path}/nope/be.ipc")
    assert r.returncode == 2 and f"cannot bind ipc://{tmp_path}/nope/be.ipc" in r.stderr, r.stderr
    assert not (tmp_path / "fe.ipc").exists()


def test_a_worker_with_a_broker_endpoint_it_cannot_connect_to_is_one_line_and_exit_2(tmp_path):
    # An ipc path longer than a socket address holds was a traceback (after the model loaded).
    long = f"ipc://{tmp_path}/{'x' * 120}.ipc"
    for endpoint, words in ((long, "a socket path holds at most 107"), ("icp:///tmp/x", "check the endpoint's spelling")):
        r = subprocess.run([sys.executable, "-m", "gpu_worker", "--broker", endpoint, "--model", "echo"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"cannot connect to --broker {endpoint}" in lines[0] and words in lines[0], r.stderr


def test_a_second_broker_does_not_take_a_running_ones_ipc_endpoint(cluster):
    cluster.broker()
    cluster.worker("echo")
    r = run_broker("--frontend", cluster.frontend, "--backend", f"ipc://{cluster.tmp}/be2.ipc")
    assert r.returncode == 2 and "a running process serves it" in r.stderr, r.stderr
    with Client(cluster.frontend, timeout=10) as c:  # the first one still has it
        assert c.infer("echo", {"x": np.arange(3)})["x"].tolist() == [0, 1, 2]


def test_a_pool_whose_model_cannot_load_stops_the_launch_with_exit_2(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text(f'frontend = "ipc://{tmp_path}/fe.ipc"\nbackend = "ipc://{tmp_path}/be.ipc"\n'
                    "[[pool]]\nmodel = 'echo'\n[[pool]]\nname = 'bad'\nmodel = 'nosuchmodel'\n")
    r = run_broker("--config", str(path))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "pool 'bad'" in last and "'nosuchmodel'" in last and "before it was ready" in last, r.stderr
    assert not r.stdout.startswith("READY")


def test_a_fixed_port_in_a_pools_extra_args_is_one_line_and_exit_2(tmp_path, launchers):
    # `--health-port 8003` in extra_args: the launcher started the pool, and every rolling
    # restart (SIGHUP) then started a replacement beside the old worker, which could not bind
    # the port, exited 2 and was restarted with backoff for good; the roll never ended.
    la = launchers(tmp_path, """
        [[pool]]
        model = "echo"
        extra_args = ["--no-warmup", "--health-port", "127.0.0.1:18933"]
    """, wait=False)
    with pytest.raises(RuntimeError, match="exited with 2"):
        la.wait_ready()  # refused before anything starts
    lines = la.read_all_stderr().strip().splitlines()
    assert len(lines) == 1, lines
    assert ("[[pool]] 'echo'" in lines[0] and "--health-port the fixed port 18933" in lines[0]
            and "rolling restart" in lines[0] and "--pool echo -- --health-port 127.0.0.1:18933" in lines[0]), lines
    # The same file still serves a worker run on its own with that port (--pool).
    r = run_broker("--config", str(tmp_path / "deploy.toml"), "--pool", "echo", "--", "--help")
    assert r.returncode == 0 and "--health-port" in r.stdout, r.stderr


def test_two_pools_of_one_service_with_other_models_are_one_line_and_exit_2(tmp_path, launchers):
    # Each request of the service went to either pool's model, and neither declares a
    # signature, so nothing said so: the same call came back with 1.0 or 3.0.
    la = launchers(tmp_path, """
        [[pool]]
        model = "echo"
        service = "s"
        [[pool]]
        name = "scaled"
        model = "meta_model:factory"
        service = "s"
    """, wait=False)
    with pytest.raises(RuntimeError, match="exited with 2"):
        la.wait_ready()  # refused before anything starts
    lines = la.read_all_stderr().strip().splitlines()
    assert len(lines) == 1, lines
    assert ("[[pool]] #2 (name 'scaled'): service 's' is served by [[pool]] #1 (name 's') with another model"
            in lines[0]), lines


# ------------------------------------------------------------------------- serving


def test_two_pools_start_with_one_command_and_serve(tmp_path, launchers):
    la = launchers(tmp_path, TWO_POOLS)
    assert la.field("workers") == "3" and la.field("frontend") == la.frontend
    la.wait_for(r"every pool is ready")
    pids = la.ready_pids()
    assert sorted(pids) == [("echo", 0), ("echo", 1), ("other", 0)] and len(set(pids.values())) == 3
    with Client(la.frontend, timeout=10) as c:
        for service in ("echo", "echo2"):
            assert c.mmi_service(service)  # READY came after every worker registered
            x = np.arange(16, dtype=np.float32)
            with c.infer(service, {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)


def test_a_sigkilled_worker_is_restarted_and_no_request_is_lost(tmp_path, launchers):
    # A worker that served restart_reset_s (here 0.3 s) since its READY is replaced at once,
    # without the first backoff (0.5 s): its pool is short of it until then.
    la = launchers(tmp_path, "[launcher]\nrestart_reset_s = 0.3\n" + TWO_POOLS)
    la.wait_for(r"every pool is ready")
    victim = la.ready_pids()[("echo", 0)]
    served = time.monotonic() + 0.3  # (the launcher saw its READY before it said every pool is)

    async def scenario():
        async with AsyncClient(la.frontend, timeout=20, heartbeat_interval=0.2) as c:
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(c, "echo", stop))

            def kill_and_wait():
                while time.monotonic() < served:  # the condition: it served restart_reset_s
                    time.sleep(0.01)
                mark = len(la._err)
                os.kill(victim, signal.SIGKILL)
                la.wait_for(rf"pool echo worker 0 pid {victim} exited with code -9; restarting it in 0 s", mark)
                return la.wait_for(r"pool echo worker 0 pid (\d+) ready", mark)

            m = await asyncio.to_thread(kill_and_wait)  # the load runs on meanwhile
            stop.set()
            return int(m.group(1)), await asyncio.wait_for(load, 30)

    new_pid, served = asyncio.run(scenario())
    assert new_pid != victim and served > 0
    assert la.ready_pids()[("echo", 0)] == new_pid
    with Client(la.frontend, timeout=10) as c:  # the new worker serves too
        for _ in range(20):
            with c.infer("echo", {"x": np.ones(4)}) as r:
                np.testing.assert_array_equal(r["x"], np.ones(4))


def _gated_launch(tmp_path, launchers, gate, count: int = 1) -> Launcher:
    """A launcher with one pool of ``count`` workers of the gated model (service "gate", one
    request at a time each), ready."""
    la = launchers(tmp_path, f"""
        [[pool]]
        model = "gate_model:factory"
        service = "gate"
        count = {count}
        max_batch = 1
        credit = 1
        extra_args = ["--no-warmup"]
    """, env=gate.env, wait=False)
    gate.open()  # the gated model opens its FIFO as it loads
    la.wait_ready()
    la.wait_for(r"every pool is ready")
    return la


async def _four_at_the_broker(c) -> tuple[list, list]:
    """Four gated calls to "gate" (inputs, tasks), all at the broker: the MMI question asked
    after them on the same connection is answered after they were dispatched (one at the
    worker, three queued behind it)."""
    xs = [np.full(4, i, np.int32) for i in range(4)]
    calls = [asyncio.create_task(c.infer("gate", {"x": x})) for x in xs]
    while c.in_flight() < len(xs):
        await asyncio.sleep(0)
    assert await c.mmi_service("gate")
    return xs, calls


def test_sigterm_finishes_every_admitted_request_then_exits_0(tmp_path, launchers, gate):
    la = _gated_launch(tmp_path, launchers, gate)
    (pid,) = la.ready_pids().values()
    fds = pidfds([pid])

    async def scenario():
        async with AsyncClient(la.frontend, timeout=30, heartbeat_interval=0.2) as c:
            xs, calls = await _four_at_the_broker(c)
            la.p.send_signal(signal.SIGTERM)  # one at the worker, three queued behind it
            await asyncio.to_thread(la.wait_for, r"shutting down")
            with pytest.raises(ServiceUnavailable, match="shutting down"):
                await c.infer("gate", {"x": xs[0]}, timeout=10)  # new work is refused at once...
            gate.release(len(xs))  # ...while the admitted requests all finish
            results = await asyncio.wait_for(asyncio.gather(*calls), 20)
            for x, r in zip(xs, results):
                np.testing.assert_array_equal(r["x"], x)
                r.release()

    asyncio.run(scenario())
    err = la.read_all_stderr()
    assert la.p.returncode == 0, err
    assert f"pool gate worker 0 pid {pid} exited with code 0" in err, err
    wait_gone(fds, 5.0)  # its worker went with it


def test_a_stop_of_the_whole_service_at_once_answers_every_request_and_replaces_no_worker(tmp_path, launchers, gate):
    # systemd's stop (KillMode=control-group) signals the launcher and every worker at the
    # same moment.  Each worker finishes what it holds and leaves; the requests still queued
    # have no worker left and fail, typed, saying why; the launcher exits 0.  A worker that
    # left while another still ran a request got a successor, which started only to be
    # stopped, and the queued requests' message blamed a second signal nobody sent.
    la = _gated_launch(tmp_path, launchers, gate, count=2)
    pids = list(la.ready_pids().values())
    fds = pidfds(pids)

    async def scenario():
        async with AsyncClient(la.frontend, timeout=30, heartbeat_interval=0.2) as c:
            xs, calls = await _four_at_the_broker(c)  # one at each worker, two queued
            await asyncio.to_thread(gate.wait_entered, 2)
            for pid in (la.p.pid, *pids):
                os.kill(pid, signal.SIGTERM)
            queued = await asyncio.wait_for(asyncio.gather(*calls[2:], return_exceptions=True), 20)
            for e in queued:
                assert isinstance(e, ServiceUnavailable) and "shutting down" in str(e), e
                assert "a second signal stops" not in str(e), e
            mark = len(la._err)
            gate.release(1)  # one worker finishes and leaves, the other still runs its request
            await asyncio.to_thread(la.wait_for, r"pool gate worker \d pid \d+ exited with code 0", mark)
            gate.release(1)
            done = await asyncio.wait_for(asyncio.gather(*calls[:2]), 20)
            for r in done:
                r.release()

    asyncio.run(scenario())
    err = la.read_all_stderr()
    assert la.p.returncode == 0, err
    after = err[err.index("shutting down"):]
    assert "successor" not in after and " started" not in after, after
    assert after.count("exited with code 0") == 2, after
    wait_gone(fds, 5.0)


def test_a_drain_grace_given_in_extra_args_sets_the_stop_timeout(tmp_path, launchers):
    # `extra_args = ["--drain-grace-s", "60"]`: the worker waits up to 60 s for its clients to
    # release their results, but the launcher's stop timeout read only the drain_grace_s key
    # (30 s by default) and SIGKILLed it 40 s after its SIGTERM.
    la = launchers(tmp_path, """
        [[pool]]
        model = "echo"
        extra_args = ["--no-warmup", "--drain-grace-s", "60"]
    """)
    la.wait_for(r"every pool is ready")
    (pid,) = la.ready_pids().values()
    fds = pidfds([pid])
    la.p.send_signal(signal.SIGTERM)
    line = la.wait_for(r"shutting down: .*").group(0)
    assert "SIGKILL to any still there 70 s after its SIGTERM" in line, line
    err = la.read_all_stderr()
    assert la.p.returncode == 0 and f"pid {pid} exited with code 0" in err, err
    wait_gone(fds, 5.0)


def _signal_until_gone(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
    """Send `sig` every millisecond until the process exits (a supervisor that insists, or an
    operator's second Ctrl-C); its exit status."""
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        assert time.monotonic() < deadline, f"still running {timeout} s into the signals"
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass
        time.sleep(0.001)  # pacing, not waiting for anything
    return p.returncode


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_sent_again_while_a_process_exits_leave_its_exit_status_0(tmp_path, cluster, launchers, sig):
    # A second SIGTERM that came once the drain was over, while the interpreter exited (it
    # puts the default actions back), ended a worker, a broker and a launcher with -15.
    broker = cluster.broker()
    worker = cluster.worker("echo", "--no-warmup")
    assert _signal_until_gone(worker.p, sig) == 0, worker.stderr()
    assert _signal_until_gone(broker.p, sig) == 0, broker.stderr()
    la = launchers(tmp_path, """
        [[pool]]
        model = "echo"
        extra_args = ["--no-warmup"]
    """)
    la.wait_for(r"every pool is ready")
    (pid,) = la.ready_pids().values()
    fds = pidfds([pid])
    assert _signal_until_gone(la.p, sig) == 0, la.read_all_stderr()
    assert re.search(rf"pid {pid} exited with code 0\n", la.read_all_stderr()), la.read_all_stderr()
    wait_gone(fds, 5.0)


def test_a_second_sigterm_fails_the_queued_requests_as_a_shutdown_and_finishes_the_running_one(tmp_path, launchers, gate):
    # A second signal stops the workers before the admitted requests have run: those still
    # queued failed after the service grace with "its last one went ... look at its workers:
    # are they running?", as if a worker had died, while the operator had stopped them.
    la = _gated_launch(tmp_path, launchers, gate)
    (pid,) = la.ready_pids().values()
    fds = pidfds([pid])

    async def scenario():
        async with AsyncClient(la.frontend, timeout=30, heartbeat_interval=0.2) as c:
            xs, calls = await _four_at_the_broker(c)
            # The worker holds the first: the MMI answer proves only the broker's dispatch, and
            # a worker that reads a request after its SIGTERM sends it back (503).
            await asyncio.to_thread(gate.wait_entered)
            la.p.send_signal(signal.SIGTERM)
            await asyncio.to_thread(la.wait_for, r"shutting down")
            la.p.send_signal(signal.SIGTERM)
            await asyncio.to_thread(la.wait_for, r"second signal")
            queued = await asyncio.wait_for(asyncio.gather(*calls[1:], return_exceptions=True), 20)
            for e in queued:
                assert isinstance(e, ServiceUnavailable), e
                assert "shutting down" in str(e) and "are they running" not in str(e), e
            gate.release(1)  # the one the worker held still finishes: its drain is not cut
            r = await asyncio.wait_for(calls[0], 20)
            np.testing.assert_array_equal(r["x"], xs[0])
            r.release()

    asyncio.run(scenario())
    err = la.read_all_stderr()
    assert la.p.returncode == 0, err
    assert f"pool gate worker 0 pid {pid} exited with code 0" in err, err
    wait_gone(fds, 5.0)


def test_sighup_rolls_a_pool_under_traffic_and_loses_nothing(tmp_path, launchers):
    la = launchers(tmp_path, "[[pool]]\nmodel = 'echo'\ncount = 2\n")
    la.wait_for(r"every pool is ready")
    old = la.ready_pids()
    fds = pidfds(old.values())

    async def scenario():
        async with AsyncClient(la.frontend, timeout=20, heartbeat_interval=0.2) as c:
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(c, "echo", stop))

            def roll():
                mark = len(la._err)
                la.p.send_signal(signal.SIGHUP)
                la.wait_for(r"pool echo: rolling restart done", mark, timeout=40)

            await asyncio.to_thread(roll)
            stop.set()
            return await asyncio.wait_for(load, 30)

    assert asyncio.run(scenario()) > 0  # and every one of them came back with its own input
    new = la.ready_pids()
    assert sorted(new) == sorted(old) and not set(new.values()) & set(old.values()), (old, new)
    log = la._err.decode(errors="replace")
    for slot, pid in old.items():  # one at a time, each replacement READY before its old worker left
        assert log.index(f"pool echo worker {slot[1]} pid {new[slot]} ready") < \
            log.index(f"pool echo worker {slot[1]} pid {pid} exited with code 0")
    assert log.index(f"pool echo worker 0 pid {old[('echo', 0)]} exited") < \
        log.index(f"pool echo worker 1 pid {new[('echo', 1)]} started")
    wait_gone(fds, 10.0)  # the old workers drained and exited


def test_workers_exit_with_a_sigkilled_launcher(tmp_path, launchers):
    la = launchers(tmp_path, "[[pool]]\nmodel = 'echo'\ncount = 2\n")
    la.wait_for(r"every pool is ready")
    fds = pidfds(la.ready_pids().values())
    la.p.kill()  # no chance to stop anyone: the kernel's parent-death signal does it
    # Each worker drains (its loop's next pass, its threads joined, 2 s of linger for its
    # sockets): seconds, more on a loaded machine; the bound is generous.
    wait_gone(fds, 40.0)


def test_what_a_worker_leaves_in_its_process_group_goes_with_it(tmp_path, launchers):
    # A model's own process (a helper, a compile pool, a pipeline) that does not stop with its
    # worker outlived it, reparented away: one more after each crash or restart (holding
    # memory, a GPU's included), and all of them after the launcher's exit.  The launcher
    # now kills the rest of a worker's process group once the worker has exited.
    helpers = tmp_path / "helpers"
    la = launchers(tmp_path, "[[pool]]\nname = 'helper'\nmodel = 'children_model:helper'\nextra_args = ['--no-warmup']\n",
                   env={"HELPER_PIDS": str(helpers)})

    def helper_pids() -> list[int]:
        return [int(x) for x in helpers.read_text().split()] if helpers.exists() else []

    try:
        la.wait_for(r"every pool is ready")
        (first,) = helper_pids()
        worker = la.ready_pids()[("helper", 0)]
        mark = len(la._err)
        os.kill(worker, signal.SIGKILL)  # a crash: the launcher restarts it
        la.wait_for(rf"pool helper worker 0 pid {worker} exited with code -9", mark)
        wait_gone(pidfds([first]), 5.0)
        la.wait_for(r"pool helper worker 0 pid \d+ ready", mark)
        second = helper_pids()[-1]
        assert second != first and os.path.exists(f"/proc/{second}")
        fds = pidfds([second])
        assert la.terminate(30) == 0, la.read_all_stderr()  # the worker drains and exits 0
        wait_gone(fds, 5.0)
    finally:
        for pid in helper_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_stopped_worker_is_killed_as_hung_and_replaced_and_no_request_is_lost(tmp_path, launchers):
    # SIGSTOP (a frozen cgroup, a debugger, a process wedged with the GIL held): the worker
    # does not exit, so only the broker notices (it stops hearing it).  The launcher watches
    # the broker's registered workers and SIGKILLs one missing hang_timeout_s.
    la = launchers(tmp_path, "[launcher]\nhang_timeout_s = 1\n[[pool]]\nmodel = 'echo'\ncount = 2\n")
    la.wait_for(r"every pool is ready")
    victim, other = la.ready_pids()[("echo", 0)], la.ready_pids()[("echo", 1)]

    async def scenario():
        async with AsyncClient(la.frontend, timeout=20, heartbeat_interval=0.2) as c:
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(c, "echo", stop))

            def stop_and_wait():
                mark = len(la._err)
                os.kill(victim, signal.SIGSTOP)
                la.wait_for(r"pool echo worker 0 not registered with the broker for [\d.]+ s .*: SIGKILL", mark)
                la.wait_for(rf"pool echo worker 0 pid {victim} exited with code -9; restarting it in", mark)
                return la.wait_for(r"pool echo worker 0 pid (\d+) ready", mark)

            try:
                m = await asyncio.to_thread(stop_and_wait)  # the load runs on meanwhile
            finally:
                stop.set()
            return int(m.group(1)), await asyncio.wait_for(load, 30)

    try:
        new_pid, served = asyncio.run(scenario())
    finally:
        try:
            os.kill(victim, signal.SIGCONT)  # (if the test failed before the SIGKILL)
        except ProcessLookupError:
            pass
    assert new_pid != victim and served > 0
    # The worker the broker kept listing was left alone, the whole time.
    assert la.ready_pids() == {("echo", 0): new_pid, ("echo", 1): other}
    assert "worker 1 not registered" not in la._err.decode(errors="replace")
    with Client(la.frontend, timeout=10) as c:
        for _ in range(20):
            with c.infer("echo", {"x": np.ones(4)}) as r:
                np.testing.assert_array_equal(r["x"], np.ones(4))


def test_a_worker_stopped_by_someone_else_leaves_on_its_own_and_its_successor_starts(tmp_path, launchers):
    # An operator's SIGTERM to one worker: it finishes, says goodbye to the broker and waits
    # (its drain grace) for a client to release a result it still reads.  Not registered
    # meanwhile, but not hung: the launcher starts its successor and lets it leave.
    la = launchers(tmp_path, "[launcher]\nhang_timeout_s = 1\n[[pool]]\nmodel = 'bench_models:fixed'\n"
                             "service = 'fixed'\ndrain_grace_s = 20\n", env={"FIXED_MS": "0"})
    la.wait_for(r"every pool is ready")
    old = la.ready_pids()[("fixed", 0)]
    fds = pidfds([old])
    x = np.arange(1 << 16, dtype=np.uint8)
    with Client(la.frontend, timeout=20) as c:
        held = c.infer("fixed", {"x": x})  # its output lives in the worker's ring: the drain waits for it
        mark = len(la._err)
        os.kill(old, signal.SIGTERM)
        la.wait_for(r"pool fixed worker 0 is leaving on its own", mark)
        m = la.wait_for(r"pool fixed worker 0 pid (\d+) ready", mark)
        new = int(m.group(1))
        assert new != old
        with pytest.raises(TimeoutError):  # nobody is killed as hung (the watch lists every second)
            la.wait_for(r"not registered with the broker", mark, timeout=2.5)
        with c.infer("fixed", {"x": x}) as r:  # the successor serves
            np.testing.assert_array_equal(r["x"], x)
        np.testing.assert_array_equal(held["x"], x)  # still readable: the old worker kept its ring
        held.release()
        wait_gone(fds, 20.0)
    la.wait_for(rf"pool fixed worker 0 pid {old} exited with code 0", mark)
    log = la._err.decode(errors="replace")
    assert "restarting it in" not in log[mark:] and la.ready_pids()[("fixed", 0)] == new


def test_an_idle_worker_stopped_by_someone_else_is_replaced_at_once_not_as_a_crash(tmp_path, launchers):
    # Idle, it drains and exits 0 before the broker's list of goodbyes is read: that exit
    # was counted a crash (restarted after 0.5, 1, 2, 4 s... "crash N in a row").
    la = launchers(tmp_path, "[[pool]]\nmodel = 'echo'\n")
    la.wait_for(r"every pool is ready")
    for _ in range(3):
        old = la.ready_pids()[("echo", 0)]
        # It serves a while first (a span measured, not a synchronisation): one that exits 0
        # within a second of its READY, again and again, is a crash loop and backs off.
        fd = la.p.stderr.fileno()
        with Client(la.frontend, timeout=10) as c:
            served = time.monotonic()
            while time.monotonic() - served < 1.2:
                with c.infer("echo", {"x": np.ones(4)}):
                    pass
                while select.select([fd], [], [], 0)[0]:  # its INFO lines: a full pipe would stall it
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    la._err += chunk
        mark = len(la._err)
        os.kill(old, signal.SIGTERM)
        la.wait_for(rf"pool echo worker 0 pid {old} exited with code 0", mark)
        m = la.wait_for(r"pool echo worker 0 pid (\d+) ready", mark)
        assert int(m.group(1)) != old
        log = la._err.decode(errors="replace")[mark:]
        assert "restarting it in" not in log and "crash" not in log, log
    with Client(la.frontend, timeout=10) as c:
        with c.infer("echo", {"x": np.ones(4)}) as r:
            np.testing.assert_array_equal(r["x"], np.ones(4))


def test_a_stop_of_the_whole_launch_ctrl_z_then_fg_kills_and_restarts_nothing(tmp_path, launchers):
    # Ctrl-Z in the terminal stops the launcher's process group: the broker (in the launcher)
    # and every worker at once, for as long as the operator takes to type `fg`.  At the
    # thaw each side found the other silent past its liveness window: a worker reconnected
    # and the broker presumed it dead (the launcher's hang watch could follow).
    la = launchers(tmp_path, "[launcher]\nhang_timeout_s = 1\n[[pool]]\nmodel = 'echo'\ncount = 2\n")
    la.wait_for(r"every pool is ready")
    pids = [la.p.pid, *la.ready_pids().values()]
    mark = len(la._err)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(2.5)  # the stimulus: stopped past every liveness window (0.6 s) and the hang watch's
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    la.wait_for(r"the broker did not run for [\d.]+ s", mark)
    with Client(la.frontend, timeout=10) as c:
        for _ in range(20):
            with c.infer("echo", {"x": np.ones(4)}) as r:
                np.testing.assert_array_equal(r["x"], np.ones(4))
    log = la._err.decode(errors="replace")[mark:]
    for bad in ("presumed dead", "reconnecting", "SIGKILL", "restarting", "not registered"):
        assert bad not in log, log
    assert set(la.ready_pids().values()) == set(pids[1:])  # the same two workers


def test_sighup_to_a_broker_without_pools_or_to_a_worker_is_said_and_ignored(cluster):
    # SIGHUP rolls a launcher's pools; sent to a plain broker or a worker (the wrong pid, a
    # closed terminal) its default action ended the process at once: no drain, requests lost.
    broker = cluster.broker()
    worker = cluster.worker("echo")
    for proc in (broker, worker):
        proc.p.send_signal(signal.SIGHUP)
        proc.wait_log("WARNING SIGHUP ignored")
    with Client(cluster.frontend, timeout=10) as c:
        with c.infer("echo", {"x": np.ones(4)}) as r:
            np.testing.assert_array_equal(r["x"], np.ones(4))
    assert broker.p.poll() is None and worker.p.poll() is None


def test_a_stderr_nobody_reads_stalls_nothing_and_the_exit(tmp_path, launchers):
    # At INFO the broker logs a line per request, and forwards its workers' lines.  With its
    # stderr a pipe that nobody read (a paused terminal, a stalled log collector), the first
    # 64 KiB filled it and the broker's loop blocked in a write, with every request behind
    # it.  Lines now go out through a thread of their own (dropped and counted once too many
    # wait), and a SIGTERM still ends it all in bounded time.
    launcher = launchers(tmp_path, '[[pool]]\nmodel = "echo"\ncount = 1\n')
    x = np.arange(4, dtype=np.float32)
    with Client(launcher.frontend, timeout=10) as c:  # stderr is not read from here on
        for _ in range(3000):  # well over a pipe's worth of log lines
            with c.infer("echo", {"x": x}) as r:
                assert r["x"][3] == 3.0
    launcher.p.send_signal(signal.SIGTERM)
    assert launcher.p.wait(30) == 0
    # What it wrote before the pipe filled (the rest was dropped, or given up on at exit).
    assert "broker INFO request dispatched" in launcher.read_all_stderr()


# ------------------------------------------------------------------------- resource limits


def _pids_root() -> str | None:
    """Where a pids cgroup can be made: the cgroup v1 `pids` hierarchy, or a cgroup v2 one
    whose root hands the pids controller to its children."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1:4] for line in f]
    for where, kind, opts in mounts:
        if kind == "cgroup" and "pids" in opts.split(","):
            return where
    for where, kind, _ in mounts:
        try:
            with open(f"{where}/cgroup.subtree_control") as f:
                if kind == "cgroup2" and "pids" in f.read().split():
                    return where
        except OSError:
            pass
    return None


@pytest.fixture
def pids_cgroup():
    """A new pids cgroup (its pids.max `max`), removed at the end once its processes are
    gone; skips without root or a pids controller.  Request it before `launchers`, so that
    the launchers are stopped first."""
    root = _pids_root()
    if os.geteuid() != 0 or root is None:
        pytest.skip("needs root and a cgroup pids controller (v1, or v2 enabled for the root's children)")
    path = f"{root}/zinf-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot make a pids cgroup in {root}: {e}")
    try:
        yield path
    finally:
        with open(f"{path}/pids.max", "w") as f:
            f.write("max")
        with open(f"{path}/cgroup.procs") as f:
            left = [int(p) for p in f.read().split()]
        fds = {}
        for pid in left:  # (only if the test failed before the launcher could stop them)
            try:
                fds[pid] = os.pidfd_open(pid)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(fds, 20.0)
        os.rmdir(path)
        assert not left, f"processes left in the cgroup after the launcher's exit: {left}"


def _children(pid: int) -> dict[int, str]:
    """{pid: state} of every child of `pid` (a zombie's state is Z)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out[int(name)] = fields[0]
    return out


def test_a_restart_that_cannot_start_its_threads_is_retried_and_stops_nothing_else(tmp_path, pids_cgroup, launchers):
    # The launcher in a pids cgroup at its limit: a crashed worker's restart forked, then the
    # launcher could not start the thread that reads the new worker's output (RuntimeError,
    # not the OSError of a fork refused): the supervisor failed, every worker of both pools was
    # stopped and the launcher exited 1, seconds before the limit was lifted.  Now that start
    # fails alone: its child is killed and reaped, and it is retried after the backoff (1 s:
    # the time the test has to set the limit, a few file writes, and waits out twice).
    la = launchers(tmp_path, "[launcher]\nrestart_backoff_s = 1\nrestart_backoff_max_s = 1\n"
                   + textwrap.dedent(TWO_POOLS),
                   prefix=["sh", "-c", f'echo $$ > {pids_cgroup}/cgroup.procs && exec "$@"', "sh"])
    la.wait_for(r"every pool is ready")
    before = la.ready_pids()
    victim = before[("echo", 0)]
    others = {slot: pid for slot, pid in before.items() if slot != ("echo", 0)}
    assert set(_children(la.p.pid)) == set(before.values())
    mark = len(la._err)
    os.kill(victim, signal.SIGKILL)
    la.wait_for(rf"pool echo worker 0 pid {victim} exited with code -9; restarting it in 1 s", mark)
    # Reaped: room for one more task than there are now (its restart forks, and no more).
    with open(f"{pids_cgroup}/pids.current") as f:
        limit = int(f.read()) + 1
    try:
        with open(f"{pids_cgroup}/pids.max", "w") as f:
            f.write(str(limit))
        m = la.wait_for(r"pool echo worker 0 pid (\d+)"
                        r"(: cannot start python -m gpu_worker: .*\(its process was killed\)| ready)", mark)
        assert m.group(2) != " ready", "the restart came before the limit was set (1 s of backoff)"
        failed = int(m.group(1))
        # Killed and reaped before that line: the launcher's children are the other workers,
        # none a zombie; every other worker runs on.
        kids = _children(la.p.pid)
        assert set(kids) == set(others.values()) and "Z" not in kids.values(), kids
        assert not os.path.exists(f"/proc/{failed}")
        la.wait_for(r"pool echo worker 0 exited with code 127; restarting it in 1 s", mark)
    finally:
        with open(f"{pids_cgroup}/pids.max", "w") as f:
            f.write("max")
    m = la.wait_for(r"pool echo worker 0 pid (\d+) ready", mark, timeout=30)
    assert int(m.group(1)) not in (victim, failed)
    log = la._err.decode(errors="replace")[mark:]
    assert "supervisor failed" not in log and "told to stop" not in log, log
    assert {slot: pid for slot, pid in la.ready_pids().items() if slot != ("echo", 0)} == others
    assert la.p.poll() is None
    with Client(la.frontend, timeout=10) as c:  # both pools serve
        for service in ("echo", "echo2"):
            with c.infer(service, {"x": np.ones(4)}) as r:
                np.testing.assert_array_equal(r["x"], np.ones(4))
    la.p.send_signal(signal.SIGTERM)
    assert la.p.wait(60) == 0
