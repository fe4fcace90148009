"""A stock `torch.nn.Sequential` (its forward is `forward(self, input)`), for the test that a
single-input module is served whatever its input is called.  Loaded as
`--model seq_model:sequential` with this folder on PYTHONPATH; exact on any device: doubles
the first two of four features (y = x[:, :2] * 2)."""


def sequential(device: str = "cpu"):
    import torch

    lin = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]))
    return torch.nn.Sequential(lin)
