"""The worker's side of leases in process (docs/protocol.md section 10): an inproc pair stands
in for the broker, a DEALER for the leaseholding client on the worker's real direct socket,
and the test drives the loop's steps (`on_message`, `_drain_direct`, `run_ready_batches`)
one by one.  Checked: nothing of it exists without --direct (Ready.direct unset, leases
refused); with it, the pid and host come from the grant, the replies go back on the direct
socket and nothing about them to the broker; LEASE_END client_gone sends the lease's queued
requests back (503: through the broker); a lost broker connection ends every lease."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol.wire import Waiter
from gpu_worker.worker import Worker, WorkerConfig
from tests.gpu_worker.pair_link import PairLink

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 16


def _worker(tmp_path, direct: bool) -> Worker:
    up = PairLink(f"lease-up-{id(tmp_path)}-{direct}")
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


def _request(client, rid, x, cls=P.Request, **kw) -> None:
    head = cls(id=rid, tensors=[P.TensorRef("x", x.dtype.str, list(x.shape), P.InlineLoc(frame=0))], **kw)
    client.send_multipart(P.client_request("echo", [P.encode_header(head), x.tobytes()]))


def _welcome(worker) -> None:
    """Our broker's WELCOME (only to it does the worker say BUSY)."""
    welcome = P.Welcome(instance=b"\x01" * 8, heartbeat_interval=1.0, heartbeat_liveness=3)
    worker.on_message(P.to_worker_welcome(b"", welcome)[1:])


def _dealer(worker, routing_id: bytes | None = None):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(worker.direct_socket.endpoint)
    return s


def _two_leases(worker, client, other) -> tuple[bytes, bytes]:
    """Leases 1 and 2 of two slots each, `client` bound to the first and `other` to the
    second, the worker registered (WELCOME) and what it sent so far read; their ids."""
    a, b = _lease(worker, 1, slots=2), _lease(worker, 2, slots=2)
    _welcome(worker)
    worker.upstream.sent()
    for sock, lease in ((client, a), (other, b)):
        sock.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    return a, b


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
    # The broker's fields, written by the client: none is believed (no broker queued it)
    _request(client, 5, x, cls=P.DispatchedRequest, pid=1, host="elsewhere/0", reply_to="ipc:///tmp/c-1-1-00.ipc",
             backlog=9, queue_ms=5.0, returned=2, attempt=3)
    _take(worker, lambda: len(worker.jobs) == 1)
    [job] = worker.jobs.values()
    assert job.req.pid == 4242 and job.req.host is None and job.req.reply_to is None and job.req.backlog == 0
    assert job.req.queue_ms is None and job.req.returned is None and job.req.attempt is None
    assert worker.leases.in_flight(lease) == 1
    worker.run_ready_batches(force=True)
    rep, frames = _reply(client)
    assert rep.id == 5 and rep.error is None
    assert np.array_equal(np.frombuffer(frames[rep.tensors[0].loc.frame], dtype=np.int16), x)
    assert worker.leases.in_flight(lease) == 0 and worker.leased_sent == 1
    assert worker.upstream.sent() == [] and len(worker.dones) == 0  # the broker hears nothing of it
    worker.close()
    assert not os.path.exists(path)


def test_client_gone_sends_the_leases_queued_requests_back_through_the_broker(worker, client):
    # "client_gone" is the broker's word that it heard nothing from the client for its
    # liveness window: a client cut off from the broker but not from this worker earns it
    # too.  Its queued requests were dropped without a word (its call waited out its
    # timeout) and its running ones answered 499, though it had cancelled nothing (found by
    # the network hunt).  Those not started are answered 503 "resend it through the broker"
    # (the SDK does), and they did not run.
    lease = _lease(worker, slots=3)
    worker.upstream.sent()
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    for rid in (1, 2):
        _request(client, rid, np.zeros(3))
    _take(worker, lambda: len(worker.jobs) == 2)
    end = P.LeaseEnd(lease=lease, reason="client_gone")
    worker.on_message(P.to_worker_lease_end(b"", lease, P.encode_header(end))[1:])
    assert worker.jobs == {} and len(worker.batcher) == 0 and lease not in worker.leases
    got = sorted((rep.id, rep.error.code) for rep, _ in (_reply(client), _reply(client)))
    assert got == [(1, 503), (2, 503)]
    assert not client.poll(100)
    assert worker.upstream.sent() == []
    _request(client, 3, np.zeros(3))  # and the connection is told its lease ended
    _take(worker, lambda: client.poll(0))
    rep, _ = _reply(client)
    assert rep.id == 3 and rep.error.code == 503 and "client_gone" in rep.error.message


def test_a_lost_broker_connection_ends_every_lease(worker, client):
    lease = _lease(worker)
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    _request(client, 1, np.zeros(3))
    _take(worker, lambda: len(worker.jobs) == 1)
    worker._fail_pending("broker connection lost")
    assert len(worker.leases) == 0 and worker.jobs == {}
    # The request it held, not started, is sent back (it waited forever otherwise: its
    # connection stays up and no LEASE_END can come from a broker that is gone).
    rep, _ = _reply(client)
    assert rep.id == 1 and rep.error.code == 503 and "through the broker" in rep.error.message
    _request(client, 2, np.zeros(3))
    _take(worker, lambda: client.poll(0))
    rep, _ = _reply(client)
    assert rep.id == 2 and rep.error.code == int(P.ErrorCode.SERVICE_UNAVAILABLE)
    assert "broker connection lost" in rep.error.message


