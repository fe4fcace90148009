"""Leases in the pure scheduler (broker/leases.py, docs/protocol.md section 10), event by
event: placement, accounting, confirmation, and every way a lease ends."""
from __future__ import annotations

from broker.leases import (
    CLIENT_DONE,
    CLIENT_GONE,
    DRAIN,
    WORKER_FAILED,
    WORKER_STOPPING,
    LeaseEndToClient,
    LeaseEndToWorker,
    LeaseRefused,
    LeaseToClient,
    LeaseToWorker,
)
from broker.state import Config, Dispatch, ErrorCode, Scheduler

C = b"client"
EP = "ipc:///run/w.ipc"


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def only(actions, cls):
    found = of(actions, cls)
    assert len(found) == 1, actions
    return found[0]


def lease(s, now=0.0, client=C, service="svc", ask_id=7, **kw):
    kw.setdefault("secret", b"s" * 16)
    return s.client_lease(client, None, ask_id, service, now, **kw)


def granted(s, now=0.0, **kw):
    """Ask, the worker confirms: the lease id and the client's answer."""
    to_w = only(lease(s, now, **kw), LeaseToWorker)
    return to_w, only(s.worker_leased(to_w.worker, to_w.lease, now), LeaseToClient)


def req(s, rid, now=0.0, client=C, **kw):
    kw.setdefault("payload", f"p{rid}")
    return s.client_request(client, rid, "svc", now, **kw)


def test_a_lease_goes_to_the_worker_first_and_to_the_client_once_it_confirms():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    out = lease(s, slots=3)
    to_w = only(out, LeaseToWorker)
    assert not of(out, LeaseToClient)  # the worker must know it before the client can use it
    assert (to_w.worker, to_w.service, to_w.slots, to_w.client, to_w.secret) == (b"w", "svc", 3, C, b"s" * 16)
    to_c = only(s.worker_leased(b"w", to_w.lease, 0.1), LeaseToClient)
    assert (to_c.client, to_c.ask_id, to_c.lease, to_c.endpoint, to_c.slots) == (C, 7, to_w.lease, EP, 3)
    st = s.stats()
    assert st["services"]["svc"]["leases"] == 1 and st["services"]["svc"]["leased_credit"] == 3
    assert st["counters"]["leases_granted"] == 1
    assert s.worker_leased(b"w", to_w.lease, 0.2) == []  # a duplicate confirmation is dropped


def test_leased_credit_is_not_handed_out_to_brokered_requests():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    granted(s, slots=3)
    dispatched = [a for i in range(1, 8) for a in of(req(s, i), Dispatch)]
    assert len(dispatched) == 5  # 8 credit - 3 leased
    assert s.stats()["services"]["svc"]["queued"]["normal"] == 2


def test_a_worker_keeps_half_its_credit_for_the_broker_and_a_lease_gets_what_is_left():
    # A lease held idle took all but one slot: every brokered batch on that worker was a
    # batch of one (its default credit is twice its largest batch).  Half stays brokered.
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    to_w, _ = granted(s, slots=10)
    assert to_w.slots == 4
    refused = only(lease(s, ask_id=8), LeaseRefused)
    assert refused.code == ErrorCode.SERVICE_UNAVAILABLE and "leased already" in refused.message
    dispatched = [a for i in range(1, 6) for a in of(req(s, i), Dispatch)]
    assert len(dispatched) == 4  # a whole batch's worth for the broker
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=3, direct=EP)
    assert granted(s, slots=10)[0].slots == 1  # odd credit: the broker's half rounds up
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=2, direct=EP)
    assert granted(s, slots=10)[0].slots == 1  # a credit of 2 still leases one


def test_placement_prefers_the_clients_host_then_the_least_loaded():
    s = Scheduler()
    s.worker_ready(b"far", "svc", 0.0, credit=8, host="h2", transports=frozenset({"inline", "shm"}), direct=EP)
    s.worker_ready(b"near1", "svc", 0.0, credit=8, host="h1", transports=frozenset({"inline", "shm"}), direct=EP)
    s.worker_ready(b"near2", "svc", 0.0, credit=8, host="h1", transports=frozenset({"inline", "shm"}), direct=EP)
    kw = dict(host="h1", transports=frozenset({"inline", "shm"}), slots=2)
    first, _ = granted(s, ask_id=1, **kw)
    second, _ = granted(s, ask_id=2, **kw)
    assert {first.worker, second.worker} == {b"near1", b"near2"}  # spread: least loaded first
    # An inline-only client may go anywhere: the least loaded is the one with no lease yet.
    third = only(lease(s, ask_id=3, slots=1), LeaseToWorker)
    assert third.worker == b"far"


