"""The torch backend on a real CUDA device (marked ``gpu``; skipped with the reason elsewhere)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backends import make_backend, warmup
from gpu_worker.devices import cuda_available
from gpu_worker.models import load_model
from tests.gpu_worker.test_backends import readonly


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs an NVIDIA GPU with CUDA (torch sees none)")
def test_cartoon_on_cuda_matches_cpu():
    rng = np.random.default_rng(0)
    reqs = [{"image": readonly(rng.integers(0, 256, (72, 128, 3), dtype=np.uint8))} for _ in range(3)]
    cpu = make_backend(load_model("cartoon", "cpu"), "cpu").run(reqs)
    backend = make_backend(load_model("cartoon", "cuda:0"), "cuda:0")
    warmup(backend, batch_sizes=[1, 3])
    for batch in (reqs, reqs[:1]):
        gpu = backend.run(batch)
        for g, c in zip(gpu, cpu):
            assert g["image"].shape == c["image"].shape and g["image"].dtype == np.uint8
            diff = np.abs(g["image"].astype(np.int16) - c["image"].astype(np.int16))
            assert (diff > 1).mean() < 0.01  # float rounding may flip a quantisation level
