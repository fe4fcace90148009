"""The CUDA plane's fixes of a review by reading, on a real device (marked ``gpu``; skipped
with the reason elsewhere).  The CPU stand-ins of the same rules are in
tests/gpu_worker/test_cuda_plane.py; these are what only a GPU shows:

- a keep-warm unit (`CudaPlane.warm`) is queued on the worker stream: it must not
  overwrite a device batch's outputs (a model that fills one buffer every call) before
  they are copied into the pool;
- `TorchBackend.run_device` uploads an output that is not a tensor from the worker
  stream's pool of torch's caching allocator, not the default stream's;
- a sticky CUDA error (a device-side assert) ends the worker's process with status 70,
  after the model's own exceptions and an out-of-memory error left it serving (a child
  process: the assert ruins its CUDA context);
- on a machine with two GPUs, a plane on cuda:1 makes no context on GPU 0.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shm.cuda import cuda_status

HAVE_CUDA, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason=f"needs a CUDA device: {WHY}")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def torch():
    import torch

    torch.cuda.init()
    return torch


def _child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_keep_warm_unit_does_not_overwrite_a_queued_device_batchs_outputs(torch):
    from broker import protocol as P
    from gpu_worker.backends import TorchBackend
    from gpu_worker.cuda_plane import CudaPlane
    from gpu_worker.planes import HostPlane
    from shm.cuda.refs import check_ref
    from tests.gpu.test_cuda_plane_order import _job, _Reuses

    model = _Reuses(torch)
    host = HostPlane(TorchBackend(model, "cuda:0"), host=P.local_host_id(), out_capacity=1 << 20, out_slots=8)
    plane = CudaPlane.open(host, model, device="cuda:0", max_batch=4, pool_capacity=64 << 20, pool_slots=16)
    try:
        on_device = _job([], reply="cuda")
        on_device.inputs, on_device.refs = {"x": np.full(1024, 1, np.int32)}, {}
        (out,) = plane.run([on_device])                # queued: buf = 2, then a long kernel
        refs, _ = plane.write_outputs(on_device, out)  # the copy into the pool, after it
        del out
        plane.warm({"x": np.full(1024, 5, np.int32)})  # buf = 6: must not run before that copy
        plane.stream.synchronize()
        torch.cuda.synchronize()
        ref = check_ref(refs[0].loc)
        got = plane.pool.view(ref, np.int32, (1024,))
        assert got.cpu().tolist() == [2] * 1024, "the keep-warm unit overwrote the device batch's output"
        del got
        plane.pool.free(ref)
    finally:
        plane.close()


def test_run_device_uploads_an_output_that_is_not_a_tensor_from_the_worker_streams_pool(torch):
    from gpu_worker.backends import TorchBackend

    class HostOut:
        name = "host_out"
        framework = "torch"
        batchable = True
        streaming = False
        inputs = outputs = None

        def __call__(self, batch):
            return {"y": (batch["x"] + 1).cpu().numpy()}  # not a tensor: run_device uploads it

    be = TorchBackend(HostOut(), "cuda:0")
    stream = torch.cuda.Stream()
    (out,) = be.run_device([{"x": np.arange(1 << 18, dtype=np.float32)}], stream=stream)
    stream.synchronize()
    assert out["y"].is_cuda and float(out["y"][1]) == 2.0
    ptr = out["y"].data_ptr()
    seg = next(s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"])
    assert seg["stream"] == stream.cuda_stream, "the upload took memory from another stream's pool"


STICKY = """
    import logging, os, sys
    import numpy as np
    import torch
    from broker import protocol as P
    from broker.protocol.logs import setup_logging
    from gpu_worker.backends import TorchBackend
    from gpu_worker.cuda_plane import CudaPlane
    from gpu_worker.job import Job
    from gpu_worker.planes import HostPlane

    setup_logging("WARNING", "text", "worker")
    torch.cuda.init()

    class Faulty:
        name = "faulty"
        framework = "torch"
        batchable = True
        streaming = False
        inputs = outputs = None
        how = None

        def __call__(self, batch):
            x = batch["x"]
            if self.how == "value":
                raise ValueError("the model's own error")
            if self.how == "oom":
                torch.empty(1 << 50, dtype=torch.uint8, device=x.device)
            if self.how == "assert":  # a device-side assert (queued, seen at the next wait): sticky
                torch._assert_async(torch.zeros((), device=x.device))
            return {"y": x + 1}

    model = Faulty()
    host = HostPlane(TorchBackend(model, "cuda:0"), host=P.local_host_id(), transports=("inline",))
    plane = CudaPlane.open(host, model, device="cuda:0", max_batch=4, pool_capacity=1 << 20, pool_slots=4)

    def job():
        j = Job(P.token_envelope(1), P.Request(id=1, host=P.local_host_id(), pid=os.getpid(), reply="inline",
                                                tensors=[]), None, None, 0.0, None, None)
        j.inputs, j.refs = {"x": np.ones(4, np.float32)}, {}
        return j

    for how in ("value", "oom", "assert"):
        model.how = how
        try:
            plane.run([job()])
        except BaseException as e:
            print(how, "raised", type(e).__name__, flush=True)
        model.how = None
        (out,) = plane.run([job()])
        print(how, "then served", out["y"].tolist(), "cap", plane.mem.cap, flush=True)
    sys.exit(0)
