"""broker.state, event by event with an injected clock."""
from __future__ import annotations

import pytest

from broker.protocol import CANCEL_CLIENT_GONE, CANCEL_EXPIRED
from broker.state import (
    CancelAtWorker,
    ClientError,
    Config,
    DisconnectWorker,
    Dispatch,
    ErrorCode,
    HeartbeatWorker,
    LateToClient,
    Priority,
    Scheduler,
    ToClient,
)

C = b"client"


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def only(actions, cls):
    found = of(actions, cls)
    assert len(found) == 1, actions
    return found[0]


def req(s, rid, now=0.0, service="svc", client=C, **kw):
    kw.setdefault("payload", f"p{rid}")
    return s.client_request(client, rid, service, now, **kw)


# ----------------------------------------------------------------------------- types


def test_error_codes_are_fixed_on_the_wire():
    assert {c.name: int(c) for c in ErrorCode} == {
        "PROTOCOL_ERROR": 400,
        "FORBIDDEN": 403,
        "NOT_LOCAL": 421,
        "INVALID_INPUT": 422,
        "QUEUE_FULL": 429,
        "CANCELLED": 499,
        "INTERNAL": 500,
        "WORKER_FAILED": 502,
        "SERVICE_UNAVAILABLE": 503,
        "DEADLINE_EXCEEDED": 504,
    }
    assert [int(p) for p in Priority] == [0, 1, 2]


@pytest.mark.parametrize(
    "kw",
    [
        {"heartbeat_interval": 0},
        {"heartbeat_liveness": 0},
        {"heartbeat_interval": 0.01, "heartbeat_liveness": 3},  # a liveness window under 0.1 s
        {"heartbeat_liveness": 1},  # an idle worker presumed dead about once a second
        {"client_liveness": 0.05},
        {"aging_s": 0},
        {"priority_weights": (1.0, 1.0)},
        {"max_retries": -1},
        {"service_grace": -1},
    ],
)
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        Scheduler(Config(**kw))


def test_actions_are_frozen():
    a = CancelAtWorker(b"w", 1)
    with pytest.raises(AttributeError):
        a.token = 2  # type: ignore[misc]


# ----------------------------------------------------------------------------- credit


def test_bare_worker_has_credit_one():
    s = Scheduler()
    assert s.worker_ready(b"w", "svc", 0.0) == []
    d1 = only(req(s, 1), Dispatch)
    assert (d1.worker, d1.client, d1.request_id, d1.payload, d1.attempt) == (b"w", C, 1, "p1", 0)
    assert req(s, 2) == []  # queued: credit 1 is used
    assert s.stats()["services"]["svc"]["queued"]["normal"] == 1
    out = s.worker_final(b"w", d1.token, 0.1, "r1")
    assert out[0] == ToClient(C, 1, "svc", True, "r1", 0.0, 0.0)
    d2 = only(out, Dispatch)
    assert d2.request_id == 2 and d2.token != d1.token


def test_credit_limit_is_never_exceeded():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=3)
    dispatched = [a for i in range(5) for a in of(req(s, i), Dispatch)]
    assert len(dispatched) == 3
    st = s.stats()["services"]["svc"]
    assert st["in_flight"] == 3 and st["queued"]["normal"] == 2 and st["credit"] == 3
    out = s.worker_final(b"w", dispatched[0].token, 1.0, None)
    assert len(of(out, Dispatch)) == 1


def test_least_loaded_then_fewest_in_flight_then_least_recently_used():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0, credit=4)
    s.worker_ready(b"w2", "svc", 0.0, credit=2)
    got = [only(req(s, i), Dispatch).worker for i in range(6)]
    # loads before each pick (w1 / w2): 0/0 (LRU: w1), .25/0, .25/.5, .5/.5 (fewer: w2),
    # .5/full, .75/full
    assert got == [b"w1", b"w2", b"w1", b"w2", b"w1", b"w1"]
    assert req(s, 99) == []  # both full


def test_idle_workers_share_work_by_least_recent_use():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    assert d.worker == b"w1"
    s.worker_final(b"w1", d.token, 0.1, None)
    assert only(req(s, 2, now=0.2), Dispatch).worker == b"w2"


def test_many_workers_dispatch_stays_cheap_and_heaps_bounded():
    s = Scheduler(Config(max_queue=100_000))
    n_workers = 200
    for i in range(n_workers):
        s.worker_ready(b"w%d" % i, "svc", 0.0, credit=4)
    live = []
    for rid in range(20_000):
        live += of(req(s, rid, deadline=1e9), Dispatch)
        if len(live) > 400:
            d = live.pop(0)
            live += of(s.worker_final(d.worker, d.token, 0.0, None), Dispatch)
    pool = s._services["svc"].any
    assert len(pool.ready) <= 4 * n_workers + 16
    assert len(s._timers) <= 4 * (2 * n_workers + 2 * s.stats()["requests"] + 256)


# ----------------------------------------------------------------------------- priorities


def test_urgent_goes_first_then_normal_then_background():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    busy = only(req(s, 0), Dispatch)
    req(s, 1, priority=Priority.BACKGROUND)
    req(s, 2, priority=Priority.NORMAL)
    req(s, 3, priority=Priority.URGENT)
    order = []
    token = busy.token
    for _ in range(3):
        d = only(s.worker_final(b"w", token, 0.0, None), Dispatch)
        order.append(d.request_id)
        token = d.token
    assert order == [3, 2, 1]


def test_aging_lets_an_old_normal_request_overtake_a_fresh_urgent_one():
    s = Scheduler()  # weights 3/1, aging 0.5 s: normal wins after waiting > 1 s
    s.worker_ready(b"w", "svc", 0.0)
    busy = only(req(s, 0), Dispatch)
    req(s, 1, now=0.0, priority=Priority.NORMAL)
    req(s, 2, now=1.5, priority=Priority.URGENT)
    d = only(s.worker_final(b"w", busy.token, 1.5, None), Dispatch)
    assert d.request_id == 1


def test_background_is_served_under_a_steady_urgent_load():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, 0, priority=Priority.URGENT), Dispatch).token
    req(s, 1, priority=Priority.BACKGROUND)
    rid = 2
    now = 0.0
    served_at = None
    # Urgent work arrives as fast as the worker completes it, so there is always an urgent
    # request waiting when the worker frees up.
    while now < 30.0:
        now += 0.1
        req(s, rid, now=now, priority=Priority.URGENT)
        rid += 1
        d = only(s.worker_final(b"w", token, now, None), Dispatch)
        token = d.token
        if d.request_id == 1:
            served_at = now
            break
    assert served_at is not None
    assert 2.0 < served_at < 10.0


def test_the_worker_is_told_the_class_a_request_outscored_by_aging():
    """The worker's batcher scores what it holds as the broker does, from each request's
    arrival there: a background request that aging got dispatched ahead of urgent ones
    started over at the worker, behind the urgent ones it held, and waited its turn a second
    time (2.5 s at the broker, then as long again: the fairness hunt, with a worker of credit
    8).  Dispatch.priority (the header's at dispatch) is the class it outscored."""
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    token = only(req(s, 0, priority=Priority.URGENT), Dispatch).token
    req(s, 1, priority=Priority.BACKGROUND)
    req(s, 2, priority=Priority.NORMAL)
    shown = {}
    now, rid = 0.0, 3
    while len(shown) < 2 and now < 10.0:
        now += 0.1
        req(s, rid, now=now, priority=Priority.URGENT)
        rid += 1
        d = only(s.worker_final(b"w", token, now, None), Dispatch)
        token = d.token
        if d.request_id in (1, 2):
            shown[d.request_id] = d.priority
        else:
            assert d.priority == Priority.URGENT
    assert shown == {1: Priority.URGENT, 2: Priority.URGENT}
    # Otherwise each is shown its own class: straight to a free worker, or first in line.
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 0, priority=Priority.BACKGROUND), Dispatch)
    assert d.priority == Priority.BACKGROUND
    req(s, 1, priority=Priority.BACKGROUND)
    req(s, 2, priority=Priority.NORMAL)
    d = only(s.worker_final(b"w", d.token, 0.1, None), Dispatch)
    assert (d.request_id, d.priority) == (2, Priority.NORMAL)
    assert only(s.worker_final(b"w", d.token, 0.2, None), Dispatch).priority == Priority.BACKGROUND


# ----------------------------------------------------------------------------- deadlines


def test_expired_on_arrival_is_refused_and_never_dispatched():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    out = req(s, 1, now=5.0, deadline=5.0)
    assert only(out, ClientError).code == ErrorCode.DEADLINE_EXCEEDED
    assert of(out, Dispatch) == []
    assert s.stats()["counters"]["expired"] == 1


def test_queued_request_expires_at_its_deadline():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    busy = only(req(s, 0), Dispatch)
    req(s, 1, deadline=0.5)
    assert s.next_wakeup(0.0) == 0.5
    assert s.tick(0.49) == []
    err = only(s.tick(0.5), ClientError)
    assert (err.request_id, err.code, err.payload) == (1, ErrorCode.DEADLINE_EXCEEDED, "p1")
    assert s.worker_final(b"w", busy.token, 0.6, None)[1:] == []  # nothing left to dispatch


