import json, sys, glob, collections
OUT = sys.argv[1]
R = json.load(open(f"{OUT}/run.json")); ev = R["events"]; t0 = ev["t0"]; kill = ev["kill"]; rs = ev["restart"]
recs = []
for f in sorted(glob.glob(f"{OUT}/load*.jsonl")):
    for l in open(f):
        i, a, b, k, m = json.loads(l); recs.append((f + str(i), a, b, k, m))
print("calls", len(recs), "kill at", round(kill - t0, 2), "exited", round(ev["exited"] - kill, 3), "rc", ev["exit_rc"], "restart", round(rs - kill, 3))
before = [r for r in recs if r[2] < kill]; after = [r for r in recs if r[1] >= kill or r[2] >= kill]
print("before kill outcomes", collections.Counter(r[3] for r in before))
print("after kill outcomes", collections.Counter(r[3] for r in after))
msgs = collections.Counter((r[3], r[4][:160]) for r in recs if r[3] != "ok")
for (k, m), c in msgs.most_common(12): print(f"  {c:6d} {k}: {m}")
clients = {r[0] for r in recs}
rec_t = {}
for c in clients:
    oks = sorted(r[2] for r in recs if r[0] == c and r[3] == "ok" and r[1] >= rs)
    rec_t[c] = oks[0] - kill if oks else None
stuck = [c for c, v in rec_t.items() if v is None]
vals = sorted(v for v in rec_t.values() if v is not None)
import statistics
if vals:
    print(f"recovery (first ok sent after restart, from kill): n={len(vals)} p50={vals[len(vals)//2]:.2f} p90={vals[int(len(vals)*.9)]:.2f} max={vals[-1]:.2f}")
print("stuck clients (no ok started after restart):", len(stuck))
# failures per client after kill
fails = collections.Counter(r[0] for r in after if r[3] != "ok")
print("clients with >=1 failure after kill:", len(fails), "max fails one client:", max(fails.values()) if fails else 0)
# latency of ok calls, per second bucket after kill
lat = collections.defaultdict(list)
for r in recs:
    if r[3] == "ok": lat[int(r[1] - kill)].append(r[2] - r[1])
print("sec-from-kill: n_ok p50 max latency")
for s in sorted(lat):
    if -3 <= s <= 25:
        L = sorted(lat[s]); print(f"  {s:3d} {len(L):5d} {L[len(L)//2]*1000:8.1f}ms {L[-1]*1000:8.1f}ms")
S = R["samples"]
print("samples t cpu% rss fds est")
prev = None
for s in S:
    if prev and s["cpu"] is not None and prev["cpu"] is not None and s["pid"] == prev["pid"]:
        c = (s["cpu"] - prev["cpu"]) / (s["t"] - prev["t"]) * 100
    else: c = None
    if abs(s["t"] - (kill - t0)) < 20 or S.index(s) % 10 == 0:
        print(f"  {s['t']:6.1f} pid={s['pid']} cpu={c if c is None else round(c)} rss={s['rss'] and round(s['rss'])}MB fds={s['fds']} est={s['est']}")
    prev = s
allports = set(); 
for s in S: allports.update(s["ports"])
print("distinct client tcp connections seen established:", len(allports))
last = S[-1]; print("last thread cpu:", {k: round(v, 1) for k, v in last["tcpu"].items()})
bad = [json.loads(l) for l in open(f"{OUT}/bad.jsonl")] if glob.os.path.exists(f"{OUT}/bad.jsonl") else []
print("bad client outcomes", collections.Counter(r[3] for r in bad), (bad[0][4][:300] if bad else ""))
