"""Turns between principals inside a group of the dynamic batcher (module docstring,
"Turns"): a flood of one principal parked at a worker does not go ahead of another's lone
request of the same class.  Driven by an injected clock, as tests/gpu_worker/test_batching.py."""
from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.batching import _LEFT_MEMO, Batcher, Pending


def _p(item, arrived, principal=None, priority=1, key="k", cost=1.0, deadline=None):
    return Pending(key=key, cost=cost, item=item, arrived=arrived, priority=priority, principal=principal,
                   deadline=deadline)


def _drain(b: Batcher, now: float = 5.0) -> list[list]:
    out = []
    while len(b):
        batch = b.take(now, idle=True, force=True)
        assert batch
        out.append([p.item for p in batch])
    return out


def _flood(b: Batcher, n: int, principal="A", t0: float = 1.0) -> float:
    t = t0
    for i in range(n):
        b.add(_p(f"{principal}{i}", t, principal), t)
        t += 0.001
    return t


def test_a_second_principals_lone_request_goes_in_the_next_batch_not_behind_a_flood():
    """The measured case (docs/security.md, "Fair sharing"): batch 4, 8 of a flood parked
    (the worker's credit), then another client's one request.  Before: 8 ran first."""
    b = Batcher(max_batch=4, max_delay=0.0)
    t = _flood(b, 8)
    b.add(_p("B0", t, "B"), t)
    assert _drain(b) == [["A0", "B0", "A1", "A2"], ["A3", "A4", "A5", "A6"], ["A7"]]


def test_turns_last_across_batches_even_of_one():
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 4)
    b.add(_p("B0", t, "B"), t)
    b.add(_p("B1", t + 0.001, "B"), t + 0.001)
    b.add(_p("C0", t + 0.002, "C"), t + 0.002)
    assert _drain(b) == [["A0"], ["B0"], ["C0"], ["A1"], ["B1"], ["A2"], ["A3"]]


def test_a_principal_served_goes_to_the_back_of_the_turns():
    """Round robin, not "oldest head first": after A and B had a turn each in a batch of 3,
    B (served less recently) goes first in the next, though A's next request is older."""
    b = Batcher(max_batch=3, max_delay=0.0)
    t = _flood(b, 4)
    for i in range(4):
        b.add(_p(f"B{i}", t, "B"), t)
        t += 0.001
    assert _drain(b) == [["A0", "B0", "A1"], ["B1", "A2", "B2"], ["A3", "B3"]]


def test_each_principals_requests_keep_their_add_order_and_newcomers_join_at_the_back():
    b = Batcher(max_batch=8, max_delay=0.0)
    b.add(_p("A0", 1.0, "A"), 1.0)
    b.add(_p("C0", 1.1, "C"), 1.1)
    b.add(_p("A1", 1.2, "A"), 1.2)
    b.add(_p("B0", 1.3, "B"), 1.3)
    b.add(_p("C1", 1.4, "C"), 1.4)
    b.add(_p("A2", 1.5, "A"), 1.5)
    assert _drain(b) == [["A0", "C0", "B0", "A1", "C1", "A2"]]


def test_one_principal_keeps_the_plain_queue():
    """The common case stays the fast path: one principal's group is a plain deque, and a
    group that had several goes back to one once a single principal is left."""
    b = Batcher(max_batch=2, max_delay=0.0)
    t = _flood(b, 4)
    assert type(b._groups["k"]) is deque
    b.add(_p("B0", t, "B"), t)
    assert type(b._groups["k"]) is not deque
    assert [p.item for p in b.take(5.0, idle=True)] == ["A0", "B0"]
    assert type(b._groups["k"]) is deque
    assert _drain(b) == [["A1", "A2"], ["A3"]]


