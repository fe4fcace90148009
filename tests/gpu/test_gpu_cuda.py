"""Tests that need an NVIDIA GPU (marked ``gpu``; skipped with the reason elsewhere).

Two real processes for CUDA IPC (bit-exact both ways, release without a round trip, a dead
importer's slots reclaimed), cudaHostRegister of shm segments (writable owner mapping and
read-only reader mapping), CUDA graphs and copy/compute overlap against eager results, the
memory watch on a real device, and a TensorRT engine build where TensorRT is importable.
Children talk line by line over pipes and are killed and reaped in ``finally``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shm.cuda import cuda_status
from tests.children import read_rest_within, readline_within

HAVE_CUDA, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason=f"needs a CUDA device: {WHY}")]
ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, torch
from broker import protocol as P
from shm.cuda import CudaPool, CudaPoolCache
torch.cuda.init()
pool = CudaPool(64 << 20, device=0, slots=64)
cache = CudaPoolCache()
stream = torch.cuda.Stream()
held = []
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "echo":
        req = P.decode_request(bytes.fromhex(arg))
        outs = []
        with torch.cuda.stream(stream):
            for t in req.tensors:
                dt = P.parse_dtype(t.dtype)
                x = cache.view(t.loc, dt, tuple(t.shape), stream=stream)
                y = pool.alloc(tuple(t.shape), dt)
                yb = y.reshape(-1).view(torch.uint8)
                yb.fill_(0xA5)
                torch.bitwise_not(x.reshape(-1).view(torch.uint8), out=yb)
                outs.append(P.TensorRef(name=t.name, dtype=t.dtype, shape=t.shape,
                                        loc=P.cuda_loc(pool.hand_off(y, stream=stream, holder_pid=req.pid))))
        print("reply", P.encode_header(P.Reply(id=req.id, tensors=outs)).hex(), "pools", len(cache), flush=True)
    elif cmd == "hold":
        req = P.decode_request(bytes.fromhex(arg))
        for t in req.tensors:
            held.append(cache.lease(t.loc, P.parse_dtype(t.dtype), tuple(t.shape)))
        torch.cuda.synchronize()
        print("held", flush=True)
    elif cmd == "reclaim":
        pool.reclaim()
        print("in_use", pool.in_use(), flush=True)
    elif cmd == "quit":
        break
cache.close()
pool.close()
print("bye", flush=True)
"""


class Child:
    def __init__(self, code: str = CHILD):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.pid = self.proc.pid

    def read(self) -> str:
        line = readline_within(self.proc.stdout, 60, "the CUDA child's next line")
        if not line:
            self.proc.wait(timeout=30)
            err = read_rest_within(self.proc.stderr, 10, "the end of the CUDA child's stderr")
            raise AssertionError(f"child exited with {self.proc.returncode}: {err[-3000:]}")
        return line.strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.fixture
def torch():
    import torch

    torch.cuda.init()
    return torch


def _rand(torch, n):
    g = torch.Generator(device="cuda:0")
    g.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0", generator=g)


CASES = [("|u1", (1080, 1920, 3)), ("<f4", (3, 257, 129)), ("<f2", (1000,)), ("<i8", (17, 33)),
         ("|b1", (4097,)), ("<f8", ()), ("|u1", (0,)), ("<c8", (5, 7))]


def test_ipc_round_trip_between_two_processes_is_bit_exact(torch):
    from broker import protocol as P
    from shm.cuda import CudaPool, CudaPoolCache

    pool = CudaPool(64 << 20, slots=64)
    cache = CudaPoolCache()
    child = Child()
    try:
        assert child.read() == "ready"
        for rnd in range(3):
            for i, (dtype, shape) in enumerate(CASES):
                dt = np.dtype(dtype)
                t = pool.alloc(shape, dt)
                n = t.numel() * t.element_size()
                src = _rand(torch, n)
                t.reshape(-1).view(torch.uint8).copy_(src)
                want = torch.bitwise_not(src)
                # The handle rides only in the first message: the child has the pool open after that.
                loc = P.cuda_loc(pool.hand_off(t, include_handle=(rnd == 0 and i == 0)))
                req = P.Request(id=i, pid=os.getpid(), tensors=[P.TensorRef(name="x", dtype=dtype, shape=list(shape), loc=loc)])
                child.send("echo " + P.encode_header(req).hex())
                words = child.read().split()
                assert words[0] == "reply" and words[3] == "1", words
                out_loc = P.decode_reply(bytes.fromhex(words[1])).tensors[0].loc
                out, fin = cache.lease(out_loc, dt, shape)
                assert out.shape == tuple(shape) and out.device.type == "cuda"
                assert torch.equal(out.reshape(-1).view(torch.uint8), want), (dtype, shape)
                ev = cache.event_of(out_loc)
                del out
                fin()
                pool.free(t, after=[ev] if ev is not None else [])
        assert len(cache) == 1  # the child's pool, opened once
        cache.sync()            # every release stored (no message was sent for any)
        child.send("reclaim")
        assert child.read() == "in_use 0"
        assert pool.in_use() == 0
    finally:
        child.close()
        cache.close()
        pool.close()


