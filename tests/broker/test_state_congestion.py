"""broker.state under congestion (adaptive LIFO): a queue that has not emptied for
``lifo_after`` serves each principal's newest requests first ("Congestion" in
broker/state.py's docstring).  Event by event, injected clock."""
from __future__ import annotations

import math

import pytest

from broker.state import ClientError, Config, Dispatch, ErrorCode, Priority, Scheduler

from tests.broker.test_state import of, only

A, B = b"client-a", b"client-b"


def req(s, rid, now, client=A, **kw):
    # Newest first is for requests that leave by their deadline: each has one, unless said.
    kw.setdefault("deadline", 1000.0)
    return s.client_request(client, rid, "svc", now, payload=f"p{rid}", **kw)


def busy_worker(**cfg):
    """A scheduler with one worker of credit 1, busy with request 0 (sent at 0)."""
    s = Scheduler(Config(**cfg))
    s.worker_ready(b"w", "svc", 0.0)
    return s, only(req(s, 0, 0.0), Dispatch).token


def missed(s, now, service="svc"):
    """A request of ``service`` missed its deadline at ``now`` (the queue's, or a worker's
    504): Congestion's second test, set where a test's events hold none (an eviction)."""
    s._services[service].missed = now


def drain(s, token, now, n, step=0.0, code=0, miss=True):
    """Let the worker finish ``n`` requests, one after the other: the ids dispatched.  Each
    answered ``code``; with ``miss``, a deadline of the service missed just before each
    (`missed`: what makes a queue that has not emptied congested; a queue that keeps its
    deadlines stays first in first out)."""
    order = []
    for _ in range(n):
        if miss:
            missed(s, now)
        d = of(s.worker_final(b"w", token, now, None, code), Dispatch)
        if not d:
            break
        order.append(d[0].request_id)
        token = d[0].token
        now += step
    return order, token


def test_a_queue_that_drains_in_time_is_first_in_first_out():
    s, token = busy_worker()
    for rid in (1, 2, 3):
        req(s, rid, 0.0)
    assert drain(s, token, 0.05, 3)[0] == [1, 2, 3]
    assert s.stats()["counters"]["newest_first"] == 0


def test_a_queue_that_has_not_emptied_but_keeps_its_deadlines_stays_first_in_first_out():
    """A standing queue alone is no overload: closed-loop callers (threads of one process,
    coroutines sharing a client, each sending its next call as the previous returns) keep
    one, and newest first left the one whose request was oldest waiting to its deadline
    while its siblings were served (the operations audit: one of four threads 6.6 s, the
    others 1.2 s at most).  Newest first only while requests miss their deadlines."""
    s, token = busy_worker()
    for rid in (1, 2, 3):
        req(s, rid, 0.0)
    req(s, 4, 0.08)
    assert drain(s, token, 0.5, 4, miss=False)[0] == [1, 2, 3, 4]
    assert s.stats()["counters"]["newest_first"] == 0
    # A worker's 504 ("not run") for one that waited a quarter of its budget or more in the
    # queue is a miss: newest first, for 0.1 s.  For one sent on at once (0 of it: request
    # 0, its timeout shorter than the model's run), it says nothing of the queue.
    s, token = busy_worker()
    for rid in (1, 2, 3, 4):
        req(s, rid, 0.0, deadline=1.0)
    d = only(s.worker_final(b"w", token, 0.3, None, ErrorCode.DEADLINE_EXCEEDED), Dispatch)
    assert d.request_id == 1  # request 0's 504: no miss, in order
    d = only(s.worker_final(b"w", d.token, 0.3, None, ErrorCode.DEADLINE_EXCEEDED), Dispatch)
    assert d.request_id == 4  # request 1 waited 0.3 of its 1.0 s: a miss, newest first
    assert drain(s, d.token, 0.45, 2, miss=False)[0] == [2, 3]  # (0.15 s after it: in order again)
    s, token = busy_worker()
    for rid in (1, 2, 3, 4):
        req(s, rid, 0.0, deadline=0.3 if rid == 1 else 9.0)
    assert only(s.tick(0.3), ClientError).request_id == 1  # lost in the queue: newest first
    assert drain(s, token, 0.35, 3, miss=False)[0] == [4, 3, 2]


def test_a_queue_that_has_not_emptied_for_lifo_after_serves_the_newest_first():
    s, token = busy_worker()
    for rid in (1, 2, 3):
        req(s, rid, 0.0)
    req(s, 4, 0.08)
    # 0.1 s (the default lifo_after) since the queue last went from empty to not
    assert drain(s, token, 0.1, 4)[0] == [4, 3, 2, 1]
    assert s.stats()["counters"]["newest_first"] == 4


