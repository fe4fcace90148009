"""CPU per request of each process's threads, pinned and brokered, 16 B.

    python -m bench.thread_cpu [--n 4000]

One broker and one `--direct` echo worker; a pinned blocking `Client`, then a brokered one,
each sends `--n` requests back to back.  Around each loop it reads every thread's CPU
(user + system) from /proc, and prints one JSON line: per path, the p50 in microseconds and,
for the client, the worker and the broker, [the Python threads', libzmq's I/O thread's] CPU
microseconds per request.  `bench.pinned` reports whole processes; this splits them, which
shows how much of a request is Python run cold and how much libzmq's own thread
(BENCHMARKS.md, "Waiting by descriptor").  Run it from a tree's root to measure that tree.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from bench.peers import Peer
from client_sdk import Client

_IO = "ZMQbg/IO/0"
_NOT_PYTHON = (_IO, "ZMQbg/Reaper")


class _Pair(Peer):
    name = "thread-cpu-echo"

    def start(self) -> None:
        self.fe, be = self.ipc("fe"), self.ipc("be")
        self.spawn([sys.executable, "-m", "broker", "--frontend", self.fe, "--backend", be])
        self.spawn([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", "echo", "--direct"])


def _threads(pid: int) -> dict[str, tuple[str, float]]:
    """thread id -> (name, CPU seconds so far)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        out[t] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def _split(before: dict, after: dict, n: int) -> list[int]:
    def used(keep) -> float:
        return sum(s - before.get(t, ("", 0.0))[1] for t, (name, s) in after.items() if keep(name))
    return [round(used(lambda name: name not in _NOT_PYTHON) * 1e6 / n), round(used(lambda name: name == _IO) * 1e6 / n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.thread_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="requests per path")
    args = ap.parse_args(argv)
    res = {}
    x = np.zeros(16, np.uint8)
    with _Pair() as d:
        pids = {"client": os.getpid(), "broker": d.pids[0], "worker": d.pids[1]}
        for pin in (True, False):
            with Client(d.fe, pin=pin, timeout=30) as c:
                deadline = time.monotonic() + 30
                while pin and not c.pinned("echo"):
                    if time.monotonic() > deadline:
                        raise SystemExit("no lease within 30 s")
                    with c.infer("echo", {"x": x}):
                        pass
                for _ in range(500):  # warm
                    with c.infer("echo", {"x": x}):
                        pass
                before = {k: _threads(p) for k, p in pids.items()}
                lat = []
                for _ in range(args.n):
                    t0 = time.perf_counter_ns()
                    with c.infer("echo", {"x": x}):
                        pass
                    lat.append(time.perf_counter_ns() - t0)
                after = {k: _threads(p) for k, p in pids.items()}
            lat.sort()
            row = {"p50_us": round(lat[len(lat) // 2] / 1e3, 1)}
            for k in pids:
                row[k] = _split(before[k], after[k], args.n)
            res["pinned" if pin else "brokered"] = row
    print(os.path.basename(os.getcwd()), json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
