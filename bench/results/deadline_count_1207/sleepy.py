"""A numpy model that sleeps a random 0-10 ms per batch and returns y = x*2+1, tok = x (the per-call token).
Also counts calls per token to a log file (APPEND) so we can see whether cancelled work ran."""
import os, random, time
import numpy as np
from gpu_worker.models import ModelBase

LOG = os.environ.get("SLEEPY_LOG")

class Sleepy(ModelBase):
    name = "sleepy"
    framework = "numpy"
    batchable = True
    def __init__(self, device="cpu"):
        self.device = device
        self._f = open(LOG, "a", buffering=1) if LOG else None
    def __call__(self, batch):
        x = batch["x"]
        lo = float(os.environ.get("SLEEPY_MIN_MS", "0")); hi = float(os.environ.get("SLEEPY_MAX_MS", "10"))
        time.sleep(random.uniform(lo, hi) / 1000.0)
        if self._f is not None:
            # first element of each row is the token (int64 view)
            toks = [int(r.reshape(-1)[0]) for r in x]
            self._f.write("%d %s\n" % (os.getpid(), " ".join(map(str, toks))))
        return {"y": x * 2 + 1, "tok": np.array(x)}
    def example_inputs(self):
        return {"x": np.zeros(4, np.int64)}

def make(device="cpu"):
    return Sleepy(device)
