"""The local link (broker/protocol/link.py, docs/protocol.md section 10.6): its framing, and
its server against peers that misbehave (garbage, a message in pieces, another uid, too many
connections, a client that stops reading), with real Unix sockets and no worker."""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import tempfile
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol as P
from broker.protocol.link import LINK_DATAGRAM, LinkConn, LinkError, LinkServer, decode, encode

TIMEOUT_MS = 5000


@pytest.fixture
def path():
    d = tempfile.mkdtemp(prefix="lk", dir="/tmp")  # short: sun_path holds 108 bytes
    yield os.path.join(d, "w.link")
    shutil.rmtree(d, ignore_errors=True)


def _readable(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(TIMEOUT_MS))


def _server_recv(server: LinkServer) -> list:
    assert _readable(server.fileno()), "the link server saw nothing"
    msg = server.recv()
    while msg is None:  # an accept first, the datagram next
        assert _readable(server.fileno()), "the link server saw nothing"
        msg = server.recv()
    return msg


def _client_recv(conn: LinkConn, server: LinkServer | None = None) -> list:
    """The client's next message; the server, as a worker's loop would, writes what waits in
    its outboxes when its descriptor says the socket has room."""
    p = select.poll()
    p.register(conn.fileno(), select.POLLIN)
    if server is not None:
        p.register(server.fileno(), select.POLLIN)
    while True:
        if server is not None:
            server.pump()
        msg = conn.recv()
        if msg is not None:
            return msg
        assert p.poll(TIMEOUT_MS), "the client got nothing"


def _whole(m) -> bytes:
    return b"".join(bytes(x) for x in m)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=12))
def test_one_datagram_messages_decode_to_their_frames(frames):
    [dgram] = encode(frames)
    buf = b"".join(bytes(memoryview(b).cast("B")) if type(b) is not bytes else b for b in dgram)
    assert [bytes(f) for f in decode(buf)] == frames


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 40))
def test_truncated_or_padded_messages_are_refused(data, cut):
    [dgram] = encode([data, b"abc"])
    buf = b"".join(bytes(b) for b in dgram)
    if cut:
        with pytest.raises(LinkError):
            decode(buf[:-cut] if cut < len(buf) else buf[:1])
    with pytest.raises(LinkError):
        decode(buf + b"x")


def test_a_large_reply_comes_in_pieces_and_whole(path):
    server = LinkServer(path)
    conn = LinkConn(path)
    try:
        assert conn.send([P.MDPC, P.C_HEARTBEAT])
        route = _server_recv(server)[0]
        big = np.arange(300_000, dtype=np.uint8)
        assert len(encode([b"h", big])) > 1
        assert server.send(route, [P.MDPC, P.C_FINAL, b"svc", b"h", big])
        assert server.send(route, [b"after"])  # order kept behind the pieces
        m = _client_recv(conn, server)
        assert [bytes(x) for x in m[:4]] == [P.MDPC, P.C_FINAL, b"svc", b"h"]
        np.testing.assert_array_equal(np.frombuffer(m[4], np.uint8), big)
        assert [bytes(x) for x in _client_recv(conn, server)] == [b"after"]
        # Frames of any buffer shape, cut across their boundaries (a 2-D float array, a
        # small frame between two large ones).
        grid = np.arange(200_000, dtype=np.float32).reshape(400, 500)
        assert server.send(route, [b"h", grid, b"mid", big])
        m = _client_recv(conn, server)
        np.testing.assert_array_equal(np.frombuffer(m[1], np.float32).reshape(400, 500), grid)
        assert bytes(m[2]) == b"mid"
        np.testing.assert_array_equal(np.frombuffer(m[3], np.uint8), big)
        # A client sends nothing that does not fit one datagram (the SDK sends it through the broker).
        assert not conn.send([np.zeros(LINK_DATAGRAM, np.uint8)])
    finally:
        conn.close()
        server.close()
    assert not os.path.exists(path)