def test_no_worker_or_no_direct_socket_is_the_same_typed_error_as_a_request_gets():
    s = Scheduler()
    r = only(lease(s), LeaseRefused)
    assert r.code == ErrorCode.SERVICE_UNAVAILABLE and "no live worker" in r.message
    s.worker_ready(b"plain", "svc", 0.0, credit=8)  # a plain MDP worker: no direct socket
    r = only(lease(s), LeaseRefused)
    assert r.code == ErrorCode.SERVICE_UNAVAILABLE and "direct socket" in r.message
    assert s.stats()["counters"]["leases_refused"] == 2


def test_a_refusing_worker_gives_the_slots_back_and_the_client_an_error():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=4, direct=EP)
    to_w = only(lease(s, slots=3), LeaseToWorker)
    r = only(s.worker_leased(b"w", to_w.lease, 0.1, ok=False, message="full"), LeaseRefused)
    assert r.ask_id == 7 and "full" in r.message
    assert s.stats()["services"]["svc"]["leased_credit"] == 0
    assert len([a for i in range(1, 5) for a in of(req(s, i), Dispatch)]) == 4


def test_the_pinned_worker_dying_tells_the_client_to_resend_through_the_broker():
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3))
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    s.worker_ready(b"w2", "svc", 0.0, credit=8, direct=EP)
    to_w, to_c = granted(s)
    s.worker_seen(b"w2" if to_w.worker == b"w" else b"w", 2.5)
    out = s.tick(3.5)  # the pinned one went silent
    end = only(out, LeaseEndToClient)
    assert (end.client, end.lease, end.reason, end.resend) == (C, to_c.lease, WORKER_FAILED, True)
    assert not of(out, LeaseEndToWorker)
    assert s.stats()["services"]["svc"]["leases"] == 0


def test_a_worker_dying_before_it_confirmed_answers_the_ask_with_an_error():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    only(lease(s), LeaseToWorker)
    out = s.worker_disconnect(b"w", 0.5)
    r = only(out, LeaseRefused)
    assert r.ask_id == 7 and r.code == ErrorCode.SERVICE_UNAVAILABLE
    assert not of(out, LeaseEndToClient)
    # Refused, not ended: only a granted lease ends (the leases audit: ended outnumbered granted).
    counters = s.stats()["counters"]
    assert (counters["leases_granted"], counters["leases_refused"], counters["leases_ended"]) == (0, 1, 0)


def test_a_drain_ends_every_lease_on_both_sides_without_resending():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    to_w, to_c = granted(s)
    s.drain("shutting down")
    out = s.end_leases(DRAIN, 1.0)
    assert only(out, LeaseEndToWorker) == LeaseEndToWorker(b"w", to_w.lease, DRAIN)
    end = only(out, LeaseEndToClient)
    assert end.reason == DRAIN and end.resend is False
    r = only(lease(s, 1.1, ask_id=9), LeaseRefused)  # no new leases while draining
    assert r.code == ErrorCode.SERVICE_UNAVAILABLE and r.message == "shutting down"


def test_a_stopping_worker_ends_its_leases_and_the_client_is_told():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    to_w, _ = granted(s, slots=4)
    out = s.worker_lease_end(b"w", to_w.lease, 1.0)
    end = only(out, LeaseEndToClient)
    assert end.reason == WORKER_STOPPING and end.resend is False
    assert not of(out, LeaseEndToWorker)
    assert s.stats()["services"]["svc"]["leased_credit"] == 0
    assert s.worker_lease_end(b"other", to_w.lease, 1.1) == []


def test_a_worker_that_dies_after_ending_its_leases_by_stopping_has_their_clients_resend():
    """It ended the lease by stopping, so it owed the lease's requests in flight their
    replies; it died (its connection closed) instead of saying DISCONNECT: the client is told
    again, with resend.  A DISCONNECT (it finished what it held) tells the client nothing."""
    for failed in (True, False):
        s = Scheduler()
        s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
        to_w, _ = granted(s, slots=4)
        assert only(s.worker_lease_end(b"w", to_w.lease, 1.0), LeaseEndToClient).resend is False
        out = s.worker_disconnect(b"w", 2.0, failed=failed)
        if failed:
            assert only(out, LeaseEndToClient) == LeaseEndToClient(C, "svc", to_w.lease, WORKER_FAILED, True)
        else:
            assert not of(out, LeaseEndToClient)
        assert s.worker_disconnect(b"w", 2.1) == []  # told once: the worker is forgotten


