"""The CUDA wiring of the worker and the SDK, checked without a GPU: flags, typed errors,
the host fallbacks, and the small shm/protocol surfaces they rely on."""
from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest

import shm
from broker import protocol as P
from shm.cuda import cuda_status

HAVE_CUDA, WHY = cuda_status()
no_cuda = pytest.mark.skipif(HAVE_CUDA, reason="CUDA is available here; these check the CPU-only behaviour")


# ------------------------------------------------------------------ protocol

def test_reply_mode_cuda_is_valid_and_unknown_modes_are_not():
    assert "cuda" in P.REPLY_MODES
    req = P.decode_request(P.encode_header(P.Request(id=1, reply="cuda")))
    assert req.reply == "cuda"
    with pytest.raises(P.ProtocolError, match="reply mode"):
        P.decode_request(P.encode_header(P.Request(id=1, reply="pigeon")))


# ------------------------------------------------------------------ shm accessors

def _in_flight(pool, n=16):
    a = pool.alloc((n,), np.uint8)
    a[:] = 7
    ref = pool.ref_of(a)
    pool.mark_in_flight(ref)
    return ref


def test_segment_cache_mapping_and_forget_hook():
    forgotten = []
    with shm.ShmPool(1 << 20) as p1, shm.ShmPool(1 << 20) as p2:
        assert p1.mapping is not None and len(p1.mapping) > 0
        r1, r2 = _in_flight(p1), _in_flight(p2)
        cache = shm.SegmentCache(max_segments=1, on_forget=forgotten.append)
        assert cache.mapping(r1.segment) is None  # not mapped yet
        v = cache.view(r1, np.uint8, (16,))
        mm = cache.mapping(r1.segment)
        assert mm is not None and len(mm) >= 16 and int(v[0]) == 7
        cache.view(r2, np.uint8, (16,))  # LRU evicts the first segment: hook first
        assert forgotten == [r1.segment] and cache.mapping(r1.segment) is None
        cache.forget("not-mapped")  # no hook for what was never mapped
        assert forgotten == [r1.segment]
        cache.close()
        assert forgotten == [r1.segment, r2.segment]
        del v


def test_segment_cache_forget_hook_failure_still_unmaps():
    def boom(name):
        raise RuntimeError("hook failed")

    with shm.ShmPool(1 << 20) as p:
        r = _in_flight(p)
        cache = shm.SegmentCache(on_forget=boom)
        cache.view(r, np.uint8, (16,))
        cache.forget(r.segment)
        assert r.segment not in cache
        cache.close()


def test_segment_cache_sweep_calls_the_hook_for_closed_segments():
    seen = []
    p = shm.ShmPool(1 << 20)
    r = _in_flight(p)
    cache = shm.SegmentCache(on_forget=seen.append)
    cache.view(r, np.uint8, (16,))
    p.close()
    assert cache.sweep() == [r.segment] and seen == [r.segment]
    cache.close()


# ------------------------------------------------------------------ backends and flags

def test_make_backend_tensorrt_unavailable_says_why():
    pytest.importorskip("torch", reason="convnet, the model asked for, is a torch model")
    from gpu_worker import trt
    from gpu_worker.backends import TENSORRT_MISSING, BackendUnavailable, make_backend
    from gpu_worker.models import load_model

    ok, why = trt.available()
    if ok:
        pytest.skip("TensorRT is usable here")
    with pytest.raises(BackendUnavailable) as info:
        make_backend(load_model("convnet", "cpu"), "cpu", "tensorrt", max_batch=4)
    if importlib.util.find_spec("tensorrt") is None:
        assert str(info.value) == TENSORRT_MISSING
    else:
        assert why in str(info.value)


