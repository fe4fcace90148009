"""Models for tests/e2e/test_bench_run.py, loaded as `--model bench_models:fixed` (this folder
on PYTHONPATH):

- `fixed`: each call takes $FIXED_MS milliseconds (a sleep: a known service time, whatever
  the machine's load), then echoes; not batchable, so with k workers the capacity is k/s.
- `digest`: echoes, and appends one line per call to $DIGEST_LOG: `name=digest` for each
  input, in the digest `bench.inputs.digest` writes into the report (so a test checks that
  inputs reached the model unchanged).
"""
import hashlib
import os
import time

import numpy as np


def fixed(device: str = "cpu"):
    seconds = float(os.environ.get("FIXED_MS", "20")) / 1000

    def run(inputs):
        time.sleep(seconds)
        return {k: np.array(v, copy=True) for k, v in inputs.items()}

    run.name = "fixed"
    run.batchable = False
    return run


def digest(device: str = "cpu"):
    log = os.environ["DIGEST_LOG"]

    def run(inputs):
        line = " ".join(f"{k}={hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16]}"
                        for k, v in sorted(inputs.items()))
        with open(log, "a") as f:
            f.write(line + "\n")
        return {k: np.array(v, copy=True) for k, v in inputs.items()}

    run.name = "digest"
    run.batchable = False
    return run
