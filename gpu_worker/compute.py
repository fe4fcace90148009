"""Where a batch runs: on the worker loop's own thread, or on the compute thread.

The worker is one poll loop (docs/architecture.md, "Threads and wake-ups").  A batch runs on
the loop's thread unless its compute time is unknown or predicted to exceed half a heartbeat
interval; then it goes to the one `ComputeThread`, so that the loop keeps heartbeating and
receiving while it runs (the broker would otherwise presume a worker that computes for
seconds dead, and retry its work).  Fast batches stay on the loop's thread: the hand-off
costs tens of microseconds, which is most of a small request's budget.

`ComputeTimes` is the decision, pure: no clock, no thread; seconds are measured by the
caller and passed in.  `ComputeThread` is the mechanism.  Invariants:

* at most one batch is on the compute thread at a time (the worker stays busy until its
  result is collected), and the thread never touches a worker socket: it signals completion
  on its own inproc PAIR, which the loop polls;
* a batch size never seen (no warm-up, or a size warm-up did not run) is offloaded, since
  nothing says it is fast.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import zmq

from broker.protocol.logs import block_stop_signals, unblock_stop_signals

__all__ = ["raised", "message_of", "ComputeTimes", "ComputeThread", "LoopHeartbeats", "READ_TICK", "READ_GAP",
           "IDLE_AFTER"]

# Seconds between the heartbeat thread's looks at the socket while a batch computes on the
# loop's thread, when nothing wakes it sooner: after a look during compute it sleeps on the
# sockets' descriptors, so what arrives meanwhile is read (and a RECALL answered) as it
# comes, READ_GAP at most after the previous look.  Outside compute each look is a failed
# lock attempt, after which the thread goes back to this tick (see IDLE_AFTER for an idle
# worker).
READ_TICK = 0.01
#: the shortest time between two looks woken by arrivals: a flood of them during a batch
#: takes the GIL from the model (and the lock from the loop, should the batch end) at most
#: this often, reading what came meanwhile in one go
READ_GAP = 0.001
#: once work (a request, a RECALL, a CANCEL) arrived during a batch (one that lasted
#: READ_GAP at least), each batch begun in the next RING_FOR seconds wakes the thread at its
#: start (`computing_begin` rings a bell): what arrived just before, or arrives in the
#: batch's first READ_TICK, is read as it comes rather than at the next tick.  Without such
#: traffic (a lone client's requests come while the loop waits, not while it computes)
#: nothing rings, and no batch pays for a look
RING_FOR = 1.0
# what `LoopHeartbeats._sleep_on` woke for
_STOP, _TIMEOUT, _ARRIVAL, _BELL = object(), object(), object(), object()
#: with no batch begun on the loop's thread for IDLE_AFTER seconds, `LoopHeartbeats` sleeps
#: until the next `computing_begin()` wakes it (or half a heartbeat interval passes) instead
#: of looking every READ_TICK: an idle worker's thread otherwise woke 100 times a second for
#: nothing (16 ms of CPU per second measured on the 2-vCPU VM), and at a fixed 50 ms tick
#: still 20 times (2 ms of CPU a second, most of an idle worker's: the idle hunt)
IDLE_AFTER = 1.0

log = logging.getLogger("gpu_worker")



def message_of(e: BaseException) -> str:
    """``str(e)``, never raising: an exception whose ``__str__`` raises took the worker down
    while its request's error was formatted (the data hunt)."""
    try:
        return str(e)
    except Exception as inner:
        return f"(its str() raised {type(inner).__name__})"