def test_a_lost_broker_connection_keeps_what_the_worker_still_owes_its_leaseholders(worker, client, monkeypatch):
    """After a broker restart the client keeps waiting on its lease's connection for what
    the worker had taken (nobody else will answer it: docs/protocol.md section 10.3, End):
    a FINAL held for it (its queue was full) still goes once it reads, and a request
    running across the reconnect stays known to the lease table (a CANCEL finds it, its
    FINAL frees its slot).  Before, the held FINAL was dropped without a word at the
    reconnect (its call waited for its deadline, or for ever) and a CANCEL found nothing."""
    from gpu_worker.leases import Unsent

    lease = _lease(worker, slots=3)
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])
    _request(client, 1, np.arange(3.0))
    _take(worker, lambda: len(worker.jobs) == 1)
    [job] = worker.jobs.values()
    real_send = worker.direct_socket.send
    monkeypatch.setattr(worker.direct_socket, "send", lambda frames, *a, **k: Unsent.FULL)
    worker.run_ready_batches(force=True)  # its FINAL finds the queue full: held
    assert len(worker._held) == 1 and worker.leases.find(job.route, 1) == job.envelope
    monkeypatch.setattr(worker.direct_socket, "send", real_send)
    worker._fail_pending("broker connection re-established")
    assert len(worker.leases) == 0 and len(worker._held) == 1
    assert worker.leases.find(job.route, 1) == job.envelope  # still in flight: a CANCEL finds it
    worker._send_held()
    rep, frames = _reply(client)
    assert rep.id == 1 and rep.error is None
    assert np.array_equal(np.frombuffer(frames[rep.tensors[0].loc.frame]), np.arange(3.0))
    assert not worker._held and worker.leases.find(job.route, 1) is None


def test_a_long_batch_sends_other_leases_waiting_requests_to_the_broker_and_says_busy(worker, client):
    """The head-of-line rule of leases (docs/protocol.md section 10.3), at the start of a
    batch predicted long (1 s): lease B's request waiting in the batcher is answered 429
    "send this one through the broker" (it did not run), lease A's own next one waits for
    A's batch; the broker is told BUSY for a long batch holding leased requests, and BUSY
    off when it ends."""
    other = _dealer(worker)
    try:
        a, b = _two_leases(worker, client, other)
        # Three shapes: three batches, in arrival order (A's first).
        _request(client, 1, np.zeros(3))
        _take(worker, lambda: len(worker.jobs) == 1)
        _request(other, 1, np.zeros(5))
        _take(worker, lambda: len(worker.jobs) == 2)
        _request(client, 2, np.zeros(4))
        _take(worker, lambda: len(worker.jobs) == 3)
        worker.compute_times.seed({1: 1.0})  # predicted long
        worker.run_ready_batches(force=True)
        rep, _ = _reply(other)
        assert rep.id == 1 and rep.error.code == int(P.ErrorCode.QUEUE_FULL)
        assert "through the broker" in rep.error.message and "did not run" in rep.error.message
        assert worker.leases.in_flight(b) == 0 and worker.leased_bounced == 1
        got = sorted(_reply(client)[0].id for _ in range(2))
        assert got == [1, 2]  # A's own waited for A's batch, and ran
        sent = [P.parse_worker(f) for f in worker.upstream.sent()]
        # BUSY for the first batch only: the second is predicted by the least of the average
        # and the last measurements (`ComputeTimes.recent`), and the first took a fraction of
        # a millisecond, so it is short.
        assert [(m.command, m.info) for m in sent] == [(P.W_BUSY, True), (P.W_BUSY, False)]
    finally:
        other.close()


def test_runs_long_is_the_rule():
    from gpu_worker.leases import LONG_BATCH_S, runs_long

    assert LONG_BATCH_S == 0.005
    assert runs_long(0.0, 1.0) and not runs_long(0.0, 0.004)   # by its prediction
    assert not runs_long(0.998, 1.0)                           # nearly done: wait for it
    assert runs_long(1.5, 1.0)                                 # past its prediction: nothing says soon
    assert not runs_long(0.003, 0.001) and runs_long(0.006, 0.001)
    assert not runs_long(0.004, None) and runs_long(0.005, None)  # a stream, or no timing


