"""Head-of-line: an idle worker takes back what waits behind a busy worker's running batch
(broker.state, "Taking work back"), event by event with an injected clock."""
from __future__ import annotations

from broker.leases import LeaseToWorker
from broker.state import (
    CancelAtWorker,
    ClientError,
    Config,
    Dispatch,
    ErrorCode,
    RecallAtWorker,
    Scheduler,
    ToClient,
)

C = b"client"
W1, W2, W3 = b"w1", b"w2", b"w3"
EP = "ipc:///run/direct.ipc"  # a direct socket: the worker takes leases (and may say BUSY)


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def only(actions, cls):
    found = of(actions, cls)
    assert len(found) == 1, actions
    return found[0]


def sched(**kw):
    s = Scheduler(Config(**kw))
    for w in (W1, W2):
        s.worker_ready(w, "svc", 0.0, credit=16, recall=True, direct=EP)
    return s


def send(s, rid, now):
    return s.client_request(C, rid, "svc", now, payload=f"p{rid}")


def test_the_1s_and_20ms_case_a_short_request_never_waits_behind_a_long_one():
    """Two workers, default credit.  A (1 s) runs on one, B (20 ms) on the other; C (20 ms)
    arrives while both are busy and lands behind one of them.  When B's worker goes idle,
    C runs there: done at about 40 ms, not at 1 s."""
    s = sched()
    a = only(send(s, 1, 0.000), Dispatch)
    b = only(send(s, 2, 0.001), Dispatch)
    assert {a.worker, b.worker} == {W1, W2}
    c = only(send(s, 3, 0.002), Dispatch)
    long_w, short_w = a.worker, b.worker
    # Both hold one: the tie goes to the least recently used, A's worker.
    assert c.worker == long_w
    # C is parked behind A's 1 s batch.  B ends at 21 ms: its worker is idle, A's batch has
    # run 21 ms (over recall_after): C is asked back.
    out = s.worker_final(short_w, b.token, 0.021, "B")
    assert only(out, ToClient).request_id == 2
    rec = only(out, RecallAtWorker)
    assert rec.worker == long_w and rec.tokens == (c.token,)
    # The busy worker had not started it: it gives it back; the idle worker gets it at once,
    # as the same attempt, its timing saying it was handed back once.
    out = s.worker_returned(long_w, [c.token], 0.0215)
    again = only(out, Dispatch)
    assert again.worker == short_w and again.request_id == 3
    assert again.attempt == 0 and again.returned == 1
    assert again.token != c.token
    out = s.worker_final(short_w, again.token, 0.0415, "C")
    fin = only(out, ToClient)
    assert fin.request_id == 3 and fin.payload == "C"
    # It waited about 20 ms in all (the shown queue time), not a second.
    assert fin.dispatched_at - fin.enqueued_at < 0.025
    # A still ends normally; the stale token of C at the long worker is dropped if it comes.
    assert only(s.worker_final(long_w, a.token, 1.0, "A"), ToClient).request_id == 1
    assert s.worker_final(long_w, c.token, 1.0, "C-late") == []
    st = s.stats()["counters"]
    assert st["recalled"] == 1 and st["returned"] == 1 and st["completed"] == 3


def test_a_request_taken_back_for_a_worker_whose_connection_closed_meanwhile_is_queued():
    """The idle worker it was asked back for closed its connection before the busy one gave
    it back: not sent there (it would be charged that worker's death), but queued."""
    s = sched()
    a = only(send(s, 1, 0.000), Dispatch)
    b = only(send(s, 2, 0.001), Dispatch)
    c = only(send(s, 3, 0.002), Dispatch)
    long_w, short_w = a.worker, b.worker
    rec = only(s.worker_final(short_w, b.token, 0.021, "B"), RecallAtWorker)
    assert rec.tokens == (c.token,)
    s.worker_closed(short_w)
    out = s.worker_returned(long_w, [c.token], 0.0215)
    assert [d.worker for d in of(out, Dispatch)] in ([], [long_w])  # queued, or back where it was
    assert all(d.worker != short_w for d in of(out, Dispatch))
    s.worker_disconnect(short_w, 0.03)
    assert s.stats()["counters"]["worker_failed"] == 0


def test_started_requests_finish_where_they_are():
    s = sched()
    a = only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    c = only(send(s, 3, 0.001), Dispatch)
    long_w = c.worker
    short_w = W1 if long_w == W2 else W2
    short = a if a.worker == short_w else b
    rec = only(s.worker_final(short_w, short.token, 0.02, "x"), RecallAtWorker)
    # The worker had started it (a batch of two): it ignores the RECALL and answers later.
    assert s.worker_final(long_w, rec.tokens[0], 1.0, "C")[0].request_id == 3
    # Asked once per dispatch: the idle worker going idle again asks nothing more.
    assert s.stats()["counters"]["returned"] == 0


def test_young_batches_are_left_alone_until_they_are_not():
    """Waiting behind a batch that started a moment ago is cheaper than a round trip: the
    broker looks again when the batch is recall_after old (a timer), not before."""
    s = sched(recall_after=0.05)
    a = only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    c = only(send(s, 3, 0.001), Dispatch)
    idle_w = a.worker if c.worker != a.worker else b.worker
    done = a if a.worker == idle_w else b
    out = s.worker_final(idle_w, done.token, 0.01, "x")
    assert not of(out, RecallAtWorker)
    assert s.next_wakeup(0.01) is not None and s.next_wakeup(0.01) <= 0.05 + 1e-9
    assert not of(s.tick(0.049), RecallAtWorker)
    rec = only(s.tick(0.05), RecallAtWorker)
    assert rec.worker == c.worker and rec.tokens == (c.token,)