"""


def test_a_sticky_cuda_error_ends_the_worker_process_and_ordinary_errors_do_not(torch):
    from gpu_worker.cuda_plane import CUDA_CONTEXT_LOST_EXIT

    p = _child(STICKY)
    out = p.stdout.splitlines()
    assert out[:4] == ["value raised ValueError", "value then served [2.0, 2.0, 2.0, 2.0] cap 4",
                       "oom raised OutOfMemoryError", "oom then served [2.0, 2.0, 2.0, 2.0] cap 2"], (out, p.stderr)
    assert len(out) == 4, f"the process went on after the device-side assert: {out}"
    assert p.returncode == CUDA_CONTEXT_LOST_EXIT, (p.returncode, p.stderr[-3000:])
    assert "CUDA context lost" in p.stderr and "exiting with status 70" in p.stderr, p.stderr[-3000:]


TWO_GPUS = """
    import ctypes, os, threading
    import numpy as np
    import torch
    from broker import protocol as P
    from gpu_worker.backends import TorchBackend
    from gpu_worker.cuda_plane import CudaPlane
    from gpu_worker.job import Job
    from gpu_worker.planes import HostPlane

    class PlusOne:
        name = "plus_one"
        framework = "torch"
        batchable = True
        streaming = False
        inputs = outputs = None

        def __call__(self, batch):
            return {"y": batch["x"] + 1}

    model = PlusOne()
    host = HostPlane(TorchBackend(model, "cuda:1"), host=P.local_host_id(), transports=("inline",))
    plane = CudaPlane.open(host, model, device="cuda:1", max_batch=4, pool_capacity=1 << 20, pool_slots=4)
    t = plane.pool.alloc((256,), np.float32)           # the pool's device calls
    loc = P.cuda_loc(plane.pool.hand_off(t, stream=plane.stream, holder_pid=os.getpid()))

    def batch():                                       # the compute thread's first batch
        j = Job(P.token_envelope(1), P.Request(id=1, host=P.local_host_id(), pid=os.getpid(), reply="cuda",
                                                tensors=[P.TensorRef("x", "<f4", [256], loc)]), None, None, 0.0,
                None, None)
        plane.map_inputs(j, [])
        (out,) = plane.run([j])
        plane.write_outputs(j, out)
        plane.stream.synchronize()

    th = threading.Thread(target=batch)
    th.start()
    th.join(60)
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    print("gpu0 context active:", active.value, flush=True)
"""


def test_a_plane_on_the_second_gpu_makes_no_context_on_the_first(torch):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs ({torch.cuda.device_count()} here)")
    p = _child(TWO_GPUS)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "gpu0 context active: 0" in p.stdout, (p.stdout, p.stderr[-3000:])
