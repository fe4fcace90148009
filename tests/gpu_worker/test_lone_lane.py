"""The worker's lone-request lane (`Worker._lone_ready`, `Batcher.goes_alone`): a request that
the batcher would send alone at once runs while it is handled, without the batcher's queue,
and only then.  Pure batcher rules first (one property: `goes_alone` decides what `add` then
`take` would, and leaves the same state), then in process with real sockets (an inproc pair
for the broker, a DEALER on the direct socket for a leaseholder), the loop's steps driven
one by one with the lane on, as `serve` has it."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol as P
from gpu_worker.batching import Batcher, Pending
from gpu_worker.worker import Worker, WorkerConfig
from tests.gpu_worker.pair_link import PairLink

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 16
KEY = (("x", "<f4", (4,)),)


# ------------------------------------------------------------------ the batcher's rule


def test_an_empty_latency_first_batcher_sends_a_request_without_backlog_alone():
    b = Batcher(max_batch=8, max_delay=0.01)
    assert b.goes_alone(KEY, 1.0, 0)
    assert b.goes_alone(KEY, 1.001, 0)
    # Counted as an arrival, as add() counts it: the next one has an inter-arrival gap.
    b.idle()
    b.add(Pending(key=KEY, cost=1.0, item="a", arrived=1.002, backlog=3), 1.002)
    assert b.wake_at(1.002) > 1.002  # a backlog and a known gap of 1 ms: it waits for company


def _seen(b: Batcher, *times: float) -> Batcher:
    """`b` after requests arrived at ``times``, each run at once (a known arrival rate)."""
    for t in times:
        b.add(Pending(key=KEY, cost=1.0, item=t, arrived=t), t)
        assert len(b.take(t, idle=True, force=True)) == 1
        b.idle()
    return b


@pytest.mark.parametrize("backlog", [None, 1])
def test_a_backlog_or_no_word_from_the_broker_brings_the_waiting_rules_back(backlog):
    # Arrivals 0.5 ms apart under a 10 ms max_delay: company is likely, so it waits.
    b = _seen(Batcher(max_batch=8, max_delay=0.01), 1.0, 1.0005, 1.001)
    assert not b.goes_alone(KEY, 1.0015, backlog)
    assert b.goes_alone(KEY, 1.0015, 0)  # ... unless the broker says nothing else is queued


def test_a_pending_request_keeps_the_batcher_in_charge():
    b = Batcher(max_batch=8)
    b.add(Pending(key=KEY, cost=1.0, item="a", arrived=1.0, backlog=0), 1.0)
    assert not b.goes_alone(KEY, 1.0, 0)


def test_the_throughput_policy_goes_alone_on_light_traffic_and_waits_on_evidence():
    b = Batcher(max_batch=8, max_delay=0.01, latency_first=False)
    assert b.goes_alone(KEY, 1.0, 0)  # nothing known of the traffic yet: light
    b.idle()
    assert b.goes_alone(KEY, 1.5, 0)  # a gap far over max_delay: light
    b.idle()
    b = _seen(Batcher(max_batch=8, max_delay=0.01, latency_first=False), 1.0, 1.0005, 1.001)
    assert not b.goes_alone(KEY, 1.0015, 0)  # 0.5 ms apart: it waits, backlog or not
    assert Batcher(max_batch=1, latency_first=False).goes_alone(KEY, 1.0, 5)


def test_a_finite_max_cost_leaves_the_decision_to_add_and_take():
    b = Batcher(max_batch=8, max_cost=10.0, latency_first=False)
    assert not b.goes_alone(KEY, 1.0, None)
    assert b.goes_alone(KEY, 1.0, 0) is False  # throughput: cost rules need it queued
    assert Batcher(max_batch=8, max_cost=10.0).goes_alone(KEY, 1.0, 0)  # latency first, no backlog


_PARAMS = st.fixed_dictionaries({
    "max_batch": st.sampled_from([1, 4]),
    "latency_first": st.booleans(),
    "max_delay": st.sampled_from([0.0005, 0.002]),
    "deadline_margin": st.sampled_from([0.0, 0.001]),
})
_ARRIVALS = st.lists(st.tuples(st.sampled_from([0.0, 0.0002, 0.001, 0.003, 0.05]),   # gap before it
                               st.sampled_from([None, 0, 2]),                        # backlog
                               st.sampled_from([None, 0.0005, 0.01])),               # its timeout
                     min_size=1, max_size=60)


def _rates(b: Batcher) -> dict:
    return {k: (r.last, r.gap, r.gain, r.waited_from, r.skips) for k, r in b._rates.items()}


@settings(max_examples=300, deadline=None)
@given(params=_PARAMS, arrivals=_ARRIVALS)
def test_goes_alone_decides_what_add_then_take_would(params, arrivals):
    """Each arrival meets an idle, empty batcher (the case the lane asks about): the
    reference adds it and takes at once; the lane's asks `goes_alone`, and on False adds it
    (observed) and takes.  Both say the same, and keep the same arrival-rate state; what
    waits is then run (forced) on both, as a worker would after the wait."""
    ref, lane = Batcher(**params), Batcher(**params)
    t = 10.0
    for i, (gap, backlog, timeout) in enumerate(arrivals):
        t += gap
        deadline = None if timeout is None else t + timeout
        p = Pending(key=KEY, cost=1.0, item=i, arrived=t, deadline=deadline, backlog=backlog)
        ref.add(p, t)
        went = ref.take(t, idle=True)
        alone = lane.goes_alone(KEY, t, backlog, deadline)
        assert bool(went) == alone, (i, params)
        if not alone:
            lane.add(p, t, observed=True)
            assert lane.take(t, idle=True) == []
            # The wait ends: it runs, or, unable to finish in time while others wait at
            # the broker, is set aside (batching.py, "Deadlines"); the same on both.
            ends = [(len(b.take(t, idle=True, force=True)), len(b.expire(t))) for b in (ref, lane)]
            assert ends[0] == ends[1] and sum(ends[0]) == 1, (i, params, ends)
        for b in (ref, lane):
            b.idle()
        assert _rates(ref) == _rates(lane), (i, params)
        assert len(ref) == len(lane) == 0


# ------------------------------------------------------------------ in the worker


class _Pair(PairLink):
    def request(self, token: int, *, backlog: int | None = 0, timeout_ms: float | None = None,
                priority: int = 1) -> None:
        x = np.arange(4, dtype=np.float32)
        head = P.encode_header(P.Request(id=token, reply="inline", backlog=backlog, timeout_ms=timeout_ms,
                                         priority=priority,
                                         tensors=[P.TensorRef("x", "<f4", [4], P.InlineLoc(frame=0))]))
        self.to_worker([P.MDPW, P.W_REQUEST, P.token_envelope(token), b"", head, x.tobytes()])

    def finals(self, n: int) -> list[P.Reply]:
        out = []
        deadline = time.monotonic() + 5
        while len(out) < n:
            assert self.peer.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no FINAL"
            msg = P.parse_worker(self.peer.recv_multipart())
            if msg.command == P.W_FINAL:
                out.append(P.decode_reply(msg.body[0], len(msg.body) - 1))
        return out


def _worker(tmp_path, **kw) -> Worker:
    up = _Pair(f"lane-{id(tmp_path)}-{len(kw)}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", warmup=False, credit=8, **kw), upstream=up)
    w._connect()
    w.up = up
    w.lone_lane = True  # as serve() has it
    return w


@pytest.fixture
def worker(tmp_path):
    w = _worker(tmp_path, direct=True)
    try:
        yield w
    finally:
        w.close()


def _read(w: Worker, n: int) -> None:
    """Let the loop read `n` messages from the broker (inproc delivers at once)."""
    deadline = time.monotonic() + 5
    while n:
        assert w.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))), "nothing arrived"
        w.on_message(w.sock.recv_multipart(copy=False))
        n -= 1


def test_a_lone_brokered_request_is_answered_while_it_is_handled(worker):
    worker.up.request(1)
    _read(worker, 1)
    assert not worker.jobs and len(worker.batcher) == 0  # never queued
    [rep] = worker.up.finals(1)
    assert rep.id == 1 and rep.error is None and rep.timing["batch"] == 1.0
    assert worker.served == 1 and worker.running == {}
    worker.run_ready_batches()  # the loop's next step finds nothing to do


def test_the_lane_is_off_outside_serve(tmp_path):
    w = _worker(tmp_path)
    w.lone_lane = False
    try:
        w.up.request(1)
        _read(w, 1)
        assert len(w.jobs) == 1  # in the batcher, for run_ready_batches
        w.run_ready_batches()
        assert [r.id for r in w.up.finals(1)] == [1]
    finally:
        w.close()


def test_requests_waiting_together_in_the_socket_are_batched_together(worker):
    worker.up.request(1)
    worker.up.request(2)
    worker.up.request(3)
    assert worker.sock.poll(5000)
    worker._drain()  # three in the socket: the first sees more behind it, and so on
    assert len(worker.jobs) == 3
    worker.run_ready_batches()
    reps = worker.up.finals(3)
    assert sorted(r.id for r in reps) == [1, 2, 3] and {r.timing["batch"] for r in reps} == {3.0}


def test_a_backlog_at_the_broker_brings_the_batchers_wait_back(tmp_path):
    w = _worker(tmp_path, max_delay=10.0)
    try:
        t = time.monotonic()
        _seen(w.batcher, t - 0.002, t - 0.001)  # requests come often: company is likely
        w.up.request(1, backlog=2)
        _read(w, 1)
        assert len(w.jobs) == 1  # it waits in the batcher for company
        w.up.request(2, backlog=0)
        _read(w, 1)
        assert len(w.jobs) == 2  # a request behind another never takes the lane
    finally:
        w.close()


def test_a_request_past_its_deadline_is_answered_by_the_usual_path(worker):
    worker.up.request(1, timeout_ms=0.0)
    _read(worker, 1)
    [rep] = worker.up.finals(1)
    assert rep.error is not None and rep.error.code == P.ErrorCode.DEADLINE_EXCEEDED


def test_while_a_batch_runs_nothing_takes_the_lane(worker):
    worker.running = {b"other": object()}  # as while a batch computes
    worker.up.request(1)
    _read(worker, 1)
    assert len(worker.jobs) == 1
    worker.running = {}


def test_a_lone_leased_request_is_answered_on_its_connection_and_frees_its_slot(worker):
    grant = P.LeaseGrant(lease=P.lease_id(1), secret=SECRET, service="echo", slots=1,
                         client_host=P.local_host_id(), client_pid=os.getpid())
    worker.on_message(P.to_worker_lease(b"", P.encode_header(grant))[1:])
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(worker.direct_socket.endpoint)
    try:
        s.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=grant.lease, secret=SECRET))])
        x = np.arange(3, dtype=np.int16)
        for rid in (7, 8):  # one slot: the second is admitted only if the first freed it
            head = P.encode_header(P.Request(id=rid, tensors=[P.TensorRef("x", "<i2", [3], P.InlineLoc(frame=0))]))
            s.send_multipart(P.client_request("echo", [head, x.tobytes()]))
            deadline = time.monotonic() + 5
            while not s.poll(0):
                assert time.monotonic() < deadline, "no reply on the lease"
                worker.direct_socket.sock.poll(50)
                worker._drain_direct()
            msg = P.parse_broker_to_client(s.recv_multipart())
            rep = P.decode_reply(msg.body[0], len(msg.body) - 1)
            assert msg.command == P.C_FINAL and rep.id == rid and rep.error is None
            assert np.array_equal(np.frombuffer(msg.body[1], np.int16), x)
            assert not worker.jobs and worker.leases.in_flight(grant.lease) == 0
    finally:
        s.close()
    assert worker.leased_sent == 2


def test_behind_a_pending_request_the_arrival_is_counted_once():
    ref, lane = Batcher(max_batch=8), Batcher(max_batch=8)
    for b in (ref, lane):
        b.add(Pending(key=KEY, cost=1.0, item="a", arrived=1.0), 1.0)
    ref.add(Pending(key=KEY, cost=1.0, item="b", arrived=1.001), 1.001)
    assert not lane.goes_alone(KEY, 1.001, 0)
    lane.add(Pending(key=KEY, cost=1.0, item="b", arrived=1.001), 1.001, observed=True)
    assert _rates(ref) == _rates(lane)


def test_the_workers_queue_runs_the_urgent_request_first(tmp_path):
    """Priorities hold in the worker's own queue (a pinned stream's only queue): three
    requests wait, the urgent one runs first."""
    w = _worker(tmp_path, max_batch=1)
    w.lone_lane = False  # all three wait in the batcher
    try:
        for token, priority in ((1, 1), (2, 2), (3, 0)):
            w.up.request(token, priority=priority)
        _read(w, 3)
        w.run_ready_batches()
        assert [r.id for r in w.up.finals(3)] == [3, 1, 2]
    finally:
        w.close()


def test_after_a_lane_batch_the_drain_returns_to_the_loop(worker):
    """Two requests in the socket, the first alone by the time it runs (the second not
    yet read): one lane batch per drain, then the loop's turn."""
    worker.up.request(1)
    _read(worker, 1)
    worker.up.request(2)
    worker.up.request(3)
    assert worker.sock.poll(5000)
    worker._drain()  # two waiting: both go to the batcher (company), then the loop runs them
    worker.run_ready_batches()
    assert sorted(r.id for r in worker.up.finals(3)) == [1, 2, 3]
    worker._lane_ran = False
    worker.up.request(4)
    assert worker.sock.poll(5000)
    worker._drain()
    assert worker._lane_ran  # it ran alone, and the drain stopped there
    assert [r.id for r in worker.up.finals(1)] == [4]


