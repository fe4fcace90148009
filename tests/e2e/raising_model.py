"""A model that fails on demand, for tests of what a failing model logs and counts: a call
whose `x` has any non-zero element raises RuntimeError; otherwise it echoes (so its warm-up,
x = 0, passes).  Loaded as `--model raising_model:factory`, with this folder on PYTHONPATH."""
import numpy as np


def factory(device: str = "cpu"):
    def run(inputs):
        x = np.asarray(inputs["x"])
        if x.any():
            raise RuntimeError("raising_model: told to fail")
        return {"x": np.array(x, copy=True)}

    run.name = "raising"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(4, np.float32)}
    return run
