"""The CUDA data plane's own decisions on the CPU (gpu_worker.cuda_plane.CudaPlane): which
path a batch and its outputs take, the fallbacks to host memory, when the worker stream is
synchronised, pinning, shedding under memory pressure, and the order of closing.

The device parts are stand-ins passed to the constructor (a stream that counts its
synchronisations, a pool and an IPC cache over CPU tensors, a pinning function that records);
`HostRegistry` and `MemoryWatch` are the real ones with injected readings.  What only a GPU
can show (real IPC, stream ordering) is in tests/gpu."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CUDA plane's tensors are torch tensors (CPU ones here)")

from broker import protocol as P  # noqa: E402
from gpu_worker.cuda_plane import CudaPlane  # noqa: E402
from gpu_worker.cuda_runtime import HostRegistry, MemoryWatch  # noqa: E402
from gpu_worker.job import Job  # noqa: E402
from gpu_worker.planes import HostPlane  # noqa: E402

HOST = P.local_host_id()
POOL = f"zinf-{os.getpid()}-1-0123456789abcdef-5"  # the requester's own pool
GiB = 1 << 30


class Stream:
    device_index = 0

    def __init__(self, log):
        self.log = log
        self.syncs = 0
        self.fail = None  # raised by each synchronise (a lost CUDA context)

    def synchronize(self):
        self.syncs += 1
        self.log.append("stream.synchronize")
        if self.fail is not None:
            raise self.fail


class _Cuda:
    """The current-stream calls `shm.cuda.views.on_stream` makes, on one device."""

    OutOfMemoryError = torch.cuda.OutOfMemoryError
    default = current = "default stream"
    devices_set: list = []  # (device, thread name) of each set_device

    @classmethod
    def set_device(cls, device):
        import threading

        cls.devices_set.append((device, threading.current_thread().name))

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_device():
        return 0

    @classmethod
    def current_stream(cls, device=None):
        return cls.current

    @classmethod
    def set_stream(cls, s):
        cls.current = s


class Torch:
    """torch with its `cuda` namespace replaced (CPU tensors stand in for device ones)."""

    Tensor = torch.Tensor
    AcceleratorError = torch.AcceleratorError
    from_numpy = staticmethod(torch.from_numpy)
    empty = staticmethod(torch.empty)
    cuda = _Cuda


class Pool:
    """Device pool of `slots` CPU tensors."""

    name = "zinf-2-2-fedcba9876543210-5"

    def __init__(self, log, slots=4):
        self.log = log
        self.slots = slots
        self.live: list = []
        self.freed: list = []
        self.handed: list = []
        self.reclaims = 0

    def try_alloc(self, shape, dtype):
        if len(self.live) >= self.slots:
            return None
        t = torch.from_numpy(np.zeros(shape, dtype))
        self.live.append(t)
        return t

    def reclaim(self):
        self.reclaims += 1
        return 0

    def free(self, t):
        self.freed.append(t)
        self.live = [x for x in self.live if x is not t]

    def hand_off(self, t, *, stream=None, holder_pid=None, holder_start=None):
        i = next(k for k, x in enumerate(self.live) if x is t)
        self.handed.append((i, holder_pid))
        return P.device_ref(P.CudaLoc(pool=self.name, offset=i * 4096, nbytes=t.numel() * t.element_size(),
                                      device=0, handle=b"h" * 64, event=b"e" * 64, slot=i, generation=1))

    def close(self):
        self.log.append("pool.close")


class Cache:
    """IPC cache: descriptors name tensors the test put in `tensors`."""

    def __init__(self, log):
        self.log = log
        self.tensors: dict[int, torch.Tensor] = {}
        self.views: list = []

    def view(self, loc, dtype, shape, *, stream=None):
        self.views.append((loc.offset, stream))
        return self.tensors[loc.offset].view(torch.from_numpy(np.empty(0, dtype)).dtype).reshape(shape)

    def poll(self):
        self.log.append("cache.poll")

    def sweep(self):
        self.log.append("cache.sweep")

    def close(self):
        self.log.append("cache.close")


class Backend:
    def __init__(self, log, fail=None):
        self.log = log
        self.fail = fail

    def run(self, batch):
        self.log.append("run")
        if self.fail:
            raise self.fail
        return [{"y": np.asarray(inputs["x"]) + 1} for inputs in batch]

    def run_device(self, batch, stream=None):
        self.log.append("run_device")
        if self.fail:
            raise self.fail
        return [{"y": (x.clone() if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))) + 1}
                for x in (inputs["x"] for inputs in batch)]


@pytest.fixture
def side():
    log: list = []
    pinned: list = []

    class Reg:
        def __init__(self, name):
            self.name = name

        def unregister(self):
            log.append(f"unpin {self.name}")

    def register(buf, readonly=None):
        pinned.append(readonly)
        return Reg(len(pinned))

    host = HostPlane(Backend(log), host=HOST, out_capacity=1 << 20, out_slots=8)
    free = [8 * GiB]
    mem = MemoryWatch(8, min_free_bytes=1 * GiB, interval=0.0, mem_info=lambda: (free[0], 16 * GiB))
    plane = CudaPlane(host, torch=Torch, stream=Stream(log), pool=Pool(log), cache=Cache(log),
                      pins=HostRegistry(register=register), mem=mem, device_path=True)
    plane.test_log, plane.test_pinned, plane.test_free = log, pinned, free
    yield plane
    if not getattr(plane, "test_closed", False):
        plane.close()


def _cuda_ref(plane, value: np.ndarray, offset: int = 0, name: str = "x") -> P.TensorRef:
    plane.cache.tensors[offset] = torch.from_numpy(value.copy().view(np.uint8).reshape(-1))
    loc = P.CudaLoc(pool=POOL, offset=offset, nbytes=value.nbytes, device=0, slot=0, generation=1)
    return P.TensorRef(name=name, dtype=value.dtype.str, shape=list(value.shape), loc=loc)


def _job(tensors, *, reply="auto", host=HOST, pid=os.getpid()) -> Job:
    return Job(P.token_envelope(1), P.Request(id=1, host=host, pid=pid, reply=reply, tensors=tensors),
               None, None, 0.0, None, None)


def test_advertises_cuda_and_pins_the_output_ring(side):
    assert side.transports == ("inline", "shm", "cuda")
    assert side.test_pinned == [None]                    # the output ring, writable
    assert side.host.inputs.on_forget == side._unpin  # unpinned before a mapping goes


def test_cuda_inputs_are_viewed_on_the_worker_stream(side):
    x = np.arange(6, dtype=np.int32)
    job = _job([_cuda_ref(side, x)])
    side.map_inputs(job, [])
    assert job.cuda_in and isinstance(job.inputs["x"], torch.Tensor)
    assert side.cache.views == [(0, side.stream)] and side.stream.syncs == 0  # no host wait
    np.testing.assert_array_equal(job.inputs["x"].numpy(), x)


def test_a_numpy_model_gets_a_read_only_host_copy_of_cuda_inputs(side):
    side.device_path = False
    job = _job([_cuda_ref(side, np.arange(4, dtype=np.float32))])
    side.map_inputs(job, [])
    arr = job.inputs["x"]
    assert isinstance(arr, np.ndarray) and not arr.flags.writeable and side.stream.syncs == 1
    assert job.cuda_in


def test_cuda_inputs_from_another_host_are_refused(side):
    job = _job([_cuda_ref(side, np.zeros(2, np.uint8))], host="elsewhere/0")
    with pytest.raises(P.ProtocolError, match="another host"):
        side.map_inputs(job, [])
    assert not job.cuda_in and job.inputs is None


@pytest.mark.parametrize("pid", [None, 1, os.getpid() + 1], ids=["none", "1", "another"])
def test_cuda_inputs_of_a_pool_the_requester_does_not_own_are_refused(side, pid):
    job = _job([_cuda_ref(side, np.zeros(2, np.uint8))], pid=pid)
    with pytest.raises(P.ProtocolError, match="attest|does not own") as e:
        side.map_inputs(job, [])
    assert POOL not in str(e.value) and not job.cuda_in and side.cache.views == []  # nothing opened


def test_client_segments_are_pinned_read_only_once(side):
    import shm

    with shm.ShmPool(1 << 20) as client:
        refs = []
        for i in range(2):
            a = client.alloc((4,), np.uint8)
            ref = client.ref_of(a)
            client.mark_in_flight(ref)
            refs.append(P.TensorRef(name=f"x{i}", dtype="|u1", shape=[4], loc=P.shm_loc(ref)))
        side.map_inputs(_job(refs), [])
        assert side.test_pinned == [None, True]
        del side.test_log[:]
        side.host.inputs.forget(client.name)
        # Uploads from those pages still queued on the stream (a batch on the offload
        # thread) are done before the pages are unregistered.
        assert side.test_log == ["stream.synchronize", "unpin 2"] and side._pinned == {}


def test_a_refused_pin_holds_no_budget(side):
    import shm

    def refuse(buf, readonly=None):
        raise ValueError("the driver says no")

    side.pins._register = refuse
    with shm.ShmPool(1 << 20) as client:
        a = client.alloc((4,), np.uint8)
        ref = client.ref_of(a)
        client.mark_in_flight(ref)
        job = _job([P.TensorRef(name="x", dtype="|u1", shape=[4], loc=P.shm_loc(ref))])
        side.map_inputs(job, [])
        assert job.inputs["x"].tolist() == [0, 0, 0, 0] or job.inputs["x"].shape == (4,)  # read unpinned
        assert side._pinned == {} and client.name in side.pins.failures()
        del side.test_log[:]
        side.host.inputs.forget(client.name)
        assert "stream.synchronize" not in side.test_log  # nothing pinned: nothing to wait for


def test_pinning_stops_at_its_budget(side, monkeypatch):
    # Pinning faults in a whole segment: past the budget, client segments are read unpinned.
    import shm
    from gpu_worker import cuda_plane

    with shm.ShmPool(1 << 20) as a, shm.ShmPool(1 << 20) as b:
        monkeypatch.setattr(cuda_plane, "PIN_BUDGET_BYTES", a.data_offset + a.capacity)
        for pool in (a, b):
            x = pool.alloc((4,), np.uint8)
            ref = pool.ref_of(x)
            pool.mark_in_flight(ref)
            side.map_inputs(_job([P.TensorRef(name="x", dtype="|u1", shape=[4], loc=P.shm_loc(ref))]), [])
        assert side.test_pinned == [None, True] and list(side._pinned) == [a.name]


def test_a_batch_with_cuda_inputs_or_device_replies_runs_on_the_device(side):
    on_host = _job([])
    on_host.inputs = {"x": np.ones(2, np.int32)}
    side.run([on_host])
    wants_device = _job([], reply="cuda")
    wants_device.inputs = {"x": np.ones(2, np.int32)}
    side.run([on_host, wants_device])
    # (on_host's outputs go through host memory: the run waits for the model)
    assert side.test_log[-3:] == ["run", "run_device", "stream.synchronize"]
    side.device_path = False
    side.run([wants_device])
    assert side.test_log[-1] == "run"


def test_a_host_batch_runs_on_the_worker_stream_too(side):
    """A batch without CUDA inputs or device replies (`backend.run`, which waits for its own
    kernels) is queued on the worker stream as well: on the thread's default stream it was
    unordered with a device batch still queued on the worker stream (no event between),
    and a model that fills the same device buffer every call overwrote that batch's outputs
    before they were copied out.  (It ran on "default stream": this test failed so.)"""
    seen = []
    real = side.backend.run

    def run(batch):
        seen.append(_Cuda.current)
        return real(batch)

    side.backend.run = run
    job = _job([])
    job.inputs = {"x": np.ones(2, np.int32)}
    (out,) = side.run([job])
    assert seen == [side.stream] and _Cuda.current == _Cuda.default
    assert out["y"].tolist() == [2, 2]


def test_a_device_batch_with_host_replies_waits_for_the_model_inside_its_run(side):
    """`run` is the batch's compute window (heartbeats go from their own thread meanwhile):
    a device batch whose outputs go back through host memory waits for its kernels there,
    not later on the loop's thread in `_to_host`, heartbeat-less.  One whose replies all stay
    on the device does not wait at all."""
    x = np.ones(2, np.int32)
    on_device = _job([_cuda_ref(side, x)], reply="cuda")
    to_host = _job([_cuda_ref(side, x, offset=4096)], reply="inline")
    for job in (on_device, to_host):
        side.map_inputs(job, [])
    side.run([on_device])
    assert side.test_log[-1] == "run_device" and side.stream.syncs == 0
    side.run([on_device, to_host])
    assert side.test_log[-2:] == ["run_device", "stream.synchronize"] and side.stream.syncs == 1


def test_a_device_batch_reading_a_pinned_client_segment_waits_for_its_upload_inside_its_run(side):
    """An input in a client segment we pinned is uploaded by a DMA queued on the worker
    stream, straight from the client's slot, which the client reuses once told FINAL: a
    batch whose replies all stay on the device waits for it inside its run (the compute
    window).  It did not: FINAL went before the DMA (queued behind earlier batches) ran,
    and the request read the client's next data (this test saw no synchronise)."""
    import shm

    with shm.ShmPool(1 << 20) as client:
        a = client.alloc((2,), np.int32)
        ref = client.ref_of(a)
        client.mark_in_flight(ref)
        job = _job([P.TensorRef(name="x", dtype="<i4", shape=[2], loc=P.shm_loc(ref))], reply="cuda")
        side.map_inputs(job, [])
        assert client.name in side._pinned
        side.run([job])
        assert side.test_log[-2:] == ["run_device", "stream.synchronize"] and side.stream.syncs == 1
        # Not for CUDA inputs (ordered by the reply's events), nor for an unpinned segment
        # (the driver stages a pageable upload before the copy call returns).
        on_device = _job([_cuda_ref(side, np.ones(2, np.int32))], reply="cuda")
        side.map_inputs(on_device, [])
        side.run([on_device])
        side._pinned.clear()
        side.run([job])
        assert side.stream.syncs == 1