def test_a_brokered_request_waits_for_what_the_direct_socket_holds(worker):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(worker.direct_socket.endpoint)
    try:
        s.send_multipart([P.MDPC, P.C_HEARTBEAT])  # anything on the direct socket
        assert worker.direct_socket.sock.poll(5000)
        worker.up.request(1)
        _read(worker, 1)
        assert len(worker.jobs) == 1  # not alone: the direct socket is read first
        worker._drain_direct()
        worker.run_ready_batches()
        assert [r.id for r in worker.up.finals(1)] == [1]
    finally:
        s.close()


def test_a_fault_of_the_worker_in_the_lane_ends_the_loop_instead_of_being_dropped(worker, monkeypatch):
    from gpu_worker.worker import LaneFault

    def broken(*a, **kw):
        raise RuntimeError("a bug")
    monkeypatch.setattr(worker, "_complete", broken)
    worker.up.request(1)
    assert worker.sock.poll(5000)
    with pytest.raises(LaneFault, match="a bug"):
        worker._drain()


def test_an_object_array_output_is_an_error_not_pointers(tmp_path):
    from gpu_worker.job import Job
    from gpu_worker.planes import HostPlane

    w = _worker(tmp_path)
    try:
        plane = w.plane
        assert isinstance(plane, HostPlane)
        job = Job(b"e", P.Request(id=1), {}, None, 0.0, None, {})
        with pytest.raises((TypeError, ValueError)):
            plane.write_outputs(job, {"o": np.array([object(), "x"], dtype=object)})
    finally:
        w.close()