def test_while_a_batch_computes_the_heartbeat_thread_reads_the_direct_socket(worker, client):
    """`_read_direct_while_computing` (the heartbeat thread, while the loop computes): a HELLO
    binds at once, so the REQUEST right behind it is judged with its lease: lease B's waits
    behind lease A's long batch, so it is answered 429 now; lease A's own next REQUEST and a
    CANCEL of its running one are stashed with their arrival times, and the loop handles them
    right after the batch (`_after_compute`): the REQUEST's wait counts from its arrival, the
    CANCEL drops the running result."""
    other = _dealer(worker)
    try:
        a, b = _lease(worker, 1, slots=2), _lease(worker, 2, slots=2)
        worker.upstream.sent()
        client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=a, secret=SECRET))])
        _request(client, 1, np.zeros(3))
        _take(worker, lambda: len(worker.jobs) == 1)
        # The loop takes A's request and computes it (as `_run` does, up to computing_begin):
        # a batch predicted at 1 ms that has run for 500 ms.
        [p] = worker.batcher.take(time.monotonic(), idle=True, force=True)
        running = worker.jobs.pop(p.item.envelope)
        worker.running = {running.envelope: running}
        worker._batch_at, worker._batch_predicted = time.monotonic() - 0.5, 0.001
        other.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=b, secret=SECRET))])
        _request(other, 7, np.zeros(5))
        _request(client, 2, np.zeros(3))
        client.send_multipart(P.client_cancel("echo", 1))
        deadline = time.monotonic() + 5
        while len(worker._stash_direct) < 2:
            assert time.monotonic() < deadline, "the heartbeat thread's reads got nothing"
            worker.direct_socket.sock.poll(50)
            worker._read_direct_while_computing()
        rep, _ = _reply(other)
        assert rep.id == 7 and rep.error.code == int(P.ErrorCode.QUEUE_FULL) and "through the broker" in rep.error.message
        assert worker.leases.in_flight(b) == 0 and worker.leased_bounced == 1  # it took no slot
        read_by = time.monotonic()
        assert [bytes(f[2]) for f, _ in worker._stash_direct] == [P.C_REQUEST, P.C_CANCEL]
        assert worker.jobs == {} and not running.cancelled  # the loop's state: untouched so far
        # The batch ends: the loop handles what was stashed, in order.
        worker._after_compute()
        assert running.cancelled and worker.cancelled_running == 1
        [queued] = worker.jobs.values()
        assert queued.req.id == 2 and queued.received <= read_by  # its arrival, not the batch's end
        assert worker._stash_direct == []
    finally:
        other.close()


def test_requests_read_during_a_batch_are_handled_before_a_lease_end_read_after_them(worker):
    """What the heartbeat thread read during a batch is handled after it in the order it
    arrived, the broker's messages and the direct socket's together.  A pinned client SIGKILLed
    with a request running and two sent right behind it, read during that batch: the broker
    ends its lease (client_gone) while the batch still runs.  The loop handled the broker's
    LEASE_END first, so the two requests, which came while the lease held, were refused as
    if sent after it (503, "resend it through the broker"): a refusal counts nothing (the
    client resends it through the broker, which counts it then), and this client was dead,
    so they were never counted (1 run in 3 of tests/e2e/test_metrics.py's
    test_a_dead_pinned_clients_requests_count_as_client_gone_once under load: the gone hunt).
    In arrival order they are the lease's, waiting, when the LEASE_END comes: told to resend,
    and, that answer finding their client gone, counted `client_gone` once each."""
    from broker.protocol.link import LinkConn

    welcome = P.Welcome(instance=b"\x01" * 8, heartbeat_interval=1.0, heartbeat_liveness=3, metrics=True)
    worker.on_message(P.to_worker_welcome(b"", welcome)[1:])
    lease = _lease(worker, slots=3)
    worker.upstream.sent()
    ds = worker.direct_socket
    link = LinkConn(ds.link.path)  # a near client's local link, as in the e2e test
    try:
        assert link.send([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=SECRET))])

        def request(rid):
            x = np.zeros(3)
            head = P.Request(id=rid, tensors=[P.TensorRef("x", x.dtype.str, [3], P.InlineLoc(frame=0))])
            assert link.send(P.client_request("echo", [P.encode_header(head), x.tobytes()]))

        def read(until, step):
            deadline = time.monotonic() + 5
            while not until():
                assert time.monotonic() < deadline, "the worker did not read it in time"
                ds.wait(50)
                step()

        request(1)
        read(lambda: len(worker.jobs) == 1, worker._drain_direct)
        # The loop takes request 1 and computes it (as `_run` does, up to computing_begin), a
        # batch that is not long (its lease's own requests wait behind it anyway).
        [p] = worker.batcher.take(time.monotonic(), idle=True, force=True)
        running = worker.jobs.pop(p.item.envelope)
        worker.running = {running.envelope: running}
        worker._batch_at, worker._batch_predicted = time.monotonic(), 10.0
        request(2)
        request(3)
        link.close()  # the client dies
        read(lambda: len(worker._stash_direct) == 3, worker._read_direct_while_computing)
        assert [bytes(f[2]) for f, _ in worker._stash_direct] == [P.C_REQUEST, P.C_REQUEST, P.C_DISCONNECT]
        # Then the broker, having heard nothing from the client, ends its lease.
        end = P.LeaseEnd(lease=lease, reason="client_gone")
        worker.upstream.to_worker(P.to_worker_lease_end(b"", lease, P.encode_header(end))[1:])
        read(lambda: len(worker._stash) == 1, worker._read_while_computing)
        worker._after_compute()
    finally:
        link.close()
    assert lease not in worker.leases and worker.jobs == {} and len(worker.batcher) == 0
    assert worker._leased_outcomes == {P.LEASED_CLIENT_GONE: 2}, worker._leased_outcomes
    assert set(worker.leases._keys) == {running.envelope}  # their slots are free: only the running one holds one


