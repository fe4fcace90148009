"""Keep-warm: when an idle worker runs a small batch of its own so that the device is warm
when traffic returns (docs/gpu.md).  Pure: no clock but the one passed in, no device; the
worker (`gpu_worker.worker`) asks it while idle and runs the unit.  Lives apart from
`gpu_worker.cuda_runtime` so that a CPU worker, which has it off by default but may turn it
on, never imports the CUDA helpers.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

__all__ = ["KeepWarm", "keep_warm_period", "KEEP_WARM_AUTO_PERIOD", "KEEP_WARM_MAX_UNIT", "KEEP_WARM_SLOW_UNITS"]

log = logging.getLogger("gpu_worker.cuda")


#: Keep-warm's period on a CUDA worker when none is configured (`keep_warm_period`), seconds.
#: 50 ms: shorter than the idle time after which a GPU starts lowering its clocks (tens of
#: milliseconds; not measured here), and a unit of ~0.1-1 ms every 50 ms keeps an idle
#: device at most 2% busy.
KEEP_WARM_AUTO_PERIOD = 0.05
#: The longest a keep-warm unit may take, seconds: a request that arrives during one waits
#: at most this long.  A model whose batch of one takes longer is not kept warm.
KEEP_WARM_MAX_UNIT = 0.005
#: Units in a row longer than `max_unit` after which keep-warm turns itself off.
KEEP_WARM_SLOW_UNITS = 3


def keep_warm_period(setting: float | None, cuda: bool) -> float | None:
    """The keep-warm period for a `WorkerConfig.keep_warm` setting: None (auto) is
    `KEEP_WARM_AUTO_PERIOD` on a CUDA device and off (None) on the CPU; 0 or less is off."""
    if setting is None:
        return KEEP_WARM_AUTO_PERIOD if cuda else None
    return float(setting) if setting > 0 else None


class KeepWarm:
    """When an idle worker runs a keep-warm unit (`warm()`: one small batch), and how often
    it did.

    GPUs drop clocks within tens of milliseconds of idling and the first kernels after a
    pause pay for it; a periodic tiny batch keeps the first real request of a burst fast.

    The decision is plain arithmetic on times passed in (`clock` only fills in a missing
    ``now``).  The caller asks only while the worker is idle (nothing pending, nothing
    computing) and reports every real batch with `busy(seconds, now)`.  A unit is due when

    * at least `period` seconds passed since the end of the last real batch or unit, and
    * the busy fraction of the last `window` seconds (real batches only; default ten
      periods) is at most `util` (the seed engine's "utilisation below 60%"); a window with
      no real work always qualifies, so an idle worker runs one unit per period.

    `next_at(now)` is when the next one is due (the loop's poll timeout).  `runs` and
    `seconds` count the units and the time they took.  A unit that raises is logged (once a
    minute at most) and counted in `failures`, never re-raised; `KEEP_WARM_SLOW_UNITS` units
    in a row longer than `max_unit` turn keep-warm off (`off_reason` says why).  Off when
    `period` is None or <= 0."""

    def __init__(self, period: float | None, warm: Callable[[], Any] | None = None, *, util: float = 0.6,
                 window: float | None = None, max_unit: float | None = None,
                 clock: Callable[[], float] = time.monotonic, timer: Callable[[], float] = time.perf_counter):
        if not 0.0 <= util <= 1.0:
            raise ValueError(f"keep-warm util must be a fraction in [0, 1], not {util!r}")
        if window is not None and window <= 0:
            raise ValueError(f"keep-warm window must be > 0 seconds, not {window!r}")
        self.period = float(period) if period and period > 0 else None
        self.util = float(util)
        self.window = float(window) if window is not None else 10.0 * (self.period or 0.0)
        self.warm = warm
        self.max_unit = max_unit
        self._clock = clock
        self._timer = timer
        self.last = clock()          # end of the last real batch or unit
        self.runs = 0
        self.seconds = 0.0
        self.failures = 0
        self.slow = 0                # units in a row longer than max_unit
        self.off_reason: str | None = None
        self._spans: deque[tuple[float, float]] = deque()  # (start, end) of real batches, oldest first
        self._span_sum = 0.0
        self._oops = None

    @property
    def enabled(self) -> bool:
        return self.period is not None and self.warm is not None

    def busy(self, seconds: float, now: float | None = None) -> None:
        """A real batch of `seconds` ended at `now`: the idle clock restarts."""
        if self.period is None:
            return
        now = self._clock() if now is None else now
        self.last = max(self.last, now)
        start = now - max(0.0, seconds)
        if self._spans:
            start = max(start, self._spans[-1][1])  # batches run one at a time: never overlap
        if start < now:
            self._spans.append((start, now))
            self._span_sum += now - start
        self._prune(now)

    def touch(self, now: float | None = None) -> None:
        """Real work happened (of no measured length): the idle clock restarts."""
        self.busy(0.0, now)

    def _prune(self, now: float) -> None:
        edge = now - self.window
        spans = self._spans
        while spans and spans[0][1] <= edge:
            a, b = spans.popleft()
            self._span_sum -= b - a
        if not spans:
            self._span_sum = 0.0  # no drift from the running sum

    def busy_seconds(self, now: float) -> float:
        """Seconds of real batches within the last `window` seconds before `now`."""
        self._prune(now)
        if not self._spans:
            return 0.0
        a, _ = self._spans[0]
        return max(0.0, self._span_sum - max(0.0, (now - self.window) - a))

    def utilisation(self, now: float) -> float:
        """The busy fraction of the last `window` seconds."""
        return self.busy_seconds(now) / self.window if self.window > 0 else 0.0

    def next_at(self, now: float | None = None) -> float | None:
        """When the next unit is due (None: keep-warm is off); at or before `now`: due now.
        While the period since the last batch or unit has not passed, that end of period
        (a lower bound: asked again then, the utilisation may push it later)."""
        if self.period is None:
            return None
        now = self._clock() if now is None else now
        at = self.last + self.period
        if self.util >= 1.0 or at > now:
            # Not due before `at` whatever the utilisation: the loop asks again then (the
            # walk below is O(spans in the window); a busy worker's idle passes skip it).
            return at
        excess = self.busy_seconds(now) - self.util * self.window  # busy seconds that must leave the window
        if excess <= 1e-12:
            return at
        # The window's start slides over the spans, oldest first, until `excess` has left it.
        edge = now - self.window
        for a, b in self._spans:
            a = max(a, edge)
            if b - a >= excess:
                return max(at, a + excess + self.window)
            excess -= b - a
        return max(at, self._spans[-1][1] + self.window)  # util 0: once the last span has left

    def due(self, now: float) -> bool:
        at = self.next_at(now)
        return at is not None and now >= at - 1e-9

    def maybe_run(self, now: float | None = None) -> bool:
        """Run one unit if it is due; True if one ran (or failed)."""
        if not self.enabled:
            return False
        now = self._clock() if now is None else now
        if not self.due(now):
            return False
        t0 = self._timer()
        try:
            self.warm()
        except Exception as e:  # a warm-up failure must never take the worker down
            self.failures += 1
            if self._oops is None:
                from broker.protocol.ratelog import RateLimitedLog

                self._oops = RateLimitedLog(log, every=60.0)
            self._oops.warning("keep-warm unit failed (%d failures so far; the worker carries on): %s: %s",
                               self.failures, type(e).__name__, e)
        elapsed = max(0.0, self._timer() - t0)
        self.runs += 1
        self.seconds += elapsed
        self.last = max(self.last, now + elapsed)
        if self.max_unit is not None:
            self.slow = self.slow + 1 if elapsed > self.max_unit else 0
            if self.slow >= KEEP_WARM_SLOW_UNITS:
                self.disable(f"{self.slow} units in a row took longer than {self.max_unit * 1e3:.3g} ms "
                             f"(the last {elapsed * 1e3:.3g} ms)")
        return True

    def disable(self, reason: str) -> None:
        """Turn keep-warm off for good, saying why (once)."""
        if self.period is not None:
            log.warning("keep-warm off: %s", reason)
        self.period = None
        self.off_reason = reason
        self._spans.clear()
        self._span_sum = 0.0
