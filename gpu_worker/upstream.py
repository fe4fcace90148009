"""The worker's upstream: where its work comes from and where its replies go (everything but
the FINALs sent straight to clients, `gpu_worker.direct`).

`BrokerLink` is the MDP/0.2 worker side of a DEALER connected to the broker: READY on
(re)connect, the broker's REQUEST/CANCEL/DISCONNECT parsed into `P.BrokerToWorker`, the
worker's replies, DONEs, heartbeats and DISCONNECT sent as given.  Anything that speaks to
something other than our broker (the bench's proxied worker, a test's recorder) is another
upstream with the same four methods and two attributes:

    connect(service, ready) -> socket   (re)open; the socket the worker loop polls
    receive(frames) -> P.BrokerToWorker | None   None: handled here, or malformed (dropped)
    send(frames)                        one worker message (P.worker_* frames)
    close()
    last_sent: float                    monotonic time of the last message sent upstream
    watch_liveness: bool                whether silence for heartbeat_liveness intervals
                                        means the peer is gone (the worker reconnects)

It never decides anything about requests: the worker loop does.  The worker owns its
upstream and closes it.
"""
from __future__ import annotations

import logging
import time

import zmq

from broker import protocol as P
from broker.protocol.wire import send_frames

__all__ = ["BrokerLink"]

log = logging.getLogger("gpu_worker")


class BrokerLink:
    """A DEALER to the broker at ``endpoint`` (see the module docstring)."""

    watch_liveness = True

    def __init__(self, endpoint: str, ctx: zmq.Context):
        self.endpoint = endpoint
        self.ctx = ctx
        self.sock: zmq.Socket | None = None
        self.last_sent = 0.0

    def open(self) -> zmq.Socket:
        """(Re)open the DEALER to ``endpoint``, without saying anything on it."""
        if self.sock is not None:
            self.sock.close(linger=0)
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = s.sndhwm = 100_000
        s.connect(self.endpoint)
        self.sock = s
        return s

    def connect(self, service: str, ready: P.Ready) -> zmq.Socket:
        """(Re)open and register with the broker (READY)."""
        s = self.open()
        s.send_multipart(P.worker_ready(service, ready))
        self.last_sent = time.monotonic()
        return s

    def receive(self, frames) -> P.BrokerToWorker | None:
        try:
            return P.parse_broker_to_worker(frames)
        except P.ProtocolError as e:
            log.warning("malformed message from broker: %s", e)
            return None

    def send(self, frames) -> None:
        send_frames(self.sock, frames)
        self.last_sent = time.monotonic()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
