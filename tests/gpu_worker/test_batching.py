"""The dynamic batcher, driven by an injected clock (no sleeps, no threads)."""
from __future__ import annotations

import sys
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.batching import Batcher, Pending, batch_key

MS = 1e-3


def req(i, t, key="a", cost=1.0, deadline=None):
    return Pending(key=key, cost=cost, item=i, arrived=t, deadline=deadline)


def items(batch):
    return [p.item for p in batch]


def idle_worker_after_heavy_traffic(b: Batcher, key="a", gap=0.1 * MS, n=10) -> float:
    """Feed ``n`` requests ``gap`` apart, each served at once as the worker keeps up, then
    let the worker report idle with nothing pending.  Returns the clock at the end."""
    t = 0.0
    for i in range(n):
        b.add(req(f"warm{i}", t, key), t)
        assert b.take(t, idle=True)  # a busy->idle worker takes what is there
        t += gap
    assert b.take(t, idle=True) == []  # nothing pending: idle again
    return t


def test_import_does_not_need_torch():
    # torch may already be imported by other tests; the module itself must not pull it in.
    import subprocess

    code = "import sys, gpu_worker.batching; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_lone_request_under_light_traffic_is_never_delayed():
    b = Batcher(max_batch=8, max_delay=2 * MS)
    t = 0.0
    for i in range(20):
        b.add(req(i, t), t)
        assert items(b.take(t, idle=True)) == [i]  # at once, same instant
        assert b.take(t, idle=True) == []
        t += 50 * MS  # gaps far above max_delay


def test_first_request_of_a_key_goes_at_once():
    b = Batcher(max_batch=8, max_delay=10 * MS)
    b.add(req(0, 1.0), 1.0)
    assert items(b.take(1.0, idle=True)) == [0]


def test_heavy_traffic_waits_at_most_max_delay():
    b = Batcher(max_batch=8, max_delay=2 * MS)
    t = idle_worker_after_heavy_traffic(b)
    b.add(req("x", t), t)
    assert b.take(t, idle=True) == []  # more are expected within max_delay: wait
    wake = b.wake_at(t)
    assert t < wake <= t + 2 * MS
    assert b.take(wake - 1e-6, idle=True) == []
    assert items(b.take(wake, idle=True)) == ["x"]


def test_wait_is_bounded_by_max_delay_even_if_fill_is_expected_later():
    b = Batcher(max_batch=64, max_delay=1 * MS)
    t = idle_worker_after_heavy_traffic(b, gap=0.5 * MS)
    b.add(req("x", t), t)
    # Filling 63 more slots at 0.5 ms would take ~31 ms; the bound is max_delay.
    assert b.wake_at(t) == pytest.approx(t + 1 * MS)


def test_heavy_traffic_batch_goes_when_it_fills():
    b = Batcher(max_batch=4, max_delay=2 * MS)
    t = idle_worker_after_heavy_traffic(b)
    got = []
    for i in range(4):
        b.add(req(i, t), t)
        got = b.take(t, idle=True)
        if i < 3:
            assert got == []
        t += 0.05 * MS
    assert items(got) == [0, 1, 2, 3]


def test_stopped_burst_waits_only_until_the_expected_fill_time():
    b = Batcher(max_batch=8, max_delay=2 * MS)
    t = idle_worker_after_heavy_traffic(b)  # arrivals 0.1 ms apart
    b.add(req("x", t), t)
    assert b.take(t, idle=True) == []
    # 7 more were expected by t + 0.7 ms; none came, so it goes then, not at t + 2 ms.
    assert b.wake_at(t) == pytest.approx(t + 0.7 * MS)
    assert b.wake_at(t + 0.5 * MS) == b.wake_at(t)  # stable until the next arrival
    assert items(b.take(t + 0.7 * MS + 1e-9, idle=True)) == ["x"]


