"""A numpy model whose outputs come in every layout a model may return, each a function
of its input ``x`` (at least 1-d per request) that `expected` computes on the client:
Fortran order, reversed and strided views of the input, a broadcast (zero-stride) view,
per-request 0-d results, bool and other dtypes, and ``x`` itself (the identity output).
Loaded as `--model layouts_model:factory`."""
import numpy as np


def outputs(x):
    """The outputs for a batch ``x`` (leading batch axis); per request, `expected`."""
    n = x.shape[0]
    return {
        "x": x,                                              # identity
        "fortran": np.asfortranarray(x * 2),
        "rev": x[:, ::-1],                                   # negative stride, view of the input
        "every2": x[:, ::2],                                 # strided view of the input
        "tail": x[:, 1:],                                    # contiguous-ish view, offset into the input
        "bcast": np.broadcast_to(x[:, :1], x.shape),         # zero strides
        "total": x.real.reshape(n, -1).sum(axis=1, dtype=np.float64),  # 0-d per request
        "pos": x > 0,
        "half": x.real.astype(np.float16),
        "bytes": x.view(np.uint8).reshape(n, -1)[:, ::-1],   # another dtype over the same memory
        "empty": np.zeros((n, 0, 3), np.int32),
    }


def expected(x):
    """What one request's outputs must be (``x`` without the batch axis)."""
    return {k: v[0] for k, v in outputs(np.asarray(x)[None]).items()}


def factory(device: str = "cpu"):
    def run(batch):
        return outputs(batch["x"])

    run.name = "layouts"
    run.example_inputs = lambda: {"x": np.ones(4, np.float32)}
    return run


def torch_clone(device: str = "cpu"):
    """A torch model (it gets torch tensors): ``x`` copied, and doubled (``two``), of the
    dtype it came in (native byte order)."""
    import torch

    class Clone(torch.nn.Module):
        def forward(self, x):
            return {"x": x.clone(), "two": x * 2}

    m = Clone()
    m.name = "tclone"
    m.example_inputs = lambda: {"x": np.ones(4, np.complex128)}
    return m
