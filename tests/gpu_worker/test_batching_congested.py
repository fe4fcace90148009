"""Congestion in the worker's batcher: a group that holds more requests than one batch takes,
and lost one to its deadline within ``lifo_after``, takes each principal's requests newest
first, as the broker's congested queue does (gpu_worker/batching.py, "Congestion");
injected clock, no sleeps."""
from __future__ import annotations

from collections import deque

import pytest

from gpu_worker.batching import Batcher, Pending


def _p(item, arrived, principal="A", deadline=10.0, priority=1, in_order=False, key="k"):
    return Pending(key=key, cost=1.0, item=item, arrived=arrived, deadline=deadline, priority=priority,
                   principal=principal, in_order=in_order)


def _take(b: Batcher, now: float) -> list:
    return [p.item for p in b.take(now, idle=True, force=True)]


def _parked(b: Batcher, n: int, t: float = 0.0, principal="A", **kw) -> None:
    """A credit's worth parked behind a running batch: ``n`` requests, one per ms."""
    for i in range(n):
        b.add(_p(f"{principal}{i}", t + i * 1e-3, principal, **kw), t + i * 1e-3)


def _lost(b: Batcher, t: float, key="k") -> None:
    """A request of the group lost to its deadline at ``t`` (set aside, answered 504)."""
    b.add(_p("lost", t - 0.01, "L", deadline=t, key=key), t - 0.01)
    assert [p.item for p in b.expire(t)] == ["lost"]


def test_a_congested_group_takes_the_newest_first():
    """A backlog that lost a request to its deadline: the newest go first (they have the
    most time left), the oldest wait on for their deadlines; new arrivals go first too."""
    b = Batcher(max_batch=2, max_delay=0.0)
    _parked(b, 5)
    _lost(b, 0.15)
    assert _take(b, 0.2) == ["A4", "A3"], "a backlog that lost a request was not served newest first"
    b.add(_p("A5", 0.2), 0.2)
    assert _take(b, 0.21) == ["A5", "A2"]
    assert _take(b, 0.22) == ["A0", "A1"]  # one batch's worth left: no backlog, add order
    assert len(b) == 0


def test_a_backlog_that_loses_nothing_stays_first_in_first_out_and_pays_nothing():
    """However long a backlog waits (a model slower than ``lifo_after``), it keeps add
    order while no request of it is lost: reordering would gain nothing (and bring a
    stream's frames back later)."""
    b = Batcher(max_batch=2, max_delay=0.0)
    _parked(b, 5)
    assert _take(b, 5.0) == ["A0", "A1"]
    assert type(b._groups["k"]) is deque, "an uncongested queue left the plain queue"
    _lost(b, 5.0, key="other")  # another group's loss is not this one's
    assert _take(b, 5.01) == ["A2", "A3"]
    # Lost longer ago than lifo_after: add order again.
    _parked(b, 3, t=6.0)
    _lost(b, 6.0)
    assert _take(b, 6.2) == ["A4", "A0"]
    # A lone request: nothing to order, and nothing looked at.
    lone = Batcher(max_batch=1, max_delay=0.0)
    lone.add(_p("x", 0.0), 0.0)
    assert lone._deep is False
    assert _take(lone, 5.0) == ["x"] and lone._deep is False


def test_one_batchs_worth_is_no_backlog():
    b = Batcher(max_batch=2, max_delay=0.0)
    _parked(b, 2)
    _lost(b, 0.1)
    assert _take(b, 0.1) == ["A0", "A1"]


def test_never_with_lifo_after_none():
    b = Batcher(max_batch=2, max_delay=0.0, lifo_after=None)
    _parked(b, 3)
    _lost(b, 0.1)
    assert _take(b, 0.1) == ["A0", "A1"]
    assert not b._shed_at
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            Batcher(lifo_after=bad)


