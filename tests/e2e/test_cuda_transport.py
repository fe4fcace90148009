"""reply="cuda" through the real product on the CPU: `python -m broker` and a CPU
`python -m gpu_worker` answer through host memory (the GPU half is tests/gpu/test_product_cuda.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.cuda_models import inputs
from tests.e2e.conftest import cluster, wait_service  # noqa: F401  (fixture)

MODEL = "tests.e2e.cuda_models:make_exact"


def test_cpu_worker_answers_reply_cuda_through_host_memory(cluster):  # noqa: F811
    pytest.importorskip("torch", reason="the exact model is a torch module (pip install '.[torch]')")
    from client_sdk import Client

    cluster.broker()
    cluster.worker(MODEL, "--service", "exact", "--device", "cpu")
    rng = np.random.default_rng(1)
    with Client(cluster.frontend) as c:
        wait_service(c, "exact")
        x, f = inputs(rng)
        with c.infer("exact", {"x": x, "f": f}, reply="cuda") as r:
            assert isinstance(r["y"], np.ndarray)
            np.testing.assert_array_equal(r["y"], x * 3 + 1)
            np.testing.assert_array_equal(r["g"].view(np.uint32), (-f).view(np.uint32))
