"""broker.state: fair sharing between clients, eviction of the heaviest, per-client caps.

All on the pure state machine with an injected clock (see the module docstring of
broker.state, sections Connections and principals, Dispatch and Admission).  The tests that
pass no ``principal`` use connections that are their own principal; the section at the end
has principals with many connections.  Every scheduler here has ``lifo_after=None``: these
are the rules of a queue that drains (first in, first out within a principal); the order
and eviction of a congested one are test_state_congestion.py's.
"""
from __future__ import annotations

import pytest

from broker.protocol import CANCEL_CLIENT_GONE
from broker.state import (
    CancelAtWorker,
    ClientError,
    Config,
    Dispatch,
    ErrorCode,
    Priority,
    Scheduler,
    ToClient,
)

from tests.broker.test_state import of, only

A, B, C, D, X = b"A", b"B", b"C", b"D", b"X"




def req(s, client, rid, now=0.0, service="svc", **kw):
    kw.setdefault("payload", (client, rid))
    return s.client_request(client, rid, service, now, **kw)


def drain(s, worker, token, n, now=0.0):
    """Complete the running request ``n`` times; the (client, request id) order dispatched."""
    order = []
    for _ in range(n):
        d = only(s.worker_final(worker, token, now, None), Dispatch)
        order.append((d.client, d.request_id))
        token = d.token
    return order, token


def assert_nothing_held(s):
    st = s.stats()
    assert st["requests"] == 0
    assert st["client_requests"] == 0 and st["client_bytes"] == 0
    assert s._bytes == {} and s._requests == {} and s._outstanding == {}
    assert st["principals"] == 0
    for svc in s._services.values():
        assert svc.queued == 0 and svc.tiers is None
        assert all(not ring for ring in svc.classes)


# ----------------------------------------------------------------------------- the burst


def test_a_burst_of_50000_does_not_delay_or_refuse_another_client():
    s = Scheduler(Config(lifo_after=None, max_queue=100_000, max_client_requests=100_000))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, A, 0), Dispatch).token
    for rid in range(1, 50_001):
        assert req(s, A, rid) == []
    assert s.stats()["services"]["svc"]["queued"]["normal"] == 50_000
    # The other client's request arrives behind the whole burst, and is accepted.
    assert req(s, B, 1, now=0.1) == []
    order, token = drain(s, b"w", token, 3, now=0.2)
    assert (B, 1) in order[:2], order
    assert order == [(A, 1), (B, 1), (A, 2)]  # A was served last (its first request)
    assert s.stats()["counters"]["rejected_full"] == 0


def test_a_burst_that_fills_the_queue_makes_room_for_another_client():
    s = Scheduler(Config(lifo_after=None, max_queue=1024, max_client_requests=100_000))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, A, 0), Dispatch).token
    refused = 0
    for rid in range(1, 50_001):
        out = req(s, A, rid)
        if out:
            # Beyond the queue, A only ever pushes itself out: the newcomer is refused.
            err = only(out, ClientError)
            assert (err.client, err.request_id, err.code) == (A, rid, ErrorCode.QUEUE_FULL)
            refused += 1
    assert refused == 50_000 - 1024
    out = req(s, B, 1, now=0.1)
    # B is queued; A's newest queued request yields its place.
    err = only(out, ClientError)
    assert (err.client, err.request_id, err.code) == (A, 1024, ErrorCode.QUEUE_FULL)
    assert "full" in err.message and "largest share" in err.message
    assert of(out, Dispatch) == []
    c = s.stats()["counters"]
    assert c["evicted"] == 1 and c["rejected_full"] == refused
    order, _ = drain(s, b"w", token, 2, now=0.2)
    assert (B, 1) in order, order


# ----------------------------------------------------------------------------- round robin


def test_round_robin_between_three_clients_in_one_class():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for client in (A, B, C):
        for rid in range(1, 5):
            assert req(s, client, rid) == []
    order, _ = drain(s, b"w", token, 12)
    assert order == [(cl, rid) for rid in range(1, 5) for cl in (A, B, C)]


def test_a_client_that_joins_goes_to_the_back_of_the_ring():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for client in (A, B, C):
        for rid in (1, 2):
            req(s, client, rid)
    order, token = drain(s, b"w", token, 1)
    assert order == [(A, 1)]  # A moves to the back: B, C, A
    req(s, D, 1)  # joins behind A
    order, _ = drain(s, b"w", token, 6)
    assert order == [(B, 1), (C, 1), (A, 2), (D, 1), (B, 2), (C, 2)]


def test_one_client_alone_is_plain_fifo():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, A, 0), Dispatch).token
    for rid in range(1, 6):
        req(s, A, rid)
    order, _ = drain(s, b"w", token, 5)
    assert order == [(A, rid) for rid in range(1, 6)]


def test_a_trickling_client_is_served_every_other_dispatch():
    # A keeps many queued; B always has exactly one queued (it sends the next when it gets
    # a result).  B is never more than one dispatch away.
    s = Scheduler(Config(lifo_after=None, max_queue=10_000))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, A, 0), Dispatch).token
    for rid in range(1, 1001):
        req(s, A, rid)
    req(s, B, 0)
    brid = 0
    served = []
    for _ in range(40):
        d = only(s.worker_final(b"w", token, 0.0, None), Dispatch)
        token = d.token
        served.append(d.client)
        if d.client == B:
            brid += 1
            req(s, B, brid)
    assert served == [A, B] * 20


