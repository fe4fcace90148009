"""How far Python can go behind the brokered floor's C relay: `proxy_sdk_vs_proxy_tiny`'s reach.

    python -m bench.lean_floor [--n 2000] [--repeats 5] [--max-batch 1] [--json PATH]

`proxy_sdk_vs_proxy_tiny` (issue 13, `bench.report`) holds our SDK client and `gpu_worker`
behind `zmq.proxy` to a raw DEALER and a raw echo behind the same relay: at most 1.2x at
16 B.  Is that a bound on Python, or on our code?  This runs, in one process tree,
interleaved, blocking clients, 16 B:

  proxy        a raw DEALER -> zmq.proxy -> the raw echo (`bench.peers.ProxyPeer`): the floor
  lean         a lean MDP client -> zmq.proxy -> a lean MDP worker (below): the same frames
               and msgpack headers as ours (`broker.protocol`: a REQUEST with one inline
               tensor, a FINAL with its header), a numpy view of each tensor on each side,
               and nothing else (no calls table, pool, deadlines, batcher, stats, liveness)
  lean->sdk-w  the lean client -> zmq.proxy -> our gpu_worker echo (`bench.proxied_worker`,
               as `proxy-sdk` runs it): what our worker adds over a lean one
  sdk->lean-w  our `Client` -> zmq.proxy -> the lean worker: what our client adds
  proxy-sdk    our `Client` -> zmq.proxy -> our gpu_worker: the pair the ratio is about

`--max-batch N` runs our worker with that batch size instead of `proxy-sdk`'s 1: with no
broker in front to report a backlog, its batcher then goes by arrival rates, and probes.

Each repeat measures every path for `--n` requests in turn; the report is each path's
median p50 over the repeats and, per repeat, its p50 over `proxy`'s (the median of those).

On Linux it also reports the CPU each path costs per request, by process (`cpu_us`: the
client, i.e. this process, the relay, and the server behind it; every thread counted, libzmq's
I/O threads included; medians over the repeats), from the scheduler's own run-time counters.
On this bench's 2-vCPU machine a closed loop of small requests is one chain of work handed
from thread to thread, so the p50 is close to the sum of these (measured so: 2026-12-04), and
they move far less between runs than the p50 does: a change to the client or the worker shows
up in its own column, beside the lean one's, whatever the machine's noise did to the floor.
The lean worker is `python -m bench.lean_floor worker --connect EP`: it answers REQUESTs
(one inline tensor each way: the reply sends the request's own frame back), client
HEARTBEATs (as a broker would, so that our `Client` can talk to it) and ignores the rest.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import zmq

from broker import protocol as P
from broker.protocol.wire import recv_frames, send_frames

TINY = 16
#: the processes a path's CPU is counted in: this one (the client), the relay, the server
ROLES = ("client", "relay", "server")


def run_worker(connect: str) -> None:
    """The lean MDP worker behind a `zmq.proxy` backend: what a minimal echo that speaks our
    protocol does per request."""
    from bench.echo_servers import die_with_parent

    die_with_parent()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(connect)
    print("READY", flush=True)  # what bench.peers' spawn waits for
    heartbeat = P.broker_heartbeat(b"\0" * P.INSTANCE_LEN, 3000)
    while True:
        f = recv_frames(sock)  # [client identity, MDPC02, command, service, header, inline...]
        if len(f) < 3:
            continue
        cmd = f[2].bytes
        if cmd == P.C_HEARTBEAT:
            send_frames(sock, [f[0], *heartbeat])
            continue
        if cmd != P.C_REQUEST or len(f) < 6:
            continue
        req = P.decode_request(f[4], len(f) - 5)
        t = req.tensors[0]
        x = np.frombuffer(f[5].buffer, dtype=t.dtype).reshape(t.shape)  # the model's input
        ref = P.TensorRef(t.name, t.dtype, list(x.shape), P.InlineLoc(frame=0))
        head = P.encode_header(P.Reply(id=req.id, tensors=[ref]))
        send_frames(sock, [f[0], P.MDPC, P.C_FINAL, f[3], head, f[5]])


class LeanClient:
    """The lean MDP client: one REQUEST with one inline tensor, one FINAL read back."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.x = np.zeros(TINY, np.uint8)

    def call(self) -> np.ndarray:
        rid = next(self.ids)
        x = self.x
        head = P.encode_header(P.Request(id=rid, tensors=[P.TensorRef("x", x.dtype.str, list(x.shape),
                                                                       P.InlineLoc(frame=0))]))
        send_frames(self.sock, [P.MDPC, P.C_REQUEST, b"echo", head, x])
        if not self.sock.poll(30_000):
            raise TimeoutError("no reply within 30 s")
        f = recv_frames(self.sock)
        rep = P.decode_reply(f[3], len(f) - 4)
        if rep.id != rid:
            raise RuntimeError(f"reply {rep.id} to request {rid}")
        t = rep.tensors[0]
        return np.frombuffer(f[4].buffer, dtype=t.dtype).reshape(t.shape)

    def close(self) -> None:
        self.sock.close(0)