def test_an_out_of_memory_batch_halves_the_batch_cap(side):
    side.backend.fail = torch.cuda.OutOfMemoryError("CUDA out of memory")
    job = _job([])
    job.inputs = {"x": np.ones(2, np.int32)}
    assert side.batch_limit(8) == 8
    with pytest.raises(torch.cuda.OutOfMemoryError):
        side.run([job])
    assert side.mem.cap == 4
    side.test_free[0] = 15 * GiB  # plenty again: the cap doubles back on the next reading
    assert side.batch_limit(8) == 8


def test_memory_pressure_sheds_new_requests_with_a_reason(side):
    assert side.admit() is None
    side.test_free[0] = GiB // 4  # far below the 1 GiB threshold
    why = side.admit()
    assert why is not None and "GPU memory pressure" in why
    assert side.batch_limit(8) == 1


def test_device_replies_stay_in_the_pool_handed_to_the_client(side):
    job = _job([], reply="cuda")
    refs, frames = side.write_outputs(job, {"y": torch.arange(3, dtype=torch.int16), "z": np.ones(2, np.float32)})
    assert frames == [] and [r.name for r in refs] == ["y", "z"]
    assert all(type(r.loc) is P.CudaLoc for r in refs) and refs[0].dtype == "<i2" and refs[1].dtype == "<f4"
    assert side.pool.handed == [(0, os.getpid()), (1, os.getpid())]
    torch.testing.assert_close(side.pool.live[0], torch.arange(3, dtype=torch.int16))
    assert _Cuda.current == _Cuda.default  # the copies ran under on_stream, which put the stream back


