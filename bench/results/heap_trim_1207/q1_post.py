"""Post-analysis of q1 runs: small calls overlapping a fixed window [t0, t0+W] after each
trim start (the control's no-op trims included), per role; and the calls 0.5-0.05 s before
each trim (same quiet phase, no trim) as an in-run baseline.  python audit/q1_post.py PREFIX [W_ms]"""
import sys, glob, os, statistics
sys.path.insert(0, "/tmp/audit_trim/audit")
from harness import pct
prefix = sys.argv[1]; W = float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.015
for d in sorted(glob.glob(f"/tmp/audit_trim/audit/run/{prefix}_*")):
    rows = [tuple(map(float, l.split())) for l in open(f"{d}/small.txt")]
    rows = [(t, l) for t, l in rows if l >= 0]
    trims = [l.split() for l in open(f"{d}/trims.log")]
    out = []
    for role in ("broker", "worker0", "any"):
        ts = [(float(t[2]), float(t[3])) for t in trims if role == "any" or t[1] == role]
        win = [l for t, l in rows if any(t <= a + W and t + l >= a for a, b in ts)]
        before = [l for t, l in rows if any(a - 0.5 <= t and t + l <= a - 0.05 for a, b in ts)]
        worst = [max([l for t, l in rows if t <= a + W and t + l >= a] or [0]) for a, b in ts]
        out.append(f"{role}: win n={len(win)} p50={pct(win,50)*1e3:.2f} p99={pct(win,99)*1e3:.2f} max={max(win or [0])*1e3:.2f} | "
                   f"before n={len(before)} p50={pct(before,50)*1e3:.2f} p99={pct(before,99)*1e3:.2f} | "
                   f"per-trim worst med={statistics.median(worst)*1e3 if worst else 0:.2f}")
    print(os.path.basename(d)); [print("   ", o) for o in out]