def test_lease_releases_only_after_the_last_view_is_gone(torch):
    from broker import protocol as P
    from shm.cuda import CudaPool, CudaPoolCache

    pool = CudaPool(16 << 20, slots=8)
    cache = CudaPoolCache()
    child = Child()
    try:
        assert child.read() == "ready"
        t = pool.alloc((256,), np.uint8)
        t.copy_(_rand(torch, 256))
        req = P.Request(id=1, pid=os.getpid(), tensors=[P.TensorRef(name="x", dtype="|u1", shape=[256], loc=P.cuda_loc(pool.hand_off(t)))])
        child.send("echo " + P.encode_header(req).hex())
        out_loc = P.decode_reply(bytes.fromhex(child.read().split()[1])).tensors[0].loc
        out, fin = cache.lease(out_loc, np.uint8, (256,))
        view = out[10:20]
        del out
        cache.sync()
        child.send("reclaim")
        assert child.read() == "in_use 1"  # `view` still reads the slot
        assert fin.alive
        del view
        cache.sync()
        child.send("reclaim")
        assert child.read() == "in_use 0"
    finally:
        child.close()
        cache.close()
        pool.close()


def test_dead_importer_slots_are_reclaimed(torch):
    from broker import protocol as P
    from shm import collect
    from shm.cuda import CudaPool

    pool = CudaPool(16 << 20, slots=8)
    child = Child()
    try:
        assert child.read() == "ready"
        t = pool.alloc((1024,), np.float32)
        t.fill_(1.5)
        loc = P.cuda_loc(pool.hand_off(t, holder_pid=child.pid))
        req = P.Request(id=1, pid=os.getpid(), tensors=[P.TensorRef(name="x", dtype="<f4", shape=[1024], loc=loc)])
        child.send("hold " + P.encode_header(req).hex())
        assert child.read() == "held"
        assert pool.reclaim() == 0 and pool.in_use() == 1
        os.kill(child.pid, signal.SIGKILL)
        child.proc.wait(timeout=30)
        assert pool.reclaim() == 1 and pool.in_use() == 0
        collect()  # the child's own state table
    finally:
        child.close()
        pool.close()


def test_pool_in_process(torch):
    from shm import BadDescriptor, StaleDescriptor
    from shm.cuda import CudaPool, CudaPoolCache, DevicePoolFull, check_ref

    with CudaPool(1 << 20, slots=4) as pool:
        a = pool.alloc((100,), np.float32)
        b = pool.alloc((2, 3), np.int16)
        assert a.data_ptr() - pool.base_ptr == 0 and (b.data_ptr() - pool.base_ptr) % 256 == 0
        r = pool.ref_of(a)
        assert r.nbytes == 400 and pool.ref_of(a[10:20]).offset == 40
        assert pool.ref_of(torch.zeros(3, device="cuda")) is None
        with pytest.raises(DevicePoolFull):
            pool.alloc((2 << 20,), np.uint8)
        loc = pool.hand_off(b)
        # A process views its own pool directly (it cannot open its own IPC handle).
        own = CudaPoolCache(local={pool.name: pool})
        v = own.view(loc, np.int16, (2, 3))
        assert v.data_ptr() == b.data_ptr()
        pool.free(b)
        with pytest.raises(StaleDescriptor):
            pool.free(check_ref(loc))
        with pytest.raises(BadDescriptor):
            pool.hand_off(torch.zeros(3, device="cuda"))
        own.close()


