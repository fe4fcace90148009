"""A model for tests that reads request ``meta``: multiplies ``x`` by ``meta["scale"]``
(default 1).  Loaded as `--model meta_model:factory` with this folder on PYTHONPATH; it
declares ``meta``, so the worker hands it the per-request dicts, a list in batch order."""
import numpy as np


def factory(device: str = "cpu"):
    def scale(inputs, meta):
        x = np.asarray(inputs["x"])
        s = np.array([m.get("scale", 1) for m in meta], dtype=x.dtype)
        return {"x": x * s.reshape(-1, *([1] * (x.ndim - 1)))}

    scale.name = "scale"
    scale.example_inputs = lambda: {"x": np.ones(4, np.float32)}
    return scale
