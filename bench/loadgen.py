"""Load generation: closed and open loops, measurement windows, interleaved comparisons.

Everything runs on one asyncio loop (uvloop when installed). Latency is measured with
time.perf_counter_ns. In the open loop it is measured from each request's *intended* send
time, so a stall in the target (or in this process) shows up as the latencies of every
request that should have been sent during it, not as one slow sample: no coordinated
omission.

A peer's blocking client (`request_sync`) is measured by `closed_loop_sync`: back-to-back
calls on the caller's thread, no event loop running (see `measure_interleaved_sync`).
"""
from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection

import numpy as np

from bench.hist import LatencyHistogram, ServerSplit, ServerTiming, converged

RequestFn = Callable[[Any], Awaitable[dict | None]]
SyncRequestFn = Callable[[Any], dict | None]  # a blocking client: request_sync(payload)

ERROR_SAMPLES = 5  # distinct error messages kept per window, for the report


# ---------------------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------------------
_ALIASES = {
    "tiny": "16",
    "frame": "1080x1920x3",
    "6mb": "1080x1920x3",
    "64mb": "64m",
}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


@dataclass(frozen=True)
class PayloadSpec:
    nbytes: int
    shape: tuple[int, ...]
    label: str


def parse_size(text: str) -> PayloadSpec:
    """'16', '4k', '64MiB', '1080x1920x3' (uint8 HxWxC), or an alias (tiny, frame, 64mb).

    k/m/g are binary (KiB, MiB, GiB) with optional 'b'/'ib'/'i' after them."""
    t = text.strip().lower()
    t = _ALIASES.get(t, t)
    if "x" in t:
        shape = tuple(int(d) for d in t.split("x"))
        if any(d <= 0 for d in shape):
            raise ValueError(f"bad shape {text!r}")
        return PayloadSpec(int(np.prod(shape)), shape, "x".join(map(str, shape)))
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:ib|i|b)?", t)
    if not m:
        raise ValueError(f"cannot parse payload size {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"payload size must be positive: {text!r}")
    return PayloadSpec(n, (n,), human_bytes(n))


def human_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n}B"


def make_payload(spec: PayloadSpec, seed: int = 0) -> np.ndarray:
    """Random bytes (not zeros: zero pages can be mapped lazily and would make the first
    send pay the page faults), generated once and reused for every request."""
    rng = np.random.default_rng(seed)
    return np.frombuffer(rng.bytes(spec.nbytes), dtype=np.uint8).reshape(spec.shape).copy()