def test_priorities_still_win_across_classes():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for rid in range(1, 4):
        req(s, A, rid)  # normal
    req(s, C, 1, priority=Priority.BACKGROUND)
    req(s, B, 1, priority=Priority.URGENT)
    req(s, B, 2, priority=Priority.URGENT)
    order, _ = drain(s, b"w", token, 6)
    assert order == [(B, 1), (B, 2), (A, 1), (A, 2), (A, 3), (C, 1)]


def test_aging_still_lets_an_old_class_overtake():
    s = Scheduler(Config(lifo_after=None))  # weights 3/1, aging 0.5 s
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    req(s, A, 1, now=0.0)
    req(s, B, 1, now=1.5, priority=Priority.URGENT)
    order, _ = drain(s, b"w", token, 2, now=1.5)
    assert order == [(A, 1), (B, 1)]


def test_a_deep_urgent_backlog_does_not_starve_another_class():
    """One principal keeps 200 urgent requests queued (any client may claim urgent); another
    sends one normal request.  Scored by the age of the urgent head, the deep backlog's head
    was always about as old as the backlog took to drain, and the normal request waited
    minutes (its client's 8 s deadlines all passed: the resource hunt).  A request's wait
    counts from its principal's previous dispatch in its class, so the normal one goes
    after about (3 - 1) x aging_s = 1 s (weights 3/1, aging 0.5 s)."""
    s = Scheduler(Config(lifo_after=None, max_queue=10_000, max_client_requests=10_000))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for i in range(200):
        req(s, A, i + 1, now=0.0, priority=Priority.URGENT)
    now, step = 0.0, 0.02  # each request takes 20 ms
    for k in range(199):
        now += step
        if k == 100:  # two seconds in, the urgent head has waited 2 s
            req(s, B, 1, now=now)
            sent = now
        d = only(s.worker_final(b"w", token, now, None), Dispatch)
        token = d.token
        if d.client == B:
            break
        if k == 100 + 90:
            pytest.fail("the normal request waited 1.8 s behind a single principal's urgent backlog")
    assert d.client == B
    waited = now - sent
    # Urgent work still wins while fresh: the normal request goes once 1 + waited/0.5 beats
    # 3 x (1 + step/0.5), the urgent head having waited one step since the previous dispatch.
    assert 1.0 <= waited <= 1.0 + 4 * step, waited


# ----------------------------------------------------------------------------- locality


def test_locality_skip_works_across_and_within_client_fifos():
    s = Scheduler(Config(lifo_after=None))
    shm = frozenset({"shm"})
    s.worker_ready(b"wA", "svc", 0.0, host="h", transports=shm)
    s.worker_ready(b"wB", "svc", 0.0, host="other")
    ta = only(req(s, X, 0, local_host="h"), Dispatch).token  # wA busy
    tb = only(req(s, X, 1), Dispatch).token  # wB busy
    req(s, A, 1, local_host="h")  # A's head: only wA can take it
    req(s, A, 2)
    req(s, B, 1)
    # wB frees: A is least recently served; its head cannot go, the request behind it can.
    d = only(s.worker_final(b"wB", tb, 0.1, None), Dispatch)
    assert (d.worker, d.client, d.request_id) == (b"wB", A, 2)
    d = only(s.worker_final(b"wB", d.token, 0.2, None), Dispatch)
    assert (d.worker, d.client, d.request_id) == (b"wB", B, 1)
    d = only(s.worker_final(b"wA", ta, 0.3, None), Dispatch)
    assert (d.worker, d.client, d.request_id) == (b"wA", A, 1)


def test_a_client_with_a_pile_of_unplaceable_requests_does_not_block_others():
    s = Scheduler(Config(lifo_after=None))
    shm = frozenset({"shm"})
    s.worker_ready(b"wA", "svc", 0.0, host="h", transports=shm)
    s.worker_ready(b"wB", "svc", 0.0, host="other")
    only(req(s, X, 0, local_host="h"), Dispatch)
    tb = only(req(s, X, 1), Dispatch).token
    for rid in range(1, 41):
        req(s, A, rid, local_host="h")  # far more than one pass looks at
    req(s, B, 1)
    d = only(s.worker_final(b"wB", tb, 0.1, None), Dispatch)
    assert (d.worker, d.client, d.request_id) == (b"wB", B, 1)


# ----------------------------------------------------------------------------- retries


def test_retries_go_back_to_the_front_of_their_clients_and_the_ring():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w1", "svc", 0.0, credit=2)
    only(req(s, A, 1), Dispatch)
    only(req(s, B, 1), Dispatch)
    req(s, C, 1)
    req(s, A, 2)
    req(s, B, 2)
    s.worker_disconnect(b"w1", 0.1)
    out = s.worker_ready(b"w2", "svc", 0.2, credit=5)
    got = [(d.client, d.request_id, d.attempt) for d in of(out, Dispatch)]
    assert got[:2] == [(A, 1, 1), (B, 1, 1)]
    assert sorted(got[2:]) == [(A, 2, 0), (B, 2, 0), (C, 1, 0)]


