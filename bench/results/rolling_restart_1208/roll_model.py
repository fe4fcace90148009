"""Deterministic test model for the rolling-restart audit.
out["image"] = 255 - image (a copy), out["fid"] = fid, out["pid"] = worker pid.
Per-call delay ROLL_DELAY_MS (default 10 ms).  Load: --model roll_model:factory"""
import os
import time

import numpy as np

DELAY_S = float(os.environ.get("ROLL_DELAY_MS", "10")) / 1000.0


def factory(device: str = "cpu"):
    pid = os.getpid()

    def run(batch):
        time.sleep(DELAY_S)
        img = batch["image"]
        n = img.shape[0]
        return {"image": 255 - np.asarray(img),
                "fid": np.array(batch["fid"], copy=True),
                "pid": np.full((n, 1), pid, np.int64)}

    run.name = "roll"
    run.batchable = False
    run.framework = "numpy"
    run.example_inputs = lambda: {"image": np.zeros((480, 640, 3), np.uint8), "fid": np.zeros(1, np.int64)}
    return run
