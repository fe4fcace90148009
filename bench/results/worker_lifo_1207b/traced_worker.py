# WORKER_PY=bench/results/worker_lifo_1207b/traced_worker.py BTRACE=FILE bench/results/overload_1206b/pair/run_pair.sh ...
# A gpu_worker whose Batcher logs add/take/expire/lost per request (principal, seq-ish id, times)
import os, sys, time, json
from gpu_worker import batching as B
LOG = open(os.environ["BTRACE"], "w", buffering=1)
_add, _take, _expire, _lost, _cong = B.Batcher.add, B.Batcher.take, B.Batcher.expire, B.Batcher.lost, B.Batcher._congestion
def add(self, p, now, **kw):
    LOG.write(json.dumps(["add", now, p.principal, id(p.item), p.deadline]) + "\n")
    return _add(self, p, now, **kw)
def take(self, now, **kw):
    out = _take(self, now, **kw)
    if out:
        g = self._groups
        desc = []
        for k, grp in g.items():
            if type(grp) is B.deque if hasattr(B, "deque") else False:
                desc.append(["plain", len(grp)])
            else:
                try:
                    desc.append(["turns", grp.lifo, [str(x) for x in grp.ring], {str(k2): v for k2, v in grp.served.items()}])
                except AttributeError:
                    desc.append(["plain", len(grp)])
        LOG.write(json.dumps(["take", now, [(p.principal, id(p.item)) for p in out], desc]) + "\n")
    return out
def expire(self, now):
    out = _expire(self, now)
    for p in out:
        LOG.write(json.dumps(["expire", now, p.principal, id(p.item)]) + "\n")
    return out
def lost(self, key, now):
    LOG.write(json.dumps(["lost", now]) + "\n")
    return _lost(self, key, now)
B.Batcher.add, B.Batcher.take, B.Batcher.expire, B.Batcher.lost = add, take, expire, lost
from gpu_worker.__main__ import main
sys.exit(main(sys.argv[1:]))
