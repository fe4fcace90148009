"""Where inline tensors stop beating shared memory: the crossover behind `SMALL_INLINE_BYTES`.

One broker, two workers (`echo`, which hands its input back, so a shared-memory reply moves no
byte; and `copy`, which returns a new array, so a shared-memory reply is a slot and a copy),
and three blocking clients on the same host:

  shm     transport="shm": every tensor by reference, outputs in the worker's ring
  inline  transport="inline": every tensor copied into a frame, both ways
  auto    the default: inline up to `SMALL_INLINE_BYTES`, by reference above

For each size, each client sends `--n` sequential requests per round; rounds are interleaved
(client by client, size by size) and the figure is the median over rounds of each p50.

    python -m bench.inline_crossover [--rounds 5] [--n 600] [--json bench/results/inline_crossover.json]

The output names, per model, the largest size at which inline's p50 is below shared memory's
(`inline_wins_up_to`) and checks that `auto` is within noise of the better of the two.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from bench.peers import Peer

SIZES = [16, 256, 1024, 4096, 16384, 65536, 262144]


def make_copy():
    """`--model bench.inline_crossover:make_copy`: a model whose output is a new array."""

    def copy(batch):
        return {"x": batch["x"] + 0}

    return copy


class _Cluster(Peer):
    name = "inline-crossover"

    def start(self) -> None:
        self.fe, be = self.ipc("fe"), self.ipc("be")
        self.spawn([sys.executable, "-m", "broker", "--frontend", self.fe, "--backend", be])
        self.spawn([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", "echo"])
        self.spawn([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", "bench.inline_crossover:make_copy",
                    "--service", "copy"])


def _p50_us(client, service: str, x: np.ndarray, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        with client.infer(service, {"x": x}):
            pass
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def main(argv: list[str] | None = None) -> int:
    from broker.protocol import SMALL_INLINE_BYTES
    from client_sdk import Client

    p = argparse.ArgumentParser(prog="python -m bench.inline_crossover", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=600, help="requests per client, size and model in each round")
    p.add_argument("--json", default="bench/results/inline_crossover.json")
    a = p.parse_args(argv)
    kinds = ("shm", "inline", "auto")
    services = ("echo", "copy")
    with _Cluster() as d:
        clients = {k: Client(d.fe, transport=k, timeout=30) for k in kinds}
        try:
            for c in clients.values():
                deadline = time.monotonic() + 30
                while not all(c.mmi_service(s) for s in services):
                    if time.monotonic() > deadline:
                        raise SystemExit("the workers did not register within 30 s")
                    time.sleep(0.05)
            # The client's own arrays: from its pool when it has one (by reference), else plain.
            arrays = {}
            for k, c in clients.items():
                for size in SIZES:
                    x = c.alloc((size,), np.uint8) if k != "inline" else np.empty(size, np.uint8)
                    x[:] = 1
                    arrays[k, size] = x
            for s in services:  # warm-up: segments mapped, sockets connected
                for (k, size), x in arrays.items():
                    _p50_us(clients[k], s, x, 20)
            per_round: dict[str, dict[int, dict[str, list[float]]]] = {
                s: {size: {k: [] for k in kinds} for size in SIZES} for s in services}
            for r in range(a.rounds):
                for s in services:
                    for size in SIZES:
                        for k in kinds:
                            per_round[s][size][k].append(_p50_us(clients[k], s, arrays[k, size], a.n))
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
        finally:
            for c in clients.values():
                c.close()
    med = statistics.median
    out: dict = {"small_inline_bytes": SMALL_INLINE_BYTES, "sizes": SIZES, "models": {}}
    print(f"{'model':6s} {'bytes':>8s} {'shm us':>8s} {'inline us':>10s} {'auto us':>8s} {'inline/shm':>10s}")
    for s in services:
        rows = []
        wins_up_to, prefix = 0, True  # the sizes from the smallest up where inline is faster
        for size in SIZES:
            m = {k: med(per_round[s][size][k]) for k in kinds}
            ratio = med(i / j for i, j in zip(per_round[s][size]["inline"], per_round[s][size]["shm"]))
            prefix = prefix and ratio < 1.0
            if prefix:
                wins_up_to = size
            rows.append({"bytes": size, "p50_us": m, "inline_vs_shm": round(ratio, 3),
                         "auto_vs_best": round(m["auto"] / min(m["shm"], m["inline"]), 3)})
            print(f"{s:6s} {size:8d} {m['shm']:8.1f} {m['inline']:10.1f} {m['auto']:8.1f} {ratio:10.2f}")
        out["models"][s] = {"rows": rows, "inline_wins_up_to": wins_up_to,
                            "per_round_us": {str(size): per_round[s][size] for size in SIZES}}
        print(f"{s}: inline is faster up to {wins_up_to} B (SMALL_INLINE_BYTES = {SMALL_INLINE_BYTES})")
    out["command"] = " ".join([sys.executable, "-m", "bench.inline_crossover",
                               *(argv if argv is not None else sys.argv[1:])])
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
