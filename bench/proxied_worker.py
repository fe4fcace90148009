"""Our real worker behind a libzmq proxy instead of our broker: the brokered floor.

`python -m bench.proxied_worker --connect EP [--model echo] [--max-batch N] ...`

Runs `gpu_worker.worker.Worker` unchanged (model loading, warm-up, batcher, shared-memory
input mapping, reply encoding) and overrides only the three methods that touch its socket,
so that it can sit behind `zmq.proxy(ROUTER front, DEALER back)` (`python -m
bench.echo_servers proxy`) and be driven by the SDK `Client`:

  _connect     DEALER connected to the proxy's backend DEALER; no READY (there is no broker
               to register with).
  _on_message  what arrives is the client's own MDP/0.2 message behind the identity the
               proxy's ROUTER prepended: [identity, MDPC02, 0x01, service, body...].
               REQUEST -> the worker's usual `_on_request`; HEARTBEAT -> answered;
               `mmi.service` -> 200/404; CANCEL and DISCONNECT -> dropped (a cancelled
               request still runs; the client discards its FINAL).
  _send        worker replies [MDPW02, FINAL|PARTIAL, envelope, "", body...] become client
               replies [identity, MDPC02, FINAL|PARTIAL, service, body...]; heartbeats,
               DISCONNECT and anything else meant for a broker are dropped.

Each request gets its own envelope (identity + an 8-byte sequence number), as the broker's
dispatch token would be: the worker keys its held jobs by envelope, and one client may have
many requests in flight.  A broker-silence reconnect never fires (`_last_heard` always reads
"now"): a proxy never heartbeats.  Replies always go back through the proxy (`direct_reply`
is switched off where `WorkerConfig` has it; a request's `reply_to` is ignored).

Prints `READY service=<name> pid=<pid> device=<dev>` once connected, like `python -m
gpu_worker`; SIGTERM drains and exits 0.  Only DEALER clients (no REQ) are supported.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from broker import protocol as P
from gpu_worker.__main__ import add_model_options, model_config
from gpu_worker.worker import Worker, WorkerConfig, install_sigterm_drain

log = logging.getLogger("bench.proxied_worker")

_MMI_SERVICE = b"mmi.service"
_SEQ_BYTES = 8


def make_config(connect: str, **kw) -> WorkerConfig:
    """WorkerConfig for a proxied worker: every reply relayed, as a relay must."""
    return WorkerConfig(broker=connect, **kw, direct_reply=False)


class ProxiedWorker(Worker):
    """`Worker` speaking to a `zmq.proxy` backend (see the module docstring)."""

    # A proxy never speaks on its own: the worker's broker-liveness check must not read
    # silence as a dead broker and reconnect (which would also drop what it holds).
    @property
    def _last_heard(self) -> float:
        return time.monotonic()

    @_last_heard.setter
    def _last_heard(self, value: float) -> None:
        pass

    def _connect(self) -> None:
        self._open_socket()  # and no READY: a proxy has nobody to register with
        self._service_b = self.service.encode()
        self._seq = getattr(self, "_seq", 0)
        self._last_sent = time.monotonic()

    def _on_message(self, frames) -> None:
        ident = frames[0].bytes
        try:
            msg = P.parse_client(frames[1:])
        except P.ProtocolError as e:
            log.warning("malformed message from client %r: %s", ident[:16], e)
            return
        if msg.leading_empty:
            log.warning("REQ clients are not supported behind the proxied worker; dropped")
            return
        cmd = msg.command
        if cmd == P.C_REQUEST:
            service = msg.service
            if service == self._service_b:
                self._seq += 1
                self._on_request(ident + self._seq.to_bytes(_SEQ_BYTES, "big"), msg.body)
            elif service == _MMI_SERVICE:
                name = bytes(msg.body[0])
                code = b"200" if name == self._service_b else b"404"
                self._to_client([ident, P.MDPC, P.C_FINAL, service, code])
            else:
                rid = _request_id(msg.body)
                self._to_client([ident, P.MDPC, P.C_FINAL, service, *P.error_body(
                    rid, P.ErrorCode.SERVICE_UNAVAILABLE,
                    f"this proxied worker serves {self.service!r} only")])
        elif cmd == P.C_HEARTBEAT:
            self._to_client([ident, P.MDPC, P.C_HEARTBEAT])
        # C_CANCEL, C_DISCONNECT: nothing to do without a broker's bookkeeping.

    def _send(self, frames) -> None:
        cmd = frames[1]
        if cmd == P.W_FINAL:
            ccmd = P.C_FINAL
        elif cmd == P.W_PARTIAL:
            ccmd = P.C_PARTIAL
        else:  # HEARTBEAT, DISCONNECT, DONE: for a broker that is not there
            self._last_sent = time.monotonic()
            return
        env = bytes(frames[2])
        self._to_client([env[:-_SEQ_BYTES], P.MDPC, ccmd, self._service_b, *frames[4:]])

    def _to_client(self, frames) -> None:
        self.sock.send_multipart(frames, copy=False)
        self._last_sent = time.monotonic()


def _request_id(body) -> int:
    if body and P.is_header(body[0]):
        try:
            return P.decode_request(body[0]).id
        except P.ProtocolError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.echo_servers import _die_with_parent

    ap = argparse.ArgumentParser(prog="python -m bench.proxied_worker", description=__doc__.splitlines()[0])
    ap.add_argument("--connect", required=True, help="the proxy's backend (DEALER) endpoint")
    add_model_options(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s proxied-worker %(levelname)s %(message)s")
    _die_with_parent()  # SIGTERM (a drain) if the harness dies

    cfg = make_config(args.connect, **model_config(args))
    with ProxiedWorker(cfg) as w:
        install_sigterm_drain(w)
        w.serve(ready_cb=lambda: print(f"READY service={w.service} pid={w.pid} device={w.device}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
