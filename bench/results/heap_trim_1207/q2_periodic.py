"""Q2: a steady or periodic big-frame stream, trims on vs off: throughput, latency, CPU and
minor faults of broker and worker.
python audit/q2_periodic.py --pattern {steady,periodic,slow} [--repeats 3] [--seconds 25]
  steady:   one 16 MiB inline request every 0.1 s (never a quiet look: no trim expected)
  periodic: a burst of 6 concurrent 16 MiB requests every --period s (default 2.05: a quiet
            housekeeping look in every gap, so a trim between every two bursts)
  slow:     one 16 MiB request every 1.3 s (a trim every few frames)"""
import sys, os, time, argparse, json, statistics, asyncio
sys.path.insert(0, "/tmp/audit_trim"); sys.path.insert(0, "/tmp/audit_trim/audit")
import numpy as np
from harness import Stack, pct, proc_stat, minflt
from client_sdk import AsyncClient

ap = argparse.ArgumentParser()
ap.add_argument("--pattern", required=True); ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--seconds", type=float, default=25); ap.add_argument("--period", type=float, default=2.05)
ap.add_argument("--k", type=int, default=6); ap.add_argument("--tcp", action="store_true")
a = ap.parse_args()
MB = 16
big = np.random.default_rng(0).integers(0, 255, MB << 20, dtype=np.uint8)


def run(trim, rep):
    name = f"q2_{a.pattern}{'_tcp' if a.tcp else ''}_{'on' if trim else 'off'}_{rep}"
    with Stack(name, trim=trim, tcp=a.tcp) as st:
        pids = st.pids()
        kw = {"insecure": True} if a.tcp else {}
        lat, bursts = [], []
        async def go():
            async with AsyncClient(st.frontend, timeout=20.0, transport="inline", **kw) as c:
                for _ in range(3):
                    await c.infer("echo", {"x": big}, timeout=20.0)
                await asyncio.sleep(2.5)
                s0 = {k: (proc_stat(p)[1], minflt(p)) for k, p in pids.items()}
                t_start = time.monotonic()
                end = t_start + a.seconds
                async def one():
                    t = time.monotonic()
                    await c.infer("echo", {"x": big}, timeout=20.0)
                    lat.append((t, time.monotonic() - t))
                nxt = time.monotonic()
                while nxt < end:
                    if a.pattern == "steady":
                        await one(); nxt += 0.1
                    elif a.pattern == "periodic":
                        b0 = time.monotonic()
                        await asyncio.wait_for(asyncio.gather(*[one() for _ in range(a.k)]), 30)
                        bursts.append((b0, time.monotonic() - b0)); nxt += a.period
                    else:
                        await one(); nxt += 1.3
                    await asyncio.sleep(max(0, nxt - time.monotonic()))
                t_end = time.monotonic()
                s1 = {k: (proc_stat(p)[1], minflt(p)) for k, p in pids.items()}
                return t_start, t_end, s0, s1
        t_start, t_end, s0, s1 = asyncio.run(go())
        trims = [t for t in st.trims() if t_start <= t["t0"] <= t_end]
    n = len(lat)
    gib = n * MB * 2 / 1024  # in and out
    r = dict(name=name, trim=trim, n=n, wall=t_end - t_start, ntrims=len(trims),
             trims_by_role={k: sum(1 for t in trims if t["role"] == k) for k in {t["role"] for t in trims}},
             trim_ms_med=statistics.median([(t["t1"] - t["t0"]) * 1e3 for t in trims]) if trims else None,
             freed_mib_sum=sum((t["rss0"] - t["rss1"]) >> 20 for t in trims),
             lat_p50=pct([l for _, l in lat], 50) * 1e3, lat_p99=pct([l for _, l in lat], 99) * 1e3,
             lat_max=max(l for _, l in lat) * 1e3,
             cpu_s={k: round(s1[k][0] - s0[k][0], 2) for k in s0},
             minflt_k={k: round((s1[k][1] - s0[k][1]) / 1e3, 1) for k in s0},
             cpu_ms_per_req={k: round((s1[k][0] - s0[k][0]) * 1e3 / n, 2) for k in s0})
    if bursts:
        r["burst_ms_p50"] = statistics.median(d for _, d in bursts) * 1e3
        r["burst_ms_max"] = max(d for _, d in bursts) * 1e3
    if a.pattern == "slow":  # the frame after a trim vs the others
        after = []
        ts = sorted(t["t1"] for t in trims)
        prev = None
        for t, l in sorted(lat):
            if prev is not None and any(prev < x <= t for x in ts):
                after.append(l)
            prev = t
        others = [l for t, l in lat if l not in after]
        r["after_trim_p50"] = statistics.median(after) * 1e3 if after else None
        r["others_p50"] = statistics.median(others) * 1e3 if others else None
    return r


res = []
for rep in range(a.repeats):
    for trim in ((True, False) if rep % 2 == 0 else (False, True)):
        r = run(trim, rep)
        res.append(r)
        print(json.dumps(r), flush=True)
json.dump(res, open(f"/tmp/audit_trim/audit/run/q2_{a.pattern}{'_tcp' if a.tcp else ''}.json", "w"), indent=1)
