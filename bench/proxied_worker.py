"""Our real worker behind a libzmq proxy instead of our broker: the brokered floor.

`python -m bench.proxied_worker --connect EP [--model echo] [--max-batch N] ...`

Runs `gpu_worker.worker.Worker` unchanged (model loading, warm-up, batcher, shared-memory
input mapping, reply encoding) with one part replaced: its upstream (`gpu_worker.upstream`),
so that it can sit behind `zmq.proxy(ROUTER front, DEALER back)` (`python -m
bench.echo_servers proxy`) and be driven by the SDK `Client`.  `ProxyLink` is that upstream:

  connect  DEALER connected to the proxy's backend DEALER; no READY (there is no broker
           to register with).
  receive  what arrives is the client's own MDP/0.2 message behind the identity the
           proxy's ROUTER prepended: [identity, MDPC02, 0x01, service, body...].
           REQUEST -> handed to the worker as the broker's REQUEST would be; HEARTBEAT ->
           answered; `mmi.service` -> 200/404; CANCEL and DISCONNECT -> dropped (a
           cancelled request still runs; the client discards its FINAL).
  send     worker replies [MDPW02, FINAL|PARTIAL, envelope, "", body...] become client
           replies [identity, MDPC02, FINAL|PARTIAL, service, body...]; heartbeats,
           DISCONNECT and anything else meant for a broker are dropped.

Each request gets its own envelope (identity + an 8-byte sequence number), as the broker's
dispatch token would be: the worker keys its held jobs by envelope, and one client may have
many requests in flight.  A broker-silence reconnect never fires (`watch_liveness` is off):
a proxy never heartbeats.  Replies always go back through the proxy (`direct_reply` is
switched off where `WorkerConfig` has it; a request's `reply_to` is ignored).

Prints `READY service=<name> pid=<pid> device=<dev>` once connected, like `python -m
gpu_worker`; SIGTERM drains and exits 0.  Only DEALER clients (no REQ) are supported.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import zmq

from broker import protocol as P
from broker.protocol.heap import freeze_startup_heap
from broker.protocol.wire import send_frames
from gpu_worker.__main__ import add_model_options, model_config
from gpu_worker.upstream import BrokerLink
from gpu_worker.worker import Worker, WorkerConfig, install_sigterm_drain

log = logging.getLogger("bench.proxied_worker")

_MMI_SERVICE = b"mmi.service"
_SEQ_BYTES = 8


def make_config(connect: str, **kw) -> WorkerConfig:
    """WorkerConfig for a proxied worker: every reply relayed, as a relay must."""
    return WorkerConfig(broker=connect, **kw, direct_reply=False)


def make_worker(cfg: WorkerConfig, *, ctx: zmq.Context | None = None) -> Worker:
    """Our `Worker` speaking to a `zmq.proxy` backend at ``cfg.broker``."""
    ctx = ctx or zmq.Context.instance()
    return Worker(cfg, ctx=ctx, upstream=ProxyLink(cfg.broker, ctx))


class ProxyLink(BrokerLink):
    """The worker's upstream when a `zmq.proxy` stands where the broker would (see the
    module docstring)."""

    # A proxy never speaks on its own: silence is not a dead broker, and a reconnect would
    # also drop what the worker holds.
    watch_liveness = False
    # ...nor sends a WELCOME: the worker is ready at once, without its "nothing heard" warning
    relay = True

    def __init__(self, endpoint: str, ctx: zmq.Context):
        super().__init__(endpoint, ctx)
        self.service = b""  # ours, set by connect
        self._seq = 0

    def connect(self, service: str, ready: P.Ready) -> zmq.Socket:
        s = self.open()  # and no READY: a proxy has nobody to register with
        self.service = service.encode()
        self.last_sent = time.monotonic()
        return s

    def receive(self, frames) -> P.BrokerToWorker | None:
        ident = frames[0].bytes
        try:
            msg = P.parse_client(frames[1:])
        except P.ProtocolError as e:
            log.warning("malformed message from client %r: %s", ident[:16], e)
            return None
        if msg.leading_empty:
            log.warning("REQ clients are not supported behind the proxied worker; dropped")
            return None
        cmd = msg.command
        if cmd == P.C_REQUEST:
            service = msg.service
            if service == self.service:
                self._seq += 1
                return P.BrokerToWorker(P.W_REQUEST, ident + self._seq.to_bytes(_SEQ_BYTES, "big"), tuple(msg.body))
            if service == _MMI_SERVICE:
                name = bytes(msg.body[0])
                code = b"200" if name == self.service else b"404"
                token = [bytes(msg.body[1])] if len(msg.body) == 2 and len(msg.body[1]) <= P.MAX_MMI_TOKEN else []
                self._to_client(P.to_client(ident, True, service, [code, *token]))  # as our broker answers
            else:
                rid = P.lenient_request_id(msg.body[0]) if P.is_header(msg.body[0]) else 0
                self._to_client(P.to_client(ident, True, service, P.error_body(
                    rid, P.ErrorCode.SERVICE_UNAVAILABLE,
                    f"this proxied worker serves {self.service.decode()!r} only")))
        elif cmd == P.C_HEARTBEAT:
            self._to_client([ident, *P.client_heartbeat()])
        # C_CANCEL, C_DISCONNECT: nothing to do without a broker's bookkeeping.
        return None

    def send(self, frames) -> None:
        cmd = frames[1]
        if cmd != P.W_FINAL and cmd != P.W_PARTIAL:  # HEARTBEAT, DISCONNECT, DONE: for a broker that is not there
            self.last_sent = time.monotonic()
            return
        env = bytes(frames[2])
        self._to_client(P.to_client(env[:-_SEQ_BYTES], cmd == P.W_FINAL, self.service, frames[4:]))

    def _to_client(self, frames) -> None:
        send_frames(self.sock, frames)  # wire's, as BrokerLink's: the loop's Waiter tracks its sockets by it
        self.last_sent = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    from bench.echo_servers import die_with_parent

    ap = argparse.ArgumentParser(prog="python -m bench.proxied_worker", description=__doc__.splitlines()[0])
    ap.add_argument("--connect", required=True, help="the proxy's backend (DEALER) endpoint")
    add_model_options(ap)
    args = ap.parse_args(argv)
    from broker.protocol.logs import setup_logging

    setup_logging(args.log_level, args.log_format, "proxied-worker")
    die_with_parent()  # SIGTERM (a drain) if the harness dies

    cfg = make_config(args.connect, **model_config(args))
    worker = make_worker(cfg)
    freeze_startup_heap()  # as `python -m gpu_worker` does
    with worker as w:
        install_sigterm_drain(w)
        w.serve(ready_cb=lambda: print(f"READY service={w.service} pid={w.pid} device={w.device}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