def test_queued_work_goes_first_and_nothing_is_recalled_from_workers_that_cannot_answer():
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=4)  # a plain worker: no RECALL
    s.worker_ready(W2, "svc", 0.0, credit=4, recall=True)
    ds = [only(send(s, i, 0.0), Dispatch) for i in range(4)]
    on_w1 = [d for d in ds if d.worker == W1]
    on_w2 = [d for d in ds if d.worker == W2]
    assert len(on_w1) == 2 and len(on_w2) == 2
    # W2 finishes both; W1 (no recall) keeps what it holds.
    s.worker_final(W2, on_w2[0].token, 0.1, "x")
    out = s.worker_final(W2, on_w2[1].token, 0.1, "x")
    assert not of(out, RecallAtWorker)


def test_half_of_a_deep_worker_and_locality():
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=16, recall=True, host="h", transports=frozenset({"inline", "shm"}))
    # Eight requests on W1 alone: two for shared memory on host h, the others inline.
    tokens = []
    for i in range(8):
        kw = {"local_host": "h"} if i in (6, 7) else {}
        tokens.append(only(s.client_request(C, i, "svc", 0.0, payload=i, **kw), Dispatch).token)
    # W2 joins: inline only (it cannot map h's shared memory), idle.
    out = s.worker_ready(W2, "svc", 0.1, credit=16, recall=True)
    rec = only(out, RecallAtWorker)
    # At most half of the eight, newest first, skipping the two it cannot take.
    assert rec.worker == W1 and rec.tokens == (tokens[5], tokens[4], tokens[3], tokens[2])
    # W1 had started 2..3 (its batch), not 4..5: it returns those; W2 gets them.
    out = s.worker_returned(W1, [tokens[5], tokens[4]], 0.101)
    assert [d.worker for d in of(out, Dispatch)] == [W2, W2]
    assert sorted(d.request_id for d in of(out, Dispatch)) == [4, 5]


def test_returned_when_cancelled_or_unasked():
    s = sched()
    a = only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    c = only(send(s, 3, 0.001), Dispatch)
    idle_w = a.worker if c.worker != a.worker else b.worker
    done = a if a.worker == idle_w else b
    only(s.worker_final(idle_w, done.token, 0.02, "x"), RecallAtWorker)
    # The client cancels while the RECALL is on its way; the worker returns it: CANCELLED.
    assert only(s.client_cancel(C, 3, 0.021), CancelAtWorker).token == c.token
    err = only(s.worker_returned(c.worker, [c.token], 0.022), ClientError)
    assert err.request_id == 3 and err.code == ErrorCode.CANCELLED
    # A worker giving back what nobody asked for refuses work: a failed attempt, retried.
    d = only(send(s, 4, 0.03), Dispatch)
    out = s.worker_returned(d.worker, [d.token], 0.031)
    again = only(out, Dispatch)
    assert again.request_id == 4 and again.attempt == 1 and again.returned == 0


def test_the_victim_dies_with_work_recalled():
    s = sched()
    a = only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    c = only(send(s, 3, 0.001), Dispatch)
    idle_w = a.worker if c.worker != a.worker else b.worker
    done = a if a.worker == idle_w else b
    only(s.worker_final(idle_w, done.token, 0.02, "x"), RecallAtWorker)
    out = s.worker_disconnect(c.worker, 0.021)
    # Both of the dead worker's requests are retried on the idle one (nothing lost twice).
    assert sorted(d.request_id for d in of(out, Dispatch)) == sorted({1, 2, 3} - {done.request_id})
    assert all(d.worker == idle_w for d in of(out, Dispatch))


def test_an_answer_that_keeps_everything_frees_the_idle_worker_to_look_elsewhere():
    """A found case: a batch of two (A, C) runs on W1; W2 goes idle and asks for C, which has
    started.  W1 says so (kept).  Later F lands behind W1's batch; when W2 is idle again it
    takes F back (before the fix, W2 waited for C's answer forever and F waited a second)."""
    s = sched()
    a = only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    c = only(send(s, 3, 0.001), Dispatch)
    assert (a.worker, b.worker, c.worker) == (W1, W2, W1)
    rec = only(s.worker_final(W2, b.token, 0.02, "B"), RecallAtWorker)
    assert rec.worker == W1 and rec.tokens == (c.token,)
    assert s.worker_returned(W1, [], 0.021, kept=[c.token]) == []  # started: kept
    d = only(send(s, 4, 0.03), Dispatch)
    e = only(send(s, 5, 0.03), Dispatch)
    f = only(send(s, 6, 0.03), Dispatch)
    assert (d.worker, e.worker, f.worker) == (W2, W2, W1)  # F: behind A and C
    s.worker_final(W2, d.token, 0.05, "D")
    rec2 = only(s.worker_final(W2, e.token, 0.05, "E"), RecallAtWorker)
    # C was asked for once already (once per dispatch); of A and F, the newest.
    assert rec2.worker == W1 and rec2.tokens == (f.token,)
    again = only(s.worker_returned(W1, [f.token], 0.051), Dispatch)
    assert again.worker == W2 and again.request_id == 6 and again.returned == 1


def test_a_request_returned_after_its_deadline_is_never_dispatched():
    s = sched()
    only(s.client_request(C, 1, "svc", 0.0, payload="a"), Dispatch)
    b = only(s.client_request(C, 2, "svc", 0.0, payload="b"), Dispatch)
    c = only(s.client_request(C, 3, "svc", 0.001, payload="c", deadline=0.03), Dispatch)
    assert c.worker != b.worker
    only(s.worker_final(b.worker, b.token, 0.02, "B"), RecallAtWorker)
    # It comes back after its deadline, before any tick: answered, never dispatched.
    out = s.worker_returned(c.worker, [c.token], 0.0305)
    assert not of(out, Dispatch)
    err = only(out, ClientError)
    assert err.request_id == 3 and err.code == ErrorCode.DEADLINE_EXCEEDED


