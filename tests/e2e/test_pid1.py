"""Our processes as pid 1 of a pid namespace, as a container runs its command (Kubernetes
without a shared pid namespace, `docker run` without `--init`): tests/e2e/own_pidns.py makes
the namespace and forwards SIGTERM and SIGINT to its pid 1, as a runtime's stop does.

The kernel discards a signal whose action is the default one when it is sent to pid 1, and
hands pid 1 every orphan of the namespace to reap.  `python -m broker` and `python -m
gpu_worker` there put a small init in front of themselves (broker/protocol/pid1.py).  Linux
and root only (the namespace); skipped elsewhere.  Every wait polls a condition with a
deadline."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import HERE, Proc
from .test_launcher import launchers  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0
OWN_PIDNS = [sys.executable, str(HERE / "own_pidns.py")]


@pytest.fixture(scope="module", autouse=True)
def _pidns():
    probe = subprocess.run([*OWN_PIDNS, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode(errors='replace').strip()}")


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    comm = data[data.index(b"(") + 1:data.rindex(b")")].decode(errors="replace")
    rest = data[data.rindex(b")") + 2:].split()
    return comm, rest[0].decode(), int(rest[1])


def _tree(root: int) -> dict[int, tuple[str, str, int]]:
    """Every process under `root` (zombies included): {pid: (comm, state, ppid)}."""
    procs = {int(n): s for n in os.listdir("/proc") if n.isdigit() and (s := _stat(int(n))) is not None}
    out: dict[int, tuple[str, str, int]] = {}
    frontier = {root}
    while frontier:
        frontier = {p for p, s in procs.items() if s[2] in frontier and p not in out}
        out.update({p: procs[p] for p in frontier})
    return out


def _kill_namespace(p: Proc) -> None:
    """SIGKILL the namespace's pid 1 (the kernel then kills the rest of it), then own_pidns:
    killing own_pidns alone would leave the namespace running, reparented away."""
    for pid, (_, _, ppid) in _tree(p.p.pid).items():
        if ppid == p.p.pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    p.kill()


def _until_no_sleeps(p: Proc) -> None:
    """Until the orphans of `children_model:orphans` (three `sleep 0.2`) have ended and were
    reaped: no `sleep` left in the namespace, running or a zombie."""
    deadline = time.monotonic() + WAIT
    while sleeps := {pid: s for pid, s in _tree(p.p.pid).items() if s[0] == "sleep"}:
        assert time.monotonic() < deadline, (
            f"orphans never reaped by pid 1 of the namespace: {sleeps} (pid, (comm, state, parent); Z: a zombie)")
        time.sleep(0.02)  # polling /proc (a condition, not a delay)


def test_a_worker_as_pid_1_ends_on_sigterm_while_it_loads_its_model(tmp_path):
    # A worker still loading its model leaves SIGTERM at its default action (nothing to
    # drain yet): as pid 1 the kernel discarded it, and `docker stop` or a pod's deletion
    # waited for the SIGKILL at the end of the grace period (45 s in deploy/k8s).
    loading = tmp_path / "loading"
    w = Proc(["-m", "gpu_worker", "--broker", f"ipc://{tmp_path}/be.ipc", "--model", "loading_model:factory",
              "--out-capacity-mb", "16"], prefix=OWN_PIDNS,
             env={"LOADING_FILE": str(loading), "LOADING_RELEASE": str(tmp_path / "never")})
    try:
        deadline = time.monotonic() + WAIT
        while not loading.exists():
            assert time.monotonic() < deadline and w.p.poll() is None, f"never began to load: {w.stderr()}"
            time.sleep(0.01)  # polling a file (a condition, not a delay)
        w.p.send_signal(signal.SIGTERM)  # own_pidns passes it to the namespace's pid 1
        try:
            code = w.p.wait(WAIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a worker as pid 1 loading its model still runs {WAIT} s after SIGTERM")
        assert code == 128 + signal.SIGTERM, w.stderr()  # as a runtime reports a process SIGTERM ended
        assert "Traceback" not in w.stderr(None), w.stderr()
    finally:
        _kill_namespace(w)
        w.close()


def test_a_worker_as_pid_1_reaps_its_models_orphans_and_drains_on_sigterm(tmp_path):
    w = Proc(["-m", "gpu_worker", "--broker", f"ipc://{tmp_path}/be.ipc", "--model", "children_model:orphans",
              "--out-capacity-mb", "16", "--heartbeat-interval", "0.2"], prefix=OWN_PIDNS)
    try:
        w.wait_ready()  # (no broker: READY after two heartbeat intervals)
        _until_no_sleeps(w)
        assert w.terminate(WAIT) == 0, w.stderr()
    finally:
        _kill_namespace(w)
        w.close()


def test_a_launcher_as_pid_1_reaps_its_workers_orphans_and_stops_on_sigterm(tmp_path, launchers):  # noqa: F811
    # The workers' orphans (a model's subprocesses whose parent exited) come to the
    # namespace's pid 1, the launcher, which reaped only the workers it started: zombies,
    # one more for every such orphan for as long as it ran.
    la = launchers(tmp_path, """
        [[pool]]
        model = "children_model:orphans"
        count = 2
    """, prefix=OWN_PIDNS)
    try:
        la.wait_for(r"every pool is ready")
        _until_no_sleeps(la)
        assert la.terminate(WAIT * 2) == 0, la.read_all_stderr()
        assert "exited with code 0" in la.read_all_stderr()
    finally:
        _kill_namespace(la)