def test_worker_backend_flag(capsys, tmp_path):
    from gpu_worker.__main__ import main

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed: the flag would try to build an engine")
    rc = main(["--broker", f"ipc://{tmp_path}/none.ipc", "--model", "echo", "--device", "cpu",
               "--backend", "tensorrt", "--no-warmup"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "backend 'tensorrt' is unavailable" in err and "TensorRT is not installed" in err
    with pytest.raises(SystemExit):
        main(["--backend", "onnxruntime"])


def test_cpu_worker_has_no_cuda_side(tmp_path):
    from gpu_worker.planes import HostPlane
    from gpu_worker.worker import Worker, WorkerConfig

    cfg = WorkerConfig(broker=f"ipc://{tmp_path}/none.ipc", device="cpu", warmup=False)
    assert cfg.backend == "auto"
    with Worker(cfg) as w:
        assert w.cuda is False and "cuda" not in w.transports
        assert type(w.plane) is HostPlane  # the CUDA plane (pools, stream, IPC cache) was never built


def test_run_device_matches_run_on_cpu():
    torch = pytest.importorskip("torch", reason="run_device is the torch backend's")

    from gpu_worker.backends import BackendError, TorchBackend, make_backend
    from gpu_worker.models import load_model

    model = load_model("tests.e2e.cuda_models:make_exact", "cpu")
    be = make_backend(model, "cpu")
    assert isinstance(be, TorchBackend)
    rng = np.random.default_rng(0)
    reqs = [{"x": rng.integers(-1000, 1000, (4, 8), dtype=np.int32),
             "f": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(3)]
    host = be.run(reqs)
    # torch tensors and numpy arrays may be mixed: CUDA IPC views next to shm inputs
    dev = be.run_device([reqs[0], {k: torch.from_numpy(v) for k, v in reqs[1].items()}, reqs[2]])
    assert len(dev) == 3
    for h, d in zip(host, dev):
        assert set(h) == set(d) == {"y", "g", "same"}
        for k in h:
            assert isinstance(d[k], torch.Tensor)
            np.testing.assert_array_equal(d[k].numpy(), h[k])
    with pytest.raises(BackendError, match="torch models"):
        make_backend(load_model("echo", "cpu"), "cpu", "torch").run_device([{"x": np.zeros(2)}])


# ------------------------------------------------------------------ client SDK

@no_cuda
def test_alloc_cuda_without_cuda_is_a_typed_error(tmp_path):
    from client_sdk import AsyncClient, Client, InferenceError
    from client_sdk.errors import NotSupported

    with Client(f"ipc://{tmp_path}/none.ipc") as c:
        with pytest.raises(NotSupported, match="CUDA tensors cannot be used by this client") as ei:
            c.alloc_cuda((2, 3), np.float32)
        assert isinstance(ei.value, InferenceError) and ei.value.code is None
        assert "CPU-only" in str(ei.value) or "no CUDA device" in str(ei.value) or "torch" in str(ei.value)
        assert c._core._cuda is None  # nothing half-built stays behind

    async def go():
        async with AsyncClient(f"ipc://{tmp_path}/none.ipc") as ac:
            with pytest.raises(NotSupported, match="CUDA"):
                ac.alloc_cuda((4,), "uint8")

    asyncio.run(go())


def test_cuda_outputs_without_a_cuda_side_are_a_typed_error():
    from client_sdk import tensors as T
    from client_sdk.errors import NotSupported

    loc = P.CudaLoc(pool="zinf-1-1-0123456789abcdef-5", offset=0, nbytes=4, device=0, slot=0, generation=0)
    rep = P.Reply(id=1, tensors=[P.TensorRef(name="y", dtype="<f4", shape=[1], loc=loc)])
    leases = T.OutputLeases()
    with pytest.raises(NotSupported, match="no CUDA side"):
        T.unpack(rep, [], leases, final=True)
    T.release_reply(rep, leases)  # nothing to release without a cache: no error
    leases.close()


# ------------------------------------------------------------------ keep-warm by device

def _cuda_like_plane(host, model, *, device, max_batch, **_):
    """`CudaPlane.open` without a GPU: the real CudaPlane around the worker's HostPlane, its
    device parts stand-ins (a stream, an output pool and an IPC cache that only close,
    pinning that records nothing, memory readings of an idle 16 GiB device)."""
    from gpu_worker.cuda_plane import CudaPlane
    from gpu_worker.cuda_runtime import HostRegistry, MemoryWatch

    class Part:
        name = "zinf-2-2-fedcba9876543210-5"
        device_index = 0

        def synchronize(self):
            pass

        def close(self):
            pass

    class Pinned:
        def unregister(self):
            pass

    class Cuda:  # what the plane asks of torch.cuda: its device made current, the current stream
        OutOfMemoryError = MemoryError
        current = None

        @staticmethod
        def set_device(index):
            pass

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
        cuda = Cuda

    return CudaPlane(host, torch=Torch, stream=Part(), pool=Part(), cache=Part(),
                     pins=HostRegistry(register=lambda buf, readonly=None: Pinned()),
                     mem=MemoryWatch(max_batch, mem_info=lambda: (8 << 30, 16 << 30)), device_path=False)


@pytest.fixture
def cuda_like(monkeypatch):
    """Workers built here on "cuda:0" get the CUDA plane above: the device resolves as if a
    GPU were there, everything else is the worker's own construction."""
    from gpu_worker import devices
    from gpu_worker.cuda_plane import CudaPlane

    real = devices.resolve_device
    monkeypatch.setattr(devices, "resolve_device", lambda spec: "cuda:0" if spec == "cuda:0" else real(spec))
    monkeypatch.setattr(CudaPlane, "open",
                        classmethod(lambda cls, host, model, **kw: _cuda_like_plane(host, model, **kw)))


@pytest.mark.parametrize("keep_warm, period", [(None, 0.05), (0.0, None), (0.02, 0.02)])
def test_keep_warm_is_on_by_default_on_a_cuda_worker(cuda_like, tmp_path, keep_warm, period):
    from gpu_worker.cuda_plane import CudaPlane
    from gpu_worker.keepwarm import KEEP_WARM_AUTO_PERIOD
    from gpu_worker.worker import Worker, WorkerConfig

    assert KEEP_WARM_AUTO_PERIOD == 0.05  # docs/gpu.md, --keep-warm-ms: "default: 50 on a CUDA device"
    cfg = WorkerConfig(broker=f"ipc://{tmp_path}/none.ipc", model="echo", device="cuda:0", warmup=False,
                       out_capacity=1 << 20, keep_warm=keep_warm)
    with Worker(cfg) as w:
        assert w.cuda and w.device == "cuda:0" and isinstance(w.plane, CudaPlane) and "cuda" in w.transports
        assert w.keep_warm.period == period
        assert w.keep_warm.enabled is (period is not None)
        assert w.keep_warm_runs == 0  # nothing ran before serving


@pytest.mark.parametrize("keep_warm, period", [(None, None), (0.02, 0.02)])
def test_keep_warm_is_off_by_default_on_a_cpu_worker(tmp_path, keep_warm, period):
    from gpu_worker.worker import Worker, WorkerConfig

    cfg = WorkerConfig(broker=f"ipc://{tmp_path}/none.ipc", model="echo", device="cpu", warmup=False,
                       out_capacity=1 << 20, keep_warm=keep_warm)
    with Worker(cfg) as w:
        assert not w.cuda
        assert w.keep_warm.period == period
        assert w.keep_warm.enabled is (period is not None)
