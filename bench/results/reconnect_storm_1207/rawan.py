import json, sys, glob, collections
OUT = sys.argv[1]; R = json.load(open(f"{OUT}/run.json")); kill = R["events"]["kill"]; rs = R["events"]["restart"]
ev = []
for k, f in enumerate(sorted(glob.glob(f"{OUT}/raw*.json"))):
    ev += [(t, (k, i), e) for t, i, e in json.load(open(f))]
import zmq
names = {getattr(zmq, n): n for n in dir(zmq) if n.startswith("EVENT_") and isinstance(getattr(zmq, n), int)}
socks = {s for _, s, _ in ev}
print("raw sockets", len(socks))
print("events before kill", collections.Counter(names.get(e, e) for t, s, e in ev if t < kill))
print("events after kill", collections.Counter(names.get(e, e) for t, s, e in ev if t >= kill))
first = {}
for t, s, e in sorted(ev):
    if t >= rs and e == zmq.EVENT_HANDSHAKE_SUCCEEDED and s not in first: first[s] = t - kill
v = sorted(first.values())
if v: print(f"raw recovery: n={len(v)} p50={v[len(v)//2]:.2f} p90={v[int(len(v)*.9)]:.2f} max={v[-1]:.2f}; never: {len(socks)-len(v)}")
# initial connect
fi = {}
t0 = R["events"]["t0"]
for t, s, e in sorted(ev):
    if t < kill and e == zmq.EVENT_HANDSHAKE_SUCCEEDED and s not in fi: fi[s] = t - t0
v = sorted(fi.values())
if v: print(f"raw initial: n={len(v)} max={v[-1]:.2f}")
per = collections.Counter(s for t, s, e in ev if t >= kill and e == zmq.EVENT_HANDSHAKE_SUCCEEDED)
print("handshakes succeeded per socket after kill histogram", collections.Counter(per.values()))
fails = collections.Counter(s for t, s, e in ev if t >= kill and e in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH))
print("sockets with handshake failures after kill", len(fails), "max per socket", max(fails.values()) if fails else 0)
tl = collections.Counter((int(t - kill), names.get(e, e)) for t, s, e in ev if t >= kill and e in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECTED))
for sec in range(0, 30):
    row = {n: tl[(sec, n)] for n in ("EVENT_CONNECTED", "EVENT_HANDSHAKE_SUCCEEDED", "EVENT_HANDSHAKE_FAILED_NO_DETAIL", "EVENT_DISCONNECTED") if tl[(sec, n)]}
    if row: print(" ", sec, row)
