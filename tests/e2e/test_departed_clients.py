"""What a worker keeps of clients that are gone (docs/shm.md, "Who cleans up"): nothing.

- A client killed with SIGKILL never marks its segment closed; the worker's mapping of it
  would keep its memory (and its pid's name) for as long as 64 other segments did not
  push it out.  The worker's housekeeping (every heartbeat interval) drops it.
- Every client that was lent an output slot leaves the worker a pidfd (how the worker
  tells that the holder of a slot is still the same process).  A client that releases its
  outputs and leaves is never asked about again: the worker closes those of processes
  that exited, so its descriptors stay bounded by the clients alive, not by every client
  it ever served.

Real processes (broker, worker, clients), ipc endpoints; every wait is a poll with a deadline.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.children import readline_within

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

# A client process: one request whose input (1 MiB) goes by reference; prints its pid once
# the reply is in, then waits to be killed (or, with "leave", closes and exits).
CLIENT = r"""
import sys, time
import numpy as np
from client_sdk import Client
fe, service, mode = sys.argv[1:4]
c = Client(fe, timeout=20)
x = np.full(1 << 20, 7, np.uint8)
out = c.infer(service, {"x": x})
assert int(out["x"][0]) == 7 and out["x"].shape == x.shape
print("DONE", flush=True)
if mode == "leave":
    del out
    c.close()
    sys.exit(0)
time.sleep(60)
"""


def _client(fe: str, service: str, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", CLIENT, fe, service, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = readline_within(p.stdout, 60, "the client's DONE (its request's own timeout is 20 s)")
        assert line.strip() == "DONE", (line, p.stderr.read() if p.poll() is not None else "")
    except BaseException:
        p.kill()
        p.wait(10)
        raise
    return p


def _maps_naming(pid: int, owner: int) -> list[str]:
    """The worker's mappings of memfds that process `owner` created."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if f"/memfd:zinf-{owner}-" in line]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_kinds(pid: int) -> dict[str, int]:
    """What the descriptors of `pid` are, counted by kind (for a failure's message)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target if target.startswith("anon_inode") else target.split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {timeout} s")
        time.sleep(0.05)


def test_a_sigkilled_clients_segment_is_let_go_by_the_worker(cluster):
    cluster.broker()
    w = cluster.worker("echo")
    wpid = w.p.pid
    c = _client(cluster.frontend, "echo", "stay")
    try:
        assert _maps_naming(wpid, c.pid), "the worker read the input in place, from the client's segment"
        c.kill()
        c.wait(10)
        # Its housekeeping runs every heartbeat interval (0.2 s here).
        _until(lambda: not _maps_naming(wpid, c.pid), 10, "the worker still maps the dead client's segment")
    finally:
        if c.poll() is None:
            c.kill()
        c.wait(10)
        for f in (c.stdout, c.stderr):
            f.close()
    # And it still serves.
    _client(cluster.frontend, "echo", "leave").wait(20)


def test_a_worker_keeps_no_descriptor_for_clients_that_left(cluster):
    cluster.broker()
    # `copy` returns a new array: each 1 MiB reply is a slot of the worker's output ring,
    # lent to the client's pid.
    w = cluster.worker("bench.inline_crossover:make_copy")
    wpid = w.p.pid

    def served(n: int) -> None:
        for _ in range(n):
            p = _client(cluster.frontend, "copy", "leave")
            assert p.wait(20) == 0, p.stderr.read()
            for f in (p.stdout, p.stderr):
                f.close()

    def pidfds() -> int:
        return _fd_kinds(wpid).get("anon_inode:[pidfd]", 0)

    served(2)  # connections, reply routes and the like settle
    # One pidfd per live client (shared by everything the worker keeps of it): none once
    # its housekeeping (every heartbeat interval: 0.2 s here) has seen them go.
    _until(lambda: pidfds() == 0, 10, f"the worker holds pidfds of clients that left: {_fd_kinds(wpid)}")
    base, kinds = _fds(wpid), _fd_kinds(wpid)
    served(6)
    # A client that released its outputs and left costs the worker nothing.
    _until(lambda: pidfds() == 0 and _fds(wpid) <= base, 10,
           f"the worker's descriptors grew from {base} ({kinds}) to {_fds(wpid)} ({_fd_kinds(wpid)})")


def test_a_long_lived_client_lets_go_of_a_sigkilled_workers_ring(cluster):
    """The other way round: a client reads its outputs in place from the worker's ring.  A
    worker killed by SIGKILL never marks the ring closed; the client drops its mapping at a
    heartbeat (every 0.2 s here, while its calls wait), not once 64 newer segments pushed it
    out, so the ring's memory goes with the worker."""
    import numpy as np

    from client_sdk import Client
    from tests.e2e.conftest import wait_service

    cluster.broker()
    w1 = cluster.worker("bench.inline_crossover:make_copy")
    x = np.full(1 << 16, 3, np.uint8)  # 64 KiB: the reply is a slot of the worker's ring
    with Client(cluster.frontend, timeout=20, heartbeat_interval=0.2) as c:
        wait_service(c, "copy")
        with c.infer("copy", {"x": x}) as r:
            assert int(r["x"][0]) == 3
        me = os.getpid()
        assert _maps_naming(me, w1.p.pid), "the client read the reply in place, from the worker's ring"
        w2 = cluster.worker("bench.inline_crossover:make_copy")
        w1.kill()
        dead = w1.p.pid

        def let_go() -> bool:
            with c.infer("copy", {"x": x}) as r:  # calls go on (to the new worker): heartbeats with them
                assert int(r["x"][0]) == 3
            return not _maps_naming(me, dead)

        _until(let_go, 10, "the client still maps the SIGKILLed worker's ring")
        assert _maps_naming(me, w2.p.pid)
