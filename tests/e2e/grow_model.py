"""A model whose output is as large as its input asks: `x[0]` bytes of zeros (uint8, shape (1, x[0])), for
tests of big replies to small requests.  Loaded as `--model grow_model:factory` (this folder
on PYTHONPATH)."""
import numpy as np


def factory(device: str = "cpu"):
    def run(inputs):
        n = int(np.asarray(inputs["x"]).flat[0])
        return {"y": np.zeros((1, n), np.uint8)}

    run.name = "grow"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.array([16], np.int64)}
    return run
