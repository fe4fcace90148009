"""The local link (docs/protocol.md section 10.6) end to end, with real broker and
`python -m gpu_worker --direct` processes: a near pinned `Client` talks to its worker over the
link (and over the ipc direct socket when the worker has none, `--no-link`), a stream and a
request too large for one datagram on the same lease, and a hostile peer on the worker's link
(garbage, a request without HELLO, another lease's secret) is cut off or refused alone while
a pinned client's requests keep their results."""
from __future__ import annotations

import asyncio
import re
import socket
import struct
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol.link import LinkConn, decode, encode
from client_sdk import Client
from tests.e2e.conftest import wait_service
from tests.e2e.test_pinned import TIMEOUT_S, _echo, _until_pinned, async_pinned_echoes

pytestmark = pytest.mark.timeout(60)


def _lease_socket(c: Client, service: str):
    """What the client holds for its lease of ``service``: a LinkConn or a zmq DEALER."""
    pin = c._core.pins[service]
    return c._pin_socks[pin.lease]


def test_a_near_pinned_client_uses_the_link(cluster):
    cluster.broker()
    w = cluster.worker("echo", "--direct")
    path = re.search(r" link=(\S+)", w.ready_line).group(1)
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        _until_pinned(c, "echo")
        assert type(_lease_socket(c, "echo")) is LinkConn and _lease_socket(c, "echo").path == path
        before = c.pinned_replies
        for i in range(20):
            _echo(c, "echo", i)
        # Larger tensors go by reference and stay on the link (800 kB, and a 6 MB frame);
        # and so does a stream.
        big = np.arange(100_000, dtype=np.int64)
        with c.infer("echo", {"x": big}, timeout=TIMEOUT_S) as r:
            np.testing.assert_array_equal(r["x"], big)
        frame = c.alloc((1080, 1920, 3), np.uint8)
        frame[...] = 7
        with c.infer("echo", {"x": frame}, timeout=TIMEOUT_S) as r:
            assert int(r["x"][1079, 1919, 2]) == 7
        with c.stream("echo", latest_wins=False, max_in_flight=2) as st:
            for i in range(6):
                st.send({"x": np.full(3, i, np.int16)})
            for i in range(6):
                with st.recv(timeout=TIMEOUT_S) as r:
                    np.testing.assert_array_equal(r["x"], np.full(3, i, np.int16))
        assert c.pinned_replies == before + 28 and c.stray_replies == 0
    # A request too large for one datagram (inline: its pool is too small for it) goes
    # through the broker, and the lease stays.
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True, pool_capacity=1 << 20) as c:
        _until_pinned(c, "echo")
        assert type(_lease_socket(c, "echo")) is LinkConn
        before = c.pinned_replies
        big = np.arange(300_000, dtype=np.int64)  # 2.4 MB
        with c.infer("echo", {"x": big}, timeout=TIMEOUT_S) as r:
            np.testing.assert_array_equal(r["x"], big)
        assert c.pinned_replies == before and c.pinned("echo")
        _echo(c, "echo", 1)
        assert c.pinned_replies == before + 1
    # The worker's DISCONNECT-on-close unbinds the link connection; the worker lives on.
    assert w.p.poll() is None


def test_without_a_link_the_ipc_direct_socket_serves(cluster):
    cluster.broker()
    w = cluster.worker("echo", "--direct", "--no-link")
    assert " link=" not in w.ready_line
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        _until_pinned(c, "echo")
        assert type(_lease_socket(c, "echo")) is not LinkConn
        before = c.pinned_replies
        for i in range(10):
            _echo(c, "echo", i)
        assert c.pinned_replies == before + 10


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT_S)
    s.connect(path)
    return s


def _send(s: socket.socket, frames) -> None:
    [dgram] = encode(frames)
    s.sendmsg(dgram)


def _request(rid: int) -> list:
    x = np.arange(4, dtype=np.int32)
    head = P.Request(id=rid, tensors=[P.TensorRef(name="x", dtype=x.dtype.str, shape=[4], loc=P.InlineLoc(frame=0))])
    return P.client_request("echo", [P.encode_header(head), x.tobytes()])


def _final_error(s: socket.socket) -> P.ErrorInfo:
    frames = decode(s.recv(1 << 16))
    assert bytes(frames[1]) == P.C_FINAL
    return P.decode_reply(frames[3]).error


