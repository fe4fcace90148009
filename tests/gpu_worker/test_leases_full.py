"""A leaseholder that stops reading its replies on the worker's zmq direct socket, in process
(the loop's steps driven one by one, as in test_leases_direct.py), with a queue of one
message per connection (`DirectSocket.sndhwm`) and a client that reads at most one: the
queue fills after a few large messages.  Checked: `DirectSocket.send` tells a full queue
(`Unsent.FULL`: the client is alive) from a connection gone (`Unsent.GONE`); a FINAL that
meets a full queue is held, its lease slot taken, and sent once the client reads, counted
then, once; dropped (counted client_gone) when the connection closes or the broker ends the
lease for a client presumed dead, kept for any other end; a running stream's partial that
meets a full queue for STREAM_WAIT_S stops the stream with an error.  End to end:
tests/e2e/test_direct_full.py."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from gpu_worker import leases, worker as worker_mod
from gpu_worker.leases import Unsent
from tests.gpu_worker.test_leases_direct import SECRET, _lease, _request, _take, _worker

pytestmark = pytest.mark.timeout(30)

ROUTE = b"\x01reader"
FILLER = b"\x00" * (256 << 10)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setattr(leases.DirectSocket, "sndhwm", 1)
    w = _worker(tmp_path, direct=True)
    w.on_message(P.to_worker_welcome(b"", P.Welcome(instance=b"\x01" * 8, heartbeat_interval=1.0,
                                                    heartbeat_liveness=3, metrics=True))[1:])
    assert w.counts
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def client(worker):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.rcvhwm = 1
    s.rcvbuf = 4096
    s.setsockopt(zmq.ROUTING_ID, ROUTE)
    s.connect(worker.direct_socket.endpoint)
    try:
        yield s
    finally:
        s.close()


def _bound(worker, client, slots=2) -> bytes:
    lease = _lease(worker, slots=slots)
    worker.upstream.sent()
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    _take(worker, lambda: worker.leases.lease_of(ROUTE) is not None)
    return lease


def _fill(worker) -> int:
    """Queue large messages to the client until its queue stays full (the I/O threads of
    both sides take what the kernel does, a little after the first refusal); how many went."""
    n = 0
    for _ in range(200):
        ds = worker.direct_socket
        sent = ds.send([ROUTE, P.MDPC, P.C_PARTIAL, b"echo", FILLER])
        if sent is Unsent.FULL:
            sent = ds.send([ROUTE, P.MDPC, P.C_PARTIAL, b"echo", FILLER], 0.2)
            if sent is Unsent.FULL:
                return n
        assert sent is True
        n += 1
    raise AssertionError("the queue never filled")


def _read_all(client, until, finals: list | None = None) -> list:
    """Read what reaches the client until `until()` holds; the FINALs read (added to
    ``finals``)."""
    finals = [] if finals is None else finals
    deadline = time.monotonic() + 10
    while not until():
        assert time.monotonic() < deadline, "not within 10 s"
        while client.poll(10):
            frames = client.recv_multipart()
            if frames[1] == P.C_FINAL:
                finals.append(P.decode_reply(frames[3], n_inline=len(frames) - 4))
    return finals


def _held_final(worker, client) -> bytes:
    """A leased echo whose FINAL met the client's full queue: held.  Its lease's id."""
    lease = _bound(worker, client)
    _request(client, 7, np.arange(3.0))
    _take(worker, lambda: len(worker.jobs) == 1)
    _fill(worker)
    worker.run_ready_batches(force=True)
    assert len(worker._held) == 1 and worker.leases.in_flight(lease) == 1  # its slot still taken
    assert worker.leased_sent == 0 and worker._leased_outcomes == {}
    return lease


def test_send_tells_a_full_queue_from_a_connection_gone(worker, client):
    _bound(worker, client)
    ds = worker.direct_socket
    assert ds.send([b"\x01nobody", P.MDPC, P.C_FINAL, b"echo", b"x"]) is Unsent.GONE
    assert not Unsent.GONE and not Unsent.FULL  # falsy, as the False they replace
    assert _fill(worker) >= 1
    ticks = []
    t0 = time.monotonic()
    assert ds.send([ROUTE, P.MDPC, P.C_PARTIAL, b"echo", FILLER], 0.15, lambda: ticks.append(1)) is Unsent.FULL
    assert time.monotonic() - t0 >= 0.15 and ticks  # it waited, heartbeating (a tick each 0.1 s at most)
    assert ds.dropped == 1  # only the reply to nobody: a full queue's is the caller's to keep
    _read_all(client, lambda: ds.send([ROUTE, P.MDPC, P.C_PARTIAL, b"echo", b"y"]) is True)
    assert ds.sock.sndtimeo == -1


def test_a_final_that_meets_a_full_queue_is_held_and_sent_once_the_client_reads(worker, client):
    lease = _held_final(worker, client)
    finals = _read_all(client, lambda: worker._send_held() or not worker._held)
    _read_all(client, lambda: finals, finals)
    assert [(f.id, f.error) for f in finals] == [(7, None)]
    assert worker.leases.in_flight(lease) == 0 and worker.leased_sent == 1
    assert worker._leased_outcomes == {0: 1}  # counted once, when it went


def test_a_final_held_for_a_client_that_left_is_dropped_as_client_gone(worker, client):
    lease = _held_final(worker, client)
    client.close()
    deadline = time.monotonic() + 10
    while worker._held:  # the ROUTER learns of the close from its I/O thread
        assert time.monotonic() < deadline, "still held"
        worker.direct_socket.sock.poll(10)
        worker._send_held()
    assert worker.leases.in_flight(lease) == 0 and worker.leased_sent == 1
    assert worker._leased_outcomes == {P.LEASED_CLIENT_GONE: 1}


@pytest.mark.parametrize("reason", ["client_gone", "drain"])
def test_a_held_final_is_dropped_when_the_broker_presumes_its_client_dead(worker, client, reason):
    lease = _held_final(worker, client)
    worker.on_message(P.to_worker_lease_end(b"", lease, P.encode_header(P.LeaseEnd(lease=lease, reason=reason)))[1:])
    if reason == "client_gone":
        assert worker._held == {} and worker._leased_outcomes == {P.LEASED_CLIENT_GONE: 1}
    else:  # the client is alive: it gets its answer on the connection, as every running request's
        assert len(worker._held) == 1 and worker._leased_outcomes == {}
        finals = _read_all(client, lambda: worker._send_held() or not worker._held)
        _read_all(client, lambda: finals, finals)
        assert [f.id for f in finals] == [7] and worker._leased_outcomes == {0: 1}


def test_a_refusal_that_meets_a_full_queue_is_held_too(worker, client):
    _bound(worker, client, slots=1)
    _request(client, 1, np.arange(3.0))
    _take(worker, lambda: len(worker.jobs) == 1)
    _fill(worker)
    _request(client, 2, np.arange(3.0))  # beyond the lease's one slot: 429, "send it through the broker"
    _take(worker, lambda: len(worker._held) == 1)
    worker.run_ready_batches(force=True)
    assert len(worker._held) == 2
    finals = _read_all(client, lambda: worker._send_held() or not worker._held)
    _read_all(client, lambda: len(finals) == 2, finals)
    assert sorted((f.id, f.error.code if f.error else 0) for f in finals) == [(1, 0), (2, 429)]
    assert worker._leased_outcomes == {0: 1}  # the refusal is no outcome (it did not run)


def test_a_streams_partial_that_meets_a_full_queue_stops_it_with_an_error(worker, client, monkeypatch):
    from gpu_worker.job import Job

    monkeypatch.setattr(worker_mod, "STREAM_WAIT_S", 0.05)
    _bound(worker, client)
    _fill(worker)
    job = Job(b"L" + bytes(8), P.Request(id=3), None, None, time.monotonic(), None, None, ROUTE)
    worker._streaming = True
    worker.running = {job.envelope: job}
    worker._reply_leased(job, False, P.error_body(3, 500, "a partial"))
    assert job.cancelled is worker_mod._UNREAD  # (not _UNSENDABLE: its client is there)