# ----------------------------------------------------------------------------- eviction


def test_eviction_takes_the_newest_request_of_the_heaviest_client():
    s = Scheduler(Config(lifo_after=None, max_queue=4))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for rid in (1, 2, 3):
        req(s, A, rid, now=rid / 10)
    req(s, B, 1, now=0.4)
    out = req(s, B, 2, now=0.5)  # 5 > 4: A holds 3, B 2
    err = only(out, ClientError)
    assert (err.client, err.request_id, err.code, err.payload) == (
        A, 3, ErrorCode.QUEUE_FULL, (A, 3))
    assert "largest share" in err.message and "svc" in err.message
    assert s.stats()["counters"]["evicted"] == 1
    # A and B now hold 2 each: a tie refuses the newcomer of a tied client.
    err = only(req(s, A, 4, now=0.6), ClientError)
    assert (err.client, err.request_id, err.code) == (A, 4, ErrorCode.QUEUE_FULL)
    err = only(req(s, B, 3, now=0.7), ClientError)
    assert (err.client, err.request_id) == (B, 3)
    assert s.stats()["counters"]["rejected_full"] == 2
    # A third client, holding nothing, always gets in.
    err = only(req(s, C, 1, now=0.8), ClientError)
    assert err.client in (A, B) and err.request_id == 2
    order, _ = drain(s, b"w", token, 4, now=1.0)
    assert sorted(order) == sorted({(A, 1), (A, 2), (B, 1), (B, 2), (C, 1)} - {(err.client, 2)})


def test_eviction_takes_the_least_urgent_class_first():
    """The class is the one word a client gives on which of its requests it can best do
    without: the heaviest's request that goes is one of its least urgent class queued (in
    it, the newest), not its newest of any class, which was its urgent one here."""
    s = Scheduler(Config(lifo_after=None, max_queue=3))
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, X, 0), Dispatch)
    req(s, A, 1, now=0.0, priority=Priority.BACKGROUND)
    req(s, A, 2, now=0.2, priority=Priority.URGENT)
    req(s, A, 3, now=0.1, priority=Priority.NORMAL)
    err = only(req(s, B, 1, now=0.3), ClientError)
    assert err.request_id == 1, (
        f"evicted A's {err.request_id}, not its background request (1): its newest, though urgent")
    assert "made room for another client's (background: the least urgent class it had queued)" in err.message
    s2 = Scheduler(Config(lifo_after=None, max_queue=2))
    s2.worker_ready(b"w", "svc", 0.0)
    only(req(s2, X, 0), Dispatch)
    req(s2, A, 1, priority=Priority.URGENT)
    req(s2, A, 2, priority=Priority.BACKGROUND)
    err = only(req(s2, B, 1), ClientError)
    assert (err.client, err.request_id) == (A, 2)


def test_the_heaviest_s_newcomer_takes_the_place_of_its_own_less_urgent_request():
    """A principal holding the most, its newcomer refused as before, unless it has a request
    of a less urgent class queued: that one goes (QUEUE_FULL, on its own connection), and the
    newcomer stays; never a request put back at the front (a retry) for it."""
    s = Scheduler(Config(lifo_after=None, max_queue=3))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    req(s, A, 1, now=0.0, priority=Priority.BACKGROUND)
    req(s, A, 2, now=0.1, priority=Priority.NORMAL)
    req(s, B, 1, now=0.2)
    err = only(req(s, A, 3, now=0.3, priority=Priority.URGENT), ClientError)
    assert (err.client, err.request_id, err.code) == (A, 1, ErrorCode.QUEUE_FULL), (
        f"A's urgent request was refused while its background one (1) kept its place: {err}")
    assert "made room for a more urgent one of its own" in err.message
    err = only(req(s, A, 4, now=0.4, priority=Priority.NORMAL), ClientError)
    assert (err.client, err.request_id) == (A, 4)  # nothing less urgent than it: refused
    assert "none less urgent than this one" in err.message
    c = s.stats()["counters"]
    assert (c["evicted"], c["rejected_full"]) == (1, 1)
    assert drain(s, b"w", token, 3, now=0.5)[0] == [(A, 3), (A, 2), (B, 1)]
    # Its background FIFO holds a retry only: passed over for a request of another class.
    s = Scheduler(Config(lifo_after=None, max_queue=2))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    only(req(s, A, 1, priority=Priority.BACKGROUND), Dispatch)  # on w1
    only(req(s, X, 0), Dispatch)  # on w2
    req(s, A, 2, now=0.1)
    assert s.worker_disconnect(b"w1", 0.2) == []  # 1 back at the front of A's background FIFO
    err = only(req(s, A, 3, now=0.3, priority=Priority.URGENT), ClientError)
    assert (err.client, err.request_id) == (A, 2), "a retry was evicted"
    err = only(req(s, A, 4, now=0.4, priority=Priority.NORMAL), ClientError)
    assert (err.client, err.request_id) == (A, 4), "a retry was evicted"


# A full queue holding requests whose deadline passed since the last tick(): they leave first,
# answered DEADLINE_EXCEEDED (as the tick would), before anyone is evicted or refused.


