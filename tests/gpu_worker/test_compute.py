"""gpu_worker.compute: whether a batch leaves the worker loop's thread (pure, seconds passed
in), and the compute thread that runs it and wakes the loop."""
from __future__ import annotations

import threading

import pytest
import zmq

from gpu_worker.compute import ComputeThread, ComputeTimes

pytestmark = pytest.mark.timeout(30)


def test_an_unknown_batch_size_is_offloaded():
    t = ComputeTimes(heartbeat_interval=1.0)
    assert t.predict(4) is None and t.offload(4)


def test_offload_when_longer_than_half_a_heartbeat_interval():
    t = ComputeTimes(heartbeat_interval=1.0)
    t.seed({1: 0.001, 8: 0.5, 16: 0.6})
    assert not t.offload(1)
    assert not t.offload(8)          # exactly half: stays on the loop's thread
    assert t.offload(16)
    assert t.offload(2)              # a size warm-up did not run


def test_measured_times_are_an_ewma_per_batch_size():
    t = ComputeTimes(heartbeat_interval=0.1)
    t.observe(2, 0.01)
    assert t.predict(2) == 0.01      # the first measurement is taken as is
    t.observe(2, 0.11)
    assert t.predict(2) == pytest.approx(0.8 * 0.01 + 0.2 * 0.11)
    assert not t.offload(2)          # 0.03 < 0.05
    for _ in range(10):
        t.observe(2, 0.2)
    assert t.offload(2)              # batches got slower: off the loop's thread now
    assert t.predict(3) is None


def test_warm_up_timings_replace_estimates_for_their_sizes_only():
    t = ComputeTimes(heartbeat_interval=1.0)
    t.observe(1, 0.9)
    t.observe(4, 0.9)
    t.seed({1: 0.001})
    assert t.predict(1) == 0.001 and t.predict(4) == 0.9


def test_the_compute_thread_runs_a_batch_and_wakes_the_loop():
    ctx = zmq.Context.instance()
    seen = []

    def run(jobs):
        seen.append(threading.current_thread().name)
        return [j * 2 for j in jobs]

    ct = ComputeThread(ctx, run)
    try:
        ct.submit([1, 2], 5.0)
        assert ct.done.poll(5000)
        jobs, started, outputs, error, seconds = ct.result()
        assert (jobs, started, outputs, error) == ([1, 2], 5.0, [2, 4], None) and seconds >= 0
        assert seen == ["compute"]

        def boom(jobs):
            raise ValueError("model failed")

        ct2 = ComputeThread(ctx, boom)
        try:
            ct2.submit([1], 0.0)
            assert ct2.done.poll(5000)
            _, _, outputs, error, _ = ct2.result()
            assert outputs is None and isinstance(error, ValueError)
        finally:
            ct2.close()
    finally:
        ct.close()


def test_the_compute_thread_keeps_nothing_of_a_batch_once_handed_over():
    # A batch's jobs view the clients' segments: kept by the thread until its next batch
    # (for good, once nothing is offloaded any more), they would keep the mappings, and of
    # clients that left, their memory.
    import gc
    import weakref

    class Job:
        pass

    ctx = zmq.Context.instance()
    ct = ComputeThread(ctx, lambda jobs: [None for _ in jobs])
    try:
        job = Job()
        ref = weakref.ref(job)
        ct.submit([job], 0.0)
        del job
        assert ct.done.poll(5000)
        out = ct.result()
        del out
        gc.collect()
        assert ref() is None, gc.get_referrers(ref()) if ref() is not None else None
    finally:
        ct.close()


def test_loop_heartbeats_go_out_only_while_the_loop_computes():
    import threading

    from gpu_worker.compute import LoopHeartbeats

    sent = threading.Event()
    last = [0.0]

    def send():
        last[0] = __import__("time").monotonic()
        sent.set()

    beats = LoopHeartbeats(send, lambda: last[0], interval=0.05)
    try:
        assert not sent.wait(0.3)  # the loop holds the socket: it heartbeats itself
        beats.computing_begin()
        assert sent.wait(5.0)      # computing: the thread keeps the broker informed
        beats.computing_end()      # and gives the socket back
        sent.clear()
        assert not sent.wait(0.3)
        assert beats.sent >= 1
    finally:
        beats.close()


