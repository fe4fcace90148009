import json,sys,glob
rows=[]
for c in (2,8):
  for t in ("before","after"):
    for i in (1,2,3):
        f=f"bench/results/turn_by_age_1207/c{c}_{t}_{i}"
        L=json.load(open(f+"_light.json"))['results'][0]; F=json.load(open(f+"_flood.json"))['results'][0]
        l=L['latency_ms']; fl=F['latency_ms']
        print(f"credit {c} {t:6s} {i}: light n={L['requests']} err={L['errors']} p50={l['p50']:.1f} p95={l['p95']:.1f} max={l['max']:.1f} q={L['server_ms']['queue']:.1f} bw={L['server_ms']['batch_wait']:.1f} | flood in time {F['requests']} of {F['requests']+F['errors']} p50={fl['p50']:.1f} p95={fl['p95']:.1f}")