def _busy(max_queue, *deadlines, **cfg):
    """A busy worker of credit 1 (X's request 0 running) and A's requests 1, 2, ... queued at
    0 with these deadlines (a deadline of 0.5 is past at 1.0, where no tick ran yet)."""
    s = Scheduler(Config(lifo_after=None, max_queue=max_queue, **cfg))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for rid, deadline in enumerate(deadlines, 1):
        assert req(s, A, rid, deadline=deadline) == []
    return s, token


def test_a_full_queue_of_requests_past_their_deadline_refuses_no_newcomer():
    s, token = _busy(2, 0.5, 0.5)
    out = req(s, A, 3, now=1.0, deadline=9.0)  # A holds the most: it was refused
    assert [(type(a), a.client, a.request_id, a.code) for a in out] == [
        (ClientError, A, 1, ErrorCode.DEADLINE_EXCEEDED),
        (ClientError, A, 2, ErrorCode.DEADLINE_EXCEEDED)], (
        f"a full queue of requests past their deadline cost a live one its place: {out}")
    c = s.stats()["counters"]
    assert (c["expired"], c["rejected_full"], c["evicted"]) == (2, 0, 0)
    assert of(s.tick(1.0), ClientError) == []  # what the tick would have done is done
    assert drain(s, b"w", token, 1, now=1.0)[0] == [(A, 3)]


def test_a_request_past_its_deadline_is_never_evicted_with_queue_full():
    s, token = _busy(3, None, None, 0.5)
    out = req(s, B, 1, now=1.0)  # B holds less: one of A's had to go, its newest (3)
    assert [(a.client, a.request_id, a.code) for a in out] == [(A, 3, ErrorCode.DEADLINE_EXCEEDED)], (
        f"evicted instead of expiring A's 3, past its deadline: {out}")
    assert s.stats()["counters"]["evicted"] == 0
    s, token = _busy(3, 0.5, None, None)
    out = req(s, B, 1, now=1.0)  # A's 1 expires; its 3, alive, keeps its place
    assert [(a.client, a.request_id, a.code) for a in out] == [(A, 1, ErrorCode.DEADLINE_EXCEEDED)], (
        f"evicted a live request while one past its deadline was queued: {out}")
    assert s.stats()["counters"]["evicted"] == 0
    assert drain(s, b"w", token, 3, now=1.0)[0] == [(A, 2), (B, 1), (A, 3)]


def test_a_victim_past_its_deadline_left_by_a_spent_budget_is_answered_by_its_deadline(monkeypatch):
    """More timers due than one admission looks at (TICK_MAX, as a tick): the victim itself,
    if past its deadline, is answered DEADLINE_EXCEEDED, never QUEUE_FULL."""
    import broker.state as state

    s, token = _busy(3, None, None, 0.5)
    for _ in range(5):  # due before A's 3: they use up the budget
        s._push_timer(0.1, state._T_HEARTBEAT, s._workers[b"w"])
    monkeypatch.setattr(state, "TICK_MAX", 2)
    out = req(s, B, 1, now=1.0)
    assert [(a.client, a.request_id, a.code) for a in out] == [(A, 3, ErrorCode.DEADLINE_EXCEEDED)], out
    assert s.stats()["counters"]["evicted"] == 0


def test_only_a_full_queue_looks_for_deadlines_due(monkeypatch):
    """The look costs nothing while the queue has room; when it is full, it fires the
    deadlines due (each timer once: what it fires leaves the heap) and leaves the other
    timers due to the tick."""
    looked = []
    s, token = _busy(4, None, None)
    real = s._expire_due
    monkeypatch.setattr(s, "_expire_due", lambda *a: looked.append(a) or real(*a))
    assert req(s, A, 3, deadline=0.5) == [] and req(s, B, 1, deadline=0.5) == []
    assert looked == []  # room: no look
    due = sorted(t[2] for t in s._timers if t[0] <= 1.0)
    n = len(s._timers)
    out = req(s, C, 1, now=1.0)  # full: A's 3 and B's 1 are past their deadline
    assert sorted((a.client, a.request_id, a.code) for a in out) == [
        (A, 3, ErrorCode.DEADLINE_EXCEEDED), (B, 1, ErrorCode.DEADLINE_EXCEEDED)]
    assert len(looked) == 1
    assert len(s._timers) == n - 2  # the two deadlines fired: gone
    left = sorted(t[2] for t in s._timers if t[0] <= 1.0)
    assert left == [k for k in due if k != 0][:len(left)] and 0 not in left  # the rest wait for the tick
    assert len(left) == len(due) - 2


def test_eviction_is_per_service():
    s = Scheduler(Config(lifo_after=None, max_queue=2))
    s.worker_ready(b"w1", "one", 0.0)
    s.worker_ready(b"w2", "two", 0.0)
    only(req(s, X, 0, service="one"), Dispatch)
    only(req(s, X, 1, service="two"), Dispatch)
    req(s, A, 1, service="one")
    req(s, A, 2, service="one")
    req(s, B, 1, service="two")
    req(s, B, 2, service="two")
    req(s, B, 3, service="two")  # B is the heaviest overall, but not in "one"
    err = only(req(s, B, 4, service="one"), ClientError)
    assert (err.client, err.request_id) == (A, 2)


