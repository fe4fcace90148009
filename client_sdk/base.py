"""What `Client` and `AsyncClient` expose in exactly the same way, answered by their core.

`ClientBase` holds the properties, the buffer methods, the counters and `give_up`; each twin
adds the methods that move frames or wait (infer, request, mmi_service, close, and the stream
seams `prepare`, `submit`, `pump`) and its `_send_soon`, with the same names, arguments and
meaning.
tests/client_sdk/test_sdk_surface.py compares the two classes so that they cannot drift.

`ReplyStreamBase` is what the blocking and the asyncio reply streams share: the call, giving
up on it (CANCEL to the broker) when closed or dropped before its FINAL, `cancel()` and
`cancelled`, and what `result()` makes of each reply; each twin adds the waiting
(`__next__`/`result()`, `__anext__`/`await result()`).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .calls import Call, final_of_infer
from .core import ClientCore
from .errors import Cancelled, EndOfStream

__all__ = ["ClientBase", "ReplyStreamBase"]


class ClientBase:
    """Properties, buffers and counters of a client; see `Client` and `AsyncClient`."""

    _core: ClientCore

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def uses_shm(self) -> bool:
        """Whether inputs go through shared memory (transport resolved against the endpoint)."""
        return self._core.use_shm

    @property
    def pool(self) -> Any:
        """The client's input `shm.ShmPool` (created on first use)."""
        return self._core.pool

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def direct_replies(self) -> int:
        """Replies that came straight from a worker on this host instead of through the
        broker (docs/protocol.md section 8); 0 when `direct_reply=False` or the broker is
        remote."""
        return self._core.direct_replies

    @property
    def stray_replies(self) -> int:
        """Replies that matched no waiting request (late, duplicate or abandoned)."""
        return self._core.discarded

    @property
    def broker_restarts(self) -> int:
        """Broker restarts this client noticed (a new instance id in a heartbeat answer); the
        calls in flight at each were sent again (docs/client.md, "When the broker restarts")."""
        return self._core.broker_restarts

    @property
    def broker_reconnects(self) -> int:
        """Times this client's connection to the broker was replaced under it (the same broker
        process knew it by a new identity: a reset, or a connection closed for silence), or
        the broker dropped its record of the client for its silence while it held work, or
        the connection was replaced before any answer named the broker (a restart cannot be
        told from a reset then); the
        calls sent before and still waited for were sent again (docs/client.md, "When the
        connection to the broker is replaced")."""
        return self._core.broker_reconnects

    @property
    def resent_calls(self) -> int:
        """Brokered calls this client sent again because the broker restarted or its
        connection was replaced (each once per resend; the broker may count both copies)."""
        return self._core.resent

    @property
    def pinned_replies(self) -> int:
        """Replies that came from a leased worker on its direct connection (`pin=True`, or a
        stream's service): requests that never crossed the broker (docs/client.md, "Pinned
        streams")."""
        return self._core.pinned_replies

    def pinned(self, service: str) -> bool:
        """Whether this client holds a lease on `service` now and its connection is up (a tcp
        lease's handshake succeeded), so that its next requests go straight to the leased
        worker (with `pin=False`, only a stream's service can be)."""
        return self._core.pinned(service)

    def in_flight(self) -> int:
        """Requests sent and not yet answered with a FINAL."""
        return self._core.in_flight()

    def deadline_error(self, call: Call) -> Exception:
        """The DeadlineExceeded for `call`, past its deadline (with a word on the endpoint
        when nothing at all has come from it)."""
        return self._core.deadline_error(call)

    def give_up(self, call: Call) -> None:
        """Stop waiting for `call`: an unsent one is dropped and its input slots freed now; one
        in flight is cancelled at the broker, or at its leased worker (its slots are freed
        when its FINAL arrives).  Whatever still arrives for it is released unread."""
        core = self._core
        frames = core.give_up(call, time.monotonic())
        if frames is not None and not core.closed:
            self._send_soon(frames)
        if core.ops and not core.closed:
            self._run_ops()

    def _close_cancel(self, wait: float) -> tuple[list[Call], float] | None:
        """The start of `close()`'s wait, the same on both twins: the requests in flight that
        may be answered in shared memory are cancelled (`ClientCore.close_cancel`; the
        CANCELs sent, a leased call's on its lease's connection).  Returns those calls and
        when the wait ends, or None when there is nothing to wait for."""
        core = self._core
        now = time.monotonic()
        calls, frames = core.close_cancel(now)
        if not calls:
            return None
        for msg in frames:
            self._send_soon(msg)
        if core.ops:
            self._run_ops()
        return calls, now + wait

    def _send_soon(self, frames: list[Any]) -> None:
        """Send one message without waiting (each twin's own: the blocking client keeps a
        REQUEST or CANCEL that a full socket refuses for its next pump, in order, and drops a
        refused heartbeat; the asyncio client queues everything in order)."""
        raise NotImplementedError

    def _run_ops(self) -> None:
        """Do what the core queued in `ops` for pinned streams (each twin's own: LEASE and
        LEASE_END to the broker, and the leases' direct connections; see pins.py)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- buffers

    def alloc(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A writable array in the client's shared memory.  Fill it and pass it to `infer`:
        it is sent by reference, never copied.  It is freed when the array (and every view of
        it) is dropped, or by `free()`; a request never frees it."""
        return self._core.alloc(shape, dtype)

    def alloc_cuda(self, shape: Any, dtype: Any = np.float32, device: Any = "cuda:0") -> Any:
        """A torch CUDA tensor in the client's device pool (created on first use).  Fill it
        (on the current stream) and pass it to `infer`: it is sent by CUDA IPC reference,
        never copied.  Freed when the tensor and every view of it are dropped.  Raises
        NotSupported (with the reason) where CUDA is unavailable."""
        return self._core.alloc_cuda(shape, dtype, device)

    def free(self, arr: np.ndarray) -> None:
        """Free an `alloc()` buffer now.  Do not use the array (or any view) afterwards, and
        not while a request that uses it is in flight."""
        self._core.free(arr)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("shm" if self.uses_shm else "inline")
        return f"<{type(self).__name__} {self.endpoint} {state}>"


