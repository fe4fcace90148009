"""The HTTP server under the broker's `/metrics` and health paths (broker.http) and a
worker's health probe (gpu_worker.health): a thread per connection, at most
``max_connections`` at once, and a full server evicts its oldest connection for a new one
(closes its socket: its thread ends at its next read), so clients that connect and then
drip bytes or say nothing can never lock the probes out.  IPv6 when the host is one.
"""
from __future__ import annotations

import socket
import threading
from collections import OrderedDict
from http.server import ThreadingHTTPServer

__all__ = ["BoundedHTTPServer", "MAX_CONNECTIONS", "host_port"]

#: Connections served at once (probes and scrapes are few).
MAX_CONNECTIONS = 16


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (a usable URL authority)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.max_connections = max(1, int(max_connections))
        self._open: OrderedDict = OrderedDict()  # request socket -> None, oldest first
        self._lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._lock:
            while len(self._open) >= self.max_connections:
                old, _ = self._open.popitem(last=False)
                try:
                    old.shutdown(socket.SHUT_RDWR)  # its thread's next read or write fails: it ends
                except OSError:
                    pass
            self._open[request] = None
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)
