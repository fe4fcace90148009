"""Stalls: how long each kind of user waits through an operator's routine events.

    python -m bench.stalls [--events all|rolling,kill,...] [--rounds 3] [--json PATH]

Three personas run side by side, each in its own thread with its own client, against a
broker on ipc endpoints in a temp dir (production defaults: 1 s heartbeats, liveness 3,
service grace 1 s) and workers of `bench.stalls:tick` (echo after $TICK_MS, default 2 ms;
a request with an input named `slow` takes $SLOW_S, default 2 s) started with `--direct`:

  ar     a camera stream: `client.stream(..., latest_wins=True, max_in_flight=2)` on a
         `Client` made without `pin` (the stream pins by default), a frame every 1/60 s;
         its stall is the longest gap between two frames delivered
  game   a game server on the same host: `Client(pin=True)`, one tiny call every 5 ms; its
         stall is the slowest call (and the longest gap between results)
  slo    a service held to a latency SLO: a plain `Client`, one call every 5 ms; its stall
         is the slowest call (and p99 around the event)

Events (one per round, after a second of steady traffic; what is timed starts at the event):

  rolling    a rolling restart: a second worker started and READY, then SIGTERM the first
  kill       a second worker started and READY, then SIGKILL the first (the leaseholder)
  broker     SIGKILL the broker, start it again on the same endpoints
  launcher   `python -m broker --config` with one pool of one worker: SIGKILL the worker,
             the launcher starts another (backoff 0.5 s + the worker's start)
  scale      a second worker started (no stall expected)
  slow       a request of $SLOW_S from another client (two workers: head-of-line?)
  order      the personas start before any worker; the worker starts a second later
             (stall: from its READY to each persona's first result, and what failed)

Printed per event and persona: the medians over rounds of the longest gap (ms) after the
event, the steady gap before it, failed calls, and for the pinned personas how long after
the event they were pinned again (`repin`).  Numbers depend on the machine: run it on an
idle one, and compare the stalls with the design's timers (docs/operations.md) rather than
with each other's milliseconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.peers import stop_process, wait_ready

SERVICE = "tick"
EVENTS = ("rolling", "kill", "broker", "launcher", "scale", "slow", "order")
PERSONAS = ("ar", "game", "slo")


def tick(device: str = "cpu"):
    """Echo after $TICK_MS ms (default 2); a request with an input named `slow` takes $SLOW_S s."""
    pause = float(os.environ.get("TICK_MS", "2")) / 1000
    slow = float(os.environ.get("SLOW_S", "2"))

    def run(inputs):
        time.sleep(slow if "slow" in inputs else pause)
        return {k: np.array(v, copy=True) for k, v in inputs.items()}

    run.name = SERVICE
    run.batchable = False
    return run


class Stack:
    """A broker (or a launcher) and workers on ipc endpoints in a temp dir; stderr of each
    process goes to a file there (`logs`)."""

    def __init__(self, hb: float):
        self.dir = Path(tempfile.mkdtemp(prefix="zinf-stalls-"))
        self.fe, self.be = f"ipc://{self.dir}/fe.ipc", f"ipc://{self.dir}/be.ipc"
        self.hb = hb
        self.broker: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._n = 0

    def _spawn(self, args: list[str], name: str, wait: bool = True) -> subprocess.Popen:
        self._n += 1
        err = open(self.dir / f"{self._n:02d}-{name}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=err, env=env)
        err.close()
        if wait:
            wait_ready(p, 60)
        return p

    def start_broker(self) -> None:
        self.broker = self._spawn(["-m", "broker", "--frontend", self.fe, "--backend", self.be,
                                   "--heartbeat-interval", str(self.hb), "--log-level", "INFO"], "broker")

    def start_launcher(self) -> None:
        cfg = self.dir / "deploy.toml"
        cfg.write_text(f'frontend = "{self.fe}"\nbackend = "{self.be}"\n[scheduler]\nheartbeat_interval = {self.hb}\n'
                       f'[[pool]]\nmodel = "bench.stalls:tick"\ncount = 1\ncredit = 32\nextra_args = ["--direct", "--no-warmup"]\n')
        self.broker = self._spawn(["-m", "broker", "--config", str(cfg), "--log-level", "INFO"], "launcher")

    def start_worker(self, wait: bool = True) -> subprocess.Popen:
        p = self._spawn(["-m", "gpu_worker", "--broker", self.be, "--model", "bench.stalls:tick", "--direct",
                         "--credit", "32", "--no-warmup", "--heartbeat-interval", str(self.hb),
                         "--log-level", os.environ.get("STALLS_WORKER_LOG", "INFO")], "worker", wait)
        self.workers.append(p)
        return p

    def launcher_workers(self) -> list[int]:
        pids: list[int] = []
        for task in Path(f"/proc/{self.broker.pid}/task").iterdir():  # the launcher forks from a thread
            try:
                pids += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                pass
        return pids

    def close(self) -> None:
        procs = [p for p in (*self.workers, self.broker) if p is not None]
        for p in procs:  # all told at once: they drain side by side
            if p.poll() is None:
                p.terminate()
        for p in procs:
            stop_process(p)
            p.stdout.close()


class Persona(threading.Thread):
    """One user's loop; `done` holds (sent, finished, ok) monotonic times, `pinned` the times
    at which the loop saw the client pinned (sampled each iteration)."""

    def __init__(self, kind: str, fe: str, stop: threading.Event):
        super().__init__(daemon=True, name=f"persona-{kind}")
        self.kind, self.fe, self.stop = kind, fe, stop
        self.done: list[tuple[float, float, bool]] = []
        self.pin_seen: list[tuple[float, bool]] = []
        self.errors: list[tuple[float, str]] = []
        self.exc: BaseException | None = None

    def _pin_sample(self, c) -> None:
        p = c.pinned(SERVICE)
        if not self.pin_seen or self.pin_seen[-1][1] != p:
            self.pin_seen.append((time.monotonic(), p))

    def run(self) -> None:
        from client_sdk import Client

        try:
            if self.kind == "ar":
                with Client(self.fe, timeout=5.0) as c:
                    self._ar(c)
            else:
                with Client(self.fe, timeout=5.0, pin=self.kind == "game") as c:
                    self._calls(c)
        except BaseException as e:  # noqa: BLE001 - reported by the driver
            self.exc = e

    def _calls(self, c) -> None:
        from client_sdk import InferenceError

        x = np.arange(16, dtype=np.float32)
        period = 0.005
        nxt = time.monotonic()
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                with c.infer(SERVICE, {"x": x}):
                    pass
                self.done.append((t0, time.monotonic(), True))
            except InferenceError as e:
                t1 = time.monotonic()
                self.done.append((t0, t1, False))
                self.errors.append((t1, f"{type(e).__name__}: {e}"[:200]))
            self._pin_sample(c)
            nxt = max(nxt + period, time.monotonic())
            time.sleep(max(0.0, nxt - time.monotonic()))

    def _ar(self, c) -> None:
        from client_sdk import EndOfStream, InferenceError

        frame = np.zeros((64, 64, 3), np.uint8)
        period = 1 / 60
        with c.stream(SERVICE, latest_wins=True, max_in_flight=2, timeout=float(os.environ.get("AR_TIMEOUT_S", "1.0"))) as s:
            nxt = time.monotonic()
            while not self.stop.is_set():
                s.send({"x": frame})
                nxt += period
                while True:
                    left = nxt - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        with s.recv(timeout=left):
                            pass
                        t = time.monotonic()
                        self.done.append((t, t, True))
                    except EndOfStream:  # (an InferenceError: first)
                        time.sleep(max(0.0, nxt - time.monotonic()))
                        break
                    except InferenceError as e:  # the frame's own (DeadlineExceeded is a TimeoutError too)
                        t = time.monotonic()
                        self.done.append((t, t, False))
                        self.errors.append((t, f"{type(e).__name__}: {e}"[:200]))
                    except TimeoutError:
                        break
                self._pin_sample(c)
                nxt = max(nxt, time.monotonic())


_SLOW_CALL = """
import sys, numpy as np
from client_sdk import Client
with Client(sys.argv[1], timeout=10.0) as c:
    c.infer("tick", {"slow": np.zeros(1, np.float32)}).release()
