"""A request that waited in a stalled broker's input (SIGSTOP here: a GC pause, a loaded
host, a frozen container) past its deadline is never run: the broker counted `timeout_ms`
from its own receipt, so a request read late got its whole budget again, and a worker ran
it for a client that had given up long before (the timeouts hunt: with the client's CANCEL
right behind it, 2 runs in 3, the broker dispatching the REQUEST before reading the CANCEL;
with the client killed, every time), the GPU time a latency SLO needs.  A client on the
broker's host, on its clock (the same time namespace), now sends its deadline as it is
(`deadline_at`, CLOCK_MONOTONIC) and the broker answers 504 to such a request, as to any
that expired before it was read.

Real processes; the broker's stop is the stimulus (its length is what is tested), every
wait for an outcome is a condition with a timeout.  That the request never ran is shown by
the model's run log: `held` writes a line when it starts a call."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from client_sdk import Client
from tests.children import readline_within

from .conftest import HERE, ROOT
from .test_metrics import scrape, until, value

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.3
STALL = 1.0  # the broker's stop: well past the deadline (and within the dead client's window)

CHILD = """
import sys, numpy as np
from client_sdk import Client
c = Client(sys.argv[1], timeout=10)
assert c.mmi_service("s")
c.infer("s", {"x": np.array([0.0])}).release()  # a client that has sent before (not logged: x = 0)
print("ready", flush=True)
sys.stdin.readline()
h = c.infer_stream("s", {"x": np.array([0.05])}, timeout=float(sys.argv[2]))
# "sent" through libzmq's I/O thread (the context's one), behind the request: it reaches the
# test only once that thread has handled the request's queueing, and so written it to the
# broker's connection.  (Printed instead, it raced the thread: killed then, the child had
# sent nothing, and the broker had nothing to answer: under load, 3 runs in 8.)
import zmq
out = zmq.Context.instance().socket(zmq.PUSH)
out.linger = 0
out.connect(sys.argv[3])
out.send(b"sent")
sys.stdin.readline()
"""


def _runs(log) -> int:
    return log.read_text().count("\n") if log.exists() else 0


@pytest.fixture
def held(cluster, tmp_path):
    broker = cluster.broker("--http", "127.0.0.1:0")
    log = tmp_path / "runs.log"
    os.mkfifo(tmp_path / "gate.fifo")
    cluster.worker("gate_model:held", "--service", "s", "--max-batch", "1",
                   env={"SLEEPY_LOG": str(log), "GATE_FIFO": str(tmp_path / "gate.fifo")})
    yield broker, log
    os.kill(broker.p.pid, signal.SIGCONT)


def _expired(base: str) -> bool:
    return value(scrape(base), "zmq_infer_requests_total", service="s", outcome="deadline_exceeded") >= 1


def test_a_dead_clients_request_read_after_its_deadline_never_runs(cluster, held, tmp_path):
    """No CANCEL at all: the client, which had sent a request before (the broker learns a
    client's process, and so its clock, at its first request, while it is there to ask),
    was killed while the broker was stopped.  (A client
    that lives sends one when it gives up, right behind the request; the broker read the
    two in one pass and still dispatched the request first in 2 runs of 3, a race this test
    leaves out: with the broker's deadline right, it never dispatches it at all.)"""
    broker, log = held
    base = "http://" + broker.field("http")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))
    sent = zmq.Context.instance().socket(zmq.PULL)
    sent.linger = 0
    sent.bind(f"ipc://{tmp_path}/sent.ipc")
    child = subprocess.Popen([sys.executable, "-c", CHILD, cluster.frontend, str(TIMEOUT), f"ipc://{tmp_path}/sent.ipc"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert readline_within(child.stdout, 30, "the child's ready (its client up)").strip() == "ready"
        os.kill(broker.p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        child.stdin.write("\n")
        child.stdin.flush()
        assert sent.poll(20_000), "the child's request sent"
        assert sent.recv() == b"sent"
        child.kill()
        child.wait(10)
        time.sleep(max(0.0, t0 + STALL - time.monotonic()))  # the stimulus: the stall's length
        os.kill(broker.p.pid, signal.SIGCONT)
        until(lambda: _expired(base), "the broker's 504 for the dead client's request")
        with Client(cluster.frontend, timeout=10) as c:
            assert c.mmi_service("s")
            with c.infer("s", {"x": np.array([0.0])}) as r:  # the worker serves, and ran nothing else
                assert r["x"][0] == 0.0
        assert _runs(log) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdin.close()
        child.stdout.close()
        sent.close()


ON_ANOTHER_CLOCK = """
import sys, numpy as np
from client_sdk import Client
with Client(sys.argv[1], timeout=5) as c:
    with c.infer("s", {"x": np.array([0.0])}) as r:
        print("served", float(r["x"][0]), flush=True)
"""


def test_a_client_on_another_clock_is_served_on_the_brokers(cluster, held):
    """A client in a time namespace whose CLOCK_MONOTONIC runs 1000 s behind the broker's:
    its `deadline_at`, taken as is, lay long past on the broker's clock (every request 504
    at once); the broker learns that the client's clock is not its own and counts from its
    receipt."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    if time.monotonic() < 1100:
        pytest.skip("the host's clock is too young for an offset of -1000 s")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))
    p = subprocess.run(["unshare", "-T", "--monotonic", "-1000", sys.executable, "-c", ON_ANOTHER_CLOCK,
                        cluster.frontend], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    if p.returncode != 0 and "unshare" in p.stderr:
        pytest.skip(f"no time namespace here: {p.stderr[-300:]}")
    assert p.stdout.split() == ["served", "0.0"], p.stderr[-2000:]
