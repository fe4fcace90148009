"""What a full garbage collection costs our processes, before and after their startup heap is
frozen (`broker.protocol.heap.freeze_startup_heap`).

    python -m bench.gc_pause [--repeats 5] [--json PATH]

CPython's cyclic collector starts a full collection by itself once enough objects have
survived into its oldest generation; the process stops for as long as the walk over every
tracked object takes.  For each process this builds what its startup builds, in a process
of its own (the broker: `Broker` on ipc endpoints; a worker: `Worker` with its model
loaded and warmed up, for ``echo`` (a numpy model, with torch imported all the same to
resolve the device) and ``convnet`` (torch)), then times
`gc.collect()` `--repeats` times (the median, and the objects the collector tracks), then
freezes the startup heap as `python -m broker` and `python -m gpu_worker` do and times it
again.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

#: what each measured process builds before it serves
TARGETS = {
    "broker": "from broker.server import Broker, BrokerConfig\n"
              "made = Broker(BrokerConfig(frontend=f'ipc://{tmp}/f.ipc', backend=f'ipc://{tmp}/b.ipc'))",
    "worker echo": "from gpu_worker.worker import Worker, WorkerConfig\n"
                   "made = Worker(WorkerConfig(broker=f'ipc://{tmp}/b.ipc', model='echo'))",
    "worker convnet (torch)": "from gpu_worker.worker import Worker, WorkerConfig\n"
                              "made = Worker(WorkerConfig(broker=f'ipc://{tmp}/b.ipc', model='convnet'))",
}

_PROBE = """
import gc, json, statistics, sys, time
tmp, repeats = sys.argv[1], int(sys.argv[2])
{build}
from broker.protocol.heap import freeze_startup_heap

def full() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3

gc.collect()
tracked = len(gc.get_objects())
before = statistics.median(full() for _ in range(repeats))
frozen = freeze_startup_heap()
after = statistics.median(full() for _ in range(repeats))
made.close()
print(json.dumps({{"tracked": tracked, "frozen": frozen, "full_ms": round(before, 3), "full_ms_frozen": round(after, 3)}}))
"""


def measure(repeats: int) -> dict:
    out = {}
    for name, build in TARGETS.items():
        with tempfile.TemporaryDirectory(prefix="gcp-") as tmp:
            p = subprocess.run([sys.executable, "-c", _PROBE.format(build=build), tmp, str(repeats)],
                               capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"{name}: {p.stderr[-2000:]}")
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    return {"repeats": repeats, "processes": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gc_pause", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="full collections timed, each side (the median)")
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    from bench.report import print_and_save

    res = measure(args.repeats)
    for name, r in res["processes"].items():
        print(f"{name:24s} {r['tracked']:>8d} objects: a full collection {r['full_ms']:8.2f} ms, "
              f"{r['full_ms_frozen']:6.2f} ms once {r['frozen']} are frozen", file=sys.stderr)
    return print_and_save(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
