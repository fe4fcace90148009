"""Pinned against brokered: the same blocking `Client` and `gpu_worker --direct` echo, one
client with `pin=True` (two hops: client -> worker -> client) and one without (three: through
the broker), interleaved round by round.

    python -m bench.pinned [--rounds 5] [--n 2000] [--json bench/results/pinned.json]

Each round sends `--n` sequential 16 B requests on each client, then `--n-large` 1080p
frames (6.2 MB, written once into the client's shared memory and sent by reference), and
records p50 and p99, and for 16 B the CPU time per request of the client, the broker and
the worker (every thread, from /proc: libzmq's I/O threads included).  The figures: per
round, pinned / brokered p50 at 16 B, and for each client its 6.2 MB p50 over its 16 B p50;
the medians over rounds.  16 B go inline by default (`SMALL_INLINE_BYTES`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from bench.hist import LatencyHistogram
from bench.peers import Peer

PIN_WAIT_S = 10.0


class _Echo(Peer):
    name = "pinned-echo"

    def start(self) -> None:
        self.fe, be = self.ipc("fe"), self.ipc("be")
        self.spawn([sys.executable, "-m", "broker", "--frontend", self.fe, "--backend", be])
        self.spawn([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", "echo", "--direct"])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _round(client, x, n: int, pids: dict[str, int] | None = None) -> tuple:
    """(p50 ms, p99 ms) of `n` sequential requests, and with ``pids`` ({"broker": pid, ...})
    the CPU microseconds per request of this process ("client") and of each of them."""
    h = LatencyHistogram()
    cpu0 = {k: _cpu_s(p) for k, p in (pids or {}).items()}
    own0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        with client.infer("echo", {"x": x}):
            pass
        h.record_ns(time.perf_counter_ns() - t0)
    if pids is None:
        return h.percentile_ms(50), h.percentile_ms(99)
    cpu = {"client": (time.process_time() - own0) * 1e6 / n}
    cpu.update({k: (_cpu_s(p) - cpu0[k]) * 1e6 / n for k, p in pids.items()})
    return h.percentile_ms(50), h.percentile_ms(99), cpu


def main(argv: list[str] | None = None) -> int:
    from client_sdk import Client

    p = argparse.ArgumentParser(prog="python -m bench.pinned", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=2000, help="16 B requests per client per round")
    p.add_argument("--n-large", type=int, default=200, help="6.2 MB requests per client per round")
    p.add_argument("--json", default="bench/results/pinned.json")
    a = p.parse_args(argv)
    rows = []
    with _Echo() as d, Client(d.fe, pin=True, timeout=30) as pinned, Client(d.fe, timeout=30) as brokered:
        clients = {"pinned": pinned, "brokered": brokered}
        tiny = {k: c.alloc((16,), np.uint8) for k, c in clients.items()}
        frame = {k: c.alloc((1080, 1920, 3), np.uint8) for k, c in clients.items()}
        for k in clients:
            tiny[k][:] = 7
            frame[k][:] = 3
        deadline = time.monotonic() + PIN_WAIT_S
        while not pinned.pinned("echo"):  # the first requests go brokered while the lease is asked
            if time.monotonic() > deadline:
                raise SystemExit("the pinned client got no lease (is the worker started with --direct?)")
            with pinned.infer("echo", {"x": tiny["pinned"]}):
                pass
        for k, c in clients.items():  # warm-up
            _round(c, tiny[k], 200)
            _round(c, frame[k], 10)
        pids = dict(zip(("broker", "worker"), d.pids))
        for r in range(a.rounds):
            row = {}
            for k, c in clients.items():
                row[k] = {"tiny": _round(c, tiny[k], a.n, pids), "frame": _round(c, frame[k], a.n_large)}
            row["pinned_replies"] = pinned.pinned_replies
            rows.append(row)
            print(f"round {r + 1}: 16 B p50 pinned {row['pinned']['tiny'][0]:.3f} ms, brokered "
                  f"{row['brokered']['tiny'][0]:.3f} ms; 6.2 MB p50 pinned {row['pinned']['frame'][0]:.3f} ms, "
                  f"brokered {row['brokered']['frame'][0]:.3f} ms", flush=True)
        assert pinned.pinned("echo"), "the lease ended during the run"
    med = statistics.median
    out = {
        "rounds": rows,
        "pinned_vs_brokered_tiny_p50": round(med(r["pinned"]["tiny"][0] / r["brokered"]["tiny"][0] for r in rows), 3),
        "pinned_payload_independence_6mb": round(med(r["pinned"]["frame"][0] / r["pinned"]["tiny"][0] for r in rows), 3),
        "brokered_payload_independence_6mb": round(med(r["brokered"]["frame"][0] / r["brokered"]["tiny"][0]
                                                       for r in rows), 3),
        "pinned_tail_ratio_tiny": round(med(r["pinned"]["tiny"][1] / r["pinned"]["tiny"][0] for r in rows), 3),
        "brokered_tail_ratio_tiny": round(med(r["brokered"]["tiny"][1] / r["brokered"]["tiny"][0] for r in rows), 3),
        # CPU per 16 B request, each process's every thread (libzmq's I/O thread included):
        # steadier than latency on a shared machine, and what the hot-path work removes.
        "cpu_us_per_request_tiny": {k: {proc: round(med(r[k]["tiny"][2][proc] for r in rows), 1)
                                        for proc in ("client", "broker", "worker")}
                                    for k in ("pinned", "brokered")},
        "command": " ".join([sys.executable, "-m", "bench.pinned", *(argv if argv is not None else sys.argv[1:])]),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