def test_expired_request_is_not_dispatched_even_before_tick_runs():
    # (First in, first out: newest first, the walk may not reach it before its timer does:
    # test_state_congestion.py)
    s = Scheduler(Config(lifo_after=None))
    s.worker_ready(b"w", "svc", 0.0)
    busy = only(req(s, 0), Dispatch)
    req(s, 1, deadline=0.5)
    req(s, 2)
    out = s.worker_final(b"w", busy.token, 0.7, None)  # no tick since 0.0
    assert only(out, ClientError).request_id == 1
    assert only(out, Dispatch).request_id == 2
    assert s.tick(0.7) == []


def test_in_flight_deadline_errors_now_and_cancels_at_worker():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1, deadline=1.0), Dispatch)
    assert d.deadline == 1.0
    out = s.tick(1.0)
    err = only(out, ClientError)
    assert err.code == ErrorCode.DEADLINE_EXCEEDED and err.request_id == 1
    assert only(out, CancelAtWorker) == CancelAtWorker(b"w", d.token, CANCEL_EXPIRED)  # (it answers 504)
    # The worker keeps the credit until its late final arrives.
    assert req(s, 2, now=1.1) == []
    out = s.worker_final(b"w", d.token, 1.2, "late")
    assert of(out, ToClient) == []
    assert of(out, LateToClient) == []  # a client with no heartbeat record gets no late reply
    assert only(out, Dispatch).request_id == 2
    assert s.stats()["counters"]["dropped_late"] == 1
    # The request id may be reused once its final has gone out.
    assert of(req(s, 1, now=1.3), ClientError) == []


def test_late_replies_go_to_the_client_its_deadline_answered_while_it_is_there():
    """Its client was answered (504) while the worker ran it: what the worker still sends
    goes to that client, only so that it gives back the output slots a reply names (the
    server forwards only replies that name some, and never to a REQ socket); not once the
    client left, nor after a new request of its own took the id."""
    s = Scheduler(Config(client_liveness=100.0))
    s.worker_ready(b"w", "svc", 0.0, credit=8)
    s.client_heartbeat(C, 0.0)
    d = only(req(s, 1, deadline=1.0), Dispatch)
    assert only(s.tick(1.0), ClientError).code == ErrorCode.DEADLINE_EXCEEDED
    assert only(s.worker_partial(b"w", d.token, 1.1, "part"), LateToClient) == LateToClient(C, 1, "svc", False, "part")
    assert only(s.worker_final(b"w", d.token, 1.2, "late"), LateToClient) == LateToClient(C, 1, "svc", True, "late")
    # The id taken again by a live request: the old one's late reply is not sent.
    d = only(req(s, 2, now=2.0, deadline=3.0), Dispatch)
    s.tick(3.0)
    only(req(s, 2, now=3.1), Dispatch)
    assert of(s.worker_final(b"w", d.token, 3.2, "late"), LateToClient) == []
    # The client gone (and back under its id: a new record): not sent.
    d = only(req(s, 3, now=4.0, deadline=5.0), Dispatch)
    s.tick(5.0)
    s.client_disconnect(C, 5.1)
    s.client_heartbeat(C, 5.2)
    assert of(s.worker_final(b"w", d.token, 5.3, "late"), LateToClient) == []


def test_in_flight_deadline_then_worker_death_gives_no_second_final():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    only(req(s, 1, deadline=1.0), Dispatch)
    assert len(of(s.tick(1.0), ClientError)) == 1
    out = s.worker_disconnect(b"w", 1.1)
    assert of(out, ClientError) == [] and of(out, Dispatch) == []


# ----------------------------------------------------------------------------- admission


def test_queue_full_is_refused_immediately():
    s = Scheduler(Config(max_queue=2))
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, 0), Dispatch)
    assert req(s, 1) == [] and req(s, 2) == []
    err = only(req(s, 3), ClientError)
    assert err.code == ErrorCode.QUEUE_FULL and "full" in err.message
    assert s.stats()["counters"]["rejected_full"] == 1
    assert s.stats()["services"]["svc"]["queued"]["normal"] == 2


def test_a_free_worker_is_used_even_with_no_queue_room():
    s = Scheduler(Config(max_queue=0))
    s.worker_ready(b"w", "svc", 0.0)
    assert only(req(s, 1), Dispatch).request_id == 1
    assert only(req(s, 2), ClientError).code == ErrorCode.QUEUE_FULL


def test_with_no_room_to_wait_a_service_without_a_worker_is_unavailable_not_full():
    """max_queue 0: a misspelt service was answered QUEUE_FULL ("retry with backoff"), and
    counted as load shed; it is SERVICE_UNAVAILABLE, as with room to wait for the grace."""
    s = Scheduler(Config(max_queue=0))
    err = only(req(s, 1, service="nosuch"), ClientError)
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE and "no worker serves 'nosuch'" in err.message
    c = s.stats()["counters"]
    assert (c["unavailable"], c["rejected_full"]) == (1, 0)
    # A service whose last worker went: said so.
    s.worker_ready(b"w", "svc", 0.0)
    s.worker_disconnect(b"w", 1.0)
    err = only(req(s, 2, now=3.0), ClientError)
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE and "its last one went 2.0 s ago" in err.message


def test_duplicate_request_id_is_a_protocol_error_for_the_new_one_only():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    err = only(req(s, 1, payload="again"), ClientError)
    assert err.code == ErrorCode.PROTOCOL_ERROR and err.payload == "again"
    out = s.worker_final(b"w", d.token, 0.1, "ok")
    assert only(out, ToClient).payload == "ok"


def test_unknown_priority_is_a_protocol_error():
    s = Scheduler()
    assert only(req(s, 1, priority=7), ClientError).code == ErrorCode.PROTOCOL_ERROR


# ----------------------------------------------------------------------------- service grace


def test_no_worker_within_grace_gives_service_unavailable():
    s = Scheduler()
    assert req(s, 1, service="cartoon", now=10.0) == []
    assert not s.has_service("cartoon")
    assert s.next_wakeup(10.0) == 11.0
    assert s.tick(10.99) == []
    err = only(s.tick(11.0), ClientError)
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE
    assert "cartoon" in err.message and "python -m gpu_worker --model cartoon" in err.message
    assert s.stats()["services"] == {}  # an empty service leaves nothing behind
    assert s.next_wakeup(11.0) is None


def test_worker_arriving_within_grace_takes_the_request():
    s = Scheduler()
    req(s, 1)
    assert only(s.worker_ready(b"w", "svc", 0.9), Dispatch).request_id == 1
    assert s.has_service("svc")
    assert of(s.tick(5.0), ClientError) == []


def test_grace_runs_from_the_last_worker_death():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, 1), Dispatch)
    s.worker_seen(b"w", 4.0)
    assert s.worker_disconnect(b"w", 5.0) == []  # retried, but no worker left
    assert not s.has_service("svc")
    assert s.tick(5.99) == []
    assert only(s.tick(6.0), ClientError).code == ErrorCode.SERVICE_UNAVAILABLE


# ----------------------------------------------------------------------------- locality


def test_shm_request_goes_only_to_a_same_host_shm_worker():
    s = Scheduler()
    shm = frozenset({"inline", "shm"})
    s.worker_ready(b"wB", "svc", 0.0, host="B", transports=shm)  # least recently used
    s.worker_ready(b"wA", "svc", 0.0, host="A", transports=shm)
    assert only(req(s, 1, local_host="A"), Dispatch).worker == b"wA"
    assert only(req(s, 2), Dispatch).worker == b"wB"  # inline: any worker


def test_a_hosts_pool_goes_with_its_last_worker_unless_a_request_waits_for_it():
    # Pods roll for months, each on a host of its own: the service keeps a pool only for
    # the hosts that have a worker, or a request waiting for one.
    s = Scheduler()
    shm = frozenset({"inline", "shm", "cuda"})
    s.worker_ready(b"w0", "svc", 0.0, host="h0", transports=shm)
    for i in range(1, 50):
        s.worker_ready(b"w%d" % i, "svc", float(i), host=f"h{i}", transports=shm)
        s.worker_disconnect(b"w%d" % (i - 1), float(i))
    svc = s._services["svc"]
    assert set(svc.pools) == {None, "h49", "h49#cuda"}, svc.pools
    # A request waiting for a host keeps its pool (its grace is timed from the gap).
    only(req(s, 1, now=50.0, local_host="h49"), Dispatch)
    s.worker_disconnect(b"w49", 51.0)  # its request goes back to the queue, for h49
    assert "h49" in svc.pools and not svc.pools["h49"].live
    assert only(s.tick(51.0 + s.config.service_grace), ClientError).code == ErrorCode.SERVICE_UNAVAILABLE
    # Requests for hosts without a worker make pools too: they go once there are many.
    for i in range(200):
        out = req(s, 100 + i, now=60.0, local_host=f"elsewhere{i}")
        s.client_cancel(C, 100 + i, 60.0) if not of(out, ClientError) else None
    assert len(svc.pools) <= 2 * len(svc.workers) + 64 + 1, len(svc.pools)


def test_shm_request_for_a_host_without_shm_worker_is_not_local():
    s = Scheduler()
    s.worker_ready(b"wA", "svc", 0.0, host="A")  # inline only
    s.worker_ready(b"wB", "svc", 0.0, host="B", transports=frozenset({"shm"}))
    for host in ("A", "C"):
        err = only(req(s, host, local_host=host), ClientError)
        assert err.code == ErrorCode.NOT_LOCAL and "inline" in err.message
    assert s.stats()["counters"]["not_local"] == 2