def test_priorities_still_win_across_classes_and_turns_hold_inside_each():
    b = Batcher(max_batch=3, max_delay=0.0)
    t = 1.0
    for i in range(3):
        b.add(_p(f"An{i}", t, "A"), t)
        t += 0.001
    b.add(_p("Bn0", t, "B"), t)
    b.add(_p("Bu0", t, "B", priority=0), t)
    b.add(_p("Au0", t, "A", priority=0), t)
    b.add(_p("Au1", t, "A", priority=0), t)
    # Urgent first, in turns (A's first request came first, so A has the first turn), then
    # the normal ones in turns: B first, as A had the last turn.
    assert _drain(b, now=t) == [["Au0", "Bu0", "Au1"], ["Bn0", "An0", "An1"], ["An2"]]


def test_aging_still_beats_a_fresh_urgent_flood():
    b = Batcher(max_batch=1, max_delay=0.0)
    b.add(_p("bg", 0.0, "B", priority=2), 0.0)
    for i in range(3):
        b.add(_p(f"u{i}", 9.9, "A", priority=0), 9.9)
    assert [p.item for p in b.take(10.0, idle=True)] == ["bg"]


def test_max_cost_stops_at_the_first_request_in_turn_order_that_does_not_fit():
    b = Batcher(max_batch=8, max_cost=4.0, max_delay=0.0)
    b.add(_p("A0", 1.0, "A", cost=1.0), 1.0)
    b.add(_p("A1", 1.1, "A", cost=1.0), 1.1)
    b.add(_p("B0", 1.2, "B", cost=3.0), 1.2)
    b.add(_p("B1", 1.3, "B", cost=1.0), 1.3)
    assert _drain(b) == [["A0", "B0"], ["A1", "B1"]]


def test_drop_and_expire_in_a_shared_group():
    b = Batcher(max_batch=4, max_delay=0.0)
    b.add(_p("A0", 1.0, "A"), 1.0)
    b.add(_p("A1", 1.0, "A", deadline=1.5), 1.0)
    b.add(_p("B0", 1.0, "B"), 1.0)
    b.add(_p("C0", 1.0, "C"), 1.0)
    b.add(_p("A2", 1.0, "A"), 1.0)
    assert [p.item for p in b.drop(lambda p: p.item == "B0")] == ["B0"]
    assert [p.item for p in b.take(2.0, idle=True)] == ["A0", "C0", "A2"]
    assert [p.item for p in b.expire(2.0)] == ["A1"]
    assert len(b) == 0


def test_the_wait_bound_is_the_groups_oldest_request_whatever_its_turn():
    b = Batcher(max_batch=8, max_delay=0.002)
    for t in (0.0, 0.0005, 0.001):  # a known short gap: the batcher waits for company
        b.add(Pending(key="k", cost=1.0, item=t, arrived=t, backlog=3), t)
        b.take(t, idle=True, force=True)
        b.idle()
    b.add(Pending(key="k", cost=1.0, item="A0", arrived=0.0015, backlog=3, principal="A"), 0.0015)
    b.add(Pending(key="k", cost=1.0, item="B0", arrived=0.002, backlog=3, principal="B"), 0.002)
    assert b.wake_at(0.002) == 0.0015 + 0.002  # A0's bound (the expected fill is later)
    assert b.take(0.003, idle=True) == []
    assert [p.item for p in b.take(0.0035, idle=True)] == ["A0", "B0"]


def _take1(b: Batcher, now: float = 5.0) -> str:
    batch = b.take(now, idle=True, force=True)
    assert len(batch) == 1
    return batch[0].item


def test_a_principal_that_rejoins_goes_ahead_of_one_served_since_its_last_request():
    """Least recently served first, also for a principal whose requests ran out in between
    (a client sending one request at a time beside a flood, ``--max-batch 1``): B's next
    request goes ahead of the flood, served since B0 went; before, B rejoined at the back
    and waited for one more of the flood's requests every time."""
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 6)
    b.add(_p("B0", t, "B"), t)
    assert [_take1(b), _take1(b), _take1(b)] == ["A0", "B0", "A1"]  # A went after B0
    b.add(_p("B1", t + 0.01, "B"), t + 0.01)
    assert _take1(b) == "B1", "B rejoined behind A, served after B's last request"
    # A not served since B1: B rejoins behind A, whose turn it is.
    b.add(_p("B2", t + 0.02, "B"), t + 0.02)
    assert _drain(b) == [["A2"], ["B2"], ["A3"], ["A4"], ["A5"]]