def test_the_queue_is_first_in_first_out_again_once_it_has_emptied():
    s, token = busy_worker()
    req(s, 1, 0.0)
    req(s, 2, 0.0)
    order, token = drain(s, token, 0.5, 2)
    assert order == [2, 1]
    # Emptied at 0.5; a new burst at 0.55 drains first in first out for 0.1 s...
    for rid in (3, 4, 5):
        req(s, rid, 0.55)
    order, token = drain(s, token, 0.6, 1)
    assert order == [3]
    # ...and newest first after it (the queue has not emptied since 0.55).
    assert drain(s, token, 0.7, 2)[0] == [5, 4]


def test_a_streams_frames_are_served_in_their_order_when_congested():
    # Found by the streams audit: a stream's frames (latest_wins off, six in flight) were run
    # newest first under congestion, 46 of 153 after a newer one, which the client then had
    # delivered ahead of it.  A FIFO whose oldest is a stream's frame is walked in order; the
    # client already gives up its stale frames.  Another principal's plain requests are not.
    s, token = busy_worker()
    for rid in (1, 2, 3):
        req(s, rid, 0.0, stream=True)
    for rid in (11, 12, 13):
        req(s, rid, 0.0, client=B)
    order = drain(s, token, 0.2, 6)[0]
    assert [r for r in order if r < 10] == [1, 2, 3]
    assert [r for r in order if r > 10] == [13, 12, 11]


def test_a_negative_lifo_after_means_first_in_first_out_always():
    s, token = busy_worker(lifo_after=-1.0)
    for rid in (1, 2, 3):
        req(s, rid, 0.0)
    assert drain(s, token, 10.0, 3)[0] == [1, 2, 3]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_lifo_after_must_be_finite(bad):
    with pytest.raises(ValueError, match="lifo_after"):
        Scheduler(Config(lifo_after=bad))


def test_retries_are_still_served_first_when_congested():
    """A request whose worker died goes back to the front of its FIFO: it has waited its
    turn already, and is served before the newest."""
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    only(req(s, 1, 0.0), Dispatch)  # on w1
    d2 = only(req(s, 2, 0.0), Dispatch)  # on w2
    for rid in (3, 4, 5):
        req(s, rid, 0.0)
    assert s.worker_disconnect(b"w1", 0.2) == []  # 1 back at the front
    order = []
    token = d2.token
    now = 0.3
    for _ in range(4):
        missed(s, now)
        d = only(s.worker_final(b"w2", token, now, None), Dispatch)
        order.append((d.request_id, d.attempt))
        token = d.token
    assert order == [(1, 1), (5, 0), (4, 0), (3, 0)]


def test_principals_still_take_turns_when_congested():
    s, token = busy_worker()
    for rid in range(1, 6):
        req(s, rid, 0.0)
    req(s, 11, 0.0, client=B)
    req(s, 12, 0.01, client=B)
    assert drain(s, token, 0.2, 7)[0] == [5, 12, 4, 11, 3, 2, 1]


def test_a_steady_normal_stream_is_not_starved_by_an_urgent_flood_when_congested():
    """Newest first, the normal candidate is always young; its principal's wait still counts
    from its oldest queued request, so aging serves it about every (3 - 1) x aging_s, as
    without congestion (counted from the young candidate, it was never served)."""
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, 0, 0.0, priority=Priority.URGENT), Dispatch).token
    rid = 1
    now = 0.0
    normal_served = []
    while now < 10.0:
        now += 0.1
        for client, pri in ((A, Priority.URGENT), (B, Priority.NORMAL)):
            req(s, rid, now, client=client, priority=pri)
            rid += 1
        missed(s, now)
        d = only(s.worker_final(b"w", token, now, None), Dispatch)
        token = d.token
        if d.client == B:
            normal_served.append(now)
    assert s.stats()["counters"]["newest_first"] > 50
    assert len(normal_served) >= 5, normal_served
    gaps = [b - a for a, b in zip(normal_served, normal_served[1:])]
    assert max(gaps) < 2.0, gaps


