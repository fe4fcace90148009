"""Every error class the client SDK raises, and `error_from` (wire code -> class).

Every error a broker or worker can report arrives as a numeric `ErrorCode` in a FINAL's
header; `error_from` turns it into one of the classes below so callers can `except` the case
they can handle (retry on `QueueFull`, give up on `ServiceUnavailable`, ...).  Each message
ends with what to do about it, because the person reading a traceback rarely has the
protocol spec open.

Invariants: no other module of the SDK defines an exception class (they import theirs from
here, and `client_sdk` re-exports all of them); a class keeps its extra base (TimeoutError,
ValueError, ...) so that code catching the builtin keeps working.
"""
# The exception tree (wire code where the error can come from the broker or a worker):
#
# Exception
# └── InferenceError                              code of the reply, or None
#     ├── ServiceUnavailable                      503  no worker serves the service
#     ├── DeadlineExceeded       (+ TimeoutError) 504  not finished in time
#     ├── QueueFull                               429  the broker's queue is full
#     ├── Cancelled                               499  cancelled before it finished
#     ├── ProtocolError (+ broker.protocol.ProtocolError)
#     │                                           400  the wire protocol was broken
#     ├── WorkerFailed                            502  the worker failed or died
#     ├── NotLocal                                421  shm tensors reached another host
#     ├── Forbidden       (+ PermissionError)     403  this client's CurveZMQ key was removed from the allow-list
#     ├── InternalError                           500  broker or worker bug
#     ├── BrokerUnreachable                       503  no answer, not even heartbeats (client-side)
#     ├── NotSupported    (+ NotImplementedError) None e.g. CUDA tensors without a CUDA side
#     ├── InvalidInput    (+ ValueError)          422  the inputs do not match the model (or cannot be sent: None)
#     ├── EndOfStream     (+ LookupError)         None a stream has nothing left to receive
#     └── PoolFull        (+ shm.ShmFull)         None `alloc()`/`alloc_cuda()`: the client's pool has no room
from __future__ import annotations

from broker import protocol as _P
from broker.protocol import ErrorCode
from shm.errors import ShmFull as _ShmFull

__all__ = [
    "InferenceError",
    "ServiceUnavailable",
    "DeadlineExceeded",
    "QueueFull",
    "Cancelled",
    "ProtocolError",
    "WorkerFailed",
    "NotLocal",
    "Forbidden",
    "BrokerUnreachable",
    "InternalError",
    "NotSupported",
    "InvalidInput",
    "EndOfStream",
    "PoolFull",
    "error_from",
]


class InferenceError(Exception):
    """Base of every error the SDK raises.  `code` is the wire `ErrorCode` (an int), or None
    for errors that never crossed the wire."""

    # (None for the base: it was INTERNAL, so "this client is closed" and the other local
    # errors, raised with code=None, read 500, which `code is not None` then kept)
    code: int | None = None
    #: appended to the message when it does not already say what to do
    hint = ""

    def __init__(self, message: str = "", *, code: int | None = None, request_id: int | None = None):
        if code is not None:
            self.code = code
        self.request_id = request_id
        text = message or (self.__class__.__doc__ or "inference failed").strip().splitlines()[0]
        if self.hint and self.hint not in text:
            text = f"{text} ({self.hint})"
        super().__init__(text)


class ServiceUnavailable(InferenceError):
    """No worker serves this service."""

    code = ErrorCode.SERVICE_UNAVAILABLE
    hint = "start a worker for the service, or check the service name (client.mmi_service(name))"

    def __init__(self, message: str = "", **kw):
        if "its last one went" in message and "start a worker" not in message:
            # the broker's: the service had workers, and lost them
            self.hint = "look at its workers: are they running, and do they reach the broker?"
        elif "shutting down" in message or "start a worker" in message:
            # The broker's own advice (its drain: "send the request elsewhere or later"; a
            # full queue with no worker: "start a worker ..."): a second one said "start a
            # worker" of a broker that was stopping, or said it twice.
            self.hint = ""
        super().__init__(message, **kw)


class DeadlineExceeded(InferenceError, TimeoutError):
    """The request did not finish within its timeout."""

    code = ErrorCode.DEADLINE_EXCEEDED
    hint = "raise `timeout`, lower the load, or add workers"


