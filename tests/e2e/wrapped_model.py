"""Factories whose results the worker wraps (docs/models.md, "Loading a custom model"), for
tests/e2e/test_wrapped_models.py.  Loaded as `--model wrapped_model:<factory>`, with this
folder on PYTHONPATH.

- `scripted`: a TorchScript module (`torch.jit.script`) computing x * 2 + 1, with example
  inputs set on it; the service is its class's name, "scale".
- `scripted_fn`: a TorchScript function (`torch.jit.script` of a plain function) computing
  -x, with example inputs set on it; the service is the function's name, "negate".
- `exported`: a `torch.export` program (x * 2 - 1, dimension 0 dynamic); the service is
  the factory's name, "exported"; its warm-up is the program's own example inputs.
- `picky`: a plain function with no example inputs that returns a list, not a dict, when
  x[0] is negative, else {"y": x + 1}; the service is "picky".
"""
import numpy as np


def scripted(device="cpu"):
    import torch

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    module = torch.jit.script(Scale())
    module.example_inputs = lambda: {"x": np.ones(3, np.float32)}
    return module


def scripted_fn(device="cpu"):
    import torch

    def negate(x: torch.Tensor) -> torch.Tensor:
        return -x

    fn = torch.jit.script(negate)
    fn.example_inputs = lambda: {"x": np.ones(3, np.float32)}
    return fn


def exported(device="cpu"):
    import torch

    class Shift(torch.nn.Module):
        def forward(self, x):
            return x * 2 - 1

    return torch.export.export(Shift().eval(), (torch.ones(2, 3),),
                               dynamic_shapes={"x": {0: torch.export.Dim("batch")}})


def picky(device="cpu"):
    def picky(batch):
        x = batch["x"]
        if (x[:, 0] < 0).any():
            return [x + 1]
        return {"y": x + 1}

    return picky