def runner(use_uvloop: bool) -> tuple[asyncio.Runner, str]:
    """An asyncio.Runner on uvloop when it is installed and wanted, and the loop's name."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return asyncio.Runner(loop_factory=uvloop.new_event_loop), "uvloop"
    return asyncio.Runner(), "asyncio"


# ---------------------------------------------------------------------------------------
# One measurement window
# ---------------------------------------------------------------------------------------
@dataclass
class WindowResult:
    hist: LatencyHistogram
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    elapsed_s: float = 0.0
    server: ServerTiming = field(default_factory=ServerTiming)
    error_samples: list[str] = field(default_factory=list)
    # Open loop only: how late the generator itself sent requests (its own health): the
    # worst, and every request's lateness (when it went out - its intended send time).
    max_send_lag_ms: float = 0.0
    lateness: LatencyHistogram | None = None
    split: ServerSplit | None = None  # bench run: queue/batch wait/.../batch sizes
    served: int = 0  # bench run: successful replies that arrived during this window

    @property
    def p50_ms(self) -> float:
        return self.hist.percentile_ms(50) if self.hist.count else math.nan

    def _note_error(self, e: BaseException | str) -> None:
        self.errors += 1
        msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        if len(self.error_samples) < ERROR_SAMPLES and msg not in self.error_samples:
            self.error_samples.append(msg)


async def _one(request: RequestFn, payload: Any, start_ns: int, res: WindowResult,
               timeout_s: float | None) -> bool:
    """Issue one request; latency = completion - start_ns (start_ns is the intended time in
    the open loop, the actual send time in the closed loop).  With `res.lateness`, how late
    the request really started against start_ns is recorded here, as it goes out (not when
    its task was created: in a burst of catch-up launches the last ones start latest).
    True when it succeeded (and was recorded)."""
    if res.lateness is not None:
        lag = time.perf_counter_ns() - start_ns
        res.lateness.record_ns(lag)
        # The worst too, from the same moment (it read the task's creation: the bench math hunt).
        res.max_send_lag_ms = max(res.max_send_lag_ms, lag / 1e6)
    try:
        if timeout_s is None:
            reply = await request(payload)
        else:
            async with asyncio.timeout(timeout_s):
                reply = await request(payload)
    except TimeoutError:
        res.timeouts += 1
        res._note_error(f"timeout after {timeout_s} s")
        return False
    except asyncio.CancelledError:
        raise
    except Exception as e:
        res._note_error(e)
        return False
    end = time.perf_counter_ns()
    if reply:
        err = reply.get("error")
        if err:
            res._note_error(str(err))
            return False
        res.server.add_reply(reply)
        if res.split is not None:
            res.split.add_timing(reply)
    res.hist.record_ns(end - start_ns)
    res.ok += 1
    return True


async def closed_loop(request: RequestFn, payload: Any, *, concurrency: int, duration_s: float,
                      min_requests: int = 1, max_duration_s: float | None = None,
                      timeout_s: float | None = None) -> WindowResult:
    """`concurrency` coroutines, each sending its next request when the previous returns.

    Stops issuing at `duration_s`, but not before `min_requests` were issued (large payloads
    on slow peers would otherwise give windows of one sample), and never after
    `max_duration_s` (default 10x duration, at least 1 s)."""
    res = WindowResult(LatencyHistogram())
    start = time.perf_counter_ns()
    soft = start + int(duration_s * 1e9)
    if max_duration_s is None:
        max_duration_s = max(10 * duration_s, 1.0)
    hard = start + int(max_duration_s * 1e9)
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while True:
            now = time.perf_counter_ns()
            if now >= hard or (now >= soft and issued >= min_requests):
                return
            issued += 1
            await _one(request, payload, time.perf_counter_ns(), res, timeout_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    res.elapsed_s = (time.perf_counter_ns() - start) / 1e9
    return res


def _one_sync(request_sync: SyncRequestFn, payload: Any, res: WindowResult,
              timeout_s: float | None) -> bool:
    """One blocking call, timed with perf_counter_ns around it; True when it succeeded.

    A blocking call cannot be interrupted from outside: the client's own timeout applies
    (a TimeoutError it raises counts as a timeout), and a call that returns after more than
    `timeout_s` is counted as a timeout (an error, not a latency), as in the async loop."""
    start = time.perf_counter_ns()
    try:
        reply = request_sync(payload)
    except TimeoutError as e:
        res.timeouts += 1
        res._note_error(e)
        return False
    except Exception as e:
        res._note_error(e)
        return False
    end = time.perf_counter_ns()
    if timeout_s is not None and end - start > timeout_s * 1e9:
        res.timeouts += 1
        res._note_error(f"timeout after {timeout_s} s")
        return False
    if reply:
        err = reply.get("error")
        if err:
            res._note_error(str(err))
            return False
        res.server.add_reply(reply)
    res.hist.record_ns(end - start)
    res.ok += 1
    return True


def closed_loop_sync(request_sync: SyncRequestFn, payload: Any, *, duration_s: float,
                     min_requests: int = 1, max_duration_s: float | None = None,
                     timeout_s: float | None = None) -> WindowResult:
    """The blocking closed loop: `request_sync(payload)` back to back on this thread (one
    request in flight), with the same window rules as `closed_loop` (stops issuing at
    `duration_s`, not before `min_requests`, never after `max_duration_s`, default 10x
    duration, at least 1 s).  Meant to run with no event loop running: called from a
    coroutine it blocks that loop for the whole window.  `timeout_s`: see `_one_sync`."""
    res = WindowResult(LatencyHistogram())
    start = time.perf_counter_ns()
    soft = start + int(duration_s * 1e9)
    if max_duration_s is None:
        max_duration_s = max(10 * duration_s, 1.0)
    hard = start + int(max_duration_s * 1e9)
    issued = 0
    while True:
        now = time.perf_counter_ns()
        if now >= hard or (now >= soft and issued >= min_requests):
            break
        issued += 1
        _one_sync(request_sync, payload, res, timeout_s)
    res.elapsed_s = (time.perf_counter_ns() - start) / 1e9
    return res


def intended_offsets_ns(rate: float, duration_s: float, arrival: str = "constant",
                        seed: int = 0) -> np.ndarray:
    """Send times (ns after t0) of an open-loop schedule: i/R, or Poisson arrivals (i.i.d.
    exponential gaps, mean 1/R) from a seeded RNG so every peer gets the same schedule."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    horizon = int(duration_s * 1e9)
    if arrival == "constant":
        n = int(math.ceil(duration_s * rate))
        t = (np.arange(n, dtype=np.float64) * (1e9 / rate)).astype(np.int64)
    elif arrival == "poisson":
        rng = np.random.default_rng(seed)
        # Draw a generous batch; the tail past the horizon is cut below.
        n = int(duration_s * rate + 10 * math.sqrt(duration_s * rate + 1) + 10)
        t = np.cumsum(rng.exponential(1e9 / rate, size=n)).astype(np.int64)
        t -= t[0]  # first request at t0, like the constant schedule
    else:
        raise ValueError(f"arrival must be 'constant' or 'poisson', not {arrival!r}")
    return t[t < horizon]


