"""Q1: small sequential calls' latency while another client sends bursts of big inline
tensors separated by idle gaps (so trims fire); trims on vs off (AUDIT_NO_TRIM), repeated.
python audit/q1_trim_latency.py [--tcp] [--repeats 3] [--seconds 40]"""
import sys, os, time, random, argparse, subprocess, json, statistics
sys.path.insert(0, "/tmp/audit_trim"); sys.path.insert(0, "/tmp/audit_trim/audit")
import numpy as np
from harness import Stack, PY, pct
from client_sdk import Client

ap = argparse.ArgumentParser()
ap.add_argument("--tcp", action="store_true"); ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--seconds", type=float, default=40); ap.add_argument("--mb", type=int, default=16)
ap.add_argument("--nmin", type=int, default=8); ap.add_argument("--nmax", type=int, default=24)
ap.add_argument("--gmin", type=float, default=1.5); ap.add_argument("--gmax", type=float, default=3.0)
ap.add_argument("--small-transport", default="auto"); ap.add_argument("--gap-ms", type=float, default=1.0)
ap.add_argument("--concurrent", action="store_true", help="each burst's N requests in flight at once (AsyncClient)")
a = ap.parse_args()


def run(trim, rep):
    name = f"q1_{'tcp' if a.tcp else 'ipc'}{'_conc' if a.concurrent else ''}_{'on' if trim else 'off'}_{rep}"
    rnd = random.Random(1000 + rep)  # same burst schedule on and off
    with Stack(name, trim=trim, tcp=a.tcp) as st:
        out = f"{st.dir}/small.txt"
        sm = subprocess.Popen([PY, "/tmp/audit_trim/audit/small_client.py", st.frontend, out,
                               "--seconds", str(a.seconds + 2), "--transport", a.small_transport, "--gap-ms", str(a.gap_ms)],
                              env=dict(os.environ, PYTHONPATH="/tmp/audit_trim"))
        time.sleep(2.0)
        big = np.random.default_rng(0).integers(0, 255, a.mb << 20, dtype=np.uint8)
        kw = {"insecure": True} if a.tcp else {}
        bursts = []
        end = time.monotonic() + a.seconds - 3
        if a.concurrent:
            import asyncio
            from client_sdk import AsyncClient
            async def go():
                async with AsyncClient(st.frontend, timeout=20.0, transport="inline", **kw) as c:
                    while time.monotonic() < end:
                        n = rnd.randint(a.nmin, a.nmax)
                        b0 = time.monotonic()
                        rs = await asyncio.wait_for(asyncio.gather(*[c.infer("echo", {"x": big}, timeout=20.0) for _ in range(n)]), 30)
                        del rs
                        bursts.append((b0, time.monotonic(), n))
                        await asyncio.sleep(rnd.uniform(a.gmin, a.gmax))
            asyncio.run(go())
        else:
          with Client(st.frontend, timeout=10.0, transport="inline", **kw) as c:
            while time.monotonic() < end:
                n = rnd.randint(a.nmin, a.nmax)
                b0 = time.monotonic()
                for _ in range(n):
                    r = c.infer("echo", {"x": big}, timeout=10.0)
                    del r
                bursts.append((b0, time.monotonic(), n))
                time.sleep(rnd.uniform(a.gmin, a.gmax))
        sm.wait(timeout=a.seconds + 60)
        trims = st.trims()
    rows = [tuple(map(float, ln.split())) for ln in open(out)]
    return name, rows, trims, bursts


def classify(rows, trims, bursts):
    """calls overlapping a trim interval (padded to >= 2 ms); calls in idle gaps away from
    bursts and trims (baseline)."""
    ok = [(t, l) for t, l in rows if l >= 0]
    errs = sum(1 for _, l in rows if l < 0)
    ivs = [(tr["t0"], max(tr["t1"], tr["t0"] + 0.002)) for tr in trims]
    def overl(t, l, ivs):
        return any(t <= b and t + l >= a_ for a_, b in ivs)
    in_trim = [l for t, l in ok if overl(t, l, ivs)]
    busy = [(b0 - 0.05, b1 + 0.2) for b0, b1, _ in bursts]
    trim_pad = [(a_ - 0.05, b + 0.05) for a_, b in ivs]
    quiet = [l for t, l in ok if not overl(t, l, busy) and not overl(t, l, trim_pad)]
    during = [l for t, l in ok if overl(t, l, [(b0, b1) for b0, b1, _ in bursts])]
    return ok, errs, in_trim, quiet, during


def stats(xs):
    if not xs:
        return dict(n=0)
    return dict(n=len(xs), p50=pct(xs, 50) * 1e3, p99=pct(xs, 99) * 1e3, max=max(xs) * 1e3)


results = []
for rep in range(a.repeats):
    for trim in ((True, False) if rep % 2 == 0 else (False, True)):
        name, rows, trims, bursts = run(trim, rep)
        ok, errs, in_trim, quiet, during = classify(rows, trims, bursts)
        durs = [(t["t1"] - t["t0"]) * 1e3 for t in trims]
        freed = [(t["rss0"] - t["rss1"]) >> 20 for t in trims]
        r = dict(name=name, trim=trim, rep=rep, calls=len(ok), errors=errs, ntrims=len(trims),
                 trims_by_role={k: sum(1 for t in trims if t["role"] == k) for k in {t["role"] for t in trims}},
                 trim_ms=dict(med=statistics.median(durs) if durs else None, max=max(durs) if durs else None),
                 freed_mib_med=statistics.median(freed) if freed else None,
                 overlapping_trim=stats(in_trim), quiet=stats(quiet), during_burst=stats(during), all=stats([l for _, l in ok]),
                 trim_detail=[(t["role"], round((t["t1"] - t["t0"]) * 1e3, 2), (t["rss0"] - t["rss1"]) >> 20) for t in trims])
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "trim_detail"}), flush=True)
        print("  trims (role, ms, MiB freed):", r["trim_detail"], flush=True)
json.dump(results, open(f"/tmp/audit_trim/audit/run/q1_{'tcp' if a.tcp else 'ipc'}{'_conc' if a.concurrent else ''}.json", "w"), indent=1)