def test_a_rejoining_principal_goes_ahead_only_of_those_served_after_it_and_a_new_one_at_the_back():
    """Three principals, two of them floods: B (one request at a time) rejoins ahead of the
    first one in the turns served after its last request, behind those served before it; a
    principal never served here (D) joins at the back, and no rejoiner passes it."""
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 6, "A")
    t = _flood(b, 6, "C", t)
    b.add(_p("B0", t, "B"), t)
    assert [_take1(b), _take1(b), _take1(b)] == ["A0", "C0", "B0"]
    assert _take1(b) == "A1"  # then C's turn; A was served after B0
    b.add(_p("B1", t, "B"), t)
    assert [_take1(b), _take1(b), _take1(b)] == ["C1", "B1", "A2"], "B behind C only (served before B0)"
    assert _take1(b) == "C2"  # turns: A, then C, both served after B1
    b.add(_p("D0", t, "D"), t)  # at the back: A, C, D
    assert [_take1(b), _take1(b)] == ["A3", "C3"]
    b.add(_p("B2", t, "B"), t)  # D, never served, is first: B does not pass it
    assert [_take1(b), _take1(b), _take1(b), _take1(b)] == ["D0", "A4", "C4", "B2"]


def test_two_principals_rejoining_keep_their_order():
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 6)
    b.add(_p("B0", t, "B"), t)
    b.add(_p("C0", t, "C"), t)
    assert [_take1(b), _take1(b), _take1(b), _take1(b)] == ["A0", "B0", "C0", "A1"]
    b.add(_p("C1", t, "C"), t)
    b.add(_p("B1", t, "B"), t)
    assert _drain(b)[:3] == [["B1"], ["C1"], ["A2"]]


def test_a_principal_that_rejoins_after_its_group_was_gone_joins_at_the_back():
    """What went unseen is not guessed at: B's last turn beside A, then A's last request,
    then B served alone (its own group), then A's new requests; B joins at the back (A, not
    served since B1, goes first), though A was served after B's last turn beside it."""
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 2)
    b.add(_p("B0", t, "B"), t)
    assert _drain(b) == [["A0"], ["B0"], ["A1"]]
    b.add(_p("B1", 2.0, "B"), 2.0)
    assert _drain(b) == [["B1"]]
    t = _flood(b, 2, t0=3.0)
    b.add(_p("B2", t, "B"), t)
    assert _drain(b) == [["A0"], ["B2"], ["A1"]]


def test_a_cancelled_request_is_not_a_turn_for_the_rejoin():
    """Beside a rejoining principal, a request dropped (cancelled, expired) from the other's
    queue is not a turn it had: B goes behind A; once A is served, ahead."""
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 6)
    b.add(_p("B0", t, "B"), t)
    assert [_take1(b), _take1(b)] == ["A0", "B0"]
    assert [p.item for p in b.drop(lambda p: p.item == "A1")] == ["A1"]
    b.add(_p("B1", t, "B"), t)
    assert [_take1(b), _take1(b)] == ["A2", "B1"]
    assert [p.item for p in b.drop(lambda p: p.item == "A3")] == ["A3"]
    assert _take1(b) == "A4"  # served since B1, after a drop
    b.add(_p("B2", t, "B"), t)
    assert _drain(b) == [["B2"], ["A5"]]


