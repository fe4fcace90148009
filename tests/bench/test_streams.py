"""The streams load mode (bench/streams.py) against a real broker and worker: frames are
scheduled, sent, matched to their results and accounted (sent, completed, dropped); a
model slower than the frame period drops frames and caps the achieved fps; detail() and
merge() agree with the windows; a window survives pickling (generator processes)."""
from __future__ import annotations

import asyncio
import pickle
import time

import numpy as np
import pytest

from bench.streams import StreamsWindow, detail, merge, stream_ticks, streams_window
from client_sdk import AsyncClient
from tests.e2e.conftest import Cluster


def _cluster(tmp_path, model: str, *worker_args: str) -> Cluster:
    """A broker and one worker (tests/e2e/conftest.py's processes: READY waited for, reaped)."""
    c = Cluster(tmp_path)
    try:
        c.broker()
        c.worker(model, *worker_args)
    except BaseException:
        c.close()
        raise
    return c


@pytest.fixture
def echo_cluster(tmp_path):
    c = _cluster(tmp_path, "echo")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def slow_cluster(tmp_path):
    c = _cluster(tmp_path, "tests.bench.slow_model:factory", "--max-batch", "1")
    try:
        yield c
    finally:
        c.close()


SAMPLES = [{"x": np.full(16, i, np.uint8)} for i in range(3)]


def test_ticks_spread_streams_over_the_period():
    t0 = 1_000_000_000
    a = stream_ticks(0, 4, 10.0, 1.0, t0)
    b = stream_ticks(1, 4, 10.0, 1.0, t0)
    assert len(a) == len(b) == 10
    assert a[0] == t0 and b[0] == t0 + 25_000_000  # a quarter of the 100 ms period
    assert all(y - x == 100_000_000 for x, y in zip(a, a[1:]))
    assert stream_ticks(3, 4, 10.0, 0.05, t0) == []  # its first tick (75 ms) is past the end


async def test_echo_streams_complete_every_frame(echo_cluster):
    async with AsyncClient(echo_cluster.frontend, timeout=10) as c:
        await c.infer("echo", SAMPLES[0], timeout=10)  # connected and served once
        async with asyncio.timeout(30):
            # Room for every frame in flight, so that no scheduling hiccup on a busy machine
            # drops one (latest wins): with 2, a stall of 180 ms dropped 9 of 30 (a fresh
            # clone's make test beside two other processes); drops are not what this checks.
            before = time.perf_counter_ns()
            win = await streams_window(c, "echo", SAMPLES, streams=2, fps=50.0, duration_s=0.6,
                                       max_in_flight=30, timeout_s=10.0, drain_s=5.0)
            wall_s = (time.perf_counter_ns() - before) / 1e9
    assert win.errors == win.timeouts == 0, win.error_samples
    assert [e["stream"] for e in win.per_stream] == [0, 1]
    for e in win.per_stream:
        assert e["frames"] == 30  # 0.6 s at 50 fps
        assert e["dropped"] == 0 and e["failed"] == 0
        assert e["sent"] == e["completed"] == e["frames"]
        assert e["latency_hist"].count == e["completed"]
    assert win.hist.count == 60
    assert win.lateness.count == 60
    # Bounds that hold however loaded the machine (timed ones, `p50 < 50 ms`, `elapsed_s <
    # 1.5`, measured the load): the window spans its whole schedule and lies inside the call,
    # and every frame was sent and answered inside the window (1 % for the histograms'
    # three significant digits).
    assert 0.6 <= win.elapsed_s <= wall_s
    assert 0 < win.hist.percentile_ms(50) <= win.hist.max_ms() <= win.elapsed_s * 1e3 * 1.01
    assert win.lateness.max_ms() <= win.elapsed_s * 1e3 * 1.01
    assert win.split.samples == 60
    assert win.cpu_s > 0

    d = detail(win, fps=50.0, slo_ms=1000.0)
    assert d["drop_rate"] == 0.0
    assert [p["stream"] for p in d["per_stream"]] == [0, 1]
    for p in d["per_stream"]:
        assert p["achieved_fps"] == pytest.approx(30 / win.elapsed_s, rel=1e-3)
        assert p["p50_ms"] is not None and p["p50_ms"] <= p["p99_ms"]
    assert d["achieved_fps"] == pytest.approx(30 / win.elapsed_s, rel=1e-3)
    # Every frame within a generous SLO: two streams' worth of completed frames per second.
    assert d["stream_equivalents"] == pytest.approx(60 / win.elapsed_s / 50.0, rel=1e-3)

    # Pickles (generator processes send windows back) and round-trips its wire form.
    back = pickle.loads(pickle.dumps(win))
    assert isinstance(back, StreamsWindow)
    assert back.hist.count == 60 and back.per_stream[1]["latency_hist"].count == 30
    assert back.split.batches == win.split.batches
    assert detail(back, 50.0, 1000.0) == d

    # Two windows of one level: counts and histograms add, measured time adds.
    m = merge([win, back])
    assert m.hist.count == 120 and m.lateness.count == 120
    assert [e["stream"] for e in m.per_stream] == [0, 1]
    assert all(e["frames"] == 60 and e["completed"] == 60 for e in m.per_stream)
    assert m.elapsed_s == pytest.approx(2 * win.elapsed_s)
    assert detail([win, back], 50.0, 1000.0)["achieved_fps"] == pytest.approx(d["achieved_fps"], rel=1e-3)


