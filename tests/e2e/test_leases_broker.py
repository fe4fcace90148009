"""Leases through a real broker process (docs/protocol.md section 10), spoken frame by frame
by raw sockets (the SDK and `gpu_worker --direct` have their own tests): the worker here is a DEALER
that says READY with a direct socket and answers LEASE itself.  What is checked is the
broker's side: placement reaches the worker first, the client is told only after the worker
confirmed, the grant carries the kernel's pid of the client's connection, every end is
relayed, a dead worker's leases end with `resend`, and bad or unplaceable asks get typed
errors while everything else keeps working."""
from __future__ import annotations

import os
import time

import numpy as np
import zmq

from broker import protocol as P

TIMEOUT_MS = 5000


def _recv(sock: zmq.Socket, timeout_ms: int = TIMEOUT_MS) -> list[bytes]:
    assert sock.poll(timeout_ms), "no message in time"
    return sock.recv_multipart()


def _worker(ctx, cluster, service="pinned", credit=4, direct="ipc:///tmp/zinf-test-direct.ipc"):
    w = ctx.socket(zmq.DEALER)
    w.setsockopt(zmq.LINGER, 0)
    w.connect(cluster.backend)
    ready = P.Ready(credit=credit, max_batch=1, transports=["inline"], pid=os.getpid(), direct=direct)
    w.send_multipart(P.worker_ready(service, ready))
    return w


def _next_lease_msg(w: zmq.Socket) -> list[bytes]:
    """The next non-heartbeat message to the fake worker (it heartbeats back meanwhile)."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        frames = _recv(w)
        assert frames[0] == P.MDPW
        if frames[1] == P.W_HEARTBEAT:
            w.send_multipart(P.worker_heartbeat())
            continue
        return frames
    raise AssertionError("only heartbeats reached the fake worker")


def _wait_registered(c: zmq.Socket, w: zmq.Socket, service: str = "pinned") -> None:
    """Ask MMI until the broker knows the fake worker (its READY and the client's messages
    travel on different sockets: a LEASE may overtake the READY)."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        w.send_multipart(P.worker_heartbeat())
        c.send_multipart([P.MDPC, P.C_REQUEST, b"mmi.service", service.encode()])
        reply = _from_broker(c, 1.0)
        if reply is not None and reply[3] == b"200":
            return
    raise AssertionError(f"the broker never registered the {service!r} worker")


def _from_broker(c: zmq.Socket, timeout_s: float = TIMEOUT_MS / 1000) -> list[bytes] | None:
    """The next message to the client that is not a heartbeat answer, or None after
    `timeout_s`; the client heartbeats meanwhile, as the SDK does (a leaseholder is a tracked
    client: silent for its liveness window, it would lose its leases)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        c.send_multipart(P.client_heartbeat())
        if c.poll(min(100, max(1, int(left * 1000)))):
            frames = c.recv_multipart()
            if frames[1] != P.C_HEARTBEAT:
                return frames
    return None


def _client(ctx, cluster):
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    c.connect(cluster.frontend)
    return c


def _ask(c, service="pinned", ask_id=1, slots=2):
    c.send_multipart(P.client_lease(service, P.encode_header(P.LeaseAsk(id=ask_id, slots=slots))))


def test_a_lease_is_placed_confirmed_relayed_and_ended_through_the_broker(cluster):
    cluster.broker()
    ctx = zmq.Context.instance()
    w = _worker(ctx, cluster)
    c = _client(ctx, cluster)
    try:
        _wait_registered(c, w)
        _ask(c)
        frames = _next_lease_msg(w)
        assert frames[1] == P.W_LEASE
        grant = P.decode_lease_grant(frames[2])
        assert grant.service == "pinned" and grant.slots == 2
        assert grant.client_pid == os.getpid()  # the kernel's word for the client's connection
        assert _from_broker(c, 0.2) is None  # the client hears nothing before the worker confirms
        w.send_multipart(P.worker_leased(grant.lease))
        reply = _from_broker(c)
        assert reply[:3] == [P.MDPC, P.C_LEASED, b"pinned"]
        info = P.decode_lease_info(reply[3])
        assert (info.id, info.lease, info.secret, info.slots) == (1, grant.lease, grant.secret, 2)
        assert info.endpoint == "ipc:///tmp/zinf-test-direct.ipc" and len(info.instance) == 8
        # The client is done: the worker is told.
        c.send_multipart(P.client_lease_end("pinned", P.encode_header(P.LeaseEnd(lease=info.lease,
                                                                                 reason="client_done"))))
        frames = _next_lease_msg(w)
        assert frames[1] == P.W_LEASE_END and frames[2] == info.lease
        assert P.decode_lease_end(frames[3]).reason == "client_done"
        # A second lease, ended by the worker (it is stopping): the client is told, no resend.
        _ask(c, ask_id=2, slots=1)
        grant2 = P.decode_lease_grant(_next_lease_msg(w)[2])
        w.send_multipart(P.worker_leased(grant2.lease))
        P.decode_lease_info(_from_broker(c)[3])
        w.send_multipart(P.worker_lease_end(grant2.lease, P.encode_header(
            P.LeaseEnd(lease=grant2.lease, reason="worker_stopping"))))
        end_frames = _from_broker(c)
        assert end_frames[:3] == [P.MDPC, P.C_LEASE_END, b"pinned"]
        end = P.decode_lease_end(end_frames[3])
        assert (end.lease, end.reason, end.resend) == (grant2.lease, "worker_stopping", False)
        # A third, then the worker falls silent: presumed dead, the client resends.
        _ask(c, ask_id=3, slots=1)
        grant3 = P.decode_lease_grant(_next_lease_msg(w)[2])
        w.send_multipart(P.worker_leased(grant3.lease))
        P.decode_lease_info(_from_broker(c)[3])
        end = P.decode_lease_end(_from_broker(c)[3])  # no more heartbeats from the worker
        assert (end.lease, end.reason, end.resend) == (grant3.lease, "worker_failed", True)
    finally:
        w.close(0)
        c.close(0)


def test_unplaceable_and_malformed_asks_get_typed_errors_and_plain_requests_still_work(cluster):
    from client_sdk import Client

    cluster.broker()
    cluster.worker()  # a real echo worker: no direct socket, never leased
    ctx = zmq.Context.instance()
    c = _client(ctx, cluster)
    try:
        _ask(c, service="nosuch", ask_id=5)
        reply = _from_broker(c)
        assert reply[1] == P.C_LEASED
        err = P.decode_reply(reply[3]).error
        assert err.code == int(P.ErrorCode.SERVICE_UNAVAILABLE) and "no live worker" in err.message
        _ask(c, service="echo", ask_id=6)
        err = P.decode_reply(_from_broker(c)[3]).error
        assert err.code == int(P.ErrorCode.SERVICE_UNAVAILABLE) and "direct socket" in err.message
        c.send_multipart([P.MDPC, P.C_LEASE, b"echo", P.MAGIC + b"\xc1garbage"])
        err = P.decode_reply(_from_broker(c)[3]).error
        assert err.code == int(P.ErrorCode.PROTOCOL_ERROR)
        with Client(cluster.frontend, timeout=10) as cl:
            x = np.arange(16, dtype=np.uint8)
            with cl.infer("echo", {"x": x}) as out:
                assert np.array_equal(out["x"], x)
    finally:
        c.close(0)
