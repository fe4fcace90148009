"""Where the broker binds: an ipc socket file a dead broker left is replaced, one a running
process serves is not taken from it (broker.server._ipc_served), and the descriptor limit a
broker and a worker raise at start (broker.protocol.limits)."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from broker.server import _ipc_served

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_a_stale_socket_file_is_not_served(tmp_path):
    path = str(tmp_path / "stale.ipc")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the file stays, nobody listens: what a SIGKILLed broker leaves
    assert os.path.exists(path) and not _ipc_served(path)
    assert not _ipc_served(str(tmp_path / "gone.ipc"))


def test_a_listener_is_served_even_with_its_backlog_full(tmp_path):
    path = str(tmp_path / "live.ipc")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(0)
    pending = []
    try:
        assert _ipc_served(path)
        # A stopped broker whose clients keep reconnecting: connects fail with EAGAIN at
        # once.  That is still a running process's socket.
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            pending.append(c)
        else:
            pytest.skip("the backlog never filled")
        assert _ipc_served(path)
    finally:
        for c in pending:
            c.close()
        lst.close()


def _lowered(soft: int):
    def pre() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
    return pre


def _soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise KeyError("Max open files")


def test_the_broker_raises_its_descriptor_limit_to_the_hard_one(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "broker", "--frontend", f"ipc://{tmp_path}/fe.ipc",
                          "--backend", f"ipc://{tmp_path}/be.ipc"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=_lowered(256))
    try:
        line = p.stdout.readline()  # READY (the broker starts in well under the test's timeout)
        assert line.startswith(b"READY"), p.stderr.read() if p.poll() is not None else line
        assert _soft_limit(p.pid) == want
    finally:
        p.terminate()
        assert p.wait(30) == 0
        p.stdout.close()
        p.stderr.close()


def test_raise_nofile_limit_in_a_child():
    code = "from broker.protocol.limits import raise_nofile_limit; print(*raise_nofile_limit())"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       preexec_fn=_lowered(256))
    soft, hard = map(int, r.stdout.split())
    assert soft == (min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20)
