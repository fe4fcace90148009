"""A connection that outlives the process that made it, run as pid 1 of a new pid namespace
(``unshare --pid --fork --mount-proc python stale_pid.py DIR``: there the next pid can be
chosen, so a pid is reused at once instead of after a wrap-around).

Process A connects a plain unix socket to the broker's frontend and forks B, which speaks
ZMTP over it through a byte relay (a DEALER of its own connects to the relay).  The broker
learns the connection's pid, A's, from SO_PEERCRED.  Two cases, each a line on stdout:

- ``late``: A exits before B sends anything: the broker learns the connection only then.
- ``reused``: B sends one request while A lives (the broker learns A), then A exits and
  its pid goes to a victim V that puts a secret in shared memory; B asks the echo worker
  for V's segment.

Each line says what B got: ``refused <code> <message>`` or ``read <hex>``.

- ``sdk``: A exits before B, which uses our `Client` over the connection, sends a tensor
  large enough to go by shared memory: the line says what the call returned.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.children import readline_within  # noqa: E402  (after the path)

WAIT = 20.0


def _wait(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def _relay(raw: socket.socket, path: str) -> None:
    """Bytes between a listener at ``path`` (one connection) and ``raw``, both ways."""
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)

    def pump():
        c, _ = lst.accept()
        while True:
            r, _, _ = select.select([c, raw], [], [], WAIT)
            if not r:
                return
            for s in r:
                data = s.recv(1 << 20)
                if not data:
                    return
                (raw if s is c else c).sendall(data)

    threading.Thread(target=pump, daemon=True).start()


def _b(raw: socket.socket, d: str, case: str, go_r: int, ref_path: str, out_path: str) -> None:
    """Process B: a DEALER through the relay; answers go to ``out_path``."""
    import zmq

    from broker import protocol as P

    relay = f"{d}/relay-{case}.sock"
    _relay(raw, relay)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(f"ipc://{relay}")

    def call(header, *frames) -> str:
        s.send_multipart(P.client_request("echo", [P.encode_header(header), *frames]))
        if not s.poll(int(WAIT * 1000)):
            return "no reply"
        msg = s.recv_multipart()
        rep = P.decode_reply(msg[3], n_inline=len(msg) - 4)
        if rep.error is not None:
            return f"refused {rep.error.code} {rep.error.message}"
        return "read " + bytes(msg[4])[:8].hex()

    if case == "reused":
        # While A lives: the broker learns the connection (an inline request).
        t = P.TensorRef(name="x", dtype="|u1", shape=[1], loc=P.InlineLoc(0))
        first = call(P.Request(id=1, host=P.local_host_id(), reply="inline", tensors=[t]), b"\x01")
        assert first.startswith("read"), first
        os.write(go_r, b"1")  # A may exit now
    _wait(lambda: os.path.exists(ref_path), "no victim")
    import shm

    ref = shm.ShmRef(*[int(v) if i else v for i, v in enumerate(open(ref_path).read().split())])
    t = P.TensorRef(name="x", dtype="|u1", shape=[ref.nbytes], loc=P.shm_loc(ref))
    got = call(P.Request(id=2, host=P.local_host_id(), reply="inline", tensors=[t]))
    with open(out_path + ".tmp", "w") as f:
        f.write(got)
    os.rename(out_path + ".tmp", out_path)


def _victim(ref_path: str, done_path: str) -> None:
    import numpy as np

    from shm import ShmPool

    pool = ShmPool(1 << 20, slots=8)
    secret = pool.alloc(4096, np.uint8)
    secret[:] = 0x5A
    ref = pool.ref_of(secret)
    pool.mark_in_flight(ref)
    with open(ref_path + ".tmp", "w") as f:
        f.write(" ".join(map(str, ref)))
    os.rename(ref_path + ".tmp", ref_path)
    _wait(lambda: os.path.exists(done_path), "B never answered")
    pool.close()


def _a_then_b(d: str, b, go_r: int | None = None) -> int:
    """Fork A, which connects a plain unix socket to the broker's frontend, forks B to run
    ``b(raw)`` over it, and exits (once B writes to ``go_r``, when given).  A's pid."""
    a = os.fork()
    if a == 0:  # A
        try:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.connect(f"{d}/fe.ipc")
            if os.fork() == 0:  # B
                try:
                    b(raw)
                finally:
                    os._exit(0)
            if go_r is not None:
                select.select([go_r], [], [], WAIT)
        finally:
            os._exit(0)
    return a


def _sdk_b(raw: socket.socket, d: str, out_path: str) -> None:
    """B of the ``sdk`` case: our `Client` on a connection whose maker (A) has exited."""
    import numpy as np

    from client_sdk import Client

    relay = f"{d}/relay-sdk.sock"
    _relay(raw, relay)
    _wait(lambda: os.getppid() == 1, "A never exited")  # B is pid 1's now
    x = np.arange(1 << 14, dtype=np.float32)  # 64 KiB: shared memory
    with Client(f"ipc://{relay}", timeout=WAIT) as c:
        try:
            y = c.infer("echo", {"x": x})["x"]
            got = "same" if np.array_equal(x, y) else "wrong"
        except Exception as e:
            got = f"{type(e).__name__} {e}"
    with open(out_path + ".tmp", "w") as f:
        f.write(got)
    os.rename(out_path + ".tmp", out_path)


def _sdk(d: str) -> str:
    out_path = f"{d}/sdk.out"
    os.waitpid(_a_then_b(d, lambda raw: _sdk_b(raw, d, out_path)), 0)
    _wait(lambda: os.path.exists(out_path), "B never answered")
    return open(out_path).read()


def _case(d: str, case: str) -> str:
    ref_path, out_path = f"{d}/{case}.ref", f"{d}/{case}.out"
    go_r, go_w = os.pipe()  # B -> A: the broker has learned the connection
    a = _a_then_b(d, lambda raw: _b(raw, d, case, go_w, ref_path, out_path), go_r if case == "reused" else None)
    os.waitpid(a, 0)  # A is gone, and reaped: its pid is free
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(a - 1))  # the next process gets A's pid
    v = os.fork()
    if v == 0:
        try:
            _victim(ref_path, out_path)
        finally:
            os._exit(0)
    assert v == a, (v, a)
    _wait(lambda: os.path.exists(out_path), "B never answered")
    os.waitpid(v, 0)
    return open(out_path).read()


def main() -> None:
    d = sys.argv[1]
    env = {**os.environ, "PYTHONPATH": ROOT, "XDG_RUNTIME_DIR": d}
    procs = [subprocess.Popen([sys.executable, "-m", "broker", "--frontend", f"ipc://{d}/fe.ipc",
                               "--backend", f"ipc://{d}/be.ipc"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait(lambda: os.path.exists(f"{d}/be.ipc"), "no broker")
        procs.append(subprocess.Popen([sys.executable, "-m", "gpu_worker", "--broker", f"ipc://{d}/be.ipc",
                                       "--model", "echo", "--no-warmup"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
        assert readline_within(procs[1].stdout, WAIT, "the worker's READY").startswith(b"READY"), "no worker"
        for case in ("late", "reused"):
            print(case, _case(d, case), flush=True)
        print("sdk", _sdk(d), flush=True)
    finally:
        for p in procs[::-1]:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        # pid 1 of the namespace: whatever is left (B) dies with it


if __name__ == "__main__":
    main()
