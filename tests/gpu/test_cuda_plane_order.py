"""The CUDA plane's host/device ordering on a real device (marked ``gpu``; skipped with the
reason elsewhere).  Each test queues a long kernel (`torch.cuda._sleep`) on the worker
stream first, so that work queued after it runs late, as behind a busy GPU's earlier
batches; the CPU tests of the same rules (tests/gpu_worker/test_cuda_plane.py) only see
which stream was current and when the stream was synchronised.

- `CudaPlane.detach` (what `Worker._isolate` keeps of each half of a failed batch) copies
  on the worker stream: a copy on the thread's default stream read the outputs before the
  kernels that make them ran;
- a device batch reading a pinned client segment has uploaded it when `run` returns: the
  client reuses its slot once told FINAL;
- an error FINAL of a request that never ran does not wait for the stream;
- a host batch (`backend.run`) is queued on the worker stream too: a model that fills the
  same device buffer every call must not overwrite a device batch's outputs before they
  are copied into the pool.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from shm.cuda import cuda_status

HAVE_CUDA, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason=f"needs a CUDA device: {WHY}")]

#: GPU clock cycles of the backlog queued first (about 0.1-0.2 s on current GPUs)
BACKLOG_CYCLES = 300_000_000


@pytest.fixture
def torch():
    import torch

    torch.cuda.init()
    return torch


class _PlusOne:
    name = "plus_one"
    framework = "torch"
    batchable = True
    streaming = False
    device = "cuda:0"
    inputs = outputs = None

    def __call__(self, batch):
        return {"y": batch["x"] + 1}


@pytest.fixture
def plane(torch):
    from broker import protocol as P
    from gpu_worker.backends import TorchBackend
    from gpu_worker.cuda_plane import CudaPlane
    from gpu_worker.planes import HostPlane

    model = _PlusOne()
    host = HostPlane(TorchBackend(model, "cuda:0"), host=P.local_host_id(), out_capacity=1 << 20, out_slots=8)
    p = CudaPlane.open(host, model, device="cuda:0", max_batch=4, pool_capacity=64 << 20, pool_slots=16)
    try:
        yield p
    finally:
        p.close()


def _backlog(torch, stream):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BACKLOG_CYCLES)


def _job(tensors, reply="cuda"):
    from broker import protocol as P
    from gpu_worker.job import Job

    return Job(P.token_envelope(1), P.Request(id=1, host=P.local_host_id(), pid=os.getpid(), reply=reply,
                                              tensors=tensors), None, None, 0.0, None, None)


def test_detach_copies_device_outputs_after_the_kernels_that_make_them(torch, plane):
    out = torch.zeros(1 << 20, device="cuda:0")
    torch.cuda.synchronize()
    _backlog(torch, plane.stream)
    with torch.cuda.stream(plane.stream):
        out.fill_(7.0)  # runs after the backlog
    (copied,) = plane.detach([{"y": out}])
    torch.cuda.synchronize()
    assert bool((copied["y"] == 7.0).all()), "the copy read the output before its kernel wrote it"


def test_a_device_batch_reading_a_pinned_client_segment_has_uploaded_it_when_run_returns(torch, plane):
    import shm
    from broker import protocol as P

    n = 4 << 20
    with shm.ShmPool(64 << 20, slots=8) as client:
        a = client.alloc((n,), np.int32)
        a[:] = 1
        ref = client.ref_of(a)
        client.mark_in_flight(ref)
        job = _job([P.TensorRef(name="x", dtype="<i4", shape=[n], loc=P.shm_loc(ref))])
        plane.map_inputs(job, [])
        if client.name not in plane._pinned:
            pytest.skip(f"the driver refused to pin the client's segment: {plane.pins.failures()}")
        _backlog(torch, plane.stream)
        (out,) = plane.run([job])
        a[:] = 9  # the client reuses its slot once told FINAL
        plane.stream.synchronize()
        assert bool((out["y"] == 2).all()), "the upload read the client's slot after run returned"
        del out, job


def test_an_error_reply_of_a_request_that_never_ran_does_not_wait_for_the_stream(torch, plane):
    from broker import protocol as P

    # One of the plane's own slots as the input (a process views its own pool directly).
    t = plane.pool.alloc((1024,), np.float32)
    loc = P.cuda_loc(plane.pool.hand_off(t, stream=plane.stream, holder_pid=os.getpid()))
    job = _job([P.TensorRef(name="x", dtype="<f4", shape=[1024], loc=loc)])
    plane.map_inputs(job, [])
    assert job.cuda_in
    _backlog(torch, plane.stream)
    plane.finish_reads(job)  # answered before it ran (a 429 bounce, a RECALL, a deadline)
    assert not plane.stream.query(), "finish_reads waited for the stream for a request that never ran"
    plane.stream.synchronize()
    del job
    plane.pool.free(t)



class _Reuses(_PlusOne):
    """Fills one device buffer every call (as a captured graph's outputs), then keeps the
    stream busy, so that what follows it on the stream runs late."""

    name = "reuses"

    def __init__(self, torch):
        self.torch = torch
        self.buf = None

    def __call__(self, batch):
        x = batch["x"]
        if self.buf is None or self.buf.shape != x.shape:
            self.buf = self.torch.empty_like(x)
        self.buf.copy_(x + 1)
        self.torch.cuda._sleep(BACKLOG_CYCLES)
        return {"y": self.buf}


def test_a_host_batch_does_not_overwrite_a_device_batchs_outputs_before_they_are_copied(torch, plane):
    from broker import protocol as P
    from shm.cuda.refs import check_ref

    model = _Reuses(torch)
    plane.backend.model = model
    plane.host.backend.model = model
    on_device, on_host = _job([], reply="cuda"), _job([], reply="inline")
    on_device.inputs, on_device.refs = {"x": np.full(1024, 1, np.int32)}, {}
    on_host.inputs, on_host.refs = {"x": np.full(1024, 5, np.int32)}, {}
    (out,) = plane.run([on_device])              # queued: buf = 2, then a long kernel
    refs, _ = plane.write_outputs(on_device, out)  # the copy into the pool, after it
    del out
    (host_out,) = plane.run([on_host])           # buf = 6: must not run before that copy
    plane.stream.synchronize()
    torch.cuda.synchronize()
    assert np.asarray(host_out["y"]).tolist() == [6] * 1024
    ref = check_ref(refs[0].loc)
    got = plane.pool.view(ref, np.int32, (1024,))
    assert got.cpu().tolist() == [2] * 1024, "the device batch's output was overwritten before it was copied"
    del got
    plane.pool.free(ref)
