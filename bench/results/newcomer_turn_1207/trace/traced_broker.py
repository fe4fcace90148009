# a broker whose scheduler records each worker event and each dispatch (wall clock), dumped at exit to $BTRACE
import atexit, json, os, runpy, sys, time
import broker.state as S
EV = []
def wstate(self, worker):
    w = self._workers.get(worker)
    if w is None: return None
    return [len(w.in_flight), w.credit, w.busy, w.leased, sum(len(getattr(p, "queue", ())) for p in ())]
def qlen(self):
    return sum(s.queued if hasattr(s, "queued") else 0 for s in self._services.values()) if hasattr(self, "_services") else None
def disp(out):
    return [a.request_id if hasattr(a, "request_id") else type(a).__name__ for a in out if type(a).__name__ == "Dispatch"] , [ (a.client[-8:].hex(), a.request_id) for a in out if type(a).__name__ == "Dispatch"]
def wrap(name, tag):
    orig = getattr(S.Scheduler, name)
    def f(self, *a, **k):
        t = time.time()
        out = orig(self, *a, **k)
        w = a[0] if name.startswith("worker") else None
        d = [(a_.client.hex(), a_.request_id) for a_ in out if type(a_).__name__ == "Dispatch"]
        extra = None
        if name == "worker_done": extra = len(a[1])
        if name == "worker_busy": extra = a[1]
        if name == "client_request": extra = (a[0].hex(), a[1])
        EV.append((t, tag, extra, wstate(self, w) if w is not None else [ (len(x.in_flight), x.credit, x.busy, x.leased) for x in self._workers.values()], d))
        return out
    setattr(S.Scheduler, name, f)
for n, tg in [("worker_done","DONE"),("worker_final","FINAL"),("worker_busy","BUSY"),("worker_returned","RET"),("client_request","REQ"),("tick","TICK")]:
    wrap(n, tg)
def dump():
    with open(os.environ["BTRACE"], "w") as fh:
        for e in EV: fh.write(json.dumps(e) + "\n")
atexit.register(dump)
sys.argv = ["broker"] + sys.argv[1:]
runpy.run_module("broker", run_name="__main__", alter_sys=True)
