"""An ipc client whose connection is open is alive however quiet it is (broker.server
`_look_at_quiet`), within bounds: not on a descriptor that a message of its closed
connection, read after the close, taught the broker, and not for longer than
`quiet_client_max` since it was last heard.  Driven in-process, step by
step, with an injected clock for everything time-driven."""
from __future__ import annotations

import os
import time

import pytest
import zmq

from broker import protocol as P
from broker.server import Broker, BrokerConfig
from broker.state import Config, Scheduler


def _drain_all(b: Broker, sock, handler) -> None:
    while sock.poll(0):
        b._drain(sock, handler)


@pytest.fixture
def broker(tmp_path):
    cfg = BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    cfg.scheduler.heartbeat_interval = 0.2  # client window 0.6 s
    cfg.scheduler.service_grace = 3600.0  # no worker: a request stays queued, the client's to lose
    ctx = zmq.Context()
    b = Broker(cfg, ctx=ctx)
    socks = []
    try:
        yield b, cfg, ctx, socks
    finally:
        for s in socks:
            s.close(0)
        b.close()
        ctx.term()


def _worker(b, cfg, ctx, socks, ready=None):
    """A DEALER on the backend that said READY for "svc" (with ``ready``), read by the broker."""
    w = ctx.socket(zmq.DEALER)
    socks.append(w)
    w.linger = 0
    w.connect(cfg.backend)
    w.send_multipart(P.worker_ready("svc", ready))
    assert b.backend.poll(5000)
    _drain_all(b, b.backend, b.on_worker)
    return w


def _client(b, cfg, ctx, socks):
    c = ctx.socket(zmq.DEALER)
    socks.append(c)
    c.linger = 5000
    c.connect(cfg.frontend)
    c.send_multipart(P.client_heartbeat())
    assert b.frontend.poll(5000)
    _drain_all(b, b.frontend, b.on_client)
    [ident] = b.sched._clients
    return c, ident


def _looks(b, start: float, seconds: float, step: float = 0.1):
    """The loop's looks and ticks, on the injected clock, from `start` on."""
    t = start
    while t < start + seconds:
        b._look_at_quiet(t, 0.15)
        b._act(b.sched.tick(t), t)
        t += step
    return t


def test_an_open_connection_keeps_a_quiet_client_and_its_request(broker):
    b, cfg, ctx, socks = broker
    c, ident = _client(b, cfg, ctx, socks)
    c.send_multipart(P.client_request("slow", [b"x"]))
    assert b.frontend.poll(5000)
    _drain_all(b, b.frontend, b.on_client)
    now = time.monotonic()
    _looks(b, now, 5.0)  # eight windows of silence
    assert ident in b.sched._clients and b.sched.stats()["requests"] == 1


def test_a_message_left_behind_by_a_closed_connection_does_not_keep_its_client(broker):
    b, cfg, ctx, socks = broker
    c, ident = _client(b, cfg, ctx, socks)
    c.send_multipart(P.client_request("slow", [b"x"]))  # still unread when the close is seen
    socks.remove(c)
    c.close()  # linger: the request goes out first, then the connection closes
    deadline = time.monotonic() + 5
    while ident in b._client_conn:  # the close, applied before the message (as a drain cap can order them)
        assert time.monotonic() < deadline, "the close never came"
        if b._frontend_events.poll(100):  # (connections accepted are events too)
            b._on_frontend_events()
    assert b.frontend.poll(5000)
    _drain_all(b, b.frontend, b.on_client)  # the request: it learns the closed descriptor
    _looks(b, time.monotonic(), 2.0)  # ... which is nobody's now: not kept
    assert ident not in b.sched._clients and b.sched.stats()["requests"] == 0


def test_a_quiet_client_is_kept_no_longer_than_quiet_client_max(broker):
    b, cfg, ctx, socks = broker
    b.sched.config.quiet_client_max = 1.0
    c, ident = _client(b, cfg, ctx, socks)
    now = time.monotonic()
    t = _looks(b, now, 0.9)
    assert ident in b.sched._clients
    _looks(b, t, 1.0)  # past 1 s since heard, and a window more
    assert ident not in b.sched._clients


def test_client_kept_moves_the_window_not_the_last_message():
    s = Scheduler(Config(quiet_client_max=10.0))
    s.client_heartbeat(b"c", 0.0)
    for t in range(1, 11):
        s.client_kept(b"c", float(t))
        s.tick(float(t))
    assert s.quiet(10.0, 0.5) == ([], [])  # kept: its window counts from the last keep
    s.client_kept(b"c", 10.5)  # 10.5 s since heard: not kept any more
    s.tick(13.0)
    assert b"c" not in s._clients
    with pytest.raises(ValueError):
        Scheduler(Config(quiet_client_max=-1))


def test_a_req_client_is_forgotten_when_its_connection_closes(broker):
    # A plain MDP client on a REQ socket wants the empty delimiter back on every reply, and
    # never says DISCONNECT: what the broker notes for it goes when its connection closes
    # (one REQ probe every few seconds would otherwise grow the broker for ever).
    b, cfg, ctx, socks = broker
    idents = []
    for i in range(3):
        r = ctx.socket(zmq.REQ)
        socks.append(r)
        r.linger = 5000
        r.connect(cfg.frontend)
        r.send_multipart([P.MDPC, P.C_REQUEST, b"nobody", b"x"])  # REQ puts the empty frame first
        assert b.frontend.poll(5000)
        before = set(b._req_clients)
        _drain_all(b, b.frontend, b.on_client)
        [ident] = set(b._req_clients) - before
        idents.append(ident)
        socks.remove(r)
        r.close()
    deadline = time.monotonic() + 10
    while set(idents) & b._req_clients:
        assert time.monotonic() < deadline, b._req_clients
        if b._frontend_events.poll(100):
            b._on_frontend_events()