def test_a_batch_that_becomes_long_on_the_loop_thread_bounces_another_leases_queued_request(worker, client,
                                                                                             monkeypatch):
    """Lease A's batch is predicted short (0.1 ms: it runs on the loop's thread, and lease
    B's request already waiting in the batcher is not bounced at its start) but runs long:
    the heartbeat thread answers B's waiting request 429 "send it through the broker" while
    A's batch still runs (the "model" here returns only once B got that answer), and the
    loop drops it from the batcher and frees its slot right after; A's runs, and the broker
    is told BUSY on and off."""
    from gpu_worker.compute import LoopHeartbeats

    other = _dealer(worker)
    beats = None
    try:
        a, b = _two_leases(worker, client, other)
        _request(client, 1, np.zeros(3))
        _take(worker, lambda: len(worker.jobs) == 1)
        _request(other, 1, np.zeros(5))   # another shape: waits in the batcher behind A's batch
        _take(worker, lambda: len(worker.jobs) == 2)
        worker.compute_times.seed({1: 0.0001})
        beats = worker._heartbeats = LoopHeartbeats(
            lambda: worker._send(P.worker_heartbeat()), lambda: worker.upstream.last_sent, 1.0,
            during=worker._read_while_computing)
        real, during = worker.plane.run, []

        def run(jobs):
            out = real(jobs)
            if not during:  # A's batch: "computes" until B got its answer (5 s at most)
                during.append(other.poll(5000))
            return out

        monkeypatch.setattr(worker.plane, "run", run)
        worker.run_ready_batches(force=True)
        assert during == [True], "B's waiting request was not answered while A's batch ran"
        rep, _ = _reply(other)
        assert rep.id == 1 and rep.error.code == int(P.ErrorCode.QUEUE_FULL)
        assert "through the broker" in rep.error.message and "did not run" in rep.error.message
        assert worker.leased_bounced == 1 and worker.leases.in_flight(b) == 0
        assert worker.jobs == {} and len(worker.batcher) == 0 and during == [True]  # B's never ran
        rep, _ = _reply(client)
        assert rep.id == 1 and rep.error is None and worker.leases.in_flight(a) == 0
        busy = [m.info for m in map(P.parse_worker, worker.upstream.sent()) if m.command == P.W_BUSY]
        assert busy == [True, False]
        assert not other.poll(100)  # one answer for B's request: the 429
    finally:
        if beats is not None:
            beats.close()
            worker._heartbeats = None
        other.close()


def test_busy_goes_only_to_our_broker_and_a_reconnect_forgets_it(worker, client):
    """BUSY (0x10) is our broker's command: never sent before its WELCOME (a plain MDP broker
    does not know it), and `_reconnect` forgets one told to the old connection (no BUSY off
    for the new broker, which was never told on)."""
    a = _lease(worker, 1, slots=2)
    worker.upstream.sent()
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=a, secret=SECRET))])
    _request(client, 1, np.zeros(3))
    _take(worker, lambda: len(worker.jobs) == 1)
    worker.compute_times.seed({1: 1.0})  # predicted long
    worker.run_ready_batches(force=True)
    assert _reply(client)[0].error is None
    assert [m.command for m in map(P.parse_worker, worker.upstream.sent())] == []  # no WELCOME: nothing
    _welcome(worker)
    worker.running = {b"x": worker_job(worker)}
    worker._batch_at, worker._batch_predicted = time.monotonic(), 1.0
    worker._maybe_tell_busy(time.monotonic())
    assert [(m.command, m.info) for m in map(P.parse_worker, worker.upstream.sent())] == [(P.W_BUSY, True)]
    worker._reconnect_why = "test"
    poller = Waiter()
    poller.add(worker.sock)
    try:
        worker._reconnect(poller)
    finally:
        poller.close()
    assert worker._busy_told is False and worker.registered is False
    worker.running = {}
    worker._batch_over()
    assert not any(P.parse_worker(f).command == P.W_BUSY for f in worker.upstream.sent())


def worker_job(worker):
    """A leased job as the batcher holds one (only its route matters to BUSY)."""
    from gpu_worker.job import Job

    job = Job.__new__(Job)
    job.route = b"r"
    job.envelope = b"x"
    return job


def test_the_direct_stash_is_capped_and_only_new_entries_are_judged(worker, client, monkeypatch):
    """While a batch computes on the loop's thread the heartbeat thread stashes at most
    `_DIRECT_STASH_MAX` messages; the rest stay in the socket (its HWM) for the loop.  An
    entry read while the batch was long is not judged again on later ticks."""
    import gpu_worker.worker as W

    monkeypatch.setattr(W, "_DIRECT_STASH_MAX", 3)
    a = _lease(worker, 1, slots=2)
    client.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=a, secret=SECRET))])
    _request(client, 1, np.zeros(3))
    _take(worker, lambda: len(worker.jobs) == 1)
    [p] = worker.batcher.take(time.monotonic(), idle=True, force=True)
    running = worker.jobs.pop(p.item.envelope)
    worker.running = {running.envelope: running}
    worker._batch_at, worker._batch_predicted = time.monotonic() - 0.5, 0.001  # long by now
    judged, handled = [], []
    real_bounce, real_handle = worker._bounce_direct, worker._on_direct_frames
    monkeypatch.setattr(worker, "_bounce_direct", lambda *a: judged.append(1) or real_bounce(*a))
    monkeypatch.setattr(worker, "_on_direct_frames", lambda *a: handled.append(1) or real_handle(*a))
    _request(client, 2, np.zeros(3))  # A's own: kept (it waits for A's batch)
    for rid in range(100, 105):
        client.send_multipart(P.client_cancel("echo", rid))  # nothing of these runs: stashed
    deadline = time.monotonic() + 5
    while len(worker._stash_direct) < 3:
        assert time.monotonic() < deadline, "the heartbeat thread's reads got nothing"
        worker.direct_socket.sock.poll(50)
        worker._read_direct_while_computing()
    assert len(judged) == 1  # the REQUEST, once, on arrival
    for _ in range(3):  # later ticks: no more read, nothing judged again
        worker._read_direct_while_computing()
    assert len(worker._stash_direct) == 3 and len(judged) == 1
    assert worker.direct_socket.sock.poll(5000)  # the rest waits in the socket (or is still on its way)
    worker._after_compute()
    assert len(handled) == 3 and worker._stash_direct == []
    worker.running, worker._batch_at = {}, None
    _take(worker, lambda: len(handled) == 6)  # the loop reads the rest
    assert {job.req.id for job in worker.jobs.values()} == {2}