def test_a_long_lived_worker_keeps_notes_of_its_latest_ended_leases_only(monkeypatch):
    """Every stream a client closes ends a lease while its worker lives, and leaves a note
    (should the worker die before DISCONNECT, that client resends).  A worker that lives
    for months would keep them all, and its death would send them all at once: the latest
    MAX_STOPPED_NOTES are kept, the oldest (long since answered) forgotten."""
    from broker import leases as L

    monkeypatch.setattr(L, "MAX_STOPPED_NOTES", 3)
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    ids = []
    for i in range(5):
        to_w, _ = granted(s, float(i), ask_id=i)
        ids.append(to_w.lease)
        only(s.client_lease_end(C, to_w.lease, i + 0.5), LeaseEndToWorker)  # the stream closed
    out = s.worker_disconnect(b"w", 10.0, failed=True)
    assert [e.lease for e in of(out, LeaseEndToClient)] == ids[-3:]


def test_a_lease_never_confirmed_leaves_no_note_when_its_worker_stops_then_dies():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    to_w = only(lease(s, slots=2), LeaseToWorker)
    out = s.worker_lease_end(b"w", to_w.lease, 0.5)  # before confirming: the client's ask is refused
    assert only(out, LeaseRefused)
    assert not of(s.worker_disconnect(b"w", 1.0), LeaseEndToClient)


def test_the_client_ending_or_leaving_tells_the_worker():
    s = Scheduler(Config(client_liveness=2.0))
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    first, _ = granted(s, ask_id=1)
    out = s.client_lease_end(C, first.lease, 0.5)
    assert only(out, LeaseEndToWorker) == LeaseEndToWorker(b"w", first.lease, CLIENT_DONE)
    assert s.client_lease_end(b"someone-else", first.lease, 0.6) == []
    second, _ = granted(s, 0.6, ask_id=2)
    s.worker_seen(b"w", 2.0)
    out = s.tick(2.7)  # the leaseholder went silent: it was tracked from its ask
    assert only(out, LeaseEndToWorker) == LeaseEndToWorker(b"w", second.lease, CLIENT_GONE)
    third, _ = granted(s, 2.8, ask_id=3)
    out = s.client_disconnect(C, 2.9)
    assert only(out, LeaseEndToWorker).reason == CLIENT_GONE
    assert s.stats()["services"]["svc"]["leases"] == 0


def test_slots_freed_by_an_ending_lease_go_to_queued_requests_at_once():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=4, direct=EP)
    to_w, _ = granted(s, slots=2)
    assert len(of(req(s, 1), Dispatch)) == 1
    assert len(of(req(s, 3), Dispatch)) == 1
    assert of(req(s, 2), Dispatch) == []  # waits: the rest is leased
    out = s.client_lease_end(C, to_w.lease, 0.5)
    assert only(out, Dispatch).request_id == 2


def test_an_unconfirmed_lease_is_refused_after_the_workers_liveness_window():
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3))
    s.worker_ready(b"w", "svc", 0.0, credit=4, direct=EP)
    to_w = only(lease(s, slots=3), LeaseToWorker)
    s.worker_seen(b"w", 2.0)
    s.client_heartbeat(C, 2.0)
    assert of(s.tick(2.9), LeaseRefused) == []
    out = s.tick(3.0)  # a worker that set a direct socket but never answers LEASE
    r = only(out, LeaseRefused)
    assert r.ask_id == 7 and r.code == ErrorCode.SERVICE_UNAVAILABLE
    # Not "worker_failed": the worker's heartbeats still came (a long batch on its loop).
    assert "did not confirm the lease within its liveness window (3 s" in r.message, r.message
    assert "worker_failed" not in r.message
    assert only(out, LeaseEndToWorker).lease == to_w.lease
    assert s.stats()["services"]["svc"]["leased_credit"] == 0
    assert s.worker_leased(b"w", to_w.lease, 3.1) == []  # too late
    counters = s.stats()["counters"]
    assert (counters["leases_granted"], counters["leases_refused"], counters["leases_ended"]) == (0, 1, 0)


