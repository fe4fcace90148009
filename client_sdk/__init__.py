"""Client SDK: numpy in, numpy out, tensors through shared memory when the broker is local.

    from client_sdk import Client
    with Client("ipc:///tmp/zinf.sock") as c:
        r = c.infer("echo", {"x": x})
        y = r["x"]            # zero-copy, read-only; r.release() when done

See docs/client.md for the API, the transports and the lifetime rules of results.

Modules: `client` (Client) and `aio` (AsyncClient) are mirrored twins over `core`
(ClientCore: everything that is not I/O) and `calls` (Call, option checks, reply parsing);
`pins` the client's side of leases (pinned streams, `pin=True` or a stream's service: which
requests go straight to a leased worker; socket-free, mixed into the core); `sockets` creates
and drops sockets;
`base` holds what both twins expose alike; `stream` the
frame streams; `tensors` packing and results; `cuda` the CUDA side; `errors` every error
class.  `__all__` below is pinned by tests/client_sdk/test_sdk_surface.py.

The asyncio twin (`AsyncClient`, `AsyncReplyStream`, `run`) is loaded at its first use
(PEP 562), so that a process with only blocking clients never imports asyncio (a fifth of
the package's import time here); `AsyncStream` is defined beside `Stream` and needs nothing
of asyncio until one is made.
"""
from broker.protocol import Priority

from . import errors
from .client import Client, ReplyStream
from .errors import (
    BrokerUnreachable,
    Cancelled,
    DeadlineExceeded,
    EndOfStream,
    Forbidden,
    InferenceError,
    InternalError,
    InvalidInput,
    NotLocal,
    NotSupported,
    PoolFull,
    ProtocolError,
    QueueFull,
    ServiceUnavailable,
    WorkerFailed,
)
from .stream import AsyncStream, Stream, StreamStats
from .tensors import Result

__all__ = [
    "Client",
    "AsyncClient",
    "Result",
    "ReplyStream",
    "AsyncReplyStream",
    "Stream",
    "AsyncStream",
    "StreamStats",
    "EndOfStream",
    "run",
    "errors",
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
    "PoolFull",
    "Priority",
]

_ASYNC = ("AsyncClient", "AsyncReplyStream", "run")


def __getattr__(name: str):
    if name in _ASYNC:
        from . import aio

        value = getattr(aio, name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ASYNC))
