"""Micro-benchmarks of the shared-memory data plane (single process, no sockets).

    python -m bench.micro_shm            # table + JSON on stdout

Each figure is the median over ``repeats`` runs of (total time / iterations) for a loop
of many iterations, timed with ``time.perf_counter_ns``.  These are costs of the Python
calls themselves; they bound what the shm layer adds to a request, not end-to-end latency.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

from shm import SegmentCache, ShmPool
from shm.fence import fence


def _per_op_ns(fn, iters: int, repeats: int) -> float:
    """Median over repeats of the mean cost of one call of ``fn`` (which runs ``iters`` ops)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(iters)
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def _bench_alloc_free(pool: ShmPool, repeats: int) -> dict:
    keep = pool.alloc(1024, np.uint8)  # a long-lived neighbour, as in real use
    alloc, alloc_nbytes, free, ref_of = pool.alloc, pool.alloc_nbytes, pool.free, pool.ref_of
    f32 = np.dtype(np.float32)

    def arrays(n):
        for _ in range(n):
            free(ref_of(alloc((3, 224, 224), f32)))

    def raw(n):
        for _ in range(n):
            free(alloc_nbytes(4096)[0])

    out = {
        "alloc_ref_of_free_us": _per_op_ns(arrays, 20_000, repeats) / 1e3,
        "alloc_nbytes_free_us": _per_op_ns(raw, 20_000, repeats) / 1e3,
    }
    pool.free(pool.ref_of(keep))
    return out


def _bench_ref_of(pool: ShmPool, repeats: int) -> dict:
    small = pool.alloc(64, np.uint8)
    big = pool.alloc(64 << 20, np.uint8)  # never touched: tmpfs allocates no pages for it
    ref_of = pool.ref_of

    def loop(arr):
        def run(n):
            for _ in range(n):
                ref_of(arr)
        return run

    out = {
        "ref_of_64B_ns": _per_op_ns(loop(small), 200_000, repeats),
        "ref_of_64MiB_ns": _per_op_ns(loop(big), 200_000, repeats),
        "ref_of_view_64B_ns": _per_op_ns(loop(small[8:]), 100_000, repeats),
        "ref_of_view_64MiB_ns": _per_op_ns(loop(big[8:]), 100_000, repeats),
    }
    out["ref_of_ratio_64MiB_over_64B"] = out["ref_of_64MiB_ns"] / out["ref_of_64B_ns"]
    pool.free(pool.ref_of(small))
    pool.free(pool.ref_of(big))
    return out


def _bench_reader(repeats: int) -> dict:
    slots = 4096
    with ShmPool(4 << 20, slots=slots) as pool, SegmentCache() as cache:
        a = pool.alloc((3, 32, 32), np.float32)
        ref = pool.ref_of(a)
        pool.mark_in_flight(ref)
        view, forget = cache.view, cache.forget
        f32 = np.dtype(np.float32)
        shape = (3, 32, 32)

        def attach(n):
            for _ in range(n):
                forget(ref.segment)
                view(ref, f32, shape)

        def cached(n):
            for _ in range(n):
                view(ref, f32, shape)

        out = {
            "first_attach_us": _per_op_ns(attach, 2_000, repeats) / 1e3,
            "cached_view_us": _per_op_ns(cached, 50_000, repeats) / 1e3,
        }
        pool.free(ref)

        # release() needs a fresh IN_FLIGHT slot per call: fill the table, time releasing
        # all of it, reclaim (untimed), repeat.
        samples = []
        for _ in range(repeats):
            refs = [pool.alloc_nbytes(64)[0] for _ in range(slots)]
            for r in refs:
                pool.mark_in_flight(r)
            release = cache.release
            t0 = time.perf_counter_ns()
            for r in refs:
                release(r)
            samples.append((time.perf_counter_ns() - t0) / slots)
            assert pool.reclaim() == slots
        out["release_us"] = statistics.median(samples) / 1e3

        def fences(n):
            for _ in range(n):
                fence()

        out["fence_ns"] = _per_op_ns(fences, 200_000, repeats)

        r = pool.alloc_nbytes(64)[0]
        pid = os.getpid()
        mark = pool.mark_in_flight

        def marks(n):
            for _ in range(n):
                mark(r, pid)

        out["mark_in_flight_with_holder_us"] = _per_op_ns(marks, 20_000, repeats) / 1e3
        t0 = time.perf_counter_ns()
        for _ in range(200):
            pool.reclaim()
        out["reclaim_4096_slots_us"] = (time.perf_counter_ns() - t0) / 200 / 1e3
        pool.free(r)
    return out


def run(repeats: int = 5) -> dict:
    """Run every micro-benchmark; a flat dict of medians (units in the key names)."""
    results: dict = {"repeats": repeats, "python": sys.version.split()[0], "numpy": np.__version__}
    with ShmPool((64 << 20) + (1 << 20), slots=4096) as pool:
        results.update(_bench_alloc_free(pool, repeats))
        results.update(_bench_ref_of(pool, repeats))
    results.update(_bench_reader(repeats))
    return results


def main() -> None:
    res = run()
    print(f"{'metric':<34} {'value':>12}")
    for k, v in res.items():
        if isinstance(v, float):
            print(f"{k:<34} {v:>12.3f}")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
