"""A plain MDP client (no heartbeats: a raw zmq DEALER here) is never presumed dead, so its
connection's close is what ends its requests (docs/protocol.md section 2, HEARTBEAT): the queued ones
dropped as `client_gone`, the running one cancelled at its worker.  Before, a plain client
that queued 50,000 requests and closed left them queued (40 MB), each run later for nobody
(the scale hunt).

The close comes from the frontend's connection monitor, apart from the messages: a new
connection that gets the closed one's descriptor number may send before that close is read.
An earlier attempt took the close for the new connection's and never answered its request.

Real processes (broker, worker), ipc and tcp endpoints; every wait is a poll with a deadline.
"""
from __future__ import annotations

import numpy as np
import pytest
import zmq

from broker import protocol as P

from .conftest import Proc, wait_service
from .test_metrics import scrape, until, value

pytestmark = pytest.mark.timeout(120)

WAIT = 20.0


def _request(rid: int, x: float) -> list:
    head = P.Request(id=rid, tensors=[P.TensorRef(name="x", dtype="<f8", shape=[1], loc=P.InlineLoc(frame=0))])
    return [P.encode_header(head), np.array([x]).tobytes()]


def _dealer(frontend: str, routing_id: bytes | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 1000
    if routing_id is not None:
        s.routing_id = routing_id
    s.connect(frontend)
    return s


def _reply(s: zmq.Socket) -> P.Reply:
    assert s.poll(int(WAIT * 1000)), "no reply"
    msg = P.parse_broker_to_client(s.recv_multipart())
    return P.decode_reply(msg.body[0], n_inline=len(msg.body) - 1)


def _held(cluster, gate, tmp_path, base: str, tree=None):
    """A worker of `gate_model:held` (one request at a time, each held until the gate lets
    it go, each run written to a log), the gate opened: its broker's queue depth, how many
    requests it started, and the worker."""
    runs = tmp_path / "runs"
    w = cluster.worker("gate_model:held", "--max-batch", "1", "--credit", "1",
                   env={**gate.env, "SLEEPY_LOG": str(runs)}, tree=tree)
    gate.open()

    def depth() -> float:
        return value(scrape(base), "zmq_infer_queue_depth", service="held", priority="normal")

    def ran() -> int:
        return len(runs.read_text().splitlines()) if runs.exists() else 0

    return depth, ran, w


def _tcp_broker(cluster) -> tuple[str, Proc]:
    """A broker on a tcp frontend of the kernel's port (its READY names it: a port picked
    here and bound there may be taken meanwhile)."""
    broker = Proc(["-m", "broker", "--frontend", "tcp://127.0.0.1:0", "--backend", cluster.backend,
                   "--heartbeat-interval", "0.2", "--insecure", "--http", "127.0.0.1:0"])
    cluster.procs.append(broker)
    broker.wait_ready()
    return broker.field("frontend"), broker


@pytest.mark.parametrize("transport, routing_id", [("ipc", None), ("ipc", b"plain-a"), ("tcp", None)])
def test_a_plain_clients_requests_end_when_its_connection_closes(cluster, gate, tmp_path, transport, routing_id):
    """Five requests from a plain client, one held at the worker and four queued, then a live
    client's: the plain client closes its socket.  Its four queued requests are dropped
    (`client_gone`) and never reach the worker, its running one is cancelled there, and the
    live client's request is the next to run and is answered."""
    if transport == "tcp":
        frontend, broker = _tcp_broker(cluster)
    else:
        frontend, broker = cluster.frontend, cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    depth, ran, _ = _held(cluster, gate, tmp_path, base)
    gone = _dealer(frontend, routing_id)
    live = _dealer(frontend)
    try:
        for i in range(5):
            gone.send_multipart(P.client_request("held", _request(i + 1, -1.0)))  # held until released
        until(lambda: depth() == 4 and ran() == 1, "one of the plain client's requests held, four queued")
        live.send_multipart(P.client_request("held", _request(1, -1.0)))
        until(lambda: depth() == 5, "the live client's request queued")
        gone.close()
        until(lambda: depth() == 1, "the closed client's queued requests dropped")
        assert value(scrape(base), "zmq_infer_requests_total", service="held", outcome="client_gone") >= 4
        gate.release(2)  # the closed client's running request, then the live client's
        rep = _reply(live)
        assert rep.error is None and rep.id == 1, rep.error
        assert ran() == 2  # none of the dropped requests reached the worker
    finally:
        gone.close(0)
        live.close(0)


def test_a_connection_reusing_a_closed_ones_descriptor_is_answered(cluster):
    """A raw DEALER is answered and closes, and a new one sends at once, while the broker is
    busy reading another client's burst: the new one gets the closed one's descriptor
    number, and its request is read before that close is.  Each must be answered (the
    close is never taken for the new connection's)."""
    cluster.broker()
    cluster.worker("echo")
    from client_sdk import Client

    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "echo")
    burst = 1000  # MMI questions: the broker answers each itself, in order
    busy = _dealer(cluster.frontend)
    old = _dealer(cluster.frontend)
    try:
        for i in range(20):
            old.send_multipart(P.client_request("echo", _request(i + 1, float(i))))
            rep = _reply(old)
            assert rep.error is None and rep.id == i + 1, rep.error
            for _ in range(burst):
                busy.send_multipart(P.client_request("mmi.service", [b"echo"]))
            old.close(0)
            old = _dealer(cluster.frontend)
            old.send_multipart(P.client_request("echo", _request(1000 + i, float(i))))
            rep = _reply(old)
            assert rep.error is None and rep.id == 1000 + i, rep.error
            for _ in range(burst):
                assert busy.poll(int(WAIT * 1000)), "the burst's answers"
                busy.recv_multipart()
    finally:
        old.close(0)
        busy.close(0)


