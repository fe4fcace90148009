"""The broker tells workers the pid the kernel attests for an ipc client, not the one the
client wrote in its header (workers reclaim a dead client's outputs by it)."""
from __future__ import annotations

import os
import threading

import zmq

from broker import protocol as P
from broker.server import Broker, BrokerConfig


def test_an_ipc_clients_pid_is_the_kernels_not_its_claim(tmp_path):
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    stop = threading.Event()
    ctx = zmq.Context.instance()
    broker = Broker(BrokerConfig(frontend=fe, backend=be), ctx=ctx)
    t = threading.Thread(target=broker.serve, args=(stop,))
    t.start()
    worker, client = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        worker.connect(be)
        worker.send_multipart(P.worker_ready("svc", P.Ready(credit=1, host=P.local_host_id(), transports=["inline"])))
        client.connect(fe)
        for attempt in range(200):  # until the READY is in: a request before it just queues
            lie = P.Request(id=attempt + 1, pid=1, host=P.local_host_id())
            client.send_multipart(P.client_request("svc", [P.encode_header(lie)]))
            if worker.poll(50):
                break
        msg = P.parse_broker_to_worker(worker.recv_multipart())
        assert P.decode_request(msg.body[0]).pid == os.getpid()  # this process, not pid 1
    finally:
        stop.set()
        t.join(10)
        worker.close(0)
        client.close(0)
        broker.close()


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
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    stop = threading.Event()
    ctx = zmq.Context.instance()
    broker = Broker(BrokerConfig(frontend=fe, backend=be), ctx=ctx)
    t = threading.Thread(target=broker.serve, args=(stop,))
    t.start()
    worker = ctx.socket(zmq.DEALER)
    try:
        worker.connect(be)
        worker.send_multipart(P.worker_ready("svc", P.Ready(credit=8, host=P.local_host_id(), transports=["inline"])))
        seen = {}
        for rid in (1, 2):  # two processes, one after the other, with the same routing id
            child = subprocess.Popen([sys.executable, "-c", _SENDER, fe, str(rid)], cwd=ROOT, stdin=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                assert worker.poll(10_000), "the request never reached the worker"
                msg = P.parse_broker_to_worker(worker.recv_multipart())
                req = P.decode_request(msg.body[0])
                seen[req.id] = (req.pid, child.pid)
            finally:
                child.communicate(b"\n", timeout=30)
        assert seen[1] == (seen[1][1], seen[1][1]) and seen[2] == (seen[2][1], seen[2][1])
        assert seen[1][0] != seen[2][0]  # each request carries its own process's pid
    finally:
        stop.set()
        t.join(10)
        worker.close(0)
        broker.close()
