"""The streams load mode of `python -m bench run`: N frame streams (cameras), each sending a
frame every 1/F s through a latest-wins `AsyncStream`.

One scheduler task sends every stream's frames at their ticks (a heap of the next tick of
each stream), with open_loop's technique for precise send times: sleep until `spin_us`
before the due time, then yield to the loop until it is due.  A late scheduler sends every
tick already due at once, and each tick's lateness (actual `send()` time - intended tick) is
recorded, so a generator that cannot keep up says so (docs/bench.md, "Honest load
generation").  A frame's latency is capture to result: the time its result was received
minus its intended tick, so a frame that waited behind a busy stream is charged the wait.

Every clock is `time.perf_counter_ns()`, the harness's clock (CLOCK_MONOTONIC on Linux, so
system-wide): generator processes given the same `t0_ns` share one schedule.  Stream g (global index, 0 <= g < total_streams)
ticks at t0 + (g / total_streams + k) / fps, k = 0, 1, ... while the tick is before
t0 + duration_s: the cameras are spread evenly over the frame period.
"""
from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram

from bench.hist import HIGHEST_US, LOWEST_US, LatencyHistogram, ServerSplit
from client_sdk.errors import EndOfStream, InferenceError

__all__ = ["StreamsWindow", "streams_window", "merge", "detail", "stream_ticks"]

ERROR_SAMPLES = 5
# Per-stream histograms use 2 significant digits (1 % resolution): 2,560 counters instead of
# 17,408, so a thousand streams cost 20 MB rather than 140 MB; the overall histogram keeps 3.
STREAM_SIG_DIGITS = 2
_COUNTS = ("frames", "sent", "completed", "dropped", "failed")


def stream_histogram() -> LatencyHistogram:
    return LatencyHistogram(HdrHistogram(LOWEST_US, HIGHEST_US, STREAM_SIG_DIGITS))


def _stream_entry(g: int) -> dict:
    return {"stream": g, "frames": 0, "sent": 0, "completed": 0, "dropped": 0, "failed": 0,
            "latency_hist": stream_histogram()}


@dataclass
class StreamsWindow:
    hist: LatencyHistogram = field(default_factory=LatencyHistogram)      # result time - intended tick, per completed frame
    lateness: LatencyHistogram = field(default_factory=LatencyHistogram)  # send() time - intended tick, per tick
    split: ServerSplit = field(default_factory=ServerSplit)
    per_stream: list[dict] = field(default_factory=list)
    errors: int = 0          # failed frames, timeouts included
    timeouts: int = 0
    error_samples: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0   # max(last outcome, schedule end) - t0
    cpu_s: float = 0.0       # process CPU over the window (summed over merged processes)

    def note_error(self, msg: str, timeout: bool = False) -> None:
        self.errors += 1
        if timeout:
            self.timeouts += 1
        if len(self.error_samples) < ERROR_SAMPLES and msg not in self.error_samples:
            self.error_samples.append(msg)

    # HdrHistogram does not pickle (its counts are a ctypes array): the wire form encodes the
    # histograms (LatencyHistogram.encode), and pickling goes through it.
    def to_wire(self) -> dict:
        """A JSON-serialisable dict; `StreamsWindow.from_wire` is its inverse."""
        return {
            "hist": self.hist.encode(),
            "lateness": self.lateness.encode(),
            "split": {"sums": dict(self.split.sums), "counts": dict(self.split.counts),
                      "batches": {str(b): n for b, n in self.split.batches.items()}},
            "per_stream": [{**{k: e[k] for k in ("stream", *_COUNTS)}, "latency_hist": e["latency_hist"].encode()}
                           for e in self.per_stream],
            "errors": self.errors, "timeouts": self.timeouts, "error_samples": list(self.error_samples),
            "elapsed_s": self.elapsed_s, "cpu_s": self.cpu_s,
        }

    @classmethod
    def from_wire(cls, w: dict) -> "StreamsWindow":
        s = w["split"]
        split = ServerSplit(sums=dict(s["sums"]), counts=dict(s["counts"]),
                            batches={int(b): int(n) for b, n in s["batches"].items()})
        per = [{**{k: e[k] for k in ("stream", *_COUNTS)}, "latency_hist": LatencyHistogram.decode(e["latency_hist"])}
               for e in w["per_stream"]]
        return cls(hist=LatencyHistogram.decode(w["hist"]), lateness=LatencyHistogram.decode(w["lateness"]),
                   split=split, per_stream=per, errors=int(w["errors"]), timeouts=int(w["timeouts"]),
                   error_samples=list(w["error_samples"]), elapsed_s=float(w["elapsed_s"]),
                   cpu_s=float(w["cpu_s"]))

    def __getstate__(self) -> dict:
        return self.to_wire()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(StreamsWindow.from_wire(state).__dict__)


