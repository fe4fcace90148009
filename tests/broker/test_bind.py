"""Where the broker binds: an ipc socket file a dead broker left is replaced, one a running
process serves is not taken from it (broker.server._ipc_served), and the descriptor limit a
broker and a worker raise at start (broker.protocol.limits); at close, only its own files go;
and an in-process broker's actions each carried out whatever another raises."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from broker.server import _ipc_served
from tests.children import readline_within

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_a_stale_socket_file_is_not_served(tmp_path):
    path = str(tmp_path / "stale.ipc")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the file stays, nobody listens: what a SIGKILLed broker leaves
    assert os.path.exists(path) and not _ipc_served(path)
    assert not _ipc_served(str(tmp_path / "gone.ipc"))


def test_a_listener_is_served_even_with_its_backlog_full(tmp_path):
    path = str(tmp_path / "live.ipc")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(0)
    pending = []
    try:
        assert _ipc_served(path)
        # A stopped broker whose clients keep reconnecting: connects fail with EAGAIN at
        # once.  That is still a running process's socket.
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            pending.append(c)
        else:
            pytest.skip("the backlog never filled")
        assert _ipc_served(path)
    finally:
        for c in pending:
            c.close()
        lst.close()


def _lowered(soft: int):
    def pre() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
    return pre


def _soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise KeyError("Max open files")


def test_the_broker_raises_its_descriptor_limit_to_the_hard_one(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "broker", "--frontend", f"ipc://{tmp_path}/fe.ipc",
                          "--backend", f"ipc://{tmp_path}/be.ipc"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=_lowered(256))
    try:
        line = readline_within(p.stdout, 30, "the broker's READY")
        assert line.startswith(b"READY"), p.stderr.read() if p.poll() is not None else line
        assert _soft_limit(p.pid) == want
    finally:
        p.terminate()
        assert p.wait(30) == 0
        p.stdout.close()
        p.stderr.close()


def test_raise_nofile_limit_in_a_child():
    code = "from broker.protocol.limits import raise_nofile_limit; print(*raise_nofile_limit())"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       preexec_fn=_lowered(256))
    soft, hard = map(int, r.stdout.split())
    assert soft == (min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20)


def test_a_peer_that_connects_as_the_broker_binds_is_seen(tmp_path, monkeypatch):
    """The connection monitors are attached before the bind: a worker and a client that
    connect the moment the endpoints exist (redialling a restarted broker) have their
    ACCEPTED events heard, so the descriptor headroom counts them and a client's
    connection has its accept time.  Attached after, as before, both events were lost."""
    import zmq

    from broker import server as S

    ctx = zmq.Context.instance()
    peers = []
    real_bind = S.Broker._bind  # a staticmethod

    def bind_then_connect(sock, ep):
        real_bind(sock, ep)
        # A peer connects now, and the test waits until its handshake is done: the broker's
        # libzmq has accepted it before the constructor goes on.
        peer = ctx.socket(zmq.DEALER)
        peers.append(peer)
        mon = peer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            peer.connect(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            assert mon.poll(10_000), f"no handshake with {ep}"
        finally:
            peer.disable_monitor()
            mon.close(0)

    monkeypatch.setattr(S.Broker, "_bind", staticmethod(bind_then_connect))
    broker = S.Broker(S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc"),
                      ctx=ctx)
    accepted = []
    monkeypatch.setattr(broker, "_accepted", lambda: accepted.append(1))
    try:
        assert len(peers) == 2
        for events, read in ((broker._frontend_events, broker._on_frontend_events),
                             (broker._backend_events, broker._on_backend_events)):
            assert events.poll(10_000), "the accepted connection's event was lost"
            read()
        assert len(accepted) == 2 and len(broker._accept_ticks) == 1
    finally:
        for p in peers:
            p.close(0)
        broker.close()


def test_a_closing_broker_leaves_the_socket_files_of_its_successor(tmp_path, monkeypatch):
    """A broker started on the same paths the moment an old one's sockets closed (a
    supervisor's overlapping restart, a handover) binds files of its own there; the old
    one's close then removed them by path: the new broker served on, but no client or
    worker could connect to it again, and nothing said why.  Now a broker removes only the
    files it bound (their inode)."""
    import time

    import zmq

    from broker import server as S

    ctx = zmq.Context.instance()
    cfg = S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    paths = [str(tmp_path / "fe.ipc"), str(tmp_path / "be.ipc")]
    old = S.Broker(cfg, ctx=ctx)
    new = []
    stop_curve = old._curve.stop

    def successor_binds():
        # Between the old broker's sockets closing and its removal of the files: the
        # successor finds them served by nobody and binds its own.
        stop_curve()
        deadline = time.monotonic() + 10
        while any(S._ipc_served(p) for p in paths):
            assert time.monotonic() < deadline, "the old broker's listeners never closed"
            time.sleep(0.005)
        new.append(S.Broker(cfg, ctx=ctx))

    monkeypatch.setattr(old._curve, "stop", successor_binds)
    old.close()
    try:
        assert len(new) == 1
        for p in paths:
            assert os.path.exists(p) and S._ipc_served(p), f"the closing broker removed its successor's {p}"
    finally:
        for b in new:
            b.close()
    assert not any(os.path.exists(p) for p in paths)  # the successor removes its own


def test_an_action_that_raises_costs_the_others_nothing(tmp_path, monkeypatch, caplog):
    """The scheduler's actions of one event are carried out whatever one of them raises (a
    peer's message no check foresaw): a Dispatch after it was skipped, and its request,
    counted at its worker, never left the broker (the review of the buggy-worker hunt)."""
    import zmq

    from broker import server as S
    from broker.state import Dispatch

    broker = S.Broker(S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc"),
                      ctx=zmq.Context.instance())
    sent = []

    def dispatch(a, now):
        if a.token == 1:
            raise IndexError("a header no check foresaw")
        sent.append(a.token)

    monkeypatch.setattr(broker, "_dispatch", dispatch)
    try:
        acts = [Dispatch(b"w", token, b"c", token, "svc", None, 0.0, None, 0) for token in (1, 2, 3)]
        with caplog.at_level("ERROR", logger="broker"):
            broker._act(acts, 1.0)
        assert sent == [2, 3]
        assert broker.malformed == 1 and "went on with the rest" in caplog.text
    finally:
        broker.close()
