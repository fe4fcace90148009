"""The floor under the pinned path: a raw Unix SOCK_SEQPACKET echo against a raw pyzmq
DEALER/ROUTER echo over ipc, both blocking, 100 B, two processes each.

    python -m bench.link_floor [--n 20000] [--rounds 3]

Why the local link exists (docs/protocol.md section 10.6): a libzmq message crosses the
sender's and the receiver's I/O threads, so a zmq round trip wakes six threads where a Unix
socket round trip wakes two.  The rounds alternate the two transports and print one JSON line:
each one's p50 and p99 in microseconds per round, and the median ratio seqpacket / zmq.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import zmq

MSG = b"x" * 100


def _pct(lat: list[float], q: float) -> float:
    lat = sorted(lat)
    return round(lat[min(len(lat) - 1, int(len(lat) * q))] * 1e6, 1)


def _seqpacket(path: str, n: int) -> list[float]:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    pid = os.fork()
    if pid == 0:  # the echo
        try:
            c, _ = srv.accept()
            while True:
                m = c.recv(65536)
                if not m:
                    break
                c.send(m)
        finally:
            os._exit(0)
    srv.close()
    cl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cl.settimeout(10)
    cl.connect(path)
    lat = []
    try:
        for i in range(n + 1000):
            t = time.perf_counter()
            cl.send(MSG)
            cl.recv(65536)
            if i >= 1000:  # the first thousand warm up
                lat.append(time.perf_counter() - t)
    finally:
        cl.close()
        os.waitpid(pid, 0)
        os.unlink(path)
    return lat


def _zmq(path: str, n: int) -> list[float]:
    ep = "ipc://" + path
    pid = os.fork()
    if pid == 0:  # the echo (a context of its own, after the fork)
        try:
            ctx = zmq.Context()
            r = ctx.socket(zmq.ROUTER)
            r.linger = 0
            r.bind(ep)
            while True:
                f = r.recv_multipart()
                if f[1] == b"":
                    break
                r.send_multipart(f)
            r.close()
            ctx.term()
        finally:
            os._exit(0)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.rcvtimeo = 10_000
    d.connect(ep)
    lat = []
    try:
        for i in range(n + 1000):
            t = time.perf_counter()
            d.send(MSG)
            d.recv()
            if i >= 1000:
                lat.append(time.perf_counter() - t)
        d.send(b"")
    finally:
        d.close()
        ctx.term()
        os.waitpid(pid, 0)
    try:
        os.unlink(path)
    except OSError:
        pass
    return lat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.link_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="round trips per transport per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="zinf-floor-", dir="/tmp")
    rows = []
    try:
        for r in range(args.rounds):
            s = _seqpacket(os.path.join(d, f"s{r}.sock"), args.n)
            z = _zmq(os.path.join(d, f"z{r}.sock"), args.n)
            rows.append({"seqpacket_us": [_pct(s, 0.5), _pct(s, 0.99)], "zmq_ipc_us": [_pct(z, 0.5), _pct(z, 0.99)]})
    finally:
        os.rmdir(d)
    ratio = statistics.median(row["seqpacket_us"][0] / row["zmq_ipc_us"][0] for row in rows)
    print(json.dumps({"rounds": rows, "seqpacket_vs_zmq_p50": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
