"""An echo that gets every 50th reply wrong (one byte changed), for the chaos bench's test of
its own check.  Loaded as `--model corrupt_model:factory` with this folder on PYTHONPATH."""
import numpy as np


def factory(device: str = "cpu"):
    calls = [0]

    def run(inputs):
        calls[0] += 1
        out = {k: np.array(v, copy=True) for k, v in inputs.items()}
        if calls[0] % 50 == 0:
            for v in out.values():
                v.reshape(-1)[0] ^= 1
        return out

    run.name = "corrupt"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(16, np.uint8)}
    return run
