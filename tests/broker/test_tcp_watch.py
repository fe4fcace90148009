"""wire.TcpWatch and wire.tcp_counts on real loopback connections: what counts as bytes
moving (a peer's liveness while a long message crosses), and what does not."""
from __future__ import annotations

import os
import select
import socket

import pytest
import zmq

from broker.protocol.wire import TcpWatch, tcp_counts


@pytest.fixture
def pair():
    """A connected loopback TCP pair (client, server side), the server's receive buffer
    small, so that a peer that does not read stops acknowledging soon."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited by the accepted socket
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    c = socket.create_connection(lst.getsockname(), timeout=5)
    s, _ = lst.accept()
    lst.close()
    yield c, s
    c.close()
    s.close()


@pytest.fixture
def zmq_pair():
    """A ROUTER bound on tcp loopback and a DEALER connected to it (router, dealer)."""
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.ROUTER)
    d = ctx.socket(zmq.DEALER)
    try:
        for x in (r, d):
            x.linger = 0
        port = r.bind_to_random_port("tcp://127.0.0.1")
        d.connect(f"tcp://127.0.0.1:{port}")
        yield r, d
    finally:
        r.close()
        d.close()


def _carry(pair, data: bytes) -> list:
    """Send `data` from the pair's DEALER and return the frames its ROUTER received
    ([identity, data]; zmq.Frame, so that `TcpWatch.note` can ask where they came from)."""
    r, d = pair
    d.send(data)
    assert r.poll(5000)
    return r.recv_multipart(copy=False)


def _read(sock: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        assert select.select([sock], [], [], 5)[0], "nothing to read"
        got += len(sock.recv(n - got))


def test_bytes_received_are_movement(pair):
    c, s = pair
    w = TcpWatch()
    w.use(s.fileno())
    assert w.look(1.0) == float("-inf")  # the first look only counts
    assert w.look(2.0) == float("-inf")  # nothing moved
    c.sendall(b"x" * 1000)
    _read(s, 1000)
    assert w.look(3.0) == 3.0
    assert w.look(4.0) == 3.0
    acked, received, backlog = tcp_counts(s.fileno())
    assert received >= 1000 and not backlog


def test_acknowledgements_alone_are_not_movement_but_an_upload_under_way_is(pair):
    """The peer's kernel acknowledges a heartbeat even when its process hangs: that is no
    sign of life.  Bytes of ours acknowledged while more wait to go are an upload under
    way; once the peer stops reading and its buffer is full, nothing moves any more."""
    c, s = pair
    w = TcpWatch()
    w.use(c.fileno())
    w.look(1.0)
    c.sendall(b"h" * 20)  # a heartbeat to a peer that does not read
    deadline = 50
    while tcp_counts(c.fileno())[2] and deadline:  # wait for its acknowledgement (a condition)
        select.select([], [], [], 0.01)
        deadline -= 1
    assert w.look(2.0) == float("-inf")
    c.setblocking(False)
    sent = 0
    try:
        while True:  # fill both buffers: the peer's process reads nothing
            sent += c.send(b"u" * 65536)
    except BlockingIOError:
        pass
    assert tcp_counts(c.fileno())[2]  # ours wait to go
    _read(s, 65536)  # the peer reads some: acknowledgements, with ours still waiting
    # The window reopens: ours move on (a moment), acknowledged while more wait.
    for _ in range(100):
        if w.look(3.0) == 3.0:
            break
        select.select([], [], [], 0.01)
    assert w.moved_at == 3.0
    # The peer reads nothing more: once its buffer is full again, no acknowledgement moves.
    for _ in range(100):
        before = tcp_counts(c.fileno())[0]
        select.select([], [], [], 0.05)  # polling kernel counts: no event says they settled
        if tcp_counts(c.fileno())[0] == before:
            break
    settled = w.look(4.0)
    select.select([], [], [], 0.2)
    assert w.look(5.0) == settled


def test_heartbeats_to_a_hung_peer_are_not_movement(pair):
    """Ours acknowledged by the kernel of a peer whose process hangs, each look right after
    a heartbeat (ours then still waits for its acknowledgement): never a sign of life."""
    c, s = pair
    for _ in range(30):  # a live exchange first
        c.sendall(b"a" * 60)
        _read(s, 60)
        s.sendall(b"b" * 60)
        _read(c, 60)
    w = TcpWatch()
    w.use(c.fileno())
    w.look(0.0)
    for i in range(1, 21):  # the peer hangs: it never reads or sends again
        select.select([], [], [], 0.02)  # heartbeat spacing; the acknowledgement comes meanwhile
        c.sendall(b"h" * 40)
        assert w.look(float(i)) == float("-inf"), i


def test_a_message_noted_starts_the_looks_afresh(zmq_pair):
    """Counts from before a message are no baseline for the next silence; and a watch a
    look switched off (the connection was gone) comes back with the next message, even on
    the same descriptor number."""
    frames = _carry(zmq_pair, b"one")
    w = TcpWatch()
    w.note(frames[1])
    w.look(1.0)
    frames = _carry(zmq_pair, b"two")
    w.note(frames[1])  # heard: the bytes of "two" are no movement for the next silence
    assert w.look(2.0) == float("-inf")
    w._off = True  # as after a look that found the connection gone
    w.note(_carry(zmq_pair, b"x" * 10_000)[1])
    w.look(3.0)
    _carry(zmq_pair, b"y" * 10_000)
    assert w.look(4.0) == 4.0


def test_a_socket_that_is_not_tcp_is_never_looked_at_again(tmp_path):
    a, b = socket.socketpair()
    try:
        assert tcp_counts(a.fileno()) is None
        w = TcpWatch()
        w.use(a.fileno())
        assert w.look(1.0) == float("-inf")
        b.sendall(b"x")
        assert w.look(2.0) == float("-inf")
    finally:
        a.close()
        b.close()
    gone = os.dup(0)
    os.close(gone)
    assert tcp_counts(gone) is None  # no such descriptor (just closed)
    with open(tmp_path / "plain", "wb") as f:  # not a socket: its duplicate is closed again
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            assert tcp_counts(f.fileno()) is None
        assert len(os.listdir("/proc/self/fd")) == before


def test_a_reused_descriptor_is_not_the_same_connection(pair):
    """The descriptor noted closes and its number carries another connection: that one's
    bytes say nothing of the first peer."""
    c, s = pair
    w = TcpWatch()
    fd = c.fileno()
    w.use(fd)
    w.look(1.0)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    other = socket.socket()
    c.close()
    os.dup2(other.fileno(), fd)  # the number now names a socket to somewhere else
    other.close()
    sock = peer = None
    try:
        os.set_blocking(fd, True)
        sock = socket.socket(fileno=fd)
        sock.connect(lst.getsockname())
        peer, _ = lst.accept()
        peer.sendall(b"y" * 100)
        _read(sock, 100)
        assert w.look(2.0) == float("-inf")
    finally:
        for x in (peer, sock, lst):
            if x is not None:
                x.close()


def test_note_takes_the_connection_a_message_came_on(zmq_pair):
    frames = _carry(zmq_pair, b"hello")
    w = TcpWatch()
    w.note(frames[1])
    assert w.fd >= 0 and tcp_counts(w.fd) is not None
    w.look(1.0)
    _carry(zmq_pair, b"z" * 10_000)
    assert w.look(2.0) == 2.0
    w.note(b"not a frame")  # no descriptor to learn: kept as it was
    assert w.look(3.0) == 2.0