def test_on_stream_puts_the_previous_stream_back(side):
    from shm.cuda.views import on_stream

    with pytest.raises(KeyError), on_stream(Torch, side.stream):
        assert _Cuda.current is side.stream
        with on_stream(Torch, None):
            assert _Cuda.current is side.stream
        raise KeyError("inside")
    assert _Cuda.current == _Cuda.default


def test_a_full_device_pool_degrades_to_host_memory(side):
    side.pool.slots = 1
    job = _job([], reply="cuda")
    job.inputs, job.refs = {}, {}
    # 8 KiB each: above P.SMALL_INLINE_BYTES, so the host fallback is the output ring, not inline
    refs, frames = side.write_outputs(job, {"y": torch.arange(4096, dtype=torch.int16), "z": torch.ones(2048)})
    assert side.pool.reclaims == 1 and len(side.pool.freed) == 1 and side.pool.live == []  # nothing half-sent
    assert all(type(r.loc) is P.ShmLoc for r in refs) and frames == []
    assert side.stream.syncs == 1  # host outputs are complete before FINAL


def test_host_replies_are_fetched_then_the_stream_synchronised(side):
    job = _job([], reply="inline")
    job.inputs, job.refs = {}, {}
    refs, frames = side.write_outputs(job, {"y": torch.arange(4, dtype=torch.int32)})
    assert side.stream.syncs == 1 and side.pool.handed == []
    assert type(refs[0].loc) is P.InlineLoc and bytes(frames[0]) == np.arange(4, dtype=np.int32).tobytes()
    # "auto" without CUDA inputs is a host reply too; a numpy-only output needs no sync.
    side.write_outputs(_job([]), {"y": np.arange(2)})
    assert side.stream.syncs == 1 and side.pool.handed == []


