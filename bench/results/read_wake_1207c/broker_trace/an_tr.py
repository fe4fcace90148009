# an_tr.py DIR NAME: the logs of overload_1206b/pair/run_pair.sh run with BROKER_ARGS="--log-level info --log-format json", "--log-level info --log-format json" in WORKER_ARGS and KEEP_LOGS=DIR (gunzip the .err.gz here first): per light call, the flood dispatches and the worker frees while it waited at the broker
import json, datetime, sys, numpy as np
def ts(s): return datetime.datetime.fromisoformat(s.replace("Z","+00:00")).timestamp()
d=sys.argv[1]; name=sys.argv[2]
L=[json.loads(l) for l in open(f"{d}/{name}_light.txt") if l.startswith("{")]
light_pid=L[0]["pid"]
B=[json.loads(l) for l in open(f"{d}/broker.err") if l.startswith("{")]
W=[json.loads(l) for l in open(f"{d}/worker.err") if l.startswith("{")]
disp=[(ts(x["ts"]), x["rid"], x["queue_ms"]) for x in B if x["msg"]=="request dispatched"]
frees=sorted(ts(x["ts"]) for x in W if x["msg"].startswith("request done") or x["msg"].startswith("request failed"))
fails=sorted(ts(x["ts"]) for x in W if x["msg"].startswith("request failed"))
lp=f"{light_pid}:"
res=[]
for t,rid,q in disp:
    if not rid.startswith(lp): continue
    arr=t-q/1000
    fb=sum(1 for x in disp if arr < x[0] < t and not x[1].startswith(lp))
    fr=sum(1 for f in frees if arr < f < t)
    res.append((q, fb, fr))
q=np.array([r[0] for r in res])
print(name, "light queue p50 %.1f p95 %.1f"%(np.median(q), np.percentile(q,95)), "| flood dispatched while light waited: calls %d, total %d"%(sum(1 for r in res if r[1]), sum(r[1] for r in res)),
      "| worker frees while light waited (mean) %.2f"%np.mean([r[2] for r in res]), "| worker set-asides %d, done %d"%(len(fails), len(frees)-len(fails)))
# burstiness: gaps between consecutive frees
g=np.diff(frees)*1000
print("   free gaps: share < 1 ms %.2f"%np.mean(g<1.0))
