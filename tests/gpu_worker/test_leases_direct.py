"""The worker's side of leases in process (docs/protocol.md section 10): an inproc pair stands
in for the broker, a DEALER for the leaseholding client on the worker's real direct socket,
and the test drives the loop's steps (`on_message`, `_drain_direct`, `run_ready_batches`)
one by one.  Checked: nothing of it exists without --direct (Ready.direct unset, leases
refused); with it, the pid and host come from the grant, the replies go back on the direct
socket and nothing about them to the broker; LEASE_END client_gone drops the lease's queued
requests silently; a lost broker connection ends every lease."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol.wire import send_frames
from gpu_worker.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 16


class _Pair:
    """The worker's upstream: a PAIR to the test's `peer`; remembers the READY it sent."""

    watch_liveness = False
    monitor = None

    def __init__(self, name: str):
        self.ctx = zmq.Context.instance()
        self.addr = f"inproc://{name}"
        self.peer = self.ctx.socket(zmq.PAIR)
        self.peer.linger = 0
        self.peer.bind(self.addr)
        self.sock = None
        self.ready = None
        self.last_sent = 0.0

    def connect(self, service, ready):
        self.ready = ready
        if self.sock is not None:
            self.sock.close()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.connect(self.addr)
        return self.sock

    def receive(self, frames):
        return P.parse_broker_to_worker(frames)

    def send(self, frames) -> None:
        send_frames(self.sock, frames)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.peer.close()

    def sent(self) -> list:
        out = []
        while self.peer.poll(50):  # inproc delivers at once; the wait is only an upper bound
            out.append(self.peer.recv_multipart())
        return out


def _worker(tmp_path, direct: bool) -> Worker:
    up = _Pair(f"lease-up-{id(tmp_path)}-{direct}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", warmup=False, credit=8, direct=direct),
               upstream=up)
    w._connect()
    return w


@pytest.fixture
def worker(tmp_path):
    w = _worker(tmp_path, direct=True)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def client(worker):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(worker.direct_socket.endpoint)
    try:
        yield s
    finally:
        s.close()


def _lease(worker, n=1, slots=2, **kw) -> bytes:
    grant = P.LeaseGrant(lease=P.lease_id(n), secret=SECRET, service="echo", slots=slots, **kw)
    worker.on_message(P.to_worker_lease(b"", P.encode_header(grant))[1:])
    return grant.lease


def _request(client, rid, x, **kw) -> None:
    head = P.Request(id=rid, tensors=[P.TensorRef("x", x.dtype.str, list(x.shape), P.InlineLoc(frame=0))], **kw)
    client.send_multipart(P.client_request("echo", [P.encode_header(head), x.tobytes()]))


def _take(worker, until) -> None:
    """Let the worker read its direct socket until `until()` holds."""
    deadline = time.monotonic() + 5
    while not until():
        assert time.monotonic() < deadline, "the worker did not get it in time"
        worker.direct_socket.sock.poll(50)
        worker._drain_direct()


def _reply(client):
    assert client.poll(5000), "no reply on the direct connection"
    msg = P.parse_broker_to_client(client.recv_multipart())
    assert msg.command == P.C_FINAL and msg.service == b"echo"
    return P.decode_reply(msg.body[0], n_inline=len(msg.body) - 1), msg.body[1:]


def test_without_direct_nothing_is_bound_and_leases_are_refused(tmp_path):
    w = _worker(tmp_path, direct=False)
    try:
        assert w.direct_socket is None and w.leases is None and w.upstream.ready.direct is None
        _lease(w)
        [leased] = w.upstream.sent()
        msg = P.parse_worker(leased)
        assert msg.command == P.W_LEASED and msg.envelope == P.lease_id(1)
        assert "without --direct" in P.decode_reply(msg.info).error.message
    finally:
        w.close()


def test_a_leased_request_runs_with_the_grants_pid_and_answers_on_the_direct_socket(worker, client):
    path = worker.direct_socket.path
    assert worker.upstream.ready.direct == worker.direct_socket.endpoint and os.path.exists(path)
    lease = _lease(worker, client_pid=4242)
    assert worker.upstream.sent() == [P.worker_leased(lease)]
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    x = np.arange(6, dtype=np.int16)
    _request(client, 5, x, pid=1, host="elsewhere/0", reply_to="ipc:///tmp/c-1-1-00.ipc", backlog=9)
    _take(worker, lambda: len(worker.jobs) == 1)
    [job] = worker.jobs.values()
    assert job.req.pid == 4242 and job.req.host is None and job.req.reply_to is None and job.req.backlog == 0
    assert worker.leases.in_flight(lease) == 1
    worker.run_ready_batches(force=True)
    rep, frames = _reply(client)
    assert rep.id == 5 and rep.error is None
    assert np.array_equal(np.frombuffer(frames[rep.tensors[0].loc.frame], dtype=np.int16), x)
    assert worker.leases.in_flight(lease) == 0 and worker.leased_sent == 1
    assert worker.upstream.sent() == [] and len(worker.dones) == 0  # the broker hears nothing of it
    worker.close()
    assert not os.path.exists(path)


def test_client_gone_drops_the_leases_queued_requests(worker, client):
    lease = _lease(worker, slots=3)
    worker.upstream.sent()
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    for rid in (1, 2):
        _request(client, rid, np.zeros(3))
    _take(worker, lambda: len(worker.jobs) == 2)
    end = P.LeaseEnd(lease=lease, reason="client_gone")
    worker.on_message(P.to_worker_lease_end(b"", lease, P.encode_header(end))[1:])
    assert worker.jobs == {} and len(worker.batcher) == 0 and lease not in worker.leases
    assert not client.poll(100)  # nobody waits for their FINALs
    assert worker.upstream.sent() == []


def test_a_lost_broker_connection_ends_every_lease(worker, client):
    lease = _lease(worker)
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    _request(client, 1, np.zeros(3))
    _take(worker, lambda: len(worker.jobs) == 1)
    worker._fail_pending("broker connection lost")
    assert len(worker.leases) == 0 and worker.jobs == {}
    _request(client, 2, np.zeros(3))
    _take(worker, lambda: client.poll(0))
    rep, _ = _reply(client)
    assert rep.id == 2 and rep.error.code == int(P.ErrorCode.SERVICE_UNAVAILABLE)
    assert "broker connection lost" in rep.error.message
