"""Frame streams for interactive use (AR, live video): send frames as they come, get results
in send order, and never build a backlog.

With `latest_wins` (the default) at most `max_in_flight` frames are outstanding; a frame sent
while that many are in flight waits, and a newer frame replaces it (the older one is
dropped and counted in `dropped`).  So a slow model shows the newest frame next instead of
working through stale ones.  With `latest_wins=False` every frame is kept and sent in order
as capacity frees up.

Each frame is its own request with its own deadline: `timeout`, counted from `send()`, so a
result is never older than that.  A frame still waiting for room when its deadline passes,
or with less time left than recent frames took from their sending to their outcome (and
than half its timeout), is never sent: it fails with DeadlineExceeded in its turn
(counted in `expired`).  With `latest_wins=False` under a model that cannot keep up, that
is what bounds the backlog and keeps the model on frames that can still make it (with no timeout,
neither the stream's nor the client's default that its `timeout=None` takes, every frame
waits its turn, as asked).

Ordinary arrays are copied at `send()` time (into a shared-memory slot, or into a private
inline buffer), so the caller may reuse its frame buffer immediately.  A
buffer from `client.alloc` is sent by reference instead (that is its point): do not
overwrite it while its frame is in `unfinished()` (sent or waiting, its outcome not received).
A fixed round-robin ring is not safe: with `latest_wins` dropped frames free their buffers
at once while an older frame may still wait at the worker, and without it frames waiting for
room hold theirs; take for each frame a buffer whose last frame is no longer unfinished
(docs/client.md, "Streams").

A stream is built on the clients' public seams only (docs/client.md, "Seams"): it packs a
frame with `client.prepare`, sends it with `client.submit` when there is room, drops or
cancels it with `client.give_up`, and the blocking stream waits with `client.pump`; the
asyncio stream is woken by the reader through `call.notify`.  It never reaches into a
client's private state.

Pinning (docs/client.md, "Pinned streams") is decided by `client.stream(..., pin=)`, which
asks the client's core to pin the service (`pin_on_demand`); a stream made with `pin=False`
marks its frames `call.no_pin`, so that none goes on a lease, on any client.
"""
from __future__ import annotations

import operator
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .calls import deadline_exceeded, final_of_infer
from .core import flag, wait_limit
from .errors import DeadlineExceeded, EndOfStream, InferenceError, InvalidInput, NotSupported
from .tensors import Result

# EndOfStream lives in errors.py; it stays importable from here, where it used to be.
__all__ = ["Stream", "AsyncStream", "StreamStats", "EndOfStream"]


@dataclass
class StreamStats:
    sent: int = 0          # frames that went to the broker
    completed: int = 0     # results received
    failed: int = 0        # frames that ended in an error (deadline, worker failure, ...)
    dropped: int = 0       # frames replaced by a newer one before they were sent (or unsent at close, time left)
    in_flight: int = 0     # sent, result not received yet (arrived or not)
    pending: int = 0       # waiting to be sent
    cancelled: int = 0     # sent, given up by close() before their result was received
    expired: int = 0       # never sent: their deadline passed, or came too near, while they waited for room
    #                        (or had passed when close() found them waiting)
    latencies_ms: list[float] = field(default_factory=list)  # send() to result, per completed frame

    @property
    def latencies(self) -> list[float]:
        return self.latencies_ms

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


# What a frame that expired waiting for room says to do (by its stream's latest_wins: one
# that already keeps only the newest frame waited behind frames that held the room).
_LAPSED_ADVICE = {
    False: "the model is slower than the frames come: raise max_in_flight (or add workers), "
           "send fewer frames, or use latest_wins=True to keep only the newest",
    True: "the frames sent before it held the room that long (a result not read yet holds its place): "
          "read results as they come, or raise max_in_flight (or add workers) or the timeout",
}