def test_an_error_reply_waits_for_queued_reads_of_cuda_inputs_only(side):
    job = _job([])
    side.finish_reads(job)
    assert side.stream.syncs == 0
    job.cuda_in = job.device_ran = True
    side.finish_reads(job)
    assert side.stream.syncs == 1


def test_an_error_reply_of_a_request_that_never_ran_does_not_wait_for_the_stream(side):
    """Mapping a CUDA input queues an event wait on the worker stream, no read: a request
    answered before it ran (a 429 bounce, a RECALL, a deadline, while another's batch runs
    on the compute thread) has nothing to wait for.  It waited for the whole running batch,
    on the loop's thread, heartbeat-less (this test saw one synchronise before the run)."""
    job = _job([_cuda_ref(side, np.ones(2, np.int32))], reply="cuda")
    side.map_inputs(job, [])
    side.finish_reads(job)
    assert job.cuda_in and side.stream.syncs == 0
    side.backend.fail = RuntimeError("the model failed")
    with pytest.raises(RuntimeError):
        side.run([job])  # its reads were queued before the model raised
    side.finish_reads(job)
    assert side.stream.syncs == 1


def test_housekeeping_polls_sweeps_and_reclaims_and_never_raises(side, caplog):
    side.housekeeping()
    assert side.test_log[-2:] == ["cache.poll", "cache.sweep"] and side.pool.reclaims == 1

    def boom():
        raise RuntimeError("driver hiccup")

    side.cache.poll = boom
    side.housekeeping()
    assert "CUDA pool housekeeping failed" in caplog.text


