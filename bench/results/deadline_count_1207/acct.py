"""Sequential accounting test: one sync Client (or AsyncClient with --aio), N calls; compares client outcomes with
broker metric deltas. --mode deadline|cancel. Usage: acct.py --mode deadline --n 2000 [--tmin 2 --tmax 20] [--cancel-ms 1]"""
import argparse, asyncio, collections, json, os, random, re, subprocess, time, urllib.request
import numpy as np
from client_sdk import Client, AsyncClient, DeadlineExceeded, Cancelled, InferenceError
ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="deadline"); ap.add_argument("--n", type=int, default=2000)
ap.add_argument("--tmin", type=float, default=2); ap.add_argument("--tmax", type=float, default=20)
ap.add_argument("--cancel-ms", type=float, default=1.0); ap.add_argument("--aio", action="store_true")
ap.add_argument("--prio", default="normal")
a = ap.parse_args()
def metrics():
    t = urllib.request.urlopen("http://" + os.environ["HTTP"] + "/metrics", timeout=3).read().decode()
    d = {}
    for m in re.finditer(r'^zmq_infer_requests_total\{outcome="(\w+)",service="sleepy"\} (\S+)', t, re.M):
        d[m.group(1)] = float(m.group(2))
    for m in re.finditer(r'^zmq_infer_broker_events_total\{event="(\w+)"\} (\S+)', t, re.M):
        d["ev_" + m.group(1)] = float(m.group(2))
    return d
cli = collections.Counter(); late = collections.defaultdict(list)
m0 = metrics()
def one_sync(c, i):
    x = np.arange(4, dtype=np.int64); x[0] = i
    T = random.uniform(a.tmin, a.tmax) / 1000
    t0 = time.perf_counter()
    try:
        if a.mode == "deadline":
            r = c.infer("sleepy", {"x": x}, timeout=T, priority=a.prio)
            el = time.perf_counter() - t0
            assert int(r["tok"][0]) == i
            r.release(); cli["ok"] += 1; cli["ok_after_T"] += el > T; late["ok"].append((el - T) * 1e3)
        else:
            h = c.infer_stream("sleepy", {"x": x}, timeout=T, priority=a.prio)
            try:
                h.result(timeout=a.cancel_ms / 1000)
                cli["ok_before_cancel"] += 1
            except DeadlineExceeded:
                cli["deadline_before_cancel"] += 1
            except TimeoutError:
                cli["cancel_" + str(h.cancel())] += 1
            h.close()
    except DeadlineExceeded:
        el = time.perf_counter() - t0
        cli["deadline"] += 1; late["deadline"].append((el - T) * 1e3)
    except InferenceError as e:
        cli[type(e).__name__] += 1
if a.aio:
    async def main():
        async with AsyncClient(os.environ["FE"], timeout=1.0) as c:
            for i in range(a.n):
                x = np.arange(4, dtype=np.int64); x[0] = i
                T = random.uniform(a.tmin, a.tmax) / 1000
                t0 = time.perf_counter()
                try:
                    if a.mode == "deadline":
                        r = await c.infer("sleepy", {"x": x}, timeout=T, priority=a.prio)
                        el = time.perf_counter() - t0
                        r.release(); cli["ok"] += 1; cli["ok_after_T"] += el > T; late["ok"].append((el - T) * 1e3)
                    elif a.mode == "taskcancel":
                        t = asyncio.ensure_future(c.infer("sleepy", {"x": x}, timeout=T, priority=a.prio))
                        await asyncio.sleep(a.cancel_ms / 1000)
                        cli["taskcancel_" + str(t.cancel())] += 1
                        try: await t
                        except asyncio.CancelledError: pass
                    else:
                        h = c.infer_stream("sleepy", {"x": x}, timeout=T, priority=a.prio)
                        await asyncio.sleep(a.cancel_ms / 1000)
                        cli["cancel_" + str(h.cancel())] += 1
                        h.close()
                except DeadlineExceeded:
                    el = time.perf_counter() - t0
                    cli["deadline"] += 1; late["deadline"].append((el - T) * 1e3)
                except InferenceError as e:
                    cli[type(e).__name__] += 1
            await asyncio.sleep(0.5)
    asyncio.run(main())
else:
    with Client(os.environ["FE"], timeout=1.0) as c:
        for i in range(a.n):
            one_sync(c, i)
        c.pump(0.5) if hasattr(c, "pump") else None
time.sleep(1.0)
m1 = metrics()
print("client:", dict(cli))
print("broker delta:", {k: m1.get(k, 0) - m0.get(k, 0) for k in sorted(set(m1) | set(m0)) if m1.get(k, 0) != m0.get(k, 0)})
def pct(v):
    v = sorted(v); n = len(v)
    return {"n": n, "min": round(v[0],2), "p50": round(v[n//2], 2), "p90": round(v[int(n*.9)], 2), "p99": round(v[int(n*.99)], 2), "max": round(v[-1], 2)} if v else None
print("lateness ms (elapsed - T):", {k: pct(v) for k, v in late.items()})