def test_a_head_that_cannot_be_placed_does_not_block_the_queue():
    s = Scheduler()
    shm = frozenset({"shm"})
    s.worker_ready(b"wA", "svc", 0.0, host="A", transports=shm)
    s.worker_ready(b"wB", "svc", 0.0, host="B")
    only(req(s, 0, local_host="A"), Dispatch)  # wA busy
    assert req(s, 1, local_host="A") == []  # waits for wA
    d = only(req(s, 2), Dispatch)  # behind it, but wB can take it
    assert d.worker == b"wB"


def test_shm_request_queued_without_workers_fails_after_grace():
    s = Scheduler()
    s.worker_ready(b"wB", "svc", 0.0, host="B")
    shm = frozenset({"shm"})
    s.worker_ready(b"wA", "svc", 0.0, host="A", transports=shm)
    only(req(s, 1, local_host="A"), Dispatch)
    req(s, 2, local_host="A")
    s.worker_seen(b"wB", 2.0)
    s.worker_disconnect(b"wA", 2.0)  # request 1 goes back to the queue, its host is gone
    assert of(s.tick(2.99), ClientError) == []
    errs = of(s.tick(3.0), ClientError)
    assert sorted(e.request_id for e in errs) == [1, 2]
    assert {e.code for e in errs} == {ErrorCode.NOT_LOCAL}  # the service itself lives on


# ----------------------------------------------------------------------------- worker deaths


def test_worker_death_redispatches_with_new_token_and_drops_late_final():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    d1 = only(req(s, 1), Dispatch)
    assert d1.worker == b"w1"
    only(req(s, 2), Dispatch)  # w2 busy
    assert req(s, 3) == []
    out = s.worker_disconnect(b"w1", 1.0)
    assert out == []  # nobody free yet; request 1 is at the front of the queue
    d2 = s.worker_final(b"w2", 2, 1.1, None)
    retry = only(d2, Dispatch)
    assert (retry.request_id, retry.worker, retry.attempt) == (1, b"w2", 1)
    assert retry.token not in (d1.token, 2)
    assert s.stats()["counters"]["retried"] == 1
    # The presumed-dead worker answers after all: dropped.
    assert s.worker_final(b"w1", d1.token, 1.2, "stale") == []
    assert s.stats()["counters"]["dropped_late"] == 1
    out = s.worker_final(b"w2", retry.token, 1.3, "good")
    finals = [a for a in out if isinstance(a, ToClient) and a.request_id == 1]
    assert [f.payload for f in finals] == ["good"]


def test_silent_worker_is_expired_by_tick_and_its_work_moves():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0, credit=2)
    only(req(s, 1), Dispatch)
    d1 = only(req(s, 2), Dispatch)
    assert d1.worker == b"w1" or d1.worker == b"w2"
    for t in (1.0, 2.0, 2.9):
        s.worker_seen(b"w2", t)
    out = s.tick(3.0)
    assert DisconnectWorker in {type(a) for a in out}
    assert only(out, DisconnectWorker).worker == b"w1"
    redo = only(out, Dispatch)
    assert redo.worker == b"w2" and redo.attempt == 1
    # A late reply from w1 after it re-registers is still not accepted.
    s.worker_ready(b"w1", "svc", 3.1)
    assert s.worker_final(b"w1", 1, 3.2, "stale") == []


def test_a_quiet_busy_worker_is_silent_while_a_client_waits_then_counted_again():
    # A plain MDP worker (bare READY) heartbeats only while it waits for work: its silence
    # while it runs a request is not its death; once nobody waits for what it runs, it is.
    s = Scheduler()  # liveness window 3 s
    s.worker_ready(b"w", "svc", 0.0, quiet_busy=True)
    assert only(req(s, 1, 0.5), Dispatch).worker == b"w"
    s.worker_ready(b"v", "svc", 2.0)  # idle: a request wrongly failed at w would move to it
    s.worker_seen(b"v", 5.0)
    s.worker_seen(b"v", 8.0)
    out = s.tick(9.0)  # w silent 9 s: three windows
    assert of(out, DisconnectWorker) == [] and of(out, Dispatch) == []
    assert s.has_worker(b"w")
    s.worker_seen(b"v", 11.0)
    out = s.client_disconnect(C, 11.5)  # its client went: the request is cancelled at w
    assert only(out, CancelAtWorker).worker == b"w"
    out = s.tick(12.5)  # looked at again a window after 9.0: silent, nothing waited for
    assert only(out, DisconnectWorker).worker == b"w"
    assert not s.has_worker(b"w")


def test_a_worker_that_is_not_quiet_busy_is_presumed_dead_however_busy():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, 1, 0.5), Dispatch)
    out = s.tick(3.0)
    assert only(out, DisconnectWorker).worker == b"w"


def test_max_retries_then_worker_failed():
    s = Scheduler(Config(max_retries=1))
    s.worker_ready(b"w1", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    out = s.worker_ready(b"w2", "svc", 0.1)
    assert out == []
    d = only(s.worker_disconnect(b"w1", 0.2), Dispatch)
    assert (d.worker, d.attempt) == (b"w2", 1)
    err = only(s.worker_disconnect(b"w2", 0.3), ClientError)
    assert err.code == ErrorCode.WORKER_FAILED and err.payload == "p1"
    assert s.stats()["counters"]["worker_failed"] == 1


def test_a_request_that_streamed_is_not_run_again_when_its_worker_dies():
    # Its caller has partial results: run again elsewhere, it would see them twice (a client
    # printed partials [0, 1, 0, 1] then an error).  It fails at once; one that had not
    # streamed is retried as before.
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0, credit=2)
    s.worker_ready(b"w2", "svc", 0.0)
    d1 = only(req(s, 1), Dispatch)
    d2 = only(req(s, 2), Dispatch)
    streamed = d1 if d1.worker == b"w1" else d2
    plain = d2 if streamed is d1 else d1
    s.worker_partial(streamed.worker, streamed.token, 0.1, "part")
    out = s.worker_disconnect(streamed.worker, 0.2)
    err = only(out, ClientError)
    assert err.request_id == streamed.request_id and err.code == ErrorCode.WORKER_FAILED
    assert "not run again" in err.message and of(out, Dispatch) == []
    out = s.worker_disconnect(plain.worker, 0.3)  # the one that only computed: retried (no worker left: queued)
    assert of(out, ClientError) == [] and s.stats()["counters"]["retried"] == 1


def test_no_retries_means_the_first_death_fails_the_request():
    s = Scheduler(Config(max_retries=0))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    only(req(s, 1), Dispatch)
    out = s.worker_disconnect(b"w1", 0.1)
    assert only(out, ClientError).code == ErrorCode.WORKER_FAILED
    assert of(out, Dispatch) == []


# ---- a request's last attempt runs alone (a request that kills its worker)


def _killed_with(s, worker, n, credit=4):
    """``worker`` (credit ``credit``) takes requests 1..n and dies holding them."""
    s.worker_ready(worker, "svc", 0.0, credit=credit)
    for rid in range(1, n + 1):
        only(req(s, rid), Dispatch)
    assert s.worker_disconnect(worker, 0.1) == []  # no worker left: queued again


def test_a_request_that_kills_its_worker_takes_no_other_request_with_it():
    # Four requests die with their worker; one of them kills every worker it runs on (a model
    # that crashes on that input).  Retried together, they were batched together again: the
    # other three died with it every time, and failed with it.  On its last attempt each runs
    # alone, so only the killer fails, and it takes one worker per attempt, as before.
    s = Scheduler(Config(max_retries=1))
    _killed_with(s, b"a", 4)
    out = s.worker_ready(b"b", "svc", 0.2, credit=4)
    d = only(out, Dispatch)  # one at a time, though B has room for four
    assert d.attempt == 1
    done = []
    for t in range(10):
        if d.request_id == 3:  # the killer
            out = s.worker_disconnect(d.worker, 0.3 + t)
            err = only(out, ClientError)
            assert err.request_id == 3 and err.code == ErrorCode.WORKER_FAILED
            assert "alone" in err.message and "max_retries=1" in err.message
            out += s.worker_ready(b"c%d" % t, "svc", 0.3 + t, credit=4)
        else:
            done.append(d.request_id)
            out = s.worker_final(d.worker, d.token, 0.3 + t)
            assert only(out, ToClient).request_id == d.request_id
        ds = of(out, Dispatch)
        if not ds:
            break
        d = only(ds, Dispatch)
        assert d.attempt == 1
    assert sorted(done) == [1, 2, 4]
    counters = s.stats()["counters"]
    assert counters["alone"] == 4 and counters["worker_failed"] == 1 and counters["worker_deaths"] == 2