def test_a_negative_recall_after_means_never():
    s = sched(recall_after=-1.0)
    only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    only(send(s, 3, 0.001), Dispatch)
    assert not of(s.worker_final(b.worker, b.token, 10.0, "B"), RecallAtWorker)
    assert not of(s.tick(20.0), RecallAtWorker)


# ---- BUSY: leased work the broker cannot see (docs/protocol.md section 10.3)


def test_a_worker_busy_with_a_long_leased_batch_comes_last_for_dispatch():
    """W1 runs a lease's long batch (it said BUSY): brokered requests go to W2, even when W2
    holds more, so none waits behind work the broker cannot see; BUSY off, W1 takes again."""
    s = sched()
    assert s.worker_busy(W1, True, 0.0) == []
    ds = [only(send(s, i, 0.001), Dispatch) for i in range(3)]
    assert [d.worker for d in ds] == [W2, W2, W2]
    # W1 holds nothing but is not idle: nothing is taken back from W2 for it (W2 is deep
    # and its batch old), and nothing is dispatched to it while W2 has credit.
    assert not of(s.tick(0.5), RecallAtWorker)
    # The leased batch ends: W1 is idle, and takes back half of what waits at W2.
    rec = only(s.worker_busy(W1, False, 0.6), RecallAtWorker)
    assert rec.worker == W2 and rec.tokens == (ds[2].token,)
    again = only(s.worker_returned(W2, [ds[2].token], 0.601), Dispatch)
    assert again.worker == W1 and again.returned == 1
    # A busy worker is still used when every other one is full (it only comes last).
    s2 = Scheduler(Config())
    s2.worker_ready(W1, "svc", 0.0, credit=2, recall=True, direct=EP)
    s2.worker_ready(W2, "svc", 0.0, credit=2, recall=True, direct=EP)
    s2.worker_busy(W2, True, 0.0)
    assert [only(send(s2, i, 0.0), Dispatch).worker for i in range(3)] == [W1, W1, W2]


def test_a_request_parked_behind_a_long_leased_batch_is_taken_back_for_an_idle_worker():
    """The issue's case, with the long batch a lease's: R lands on W1 (W2 busy with a
    brokered one); W1 starts a long leased batch and says BUSY; when W2 goes idle, R (the
    only one W1 holds: nothing of W1's brokered work runs) is taken back and runs there."""
    s = sched()
    long_one = only(send(s, 1, 0.0), Dispatch)
    assert long_one.worker == W1
    s.worker_final(W1, long_one.token, 0.001, "x")
    busy = only(send(s, 2, 0.002), Dispatch)   # W2's: W1 was used last
    assert busy.worker == W2
    r = only(send(s, 3, 0.003), Dispatch)
    assert r.worker == W1                      # one held: not deep, nothing to take back
    assert not of(s.worker_busy(W1, True, 0.010), RecallAtWorker)  # W2 is not idle yet
    rec = only(s.worker_final(W2, busy.token, 0.020, "B"), RecallAtWorker)
    assert rec.worker == W1 and rec.tokens == (r.token,)
    again = only(s.worker_returned(W1, [r.token], 0.021), Dispatch)
    assert again.worker == W2 and again.request_id == 3 and again.returned == 1
    fin = only(s.worker_final(W2, again.token, 0.041, "R"), ToClient)
    assert fin.request_id == 3 and fin.dispatched_at - fin.enqueued_at < 0.025
    # Without BUSY the same request would have waited for W1's batch: one held is not deep.
    s2 = sched()
    a = only(send(s2, 1, 0.0), Dispatch)
    s2.worker_final(W1, a.token, 0.001, "x")
    b = only(send(s2, 2, 0.002), Dispatch)
    only(send(s2, 3, 0.003), Dispatch)
    assert not of(s2.worker_final(W2, b.token, 0.020, "B"), RecallAtWorker)


def test_busy_is_only_a_hint_from_a_registered_worker_and_a_returned_request_skips_a_busy_thief():
    s = sched()
    assert [type(a).__name__ for a in s.worker_busy(b"stranger", True, 0.0)] == ["DisconnectWorker"]
    assert s.worker_busy(W1, False, 0.0) == []   # no change: nothing to do
    # R is recalled from deep W1 for idle W2; before W1 answers, W2 says BUSY: R goes back
    # to the queue instead of behind W2's leased batch, and then to the best worker: W1.
    a = only(send(s, 1, 0.0), Dispatch)
    b = only(send(s, 2, 0.0), Dispatch)
    c = only(send(s, 3, 0.001), Dispatch)
    assert (a.worker, b.worker, c.worker) == (W1, W2, W1)
    rec = only(s.worker_final(W2, b.token, 0.02, "B"), RecallAtWorker)
    assert rec.tokens == (c.token,)
    s.worker_busy(W2, True, 0.021)
    again = only(s.worker_returned(W1, [c.token], 0.022), Dispatch)
    assert again.worker == W1 and again.returned == 1


