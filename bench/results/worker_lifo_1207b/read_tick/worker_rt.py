# WORKER_PY=bench/results/worker_lifo_1207b/read_tick/worker_rt.py WTRACE=FILE [READ_TICK=S] bench/results/overload_1206b/pair/run_pair.sh ...
# (with LIGHT_PY=bench/results/worker_lifo_1207/light.py LIGHT_EVERY=1): a worker that logs each request's arrival
# stamp and reply times; READ_TICK sets gpu_worker.compute.READ_TICK
import os, sys, time, json
from gpu_worker import worker as Wm, compute as Cm
if os.environ.get("READ_TICK"): Cm.READ_TICK = float(os.environ["READ_TICK"])
from broker import protocol as P
LOG = open(os.environ["WTRACE"], "w", buffering=1)
_on_request, _reply_batch = Wm.Worker._on_request, Wm.Worker._reply_batch
def on_request(self, envelope, body, now=None):
    try:
        req = P.decode_request(body[0], len(body) - 1)
        LOG.write(json.dumps(["arr", req.pid, req.id, now, time.monotonic(), req.queue_ms]) + "\n")
    except Exception:
        pass
    return _on_request(self, envelope, body, now)
def reply_batch(self, jobs, outputs, started, compute_ms, n):
    t = time.monotonic()
    r = _reply_batch(self, jobs, outputs, started, compute_ms, n)
    for j in jobs:
        if j.req is not None:
            LOG.write(json.dumps(["rep", j.req.pid, j.req.id, started, t, time.monotonic()]) + "\n")
    return r
Wm.Worker._on_request, Wm.Worker._reply_batch = on_request, reply_batch
from gpu_worker.__main__ import main
sys.exit(main(sys.argv[1:]))