def test_a_req_client_back_under_the_same_id_keeps_its_delimiter(broker):
    # A REQ client that chose its routing id reconnects under it, and its first message is
    # read before the old connection's close (the loop reads the frontend first).  The close
    # is applied before the new connection is noted, so the broker still knows to put the
    # empty frame its REQ socket needs on the reply (without it, the socket drops the reply
    # and the client hangs).  The new connection's message is handed in directly: when a
    # real second connection gets through depends on libzmq's pipe hand-over.
    b, cfg, ctx, socks = broker
    a = ctx.socket(zmq.REQ)
    socks.append(a)
    a.linger = 0
    a.setsockopt(zmq.ROUTING_ID, b"req-X")
    a.connect(cfg.frontend)
    a.send_multipart([P.MDPC, P.C_REQUEST, b"mmi.service", b"echo"])
    assert b.frontend.poll(5000)
    _drain_all(b, b.frontend, b.on_client)
    assert a.poll(5000) and a.recv_multipart()[:2] == [P.MDPC, P.C_FINAL]
    assert b"req-X" in b._req_clients and b._client_conn.get(b"req-X") is not None
    socks.remove(a)
    a.close()
    assert b._frontend_events.poll(5000)  # its close is queued, not read
    F = zmq.Frame
    b.on_client([F(b"req-X"), F(b""), F(P.MDPC), F(P.C_REQUEST), F(b"nobody"), F(b"x")])  # queued: no worker
    assert b"req-X" in b._req_clients


def test_what_the_broker_keeps_per_worker_is_for_registered_workers_only(broker):
    # A launcher restarts and rolls workers for months: what each READY said, and the
    # metrics' gauges, are kept for the registered workers only (pruned once a second).
    b, cfg, ctx, socks = broker
    w = _worker(b, cfg, ctx, socks)
    [live] = b.sched._workers
    for i in range(100):  # workers that registered once and are gone
        b._worker_info[b"gone-%d" % i] = ("svc", 1000 + i, None, None, None, False)
    b._prune_workers()
    assert list(b._worker_info) == [live]


def test_the_pids_of_registered_workers_are_the_kernels_word_on_ipc(broker, monkeypatch):
    # What a launcher watches for hung workers (broker.launcher: Supervisor.broker_sees): the
    # pid SO_PEERCRED gives for the worker's ipc connection, not its READY's claim; a worker
    # no longer registered leaves the list at the next prune.
    b, cfg, ctx, socks = broker
    w = _worker(b, cfg, ctx, socks, P.Ready(pid=1, host="elsewhere"))  # a claim that lies
    _, _, at0 = b.worker_pids
    b._prune_workers()
    pids, leaving, at = b.worker_pids
    assert pids == frozenset({os.getpid()}) and leaving == {} and at >= at0
    [ident] = b.sched._workers
    b._act(b.sched.worker_disconnect(ident, at), at)  # its connection closed: not a goodbye
    b._prune_workers()
    assert b.worker_pids[:2] == (frozenset(), {})
    # One that says goodbye (DISCONNECT) is listed as leaving (on its own), with the time.
    w.send_multipart(P.worker_ready("svc"))
    assert b.backend.poll(5000)
    _drain_all(b, b.backend, b.on_worker)
    w.send_multipart(P.worker_disconnect())
    assert b.backend.poll(5000)
    _drain_all(b, b.backend, b.on_worker)
    b._prune_workers()
    pids, leaving, at = b.worker_pids
    assert pids == frozenset() and list(leaving) == [os.getpid()] and leaving[os.getpid()] <= at
    # A claim from another host (a tcp worker: no kernel's word) is not this host's pid.
    b._worker_info.clear()
    b._worker_info[b"tcp"] = ("svc", os.getpid(), None, "elsewhere", None, False)
    monkeypatch.setattr(b.sched, "has_worker", lambda w: True)
    b._prune_workers()
    assert b.worker_pids[0] == frozenset()
    b._worker_info[b"tcp"] = ("svc", 4242, None, b._here, None, False)
    b._prune_workers()
    assert b.worker_pids[0] == frozenset({4242})


def test_after_a_stall_what_workers_sent_is_read_before_the_timers_judge_them(broker, monkeypatch):
    # A loop that stalled (a long collection, a burst of sends) past the liveness window
    # finds the workers' heartbeats waiting in the backend: they are read before the
    # timers run, so no live worker is presumed dead for the broker's own pause.
    import broker.server as server

    b, cfg, ctx, socks = broker
    clock = [time.monotonic()]

    class Clock:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def monotonic():
            return clock[0]

    monkeypatch.setattr(server, "time", Clock())
    w = _worker(b, cfg, ctx, socks)
    [ident] = b.sched._workers
    clock[0] += 10.0  # the stall: ten seconds against a 0.6 s window
    w.send_multipart(P.worker_heartbeat())
    assert b.backend.poll(5000)
    b._run_timers(clock[0])
    assert b.sched.has_worker(ident)
    clock[0] += 10.0  # silent for real this time
    b._run_timers(clock[0])
    assert not b.sched.has_worker(ident)