def test_a_hostile_peer_on_the_link_harms_only_itself(cluster):
    cluster.broker()
    w = cluster.worker("echo", "--direct")
    path = re.search(r" link=(\S+)", w.ready_line).group(1)
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        _until_pinned(c, "echo")
        garbage, unbound, forger = _raw(path), _raw(path), _raw(path)
        try:
            garbage.send(b"\x00\xff\xff\x00")  # 65535 frames announced, none there
            _send(unbound, _request(1))        # no HELLO: 400, nothing runs
            err = _final_error(unbound)
            assert err.code == P.ErrorCode.PROTOCOL_ERROR and "HELLO" in err.message
            pin = c._core.pins["echo"]         # the real lease, a wrong secret: refused
            _send(forger, [P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=pin.lease, secret=b"\x00" * 16))])
            _send(forger, _request(2))
            err = _final_error(forger)
            assert err.code == P.ErrorCode.PROTOCOL_ERROR and "refused" in err.message
            assert garbage.recv(16) == b""     # cut off
            # A peer of the ipc direct socket that chose a routing id shaped like the client's
            # link connection (ZMQ_ROUTING_ID) would speak for it: its DISCONNECT would unbind
            # the lease's connection.  Dropped, every one of them.
            direct = re.search(r" direct=(\S+)", w.ready_line).group(1)
            impostors = []
            for k in range(1, 4):
                d = zmq.Context.instance().socket(zmq.DEALER)
                d.linger = 0
                d.setsockopt(zmq.ROUTING_ID, b"\x00" + k.to_bytes(8, "big"))
                d.connect(direct)
                d.send_multipart(P.client_disconnect())
                impostors.append(d)
            w.wait_log("shaped like a local link connection")  # read, and dropped
            for d in impostors:
                d.close(0)
            before = c.pinned_replies
            for i in range(20):                # the leaseholder never noticed
                _echo(c, "echo", i)
            assert type(_lease_socket(c, "echo")) is LinkConn and c.pinned_replies == before + 20
            assert c.stray_replies == 0
        finally:
            for s in (garbage, unbound, forger):
                s.close()
    assert w.p.poll() is None


def test_an_async_pinned_client_uses_the_link_too(cluster):
    cluster.broker()
    cluster.worker("echo", "--direct")

    def on_the_link(ac):
        assert type(ac._pin_socks[ac._core.pins["echo"].lease]) is LinkConn

    asyncio.run(asyncio.wait_for(async_pinned_echoes(cluster.frontend, on_the_link), 30))


def test_a_large_reply_on_the_link_is_read_whole_by_one_poll(cluster):
    # Found by the streams audit: a reply of many pieces (2 MB inline: ten socket buffers) was
    # read one buffer per pump, so a camera loop polling with recv(timeout=0) every 33 ms had
    # its frame after ten polls, 300 ms, against 35 through the broker.  A poll that finds a
    # message begun waits briefly for its pieces, which the worker writes as they are read.
    cluster.broker()
    cluster.worker("echo", "--direct")
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        _until_pinned(c, "echo")
        link = _lease_socket(c, "echo")
        assert type(link) is LinkConn
        x = np.arange(2 << 20, dtype=np.uint8)
        for _ in range(3):
            h = c.infer_stream("echo", {"x": x}, reply="inline")
            begun = 0  # polls that left a message begun and unfinished
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                c.pump(0)
                if h._call.inbox:
                    break
                begun += link.partial
                assert time.monotonic() < deadline, "no reply"
            with h.result(timeout=TIMEOUT_S) as r:
                np.testing.assert_array_equal(r["x"], x)
            assert begun <= 3, begun  # (479 before; 1 unless the worker was descheduled 20 ms)


def test_connections_that_never_say_hello_are_ended_and_the_link_serves_again(cluster):
    # Found by the ninth session's audit: the link kept every connection that said nothing,
    # and at its cap (256) refused the rest, so a leaseholder that came later sent through
    # the ipc direct socket for as long as the silent ones stayed (for good).  A client says
    # HELLO as soon as it connects: one that said nothing for SILENT_GRACE_S is ended.
    from broker.protocol.link import SILENT_GRACE_S
    from gpu_worker.leases import LINK_CONNS

    cluster.broker()
    w = cluster.worker("echo", "--direct")
    path = re.search(r" link=(\S+)", w.ready_line).group(1)
    silent = []

    def connect() -> socket.socket:  # blocking: the listen backlog (128) fills while the worker accepts
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        silent.append(s)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(TIMEOUT_S), 0))
        s.connect(path)
        s.settimeout(TIMEOUT_S)
        return s

    for _ in range(LINK_CONNS):
        connect()
    try:
        late = connect()  # the link is full: one more is closed at once
        assert late.recv(16) == b""
        silent.remove(late)
        late.close()
        for s in silent:  # each is ended (the worker's housekeeping looks once a second)
            s.settimeout(SILENT_GRACE_S + 10)
            assert s.recv(16) == b""
        w.wait_log("sent nothing within")
        with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
            wait_service(c, "echo")
            _until_pinned(c, "echo")
            assert type(_lease_socket(c, "echo")) is LinkConn
            before = c.pinned_replies
            _echo(c, "echo", 2)
            assert c.pinned_replies == before + 1
    finally:
        for s in silent:
            s.close()
    assert w.p.poll() is None