def test_host_register_shm_segments(torch):
    from gpu_worker.cuda_runtime import HostRegistry, buffer_span, register_host
    from shm import ShmPool
    from shm.segment import attach_segment, detach

    rng = np.random.default_rng()
    with ShmPool(16 << 20, slots=8, align=4096) as p:
        mm = np.frombuffer(p._mm, np.uint8)
        span = buffer_span(mm)[:2]
        del mm
        reg = register_host(span)
        try:
            src = p.alloc((1024, 1024), np.uint8)
            src[...] = rng.integers(0, 256, src.shape, dtype=np.uint8)
            t = torch.from_numpy(src)
            assert t.is_pinned()  # the driver sees the shm pages as page-locked host memory
            d = t.to("cuda", non_blocking=True)
            dst = p.alloc((1024, 1024), np.uint8)
            torch.from_numpy(dst).copy_(d.flip(0), non_blocking=True)  # D2H straight into the segment
            torch.cuda.synchronize()
            assert np.array_equal(dst, src[::-1])
            # A reader's read-only mapping needs the read-only flag.
            a = attach_segment(p.name)
            try:
                reg2 = HostRegistry()
                assert reg2.ensure(p.name, (a.data_addr, a.data_end - a.data_offset), readonly=True), reg2.failures()
                view = np.frombuffer(a.data_mm, np.uint8, src.nbytes, p.ref_of(src).offset - a.data_offset)
                tv = torch.from_dlpack(view.reshape(src.shape))
                assert tv.is_pinned()
                assert torch.equal(tv.to("cuda", non_blocking=True).cpu(), t)
                del view, tv
                reg2.close()
            finally:
                detach(a)
            del t, d
        finally:
            reg.unregister()


def test_graph_cache_matches_eager(torch):
    from gpu_worker.cuda_runtime import GraphCache
    from gpu_worker.models import load_model

    model = load_model("convnet", "cuda:0")
    with torch.inference_mode():
        x = torch.randint(0, 256, (2, 96, 128, 3), dtype=torch.uint8, device="cuda")
        want = model({"image": x})["logits"].clone()
        gc = GraphCache(model, buckets=(1, 2, 4), warmup=1)
        for _ in range(3):
            got = gc.run({"image": x})["logits"]
        assert gc.stats["captured"] == 1 and gc.stats["replayed"] == 2
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        x3 = torch.randint(0, 256, (3, 96, 128, 3), dtype=torch.uint8, device="cuda")
        for _ in range(3):
            got3 = gc.run({"image": x3})["logits"]  # bucket 4: padded
        torch.testing.assert_close(got3, model({"image": x3})["logits"], rtol=1e-3, atol=1e-3)


def test_copy_compute_overlap(torch):
    from gpu_worker.cuda_runtime import CopyComputeOverlap

    ov = CopyComputeOverlap(0)
    host = {"x": torch.arange(1 << 20, dtype=torch.float32).pin_memory()}
    st = ov.upload(host)
    c = ov.compute(st, lambda b: {"y": b["x"] * 2})
    out, ev = ov.download(c, into={"y": torch.empty(1 << 20, dtype=torch.float32).pin_memory()})
    ev.synchronize()
    assert torch.equal(out["y"], host["x"] * 2)


def test_on_stream_swaps_and_restores_the_current_stream_as_torchs_context_does(torch):
    from shm.cuda.views import on_stream

    base = torch.cuda.current_stream()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with on_stream(torch, a):
        assert torch.cuda.current_stream() == a
        with on_stream(torch, b):
            assert torch.cuda.current_stream() == b
        assert torch.cuda.current_stream() == a
        with on_stream(torch, None):
            assert torch.cuda.current_stream() == a
    assert torch.cuda.current_stream() == base
    with pytest.raises(KeyError), on_stream(torch, a):
        raise KeyError("inside")
    assert torch.cuda.current_stream() == base
    # Work queued inside runs on the stream: the same result as under torch's own context.
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    with on_stream(torch, a):
        a.wait_stream(base)
        y = x * 2
    a.synchronize()
    assert torch.equal(y, x * 2)


def test_memory_watch_on_the_device(torch):
    from gpu_worker.cuda_runtime import MemoryWatch

    w = MemoryWatch(8, min_free_bytes=1 << 20)
    assert w.limit() == 8 and w.total > 0 and not w.shedding


@pytest.mark.timeout(400)
def test_tensorrt_engine_build_and_run(torch, tmp_path):
    from gpu_worker import trt
    from gpu_worker.models import load_model

    ok, why = trt.available()
    if not ok:
        pytest.skip(why)
    model = load_model("convnet", "cuda:0")
    item = np.zeros((64, 64, 3), np.uint8)
    plan, info = trt.load_or_build(model, max_batch=2, opt_batch=2, directory=tmp_path, opt_level=1,
                                   example={"image": item})
    assert not info["cached"] and Path(info["path"]).exists()
    assert trt.load_or_build(model, max_batch=2, opt_batch=2, directory=tmp_path, example={"image": item})[1]["cached"]
    eng = trt.TensorRTEngine(plan, 0)
    with torch.inference_mode():
        x = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8, device="cuda")
        got = eng.run({"image": x})["logits"]
        torch.cuda.synchronize()
        torch.testing.assert_close(got, model({"image": x})["logits"], rtol=2e-2, atol=2e-2)