# ----------------------------------------------------------------------------- caps


@pytest.mark.parametrize("kw", [{"max_client_requests": 0}, {"max_client_bytes": -1},
                                {"max_client_bytes": 0}])  # (0 refused every inline tensor: not "no limit")
def test_bad_caps_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Scheduler(Config(lifo_after=None, **kw))


def test_a_request_over_the_byte_cap_by_itself_is_not_told_to_wait():
    """A request whose own bytes are over the cap can never be admitted: it was told to
    "wait for results before sending more", with nothing outstanding (the configuration hunt)."""
    s = Scheduler(Config(lifo_after=None, max_client_bytes=100))
    s.worker_ready(b"w", "svc", 0.0)
    err = only(req(s, A, 1, size=101), ClientError)
    assert err.code == ErrorCode.QUEUE_FULL and "max_client_bytes=100" in err.message
    assert "by themselves" in err.message and "never" in err.message, err.message
    assert "wait for results" not in err.message, err.message
    assert s.stats()["counters"]["rejected_client_bytes"] == 1
    assert s.client_usage(A) == {"outstanding": 0, "bytes": 0}
    assert only(req(s, A, 2, size=100), Dispatch).request_id == 2  # at the cap: admitted
    err = only(req(s, A, 3, size=1), ClientError)  # over it with what is outstanding: wait
    assert "wait for results" in err.message, err.message


def test_the_broker_wide_byte_cap_counts_every_principal():
    """The resource audit: processes each within their cap held more than the broker's
    memory.  ``max_total_bytes`` bounds all principals' outstanding bytes together."""
    s = Scheduler(Config(lifo_after=None, max_client_bytes=100, max_total_bytes=150))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, A, 1, size=100), Dispatch)  # A at its own cap
    assert req(s, B, 1, size=50) == []  # queued: 150 in all, at the cap
    err = only(req(s, C, 1, size=1), ClientError)  # a third process, within its own cap: over the broker's
    assert err.code == ErrorCode.QUEUE_FULL and "max_total_bytes=150" in err.message, err.message
    assert "--max-total-mb" in err.message and s.stats()["counters"]["rejected_total_bytes"] == 1
    assert req(s, C, 2) == []  # a request of no inline bytes is not refused for bytes
    out = s.worker_final(b"w", d.token, 0.1, "ok")  # A's answer gives its 100 back
    assert only(out, ToClient).request_id == 1
    assert of(req(s, C, 3, size=100, now=0.2), ClientError) == []  # 50 + 100: admitted


def test_a_request_over_the_broker_wide_cap_by_itself_is_told_it_can_never_be_admitted():
    # A broker in a small cgroup: its request cap (half its memory) under the per-client cap.
    s = Scheduler(Config(lifo_after=None, max_client_bytes=100, max_total_bytes=60))
    s.worker_ready(b"w", "svc", 0.0)
    err = only(req(s, A, 1, size=80), ClientError)
    assert err.code == ErrorCode.QUEUE_FULL and "can never be admitted" in err.message, err.message
    assert "max_total_bytes=60" in err.message


def test_defaults():
    cfg = Config()
    assert cfg.max_client_requests == 4096 and cfg.max_client_bytes == 512 << 20


def test_cap_on_outstanding_requests_counts_every_service_and_state():
    s = Scheduler(Config(lifo_after=None, max_client_requests=3))
    s.worker_ready(b"w1", "one", 0.0)
    s.worker_ready(b"w2", "two", 0.0)
    d = only(req(s, A, 1, service="one"), Dispatch)  # running
    assert req(s, A, 2, service="one") == []  # queued
    only(req(s, A, 3, service="two"), Dispatch)  # running elsewhere
    assert s.client_usage(A) == {"outstanding": 3, "bytes": 0}
    err = only(req(s, A, 4, service="two"), ClientError)
    assert err.code == ErrorCode.QUEUE_FULL and "max_client_requests=3" in err.message
    assert s.stats()["counters"]["rejected_client_requests"] == 1
    assert s.client_usage(A)["outstanding"] == 3  # nothing else changed
    assert req(s, B, 1, service="one") == []  # other clients are not affected
    # Cancelling still counts until the worker's final.
    assert s.client_cancel(A, 1, 0.1) == [CancelAtWorker(b"w1", d.token)]
    assert only(req(s, A, 5, service="two"), ClientError).code == ErrorCode.QUEUE_FULL
    out = s.worker_final(b"w1", d.token, 0.2, "cancelled")
    assert only(out, ToClient).request_id == 1
    assert of(req(s, A, 6, service="two", now=0.3), ClientError) == []


def test_cap_on_bytes():
    s = Scheduler(Config(lifo_after=None, max_client_bytes=100))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, A, 1, size=60), Dispatch)
    err = only(req(s, A, 2, size=50), ClientError)
    assert err.code == ErrorCode.QUEUE_FULL and "max_client_bytes=100" in err.message
    assert s.stats()["counters"]["rejected_client_bytes"] == 1
    assert req(s, A, 3, size=40) == []  # exactly at the limit
    assert req(s, A, 4) == []  # size 0 is never refused for bytes
    assert req(s, B, 1, size=100) == []  # per client
    assert s.client_usage(A) == {"outstanding": 3, "bytes": 100}
    assert s.stats()["client_bytes"] == 200
    err = only(req(s, C, 1, size=101), ClientError)  # bigger than the whole allowance
    assert "max_client_bytes" in err.message
    s.worker_final(b"w", d.token, 0.1, None)
    assert s.client_usage(A)["bytes"] == 40
    assert of(req(s, A, 5, size=60, now=0.2), ClientError) == []