def test_busy_then_idle_takes_accumulated_work_at_once():
    b = Batcher(max_batch=8, max_delay=2 * MS)
    t = idle_worker_after_heavy_traffic(b)
    b.add(req(0, t), t)
    assert b.take(t, idle=True) == []  # idle, heavy traffic: waiting
    batch = b.take(t + 2 * MS, idle=True)
    assert items(batch) == [0]  # worker now busy with it
    t += 2 * MS
    for i in range(1, 4):
        t += 0.1 * MS
        b.add(req(i, t), t)
        assert b.take(t, idle=False) == []  # busy and not full: nothing
    assert b.wake_at(t) == t
    assert items(b.take(t, idle=True)) == [1, 2, 3]  # idle again: no extra wait


def test_force_skips_the_wait_but_not_the_limits():
    b = Batcher(max_batch=2, max_delay=2 * MS)
    t = idle_worker_after_heavy_traffic(b)
    for i in range(3):
        b.add(req(i, t), t)
    b.add(req("late", t, deadline=t), t + 1e-9)
    assert items(b.take(t, idle=True, force=True)) == [0, 1]
    assert items(b.take(t, idle=True, force=True)) == [2]
    assert b.take(t, idle=True, force=True) == []
    assert items(b.expire(t)) == ["late"]


def test_busy_worker_gets_a_full_batch():
    b = Batcher(max_batch=2, max_delay=2 * MS)
    b.add(req(0, 0.0), 0.0)
    b.add(req(1, 0.0), 0.0)
    b.add(req(2, 0.0), 0.0)
    assert items(b.take(0.0, idle=False)) == [0, 1]
    assert b.take(0.0, idle=False) == []
    assert items(b.take(0.0, idle=True)) == [2]


def test_max_batch_respected():
    b = Batcher(max_batch=3, max_delay=0.0)
    for i in range(10):
        b.add(req(i, 0.0), 0.0)
    sizes = []
    while len(b):
        sizes.append(len(b.take(0.0, idle=True)))
    assert sizes == [3, 3, 3, 1]


def test_max_cost_respected_and_oversized_request_runs_alone():
    b = Batcher(max_batch=8, max_cost=10.0, max_delay=0.0)
    for i, c in enumerate([4, 4, 4, 25, 3, 3]):
        b.add(req(i, 0.0, cost=c), 0.0)
    batches = []
    while len(b):
        batches.append(items(b.take(0.0, idle=True)))
    assert batches == [[0, 1], [2], [3], [4, 5]]


def test_incompatible_keys_never_mixed_and_groups_served_fifo():
    b = Batcher(max_batch=8, max_delay=0.0)
    order = [("a", 0.0), ("b", 0.1), ("a", 0.2), ("c", 0.3), ("b", 0.4), ("a", 0.5)]
    for i, (k, t) in enumerate(order):
        b.add(req(i, t, key=k), t)
    batches = []
    while len(b):
        batch = b.take(1.0, idle=True)
        assert len({p.key for p in batch}) == 1
        batches.append((batch[0].key, items(batch)))
    assert batches == [("a", [0, 2, 5]), ("b", [1, 4]), ("c", [3])]


def test_oldest_group_goes_first_even_if_another_is_fuller():
    b = Batcher(max_batch=4, max_delay=0.0)
    b.add(req("old", 0.0, key="x"), 0.0)
    for i in range(3):
        b.add(req(i, 0.1, key="y"), 0.1)
    assert items(b.take(0.2, idle=True)) == ["old"]


def test_expired_requests_are_not_batched_and_are_returned_by_expire():
    # (In add order: congestion, a second of waiting, would take "none" first; see
    # test_batching_congested.py.)
    b = Batcher(max_batch=8, max_delay=0.0, lifo_after=None)
    b.add(req("late", 0.0, deadline=0.5), 0.0)
    b.add(req("ok", 0.0, deadline=5.0), 0.0)
    b.add(req("none", 0.0), 0.0)
    b.add(req("dead-on-arrival", 0.0, deadline=0.9), 1.0)
    assert items(b.take(1.0, idle=True)) == ["ok", "none"]
    assert len(b) == 2
    assert sorted(items(b.expire(1.0))) == ["dead-on-arrival", "late"]
    assert len(b) == 0 and b.expire(2.0) == []


