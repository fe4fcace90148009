"""A client message read after its connection closed is not attributed to whoever got the
connection's descriptor number next.

libzmq keeps what a connection sent (up to the high-water mark) after the connection
closes, and its I/O thread reuses the descriptor number for the next connection it accepts;
ZMQ_SRCFD names the number.  The fuzz audit saw a client dropped for not reading have its
left-behind requests dispatched under another process's pid (the one whose new connection
took the number), and that process's request lost.  The broker checks the number against
the pid libzmq read for the message's own connection ("Peer-Address") and drops what was
left behind.

Real sockets and real processes; the broker's loop is stepped by hand (`Broker._drain`), so
that the close and the reuse happen between a message's arrival and its read, as they did
under load."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from broker import protocol as P
from broker.server import Broker, BrokerConfig, _fd_peer_pid
from tests.children import readline_within
from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED and /proc: Linux")

# A client process driven line by line: "open" a connection (a DEALER), "send N" a REQUEST
# with id N on the last one, "close" it; each answered "ok".
_PEER = """
import sys, zmq
from broker import protocol as P
ctx = zmq.Context.instance()
socks = []
print("ok", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "open":
        s = ctx.socket(zmq.DEALER)
        s.connect(sys.argv[1])
        socks.append(s)
    elif cmd == "send":
        socks[-1].send_multipart(P.client_request("svc", [P.encode_header(P.Request(id=int(arg), pid=1))]))
    elif cmd == "close":
        socks.pop().close(linger=0)
    print("ok", flush=True)
"""


class _Peer:
    def __init__(self, endpoint: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _PEER, endpoint], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        readline_within(self.proc.stdout, 30, "the peer's start")

    def do(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        assert readline_within(self.proc.stdout, 10, f"the peer's answer to {cmd!r}") == "ok\n"

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.002)


def _conns_of(pid: int) -> set[int]:
    """This process's descriptors that are unix-domain connections made by ``pid``."""
    return {int(fd) for fd in os.listdir("/proc/self/fd") if _fd_peer_pid(int(fd)) == pid}


def _take_number(peer: _Peer, fd: int) -> None:
    """Have ``peer`` open connections until the broker's libzmq accepted one on ``fd``."""
    for _ in range(64):
        peer.do("open")
        try:
            _until(lambda: _fd_peer_pid(fd) == peer.proc.pid, f"a connection of the peer on descriptor {fd}", 0.5)
            return
        except TimeoutError:
            continue
    pytest.fail(f"descriptor {fd} was not reused within 64 connections")


def _peer_address_has_pid(tmp_path) -> None:
    """Skip where libzmq puts no pid in a message's Peer-Address (built without SO_PEERCRED):
    the broker cannot tell a left-behind message there (docs/protocol.md, section 2)."""
    from broker.server import _said_pid

    ctx = zmq.Context.instance()
    r, d = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        r.bind(f"ipc://{tmp_path}/probe.ipc")
        d.connect(f"ipc://{tmp_path}/probe.ipc")
        d.send(b"x")
        assert r.poll(10_000)
        frames = r.recv_multipart(copy=False)
        if _said_pid(frames[1]) != os.getpid():
            pytest.skip("this libzmq puts no pid in Peer-Address")
    finally:
        r.close(0)
        d.close(0)


@pytest.fixture
def stepped(tmp_path):
    """A broker whose loop the test steps, a worker of "svc" that records what it is sent,
    and the two client processes: (broker, dispatched pids by request id, peer a, peer b)."""
    cfg = BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    b = Broker(cfg)
    dispatched: dict[int, int | None] = {}

    def to_worker(frames):
        msg = P.parse_broker_to_worker(frames[1:])
        if msg.command == P.W_REQUEST:
            req = P.decode_request(msg.body[0])
            dispatched[req.id] = req.pid

    b.send_to_worker = to_worker
    _peer_address_has_pid(tmp_path)
    b.on_worker([zmq.Frame(b"W"), *(zmq.Frame(bytes(f)) for f in P.worker_ready(
        "svc", P.Ready(credit=64, host=P.local_host_id(), transports=["inline"])))])
    a = _Peer(cfg.frontend)
    c = _Peer(cfg.frontend)
    try:
        yield b, dispatched, a, c
    finally:
        a.stop()
        c.stop()
        b.close()


def _step(b: Broker) -> None:
    b._drain(b.frontend, b.on_client)


def test_a_dropped_clients_left_behind_request_is_not_another_processes(stepped):
    """The audit's case: a client dropped for not reading (its connection shut down by the
    broker) had sent more; read after another process's connection took its number."""
    b, dispatched, a, c = stepped
    a.do("open")
    a.do("send 1")
    _until(lambda: b.frontend.poll(0), "the first request")
    _step(b)
    assert dispatched == {1: a.proc.pid}  # learned: the kernel's word for a's connection
    (fd,) = _conns_of(a.proc.pid)
    a.do("send 2")
    _until(lambda: b.frontend.poll(0), "the second request, in the broker's queue")
    ident = next(i for i, f in b._client_conn.items() if f == fd)
    b._stalled(ident, "the test says so")  # as at "stopped reading": dropped, its connection shut
    b._drop_doomed()
    _until(lambda: _fd_peer_pid(fd) != a.proc.pid, "the shut connection's descriptor to close")
    _take_number(c, fd)  # another process's connection on the same number
    _step(b)
    assert 2 not in dispatched  # dropped: nobody reads its answer (it went under c's pid)
    # c itself is served as itself on that number.
    c.do("send 3")
    _until(lambda: b.frontend.poll(0), "c's request")
    _step(b)
    assert dispatched == {1: a.proc.pid, 3: c.proc.pid}


def test_a_dropped_clients_left_behind_request_is_dropped_when_its_own_process_has_the_number(stepped):
    """The same, with the dropped client's own process on the number again (our SDK makes a
    new connection after such a drop, and sends its calls again on it): the left-behind
    copy is not run beside the resent one (the review)."""
    b, dispatched, a, _ = stepped
    a.do("open")
    a.do("send 1")
    _until(lambda: b.frontend.poll(0), "the first request")
    _step(b)
    (fd,) = _conns_of(a.proc.pid)
    a.do("send 2")
    _until(lambda: b.frontend.poll(0), "the second request, in the broker's queue")
    ident = next(i for i, f in b._client_conn.items() if f == fd)
    b._stalled(ident, "the test says so")
    b._drop_doomed()
    _until(lambda: _fd_peer_pid(fd) != a.proc.pid, "the shut connection's descriptor to close")
    _take_number(a, fd)  # a's new connection on the same number
    _step(b)
    assert 2 not in dispatched
    a.do("send 3")
    _until(lambda: b.frontend.poll(0), "the new connection's request")
    _step(b)
    assert dispatched == {1: a.proc.pid, 3: a.proc.pid}


def test_the_pid_libzmq_read_for_a_connection_is_parsed_from_its_peer_address():
    from broker.server import _said_pid

    class Frame:
        def __init__(self, addr):
            self.addr = addr

        def get(self, name):
            assert name == "Peer-Address"
            if isinstance(self.addr, Exception):
                raise self.addr
            return self.addr

    assert _said_pid(Frame("localhost:1000:1000:4242")) == 4242  # ipc: <address>:<uid>:<gid>:<pid>
    for other in ("127.0.0.1", "2001:db8::1:2:3", "::1:2:3", "::1", "", "localhost:a:b:c", "x:1:2:3:4",
                  zmq.ZMQError(22), None):
        assert _said_pid(Frame(other)) is None, other


def test_a_first_message_read_after_its_connection_closed_is_nobodys(stepped):
    """A client that sent one request and closed before the broker read it: by the read, its
    descriptor number is another process's connection."""
    b, dispatched, a, c = stepped
    a.do("open")
    _until(lambda: len(_conns_of(a.proc.pid)) == 1, "a's connection")
    (fd,) = _conns_of(a.proc.pid)
    a.do("send 1")
    _until(lambda: b.frontend.poll(0), "the request, in the broker's queue")
    a.do("close")
    _until(lambda: _fd_peer_pid(fd) != a.proc.pid, "a's descriptor to close")
    _take_number(c, fd)
    _step(b)
    assert dispatched == {}  # not under c's pid; nobody is there to answer
    c.do("send 2")
    _until(lambda: b.frontend.poll(0), "c's request")
    _step(b)
    assert dispatched == {2: c.proc.pid}