def test_a_worker_set_aside_for_a_last_attempt_takes_nothing_else_until_it_has_run_it():
    s = Scheduler(Config(max_retries=1))
    _killed_with(s, b"a", 1)
    d1 = only(s.worker_ready(b"b", "svc", 0.2, credit=2), Dispatch)  # request 1, alone on B
    s.worker_ready(b"c", "svc", 0.2, credit=2)
    # New work goes to C only; C dies holding it: 10 and 11 on their last attempt now, and
    # no worker to set aside for them (B runs 1).  New work waits too: B takes nothing else.
    assert {only(req(s, rid, 0.3), Dispatch).worker for rid in (10, 11)} == {b"c"}
    assert s.worker_disconnect(b"c", 0.4) == []
    assert req(s, 12, 0.5) == []
    assert s.service_info("svc")["queued"]["normal"] == 3
    # B finishes 1: it runs 10 alone, then 11 alone, then takes brokered work again.
    d = only(s.worker_final(b"b", d1.token, 0.6), Dispatch)
    assert (d.request_id, d.attempt) == (10, 1)
    # Run alone, it was its principal's turn (the rejoin memo and the aging read it)
    principal = s._services["svc"].classes[1]
    assert [f.served for f in principal.values()] == [0.6]
    d = only(s.worker_final(b"b", d.token, 0.7), Dispatch)
    assert (d.request_id, d.attempt) == (11, 1)
    d = only(s.worker_final(b"b", d.token, 0.8), Dispatch)
    assert (d.request_id, d.attempt) == (12, 0)
    assert only(req(s, 13, 0.9), Dispatch).worker == b"b"  # beside 12: credit 2


@pytest.mark.parametrize("leaves", ["cancelled", "worker dies"])
def test_a_worker_set_aside_for_a_last_attempt_is_freed_when_that_request_goes_elsewhere(leaves):
    s = Scheduler(Config(max_retries=1, service_grace=60))
    s.worker_ready(b"a", "svc", 0.0)
    only(req(s, 1), Dispatch)
    s.worker_ready(b"b", "svc", 0.0, credit=3)
    assert {only(req(s, rid), Dispatch).worker for rid in (2, 3)} == {b"b"}
    # A dies: 1 is on its last attempt, and B (holding two) is set aside for it.
    assert s.worker_disconnect(b"a", 0.1) == []
    assert req(s, 4, 0.2) == []  # B has room, but is set aside
    if leaves == "cancelled":
        out = s.client_cancel(C, 1, 0.3)
        assert only(out, ClientError).code == ErrorCode.CANCELLED
        assert only(out, Dispatch).request_id == 4  # B takes brokered work again
    else:
        # B dies: 1 looks again and finds D empty; 2 and 3 (last attempts now) wait for
        # workers of their own, and so does 4 behind them (D runs 1 alone).
        out = s.worker_disconnect(b"b", 0.3)
        out += s.worker_ready(b"d", "svc", 0.3, credit=3)
        d = only(out, Dispatch)
        assert (d.worker, d.request_id, d.attempt) == (b"d", 1, 1)
        out = s.worker_final(b"d", d.token, 0.4)
        assert only(out, Dispatch).request_id in (2, 3)


def test_a_client_dropped_while_it_held_work_is_a_new_record_when_heard_again():
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3, service_grace=60))  # client window 3 s
    assert s.client_epoch(C) is None
    s.client_heartbeat(C, 0.0)
    first = s.client_epoch(C)
    s.client_heartbeat(C, 2.0)
    s.tick(2.0)
    assert s.client_epoch(C) == first  # alive: the same record
    req(s, 1, 2.0)  # queued: no worker
    s.tick(5.5)  # silent past its window: presumed gone, its request dropped
    assert s.client_epoch(C) is None and s.stats()["requests"] == 0
    s.client_heartbeat(C, 6.0)
    second = s.client_epoch(C)
    assert second not in (None, first)
    # Idle when it is dropped again: nothing lost, the same name when it is back.
    s.tick(9.5)
    assert s.client_epoch(C) is None
    s.client_heartbeat(C, 10.0)
    assert s.client_epoch(C) == second
    # After its goodbye, a record of the same identity starts afresh.
    s.client_disconnect(C, 11.0)
    s.client_heartbeat(C, 12.0)
    assert s.client_epoch(C) == first == 0


def test_an_idle_client_dropped_for_its_silence_keeps_its_name():
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3))
    s.client_heartbeat(C, 0.0)
    first = s.client_epoch(C)
    s.tick(3.5)
    assert s.client_epoch(C) is None
    s.client_heartbeat(C, 4.0)
    assert s.client_epoch(C) == first


def test_a_worker_whose_connection_closed_gets_no_retry_of_another_ones_work():
    """Workers that die together: the server sees each connection close, and each verdict
    waits for that worker's last messages.  A's requests must not go to B, whose connection
    closed too (max_retries 1: a second death would fail the request)."""
    s = Scheduler(Config(max_retries=1))
    s.worker_ready(b"a", "svc", 0.0)
    s.worker_ready(b"b", "svc", 0.0, credit=2)  # room for A's request
    da, db = only(req(s, 1), Dispatch), only(req(s, 2), Dispatch)
    assert {da.worker, db.worker} == {b"a", b"b"}
    assert s.worker_closed(b"a") == [] and s.worker_closed(b"b") == []
    out = s.worker_disconnect(b"a", 0.1)
    assert of(out, Dispatch) == [] and of(out, ClientError) == []  # queued: no live worker
    assert of(s.worker_disconnect(b"b", 0.1), Dispatch) == []
    out = s.worker_ready(b"c", "svc", 0.2, credit=2)
    # Each is on its last attempt, so each runs alone on C, one after the other.
    first = only(out, Dispatch)
    second = only(s.worker_final(b"c", first.token, 0.3), Dispatch)
    assert sorted((d.request_id, d.attempt) for d in (first, second)) == [(1, 1), (2, 1)]


def test_a_closing_worker_takes_no_new_request_nor_lease_but_its_replies_count():
    s = Scheduler()
    s.worker_ready(b"a", "svc", 0.0, credit=4, direct="ipc:///tmp/a-direct")
    d = only(req(s, 1), Dispatch)
    s.worker_closed(b"a")
    assert of(req(s, 2, 0.01), Dispatch) == []  # waits in the queue
    refused = s.client_lease(C, None, 1, "svc", 0.02, slots=1)
    assert [type(a).__name__ for a in refused] == ["LeaseRefused"]
    fin = only(s.worker_final(b"a", d.token, 0.03, "r1"), ToClient)
    assert fin.payload == "r1" and fin.final  # what it sent before closing still counts
    assert of(s.worker_final(b"a", d.token, 0.03, "again"), Dispatch) == []
    out = s.worker_ready(b"b", "svc", 0.04)
    assert only(out, Dispatch).request_id == 2


def test_retried_requests_keep_their_order_at_the_front():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0, credit=2)
    only(req(s, 1), Dispatch)
    only(req(s, 2), Dispatch)
    req(s, 3)
    s.worker_disconnect(b"w1", 0.1)
    out = s.worker_ready(b"w2", "svc", 0.2, credit=3)
    assert [d.request_id for d in of(out, Dispatch)] == [1, 2, 3]
    assert [d.attempt for d in of(out, Dispatch)] == [1, 1, 0]


def test_second_ready_disconnects_and_retries():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    only(req(s, 2), Dispatch)
    out = s.worker_ready(b"w1", "svc", 0.5)
    assert isinstance(out[0], DisconnectWorker) and out[0].worker == b"w1"
    assert of(out, Dispatch) == []  # w2 is busy
    assert s.stats()["workers"] == 1
    assert only(s.worker_final(b"w2", d.token + 1, 0.6, None), Dispatch).request_id == 1


def test_unknown_worker_is_told_to_reconnect():
    s = Scheduler()
    assert only(s.worker_seen(b"ghost", 0.0), DisconnectWorker).worker == b"ghost"
    assert s.worker_final(b"ghost", 42, 0.0, None) == []
    assert s.worker_partial(b"ghost", 42, 0.0, None) == []
    assert s.worker_disconnect(b"ghost", 0.0) == []
    assert s.stats()["counters"]["dropped_late"] == 2


def test_partials_are_relayed_only_while_the_worker_holds_the_token():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    p = only(s.worker_partial(b"w", d.token, 0.1, "chunk"), ToClient)
    assert (p.final, p.payload, p.dispatched_at) == (False, "chunk", 0.0)
    s.worker_final(b"w", d.token, 0.2, "end")
    assert s.worker_partial(b"w", d.token, 0.3, "late") == []
    assert s.worker_final(b"w", d.token, 0.3, "dup") == []
    assert s.worker_final(b"w", 999, 0.3, "bogus") == []
    assert s.stats()["counters"]["dropped_late"] == 3


# ----------------------------------------------------------------------------- cancellation


def test_cancel_queued_request():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    busy = only(req(s, 0), Dispatch)
    req(s, 1)
    err = only(s.client_cancel(C, 1, 0.1), ClientError)
    assert err.code == ErrorCode.CANCELLED and err.request_id == 1
    assert s.client_cancel(C, 1, 0.2) == []  # already final
    assert s.client_cancel(C, 77, 0.2) == []  # never existed
    assert s.worker_final(b"w", busy.token, 0.3, None)[1:] == []
    assert s.stats()["counters"]["cancelled"] == 1


def test_cancel_in_flight_waits_for_the_workers_final():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    assert s.client_cancel(C, 1, 0.1) == [CancelAtWorker(b"w", d.token)]
    assert s.client_cancel(C, 1, 0.15) == []  # told once
    out = s.worker_final(b"w", d.token, 0.2, "cancelled-or-result")
    assert only(out, ToClient).payload == "cancelled-or-result"
    assert s.worker_final(b"w", d.token, 0.3, "again") == []


