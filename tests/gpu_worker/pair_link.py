"""A worker upstream for in-process worker tests: a PAIR to the test's `peer` socket, in
place of the DEALER to a broker (`gpu_worker.upstream.BrokerLink`'s interface)."""
from __future__ import annotations

import itertools

import zmq

from broker import protocol as P
from broker.protocol.wire import send_frames


_UNIQUE = itertools.count()


class PairLink:
    """The worker's upstream: a PAIR to the test's `peer`; remembers the READY it sent."""

    watch_liveness = False
    monitor = None

    def __init__(self, name: str):
        self.ctx = zmq.Context.instance()
        # Unique in the process: callers name links after id(tmp_path), which a later test's
        # tmp_path can reuse, and libzmq frees a closed socket's inproc name only later, on
        # its reaper thread (a loaded run's bind then failed: Address already in use).
        self.addr = f"inproc://{name}-{next(_UNIQUE)}"
        self.peer = self.ctx.socket(zmq.PAIR)
        self.peer.linger = 0
        self.peer.bind(self.addr)
        self.sock = None
        self.ready = None
        self.last_sent = 0.0

    def connect(self, service, ready):
        self.ready = ready
        if self.sock is not None:
            self.sock.close()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.connect(self.addr)
        return self.sock

    def receive(self, frames):
        return P.parse_broker_to_worker(frames)

    def send(self, frames) -> None:
        send_frames(self.sock, frames)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.peer.close()

    # the test's side

    def to_worker(self, frames) -> None:
        self.peer.send_multipart(frames)

    def sent(self) -> list:
        """What the worker sent so far (inproc delivers at once; the wait is an upper bound)."""
        out = []
        while self.peer.poll(50):
            out.append(self.peer.recv_multipart())
        return out