"""


def _gap(done: list, t_from: float, t_to: float, started_in: bool = False) -> float:
    """The longest wait for a good result within [t_from, t_to]: between two consecutive
    good results (or t_from and the first one), and the slowest good call that ended in it
    (`started_in`: only those that also started in it)."""
    ok = sorted(t1 for _, t1, good in done if good and t1 >= t_from)
    marks = [t_from] + [t for t in ok if t <= t_to]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    lat = [t1 - t0 for t0, t1, good in done if good and t_from <= t1 <= t_to and (not started_in or t0 >= t_from)]
    return max(gaps + lat + [0.0])


def summarize(p: Persona, t_event: float, t_end: float) -> dict:
    before = _gap(p.done, t_event - 1.0, t_event, started_in=True)
    after = _gap(p.done, t_event, t_end)
    failed = sum(1 for _, t1, good in p.done if not good and t_event <= t1 <= t_end)
    repin = None
    if p.kind != "slo":
        # pinned again: the first sample pinned after the first unpinned one since the event
        # (or since the start, for a client not pinned at the event); 0: never unpinned
        at_event = [v for t, v in p.pin_seen if t < t_event][-1:] or [False]
        unpinned = [t for t, v in p.pin_seen if not v and t >= t_event - 0.05]
        if not at_event[0]:
            unpinned = [t_event]
        again = [t for t, v in p.pin_seen if v and unpinned and t > unpinned[0]]
        if again and again[0] <= t_end:
            repin = again[0] - t_event
        elif not unpinned:
            repin = 0.0
        else:
            repin = float("inf")  # still brokered at the end
    errs = sorted({e for t, e in p.errors if t >= t_event})[:3]
    return {"gap_ms": after * 1e3, "steady_ms": before * 1e3, "failed": failed, "repin_s": repin, "errors": errs}


def _wait_traffic(personas: list[Persona], n: int = 20, pinned: bool = True, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(sum(1 for d in p.done if d[2]) >= n and (not pinned or p.kind == "slo" or
                                                        (p.pin_seen and p.pin_seen[-1][1]))
               for p in personas):
            return
        if any(p.exc for p in personas):
            raise RuntimeError(f"persona failed: {[p.exc for p in personas if p.exc]}")
        time.sleep(0.05)
    raise TimeoutError("personas did not reach steady traffic: "
                       + ", ".join(f"{p.kind}: {len(p.done)} done, pinned {p.pin_seen[-1:]}" for p in personas))


def one_round(event: str, kinds: tuple[str, ...], hb: float, after_s: float) -> dict:
    st = Stack(hb)
    stop = threading.Event()
    personas: list[Persona] = []
    try:
        if event == "launcher":
            st.start_launcher()
        else:
            st.start_broker()
            if event != "order":
                st.start_worker()
        if event == "slow":
            st.start_worker()
        personas = [Persona(k, st.fe, stop) for k in kinds]
        for p in personas:
            p.start()
        info: dict = {}
        if event == "order":
            time.sleep(1.0)  # the personas call a service that has no worker yet
            w = st.start_worker(wait=False)
            wait_ready(w, 60)
            t_event = time.monotonic()
        else:
            _wait_traffic(personas)
            time.sleep(1.0)
            if event in ("rolling", "kill"):
                st.start_worker()
                t_event = time.monotonic()
                old = st.workers[0]
                old.send_signal(signal.SIGTERM if event == "rolling" else signal.SIGKILL)
            elif event == "broker":
                t_event = time.monotonic()
                st.broker.kill()
                st.broker.wait(10)
                st.broker.stdout.close()
                st.start_broker()
                info["broker_back_s"] = time.monotonic() - t_event
            elif event == "launcher":
                pids = st.launcher_workers()
                t_event = time.monotonic()
                os.kill(pids[0], signal.SIGKILL)
            elif event == "scale":
                t_event = time.monotonic()
                st.start_worker()
                info["worker_ready_s"] = time.monotonic() - t_event
            elif event == "slow":
                # From another process: a brokered request of a leaseholder's own process
                # counts as its own at the worker (gpu_worker.worker._waits_behind_another)
                t_event = time.monotonic()
                subprocess.run([sys.executable, "-c", _SLOW_CALL, st.fe], check=True, timeout=30)
                info["slow_s"] = time.monotonic() - t_event
        time.sleep(after_s)
        t_end = time.monotonic()
        stop.set()
        for p in personas:
            p.join(15)
        res = {"event": event, "dir": str(st.dir), **info}
        for p in personas:
            res[p.kind] = summarize(p, t_event, t_end)
            if p.exc:
                res[p.kind]["exc"] = repr(p.exc)
        return res
    finally:
        stop.set()
        for p in personas:
            p.join(15)
        st.close()


def _strict(x):
    """``x`` as strict JSON holds it: a re-pin that never came (``inf``) is null there."""
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_strict(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stalls", description=__doc__.splitlines()[0])
    ap.add_argument("--events", default="all", help=f"comma-separated, of {', '.join(EVENTS)} (default all)")
    ap.add_argument("--personas", default="ar,game,slo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--after-s", type=float, default=4.0, help="traffic measured after each event")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    events = EVENTS if a.events == "all" else tuple(a.events.split(","))
    kinds = tuple(a.personas.split(","))
    os.environ.setdefault("PYTHONPATH", "")
    out: dict = {"heartbeat_interval_s": a.heartbeat_interval, "rounds": {}, "median": {}}
    for ev in events:
        rounds = []
        for i in range(a.rounds):
            r = one_round(ev, kinds, a.heartbeat_interval, a.after_s)
            rounds.append(r)
            print(json.dumps(_strict(r)), flush=True)
        out["rounds"][ev] = rounds
        med = {}
        for k in kinds:
            med[k] = {m: statistics.median(r[k][m] for r in rounds) for m in ("gap_ms", "steady_ms", "failed")}
            rp = [r[k]["repin_s"] for r in rounds if r[k]["repin_s"] is not None]
            med[k]["repin_s"] = statistics.median(rp) if rp else None
        out["median"][ev] = med
        print(f"{ev:9s} " + "  ".join(
            f"{k}: gap {m['gap_ms']:.0f} ms (steady {m['steady_ms']:.0f}) failed {m['failed']:g}"
            + ("" if m["repin_s"] is None else f" repin {m['repin_s']:.2f} s") for k, m in med.items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(_strict(out), indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