def test_wait_never_reaches_a_deadline_margin():
    # The wait for company ends at 0.7 ms (the expected fill); a deadline 1.5 ms away
    # leaves room after it.
    b = Batcher(max_batch=8, max_delay=2 * MS, deadline_margin=0.3 * MS)
    t = idle_worker_after_heavy_traffic(b)
    b.add(req("x", t, deadline=t + 1.5 * MS), t)
    wake = b.wake_at(t)
    assert wake == pytest.approx(t + 0.7 * MS)
    assert b.take(t + 0.6 * MS, idle=True) == []
    assert items(b.take(wake, idle=True)) == ["x"]
    # One 1 ms away would have only the margin left when the wait ends (it could no longer
    # finish in time: batching.py "Deadlines"): no wait.
    b = Batcher(max_batch=8, max_delay=2 * MS, deadline_margin=0.3 * MS)
    t = idle_worker_after_heavy_traffic(b)
    b.add(req("y", t, deadline=t + 1 * MS), t)
    assert b.wake_at(t) == t
    assert items(b.take(t, idle=True)) == ["y"]


def test_wake_at_reports_deadlines_for_expiry():
    b = Batcher(max_batch=2, max_delay=0.0)
    assert b.wake_at(0.0) is None
    b.add(req(0, 0.0, key="a"), 0.0)
    b.add(req(1, 0.0, key="b", deadline=3.0), 0.0)
    assert b.wake_at(0.0) == 0.0  # "a" can go now
    assert items(b.take(0.0, idle=True)) == [0]
    b.add(req(2, 0.0, key="b"), 0.0)
    b.add(req(3, 0.0, key="b"), 0.0)
    assert items(b.take(0.0, idle=True)) == [1, 2]
    b.add(req(4, 10.0, key="c", deadline=12.0), 10.0)
    b.add(req(5, 10.0, key="d", deadline=11.0), 10.0)
    b.drop(lambda p: p.item in (3, 4))
    assert b.wake_at(10.0) == 10.0
    assert items(b.take(10.0, idle=True)) == [5]
    assert b.wake_at(10.0) is None


def test_drop_removes_pending_and_expired():
    b = Batcher(max_batch=8, max_delay=0.0)
    for i in range(6):
        b.add(req(i, 0.0, key=i % 2, deadline=1.0 if i == 4 else None), 0.0)
    assert b.take(0.0, idle=False) == []
    dropped = b.drop(lambda p: p.item in (1, 2))
    assert sorted(items(dropped)) == [1, 2]
    assert items(b.take(2.0, idle=True)) == [0]  # 4 expired, set aside
    assert items(b.drop(lambda p: p.item == 4)) == [4]
    assert items(b.take(2.0, idle=True)) == [3, 5]
    assert len(b) == 0


def test_batch_key_groups_by_names_dtypes_shapes():
    np = pytest.importorskip("numpy")
    a = {"x": np.zeros((2, 3), np.float32), "y": np.zeros(4, np.uint8)}
    b = {"y": np.ones(4, np.uint8), "x": np.ones((2, 3), np.float32)}
    assert batch_key(a) == batch_key(b)
    assert batch_key(a) != batch_key({**a, "x": np.zeros((2, 3), np.float64)})
    assert batch_key(a) != batch_key({**a, "x": np.zeros((3, 2), np.float32)})
    assert batch_key(a) != batch_key({"x": a["x"]})


def test_bad_parameters_rejected():
    for kwargs in ({"max_batch": 0}, {"max_batch": 1.5}, {"max_cost": 0}, {"max_delay": -1},
                   {"max_delay": float("inf")}):
        with pytest.raises(ValueError):
            Batcher(**kwargs)


# ------------------------------------------------------------------------------ property

