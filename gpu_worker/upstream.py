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
    close()                             (BrokerLink: what is still queued, a DISCONNECT, may
                                        take CLOSE_LINGER_MS to leave)
    last_sent: float                    monotonic time of the last message sent upstream
    watch_liveness: bool                whether silence for heartbeat_liveness intervals
                                        means the peer is gone (the worker reconnects)
    relay: bool                         a relay that never speaks on its own (no WELCOME):
                                        the worker is ready at once, without a warning
    monitor: zmq.Socket | None          polled by the loop when set, by its file descriptor
                                        (ZMQ_FD: it signals on new events only, so
                                        reconnected() must read until none is left, and
                                        nothing else may touch the socket); then
                                        reconnected() says whether the connection dropped
                                        and came back

It never decides anything about requests: the worker loop does.  The worker owns its
upstream and closes it.

A broker on tcp is reached with CurveZMQ (docs/security.md): `server_key` is the broker's
public certificate or z85 key, `worker_key` this worker's secret certificate, whose public
half must be in the broker's worker allow-list (`--worker-keys`); `insecure=True` is plain tcp.
Without either, a tcp endpoint raises `CurveKeyError` naming the options to pass.
"""
from __future__ import annotations

import logging
import time

import zmq

from broker import protocol as P
from broker.protocol import curve as C
from broker.protocol.wire import recv_monitor_event, send_frames

__all__ = ["BrokerLink", "link_keys", "CurveKeyError", "ENV_WORKER_KEY"]

CurveKeyError = C.CurveKeyError

#: this worker's secret certificate when none is given (with ZMQ_INFER_SERVER_KEY for the
#: broker's public key)
ENV_WORKER_KEY = "ZMQ_INFER_WORKER_KEY"


def link_keys(endpoint: str, server_key=None, worker_key=None, insecure: bool = False) -> C.PeerKeys | None:
    """The CURVE keys for a broker at `endpoint` (None: not tcp, or `insecure`); raises
    `CurveKeyError` for a tcp endpoint without keys, or with keys that cannot be read."""
    return C.peer_keys(endpoint, server_key, worker_key, insecure=insecure, server_opt="--server-key",
                       own_opt="--worker-key", insecure_opt="--insecure", own_name="worker",
                       env_own=ENV_WORKER_KEY)

log = logging.getLogger("gpu_worker")


#: how long what is still queued to the broker may take to leave when the link closes for good
CLOSE_LINGER_MS = 250

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_WHY = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the broker refused this worker's key",
                  zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a protocol mismatch: CurveZMQ on one side only?",
                  zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail: a wrong --server-key?"}


class BrokerLink:
    """A DEALER to the broker at ``endpoint`` (see the module docstring)."""

    watch_liveness = True
    relay = False

    def __init__(self, endpoint: str, ctx: zmq.Context, *, server_key=None, worker_key=None,
                 insecure: bool = False):
        self.endpoint = endpoint
        self.ctx = ctx
        self.curve = link_keys(endpoint, server_key, worker_key, insecure)
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # the socket's connection events (PAIR), for the loop to poll
        self.connected = False  # as the monitor last said (read by `reconnected`)
        self.last_sent = 0.0
        #: why the broker refused this worker's latest CurveZMQ handshake, as libzmq reports it
        #: (None: none refused since the last one that succeeded).  The worker's lines about
        #: the broker's silence name it: the silence of a refused handshake is no wrong
        #: endpoint, and "could not send" alone left the cause to a line a minute old.
        self.refused: str | None = None
        self._dropped = False
        self._bad = P.RateLimitedLog(log)

    def open(self) -> zmq.Socket:
        """(Re)open the DEALER to ``endpoint``, without saying anything on it."""
        self._close_socket()
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = s.sndhwm = 100_000
        # libzmq reconnects on its own when the broker goes away; the monitor tells us when
        # the connection came back, which means (most often) a new broker process that has
        # never heard of us: register again at once rather than at the next heartbeat.
        self.monitor = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
                                            | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._dropped = False
        self.connected = False
        C.configure_peer(s, self.curve)
        P.ipv6_for(s, self.endpoint)
        s.connect(self.endpoint)
        self.sock = s
        return s

    def reconnected(self) -> bool:
        """Read the monitor's pending events; True when the connection dropped and came back
        since the last (re)open, i.e. the worker should register afresh."""
        came_back = False
        while self.monitor is not None and self.monitor.poll(0):
            event = recv_monitor_event(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._dropped = True
                self.connected = False
            elif event == zmq.EVENT_CONNECTED:
                self.connected = True
                if self._dropped:
                    came_back = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
            elif event & _HANDSHAKE_FAILED:
                self.refused = _HANDSHAKE_WHY.get(event, "no detail")
                self._bad.warning("the CurveZMQ handshake with the broker at %s failed (%s): check --server-key, "
                                  "--worker-key (in the broker's --worker-keys?) or --insecure against how the "
                                  "broker was started", self.endpoint, _HANDSHAKE_WHY.get(event, "no detail"))
        return came_back

    def connect(self, service: str, ready: P.Ready) -> zmq.Socket:
        """(Re)open and register with the broker (READY)."""
        s = self.open()
        # Never blocking (`send`): a handshake the broker refused for good before this line
        # ran (a loaded machine descheduled the worker after its connect: libzmq then gives
        # the endpoint up, and a DEALER with no peer takes nothing) left the worker in this
        # send for good, deaf to SIGTERM.  Dropped, the liveness check opens it again.
        self.send(P.worker_ready(service, ready))
        return s

    def receive(self, frames) -> P.BrokerToWorker | None:
        try:
            return P.parse_broker_to_worker(frames)
        except P.ProtocolError as e:
            self._bad.warning("malformed message from broker: %s", e)
            return None

    def send(self, frames) -> None:
        # Never blocking: with no connection to queue on (a refused CurveZMQ handshake leaves
        # none) a blocking send waited for good, deaf to SIGTERM.  What cannot be queued is
        # dropped and said; the broker's liveness rules take it from there.
        try:
            send_frames(self.sock, frames, zmq.NOBLOCK)
        except zmq.Again:
            if self.refused is not None:
                self._bad.warning("could not send to the broker at %s: its handshake failed (%s); dropped", self.endpoint, self.refused)
            else:
                self._bad.warning("could not send to the broker at %s: no connection takes it (a refused "
                                  "handshake, a wrong endpoint, or 100,000 messages queued); dropped", self.endpoint)
            return
        self.last_sent = time.monotonic()

    def _close_socket(self, linger_ms: int = 0) -> None:
        if self.sock is not None:
            if self.monitor is not None:
                self.sock.disable_monitor()
                self.monitor.close(linger=0)
                self.monitor = None
            self.sock.close(linger=linger_ms)
            self.sock = None

    def close(self) -> None:
        """Close the connection for good.  What is still queued (the DISCONNECT just sent)
        may take CLOSE_LINGER_MS to leave: dropped, a goodbye would look like a death to the
        broker (the clients of the leases we ended would resend what we answered)."""
        self._close_socket(CLOSE_LINGER_MS)
