"""The broker's HTTP endpoint (`python -m broker --http HOST:PORT`): Prometheus metrics and
KServe v2 / Open Inference Protocol health paths (docs/operations.md, "Metrics and health").

    GET /metrics                       Prometheus text (broker.metrics)
    GET /v2/health/live                200 while the broker loop runs (it passed within 2 s), else 503
    GET /v2/health/ready               200 when some service has a live worker (and a launcher's pools all
                                       were ready once), else 503
    GET /v2/models/{service}/ready     200 live worker; 503 known service without one; 404 unknown
    GET /v2/models/{service}           JSON: workers, hosts, transports, credit, queue, inputs

Threads: the server runs in its own threads (one per connection, at most `MAX_CONNECTIONS`
at once: a new one evicts the oldest still sending its request, so slow clients cannot lock
probes out; a socket timeout per read; a request head of 8 KiB at most;
`broker.protocol.httpserve`).  Scrapes that arrive together share a render (`_Scrapes`).  It never reads the broker's
state itself: each request asks the broker loop for a snapshot over an inproc PAIR
(`LoopLink`), which the loop answers between two messages (`Broker._on_http`).  So the
numbers are consistent and the loop keeps its single-thread invariants.  Liveness alone asks
nothing: the loop stamps each pass, and a probe reads the stamp, so a burst of scrapes can
never make a live broker look dead.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from urllib.parse import unquote, urlsplit

import zmq

from broker.protocol.httpserve import MAX_CONNECTIONS, BoundedHandler, BoundedHTTPServer, host_port

__all__ = ["HttpFront", "LoopLink", "parse_address", "MAX_CONNECTIONS", "host_port"]

log = logging.getLogger("broker")

#: How long a request waits for the loop's snapshot before the answer is 503 (live: the loop
#: is stuck; anything else: it cannot be known now).
LOOP_TIMEOUT_S = 1.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too), or ``PORT`` alone for loopback; ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"--http {text!r}: expected HOST:PORT or PORT") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"--http {text!r}: port {p} out of range")
    return host, p


class LoopLink:
    """The HTTP threads' side of the inproc PAIR to the broker loop: `ask()` sends a
    numbered question and waits for the answer with that number (a late answer to an
    earlier, timed-out question is skipped).  One question at a time (a lock), since a
    ZeroMQ socket is used by one thread at a time; the lock hand-off is the memory barrier."""

    def __init__(self, ctx: zmq.Context, address: str):
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.linger = 0
        self._sock.connect(address)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        #: question number -> the loop's answer, put here by the loop (`answer`); the PAIR
        #: carries only the numbers.  Pickled through it, a scrape's snapshot at 1000
        #: services held the loop 25 ms more than taking it (the scale hunt).
        self.answers: dict[int, object] = {}

    def answer(self, sock: zmq.Socket, n: int, answer) -> None:
        """The loop's side: leave ``answer`` to question ``n`` and say so (never waits)."""
        self.answers[n] = answer
        try:
            sock.send(n.to_bytes(8, "little"), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.answers.pop(n, None)

    def ask(self, what: str, arg: str = "", timeout: float = LOOP_TIMEOUT_S):
        """The loop's answer to ``what`` (a Python object), or None when it did not answer
        within ``timeout``."""
        if not self._lock.acquire(timeout=timeout):
            return None
        try:
            n = next(self._seq)
            self._sock.send_pyobj((n, what, arg))
            ms = int(timeout * 1000)
            while self._sock.poll(ms):
                got = int.from_bytes(self._sock.recv(), "little")
                answer = self.answers.pop(got, None)  # (a late one, to an earlier question, goes too)
                if got == n:
                    return answer
            return None
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)


