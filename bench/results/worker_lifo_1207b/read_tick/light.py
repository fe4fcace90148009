import sys, time, json, os, numpy as np
from client_sdk import Client
ep = sys.argv[1]
with Client(ep, timeout=0.1) as c:
    x = np.zeros(16, np.uint8)
    t_next = time.monotonic() + 1.0
    for i in range(60):
        while time.monotonic() < t_next: time.sleep(0.001)
        t0 = time.monotonic()
        try:
            r = c.infer("fixed", {"x": x})
            print(json.dumps({"pid": os.getpid(), "id": r.id, "t0": t0, "t1": time.monotonic(), **dict(r.timing)}), flush=True)
        except Exception as e:
            print(json.dumps({"error": str(e)}), flush=True)
        t_next += 0.2
