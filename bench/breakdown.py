"""Where a tiny request's time goes: the same 16-byte round trip, one piece swapped at a time.

Every configuration uses a blocking pyzmq DEALER client (no asyncio) so the differences
between rows are the pieces themselves:

  direct        client -> echo                                   (no broker)
  proxy         client -> zmq.proxy (C) -> echo                  (the floor any broker is held to)
  broker/raw    client -> our broker -> minimal MDP worker       opaque body, then with a header
  broker/ours   client -> our broker -> gpu_worker --model echo  opaque body, then with a header
  proxy/sdk     client_sdk.Client -> zmq.proxy (C) -> gpu_worker (the brokered floor, shm)
  sdk           client_sdk.Client -> our broker -> gpu_worker    (the full product path, shm),
                with replies relayed by the broker, then sent straight back (direct reply)

Rows are interleaved round-robin over `--rounds` rounds and the median of the per-round
medians is reported, so drift on a shared machine hits every row alike.

    python -m bench.breakdown [--rounds 5] [--n 2000] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from bench.peers import wait_ready
from broker import protocol as P

# A worker written from RFC 18 alone: READY, then echo every REQUEST body as a FINAL and
# answer heartbeats.
_RAW_WORKER = r"""
import sys, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send_multipart([b"MDPW02", b"\x01", b"echo"])
print("READY", flush=True)
while True:
    f = s.recv_multipart(copy=False)
    cmd = f[1].bytes
    if cmd == b"\x02":
        s.send_multipart([b"MDPW02", b"\x04", f[2], b"", *f[4:]], copy=False)
    elif cmd == b"\x05":  # heartbeat: answer, or the broker presumes us dead between rows
        s.send_multipart([b"MDPW02", b"\x05"])
    elif cmd == b"\x06":  # told to reconnect
        s.send_multipart([b"MDPW02", b"\x01", b"echo"])
"""


def _spawn(args, procs):
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    procs.append(p)
    wait_ready(p, 120)
    return p


def _median_us(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.breakdown", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000, help="requests per row per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="zinf-breakdown-")
    ep = {k: f"ipc://{tmp}/{k}.ipc" for k in ("direct", "pfront", "pback", "fe1", "be1", "fe2", "be2",
                                          "sfront", "sback")}
    procs: list[subprocess.Popen] = []
    ctx = zmq.Context.instance()
    socks: list[zmq.Socket] = []
    try:
        _spawn(["-m", "bench.echo_servers", "zmq-echo", "--bind", ep["direct"]], procs)
        _spawn(["-m", "bench.echo_servers", "proxy", "--front", ep["pfront"], "--back", ep["pback"]], procs)
        _spawn(["-m", "bench.echo_servers", "zmq-echo", "--connect", ep["pback"]], procs)
        _spawn(["-m", "broker", "--frontend", ep["fe1"], "--backend", ep["be1"]], procs)
        _spawn(["-c", _RAW_WORKER, ep["be1"]], procs)
        _spawn(["-m", "broker", "--frontend", ep["fe2"], "--backend", ep["be2"]], procs)
        _spawn(["-m", "gpu_worker", "--broker", ep["be2"], "--model", "echo", "--max-batch", "1"], procs)
        _spawn(["-m", "bench.echo_servers", "proxy", "--front", ep["sfront"], "--back", ep["sback"]], procs)
        _spawn(["-m", "bench.proxied_worker", "--connect", ep["sback"], "--model", "echo", "--max-batch", "1"], procs)

        from client_sdk import Client

        sdk = Client(ep["fe2"], timeout=30)
        relayed = Client(ep["fe2"], timeout=30, direct_reply=False)
        while not sdk.mmi_service("echo"):
            time.sleep(0.01)
        with Client(ep["fe1"], timeout=30) as probe:
            while not probe.mmi_service("echo"):
                time.sleep(0.01)
        psdk = Client(ep["sfront"], timeout=30)
        psdk.mmi_service("echo")  # one round trip through the relay: the path is up

        def dealer(e):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(e)
            socks.append(s)
            return s

        payload = b"x" * 16
        hdr = P.encode_header(P.Request(id=1, tensors=[P.TensorRef(name="x", dtype="|u1", shape=[16],
                                                                 loc=P.InlineLoc(frame=0))]))
        sd, sp, s1, s2 = dealer(ep["direct"]), dealer(ep["pfront"]), dealer(ep["fe1"]), dealer(ep["fe2"])
        x = sdk.alloc((16,), np.uint8)
        rx = relayed.alloc((16,), np.uint8)
        px = psdk.alloc((16,), np.uint8)

        def rt(sock, frames):
            def go():
                sock.send_multipart(frames)
                sock.recv_multipart()
            return go

        def sdk_call():
            sdk.infer("echo", {"x": x}).release()

        def relayed_call():
            relayed.infer("echo", {"x": rx}).release()

        def proxy_sdk_call():
            psdk.infer("echo", {"x": px}).release()

        rows = {
            "direct": rt(sd, [payload]),
            "proxy": rt(sp, [payload]),
            "broker/raw opaque": rt(s1, [P.MDPC, P.C_REQUEST, b"echo", payload]),
            "broker/raw header": rt(s1, [P.MDPC, P.C_REQUEST, b"echo", hdr, payload]),
            "broker/ours opaque": rt(s2, [P.MDPC, P.C_REQUEST, b"echo", payload]),
            "broker/ours header": rt(s2, [P.MDPC, P.C_REQUEST, b"echo", hdr, payload]),
            "proxy → gpu_worker echo (SDK client)": proxy_sdk_call,
            "sdk shm, replies relayed by the broker": relayed_call,
            "sdk shm (direct reply)": sdk_call,
        }
        for fn in rows.values():  # warm every path
            _median_us(fn, 200)
        per_round = {k: [] for k in rows}
        for _ in range(args.rounds):
            for k, fn in rows.items():
                per_round[k].append(_median_us(fn, args.n))
        res = {k: statistics.median(v) for k, v in per_round.items()}
        sdk.close()
        relayed.close()
        psdk.close()
    finally:
        for s in socks:
            s.close(0)
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        for f in os.listdir(tmp):
            try:
                os.unlink(os.path.join(tmp, f))
            except OSError:
                pass
        os.rmdir(tmp)

    floor = res["proxy"]
    w = max(len(k) for k in res)
    print(f"{'path':{w}s} {'p50 us':>8s} {'x proxy':>8s}")
    for k, v in res.items():
        print(f"{k:{w}s} {v:8.1f} {v / floor:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m bench.breakdown " + " ".join(argv or sys.argv[1:]),
                       "p50_us": res, "per_round_us": per_round}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