def cpu_ns(pid: int) -> int | None:
    """CPU time (ns) every thread of process `pid` has run so far (the first field of each
    /proc/<pid>/task/<tid>/schedstat); None off Linux.  A thread that exits between two
    readings takes its time with it (the processes here keep theirs)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    return total


def p50_us(call: Callable[[], object], n: int) -> float:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        lat.append(time.perf_counter_ns() - t0)
    lat.sort()
    return lat[len(lat) // 2] / 1e3


def measure(n: int, repeats: int, max_batch: int = 1) -> dict:
    from bench.broker_peers import ProxySdkPeer
    from bench.peers import Peer, ProxyPeer, ZmqEchoClient
    from client_sdk import Client

    class SdkPeer(ProxySdkPeer):
        pass

    SdkPeer.max_batch = max_batch

    class LeanPeer(Peer):
        name = "lean-mdp"

        def start(self) -> None:
            self.endpoint = self.ipc("front")
            back = self.ipc("back")
            self.spawn(self.python_module("bench.echo_servers", "proxy", "--front", self.endpoint, "--back", back))
            self.spawn(self.python_module("bench.lean_floor", "worker", "--connect", back))

    closers = []
    with ProxyPeer() as raw, LeanPeer() as lean, SdkPeer() as sdk:
        try:
            echo = ZmqEchoClient(raw.endpoint)
            closers.append(echo.close)
            x = np.zeros(TINY, np.uint8)
            lean_c = LeanClient(lean.endpoint)
            closers.append(lean_c.close)
            lean_to_sdk = LeanClient(sdk.frontend)
            closers.append(lean_to_sdk.close)
            ours = Client(sdk.frontend, timeout=30)
            closers.append(ours.close)
            ours_to_lean = Client(lean.endpoint, timeout=30)
            closers.append(ours_to_lean.close)
            buf, buf2 = ours.alloc((TINY,), np.uint8), ours_to_lean.alloc((TINY,), np.uint8)

            def sdk_call(c=ours, b=buf):
                with c.infer("echo", {"x": b}):
                    pass

            def sdk_to_lean(c=ours_to_lean, b=buf2):
                with c.infer("echo", {"x": b}):
                    pass

            # each path: its call, and the (relay, server) processes behind it
            paths = {"proxy": (lambda: echo.request_sync(x), raw), "lean": (lean_c.call, lean),
                     "lean->sdk-w": (lean_to_sdk.call, sdk), "sdk->lean-w": (sdk_to_lean, lean),
                     "proxy-sdk": (sdk_call, sdk)}
            for call, _ in paths.values():  # warm every path (imports, pools, first connections)
                for _ in range(300):
                    call()
            p50s: dict[str, list[float]] = {k: [] for k in paths}
            cpus: dict[str, dict[str, list[float]]] = {k: {role: [] for role in ROLES} for k in paths}
            for _ in range(repeats):
                for name, (call, peer) in paths.items():
                    pids = dict(zip(ROLES, [os.getpid(), *peer.pids]))
                    before = {role: cpu_ns(pid) for role, pid in pids.items()}
                    p50s[name].append(p50_us(call, n))
                    for role, pid in pids.items():
                        after = cpu_ns(pid)
                        if after is not None and before[role] is not None:
                            cpus[name][role].append((after - before[role]) / n / 1e3)
        finally:
            for close in reversed(closers):
                close()
    floor = p50s["proxy"]
    cpu_us = {}
    for name, roles in cpus.items():
        if all(roles.values()):
            per = {role: round(statistics.median(v), 1) for role, v in roles.items()}
            per["total"] = round(statistics.median([sum(t) for t in zip(*roles.values())]), 1)
            cpu_us[name] = per
    return {
        "n": n, "repeats": repeats, "max_batch": max_batch, "payload_bytes": TINY,
        "p50_us": {k: round(statistics.median(v), 1) for k, v in p50s.items()},
        "over_proxy": {k: round(statistics.median([a / b for a, b in zip(v, floor)]), 3)
                       for k, v in p50s.items() if k != "proxy"},
        "runs_us": {k: [round(a, 1) for a in v] for k, v in p50s.items()},
        "cpu_us": cpu_us,  # per request, by process; {} off Linux
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lean_floor", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="run the lean MDP worker (a bench process)")
    w.add_argument("--connect", required=True)
    ap.add_argument("--n", type=int, default=2000, help="requests per path per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=1,
                    help="our worker's --max-batch (1, as `proxy-sdk` runs it; more: its batcher in the loop)")
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        run_worker(args.connect)
        return 0
    from bench.report import print_and_save

    return print_and_save(measure(args.n, args.repeats, args.max_batch), args.json)


if __name__ == "__main__":
    sys.exit(main())
