"""Where a lone small request's time goes inside our worker, measured cold: stage timers.

    python -m bench.worker_stages [--n 3000] [--json PATH]
    python -m bench.worker_stages --client sdk --device cuda:0 --transport cuda --bytes 6220800

The second form is for a GPU machine: our `Client` (its round trip timed too) sends an
`alloc_cuda` tensor to a `--device cuda:0` worker of `bench.gpu_product`'s copying model
and asks for the reply on the device; the stages then include the CUDA plane's input
mapping (IPC handle, event wait) and output hand-off.  `--transport shm` sends an `alloc`
buffer instead (host memory, to a CPU or a GPU worker).

`bench.hotpath` times the worker's Python with its sockets stubbed, in a tight loop: warm
caches, a few microseconds per stage.  In a real closed loop every request arrives after
the worker slept, with its caches and branch predictors taken by the client, the relay and
the kernel, and the same code runs several times slower.  This runs the worker as
`proxy-sdk` does (`bench.proxied_worker`, echo, `--max-batch 1`, behind `zmq.proxy`), driven
by `bench.lean_floor`'s lean client, with `time.perf_counter_ns` taken at the boundaries of
the worker's own methods (wrapped at start: about a microsecond each), and reports the
median of each stage over `--n` requests (the first 200 left out), beside the lean worker's
received-to-sent time measured the same way (`bench.lean_floor worker`): compare it with
ours' "received -> sent" (both from the moment the request's frames were read).  Requests
found by a wait that did not sleep (a zero timeout) are left out of ours.

Stages (wake: the loop's wait returned with the request; sent: the reply's frames handed to
libzmq, the I/O thread woken):

  wake -> drain       the loop's checks before it reads
  drain -> admit      receive, upstream parse, header decode, the Job
  admit -> run        model check, input views, the lone-request check, the batcher
  run -> model        the batch's bookkeeping (compute-time predictions, heartbeat hand-off)
  model               the model (the echo, through the backend)
  model -> reply      compute-time and keep-warm records, timing, outputs, header encode
  reply -> sent       the upstream's framing and the send
  sent -> next wait   the rest of the loop pass, after the reply left (not on the latency
                      path, but on a 2-vCPU machine it takes CPU from the client and relay)
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import time

STAGES = [("wake", "drain0", "wake -> drain"), ("drain0", "admit0", "drain -> admit"), ("admit0", "run0", "admit -> run"),
          ("map0", "map1", "  of which: map inputs"), ("out0", "out1", "  of which: write outputs"),
          ("run0", "model0", "run -> model"), ("model0", "model1", "model"), ("model1", "reply0", "model -> reply"),
          ("reply0", "sent", "reply -> sent"), ("wake", "sent", "wake -> sent"), ("recv", "sent", "received -> sent"), ("sent", "next", "sent -> next wait"),
          ("wake", "next", "wake -> next wait")]
SKIP = 200


def _instrumented_worker(argv: list[str]) -> int:
    """`bench.proxied_worker` with the stage timers; writes the medians to $STAGES_OUT at exit."""
    import broker.protocol.wire as W
    import gpu_worker.worker as GW
    from bench import proxied_worker as PW
    from gpu_worker import planes

    pc = time.perf_counter_ns
    marks: dict[str, int] = {}
    rows: list[dict] = []
    wait = W.Waiter.wait

    def timed_wait(self, ms):
        t = pc()
        if "wake" in marks and "sent" in marks:
            marks["next"] = t
            rows.append(dict(marks))
        marks.clear()
        ready = wait(self, ms)
        if ms != 0 and ready:
            marks["wake"] = pc()
        return ready

    def wrap(cls, name: str, key: str) -> None:
        f = getattr(cls, name)

        def timed(*a, **k):
            if "wake" in marks and key + "0" not in marks:
                marks[key + "0"] = pc()
            try:
                return f(*a, **k)
            finally:
                if "wake" in marks and key + "1" not in marks:
                    marks[key + "1"] = pc()
        setattr(cls, name, timed)

    W.Waiter.wait = timed_wait
    recv = GW.recv_frames

    def timed_recv(sock, *a):
        frames = recv(sock, *a)
        if "wake" in marks and "recv" not in marks:
            marks["recv"] = pc()
        return frames

    GW.recv_frames = timed_recv
    wrap(GW.Worker, "_drain", "drain")
    wrap(GW.Worker, "_admit", "admit")
    wrap(GW.Worker, "_run", "run")
    wrap(GW.Worker, "_reply", "reply")
    wrap(planes.HostPlane, "run", "model")
    wrap(planes.HostPlane, "map_inputs", "map")
    wrap(planes.HostPlane, "write_outputs", "out")
    from gpu_worker import cuda_plane  # imports no torch: the CUDA plane's own methods, for a cuda worker

    wrap(cuda_plane.CudaPlane, "run", "model")
    wrap(cuda_plane.CudaPlane, "map_inputs", "map")
    wrap(cuda_plane.CudaPlane, "write_outputs", "out")
    to_client = PW.ProxyLink._to_client

    def timed_to_client(self, frames):
        out = to_client(self, frames)
        if "wake" in marks and "sent" not in marks:
            marks["sent"] = pc()
        return out

    PW.ProxyLink._to_client = timed_to_client

    def dump() -> None:
        rs = rows[SKIP:]
        res = {"n": len(rs)}
        for a, b, name in STAGES:
            v = [r[b] - r[a] for r in rs if a in r and b in r]
            res[name] = round(statistics.median(v) / 1e3, 1) if v else None
        with open(os.environ["STAGES_OUT"], "w") as f:
            json.dump(res, f)

    atexit.register(dump)
    return PW.main(argv)


def _instrumented_lean(connect: str) -> None:
    """The lean worker with its receive-to-send time taken; medians to $STAGES_OUT on SIGTERM.

    The lean worker blocks in a plain ``recv`` (it has no wake-up pipe, as ours has), and a
    Python signal handler runs only once the main thread's blocking call returns: a SIGTERM
    that came just before the call blocked, or that the kernel gave another thread (numpy's
    BLAS thread), tripped the handler's flag and woke nothing, and the worker slept on until
    `Peer.stop` killed it 5 s later, with no results written (tests/bench/test_worker_stages,
    under load: 11 of 80 SIGTERMs to a loaded 2-core box's lean worker were not acted on for
    10 s).  The C-level handler writes the signal to the wake-up fd on whatever thread it
    ran, so a thread of ours that waits on that fd writes the results and ends the process."""
    import signal
    import threading

    import bench.lean_floor as L

    pc = time.perf_counter_ns
    rows: list[tuple[int, int]] = []
    got: list[int] = [0]
    recv, send = L.recv_frames, L.send_frames

    def timed_recv(sock, *a):
        f = recv(sock, *a)
        got[0] = pc()
        return f

    def timed_send(sock, frames, *a):
        send(sock, frames, *a)
        rows.append((got[0], pc()))

    L.recv_frames, L.send_frames = timed_recv, timed_send

    def dump() -> None:
        rs = rows[SKIP:]  # (a list's slice is taken whole, the main thread running or not)
        tmp = os.environ["STAGES_OUT"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"n": len(rs), "received -> sent": round(statistics.median(b - a for a, b in rs) / 1e3, 1)
                       if rs else None}, f)
        os.replace(tmp, os.environ["STAGES_OUT"])  # whole or not at all

    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # (a Python handler: the wake-up fd is written)

    def on_term() -> None:
        while os.read(r, 1) != bytes([signal.SIGTERM]):  # (SIGINT, say, is the main thread's)
            pass
        try:
            dump()
        finally:
            os._exit(0)

    threading.Thread(target=on_term, name="stages-dump", daemon=True).start()
    L.run_worker(connect)


class _Staged:
    """A `zmq.proxy` and one instrumented worker (``sub``: "serve", ours; "lean")."""

    def __init__(self, sub: str, out: str, worker_args: list[str]):
        from bench.peers import Peer

        class Staged(Peer):
            name = f"worker-stages-{sub}"

            def start(self) -> None:
                self.endpoint = self.ipc("front")
                back = self.ipc("back")
                self.spawn(self.python_module("bench.echo_servers", "proxy", "--front", self.endpoint, "--back", back))
                args = ["--connect", back, *worker_args] if sub == "serve" else [back]
                self.spawn(self.python_module("bench.worker_stages", sub, *args), env=dict(os.environ, STAGES_OUT=out),
                           ready_timeout=180.0)

            def stop(self) -> None:
                procs = list(self._procs)
                super().stop()
                if len(procs) == 2:  # the worker's exit status (-9: killed by stop(), not ended by its SIGTERM)
                    outer.worker_status = procs[1].returncode

        outer = self
        self.worker_status: int | None = None

        self.peer = Staged()


def _sdk_caller(endpoint: str, service: str, transport: str, nbytes: int, device: str):
    """(call, close, stages): our `Client` sending one `nbytes` uint8 tensor of ``transport``
    ("shm": an `alloc` buffer, "cuda": an `alloc_cuda` one, the reply kept on the device).

    ``stages()`` gives the medians (µs) of the client's own stages per call: ``pack`` (the
    inputs into descriptors: for CUDA, the IPC handle and event record), ``unpack`` (the
    reply's descriptors into views: for CUDA, the cached handle and the event wait),
    ``infer`` (the whole `infer` call, both of those and the wait for the reply included),
    ``use`` (reading the output, and for CUDA the stream synchronised) and ``release``
    (the result's views given back)."""
    import numpy as np

    from client_sdk import Client
    from client_sdk import tensors as T

    c = Client(endpoint, timeout=60, pool_capacity=max(256 << 20, 4 * nbytes))
    deadline = time.monotonic() + 120
    while not c.mmi_service(service):
        if time.monotonic() > deadline:
            c.close()
            raise TimeoutError(f"{service!r} did not come up within 120 s")
        time.sleep(0.05)
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {k: [] for k in ("pack", "unpack", "infer", "use", "release")}
    pack0, unpack0 = T.pack, T.unpack

    def timed(name: str, f):
        def call(*a, **kw):
            t = clock()
            try:
                return f(*a, **kw)
            finally:
                times[name].append(clock() - t)
        return call

    T.pack, T.unpack = timed("pack", pack0), timed("unpack", unpack0)
    if transport == "cuda":
        import torch

        x = c.alloc_cuda((nbytes,), torch.uint8, device=device)
        x.fill_(7)
        stream = torch.cuda.current_stream(device)
        kind = "cuda"

        def use(r):
            r["y"]
            stream.synchronize()  # the output is complete on the device
    else:
        x = c.alloc((nbytes,), np.uint8)
        x[:] = 7
        kind = "shm"

        def use(r):
            r["y"]

    def call():
        t0 = clock()
        r = c.infer(service, {"x": x}, reply=kind)
        t1 = clock()
        use(r)
        t2 = clock()
        r.release()
        t3 = clock()
        times["infer"].append(t1 - t0)
        times["use"].append(t2 - t1)
        times["release"].append(t3 - t2)

    def close():
        T.pack, T.unpack = pack0, unpack0
        c.close()

    def stages() -> dict:
        return {k: round(statistics.median(v[SKIP:] or v) / 1000, 1) for k, v in times.items() if v}

    return call, close, stages


def worker_args(client: str, device: str) -> list[str]:
    """The instrumented worker's model options (`bench.proxied_worker`'s, after --connect)."""
    if client == "lean":
        return ["--model", "echo", "--max-batch", "1"]
    return ["--model", "bench.gpu_product:make_copy", "--service", "copy", "--device", device, "--max-batch", "1"]


def measure(n: int, client: str = "lean", device: str = "cpu", transport: str = "shm", nbytes: int = 16) -> dict:
    import shutil
    import tempfile

    from bench.lean_floor import LeanClient, p50_us

    out: dict = {"n": n, "client": client, "device": device, "transport": transport, "bytes": nbytes}
    if client == "lean":
        runs = [("ours", "serve", worker_args(client, device)), ("lean", "lean", [])]
    else:
        runs = [("ours", "serve", worker_args(client, device))]
    tmp = tempfile.mkdtemp(prefix="zstages-")
    try:
        for name, sub, args in runs:
            path = os.path.join(tmp, f"{name}.json")
            staged = _Staged(sub, path, args)
            with staged.peer as peer:  # stop() ends the worker: it writes `path`
                if client == "lean":
                    c = LeanClient(peer.endpoint)
                    call, close, stages = c.call, c.close, None
                else:
                    call, close, stages = _sdk_caller(peer.endpoint, "copy", transport, nbytes, device)
                try:
                    for _ in range(SKIP):
                        call()
                    out["client_p50_us"] = round(p50_us(call, n), 1)
                    if client != "lean":
                        out["client_stages"] = stages()
                finally:
                    close()
            if not os.path.exists(path):
                raise RuntimeError(f"the {name} stage's worker wrote no results (its exit status: "
                                   f"{staged.worker_status}; -9: it did not end on SIGTERM and was killed)")
            with open(path) as f:
                out[name] = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _instrumented_worker(argv[1:])
    if argv and argv[0] == "lean":
        _instrumented_lean(argv[1])
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.worker_stages", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="requests measured (after 200 warm-ups)")
    ap.add_argument("--client", choices=("lean", "sdk"), default="lean",
                    help="lean: the lean client to our echo worker and to the lean worker (the CPU figures); "
                         "sdk: our Client to a worker of gpu_product's copying model")
    ap.add_argument("--device", default="cpu", help="the worker's device (with --client sdk)")
    ap.add_argument("--transport", choices=("shm", "cuda"), default="shm", help="the input's memory (--client sdk)")
    ap.add_argument("--bytes", type=int, default=16, help="the input's size (--client sdk)")
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    if args.n < 1 or args.bytes < 1:
        ap.error("--n and --bytes must be at least 1")
    if args.client == "lean" and (args.device, args.transport, args.bytes) != ("cpu", "shm", 16):
        ap.error("--device, --transport and --bytes go with --client sdk")
    if args.device != "cpu" or args.transport == "cuda":
        from shm.cuda import cuda_status

        ok, why = cuda_status()
        if not ok:
            print(f"worker_stages: skipped, no CUDA device: {why}", file=sys.stderr)
            return 3
    from bench.report import print_and_save

    return print_and_save(measure(args.n, args.client, args.device, args.transport, args.bytes), args.json)


if __name__ == "__main__":
    sys.exit(main())
