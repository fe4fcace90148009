"""The Python cost of one tiny request in each process, with the sockets taken out.

Each component handles the frames it would see for a 16-byte shared-memory echo, with its
sockets taken out through its public seams (the broker's `send_to_client`/`send_to_worker`,
the worker's upstream, a `BrokerLink` whose send only records; the client's socket-free
`ClientCore`); what is left is the component's own work per request (parsing, validation,
scheduling, batching, descriptors):

  broker   client REQUEST in -> dispatch out, worker FINAL in -> FINAL to the client out
  worker   REQUEST in -> map inputs, batch, run echo, reply header out (also with counting on,
           as for a broker with --http: `worker_with_metrics_us`)
  leased   a pinned REQUEST in on the worker's direct socket -> the lone-request lane (run at
           once, no batcher queue) -> FINAL out on the same connection, 16 B inline both ways
           (`worker_leased_us`)
  client   pack the request -> parse the reply -> build and release the Result

    python -m bench.hotpath [--n 20000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import os
import shutil
import tempfile
import time

import numpy as np
import zmq

from broker import protocol as P
from gpu_worker.upstream import BrokerLink


def _per_call_us(fn, n: int, repeats: int = 5) -> float:
    for _ in range(min(n, 1000)):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(out)


def broker_us(n: int, metrics: bool = False) -> float:
    """``metrics``: with the broker's metrics on (`--http`), as `broker_metrics_us` measures."""
    from broker.server import Broker, BrokerConfig

    class RecordingBroker(Broker):
        """The broker with its two send seams recording instead of sending."""

        to_worker = to_client = None

        def send_to_worker(self, frames) -> None:
            self.to_worker = frames

        def send_to_client(self, frames) -> None:
            self.to_client = frames

    # What libzmq gives a client that sets no routing id: a zero byte, then a counter.
    CLIENT_ID = b"\x00\x00\x00\x00\x01"
    d = tempfile.mkdtemp(prefix="zinf-hot-")
    b = RecordingBroker(BrokerConfig(frontend=f"ipc://{d}/f", backend=f"ipc://{d}/b",
                                     http="127.0.0.1:0" if metrics else ""))
    F = zmq.Frame
    try:
        caps = P.Ready(credit=4, host=P.local_host_id(), transports=["inline", "shm"])
        b.on_worker([F(b"W1"), *map(F, P.worker_ready("echo", caps))])
        ref = P.TensorRef(name="x", dtype="|u1", shape=[16],
                          loc=P.ShmLoc(segment="zinf-1-2-0123456789abcdef-5", offset=4096, nbytes=16, slot=0,
                                       generation=1))
        hdr = P.encode_header(P.Request(id=1, host=P.local_host_id(), pid=1, tensors=[ref]))
        rep = P.encode_header(P.Reply(id=1, tensors=[ref], timing={"compute_ms": 0.01}))

        def one():
            b.on_client([F(CLIENT_ID), F(P.MDPC), F(P.C_REQUEST), F(b"echo"), F(hdr)])
            env = b.to_worker[3]
            b.on_worker([F(b"W1"), F(P.MDPW), F(P.W_FINAL), F(env), F(b""), F(rep)])

        return _per_call_us(one, n)
    finally:
        b.close()
        shutil.rmtree(d, ignore_errors=True)  # (the ipc endpoints' folder: it was left in /tmp)


class _RecordingLink(BrokerLink):
    """The worker's broker connection with the socket taken out: what it would send is kept
    (`gpu_worker.upstream` is the worker's seam for this)."""

    last = None

    def send(self, frames) -> None:
        self.last = frames