def test_a_peer_that_sends_garbage_is_cut_off_alone(path):
    server = LinkServer(path)
    good = LinkConn(path)
    bad = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
    try:
        for s in bad:
            s.connect(path)
        bad[0].send(b"\x00\xff\xff")                    # 65535 frames, no sizes
        bad[1].send(b"\x01" + b"\x00" * 40)             # "more follows": a client sends one datagram
        bad[2].send(b"\x00\x01\x00\x10\x00\x00\x00ab")  # one frame of 16 bytes, 2 there
        bad[3].send(b"")                                # an empty datagram
        assert good.send([P.MDPC, P.C_HEARTBEAT, b"x" * 10])
        got, ended = [], set()
        while len(ended) < 4 or not got:
            assert _readable(server.fileno()), "the server stopped reading"
            while (m := server.recv()) is not None:
                if bytes(m[2]) == P.C_DISCONNECT:
                    ended.add(bytes(m[0]))
                else:
                    got.append(m)
        assert [bytes(x) for x in got[0][1:]] == [P.MDPC, P.C_HEARTBEAT, b"x" * 10]
        # (an empty datagram reads as the end of the connection: ended, not counted malformed)
        assert bytes(got[0][0]) not in ended and server.malformed == 3 and len(server) == 1
        for s in bad:  # each one's connection closed
            s.settimeout(5)
            assert s.recv(10) == b""
        assert server.send(bytes(got[0][0]), [b"still here"])
        assert [bytes(x) for x in _client_recv(good, server)] == [b"still here"]
    finally:
        for s in bad:
            s.close()
        good.close()
        server.close()


def test_another_uid_and_one_connection_too_many_are_refused(path):
    other = LinkServer(path, uid=os.geteuid() + 1)
    try:
        conn = LinkConn(path)  # the kernel accepts; the server closes it at once
        other.pump()
        assert _readable(conn.fileno())
        with pytest.raises(EOFError):
            assert conn.recv() is None and False
        conn.close()
        assert other.refused == 1 and len(other) == 0
    finally:
        other.close()
    server = LinkServer(path, max_conns=1)
    a = LinkConn(path)
    b = LinkConn(path)
    try:
        a.send([b"a"])
        assert bytes(_server_recv(server)[1]) == b"a"
        assert _readable(b.fileno())
        with pytest.raises(EOFError):
            b.recv()
        assert server.refused == 1 and len(server) == 1
    finally:
        a.close()
        b.close()
        server.close()


def test_replies_to_a_client_that_stops_reading_wait_then_leave_in_order(path):
    server = LinkServer(path, max_queue=100_000)
    conn = LinkConn(path)
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        n = 0
        while not server._routes[route].outbox:  # fill the kernel's buffer: the rest waits in the outbox
            assert server.send(route, [n.to_bytes(4, "little"), b"y" * 1000])
            n += 1
            assert n < 100_000
        for _ in range(50):
            server.send(route, [n.to_bytes(4, "little"), b"y" * 1000])
            n += 1
        for i in range(n):  # every reply, in order, as the client reads
            m = _client_recv(conn, server)
            assert int.from_bytes(bytes(m[0]), "little") == i
        assert server.dropped == 0
        conn.close()
        assert bytes(_server_recv(server)[2]) == P.C_DISCONNECT  # its end, as a DISCONNECT
        assert not server.send(route, [b"gone"]) and server.dropped == 1
    finally:
        conn.close()
        server.close()


def _until_end(conn: LinkConn, server: LinkServer) -> list:
    """Every message the client reads until the worker's side ends the connection (EOFError),
    the server writing its outboxes meanwhile as a worker's loop would."""
    got = []
    while True:
        try:
            got.append(_client_recv(conn, server))
        except EOFError:
            return got