def _deadline_of(call: Any) -> float | None:
    """A frame's deadline: its timeout counted from its `send()`."""
    return None if call.timeout is None else call.t_submit + call.timeout


class _StreamCore:
    """Bookkeeping shared by the blocking and the asyncio stream."""

    LATENCY_WINDOW = 10_000

    def __init__(self, client: Any, service: str, *, latest_wins: bool, max_in_flight: int,
                 timeout: float | None, priority: Any, meta: Mapping[str, Any] | None, reply: str,
                 pin: bool = True):
        try:
            n = operator.index(max_in_flight)  # an int (numpy's too); not 1.5, "2", NaN or None
        except TypeError:
            n = 0
        if n < 1 or isinstance(max_in_flight, bool):
            raise InvalidInput(f"max_in_flight must be at least 1, got {max_in_flight!r}")
        self._client = client
        # The client's seams: an AsyncClient's own steps without its thread check (a stream's
        # `send` is on the loop already, handed over whole), else its public ones.
        seams = getattr(client, "_stream_seams", None)
        self._prepare, self._submit_call = seams() if seams is not None else (client.prepare, client.submit)
        self.service = service
        self.latest_wins = flag("latest_wins", latest_wins)
        self.max_in_flight = n
        self.pin = bool(pin)  # its frames may go on a lease (False: every one through the broker)
        self._pinned = False  # counted by the client's pin_on_demand (set by client.stream)
        self._opts = dict(timeout=timeout, priority=priority, meta=meta, reply=reply)
        self._outstanding: deque = deque()   # sent calls, in send order
        self._pending: deque = deque()       # packed calls not sent yet
        self._frames = 0
        self._sent = 0
        self._completed = 0
        self._failed = 0
        self._dropped = 0
        self._cancelled = 0
        self._told = 0  # of the dropped and expired, how many a request sent so far told the broker about
        self._expired = 0
        # Frames in `_outstanding` that were never sent (their deadline passed while they
        # waited for room): each holds its DeadlineExceeded for its turn, and no room.
        self._lapsed: set[int] = set()
        #: a lapsed frame standing for a run of them (`_lapse`): its number -> (the run's
        #: first frame, how many)
        self._runs: dict[int, tuple[int, int]] = {}
        # How long a frame sent now takes to its outcome, as recent ones did (`_learn`);
        # 0 until one is known.
        self._need = 0.0
        self._lat: deque[float] = deque(maxlen=self.LATENCY_WINDOW)
        self._closed = False
        self._finishing = False

    # counters, readable without a stats() snapshot
    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def completed(self) -> int:
        return self._completed

    def _in_flight(self) -> int:
        # Every frame sent whose outcome the caller has not received, arrived or not: a
        # result waiting to be read holds its place (and its output slot), so a reader that
        # falls behind makes latest_wins drop frames instead of piling up stale results
        # (a hunt saw 103 frames, 3.4 s, of backlog, and the worker's output ring full).
        return len(self._outstanding) - len(self._lapsed)

    def unfinished(self) -> frozenset[int]:
        """The numbers of the frames whose inputs may still be read: sent or waiting to be
        sent, outcome not received (a dropped or expired frame is not one).  A `client.alloc` buffer of
        a frame in here must not be written yet (docs/client.md, "Streams")."""
        lapsed = self._lapsed
        return frozenset([c.frame for c in self._outstanding if c.frame not in lapsed]
                         + [c.frame for c in self._pending])

    def stats(self) -> StreamStats:
        return StreamStats(sent=self._sent, completed=self._completed, failed=self._failed,
                           dropped=self._dropped, in_flight=self._in_flight(), pending=len(self._pending),
                           cancelled=self._cancelled, expired=self._expired, latencies_ms=list(self._lat))

    def _make(self, inputs: Mapping[str, Any]) -> Any:
        if self._closed:
            raise InferenceError("this stream is closed; open a new one with client.stream()", code=None)
        if self._finishing:  # (AsyncStream; the same misuse, the same error as after close())
            raise InferenceError("this stream was finished: no more frames after finish(); "
                                 "open a new one with client.stream()", code=None)
        call = self._prepare(self.service, inputs, copy_inline=True, **self._opts)
        call.frame = self._frames
        call.t_submit = time.monotonic()  # its deadline counts from here (`_submit`)
        call.no_pin = not self.pin
        self._frames += 1
        return call

    def _admit(self, call: Any) -> None:
        if self.latest_wins:
            while self._pending:
                self._client.give_up(self._pending.popleft())  # never sent: its slots go now
                self._dropped += 1
        self._pending.append(call)

    def _flush(self) -> None:
        """Send pending frames while fewer than max_in_flight are outstanding (none once the
        client is closed: `recv` still hands out what had arrived, then says so); those
        whose deadline passed first are never sent (`_lapse`)."""
        if self._pending and self._pending[0].timeout is not None:
            self._lapse(time.monotonic())
        room = self.max_in_flight - self._in_flight()
        if room <= 0 or not self._pending or self._client.closed:
            return
        while self._pending and room > 0:
            if not self._send_head(0.0):
                return  # the broker is not reading (high-water mark): it waits
            room -= 1

    def _send_head(self, timeout: float | None) -> bool:
        """`_submit` the frame at the head of `_pending`: False when the socket did not
        take it (it stays pending).  It leaves `_pending` only once it is sent: an interrupt
        (KeyboardInterrupt, a signal handler's exception) in the socket's wait leaves it
        there for a later `recv()` (taken off first, it was lost: counted nowhere, its
        outcome never given), and so does a client closed meanwhile (a signal handler's
        `close()`): it never left, so it is not `sent`, and `close()` drops it.  A stream
        closed meanwhile (its own `close()` in a signal handler) dropped it already.

        A frame the client could not send (its request refused before it left: a header
        too big, out of descriptors) fails alone, in its turn, as a sent frame whose error
        came back (counted in `sent`, then `failed`); raised here, the error came out of
        another frame's `send()` or `recv()` (which had just taken its own result: lost)
        and the frame was counted nowhere."""
        call = self._pending[0]
        try:
            if not self._submit(call, timeout):
                return False
        except Exception as e:
            if self._client.closed or self._closed:
                return False
            self._client.give_up(call)  # (the client discarded it already: nothing more)
            call.inbox.append(("error", e))
        except BaseException as e:
            if self._closed:  # (as below)
                raise
            if call.done:  # interrupted while it was being sent: the client discarded it
                self._took(call)
                call.inbox.append(("error", InferenceError(
                    f"frame {call.frame} of the stream to {self.service!r} was interrupted "
                    f"({type(e).__name__}) while it was being sent; it was never sent", code=None)))
            elif call.id:  # interrupted once it had left: in flight
                self._told += call.dropped
                self._took(call)
            raise
        else:
            if self._closed:
                # The stream's close() ran meanwhile (a signal handler's): it took the frame
                # off `_pending` and counted it, and gave it up at the client (a send that
                # went on is cancelled there).  (Taken off again: IndexError.)
                return False
            self._told += call.dropped
        self._took(call)
        return True

    def _took(self, call: Any) -> None:
        """The head of `_pending`, `call`, was sent (or failed sending): outstanding now."""
        self._pending.popleft()
        self._outstanding.append(call)
        self._sent += 1

    def _lapse(self, now: float) -> None:
        """Pending frames that cannot make their deadline are never sent: those whose
        deadline has passed, and those with less time left than recent frames took from
        their sending to their outcome (`_need`) and than half their timeout.  The oldest
        go first (one timeout for all: their deadlines are in send order).  Their
        slots go now, and each takes its place among the outcomes with its
        DeadlineExceeded.

        Kept, `latest_wins=False` under a slow model built a backlog without end (a hunt
        saw 105 frames pending, and results 1.06 s after `send()` with a 0.1 s timeout).
        Sent with what was left, each frame reached the worker too late to finish: a stream
        at twice a 20 ms model's capacity, timeout 0.1 s, completed 8 frames of 301
        (bench/results/stream_backlog_1206).  A frame with half its timeout left is always
        sent, so what frames take keeps being learnt: a stall's deadlines (`_learn`) never
        keep every frame from being sent."""
        pending = self._pending
        while pending:
            call = pending[0]
            deadline = _deadline_of(call)
            if deadline is None:
                return
            left = deadline - now
            need = min(self._need, call.timeout * 0.5)
            if left > 0 and left >= need:
                return
            pending.popleft()
            self._client.give_up(call)  # never registered: discarded, its inputs freed
            # Its error is all it keeps for its turn: its packed inputs (an inline copy, the
            # caller's arrays) go now, not when a reader behind gets to it.
            call.packed = None
            waited = now - call.t_submit
            why = (f"and outlived its timeout of {call.timeout:g}s" if left <= 0 else
                   f"and had {left * 1e3:.3g} ms left of its timeout of {call.timeout:g}s, less than "
                   f"the {need * 1e3:.3g} ms recent frames took to their outcome")
            self._expired += 1
            # The broker silent (down, restarting): that held the room, not the model (unless
            # the oldest frame out is on a live lease: its worker held it).
            core = getattr(self._client, "_core", None)
            silent = None
            if core is not None:
                silent = (core.quiet_advice(self._outstanding[0], now) if self._outstanding
                          else core.broker_silence(now))
            advice = silent or _LAPSED_ADVICE[self.latest_wins]
            last = self._outstanding[-1] if self._outstanding else None
            if last is not None and last.frame in self._lapsed and len(last.inbox) == 1:
                # A run of frames never sent, one after another, is one outcome: each its own,
                # a reader that paused (one recv per send) was served the run one error per
                # frame, so the errors came in as fast as it read them and the stream never
                # caught up (13 times older than its timeout 12 s on, its backlog growing
                # 2 KB a frame: the streams audit).
                first, n = self._runs.pop(last.frame, (last.frame, 1))
                n += 1
                self._lapsed.discard(last.frame)
                self._outstanding.pop()
                call.inbox.clear()
                call.inbox.append(("error", deadline_exceeded(
                    f"frames {first} to {call.frame} of the stream to {self.service!r} "
                    f"({n} frames{'' if n == call.frame - first + 1 else ' of them: the others were dropped'}) waited for "
                    f"room (max_in_flight={self.max_in_flight}) and ran out of time; they were never sent "
                    f"(the last waited {waited:.3g}s {why})", advice)))
                self._runs[call.frame] = (first, n)
            else:
                call.inbox.append(("error", deadline_exceeded(
                    f"frame {call.frame} of the stream to {self.service!r} waited {waited:.3g}s for room "
                    f"(max_in_flight={self.max_in_flight}) {why}; it was never sent",
                    advice)))
            self._lapsed.add(call.frame)
            self._outstanding.append(call)

    def _learn(self, call: Any, kind: str, item: Any) -> None:
        """What a sent frame's outcome says of how long a frame takes from its sending to
        its outcome (`_need`): a result, that long (a moving average); a deadline, longer
        than it had."""
        if kind != "error":
            took = call.t_done - call.t_sent
            self._need = took if self._need == 0.0 else self._need + (took - self._need) * 0.25
        elif isinstance(item, DeadlineExceeded) and call.deadline is not None and call.t_sent:
            # (t_sent: it reached the wire; at most its timeout, whatever the clocks say)
            self._need = max(self._need, min(call.deadline - call.t_sent, call.timeout))

    def _submit(self, call: Any, timeout: float | None) -> bool:
        """Submit one frame, its deadline counted from its `send()`; the frames dropped or
        expired since the last one sent ride on it (the broker counts them:
        `zmq_infer_stream_dropped_frames_total`, frames its service never saw)."""
        call.deadline = _deadline_of(call)  # (set again each try: an unsent call loses it)
        call.dropped = self._dropped + self._expired - self._told  # (told once it left: `_send_head`)
        return self._submit_call(call, timeout)

    def _pop_head(self) -> tuple[str, Any] | None:
        """The head frame's outcome, if it has one (PARTIALs are released unread)."""
        while self._outstanding:
            head = self._outstanding[0]
            while head.inbox and head.inbox[0][0] == "partial":
                head.inbox.popleft()[1].release()
            if not head.inbox:
                return None
            kind, item = head.inbox.popleft()
            self._outstanding.popleft()
            if self._lapsed and head.frame in self._lapsed:  # never sent (`_lapse`): counted there
                self._lapsed.discard(head.frame)
                self._runs.pop(head.frame, None)
                if not self._closed:
                    self._flush()
                return kind, item
            if head.partials and kind == "final":
                # A streaming model's frame: its PARTIALs went unread, and an empty FINAL is
                # no result (what `infer` says too, rather than hand out an empty Result).
                try:
                    item = final_of_infer(self.service, item, head.partials,
                                          instead="use client.infer_stream() for each frame")
                except NotSupported as e:
                    kind, item = "error", e
            self._learn(head, kind, item)
            if kind == "error":
                self._failed += 1
                if not head.done:  # a client-side failure: tell the broker to stop
                    self._client.give_up(head)
            else:
                self._completed += 1
                self._lat.append((head.t_done - head.t_submit) * 1000.0)
            if not self._closed:
                self._flush()  # its place is free: the next frame goes now
            return kind, item
        return None

    def _expire_head(self) -> InferenceError:
        head = self._outstanding.popleft()
        self._failed += 1
        self._client.give_up(head)
        err = self._client.deadline_error(head)
        self._learn(head, "error", err)
        return err

    def _shutdown(self) -> None:
        self._closed = True
        now = time.monotonic()
        while self._pending:  # never sent: dropped, as a newer frame would have, or expired
            call = self._pending.popleft()
            self._client.give_up(call)
            deadline = _deadline_of(call)
            if deadline is not None and now >= deadline:
                self._expired += 1  # out of time already (as `_lapse` counts it)
            else:
                self._dropped += 1
        while self._outstanding:
            call = self._outstanding.popleft()
            if call.frame in self._lapsed:  # never sent, given up already (counted in expired)
                continue
            self._client.give_up(call)
            self._cancelled += 1
        self._lapsed.clear()
        self._runs.clear()
        if self._pinned:
            self._pinned = False
            self._client.stream_closed(self.service)  # the last stream of a service ends its lease

    def __del__(self) -> None:
        # Dropped unclosed (an application's error before close(), no `with`): closed as a
        # reply handle is, or a stream that pinned its service kept the lease, and the
        # worker's credit it holds, for the client's life, and the client's plain calls to
        # that service went on it (the interruption hunt).
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


