"""A TCP relay that can reset every connection through it: the cut a middlebox, a load
balancer or a peer's crash makes, on loopback, for the tests and `bench.restart`.

`Relay(target_port)` listens on 127.0.0.1 (`port`) and forwards each connection it accepts to
127.0.0.1:<target_port>, both ways, on one thread; `cut()` resets every connection through it
(RST to both ends, as SO_LINGER 0 makes a close) and returns once that is done, and it keeps
accepting new ones; `accepted` counts the connections it took; `close()` stops it.

`cut_at(pattern)` arms a cut for the first read from the target side that holds `pattern`:
that read is dropped, not forwarded, and every connection is reset then, so a reply the
target sent is lost with its connection (a test names a string in the reply, e.g. its
service; plain-text traffic only, and a pattern split across two reads is missed).
"""
from __future__ import annotations

import selectors
import socket
import struct
import threading

__all__ = ["Relay"]


class Relay:
    """127.0.0.1:<port> -> 127.0.0.1:<target>, one select loop on a thread (module docstring)."""

    def __init__(self, target: int):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._peer: dict[socket.socket, socket.socket] = {}
        self._targets: set[socket.socket] = set()  # the connections to the target
        self._cut_at: bytes | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._cut_asked = threading.Event()
        self._cut_done = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bench-relay", daemon=True)
        self._thread.start()

    def cut(self, timeout: float = 10.0) -> None:
        self._cut_done.clear()
        self._cut_asked.set()
        self._wake_w.send(b"c")
        if not self._cut_done.wait(timeout):
            raise TimeoutError("the relay did not cut its connections")

    def cut_at(self, pattern: bytes) -> None:
        """Cut when the target next sends something that holds `pattern` (dropped, unsent)."""
        self._cut_at = bytes(pattern)

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"s")
        self._thread.join(10)
        if self._thread.is_alive():
            raise RuntimeError("the relay's thread did not stop")
        for s in (self.listener, self._wake_r, self._wake_w):  # its connections: closed by the thread
            s.close()

    def _reset(self, sel: selectors.BaseSelector) -> None:
        for s in list(self._peer):
            sel.unregister(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
            s.close()
        self._peer.clear()
        self._targets.clear()

    def _drop(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        other = self._peer.pop(s, None)
        for x in (s, other):
            if x is not None:
                sel.unregister(x)
                self._peer.pop(x, None)
                self._targets.discard(x)
                x.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop:
                for key, _ in sel.select(1.0):
                    s = key.fileobj
                    if s is self._wake_r:
                        s.recv(64)
                        if self._cut_asked.is_set():
                            self._cut_asked.clear()
                            self._reset(sel)
                            self._cut_done.set()
                    elif s is self.listener:
                        a, _ = self.listener.accept()
                        try:
                            b = socket.create_connection(("127.0.0.1", self.target), timeout=10)
                        except OSError:  # nobody there (yet): the client tries again
                            a.close()
                            continue
                        self._peer[a], self._peer[b] = b, a
                        self._targets.add(b)
                        sel.register(a, selectors.EVENT_READ)
                        sel.register(b, selectors.EVENT_READ)
                        self.accepted += 1
                    elif s in self._peer:
                        try:
                            data = s.recv(1 << 16)
                        except OSError:
                            data = b""
                        if not data:
                            self._drop(sel, s)
                            continue
                        at = self._cut_at
                        if at is not None and s in self._targets and at in data:
                            self._cut_at = None
                            self._reset(sel)  # the read is dropped with its connection
                            continue
                        try:
                            self._peer[s].sendall(data)
                        except OSError:
                            self._drop(sel, s)
        finally:
            self._reset(sel)
            sel.close()