@contextlib.contextmanager
def _pair(path: str, **kw):
    """A link server (``kw``: its caps) and one client connected to it: (server, conn, route)."""
    server = LinkServer(path, **kw)
    conn = LinkConn(path)
    try:
        conn.send([b"hi"])
        yield server, conn, _server_recv(server)[0]
    finally:
        conn.close()
        server.close()


def _retire(server: LinkServer, route: bytes) -> int:
    """Send to ``route`` until a reply finds its outbox at a cap (the connection retires);
    how many replies went."""
    n = 0
    while server.send(route, [n.to_bytes(4, "little"), b"z" * 4000]):
        n += 1
        assert n < 100_000
    return n


def test_a_reply_that_finds_the_outbox_full_retires_the_connection(path):
    """Where a ROUTER past its high-water mark would drop the reply and leave its client
    waiting for a deadline, the link retires the connection: that reply and every later one
    are dropped and counted, the worker gets the connection's DISCONNECT at once, nothing
    more is read from it, what the outbox held still arrives, in order, and then the client
    reads the end (and sends what still waits through the broker: client_sdk.pins)."""
    server = LinkServer(path, max_queue=3)
    conn = LinkConn(path)
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        assert conn.send([b"unread"])  # still in the socket when it retires: dropped, not a reset
        sent = _retire(server, route)
        assert server.dropped == 1 and server.retired == 1 and route not in server
        assert server.inbox and list(map(bytes, server.inbox.popleft())) == [route, P.MDPC, P.C_DISCONNECT]
        assert not server.send(route, [b"later"]) and server.dropped == 2
        assert not conn.send([b"refused"])  # shut for reading: the client sends elsewhere
        got = _until_end(conn, server)
        assert [int.from_bytes(bytes(m[0]), "little") for m in got] == list(range(sent))
        assert not server.inbox and len(server) == 0  # closed once its outbox left, no second DISCONNECT
    finally:
        conn.close()
        server.close()


def test_what_a_retiring_connection_sent_and_the_worker_had_not_taken_is_dropped(path):
    """Messages of the connection already read into the inbox, not yet taken by the worker,
    do not run: the client sends them through the broker once it reads the end."""
    server = LinkServer(path, max_queue=2)
    conn, other = LinkConn(path), LinkConn(path)
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        other.send([b"hello"])
        other_route = _server_recv(server)[0]
        assert conn.send([b"request"]) and other.send([b"theirs"])
        while len(server.inbox) < 2:
            assert _readable(server.fileno())
            server.pump()
        _retire(server, route)
        assert [bytes(m[0]) for m in server.inbox] == [other_route, route]  # theirs, then our DISCONNECT
        assert bytes(server.inbox[-1][2]) == P.C_DISCONNECT and bytes(server.inbox[0][1]) == b"theirs"
    finally:
        conn.close()
        other.close()
        server.close()


def test_a_retiring_connection_whose_client_goes_away_ends_without_a_second_disconnect(path):
    with _pair(path, max_queue=2) as (server, conn, route):
        _retire(server, route)
        assert server.retired == 1 and len(server.inbox) == 1  # its DISCONNECT
        server.inbox.clear()
        conn.close()
        deadline = time.monotonic() + 10
        while len(server):
            assert time.monotonic() < deadline, "the retiring connection was never ended"
            assert _readable(server.fileno())
            server.pump()
        assert not server.inbox


def test_a_retiring_connection_whose_client_never_reads_again_is_ended_after_its_grace(path):
    """A client that stopped reading for good must not keep the worker's memory (its outbox,
    up to the cap) and a descriptor for ever: `expire`, from the worker's housekeeping,
    ends the connection `grace` seconds after it retired, with what still waited (counted
    as dropped).  The client then reads what had reached its socket, then the end."""
    with _pair(path, max_queue=2) as (server, conn, route):
        n = _retire(server, route)
        retired_at = time.monotonic()
        server.inbox.clear()  # its DISCONNECT, given at retirement
        assert server.expire(retired_at + 5.0, grace=10.0) == 0 and len(server) == 1  # not yet
        dropped = server.dropped
        assert server.expire(retired_at + 10.5, grace=10.0) == 1
        assert len(server) == 0 and not server.inbox  # no second DISCONNECT
        assert server.dropped > dropped  # what its outbox still held
        got = _until_end(conn, server)
        assert [int.from_bytes(bytes(m[0]), "little") for m in got] == list(range(len(got)))
        assert len(got) < n  # the rest was in the outbox, dropped
        assert server.expire(retired_at + 100.0) == 0