class Stream(_StreamCore):
    """Blocking frame stream (`Client.stream`).  Not thread-safe, like the client."""

    def send(self, inputs: Mapping[str, Any]) -> int:
        """Queue one frame and return its number (0, 1, ...).  Never waits for the broker (a
        reply begun on a lease's link is read whole first: 20 ms at most, `Client.pump`)."""
        self._client.pump(0)
        call = self._make(inputs)
        self._admit(call)
        self._flush()
        return call.frame

    def recv(self, timeout: float | None = None) -> Result:
        """The next result in send order.  Raises the frame's error if it failed,
        DeadlineExceeded if the frame outlived its timeout, TimeoutError after `timeout`
        seconds (the frame stays in flight), EndOfStream when nothing is outstanding.
        After the client was closed, the results that had arrived before, then
        InferenceError, as `AsyncStream.recv` (and a handle's `result()`)."""
        client = self._client
        timeout = wait_limit(timeout)
        stop = None if timeout is None else time.monotonic() + timeout
        if not client.closed:
            client.pump(0)  # what already arrived counts, even with timeout=0
        while True:
            self._flush()
            got = self._pop_head()
            if got is not None:
                kind, item = got
                if kind == "error":
                    raise item
                return item
            if client.closed and not self._closed:  # close() failed its calls, then let go of them
                raise InferenceError("this stream's client was closed (its frames still out failed with it); "
                                     "make a new client and stream", code=None)
            now = time.monotonic()
            if not self._outstanding:
                if not self._pending:
                    raise EndOfStream("nothing to receive: every frame sent so far has been received or dropped")
                # Frames wait for the socket (high-water mark): wait until it takes the oldest.
                if stop is not None and now >= stop:
                    raise TimeoutError(f"no result within {timeout:g}s; the broker is not reading")
                limit = stop
                deadline = _deadline_of(self._pending[0])
                if deadline is not None and (limit is None or deadline < limit):
                    limit = deadline  # (past it, the next `_flush` lapses it)
                self._send_head(None if limit is None else max(limit - now, 1e-3))
                continue
            head = self._outstanding[0]
            if head.deadline is not None and now >= head.deadline:
                raise self._expire_head()
            if stop is not None and now >= stop:
                raise TimeoutError(f"no result within {timeout:g}s; the frame is still in flight")
            # A silent broker fails the head in its inbox (client.pump): _pop_head raises it.
            ends = [t for t in (head.deadline, stop) if t is not None]
            client.pump(min(ends) - now if ends else None)

    def __iter__(self):
        """Results until every frame sent so far has one."""
        while self._outstanding or self._pending:
            yield self.recv()

    def close(self) -> None:
        """Cancel outstanding frames, drop pending ones (those whose deadline passed count as
        expired).  Results already received stay valid."""
        if not self._closed:
            self._shutdown()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _waker(method: "weakref.WeakMethod") -> Callable[[], None]:
    def wake() -> None:
        bound = method()
        if bound is not None:
            bound()
    return wake