def test_busy_from_a_worker_without_a_direct_socket_is_ignored():
    """A worker that takes no leases (no `Ready.direct`) has no leased work to say BUSY
    about: its BUSY changes nothing (it stays idle, first for dispatch, and takes work back),
    though it counts as a sign of life."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=2, recall=True)
    s.worker_ready(W2, "svc", 0.0, credit=2, recall=True, direct=EP)
    assert s.worker_busy(W1, True, 0.0) == []
    assert not s._workers[W1].busy and s._workers[W1].is_idle
    assert only(send(s, 1, 0.001), Dispatch).worker == W1  # not put last
    # The same from the leasing worker counts.
    s.worker_busy(W2, True, 0.002)
    assert s._workers[W2].busy and not s._workers[W2].is_idle
    s.worker_busy(W1, True, 0.5)
    assert s._workers[W1].last_seen == 0.5  # a sign of life all the same


def test_workers_with_nothing_left_to_ask_back_are_not_looked_at_for_every_idle_worker(monkeypatch):
    # A batching pool under load: some workers run started batches (their requests asked
    # back once and kept), others are idle.  Each event looked at every kept victim for
    # every idle worker: quadratic in the pool (a scale hunt: 750 µs a request at 80
    # workers).  A worker with nothing left to ask back is skipped before the pairs.
    s = Scheduler(Config())
    busy = [b"b%d" % i for i in range(10)]
    for w in busy:
        s.worker_ready(w, "svc", 0.0, credit=2, recall=True)
    held = {}
    for i in range(20):  # two each
        d = only(send(s, i, 0.0), Dispatch)
        held.setdefault(d.worker, []).append(d.token)
    idle = [b"i%d" % i for i in range(10)]
    for w in idle:
        s.worker_ready(w, "svc", 0.0, credit=2, recall=True)
    out = s.tick(1.0)  # the batches are old: asked back once...
    for rec in of(out, RecallAtWorker):
        s.worker_returned(rec.worker, [], 1.0, kept=rec.tokens)  # ...and kept: they had started
    calls = []
    real = Scheduler._recall_for
    monkeypatch.setattr(Scheduler, "_recall_for", staticmethod(lambda t, v: calls.append(1) or real(t, v)))
    s.client_heartbeat(C, 1.1)
    assert not of(s.tick(2.0), RecallAtWorker)
    for i in range(5):  # requests served by the idle workers, each final an event
        r = only(send(s, 99 + i, 2.1 + i * 0.01), Dispatch)
        assert r.worker in idle
        assert only(s.worker_final(r.worker, r.token, 2.105 + i * 0.01, "r"), ToClient)
    assert calls == []  # nothing left to ask back anywhere: no pair looked at


def test_idle_workers_of_another_host_are_not_paired_with_every_victim_at_every_event(monkeypatch):
    # Found by the scale hunt: workers of one host deep in that host's shared-memory
    # requests, idle workers of another host (they cannot map them).  Each event paired
    # every idle worker with every victim, for nothing: 5.6 ms a request at 100 deep
    # workers and 10 idle ones, 20 ms at 100 of each.  Now only the workers that could take
    # something are paired: a worker of the victims' host that goes idle still takes work back.
    s = Scheduler(Config())
    shm = frozenset({"inline", "shm"})
    deep = [b"a%d" % i for i in range(4)]
    for w in deep:
        s.worker_ready(w, "svc", 0.0, credit=4, recall=True, host="a", transports=shm)
    held = {}
    for i in range(16):  # four each, all for host a's shared memory
        d = only(s.client_request(C, i, "svc", 0.0, payload=i, local_host="a"), Dispatch)
        held.setdefault(d.worker, []).append(d.token)
    for i in range(8):
        s.worker_ready(b"b%d" % i, "svc", 0.0, credit=4, recall=True, host="b", transports=shm)
    calls = []
    real = Scheduler._recall_for
    monkeypatch.setattr(Scheduler, "_recall_for", staticmethod(lambda t, v: calls.append(1) or real(t, v)))
    assert not of(s.tick(1.0), RecallAtWorker)  # the batches are old, but no idle worker can take any
    for i in range(5):  # events on the service: a request for host a queued, then cancelled
        assert not of(s.client_request(C, 100 + i, "svc", 1.1 + i * 0.01, payload=i, local_host="a"), Dispatch)
        assert only(s.client_cancel(C, 100 + i, 1.105 + i * 0.01), ClientError).code == ErrorCode.CANCELLED
    assert calls == []
    # A worker of host a that joins idle still takes work back (half of a victim's four).
    rec = only(s.worker_ready(b"a9", "svc", 1.2, credit=4, recall=True, host="a", transports=shm), RecallAtWorker)
    assert rec.worker in deep and len(rec.tokens) == 2 and calls


# ---- urgent work: a parked request of a lower class is taken back to make room for it


def full_worker(recall=True, credit=8, pri=2, **kw):
    """One worker of credit 8 holding 8 requests of class ``pri`` (ids 1..8) and two more
    of them queued (9, 10)."""
    s = Scheduler(Config(**kw))
    s.worker_ready(W1, "svc", 0.0, credit=credit, recall=recall)
    held = [only(s.client_request(C, i, "svc", 0.0, payload=i, priority=pri), Dispatch) for i in range(1, credit + 1)]
    for i in (credit + 1, credit + 2):
        assert s.client_request(C, i, "svc", 0.0, payload=i, priority=pri) == []
    return s, held


def test_an_urgent_request_queued_at_a_full_worker_takes_back_its_newest_background_one():
    s, held = full_worker()
    out = s.client_request(b"slo", 1, "svc", 0.01, payload="u", priority=0)
    rec = only(out, RecallAtWorker)
    assert rec.worker == W1 and rec.tokens == (held[-1].token,)
    assert not of(out, Dispatch)
    # The worker had not started it: the credit it frees goes to the urgent request, and
    # the background one goes back to the front of its FIFO (next in its class).
    out = s.worker_returned(W1, [held[-1].token], 0.011)
    d = only(out, Dispatch)
    assert (d.client, d.request_id) == (b"slo", 1)
    out = s.worker_final(W1, held[0].token, 0.02, "r1")
    assert only(out, Dispatch).request_id == 8  # taken back, so first again
    st = s.stats()["counters"]
    assert st["recalled"] == 1 and st["returned"] == 1


def test_each_urgent_request_asks_for_one_and_started_ones_are_kept():
    s, held = full_worker(pri=1)  # normal work is taken back for urgent work too
    r1 = only(s.client_request(b"slo", 1, "svc", 0.01, payload="u1", priority=0), RecallAtWorker)
    r2 = only(s.client_request(b"slo", 2, "svc", 0.01, payload="u2", priority=0), RecallAtWorker)
    assert (r1.tokens, r2.tokens) == ((held[-1].token,), (held[-2].token,))
    # Started (in the running batch): kept, nothing moves; the urgent ones go at the next
    # freed credit, before the queued normal ones.
    assert s.worker_returned(W1, [], 0.012, kept=r1.tokens + r2.tokens) == []
    out = s.worker_final(W1, held[0].token, 0.02, "r1")
    assert [(d.client, d.request_id) for d in of(out, Dispatch)] == [(b"slo", 1)]
    # Asked once per dispatch: a third urgent request asks for the next one, not those.
    r3 = only(s.client_request(b"slo", 3, "svc", 0.03, payload="u3", priority=0), RecallAtWorker)
    assert r3.tokens == (held[-3].token,)


def test_nothing_is_taken_back_for_urgent_work_when_it_cannot_help():
    # What the worker holds is urgent too: urgent work is not taken back for urgent work.
    s, _ = full_worker(pri=0)
    assert s.client_request(b"slo", 1, "svc", 0.01, payload="u", priority=0) == []
    # A normal request of the principal whose work is parked there takes nothing back (a
    # newcomer's turn, below, is for a principal holding nothing there).
    s, _ = full_worker(pri=2)
    assert s.client_request(C, 11, "svc", 0.01, payload="n", priority=1) == []
    # A worker that does not answer RECALL, or recall turned off.
    s, _ = full_worker(recall=False)
    assert s.client_request(b"slo", 1, "svc", 0.01, payload="u", priority=0) == []
    s, _ = full_worker(recall_after=-1)
    assert s.client_request(b"slo", 1, "svc", 0.01, payload="u", priority=0) == []
    assert s.stats()["counters"]["recalled"] == 0


def test_a_worker_over_its_brokered_credit_after_a_lease_gives_back_enough_or_nothing():
    """A lease took half the credit of a worker holding 8 brokered background requests: one
    given back would not make room, so an urgent request asks for 5 (8 held - 4 brokered
    credit + 1), oldest first (they go back to the front of their FIFO in order); a worker
    with fewer of a lower class than that is asked nothing."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=8, recall=True, direct=EP)
    held = [only(s.client_request(C, i, "svc", 0.0, payload=i, priority=2), Dispatch) for i in range(1, 9)]
    to_w = only(s.client_lease(b"pin", None, 1, "svc", 0.0, slots=4, secret=b"s" * 16), LeaseToWorker)
    s.worker_leased(W1, to_w.lease, 0.0)
    rec = only(s.client_request(b"slo", 1, "svc", 0.01, payload="u", priority=0), RecallAtWorker)
    assert rec.tokens == tuple(d.token for d in held[3:])
    d = only(s.worker_returned(W1, list(rec.tokens), 0.011), Dispatch)
    assert (d.client, d.request_id) == (b"slo", 1)
    # The worker runs one of the three left: the next free credit goes to the oldest given back.
    assert only(s.worker_final(W1, held[0].token, 0.02, "r1"), Dispatch).request_id == 4
    # Only urgent work left to give back: nothing is asked.
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=8, recall=True, direct=EP)
    for i in range(1, 9):
        s.client_request(C, i, "svc", 0.0, payload=i, priority=0 if i < 5 else 2)
    to_w = only(s.client_lease(b"pin", None, 1, "svc", 0.0, slots=4, secret=b"s" * 16), LeaseToWorker)
    s.worker_leased(W1, to_w.lease, 0.0)
    assert s.client_request(b"slo", 1, "svc", 0.01, payload="u", priority=0) == []