def test_loop_heartbeats_look_seldom_while_the_worker_is_idle_and_often_once_it_computes():
    """After IDLE_AFTER with no batch begun the thread sleeps until a batch begins (half a
    heartbeat interval at most), not every READ_TICK nor at a fixed
    50 ms tick (20 a second, most of an idle worker's CPU: the idle hunt); a batch wakes it
    and brings the fast looks back.

    Counted, not timed as a rate over the wall clock: the thread says when it is idle
    (``_idle``), and a loaded machine only delays its looks (a rate measured from a fixed
    1.1 s after its start counted the fast looks of a thread started late)."""
    import time

    from gpu_worker.compute import IDLE_AFTER, LoopHeartbeats

    read = threading.Event()
    # a long interval: its half (the idle bound, 5 s) is longer than the windows below, so
    # that a look in them is not the idle timeout's
    beats = LoopHeartbeats(lambda: None, time.monotonic, interval=10.0, during=read.set)
    try:
        assert _wait_for(lambda: beats._idle, 10 * IDLE_AFTER), "the thread did not go idle"
        before = beats.looks
        threading.Event().wait(1.0)  # a window to count looks in (a duration, not a sync)
        assert beats.looks - before <= 1, beats.looks - before  # asleep: not 20 nor 100 a second
        beats.computing_begin()
        assert read.wait(10.0)  # computing: woken at once, it reads the socket again
        beats.computing_end()
        read.clear()
        # a batch just ran: back at READ_TICK for IDLE_AFTER, not idle after one look
        before = beats.looks
        assert _wait_for(lambda: beats.looks >= before + 3 or beats._idle, 10.0)
        assert beats.looks >= before + 3, (beats.looks - before, beats._idle)
    finally:
        beats.close()


class _Wire:
    """A PAIR pair standing in for the worker's upstream socket and the broker, and a
    `during` that drains the worker's side as `Worker._read_while_computing` does (EVENTS
    until none, then the quiet socket's descriptor to sleep on), noting when each message
    was read and when each look was made."""

    def __init__(self, name: str, on_look=None):
        from broker.protocol.wire import Waiter

        self.ctx = zmq.Context.instance()
        self.broker = self.ctx.socket(zmq.PAIR)
        self.broker.linger = 0
        addr = f"inproc://{name}-{id(self)}"
        self.broker.bind(addr)
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.connect(addr)
        self.waiter = Waiter()     # watched, as the worker loop's Waiter watches its upstream
        self.waiter.add(self.sock)
        self.read: list[tuple[bytes, float]] = []
        self.looks: list[float] = []
        self.got = threading.Event()
        self.on_look = on_look

    def during(self):
        import time

        from broker.protocol.wire import quiet_fd, recv_frames, sock_events

        self.looks.append(time.monotonic())
        if self.on_look is not None:
            self.on_look(len(self.looks))
        n = 0
        while sock_events(self.sock) & zmq.POLLIN:
            self.read.append((bytes(recv_frames(self.sock)[0]), time.monotonic()))
            n += 1
            self.got.set()
        fd = quiet_fd(self.sock)
        return n, [] if fd is None else [fd]

    def close(self) -> None:
        self.waiter.close()
        self.sock.close()
        self.broker.close()


def _slow_ticks_after(n: int, monkeypatch):
    """An `on_look` that makes READ_TICK 30 s at the n-th look: from the sleep after the
    next one on (the thread reads the tick before it looks), a look that comes within 30 s
    was woken by something else (an arrival, the bell)."""
    from gpu_worker import compute

    def on_look(k: int) -> None:
        if k == n:
            monkeypatch.setattr(compute, "READ_TICK", 30.0)
    return on_look


def _wait_for(cond, seconds: float = 5.0) -> bool:
    ev = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if cond():
            return True
        ev.wait(0.01)
    return cond()


def test_during_a_batch_an_arrival_is_read_as_it_comes_not_at_the_next_tick(monkeypatch):
    """After a look during compute the heartbeat thread sleeps on the drained socket's
    descriptor (edge-triggered: the EVENTS that found it empty arms it), so a message that
    arrives is read and stamped at once, not READ_TICK later (30 s here), and so is the next
    one (the look's EVENTS arms it again)."""
    from gpu_worker.compute import LoopHeartbeats

    wire = _Wire("arrival", on_look=_slow_ticks_after(1, monkeypatch))
    beats = LoopHeartbeats(lambda: None, lambda: float("inf"), interval=100.0, during=wire.during)
    try:
        beats.computing_begin()
        assert _wait_for(lambda: len(wire.looks) >= 2)  # the sleep after it: 30 s, or until a message
        for k in (b"a", b"b"):
            wire.got.clear()
            wire.broker.send(k)
            assert wire.got.wait(5.0), f"{k!r} not read during compute"
            assert wire.read[-1][0] == k
        assert beats.woken >= 2
        beats.computing_end()
    finally:
        beats.close()
        wire.close()