def test_bytes_are_released_on_every_path():
    s = Scheduler(Config(lifo_after=None, max_retries=1, max_queue=3, service_grace=1.0))
    s.worker_ready(b"w1", "svc", 0.0, credit=2)
    s.worker_ready(b"w2", "svc", 0.0, credit=2)
    now = 0.0
    # final and direct reply
    d1 = only(req(s, A, 1, size=10), Dispatch)
    d2 = only(req(s, A, 2, size=20), Dispatch)
    assert s.client_usage(A)["bytes"] == 30
    s.worker_final(d1.worker, d1.token, now, None)
    s.worker_done(d2.worker, [d2.token], now)
    assert s.client_usage(A) == {"outstanding": 0, "bytes": 0}
    # running: cancel then the worker's final; cancel then worker death
    d3 = only(req(s, A, 3, size=5), Dispatch)
    d4 = only(req(s, B, 1, size=7), Dispatch)
    d5 = only(req(s, B, 2, size=9), Dispatch)
    d6 = only(req(s, A, 4, size=11), Dispatch)
    # queued: cancel, deadline, eviction, refused newcomer, client gone
    req(s, A, 5, size=13)
    req(s, A, 6, size=17, deadline=0.5)
    req(s, A, 7, size=19)
    assert s.client_usage(A)["bytes"] == 5 + 11 + 13 + 17 + 19
    assert only(req(s, B, 3, size=23), ClientError).request_id == 7  # evicted
    assert only(req(s, B, 4, size=29), ClientError).request_id == 4  # B now ties: refused
    s.client_cancel(A, 5, now)
    assert s.client_usage(A)["bytes"] == 5 + 11 + 17
    s.client_cancel(A, 3, now)
    s.worker_final(d3.worker, d3.token, now, None)
    s.client_cancel(B, 1, now)
    # worker death: a cancelling request finishes, a running one is retried (still counted)
    dead = d4.worker
    held_b = s.client_usage(B)["bytes"]
    out = s.worker_disconnect(dead, 0.1)
    assert s.client_usage(B)["bytes"] == held_b - 7
    retried = [d for d in of(out, Dispatch) if d.attempt == 1]
    # the queued one with a deadline expires
    s.tick(0.5)
    assert s.client_usage(A)["bytes"] <= 11
    # the second death of a retried request: WORKER_FAILED
    live = [w for w in (b"w1", b"w2") if w in s._workers]
    for w in live:
        s.worker_seen(w, 0.6)
    for d in retried:
        if d.worker in s._workers:
            s.worker_disconnect(d.worker, 0.6)
    # client disconnect drops queued and abandons running ones
    s.worker_ready(b"w3", "svc", 0.7, credit=1)
    s.client_disconnect(A, 0.8)
    s.client_disconnect(B, 0.8)
    assert s.client_usage(A)["bytes"] == 0 and s.client_usage(B)["bytes"] == 0
    # grace: a queued request with no worker at all
    req(s, C, 1, service="nobody", size=31, now=1.0)
    assert s.client_usage(C)["bytes"] == 31
    assert only(s.tick(2.0), ClientError).code == ErrorCode.SERVICE_UNAVAILABLE
    # everything the workers still hold finishes (late finals of abandoned requests)
    for w in list(s._workers.values()):
        for token in list(w.in_flight):
            s.worker_final(w.ident, token, 3.0, None)
    assert_nothing_held(s)
    del d5, d6


def test_bytes_are_released_when_a_queued_request_expires_and_when_running_one_does():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, A, 1, size=100, deadline=1.0), Dispatch)
    req(s, A, 2, size=50, deadline=0.5)
    assert only(s.tick(0.5), ClientError).request_id == 2
    assert s.client_usage(A)["bytes"] == 100
    out = s.tick(1.0)  # running: the client gets its final now, the worker keeps the credit
    assert only(out, ClientError).request_id == 1
    assert s.client_usage(A)["bytes"] == 0
    s.worker_final(b"w", d.token, 1.1, None)
    assert_nothing_held(s)


def test_bytes_stay_counted_across_a_retry_then_go():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w1", "svc", 0.0)
    only(req(s, A, 1, size=64), Dispatch)
    assert s.worker_disconnect(b"w1", 0.1) == []  # back in the queue, no worker
    assert s.client_usage(A) == {"outstanding": 1, "bytes": 64}
    d = only(s.worker_ready(b"w2", "svc", 0.2), Dispatch)
    assert d.attempt == 1
    s.worker_final(b"w2", d.token, 0.3, None)
    assert_nothing_held(s)


# ----------------------------------------------------------------------------- principals

PID, USER = 4242, "alice"  # what the server passes: an attested pid, a CurveZMQ user id


def conns(n, prefix=b"p"):
    return [prefix + str(i).encode() for i in range(n)]