async def test_processes_share_one_schedule(echo_cluster):
    """Two generators given the same t0 and their halves of 4 streams: one merged window
    whose per-stream entries are the union, timed side by side (not added)."""
    async with AsyncClient(echo_cluster.frontend, timeout=10) as c:
        await c.infer("echo", SAMPLES[0], timeout=10)
        t0 = time.perf_counter_ns() + 20_000_000
        # Room for all 6 frames of a stream in flight: what is checked is how the windows
        # merge, and with the default 2 a loaded machine (an echo round trip over 100 ms,
        # CI) dropped frames, latest-wins, and 15 of the 24 completed.
        async with asyncio.timeout(30):
            a, b = await asyncio.gather(
                streams_window(c, "echo", SAMPLES, streams=2, fps=20.0, duration_s=0.3, t0_ns=t0,
                               first_stream=2, total_streams=4, timeout_s=10.0, max_in_flight=6),
                streams_window(c, "echo", SAMPLES, streams=2, fps=20.0, duration_s=0.3, t0_ns=t0,
                               first_stream=0, total_streams=4, timeout_s=10.0, max_in_flight=6))

        # A window cancelled midway closes its streams and leaves no task behind; the client
        # goes on serving.
        task = asyncio.create_task(streams_window(c, "echo", SAMPLES, streams=3, fps=100.0, duration_s=10.0))
        await asyncio.sleep(0.2)  # let it run a while; cancelling at any point must be clean
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("bench-stream-")]
        assert left == []
        with await c.infer("echo", SAMPLES[1], timeout=10) as r:
            assert r["x"][0] == 1
    m = merge([a, b])
    assert [e["stream"] for e in m.per_stream] == [0, 1, 2, 3]
    # 0.3 s at 20 fps: ticks at 0, 50, 100 ... 250 ms plus the stream's phase (12.5 ms steps).
    assert [e["frames"] for e in m.per_stream] == [6, 6, 6, 6]
    assert m.errors == m.timeouts == 0, m.error_samples
    assert [(e["dropped"], e["failed"]) for e in m.per_stream] == [(0, 0)] * 4
    assert sum(e["completed"] for e in m.per_stream) == 24 == m.hist.count
    assert m.elapsed_s == pytest.approx(max(a.elapsed_s, b.elapsed_s))
    assert m.cpu_s == pytest.approx(a.cpu_s + b.cpu_s)