class ReplyStreamBase:
    """A handle on one request in flight: its replies, `result()`, `cancel()`, `close()`.

    `cancel()` ends the handle at once: the broker is sent CANCEL now, and every later
    `next()` or `result()` raises `Cancelled` without waiting for anything.  The request's
    input slots stay allocated until the FINAL that answers the cancellation arrives (a
    worker may be reading them until then), and are freed by whichever later call of the
    client routes it.  `close()` (also when the handle is garbage-collected) stops
    listening and cancels the request if its FINAL has not arrived; the iteration then just
    ends."""

    def __init__(self, client: Any, call: Call):
        self._client = client
        self._call = call
        self._finished = False   # nothing more will be handed out (FINAL taken, error, closed, cancelled)
        self._cancelled = False  # ended by cancel()
        self._dropped = 0        # PARTIALs that result() released unread

    @property
    def request_id(self) -> int:
        return self._call.id

    @property
    def cancelled(self) -> bool:
        """Whether `cancel()` ended this handle before its FINAL arrived."""
        return self._cancelled

    def cancel(self) -> bool:
        """Cancel the request now, without waiting: CANCEL goes to the broker (a queued
        request never runs; a running one is stopped at its worker) and every later `next()`
        or `result()` raises `Cancelled` at once.  Its input slots are freed when the broker's
        (or worker's) FINAL for it arrives, never earlier.  True if the handle is cancelled
        (now or before); False when there is nothing left to cancel: its FINAL (or error) has
        already arrived, or the handle was closed."""
        if self._cancelled:
            return True
        if self._finished or self._call.done:
            return False
        # The handle is marked once the client took the give-up (a `Client` in use by another
        # thread refuses it: the handle stays as it was, and a later cancel() does it; marked
        # first, that one did nothing and result() raised Cancelled for a request that ran).
        self._client.give_up(self._call)
        self._cancelled = True
        self._finished = True
        return True

    def close(self) -> None:
        """Stop listening; cancels the request if its FINAL has not arrived."""
        if not self._finished:
            self._client.give_up(self._call)  # (refused: not closed, as cancel())
            self._finished = True

    # ---------------------------------------------------------------- for the twins

    def _ended(self, iterating: bool) -> bool:
        """Called before waiting: raises `Cancelled` on a cancelled handle; True when
        nothing more will come (`next()` stops), for `result()` an `EndOfStream`."""
        if self._cancelled:
            call = self._call
            raise Cancelled(f"request {call.id} to {call.service!r} was cancelled by its caller (cancel())",
                            request_id=call.id or None)
        if not self._finished:
            return False
        if iterating:
            return True
        raise EndOfStream("this reply stream has nothing left to receive: its FINAL was already taken, "
                          "it failed, or it was closed")

    def _item(self, kind: str, item: Any) -> Any:
        """What the next reply means for the caller: an error raised (the handle closed,
        which cancels the request if it is still in flight), or the Result."""
        if kind == "error":
            self.close()  # a client-side error (silent broker): the broker hears CANCEL
            raise item
        if kind == "final":
            self._finished = True
        return item

    def _final(self, kind: str, item: Any) -> Any:
        """`result()`'s step: the FINAL's Result (checked as `infer` checks it), or None after
        releasing a PARTIAL."""
        res = self._item(kind, item)
        if res.final:
            return final_of_infer(self._call.service, res, self._dropped, "iterate the handle (not result())")
        self._dropped += 1
        res.release()
        return None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
