# The time a broker and then a worker of tests/e2e/conftest.py take from spawn to READY
# (Cluster.broker, Cluster.worker), N pairs, medians: run from a tree's root,
#   PYTHONDONTWRITEBYTECODE= .venv/bin/python bench/results/suite_1207b/start_times.py [N]
import statistics, sys, tempfile, time
sys.path.insert(0, "tests/e2e")
from pathlib import Path
from conftest import Cluster
n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
b, w = [], []
for i in range(n):
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(Path(d))
        t0 = time.perf_counter(); c.broker(); t1 = time.perf_counter(); c.worker(); t2 = time.perf_counter()
        c.close()
        b.append(t1 - t0); w.append(t2 - t1)
print(f"broker to READY: median {statistics.median(b) * 1e3:.0f} ms (min {min(b) * 1e3:.0f}); "
      f"worker: median {statistics.median(w) * 1e3:.0f} ms (min {min(w) * 1e3:.0f}); {n} pairs")