def test_a_full_congested_queue_evicts_what_the_heaviest_would_have_served_last():
    """Admission is unchanged: the newcomer of the heaviest principal is refused at once (its
    backpressure).  Another principal's newcomer takes the place of the heaviest's request
    its walk would serve last: newest first, that is its oldest (doomed anyway, its caller
    about to give up), not its newest, which it would have served next."""
    s, token = busy_worker(max_queue=3)
    for rid in (1, 2, 3):
        req(s, rid, 0.0)
    err = only(req(s, 4, 0.2), ClientError)
    assert (err.request_id, err.code) == (4, ErrorCode.QUEUE_FULL)
    missed(s, 0.3)
    err = only(req(s, 11, 0.3, client=B), ClientError)
    assert (err.client, err.request_id, err.code) == (A, 1, ErrorCode.QUEUE_FULL), (
        f"evicted A's {err.request_id}: the walk serves A's newest first, so its oldest (1) "
        f"is the one it would serve last")
    assert "its oldest request" in err.message and "made room for another client's" in err.message
    assert "largest share" in err.message
    assert s.stats()["counters"]["evicted"] == 1
    assert s.stats()["counters"]["rejected_full"] == 1
    assert drain(s, token, 0.4, 3)[0] == [3, 11, 2]


def test_a_full_queue_that_drains_still_evicts_the_heaviest_s_newest():
    s, token = busy_worker(max_queue=3)
    for rid in (1, 2, 3):
        req(s, rid, 0.0)
    err = only(req(s, 11, 0.05, client=B), ClientError)  # 0.05 < lifo_after: not congested
    assert (err.client, err.request_id) == (A, 3)
    assert "its newest request made room for another client's" in err.message
    assert drain(s, token, 0.06, 3)[0] == [1, 11, 2]


def test_eviction_from_a_congested_fifo_walked_in_order_takes_its_newest():
    """A FIFO whose head has no deadline is walked in order when congested: its newest is
    served last, and is the one evicted (as in a queue that drains)."""
    s, token = busy_worker(max_queue=3)
    req(s, 1, 0.0, deadline=None)
    req(s, 2, 0.0)
    req(s, 3, 0.0)
    err = only(req(s, 11, 0.3, client=B), ClientError)
    assert (err.client, err.request_id) == (A, 3)
    assert drain(s, token, 0.4, 3)[0] == [1, 11, 2]


def test_eviction_never_takes_a_retry_from_a_congested_queue():
    """A request put back at the front of its FIFO (its worker died) has had its turn; its
    FIFO is walked in order, so its newest goes, never the retry."""
    s = Scheduler(Config(max_queue=4))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    only(req(s, 1, 0.0), Dispatch)  # on w1
    d = only(req(s, 0, 0.0, client=B), Dispatch)  # on w2
    for rid in (2, 3, 4):
        req(s, rid, 0.0)
    assert s.worker_disconnect(b"w1", 0.2) == []  # 1 back at the front of A's FIFO
    missed(s, 0.3)
    err = only(req(s, 11, 0.3, client=b"client-c"), ClientError)
    assert (err.client, err.request_id) == (A, 4)
    order = []
    token = d.token
    for _ in range(4):
        missed(s, 0.4)
        d = only(s.worker_final(b"w2", token, 0.4, None), Dispatch)
        order.append(d.request_id)
        token = d.token
    assert order == [1, 11, 3, 2]


@pytest.mark.parametrize("lifo_after", [None, 0.1])
def test_eviction_takes_another_class_s_request_before_a_retry(lifo_after):
    """The heaviest's newest request is a retry (at the front of its FIFO, alone there): the
    eviction takes one of its requests of another class instead, the one that class's walk
    would serve last (congested: the oldest; draining: the newest)."""
    s = Scheduler(Config(max_queue=3, lifo_after=lifo_after))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    t1 = only(req(s, 0, 0.0, client=B), Dispatch).token  # on w1
    only(req(s, 20, 0.0, client=B), Dispatch)  # on w2
    bg = Priority.BACKGROUND
    req(s, 1, 0.0, priority=bg)
    req(s, 2, 0.01, priority=bg)
    req(s, 3, 0.1)  # normal: w1's next
    d = only(s.worker_final(b"w1", t1, 0.15, None), Dispatch)
    assert d.request_id == 3
    assert s.worker_disconnect(b"w1", 0.2) == []  # 3 back at the front of A's normal FIFO
    missed(s, 0.3)
    err = only(req(s, 11, 0.3, client=b"client-c"), ClientError)
    assert err.client == A and err.request_id != 3, "a retry was evicted"
    assert err.request_id == (2 if lifo_after is None else 1)