def test_close_with_a_retiring_connection_lets_its_outbox_leave_then_ends_it(path):
    import threading

    with _pair(path, max_queue=2) as (server, conn, route):
        n = _retire(server, route)
        got: list = []

        def read():
            try:
                while True:
                    m = conn.recv()
                    if m is not None:
                        got.append(int.from_bytes(bytes(m[0]), "little"))
                    elif not _readable(conn.fileno()):
                        return
            except EOFError:
                got.append("end")

        t = threading.Thread(target=read)
        t.start()
        server.close(linger_ms=10_000)
        t.join(10)
        assert not t.is_alive() and got == [*range(n), "end"]


def test_the_outbox_cap_counts_whole_messages_not_their_datagrams(path):
    """A reply of several datagrams is one message against ``max_queue``; every one of the
    messages the cap lets in arrives whole and in order, before the end."""
    server = LinkServer(path, max_queue=5)
    conn = LinkConn(path)
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        peer = server._routes[route]
        big = b"b" * (3 * LINK_DATAGRAM)  # four datagrams each
        n = 0
        while server.send(route, [n.to_bytes(4, "little"), big]):
            n += 1
            assert n < 10_000
        assert server.dropped == 1 and peer.queued == 5 and len(peer.outbox) > 5
        got = _until_end(conn, server)
        assert [(int.from_bytes(bytes(m[0]), "little"), bytes(m[1]) == big) for m in got] == [(i, True)
                                                                                             for i in range(n)]
        assert peer.queued == 0 and peer.queued_bytes == 0
    finally:
        conn.close()
        server.close()


