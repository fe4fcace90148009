"""Under overload a request can reach the worker with less time left than any batch takes:
run, it finishes after its caller gave up, and takes a batch's place from requests that
could still make their deadlines (gpu_worker/batching.py, "Deadlines").  The batcher's rule
first (pure), then the worker's use of it in process: the margin comes from the batches it
measured, and a request that cannot finish in time is answered DEADLINE_EXCEEDED without
running while others wait."""
from __future__ import annotations

import time

import numpy as np
import pytest

from broker import protocol as P
from gpu_worker.batching import Batcher, Pending
from gpu_worker.compute import ComputeTimes
from gpu_worker.worker import Worker, WorkerConfig
from tests.gpu_worker.pair_link import PairLink

pytestmark = pytest.mark.timeout(30)

KEY = (("x", "<f8", (1,)),)


def _p(item, deadline, backlog=None, arrived=0.0, since=-1.0):
    # `since`: it queued a second at the broker first (its budget had room for a batch)
    return Pending(key=KEY, cost=1.0, item=item, arrived=arrived, deadline=deadline, backlog=backlog, since=since)


def test_a_request_that_cannot_finish_in_time_is_set_aside_while_others_wait():
    b = Batcher(max_batch=4, deadline_margin=0.05)
    for p in (_p("short", 0.03), _p("long", 1.0), _p("edge", 0.05), _p("none", None)):
        b.add(p, 0.0)
    assert [p.item for p in b.take(0.0, idle=True, force=True)] == ["long", "none"]
    assert sorted(p.item for p in b.expire(0.0)) == ["edge", "short"]
    assert len(b) == 0


def test_alone_with_nothing_queued_at_the_broker_it_still_runs():
    # Nothing competes for the worker: running it takes nothing from anyone (and measures
    # the model again, should the margin be wrong).
    for backlog in (0, None):
        b = Batcher(max_batch=4, deadline_margin=0.05)
        b.add(_p("a", 0.03, backlog), 0.0)
        assert b.expire(0.0) == []
        assert [p.item for p in b.take(0.0, idle=True)] == ["a"]
        b.idle()
        assert b.goes_alone(KEY, 1.0, backlog, 1.03, 0.0)
    # Others queued at the broker: it would take their place.
    b = Batcher(max_batch=4, deadline_margin=0.05)
    assert not b.goes_alone(KEY, 1.0, 3, 1.03, 0.0)
    b.add(_p("a", 1.03, 3, arrived=1.0), 1.0, observed=True)
    assert b.take(1.0, idle=True) == []
    assert [p.item for p in b.expire(1.0)] == ["a"]
    # The margin wakes an idle worker in time to run what can still make it.
    b.add(_p("b", 2.0, 3, arrived=1.0), 1.0)
    wake = b.wake_at(1.0)
    assert wake <= 2.0 - 0.05 and [p.item for p in b.take(wake, idle=True)] == ["b"]


def test_a_budget_too_short_for_this_worker_is_not_late_and_runs():
    # A whole budget under the margin: this worker is too slow for it (another of the
    # service may not be).  Set aside at once, it freed the credit for the next such one,
    # and a slow worker turned the broker's queue into errors; it runs, as before.
    b = Batcher(max_batch=4, deadline_margin=0.05)
    b.add(_p("short budget", 0.03, 3, since=0.0), 0.0)
    b.add(_p("no queue time said", 0.04, 3, since=None), 0.0)
    b.add(_p("queued, then late", 0.04, 3), 0.0)
    assert [p.item for p in b.expire(0.0)] == ["queued, then late"]
    assert [p.item for p in b.take(0.0, idle=True, force=True)] == ["short budget", "no queue time said"]
    assert b.goes_alone(KEY, 1.0, 3, 1.03, 1.0)
    assert not b.goes_alone(KEY, 1.0, 3, 1.03, 0.9) and b.expire(1.0) == []  # nothing added


def test_the_margin_is_the_quickest_recent_batch():
    t = ComputeTimes(heartbeat_interval=1.0)
    assert t.floor() == 0.0
    t.seed({1: 0.02, 8: 0.09})
    assert t.floor() == pytest.approx(0.02)
    for _ in range(20):
        t.observe(1, 0.2)  # batches of one are slower now
    assert t.floor() == pytest.approx(0.09)  # the batch of eight is the quickest recent one
    assert t.floor() == min(t.recent(1), t.recent(8))


# ------------------------------------------------------------------ in the worker


