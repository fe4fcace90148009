"""A model that takes a fixed 50 ms per call and echoes copies of its inputs, for the streams
bench tests.  Loaded as `--model slow_model:factory` with this folder on PYTHONPATH."""
import time

import numpy as np

DELAY_S = 0.050


def factory(device: str = "cpu"):
    def run(inputs):
        time.sleep(DELAY_S)
        return {k: np.array(v, copy=True) for k, v in inputs.items()}

    run.name = "slow"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(16, np.uint8)}
    return run