op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from("abc"), st.floats(0.0, 5.0), st.none() | st.floats(0.0, 0.01),
              st.floats(0.0, 0.003), st.sampled_from([None, "P", "Q"]), st.sampled_from([1, 1, 1, 0, 2]),
              st.sampled_from([False, False, False, True])),
    # a principal's flood: several requests at once (normal; no deadline, or one for all)
    st.tuples(st.just("burst"), st.sampled_from("ab"), st.sampled_from([None, "P", "Q"]), st.integers(1, 6),
              st.none() | st.sampled_from([0.005, 0.05])),
    st.tuples(st.just("take"), st.booleans(), st.floats(0.0, 0.003)),
    st.tuples(st.just("drop"), st.integers(0, 6)),
    st.tuples(st.just("expire"), st.floats(0.0, 0.003)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=60), max_batch=st.integers(1, 5), max_cost=st.sampled_from([3.0, 6.0, float("inf")]),
       max_delay=st.sampled_from([0.0, 0.001, 0.002]), lifo_after=st.sampled_from([None, 0.0, 0.0, 0.004, 0.1]))
def test_every_request_is_returned_exactly_once(ops, max_batch, max_cost, max_delay, lifo_after):
    """Also with several principals and classes, congested or not: each principal's requests
    of one class and key come out of `take` in add order, or, while their group is
    congested (it held more than a batch takes for ``lifo_after``) and the principal's oldest
    of them has a deadline and is not ``in_order``, newest first; and within a class of a
    batch no principal has a second request while another principal's request of that
    class and key waits (turns)."""
    b = Batcher(max_batch=max_batch, max_cost=max_cost, max_delay=max_delay, deadline_margin=0.0005,
                lifo_after=lifo_after)
    now = 0.0
    added: dict[int, Pending] = {}
    returned: list[int] = []

    def check_batch(batch, t):
        if not batch:
            return
        assert len(batch) <= max_batch
        assert len({p.key for p in batch}) == 1
        assert len(batch) == 1 or sum(p.cost for p in batch) <= max_cost
        assert all(p.deadline is None or p.deadline > t for p in batch)
        done = set(returned)
        # What was pending for this batch: not set aside as hopeless, with less than the
        # margin left of a budget that had room for it (the batcher's `_late`; a 3.12 run
        # found one counted), nor past its deadline.
        waiting = {i: p for i, p in added.items() if i not in done and p.key == batch[0].key
                   and (p.deadline is None or p.deadline > t and (
                       p.deadline - b.deadline_margin > t or p.deadline - p.arrived < b.deadline_margin))}
        waiting.update((p.item, p) for p in batch)  # (one alone may run late: nothing competes)
        # Newest first only where the group held more than a batch takes (all not returned
        # yet, a bound on what the batcher counts), for lifo_after since an add or a look
        # saw it first (when exactly, test_batching_congested.py checks).
        held = sum(1 for i, p in added.items() if i not in done and p.key == batch[0].key)
        congested = lifo_after is not None and held > max_batch
        for who in {(p.principal, p.priority) for p in batch}:
            mine = [p.item for p in batch if (p.principal, p.priority) == who]
            pend = sorted(i for i, p in waiting.items() if (p.principal, p.priority) == who)
            head = waiting[pend[0]]
            lifo = congested and head.deadline is not None and not head.in_order
            assert mine == pend[:len(mine)] or lifo and mine == sorted(pend, reverse=True)[:len(mine)], (
                who, "in order or newest first" if lifo else "in order", mine, pend)
        for c in {p.priority for p in batch}:
            mine = [p.principal for p in batch if p.priority == c]
            waiting_c = {p.principal for i, p in waiting.items() if p.priority == c and i not in
                         {q.item for q in batch}}
            if waiting_c - set(mine):
                assert len(mine) == len(set(mine)), (c, mine, waiting_c)
        returned.extend(p.item for p in batch)

    for o in ops:
        if o[0] == "add":
            _, key, cost, ttl, dt, principal, priority, in_order = o
            now += dt
            i = len(added)
            added[i] = Pending(key=key, cost=cost, item=i, arrived=now, deadline=None if ttl is None else now + ttl,
                               principal=principal, priority=priority, in_order=in_order)
            b.add(added[i], now)
        elif o[0] == "burst":
            _, key, principal, n, ttl = o
            for _ in range(n):
                i = len(added)
                added[i] = Pending(key=key, cost=1.0, item=i, arrived=now, principal=principal,
                                   deadline=None if ttl is None else now + ttl)
                b.add(added[i], now)
        elif o[0] == "take":
            _, idle, dt = o
            now += dt
            batch = b.take(now, idle=idle)
            check_batch(batch, now)
            if idle and not batch and len(b):
                # Waiting never stretches past the oldest pending request's max_delay.
                done = set(returned)
                oldest = min(p.arrived for i, p in added.items() if i not in done)
                assert now <= b.wake_at(now) <= max(now, oldest + max_delay)
        elif o[0] == "drop":
            returned.extend(items(b.drop(lambda p, m=o[1]: p.item % 7 == m)))
        else:
            now += o[1]
            gone = b.expire(now)
            # Past its deadline, or with less than the margin left (it cannot finish in time).
            assert all(p.deadline is not None and p.deadline - b.deadline_margin <= now for p in gone)
            returned.extend(p.item for p in gone)
        w = b.wake_at(now)
        assert w is None or w >= now
        # The turns' bookkeeping follows the groups: each ring holds its queues' principals,
        # a last turn only for those, and a plain queue's `_Solo` is that very queue's.
        for key, group in b._groups.items():
            if type(group) is not deque:
                assert len(group.ring) == len(group.queues) == len(set(group.ring)) and set(group.ring) == set(group.queues)
                assert set(group.served) <= set(group.queues)
        for key, solo in b._solo.items():
            assert b._groups.get(key) is solo.group and solo.group
        assert len(b) == len(added) - len(returned)

    # Drain: an idle worker that sleeps until wake_at always makes progress.
    for _ in range(10 * len(added) + 10):
        if not len(b):
            break
        w = b.wake_at(now)
        assert w is not None
        now = max(now, w)
        check_batch(b.take(now, idle=True), now)
        returned.extend(items(b.expire(now)))
    assert len(b) == 0
    assert sorted(returned) == sorted(added)