def test_a_principal_with_100_connections_gets_one_share_of_the_ring():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    many = conns(100)
    for c in many:
        assert req(s, c, 1, principal=PID) == []
    assert req(s, B, 1, principal=USER) == []  # one connection, behind all 100
    order, _ = drain(s, b"w", token, 3)
    assert (B, 1) in order[:2], order
    assert order == [(many[0], 1), (B, 1), (many[1], 1)]  # routed to each connection
    # The same 100 connections as their own principals: B waits behind all of them.
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    for c in many:
        req(s, c, 1)
    req(s, B, 1)
    order, _ = drain(s, b"w", token, 101)
    assert order.index((B, 1)) == 100


def test_one_principal_on_many_connections_is_fifo_across_them():
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    sent = [(c, rid) for rid in (1, 2) for c in (A, B, C)]
    for c, rid in sent:
        req(s, c, rid, principal=PID)
    order, _ = drain(s, b"w", token, 6)
    assert order == sent


def test_request_cap_counts_every_connection_of_a_principal():
    s = Scheduler(Config(lifo_after=None, max_client_requests=3))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, A, 1, principal=PID), Dispatch)  # running
    assert req(s, B, 1, principal=PID) == []  # queued
    assert req(s, C, 1, principal=PID) == []
    assert s.client_usage(PID) == {"outstanding": 3, "bytes": 0}
    assert s.client_usage(A) == {"outstanding": 0, "bytes": 0}  # a connection, not a principal
    err = only(req(s, D, 1, principal=PID), ClientError)  # a fresh connection: same principal
    assert (err.client, err.request_id, err.code) == (D, 1, ErrorCode.QUEUE_FULL)
    assert "max_client_requests=3" in err.message
    assert "this client process/principal" in err.message
    assert only(req(s, A, 2, principal=PID), ClientError).code == ErrorCode.QUEUE_FULL
    assert s.stats()["counters"]["rejected_client_requests"] == 2
    assert req(s, D, 2, principal=USER) == []  # another principal is not affected
    assert req(s, X, 1) == []  # nor a connection that is its own principal
    assert s.stats()["principals"] == 3  # PID, USER and X (the worker still holds X 0)
    s.worker_final(b"w", d.token, 0.1, None)
    assert s.client_usage(PID)["outstanding"] == 2
    assert of(req(s, D, 3, principal=PID, now=0.2), ClientError) == []


def test_byte_cap_counts_every_connection_of_a_principal():
    s = Scheduler(Config(lifo_after=None, max_client_bytes=100))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, A, 1, size=60, principal=PID), Dispatch)
    err = only(req(s, B, 1, size=50, principal=PID), ClientError)
    assert (err.client, err.code) == (B, ErrorCode.QUEUE_FULL)
    assert "max_client_bytes=100" in err.message
    assert "this client process/principal" in err.message
    assert s.stats()["counters"]["rejected_client_bytes"] == 1
    assert req(s, B, 2, size=40, principal=PID) == []  # exactly at the limit
    assert only(req(s, C, 1, size=1, principal=PID), ClientError).code == ErrorCode.QUEUE_FULL
    assert req(s, C, 2, principal=PID) == []  # size 0 is never refused for bytes
    assert req(s, D, 1, size=100, principal=USER) == []  # per principal
    assert s.client_usage(PID) == {"outstanding": 3, "bytes": 100}
    assert s.client_usage(USER) == {"outstanding": 1, "bytes": 100}
    assert s.stats()["client_bytes"] == 200
    s.worker_final(b"w", d.token, 0.1, None)  # A's 60 go; B's 40 are dispatched
    assert s.client_usage(PID) == {"outstanding": 2, "bytes": 40}
    assert of(req(s, C, 3, size=60, principal=PID, now=0.2), ClientError) == []


def test_1024_one_request_connections_fill_the_queue_and_yield_to_another_principal():
    s = Scheduler(Config(lifo_after=None, max_queue=1024))
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, X, 0), Dispatch).token
    many = conns(1024)
    for i, c in enumerate(many):
        assert req(s, c, 1, now=i * 1e-4, principal=PID) == []
    assert s.stats()["services"]["svc"]["queued"]["normal"] == 1024
    out = req(s, B, 1, now=0.2, principal=USER)
    # The newcomer stays; the principal's newest request goes, to its own connection.
    err = only(out, ClientError)
    assert (err.client, err.request_id, err.code) == (many[-1], 1, ErrorCode.QUEUE_FULL)
    assert err.payload == (many[-1], 1)
    assert "largest share" in err.message and "1024 waiting" in err.message
    c = s.stats()["counters"]
    assert c["evicted"] == 1 and c["rejected_full"] == 0
    assert s.client_usage(PID)["outstanding"] == 1023
    # The principal's next newcomer, on yet another connection, only pushes itself out.
    err = only(req(s, b"new", 1, now=0.3, principal=PID), ClientError)
    assert (err.client, err.request_id) == (b"new", 1)
    assert "largest share" in err.message
    order, _ = drain(s, b"w", token, 2, now=0.4)
    assert order == [(many[0], 1), (B, 1)]
    # Without principals each connection holds one, ties with the newcomer: it is refused.
    s = Scheduler(Config(lifo_after=None, max_queue=1024))
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, X, 0), Dispatch)
    for c in many:
        req(s, c, 1)
    err = only(req(s, B, 1, now=0.2), ClientError)
    assert (err.client, err.request_id) == (B, 1)


