import json, sys, collections, datetime
E=[json.loads(l) for l in open(sys.argv[1])]
W=[json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
def ts(s): return datetime.datetime.fromisoformat(s.replace("Z","+00:00")).timestamp()
cnt=collections.Counter(e[2][0] for e in E if e[1]=="REQ")
light=min(cnt,key=cnt.get); print(cnt, "light", light)
wev=[(ts(x["ts"]), x["msg"][:30], x.get("rid","")) for x in W if x["msg"].startswith("request")]
# dispatch time of each (client,rid)
disp={}
for e in E:
    for d in e[4]: disp.setdefault(tuple(d),(e[0],e[1]))
shown=0
for i,e in enumerate(E):
    if e[1]!="REQ" or e[2][0]!=light: continue
    key=tuple(e[2]); t0=e[0]; td=disp.get(key,(None,))[0]
    if td is None or td-t0<0.004: continue
    shown+=1
    if shown>8: break
    print(f"--- light {key[1]} waited {1000*(td-t0):.1f} ms")
    evs=[(x[0],"B",x[1],x[2] if x[1]!="REQ" else ("L" if x[2][0]==light else "f"),x[3],len(x[4])) for x in E if t0-0.001<=x[0]<=td+0.0005 and x[1]!="TICK" or (t0<=x[0]<=td and x[1]=="TICK" and x[4])]
    evs+=[(t,"W",m,r[-6:]) for t,m,r in wev if t0-0.025<=t<=td+0.0005]
    for x in sorted(evs, key=lambda x:x[0]): print(f"{1000*(x[0]-t0):8.2f}", *x[1:])