def test_close_synchronises_closes_the_cache_unpins_then_closes_the_pools(side):
    del side.test_log[:]
    side.close()
    side.test_closed = True
    assert side.test_log == ["stream.synchronize", "cache.close", "unpin 1", "pool.close"]
    assert side.host.out_pool is not None
    with pytest.raises(Exception):
        side.host.out_pool.try_alloc((1,), np.uint8)  # the host plane was closed too


def test_usage_reports_the_device_pool_and_device_memory(side):
    """What a CUDA worker's STATS carry (broker.metrics: zmq_infer_cuda_pool_* and
    zmq_infer_gpu_memory_*): the host ring's use, the device pool's live bytes and capacity,
    and the memory watch's last cudaMemGetInfo reading (None until it took one)."""
    from shm.cuda import CudaPool
    from tests.shm.cuda_fake import FakeCudaRuntime

    out = side.usage()
    assert out["shm_capacity"] == side.host.out_pool.capacity and out["shm_used"] == 0
    # The stand-in pool has no book: not reported, and the report does not fail.
    assert out["cuda_used"] is None and out["cuda_capacity"] is None
    assert out["device_used"] is None and out["device_total"] is None  # no reading yet
    side.admit()  # the memory watch reads: 8 of 16 GiB free
    side.pool.close()
    side.pool = pool = CudaPool(1 << 16, slots=4, runtime=FakeCudaRuntime())  # closed with the plane
    t = pool.try_alloc((1024,), np.uint8)
    out = side.usage()
    assert (out["cuda_used"], out["cuda_capacity"]) == (1024, 1 << 16)
    assert (out["device_used"], out["device_total"]) == (8 * GiB, 16 * GiB)
    assert set(out) == {"shm_used", "shm_capacity", "cuda_used", "cuda_capacity", "device_used", "device_total"}
    P.WorkerStats(**out)  # the fields the worker's STATS header takes, as they are
    pool.free(t)
    side.test_free[0] = 12 * GiB
    side.admit()
    out = side.usage()
    assert out["cuda_used"] == 0 and out["device_used"] == 4 * GiB


class _OnWhichStream(torch.Tensor):
    """A device output (a CPU tensor here) whose copies note the stream current when they
    were queued (`_Cuda.current`, which `on_stream` sets)."""

    copied_on: list = []

    def clone(self, *args, **kwargs):
        _OnWhichStream.copied_on.append(_Cuda.current)
        return super().clone(*args, **kwargs)


