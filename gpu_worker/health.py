"""The worker's own HTTP probes (`python -m gpu_worker --health-port [HOST:]PORT`), for an
orchestrator that watches each process (a kubelet's liveness probe):

    GET /v2/health/live    200 while the worker's loop runs (it passed within its liveness
                           window, or a batch is computing: a model that computes is alive)
    GET /v2/health/ready   200 while the broker has it registered (from its WELCOME until the
                           connection is lost or it drains; behind a plain MDP broker, which
                           sends no WELCOME, while its heartbeats are heard once READY is
                           announced)

Served on one daemon thread (`ThreadingHTTPServer`, a socket timeout per connection); it
only reads two attributes the loop writes (a float and a bool), never the loop's state.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

from broker.protocol.httpserve import BoundedHandler, BoundedHTTPServer
from broker.protocol.logs import block_stop_signals

__all__ = ["HealthServer", "parse_port"]

log = logging.getLogger("gpu_worker")


def parse_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (127.0.0.1); ValueError otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep:
        host = "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"--health-port {text!r}: expected [HOST:]PORT") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"--health-port {text!r}: port {p} out of range")
    return host.strip("[]") or "127.0.0.1", p


class _Handler(BoundedHandler):
    server_version = "zmq-infer-worker"

    def log_message(self, fmt, *args):
        log.debug("health %s " + fmt, self.client_address[0], *args)

    def do_HEAD(self):  # some load balancers probe with HEAD
        self.do_GET()

    def do_GET(self):
        try:
            path = urlsplit(self.path).path.rstrip("/")
        except ValueError:  # ("GET http://[::1 ...": an ERROR with a traceback, and no answer)
            path = None
        if path is None:
            body, status = {"error": "the request's path cannot be parsed"}, 400
        elif path == "/v2/health/live":
            ok = self.server.live()
            body, status = {"live": ok}, 200 if ok else 503
        elif path == "/v2/health/ready":
            ok = self.server.ready()
            body, status = {"ready": ok}, 200 if ok else 503
        else:
            body, status = {"error": f"no such path {path!r}"}, 404
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class HealthServer:
    def __init__(self, address: tuple[str, int], live: Callable[[], bool], ready: Callable[[], bool]):
        self.server = BoundedHTTPServer(address, _Handler)
        self.server.daemon_threads = True
        self.server.live = live
        self.server.ready = ready
        self.address = self.server.server_address[:2]
        self._thread = threading.Thread(target=self._serve, name="gpu_worker-health", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        block_stop_signals()  # the worker's loop thread takes them (its request threads inherit this)
        self.server.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def loop_alive(last_loop: Callable[[], float], window: Callable[[], float], computing: Callable[[], bool]) -> bool:
    """Liveness: the loop passed within ``window`` seconds (at least 2 s: a loaded machine
    may stall a loop that long without anything being wrong), or a batch is computing."""
    return computing() or time.monotonic() - last_loop() <= max(2.0, window())
