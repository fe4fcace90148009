"""broker.state: a light principal (one request at a time) beside a flooding one.  The ring
is least recently served first: a principal whose FIFO emptied when its last request was
dispatched, and that queues again, goes ahead of a principal dispatched since, instead of
behind it ("Dispatch" in broker/state.py's docstring).  Event by event, injected clock."""
from __future__ import annotations

from broker.state import Config, Dispatch, Scheduler

H, L, N = b"heavy", b"light", b"newcomer"


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def req(s, client, rid, now):
    return s.client_request(client, rid, "svc", now, payload=rid, deadline=now + 100.0)


def serve(s, token, now, n, key=lambda d: d.client):
    """``n`` dispatches, each as worker "w" finishes the one before, 20 ms apart: (what
    ``key`` says of each, the last token, the clock)."""
    order = []
    for _ in range(n):
        now += 0.02
        d = of(s.worker_final(b"w", token, now, None), Dispatch)[0]
        token = d.token
        order.append(key(d))
    return order, token, now


def test_a_light_client_is_not_put_behind_a_flood_served_since_its_last_request():
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)  # credit 1
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token
    for i in range(1, 50):
        req(s, H, i, 0.0)  # the flood: its FIFO never empties
    now = 0.0
    light_waits = []
    for round_ in range(5):
        for k in range(3):  # the flood runs on (its principal goes to the back of the ring)...
            now += 0.02
            token = of(s.worker_final(b"w", token, now, None), Dispatch)[0].token
            req(s, H, 1000 * (round_ + 1) + k, now)
        # ...and the light client's next request arrives while the worker runs one of them.
        now += 0.01
        req(s, L, 10 ** 6 + round_, now)
        dispatched = []
        while True:
            now += 0.02
            d = of(s.worker_final(b"w", token, now, None), Dispatch)[0]
            token = d.token
            dispatched.append(d.client)
            if d.client == L:
                break
            req(s, H, 100 * (round_ + 1) + len(dispatched), now)  # the flood keeps coming
        light_waits.append(len(dispatched) - 1)
    # Round robin says the light client waits for at most one dispatch of the flood; least
    # recently served first, it waits for none: the flood was served after it, every time.
    assert light_waits[1:] == [0] * 4, f"flood dispatches ahead of the light client's request: {light_waits}"


def test_a_principal_never_served_still_joins_at_the_back():
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token
    req(s, H, 1, 0.0)
    req(s, N, 2, 0.01)  # new: behind the flood's queued one, as before (no jumping in with new names)
    order = []
    for i in range(2):
        d = of(s.worker_final(b"w", token, 0.02 * (i + 1), None), Dispatch)[0]
        token = d.token
        order.append(d.client)
    assert order == [H, N]


def test_a_principal_served_after_the_front_one_joins_at_the_back():
    # L served last: it rejoins behind H (H waited longer since its last dispatch).
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token
    req(s, H, 1, 0.0)
    req(s, L, 2, 0.0)
    req(s, H, 3, 0.0)
    order, token, now = serve(s, token, 0.0, 2)
    assert order == [H, L]  # H (1) then L (2): L was served after H
    req(s, L, 4, now)  # L rejoins: H (3) was last served before L
    more, token, now = serve(s, token, now, 2)
    assert order + more == [H, L, H, L]


def test_two_light_clients_are_not_put_behind_a_flood_served_since_their_last_requests():
    # The second light client compared itself with the first (just rejoined, its FIFO new:
    # "never served") and went behind the flood, every round.
    L2 = b"light2"
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token
    for i in range(1, 50):
        req(s, H, i, 0.0)
    now, rid, rounds = 0.0, 10 ** 6, []
    for round_ in range(5):
        for k in range(3):
            now += 0.02
            token = of(s.worker_final(b"w", token, now, None), Dispatch)[0].token
            req(s, H, 1000 * (round_ + 1) + k, now)
        now += 0.01
        for c in (L, L2):
            rid += 1
            req(s, c, rid, now)
        order = []
        while L not in order or L2 not in order:
            now += 0.02
            d = of(s.worker_final(b"w", token, now, None), Dispatch)[0]
            token = d.token
            order.append(d.client)
            if d.client == H:
                rid += 1
                req(s, H, 10 ** 7 + rid, now)
        rounds.append(order)
    assert rounds[1:] == [[L, L2]] * 4, f"dispatch order after each pair of light requests: {rounds}"