def test_a_principal_served_alone_since_it_left_does_not_pass_one_served_before_that():
    """A's last turn beside the others was before X's, but A was then served alone (its own
    group): when A comes back beside X it is not the least recently served of the two, and
    goes behind X, and behind Y (served before A's last request too).  Y's and X's own
    last turns, kept while Y's requests wait alone, put X (served before Y's last) first."""
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 3, "Y")
    b.add(_p("A0", t, "A"), t)
    b.add(_p("X0", t, "X"), t)
    assert _drain(b) == [["Y0"], ["A0"], ["X0"], ["Y1"], ["Y2"]]  # A's turn, then X's
    b.add(_p("A1", 2.0, "A"), 2.0)
    assert _drain(b) == [["A1"]]  # A alone: after X0 and Y2
    t = _flood(b, 3, "Y", 3.0)
    b.add(_p("X1", t, "X"), t)
    b.add(_p("A2", t, "A"), t)
    assert _drain(b) == [["X1"], ["Y0"], ["A2"], ["Y1"], ["Y2"]], "A passed X or Y, served before A's last request"



def test_a_flood_served_alone_after_turns_in_which_it_had_none_is_passed_by_one_served_before():
    """B's request came first, with the flood's behind it: B was served, the flood not yet
    (it had no turn in the turns).  Then the flood, alone, was served; B's next request goes
    ahead of the flood's next, as least recently served first says.  Before, the flood
    counted as never served (no turn seen), and B waited behind one more of its requests
    (the broker's turn for B, `_make_turn`, then bought nothing at the worker)."""
    b = Batcher(max_batch=1, max_delay=0.0)
    b.add(_p("B0", 1.0, "B"), 1.0)
    _flood(b, 4, "A", 1.001)
    assert [_take1(b), _take1(b)] == ["B0", "A0"]  # A0: served alone, after B0
    b.add(_p("B1", 2.0, "B"), 2.0)
    assert _drain(b) == [["B1"], ["A1"], ["A2"], ["A3"]]
    # Not served since B0 (B rejoins before any of A's turns): behind A, never served.
    b = Batcher(max_batch=1, max_delay=0.0)
    b.add(_p("B0", 1.0, "B"), 1.0)
    _flood(b, 3, "A", 1.001)
    assert _take1(b) == "B0"
    b.add(_p("B1", 2.0, "B"), 2.0)
    assert _drain(b) == [["A0"], ["B1"], ["A1"], ["A2"]]


def test_a_principal_whose_pending_request_was_cancelled_keeps_its_last_turn():
    """B (one request at a time beside a flood) rejoined ahead of A; its request is cancelled
    (or expires) before its turn: B's last turn is still B0's, and its next request goes
    ahead of A again (A was served since B0), not to the back."""
    b = Batcher(max_batch=1, max_delay=0.0)
    t = _flood(b, 6)
    b.add(_p("B0", t, "B"), t)
    assert [_take1(b), _take1(b), _take1(b)] == ["A0", "B0", "A1"]
    b.add(_p("B1", t, "B"), t)
    assert [p.item for p in b.drop(lambda p: p.item == "B1")] == ["B1"]
    b.add(_p("B2", t, "B"), t)
    assert _take1(b) == "B2", "B lost its last turn with its cancelled request: at the back, behind A"


def test_a_plain_queue_emptied_by_a_cancel_keeps_its_principals_last_turn():
    """B's queue, the group again after A left (not served since), is emptied by a cancel:
    B's last turn (B0, before A's) is not lost, and B rejoins ahead of A."""
    b = Batcher(max_batch=1, max_delay=0.0)
    b.add(_p("B0", 1.0, "B"), 1.0)
    b.add(_p("B1", 1.0, "B"), 1.0)
    b.add(_p("A0", 1.0, "A"), 1.0)
    assert [_take1(b), _take1(b)] == ["B0", "A0"]
    assert type(b._groups["k"]) is deque  # B's alone: the plain queue
    assert [p.item for p in b.drop(lambda p: p.item == "B1")] == ["B1"]
    t = _flood(b, 2, "C", 2.0)
    b.add(_p("A1", t, "A"), t)
    assert _take1(b) == "C0"  # turns: A (served at A0), C
    b.add(_p("B2", t, "B"), t)
    assert _drain(b) == [["B2"], ["A1"], ["C1"]], "B's last turn was lost with its emptied queue"


