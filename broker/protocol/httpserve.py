"""The HTTP server under the broker's `/metrics` and health paths (broker.http) and a
worker's health probe (gpu_worker.health): a thread per connection, at most
``max_connections`` at once, and a full server evicts a connection for a new one (closes
its socket: its thread ends at its next read; `_victim` says which), so clients that connect
and then drip bytes, say nothing or read nothing can never lock the probes out, nor cut the
answers being written.  IPv6 when the host is one.

These threads share the interpreter with a latency-critical loop, so what a peer can make
them do is bounded: a request's head (request line and headers) is at most `MAX_HEAD`
bytes (431 past it; the standard parser would take 100 lines of 64 KiB, tens of
milliseconds of the loop's interpreter each), a connection that breaks mid-answer is not a
traceback on stderr (others are logged, rate-limited), and the listen backlog holds a burst
of probes (the default 5 made the sixth simultaneous probe wait for a SYN retry, a second).
"""
from __future__ import annotations

import errno
import io
import logging
import socket
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .ratelog import RateLimitedLog

__all__ = ["BoundedHTTPServer", "BoundedHandler", "MAX_CONNECTIONS", "MAX_HEAD", "host_port"]

#: Connections served at once (probes and scrapes are few).
MAX_CONNECTIONS = 16
#: Largest request head read (request line and headers, bytes): probes and scrapes send a few
#: hundred.
MAX_HEAD = 8192

#: how long a new connection is spared while older idle ones are there (seconds)
_YOUNG_S = 0.5
#: errors of a peer that went away (reset, closed, evicted): no news
_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN, errno.EBADF, errno.ECONNABORTED})

log = logging.getLogger("broker.http")
_errors = RateLimitedLog(log, 10.0)


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (a usable URL authority)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler that reads at most `MAX_HEAD` bytes of request head (431 past it)
    before the standard parser sees it, and tells its server once the head is in (the
    connection is being answered: evicted last)."""

    timeout = 5.0  # a client that sends nothing for this long is dropped (its thread ends)

    def handle_one_request(self):
        raw = getattr(self, "_socket_rfile", None)
        if raw is not None:  # a second request on the connection (HTTP/1.1 keep-alive): the socket again
            self.rfile = raw
            self.server.answering(self.request, False)
        try:
            head = self._read_head()
        except (TimeoutError, OSError):  # silent, or gone (evicted, reset): nothing to answer
            self.close_connection = True
            return
        if head is None:
            self.close_connection = True
            self.request_version, self.command, self.requestline = "HTTP/1.0", "", ""
            self.send_error(431, f"request head over {MAX_HEAD} bytes")
            return
        self.server.answering(self.request, True)
        self._socket_rfile, self.rfile = self.rfile, io.BytesIO(head)
        super().handle_one_request()

    def _read_head(self) -> bytes | None:
        """The request line and headers through the blank line (or what came before the
        peer stopped sending), or None past `MAX_HEAD` bytes."""
        lines, total = [], 0
        while True:
            line = self.rfile.readline(MAX_HEAD + 1 - total)
            total += len(line)
            if total > MAX_HEAD:
                return None
            lines.append(line)
            if not line or line in (b"\r\n", b"\n"):
                return b"".join(lines)

    def finish(self):
        try:
            super().finish()
        finally:
            raw = getattr(self, "_socket_rfile", None)
            if raw is not None:
                raw.close()


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of probes is queued, not dropped

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.max_connections = max(1, int(max_connections))
        # request socket -> whether its head is in (being answered), oldest first
        self._open: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        now = time.monotonic()
        with self._lock:
            while len(self._open) >= self.max_connections:
                old = self._victim(now)
                del self._open[old]
                try:
                    old.shutdown(socket.SHUT_RDWR)  # its thread's next read or write fails: it ends
                except OSError:
                    pass
            self._open[request] = [False, now]
        super().process_request(request, client_address)

    def _victim(self, now: float):
        """The connection a full server closes, the oldest of the first kind there is: still
        sending its request `_YOUNG_S` after it connected (a slow or silent client); answered
        for that long (a client that does not read its answer: ours take milliseconds); still
        sending its request; any.  So neither a probe that just connected nor one being
        answered is what a flood of connections pushes out first."""
        items = self._open.items()
        for r, (answering, since) in items:
            if not answering and now - since >= _YOUNG_S:
                return r
        for r, (answering, since) in items:
            if answering and now - since >= _YOUNG_S:
                return r
        for r, (answering, _) in items:
            if not answering:
                return r
        return next(iter(self._open))

    def answering(self, request, yes: bool = True) -> None:
        """Whether ``request``'s head is in (being answered, from now) or not (waiting for one)."""
        now = time.monotonic()
        with self._lock:
            entry = self._open.get(request)
            if entry is not None:
                entry[0], entry[1] = yes, now

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)

    def handle_error(self, request, client_address):
        """A peer that resets, times out or goes away mid-answer is no news; anything else is
        logged (rate-limited, through logging: not a bare traceback on stderr)."""
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)) or (isinstance(exc, OSError) and exc.errno in _GONE):
            return
        _errors.exception("HTTP request from %s failed", client_address[0] if client_address else "?")
