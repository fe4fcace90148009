"""Latency histograms and the numbers a report shows from them.

Every latency in the harness is stored in an HDR histogram at microsecond resolution
(1 us .. 60 s, 3 significant digits): constant memory whatever the request count, merges
across windows without losing the tail, and serialises compactly into the JSON report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 60_000_000
SIG_DIGITS = 3

# The percentiles every report shows, keyed as they appear in the JSON.
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p95", 95.0),
    ("p99", 99.0),
    ("p99.9", 99.9),
)

SERVER_FIELDS = ("queue_ms", "input_ms", "compute_ms", "output_ms")


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIG_DIGITS)


class LatencyHistogram:
    """An HDR histogram fed with nanoseconds and read back in milliseconds."""

    __slots__ = ("h",)

    def __init__(self, h: HdrHistogram | None = None):
        self.h = h if h is not None else new_histogram()

    def record_ns(self, ns: int) -> None:
        # Rounded up, so that a bucket's highest value (what a percentile reads, what the SLO
        # count compares) is at least every sample in it (floored, 1,000.9 us counted within
        # a 1 ms SLO: the bench math hunt).  Clamp rather than drop: a sub-microsecond or
        # >60 s sample is still a request that happened, and dropping it would bias the count
        # and the tail.
        us = -(-ns // 1000)
        if us < LOWEST_US:
            us = LOWEST_US
        elif us > HIGHEST_US:
            us = HIGHEST_US
        self.h.record_value(us)

    def add(self, other: "LatencyHistogram") -> None:
        self.h.add(other.h)

    @property
    def count(self) -> int:
        return self.h.get_total_count()

    def percentile_ms(self, p: float) -> float:
        """The nearest-rank percentile: the value below which ``p`` % of the samples fall,
        rounding the rank up.  (hdrh rounds it to the nearest: with 2 slow requests of 151,
        1.3 %, p99 read the fast ones, and a level was taken to hold a p99 SLO it missed:
        the bench hunt.)"""
        h = self.h
        n = h.get_total_count()
        if n == 0:
            return 0.0
        p = min(max(p, 0.0), 100.0)
        target = max(1, math.ceil(p * n / 100.0 - 1e-9))
        acc = 0
        count_at = h.get_count_at_index
        for i in range(h.counts_len):  # (as hdrh's own: an iterator's object per bucket cost 10x)
            acc += count_at(i)
            if acc >= target:
                v = h.get_value_from_index(i)
                return (h.get_highest_equivalent_value(v) if p else h.get_lowest_equivalent_value(v)) / 1000.0
        return h.get_max_value() / 1000.0

    def max_ms(self) -> float:
        return self.h.get_max_value() / 1000.0

    def min_ms(self) -> float:
        return self.h.get_min_value() / 1000.0

    def mean_ms(self) -> float:
        return self.h.get_mean_value() / 1000.0

    def count_at_or_below_ms(self, limit_ms: float) -> int:
        limit_us = limit_ms * 1000.0
        n = 0
        for item in self.h.get_recorded_iterator():
            # The bucket's highest equivalent value, so that a sample is counted as within
            # the SLO only when every value in its bucket is (its lowest counted 10.007 ms
            # within 10: the bench hunt).
            if self.h.get_highest_equivalent_value(item.value_iterated_to) <= limit_us:
                n += item.count_at_value_iterated_to
        return n

    def cdf_points(self) -> tuple[list[float], list[float]]:
        """(latency_ms, cumulative fraction) at every recorded bucket, for plotting."""
        total = self.count
        xs: list[float] = []
        ys: list[float] = []
        if total == 0:
            return xs, ys
        acc = 0
        for item in self.h.get_recorded_iterator():
            acc += item.count_at_value_iterated_to
            xs.append(item.value_iterated_to / 1000.0)
            ys.append(acc / total)
        return xs, ys

    def summary_ms(self) -> dict[str, float | None]:
        if self.count == 0:
            out: dict[str, float | None] = {k: None for k, _ in PERCENTILES}
            out.update(max=None, min=None, mean=None)
            return out
        out = {k: self.percentile_ms(p) for k, p in PERCENTILES}
        out.update(max=self.max_ms(), min=self.min_ms(), mean=round(self.mean_ms(), 3))
        return out

    def encode(self) -> str:
        return self.h.encode().decode("ascii")

    @classmethod
    def decode(cls, text: str) -> "LatencyHistogram":
        return cls(HdrHistogram.decode(text.encode("ascii")))


@dataclass
class ServerTiming:
    """Running sums of the server-side split, averaged when reported."""

    sums: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in SERVER_FIELDS})
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in SERVER_FIELDS})

    def add_reply(self, reply: dict) -> None:
        for k in SERVER_FIELDS:
            v = reply.get(k)
            if v is not None:
                self.sums[k] += float(v)
                self.counts[k] += 1

    def merge(self, other: "ServerTiming") -> None:
        for k in SERVER_FIELDS:
            self.sums[k] += other.sums[k]
            self.counts[k] += other.counts[k]

    @property
    def samples(self) -> int:
        return max(self.counts.values())

    def means_ms(self) -> dict[str, float | None] | None:
        if self.samples == 0:
            return None
        return {
            k.removesuffix("_ms"): (round(self.sums[k] / self.counts[k], 4) if self.counts[k] else None)
            for k in SERVER_FIELDS
        }


def agree_within(values: list[float], tolerance: float) -> bool:
    """True when all values lie within `tolerance` (relative to the smallest) of each other."""
    if not values:
        return False
    lo, hi = min(values), max(values)
    if lo <= 0:
        return hi <= 0
    return (hi - lo) / lo <= tolerance


def converged(p50s: list[float], needed: int = 3, tolerance: float = 0.10) -> bool:
    """The stopping rule: the last `needed` window p50s agree within `tolerance`."""
    if len(p50s) < needed:
        return False
    tail = p50s[-needed:]
    if any(v is None or math.isnan(v) for v in tail):
        return False
    return agree_within(tail, tolerance)


# The reply-header fields `bench run` splits a request's server time into (ms), as the
# worker and broker write them, and the JSON keys they are reported under.
SPLIT_FIELDS = (("queue_ms", "queue"), ("batch_wait_ms", "batch_wait"), ("input_ms", "input"),
                ("compute_ms", "compute"), ("output_ms", "output"))


@dataclass
class ServerSplit:
    """Sums of the server-side split (queue wait, batch wait, input, compute, output) over
    replies, and the batch sizes the worker formed (the `batch` timing field), for one
    level of `bench run`.  Picklable and mergeable, so generator processes can send theirs."""

    sums: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k, _ in SPLIT_FIELDS})
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k, _ in SPLIT_FIELDS})
    batches: dict[int, int] = field(default_factory=dict)

    def add_timing(self, timing) -> None:
        """One reply's timing mapping (`Result.timing`); unknown or missing keys are ignored."""
        if not timing:
            return
        for k, _ in SPLIT_FIELDS:
            v = timing.get(k)
            if v is not None:
                self.sums[k] += float(v)
                self.counts[k] += 1
        b = timing.get("batch")
        if b is not None:
            b = int(b)
            self.batches[b] = self.batches.get(b, 0) + 1

    def merge(self, other: "ServerSplit") -> None:
        for k, _ in SPLIT_FIELDS:
            self.sums[k] += other.sums[k]
            self.counts[k] += other.counts[k]
        for b, n in other.batches.items():
            self.batches[b] = self.batches.get(b, 0) + n

    @property
    def samples(self) -> int:
        return max(self.counts.values())

    def means_ms(self) -> dict[str, float | None] | None:
        """{"queue": ms, "batch_wait": ms, ...}; None when no reply carried timing."""
        if self.samples == 0:
            return None
        return {name: (round(self.sums[k] / self.counts[k], 4) if self.counts[k] else None)
                for k, name in SPLIT_FIELDS}

    def batch_size(self) -> dict | None:
        """{"mean": m, "counts": {"1": n, ...}}; None when no reply carried a batch size."""
        total = sum(self.batches.values())
        if not total:
            return None
        mean = sum(b * n for b, n in self.batches.items()) / total
        return {"mean": round(mean, 3), "counts": {str(b): self.batches[b] for b in sorted(self.batches)}}
