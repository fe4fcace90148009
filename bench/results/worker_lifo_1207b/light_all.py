import sys, time, json, numpy as np
from client_sdk import Client
# The light client of overload_1206b/pair/run_pair.sh (LIGHT_PY=this): 60 calls at 5/s, 100 ms
# timeouts; prints one JSON line per call: its latency and the reply's timing split (ms)
ep = sys.argv[1]
with Client(ep, timeout=0.1) as c:
    x = np.zeros(16, np.uint8)
    t_next = time.monotonic() + 1.0
    for i in range(60):
        while time.monotonic() < t_next: time.sleep(0.001)
        t0 = time.monotonic()
        try:
            r = c.infer("fixed", {"x": x})
            print(json.dumps({"ms": (time.monotonic() - t0) * 1000, **dict(r.timing)}), flush=True)
        except Exception as e:
            print(json.dumps({"ms": None, "error": str(e)}), flush=True)
        t_next += 0.2
