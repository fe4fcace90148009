"""A long mixed-load run that looks for leaks: `python -m bench soak --minutes N`.

A broker, two `echo` workers and two client threads on ipc endpoints in a temp dir: one
thread sends 16 B requests, the other 6.2 MB frames (1080x1920x3, written once into shared
memory), both closed loop, for N minutes.  Every few seconds the RSS and the number of open
files of every process (broker, workers, this one) are sampled from /proc.  The report gives,
per process, the values at the start and the end of the second half and the growth over it
(the first half is warm-up: caches and pools fill), plus request counts and errors.  A flat
second half is the pass mark; it is not run by `make test`.

    python -m bench soak --minutes 4 [--json PATH] [--sample-s 5]

With `--faults` it is the soak with faults instead (bench/soak_faults.py: processes killed,
drained and restarted under mixed load, every answer checked, a PASS/FAIL verdict):

    python -m bench soak --faults --minutes 10 [--seed 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from bench.peers import start_ready as _start
from bench.peers import stop_process


def _proc_sample(pid: int) -> tuple[int, int]:
    """(RSS bytes, open file descriptors) of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def run(minutes: float, sample_s: float) -> dict:
    from client_sdk import Client, InferenceError

    d = tempfile.mkdtemp(prefix="zinf-soak-")
    fe, be = f"ipc://{d}/fe.ipc", f"ipc://{d}/be.ipc"
    procs = {"broker": _start(["-m", "broker", "--frontend", fe, "--backend", be])}
    for i in range(2):
        procs[f"worker{i}"] = _start(["-m", "gpu_worker", "--broker", be, "--model", "echo"])
    counts = {"small": 0, "frame": 0, "errors": 0}
    stop = threading.Event()

    def load(kind: str, shape: tuple[int, ...]) -> None:
        with Client(fe, timeout=30) as c:
            while not c.mmi_service("echo"):
                time.sleep(0.01)
            x = c.alloc(shape, np.uint8)
            x[...] = 7
            while not stop.is_set():
                try:
                    c.infer("echo", {"x": x}).release()
                    counts[kind] += 1
                except InferenceError:
                    counts["errors"] += 1

    threads = [threading.Thread(target=load, args=("small", (16,))),
               threading.Thread(target=load, args=("frame", (1080, 1920, 3)))]
    pids = {name: p.pid for name, p in procs.items()} | {"bench": os.getpid()}
    samples: list[dict] = []
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        end = t0 + minutes * 60.0
        while True:
            now = time.monotonic()
            samples.append({"t": now - t0, **{n: _proc_sample(pid) for n, pid in pids.items()}})
            if now >= end:
                break
            time.sleep(min(sample_s, max(0.0, end - now)))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        for p in procs.values():
            stop_process(p)
        shutil.rmtree(d, ignore_errors=True)  # (left behind before: the bench audit)
    half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2] or samples
    growth = {}
    for name in pids:
        (rss0, fd0), (rss1, fd1) = half[0][name], half[-1][name]
        growth[name] = {"rss_start_mib": rss0 / 2**20, "rss_end_mib": rss1 / 2**20,
                        "rss_growth_mib": (rss1 - rss0) / 2**20, "fds_start": fd0, "fds_end": fd1,
                        "fd_growth": fd1 - fd0}
    return {"minutes": minutes, "requests": dict(counts), "second_half": growth, "samples": samples}


def main(argv: list[str] | None = None, from_shell: bool | None = None) -> int:
    if "--faults" in (sys.argv[1:] if argv is None else argv):
        from bench import soak_faults

        return soak_faults.main(argv, from_shell=argv is None if from_shell is None else from_shell)
    ap = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--faults", action="store_true",
                    help="the soak with faults (bench/soak_faults.py; `--faults --help` for its options)")
    a = ap.parse_args(argv)
    if (argv is None if from_shell is None else from_shell):  # (a caller of main(), a test, keeps its own)
        from bench.peers import sigterm_exits

        sigterm_exits()
    res = run(a.minutes, a.sample_s)
    print(f"requests: {res['requests']}")
    print(f"{'process':10s} {'RSS MiB (2nd half)':>22s} {'growth':>8s} {'fds':>9s} {'growth':>7s}")
    for name, g in res["second_half"].items():
        print(f"{name:10s} {g['rss_start_mib']:10.1f} -> {g['rss_end_mib']:8.1f} {g['rss_growth_mib']:+8.1f} "
              f"{g['fds_start']:4d} -> {g['fds_end']:<4d} {g['fd_growth']:+5d}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["requests"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