def test_cancel_in_flight_then_worker_death_is_cancelled_not_retried():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    only(req(s, 1), Dispatch)
    s.client_cancel(C, 1, 0.1)
    out = s.worker_disconnect(b"w", 0.2)
    assert only(out, ClientError).code == ErrorCode.CANCELLED
    assert of(out, Dispatch) == []


# ----------------------------------------------------------------------------- clients


def test_client_disconnect_drops_queued_and_cancels_running():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    req(s, 2)
    req(s, 3, client=b"other")
    out = s.client_disconnect(C, 0.5)
    assert out == [CancelAtWorker(b"w", d.token, CANCEL_CLIENT_GONE)]
    out = s.worker_final(b"w", d.token, 0.6, "late")
    assert of(out, ToClient) == []
    assert only(out, Dispatch).client == b"other"  # request 2 is gone
    assert s.stats()["counters"]["client_dropped"] == 1


def test_only_a_client_without_heartbeats_ends_with_its_connection():
    # A plain client is never presumed dead: its connection's close is what ends its
    # requests (the server then drops it as at DISCONNECT).  One that heartbeats keeps its
    # liveness window; dropped for its silence, it has no record left, and nothing to keep.
    s = Scheduler(Config(client_liveness=2.0, heartbeat_interval=100.0))
    assert s.ends_with_connection(b"plain")
    req(s, 1, client=b"plain")
    assert s.ends_with_connection(b"plain")
    s.client_heartbeat(C, 0.0)
    assert not s.ends_with_connection(C)
    s.tick(3.0)  # silent past its window
    assert s.ends_with_connection(C)


def test_silent_client_is_dropped_only_if_it_ever_sent_a_heartbeat():
    s = Scheduler(Config(client_liveness=2.0, heartbeat_interval=100.0))
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    req(s, 2)
    req(s, 3, client=b"quiet")  # never heartbeats: never expired
    s.client_heartbeat(C, 0.0)
    s.client_seen(C, 1.0)
    assert s.next_wakeup(1.0) == 3.0
    assert s.tick(2.9) == []
    assert s.tick(3.0) == [CancelAtWorker(b"w", d.token, CANCEL_CLIENT_GONE)]
    assert s.stats()["clients"] == 0
    out = s.worker_final(b"w", d.token, 3.1, None)
    assert only(out, Dispatch).client == b"quiet"
    s.worker_seen(b"w", 50.0)
    assert of(s.tick(50.0), CancelAtWorker) == []


def test_quiet_lists_tracked_clients_and_workers_not_heard_from():
    """What the server looks at the connections of (bytes of a long message on the way keep
    a peer alive): tracked clients (they heartbeat) and live workers silent that long."""
    s = Scheduler(Config(client_liveness=2.0, heartbeat_interval=1.0))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    s.client_heartbeat(C, 0.0)
    s.client_heartbeat(b"other", 0.0)
    req(s, 1, client=b"untracked")  # never heartbeats: never expired, never looked at
    s.worker_seen(b"w2", 0.8)
    s.client_seen(b"other", 0.8)
    assert s.quiet(1.0, 0.5) == ([C], [b"w1"])
    # Bytes seen moving count as the peer's word: its expiry moves with it.
    s.client_seen(C, 1.9)
    s.worker_seen(b"w1", 1.9)
    assert s.quiet(2.0, 0.5) == ([b"other"], [b"w2"])
    out = s.tick(3.0)  # "other" was due at 2.8; C, seen at 1.9, is due at 3.9
    assert of(out, DisconnectWorker) == [] and s.stats()["clients"] == 1
    assert s.quiet(3.0, 0.5) == ([C], [b"w1", b"w2"])


def test_default_client_liveness_follows_heartbeats():
    s = Scheduler(Config(heartbeat_interval=0.5, heartbeat_liveness=4))
    s.client_heartbeat(C, 0.0)
    assert s.next_wakeup(0.0) == 2.0


# ----------------------------------------------------------------------------- heartbeats


def test_heartbeats_are_sent_each_interval_and_silence_kills():
    s = Scheduler()  # interval 1 s, liveness 3
    s.worker_ready(b"w", "svc", 0.0)
    assert s.tick(0.5) == []
    assert s.tick(1.0) == [HeartbeatWorker(b"w")]
    assert s.tick(1.5) == []
    assert s.tick(2.0) == [HeartbeatWorker(b"w")]
    s.worker_seen(b"w", 2.5)
    assert s.tick(3.0) == [HeartbeatWorker(b"w")]  # not dead: heard from at 2.5
    assert s.tick(4.0) == [HeartbeatWorker(b"w")]
    assert s.tick(5.0) == [HeartbeatWorker(b"w")]
    assert s.tick(5.49) == []
    out = s.tick(5.5)
    assert [type(a) for a in out] == [DisconnectWorker]
    assert not s.has_service("svc")
    assert s.tick(10.0) == []


def test_late_tick_sends_one_heartbeat_not_a_burst():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    s.worker_seen(b"w", 2.5)
    assert s.tick(2.5) == [HeartbeatWorker(b"w")]
    assert s.next_wakeup(2.5) == 3.5


# ----------------------------------------------------------------------------- next_wakeup


def test_next_wakeup_tracks_the_earliest_real_deadline():
    s = Scheduler(Config(heartbeat_interval=10.0))
    assert s.next_wakeup(0.0) is None
    s.worker_ready(b"w", "svc", 0.0)
    assert s.next_wakeup(0.0) == 10.0
    d = only(req(s, 1, deadline=4.0), Dispatch)
    assert s.next_wakeup(0.0) == 4.0
    s.worker_final(b"w", d.token, 1.0, None)
    assert s.next_wakeup(1.0) == 10.0  # the finished request's deadline no longer counts
    s.worker_seen(b"w", 5.0)  # liveness moves to 35, heartbeat still due at 10
    assert s.tick(9.99) == []
    assert s.tick(10.0) == [HeartbeatWorker(b"w")]
    assert s.next_wakeup(10.0) == 20.0


def test_next_wakeup_never_promises_work_that_is_not_there():
    s = Scheduler(Config(client_liveness=2.0))
    s.client_heartbeat(C, 0.0)
    for t in (0.5, 1.0, 1.5):
        s.client_seen(C, t)
    assert s.next_wakeup(1.5) == 3.5
    assert s.tick(3.49) == []


def test_stats_shape():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=2)
    req(s, 1, priority=Priority.URGENT)
    req(s, 2)
    req(s, 3, priority=Priority.BACKGROUND)
    st = s.stats()
    assert st["services"]["svc"] == {
        "queued": {"urgent": 0, "normal": 0, "background": 1},
        "in_flight": 2,
        "workers": 1,
        "credit": 2,
        "hosts": {"": 1},
        "leases": 0,
        "leased_credit": 0,
    }
    assert st["workers"] == 1 and st["requests"] == 3
    info = s.service_info("svc")
    assert info["queued"] == {"urgent": 0, "normal": 0, "background": 1} and info["in_flight"] == 2
    assert info["workers"] == [{"worker": b"w", "host": None, "transports": ["inline"], "credit": 2, "in_flight": 2,
                                "stopping": False}]
    assert s.service_info("nope") is None
    assert st["counters"]["dispatched"] == 2
    assert set(st["counters"]) >= {
        "dispatched", "completed", "expired", "rejected_full", "retried", "dropped_late",
        "cancelled",
    }


def test_finished_request_payload_is_not_retained():
    """A stale deadline timer must not keep a finished request's payload (it can be a 64 MB
    inline tensor) alive: found as a broker RSS leak of one tensor per request."""
    import gc
    import weakref

    class Payload:
        pass

    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0, credit=1)
    refs = []
    for i in range(50):
        p = Payload()
        refs.append(weakref.ref(p))
        acts = s.client_request(b"c", i, "svc", 0.0, payload=p, deadline=100.0)
        token = next(a.token for a in acts if isinstance(a, Dispatch))
        s.worker_final(b"w", token, 0.0, payload=None)
        del p, acts
    gc.collect()
    assert all(r() is None for r in refs)


def test_cuda_requests_only_go_to_same_host_cuda_workers():
    from broker.state import cuda_key

    s = Scheduler(Config())
    s.worker_ready(b"cpu", "svc", 0.0, credit=4, host="h", transports=frozenset({"inline", "shm"}))
    acts = s.client_request(b"c", 1, "svc", 0.0, payload=None, local_host=cuda_key("h"))
    assert [type(a) for a in acts] == [ClientError] and acts[0].code == ErrorCode.NOT_LOCAL
    s.worker_ready(b"gpu", "svc", 0.0, credit=4, host="h", transports=frozenset({"inline", "shm", "cuda"}))
    acts = s.client_request(b"c", 2, "svc", 0.0, payload=None, local_host=cuda_key("h"))
    assert [(type(a), a.worker) for a in acts] == [(Dispatch, b"gpu")]
    # Shared-memory requests still go to either (least loaded first: the idle CPU worker).
    acts = s.client_request(b"c", 3, "svc", 0.0, payload=None, local_host="h")
    assert [(type(a), a.worker) for a in acts] == [(Dispatch, b"cpu")]


# ----------------------------------------------------------------------------- direct reply (DONE)