def stream_ticks(g: int, total_streams: int, fps: float, duration_s: float, t0_ns: int) -> list[int]:
    """The intended tick times (monotonic ns) of stream `g`: t0 + (g/total + k)/fps, k = 0, 1, ...,
    while before t0 + duration_s."""
    end = t0_ns + int(round(duration_s * 1e9))
    pos = g / total_streams
    period_ns = 1e9 / fps
    out = []
    k = 0
    while True:
        t = t0_ns + int(round((pos + k) * period_ns))
        if t >= end:
            return out
        out.append(t)
        k += 1


async def streams_window(client: Any, service: str, samples: list[dict], *, streams: int, fps: float,
                         duration_s: float, t0_ns: int | None = None, first_stream: int = 0,
                         total_streams: int | None = None, max_in_flight: int = 1,
                         timeout_s: float | None = 30.0, spin_us: float = 1000.0, reply: str = "auto",
                         drain_s: float = 5.0) -> StreamsWindow:
    """Run `streams` latest-wins streams (global indices first_stream ..) for one window.

    After the last tick every stream is finished and its outstanding frames get up to
    `drain_s` to come back; the streams are then closed.  A frame still in flight at that
    point counts as failed (a timeout); one still waiting to be sent counts as dropped; one
    whose deadline passed while it waited (never sent, the stream's `expired`) as failed."""
    if streams < 0 or fps <= 0 or duration_s <= 0:
        raise ValueError(f"need streams >= 0, fps > 0 and duration_s > 0 (got {streams}, {fps}, {duration_s})")
    if not samples:
        raise ValueError("no samples to send")
    total = streams if total_streams is None else int(total_streams)
    if first_stream < 0 or first_stream + streams > total:
        raise ValueError(f"streams {first_stream}..{first_stream + streams - 1} do not fit in {total} streams")
    cpu0 = time.process_time()
    if t0_ns is None:
        t0_ns = time.perf_counter_ns() + 20_000_000
    end_ns = t0_ns + int(round(duration_s * 1e9))
    spin_ns = int(spin_us * 1000)
    nsamples = len(samples)

    win = StreamsWindow(per_stream=[_stream_entry(first_stream + i) for i in range(streams)])
    ticks = [stream_ticks(first_stream + i, total, fps, duration_s, t0_ns) for i in range(streams)]
    intended: list[dict[int, int]] = [{} for _ in range(streams)]  # frame number -> tick, per stream
    got = [[0, 0] for _ in range(streams)]                           # results, errors seen by recv
    send_failed = [0] * streams
    last_ns = [end_ns]
    broken: list[BaseException] = []
    hist, lat = win.hist, win.lateness
    split = win.split

    strs = [client.stream(service, latest_wins=True, max_in_flight=max_in_flight, timeout=timeout_s, reply=reply)
            for _ in range(streams)]

    async def receive(i: int) -> None:
        s = strs[i]
        entry = win.per_stream[i]
        shist = entry["latency_hist"]
        frames = intended[i]
        counts = got[i]
        while True:
            try:
                res = await s.recv()
            except EndOfStream:
                return
            except Exception as e:  # the frame's error: InferenceError, DeadlineExceeded, ...
                before = counts[1] + counts[0]
                st = s.stats()
                # (`expired`: frames never sent, their deadline passed while they waited for
                # room; each fails in its turn.  Counted when it lapsed, maybe before its turn:
                # an error that is no frame's then passes for one, and the next ends the window.)
                if st.failed + st.completed + st.expired <= before:
                    raise  # not one frame's outcome (the client itself broke): stop the window
                counts[1] += 1
                last_ns[0] = max(last_ns[0], time.perf_counter_ns())
                win.note_error(f"{type(e).__name__}: {e}", isinstance(e, TimeoutError))
                continue
            now = time.perf_counter_ns()
            counts[0] += 1
            last_ns[0] = max(last_ns[0], now)
            due = frames.pop(res.frame, None)
            timing = res.timing
            res.release()
            if due is not None:
                hist.record_ns(now - due)
                shist.record_ns(now - due)
            split.add_timing(timing)

    def on_done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            broken.append(t.exception())

    loop = asyncio.get_running_loop()
    tasks = []
    try:
        for i in range(streams):
            t = loop.create_task(receive(i), name=f"bench-stream-{first_stream + i}")
            t.add_done_callback(on_done)
            tasks.append(t)

        heap = [(tk[0], i, 0) for i, tk in enumerate(ticks) if tk]
        heapq.heapify(heap)
        while heap:
            if broken:
                raise broken[0]
            due = heap[0][0]
            now = time.perf_counter_ns()
            if due > now:
                # Timers fire on a ~1 ms grid: sleep only up to spin_ns before the due time,
                # then yield in a tight loop (replies keep being read meanwhile).
                if due - now > spin_ns:
                    await asyncio.sleep((due - now - spin_ns) / 1e9)
                else:
                    await asyncio.sleep(0)
                continue
            # Everything already due goes out now, each tick's lateness against its own time.
            while heap and heap[0][0] <= now:
                due, i, k = heapq.heappop(heap)
                g = first_stream + i
                t_send = time.perf_counter_ns()
                lat.record_ns(t_send - due)
                try:
                    frame = strs[i].send(samples[(g + k) % nsamples])
                except InferenceError as e:  # packing failed (pool full, bad input): the tick is lost
                    send_failed[i] += 1
                    win.note_error(f"{type(e).__name__}: {e}")
                else:
                    intended[i][frame] = due
                if k + 1 < len(ticks[i]):
                    heapq.heappush(heap, (ticks[i][k + 1], i, k + 1))

        # Drain: no more frames; the outstanding ones get drain_s to come back.
        for s in strs:
            s.finish()
        if tasks:
            await asyncio.wait(tasks, timeout=drain_s)
        if broken:
            raise broken[0]
        for i, s in enumerate(strs):
            entry = win.per_stream[i]
            entry["frames"] = len(ticks[i])
            entry["sent"] = s.sent
            entry["completed"] = got[i][0]
            expired = s.stats().expired  # never sent (deadline passed waiting for room): failed
            undrained = s.sent + expired - got[i][0] - got[i][1]
            unsent = len(ticks[i]) - s.sent - s.dropped - expired - send_failed[i]
            entry["dropped"] = s.dropped + max(unsent, 0)
            entry["failed"] = got[i][1] + send_failed[i] + max(undrained, 0)
            for _ in range(max(undrained, 0)):
                win.note_error(f"no result within drain_s={drain_s:g} s after the last tick", timeout=True)
    finally:
        for s in strs:
            s.close()  # a waiting recv() ends with EndOfStream
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=1.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    win.elapsed_s = (max(last_ns[0], end_ns) - t0_ns) / 1e9
    win.cpu_s = time.process_time() - cpu0
    return win


