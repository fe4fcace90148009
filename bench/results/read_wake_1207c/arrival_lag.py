# arrival_lag.py LIGHT.txt WTRACE.jsonl [LABEL]: per light call (worker_lifo_1207/light.py with LIGHT_EVERY=1), the
# worker's arrival stamp (read_tick/worker_rt.py's trace) less the client's send and the broker's queue, ms
import json, sys, numpy as np
light, w = sys.argv[1], sys.argv[2]
L = {}
for line in open(light):
    try: d = json.loads(line)
    except Exception: continue
    if d.get("ms") is None: continue
    L[(d["pid"], d["id"])] = d
lag = []; lat = []
for line in open(w):
    r = json.loads(line)
    if r[0] != "arr": continue
    d = L.get((r[1], r[2]))
    if d is None: continue
    lag.append((r[3] - d["t0"]) * 1000 - r[5]); lat.append(d["ms"])
lag = np.array(lag); lat = np.array(lat)
print(f"{sys.argv[3] if len(sys.argv)>3 else ''} n={len(lag)} send->arrival-queue p50 {np.median(lag):.2f} p95 {np.percentile(lag,95):.2f} | light latency p50 {np.median(lat):.1f} p95 {np.percentile(lat,95):.1f}")