def test_a_request_that_aging_dispatched_ahead_of_urgent_ones_is_not_taken_back_for_one():
    """Taken back, it would lose the turn its wait won (its FIFO was served at dispatch)."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=2, recall=True)
    u1 = only(s.client_request(b"u", 1, "svc", 0.0, payload=1, priority=0), Dispatch)
    only(s.client_request(b"u", 2, "svc", 0.0, payload=2, priority=0), Dispatch)
    assert s.client_request(C, 1, "svc", 0.0, payload="bg", priority=2) == []  # full: queued
    # 3 s later a fresh urgent request is queued too; when u1 ends, the background one has
    # waited long enough to outscore it, and the worker is told so.
    assert s.client_request(b"u", 3, "svc", 3.0, payload=3, priority=0) == []
    d = only(s.worker_final(W1, u1.token, 3.0, "r"), Dispatch)
    assert (d.client, d.priority) == (C, 0)
    # The worker now holds urgent 2 and it: a new urgent request takes nothing back.
    assert s.client_request(b"u", 4, "svc", 3.0, payload=4, priority=0) == []
    assert s.stats()["counters"]["recalled"] == 0


# ---- a newcomer's turn: a principal holding nothing at a full worker takes one parked
# request back from the principal holding most there


F, L = b"flood", b"light"


def flooded(credit=8, queued=2, light_first=True, **kw):
    """One worker of ``credit`` full of F's requests (ids 1..credit) and ``queued`` more of
    them at the broker; L had one request served before the flood (``light_first``), so it
    is remembered as served before F: its next request goes ahead of F's in the ring."""
    s = Scheduler(Config(**kw))
    s.worker_ready(W1, "svc", 0.0, credit=credit, recall=True)
    if light_first:
        d = only(s.client_request(L, 0, "svc", 0.0005, payload="l0"), Dispatch)
        assert only(s.worker_final(W1, d.token, 0.001, "r"), ToClient).request_id == 0
    held = [only(s.client_request(F, i, "svc", 0.002, payload=i), Dispatch) for i in range(1, credit + 1)]
    for i in range(credit + 1, credit + 1 + queued):
        assert s.client_request(F, i, "svc", 0.003, payload=i) == []
    return s, held