def test_the_lane_polls_no_monitor_but_defers_to_one_this_wake_up_found(tmp_path):
    """With serve's Waiter: a connection event still waiting in the monitor's descriptor does
    not keep a lone request out of the lane (it is not polled for it), but one that this
    wake-up's wait found does: the reconnect that may follow gives held work back first."""
    from broker.protocol.wire import Waiter

    w = _worker(tmp_path)
    r, wfd = os.pipe()
    waiter = Waiter()
    try:
        waiter.add(w.sock)
        waiter.add_fd(r)
        w._poller, w._monitor_fd = waiter, r
        os.write(wfd, b"x")  # an event waits on the monitor's descriptor
        w._events = [w.sock]  # ... which this wake-up did not report
        w.up.request(1)
        _read(w, 1)
        assert not w.jobs and [x.id for x in w.up.finals(1)] == [1]  # the lane ran it
        w._events = [w.sock, r]  # this one did
        w.up.request(2)
        _read(w, 1)
        assert len(w.jobs) == 1  # the batcher's way, after the loop's turn
        w.run_ready_batches()
        assert [x.id for x in w.up.finals(1)] == [2]
    finally:
        w._poller = None
        waiter.close()
        w.close()
        os.close(r)
        os.close(wfd)


def test_a_drain_told_a_message_waits_never_blocks_when_none_does(worker):
    """`_drain(ready=True)` (serve's, right after its Waiter found a message) reads without
    waiting: were the message gone, it returns instead of blocking the loop."""
    worker._drain(ready=True)
    assert not worker.jobs and worker.served == 0
    worker.up.request(1)
    assert worker.sock.poll(5000)
    worker._drain(ready=True)
    assert [x.id for x in worker.up.finals(1)] == [1]


