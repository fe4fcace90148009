"""Where the product path's time goes, by function: the client and the worker under cProfile.

    python -m bench.gpu_profile [--device cuda:0] [--transport cuda|shm] [--n 2000] [--out DIR]

`bench.worker_stages` says which stage of a request costs what; this says which functions
inside them do, and who calls the expensive ones.  It runs the real broker, a `gpu_worker`
of `bench.gpu_product`'s copying model (`--max-batch 1`) started under `python -m cProfile`,
and a blocking `Client` profiled in this process over `--n` requests of 16 B (after 200
warm-ups): ``--transport cuda`` sends an `alloc_cuda` tensor and keeps the reply on the
device (`reply="cuda"`, the current stream synchronised), ``shm`` an `alloc` buffer
(`reply="shm"`).  ``--device cpu`` with ``--transport shm`` runs anywhere (the test runs it
so).

Writes ``DIR/profile_<transport>.txt``: the p50 under the profiler, then for each process the
functions by own time, the callers of the calls that reach the driver from Python
(`torch.cuda` device counts and queries, `torch.as_tensor`), and the cumulative time of the
path's own CUDA steps per request.  Profiling slows Python several times: read shares and
call counts, not absolute times.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

from bench.peers import Peer

#: the calls into the driver from Python worth knowing the callers of
WATCH = ("_cuda_getDeviceCount", "_cuda_getDevice", "is_available", "device_count", "as_tensor", "synchronize")
#: the path's own steps, cumulative per request
STEPS = ("tensor_at", "_view", "hand_off", "_device_outputs", "map_inputs", "write_outputs", "run_device",
         "poll", "pack", "unpack", "_release_cuda", "release")


class _Cluster(Peer):
    name = "gpu-profile"

    def __init__(self, device: str, worker_prof: str):
        super().__init__()
        self.device = device
        self.worker_prof = worker_prof

    def start(self) -> None:
        backend = self.spawn_broker()
        env = self.unbuffered_env()
        self.spawn([sys.executable, "-m", "cProfile", "-o", self.worker_prof, "-m", "gpu_worker", "--broker", backend,
                    "--model", "bench.gpu_product:make_copy", "--service", "copy", "--device", self.device,
                    "--max-batch", "1"], env=env, ready_timeout=180.0)


def _report(stats: pstats.Stats, n: int, top: int) -> str:
    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats("tottime").print_stats(top)
    for name in WATCH:
        stats.print_callers(rf"\b{name}\b")
    buf.write(f"\ncumulative µs per request (of {n}) in the path's own steps:\n")
    for (file, line, func), (_cc, nc, _tt, ct, _callers) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
        if func in STEPS and ("/shm/" in file or "/gpu_worker/" in file or "/client_sdk/" in file):
            buf.write(f"  {ct / n * 1e6:9.1f}  {nc / n:5.2f} calls  {Path(file).parent.name}/{Path(file).name}:{line}({func})\n")
    return buf.getvalue()


def run(device: str, transport: str, n: int, out: Path, top: int = 30) -> Path:
    from client_sdk import Client

    out.mkdir(parents=True, exist_ok=True)
    worker_prof = str(out / f"worker_{transport}.prof")
    with _Cluster(device, worker_prof) as cl, Client(cl.frontend, timeout=60) as c:
        deadline = time.monotonic() + 120
        while not c.mmi_service("copy"):
            if time.monotonic() > deadline:
                raise TimeoutError("the worker did not register within 120 s")
            time.sleep(0.05)
        if transport == "cuda":
            import torch

            x = c.alloc_cuda((16,), torch.uint8, device=device)
            stream = torch.cuda.current_stream(device)

            def call():
                with c.infer("copy", {"x": x}, reply="cuda") as r:
                    r["y"]
                    stream.synchronize()
        else:
            x = c.alloc((16,), np.uint8)

            def call():
                with c.infer("copy", {"x": x}, reply="shm") as r:
                    r["y"]

        for _ in range(200):
            call()
        ms = []
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            ms.append((time.perf_counter() - t0) * 1e3)
        prof.disable()
    # The cluster stopped: the worker drained on SIGTERM and cProfile wrote its file.
    text = [f"{transport} on {device}: p50 {np.percentile(ms, 50):.3f} ms under cProfile, {n} requests of 16 B\n",
            "== CLIENT\n", _report(pstats.Stats(prof), n, top)]
    if os.path.exists(worker_prof):
        # The worker's profile holds its start-up too (imports, the warm-up): own-time ranks
        # mix both; the per-request lines divide by the profiled requests plus the warm-ups.
        text += ["\n== WORKER (start-up included)\n", _report(pstats.Stats(worker_prof), n + 200, top)]
    else:
        text.append("\n== WORKER: no profile written (did it exit on SIGTERM?)\n")
    path = out / f"profile_{transport}.txt"
    path.write_text("".join(text))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--transport", choices=("cuda", "shm"), default="cuda")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for profile_<transport>.txt")
    args = ap.parse_args(argv)
    if args.device != "cpu" or args.transport == "cuda":
        from shm.cuda import cuda_status

        ok, why = cuda_status()
        if not ok:
            print(f"gpu_profile: skipped, no CUDA device: {why}", file=sys.stderr)
            return 3
    print(run(args.device, args.transport, args.n, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