def test_closed_loop_client_stops_paying_for_waits():
    """A client that sends its next request only after the reply has short inter-arrival
    gaps but never sends during a wait.  The first waits gain nothing; after that a lone
    request goes at once, with a probing wait every `probe_every` batches."""
    b = Batcher(max_batch=8, max_delay=0.002)
    now = 0.0
    delays = []
    for i in range(200):
        b.add(Pending(key="k", cost=1.0, item=i, arrived=now), now)
        got = b.take(now, idle=True)
        start = now
        while not got:
            now = b.wake_at(now)
            got = b.take(now, idle=True)
        assert [p.item for p in got] == [i]
        assert b.take(now, idle=True) == []  # the worker's loop asks again: nothing left, idle
        delays.append(now - start)
        now += 0.0005  # the reply's trip back and the client's next send
    waited = [d for d in delays[20:] if d > 0]
    # Early requests wait (gaps look short); later only the periodic probe does.
    assert any(d > 0 for d in delays[:10])
    assert len(waited) <= len(delays[20:]) // Batcher.probe_every + 1


def test_waits_that_gather_company_keep_happening():
    b = Batcher(max_batch=4, max_delay=0.002)
    now = 0.0
    sizes = []
    for _ in range(50):
        # Four concurrent clients: their requests land 0.1 ms apart.
        for j in range(4):
            b.add(Pending(key="k", cost=1.0, item=j, arrived=now), now)
            got = b.take(now, idle=True)
            if got:
                break
            now += 0.0001
        while not got:
            now = b.wake_at(now)
            got = b.take(now, idle=True)
        sizes.append(len(got))
        assert b.take(now, idle=True) == []
        now += 0.001
    assert sum(s == 4 for s in sizes[10:]) >= 35


def _closed_loop(b: Batcher, backlog, n: int = 200) -> list[float]:
    """A closed-loop client (next request 0.5 ms after each reply); each request's wait."""
    now = 0.0
    delays = []
    for i in range(n):
        b.add(Pending(key="k", cost=1.0, item=i, arrived=now, backlog=backlog), now)
        got = b.take(now, idle=True)
        start = now
        while not got:
            now = b.wake_at(now)
            got = b.take(now, idle=True)
        assert [p.item for p in got] == [i]
        assert b.take(now, idle=True) == []
        delays.append(now - start)
        now += 0.0005
    return delays