def merge(wins: list[StreamsWindow]) -> StreamsWindow:
    """Windows of one level, from one or several generator processes, as one.

    Histograms, counts and the split add up; per_stream entries with the same global index
    are summed, the rest concatenated in index order.  Measured time: windows covering the
    same set of streams are consecutive windows (their elapsed_s add up); groups covering
    different streams ran side by side in different processes (the longest counts).  CPU
    adds up."""
    out = StreamsWindow()
    by_stream: dict[int, dict] = {}
    group_elapsed: dict[frozenset, float] = {}
    for w in wins:
        out.hist.add(w.hist)
        out.lateness.add(w.lateness)
        out.split.merge(w.split)
        out.errors += w.errors
        out.timeouts += w.timeouts
        out.cpu_s += w.cpu_s
        for msg in w.error_samples:
            if len(out.error_samples) < ERROR_SAMPLES and msg not in out.error_samples:
                out.error_samples.append(msg)
        key = frozenset(e["stream"] for e in w.per_stream)
        group_elapsed[key] = group_elapsed.get(key, 0.0) + w.elapsed_s
        for e in w.per_stream:
            acc = by_stream.get(e["stream"])
            if acc is None:
                acc = by_stream[e["stream"]] = _stream_entry(e["stream"])
            for k in _COUNTS:
                acc[k] += e[k]
            acc["latency_hist"].add(e["latency_hist"])
    out.per_stream = [by_stream[g] for g in sorted(by_stream)]
    out.elapsed_s = max(group_elapsed.values(), default=0.0)
    return out


def detail(win: StreamsWindow | list[StreamsWindow], fps: float, slo_ms: float) -> dict:
    """The report's `streams_detail` (docs/bench.md)."""
    if isinstance(win, list):
        win = merge(win)
    secs = win.elapsed_s
    frames = sum(e["frames"] for e in win.per_stream)
    dropped = sum(e["dropped"] for e in win.per_stream)
    per = []
    for e in win.per_stream:
        h = e["latency_hist"]
        per.append({"stream": e["stream"], **{k: e[k] for k in _COUNTS},
                    "achieved_fps": round(e["completed"] / secs, 3) if secs > 0 else 0.0,
                    "p50_ms": h.percentile_ms(50) if h.count else None,
                    "p99_ms": h.percentile_ms(99) if h.count else None})
    within = win.hist.count_at_or_below_ms(slo_ms) if win.hist.count else 0
    return {
        "drop_rate": dropped / frames if frames else 0.0,
        "achieved_fps": round(sum(p["achieved_fps"] for p in per) / len(per), 3) if per else 0.0,
        "stream_equivalents": round(within / secs / fps, 4) if secs > 0 and fps > 0 else 0.0,
        "per_stream": per,
    }