async def test_slow_model_drops_frames(slow_cluster):
    async with AsyncClient(slow_cluster.frontend, timeout=10) as c:
        await c.infer("slow", SAMPLES[0], timeout=10)
        win = await streams_window(c, "slow", SAMPLES, streams=1, fps=60.0, duration_s=1.0,
                                   max_in_flight=1, timeout_s=10.0, drain_s=5.0)
    (e,) = win.per_stream
    assert win.errors == 0, win.error_samples
    assert e["frames"] == 60
    assert e["dropped"] > 0
    assert e["sent"] + e["dropped"] == e["frames"]
    assert e["completed"] == e["sent"]
    d = detail(win, fps=60.0, slo_ms=1000.0)
    # 50 ms a frame, one at a time: at most 20 results a second, whatever the 60 fps offered
    # (no lower bound: how many come back in the second is the machine's load).
    assert 0 < d["achieved_fps"] <= 21.0
    assert d["drop_rate"] == pytest.approx(e["dropped"] / 60)
    assert d["stream_equivalents"] == pytest.approx(e["completed"] / win.elapsed_s / 60.0, rel=1e-3)
    assert d["stream_equivalents"] < 0.4  # a fraction of one stream
    # Capture to result: at least the 50 ms the model takes; frames that waited pay more.
    assert win.hist.min_ms() >= 49.0
    # A tight SLO holds nothing.
    assert detail(win, fps=60.0, slo_ms=10.0)["stream_equivalents"] == 0.0
    assert win.split.means_ms()["compute"] >= 45.0

    # Cut the drain short: the frame in flight at the cut is a failed frame (a timeout), the
    # one still waiting to be sent a dropped one; every tick is accounted for.
    async with AsyncClient(slow_cluster.frontend, timeout=10) as c:
        async with asyncio.timeout(30):
            cut = await streams_window(c, "slow", SAMPLES, streams=1, fps=60.0, duration_s=0.2,
                                       max_in_flight=1, timeout_s=10.0, drain_s=0.0)
    (e,) = cut.per_stream
    assert e["failed"] >= 1 and cut.timeouts == cut.errors == e["failed"], cut.error_samples
    assert e["completed"] + e["failed"] == e["sent"]
    assert e["sent"] + e["dropped"] == e["frames"] == 12

    # A frame whose deadline passes while it waits for room is never sent and fails in its
    # turn (the stream's `expired`): one frame's outcome, counted failed, not the client
    # broken (before: `recv`'s DeadlineExceeded for it looked like no frame's outcome, and
    # the window raised it).  The loop stalls (a busy spell, as a loaded generator's) in
    # frame 1's send, while frame 0 holds the room, until frame 1's deadline has passed.
    class Stalling:
        def __init__(self, c):
            self.c = c

        def stream(self, *a, **kw):
            s = self.c.stream(*a, **kw)
            send = s.send

            def stalling_send(inputs):
                frame = send(inputs)
                if frame == 1:
                    assert s.stats().pending == 1
                    until = time.monotonic() + 0.15
                    while time.monotonic() < until:  # (the stall is the point: nothing runs meanwhile)
                        pass
                return frame

            s.send = stalling_send
            return s

    async with AsyncClient(slow_cluster.frontend, timeout=10) as c:
        async with asyncio.timeout(30):
            lapsed = await streams_window(Stalling(c), "slow", SAMPLES, streams=1, fps=1000.0, duration_s=0.002,
                                          max_in_flight=1, timeout_s=0.1, drain_s=5.0)
    (e,) = lapsed.per_stream
    assert (e["frames"], e["sent"], e["dropped"]) == (2, 1, 0), e
    assert e["completed"] + e["failed"] == 2 and e["failed"] >= 1, e
    assert any("never sent" in m for m in lapsed.error_samples), lapsed.error_samples
