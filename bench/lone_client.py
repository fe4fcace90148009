"""The batching tax on a lone sequential client: a blocking `Client` sending 16 B requests
one after the other to one `echo` worker with default settings (max batch 8), p50 and p99,
with the worker's `--batching latency` (the default: wait for company only while the broker
has a backlog) and `--batching throughput` (wait on arrival-rate evidence, the earlier
default), interleaved; and the brokered floor's own p99/p50 (`proxy-sdk`: the same client
and worker with a libzmq proxy in place of the broker, `--max-batch 1`) in the same run.

    python -m bench.lone_client [--rounds 3] [--n 5000] [--json bench/results/lone_client.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from bench.peers import Peer


class _EchoCluster(Peer):
    name = "lone-client"

    def __init__(self, batching: str):
        super().__init__()
        self.batching = batching

    def start(self) -> None:
        backend = self.spawn_broker()
        env = self.unbuffered_env()
        self.spawn(self.python_module("gpu_worker", "--broker", backend, "--model", "echo",
                                      "--batching", self.batching), env=env)


def _run(request, n: int) -> dict:
    for _ in range(200):
        request()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        request()
        lat.append((time.perf_counter() - t0) * 1e3)
    a = np.asarray(lat)
    p50, p99 = float(np.percentile(a, 50)), float(np.percentile(a, 99))
    return {"p50_ms": p50, "p99_ms": p99, "p99_over_p50": p99 / p50, "over_1_5ms": int((a > 1.5).sum())}


def ours(batching: str, n: int) -> dict:
    from client_sdk import Client

    x = {"x": np.zeros(16, np.uint8)}
    with _EchoCluster(batching) as cl, Client(cl.frontend, timeout=30) as c:
        while not c.mmi_service("echo"):
            time.sleep(0.01)
        return _run(lambda: c.infer("echo", x).release(), n)


def floor(n: int) -> dict:
    from bench.broker_peers import ProxySdkPeer

    with ProxySdkPeer() as peer:
        client = peer.client()
        payload = np.zeros(16, np.uint8).tobytes()
        try:
            return _run(lambda: client.request_sync(payload), n)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lone_client", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = {"latency": [], "throughput": [], "floor": []}
    for i in range(args.rounds):
        order = ["latency", "throughput", "floor"] if i % 2 == 0 else ["floor", "throughput", "latency"]
        for what in order:
            rows[what].append(floor(args.n) if what == "floor" else ours(what, args.n))
        print(f"round {i + 1}: " + "; ".join(
            f"{k} p50 {v[-1]['p50_ms']:.3f} p99 {v[-1]['p99_ms']:.3f} ms (x{v[-1]['p99_over_p50']:.2f}, "
            f"{v[-1]['over_1_5ms']} over 1.5 ms)" for k, v in rows.items()), flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("p50_ms", "p99_ms", "p99_over_p50", "over_1_5ms")}
           for k, v in rows.items()}
    out = {"command": "python -m bench.lone_client " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
           "n": args.n, "rounds": rows, "median": med,
           "p99_over_p50_vs_floor": med["latency"]["p99_over_p50"] / med["floor"]["p99_over_p50"]}
    print("median: " + "; ".join(f"{k} p50 {v['p50_ms']:.3f} p99 {v['p99_ms']:.3f} (x{v['p99_over_p50']:.2f})"
                                 for k, v in med.items())
          + f"; latency's p99/p50 over the floor's: {out['p99_over_p50_vs_floor']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
