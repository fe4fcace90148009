"""The client's sockets: creating them, dropping them, and the direct-reply inbox.

Both twins use these; nothing here parses a reply or keeps request state (that is core.py).

- `dealer(ctx, endpoint)`: a DEALER connected to the broker (linger 0).  Works for a plain
  and an asyncio context alike.
- `drop_socket(sock)`: DISCONNECT, then close with a short linger.  For the short-lived
  socket of an opaque request: the DISCONNECT drops the request at the broker if it is
  still queued, so a late answer goes nowhere.
- `ReplyInbox`: the PULL socket a client binds for direct replies (docs/protocol.md section
  8).  Its ipc file is unlinked by `close()`, or by a finalizer when the client is dropped
  without closing; the broker sweeps the files of clients that died (SIGKILL).
"""
from __future__ import annotations

import logging
import os
import weakref

import zmq

from broker import protocol as P

from .errors import InvalidInput

__all__ = ["CLOSE_LINGER_MS", "dealer", "drop_socket", "ReplyInbox"]

log = logging.getLogger("client_sdk")

#: milliseconds a closing socket may keep trying to deliver its DISCONNECT (close() itself
#: never waits: only terminating the context would)
CLOSE_LINGER_MS = 100

#: sun_path holds 108 bytes; a longer runtime directory keeps replies on the relayed path
_MAX_IPC_PATH = 100


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise InvalidInput(f"cannot connect to {endpoint!r}: {e}; check the endpoint's spelling") from None
    return sock


def drop_socket(sock: zmq.Socket) -> None:
    """DISCONNECT (drops the request at the broker if it is still queued), then close."""
    try:
        sent = sock.send_multipart(P.client_disconnect(), flags=zmq.NOBLOCK)
        if hasattr(sent, "exception") and sent.done():  # an asyncio socket returns a future
            sent.exception()
    except zmq.ZMQError:
        pass
    sock.close(linger=CLOSE_LINGER_MS)


class ReplyInbox:
    """The client's direct-reply socket: a PULL bound to an ipc path that only this user can
    reach (the runtime directory is mode 0700).  Workers on this host connect to it and send
    FINALs there.  libzmq leaves the socket file behind on close, so `close` unlinks it."""

    def __init__(self, sock: zmq.Socket, path: str):
        self.sock = sock
        self.path = path
        self.endpoint = "ipc://" + path   # what requests name as `reply_to`
        # A client dropped without close() still removes its file (at collection or exit).
        self._unlink = weakref.finalize(self, _unlink_quietly, path)

    @classmethod
    def open(cls, ctx: zmq.Context) -> "ReplyInbox | None":
        """Bind a fresh inbox; None (replies then come through the broker) when it cannot be."""
        path = P.reply_socket_path()
        if len(path.encode()) > _MAX_IPC_PATH:
            log.info("runtime directory path too long for a reply socket; replies go through the broker")
            return None
        sock = ctx.socket(zmq.PULL)
        sock.linger = 0
        sock.rcvhwm = 100_000
        try:
            sock.bind("ipc://" + path)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.info("cannot bind a reply socket (%s); replies go through the broker", e)
            return None
        return cls(sock, path)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._unlink()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
