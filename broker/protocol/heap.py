"""The startup heap out of the cyclic garbage collector's reach, for the processes we run.

A worker that has imported torch and loaded its model holds about 170,000 objects that
CPython's cyclic collector tracks; a full collection walks every one of them, and on the
test machine takes 35-90 ms (`python -m bench.gc_pause`, BENCHMARKS.md "Garbage collector
pauses").  CPython starts a full collection on its own once enough objects have survived
into the oldest generation since the last one (a quarter of those it holds), so a worker
whose model, caches or clients leave objects behind stops, now and then, for that long in
the middle of a request: a frame of an AR stream is 33 ms.  The objects made before the
worker served its first request (modules, the model, its warm-up) live as long as the
process, so `freeze_startup_heap` collects once, then moves them all to the permanent
generation (`gc.freeze`): later collections, full ones included, walk only what serving
made.

Full collections then come more often (CPython 3.11-3.13 start one once the survivors
since the last exceed a quarter of the unfrozen oldest generation, which is now small), but
each walks only what serving made: the same work in all, in far shorter stops.

Frozen objects are still freed by reference counting.  What freezing gives up is the
collection of a reference cycle that involves one of them and becomes garbage later (a
startup object and a later one pointing at each other, both dropped): such a cycle stays.
They are also left out of `gc.get_objects()` and `gc.get_referrers()`, so a leak hunt in
a running worker should call `gc.unfreeze()` first.  Only for processes of our own
(`python -m gpu_worker`, `python -m broker`, and the bench's proxied worker, which runs
ours): a library must not freeze its host application's heap, so the client SDK never
calls it.

Must never: touch a socket or parse a frame.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time

__all__ = ["freeze_startup_heap", "trim_heap", "start_trim", "TRIM_AFTER_CLOSES", "TRIM_AFTER_BYTES", "TRIM_QUIET_S", "ClosesSeen",
           "BurstSeen"]

log = logging.getLogger("broker.protocol.heap")


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze every object alive now; returns how
    many are frozen in all.  Call once, when startup is done, before serving."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("startup heap frozen: %d objects out of the cyclic garbage collector's reach", n)
    return n


_libc = None  # loaded on first use: False where there is no malloc_trim (not glibc)


def trim_heap() -> bool:
    """Give the C heap's free memory back to the kernel (glibc's ``malloc_trim(0)``); False
    where the C library has none (musl, macOS).  libzmq keeps ~40 KB of buffers per
    connection in glibc's heap, and a broker that 3,000 connections came to and left held
    90 MB more after each such round until it restarted (a scale hunt: Python's own heap
    stayed flat); the broker calls this in its once-a-second housekeeping after many
    connections closed, on a thread (freeing 80 MB took 12 ms here, 1.5-2 ms with little to give
    back; glibc holds each arena's lock as it trims it, so a malloc from that arena waits)."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL("libc.so.6")  # (find_library may run ldconfig or a compiler)
            _libc = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True


_trim_refused_at = -1e9  # when a trim's thread could not start, last said (monotonic)


def start_trim() -> "threading.Thread | None":
    """`trim_heap` on a thread of its own, started; None when no thread can be started (a
    pids cgroup or RLIMIT_NPROC at its limit): the trim is skipped, and said (at most once a
    minute).  A trim is housekeeping: the resource audit saw the broker's and a worker's
    loops end on its RuntimeError ("can't start new thread"), every client losing service."""
    global _trim_refused_at
    t = threading.Thread(target=trim_heap, name="trim-heap", daemon=True)
    try:
        t.start()
    except RuntimeError as e:
        now = time.monotonic()
        if now - _trim_refused_at >= 60.0:
            _trim_refused_at = now
            log.warning("could not start a thread to give freed memory back to the kernel (%s): skipped; the "
                        "process's threads are at a limit (a pids cgroup, RLIMIT_NPROC)", e)
        return None
    return t


#: Connections closed (or descriptors, where a process counts those) after which the
#: process's housekeeping gives the C heap's free memory back (`trim_heap`): libzmq's ~40 KB
#: a connection otherwise stayed with glibc, 90 MB more after each round of 3,000 connections
#: to the broker (a scale hunt), 30-45 MB after 1,500 to a worker's direct socket (the churn
#: hunt).
TRIM_AFTER_CLOSES = 256


class ClosesSeen:
    """Descriptors closed since the C heap was last trimmed, for a process whose housekeeping
    looks at how many descriptors it has open (a worker): each fall between two looks
    counts, and so do the connections its caller saw end meanwhile (a worker's direct
    socket: its monitor's DISCONNECTED events), whichever is more.  A fall alone missed a
    crowd that came and left between two looks (1,500 leaseholder connections within the
    worker's first second, or any interval longer than the crowd's stay: 30-45 MB kept for
    good); connections that come and go one after another reuse the same buffers (30,000
    in turn grew a worker by 2.5 MB).  Pure: the caller counts and trims."""

    __slots__ = ("last", "closed")

    def __init__(self) -> None:
        self.last: int | None = None
        self.closed = 0

    def look(self, used: int, ended: int = 0) -> bool:
        """``used`` descriptors are open now (negative: unknown), and ``ended`` connections
        were seen to end since the last look; whether enough closed since the last
        `trimmed` for a trim to be worth it."""
        fall = 0
        if used >= 0:
            if self.last is not None and used < self.last:
                fall = self.last - used
            self.last = used
        self.closed += max(fall, ended)
        return self.closed >= TRIM_AFTER_CLOSES

    def trimmed(self) -> None:
        self.closed = 0


#: bytes of big frames (inline tensors) a process moved after which, once they stop coming,
#: the C heap's free memory goes back to the kernel (`BurstSeen`)
TRIM_AFTER_BYTES = 64 << 20
#: seconds without big frames after which a burst counts as over (`BurstSeen`); doubled, up
#: to `TRIM_QUIET_MAX_S`, each time big frames come back within `TRIM_BACKOFF_S` of a trim
TRIM_QUIET_S = 5.0
TRIM_QUIET_MAX_S = 60.0
TRIM_BACKOFF_S = 30.0
#: bytes of big frames between two looks that do not break a quiet (a trickle of ordinary
#: large requests: one every few seconds kept a burst's memory for good; found by review)
TRIM_TRICKLE = TRIM_AFTER_BYTES // 64


class BurstSeen:
    """Bytes of big frames a process moved (its caller adds them to `moved`), for its
    housekeeping: whether to trim the C heap now.  glibc serves a frame over its mmap
    threshold from mmap and gives it back when freed, but raises that threshold to the size
    of each such block freed (up to 32 MiB), so that the next frames of that size come from
    the heap, which keeps them when freed: a burst of 24 inline requests of 16 MiB left a
    broker 193 MiB larger and its worker 48 MiB, for good (the memory audit).

    A trim is not free: glibc holds each arena's lock while it gives memory back (about
    0.1 ms a MiB), and a concurrent call that allocates from it waits (5-14 ms after 96 MiB
    bursts on the test VM), and the next burst faults its pages in again (bursts every 2 s,
    a trim between each: 1.5x the broker's CPU a request; the trim audit).  Fixing the mmap
    threshold instead (GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304) faults every
    frame in: a steady 16 MiB stream took 2.3x the CPU and 2.4x the latency.  So a trim is
    due once `TRIM_AFTER_BYTES` moved since the last one and no more than `TRIM_TRICKLE` a
    look for `TRIM_QUIET_S`: after a burst, not between the bursts of a stream; and big
    frames that come back within `TRIM_BACKOFF_S` of a trim double that quiet (up to
    `TRIM_QUIET_MAX_S`: a periodic stream is trimmed ever more rarely), reset once a trim
    was not followed so soon, or after a rest that long.  Pure: the caller trims."""

    __slots__ = ("moved", "last", "at_trim", "quiet_since", "quiet_s", "trimmed_at")

    def __init__(self) -> None:
        self.moved = 0    # bytes of big frames moved, in all
        self.last = 0     # ... at the previous look
        self.at_trim = 0  # ... at the last trim
        self.quiet_since = 0.0  # the last look that saw more than a trickle move (monotonic)
        self.quiet_s = TRIM_QUIET_S
        self.trimmed_at: float | None = None  # the last trim, until big frames came again

    def due(self, now: float) -> bool:
        """At each housekeeping look (``now``: monotonic seconds): whether a burst is over
        and its memory worth a trim."""
        moved = self.moved
        if moved - self.last > TRIM_TRICKLE:
            self.last = moved
            if self.trimmed_at is not None:  # the first frames since a trim: was it too soon?
                soon = now - self.trimmed_at < TRIM_BACKOFF_S
                self.quiet_s = min(self.quiet_s * 2, TRIM_QUIET_MAX_S) if soon else TRIM_QUIET_S
                self.trimmed_at = None
            elif now - self.quiet_since >= TRIM_BACKOFF_S:
                self.quiet_s = TRIM_QUIET_S  # (a long rest since the last movement: start over)
            self.quiet_since = now
            return False
        self.last = moved  # (a trickle: counted towards the next trim, no break in the quiet)
        if now - self.quiet_since >= self.quiet_s and moved - self.at_trim >= TRIM_AFTER_BYTES:
            self.at_trim = moved
            self.trimmed_at = now
            return True
        return False