def test_congested_eviction_across_classes_takes_the_least_urgent_class_first():
    """Each class has its own FIFO: the least urgent class goes first, and from its FIFO
    what its walk serves last: walked newest first, its oldest; walked in order (its head
    has no deadline), its newest."""
    s, token = busy_worker(max_queue=6)
    req(s, 1, 0.0, deadline=None)  # A's normal FIFO: walked in order
    req(s, 2, 0.08)
    for rid, now in ((3, 0.01), (4, 0.02)):
        req(s, rid, now, priority=Priority.URGENT)
    for rid, now in ((5, 0.01), (6, 0.02)):
        req(s, rid, now, priority=Priority.BACKGROUND)
    evicted = []
    missed(s, 0.3)
    for k, now in enumerate((0.3, 0.31, 0.32, 0.33, 0.34)):
        err = only(req(s, 100 + k, now, client=b"other-%d" % k), ClientError)
        assert err.client == A
        evicted.append(err.request_id)
    # Background 5, 6 (oldest first), normal 2, 1 (in order: newest first), urgent 3.
    assert evicted == [5, 6, 2, 1, 3], evicted


def test_the_oldest_wait_on_and_are_failed_by_their_deadlines_never_dispatched():
    s, token = busy_worker()
    req(s, 1, 0.0, deadline=0.25)
    req(s, 2, 0.0, deadline=5.0)
    req(s, 3, 0.2, deadline=5.0)
    assert s.next_wakeup(0.2) == 0.25
    err = only(s.tick(0.25), ClientError)
    assert (err.request_id, err.code) == (1, ErrorCode.DEADLINE_EXCEEDED)
    assert drain(s, token, 0.3, 2)[0] == [3, 2]


def test_a_request_without_a_deadline_is_not_starved_by_newer_ones_when_congested():
    """Newest first is safe only for requests that leave by their deadline: one without a
    deadline (a batch job's call with timeout=None) waited, behind a client that keeps its
    pipeline full, for as long as it kept sending (for ever).  A FIFO whose head has no
    deadline is walked in order; the requests with one are still served newest first."""
    s, token = busy_worker()
    req(s, 1, 0.0, deadline=None)
    req(s, 2, 0.0, deadline=60.0)
    served = []
    now, rid = 0.1, 3
    for _ in range(40):  # one new request per completion: the queue never empties
        req(s, rid, now, deadline=now + 60.0)
        rid += 1
        missed(s, now)
        d = only(s.worker_final(b"w", token, now, None), Dispatch)
        served.append(d.request_id)
        token = d.token
        now += 0.05
    assert 1 in served, f"the request without a deadline was never served: {served}"
    assert served[:3] == [1, 4, 5], served
    assert s.stats()["counters"]["newest_first"] >= 40


def test_the_queue_wait_under_overload_counts_the_requests_their_deadline_took_from_it():
    """Newest first, what is dispatched waited little and the queue's wait is in what its
    deadline takes out of it, never dispatched.  Counted from dispatches alone, the p99 queue
    wait (the autoscaler's signal and ZmqInferQueueWaitHigh's, docs/deploy.md) fell as the
    overload grew: here (5x a worker's capacity, four calls in five failing) it was 4 ms,
    under the autoscaler's 20 ms target and ZmqInferQueueWaitHigh's 50 ms (docs/deploy.md).  A request its deadline took out of the queue says when
    (``ClientError.left_queue``) and the server counts that wait too."""
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    waits = []
    running = []  # (token, finishes at)
    now, rid = 0.0, 0

    def seen(actions, now):
        for a in actions:
            if isinstance(a, Dispatch):
                waits.append(now - a.enqueued_at)
                running.append((a.token, now + 0.02))  # a 20 ms model
            elif isinstance(a, ClientError) and a.code == ErrorCode.DEADLINE_EXCEEDED:
                left = getattr(a, "left_queue", None)
                if left is not None:
                    waits.append(left - a.enqueued_at)

    while now < 10.0:  # a request every 4 ms, each with a 100 ms timeout: 5x what it serves
        rid += 1
        seen(req(s, rid, now, deadline=now + 0.1), now)
        seen(s.tick(now), now)
        now = round(now + 0.004, 6)
        while running and running[0][1] <= now:
            token, at = running.pop(0)
            seen(s.worker_final(b"w", token, at, None), at)
    assert s.stats()["counters"]["newest_first"] > 100
    waits.sort()
    p99 = waits[int(0.99 * (len(waits) - 1))]
    assert p99 >= 0.09, f"p99 queue wait {p99 * 1e3:.1f} ms at 5x overload ({len(waits)} waits)"
