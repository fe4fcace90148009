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