def test_a_light_client_queued_at_a_worker_full_of_a_flood_takes_the_newest_parked_one_back():
    s, held = flooded()
    out = s.client_request(L, 1, "svc", 0.01, payload="l1")
    rec = only(out, RecallAtWorker)
    assert rec.worker == W1 and rec.tokens == (held[-1].token,) and not of(out, Dispatch)
    # Given back unstarted: the credit goes to the light client's request (its principal
    # keeps its place in the ring, behind the light one), and the flood's request goes back
    # into its FIFO by age, ahead of the newer 9 and 10: it is the flood's next.
    d = only(s.worker_returned(W1, [held[-1].token], 0.011), Dispatch)
    assert (d.client, d.request_id) == (L, 1)
    assert only(s.worker_final(W1, held[0].token, 0.02, "r"), Dispatch).request_id == 8
    assert only(s.worker_final(W1, held[1].token, 0.03, "r"), Dispatch).request_id == 9
    st = s.stats()["counters"]
    assert st["recalled"] == 1 and st["returned"] == 1 and st["turns"] == 1
    # Started (the worker kept it): nothing moves, the light request goes at the next credit.
    s, held = flooded()
    rec = only(s.client_request(L, 1, "svc", 0.01, payload="l1"), RecallAtWorker)
    assert s.worker_returned(W1, [], 0.011, kept=rec.tokens) == []
    d = only(s.worker_final(W1, held[0].token, 0.02, "r"), Dispatch)
    assert (d.client, d.request_id) == (L, 1)


def test_two_newcomers_each_take_one_back_but_a_new_name_does_not_jump_the_queue():
    # New here (never served): behind the flood's queued requests in the ring, so a credit
    # given back would go to the flood: nothing asked.
    s, held = flooded(light_first=False)
    for p in (b"a", b"b"):
        assert s.client_request(p, 1, "svc", 0.01, payload=1) == []
    assert s.stats()["counters"]["recalled"] == 0
    # Served before the flood came: each asks for one, the flood's newest first.
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=8, recall=True)
    for p in (b"a", b"b"):
        d = only(s.client_request(p, 0, "svc", 0.0005, payload=0), Dispatch)
        s.worker_final(W1, d.token, 0.001, "r")
    held = [only(s.client_request(F, i, "svc", 0.002, payload=i), Dispatch) for i in range(1, 9)]
    assert s.client_request(F, 9, "svc", 0.003, payload=9) == []
    recs = [only(s.client_request(p, 1, "svc", 0.01, payload=1), RecallAtWorker) for p in (b"a", b"b")]
    assert [r.tokens for r in recs] == [(held[-1].token,), (held[-2].token,)]
    out = [d.client for r in recs for d in of(s.worker_returned(W1, list(r.tokens), 0.011), Dispatch)]
    assert out == [b"a", b"b"]
    # The flood's two go back into its FIFO by age (7 given back after 8, and ahead of
    # it: they came together), both before its 9.
    assert [only(s.worker_final(W1, held[i].token, 0.02 + i / 100, "r"), Dispatch).request_id
            for i in range(3)] == [7, 8, 9]