def test_a_plain_client_reconnecting_under_its_own_routing_id_is_served(cluster, gate, tmp_path):
    """A plain client with a routing id of its own closes with requests queued and comes back
    under the same id, on the same descriptor number as a rule: each time, the closed
    connection's requests are dropped, and the new connection's are queued and served (never
    taken for the closed one's leftovers).  (It comes back once the broker has read the
    close: libzmq ignores a connection under an id another connection still holds.)"""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    depth, ran, _ = _held(cluster, gate, tmp_path, base)
    s = None
    try:
        for n in range(3):
            s = _dealer(cluster.frontend, b"plain-me")
            for i in range(3):
                s.send_multipart(P.client_request("held", _request(10 * n + i + 1, -1.0)))
            until(lambda: depth() == 2, f"round {n}: two of its requests queued behind the held one")
            s.close()
            until(lambda: depth() == 0, f"round {n}: the closed connection's queued requests dropped")
            gate.release()  # the closed connection's running request ends
        s = _dealer(cluster.frontend, b"plain-me")
        s.send_multipart(P.client_request("held", _request(100, 1e-6)))
        rep = _reply(s)
        assert rep.error is None and rep.id == 100, rep.error
        m = scrape(base)
        assert value(m, "zmq_infer_requests_total", service="held", outcome="client_gone") == 9, m
        assert ran() == 4
    finally:
        if s is not None:
            s.close(0)


@pytest.mark.parametrize("routing_id", [None, b"plain-late"])
def test_late_messages_of_a_closed_plain_client_are_dropped_and_counted(cluster, gate, tmp_path, routing_id):
    """Many requests sent and the socket closed at once: whatever libzmq still held of them
    when the close was read is dropped as it is read, never queued for nobody (with a
    routing id of the client's own too: they came on the closed connection)."""
    n = 3000
    broker = cluster.broker("--http", "127.0.0.1:0", "--max-queue", str(2 * n))  # all queued, none refused
    base = "http://" + broker.field("http")
    runs = tmp_path / "runs"
    cluster.worker("gate_model:held", "--max-batch", "1", "--credit", "1",
                   env={**gate.env, "SLEEPY_LOG": str(runs)})
    gate.open()
    s = _dealer(cluster.frontend, routing_id)
    try:
        for i in range(n):
            s.send_multipart(P.client_request("held", _request(i + 1, -1.0)))
        s.close(linger=int(WAIT * 1000))  # libzmq sends what it still holds, then closes

        def settled():
            m = scrape(base)
            return (value(m, "zmq_infer_queue_depth", service="held", priority="normal") == 0
                    and value(m, "zmq_infer_requests_total", service="held", outcome="client_gone") >= n - 1)

        until(settled, "every request of the closed client dropped but the running one")
    finally:
        s.close(0)
    gate.release()
    # The one dispatched before the close was read ran, or was cancelled before it started
    # (the broker's CANCEL for a client that left reached the worker with it, as it does
    # once the broker reads the close in the same pass): then all n were the client's loss.
    ran = len(runs.read_text().splitlines()) if runs.exists() else 0
    gone = value(scrape(base), "zmq_infer_requests_total", service="held", outcome="client_gone")
    assert ran == 1 or (ran == 0 and gone == n), (ran, gone)
