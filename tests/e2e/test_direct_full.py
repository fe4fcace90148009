"""A leaseholder that stops reading its replies on the worker's zmq direct socket (ipc, a
worker started with `--no-link`), with real broker, worker and client processes: the client
SIGSTOPs itself, the worker finds the connection's queue full, the client is SIGCONTed.

Found by a hunt: a stream of 30,000 small partials to a client paused for a few seconds
filled the queue (10,000), the worker dropped the partial that did not fit and stopped the
stream without a FINAL, and the client, resumed, read the 10,000 partials and then waited
for the stream's end until its deadline (for ever without one); a pinned `infer` whose FINAL
met the full queue was dropped the same way.  Now a running stream waits for its client
(`STREAM_WAIT_S`), then ends with an error FINAL after what was queued; a FINAL that meets a
full queue is held and sent once the client reads again, or dropped when its connection
closes (docs/protocol.md section 10.3, "Use")."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import time

import numpy as np
import pytest

from client_sdk import Client

from .conftest import HERE, Proc
from .test_metrics import scrape, until, value
from .test_pinned import TIMEOUT_S, _until_pinned

pytestmark = pytest.mark.timeout(90)

WAIT_S = 20.0


class _Lines:
    """A subprocess's stdout, line by line, each read with a timeout."""

    def __init__(self, proc: Proc):
        self.proc, self.buf = proc, b""
        self.skipped: list[str] = []  # lines `until` passed over (named when a wait fails)

    def next(self, timeout: float = WAIT_S) -> str:
        deadline = time.monotonic() + timeout
        fd = self.proc.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no line from {self.proc.args[:1]} within {timeout} s"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                assert chunk, (f"the client exited ({self.proc.p.wait(5)}) after the lines {self.skipped[-5:]}: "
                               f"{self.proc.stderr()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def until(self, want: str, timeout: float = WAIT_S) -> str:
        while True:
            line = self.next(timeout)
            if line.startswith(want):
                return line
            self.skipped.append(line)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _until_stopped(pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not _stopped(pid):
        assert time.monotonic() < deadline, "the client did not stop"
        time.sleep(0.005)  # polling /proc (a condition, not a delay)


STREAM_CLIENT = """
import json, os, signal, sys
import numpy as np
from client_sdk import Client, InferenceError
c = Client(sys.argv[1], timeout=10, pin=True)
x = np.zeros(1, np.int64)
while not c.pinned("s"):
    with c.infer_stream("s", {"x": x}, meta={"do": "many", "n": 1}, reply="inline") as h:
        [r.release() for r in h]
    c.pump(0.05)
print("PINNED", flush=True)
got, err = [], None
try:
    with c.infer_stream("s", {"x": x}, meta={"do": "many", "n": 30000}, reply="inline") as h:
        for r in h:
            with r:
                if "y" in r:
                    got.append(int(r["y"]))
                    if len(got) == 1:
                        print("STOPPING", flush=True)
                        os.kill(os.getpid(), signal.SIGSTOP)  # the application is busy elsewhere
except InferenceError as e:
    err = [type(e).__name__, str(e)]
print(json.dumps({"n": len(got), "in_order": got == list(range(len(got))), "error": err}), flush=True)
c.close()
"""


def test_a_paused_stream_client_gets_its_partials_then_an_error(cluster):
    cluster.broker()
    w = cluster.worker("faulty_model:streaming", "--service", "s", "--direct", "--no-link")
    client = Proc(["-c", STREAM_CLIENT, cluster.frontend])
    cluster.procs.append(client)
    out = _Lines(client)
    out.until("PINNED")
    out.until("STOPPING")
    w.wait_log("not reading")  # the queue of 10,000 is full
    os.kill(client.p.pid, signal.SIGCONT)
    got = json.loads(out.until("{"))
    # Every partial that was sent, in order, then the stream's end as an error (it was a
    # DeadlineExceeded after the client's whole timeout, 10 s: the FINAL never came).
    assert got["in_order"] and got["n"] >= 1, got
    assert got["error"] is not None and got["error"][0] == "WorkerFailed", got
    sent = int(re.search(r"cut after (\d+) partial", got["error"][1]).group(1))
    assert got["n"] == sent, got
    assert client.p.wait(WAIT_S) == 0
    # The worker serves on, a new leaseholder's stream included.
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        x = np.zeros(4, np.float32)
        deadline = time.monotonic() + TIMEOUT_S
        while not c.pinned("s"):
            assert time.monotonic() < deadline
            with c.infer_stream("s", {"x": x}) as h:
                assert len([r.release() for r in h]) == 5
            c.pump(0.05)
        with c.infer_stream("s", {"x": x}) as h:
            assert len([r.release() for r in h]) == 5
    assert w.p.poll() is None


# Six pinned requests of 1 MB each on a gated model, answered inline (1 MB FINALs): the
# client takes the first answer and stops; the other five meet a kernel buffer and a
# queue of one message (small_queue_worker.py) that the stopped client does not empty.
CALLS = 6
INFER_CLIENT = """
import json, os, signal, sys
import numpy as np
from client_sdk import Client, InferenceError
c = Client(sys.argv[1], timeout=10, pin=True)
x = np.zeros(4, np.float64)
while not c.pinned("gate"):
    print("NEED", flush=True)  # the test lets one call through the gate
    c.infer("gate", {"x": x}).release()
    c.pump(0.05)
xs = [np.full(1 << 17, i, np.float64) for i in range(%d)]
calls = [c.infer_stream("gate", {"x": v}, reply="inline") for v in xs]
print("SUBMITTED", flush=True)
with calls[0].result() as r:
    assert (r["x"] == 0).all()
print("STOPPING", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
ok, err = [], None
try:
    for i, call in enumerate(calls[1:], 1):
        with call.result() as r:
            ok.append(bool((r["x"] == i).all()))
except InferenceError as e:
    err = [type(e).__name__, str(e)]
print(json.dumps({"ok": ok, "error": err, "pinned": c.pinned("gate")}), flush=True)
c.close()
""" % CALLS


def _gated_worker(cluster, gate, *extra):
    # --credit 16: a lease takes at most half a worker's credit, and the default credit of a
    # worker of batches of one (2) would leave the lease one slot (the other calls brokered).
    w = Proc([str(HERE / "small_queue_worker.py"), "--broker", cluster.backend, "--model", "gate_model:copying",
              "--service", "gate", "--heartbeat-interval", "0.2", "--out-capacity-mb", "160", "--max-batch", "1",
              "--credit", "16",
              "--no-warmup", "--direct", "--no-link", *extra], env={**gate.env, "DIRECT_SNDHWM": "1"})
    cluster.procs.append(w)
    gate.open()
    w.wait_ready()
    return w


def _stopped_with_finals_waiting(cluster, gate, w) -> tuple[Proc, _Lines, int]:
    """The client pinned, its first answer read, stopped; its other answers sent (held).
    Also how many calls it made to pin (each answered)."""
    client = Proc(["-c", INFER_CLIENT, cluster.frontend])
    cluster.procs.append(client)
    out = _Lines(client)
    pinning = 0
    while (line := out.next()) == "NEED":
        gate.release(1)
        pinning += 1
    assert line == "SUBMITTED"
    gate.release(1)  # the first answer, which it reads
    out.until("STOPPING")
    _until_stopped(client.p.pid)
    gate.release(CALLS - 1)
    w.wait_log("not reading")
    return client, out, pinning


def test_a_pinned_infer_whose_final_met_a_full_queue_gets_it_after_its_client_resumes(cluster, gate):
    cluster.broker()
    w = _gated_worker(cluster, gate)
    client, out, _ = _stopped_with_finals_waiting(cluster, gate, w)
    os.kill(client.p.pid, signal.SIGCONT)
    got = json.loads(out.until("{"))
    # Each answer, the right one (those that met the full queue were dropped: the client
    # waited for its deadline, DeadlineExceeded).
    assert got == {"ok": [True] * (CALLS - 1), "error": None, "pinned": True}, got
    assert client.p.wait(WAIT_S) == 0
    assert w.p.poll() is None


def test_answers_held_for_a_client_that_exits_are_dropped_and_the_worker_serves_on(cluster, gate):
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    w = _gated_worker(cluster, gate)
    client, _, pinning = _stopped_with_finals_waiting(cluster, gate, w)
    client.kill()  # stopped, with answers held for it: its connection closes
    # Every request of the dead client is counted once: answered (the first, and those that
    # were queued before the queue filled) or client_gone (those held, dropped).
    def counted():
        s = scrape(base)
        ok = value(s, "zmq_infer_requests_total", service="gate", outcome="ok")
        gone = value(s, "zmq_infer_requests_total", service="gate", outcome="client_gone")
        return gone >= 1 and ok + gone == pinning + CALLS and (ok, gone)

    ok, gone = until(counted, "the held answers dropped as client_gone")
    # Another leaseholder is served, pinned.
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        x = np.arange(4, dtype=np.float64)
        deadline = time.monotonic() + TIMEOUT_S
        before = None
        while before is None or c.pinned_replies == before:
            assert time.monotonic() < deadline, "not served pinned"
            before = c.pinned_replies if before is None else before
            h = c.infer_stream("gate", {"x": x})
            gate.release(1)
            with h.result() as r:
                np.testing.assert_array_equal(r["x"], x)
            h.close()
            c.pump(0.05)
    s = scrape(base)
    assert value(s, "zmq_infer_requests_total", service="gate", outcome="client_gone") == gone
    assert w.p.poll() is None