def test_arrivals_during_a_batch_wake_the_thread_read_gap_apart_at_most_often(monkeypatch):
    """A flood during a batch: the thread takes the GIL (and the socket) no more often than
    every READ_GAP, reading what came meanwhile in one go."""
    import time

    from gpu_worker.compute import READ_GAP, LoopHeartbeats

    wire = _Wire("gap", on_look=_slow_ticks_after(1, monkeypatch))
    beats = LoopHeartbeats(lambda: None, lambda: float("inf"), interval=100.0, during=wire.during)
    try:
        beats.computing_begin()
        assert _wait_for(lambda: len(wire.looks) >= 2)
        start = len(wire.looks)
        end = time.monotonic() + 0.2
        sent = 0
        while time.monotonic() < end:   # a rate, not a sync: as fast as this thread can send
            wire.broker.send(b"%d" % sent)
            sent += 1
        assert _wait_for(lambda: len(wire.read) == sent)
        beats.computing_end()
        looks = wire.looks[start - 1:]
        gaps = [b - a for a, b in zip(looks, looks[1:])]
        assert gaps and min(gaps) >= READ_GAP * 0.999, (min(gaps), len(gaps), sent)
        assert len(looks) - 1 < sent  # several messages a look
    finally:
        beats.close()
        wire.close()


def test_after_arrivals_during_batches_the_next_batch_rings_and_a_lone_client_never_does(monkeypatch):
    """A batch begun while the loop holds the socket is seen at the next tick; once batches
    see arrivals, `computing_begin` rings the thread's bell instead, so it looks at the
    batch's start (30 s ticks here: only the bell can bring that look).  Batches that see no
    arrival (a lone client) never ring."""
    from gpu_worker.compute import LoopHeartbeats

    wire = _Wire("ring", on_look=_slow_ticks_after(1, monkeypatch))
    beats = LoopHeartbeats(lambda: None, lambda: float("inf"), interval=100.0, during=wire.during)
    try:
        beats.computing_begin()
        assert _wait_for(lambda: len(wire.looks) >= 2)
        assert not beats._ring           # no arrival yet: nothing to ring for
        wire.broker.send(b"x")
        assert wire.got.wait(5.0)
        assert _wait_for(lambda: len(wire.looks) >= 3)
        beats.computing_end()
        # the look that read "x" was woken by it, in a batch already looked at: rings now
        assert beats._ring
        looks = len(wire.looks)
        beats.computing_begin()          # the next batch
        assert _wait_for(lambda: len(wire.looks) > looks), "the batch's start was not looked at"
        assert beats.rung >= 1
        beats.computing_end()
    finally:
        beats.close()
        wire.close()

    lone = _Wire("lone")
    monkeypatch.setattr("gpu_worker.compute.READ_TICK", 0.01)
    beats = LoopHeartbeats(lambda: None, lambda: float("inf"), interval=100.0, during=lone.during)
    try:
        for i in range(3):   # batches, each looked at, no message arriving during any
            beats.computing_begin()
            assert _wait_for(lambda: len(lone.looks) >= i + 1)
            beats.computing_end()
            assert not beats._ring and beats.rung == 0
            lone.broker.send(b"between")  # the loop's: arrives while it holds the socket
        assert not beats._ring and beats.rung == 0
    finally:
        beats.close()
        lone.close()


def test_ringing_stops_once_batches_see_no_work_and_the_thread_goes_idle(monkeypatch):
    """Work during a batch makes the next batches ring for RING_FOR; then, with no batch at
    all, the ring lapses and the thread goes idle (sleeps until a batch begins) as before:
    a worker that once saw traffic does not keep waking every READ_TICK."""
    from gpu_worker import compute
    from gpu_worker.compute import LoopHeartbeats

    monkeypatch.setattr(compute, "RING_FOR", 0.05)
    monkeypatch.setattr(compute, "IDLE_AFTER", 0.1)
    wire = _Wire("lapse", on_look=_slow_ticks_after(1, monkeypatch))
    beats = LoopHeartbeats(lambda: None, lambda: float("inf"), interval=100.0, during=wire.during)
    try:
        beats.computing_begin()
        assert _wait_for(lambda: len(wire.looks) >= 2)
        wire.broker.send(b"x")
        assert _wait_for(lambda: len(wire.read) == 1 and len(wire.looks) >= 3)
        beats.computing_end()
        assert beats._ring
        monkeypatch.setattr(compute, "READ_TICK", 0.01)  # looks again, each finding the socket taken,
        wire.broker.send(b"y")                            # from this message's wake on
        assert _wait_for(lambda: not beats._ring and beats._idle), (beats._ring, beats._idle)
    finally:
        beats.close()
        wire.close()