def raised(e: BaseException) -> str:
    """``TypeName: message`` of what a model (or anything) raised, for an error reply or a
    log line; never raises itself (`message_of`)."""
    text = message_of(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class ComputeTimes:
    """Seconds a batch takes, per batch size (an EWMA: a new measurement weighs 0.2), and
    the offload rule; `recent` is the head-of-line rule's prediction."""

    def __init__(self, heartbeat_interval: float):
        self.heartbeat_interval = float(heartbeat_interval)
        self._seconds: dict[int, float] = {}
        self._last: dict[int, float] = {}  # n -> the last measurement
        self._recent: dict[int, float] = {}  # n -> `recent(n)`, kept as batches are observed
        self._floor = 0.0  # `floor()`: the least of them (read after every batch)

    def seed(self, timings: Mapping[int, float]) -> None:
        """Take warm-up timings (batch size -> seconds) as the current estimates."""
        self._seconds.update(timings)
        for n, seconds in timings.items():
            self._last[n] = seconds
            self._recent[n] = seconds
        self._floor = min(self._recent.values()) if self._recent else 0.0

    def predict(self, n: int) -> float | None:
        """Expected seconds for a batch of ``n``; None when no batch of that size ran yet."""
        return self._seconds.get(n)

    def recent(self, n: int) -> float | None:
        """The head-of-line rule's prediction (`gpu_worker.leases.runs_long`) for a batch of
        ``n``: the least of the average and the last two measurements, so one slow outlier
        (which lifts the average for many batches) does not make the following batches
        "long" (BUSY and bounces for nothing), while two slow ones in a row do; a batch that
        does run long is caught by the rule's "past its prediction" arm anyway.  Kept by
        `observe` and `seed`."""
        return self._recent.get(n)

    def floor(self) -> float:
        """The shortest time a batch may be expected to take (`recent` of the quickest
        batch size; 0 before any ran): the batcher's ``deadline_margin``, below which a
        request cannot finish before its deadline (gpu_worker/batching.py, "Deadlines").
        A floor, so that a request is refused only when even the quickest recent batch
        would end past its deadline."""
        return self._floor

    def observe(self, n: int, seconds: float) -> None:
        prev = self._seconds.get(n)
        avg = self._seconds[n] = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        before = self._last.get(n, seconds)
        self._last[n] = seconds
        # `recent(n)` and the floor, kept (the least over the sizes: a few, in C)
        recent = self._recent
        recent[n] = min(avg, seconds, before)
        self._floor = min(recent.values())

    def offload(self, n: int) -> bool:
        """Whether a batch of ``n`` goes to the compute thread: its time is unknown or
        longer than half a heartbeat interval."""
        predicted = self._seconds.get(n)
        return predicted is None or predicted > self.heartbeat_interval / 2


class ComputeThread:
    """One thread that runs offloaded batches; it signals completion on an inproc PAIR
    socket so the worker's poll wakes up (a zmq socket may not be shared across threads,
    but each end of the pair is used by one thread only)."""

    _n = 0

    def __init__(self, ctx: zmq.Context, run: Callable[[list], list]):
        ComputeThread._n += 1
        addr = f"inproc://gpu-worker-done-{os.getpid()}-{ComputeThread._n}"
        #: the loop polls this for POLLIN; `result()` then returns the finished batch
        self.done = ctx.socket(zmq.PAIR)
        self.done.linger = 0
        self.done.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.linger = 0
        self._tx.connect(addr)
        self._run = run  # jobs -> outputs (the worker's data plane)
        self._job = None
        self._out = None
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="compute", daemon=True)
        self._thread.start()

    def submit(self, jobs, started) -> None:
        with self._cv:
            self._job = (jobs, started)
            self._cv.notify()

    def _loop(self) -> None:
        block_stop_signals()  # the loop's thread takes them, even while it waits in a model call
        while True:
            with self._cv:
                while self._job is None and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                jobs, started = self._job
                self._job = None
            t0 = time.perf_counter()
            # Not while the model runs: what it starts (a process, a thread) inherits this
            # thread's mask, and a pool's workers or a helper with SIGTERM blocked never
            # ended (unblock_stop_signals).  One that lands here meanwhile still wakes the
            # loop at once (the C handler writes the wakeup pipe the loop polls).
            unblock_stop_signals()
            try:
                outputs, error = self._run(jobs), None
            except BaseException as e:  # whatever it is, the loop must hear the batch ended
                outputs, error = None, e if isinstance(e, Exception) else RuntimeError(raised(e))
            finally:
                block_stop_signals()
            self._out = (jobs, started, outputs, error, time.perf_counter() - t0)
            # Not kept here until the next batch: its jobs view the clients' segments, whose
            # mappings (and, of clients that left, memory) would live on with them, for
            # good once nothing is offloaded any more (a fast model, every size timed).
            del jobs, outputs, error
            self._tx.send(b"")

    def result(self):
        """(jobs, started, outputs, error, seconds) of the finished batch; blocks until done."""
        self.done.recv()
        out, self._out = self._out, None
        return out

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(5)
        self._tx.close(linger=0)
        self.done.close(linger=0)


