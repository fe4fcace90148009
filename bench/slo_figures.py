"""The SLO figures in BENCHMARKS.md, measured with `python -m bench run` against real
deployments started here: streams of 720p frames at 30 fps for `echo` and `cartoon` with one
and two workers, and the open-loop capacity at p99 <= 10 ms for `echo` at 16 B and at one
1080p frame (6.2 MB).

    python -m bench.slo_figures [--only NAME ...] [--out bench/results/slo]

Each case starts its own broker and workers (ipc:// in a temp dir; the `cartoon` workers get
one torch thread each, as `make demo` does, or two of them fight over two cores), runs
`python -m bench run` with --json/--csv/--markdown into OUT/<case>.*, stops them, and at the
end prints one line per case.  Cases run one after another, never two at once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.peers import Peer

FRAME_720P = "image=720x1280x3:uint8"
MEASURE = ["--warmup-s", "0.5", "--window-s", "1.0", "--windows", "3"]

# name -> (model, workers, worker options, bench run options)
CASES: dict[str, tuple[str, int, list[str], list[str]]] = {
    "echo_streams_1w": ("echo", 1, [], [
        "--input", FRAME_720P, "--streams-range", "1:512", "--search", "--fps", "30",
        "--slo-ms", "33"]),
    "echo_streams_2w": ("echo", 2, [], [
        "--input", FRAME_720P, "--streams-range", "1:512", "--search", "--fps", "30",
        "--slo-ms", "33"]),
    # One 720p frame takes longer than a frame period on one core: the figure is fractional.
    "cartoon_streams_1w": ("cartoon", 1, ["--max-batch", "1"], [
        "--input", FRAME_720P, "--streams-range", "1:2", "--fps", "30", "--slo-ms", "250"]),
    "cartoon_streams_2w": ("cartoon", 2, ["--max-batch", "1"], [
        "--input", FRAME_720P, "--streams-range", "1:3", "--fps", "30", "--slo-ms", "250"]),
    "echo_16B_capacity": ("echo", 1, [], [
        "--input", "x=16:uint8", "--request-rate-range", "500:100000", "--search", "--slo-ms", "10"]),
    # The same with the generator in two processes (it takes a core at the knee above).
    "echo_16B_capacity_2gen": ("echo", 1, [], [
        "--input", "x=16:uint8", "--request-rate-range", "500:100000", "--search", "--slo-ms", "10",
        "--workers", "2"]),
    # ... and without the spin before each send (--spin-us 0): two spinning generators on
    # two cores take a core from the broker and the worker.
    "echo_16B_capacity_2gen_nospin": ("echo", 1, [], [
        "--input", "x=16:uint8", "--request-rate-range", "500:100000", "--search", "--slo-ms", "10",
        "--workers", "2", "--spin-us", "0"]),
    "echo_6MB_capacity": ("echo", 1, [], [
        "--input", "x=1080x1920x3:uint8", "--request-rate-range", "50:100000", "--search",
        "--slo-ms", "10"]),
}


class Deployment(Peer):
    """A broker and its workers, reaped by Peer.stop()."""

    name = "slo-deployment"

    def start(self) -> None:  # started by start_with(), once the case is known
        pass

    def start_with(self, model: str, workers: int, worker_opts: list[str]) -> str:
        fe, be = self.ipc("fe"), self.ipc("be")
        self.spawn([sys.executable, "-m", "broker", "--frontend", fe, "--backend", be])
        env = dict(os.environ, OMP_NUM_THREADS="1") if model == "cartoon" else None
        for _ in range(workers):
            self.spawn([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", model, *worker_opts],
                       ready_timeout=120, env=env)
        return fe


def summary_line(name: str, report: dict) -> str:
    s = report["search"]
    results = report["results"]
    cpu = max((r["generator"]["cpu_cores"] or 0) for r in results) if results else 0
    if report["config"]["mode"] == "streams":
        eq = s["stream_equivalents"]
        return (f"{name}: capacity {s['capacity']} streams at 30 fps (p99 <= {s['slo_ms']:g} ms), "
                f"stream equivalents {eq}, limited by {s['limited_by']}, generator cpu <= {cpu:.2f} cores")
    return (f"{name}: capacity {s['capacity']} req/s ({s['capacity_throughput_rps']} achieved) at "
            f"p99 <= {s['slo_ms']:g} ms, limited by {s['limited_by']}, knee {s['knee']}, "
            f"generator cpu <= {cpu:.2f} cores")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slo_figures", description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(CASES), help="run these cases only")
    p.add_argument("--out", default="bench/results/slo", help="output folder (default bench/results/slo)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    lines = []
    for name in a.only or CASES:
        model, workers, wopts, ropts = CASES[name]
        with Deployment() as d:
            fe = d.start_with(model, workers, wopts)
            base = os.path.join(a.out, name)
            cmd = [sys.executable, "-m", "bench", "run", "--endpoint", fe, "--service", model, *MEASURE, *ropts,
                   "--json", base + ".json", "--csv", base + ".csv", "--markdown", base + ".md"]
            print(f"== {name}: {model} x{workers}", flush=True)
            rc = subprocess.run(cmd, timeout=1800).returncode
        if rc != 0:
            lines.append(f"{name}: bench run exited {rc}")
            continue
        with open(base + ".json") as f:
            lines.append(summary_line(name, json.load(f)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