def test_while_a_request_waits_for_company_the_loop_sleeps_instead_of_spinning(tmp_path, monkeypatch):
    """`serve` in a thread: a request the batcher holds for company (a backlog at the broker,
    requests seen often) waits out its window of a few milliseconds.  The loop sleeps it to
    the microsecond (`Waiter.wait` takes fractional milliseconds), never as whole ones and a
    run of zero-timeout polls through the loop (which, on a small machine, takes the CPU
    the clients it waits for need)."""
    import threading

    from broker.protocol import wire

    up = _Pair(f"lane-serve-{id(tmp_path)}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", warmup=False, credit=8, max_delay=0.0045),
               upstream=up)
    w.up = up  # serve() connects it (a PAIR pairs once)
    b = w.batcher
    arrived: list[float] = []
    real_alone = b.goes_alone

    def after_two_arrivals(key, now, *args, **kw):
        # Requests 1 ms apart just before this one, stamped from the loop's own stamp of it
        # (on its thread): stamps taken in the test's thread before the loop read the request
        # made the gap its scheduling delay, and a delay over 17.5 ms (a loaded machine) read
        # as light traffic, so the request went alone without waiting.
        arrived.append(now)
        _seen(b, now - 0.002, now - 0.001)
        return real_alone(key, now, *args, **kw)

    monkeypatch.setattr(b, "goes_alone", after_two_arrivals)
    waits: list[tuple[float, float]] = []
    real = wire.Waiter.wait

    def counted(self, ms):
        waits.append((time.monotonic(), ms))
        return real(self, ms)

    monkeypatch.setattr(wire.Waiter, "wait", counted)
    t = threading.Thread(target=w.serve, daemon=True)
    try:
        t.start()
        w.up.request(1, backlog=2)
        [rep] = w.up.finals(1)
        assert rep.error is None and rep.timing["batch_wait_ms"] >= 3.0  # it did wait for company
        ran = list(waits)
        ms_ran = [ms for _, ms in ran]
        # The window's wait, to the microsecond (the old loop passed whole milliseconds and
        # then zeros): each wait begun inside the window is a fraction of a millisecond, and
        # not zero; one zero at most, for a pass that began as the window ended (the loop's
        # thread, not run meanwhile on a loaded machine, may come back only after its end).
        end = arrived[0] + w.batcher.max_delay
        inside = [ms for at, ms in ran if arrived[0] <= at < end]
        assert all(ms % 1 for ms in inside), f"a wait inside the window that is no fraction: {ms_ran}"
        assert ms_ran.count(0) <= 1, f"the loop spun through its batch window: {ms_ran}"
    finally:
        w.stop.set()
        up.to_worker(P.worker_heartbeat())  # a word from the broker ends the loop's idle wait
        t.join(10)
        assert not t.is_alive()
        w.close()
