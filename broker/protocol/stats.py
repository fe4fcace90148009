"""Histograms with fixed buckets, shared by the worker (which counts what only it sees:
compute, input and output times, batch sizes) and the broker (which merges the counts into
its metrics, docs/operations.md "Metrics").  Both sides use the same bounds, so a worker's
STATS message carries bucket counts, not observations: its size does not grow with traffic.

Pure: no clock, no socket.  `observe` is a bisect and two additions (about a third of a
microsecond), cheap enough for every request.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

__all__ = ["LATENCY_BUCKETS", "BATCH_BUCKETS", "Histogram"]

#: Upper bounds, in seconds, of the latency buckets (the last bucket, +Inf, is implicit):
#: from 100 us (the broker's own cost) to 10 s (a long generative request).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: Upper bounds of the batch-size buckets (requests per batch).
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    """Counts per bucket (not cumulative; one more than the bounds, for +Inf), their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Count `value` (`n` times: a batch's compute time, once per request in it)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add(self, counts: Sequence[int], total: float) -> None:
        """Add another histogram's bucket counts (same bounds) and sum; extra or missing
        buckets from a peer with other bounds are refused (ValueError)."""
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} bucket counts for a histogram of {len(self.counts)} buckets")
        if any(type(c) is not int or c < 0 for c in counts):
            raise ValueError("bucket counts must be non-negative integers")
        mine = self.counts
        for i, c in enumerate(counts):
            mine[i] += c
        self.sum += float(total)

    def take(self) -> tuple[list[int], float]:
        """The counts and sum so far, and start again from zero (a worker's delta)."""
        counts, total = self.counts, self.sum
        self.counts = [0] * len(counts)
        self.sum = 0.0
        return counts, total

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' view: (upper bound as text, cumulative count), +Inf last."""
        out = []
        run = 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts):
            run += c
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), run))
        return out

    def copy(self) -> "Histogram":
        h = object.__new__(Histogram)  # a scrape copies hundreds, on the broker's loop
        h.bounds = self.bounds
        h.counts = self.counts.copy()
        h.sum = self.sum
        return h