def test_the_outbox_is_bounded_in_bytes_and_large_replies_are_not_refused_for_their_size(path):
    """A client that stops reading holds at most ``max_queue_bytes`` of the worker's memory,
    plus one message; below the cap a reply goes however large, so two replies each larger
    than half the cap, back to back, both arrive (a reader that keeps up loses nothing).  A
    client that reads never meets the cap."""
    cap = 1 << 20
    server = LinkServer(path, max_queue_bytes=cap)
    conn = LinkConn(path)
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        peer = server._routes[route]
        big = np.full(cap * 3 // 4, 7, np.uint8)
        for i in range(3):  # read as it comes: never retired
            assert server.send(route, [b"%d" % i, big])
            assert bytes(_client_recv(conn, server)[0]) == b"%d" % i
        assert server.retired == 0 and route in server
        assert server.send(route, [b"1", big]) and peer.outbox  # most of it waits
        assert server.send(route, [b"2", big])  # 1.5 caps in all: the backlog was under the cap
        assert cap <= peer.queued_bytes < 2 * cap  # the cap plus one message at most
        assert not server.send(route, [b"3", b"x"]) and server.dropped == 1 and server.retired == 1
        got = _until_end(conn, server)
        assert [bytes(m[0]) for m in got] == [b"1", b"2"] and all(bytes(m[1]) == big.tobytes() for m in got)
        assert peer.queued == 0 and peer.queued_bytes == 0
    finally:
        conn.close()
        server.close()


def test_a_send_that_may_wait_goes_at_the_pace_of_a_reading_client_and_not_past_a_stopped_one(path):
    """A stream's replies may come faster than a reading client takes them: at the cap, a
    send given ``wait`` blocks while the client reads (its ``tick`` running meanwhile) and
    the reply goes; without it the connection was retired though its client read (found by
    the data hunt: five 20 MB partials at once).  A client that stops reading costs one such
    wait, then the connection retires as before."""
    cap = 1 << 20
    server = LinkServer(path, max_queue_bytes=cap)
    conn = LinkConn(path)
    got, ticks = [], []
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        big = np.full(cap * 3 // 4, 7, np.uint8)

        def read(n):
            for _ in range(n):
                got.append(bytes(_client_recv(conn)[0]))

        reader = threading.Thread(target=read, args=(8,))
        reader.start()
        for i in range(8):  # 6 MiB sent at once: eight times the cap's share
            assert server.send(route, [b"%d" % i, big], wait=5.0, tick=lambda: ticks.append(1))
        while server._routes[route].outbox:  # the rest leaves as the client reads (the loop's job)
            assert _readable_out(server._routes[route].fd), "the client stopped reading"
            server.pump()
        reader.join(TIMEOUT_MS / 1000)
        assert not reader.is_alive()
        assert got == [b"%d" % i for i in range(8)] and server.retired == 0 and server.dropped == 0
        # A client that reads no more: the first reply at the cap waits `wait`, then retires.
        while server.send(route, [b"x", big], wait=0.3, tick=lambda: ticks.append(2)):
            pass
        assert server.retired == 1 and 2 in ticks
    finally:
        conn.close()
        server.close()


def _readable_out(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return bool(p.poll(TIMEOUT_MS))


def test_close_lets_replies_waiting_in_an_outbox_leave_within_the_linger(path):
    import threading

    server = LinkServer(path)
    conn = LinkConn(path)
    got: list = []
    try:
        conn.send([b"hi"])
        route = _server_recv(server)[0]
        big = np.arange(1 << 20, dtype=np.uint8)  # 16 datagrams: most wait in the outbox
        assert server.send(route, [b"h", big]) and server._routes[route].outbox

        def read():
            p = select.poll()
            p.register(conn.fileno(), select.POLLIN)
            while True:
                assert p.poll(TIMEOUT_MS)
                try:
                    m = conn.recv()
                except EOFError:
                    return
                if m is not None:
                    got.append(m)

        t = threading.Thread(target=read)
        t.start()
        server.close(linger_ms=TIMEOUT_MS)  # returns once the outbox is empty
        t.join(TIMEOUT_MS / 1000)
        assert not t.is_alive()
        [m] = got
        np.testing.assert_array_equal(np.frombuffer(m[1], np.uint8), big)
    finally:
        conn.close()
        server.close()


def test_out_of_descriptors_the_listener_refuses_instead_of_spinning(path):
    """EMFILE: the queued connection is taken with the spare descriptor and closed (its
    client sees the end), so the level-triggered listener does not wake the loop forever.
    In a child process: the descriptor limit is lowered for it alone."""
    import subprocess
    import sys

    code = f"""
import os, resource, select
from broker.protocol.link import LinkConn, LinkServer
server = LinkServer({path!r})
conns = [LinkConn({path!r}) for _ in range(4)]
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
server.pump()
p = select.poll()
p.register(server.fileno(), select.POLLIN)
assert server.refused >= 1 and len(server) + server.refused == 4, (server.refused, len(server))
assert not p.poll(0), "the listener still wakes the loop"
assert not server.pump()  # and looking again does not spin either
ended = 0
for c in conns:
    try:
        c.recv()
    except EOFError:
        ended += 1
assert ended == server.refused, (ended, server.refused)
server.close()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "ok", r.stderr


def test_a_direct_socket_whose_link_path_would_be_too_long_has_none(tmp_path, caplog):
    import zmq

    from gpu_worker.leases import DirectSocket

    d = "/tmp/" + "d" * (100 - len("/tmp/") - len("/w.ipc"))
    os.makedirs(d, mode=0o700, exist_ok=True)
    try:
        ipc = os.path.join(d, "w.ipc")
        assert len(ipc) == 100
        ds = DirectSocket(zmq.Context.instance(), path=ipc)
        try:
            assert ds.link is None and "no local link" in caplog.text
        finally:
            ds.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_ready_and_lease_info_check_the_link_and_the_direct_key():
    import zmq.utils.z85 as z85

    from client_sdk.errors import InvalidInput
    from client_sdk.sockets import lease_curve
    from broker.protocol.curve import PeerKeys

    key = z85.encode(bytes(range(32))).decode()
    ok = P.Ready(direct="tcp://10.0.0.1:5557", direct_key=key, link="/run/x/w-1-2-ab.link")
    assert P.decode_ready(P.encode_header(ok)).direct_key == key
    for bad in (P.Ready(direct="ipc:///run/x/w.ipc", direct_key=key),   # a key without tcp
                P.Ready(direct="tcp://10.0.0.1:5557", direct_key="short"),
                P.Ready(link="/run/x/w.link"),                            # a link without a direct socket
                P.Ready(direct="ipc:///run/x/w.ipc", link="relative/w.link"),
                P.Ready(direct="ipc:///run/x/w.ipc", link="/" + "x" * 120)):
        with pytest.raises(P.ProtocolError):
            P.decode_ready(P.encode_header(bad))
    info = P.LeaseInfo(id=1, lease=bytes(8), secret=bytes(16), endpoint="tcp://10.0.0.1:5557", slots=1,
                       instance=bytes(8), server_key="not a key")
    with pytest.raises(P.ProtocolError):
        P.decode_lease_info(P.encode_header(info))
    mine = PeerKeys(server=b"s" * 40, public=b"p" * 40, secret=b"q" * 40)
    assert lease_curve(mine, "ipc:///run/x/w.ipc", None) is None
    got = lease_curve(mine, "tcp://10.0.0.1:5557", key)
    assert got.server == key.encode() and got.public == mine.public and got.secret == mine.secret
    assert lease_curve(None, "tcp://10.0.0.1:5557", None) is None  # --insecure on both sides
    with pytest.raises(InvalidInput):
        lease_curve(mine, "tcp://10.0.0.1:5557", None)  # never in clear with keys
    with pytest.raises(InvalidInput):
        lease_curve(None, "tcp://10.0.0.1:5557", key)


def test_a_reply_in_pieces_that_lies_about_its_length_is_refused(path):
    """The client reads a message in pieces into one buffer of the length its first piece
    declares: a piece that would run past it, or a message that ends short, is an error."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(4)
    try:
        for pieces in ([b"\x01" + b"\x01\x00" + (4).to_bytes(4, "little") + b"ab",  # 4 bytes declared...
                        b"\x00" + b"cdefgh"],                                        # ...6 more come
                       [b"\x01" + b"\x01\x00" + (40).to_bytes(4, "little") + b"ab",  # 40 declared
                        b"\x00" + b"cd"],                                            # ends at 4
                       [b"\x02" + b"\x00\x00"]):                                     # a bad flag
            conn = LinkConn(path)
            s, _ = srv.accept()
            try:
                for p in pieces:
                    s.send(p)
                assert _readable(conn.fileno())
                with pytest.raises(LinkError):
                    while conn.recv() is None:
                        assert _readable(conn.fileno())
            finally:
                s.close()
                conn.close()
    finally:
        srv.close()


def test_a_client_that_closed_with_replies_unread_still_has_its_requests_read(path):
    # Its close resets the connection: the kernel says ECONNRESET once, at the worker's next
    # read, and the requests the client sent before are queued behind it.  The server ended
    # the connection at the error: those requests were lost, run by nobody and counted
    # nowhere (the gone hunt found it beside a pinned client SIGKILLed with replies unread).
    server = LinkServer(path)
    conn = LinkConn(path)
    try:
        assert conn.send([P.MDPC, P.C_HEARTBEAT])
        route = _server_recv(server)[0]
        assert server.send(route, [P.MDPC, P.C_FINAL, b"svc", b"h", b"never read"])
        server.pump()
        assert conn.send([b"req", b"1"]) and conn.send([b"req", b"2"])
        conn.close()  # with the reply unread: a reset, not a plain end of file
        got = [_server_recv(server) for _ in range(3)]
        assert [[bytes(f) for f in m] for m in got] == [
            [route, b"req", b"1"], [route, b"req", b"2"], [route, P.MDPC, P.C_DISCONNECT]]
    finally:
        server.close()


@contextlib.contextmanager
def _bare_worker(path):
    """A client's LinkConn and the worker's end of its connection, a bare socket (no LinkServer
    to read what the client sends)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    conn = LinkConn(path)
    worker, _ = listener.accept()
    try:
        yield conn, worker
    finally:
        conn.close()
        worker.close()
        listener.close()
        os.unlink(path)


@pytest.mark.parametrize("size", [100, 100_000])  # one datagram, and a reply in two pieces (within a send buffer)
def test_a_worker_that_closed_with_requests_unread_still_has_its_replies_read(path, size):
    # The same from the client's side: a worker that exited with requests of ours unread
    # resets the connection, and the replies it sent before are queued behind the error.
    # The client dropped them with the connection: their calls went through the broker again
    # (run twice), a stream's partials were cut.
    with _bare_worker(path) as (conn, worker):
        reply = [P.MDPC, P.C_FINAL, b"svc", b"h", np.arange(size, dtype=np.uint8)]
        for datagram in encode(reply):
            worker.sendmsg(datagram)
        assert conn.send([b"req"])  # never read by the worker
        worker.close()
        m = _client_recv(conn)
        assert [bytes(x) for x in m[:4]] == [P.MDPC, P.C_FINAL, b"svc", b"h"]
        np.testing.assert_array_equal(np.frombuffer(m[4], np.uint8), reply[4])
        with pytest.raises(EOFError):
            _client_recv(conn)


def test_a_worker_that_closed_with_requests_unread_and_nothing_sent_is_an_end_of_file(path):
    # The reset said, nothing queued behind it: the connection's end (EOFError), as a plain
    # close is (the first version read on and handed an empty datagram to the decoder).
    with _bare_worker(path) as (conn, worker):
        assert conn.send([b"req"])  # never read by the worker
        worker.close()
        with pytest.raises(EOFError):
            _client_recv(conn)


def test_a_connection_that_says_nothing_is_ended_after_its_grace_and_one_that_spoke_is_not(path):
    server = LinkServer(path)
    quiet, spoke, late = LinkConn(path), LinkConn(path), LinkConn(path)
    try:
        spoke.send([b"hello"])
        assert bytes(_server_recv(server)[1]) == b"hello"
        while len(server) < 3:  # accepts (quiet and late say nothing yet)
            assert _readable(server.fileno())
            server.pump()
        t0 = time.monotonic()
        assert server.expire(t0 + 1.0, silent_grace=5.0) == 0 and len(server) == 3
        # ``late`` speaks after the loop last read (a long batch): the look reads it first.
        late.send([b"hello at last"])
        assert server.expire(t0 + 6.0, silent_grace=5.0) == 1
        assert len(server) == 2 and server.silent == 1
        got = [server.inbox.popleft() for _ in range(len(server.inbox))]
        assert sorted(b"".join(bytes(f) for f in m[1:]) for m in got) == [P.MDPC + P.C_DISCONNECT, b"hello at last"]
        assert _readable(quiet.fileno())
        with pytest.raises(EOFError):
            quiet.recv()
        assert server.expire(t0 + 60.0, silent_grace=5.0) == 0  # those that spoke stay, however long
    finally:
        for c in (quiet, spoke, late):
            c.close()
        server.close()
