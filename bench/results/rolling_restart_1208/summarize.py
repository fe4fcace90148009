"""Totals over the run_*.txt files of this folder: runs, frames, errors by type, wrong / duplicated /
out-of-order / unaccounted frames, and per operator event the worst gap between outcomes (ms).
usage: python summarize.py [run_X.txt ...]"""
import collections, glob, json, re, sys
runs = frames = unreadable = 0
bad = collections.Counter(); errors = collections.Counter(); gaps = collections.defaultdict(list)
for path in sorted(sys.argv[1:] or glob.glob("run_*.txt")):
    event = None
    for line in open(path):
        if line.startswith("SUMMARY "):
            try:
                s = json.loads(line[8:])
            except ValueError:  # (a line cut short in the raw output)
                unreadable += 1
                event = None
                continue
            runs += 1; frames += s["sent"]; event = s["event"]
            for k in ("wrong", "dup", "out_of_order", "unaccounted"):
                bad[k] += s[k]
            if s.get("stats"):
                bad["dropped_by_latest_wins"] += s["stats"]["dropped"]
            for k, v in s["errors"].items():
                errors[k] += v
        elif line.strip().startswith("EVENT {") and event is not None:
            e = json.loads(line.strip()[6:])
            kind = re.sub(r" pid=\d+| w\d+n?", "", e["ev"])
            gaps[f"{event}: {kind}"].append(e["worst_gap_ms_at"][0])
print(f"runs {runs} (+{unreadable} cut short), frames {frames}, {dict(bad)}, errors {dict(errors)}")
for k, v in sorted(gaps.items()):
    v = sorted(v)
    print(f"{k}: n={len(v)} worst gap ms median {v[len(v)//2]:.0f} max {v[-1]:.0f}")