def test_done_settles_without_relaying_and_returns_credit():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=2)
    d1, d2 = (only(req(s, i), Dispatch) for i in (1, 2))
    assert req(s, 3) == []  # credit used up
    out = s.worker_done(b"w", [d1.token, d2.token], 0.5)
    assert of(out, ToClient) == [] and of(out, ClientError) == []
    assert only(out, Dispatch).request_id == 3
    c = s.stats()["counters"]
    assert c["completed"] == 2 and c["direct"] == 2
    # The ids are free again: the client has its finals.
    assert len(of(req(s, 1, now=0.6), Dispatch)) == 1


def test_late_or_duplicate_done_is_dropped_and_counted():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1), Dispatch)
    s.worker_done(b"w", [d.token], 0.1)
    assert s.worker_done(b"w", [d.token, 999], 0.2) == []
    assert s.worker_done(b"stranger", [d.token], 0.2) == []
    assert s.stats()["counters"]["dropped_late"] == 3


def test_done_after_in_flight_deadline_gives_no_second_final():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1, deadline=1.0), Dispatch)
    assert only(s.tick(1.0), ClientError).code == ErrorCode.DEADLINE_EXCEEDED
    assert req(s, 2, now=1.1) == []  # the worker still holds the credit
    out = s.worker_done(b"w", [d.token], 1.2)
    assert of(out, ClientError) == [] and of(out, ToClient) == []
    assert only(out, Dispatch).request_id == 2


def test_done_from_a_presumed_dead_worker_is_dropped_and_the_retry_stands():
    s = Scheduler()
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    d1 = only(req(s, 1), Dispatch)
    assert d1.worker == b"w1"
    retry = only(s.worker_disconnect(b"w1", 1.0), Dispatch)
    assert retry.worker == b"w2"
    # w1 had delivered its FINAL straight to the client before it was presumed dead: its
    # DONE settles nothing (the client drops the retry's second FINAL itself).
    assert s.worker_done(b"w1", [d1.token], 1.1) == []
    assert of(s.worker_done(b"w2", [retry.token], 1.2), ToClient) == []
    assert s.stats()["counters"]["completed"] == 1


def test_a_last_attempt_moves_from_a_busy_worker_set_aside_for_it_to_one_gone_idle():
    # w1 set aside for A while it ran X; w2 emptied meanwhile and took new work, while A
    # waited behind X (for ever behind a long stream).  Now A goes to w2.
    s = Scheduler(Config(max_retries=1, service_grace=60))
    s.worker_ready(b"a", "svc", 0.0)
    only(req(s, 1), Dispatch)  # A: dies with its worker below
    s.worker_ready(b"w1", "svc", 0.0, credit=2)
    s.worker_ready(b"w2", "svc", 0.0, credit=2)
    x, y = only(req(s, 2), Dispatch), only(req(s, 3), Dispatch)
    assert {x.worker, y.worker} == {b"w1", b"w2"}
    assert s.worker_disconnect(b"a", 0.1) == []  # A: its last attempt, a busy worker set aside for it
    (aside,) = s._services["svc"].aside
    other = y if aside.ident == x.worker else x
    d = only(s.worker_final(other.worker, other.token, 0.2), Dispatch)  # the other one empties
    assert (d.request_id, d.attempt, d.worker) == (1, 1, other.worker)
    assert not s._services["svc"].aside and aside.iso is None  # the first takes work again
    assert only(req(s, 4, 0.3), Dispatch).worker == aside.ident


def test_a_worker_that_says_goodbye_is_counted_as_left_not_as_a_death():
    # Every rolling restart showed as worker deaths: an alert on them fired on each.
    s = Scheduler()
    s.worker_ready(b"a", "svc", 0.0)
    s.worker_ready(b"b", "svc", 0.0)
    s.worker_disconnect(b"a", 0.1, failed=False)
    s.worker_disconnect(b"b", 0.1)
    c = s.stats()["counters"]
    assert (c["workers_left"], c["worker_deaths"]) == (1, 1)


def test_a_service_that_lost_its_workers_says_so_instead_of_start_one():
    # A request retried after its service's only worker was presumed dead waited out the
    # grace and was told "no worker registered; start one" (found by the network hunt): the
    # worker was there, cut off.  It says the last one went, and when.
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3, service_grace=1.0, max_retries=2))
    s.worker_ready(b"w", "svc", 0.0)
    assert of(req(s, 1, 0.0, client=b"c"), Dispatch)
    out = s.tick(3.5)  # presumed dead: the request waits for another worker
    out = s.tick(4.6)  # the grace is over
    [err] = [a for a in out if type(a) is ClientError]
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE
    assert "its last one went" in err.message and "start one" not in err.message, err.message
    assert "presumed dead after its silence" in err.message, err.message
    req(s, 2, 5.0, service="never", client=b"c")
    [err] = [a for a in s.tick(6.1) if type(a) is ClientError]
    assert "start one" in err.message


@pytest.mark.parametrize("went, words", [
    ({"closed": True}, "its connection closed without a goodbye: it crashed or was killed"),
    ({"failed": False}, "it said goodbye: stopped, or drained"),
    ({}, "disconnected by the broker"),
    (None, "it was stopped (draining)"),
])
def test_a_service_that_lost_its_workers_says_how_the_last_one_went(went, words):
    # Every way was "presumed dead after silence, or stopped" (the models audit), a crash
    # too, which the server sees as a closed connection at once.
    s = Scheduler(Config(service_grace=1.0))
    s.worker_ready(b"w", "svc", 0.0)
    if went is None:
        s.worker_stopping(b"w", 2.0)
    else:
        s.worker_disconnect(b"w", 2.0, **went)
    req(s, 1, 3.0, client=b"c")  # (its record kept through the gap when it went with nothing queued)
    [err] = [a for a in s.tick(4.1) if type(a) is ClientError]
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE and f"ago ({words})" in err.message, err.message


def test_a_request_left_queued_by_a_shutdown_that_stopped_the_workers_says_so():
    # A second signal to the launcher stops the workers while admitted requests still
    # queue (docs/operations.md, "One launcher"): they failed with "its last one went ...",
    # and the client's hint said to look at the workers, which the operator had stopped.
    s = Scheduler(Config(service_grace=1.0))
    s.worker_ready(b"w", "svc", 0.0, credit=1)
    assert of(req(s, 1, 0.0, client=b"c"), Dispatch)
    assert not [a for a in req(s, 2, 0.0, client=b"c") if type(a) is Dispatch]  # queued
    s.drain("the broker is shutting down (its launcher was told to stop); send the request elsewhere or later")
    s.worker_stopping(b"w", 0.5)
    [err] = [a for a in s.tick(1.6) if type(a) is ClientError]
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE and err.request_id == 2
    assert "the broker is shutting down" in err.message and "its last one went" not in err.message, err.message


def test_a_request_after_the_last_worker_left_says_it_went_too():
    # operations.md ("A worker is stopped"): requests that arrive once the service's last
    # worker went fail after the grace with a message saying when it went.  Only one already
    # queued when it went did: with nothing queued the service's record was dropped, and a
    # later request was told "no worker registered; start one" (the docs hunt).
    s = Scheduler(Config(service_grace=1.0))
    s.worker_ready(b"w", "svc", 0.0)
    s.worker_disconnect(b"w", 2.0, failed=False)  # a drain (SIGTERM): nothing was queued
    assert "svc" not in s._services  # its record went with its last worker
    req(s, 1, 10.0, client=b"c")
    [err] = [a for a in s.tick(11.1) if type(a) is ClientError]
    assert err.code == ErrorCode.SERVICE_UNAVAILABLE
    assert "its last one went 9.1 s ago" in err.message and "start one" not in err.message, err.message
    req(s, 2, 12.0, service="never", client=b"c")
    [err] = [a for a in s.tick(13.1) if type(a) is ClientError]
    assert "start one" in err.message
    # A bounded memory: the oldest names go first.
    from broker import state as S

    for i in range(S._GONE_SERVICES + 1):
        s.worker_ready(b"x%d" % i, f"s{i}", 20.0)
        s.worker_disconnect(b"x%d" % i, 21.0)
    lost = s._lost_services
    assert len(lost) == S._GONE_SERVICES and "s0" not in lost and f"s{S._GONE_SERVICES}" in lost


def test_a_worker_presumed_dead_for_its_silence_is_a_death_the_server_warns_of():
    # The broker said nothing at its default level when a worker died (the observability
    # hunt): the verdict is marked `dead`, with what it costs, for a WARNING.
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3, service_grace=1.0))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    assert of(req(s, 1, 0.0, client=b"c"), Dispatch)
    assert s.death_note(b"nobody") == ""
    s.worker_seen(b"w2", 2.0)
    [d] = [a for a in s.tick(3.5) if type(a) is DisconnectWorker]
    assert d.dead and "presumed dead; service 'svc'" in d.reason, d
    assert "request(s) held" in d.reason and "last live worker" not in d.reason, d.reason
    [d] = [a for a in s.tick(5.5) if type(a) is DisconnectWorker]
    assert d.dead and d.worker == b"w2" and "it was the service's last live worker" in d.reason, d.reason
    # A DISCONNECT of another kind (an unknown worker) is no death.
    [d] = [a for a in s.worker_seen(b"ghost", 6.0) if type(a) is DisconnectWorker]
    assert not d.dead