class LoopHeartbeats:
    """Heartbeats while a batch runs on the loop's own thread.

    A batch predicted fast runs on the loop thread, but a prediction can be wrong (an input
    that makes the model slow, a first call that compiles): without heartbeats for the
    broker's liveness window the worker would be presumed dead and its request run a second
    time elsewhere.  So one small thread sends them for the loop while it computes.

    The upstream socket (and a leasing worker's direct socket, which `during` reads) is never
    used by two threads at once: the loop holds `_socket` at all times except inside
    `computing_begin()` .. `computing_end()`, and this thread touches the sockets only while
    it holds `_socket` itself (a lock hand-off is the full memory barrier
    libzmq asks for when a socket changes threads).  Outside compute the thread only wakes
    every half interval, finds the lock taken, and sleeps again.  A model that holds the GIL
    for longer than the liveness window without releasing it (a C extension that never
    does) still starves this thread: such models must be offloaded (their warm-up timing
    says so).

    With ``during`` (the worker's `_read_while_computing`), the thread also reads the sockets
    while the loop computes: so a request that arrives during a batch has its arrival time
    (its wait in the batcher, its batching window), and a RECALL for it is answered while the
    batch runs instead of after it.  ``during`` returns how many messages it read that were
    work (requests, RECALLs, CANCELs: not heartbeats) and the descriptors to sleep on until
    the next look (`wire.quiet_fd`: sockets it drained, whose next message signals them),
    none when one may hold a message that will not signal (a send after the drain, a stash
    full).  After a look during compute the thread wakes at the next arrival
    (`READ_GAP` after the look at the earliest) or at `READ_TICK`, whichever is first;
    after a failed lock attempt, or with nothing to sleep on, at the tick.  The descriptors
    are only slept on, never read, without the lock (libzmq's are edge-triggered: a poll
    does not take the signal, the EVENTS of the next look does).  A batch that begins while
    the loop has the socket is seen at the next tick, so what arrives in its first tick
    would wait for it; hence, for `RING_FOR` seconds after work arrived during a batch, each
    batch begun rings a bell (an eventfd the thread sleeps on with the sockets) and the
    thread looks at its start.  Only workers whose batches see arrivals pay that wake-up;
    a lone client's (its requests come while the loop waits) never rings.  After
    `IDLE_AFTER` seconds with no batch begun it says it is idle and sleeps until
    `computing_begin()` wakes it (half a heartbeat interval at most): only the first batch
    after a quiet spell pays that wake-up (an Event's set); the others cost the loop a
    counter and an attribute read (no syscall: a signal to this thread at every batch would
    cost every request a wake-up).
    """

    def __init__(self, send_heartbeat: Callable[[], None], last_sent: Callable[[], float], interval: float,
                 during: Callable[[], tuple[int, Sequence[int]] | None] | None = None):
        self._send = send_heartbeat
        self._last_sent = last_sent
        self.interval = interval
        self._during = during  # run with the socket held at each look while the loop computes
        self._socket = threading.Lock()
        self._socket.acquire()  # the loop's, from now on (construct on the loop thread)
        self._stop = threading.Event()
        self.sent = 0
        self.begun = 0   # batches begun on the loop's thread (the loop writes it, this thread reads)
        self.looks = 0   # times this thread woke
        self.woken = 0   # of them, woken by an arrival on a descriptor `during` returned
        self.rung = 0    # of them, woken by `computing_begin` (traffic comes during batches)
        self._poll = select.poll()
        self._polled: tuple[int, ...] = ()
        # Rung by `computing_begin` while `_ring` (set and cleared by this thread): see _loop
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ring = False
        # Idle: set by this thread before it sleeps on `_wake`, read by `computing_begin`
        # after it counted its batch (so either the loop sees it and sets `_wake`, or this
        # thread sees the count move before it sleeps: no batch is missed).
        self._idle = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu_worker-heartbeats", daemon=True)
        self._thread.start()

    def computing_begin(self) -> None:
        self.begun += 1
        self._socket.release()
        if self._ring:
            try:  # traffic comes during batches: look now, at this one's start
                os.eventfd_write(self._bell, 1)
            except OSError:
                pass
        elif self._idle:
            self._wake.set()  # the first batch after a quiet spell: look now

    def computing_end(self) -> None:
        self._socket.acquire()

    def _tick(self) -> float:
        return self.interval / 2 if self._during is None else min(self.interval / 2, READ_TICK)

    def _loop(self) -> None:
        block_stop_signals()  # the loop's thread takes them, even while it waits in a model call
        seen, quiet_since = self.begun, time.monotonic()
        wait = self._tick()
        idle = False
        fds: Sequence[int] = ()  # what the last look, during compute, left to sleep on
        phase = -1               # `begun` at the last look that held the socket
        ring_until = 0.0
        while True:
            woke = _TIMEOUT
            if idle:
                self._wake.clear()
                self._idle = True
                if self.begun == seen:
                    self._wake.wait(wait)
                self._idle = False
                if self._stop.is_set():
                    break
            elif fds or self._ring:
                woke = self._sleep_on(fds, wait)
                if woke is _STOP:
                    break
            elif self._stop.wait(wait):
                break
            self.looks += 1
            wait = self._tick()
            idle = False
            fds = ()
            now = time.monotonic()
            if self._ring and now >= ring_until:
                self._ring = False  # no traffic during a batch for RING_FOR: the plain tick
            if not self._socket.acquire(blocking=False):
                # the loop has the socket: it heartbeats itself (and, ringing, it rings when
                # its next batch begins)
                if self.begun != seen:
                    seen, quiet_since = self.begun, now
                elif now - quiet_since >= IDLE_AFTER and not self._ring:
                    # nothing to do until a batch begins: `computing_begin` wakes us
                    wait, idle = self.interval / 2, True
                continue
            # woken by an arrival in a batch this thread looked at READ_GAP before, at least
            traffic = woke is _ARRIVAL and self.begun == phase
            phase = seen = self.begun
            quiet_since = now
            try:
                try:
                    # First, so that the read's last call on the socket is the EVENTS that
                    # found it empty: its descriptor then signals the next message.
                    if now - self._last_sent() >= self.interval:
                        self._send()
                        self.sent += 1
                except Exception:  # its failure must not cost this look's read
                    log.exception("heartbeat during compute failed")
                if self._during is not None:
                    read, fds = self._during() or (0, ())
                    if traffic and read:  # work came (not a heartbeat, not a socket command)
                        ring_until = now + RING_FOR
                        self._ring = True
            except Exception:  # never let a failure take the loop's lock with it
                log.exception("reading the sockets during compute failed")
                fds = ()
            finally:
                self._socket.release()

    def _sleep_on(self, fds: Sequence[int], timeout: float) -> object:
        """Sleep until one of ``fds`` signals (then until `READ_GAP` after the look just
        made, at the earliest), the bell rings or ``timeout`` seconds pass: `_ARRIVAL`,
        `_BELL`, `_TIMEOUT`, or `_STOP`."""
        looked = time.monotonic()
        fds = (self._bell, *fds)
        poll = self._poll
        if fds != self._polled:
            self._forget()
            for fd in fds:
                poll.register(fd, select.POLLIN)
            self._polled = fds
        try:
            ready = poll.poll(timeout * 1000.0)
        except OSError:  # EINTR is retried by Python; anything else: a plain tick
            ready = ()
            self._forget()
            if self._stop.wait(timeout):
                return _STOP
        if self._stop.is_set():
            return _STOP
        if not ready:
            return _TIMEOUT
        bell = self._bell
        if any(fd == bell for fd, _ in ready):
            try:
                os.eventfd_read(bell)
            except OSError:  # BlockingIOError: read by an earlier wake
                pass
            self.rung += 1
            return _BELL
        if any(ev & select.POLLNVAL for _, ev in ready):
            # a descriptor closed under us (the loop reconnected since): the rest of the tick
            # plain, then the next look says what to watch
            self._forget()
            return _STOP if self._stop.wait(max(0.0, looked + timeout - time.monotonic())) else _TIMEOUT
        self.woken += 1
        gap = looked + READ_GAP - time.monotonic()
        if gap > 0 and self._stop.wait(gap):
            return _STOP
        return _ARRIVAL

    def _forget(self) -> None:
        for fd in self._polled:
            try:
                self._poll.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass
        self._polled = ()

    def close(self) -> None:
        self._ring = False  # a computing_begin after this rings nothing
        self._stop.set()
        self._wake.set()
        try:
            os.eventfd_write(self._bell, 1)
        except OSError:
            pass
        self._thread.join(5)
        if not self._thread.is_alive() and self._bell >= 0:
            os.close(self._bell)
            self._bell = -1