def test_a_failed_batch_run_again_in_halves_copies_each_halfs_outputs_on_the_worker_stream(side):
    """`Worker._isolate` keeps a copy of each half's outputs while it runs the next half.
    Device outputs were made on the worker stream (non-blocking, no event): a copy queued
    on the thread's default stream could read them before their kernels wrote them, or
    after the next half's kernels reused their memory (the original dropped).  The copy is
    the plane's `detach`, on the worker stream.  (It was `clone()` outside on_stream: this
    test saw ["default stream", "default stream"].)"""
    from types import SimpleNamespace

    from gpu_worker.worker import ModelFailed, Worker

    class HalvesBackend:
        def run_device(self, batch, stream=None):
            if len(batch) > 1:
                raise ValueError("one of them is bad")
            return [{"y": (torch.as_tensor(np.asarray(x["x"])) + 1).as_subclass(_OnWhichStream)} for x in batch]

    side.backend = HalvesBackend()
    jobs = []
    for i in range(2):
        job = _job([], reply="cuda")
        job.inputs = {"x": np.full(2, i, np.int32)}
        jobs.append(job)
    me = SimpleNamespace(plane=side)
    me._isolate = lambda jobs, failed: Worker._isolate(me, jobs, failed)
    _OnWhichStream.copied_on = []
    outs = me._isolate(jobs, ModelFailed(ValueError("one of them is bad")))
    assert [o["y"].tolist() for o in outs] == [[1, 1], [2, 2]]
    assert _OnWhichStream.copied_on == [side.stream, side.stream]
    assert _Cuda.current == _Cuda.default  # put back after each copy


def test_the_host_planes_detach_copies_arrays_and_tensors(side):
    buf = np.arange(3)
    t = torch.arange(3)
    (out,) = side.host.detach([{"a": buf, "t": t}])
    buf[:] = 7
    t[:] = 7
    assert out["a"].tolist() == [0, 1, 2] and out["t"].tolist() == [0, 1, 2]
    assert side.host.detach([None]) == [None]  # a failed request's place as it is


# ------------------------------------------------------------------ the review's open points

def test_a_keep_warm_unit_runs_on_the_worker_stream(side):
    """A keep-warm unit (`plane.warm`) is queued on the worker stream: on the loop thread's
    default stream it was unordered with a device batch still queued there (not waited
    for), so a TensorRT engine's one context ran on two streams at once and a model that
    fills one device buffer every call could overwrite that batch's outputs.  (Before the
    fix the worker called `backend.run` itself, on "default stream".)"""
    seen = []
    real = side.backend.run

    def run(batch):
        seen.append((_Cuda.current, len(batch)))
        return real(batch)

    side.backend.run = run
    assert side.warm({"x": np.ones(2, np.int32)}) is None
    assert seen == [(side.stream, 1)] and _Cuda.current == _Cuda.default


def _accelerator_error(code=700, text="an illegal memory access was encountered"):
    e = torch.AcceleratorError(f"CUDA error: {text}\nSearch for `cudaErrorIllegalAddress' ...")
    e.error_code = code
    return e


class _Lost(Exception):
    """What the stand-in for `lost_context` raises (the real one never returns)."""


@pytest.fixture
def lost(side):
    calls = []

    def fake(e):
        calls.append(e)
        raise _Lost(e)

    side.lost_context = fake
    return calls


def _host_job():
    job = _job([])
    job.inputs, job.refs = {"x": np.ones(2, np.int32)}, {}
    return job


def test_a_sticky_cuda_error_in_a_batch_ends_the_worker(side, lost):
    """An illegal memory access or a device-side assert leaves the CUDA context unusable:
    the worker went on heartbeating and answered every request 500 after `_isolate`'s
    reruns, a black hole for its service.  Now `run` ends the worker (`lost_context`,
    exit status CUDA_CONTEXT_LOST_EXIT) when torch's CUDA error comes with a stream that
    cannot be synchronised either.  (Before: the error was re-raised, `lost` stayed empty.)"""
    err = _accelerator_error()
    side.backend.fail = err
    side.stream.fail = _accelerator_error()  # every later call fails the same way
    with pytest.raises(_Lost):
        side.run([_host_job()])
    assert lost == [err] and side.mem.cap == 8
    side.cache.poll = lambda: _raise(RuntimeError("cudaEventQuery failed: CUDA error 700 (an illegal memory access)"))
    # Where device work is waited for: a device batch's fault shows at its outputs' copy or
    # download, an error reply's wait, a keep-warm unit, housekeeping.
    for step in (lambda: side.write_outputs(_job([], reply="inline"), {"y": torch.ones(2)}),
                 lambda: side.warm({"x": np.ones(2, np.int32)}),
                 lambda: side.detach([{"y": _Raising(2)}]),
                 lambda: side.finish_reads(_ran_with_cuda_inputs()),
                 side.housekeeping):
        with pytest.raises(_Lost):
            step()
    assert len(lost) == 6