def test_an_early_hello_keeps_its_place_behind_what_its_connection_sent_before(worker):
    """A HELLO read during compute is handled at once only when nothing of its connection is
    stashed: here DISCONNECT then HELLO (a client re-binding) replay in order after the
    batch, so the connection ends bound (handled at once, the HELLO would be undone by the
    DISCONNECT replayed after it)."""
    route = b"conn-hello"
    sock = _dealer(worker, route)
    try:
        a = _lease(worker, 1, slots=2)
        hello = [P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=a, secret=SECRET))]
        sock.send_multipart(hello)
        _take(worker, lambda: worker.leases.lease_of(route) is not None)
        sock.send_multipart(P.client_disconnect())
        sock.send_multipart(hello)
        deadline = time.monotonic() + 5
        while len(worker._stash_direct) < 2:
            assert time.monotonic() < deadline, "the heartbeat thread's reads got nothing"
            worker.direct_socket.sock.poll(50)
            worker._read_direct_while_computing()
        assert [bytes(f[2]) for f, _ in worker._stash_direct] == [P.C_DISCONNECT, P.C_HELLO]
        assert worker.leases.lease_of(route) is not None  # nothing handled yet
        worker._after_compute()
        assert worker.leases.lease_of(route) is not None  # unbound, then bound again
    finally:
        sock.close()


def test_one_slow_batch_does_not_make_the_following_ones_long():
    """`ComputeTimes.recent` (the head-of-line rule's prediction) is the least of the average
    and the last two measurements: one 300 ms outlier among sub-millisecond batches lifts the
    average (the offload rule's) for many batches, but marks none of the following ones long
    (no BUSY, no bounces for nothing); two slow ones in a row do."""
    from gpu_worker.compute import ComputeTimes
    from gpu_worker.leases import runs_long

    ct = ComputeTimes(1.0)
    ct.seed({1: 0.0002})
    for _ in range(5):
        ct.observe(1, 0.0002)
    ct.observe(1, 0.3)
    assert runs_long(0.0, ct.predict(1))         # the average alone would say long ...
    for _ in range(11):
        assert not runs_long(0.0, ct.recent(1))  # ... for each of the next 11; recent: none
        ct.observe(1, 0.0002)
    assert ct.recent(1) <= 0.0002 + 1e-12
    ct.observe(1, 0.3)
    ct.observe(1, 0.3)
    assert runs_long(0.0, ct.recent(1))          # slow twice in a row: long
    assert ComputeTimes(1.0).recent(2) is None   # nothing measured: unknown


def test_a_failing_read_during_compute_does_not_cost_the_heartbeat():
    """`LoopHeartbeats`: an exception in `during` (the reads while the loop computes) is
    logged, and that tick's heartbeat still goes."""
    import threading

    from gpu_worker.compute import LoopHeartbeats

    sent, tried = threading.Event(), []

    def boom():
        tried.append(1)
        raise RuntimeError("read failed")

    beats = LoopHeartbeats(sent.set, lambda: 0.0, 0.02, during=boom)
    try:
        beats.computing_begin()
        assert sent.wait(5), "no heartbeat while `during` fails"
        beats.computing_end()
        assert tried and beats.sent >= 1
    finally:
        beats.close()


def test_near_its_descriptor_limit_a_worker_takes_no_lease_and_hides_its_direct_socket(worker):
    # Each client costs a worker descriptors (segments, a pidfd, a reply socket); at the
    # limit libzmq's ipc listener aborted the worker on the next connection to its direct
    # socket.  Near it, no new lease, and the socket's file is moved aside until they close.
    guard = worker._fd_guard
    assert guard is not None
    fds = {"n": 10}
    guard.count = lambda: fds["n"]
    path = worker.direct_socket.path
    worker._watch_descriptors()
    assert os.path.exists(path) and not guard.paused
    fds["n"] = guard.limit - 1
    worker._watch_descriptors()
    assert guard.paused and not os.path.exists(path)
    worker.upstream.sent()
    lease = P.lease_id(7)
    worker.on_message(P.to_worker_lease(b"", P.encode_header(
        P.LeaseGrant(lease=lease, secret=SECRET, service="echo", slots=1)))[1:])
    (leased,) = [P.parse_worker(f) for f in worker.upstream.sent()]
    assert leased.command == P.W_LEASED and leased.info  # refused: an error header
    assert "near its descriptor limit" in P.decode_reply(leased.info).error.message
    fds["n"] = 10
    worker._watch_descriptors()
    assert not guard.paused and os.path.exists(path)
    _lease(worker, 8)
    (leased,) = [P.parse_worker(f) for f in worker.upstream.sent()]
    assert leased.command == P.W_LEASED and not leased.info  # taken


