"""The CUDA transport through the real product: `python -m broker`, `python -m gpu_worker
--device cuda:0` and `client_sdk` with `alloc_cuda` and torch CUDA tensors.  The GPU tests
skip (with the reason) without CUDA; the CPU worker's answer to reply="cuda" is pinned by
tests/e2e/test_cuda_transport.py."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from shm.cuda import cuda_status
from tests.e2e.cuda_models import inputs
from tests.e2e.conftest import cluster, wait_service  # noqa: F401  (fixture)

HAVE_CUDA, WHY = cuda_status()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason=f"needs an NVIDIA GPU with CUDA: {WHY}")
MODEL = "tests.e2e.cuda_models:make_exact"


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_in_and_out_bit_exact(cluster):  # noqa: F811
    import torch

    from client_sdk import Client

    cluster.broker()
    cluster.worker(MODEL, "--service", "exact", "--device", "cuda:0", "--cuda-pool-mb", "64")
    rng = np.random.default_rng(2)
    with Client(cluster.frontend) as c:
        wait_service(c, "exact")
        xbuf = c.alloc_cuda((4, 8), torch.int32)            # by reference
        side = c._core._cuda
        for round_ in range(3):
            x, f = inputs(rng)
            xbuf.copy_(torch.from_numpy(x))
            fdev = torch.from_numpy(f).cuda()                  # not in the pool: one device copy
            with c.infer("exact", {"x": xbuf, "f": fdev}) as r:  # auto + CUDA inputs: CUDA outputs
                assert r["y"].is_cuda and r["g"].is_cuda and r["same"].is_cuda
                y, g, same = (r[k].cpu().numpy() for k in ("y", "g", "same"))
            np.testing.assert_array_equal(y, x * 3 + 1)
            assert g.tobytes() == (-f).tobytes() and same.tobytes() == f.tobytes()
            assert side.pool.in_use() == 1, round_          # the temp slot went back at FINAL
            with c.infer("exact", {"x": xbuf, "f": fdev}, reply="shm") as r:  # CUDA in, host out
                assert isinstance(r["y"], np.ndarray)
                np.testing.assert_array_equal(r["y"], x * 3 + 1)
            with c.infer("exact", {"x": x, "f": f}, reply="cuda") as r:  # host in, CUDA out
                assert r["y"].is_cuda
                np.testing.assert_array_equal(r["y"].cpu().numpy(), x * 3 + 1)
            side.cache.sync()                                  # leases stored RELEASED
        del xbuf
        gc.collect()
        c.infer("exact", {"x": x, "f": f}).release()           # frees the dropped buffer
        assert side.pool.in_use() == 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_inputs_to_a_cpu_worker_fail_typed(cluster):  # noqa: F811
    import torch

    from client_sdk import Client, InferenceError

    cluster.broker()
    cluster.worker(MODEL, "--service", "exact", "--device", "cpu")
    # The broker refuses at once (NOT_LOCAL): no worker of the service maps CUDA IPC.
    with Client(cluster.frontend, fallback_inline=False) as c:
        wait_service(c, "exact")
        with pytest.raises(InferenceError, match="CUDA IPC"):
            c.infer("exact", {"x": torch.zeros((4, 8), dtype=torch.int32, device="cuda"),
                              "f": torch.zeros((4, 8), device="cuda")})
        assert c._core._cuda.pool.in_use() == 0