def test_a_stopping_worker_gets_nothing_new_and_is_not_live_but_finishes_what_it_holds():
    # STOPPING (a worker's SIGTERM): readiness and the grace of requests with no other worker
    # see it gone at once, not at its DISCONNECT after the drain (the observability hunt).
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3, service_grace=1.0))
    s.worker_ready(b"w", "svc", 0.0, credit=2)
    d = only(req(s, 1, 0.0), Dispatch)
    assert s.worker_stopping(b"w", 0.5) == [] and s.worker_stopping(b"w", 0.5) == []
    assert not s.has_service("svc") and s.live_services() == 0
    assert s.stats()["services"]["svc"]["hosts"] == {}
    assert of(req(s, 2, 0.6), Dispatch) == []  # credit to spare, but nothing new goes to it
    [err] = of(s.tick(1.7), ClientError)  # the grace counts from the STOPPING
    assert err.request_id == 2 and err.code == ErrorCode.SERVICE_UNAVAILABLE
    # What it holds is its own: its FINAL is relayed, then its goodbye settles the rest.
    assert of(s.worker_final(b"w", d.token, 1.8, None), ToClient)
    s.worker_disconnect(b"w", 1.9, failed=False)
    assert s.stats()["counters"]["workers_left"] == 1
    # Another worker, stopping while it runs a request, then dying: the request is retried
    # and waits a grace for a live worker.
    s.worker_ready(b"v", "svc", 2.0)
    d = only(req(s, 3, 2.0), Dispatch)
    s.worker_stopping(b"v", 2.1)
    out = s.worker_disconnect(b"v", 2.2)
    assert of(out, Dispatch) == [] and of(out, ClientError) == []
    [err] = of(s.tick(3.3), ClientError)
    assert err.request_id == 3 and err.code == ErrorCode.SERVICE_UNAVAILABLE
    s.worker_ready(b"u", "svc", 4.0)
    assert s.has_service("svc")


def test_a_stopping_worker_is_out_of_the_counts_and_its_late_death_gives_a_whole_grace():
    # Found by review: the death of a stopping worker said "the service's last live worker"
    # while another lived; credit and service_info still counted it; and what it held, when
    # it died after a drain longer than the grace, failed at once though a replacement came.
    from broker.state import LAST_WORKER

    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=30, service_grace=2.0))
    s.worker_ready(b"w1", "svc", 0.0, credit=4)
    s.worker_ready(b"w2", "svc", 0.0, credit=2)
    s.worker_stopping(b"w1", 0.1)
    assert LAST_WORKER not in s.death_note(b"w1") and LAST_WORKER in s.death_note(b"w2")
    st = s.stats()["services"]["svc"]
    assert (st["workers"], st["credit"]) == (1, 2)
    assert [w["stopping"] for w in s.service_info("svc")["workers"]] == [True, False]
    s.worker_disconnect(b"w2", 0.2, failed=False)
    s.worker_disconnect(b"w1", 0.2, failed=False)
    s.worker_ready(b"v", "svc", 1.0)
    only(req(s, 3, 1.0), Dispatch)
    s.worker_stopping(b"v", 1.1)  # SIGTERM: a long batch drains
    assert of(s.worker_disconnect(b"v", 10.0), ClientError) == []  # killed at 10 s
    assert of(s.tick(10.01), ClientError) == []  # a whole grace from the death
    assert of(s.worker_ready(b"u", "svc", 10.5), Dispatch)  # the replacement takes it


def test_a_queued_only_cancel_leaves_a_running_request_alone():
    # A client resending a call it may have sent twice (a new connection to the broker) asks
    # for queued copies only: a copy already running answers (the network hunt saw a CANCEL
    # throw such a result away and the call wait for a second full run).
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3))
    s.worker_ready(b"w", "svc", 0.0, credit=1)
    only(req(s, 1, 0.0), Dispatch)
    req(s, 2, 0.0)  # queued: the worker's credit is taken
    assert s.client_cancel(C, 1, 0.1, queued_only=True) == []  # running: left alone
    assert only(s.client_cancel(C, 2, 0.1, queued_only=True), ClientError).code == ErrorCode.CANCELLED
    assert only(s.client_cancel(C, 1, 0.2), CancelAtWorker)  # a plain CANCEL still reaches the worker


def test_a_tick_handles_a_bounded_number_of_timers_and_says_the_rest_are_due():
    # 300,000 queued requests whose service lost its workers held the broker's loop 4 s in
    # one tick (a grace timer each), and healthy workers, silent to it that long, took it
    # for lost (a scale hunt).  A tick handles at most TICK_MAX; the rest stay due, so the
    # server reads its sockets between the ticks.
    from broker.state import TICK_MAX

    s = Scheduler(Config(heartbeat_interval=100.0, max_queue=3 * TICK_MAX, max_client_requests=3 * TICK_MAX,
                         service_grace=1.0))
    n = TICK_MAX + 100
    for i in range(n):
        req(s, i, 0.0)  # no worker: each waits out the grace
    first = of(s.tick(5.0), ClientError)
    assert len(first) == TICK_MAX and s.next_wakeup(5.0) <= 5.0
    rest = of(s.tick(5.0), ClientError)
    assert len(rest) == 100 and {e.request_id for e in first + rest} == set(range(n))


def test_a_cancel_at_the_deadline_ends_the_request_as_the_deadline_does():
    # The client's timer usually beats the broker's by a hair: its CANCEL counted most
    # timeouts `cancelled` (the metrics hunt: 16 of 20 queued, 7 of 10 running).  A CANCEL
    # that says `expired` ends the request as the broker's own timer would.
    from broker.protocol import CANCEL_EXPIRED

    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1, deadline=1.0), Dispatch)
    req(s, 2, deadline=1.0)  # queued behind it
    err = only(s.client_cancel(C, 2, 0.999, expired=True), ClientError)
    assert err.code == ErrorCode.DEADLINE_EXCEEDED and err.request_id == 2
    out = s.client_cancel(C, 1, 0.999, expired=True)
    assert only(out, ClientError).code == ErrorCode.DEADLINE_EXCEEDED
    assert only(out, CancelAtWorker) == CancelAtWorker(b"w", d.token, CANCEL_EXPIRED)
    counters = s.stats()["counters"]
    assert counters["expired"] == 2 and counters["cancelled"] == 0
    assert of(s.tick(1.0), ClientError) == [] and of(s.tick(1.0), CancelAtWorker) == []  # its timer: nothing left
    out = s.worker_final(b"w", d.token, 1.1, "its 504")
    assert of(out, ToClient) == [] and s.stats()["counters"]["dropped_late"] == 1
    # A CANCEL without it is the client's asking, as before.
    d3 = only(req(s, 3, now=1.2, deadline=5.0), Dispatch)
    assert s.client_cancel(C, 3, 1.3) == [CancelAtWorker(b"w", d3.token)]


def test_a_request_whose_client_left_is_counted_client_gone_when_its_worker_answers_the_cancel():
    # The broker cancels a running request whose client left (telling the worker why) and
    # counts the worker's answer: its 499 was counted `cancelled`, as if the client had asked.
    from broker.protocol import CANCEL_CLIENT_GONE
    from broker.state import CLIENT_GONE

    counted = []
    s = Scheduler(on_direct=lambda service, code, *rest: counted.append(code))
    s.worker_ready(b"w", "svc", 0.0, credit=3)
    d1 = only(req(s, 1), Dispatch)
    d2 = only(req(s, 2), Dispatch)
    d3 = only(req(s, 3), Dispatch)
    s.client_cancel(C, 3, 0.05)  # this one its client did cancel, before it left
    out = s.client_disconnect(C, 0.1)
    assert sorted(of(out, CancelAtWorker), key=lambda a: a.token) == [
        CancelAtWorker(b"w", d1.token, CANCEL_CLIENT_GONE), CancelAtWorker(b"w", d2.token, CANCEL_CLIENT_GONE)]
    s.worker_final(b"w", d1.token, 0.2, "its 499", code=ErrorCode.CANCELLED)
    # Its result, sent straight to the client before the cancel reached the worker: the
    # client may have read it before it left (a close races the DONE), so it counts as it is.
    s.worker_done(b"w", [d2.token], 0.2, [0], [0.0])
    s.worker_final(b"w", d3.token, 0.2, "its 499", code=ErrorCode.CANCELLED)
    assert counted == [CLIENT_GONE, 0, ErrorCode.CANCELLED]
    # A result relayed through the broker after its client left reached nobody; a model's
    # error is the service's own, whoever was there to see it.
    d4 = only(req(s, 4, client=b"c2"), Dispatch)
    d5 = only(req(s, 5, client=b"c2"), Dispatch)
    s.client_disconnect(b"c2", 0.3)
    s.worker_final(b"w", d4.token, 0.4, "a result for nobody", code=0)
    s.worker_final(b"w", d5.token, 0.4, "the model crashed", code=ErrorCode.INTERNAL)
    assert counted[-2:] == [CLIENT_GONE, ErrorCode.INTERNAL]


