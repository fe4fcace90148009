"""What a Prometheus scrape costs the request path: a lone client's latency while `/metrics`
is read, against the same client with nobody scraping.

    python -m bench.scrape_load [--services 128] [--n 4000] [--rounds 3] [--every-ms 0] [--json PATH]

A broker with its metrics on (`--http 127.0.0.1:0`), one `gpu_worker` echo (max batch 1),
and `--services` more services, each registered by a plain MDP worker in one helper process
(`python -m bench.scrape_load workers`) that heartbeats and reports one STATS, so that every
service has its series on the page (about 120 lines each, most of them histogram buckets).
One blocking `Client` sends `--n` sequential 16 B echoes over shared memory; meanwhile a
scraper in a process of its own reads `/metrics` back to back (`--every-ms 0`, the worst
case: a render always under way) or once every that many ms.  Rounds alternate quiet and
scraped.  A render holds the broker's interpreter on its HTTP thread, and the loop waits
for it (CPython hands the interpreter over at most every `sys.getswitchinterval()`), so
what to look at is the tail: p99 and p99.9 of the scraped rounds against the quiet ones.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

TINY = 16


def run_workers(backend: str, services: int) -> None:
    """`--services` plain MDP workers in this one process: READY, one STATS (so the service
    has its histograms), then a heartbeat every second; requests are never sent to them (the
    bench calls echo only)."""
    import zmq

    from bench.echo_servers import die_with_parent
    from broker import protocol as P
    from broker.protocol.stats import BATCH_BUCKETS, LATENCY_BUCKETS
    from broker.protocol.wire import send_frames

    die_with_parent()
    ctx = zmq.Context.instance()
    socks = []
    lat = ([1] * (len(LATENCY_BUCKETS) + 1), 0.01)
    stats = P.WorkerStats(compute=lat, input=lat, output=lat, batch=([1] * (len(BATCH_BUCKETS) + 1), 10.0))
    for i in range(services):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(backend)
        send_frames(s, P.worker_ready(f"svc{i}"))
        send_frames(s, P.worker_stats(stats))
        socks.append(s)
    print("READY", flush=True)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    beat = P.worker_heartbeat()
    next_beat = 0.0
    while True:
        for s, _ in poller.poll(200):
            s.recv_multipart()  # heartbeats and the like: nothing to answer but our own beats
        if time.monotonic() >= next_beat:
            for s in socks:
                send_frames(s, beat)
            next_beat = time.monotonic() + 1.0


def run_scraper(url: str, every_ms: float) -> None:
    """Read `url` until killed: back to back, or once every ``every_ms``."""
    from bench.echo_servers import die_with_parent

    die_with_parent()
    opener = urllib.request.build_opener()
    print("READY", flush=True)
    while True:
        t = time.monotonic()
        with opener.open(url, timeout=30) as r:
            r.read()
        if every_ms > 0:
            time.sleep(max(0.0, every_ms / 1e3 - (time.monotonic() - t)))


def _latencies(client, buf, n: int) -> np.ndarray:
    out = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        with client.infer("echo", {"x": buf}):
            pass
        out[i] = time.perf_counter() - t
    return out * 1e3


def _summary(ms: np.ndarray) -> dict:
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "p999_ms": float(np.percentile(ms, 99.9)), "max_ms": float(ms.max())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["workers"]:
        run_workers(argv[1], int(argv[2]))
        return 0
    if argv[:1] == ["scraper"]:
        run_scraper(argv[1], float(argv[2]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.scrape_load", description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=128, help="services besides echo, each with its series")
    ap.add_argument("--n", type=int, default=4000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of rounds (quiet, scraped), alternating")
    ap.add_argument("--every-ms", type=float, default=0.0, help="scrape period (0: back to back)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from bench.peers import Peer
    from client_sdk import Client

    class Cluster(Peer):
        name = "scrape-load"

        def start(self) -> None:
            env = self.unbuffered_env()
            self.frontend, backend = self.ipc("f.ipc"), self.ipc("b.ipc")
            info = self.spawn(self.python_module("broker", "--frontend", self.frontend, "--backend", backend,
                                                 "--http", "127.0.0.1:0"), env=env)
            self.url = _http_url(info)
            self.spawn(self.python_module("gpu_worker", "--broker", backend, "--model", "echo", "--max-batch", "1"),
                       env=env)
            self.spawn(self.python_module("bench.scrape_load", "workers", backend, str(args.services)), env=env)

    rows = []
    with Cluster() as cl, Client(cl.frontend, timeout=30) as c:
        deadline = time.monotonic() + 30
        while not all(c.mmi_service(s) for s in ("echo", f"svc{args.services - 1}")):
            if time.monotonic() > deadline:
                raise SystemExit("the services did not register")
            time.sleep(0.05)
        url = cl.url
        with urllib.request.urlopen(url, timeout=30) as r:
            page = r.read()
        lines = page.count(b"\n")
        buf = c.alloc((TINY,), np.uint8)
        _latencies(c, buf, 500)  # warm
        renders = []
        for i in range(2 * args.rounds):
            scraped = i % 2 == 1
            scraper = None
            if scraped:
                scraper = subprocess.Popen([sys.executable, "-m", "bench.scrape_load", "scraper", url,
                                            str(args.every_ms)], stdout=subprocess.PIPE, env=cl.unbuffered_env())
                scraper.stdout.readline()
                t = time.perf_counter()
                with urllib.request.urlopen(url, timeout=30) as r:
                    r.read()
                renders.append((time.perf_counter() - t) * 1e3)
            try:
                ms = _latencies(c, buf, args.n)
            finally:
                if scraper is not None:
                    scraper.kill()
                    scraper.wait(10)
            rows.append({"scraped": scraped, **_summary(ms)})
            r = rows[-1]
            print(f"round {i + 1} {'scraped' if scraped else 'quiet  '}: p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:.3f} "
                  f"p99.9 {r['p999_ms']:.3f} max {r['max_ms']:.2f} ms", flush=True)
    med = {k: {q: statistics.median(r[q] for r in rows if r["scraped"] == k) for q in ("p50_ms", "p99_ms", "p999_ms")}
           for k in (False, True)}
    summary = {"command": "python -m bench.scrape_load " + " ".join(argv), "services": args.services + 1,
               "page_lines": lines, "scrape_ms_median": statistics.median(renders), "quiet": med[False],
               "scraped": med[True], "rounds": rows}
    print(f"{args.services + 1} services, {lines} lines a page, a scrape {summary['scrape_ms_median']:.1f} ms; "
          f"medians quiet / scraped: p50 {med[False]['p50_ms']:.3f} / {med[True]['p50_ms']:.3f}, "
          f"p99 {med[False]['p99_ms']:.3f} / {med[True]['p99_ms']:.3f}, "
          f"p99.9 {med[False]['p999_ms']:.3f} / {med[True]['p999_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _http_url(info: str) -> str:
    """The broker's /metrics URL, from the READY line it printed (`http=HOST:PORT`)."""
    for field in info.split():
        if field.startswith("http="):
            return f"http://{field[5:]}/metrics"
    raise SystemExit(f"the broker printed no http= field: {info!r}")


if __name__ == "__main__":
    sys.exit(main())
