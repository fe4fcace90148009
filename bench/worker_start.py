"""How long a worker takes from its start to READY (registered with its broker): the gap a
service with one worker has when that worker restarts, which `service_grace` (1 s by
default) must cover.

    python -m bench.worker_start [--rounds 5] [--model echo] [--root DIR ...] [--json PATH]

One broker on ipc endpoints in a temp dir; each round starts `python -m gpu_worker --model
MODEL` (default device "auto") from each `--root` in turn (a source tree: this one by
default; pass an older checkout to compare), waits for its READY line and stops it.
Reported per root: every round's seconds and the median.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ready(p: subprocess.Popen, timeout: float) -> str:
    """The process's first stdout line (READY ...), within `timeout` s (it is killed otherwise)."""
    import select

    r, _, _ = select.select([p.stdout], [], [], timeout)
    if not r:
        p.kill()
        raise TimeoutError(f"{p.args} printed nothing within {timeout} s")
    line = p.stdout.readline().decode()
    if not line.startswith("READY"):
        raise RuntimeError(f"{p.args}: {line!r}")
    return line


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    p.stdout.close()


def measure(roots: list[str], rounds: int = 5, model: str = "echo", extra: tuple[str, ...] = ()) -> dict:
    tmp = tempfile.mkdtemp(prefix="worker-start-")
    fe, be = f"ipc://{tmp}/fe.ipc", f"ipc://{tmp}/be.ipc"
    broker = subprocess.Popen([sys.executable, "-m", "broker", "--frontend", fe, "--backend", be], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out: dict[str, list[float]] = {root: [] for root in roots}
    try:
        _ready(broker, 30)
        for _ in range(rounds):
            for root in roots:
                env = dict(os.environ, PYTHONPATH=root)
                t0 = time.monotonic()
                w = subprocess.Popen([sys.executable, "-m", "gpu_worker", "--broker", be, "--model", model, *extra],
                                     cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                try:
                    _ready(w, 120)
                    out[root].append(time.monotonic() - t0)
                finally:
                    _stop(w)
    finally:
        _stop(broker)
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    return {"model": model, "rounds": rounds, "extra": list(extra),
            "roots": {root: {"seconds": v, "median_s": statistics.median(v)} for root, v in out.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.worker_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="echo")
    ap.add_argument("--root", action="append", help="a source tree to start the worker from (repeatable; "
                                                    "default: this one)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("extra", nargs="*", help="more worker flags, after --")
    args = ap.parse_args(argv)
    roots = [str(Path(r).resolve()) for r in (args.root or [str(ROOT)])]
    res = measure(roots, rounds=max(1, args.rounds), model=args.model, extra=tuple(args.extra))
    for root, r in res["roots"].items():
        print(f"{root}: " + ", ".join(f"{s:.2f}" for s in r["seconds"]) + f" s; median {r['median_s']:.2f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