class _Pair(PairLink):
    def request(self, token: int, x: float, *, timeout_ms: float, backlog: int, queue_ms: float | None = None) -> None:
        head = P.encode_header(P.Request(id=token, reply="inline", backlog=backlog, timeout_ms=timeout_ms,
                                         queue_ms=queue_ms,
                                         tensors=[P.TensorRef("x", "<f8", [1], P.InlineLoc(frame=0))]))
        self.to_worker([P.MDPW, P.W_REQUEST, P.token_envelope(token), b"", head, np.array([x]).tobytes()])

    def finals(self, n: int) -> dict[int, P.Reply]:
        out = {}
        deadline = time.monotonic() + 10
        while len(out) < n:
            assert self.peer.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no FINAL"
            msg = P.parse_worker(self.peer.recv_multipart())
            if msg.command == P.W_FINAL:
                rep = P.decode_reply(msg.body[0], len(msg.body) - 1)
                out[rep.id] = rep
        return out


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEPY_LOG", str(tmp_path / "runs.log"))
    up = _Pair(f"hopeless-{id(tmp_path)}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="tests.e2e.gate_model:sleepy", warmup=False, credit=8),
               upstream=up)
    w._connect()
    w.up = up
    w.lone_lane = True  # as serve() has it
    w.runs = lambda: len((tmp_path / "runs.log").read_text().split())
    try:
        yield w
    finally:
        w.close()


def test_the_worker_does_not_run_what_cannot_finish_in_time_while_others_wait(worker):
    up = worker.up
    up.request(1, 0.6, timeout_ms=30_000, backlog=0)  # the model takes 0.6 s: measured
    assert worker.sock.poll(5000)
    worker._drain()
    assert up.finals(1)[1].error is None and worker.runs() == 1
    # Four arrive together from a broker that has more queued.  Two queued there until
    # half the time a batch takes was left: their callers would give up before they
    # finished.  One had less than that from the start: the worker is too slow for it,
    # not it late; it runs (another worker of the service might be quicker).
    up.request(2, 0.001, timeout_ms=300, backlog=2, queue_ms=2000)
    up.request(3, 0.001, timeout_ms=300, backlog=1, queue_ms=2000)
    up.request(4, 0.001, timeout_ms=30_000, backlog=0)
    up.request(5, 0.001, timeout_ms=300, backlog=1, queue_ms=1)
    for _ in range(4):
        assert worker.sock.poll(5000)
        worker._drain()
        if len(worker.jobs) == 4:
            break
    worker.run_ready_batches()
    reps = up.finals(4)
    assert reps[4].error is None and reps[5].error is None
    for rid in (2, 3):
        err = reps[rid].error
        assert err is not None and err.code == P.ErrorCode.DEADLINE_EXCEEDED, (rid, err)
        assert "not run" in err.message, err.message
    assert worker.runs() == 3  # the first, and the two that were not late


def test_the_kept_margin_is_what_a_look_at_every_size_gives():
    """`floor()` is kept as batches are observed (it is read after every batch): the same as
    the least `recent` over the sizes, whatever the order of the measurements."""
    import random

    rng = random.Random(7)
    t = ComputeTimes(heartbeat_interval=1.0)
    t.seed({1: 0.02, 4: 0.05})
    for _ in range(500):
        t.observe(rng.choice((1, 2, 4, 8)), rng.uniform(0.001, 0.2))
        assert t.floor() == min(t.recent(n) for n in (1, 2, 4, 8) if t.recent(n) is not None)


def _busy_key(b: Batcher, t: float) -> float:
    """Arrivals 0.5 ms apart with more queued at the broker: the waiting rules apply (an
    idle worker waits up to max_delay for company).  Returns the time after them."""
    for i in range(20):
        b.add(_p(("warm", i), None, 3, arrived=t, since=None), t)
        b.take(t, idle=True, force=True)
        t += 0.0005
    b.take(t, idle=True)  # nothing pending: idle again
    return t


def test_a_wait_for_company_does_not_last_until_a_request_cannot_finish():
    # 6 ms left of a 10 ms budget, batches take 5 ms, company expected within 2 ms: run at
    # once it finishes in time.  The wait used to end at its deadline less the margin, the
    # very moment the rule above sets it aside: it waited 1 ms, then was answered 504.
    b = Batcher(max_batch=8, max_delay=0.002, deadline_margin=0.005)
    now = _busy_key(b, 10.0)
    b.add(_p("x", now + 0.006, 3, arrived=now, since=now - 0.004), now)
    went = b.take(now, idle=True)
    if not went:
        wake = b.wake_at(now)
        assert not b.expire(wake), f"waited {(wake - now) * 1e3:.1f} ms for company, then set it aside"
        went = b.take(wake, idle=True)
    assert [p.item for p in went] == ["x"]
    # The lone-request lane decides the same: it goes at once.
    lane = Batcher(max_batch=8, max_delay=0.002, deadline_margin=0.005)
    now = _busy_key(lane, 10.0)
    assert lane.goes_alone(KEY, now, 3, now + 0.006, now - 0.004)
    # With time to spare after the wait, the wait is as it was.
    b = Batcher(max_batch=8, max_delay=0.002, deadline_margin=0.005)
    now = _busy_key(b, 10.0)
    b.add(_p("y", now + 0.5, 3, arrived=now, since=now), now)
    assert b.take(now, idle=True) == [] and b.wake_at(now) > now
