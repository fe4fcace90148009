# The time a worker and a broker of tests/e2e/conftest.py take to stop on SIGTERM (Proc.close), six pairs:
# .venv/bin/python bench/results/suite_1207/stop_times.py (from the repository root)
import sys, time, tempfile
sys.path.insert(0, "tests/e2e")
from pathlib import Path
from conftest import Cluster
for i in range(6):
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(Path(d))
        br = c.broker(); wk = c.worker()
        t0 = time.perf_counter(); wk.close(); t1 = time.perf_counter(); br.close(); t2 = time.perf_counter()
        print("worker", round(t1-t0,3), "broker", round(t2-t1,3))
