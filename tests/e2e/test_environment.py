"""The broker and the worker under hosts as operators have them (found by the environment
hunt): a terminal that hung up (SIGHUP with a dead stderr), stderr closed, stdout that takes
nothing, a runtime directory on a read-only file system, a worker in a time namespace with a
boottime offset.  Real processes; every wait bounded."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from client_sdk import Client
from client_sdk.errors import InvalidInput, WorkerFailed

from .conftest import HERE, ROOT, Proc, wait_service

pytestmark = pytest.mark.timeout(120)


def _env(tmp_path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), "XDG_RUNTIME_DIR": str(tmp_path)}


def _started(args, tmp_path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(tmp_path), **kw)


def _stop(p: subprocess.Popen) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait(10)


def _serving(frontend: str, service: str | None = None) -> None:
    with Client(frontend, timeout=20) as c:
        if service is None:
            c.mmi_service("anything")  # answered: the broker's loop runs
        else:
            wait_service(c, service)
            with c.infer(service, {"x": np.arange(4, dtype=np.float32)}) as r:
                np.testing.assert_array_equal(r["x"], np.arange(4, dtype=np.float32))


def test_sighup_with_a_dead_stderr_and_a_closed_stderr_are_survived(tmp_path):
    # A SIGHUP comes when the terminal hung up: its handler's write to the dead stderr raised
    # into the main loop (exit 1, no drain); with stderr closed (2>&-) faulthandler raised
    # and the process exited 1 at once.
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    with open("/dev/full", "w") as full:
        broker = _started(["-m", "broker", "--frontend", fe, "--backend", be, "--heartbeat-interval", "0.2"],
                          tmp_path, stderr=full, stdout=subprocess.DEVNULL)
        worker = _started(["-m", "gpu_worker", "--broker", be, "--heartbeat-interval", "0.2"], tmp_path,
                          stderr=full, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(2))
    try:
        _serving(fe, "echo")
        broker.send_signal(signal.SIGHUP)
        worker.send_signal(signal.SIGHUP)
        _serving(fe, "echo")
        assert broker.poll() is None and worker.poll() is None
    finally:
        assert _stop(worker) == 0
        assert _stop(broker) == 0


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full (of empty lines): nothing more can be written until its
    reader reads, as with a log collector that stalled."""
    r, w = os.pipe()
    flags = fcntl.fcntl(w, fcntl.F_GETFL)
    fcntl.fcntl(w, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(w, b"\n" * 4096)
    except BlockingIOError:
        pass
    fcntl.fcntl(w, fcntl.F_SETFL, flags)  # the processes get it blocking, as a shell gives it
    return r, w


def test_sighup_with_a_stderr_nobody_reads_stalls_nothing(tmp_path):
    # The SIGHUP handler wrote its "ignored" line to descriptor 2 itself: with stderr a pipe
    # nobody read (a stalled log collector), the write blocked the main thread for good.  The
    # broker served nothing more and ignored SIGTERM (its workers reconnected in a loop); the
    # worker went silent and was presumed dead.  The line now goes through the log's writer
    # thread, as a log line (one JSON object with --log-format json).
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    r, w = _full_pipe()
    got = bytearray()
    try:
        broker = _started(["-m", "broker", "--frontend", fe, "--backend", be, "--heartbeat-interval", "0.2",
                           "--log-format", "json"], tmp_path, stderr=w, stdout=subprocess.DEVNULL)
        worker = _started(["-m", "gpu_worker", "--broker", be, "--heartbeat-interval", "0.2", "--log-format", "json"],
                          tmp_path, stderr=w, stdout=subprocess.DEVNULL)
        os.close(w)
        w = -1
        try:
            with Client(fe, timeout=5) as c:
                wait_service(c, "echo")
                broker.send_signal(signal.SIGHUP)
                worker.send_signal(signal.SIGHUP)
                for _ in range(3):  # past the worker's liveness (0.6 s) and the broker's
                    with c.infer("echo", {"x": np.arange(4, dtype=np.float32)}, timeout=1.5) as res:
                        np.testing.assert_array_equal(res["x"], np.arange(4, dtype=np.float32))
                    t = time.monotonic() + 0.5
                    while time.monotonic() < t:
                        c.mmi_service("echo")  # a request a few times a second for half a second
            assert broker.poll() is None and worker.poll() is None
        finally:
            # The collector catches up (until both processes exit: EOF), so that the exits
            # need not wait out their lines' FLUSH_S.
            def collect() -> None:
                for chunk in iter(lambda: os.read(r, 65536), b""):
                    got.extend(chunk)

            reader = threading.Thread(target=collect, daemon=True)
            reader.start()
            assert _stop(worker) == 0
            assert _stop(broker) == 0
            reader.join(10)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    said = [json.loads(line) for line in got.decode(errors="replace").splitlines() if "SIGHUP ignored" in line]
    assert sorted(d["process"] for d in said) == ["broker", "worker"], got[-3000:]
    assert all(d["level"] == "WARNING" for d in said), said


def test_an_ipc_path_that_is_not_utf8_is_one_line_for_each_process(tmp_path):
    # A directory named in Latin-1 (or any non-ASCII name under PYTHONUTF8=0 LC_ALL=C): the
    # interpreter hands such bytes on as lone surrogates, which pyzmq cannot encode.  The
    # broker said only "'utf-8' codec can't encode character '\\udce9' in position N", the
    # worker exited 1 with a traceback, and a client's connect raised UnicodeEncodeError.
    d = os.fsencode(tmp_path) + b"/caf\xe9"
    os.mkdir(d)
    d_text = os.fsdecode(d)
    fe, be = f"ipc://{d_text}/fe.ipc", f"ipc://{d_text}/be.ipc"
    for args in (["-m", "broker", "--frontend", fe, "--backend", f"ipc://{tmp_path}/be.ipc"],
                 ["-m", "gpu_worker", "--broker", be]):
        p = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                           timeout=60)
        err = p.stderr.decode(errors="replace")
        assert p.returncode == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "caf\\xe9/" in err and "not UTF-8" in err, err
    p = subprocess.run([sys.executable, "-m", "broker"], cwd=ROOT, env={**_env(tmp_path), "XDG_RUNTIME_DIR": d_text},
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"not UTF-8" in p.stderr and b"Traceback" not in p.stderr, p.stderr
    with pytest.raises(InvalidInput, match="not UTF-8"):
        Client(fe)
    assert sorted(os.listdir(d)) in ([], [b"zmq-infer-%d" % os.getuid()])  # no socket file made


def test_sigusr1_and_sigusr2_are_said_and_ignored(cluster):
    # A logrotate postrotate `kill -USR1` (or an operator after a stack dump): the default
    # action ended the broker or the worker at once, no drain, nothing on stderr (exit -10).
    broker = cluster.broker()
    worker = cluster.worker("echo")
    for proc in (broker, worker):
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            proc.p.send_signal(sig)
            proc.wait_log(f"WARNING {sig.name} ignored")
    _serving(cluster.frontend, "echo")
    assert worker.terminate() == 0 and broker.terminate() == 0


def test_a_crash_with_a_stderr_nobody_reads_still_ends_the_worker(tmp_path):
    # faulthandler writes every thread's stack from the fatal signal's handler, and only then
    # lets the signal end the process.  To a stderr pipe nobody read, that write blocked for
    # good: the crashed worker never exited (its supervisor or restart policy saw nothing to
    # restart).  It now writes through a non-blocking description of the pipe.
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    broker = _started(["-m", "broker", "--frontend", fe, "--backend", be, "--heartbeat-interval", "0.2",
                       "--max-retries", "0"], tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r, w = _full_pipe()
    try:
        worker = _started(["-m", "gpu_worker", "--broker", be, "--model", "faulty_model:batched", "--service",
                           "batched", "--heartbeat-interval", "0.2"], tmp_path, stdout=subprocess.DEVNULL, stderr=w)
        os.close(w)
        w = -1
        try:
            with Client(fe, timeout=20) as c:
                wait_service(c, "batched")
                with pytest.raises(WorkerFailed):
                    c.infer("batched", {"x": np.zeros(4, np.float32)}, meta={"do": "segv"})
            assert worker.wait(10) == -signal.SIGSEGV
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        assert _stop(broker) == 0


def test_a_service_name_that_is_not_utf8_is_called_so(tmp_path):
    # `--service` with a byte that is not UTF-8 (typed in Latin-1, or any non-ASCII name
    # under PYTHONUTF8=0 LC_ALL=C) arrives as a lone surrogate: the worker said the name
    # had "whitespace or control characters".
    p = subprocess.run([os.fsencode(sys.executable), b"-m", b"gpu_worker", b"--broker",
                        os.fsencode(f"ipc://{tmp_path}/be.ipc"), b"--service", b"caf\xe9"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, timeout=60)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "not UTF-8" in err and "whitespace" not in err, err


_CAFE = """
import numpy as np

def factory(device="cpu"):
    def run(batch, meta):
        return {"y": batch["x"] + 1}
    run.name = "caf\\u00e9"
    run.example_inputs = lambda: {"x": np.ones(4, np.float32)}
    return run
"""


def test_ready_lines_are_utf8_under_an_ascii_locale(tmp_path):
    # A model named in UTF-8 (here "café") under a locale that is not UTF-8 (PYTHONUTF8=0
    # LC_ALL=C: stdout is ASCII): the worker's READY line could not be encoded, only a
    # WARNING came out, and its launcher waited for READY until its ready timeout, killed it
    # as hung and gave the launch up.  READY lines are now written in UTF-8 whatever the locale.
    (tmp_path / "cafe_model.py").write_text(_CAFE)
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    (tmp_path / "deploy.toml").write_text(
        f'frontend = "{fe}"\nbackend = "{be}"\n[scheduler]\nheartbeat_interval = 0.2\n'
        f'[launcher]\nready_timeout_s = 20\n[[pool]]\nmodel = "cafe_model:factory"\ncount = 1\ndevice = "cpu"\n')
    env = {"PYTHONUTF8": "0", "LC_ALL": "C", "XDG_RUNTIME_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE), str(ROOT)])}
    la = Proc(["-m", "broker", "--config", str(tmp_path / "deploy.toml")], env=env)
    try:
        assert la.wait_ready(30).endswith("workers=1")
        with Client(fe, timeout=20) as c:
            with c.infer("caf\u00e9", {"x": np.zeros(4, np.float32)}) as r:
                np.testing.assert_array_equal(r["y"], np.ones(4, np.float32))
        assert la.terminate() == 0
    finally:
        la.close()


def test_pool_flags_an_ascii_locale_cannot_pass_are_one_line(tmp_path):
    # `service = "café"` in a deploy file, the launcher under PYTHONUTF8=0 LC_ALL=C: every
    # start of the worker was a traceback (the argument could not be encoded), then "exited
    # with code 127 before it was ready: (it wrote nothing on stderr)", and exit 1.
    (tmp_path / "deploy.toml").write_text(
        f'frontend = "ipc://{tmp_path}/fe.ipc"\nbackend = "ipc://{tmp_path}/be.ipc"\n'
        '[[pool]]\nmodel = "echo"\nservice = "caf\u00e9"\ncount = 1\ndevice = "cpu"\n', encoding="utf-8")
    p = subprocess.run([sys.executable, "-m", "broker", "--config", str(tmp_path / "deploy.toml")], cwd=ROOT,
                       env={**_env(tmp_path), "PYTHONUTF8": "0", "LC_ALL": "C"}, capture_output=True, timeout=60)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot be passed to a process under this locale" in err and "UTF-8 locale" in err, err
    assert not (tmp_path / "fe.ipc").exists()  # refused before anything was bound


def test_a_ready_line_that_stdout_cannot_take_is_a_warning(tmp_path):
    # stdout /dev/full (or a pipe nobody reads any more): the broker died at its READY line.
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    with open("/dev/full", "w") as full:
        broker = _started(["-m", "broker", "--frontend", fe, "--backend", be], tmp_path, stdout=full,
                          stderr=subprocess.PIPE)
    try:
        _serving(fe)
        assert broker.poll() is None
    finally:
        assert _stop(broker) == 0
    assert b"could not print" in broker.stderr.read()


def test_a_runtime_directory_on_a_read_only_file_system_is_one_line(tmp_path):
    # EROFS (and ENOSPC) were tracebacks and exit 1, for the broker and the worker alike.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a private mount namespace)")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && mount -o remount,ro {mnt} && "
              f"XDG_RUNTIME_DIR={mnt} {sys.executable} -m broker; echo rc=$?; "
              f"XDG_RUNTIME_DIR={mnt} {sys.executable} -m gpu_worker --device cpu; echo rc=$?")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=90)
    if "rc=" not in p.stdout:
        pytest.skip(f"no private mount namespace here: {p.stderr[-300:]}")
    assert p.stdout.count("rc=2") == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    for who in ("python -m broker:", "python -m gpu_worker:"):
        assert f"{who} cannot make the runtime directory" in p.stderr and "Read-only file system" in p.stderr


def test_start_times_read_the_same_from_a_time_namespace(tmp_path):
    # The kernel adds the reader's boottime offset to /proc/<pid>/stat's start time: a worker
    # in such a namespace took every live client for dead and lent its output slots again
    # while it held its results (their data changed under it).
    from shm.segment import proc_starttime

    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    code = "import sys; from shm.segment import proc_starttime; print(proc_starttime(int(sys.argv[1])))"
    pid = os.getpid()
    p = subprocess.run(["unshare", "-T", "--boottime", "100000", sys.executable, "-c", code, str(pid)], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        pytest.skip(f"no time namespace here: {p.stderr[-300:]}")
    assert int(p.stdout) == proc_starttime(pid)
    # and the clock the broker compares them with
    code = "from broker.server import _boot_ticks; print(_boot_ticks())"
    t0 = time.clock_gettime(time.CLOCK_BOOTTIME)
    p = subprocess.run(["unshare", "-T", "--boottime", "100000", sys.executable, "-c", code], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    t1 = time.clock_gettime(time.CLOCK_BOOTTIME)
    tck = os.sysconf("SC_CLK_TCK")
    assert int(t0 * tck) - 1 <= int(p.stdout) <= int(t1 * tck) + 1, (p.stdout, t0, t1)



def test_a_worker_in_a_pid_namespace_of_its_own_is_served_inline(cluster):
    # A worker in its own pid namespace (a container without `--pid` shared) but the same
    # /dev/shm and runtime directory was taken as local: it cannot open a client's memfd by
    # the client's pid, so shared-memory requests failed ("segment does not exist", a 400
    # "this is a bug").  Its host identity now names its pid namespace: the broker answers
    # NOT_LOCAL to shared-memory requests for it and the client resends them inline.
    probe = subprocess.run([sys.executable, str(HERE / "own_pidns.py"), "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode(errors='replace').strip()}")
    cluster.broker()
    w = cluster.worker("echo", prefix=[sys.executable, str(HERE / "own_pidns.py")])
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        for n in (16, 1 << 20):  # inline-sized and slot-sized
            x = np.arange(n, dtype=np.uint8)
            with c.infer("echo", {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)
    assert w.p.poll() is None
    assert w.terminate() == 0, w.stderr()
