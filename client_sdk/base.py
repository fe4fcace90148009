"""What `Client` and `AsyncClient` expose in exactly the same way, answered by their core.

`ClientBase` holds the properties, the buffer methods, the counters and `give_up`; each twin
adds the methods that move frames or wait (infer, request, mmi_service, close, and the stream
seams `prepare`, `submit`, `pump`) and its `_send_soon`, with the same names, arguments and
meaning.
tests/client_sdk/test_sdk_surface.py compares the two classes so that they cannot drift.

`ReplyStreamBase` is what the blocking and the asyncio reply streams share: the call, and
giving up on it (CANCEL to the broker) when closed or dropped before its FINAL.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .calls import Call
from .core import ClientCore

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

    def in_flight(self) -> int:
        """Requests sent and not yet answered with a FINAL."""
        return self._core.in_flight()

    def give_up(self, call: Call) -> None:
        """Stop waiting for `call`: an unsent one is dropped and its input slots freed now; one
        in flight is cancelled at the broker (its slots are freed when its FINAL arrives).
        Whatever still arrives for it is released unread."""
        frames = self._core.give_up(call)
        if frames is not None and not self._core.closed:
            self._send_soon(frames)

    def _send_soon(self, frames: list[Any]) -> None:
        """Send one message without waiting (each twin's own: the blocking client drops what a
        full socket refuses, the broker being gone then; the asyncio client queues it in order)."""
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
    """The replies to one request: `request_id`, and `close()`, which cancels the request if
    its FINAL has not arrived (also when the stream is garbage-collected)."""

    def __init__(self, client: Any, call: Call):
        self._client = client
        self._call = call
        self._finished = False

    @property
    def request_id(self) -> int:
        return self._call.id

    def close(self) -> None:
        """Stop listening; cancels the request if its FINAL has not arrived."""
        if not self._finished:
            self._finished = True
            self._client.give_up(self._call)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