def test_an_oldest_without_deadline_or_in_order_keeps_its_principal_in_order():
    """As at the broker: a principal whose oldest request has no deadline (nothing else
    would take it out) or must go first (``in_order``: given back once, or a stream's frame)
    is served in order; the others of the group newest first."""
    b = Batcher(max_batch=1, max_delay=0.0)
    b.add(_p("A0", 0.0, deadline=None), 0.0)
    b.add(_p("A1", 0.0), 0.0)
    b.add(_p("A2", 0.0), 0.0)
    b.add(_p("B0", 0.0, "B", in_order=True), 0.0)
    b.add(_p("B1", 0.0, "B"), 0.0)
    b.add(_p("C0", 0.0, "C"), 0.0)
    b.add(_p("C1", 0.0, "C"), 0.0)
    _lost(b, 0.5)
    order = [_take(b, 0.5)[0] for _ in range(3)]
    assert order == ["A0", "B0", "C1"], order
    # A's and B's heads went: their remaining ones newest first now.
    assert [_take(b, 0.5)[0] for _ in range(3)] == ["A2", "B1", "C0"]
    assert _take(b, 0.5) == ["A1"]


def test_turns_between_principals_hold_while_congested():
    """A flood parked beside another principal's requests: still one of each in turn."""
    b = Batcher(max_batch=1, max_delay=0.0)
    _parked(b, 4, principal="A")
    _parked(b, 2, t=0.01, principal="B")
    _lost(b, 0.3)
    assert [_take(b, 0.3)[0] for _ in range(5)] == ["A3", "B1", "A2", "B0", "A1"]
    assert _take(b, 0.3) == ["A0"]


def test_priorities_and_aging_hold_while_congested():
    """Several classes: the urgent go first still; inside a class, newest first."""
    b = Batcher(max_batch=3, max_delay=0.0)
    b.add(_p("n0", 0.0), 0.0)
    b.add(_p("n1", 0.001), 0.001)
    b.add(_p("u0", 0.002, priority=0), 0.002)
    b.add(_p("u1", 0.003, priority=0), 0.003)
    b.add(_p("n2", 0.004), 0.004)
    _lost(b, 0.2)
    assert _take(b, 0.2) == ["u1", "u0", "n2"]
    assert _take(b, 0.2) == ["n0", "n1"]  # one batch's worth left: add order


def test_the_deadline_margin_still_sets_aside_what_cannot_finish_and_that_is_a_loss():
    """Newest first, the oldest waits on: once it has less than the margin left while others
    compete it is set aside (answered at once), never run late.  Such a set-aside is a loss
    too: it turns the group newest first."""
    b = Batcher(max_batch=1, max_delay=0.0, deadline_margin=0.02)
    b.add(_p("old", 0.0, deadline=0.25), 0.0)
    b.add(_p("mid", 0.01, deadline=0.5), 0.01)
    b.add(_p("new", 0.02, deadline=0.5), 0.02)
    b.add(_p("newer", 0.03, deadline=0.5), 0.03)
    assert _take(b, 0.2) == ["old"]  # nothing lost yet: add order
    b.add(_p("doomed", 0.19, deadline=0.22), 0.19)  # (a budget of 30 ms: room for a batch)
    assert [p.item for p in b.expire(0.2)] == ["doomed"]  # less than the margin left: set aside
    assert _take(b, 0.21) == ["newer"], "a set-aside for the margin did not count as a loss"
    assert _take(b, 0.22) == ["new"]
    assert _take(b, 0.23) == ["mid"]


def test_a_loss_the_worker_is_told_of_counts_too():
    """The broker's cancel for a deadline can come before the batcher's own set-aside (a
    margin of 0): the worker drops the request and says it was lost (`Batcher.lost`)."""
    b = Batcher(max_batch=1, max_delay=0.0)
    _parked(b, 3)
    b.drop(lambda p: p.item == "A0")
    b.lost("k", 0.1)
    assert _take(b, 0.15) == ["A2"]