def test_given_back_for_a_turn_into_a_congested_queue_the_request_waits_by_age():
    """Congested (newest first), the request given back goes among the flood's queued ones
    by age: the newer go first.  Put back at the front, it made the flood's walk oldest
    first: it went next, late, and the flood's newest waited for it."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=2, recall=True)
    d = only(s.client_request(L, 0, "svc", 0.0005, payload="l0", deadline=1.0), Dispatch)
    s.worker_final(W1, d.token, 0.001, "r")
    held = [only(s.client_request(F, i, "svc", 0.002 * i, payload=i, deadline=9.0), Dispatch) for i in (1, 2)]
    for i in (3, 4, 5):
        assert s.client_request(F, i, "svc", 0.002 * i, payload=i, deadline=9.0) == []
    # 0.2 s later the queue has not emptied, and a request just missed its deadline
    # (set here: this test's events hold none): congested.  The light request takes 2 back.
    s._services["svc"].missed = 0.2
    rec = only(s.client_request(L, 1, "svc", 0.2, payload="l1", deadline=9.0), RecallAtWorker)
    assert rec.tokens == (held[1].token,)
    light = only(s.worker_returned(W1, list(rec.tokens), 0.201), Dispatch)
    assert light.client == L
    # The flood's next are its newest, 5, 4, 3: the one given back (2) is its oldest now.
    s._services["svc"].missed = 0.21
    nxt = only(s.worker_final(W1, held[0].token, 0.21, "r"), Dispatch)
    order = [nxt.payload]
    for t, tok in enumerate((light.token, nxt.token), 1):
        s._services["svc"].missed = 0.21 + t / 100
        nxt = only(s.worker_final(W1, tok, 0.21 + t / 100, "r"), Dispatch)
        order.append(nxt.payload)
    assert order == [5, 4, 3]


def test_nothing_is_taken_back_for_a_client_that_has_its_share():
    # It holds one at the worker already (its second request waits its turn at the broker).
    s, held = flooded(credit=8)
    s2 = Scheduler(Config())
    s2.worker_ready(W1, "svc", 0.0, credit=4, recall=True)
    d = only(s2.client_request(L, 0, "svc", 0.0005, payload=0), Dispatch)
    s2.worker_final(W1, d.token, 0.001, "r")
    only(s2.client_request(L, 1, "svc", 0.002, payload=1), Dispatch)
    for i in range(1, 4):
        only(s2.client_request(F, i, "svc", 0.002, payload=i), Dispatch)
    assert s2.client_request(L, 2, "svc", 0.01, payload=2) == []
    # It has another request queued already (only its first queued one asks).
    assert s.client_request(L, 1, "svc", 0.01, payload=1) != []
    assert s.client_request(L, 2, "svc", 0.01, payload=2) == []
    # Everyone at the worker holds one: nobody holds more than its share.
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=4, recall=True)
    d = only(s.client_request(L, 0, "svc", 0.0005, payload=0), Dispatch)
    s.worker_final(W1, d.token, 0.001, "r")
    for p in (b"p1", b"p2", b"p3", b"p4"):
        only(s.client_request(p, 1, "svc", 0.002, payload=1), Dispatch)
    assert s.client_request(L, 1, "svc", 0.01, payload=1) == []
    # What is parked there is more urgent than the newcomer's request.
    s, _ = flooded()
    assert s.client_request(L, 1, "svc", 0.01, payload=1, priority=2) == []
    # A worker that does not answer RECALL, or recall turned off.
    for kw in ({"recall": False}, {"recall_after": -1}):
        s = Scheduler(Config(**{k: v for k, v in kw.items() if k != "recall"}))
        s.worker_ready(W1, "svc", 0.0, credit=4, recall=kw.get("recall", True))
        d = only(s.client_request(L, 0, "svc", 0.0005, payload=0), Dispatch)
        s.worker_final(W1, d.token, 0.001, "r")
        for i in range(1, 6):
            s.client_request(F, i, "svc", 0.002, payload=i)
        assert s.client_request(L, 1, "svc", 0.01, payload=1) == []
    assert s.stats()["counters"]["recalled"] == 0


def test_nothing_is_taken_back_from_a_principal_the_freed_credit_would_go_to_first():
    """F's requests are all at the worker (none queued: F is not in the ring), and F's last
    turn is older than the newcomer's: given back, F's FIFO would be made ahead of N's
    (least recently served first) and take the credit straight back.  So nothing is asked
    (a review found the round trip wasted)."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=8, recall=True)
    for i in range(7):
        only(s.client_request(F, i, "svc", 0.002, payload=i), Dispatch)  # F's last turn: 0.002
    d = only(s.client_request(b"n", 0, "svc", 0.003, payload=0), Dispatch)  # N's: 0.003
    s.worker_final(W1, d.token, 0.004, "r")
    only(s.client_request(b"g", 0, "svc", 0.005, payload=0), Dispatch)  # the last credit
    assert s.client_request(b"n", 1, "svc", 0.01, payload=1) == []
    assert s.stats()["counters"]["recalled"] == 0


def test_nothing_is_taken_back_from_a_flood_whose_fifo_would_be_made_again_ahead_of_one_ahead():
    """P is ahead of N in the ring (N never served here) and was served after F's last
    turn: F's FIFO, made again by a give-back, would go ahead of P's, so ahead of N's, and
    take the credit back.  So nothing is asked (a second review's case)."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=4, recall=True)
    for i in range(3):
        only(s.client_request(F, i, "svc", 0.002, payload=i), Dispatch)
    only(s.client_request(b"p", 0, "svc", 0.003, payload=0), Dispatch)
    assert s.client_request(b"p", 1, "svc", 0.004, payload=1) == []
    assert s.client_request(b"n", 0, "svc", 0.005, payload=0) == []
    assert s.stats()["counters"]["recalled"] == 0


def test_a_busy_worker_is_asked_for_a_turn_or_for_urgent_work_only_when_no_other_will_do():
    """w2 says BUSY (a long batch): a request given back there would put the newcomer (or
    the urgent request) behind that batch, so the other worker is asked instead.  With
    every worker busy (one worker whose batches all run long: a worker that takes leases
    says so of any batch predicted 5 ms or more), a busy one is asked, or the newcomer
    would wait for a batch more."""
    for pri, flood in ((1, 1), (0, 2)):  # a newcomer's turn; urgent work
        for workers in ((W1, W2), (W1,)):
            s = Scheduler(Config())
            for w in workers:
                s.worker_ready(w, "svc", 0.0, credit=4, recall=True, direct=EP)
            d = only(s.client_request(L, 0, "svc", 0.0005, payload=0), Dispatch)
            s.worker_final(d.worker, d.token, 0.001, "r")
            for i in range(4 * len(workers)):
                only(s.client_request(F, i, "svc", 0.002, payload=i, priority=flood), Dispatch)
            s.client_request(F, 100, "svc", 0.003, payload=100, priority=flood)
            # The busy one is the first a look at the service's deep workers finds (W2: L's
            # request ran on W1, so W2 took F's first and held two first).
            busy, other = workers[-1], workers[0]
            assert next(iter(s._services["svc"].deep)).ident == busy
            s.worker_busy(busy, True, 0.004)
            rec = only(s.client_request(L, 1, "svc", 0.01, payload=1, priority=pri), RecallAtWorker)
            assert rec.worker == other
            d = only(s.worker_returned(rec.worker, list(rec.tokens), 0.011), Dispatch)
            assert (d.client, d.worker) == (L, other)


def test_what_a_flood_cancelled_or_asked_back_already_does_not_count_as_its_share():
    """F holds one request it runs and one its client cancelled: one to give, not two."""
    s = Scheduler(Config())
    s.worker_ready(W1, "svc", 0.0, credit=2, recall=True)
    d = only(s.client_request(L, 0, "svc", 0.0005, payload=0), Dispatch)
    s.worker_final(W1, d.token, 0.001, "r")
    only(s.client_request(F, 1, "svc", 0.002, payload=1), Dispatch)
    only(s.client_request(F, 2, "svc", 0.002, payload=2), Dispatch)
    s.client_request(F, 3, "svc", 0.003, payload=3)
    s.client_cancel(F, 2, 0.004)  # at the worker: cancelling
    assert not of(s.client_request(L, 1, "svc", 0.01, payload=1), RecallAtWorker)


class _Looked(dict):
    """A service's ``deep`` set that counts the workers looked at through it."""

    n = 0

    def __iter__(self):
        for w in super().__iter__():
            _Looked.n += 1
            yield w


