import os, sys, time, json, numpy as np
from client_sdk import Client
# The light client of overload_1206b/pair/run_pair.sh (LIGHT_PY=this): 60 calls at 5/s, 100 ms
# timeouts; prints the six slowest with each reply's timing split, or with LIGHT_EVERY=1 one
# JSON line per call (its pid and request id, its send and receipt times on CLOCK_MONOTONIC,
# its latency and the reply's timing split, ms)
ep = sys.argv[1]; out = []; every = os.environ.get("LIGHT_EVERY") == "1"
with Client(ep, timeout=0.1) as c:
    x = np.zeros(16, np.uint8)
    t_next = time.monotonic() + 1.0
    for i in range(60):
        while time.monotonic() < t_next: time.sleep(0.001)
        t0 = time.monotonic()
        try:
            r = c.infer("fixed", {"x": x})
            t1 = time.monotonic()
            out.append(((t1 - t0) * 1000, dict(r.timing)))
            if every:
                print(json.dumps({"pid": os.getpid(), "id": r.id, "t0": t0, "t1": t1, "ms": (t1 - t0) * 1000,
                                  **dict(r.timing)}), flush=True)
        except Exception as e:
            out.append((None, str(e)))
            if every:
                print(json.dumps({"ms": None, "error": str(e)}), flush=True)
        t_next += 0.2
if not every:
    out.sort(key=lambda o: -(o[0] or 1e9))
    for o in out[:6]: print(round(o[0],1) if o[0] else o[0], {k: round(v,1) for k, v in o[1].items()} if isinstance(o[1], dict) else o[1])