def test_a_pause_of_the_broker_itself_does_not_count_against_its_peers():
    """`resumed`: the broker did not run for a while (stopped with its peers: one `docker
    pause`, a Ctrl-Z of the launcher's group).  Liveness windows move on by the lost time,
    never past now; deadlines do not move; a peer really gone is found that much later."""
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3, client_liveness=3.0))
    s.worker_ready(b"w1", "svc", 0.0)
    s.worker_ready(b"w2", "svc", 0.0)
    s.client_heartbeat(C, 0.0)
    d = only(req(s, 1, deadline=8.0), Dispatch)
    s.worker_seen(b"w1", 1.0)
    s.worker_seen(b"w2", 1.0)
    s.client_seen(C, 1.0)
    # Stopped from 1.5 to 11.5: every window (due at 4.0) passed meanwhile, and the deadline.
    assert s.resumed(10.0, 11.5) == []
    out = s.tick(11.5)
    assert of(out, DisconnectWorker) == [] and s.stats()["clients"] == 1
    assert only(out, ClientError).code == ErrorCode.DEADLINE_EXCEEDED  # the caller lived through it
    assert only(out, CancelAtWorker).token == d.token
    assert s.stats()["counters"]["paused"] == 1
    # Windows counted from 11.0 (1.0 + 10, capped at now): w1 speaks, w2 and the client do not.
    s.worker_seen(b"w1", 13.9)
    assert of(s.tick(13.9), DisconnectWorker) == []
    out = s.tick(14.0)
    assert only(out, DisconnectWorker).worker == b"w2"
    assert s.stats()["clients"] == 0
    # Never past now: a pause longer than the silence before it leaves the window whole.
    s.resumed(100.0, 20.0)  # w1 last heard at 13.9: counted from 20.0, not 113.9
    assert of(s.tick(22.9), DisconnectWorker) == []
    assert only(s.tick(23.0), DisconnectWorker).worker == b"w1"


def test_a_direct_done_after_its_client_left_is_not_a_dropped_late_reply():
    """The worker answered the client straight, the client read it and left (DISCONNECT)
    before the worker's DONE reached the broker: nothing was dropped.  A relayed final for
    a client gone, and a direct DONE after the deadline was answered, still count."""
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=4)
    d1 = only(req(s, 1), Dispatch)
    d2 = only(req(s, 2), Dispatch)
    d3 = only(req(s, 3, client=b"other", deadline=1.0), Dispatch)
    s.client_disconnect(C, 0.2)
    s.worker_done(b"w", [d1.token], 0.3)
    assert s.stats()["counters"]["dropped_late"] == 0
    s.worker_final(b"w", d2.token, 0.3, "relayed to nobody")
    assert s.stats()["counters"]["dropped_late"] == 1
    s.tick(1.0)  # d3's deadline answered
    s.worker_done(b"w", [d3.token], 1.1)
    assert s.stats()["counters"]["dropped_late"] == 2


def test_a_result_for_a_request_its_client_cancelled_counts_as_cancelled():
    """The CANCEL reached the broker first; the worker had already sent its result (a
    batch runs to its end): relayed (the SDK drops it) or straight to the client (its
    DONE), it counts `cancelled`, as the client saw it.  Also when the client left after
    cancelling.  A result that came before the CANCEL is the client's: `ok`."""
    counted = []
    s = Scheduler(on_direct=lambda service, code, *rest: counted.append(code))
    s.worker_ready(b"w", "svc", 0.0, credit=4)
    d1 = only(req(s, 1), Dispatch)
    d2 = only(req(s, 2), Dispatch)
    d3 = only(req(s, 3), Dispatch)
    for rid in (1, 2, 3):
        s.client_cancel(C, rid, 0.1)
    out = s.worker_final(b"w", d1.token, 0.2, "a result", code=0)
    assert only(out, ToClient).code == ErrorCode.CANCELLED  # still relayed: its slots are released
    s.worker_done(b"w", [d2.token], 0.2, [0], [0.0])
    s.client_disconnect(C, 0.25)
    s.worker_done(b"w", [d3.token], 0.3, [0], [0.0])
    assert counted == [ErrorCode.CANCELLED, ErrorCode.CANCELLED]
    d5 = only(req(s, 5, client=b"c2"), Dispatch)
    s.worker_done(b"w", [d5.token], 0.4, [0], [0.0])
    s.client_cancel(b"c2", 5, 0.5)  # too late: answered already
    assert counted[-1] == 0


def test_a_cancelled_request_whose_deadline_passes_before_its_worker_confirms_counts_cancelled():
    """The client cancelled a running request (its call ended `Cancelled` then); its worker
    did not confirm before the request's deadline (a batch runs to its end), and the
    deadline answered it: it counted `deadline_exceeded` (and `expired`), an outcome its
    client never saw.  It ends `cancelled` now, at the deadline as before (its slots and
    its client's counts freed), and the worker's late answer changes nothing."""
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    d = only(req(s, 1, deadline=1.0), Dispatch)
    s.client_cancel(C, 1, 0.1)
    out = s.tick(1.0)
    err = only(out, ClientError)
    assert err.code == ErrorCode.CANCELLED, err
    assert of(out, CancelAtWorker) == []  # told once already
    counters = s.stats()["counters"]
    assert counters["expired"] == 0 and counters["cancelled"] == 1
    assert s.worker_final(b"w", d.token, 1.2, "late", code=0) == []
    assert s.stats()["counters"]["dropped_late"] == 1
    assert of(req(s, 1, now=1.3), ClientError) == []  # its id is free again


# ----------------------------------------------------------------------------- hold (a standalone broker's drain)


def test_holding_dispatches_nothing_and_lets_the_workers_finish():
    """`hold()` (a standalone broker's SIGTERM): what a worker holds is answered as before;
    nothing queued, nor arriving, goes to a worker, and `at_workers` reaches 0."""
    s = Scheduler(Config())
    s.worker_ready(b"w1", "svc", 0.0, credit=1, recall=True)
    s.worker_ready(b"w2", "svc", 0.0, credit=1, recall=True)
    d1 = only(req(s, 1), Dispatch)
    d2 = only(req(s, 2), Dispatch)
    assert req(s, 3) == []  # queued: both workers full
    s.hold()
    assert s.holding and s.at_workers() == 2
    assert only(s.worker_final(d1.worker, d1.token, 1.0, "r1"), ToClient).request_id == 1  # nothing dispatched
    assert not of(s.tick(1.5), Dispatch)
    assert req(s, 4, now=2.0) == []  # a free worker, and still queued
    assert s.at_workers() == 1
    assert only(s.worker_final(d2.worker, d2.token, 2.0, "r2"), ToClient).request_id == 2
    assert s.at_workers() == 0 and s.stats()["services"]["svc"]["queued"]["normal"] == 2
    # A lease is refused: requests go through the broker, to its successor.
    refused = s.client_lease(b"c2", None, 1, "svc", 2.0)
    assert refused and refused[0].code == ErrorCode.SERVICE_UNAVAILABLE and "shutting down" in refused[0].message


def test_a_running_requests_deadline_counts_what_its_client_saw_once_the_worker_answers():
    """The deadline of a request a worker runs passed, and the broker sent its 504 (its
    client's own timer ends the call anyway).  Its FINAL may have gone straight to the
    client a hair before: counted `deadline_exceeded` at once, the broker's outcomes and its
    callers' differed by 16-42 of 2,000 calls with deadlines near their compute time.  The
    count waits for the worker's answer (its DONE says when the FINAL went), a heartbeat
    interval at most, or the worker's end."""
    counted = []
    s = Scheduler(Config(heartbeat_interval=1.0),
                  on_direct=lambda service, code, enq, disp, fin, key: counted.append((key[1], int(code), fin)))
    s.worker_ready(b"w", "svc", 0.0, credit=4)
    d = {rid: only(req(s, rid, deadline=1.0), Dispatch) for rid in (1, 2, 3, 4)}
    out = s.tick(1.0)
    errors = of(out, ClientError)
    assert sorted(e.request_id for e in errors) == [1, 2, 3, 4]  # sent at once
    assert all(e.code == ErrorCode.DEADLINE_EXCEEDED and not e.counted for e in errors)
    assert len(of(out, CancelAtWorker)) == 4 and counted == []
    # 1: its result went 0.3 ms before the deadline (DONE at 1.0005, age 0.8 ms): `ok`.
    # 2: its result went 0.1 ms before it: too late to be read in time (`_DELIVERY_S`).
    s.worker_done(b"w", [d[1].token, d[2].token], 1.0005, [0, 0], [0.0008, 0.0006])
    assert [c[:2] for c in counted] == [(1, 0), (2, 504)]
    assert counted[0][2] == pytest.approx(0.9997) and counted[1][2] == 1.0
    # 3: relayed (the broker's 504 went first): the deadline's.
    s.worker_final(b"w", d[3].token, 1.1, "late result", code=0)
    assert counted[-1] == (3, 504, 1.0)
    # 4: no answer within a heartbeat interval: counted then, and not again at its answer.
    assert s.tick(1.9) == [] and len(counted) == 3
    s.tick(2.0)
    assert counted[-1] == (4, 504, 1.0)
    s.worker_done(b"w", [d[4].token], 2.5, [0], [0.0])
    assert len(counted) == 4
    # The worker dies holding one: counted at its end.
    d5 = only(req(s, 5, deadline=3.0), Dispatch)
    s.tick(3.0)
    s.worker_disconnect(b"w", 3.1)
    assert counted[-1] == (5, 504, 3.0) and len(counted) == 5


def test_without_a_counter_a_running_requests_deadline_is_counted_at_once():
    s = Scheduler()  # no metrics: nothing waits
    s.worker_ready(b"w", "svc", 0.0)
    only(req(s, 1, deadline=1.0), Dispatch)
    assert only(s.tick(1.0), ClientError).counted