async def _sleep_until(t_ns: int) -> None:
    while True:
        left = t_ns - time.perf_counter_ns()
        if left <= 0:
            return
        await asyncio.sleep(left / 1e9 if left > 1_000_000 else 0)


async def open_loop(request: RequestFn, payload: Any, *, rate: float, duration_s: float,
                    arrival: str = "constant", seed: int = 0,
                    timeout_s: float | None = None, spin_us: float = 1000.0,
                    t0_ns: int | None = None, part: tuple[int, int] = (0, 1)) -> WindowResult:
    """Launch request i as its own task at t0 + offset_i (or as soon as possible after, if
    the loop was late) and record completion - (t0 + offset_i).

    `spin_us`: the last stretch before a due time is waited by yielding to the loop rather
    than by a timer, trading CPU for send-time precision (0: timers only).  `t0_ns`
    (perf_counter_ns; default now) and `part=(j, n)`: this generator sends requests j, j+n,
    j+2n, ... of the schedule, so n processes given the same t0 share one schedule exactly.
    Every request's lateness (the moment it really went out, less its intended time) goes
    into the result's `lateness`, the worst into `max_send_lag_ms`."""
    res = WindowResult(LatencyHistogram(), lateness=LatencyHistogram())
    offsets = _part(intended_offsets_ns(rate, duration_s, arrival, seed), part)
    t0 = time.perf_counter_ns() if t0_ns is None else t0_ns

    def launch(off: int, now: int):
        return _one(request, payload, t0 + off, res, timeout_s)

    await _follow_schedule(offsets, t0, int(spin_us * 1000), launch)
    end = time.perf_counter_ns()
    res.elapsed_s = max((end - t0) / 1e9, duration_s)
    return res


def _part(offsets: np.ndarray, part: tuple[int, int]) -> np.ndarray:
    """Generator j of n sends requests j, j+n, j+2n, ... of one schedule."""
    j, nparts = part
    return offsets[j::nparts] if nparts > 1 else offsets


async def _follow_schedule(offsets: np.ndarray, t0: int, spin_ns: int, launch) -> None:
    """Run `launch(offset, now)` (a coroutine, as its own task) for every offset at t0 +
    offset, or as soon as possible after when the loop was late; then wait for them all."""
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    i, n = 0, len(offsets)
    while i < n:
        due = t0 + int(offsets[i])
        now = time.perf_counter_ns()
        if due > now:
            # Event-loop timers fire on a ~1 ms grid (libuv and epoll both round to ms), and
            # every bit of lateness is charged to the request. So sleep only up to `spin_ns`
            # before the due time, then yield in a tight loop (I/O keeps being served).
            await asyncio.sleep((due - now - spin_ns) / 1e9 if due - now > spin_ns else 0)
            continue
        # Catch up: everything already due goes out now, each timed from its own due time.
        while i < n and t0 + int(offsets[i]) <= now:
            task = loop.create_task(launch(int(offsets[i]), now))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
    if tasks:
        await asyncio.gather(*tasks)