def test_a_partial_that_cannot_be_sent_stops_the_stream_without_an_answer(worker):
    # A leased stream whose connection is gone (or stopped reading) ran on for nobody; then
    # it was stopped as "cancelled by the client" and counted so (review).  It stops, quietly.
    from gpu_worker.job import Job
    from gpu_worker.worker import _UNSENDABLE

    job = Job(b"L" + bytes(8), P.Request(id=3), None, None, time.monotonic(), None, None, b"\x00nobody-here")
    worker._reply_leased(job, False, P.error_body(3, 500, "a partial"))  # EHOSTUNREACH: nobody has that route
    assert job.cancelled is _UNSENDABLE


def test_the_direct_socket_takes_no_frame_larger_than_the_broker_does(worker):
    # A leaseholder reaches it without the broker, which bounds frames elsewhere: one of
    # 512 MiB was buffered whole before any HELLO (found by the CURVE hunt).
    from gpu_worker.leases import MAX_FRAME_BYTES

    assert worker.direct_socket.sock.maxmsgsize == MAX_FRAME_BYTES == 256 << 20


@pytest.mark.parametrize("credit,conns", [(8, 256), (600, 1200)])
def test_the_local_link_takes_a_connection_for_every_lease_the_credit_allows(tmp_path, credit, conns):
    # The broker grants a worker at most one lease per slot of its credit; the link took 256
    # connections whatever the credit: of 300 near leaseholders, those past the 256th had
    # their connection closed at once and churned (lease, reset, lease given back, backoff:
    # 29 still unpinned after 60 s) while the ipc direct socket had room (the scale hunt).
    up = PairLink(f"lease-link-{id(tmp_path)}-{credit}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", warmup=False, credit=credit, direct=True),
               upstream=up)
    w._connect()
    try:
        assert w.direct_socket.link is not None and w.direct_socket.link.max_conns == conns
    finally:
        w.close()


