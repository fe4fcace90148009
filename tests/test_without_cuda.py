"""Without CUDA every GPU module imports, and every device entry point says why it cannot
run with one typed error."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from shm.cuda import CudaUnavailable, cuda_status

HAVE_CUDA, WHY = cuda_status()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
no_cuda = pytest.mark.skipif(HAVE_CUDA, reason="CUDA is available here; these check the CPU-only behaviour")


def test_modules_import_without_cuda_python_or_tensorrt():
    # A fresh interpreter, so nothing imported by other tests hides a missing import.
    code = ("import shm.cuda, shm.cuda.book, shm.cuda.importer, shm.cuda.pool, shm.cuda.refs, "
            "shm.cuda.runtime, shm.cuda.table, shm.cuda.views, gpu_worker.cuda_runtime, gpu_worker.trt, "
            "bench.gpu_check; import sys; print('tensorrt' in sys.modules, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]  # imported lazily, only when used


@no_cuda
def test_device_entry_points_raise_cuda_unavailable():
    from broker import protocol as P
    from gpu_worker import cuda_runtime as cr
    from shm import cuda

    assert "no CUDA device" in WHY or "torch" in WHY
    for call in (lambda: cuda.CudaPool(1 << 20), cuda.runtime_api, cuda.require_cuda,
                 lambda: cuda.default_runtime().torch(), lambda: cuda.default_runtime().api(),
                 lambda: cr.CopyComputeOverlap(0),
                 lambda: cr.register_host((4096 * 16, 4096))):
        with pytest.raises(CudaUnavailable, match="CUDA|torch"):
            call()
    with pytest.raises(CudaUnavailable):
        cuda.CudaPoolCache().view(
            P.cuda_loc(cuda.DeviceRef("zinf-1-1-0123456789abcdef-5", 0, 1, 0, 0, 0)), "|u1", (1,))
    w = cr.MemoryWatch(4)  # construction is pure; the first reading needs CUDA
    with pytest.raises(CudaUnavailable):
        w.limit()


@no_cuda
def test_trt_backend_says_what_is_missing():
    pytest.importorskip("torch", reason="the convnet model it wraps is a torch model")
    from gpu_worker import trt
    from gpu_worker.backends import BackendUnavailable
    from gpu_worker.models import load_model

    ok, why = trt.available()
    assert not ok and why
    with pytest.raises(BackendUnavailable, match=why.split(":")[0]):
        trt.TrtBackend(load_model("convnet", "cpu"))


def test_cuda_package_is_not_imported_by_shm():
    # shm stays CUDA-free for host-only users: the device plane is opt-in.
    mod = importlib.import_module("shm")
    assert "cuda" not in mod.__all__
    code = "import shm, sys; print(sorted(m for m in sys.modules if m.startswith('shm.cuda')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def test_the_protocol_loads_no_device_pool():
    # Every process imports broker.protocol; only DeviceRef of the CUDA plane comes with it.
    code = ("import broker.protocol, sys; "
            "print(sorted(m for m in sys.modules if m.startswith('shm.cuda')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['shm.cuda',", "'shm.cuda.refs']"]


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "gpu"])
def test_a_device_a_worker_cannot_use_is_said_as_the_device_not_the_model(device, tmp_path):
    # Found by the architecture audit: "cannot load model 'echo': device 'cuda' requested but
    # CUDA is not available", the model blamed for the device.
    if device != "gpu" and HAVE_CUDA:
        pytest.skip("CUDA is here: the device is usable")
    p = subprocess.run([sys.executable, "-m", "gpu_worker", "--broker", f"ipc://{tmp_path}/be.ipc", "--model",
                        "echo", "--device", device], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"--device {device}:" in p.stderr and "cannot load model" not in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