# ---------------------------------------------------------------------------------------
# One load level as continuous windows (bench run)
# ---------------------------------------------------------------------------------------
def _window_of(offset_ns: int, warmup_ns: int, window_ns: int, windows: int) -> int:
    """-1 for warm-up, else the index of the window `offset_ns` (after the start) falls in."""
    if offset_ns < warmup_ns:
        return -1
    return min(int((offset_ns - warmup_ns) // window_ns), windows - 1)


def _finish_windows(results: list[WindowResult], window_s: float, t_last_start_ns: int | None) -> None:
    """Each window lasted window_s; with `t_last_start_ns` (open loop) the last one also holds
    the tail, the replies to its requests that came after its end, so that the level's
    throughput (successes over the windows' time) is what was served, not what was offered."""
    for r in results:
        r.elapsed_s = window_s
    if t_last_start_ns is not None:
        results[-1].elapsed_s = max(window_s, (time.perf_counter_ns() - t_last_start_ns) / 1e9)


async def _counted(request: RequestFn, payload: Any, start_ns: int, res: WindowResult,
                   timeout_s: float | None, results: list[WindowResult], m0: int, win_ns: int,
                   tail: bool = False) -> None:
    """_one, and a success also counted as served in the window its reply arrived in
    (``tail``, the open loop: one after the last window in the last, whose time holds the
    tail: `_finish_windows`; left out, an overloaded level's last window read a third of
    what was served: the bench hunt)."""
    if await _one(request, payload, start_ns, res, timeout_s):
        k = (time.perf_counter_ns() - m0) // win_ns
        if tail and k >= len(results):
            k = len(results) - 1
        if 0 <= k < len(results):
            results[k].served += 1


async def closed_loop_windows(request: RequestFn, payload: Any, *, concurrency: int, warmup_s: float,
                              window_s: float, windows: int, timeout_s: float | None = None,
                              start_ns: int | None = None) -> list[WindowResult]:
    """`concurrency` coroutines run without a pause through a warm-up and `windows` windows;
    each request lands in the window its send time falls in (warm-up ones are dropped), so
    no window starts from an empty system.  Issuing stops at the end of the last window."""
    if start_ns is not None:
        await _sleep_until(start_ns)
    results = [WindowResult(LatencyHistogram(), split=ServerSplit()) for _ in range(windows)]
    warm = WindowResult(LatencyHistogram())
    warm_ns, win_ns = int(warmup_s * 1e9), int(window_s * 1e9)
    t0 = time.perf_counter_ns()
    m0 = t0 + warm_ns
    end = m0 + windows * win_ns

    async def worker() -> None:
        while (now := time.perf_counter_ns()) < end:
            k = _window_of(now - t0, warm_ns, win_ns, windows)
            await _counted(request, payload, now, warm if k < 0 else results[k], timeout_s,
                           results, m0, win_ns)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    # Closed loop: requests started in a window count there, so it lasted window_s (the
    # tail of the last balances the warm-up's replies that came in the first).
    _finish_windows(results, window_s, None)
    return results


async def open_loop_windows(request: RequestFn, payload: Any, *, rate: float, warmup_s: float,
                            window_s: float, windows: int, arrival: str = "constant", seed: int = 0,
                            timeout_s: float | None = None, spin_us: float = 1000.0,
                            t0_ns: int | None = None, part: tuple[int, int] = (0, 1)) -> list[WindowResult]:
    """One open-loop schedule over a warm-up and `windows` windows, no pause between them (a
    backlog built in one window is still there in the next); each request lands in the
    window its *intended* send time falls in, timed from that time.  `t0_ns` and `part` as
    in `open_loop`.  Every request's lateness is in its window's `lateness`."""
    warm_ns, win_ns = int(warmup_s * 1e9), int(window_s * 1e9)
    offsets = _part(intended_offsets_ns(rate, warmup_s + windows * window_s, arrival, seed), part)
    results = [WindowResult(LatencyHistogram(), lateness=LatencyHistogram(), split=ServerSplit())
               for _ in range(windows)]
    warm = WindowResult(LatencyHistogram())
    t0 = time.perf_counter_ns() if t0_ns is None else t0_ns

    def launch(off: int, now: int):
        k = _window_of(off, warm_ns, win_ns, windows)
        res = warm if k < 0 else results[k]
        return _counted(request, payload, t0 + off, res, timeout_s, results, t0 + warm_ns, win_ns, tail=True)

    await _follow_schedule(offsets, t0, int(spin_us * 1000), launch)
    _finish_windows(results, window_s, t0 + warm_ns + (windows - 1) * win_ns)
    return results


# ---------------------------------------------------------------------------------------
# Workloads, windows until stable, interleaved peers
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    payload: PayloadSpec
    mode: str = "closed"  # "closed" | "open"
    concurrency: int = 1
    rate: float | None = None
    arrival: str = "constant"

    @property
    def key(self) -> str:
        load = f"c{self.concurrency}" if self.mode == "closed" else f"r{self.rate:g}{self.arrival[0]}"
        return f"{self.payload.label}_{load}"

    def describe(self) -> str:
        if self.mode == "closed":
            return f"{self.payload.label} x{self.concurrency}"
        return f"{self.payload.label} @{self.rate:g}/s {self.arrival}"


@dataclass
class RunConfig:
    window_s: float = 1.0
    warmup_s: float = 0.5
    stable_windows: int = 3  # this many consecutive windows ...
    tolerance: float = 0.10  # ... whose p50s agree within this fraction
    max_duration_s: float = 30.0  # per workload, all peers together
    min_requests: int = 3  # per closed-loop window
    timeout_s: float | None = 30.0
    seed: int = 1
    spin_us: float = 1000.0  # open loop: see open_loop()


@dataclass
class Measurement:
    """All windows of one peer on one workload, merged."""

    peer: str
    workload: Workload
    hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    server: ServerTiming = field(default_factory=ServerTiming)
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    elapsed_s: float = 0.0
    window_p50_ms: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    converged: bool = False
    max_send_lag_ms: float = 0.0
    blocking: bool = False  # measured through the peer's blocking client (closed_loop_sync)

    def add(self, w: WindowResult) -> None:
        self.hist.add(w.hist)
        self.server.merge(w.server)
        self.ok += w.ok
        self.errors += w.errors
        self.timeouts += w.timeouts
        self.elapsed_s += w.elapsed_s
        self.window_p50_ms.append(w.p50_ms)
        self.max_send_lag_ms = max(self.max_send_lag_ms, w.max_send_lag_ms)
        for e in w.error_samples:
            if len(self.error_samples) < ERROR_SAMPLES and e not in self.error_samples:
                self.error_samples.append(e)


async def run_window(request: RequestFn, payload: Any, wl: Workload, cfg: RunConfig,
                     duration_s: float, window_index: int) -> WindowResult:
    if wl.mode == "closed":
        return await closed_loop(request, payload, concurrency=wl.concurrency,
                                 duration_s=duration_s, min_requests=cfg.min_requests,
                                 timeout_s=cfg.timeout_s)
    # Same seed per window index: in round r every peer sees the identical arrival sequence.
    return await open_loop(request, payload, rate=wl.rate, duration_s=duration_s,
                           arrival=wl.arrival, seed=cfg.seed * 1_000_003 + window_index,
                           timeout_s=cfg.timeout_s, spin_us=cfg.spin_us)


def run_window_sync(request_sync: SyncRequestFn, payload: Any, wl: Workload, cfg: RunConfig,
                    duration_s: float, window_index: int = 0) -> WindowResult:
    """One window of a blocking client: closed loop, one request in flight."""
    if wl.mode != "closed" or wl.concurrency != 1:
        raise ValueError(f"a blocking client runs closed loop at concurrency 1, not {wl.describe()}")
    return closed_loop_sync(request_sync, payload, duration_s=duration_s,
                            min_requests=cfg.min_requests, timeout_s=cfg.timeout_s)


ProgressFn = Callable[[str, str, int], None]  # (workload, peer, window index)


def _interleaving(names: list[str], wl: Workload, cfg: RunConfig, progress: ProgressFn | None,
                  blocking: Collection[str]):
    """The schedule of an interleaved measurement, as a generator: it yields
    (name, duration_s, window_index) for each window to run, is sent that window's
    WindowResult back, and returns the merged Measurements (StopIteration.value).  The async
    and the blocking drivers below share it, so both follow one stopping rule."""
    out = {name: Measurement(name, wl, blocking=name in blocking) for name in names}
    if not names:
        return out
    start = time.monotonic()
    if cfg.warmup_s > 0:
        for name in names:
            if progress:
                progress(wl.describe(), name, -1)
            yield name, cfg.warmup_s, 0
    rnd = 0
    while True:
        for name in names:
            if progress:
                progress(wl.describe(), name, rnd)
            out[name].add((yield name, cfg.window_s, rnd + 1))
        rnd += 1
        for m in out.values():
            # Sticky: a peer that has shown stable windows stays done even if a later window
            # is disturbed; it keeps running only so the interleaving stays fair to the rest.
            m.converged = m.converged or converged(m.window_p50_ms, cfg.stable_windows,
                                                   cfg.tolerance)
        if all(m.converged for m in out.values()):
            break
        if time.monotonic() - start >= cfg.max_duration_s:
            break
    return out


async def measure_interleaved(requests: dict[str, RequestFn], payload: Any, wl: Workload,
                              cfg: RunConfig, progress: ProgressFn | None = None, *,
                              blocking: Collection[str] = ()) -> dict[str, Measurement]:
    """Round-robin windows A,B,C,A,B,C... so slow machine drift (thermal, noisy neighbours,
    frequency scaling) lands on every peer alike, until every peer has had `stable_windows`
    consecutive window p50s agreeing within `tolerance`, or `max_duration_s` has passed.

    Names in `blocking` map to a blocking `request_sync` instead of a coroutine function and
    run `closed_loop_sync` windows, which block this loop while they run (to measure them
    with no loop running at all, use `measure_interleaved_sync`)."""
    gen = _interleaving(list(requests), wl, cfg, progress, blocking)
    try:
        step = next(gen)
        while True:
            name, duration_s, index = step
            req = requests[name]
            if name in blocking:
                w = run_window_sync(req, payload, wl, cfg, duration_s, index)
            else:
                w = await run_window(req, payload, wl, cfg, duration_s, index)
            step = gen.send(w)
    except StopIteration as stop:
        return stop.value


def measure_interleaved_sync(requests: dict[str, Any], payload: Any, wl: Workload, cfg: RunConfig,
                             progress: ProgressFn | None = None, *, blocking: Collection[str] = (),
                             run_async: Callable[[Awaitable], Any] | None = None
                             ) -> dict[str, Measurement]:
    """`measure_interleaved` driven from plain code, so that the blocking windows (names in
    `blocking`, whose request is a `request_sync`) run with no event loop running.  The
    other names' windows are coroutines run to completion by `run_async` (e.g. an
    `asyncio.Runner`'s `run`, so that every async window uses the loop its clients were
    made on); the loop stands still between them."""
    if run_async is None and any(n not in blocking for n in requests):
        raise ValueError("asyncio peers need run_async to run their windows")
    gen = _interleaving(list(requests), wl, cfg, progress, blocking)
    try:
        step = next(gen)
        while True:
            name, duration_s, index = step
            req = requests[name]
            if name in blocking:
                w = run_window_sync(req, payload, wl, cfg, duration_s, index)
            else:
                w = run_async(run_window(req, payload, wl, cfg, duration_s, index))
            step = gen.send(w)
    except StopIteration as stop:
        return stop.value