def worker_us(n: int, metrics: bool = False) -> float:
    """``metrics``: counting on, as for a broker with `--http` (its WELCOME says so): the
    worker's histograms are fed per request, for its STATS."""
    from gpu_worker.worker import Worker, WorkerConfig
    from shm import ShmPool

    pool = ShmPool(1 << 20)
    x = pool.alloc((16,), np.uint8)
    ref = pool.ref_of(x)
    pool.mark_in_flight(ref)
    link = _RecordingLink("ipc:///nonexistent", zmq.Context.instance())
    w = Worker(WorkerConfig(broker="ipc:///nonexistent", model="echo", max_batch=1), upstream=link)
    F = zmq.Frame
    if metrics:  # what a counting broker's WELCOME does
        welcome = P.Welcome(instance=b"\0" * 8, heartbeat_interval=w.heartbeat_interval,
                            heartbeat_liveness=w.heartbeat_liveness, metrics=True)
        w.on_message(P.to_worker_welcome(b"", welcome)[1:])
        assert w.counts
    loc = P.shm_loc(ref._replace(nbytes=16))
    hdr = P.encode_header(P.Request(id=1, host=P.local_host_id(), pid=os.getpid(), queue_ms=0.01,
                                    tensors=[P.TensorRef(name="x", dtype="|u1", shape=[16], loc=loc)]))

    def one():
        w.on_message([F(P.MDPW), F(P.W_REQUEST), F(b"\0" * 8), F(b""), F(hdr)])
        w.run_ready_batches()

    try:
        return _per_call_us(one, n)
    finally:
        w.close()
        pool.close()


def worker_leased_us(n: int) -> float:
    """A leased (pinned) request at a serving worker: the direct socket's REQUEST handled as
    the loop handles it (`_on_direct_frames`, the lone-request lane on, as in `serve`), its
    FINAL recorded instead of sent."""
    from gpu_worker.worker import Worker, WorkerConfig

    link = _RecordingLink("ipc:///nonexistent", zmq.Context.instance())
    w = Worker(WorkerConfig(broker="ipc:///nonexistent", model="echo", direct=True, warmup=False), upstream=link)
    w._connect()
    w.lone_lane = True
    secret = b"s" * 16
    grant = P.LeaseGrant(lease=P.lease_id(1), secret=secret, service=w.service, slots=2,
                         client_host=P.local_host_id(), client_pid=os.getpid())
    w.on_message(P.to_worker_lease(b"", P.encode_header(grant))[1:])
    route = b"\x00hotpath"
    assert w.leases.hello(route, grant.lease, secret) is None
    sent = []
    w.direct_socket.send = sent.append  # the reply is recorded, not sent
    x = np.zeros(16, np.uint8).tobytes()
    F = zmq.Frame
    ids = iter(range(1, 1 << 62))
    service = w.service.encode()

    def one():
        head = P.encode_header(P.Request(id=next(ids), tensors=[P.TensorRef("x", "|u1", [16], P.InlineLoc(frame=0))]))
        w._on_direct_frames([F(route), F(P.MDPC), F(P.C_REQUEST), F(service), F(head), F(x)], time.monotonic())
        assert sent, "the lane did not answer at once"
        sent.clear()

    try:
        return _per_call_us(one, n)
    finally:
        w.close()


def client_us(n: int) -> float:
    from client_sdk.core import ClientCore

    d = tempfile.mkdtemp(prefix="zinf-hot-")
    core = ClientCore(f"ipc://{d}/nothing", timeout=5)  # the client's socket-free core
    x = core.alloc((16,), np.uint8)
    F = zmq.Frame
    call0 = core.new_call("echo", {"x": x})
    frames0 = core.request_frames(call0, time.monotonic())
    # 16 B travel inline both ways by default (P.SMALL_INLINE_BYTES): the echo's reply
    # carries the request's own inline frame back.
    inline = [bytes(f) for f in frames0[4:]]
    tensors = P.decode_request(frames0[3], len(inline)).tensors
    core.calls.pop(call0.id, None)

    def one():
        call = core.new_call("echo", {"x": x})
        core.request_frames(call, time.monotonic())
        # Encoding the worker's reply (~1 us) is the one piece timed here that is not the client's.
        rep = P.encode_header(P.Reply(id=call.id, tensors=tensors, timing={"compute_ms": 0.01}))
        core.on_message([F(P.MDPC), F(P.C_FINAL), F(b"echo"), F(rep), *map(F, inline)], time.monotonic())
        call.inbox.popleft()[1].release()

    try:
        return _per_call_us(one, n)
    finally:
        core.close()
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {"broker_request_and_reply_us": broker_us(args.n),
           "broker_with_metrics_us": broker_us(args.n, metrics=True),
           "worker_request_us": worker_us(args.n // 4), "worker_with_metrics_us": worker_us(args.n // 4, metrics=True),
           "worker_leased_us": worker_leased_us(args.n // 4),
           "client_request_us": client_us(args.n // 4)}
    for k, v in res.items():
        print(f"{k:30s} {v:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m bench.hotpath " + " ".join(argv or sys.argv[1:]), **res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
