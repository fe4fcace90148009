"""Keep-warm's effect on the first request after a pause: two workers of one model, one with
keep-warm (the default on a CUDA device), one without.

    python -m bench.keep_warm [--device cuda:0] [--model convnet] [--pauses 0.2,1,3]
                              [--rounds 8] [--json PATH]

A GPU lowers its clocks within moments of going idle, and the first kernels after a pause
pay for it; the worker's own code and data go cold too.  Keep-warm (docs/gpu.md, section 7)
runs one batch of the model's example inputs every `--keep-warm-ms` (50 on a CUDA device)
while the worker is idle.  This measures what that buys: the real broker, two `gpu_worker`
processes on `--device` serving the same model (service ``kw-on``: keep-warm as configured,
the default on CUDA and 50 ms on the CPU, where it is otherwise off; ``kw-off``:
`--keep-warm-ms 0`), and one blocking `Client` sending the model's example inputs from its
shared memory.

First each service's steady latency (`--steady` requests back to back, p50).  Then for each
pause, `--rounds` rounds; in each, for both services in turn (the order alternating): the
client sleeps the pause (the idle time is the variable here, not a wait for anything) and
times the first request after it, then a second one right behind it.  Reported per pause
and service: the medians of the first and second requests, and the first over the steady
p50; and how many keep-warm units each service's worker ran (the broker's
`zmq_infer_keep_warm_runs` counter, so the broker runs with `--http`).  Without CUDA, ``--device cuda:N`` exits 3 saying why; ``--device cpu`` runs anywhere
(the test runs it so, with short pauses).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import urllib.request

import numpy as np

from bench.peers import Peer, free_port

SERVICES = ("kw-on", "kw-off")
_RUNS = re.compile(r'^zmq_infer_keep_warm_runs_total\{[^}]*service="([^"]+)"[^}]*\}\s+(\S+)', re.M)


class _Cluster(Peer):
    name = "keep-warm"

    def __init__(self, device: str, model: str):
        super().__init__()
        self.device = device
        self.model = model

    def start(self) -> None:
        # The broker's metrics count each service's keep-warm units (the workers' STATS).
        port = free_port()
        self.metrics = f"http://127.0.0.1:{port}/metrics"
        backend = self.spawn_broker("--http", f"127.0.0.1:{port}")
        env = self.unbuffered_env()
        for service in SERVICES:
            args = ["--broker", backend, "--model", self.model, "--service", service, "--device", self.device]
            if service == "kw-off":
                args += ["--keep-warm-ms", "0"]
            elif self.device == "cpu":
                args += ["--keep-warm-ms", "50"]  # off by default on the CPU
            self.spawn(self.python_module("gpu_worker", *args), env=env, ready_timeout=180.0)


def keep_warm_runs(url: str) -> dict[str, int]:
    """Keep-warm units per service, as the broker's /metrics last heard from the workers."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {svc: int(float(v)) for svc, v in _RUNS.findall(text)}


def _inputs(model: str) -> dict[str, np.ndarray]:
    from gpu_worker.models import load_model

    return load_model(model, device="cpu").example_inputs()


def run(device: str, model: str, pauses: list[float], rounds: int, steady: int = 100, warm: int = 20) -> dict:
    from client_sdk import Client

    example = _inputs(model)
    out: dict = {"device": device, "model": model, "pauses_s": pauses, "rounds": rounds, "steady_n": steady,
                 "inputs": {k: [list(v.shape), v.dtype.str] for k, v in example.items()}}
    with _Cluster(device, model) as cl, Client(cl.frontend, timeout=60) as c:
        for service in SERVICES:
            deadline = time.monotonic() + 120
            while not c.mmi_service(service):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{service!r} did not register within 120 s")
                time.sleep(0.05)
        inputs = {}
        for k, v in example.items():
            inputs[k] = c.alloc(v.shape, v.dtype)
            inputs[k][...] = v

        def one(service: str) -> float:
            t0 = time.perf_counter()
            with c.infer(service, inputs) as r:
                for k in r:
                    r[k]
            return (time.perf_counter() - t0) * 1e3

        for service in SERVICES:
            for _ in range(warm):
                one(service)
        ms: dict[str, list[float]] = {s: [] for s in SERVICES}
        for i in range(steady):
            for s in (SERVICES if i % 2 == 0 else SERVICES[::-1]):
                ms[s].append(one(s))
        out["steady_p50_ms"] = {s: round(float(np.percentile(ms[s], 50)), 4) for s in SERVICES}
        rows: dict[str, dict] = {}
        for pause in pauses:
            got: dict[str, dict[str, list[float]]] = {s: {"first": [], "second": []} for s in SERVICES}
            for r in range(rounds):
                for s in (SERVICES if r % 2 == 0 else SERVICES[::-1]):
                    time.sleep(pause)  # the idle time under test
                    got[s]["first"].append(one(s))
                    got[s]["second"].append(one(s))
            rows[str(pause)] = {s: {"first_ms": round(statistics.median(got[s]["first"]), 4),
                                    "second_ms": round(statistics.median(got[s]["second"]), 4),
                                    "first_over_steady": round(statistics.median(got[s]["first"])
                                                               / out["steady_p50_ms"][s], 3),
                                    "first_all_ms": [round(x, 4) for x in got[s]["first"]]}
                                for s in SERVICES}
        out["after_pause"] = rows
        # Units run, as of the workers' last STATS (sent each heartbeat interval when
        # something changed): a lower bound; wait a while for kw-on's first report.
        deadline = time.monotonic() + 15
        runs = keep_warm_runs(cl.metrics)
        while not runs.get("kw-on") and time.monotonic() < deadline:
            time.sleep(0.2)
            runs = keep_warm_runs(cl.metrics)
        out["keep_warm_runs"] = {s: runs.get(s, 0) for s in SERVICES}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.keep_warm", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--pauses", default="0.2,1,3", help="idle seconds before each timed request, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steady", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device != "cpu":
        from shm.cuda import cuda_status

        ok, why = cuda_status()
        if not ok:
            print(f"keep_warm: skipped, no CUDA device: {why}", file=sys.stderr)
            return 3
    from bench.report import print_and_save

    pauses = [float(p) for p in args.pauses.split(",") if p]
    return print_and_save(run(args.device, args.model, pauses, args.rounds, args.steady), args.json)


if __name__ == "__main__":
    sys.exit(main())
