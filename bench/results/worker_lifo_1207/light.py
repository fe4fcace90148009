import sys, time, json, numpy as np
from client_sdk import Client
ep = sys.argv[1]; out = []  # the light client of overload_1206b/pair/run_pair.sh (LIGHT_PY=this), each reply's timing split
with Client(ep, timeout=0.1) as c:
    x = np.zeros(16, np.uint8)
    t_next = time.monotonic() + 1.0
    for i in range(60):
        while time.monotonic() < t_next: time.sleep(0.001)
        t0 = time.monotonic()
        try:
            r = c.infer("fixed", {"x": x})
            out.append(((time.monotonic() - t0) * 1000, dict(r.timing)))
        except Exception as e:
            out.append((None, str(e)))
        t_next += 0.2
out.sort(key=lambda o: -(o[0] or 1e9))
for o in out[:6]: print(round(o[0],1) if o[0] else o[0], {k: round(v,1) for k, v in o[1].items()} if isinstance(o[1], dict) else o[1])
