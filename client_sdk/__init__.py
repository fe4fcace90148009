"""Client SDK: numpy in, numpy out, tensors through shared memory when the broker is local.

    from client_sdk import Client
    with Client("ipc:///tmp/zinf.sock") as c:
        r = c.infer("echo", {"x": x})
        y = r["x"]            # zero-copy, read-only; r.release() when done

See docs/client.md for the API, the transports and the lifetime rules of results.
"""
from . import errors
from .aio import AsyncClient, AsyncReplyStream, run
from .client import Client, ReplyStream
from .errors import (
    BrokerUnreachable,
    Cancelled,
    DeadlineExceeded,
    InferenceError,
    NotLocal,
    NotSupported,
    ProtocolError,
    QueueFull,
    ServiceUnavailable,
    WorkerFailed,
)
from .stream import AsyncStream, EndOfStream, Stream, StreamStats
from .tensors import InvalidInput, Result

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
    "BrokerUnreachable",
    "NotSupported",
    "InvalidInput",
]
