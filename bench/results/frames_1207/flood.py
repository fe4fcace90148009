"""The "Messages of many frames" run (BENCHMARKS.md): against a broker and an `echo` worker
already started on ipc:///tmp/hf/{fe,be}.ipc (`python -m broker --frontend ipc:///tmp/hf/fe.ipc
--backend ipc:///tmp/hf/be.ipc`, `python -m gpu_worker --broker ipc:///tmp/hf/be.ipc --model
echo`), an honest client calls every 10 ms while a DEALER sends ten messages of 500,000 empty
frames; prints the broker's VmHWM and VmRSS (kB) before and after and the honest client's
latencies.  The loop stalls are the broker's own "did not run for" lines on its stderr."""
import subprocess
import threading
import time

import numpy as np
import zmq

from client_sdk import Client

pid = int(subprocess.check_output(["pgrep", "-f", "-n", "python -m broker --frontend ipc:///tmp/hf"]).split()[0])


def mem():
    return [line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith(("VmRSS", "VmHWM"))]


lat, stop = [], False


def honest():
    with Client("ipc:///tmp/hf/fe.ipc", timeout=10) as c:
        while not stop:
            t = time.perf_counter()
            with c.infer("echo", {"x": np.zeros(16, np.uint8)}):
                pass
            lat.append(time.perf_counter() - t)
            time.sleep(0.01)


th = threading.Thread(target=honest)
th.start()
time.sleep(1)
print("before VmHWM, VmRSS", mem())
ctx = zmq.Context()
h = ctx.socket(zmq.DEALER)
h.connect("ipc:///tmp/hf/fe.ipc")
for _ in range(10):
    h.send_multipart([b"MDPC02", b"\x01", b"nosuch"] + [b""] * 500000)
time.sleep(12)
print("after VmHWM, VmRSS", mem())
stop = True
th.join()
lat.sort()
print("honest n", len(lat), "p50 %.1f ms p99 %.1f max %.1f" % (lat[len(lat) // 2] * 1e3,
                                                                 lat[int(len(lat) * .99)] * 1e3, lat[-1] * 1e3))
h.close(0)
ctx.term()