def test_shared_memory_is_offered_only_when_the_lease_is_near_and_a_remote_client_needs_tcp():
    s = Scheduler()
    shm = frozenset({"inline", "shm"})
    s.worker_ready(b"local-noshm", "svc", 0.0, credit=8, host="h1", direct=EP)
    _, info = granted(s, ask_id=1, host="h1", transports=shm)
    assert info.worker_host is None  # same host, but the worker maps no shared memory
    s.worker_ready(b"local", "svc", 0.0, credit=8, host="h1", transports=shm, direct=EP)
    to_w, info = granted(s, ask_id=2, host="h1", transports=shm)
    assert to_w.worker == b"local" and info.worker_host == "h1" and to_w.client_host == "h1"
    r = only(lease(s, ask_id=3, remote=True), LeaseRefused)
    assert "tcp direct socket" in r.message  # both workers' direct sockets are ipc://
    s.worker_ready(b"net", "svc", 0.0, credit=8, direct="tcp://10.0.0.1:7000")
    to_w = only(lease(s, ask_id=4, remote=True, host="h1", transports=shm), LeaseToWorker)
    assert to_w.worker == b"net" and to_w.client_host is None


def test_each_client_is_placed_only_where_its_sdk_can_connect():
    """Local clients on ipc direct sockets; remote ones on tcp ones, CurveZMQ (direct_key)
    for a client with a key (principal curve:...), plain for one without."""
    s = Scheduler()
    key = "rQ]ew/6&pt%k7i1GqV@y1NSDMRmz)U0]vp/Dh7A7"
    s.worker_ready(b"curve", "svc", 0.0, credit=8, direct="tcp://10.0.0.1:7000", direct_key=key)
    r = only(lease(s, ask_id=1), LeaseRefused)  # a local client: no ipc direct socket
    assert "ipc direct socket" in r.message
    r = only(s.client_lease(C, None, 2, "svc", 0.0, secret=b"s" * 16, remote=True), LeaseRefused)
    assert "plain tcp direct socket" in r.message  # came in clear: cannot speak CurveZMQ to it
    to_w = only(s.client_lease(C, "curve:" + key, 3, "svc", 0.0, secret=b"s" * 16, remote=True), LeaseToWorker)
    info = only(s.worker_leased(to_w.worker, to_w.lease, 0.0), LeaseToClient)
    assert to_w.worker == b"curve" and info.server_key == key and info.link is None
    s.worker_ready(b"plain", "svc", 0.0, credit=8, direct="tcp://10.0.0.2:7000")
    to_w = only(s.client_lease(b"c2", None, 4, "svc", 0.0, secret=b"s" * 16, remote=True), LeaseToWorker)
    assert to_w.worker == b"plain"
    r = only(s.client_lease(b"c3", "curve:other", 5, "svc", 0.0, secret=b"s" * 16, remote=True,
                            slots=1), LeaseToWorker)
    assert r.worker == b"curve"  # never the plain one, however idle
    s.worker_ready(b"local", "svc", 0.0, credit=8, direct=EP)
    assert only(lease(s, ask_id=6), LeaseToWorker).worker == b"local"


def test_a_principals_leases_are_capped_and_a_refused_ask_does_not_track_the_client():
    s = Scheduler(Config(max_client_requests=4, client_liveness=1.0))
    only(lease(s), LeaseRefused)
    assert C not in s._clients  # a refused asker is not tracked (it may never heartbeat)
    s.worker_ready(b"w", "svc", 0.0, credit=16, direct=EP)
    first, _ = granted(s, 5.0, ask_id=1, slots=3)
    second, _ = granted(s, 5.0, ask_id=2, slots=3)
    assert (first.slots, second.slots) == (3, 1)  # 4 in all for this principal
    r = only(lease(s, 5.0, ask_id=3), LeaseRefused)
    assert "max_client_requests" in r.message
    s.client_lease_end(C, first.lease, 5.1)
    assert only(lease(s, 5.1, ask_id=4, slots=5), LeaseToWorker).slots == 3


def test_a_worker_cannot_end_a_lease_as_the_client_or_as_failed():
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    to_w, _ = granted(s)
    end = only(s.worker_lease_end(b"w", to_w.lease, 1.0, reason="worker_failed"), LeaseEndToClient)
    assert end.reason == WORKER_STOPPING and end.resend is False


def test_an_unconfirmed_lease_waits_for_its_confirmation_as_long_again_after_a_pause():
    """The broker stopped with the worker it asked (`Scheduler.resumed`): the confirmation
    window moves on by the lost time, at most a whole window from now."""
    s = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3))
    s.worker_ready(b"w", "svc", 0.0, credit=4, direct=EP)
    to_w = only(lease(s, slots=3), LeaseToWorker)  # due at 3.0
    s.client_heartbeat(C, 0.0)
    s.resumed(5.0, 5.5)  # stopped from 0.5 to 5.5: due at 8.0 now
    assert of(s.tick(5.5), LeaseRefused) == []
    to_c = only(s.worker_leased(b"w", to_w.lease, 5.6), LeaseToClient)
    assert to_c.lease == to_w.lease
    s2 = Scheduler(Config(heartbeat_interval=1.0, heartbeat_liveness=3))
    s2.worker_ready(b"w", "svc", 0.0, credit=4, direct=EP)
    only(lease(s2, slots=3), LeaseToWorker)
    s2.client_heartbeat(C, 0.0)
    s2.resumed(50.0, 1.0)  # capped: due at 4.0, not 53.0
    s2.worker_seen(b"w", 3.9)
    s2.client_seen(C, 3.9)
    assert of(s2.tick(3.9), LeaseRefused) == []
    assert only(s2.tick(4.0), LeaseRefused).ask_id == 7


