"""Work already at a worker (issue "rough edges", items 1 and 2), measured with real
processes:

* head-of-line: two workers of a model that sleeps x[0] seconds (its warm-up is fast, so a
  long call runs on the worker loop's own thread, the hard case); A (1 s) runs on one, B
  (50 ms) on the other, C (20 ms) arrives while both are busy and is placed behind A.  The
  latency of C with the broker taking work back (the default) and with `--recall-after-ms -1`
  (never), interleaved rounds.
* cancelling a stream: a model streaming 100 partials 50 ms apart is cancelled after its
  first; the time until the next request's reply (it starts at the stream's next partial).

    python -m bench.running_work [--rounds 3] [--json bench/results/running_work.json]
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


def sleepy(device: str = "cpu"):
    """Sleeps x[0] seconds, then echoes; its warm-up (x = 0) is fast."""
    def run(inputs):
        x = np.asarray(inputs["x"])
        if x.size and float(x.flat[0]) > 0:
            time.sleep(float(x.flat[0]))
        return {"x": np.array(x, copy=True)}

    run.name = "sleepy"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(1)}
    return run


def ticker(device: str = "cpu"):
    """Streams x[0] partials, one every x[1] seconds."""
    def run(inputs):
        x = np.asarray(inputs["x"]).ravel()
        for i in range(int(x[0])):
            if x[1] > 0:
                time.sleep(float(x[1]))
            yield {"x": np.array([float(i)])}

    run.name = "ticker"
    run.batchable = False
    run.streaming = True
    run.example_inputs = lambda: {"x": np.array([1.0, 0.0])}
    return run


class _Cluster(Peer):
    name = "running-work"

    def __init__(self, model: str, workers: int, *broker_args: str):
        super().__init__()
        self.model, self.workers, self.broker_args = model, workers, broker_args

    def start(self) -> None:
        backend = self.spawn_broker(*self.broker_args)
        env = self.unbuffered_env()
        for _ in range(self.workers):
            self.spawn(self.python_module("gpu_worker", "--broker", backend, "--model",
                                          f"bench.running_work:{self.model}"), env=env)


def head_of_line(recall: bool) -> float:
    from client_sdk import Client

    args = () if recall else ("--recall-after-ms", "-1")
    with _Cluster("sleepy", 2, *args) as cl, Client(cl.frontend, timeout=30) as c:
        while not c.mmi_service("sleepy"):
            time.sleep(0.01)
        a = c.infer_stream("sleepy", {"x": np.array([1.0])})
        assert c.mmi_service("sleepy")  # A is at a worker before B is sent
        time.sleep(0.05)  # A has started (a bench, not a test: the order is what matters)
        b = c.infer_stream("sleepy", {"x": np.array([0.05])})
        assert c.mmi_service("sleepy")
        time.sleep(0.01)
        t0 = time.monotonic()
        cc = c.infer_stream("sleepy", {"x": np.array([0.02])})
        cc.result(timeout=30).release()
        took = time.monotonic() - t0
        b.result(timeout=30).release()
        a.result(timeout=30).release()
        return took


def cancel_stream() -> float:
    from client_sdk import Client

    with _Cluster("ticker", 1) as cl, Client(cl.frontend, timeout=30) as c:
        while not c.mmi_service("ticker"):
            time.sleep(0.01)
        h = c.infer_stream("ticker", {"x": np.array([100.0, 0.05])})
        next(h).release()
        h.cancel()
        t0 = time.monotonic()
        for r in c.infer_stream("ticker", {"x": np.array([1.0, 0.0])}):
            r.release()
        return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.running_work", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    on, off, cancel = [], [], []
    for i in range(args.rounds):
        for recall in ((True, False) if i % 2 == 0 else (False, True)):
            (on if recall else off).append(head_of_line(recall) * 1e3)
        cancel.append(cancel_stream() * 1e3)
        print(f"round {i + 1}: C took {on[-1]:.0f} ms taking work back, {off[-1]:.0f} ms without; "
              f"after a cancelled stream the next reply took {cancel[-1]:.0f} ms", flush=True)
    out = {
        "command": "python -m bench.running_work " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "c_ms_recall": on, "c_ms_no_recall": off, "next_after_cancel_ms": cancel,
        "median_c_ms_recall": statistics.median(on), "median_c_ms_no_recall": statistics.median(off),
        "median_next_after_cancel_ms": statistics.median(cancel),
    }
    print(f"median: C {out['median_c_ms_recall']:.0f} ms (taking work back) vs {out['median_c_ms_no_recall']:.0f} ms; "
          f"next after a cancelled stream {out['median_next_after_cancel_ms']:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
