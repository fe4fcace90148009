"""The worker's lease table (gpu_worker.leases.LeaseTable): pure, no sockets.  Which direct
connections are bound to which lease, which direct REQUEST may run (and what the others are
answered), and what an end or a stop leaves behind."""
from __future__ import annotations

import pytest

from broker import protocol as P
from gpu_worker.leases import NOT_BOUND, LeaseTable, Refusal

SECRET = bytes(range(16))
A, B = b"conn-a", b"conn-b"  # two direct connections' routing ids


def _grant(n: int = 1, slots: int = 2, secret: bytes = SECRET, **kw) -> P.LeaseGrant:
    return P.LeaseGrant(lease=P.lease_id(n), secret=secret, service="echo", slots=slots, **kw)


@pytest.fixture
def table() -> LeaseTable:
    t = LeaseTable()
    assert t.grant(_grant()) is None
    return t


def test_grant_then_hello_with_the_secret_binds_the_connection(table):
    lid = P.lease_id(1)
    assert lid in table and len(table) == 1
    assert table.grant(_grant()) is not None  # the same lease twice: refused
    assert table.hello(A, lid, SECRET) is None
    assert table.lease_of(A).id == lid
    lease = table.admit(A, 7, b"k7")
    assert not isinstance(lease, Refusal) and lease.id == lid
    assert table.in_flight(lid) == 1 and table.find(A, 7) == b"k7"
    assert table.finish(b"k7") and table.in_flight(lid) == 0 and table.find(A, 7) is None
    assert not table.finish(b"k7")  # once only


def test_a_wrong_secret_or_an_unknown_lease_binds_nothing(table):
    lid = P.lease_id(1)
    assert table.hello(A, lid, bytes(16)) == "wrong secret"
    assert table.hello(B, P.lease_id(99), SECRET) == "unknown lease"
    for conn in (A, B):
        r = table.admit(conn, 1, b"k")
        assert isinstance(r, Refusal) and r.code == 400 and r.message.startswith(NOT_BOUND)
        assert "HELLO was refused" in r.message
    assert isinstance(table.admit(b"never-said-hello", 1, b"k"), Refusal)
    assert table.admit(b"never-said-hello", 1, b"k").message == NOT_BOUND
    # A refused HELLO on a bound connection unbinds it; a right one binds it again.
    assert table.hello(A, lid, SECRET) is None
    assert table.hello(A, lid, b"x" * 16) == "wrong secret" and table.lease_of(A) is None
    assert table.hello(A, lid, SECRET) is None and table.lease_of(A) is not None


def test_at_most_slots_in_flight_per_lease_over_all_its_connections(table):
    lid = P.lease_id(1)
    table.hello(A, lid, SECRET)
    table.hello(B, lid, SECRET)  # a second connection shares the lease's slots
    assert not isinstance(table.admit(A, 1, b"k1"), Refusal)
    assert not isinstance(table.admit(B, 1, b"k2"), Refusal)  # ids are per connection
    full = table.admit(A, 2, b"k3")
    assert isinstance(full, Refusal) and full.code == int(P.ErrorCode.QUEUE_FULL) and "2 slots" in full.message
    table.finish(b"k1")
    assert not isinstance(table.admit(A, 2, b"k3"), Refusal)
    # An id already in flight on the same connection is refused (CANCEL must find one request).
    table.finish(b"k2")
    dup = table.admit(A, 2, b"k4")
    assert isinstance(dup, Refusal) and dup.code == 400 and "already in flight" in dup.message
    # Another lease has its own slots.
    assert table.grant(_grant(2, slots=1)) is None
    table.hello(B, P.lease_id(2), SECRET)
    assert table.lease_of(B).id == P.lease_id(2) and table.lease_of(A).id == lid
    assert not isinstance(table.admit(B, 5, b"k5"), Refusal)
    assert isinstance(table.admit(B, 6, b"k6"), Refusal)


def test_end_unbinds_and_keeps_the_requests_in_flight_for_their_finals(table):
    lid = P.lease_id(1)
    table.hello(A, lid, SECRET)
    table.admit(A, 1, b"k1")
    lease = table.end(lid, "drain")
    assert lease is not None and lease.in_flight == {b"k1"} and lid not in table
    assert table.end(lid, "drain") is None  # unknown: nothing
    r = table.admit(A, 2, b"k2")
    assert isinstance(r, Refusal) and r.code == int(P.ErrorCode.SERVICE_UNAVAILABLE)
    assert "drain" in r.message and "through the broker" in r.message
    assert table.find(A, 1) == b"k1"  # a CANCEL still reaches it
    assert table.finish(b"k1")
    assert table.hello(A, lid, SECRET) == "unknown lease"


def test_stop_ends_every_lease_and_refuses_everything_after(table):
    table.grant(_grant(2))
    table.hello(A, P.lease_id(1), SECRET)
    table.admit(A, 1, b"k1")
    ids = table.stop()
    assert sorted(ids) == [P.lease_id(1), P.lease_id(2)] and len(table) == 0
    for conn in (A, b"anyone"):
        r = table.admit(conn, 9, b"k9")
        assert isinstance(r, Refusal) and r.code == int(P.ErrorCode.SERVICE_UNAVAILABLE)
        assert "stopping" in r.message and "resend this request through the broker" in r.message
    assert table.grant(_grant(3)) == "the worker is stopping"
    assert table.hello(A, P.lease_id(1), SECRET) == "the worker is stopping"
    assert table.finish(b"k1")  # what was in flight still finishes
    assert table.stop() == []


