"""Throughput benchmarks of the request path (issue "End-to-end request path"):

- `inflight`: tiny echo requests through broker + worker, one at a time vs N in flight over
  one AsyncClient (pipelining and worker-side batching).
- `batching`: `convnet` at saturation, worker batching on (max batch 8) vs off (max batch 1).

Each configuration runs in the same invocation, alternating A/B/A/B windows so that machine
drift hits both alike; the reported number is the median over windows.

    python -m bench.throughput [--windows 5] [--window-s 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.peers import wait_ready


class _Cluster:
    def __init__(self, model: str, *worker_args: str):
        self.tmp = tempfile.mkdtemp(prefix="zinf-tp-")
        self.fe = f"ipc://{self.tmp}/fe.ipc"
        be = f"ipc://{self.tmp}/be.ipc"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs = [subprocess.Popen([sys.executable, "-m", "broker", "--frontend", self.fe, "--backend", be],
                                       stdout=subprocess.PIPE, env=env)]
        wait_ready(self.procs[0], 60)
        self.procs.append(subprocess.Popen([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", model,
                                            *worker_args], stdout=subprocess.PIPE, env=env))
        wait_ready(self.procs[1], 120)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        for name in ("fe.ipc", "be.ipc"):
            try:
                os.unlink(os.path.join(self.tmp, name))
            except OSError:
                pass
        os.rmdir(self.tmp)


async def _window(client, service: str, inputs: dict, concurrency: int, seconds: float) -> float:
    """Requests per second with `concurrency` requests kept in flight for `seconds`."""
    done = 0
    stop = time.perf_counter() + seconds

    async def lane():
        nonlocal done
        while time.perf_counter() < stop:
            r = await client.infer(service, inputs)
            r.release()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def _ab(fe_a: str, fe_b: str, service: str, make_inputs, conc_a: int, conc_b: int,
              windows: int, seconds: float) -> tuple[list[float], list[float]]:
    from client_sdk import AsyncClient

    async with AsyncClient(fe_a, timeout=60) as ca, AsyncClient(fe_b, timeout=60) as cb:
        for c in (ca, cb):
            while not await c.mmi_service(service):
                await asyncio.sleep(0.05)
        ia, ib = make_inputs(ca), make_inputs(cb)
        await _window(ca, service, ia, conc_a, 0.5)  # warm the path
        await _window(cb, service, ib, conc_b, 0.5)
        a, b = [], []
        for _ in range(windows):
            a.append(await _window(ca, service, ia, conc_a, seconds))
            b.append(await _window(cb, service, ib, conc_b, seconds))
        return a, b


def inflight(windows: int, seconds: float, n: int = 64) -> dict:
    cl = _Cluster("echo", "--max-batch", "8", "--credit", str(n))
    try:
        def tiny(c):
            x = c.alloc((16,), np.uint8)
            x[:] = 7
            return {"x": x}

        one, many = asyncio.run(_ab(cl.fe, cl.fe, "echo", tiny, 1, n, windows, seconds))
    finally:
        cl.close()
    return {"one_at_a_time_rps": statistics.median(one), f"in_flight_{n}_rps": statistics.median(many),
            "ratio": statistics.median(many) / statistics.median(one), "windows_one": one, "windows_many": many}


def batching(windows: int, seconds: float, conc: int = 16) -> dict:
    on = _Cluster("convnet", "--max-batch", "8", "--credit", str(conc))
    off = _Cluster("convnet", "--max-batch", "1", "--credit", str(conc))
    try:
        def image(c):
            img = c.alloc((224, 224, 3), np.uint8)
            img[:] = np.random.default_rng(0).integers(0, 255, img.shape, dtype=np.uint8)
            return {"image": img}

        a, b = asyncio.run(_ab(on.fe, off.fe, "convnet", image, conc, conc, windows, seconds))
    finally:
        on.close()
        off.close()
    return {"batch8_items_per_s": statistics.median(a), "batch1_items_per_s": statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b), "windows_batch8": a, "windows_batch1": b}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=2.0)
    ap.add_argument("--only", choices=["inflight", "batching"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out: dict = {"command": " ".join([os.path.basename(sys.executable), "-m", "bench.throughput", *(argv or sys.argv[1:])])}
    if args.only in (None, "inflight"):
        out["inflight"] = inflight(args.windows, args.window_s)
        r = out["inflight"]
        print(f"echo 16 B: one at a time {r['one_at_a_time_rps']:.0f} req/s, 64 in flight "
              f"{r['in_flight_64_rps']:.0f} req/s, ratio {r['ratio']:.2f}x")
    if args.only in (None, "batching"):
        out["batching"] = batching(args.windows, args.window_s)
        r = out["batching"]
        print(f"convnet 224x224, 16 in flight: batch 8 {r['batch8_items_per_s']:.1f} items/s, batch 1 "
              f"{r['batch1_items_per_s']:.1f} items/s, ratio {r['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