class _Handler(BoundedHandler):
    server_version = "zmq-infer"

    def log_message(self, fmt, *args):  # access lines at DEBUG, not on stderr
        log.debug("http %s " + fmt, self.client_address[0], *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        link: LoopLink = self.server.link
        try:
            raw = urlsplit(self.path).path.rstrip("/") or "/"
        except ValueError:  # ("GET http://[::1 ...": an ERROR with a traceback, and no answer)
            return self._json(400, {"error": "the request's path cannot be parsed"})
        parts = [unquote(p) for p in raw.split("/")[1:]]  # split first: a name may hold %2F
        path = unquote(raw)
        if path == "/metrics":
            body = self.server.scrape(link)
            if body is None:
                return self._json(503, {"error": "the broker loop did not answer"})
            from prometheus_client.exposition import CONTENT_TYPE_LATEST

            return self._send(200, body, CONTENT_TYPE_LATEST)
        if path == "/v2/health/live":
            ok = self.server.alive()
            return self._json(200 if ok else 503, {"live": ok})
        if path == "/v2/health/ready":
            ready = link.ask("ready")
            ok = bool(ready)
            return self._json(200 if ok else 503, {"ready": ok})
        if len(parts) in (3, 4) and parts[:2] == ["v2", "models"] and parts[2]:
            service = parts[2]
            if len(parts) == 4:
                if parts[3] != "ready":
                    return self._json(404, {"error": f"no such path {path!r}"})
                state = link.ask("model_ready", service)
                if state is None:
                    return self._json(503, {"error": "the broker loop did not answer"})
                status = {"ready": 200, "unavailable": 503}.get(state, 404)
                return self._json(status, {"name": service, "ready": state == "ready"})
            info = link.ask("model", service)
            if info is None:
                return self._json(503, {"error": "the broker loop did not answer"})
            if not info:
                return self._json(404, {"error": f"unknown service {service!r}"})
            return self._json(200, info)
        return self._json(404, {"error": f"no such path {path!r}"})


#: a /metrics render waits this many times what the previous snapshot and render cost
SCRAPE_SHARE = 10


class _Scrapes:
    """`/metrics` bodies, rendered one at a time and shared: a scrape is answered with the
    first body whose snapshot the loop took after the scrape arrived, so scrapes that come
    together cost one or two renders, not one each (a render holds the interpreter the
    broker loop needs for milliseconds: about 0.07 ms a service here, `python -m
    bench.metrics_cost --render`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._at = -float("inf")  # when the snapshot under _body was asked for
        #: until when _body is answered to every scrape: `SCRAPE_SHARE` times what it cost
        self._fresh_until = -float("inf")

    def __call__(self, link: LoopLink) -> bytes | None:
        arrived = time.monotonic()
        # Not before the last body has been kept for SCRAPE_SHARE times what it cost: a
        # scraper that asks again as soon as it is answered waits here, on its HTTP thread
        # and outside the lock (so that scrapes waiting together share the one render that
        # follows, each of a snapshot taken after it arrived).
        if arrived < self._fresh_until:
            wait = min(self._fresh_until - arrived, LOOP_TIMEOUT_S)
            if wait > 0:
                time.sleep(wait)
        if not self._lock.acquire(timeout=LOOP_TIMEOUT_S * 2):
            return None
        try:
            if self._body is not None and self._at >= arrived:
                return self._body
            at = time.monotonic()
            snap = link.ask("metrics")
            if snap is None:
                return None
            from broker.metrics import exposition, render

            # Rendered here, on this thread: the loop only copied its numbers.
            self._body, self._at = exposition(render(*snap)), at
            # A scraper that asks again as soon as it is answered (one HTTP peer in a loop, or
            # HEAD, which downloads nothing) took a snapshot on the loop and a render every
            # time: with 1,000 services, p99 of 16 B calls 2.9 -> 16-20 ms (the HTTP audit).
            # The next render waits SCRAPE_SHARE times what this one cost, so scrapes take
            # at most about a tenth of the interpreter however often they come (a few
            # milliseconds for a few services).
            done = time.monotonic()
            self._fresh_until = done + SCRAPE_SHARE * (done - at)
            return self._body
        finally:
            self._lock.release()


class HttpFront:
    """The HTTP server on its own threads; `close()` stops it."""

    def __init__(self, address: tuple[str, int], link: LoopLink, alive=lambda: True):
        self.server = BoundedHTTPServer(address, _Handler)
        self.server.link = link
        self.server.alive = alive
        self.server.scrape = _Scrapes()
        self.link = link
        self.address = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="broker-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
        self.link.close()