def test_reset_ends_every_lease_and_disconnect_unbinds(table):
    lid = P.lease_id(1)
    table.hello(A, lid, SECRET)
    table.hello(B, lid, SECRET)
    table.admit(B, 7, b"kb")
    assert table.unbind(B) == [b"kb"]  # what it has in flight: its client left (the worker cancels it)
    assert table.unbind(B) == [b"kb"] and table.unbind(b"conn-never") == []
    assert table.lease_of(B) is None and table.admit(B, 1, b"k").message == NOT_BOUND
    assert table.finish(b"kb")
    table.admit(A, 1, b"k1")
    table.reset("broker connection lost")
    assert len(table) == 0
    # What was in flight is still the worker's to finish (its client waits on the
    # connection), and a CANCEL still finds it.
    assert table.find(A, 1) == b"k1" and table.finish(b"k1") and not table.finish(b"k1")
    assert table.find(A, 1) is None
    r = table.admit(A, 2, b"k2")
    assert r.code == int(P.ErrorCode.SERVICE_UNAVAILABLE) and "broker connection lost" in r.message
    assert table.grant(_grant(5)) is None  # not stopping: new leases are taken


def test_what_is_remembered_of_ended_connections_is_bounded():
    t = LeaseTable(remember=2)
    for n in range(1, 5):
        t.grant(_grant(n))
        t.hello(bytes([n]), P.lease_id(n), SECRET)
        t.end(P.lease_id(n), "client_done")
    assert t.admit(bytes([1]), 1, b"k").message == NOT_BOUND  # forgotten: the plain answer
    assert "client_done" in t.admit(bytes([4]), 1, b"k").message


def test_the_worker_parses_the_brokers_lease_and_lease_end():
    grant = _grant(7, slots=3, client_pid=42)
    msg = P.parse_broker_to_worker(P.to_worker_lease(b"wid", P.encode_header(grant))[1:])
    assert (msg.command, msg.envelope) == (P.W_LEASE, P.lease_id(7))
    assert msg.body[0].slots == 3 and msg.body[0].client_pid == 42
    end = P.LeaseEnd(lease=P.lease_id(7), reason="client_gone")
    msg = P.parse_broker_to_worker(P.to_worker_lease_end(b"wid", P.lease_id(7), P.encode_header(end))[1:])
    assert (msg.command, msg.envelope, msg.body[0].reason) == (P.W_LEASE_END, P.lease_id(7), "client_gone")
    bad = [
        [P.MDPW, P.W_LEASE],                                                    # no grant
        [P.MDPW, P.W_LEASE, P.encode_header(P.LeaseGrant(lease=b"x", secret=SECRET, service="s", slots=1))],
        [P.MDPW, P.W_LEASE_END, P.lease_id(7)],                                 # no header
        [P.MDPW, P.W_LEASE_END, b"short", P.encode_header(end)],
        [P.MDPW, P.W_LEASE_END, P.lease_id(8), P.encode_header(end)],           # another lease's header
        [P.MDPW, P.W_LEASE_END, P.lease_id(7), P.encode_header(P.LeaseEnd(lease=P.lease_id(7), reason="why"))],
    ]
    for frames in bad:
        with pytest.raises(P.ProtocolError):
            P.parse_broker_to_worker(frames)


def test_a_leaseholder_that_churns_connections_holds_a_bounded_table():
    """A ROUTER never says that a connection closed, so a bound connection was forgotten only
    at its lease's end: a leaseholder that opened connections in a loop, each saying HELLO,
    grew the worker's table by one entry each for as long as it held the lease (3,000
    connections: 3,000 entries and 0.35 MiB of the worker's memory; the churn hunt).  A
    lease keeps its latest `MAX_ROUTES` connections; the oldest one past them is unbound (its
    next REQUEST is told to say HELLO), and what it has in flight still finishes."""
    from gpu_worker.leases import MAX_ROUTES

    t = LeaseTable()
    t.grant(_grant(slots=2))
    lid = P.lease_id(1)
    t.hello(b"first", lid, SECRET)
    assert not isinstance(t.admit(b"first", 1, b"k1"), Refusal)
    for n in range(10 * MAX_ROUTES):
        assert t.hello(n.to_bytes(5, "big"), lid, SECRET) is None
    lease = t.leases[lid]
    assert len(lease.routes) == MAX_ROUTES and len(t._routes) == MAX_ROUTES, (
        f"{len(lease.routes)} connections bound to one lease after {10 * MAX_ROUTES} HELLOs")
    newest = (10 * MAX_ROUTES - 1).to_bytes(5, "big")
    assert t.lease_of(newest) is lease and t.lease_of(b"first") is None
    assert t.admit(b"first", 2, b"k2").message == NOT_BOUND
    assert t.find(b"first", 1) == b"k1" and t.finish(b"k1")  # its request in flight still finishes
    # A connection that says HELLO again is the newest: it stays bound.
    t.hello(b"again", lid, SECRET)
    for n in range(MAX_ROUTES - 1):
        t.hello(b"again", lid, SECRET)
        t.hello(b"x" + n.to_bytes(4, "big"), lid, SECRET)
    assert t.lease_of(b"again") is lease
    t.end(lid, "client_done")
    assert not t._routes and not lease.routes


def test_holds_says_whether_a_connection_has_a_request_in_flight(table):
    """`holds` (a refusal that meets a full queue ends the connection only when it holds
    nothing: the worker's `_direct_send`), whether or not the lease ended since."""
    lid = P.lease_id(1)
    table.hello(A, lid, SECRET)
    table.hello(B, lid, SECRET)
    assert not table.holds(A) and not table.holds(b"stranger")
    table.admit(A, 1, b"k1")
    assert table.holds(A) and not table.holds(B)
    table.end(lid, "drain")
    assert table.holds(A)  # its answer is still owed on it
    table.finish(b"k1")
    assert not table.holds(A)
