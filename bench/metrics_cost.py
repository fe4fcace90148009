"""What the broker's metrics cost on the tiny path: the same 16 B shared-memory echo through
the broker with metrics off (`broker-shm`) and on (`broker-shm-metrics`: `--http`), in
interleaved rounds (the order flips every round), p50 of each, and the ratio per round; the
median ratio is the figure.  Then the microseconds per request the metrics add to the
broker's own Python work (`bench.hotpath`, sockets taken out), interleaved the same way.

    python -m bench.metrics_cost [--rounds 5] [--json bench/results/metrics_cost.json]

`--render`: instead, the time one `/metrics` body takes to render (`broker.metrics.render`
and `exposition`, what a scrape runs on the broker's HTTP thread, holding the interpreter
the loop needs), by the number of services, median of 5; beside it, the same families
through prometheus-client's own writer (`broker.metrics.reference`, byte for byte the same
page), interleaved.  What a render does to the request path: `python -m bench.scrape_load`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

OFF, ON = "broker-shm", "broker-shm-metrics"


def _p50s(order: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "q.json")
        subprocess.run([sys.executable, "-m", "bench", "quick", "--quiet", "--sizes", "16", "--peers", ",".join(order),
                        "--json", out], check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            rows = json.load(f)["results"]
    return {r["peer"]: r["latency_ms"]["p50"] for r in rows}


def render_ms(services: int, repeats: int = 5) -> tuple[float, float]:
    """Median ms of one scrape's render with ``services`` services, each with a few answers:
    ours, and through prometheus-client's writer."""
    import time

    from broker.metrics import Metrics, exposition, reference, render

    m = Metrics()
    sched = {"services": {}, "counters": {"dispatched": 1, "retried": 0}}
    for i in range(services):
        name = f"svc{i}"
        m.register(name, 0.0)
        for code in (0, 3, 4):
            m.final(name, code, 0.0, 0.001, 0.002)
        sched["services"][name] = {"queued": {"urgent": 0, "normal": 0, "background": 0}, "in_flight": 0,
                                   "credit": 4, "hosts": {"h": 1}, "leases": 0, "leased_credit": 0}
    times: dict = {exposition: [], reference: []}
    for _ in range(repeats):
        for write in times:
            snap = m.snapshot()
            t = time.perf_counter()
            write(render(snap, sched, m.known))
            times[write].append((time.perf_counter() - t) * 1000.0)
    return statistics.median(times[exposition]), statistics.median(times[reference])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.metrics_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000, help="hot-path iterations per measurement")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", action="store_true", help="time a scrape's render by service count, and exit")
    args = ap.parse_args(argv)
    if args.render:
        for n in (1, 8, 16, 128, 500):
            ours, lib = render_ms(n)
            print(f"{n:4d} services: {ours:7.2f} ms per render; through prometheus-client's writer {lib:7.2f} ms "
                  f"({lib / ours:.1f}x)")
        return 0
    from bench.hotpath import broker_us

    rounds = []
    for i in range(args.rounds):
        order = [OFF, ON] if i % 2 == 0 else [ON, OFF]
        p = _p50s(order)
        hot_off, hot_on = (broker_us(args.n), broker_us(args.n, metrics=True)) if i % 2 == 0 else \
            tuple(reversed((broker_us(args.n, metrics=True), broker_us(args.n))))
        rounds.append({"order": order, "p50_off_ms": p[OFF], "p50_on_ms": p[ON], "ratio": p[ON] / p[OFF],
                       "hot_off_us": hot_off, "hot_on_us": hot_on, "hot_added_us": hot_on - hot_off})
        r = rounds[-1]
        print(f"round {i + 1}: p50 off {r['p50_off_ms']:.3f} ms, on {r['p50_on_ms']:.3f} ms, ratio {r['ratio']:.3f}; "
              f"broker hot path {r['hot_off_us']:.1f} -> {r['hot_on_us']:.1f} us", flush=True)
    summary = {
        "command": "python -m bench.metrics_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_hot_added_us": statistics.median(r["hot_added_us"] for r in rounds),
        "rounds": rounds,
    }
    print(f"median p50 ratio (metrics on / off): {summary['median_ratio']:.3f}; "
          f"median microseconds added per request on the broker's hot path: {summary['median_hot_added_us']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