class QueueFull(InferenceError):
    """The broker's queue for this service is full."""

    code = ErrorCode.QUEUE_FULL
    hint = "back off and retry, send fewer requests at once, or add workers"


class Cancelled(InferenceError):
    """The request was cancelled before it finished."""

    code = ErrorCode.CANCELLED
    hint = "nothing to do if you cancelled it; otherwise the broker or worker dropped it, so retry"


class ProtocolError(InferenceError, _P.ProtocolError):
    """A peer sent (or was sent) something that breaks the wire protocol."""

    code = ErrorCode.PROTOCOL_ERROR
    hint = "client, broker and worker must run the same protocol version; this is a bug if they do"


class WorkerFailed(InferenceError):
    """The worker running the request failed or died."""

    code = ErrorCode.WORKER_FAILED
    hint = "see the worker's log; the request may be retried if the model is deterministic"


class Forbidden(InferenceError, PermissionError):
    """The broker no longer serves this client's CurveZMQ key: it was removed from the
    broker's client allow-list while the client was connected (docs/security.md); or, for a
    plain MDP `request` (a connection of its own), the broker refused the key at that
    connection's handshake."""

    code = ErrorCode.FORBIDDEN
    hint = "ask the broker's operator to put this client's public key back in --client-keys"


class NotLocal(InferenceError):
    """Shared-memory tensors were sent to a worker on another host."""

    code = ErrorCode.NOT_LOCAL
    hint = "use transport='inline' for remote brokers, or keep fallback_inline=True"


class BrokerUnreachable(InferenceError):
    """The broker does not answer, not even heartbeats."""

    code = ErrorCode.SERVICE_UNAVAILABLE
    hint = "check that the broker is running and that the endpoint is right"


class InternalError(InferenceError):
    """The broker or worker hit an internal error."""

    code = ErrorCode.INTERNAL
    hint = "see the broker and worker logs; retrying may help"

    def __init__(self, message: str = "", **kw):
        if "the same request fails the same way" in message:  # the worker's: outputs it cannot send
            self.hint = ""
        super().__init__(message, **kw)


class NotSupported(InferenceError, NotImplementedError):
    """This input is not supported yet."""

    code = None
    hint = ""


class InvalidInput(InferenceError, ValueError):
    """An input cannot be sent, or the model's declared inputs refused it (422: the message
    names the mismatch and the signature the service takes)."""

    code = None
    hint = ""  # a local argument error says what to do itself

    def __init__(self, message: str = "", *, code: int | None = None, request_id: int | None = None):
        if code == ErrorCode.INVALID_INPUT and message and "inputs" not in message:
            # (the worker's 422s say what to do; a terse one from another worker gets this)
            message = f"{message} (send inputs the model takes)"
        super().__init__(message, code=code, request_id=request_id)


class EndOfStream(InferenceError, LookupError):
    """Nothing left to receive from this stream."""

    code = None


class PoolFull(InferenceError, _ShmFull):
    """`alloc()` found no room in the client's shared-memory pool, or `alloc_cuda()` none in
    its device pool (also a `shm.ShmFull`)."""

    code = None
    hint = ""  # the pool's message says what to do (a larger pool_capacity, free buffers sooner)


_BY_CODE: dict[int, type[InferenceError]] = {
    ErrorCode.PROTOCOL_ERROR: ProtocolError,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.NOT_LOCAL: NotLocal,
    ErrorCode.INVALID_INPUT: InvalidInput,
    ErrorCode.QUEUE_FULL: QueueFull,
    ErrorCode.CANCELLED: Cancelled,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.WORKER_FAILED: WorkerFailed,
    ErrorCode.SERVICE_UNAVAILABLE: ServiceUnavailable,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def error_from(code: int, message: str = "", *, request_id: int | None = None) -> InferenceError:
    """The exception for a wire error code; unknown codes give a plain `InferenceError` that
    keeps the code, so a newer broker never makes an older client crash."""
    cls = _BY_CODE.get(int(code), InferenceError)
    text = message or ""
    if cls is InferenceError:
        text = f"error {int(code)}: {text or 'no message'} (upgrade the client to learn this code)"
    return cls(text, code=int(code), request_id=request_id)