_KEYS = ("k", "j")
_WHO = ("A", "B", "C", None)
_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(_KEYS), st.sampled_from(_WHO), st.sampled_from([1, 1, 1, 0]),
              st.none() | st.sampled_from([0.001, 0.01])),
    st.tuples(st.just("burst"), st.sampled_from(_KEYS), st.sampled_from(_WHO), st.integers(1, 4)),
    st.tuples(st.just("take"), st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 4)),
    st.tuples(st.just("expire"), st.sampled_from([0.0, 0.005, 0.02])),
    st.tuples(st.just("lane"), st.sampled_from(_KEYS), st.sampled_from(_WHO)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=50), max_batch=st.integers(1, 3), lifo_after=st.sampled_from([0.1, 0.0, None]))
def test_what_the_turns_know_of_last_turns_is_never_out_of_date(ops, max_batch, lifo_after):
    """Whatever the batcher remembers of principals' last turns in a group (a ring's
    ``served``, ``_left``, a plain queue's `_Solo`: its last turn, or after everyone once
    its head was served) orders them as they were really last served in that group, alone
    or not (in the worker's lone-request lane too, `goes_alone`): a record that outlived a turn it
    did not see would let a principal pass one served before it.  Also while groups turn
    congested and back (``lifo_after`` 0: a group of two requests or more at once), one
    principal's queue then becoming turns of its own and a plain queue again."""
    b = Batcher(max_batch=max_batch, max_delay=0.0, lifo_after=lifo_after)
    now = 1.0
    n = 0
    clock = 0
    truth: dict[tuple, int] = {}  # (key, principal) -> when last served there (batch order)

    def took(batch):
        nonlocal clock
        for p in batch:
            clock += 1
            truth[(p.key, p.principal)] = clock

    for o in ops:
        now += 0.001
        if o[0] == "add":
            _, key, who, pri, ttl = o
            b.add(Pending(key=key, cost=1.0, item=n, arrived=now, priority=pri, principal=who,
                          deadline=None if ttl is None else now + ttl), now)
            n += 1
        elif o[0] == "burst":
            _, key, who, k = o
            for _ in range(k):
                b.add(Pending(key=key, cost=1.0, item=n, arrived=now, principal=who), now)
                n += 1
        elif o[0] == "take":
            took(b.take(now, idle=True, force=o[1]))
        elif o[0] == "drop":
            b.drop(lambda p, m=o[1]: p.item % 5 == m)
        elif o[0] == "lane":  # the worker's lone-request lane: served alone, never queued
            _, key, who = o
            if b.goes_alone(key, now, 0, principal=who):
                clock += 1
                truth[(key, who)] = clock
                b.idle()
        else:
            now += o[1]
            b.expire(now)
        assert len(b._left) <= _LEFT_MEMO
        for key in _KEYS:
            known = {pr: v for (k, pr), v in b._left.items() if k == key}
            group = b._groups.get(key)
            if group is not None and type(group) is not deque:
                assert not set(known) & set(group.queues), "a principal of the ring is also remembered as gone"
                known.update(group.served)
            elif group is not None:
                assert group[0].p.principal not in known, "a plain queue's principal is remembered as gone"
            s = b._solo.get(key)
            if s is not None and group is not None and type(group) is deque and s.group is group:
                if s.seq and s.seq == group[0].seq:
                    if s.served is not None:
                        known[group[0].p.principal] = s.served
                else:  # served since: after everyone remembered
                    known[group[0].p.principal] = float("inf")
            ranked = sorted(known, key=known.__getitem__)
            for p, q in zip(ranked, ranked[1:]):
                assert (key, p) in truth and truth[(key, p)] < truth[(key, q)], (
                    f"{key}: {p!r} recorded as served before {q!r}, but was served last at "
                    f"{truth.get((key, p))}, {q!r} at {truth.get((key, q))}")