def _gone(fd: int, ino: int) -> None:
    """Wait until descriptor ``fd`` no longer holds socket ``ino`` (libzmq closed it)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            if os.fstat(fd).st_ino != ino:
                return
        except OSError:
            return
        assert time.monotonic() < deadline, "libzmq did not close the connection's descriptor"
        time.sleep(0.005)  # polling a condition (the I/O thread's close), not a delay


def test_a_refusal_read_after_its_connection_closed_never_ends_the_socket_that_took_its_descriptor(worker):
    """A refusal that finds its connection's queue full, nothing in flight on it, ends that
    connection through the descriptor libzmq read its first refused request from
    (`DirectSocket.end_connection`).  libzmq still hands over what a connection sent before
    it closed, after it closed its descriptor, and the process may have opened something
    else under that number meanwhile (the lowest free one): noted then, that socket, the
    worker's own (its broker connection, a local link connection, ...), was shut down in
    place of the connection that had left (the review of the churn hunt)."""
    import socket

    ds = worker.direct_socket
    h = _dealer(worker)
    h.rcvhwm = 1  # what waits for it is the worker's
    h.send_multipart(P.client_heartbeat())  # taken silently: nothing refused, nothing noted
    assert ds.sock.poll(5000), "nothing reached the direct socket"
    frames = ds.next_message(link=False)
    route, fd = bytes(frames[0]), frames[1].get(zmq.SRCFD)
    ino = os.fstat(fd).st_ino
    worker._on_direct_frames(frames, time.monotonic())
    # Its queue fills, as with its lease's FINALs (nothing refused so far), ...
    reply = [route, *P.client_reply(True, b"echo", P.error_body(1, 500, "filler"))]
    while ds.send(reply) is True:
        pass
    # ... it sends a request that will be refused (no HELLO), and leaves.
    _request(h, 9, np.zeros(4, dtype=np.uint8))
    h.linger = 5000  # (sent before it closes)
    h.close()
    _gone(fd, ino)
    a, b = socket.socketpair()  # a socket of the worker's own takes the number
    os.dup2(a.fileno(), fd)
    try:
        refused = len(worker._held)
        _take(worker, lambda: ds.ended or len(worker._held) > refused)
        b.settimeout(5)
        a.settimeout(5)
        try:
            b.sendall(b"ping")
            got = a.recv(4)
        except OSError as e:
            got = repr(e)
        assert got == b"ping" and ds.ended == 0, (
            f"a socket that took the descriptor of a connection that had left was shut down ({got!r}, "
            f"{ds.ended} ended)")
    finally:
        os.close(fd)
        a.close()
        b.close()


_LEAVER = """
import sys, zmq
from broker import protocol as P
s = zmq.Context.instance().socket(zmq.DEALER)
s.rcvhwm = 1
s.connect(sys.argv[1])
s.send_multipart(P.client_heartbeat())
sys.stdin.readline()
s.send_multipart(P.client_request("echo", [b"no header, no HELLO"]))
s.linger = 5000
s.close()
zmq.Context.instance().term()
"""


def test_a_refusal_read_after_its_connection_closed_never_ends_another_process_connection(worker):
    """As above, the number taken by another client's connection to the direct socket (the
    lowest free number: what a busy worker accepts next): that client's connection was shut
    down for a peer that had left."""
    import socket
    import subprocess
    import sys

    ds = worker.direct_socket
    leaver = subprocess.Popen([sys.executable, "-c", _LEAVER, ds.endpoint], stdin=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    c = None
    held: list[int] = []
    try:
        assert ds.sock.poll(10_000), "nothing reached the direct socket"
        frames = ds.next_message(link=False)
        route, fd = bytes(frames[0]), frames[1].get(zmq.SRCFD)
        ino = os.fstat(fd).st_ino
        worker._on_direct_frames(frames, time.monotonic())
        reply = [route, *P.client_reply(True, b"echo", P.error_body(1, 500, "filler"))]
        while ds.send(reply) is True:  # its queue fills (as with its lease's FINALs)
            pass
        leaver.communicate(b"go\n", timeout=10)  # it sends a request that will be refused, and leaves
        _gone(fd, ino)
        # Another client connects: its connection takes the lowest free number, the leaver's.
        null = os.open(os.devnull, os.O_RDONLY)
        held.append(null)
        for n in range(fd + 1):
            try:
                os.fstat(n)
            except OSError:
                held.append(os.dup2(null, n))
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # (its own number is not that one)
        os.close(fd)
        held.remove(fd)
        c.connect(ds.path)
        deadline = time.monotonic() + 5
        while True:
            try:
                with socket.socket(fileno=os.dup(fd)) as conn:
                    if conn.getsockname() == ds.path:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the new connection did not take the leaver's number"
            time.sleep(0.005)  # polling a condition (libzmq's accept), not a delay
        for n in held:
            os.close(n)
        held.clear()
        refused = len(worker._held)
        _take(worker, lambda: ds.ended or len(worker._held) > refused)
        c.setblocking(False)
        end = None
        try:
            while c.recv(4096):  # libzmq's greeting, then the end if it was shut down
                pass
            end = "shut down"
        except BlockingIOError:
            pass
        except OSError as e:
            end = repr(e)
        assert end is None and ds.ended == 0, (
            f"another client's connection, which took the number of one that had left, was {end} "
            f"({ds.ended} ended)")
    finally:
        for n in held:
            os.close(n)
        if c is not None:
            c.close()
        if leaver.poll() is None:
            leaver.kill()
        leaver.wait(5)


@pytest.mark.parametrize("tcp", [False, True])
def test_a_connection_that_does_not_read_is_ended_over_ipc_and_tcp(tmp_path, tcp):
    """What the two tests above must not lose: a live connection whose queue is full, its
    descriptor noted at a refusal, is ended (`DirectSocket.end_connection`), over ipc and
    over tcp (the peer checks of `note_refused` pass for it), and its peer sees the end."""
    from gpu_worker.leases import DirectSocket, Unsent

    ctx = zmq.Context()
    ds = DirectSocket(ctx, path=str(tmp_path / "w.ipc"), link=False, tcp="tcp://127.0.0.1:*" if tcp else None)
    h = ctx.socket(zmq.DEALER)
    h.linger = 0
    h.rcvhwm = 1
    mon = h.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        h.connect(ds.endpoint)
        h.send_multipart(P.client_heartbeat())
        assert ds.sock.poll(5000), "nothing reached the direct socket"
        frames = ds.next_message(link=False)
        route = bytes(frames[0])
        ds.note_refused(route, frames[1])
        reply = [route, *P.client_reply(True, b"echo", P.error_body(1, 400, "refused"))]
        while ds.send(reply) is True:
            pass
        assert ds.send(reply) is Unsent.FULL
        assert ds.end_connection(route) and ds.ended == 1 and ds.ended_route(route)
        deadline = time.monotonic() + 5
        while not mon.poll(0):
            assert time.monotonic() < deadline, "the connection did not end"
            while h.poll(20):
                h.recv_multipart()
    finally:
        h.disable_monitor()
        mon.close(0)
        h.close(0)
        ds.close()
        ctx.term()


def test_a_noted_number_that_a_file_took_leaks_no_descriptor(tmp_path):
    """`note_refused` and `end_connection` look at the socket under a noted number through a
    copy of it; when the number holds a file by then (the connection left, and the worker
    opened something else), `socket.socket` refused the copy and kept it open: a descriptor
    leaked per refusal of such a connection (the review of the churn hunt)."""
    from gpu_worker.leases import DirectSocket

    def nulls() -> int:
        n = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{name}") == os.devnull
            except OSError:
                pass
        return n

    ctx = zmq.Context()
    ds = DirectSocket(ctx, path=str(tmp_path / "w.ipc"), link=False)
    h = ctx.socket(zmq.DEALER)
    h.linger = 0
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        h.connect(ds.endpoint)
        h.send_multipart(P.client_heartbeat())
        assert ds.sock.poll(5000), "nothing reached the direct socket"
        frames = ds.next_message(link=False)
        route, fd, peer = bytes(frames[0]), frames[1].get(zmq.SRCFD), frames[1].get("Peer-Address")
        ino = os.fstat(fd).st_ino
        ds.note_refused(route, frames[1])  # noted: a live connection
        h.close(0)
        _gone(fd, ino)
        os.dup2(null, fd)  # a file takes its number

        class Frame:  # a later request of the route that left, read now
            def get(self, what):
                return fd if what == zmq.SRCFD else peer

        before = nulls()
        assert not ds.end_connection(route)
        ds.note_refused(b"another", Frame())
        ds.note_refused(b"another", Frame())
        assert nulls() == before, f"{nulls() - before} descriptors leaked"
        os.close(fd)
    finally:
        os.close(null)
        h.close(0)
        ds.close()
        ctx.term()


def test_direct_connections_that_came_and_left_between_two_looks_count_toward_a_trim(worker, monkeypatch):
    """libzmq keeps each direct connection's buffers (~40 KB) in the C heap; the worker gives
    that memory back after many closed (`_trim_after_closes`, once a housekeeping interval).
    It counted only a fall in its open descriptors between two looks: a crowd that came and
    left between two looks (1,500 leaseholder connections within the worker's first second,
    or within any interval) showed none, and its 44 MB stayed for good.  The direct socket's
    ends are counted as they come (its monitor), whenever the looks are."""
    from broker.protocol import heap
    from broker.protocol.heap import TRIM_AFTER_CLOSES

    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1))  # (what `heap.start_trim` runs)
    worker._trim_after_closes()  # the look before the crowd
    ctx = zmq.Context()
    router = worker.direct_socket.sock
    try:
        crowd = []
        for _ in range(TRIM_AFTER_CLOSES + 8):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(worker.direct_socket.endpoint)
            s.send(b"hi")
            crowd.append(s)
        for _ in crowd:  # each one accepted, and read
            assert router.poll(5000), "a connection of the crowd never reached the direct socket"
            router.recv_multipart()
    finally:
        ctx.destroy(linger=0)  # the crowd leaves, before the next look
    deadline = time.monotonic() + 10
    while True:  # the worker sees the ends as libzmq does (its I/O thread, soon after)
        worker._trim_after_closes()
        if worker._trimming is not None:
            break
        assert time.monotonic() < deadline, "no trim after a crowd of direct connections came and left"
        time.sleep(0.01)  # (polling a condition, not a delay)
    worker._trimming.join(5)
    assert trims == [1]


def test_many_direct_connections_ending_between_two_looks_never_stop_the_socket(worker):
    """Their ends wait for the next housekeeping look in the socket monitor's queue, which
    has no bound: libzmq's I/O thread waits on a full one, and with it every connection of
    the direct socket (past 2,000 ends between two looks it took no message more)."""
    ctx = zmq.Context()
    router = worker.direct_socket.sock
    ep = worker.direct_socket.endpoint
    crowd = [ctx.socket(zmq.DEALER) for _ in range(200)]  # under any descriptor limit a test runs with
    ended = 0
    try:
        for s in crowd:
            s.linger = 0
            s.connect(ep)
        while True:
            for s in crowd:
                s.send(b"hi")
            for _ in crowd:  # each connection made and read
                assert router.poll(5000), f"the direct socket took no message more after {ended} connections ended"
                router.recv_multipart()
            if ended >= 2200:
                break
            for s in crowd:  # each one ends; a new one comes in its place
                s.disconnect(ep)
                s.connect(ep)
            ended += len(crowd)
    finally:
        ctx.destroy(linger=0)
    ended += len(crowd)
    deadline, seen = time.monotonic() + 10, 0
    while seen < ended:  # every end counted, at the look
        seen += worker.direct_socket.closed_connections()
        assert time.monotonic() < deadline, f"{seen} of {ended} ends seen"
        time.sleep(0.01)  # (polling a condition, not a delay)


def test_a_direct_socket_at_a_closed_ones_address_opens(tmp_path, monkeypatch):
    """Its monitor's inproc name is its own in the process.  It was id(self): a closed
    DirectSocket's successor often has its address, and libzmq's reaper thread frees a
    closed socket's inproc name only later, so a worker opened again in the same process
    (every in-process worker test with direct=True) could fail: Address already in use.
    Every object here has "the same address", so the name must not come from it."""
    from gpu_worker import leases

    monkeypatch.setattr(leases, "id", lambda obj: 1, raising=False)
    ctx = zmq.Context()
    first = leases.DirectSocket(ctx, path=str(tmp_path / "a.ipc"), link=False)
    try:
        second = leases.DirectSocket(ctx, path=str(tmp_path / "b.ipc"), link=False)
        second.close()
    finally:
        first.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("metrics, outcomes", [(False, False), (False, True), (True, False), (True, True)])
def test_a_welcome_asking_for_outcomes_gets_them_in_dones_whether_or_not_the_broker_counts(
        tmp_path, metrics, outcomes):
    """WELCOME `outcomes`: the broker's congestion rule reads the deadlines this worker misses
    (its 504s), so the DONEs carry the outcomes without the broker counting (no STATS)."""
    w = _worker(tmp_path, direct=False)
    try:
        welcome = P.Welcome(instance=b"\x01" * 8, heartbeat_interval=1.0, heartbeat_liveness=3,
                            metrics=metrics, outcomes=outcomes)
        w.on_message(P.to_worker_welcome(b"", welcome)[1:])
        assert w.dones.info is (metrics or outcomes) and w.counts is metrics
    finally:
        w.close()
