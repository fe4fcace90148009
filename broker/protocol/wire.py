"""Multipart send and receive without pyzmq's per-frame Python layers.

`Socket.send_multipart` and `recv_multipart` go, for every frame, through the sugar
`send`/`recv`, build `SNDMORE | flags` as an `IntFlag` (an enum construction each time) and
ask `getsockopt(RCVMORE)` through the option-name machinery.  For the 5 small frames of an
MDP request that costs 6.7 µs per send and 7.9 µs per receive on the test machine, against
1.8 µs and 2.7 µs here (`python -m bench.micro_protocol`, BENCHMARKS.md): a request crosses
six such sends and receives in three processes, most of them on its critical path.  Semantics are those
of `send_multipart(frames, flags, copy=False)` and `recv_multipart(copy=False)`: frames are
sent zero-copy above pyzmq's copy threshold, and received as `zmq.Frame` objects.
"""
from __future__ import annotations

from typing import Any, Sequence

import zmq
from zmq.backend import Socket as _Base

__all__ = ["send_frames", "recv_frames", "sock_events", "NOBLOCK"]

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_send = _Base.send
_recv = _Base.recv
_get = _Base.get
_EVENTS = int(zmq.EVENTS)


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags=flags, copy=False)`, faster.  `flags` is 0 or
    NOBLOCK; as with send_multipart, a full queue raises `zmq.Again` at the first frame
    (libzmq queues a multipart message whole or not at all)."""
    last = len(frames) - 1
    more = int(flags) | _SNDMORE
    for i, f in enumerate(frames):
        _send(sock, f, more if i < last else int(flags), False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """`sock.recv_multipart(flags, copy=False)`, faster."""
    f = _recv(sock, flags, False)
    parts = [f]
    while f.more:
        f = _recv(sock, flags, False)
        parts.append(f)
    return parts


def sock_events(sock: zmq.Socket) -> int:
    """`sock.get(zmq.EVENTS)` without the sugar layer's Python call (the loops ask this once
    per message and once more to find the queue empty)."""
    return _get(sock, _EVENTS)
