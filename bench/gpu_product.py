"""Payload independence of the product path on a GPU: `python -m broker`, `python -m
gpu_worker --device cuda:0` and a blocking `client_sdk.Client`, one request at a time, tensors
of 16 B to 64 MiB.

    python -m bench.gpu_product [--n 300] [--rounds 3] [--devices cuda:0,cpu] [--json PATH]

Paths measured, each against one worker of a copying model (`y = x.clone()`, `--max-batch 1`):

- ``cuda``: the input in the client's CUDA pool (`alloc_cuda`), sent by CUDA IPC reference;
  the output comes back in the worker's device pool (`reply="cuda"`).  Timed from `infer` until
  the output is complete on the device (the current stream synchronised).  No tensor byte
  crosses PCIe or the sockets: this is the path whose latency should not depend on the size.
- ``shm->gpu``: the input in the client's shared memory (`alloc`), the output in host shared
  memory (`reply="shm"`), a CUDA worker: the worker copies in and out over PCIe (pinned, by
  DMA), so its latency grows with the size by design; reported for comparison.
- ``shm->cpu``: the same client and model on a CPU worker (`--device cpu`): the host path.

Rounds interleave the paths; each round measures every (path, size) with `--n` requests after
warm-ups and checks the first output byte for byte.  The summary gives medians over rounds of
p50 and p99, and for each path the payload ratio p50(size) / p50(smallest size, 16 B by
default) (`p50_over_smallest`; the first runs, in bench/results/gpu/, named it `p50_over_16B`).  Without CUDA the
cuda paths are skipped with the reason and the CPU path still runs (the harness is tested on
the CPU this way).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.peers import Peer

SIZES = (16, 64 << 10, 1080 * 1920 * 3, 64 << 20)  # 16 B, 64 KiB, one 1080p RGB frame, 64 MiB


def make_copy():
    """The model: one D2D (or host) copy of its input, so the transport is what is measured."""
    import torch

    class Copy(torch.nn.Module):
        batchable = False

        @staticmethod
        def example_inputs():
            return {"x": np.zeros(16, np.uint8)}

        def forward(self, x):
            return {"y": x.clone()}

    return Copy()


class _Cluster(Peer):
    name = "gpu-product"

    def __init__(self, devices: list[str]):
        super().__init__()
        self.devices = devices

    def start(self) -> None:
        backend = self.spawn_broker()
        env = self.unbuffered_env()
        for dev in self.devices:
            args = ["--broker", backend, "--model", "bench.gpu_product:make_copy", "--service", service_of(dev),
                    "--device", dev, "--max-batch", "1"]
            if dev != "cpu":
                args += ["--cuda-pool-mb", "512"]
            self.spawn(self.python_module("gpu_worker", *args), env=env, ready_timeout=180.0)


def service_of(device: str) -> str:
    return "copy-cpu" if device == "cpu" else "copy-" + device.replace(":", "")


def _percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "min_ms": float(a.min())}


def _measure(call, n: int, warm: int) -> dict:
    for _ in range(warm):
        call()
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        ms.append((time.perf_counter() - t0) * 1e3)
    return _percentiles(ms)


def _cuda_case(c, service: str, device: str, size: int, n: int, warm: int) -> dict:
    import torch

    x = c.alloc_cuda((size,), torch.uint8, device=device)
    x.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device=device))
    stream = torch.cuda.current_stream(device)
    with c.infer(service, {"x": x}, reply="cuda") as r:
        y = r["y"]
        exact = bool(y.is_cuda and torch.equal(y, x))
        del y

    def call():
        with c.infer(service, {"x": x}, reply="cuda") as r:
            r["y"]
            stream.synchronize()

    row = _measure(call, n, warm)
    row["bit_exact"] = exact
    return row


def _shm_case(c, service: str, size: int, n: int, warm: int) -> dict:
    x = c.alloc((size,), np.uint8)
    x[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with c.infer(service, {"x": x}, reply="shm") as r:
        exact = bool(np.array_equal(r["y"], x))

    def call():
        with c.infer(service, {"x": x}, reply="shm") as r:
            r["y"]

    row = _measure(call, n, warm)
    row["bit_exact"] = exact
    return row


def run(devices: list[str], n: int, rounds: int, sizes=SIZES, warm: int = 30) -> dict:
    from client_sdk import Client

    from shm.cuda import cuda_status

    have_cuda, why = cuda_status()
    skipped: dict[str, str] = {}
    count = 0
    if have_cuda:
        import torch

        count = torch.cuda.device_count()
    for d in devices:
        if d == "cpu":
            continue
        if not have_cuda:
            skipped[d] = f"no CUDA device: {why}"
        elif not d.startswith("cuda:") or not d[5:].isdigit() or int(d[5:]) >= count:
            skipped[d] = f"no such device here ({count} CUDA device(s): cuda:0 .. cuda:{count - 1})"
    devices = [d for d in devices if d not in skipped]
    sizes = tuple(sorted(sizes))
    paths: list[tuple[str, str]] = []  # (path name, worker device)
    for d in devices:
        if d == "cpu":
            paths.append(("shm->cpu", d))
        else:
            paths += [("cuda", d), ("shm->gpu", d)]
    per_round: list[dict] = []
    if paths:
        with _Cluster(devices) as cl, Client(cl.frontend, timeout=60, pool_capacity=512 << 20) as c:
            for d in devices:
                deadline = time.monotonic() + 120
                while not c.mmi_service(service_of(d)):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"worker for {d} did not register within 120 s")
                    time.sleep(0.05)
            for r in range(rounds):
                rows = {}
                order = paths if r % 2 == 0 else paths[::-1]
                for path, dev in order:
                    for size in sizes:
                        if path == "cuda":
                            row = _cuda_case(c, service_of(dev), dev, size, n, warm)
                        else:
                            row = _shm_case(c, service_of(dev), size, n, warm)
                        rows[f"{path}/{size}"] = row
                per_round.append(rows)
    summary: dict[str, dict] = {}
    for path, _dev in paths:
        base = None
        for size in sizes:
            key = f"{path}/{size}"
            p50 = statistics.median(rd[key]["p50_ms"] for rd in per_round)
            p99 = statistics.median(rd[key]["p99_ms"] for rd in per_round)
            if base is None:
                base = p50
            summary[key] = {"path": path, "bytes": size, "p50_ms": p50, "p99_ms": p99,
                            "p50_over_smallest": p50 / base,
                            "bit_exact": all(rd[key]["bit_exact"] for rd in per_round)}
    return {"paths": [p for p, _ in paths], "sizes": list(sizes), "n": n, "rounds": rounds,
            "skipped": skipped, "summary": summary, "per_round": per_round,
            "ok": all(v["bit_exact"] for v in summary.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_product", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="timed requests per (path, size) and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--devices", default="cuda:0,cpu", help="comma list of worker devices")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma list of bytes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.n < 1 or args.rounds < 1:
        ap.error("--n and --rounds must be at least 1")
    t0 = time.monotonic()
    doc = run([d for d in args.devices.split(",") if d], args.n, args.rounds,
              tuple(int(s) for s in args.sizes.split(",") if s))
    doc.update(command=" ".join([sys.executable, "-m", "bench.gpu_product", *(argv or sys.argv[1:])]),
               python=sys.version.split()[0], platform=platform.platform(),
               elapsed_s=round(time.monotonic() - t0, 1))
    for key, v in doc["summary"].items():
        print(f"{key:>22}  p50 {v['p50_ms']:8.3f} ms  p99 {v['p99_ms']:8.3f} ms  "
              f"x smallest {v['p50_over_smallest']:5.2f}  {'exact' if v['bit_exact'] else 'WRONG'}")
    for d, why in doc["skipped"].items():
        print(f"skipped {d}: {why}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