def test_a_revoked_principals_leases_end_and_others_keep_theirs():
    """A tcp client's key left the allow-list (docs/security.md): its leases end as when it
    ends one itself (`client_done`: the worker answers what it holds), the client hears
    `revoked` without resend, an ask not yet confirmed is refused 403; another key's lease
    stands, and the slots come back."""
    from broker.leases import CLIENT_DONE, REVOKED

    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=16, direct="tcp://10.0.0.1:7000", direct_key="k")

    def ask(client, key, ask_id):
        return only(s.client_lease(client, key, ask_id, "svc", 0.0, remote=True, secret=b"s" * 16), LeaseToWorker)

    a = ask(b"c1", "curve:AAA", 1)
    only(s.worker_leased(b"w", a.lease, 0.0), LeaseToClient)
    p = ask(b"c1", "curve:AAA", 2)  # not yet confirmed
    o = ask(b"c2", "curve:BBB", 3)
    only(s.worker_leased(b"w", o.lease, 0.0), LeaseToClient)
    leased = s.stats()["services"]["svc"]["leased_credit"]
    out = s.principal_revoked("curve:AAA", 1.0, "removed")
    ends = of(out, LeaseEndToWorker)
    assert sorted(e.lease for e in ends) == sorted([a.lease, p.lease]) and {e.reason for e in ends} == {CLIENT_DONE}
    assert only(out, LeaseEndToClient) == LeaseEndToClient(b"c1", "svc", a.lease, REVOKED, False)
    r = only(out, LeaseRefused)
    assert (r.client, r.ask_id, r.code, r.message) == (b"c1", 2, ErrorCode.FORBIDDEN, "removed")
    assert s.stats()["services"]["svc"]["leased_credit"] == leased - a.slots - p.slots
    assert s.principal_revoked("curve:AAA", 1.1, "removed") == []  # nothing left of it
    assert s.leases_of("svc") == 1  # the other key's lease stands
    assert s.worker_leased(b"w", p.lease, 1.2) == []  # the worker's late confirmation changes nothing


def test_a_client_churning_leases_pushes_out_no_other_clients_note_and_leaves_none_behind():
    """A note of a lease ended while its worker lives (the client told to resend, should the
    worker die before DISCONNECT) is per worker, the latest MAX_STOPPED_NOTES kept: a client
    that asked for a lease and gave it back in a loop pushed every other client's note out
    (a client that gave its lease back with a call on it then waited for that call's
    deadline when the worker died), and its own notes stayed after it left (the churn hunt).
    One principal's notes are the latest MAX_CLIENT_NOTES, and go with the client."""
    from broker import leases as L

    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0, credit=8, direct=EP)
    mine, _ = granted(s, client=b"honest", ask_id=1)
    only(s.client_lease_end(b"honest", mine.lease, 0.5), LeaseEndToWorker)  # given back, a call on it
    for i in range(L.MAX_STOPPED_NOTES + 10):
        to_w, _ = granted(s, 1.0, client=b"churner", ask_id=i)
        s.client_lease_end(b"churner", to_w.lease, 1.0)
    w = s._workers[b"w"]
    assert any(c == b"honest" for c, *_ in w.stopped.values()), (
        f"{L.MAX_STOPPED_NOTES + 10} leases given back by another client pushed out the note of this one")
    assert sum(1 for c, *_ in w.stopped.values() if c == b"churner") == L.MAX_CLIENT_NOTES
    s.client_disconnect(b"churner", 2.0)
    assert [c for c, *_ in w.stopped.values()] == [b"honest"], "the churner's notes stayed after it left"
    assert not s._notes.get(b"churner") and b"churner" not in s._note_key
    out = s.worker_disconnect(b"w", 3.0, failed=True)
    assert of(out, LeaseEndToClient) == [LeaseEndToClient(b"honest", "svc", mine.lease, WORKER_FAILED, True)]
    s.client_disconnect(b"honest", 4.0)
    assert not s._notes and not s._note_key
