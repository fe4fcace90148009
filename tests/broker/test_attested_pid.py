"""The broker tells workers the pid the kernel attests for an ipc client, not the one the
client wrote in its header (workers reclaim a dead client's outputs by it, and read only
its memory)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import zmq

from broker import protocol as P
from broker.server import Broker, BrokerConfig
from tests.e2e.conftest import ROOT


@contextlib.contextmanager
def _broker_and_worker(tmp_path, credit: int):
    """A broker serving in a thread and a raw worker of service "svc": (frontend, worker)."""
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    stop = threading.Event()
    ctx = zmq.Context.instance()
    broker = Broker(BrokerConfig(frontend=fe, backend=be), ctx=ctx)
    t = threading.Thread(target=broker.serve, args=(stop,))
    t.start()
    worker = ctx.socket(zmq.DEALER)
    try:
        worker.connect(be)
        worker.send_multipart(P.worker_ready("svc", P.Ready(credit=credit, host=P.local_host_id(),
                                                           transports=["inline"])))
        yield fe, worker
    finally:
        stop.set()
        t.join(10)
        worker.close(0)
        broker.close()


def _dispatched(worker: zmq.Socket) -> P.Request:
    while True:
        assert worker.poll(10_000), "the request never reached the worker"
        msg = P.parse_broker_to_worker(worker.recv_multipart())
        if msg.command == P.W_CANCEL:
            # A plain client's request, cancelled when its connection closed (its process
            # left without a DISCONNECT): not the request waited for.
            assert msg.body == (P.CANCEL_CLIENT_GONE,)
            continue
        return P.decode_request(msg.body[0])


def test_an_ipc_clients_pid_is_the_kernels_not_its_claim(tmp_path):
    with _broker_and_worker(tmp_path, credit=1) as (fe, worker):
        client = zmq.Context.instance().socket(zmq.DEALER)
        try:
            client.connect(fe)
            for attempt in range(200):  # until the READY is in: a request before it just queues
                lie = P.Request(id=attempt + 1, pid=1, host=P.local_host_id())
                client.send_multipart(P.client_request("svc", [P.encode_header(lie)]))
                if worker.poll(50):
                    break
            assert _dispatched(worker).pid == os.getpid()  # this process, not pid 1
        finally:
            client.close(0)


_SENDER = """
import sys, zmq
from broker import protocol as P
s = zmq.Context.instance().socket(zmq.DEALER)
s.routing_id = b"victim"   # a client chooses its routing id
s.connect(sys.argv[1])
s.send_multipart(P.client_request("svc", [P.encode_header(P.Request(id=int(sys.argv[2]), pid=1))]))
sys.stdin.readline()       # until the test has seen the request at the worker
s.close(linger=0)          # then gone, without a DISCONNECT
"""


def test_a_routing_id_reused_by_another_process_does_not_inherit_the_first_ones_pid(tmp_path):
    with _broker_and_worker(tmp_path, credit=8) as (fe, worker):
        seen = {}
        for rid in (1, 2):  # two processes, one after the other, with the same routing id
            child = subprocess.Popen([sys.executable, "-c", _SENDER, fe, str(rid)], cwd=ROOT, stdin=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                req = _dispatched(worker)
                seen[req.id] = (req.pid, child.pid)
            finally:
                child.communicate(b"\n", timeout=30)
        assert seen[1][0] == seen[1][1] and seen[2][0] == seen[2][1]  # each its own process's pid
        assert seen[1][0] != seen[2][0]


def test_a_clients_principal_is_its_process_not_its_pid_alone(tmp_path, monkeypatch):
    """Fairness, caps and remembered turns count an ipc client by (pid, start time): a new
    process that reuses a pid is another principal (it inherits no remembered turn)."""
    from broker.state import Scheduler
    from shm.names import proc_starttime

    seen = []
    real = Scheduler.client_request

    def spy(self, *a, **kw):
        seen.append(kw.get("principal"))
        return real(self, *a, **kw)

    monkeypatch.setattr(Scheduler, "client_request", spy)
    with _broker_and_worker(tmp_path, credit=1) as (fe, worker):
        client = zmq.Context.instance().socket(zmq.DEALER)
        try:
            client.connect(fe)
            for attempt in range(200):  # until the READY is in: a request before it just queues
                client.send_multipart(P.client_request("svc", [P.encode_header(P.Request(id=attempt + 1))]))
                if worker.poll(50):
                    break
            req = _dispatched(worker)
        finally:
            client.close(0)
    assert seen and set(seen) == {(os.getpid(), proc_starttime(os.getpid()))}
    assert (req.pid, req.pid_start) == seen[0]  # what the worker counts it by too


def test_a_principal_whose_start_could_not_be_read_is_its_process_still():
    """Out of descriptors the broker cannot read a connection's start time: its principal
    takes the start last read for that pid, so one process keeps one share; a lease grant
    names an ipc principal as pid:start."""
    import types

    from broker.server import Broker, _principal_text

    b = types.SimpleNamespace(_pid_starts={4242: 77})
    assert Broker._principal(b, (4242, None)) == (4242, 77)
    assert Broker._principal(b, (4242, 78)) == (4242, 78)  # its own, when read
    assert Broker._principal(b, (5, None)) == (5, None)  # nothing known
    assert _principal_text((4242, 77)) == "4242:77" and _principal_text((5, None)) == "5"
    assert _principal_text("curve:abc") == "curve:abc" and _principal_text(None) is None

