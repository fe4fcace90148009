# usage: batcher_lone.py TREE: the pure batcher's add + take + idle for one principal, best of 5 x 200000 (us)
import sys, time
sys.path.insert(0, sys.argv[1])
from gpu_worker.batching import Batcher, Pending
b = Batcher(max_batch=8, max_delay=0.002)
n = 200000
best = []
for rep in range(5):
    t0 = time.perf_counter()
    for i in range(n):
        now = i * 1e-3
        b.add(Pending(key="k", cost=1.0, item=i, arrived=now, principal="P"), now)
        b.take(now, idle=True)
        b.idle()
    best.append((time.perf_counter() - t0) / n * 1e6)
print(sys.argv[1], "us per add+take:", round(min(best), 3), [round(x, 3) for x in best])