def test_latency_first_a_lone_client_never_waits_not_even_to_probe():
    """The broker says it had nothing of the service queued (backlog 0): no request of a
    lone sequential client waits, from the first to the last: no probing wait either."""
    assert _closed_loop(Batcher(max_batch=8, max_delay=0.002), backlog=0) == [0.0] * 200
    # The same client through a broker that says nothing (a plain MDP broker), or with
    # latency_first off: the waiting rules on arrival rates alone (early waits, probes).
    for b, backlog in ((Batcher(max_batch=8, max_delay=0.002), None),
                       (Batcher(max_batch=8, max_delay=0.002, latency_first=False), 0)):
        assert any(d > 0 for d in _closed_loop(b, backlog))


def test_latency_first_a_broker_backlog_brings_waiting_back():
    """Requests dispatched while the broker still held more of the service wait for them
    as before (bounded by max_delay), and a full batch still goes at once."""
    b = Batcher(max_batch=4, max_delay=0.002)
    t = idle_worker_after_heavy_traffic(b)  # short gaps: waiting looks worth it
    b.add(Pending(key="a", cost=1.0, item="x", arrived=t, backlog=3), t)
    assert b.take(t, idle=True) == []
    assert t < b.wake_at(t) <= t + 0.002 + 1e-12
    for i in range(3):
        b.add(Pending(key="a", cost=1.0, item=i, arrived=t, backlog=3 - i - 1), t)
    assert items(b.take(t, idle=True)) == ["x", 0, 1, 2]


def test_latency_first_batches_still_form_under_load():
    """Requests that arrive while a batch runs go together when it ends, backlog or not."""
    b = Batcher(max_batch=8, max_delay=0.002)
    b.add(Pending(key="a", cost=1.0, item=0, arrived=0.0, backlog=0), 0.0)
    assert items(b.take(0.0, idle=True)) == [0]          # runs alone
    for i in range(1, 6):                                 # arrive while it runs
        b.add(Pending(key="a", cost=1.0, item=i, arrived=0.0001 * i, backlog=0), 0.0001 * i)
        assert b.take(0.0001 * i, idle=False) == []
    assert items(b.take(0.001, idle=True)) == [1, 2, 3, 4, 5]


def test_idle_with_nothing_pending_is_an_empty_take():
    """`idle()` (what the worker calls instead of an empty take once its batches ran) makes
    the next arrival wait for company again; a busy batcher would send it at once."""
    b = Batcher(max_batch=8, max_delay=2 * MS)
    t = idle_worker_after_heavy_traffic(b)
    b.add(req("y", t), t)
    assert b.take(t + 2 * MS, idle=True)  # busy with it now
    t += 2 * MS
    b.idle()
    t += 0.1 * MS
    b.add(req("x", t), t)
    assert b.take(t, idle=True) == []  # waits for company, as after an empty take
    b.add(req("z", t), t)
    b.idle()  # something pending: idle() changes nothing
    assert b.wake_at(t) > t


def test_the_worker_leaves_the_batcher_waiting_for_company_after_a_batch():
    """After the worker ran its batches, the batcher must not stay busy (it would send every
    later arrival alone, batching off for good)."""
    from gpu_worker.worker import Worker, WorkerConfig

    w = Worker(WorkerConfig(broker="ipc:///nonexistent", model="echo", max_batch=8, batching="throughput"),
               upstream=_NoLink())
    try:
        t = idle_worker_after_heavy_traffic(w.batcher)
        w.batcher.add(req("first", t), t)
        assert w.batcher.take(t + 2 * MS, idle=True)  # a batch handed out: busy
        w.run_ready_batches()  # nothing pending now: the worker is idle again
        t += 2.1 * MS
        w.batcher.add(req("x", t), t)
        assert w.batcher.take(t, idle=True) == []  # waits for company
    finally:
        w.close()