def _deep_looked_at(s, events) -> int:
    for svc in s._services.values():
        svc.deep = _Looked(svc.deep)
    _Looked.n = 0
    events()
    return _Looked.n


def _cross_host(deep_workers):
    """Workers of host a, each full of host a's shared-memory requests (more queued), and
    idle workers of host b (they cannot map them); every request has run long."""
    s = Scheduler(Config(max_queue=1 << 20, max_client_requests=1 << 20))
    shm = frozenset({"inline", "shm"})
    for i in range(deep_workers):
        s.worker_ready(b"a%d" % i, "svc", 0.0, credit=4, recall=True, host="a", transports=shm)
    held = []
    for i in range(5 * deep_workers):
        held += of(s.client_request(C, i, "svc", 0.0, payload=i, local_host="a"), Dispatch)
    for i in range(4):
        s.worker_ready(b"b%d" % i, "svc", 0.0, credit=4, recall=True, host="b", transports=shm)
    assert not of(s.tick(1.0), RecallAtWorker)

    def events():  # each result of host a makes room for a queued request there
        for i in range(20):
            d = held.pop(0)
            out = s.worker_final(d.worker, d.token, 1.1 + i * 0.001, "r")
            assert only(out, ToClient) and not of(out, RecallAtWorker)
            held.append(only(out, Dispatch))
            s.client_request(C, 10_000 + i, "svc", 1.1 + i * 0.001, payload=i, local_host="a")
    return s, events


def _kept(deep_workers):
    """Workers running started batches (asked back once, kept), and as many idle ones
    serving a trickle of requests."""
    s = Scheduler(Config())
    for i in range(deep_workers):
        s.worker_ready(b"b%d" % i, "svc", 0.0, credit=2, recall=True)
    for i in range(2 * deep_workers):
        send(s, i, 0.0)
    for i in range(deep_workers):
        s.worker_ready(b"i%d" % i, "svc", 0.0, credit=2, recall=True)
    for rec in of(s.tick(1.0), RecallAtWorker):
        s.worker_returned(rec.worker, [], 1.0, kept=rec.tokens)

    def events():
        for i in range(20):
            d = only(send(s, 10_000 + i, 2.0 + i * 0.001), Dispatch)
            assert not of(s.worker_final(d.worker, d.token, 2.0005 + i * 0.001, "r"), RecallAtWorker)
    return s, events


def test_an_event_with_nothing_new_to_take_back_looks_at_no_deep_worker():
    # Found by the complexity hunt: with an idle worker beside deep ones, every event of the
    # service walked every deep worker and each one's requests, though nothing had changed
    # that could give an idle worker something: O(deep workers x credit) per event, 87 µs at
    # 100 deep workers, 325 µs at 400 (idle workers of another host, whose pools cannot
    # take the deep ones' shared-memory requests; or a pool's batches asked back and kept).
    # Now the look is made again only when something an idle worker could take may have
    # appeared (a worker newly deep or idle, a request dispatched to a deep one, the recall
    # timer), and a request that lands at a deep worker costs a look at that worker alone.
    for scenario in (_cross_host, _kept):
        looked = []
        for n in (8, 40):
            s, events = scenario(n)
            looked.append(_deep_looked_at(s, events))
        assert looked[0] == looked[1], (scenario.__name__, looked)


def test_given_back_by_age_it_never_goes_ahead_of_a_retry_at_the_front():
    """A retry goes back to the front of its FIFO and is served first (`_newest_first` and
    eviction count on that prefix); a request given back for a turn goes by age, but never
    ahead of one (a review: a worker that dies between the RECALL and its answer puts its
    retries there).  On the queue itself (no worker: nothing is dispatched meanwhile)."""
    s = Scheduler(Config())
    for i in (1, 2, 3, 4, 5):
        assert s.client_request(F, i, "svc", 0.001 * i, payload=i) == []
    svc = s._services["svc"]
    fifo = svc.classes[1][F]
    req = {r.payload: r for r in fifo}

    def put_back(i, **kw):
        s._take(req[i], False)
        s._enqueue(req[i], 0.01, **kw)

    put_back(3, front=True)  # a retry
    put_back(2, by_age=True)  # older than the retry: still behind it
    assert [r.payload for r in fifo] == [3, 1, 2, 4, 5]
    put_back(4, by_age=True)
    assert [r.payload for r in fifo] == [3, 1, 2, 4, 5]
    put_back(1, by_age=True)  # the oldest: right behind the retry
    assert [r.payload for r in fifo] == [3, 1, 2, 4, 5]
    put_back(5, front=True)
    put_back(4, by_age=True)  # newer than every one after the retries
    assert [r.payload for r in fifo] == [5, 3, 1, 2, 4]


def test_holding_takes_nothing_back():
    """`hold()` (a standalone broker's drain): a newcomer asks no turn, and a request given
    back is queued, not handed to the worker it was taken back for."""
    s, held = flooded()
    s.hold()
    assert s.client_request(L, 1, "svc", 0.01, payload="l1") == []  # no RECALL
    s, held = flooded()
    rec = only(s.client_request(L, 1, "svc", 0.01, payload="l1"), RecallAtWorker)
    s.hold()
    assert not of(s.worker_returned(W1, list(rec.tokens), 0.011), Dispatch)
    assert not of(s.worker_final(W1, held[0].token, 0.02, "r"), Dispatch)
    assert s.at_workers() == 6