def test_a_light_client_whose_queued_request_was_cancelled_keeps_its_last_dispatch():
    """L rejoined ahead of the flood, then cancelled that request before its turn (or it
    expired): L's last dispatch is still L1's, before the flood's last, so its next request
    goes ahead of the flood again, not to the back (as the worker's batcher does)."""
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)  # credit 1
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token
    for i in range(1, 10):
        req(s, H, i, 0.0)
    req(s, L, 101, 0.01)
    order, token, now = serve(s, token, 0.0, 3, key=lambda d: (d.client, d.request_id))
    assert order == [(H, 1), (L, 101), (H, 2)]  # H served after L's last dispatch
    req(s, L, 102, now + 0.01)
    s.client_cancel(L, 102, now + 0.015)
    req(s, L, 103, now + 0.02)
    d = of(s.worker_final(b"w", token, now + 0.03, None), Dispatch)[0]
    assert (d.client, d.request_id) == (L, 103), "L lost its last dispatch with its cancelled request"


def test_a_client_dispatched_straight_from_an_empty_queue_does_not_pass_one_served_before():
    """L's last dispatch from the ring came before X's, but L's next request went straight
    to a free worker (the queue empty: no ring): L was served after X, and when both queue
    again L does not go ahead of X (it rejoins at the back: its last turn there unknown)."""
    X, Y = b"x", b"y"
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)  # credit 1
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token
    req(s, H, 1, 0.0)
    req(s, L, 10, 0.001)
    req(s, X, 20, 0.002)
    order, token, now = serve(s, token, 0.0, 3, key=lambda d: (d.client, d.request_id))
    assert order == [(H, 1), (L, 10), (X, 20)]  # L's turn, then X's: both leave the ring
    now += 0.02
    assert of(s.worker_final(b"w", token, now, None), Dispatch) == []  # nothing queued
    token = of(req(s, L, 11, now + 0.01), Dispatch)[0].token  # straight to the worker
    now += 0.02
    for rid in (30, 31):
        req(s, Y, rid, now)
    req(s, X, 21, now)  # behind Y (never served here)
    now += 0.02
    d = of(s.worker_final(b"w", token, now, None), Dispatch)[0]
    token = d.token
    assert (d.client, d.request_id) == (Y, 30)
    req(s, L, 12, now + 0.001)
    d = of(s.worker_final(b"w", token, now + 0.02, None), Dispatch)[0]
    assert (d.client, d.request_id) == (X, 21), "L passed X, served before L's last request"


def test_a_flood_whose_queue_emptied_and_came_back_does_not_keep_a_light_client_behind_it():
    """The service's queue empties (the flood's requests all dispatched or expired: a
    congested worker setting its oldest aside frees credit in bunches) and the flood's next
    requests queue again into an empty ring: before, that new FIFO counted as never served,
    and a light client rejoining after it went behind it, one flood dispatch more to wait
    (12 light calls of 60 in a traced run at credit 8, 1 in 60 with the worker first in first
    out).  The flood's last turn is remembered across the empty queue, and a request sent
    straight to a free worker is a turn too, so the light client, served before, goes first."""
    s = Scheduler(Config())
    s.worker_ready(b"w", "svc", 0.0)  # credit 1
    token = of(req(s, H, 0, 0.0), Dispatch)[0].token   # straight: the queue was empty
    req(s, L, 1, 0.005)                                # queued behind the running one
    order, token, now = serve(s, token, 0.0, 1)
    assert order == [L]                                # L served at 0.02 (its FIFO empties)
    # The flood's next request goes straight to the worker when it frees up...
    now += 0.02
    assert not of(s.worker_final(b"w", token, now, None), Dispatch)  # nothing queued: idle
    token = of(req(s, H, 2, now + 0.001), Dispatch)[0].token       # straight: H served last
    # ...then both queue behind it, the flood first, into an empty ring.
    req(s, H, 3, now + 0.002)
    req(s, L, 4, now + 0.003)
    order, token, now = serve(s, token, now + 0.003, 2)
    assert order == [L, H], f"the light client waited behind the flood served after it: {order}"