class _NoLink:
    """An upstream that is never used (the test drives the worker's batcher directly)."""

    monitor = None
    watch_liveness = False
    last_sent = 0.0

    def __init__(self):
        self.sock = None

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ priorities


def _p(item, arrived, priority=1, key="k"):
    return Pending(key=key, cost=1.0, item=item, arrived=arrived, priority=priority)


def test_an_urgent_request_goes_ahead_of_normal_ones_waiting_in_its_group():
    b = Batcher(max_batch=2, max_delay=0.0)
    for p in (_p("a", 1.0), _p("b", 1.1), _p("u", 1.2, priority=0), _p("bg", 1.25, priority=2),
              _p("u2", 1.3, priority=0)):
        b.add(p, 1.3)
    order = []
    while len(b):
        order.append([p.item for p in b.take(2.0, idle=True, force=True)])
    assert order == [["u", "u2"], ["a", "b"], ["bg"]]


def test_the_group_with_the_most_urgent_request_goes_first_then_the_oldest():
    b = Batcher(max_batch=8, max_delay=0.0)
    b.add(_p("old-normal", 1.0, key="x"), 1.0)
    b.add(_p("new-urgent", 1.5, priority=0, key="y"), 1.5)
    b.add(_p("older-bg", 0.5, priority=2, key="z"), 1.5)
    assert [p.item for p in b.take(2.0, idle=True, force=True)] == ["new-urgent"]
    assert [p.item for p in b.take(2.0, idle=True, force=True)] == ["old-normal"]
    assert [p.item for p in b.take(2.0, idle=True, force=True)] == ["older-bg"]


def test_the_wait_bound_is_the_oldest_requests_even_behind_an_urgent_head():
    b = Batcher(max_batch=8, max_delay=0.01)
    for t in (0.0, 0.001, 0.002):  # a known short gap: the batcher waits for company
        b.add(_p(t, t), t)
        b.take(t, idle=True, force=True)
        b.idle()
    b.add(_p("normal", 1.0), 1.0)
    b.add(_p("urgent", 1.004, priority=0), 1.004)
    assert b.wake_at(1.004) <= 1.0 + 0.01  # bounded by the normal one's arrival, not the urgent's


def test_a_request_that_waited_long_enough_beats_a_fresh_urgent_one():
    """Aging, as the broker's queues have it: no class starves another."""
    b = Batcher(max_batch=1, max_delay=0.0)
    b.add(_p("background", 0.0, priority=2), 0.0)
    b.add(_p("urgent", 9.9, priority=0), 9.9)
    assert [p.item for p in b.take(10.0, idle=True)] == ["background"]  # 0.5 x 21 > 3 x 1.2
    assert [p.item for p in b.take(10.0, idle=True)] == ["urgent"]


def test_one_class_pending_keeps_add_order_exactly():
    b = Batcher(max_batch=2, max_delay=0.0)
    for i, t in enumerate((1.0, 1.1, 1.2)):
        b.add(_p(i, t, priority=2), t)
    assert [p.item for p in b.take(5.0, idle=True)] == [0, 1]
    assert [p.item for p in b.take(5.0, idle=True)] == [2]


def test_with_priorities_mixed_the_wait_bound_is_the_oldest_pending_requests_of_any_group():
    b = Batcher(max_batch=8, max_delay=0.002)
    for key in ("x", "y"):  # both keys: a known short gap, so each would wait for company
        for t in (0.0, 0.0005, 0.001):
            b.add(Pending(key=key, cost=1.0, item=t, arrived=t, backlog=3), t)
            b.take(t, idle=True, force=True)
            b.idle()
    b.add(Pending(key="x", cost=1.0, item="normal", arrived=1.0, backlog=3), 1.0)
    b.add(Pending(key="y", cost=1.0, item="urgent", arrived=1.0003, backlog=3, priority=0), 1.0003)
    assert b.wake_at(1.0003) <= 1.002 + 1e-9  # the normal one's bound, not the urgent's 1.0023
    assert [p.item for p in b.take(1.002, idle=True)] == ["urgent"]
    assert [p.item for p in b.take(1.002, idle=True)] == ["normal"]