class AsyncStream(_StreamCore):
    """asyncio frame stream (`AsyncClient.stream`).  `send()` is a plain method (it never
    waits for the broker); results come from `await s.recv()` or `async for r in s`, which
    ends after `finish()` once everything sent has a result, or at `close()`.

    `send()`, `finish()` and `close()` may be called from another thread (a camera's) while
    the client's loop runs: each is then done on the loop, the caller waiting for it (one
    turn of the loop; `via`, the client's hand-off, passed by `AsyncClient.stream`), so the
    stream, the client's socket and its pool are only ever touched by the loop's thread.
    Done in the caller's thread, a frame went out on the socket while the loop sent its own,
    and the two messages tore."""

    def __init__(self, *args: Any, via: Callable[..., Any] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        import asyncio  # here, not at the module's top: a blocking client never loads asyncio

        self._event = asyncio.Event()
        # ``via(fn, *args)``: fn(*args), on the client's loop from another thread while it
        # runs (and waited for), else here (None: always here)
        self._via = via
        # A weak wake-up for its frames: the client holds each frame in flight (and its
        # `notify`) until its outcome, and a bound `self._wake` kept a stream dropped
        # unclosed alive that long, so its frames in flight were not cancelled, nor its
        # lease ended, at its drop.
        self._notify = _waker(weakref.WeakMethod(self._wake))

    def _wake(self) -> None:
        # Called by the client's reader for every reply to one of our frames.  An arrived
        # result holds its place until recv() takes it (`_in_flight`), so this sends nothing
        # new; it lapses the pending frames that can no longer make their deadline, and
        # wakes a waiting recv().
        if not self._closed:
            self._flush()
        self._event.set()

    def send(self, inputs: Mapping[str, Any]) -> int:
        """Queue one frame and return its number (0, 1, ...).  Never waits for the broker
        (from another thread: for the client's loop to take it; the inputs are packed, and an
        ordinary array copied, before it returns)."""
        via = self._via
        if via is not None:
            return via(self._send, inputs)
        return self._send(inputs)

    def _send(self, inputs: Mapping[str, Any]) -> int:
        call = self._make(inputs)
        call.notify = self._notify
        self._admit(call)
        self._flush()
        self._event.set()
        return call.frame

    def finish(self) -> None:
        """No more frames will be sent: iteration ends once the outstanding ones are in."""
        if self._via is not None:
            self._via(self._finish)
        else:
            self._finish()

    def _finish(self) -> None:
        self._finishing = True
        self._event.set()

    def unfinished(self) -> frozenset[int]:
        """As `Stream.unfinished`; from another thread (the camera thread that picks the
        `client.alloc` buffer to write next) it is read on the client's loop, between two
        of the loop's own steps: read in the caller's thread, the deques it reads changed
        under it (RuntimeError), and a frame moving from pending to outstanding could be in
        neither (its buffer then taken for free while the worker reads it: the AR audit)."""
        via = self._via
        if via is not None:
            return via(super().unfinished)
        return super().unfinished()

    def stats(self) -> StreamStats:
        """As `Stream.stats`; from another thread, read on the client's loop (`unfinished`)."""
        via = self._via
        if via is not None:
            return via(super().stats)
        return super().stats()

    async def recv(self, timeout: float | None = None) -> Result:
        """The next result in send order; same errors as `Stream.recv`.  With nothing
        outstanding it waits for the next `send()`, unless the stream is finished or closed
        (EndOfStream)."""
        timeout = wait_limit(timeout)
        stop = None if timeout is None else time.monotonic() + timeout
        looked = False
        while True:
            if self._closed:
                raise EndOfStream("the stream is closed")
            self._flush()
            got = self._pop_head()
            if got is not None:
                kind, item = got
                if kind == "error":
                    raise item
                return item
            if not self._outstanding and not self._pending and self._finishing:
                raise EndOfStream("the stream is finished and every frame has its result")
            if self._client.closed:  # close() failed its calls, then let go of them
                raise InferenceError("this stream's client was closed (its frames still out failed with it); "
                                     "make a new client and stream", code=None)
            now = time.monotonic()
            head = self._outstanding[0] if self._outstanding else None
            if head is not None and head.deadline is not None and now >= head.deadline:
                raise self._expire_head()
            if stop is not None and now >= stop:
                if looked:
                    raise TimeoutError(f"no result within {timeout:g}s; "
                                       + ("the frame is still in flight" if head is not None else "no frame in flight"))
                # What already arrived counts, even with timeout=0 (as `Stream.recv`): the
                # loop's reader may not have run since the reply came (the asyncio hunt).
                looked = True
                await self._client.pump(0)  # routes what is in the sockets, and returns at once
                continue
            looked = True
            ends = [t for t in (head.deadline if head is not None else None, stop) if t is not None]
            self._event.clear()
            if ends:
                # asyncio.timeout, not wait_for: on 3.11 wait_for drops the task's
                # cancellation when the event comes at the same moment.
                import asyncio

                try:
                    async with asyncio.timeout(min(ends) - now):
                        await self._event.wait()
                except TimeoutError:
                    pass
            else:
                await self._event.wait()

    def wake(self) -> None:
        """Wake a `recv()` that waits (the client closed: it raises `InferenceError`)."""
        self._event.set()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Result:
        try:
            return await self.recv()
        except EndOfStream:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Cancel outstanding frames, drop pending ones (those whose deadline passed count as
        expired), end iteration."""
        if self._via is not None:
            self._via(self._close)
        else:
            self._close()

    def _close(self) -> None:
        if not self._closed:
            self._shutdown()
            self._event.set()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