def test_congestion_ends_once_the_backlog_is_worked_off():
    """Once a look finds the group at one batch or less, it is in add order again, its plain
    queue once more."""
    b = Batcher(max_batch=1, max_delay=0.0)
    _parked(b, 3)
    _lost(b, 0.15)
    assert _take(b, 0.15) == ["A2"]
    assert type(b._groups["k"]) is not deque  # newest first: the turns' walk
    assert [p.item for p in b.drop(lambda p: p.item == "A0")] == ["A0"]  # (cancelled)
    assert _take(b, 0.16) == ["A1"]  # the last one: a batch takes it whole
    b.add(_p("A3", 0.17), 0.17)
    assert _take(b, 0.17) == ["A3"] and type(b._groups.get("k", deque())) is deque
    _parked(b, 3, t=0.3)  # a new backlog, nothing lost since 0.15
    assert _take(b, 0.31) == ["A0"], "a backlog with no loss within lifo_after was newest first"


def test_wake_at_and_take_agree_on_the_congested_order():
    """`wake_at` looks at the same order `take` serves: a congested group's next batch is
    the newest requests'."""
    b = Batcher(max_batch=2, max_delay=0.05)
    for i in range(5):
        b.add(Pending(key="k", cost=1.0, item=i, arrived=i * 1e-3, deadline=10.0, backlog=5), i * 1e-3)
    assert [p.item for p in b.take(0.0041, idle=True, force=True)] == [0, 1]  # 3 left: over a batch still
    _lost(b, 0.19)
    b.add(Pending(key="k", cost=1.0, item=5, arrived=0.2, deadline=10.0, backlog=5), 0.2)
    assert b.wake_at(0.2) == 0.2  # full: goes at once
    assert [p.item for p in b.take(0.2, idle=True)] == [5, 4]


def test_what_the_batcher_keeps_of_losses_is_bounded():
    b = Batcher(max_batch=1, max_delay=0.0)
    for i in range(200):
        _lost(b, 1.0 + i, key=i)
    assert len(b._shed_at) <= 65


def test_the_workers_lifo_after_ms_flag():
    """``--lifo-after-ms``, as the broker's: ms, negative for never; what the worker cannot
    run with is a `ConfigError` naming the flag."""
    from gpu_worker.__main__ import build_parser, model_config
    from gpu_worker.worker import ConfigError, WorkerConfig

    ap = build_parser()
    base = ["--broker", "ipc:///x"]
    assert model_config(ap.parse_args(base))["lifo_after"] == 0.1
    assert model_config(ap.parse_args(base + ["--lifo-after-ms", "-1"]))["lifo_after"] is None
    assert model_config(ap.parse_args(base + ["--lifo-after-ms", "0"]))["lifo_after"] == 0.0
    with pytest.raises(ConfigError, match=r"lifo_after \(--lifo-after-ms\) must be a number of ms from 0"):
        WorkerConfig(broker="ipc:///x", lifo_after=float("inf")).check()
    WorkerConfig(broker="ipc:///x", lifo_after=None).check()


def test_a_flood_whose_oldest_are_set_aside_before_lifo_after_is_congested():
    """The flood of the benchmark (BENCHMARKS.md, "Newest first at the worker"): a 20 ms
    model, batches of one, 100 ms deadlines, five parked.  The worker sets each oldest aside
    at 80 ms (the margin), before it has waited ``lifo_after``: read off the oldest's wait,
    the group was never congested and ran its oldest, nearly out of time, first in first
    out.  A backlog held for ``lifo_after``, it runs the newest."""
    b = Batcher(max_batch=1, max_delay=0.0, deadline_margin=0.02)
    n = 0

    def arrive(t):
        nonlocal n
        b.add(_p(n, t, deadline=t + 0.1), t)
        n += 1

    for i in range(5):
        arrive(i * 0.004)
    ran = []
    for step in range(1, 16):
        t = step * 0.02
        b.expire(t)
        ran.append((t, n - 1, _take(b, t)[0]))
        arrive(t)
    late = [(t, newest, got) for t, newest, got in ran if t > 0.12 and got != newest]
    assert not late, f"(time, newest, what ran) while the backlog was held for lifo_after: {late}"