def _raise(e):
    raise e


class _Raising(torch.Tensor):
    def clone(self, *args, **kwargs):
        raise _accelerator_error(710, "device-side assert triggered")


def _ran_with_cuda_inputs():
    job = _job([])
    job.cuda_in = job.device_ran = True
    return job


def test_the_sticky_error_is_also_read_from_torchs_older_runtime_error_and_shm_cudas(side, lost):
    side.stream.fail = RuntimeError("CUDA error: an illegal memory access was encountered")
    for err in (RuntimeError("CUDA error: an illegal memory access was encountered"),
                RuntimeError("cudaEventRecord failed: CUDA error 700 (an illegal memory access was encountered)")):
        side.backend.fail = err
        with pytest.raises(_Lost):
            side.run([_host_job()])
    assert len(lost) == 2


@pytest.mark.parametrize("err", [
    ValueError("CUDA error: a model's own words"),          # not a RuntimeError
    RuntimeError("the model failed"),                      # a model's own RuntimeError
    KeyError("x"),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
], ids=["value-error", "runtime-error", "key-error", "oom"])
def test_a_models_own_errors_and_out_of_memory_are_the_batchs_only(side, lost, err):
    """Never mistaken for a lost context: no probe of the stream, no exit; the error goes to
    the worker (`_isolate`, 500) as before, and out of memory still halves the cap."""
    side.backend.fail = err
    side.stream.fail = _accelerator_error()  # would say "lost" if it were asked
    with pytest.raises(type(err)):
        side.run([_host_job()])
    assert lost == [] and side.stream.syncs == 0
    assert side.mem.cap == (4 if isinstance(err, torch.cuda.OutOfMemoryError) else 8)


def test_a_cuda_error_that_leaves_the_context_usable_fails_its_batch_only(side, lost):
    """A non-sticky CUDA error (an invalid launch configuration from one input's shape):
    the stream still synchronises, so the request fails alone (500) and the worker stays.
    Ending the worker there would let one input take a worker on every retry."""
    side.backend.fail = _accelerator_error(9, "invalid configuration argument")
    with pytest.raises(torch.AcceleratorError):
        side.run([_host_job()])
    assert lost == [] and side.stream.syncs == 1  # asked once: it answered


LOST_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from broker import protocol as P
import gpu_worker.cuda_plane as cp
from broker.protocol.logs import setup_logging
from tests.gpu_worker import test_cuda_plane as t

setup_logging("WARNING", "text", "worker")
log = []
host = cp.HostPlane(t.Backend(log, fail=t._accelerator_error()), host=t.HOST, transports=("inline",))
stream = t.Stream(log)
stream.fail = t._accelerator_error()
plane = cp.CudaPlane(host, torch=t.Torch, stream=stream, pool=t.Pool(log), cache=t.Cache(log),
                     pins=cp.HostRegistry(register=lambda b, readonly=None: None),
                     mem=cp.MemoryWatch(8, mem_info=lambda: (1 << 33, 1 << 34)), device_path=True)
job = t._job([])
job.inputs, job.refs = {"x": np.ones(2, np.int32)}, {}
try:
    plane.run([job])
except BaseException as e:
    print("survived:", repr(e), flush=True)
