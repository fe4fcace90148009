"""The cost of CurveZMQ on a tcp round trip through the broker.

    python -m bench.curve [--rounds 5] [--requests 1000] [--big-requests 100] [--json PATH]

Two deployments side by side, each a broker on tcp loopback (both sockets) and one `echo`
worker connected over tcp: `curve` (keys made for the run, `--curve-secret` and allow-lists)
and `plain` (`--insecure`).  A sync `Client` of each sends sequential inline requests of one
16-byte and one 1 MiB tensor (`reply="inline"`: the result crosses tcp as well, so a 1 MiB
request is 1 MiB encrypted and decrypted twice each way).  Rounds interleave the modes, the
first mode alternating from round to round, so that drift of the machine (another process,
frequency) lands on both alike.

Reported per size and mode: p50 and p99 of the round-trip latency over all rounds, the
per-round medians, and `ratio` = p50(curve) / p50(plain).  The first requests of each client
(connection, handshake, warm-up) are not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.peers import stop_process, wait_ready

SIZES = {"16B": 16, "1MiB": 1 << 20}
MODES = ("curve", "plain")


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        return p, wait_ready(p, 60)
    except BaseException:
        stop_process(p)
        raise


def _field(info: str, name: str) -> str:
    for part in info.split():
        if part.startswith(name + "="):
            return part.split("=", 1)[1]
    raise KeyError(name)


class Deployment:
    """A broker on tcp loopback and an echo worker, with CURVE or without."""

    def __init__(self, mode: str, keydir: str):
        from broker.security import make_keys

        self.mode = mode
        self.procs: list[subprocess.Popen] = []
        tcp = ["--frontend", "tcp://127.0.0.1:0", "--backend", "tcp://127.0.0.1:0"]
        if mode == "curve":
            keys = {n: make_keys(keydir, n) for n in ("server", "client", "worker")}
            for side, n in (("clients", "client"), ("workers", "worker")):
                os.makedirs(os.path.join(keydir, side), exist_ok=True)
                shutil.copy(keys[n][0], os.path.join(keydir, side))
            broker_sec = ["--curve-secret", keys["server"][1], "--client-keys", os.path.join(keydir, "clients"),
                          "--worker-keys", os.path.join(keydir, "workers")]
            worker_sec = ["--server-key", keys["server"][0], "--worker-key", keys["worker"][1]]
            self.client_opts = dict(server_key=keys["server"][0], client_key=keys["client"][1])
        else:
            broker_sec = worker_sec = ["--insecure"]
            self.client_opts = dict(insecure=True)
        try:
            p, info = _spawn(["-m", "broker", *tcp, *broker_sec])
            self.procs.append(p)
            self.frontend, backend = _field(info, "frontend"), _field(info, "backend")
            p, _ = _spawn(["-m", "gpu_worker", "--broker", backend, "--model", "echo", "--max-batch", "1",
                           "--out-capacity-mb", "16", *worker_sec])
            self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def client(self):
        from client_sdk import Client

        c = Client(self.frontend, timeout=30, **self.client_opts)
        deadline = time.monotonic() + 30
        while not c.mmi_service("echo"):
            if time.monotonic() > deadline:
                c.close()
                raise RuntimeError(f"{self.mode}: no echo worker after 30 s")
            time.sleep(0.01)
        return c

    def close(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        self.procs = []


def _timed(client, x: np.ndarray, n: int) -> list[float]:
    """Latencies (seconds) of `n` sequential round trips of `x`."""
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        with client.infer("echo", {"x": x}, reply="inline") as r:
            got = r["x"]
        out.append(clock() - t0)
        assert got.nbytes == x.nbytes
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run(rounds: int, requests: int, big_requests: int) -> dict:
    keydir = tempfile.mkdtemp(prefix="zinf-curve-")
    deps: dict = {}
    clients: dict = {}
    try:
        for mode in MODES:
            deps[mode] = Deployment(mode, keydir)
            clients[mode] = deps[mode].client()
        payload = {name: np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8) for name, size in SIZES.items()}
        counts = {"16B": requests, "1MiB": big_requests}
        for mode in MODES:  # warm-up: connections, handshakes, allocator, caches
            for name, x in payload.items():
                _timed(clients[mode], x, max(5, counts[name] // 10))
        lat = {(name, mode): [] for name in SIZES for mode in MODES}
        medians = {(name, mode): [] for name in SIZES for mode in MODES}
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for name, x in payload.items():
                for mode in order:
                    got = _timed(clients[mode], x, counts[name])
                    lat[name, mode] += got
                    medians[name, mode].append(_pct(got, 50) * 1e6)
        result = {"rounds": rounds, "requests": counts, "transport": "tcp loopback, inline tensors both ways",
                  "sizes": {}}
        for name in SIZES:
            row = {}
            for mode in MODES:
                xs = lat[name, mode]
                row[mode] = {"p50_us": round(_pct(xs, 50) * 1e6, 1), "p99_us": round(_pct(xs, 99) * 1e6, 1),
                             "n": len(xs), "round_p50_us": [round(m, 1) for m in medians[name, mode]]}
            row["ratio"] = round(row["curve"]["p50_us"] / row["plain"]["p50_us"], 3)
            result["sizes"][name] = row
        return result
    finally:
        for c in clients.values():
            c.close()
        for d in deps.values():
            d.close()
        shutil.rmtree(keydir, ignore_errors=True)


def render(result: dict) -> str:
    lines = [f"CurveZMQ vs plain tcp, broker round trip ({result['transport']}; {result['rounds']} interleaved rounds)",
             f"{'size':>6} {'mode':>6} {'p50 us':>10} {'p99 us':>10} {'n':>6}   per-round p50 us"]
    for name, row in result["sizes"].items():
        for mode in MODES:
            m = row[mode]
            rounds = " ".join(f"{v:.0f}" for v in m["round_p50_us"])
            lines.append(f"{name:>6} {mode:>6} {m['p50_us']:>10.1f} {m['p99_us']:>10.1f} {m['n']:>6}   {rounds}")
        lines.append(f"{name:>6} {'ratio':>6} {row['ratio']:>10.3f}   (p50 curve / p50 plain)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.curve", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved A/B rounds (at least 5 for a report)")
    ap.add_argument("--requests", type=int, default=1000, help="16-byte requests per mode per round")
    ap.add_argument("--big-requests", type=int, default=100, help="1 MiB requests per mode per round")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.big_requests < 1:
        ap.error("--rounds, --requests and --big-requests must be positive")
    result = run(args.rounds, args.requests, args.big_requests)
    result["command"] = " ".join(["python -m bench.curve", *(sys.argv[1:] if argv is None else argv)])
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
