"""A torch model whose outputs are exact on any device (integer arithmetic), for the CUDA
round trip through the real broker and worker."""
from __future__ import annotations

import numpy as np


def make_exact():
    import torch

    class Exact(torch.nn.Module):
        batchable = True

        @staticmethod
        def example_inputs():
            return {"x": np.zeros((4, 8), np.int32), "f": np.zeros((4, 8), np.float32)}

        def forward(self, x, f):
            # x * 3 + 1 in int32 and -f in float32: bit-exact whatever the device.
            return {"y": x * 3 + 1, "g": -f, "same": f.clone()}

    return Exact()


def inputs(rng):
    """Inputs whose outputs `make_exact` computes exactly: int32 x and float32 f."""
    return (rng.integers(-(1 << 20), 1 << 20, (4, 8), dtype=np.int32),
            rng.standard_normal((4, 8)).astype(np.float32))