sys.exit(0)
"""


def test_a_lost_context_ends_the_process_with_its_status_and_says_why(tmp_path):
    """The real `lost_context`, in a process of its own: exit status 70 (a crash to the
    launcher, which restarts the worker), the reason on stderr, nothing after it runs."""
    import subprocess
    import sys

    from gpu_worker.cuda_plane import CUDA_CONTEXT_LOST_EXIT

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", LOST_CHILD, root], capture_output=True, text=True, timeout=60,
                       cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert p.returncode == CUDA_CONTEXT_LOST_EXIT == 70, (p.returncode, p.stdout, p.stderr)
    assert "survived" not in p.stdout
    assert "CUDA context lost (AcceleratorError: CUDA error: an illegal memory access" in p.stderr
    assert "exiting with status 70" in p.stderr


def test_the_workers_device_is_made_current_on_each_thread_that_runs_a_batch(side):
    """shm.cuda's runtime switches to a pool's device and back to the thread's previous one
    with a raw cudaSetDevice: with no device set that was 0, so a worker on cuda:N made a
    context on GPU 0 at each pool call.  The plane makes its device current on the thread
    that makes it (the loop's) and on the compute thread at its first batch, once each.
    (Before: set_device was never called.)"""
    import threading

    _Cuda.devices_set = []
    plane = CudaPlane(side.host, torch=Torch, stream=side.stream, pool=side.pool, cache=side.cache,
                      pins=side.pins, mem=side.mem, device_path=True, device_index=3)
    here = threading.current_thread().name
    assert _Cuda.devices_set == [(3, here)]
    plane.run([_host_job()])
    assert _Cuda.devices_set == [(3, here)]  # once a thread
    t = threading.Thread(target=lambda: [plane.run([_host_job()]) for _ in range(2)], name="compute")
    t.start()
    t.join(10)
    assert not t.is_alive() and _Cuda.devices_set == [(3, here), (3, "compute")]


def test_open_makes_the_device_current_before_the_pool_is_made(monkeypatch):
    """`CudaPlane.open` (real torch and shm.cuda, their device calls replaced): set_device
    with the configured index comes before the pool's cudaMalloc."""
    import shm.cuda

    order = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: order.append(("set_device", i)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: order.append(("stream", device)) or Stream([]))

    class FakePool:
        name = "zinf-fake"

        def __init__(self, capacity, device=0, slots=0):
            order.append(("pool", device))

        def close(self):
            pass

    class FakeCache:
        def __init__(self, local=None):
            pass

        def close(self):
            pass

    monkeypatch.setattr(shm.cuda, "CudaPool", FakePool)
    monkeypatch.setattr(shm.cuda, "CudaPoolCache", FakeCache)
    host = HostPlane(Backend([]), host=HOST, transports=("inline",))
    model = type("M", (), {"framework": "numpy"})()
    plane = CudaPlane.open(host, model, device="cuda:2", max_batch=4)
    try:
        assert order[0] == ("set_device", 2) and ("pool", 2) in order
        assert plane.device_index == 2
    finally:
        plane.pins.close()
        host.close()


class _TorchOnAStream:
    """torch, with the `cuda` namespace of these tests, whose `as_tensor` notes the stream
    current when it runs (`on_stream` sets `_Cuda.current`)."""

    cuda = _Cuda
    uploads: list = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def as_tensor(self, *args, **kwargs):
        _TorchOnAStream.uploads.append(_Cuda.current)
        return torch.as_tensor(*args, **kwargs)


def test_run_device_uploads_an_output_that_is_not_a_tensor_on_the_given_stream():
    """`TorchBackend.run_device` turns a model's non-tensor output into a device tensor; it
    did so after the `on_stream` block, on the thread's default stream, so its memory came
    from the default stream's pool of torch's caching allocator and was read on the worker
    stream without record_stream.  (This test saw ["default stream"].)"""
    from gpu_worker.backends import TorchBackend

    class Lists:
        name = "lists"
        framework = "torch"
        batchable = True
        streaming = False
        inputs = outputs = None

        def __call__(self, batch):
            return {"y": (batch["x"] + 1).tolist(), "z": batch["x"] * 2}

        def example_inputs(self):
            return {"x": np.ones(2, np.int32)}

    be = TorchBackend(Lists(), "cpu")
    be._torch, be._cuda = _TorchOnAStream(), True  # a CUDA backend, on CPU tensors
    stream = Stream([])
    _TorchOnAStream.uploads = []
    (out,) = be.run_device([{"x": np.arange(3, dtype=np.int32)}], stream=stream)
    assert _TorchOnAStream.uploads == [stream] and _Cuda.current == _Cuda.default
    assert out["y"].tolist() == [1, 2, 3] and out["z"].tolist() == [0, 2, 4]
