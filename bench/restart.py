"""Recovery times: how long a service is gone when its broker is SIGKILLed and started again,
and how long a request in flight at that moment takes to complete (the client resends it).

    python -m bench.restart [--rounds 5] [--heartbeat-interval 1.0] [--json PATH]

Each round: a broker and one `echo` worker on ipc endpoints in a temp dir, a sync `Client`
with a request held in flight by a gate (the worker's model is `gpu_worker` echo behind a
short compute, so the request is at the worker when the broker dies), SIGKILL of the broker,
a new broker on the same endpoints at once.  Reported per round and as medians:

  service_back_s   restart -> the broker knows a worker again (MMI answers 200): the worker
                   notices on its next heartbeat (DISCONNECT from the new broker) and
                   re-registers, so about one worker heartbeat interval at most
  request_done_s   restart -> the request in flight at the kill has its result (resent by
                   the client once a heartbeat answer names the new broker)
  failover_s       a second measurement: SIGKILL of a local worker that holds a request ->
                   the request's result from the other worker (the broker presumes the dead
                   worker gone when its connection closes, not after heartbeat_liveness)
  reset_s          a third: the client reaches a tcp broker through `bench.relay`, which
                   resets its connection while a request runs at the worker -> the
                   request's result (the broker's FINAL for it had nowhere to go; the client
                   heartbeats at its new connection's handshake, resends the request when
                   the answer names the new connection, and it runs again after the first
                   run: about the rest of that run plus 0.3 s)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from bench.peers import start_ready as _start
from bench.peers import stop_process as _stop


def one_round(hb: float) -> dict:
    from client_sdk import Client

    d = tempfile.mkdtemp(prefix="zinf-restart-")
    fe, be = f"ipc://{d}/fe.ipc", f"ipc://{d}/be.ipc"
    broker_args = ["-m", "broker", "--frontend", fe, "--backend", be, "--heartbeat-interval", str(hb)]
    procs = [_start(broker_args)]
    procs.append(_start(["-m", "gpu_worker", "--broker", be, "--model", "bench.restart:slow_echo",
                         "--heartbeat-interval", str(hb), "--no-warmup"]))
    try:
        with Client(fe, timeout=60, heartbeat_interval=hb) as c:
            while not c.mmi_service("slow_echo"):
                time.sleep(0.01)
            x = np.arange(16, dtype=np.int32)
            got: dict = {}

            def call() -> None:
                with Client(fe, timeout=60, heartbeat_interval=hb) as c2:
                    with c2.infer("slow_echo", {"x": x}) as r:
                        got["ok"] = bool(np.array_equal(r["x"], x))
                        got["t"] = time.monotonic()

            t = threading.Thread(target=call)
            t.start()
            time.sleep(0.1)  # the request is at the worker (its compute takes 0.3 s)
            procs[0].kill()
            procs[0].wait(10)
            t0 = time.monotonic()
            procs[0] = _start(broker_args)
            while not c.mmi_service("slow_echo", timeout=10):
                time.sleep(0.005)
            back = time.monotonic() - t0
            t.join(60)
            return {"service_back_s": back, "request_done_s": got.get("t", float("nan")) - t0,
                    "request_ok": got.get("ok", False)}
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(d, ignore_errors=True)  # (3 left a round before: the bench audit)


def failover_round(hb: float) -> float:
    from client_sdk import Client

    d = tempfile.mkdtemp(prefix="zinf-failover-")
    fe, be = f"ipc://{d}/fe.ipc", f"ipc://{d}/be.ipc"
    worker = ["-m", "gpu_worker", "--broker", be, "--model", "bench.restart:slow_echo",
              "--heartbeat-interval", str(hb), "--no-warmup"]
    procs = [_start(["-m", "broker", "--frontend", fe, "--backend", be, "--heartbeat-interval", str(hb)])]
    procs.append(_start(worker, env={"SLOW_ECHO_S": "60"}))  # holds what it gets
    try:
        with Client(fe, timeout=60, heartbeat_interval=hb) as c:
            while not c.mmi_service("slow_echo"):
                time.sleep(0.01)
            got: dict = {}

            def call() -> None:
                with Client(fe, timeout=60, heartbeat_interval=hb) as c2:
                    c2.infer("slow_echo", {"x": np.arange(4)}).release()
                    got["t"] = time.monotonic()

            t = threading.Thread(target=call)
            t.start()
            procs.append(_start(worker, env={"SLOW_ECHO_S": "0"}))  # the request is at the first one by now
            t0 = time.monotonic()
            procs[1].kill()
            t.join(60)
            return got.get("t", float("nan")) - t0
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(d, ignore_errors=True)  # (3 left a round before: the bench audit)


def reset_round(hb: float) -> float:
    from bench.peers import free_port
    from bench.relay import Relay
    from client_sdk import Client

    d = tempfile.mkdtemp(prefix="zinf-reset-")
    port, be = free_port(), f"ipc://{d}/be.ipc"
    procs = [_start(["-m", "broker", "--frontend", f"tcp://127.0.0.1:{port}", "--backend", be, "--insecure",
                     "--heartbeat-interval", str(hb)])]
    procs.append(_start(["-m", "gpu_worker", "--broker", be, "--model", "bench.restart:slow_echo",
                         "--heartbeat-interval", str(hb), "--no-warmup"]))
    relay = Relay(port)
    try:
        with Client(f"tcp://127.0.0.1:{relay.port}", insecure=True, timeout=60, heartbeat_interval=hb) as c:
            while not c.mmi_service("slow_echo"):
                time.sleep(0.01)
            x = np.arange(16, dtype=np.int32)
            handle = c.infer_stream("slow_echo", {"x": x})
            time.sleep(0.1)  # the request is at the worker (its compute takes 0.3 s)
            relay.cut()
            t0 = time.monotonic()
            with handle.result(timeout=60) as r:
                done = time.monotonic() - t0
                if not np.array_equal(r["x"], x) or c.broker_reconnects != 1:
                    return float("nan")
            return done
    finally:
        relay.close()
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(d, ignore_errors=True)


def slow_echo(device: str = "cpu"):
    """The worker's model here: echo after $SLOW_ECHO_S (default 0.3) seconds of "compute"."""
    delay = float(os.environ.get("SLOW_ECHO_S", "0.3"))

    def run(inputs):
        time.sleep(delay)
        return {k: np.array(v) for k, v in inputs.items()}

    run.name = "slow_echo"
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rounds = [one_round(a.heartbeat_interval) for _ in range(a.rounds)]
    failovers = [failover_round(a.heartbeat_interval) for _ in range(a.rounds)]
    resets = [reset_round(a.heartbeat_interval) for _ in range(a.rounds)]
    res = {
        "failover_s": failovers,
        "failover_s_median": statistics.median(failovers),
        "reset_s": resets,
        "reset_s_median": statistics.median(resets),
        "heartbeat_interval_s": a.heartbeat_interval,
        "rounds": rounds,
        "service_back_s_median": statistics.median(r["service_back_s"] for r in rounds),
        "request_done_s_median": statistics.median(r["request_done_s"] for r in rounds),
        "all_requests_ok": all(r["request_ok"] for r in rounds) and all(t == t for t in resets),  # NaN: wrong
    }
    for r in rounds:
        print(f"service back {r['service_back_s']:.3f} s   request done {r['request_done_s']:.3f} s   "
              f"ok={r['request_ok']}")
    print(f"median: service back {res['service_back_s_median']:.3f} s, "
          f"request done {res['request_done_s_median']:.3f} s, worker fail-over {res['failover_s_median']:.3f} s, "
          f"connection reset -> result {res['reset_s_median']:.3f} s "
          f"(heartbeat interval {a.heartbeat_interval} s; liveness {3 * a.heartbeat_interval:g} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["all_requests_ok"] else 1


if __name__ == "__main__":
    from bench.peers import sigterm_exits

    sigterm_exits()
    sys.exit(main())