def test_a_tie_between_principals_refuses_the_newcomer():
    s = Scheduler(Config(lifo_after=None, max_queue=4))
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, X, 0), Dispatch)
    req(s, A, 1, now=0.1, principal=PID)
    req(s, B, 1, now=0.2, principal=PID)
    req(s, C, 1, now=0.3, principal=USER)
    req(s, D, 1, now=0.4, principal=USER)
    err = only(req(s, b"E", 1, now=0.5, principal=USER), ClientError)  # USER would hold 3
    assert (err.client, err.request_id) == (b"E", 1)
    err = only(req(s, b"F", 1, now=0.6), ClientError)  # a third principal evicts
    assert (err.client, err.request_id) in {(B, 1), (D, 1)}


def test_disconnecting_one_connection_releases_exactly_its_requests():
    s = Scheduler(Config(lifo_after=None, max_client_requests=5, max_client_bytes=100))
    s.worker_ready(b"w", "svc", 0.0, credit=2)
    da = only(req(s, A, 1, size=10, principal=PID), Dispatch)  # running
    db = only(req(s, B, 1, size=5, principal=PID), Dispatch)  # running
    req(s, A, 2, size=20, principal=PID)
    req(s, B, 2, size=7, principal=PID)
    req(s, A, 3, size=30, principal=PID)
    assert s.client_usage(PID) == {"outstanding": 5, "bytes": 72}
    assert only(req(s, C, 1, principal=PID), ClientError).code == ErrorCode.QUEUE_FULL
    out = s.client_disconnect(A, 0.1)
    assert out == [CancelAtWorker(b"w", da.token, CANCEL_CLIENT_GONE)]
    assert s.client_usage(PID) == {"outstanding": 2, "bytes": 12}
    assert s.stats()["services"]["svc"]["queued"]["normal"] == 1
    ring = s._services["svc"].classes[Priority.NORMAL]
    assert [(r.client, r.request_id) for r in ring[PID]] == [(B, 2)]
    assert s.stats()["counters"]["client_dropped"] == 2
    # The freed counts are usable at once, on another connection of the same principal.
    assert req(s, C, 2, size=88, principal=PID) == []
    # A's worker answers late: dropped; B's requests are served and routed to B.
    out = s.worker_final(b"w", da.token, 0.2, None)
    assert of(out, ToClient) == []
    assert s.stats()["counters"]["dropped_late"] == 1
    d = only(out, Dispatch)
    assert (d.client, d.request_id) == (B, 2)
    assert only(s.worker_final(b"w", db.token, 0.3, "r"), ToClient).client == B
    d2 = only(s.worker_final(b"w", d.token, 0.4, "r"), ToClient)
    assert (d2.client, d2.request_id) == (B, 2)
    assert s.client_usage(PID) == {"outstanding": 1, "bytes": 88}
    s.client_disconnect(C, 0.5)
    s.client_disconnect(B, 0.5)
    for w in s._workers.values():
        for t in list(w.in_flight):
            s.worker_final(w.ident, t, 0.6, None)
    assert_nothing_held(s)


def test_a_silent_connection_drops_only_its_own_requests():
    s = Scheduler(Config(lifo_after=None, client_liveness=2.0))
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, X, 0), Dispatch)
    s.client_heartbeat(A, 0.0)
    req(s, A, 1, size=3, principal=PID)
    req(s, B, 1, size=4, principal=PID)
    s.client_seen(B, 1.9)
    out = s.tick(2.0)  # A is presumed gone; its queued request goes silently
    assert of(out, ClientError) == [] and of(out, CancelAtWorker) == []
    assert s.stats()["counters"]["client_dropped"] == 1
    assert s.client_usage(PID) == {"outstanding": 1, "bytes": 4}
    ring = s._services["svc"].classes[Priority.NORMAL]
    assert [r.client for r in ring[PID]] == [B]


def test_a_requests_principal_is_fixed_at_admission():
    # One identity, two principals (e.g. a reconnect that reuses the identity): each request
    # stays counted where it was admitted, and leaves from there.
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, A, 1, size=10, principal=PID), Dispatch)
    req(s, A, 2, size=20, principal=USER)
    req(s, A, 3, size=40, principal=USER)
    assert s.client_usage(PID) == {"outstanding": 1, "bytes": 10}
    assert s.client_usage(USER) == {"outstanding": 2, "bytes": 60}
    s.client_cancel(A, 3, 0.1)
    assert s.client_usage(USER) == {"outstanding": 1, "bytes": 20}
    d2 = only(s.worker_final(b"w", d.token, 0.2, None), Dispatch)
    assert (d2.client, d2.request_id) == (A, 2)
    assert s.client_usage(PID) == {"outstanding": 0, "bytes": 0}
    s.client_disconnect(A, 0.3)
    assert s.client_usage(USER) == {"outstanding": 0, "bytes": 0}
    s.worker_final(b"w", d2.token, 0.4, None)
    assert_nothing_held(s)
