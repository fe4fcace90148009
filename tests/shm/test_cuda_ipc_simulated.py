"""CudaPool and CudaPoolCache driven on the CPU: the device is simulated.

`require_cuda`, `runtime`, `_tensor_at` and `_on_device` are the module's seams to CUDA.
Here "device memory" is host memory, IPC handles carry its address, events complete when
the test says so, and tensors are CPU tensors over the same bytes.  Everything else -
state tables in /dev/shm, descriptors through broker.protocol, validation, leases, the
deferred release, reclaim, closing pools whose owner went away - is the real code.  What
only a GPU can show (real IPC between processes, stream ordering) is in test_gpu_cuda.py.
"""
from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest
import torch

from broker import protocol as P
from shm import BadDescriptor, SegmentGone, StaleDescriptor
from shm.cuda import ipc as ci


class FakeEvent:
    registry: dict[int, "FakeEvent"] = {}
    auto_done = True

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.records = 0
        self.done = FakeEvent.auto_done
        self.interprocess = interprocess
        FakeEvent.registry[id(self)] = self

    def record(self, stream=None):
        self.records += 1
        self.stream = stream
        self.done = FakeEvent.auto_done

    def ipc_handle(self):
        return id(self).to_bytes(8, "little").ljust(64, b"\0")

    @classmethod
    def from_ipc_handle(cls, device, handle):
        return cls.registry[int.from_bytes(bytes(handle)[:8], "little")]

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, ev):
        self.waited.append(ev)


class FakeCuda:
    Event = FakeEvent

    def __init__(self):
        self.stream = FakeStream()

    def current_stream(self, device=None):
        return self.stream

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def get_device_properties(self, i):
        raise RuntimeError("no properties in the simulation")


class FakeTorch:
    device = torch.device

    def __init__(self):
        self.cuda = FakeCuda()


class FakeRuntime:
    """Device memory = host buffers; a handle carries the address."""

    def __init__(self):
        self.blocks: dict[int, ctypes.Array] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.freed: list[int] = []

    def malloc(self, n, device):
        buf = (ctypes.c_uint8 * n)()
        addr = ctypes.addressof(buf)
        self.blocks[addr] = buf
        return addr

    def free(self, ptr, device):
        self.freed.append(ptr)

    def ipc_get_mem_handle(self, ptr, device):
        return ptr.to_bytes(8, "little").ljust(64, b"\x07")

    def ipc_open_mem_handle(self, handle, device):
        ptr = int.from_bytes(bytes(handle)[:8], "little")
        self.opened.append(ptr)
        return ptr

    def ipc_close_mem_handle(self, ptr, device):
        self.closed.append(ptr)


class _Holder:
    __slots__ = ("__array_interface__", "keep", "__weakref__")


def fake_tensor_at(ptr, shape, dt, device, keep, on_drop=None, args=()):
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n == 0:
        return torch.empty(shape, dtype=ci._torch_dtype(dt)), None
    h = _Holder()
    h.__array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "data": (ptr, False), "version": 3}
    h.keep = keep
    fin = weakref.finalize(h, on_drop, *args) if on_drop is not None else None
    # numpy keeps the holder as the array's base, torch keeps the array: the finalizer runs
    # when the last tensor view is gone, as with __cuda_array_interface__ on a device.
    return torch.from_numpy(np.asarray(h)), fin


@pytest.fixture
def sim(monkeypatch):
    ft, rt = FakeTorch(), FakeRuntime()
    FakeEvent.auto_done = True
    monkeypatch.setattr(ci, "require_cuda", lambda: ft)
    monkeypatch.setattr(ci, "runtime", lambda: rt)
    monkeypatch.setattr(ci, "_tensor_at", fake_tensor_at)
    monkeypatch.setattr(ci, "_on_device", lambda t, device: getattr(t, "device", None) is not None and t.device.type == "cpu")
    ft.rt = rt
    yield ft
    FakeEvent.registry.clear()


def test_hand_off_view_lease_release_reclaim(sim):
    owner = ci.CudaPool(1 << 20, device=0, slots=8)
    reader = ci.CudaPoolCache()
    try:
        x = owner.alloc((4, 5), np.float32)
        x.copy_(torch.arange(20, dtype=torch.float32).reshape(4, 5))
        loc = owner.hand_off(x, holder_pid=None)
        # On the wire and back, as the worker gets it.
        wire = P.decode_request(P.encode_header(P.Request(id=1, tensors=[
            P.TensorRef(name="x", dtype="<f4", shape=[4, 5], loc=loc)]))).tensors[0].loc
        ev = FakeEvent.from_ipc_handle(0, wire.event)
        assert ev.interprocess and ev.records == 1
        assert len(wire.handle) == 64 and wire.handle == owner.handle
        t, fin = reader.lease(wire, np.float32, (4, 5))
        assert torch.equal(t, x) and t.data_ptr() == x.data_ptr()  # the same bytes, no copy
        assert sim.cuda.stream.waited[-1] is ev                      # ordered after the producer
        assert sim.rt.opened == [owner.base_ptr] and wire.pool.split("/")[0] in reader
        row = t[1]
        del t
        gc.collect()
        assert reader.poll() == 0 and owner.reclaim() == 0           # a view is alive
        del row
        gc.collect()
        assert reader.poll() == 1
        assert owner.reclaim() == 1 and owner.in_use() == 0
        assert not fin.alive
        with pytest.raises(StaleDescriptor):
            reader.view(wire, np.float32, (4, 5))
    finally:
        reader.close()
        owner.close()


def test_release_waits_for_the_consumer_stream(sim):
    owner = ci.CudaPool(1 << 16, slots=4)
    reader = ci.CudaPoolCache()
    try:
        loc = owner.hand_off(owner.alloc((16,), np.uint8))
        t, fin = reader.lease(loc, np.uint8, (16,))
        FakeEvent.auto_done = False  # the consumer's kernels are still running
        fin()
        assert reader.poll() == 0 and owner.reclaim() == 0
        FakeEvent.auto_done = True
        for ev in FakeEvent.registry.values():
            if not ev.interprocess:
                ev.done = True
        assert reader.poll() == 1 and owner.reclaim() == 1
        del t
        gc.collect()
        assert reader.poll() == 0  # released once only
    finally:
        reader.close()
        owner.close()


def test_borrowed_views_never_release(sim):
    owner = ci.CudaPool(1 << 16, slots=4)
    reader = ci.CudaPoolCache()
    try:
        x = owner.alloc((8,), np.int32)
        loc = owner.hand_off(x)
        v = reader.view(loc, np.int32, (8,))
        del v
        gc.collect()
        assert reader.poll() == 0 and owner.reclaim() == 0  # inputs: the owner frees them
        pool = reader._pools[loc.pool.split("/")[0]]
        assert pool.live == 0
        owner.free(x, after=[FakeEvent()])
        assert owner.in_use() == 0 and len(sim.cuda.stream.waited) == 2
    finally:
        reader.close()
        owner.close()


def test_descriptor_checks(sim):
    owner = ci.CudaPool(4096, slots=4)
    reader = ci.CudaPoolCache()
    try:
        x = owner.alloc((64,), np.uint8)
        loc = owner.hand_off(x)
        with pytest.raises(BadDescriptor, match="bytes but the descriptor has 64"):
            reader.view(loc, np.uint8, (65,))
        r = ci.from_loc(loc)
        far = ci.to_loc(r._replace(offset=4090), handle=loc.handle, event=loc.event)
        with pytest.raises(BadDescriptor, match="outside pool"):
            reader.view(far, np.uint8, (64,))
        with pytest.raises(BadDescriptor, match="does not match"):
            reader.view(ci.to_loc(r, handle=b"\x01" * 64, event=loc.event), np.uint8, (64,))
        # Once the pool is open, a descriptor without the handle is enough.
        assert reader.view(ci.to_loc(r, event=loc.event), np.uint8, (64,)).shape == (64,)
        # Wrong generation: stale before a byte is viewed.
        with pytest.raises(StaleDescriptor):
            reader.view(ci.to_loc(r._replace(generation=5), event=loc.event), np.uint8, (64,))
        with pytest.raises(BadDescriptor, match="no torch equivalent"):
            owner.alloc((2,), "<U3")
        assert len(sim.rt.opened) == 1  # one open per pool, however many descriptors
    finally:
        reader.close()
        owner.close()


def test_empty_and_scalar_tensors(sim):
    owner = ci.CudaPool(4096, slots=4)
    reader = ci.CudaPoolCache()
    try:
        e = owner.alloc((0, 3), np.float32)
        s = owner.alloc((), np.float64)
        s.fill_(2.5)
        le = owner.hand_off(e)
        ls = owner.hand_off(s)
        assert ci.from_loc(le).nbytes == 0
        te, fe = reader.lease(le, np.float32, (0, 3))
        ts, fs = reader.lease(ls, np.float64, ())
        assert te.shape == (0, 3) and float(ts) == 2.5
        fs()
        reader.poll()
        assert owner.reclaim() == 2  # the empty one was released on viewing: nothing to read
    finally:
        reader.close()
        owner.close()


def test_dead_owner_pool_is_closed_after_last_view(sim):
    owner = ci.CudaPool(4096, slots=4)
    reader = ci.CudaPoolCache()
    try:
        loc = owner.hand_off(owner.alloc((16,), np.uint8))
        t, fin = reader.lease(loc, np.uint8, (16,))
        name = loc.pool.split("/")[0]
        owner.close()  # the owner goes away (close = state table marked closed and unlinked)
        assert reader.sweep() == [name]
        assert name in reader and sim.rt.closed == []  # a tensor still views it
        with pytest.raises(SegmentGone):
            reader.view(loc, np.uint8, (16,))
        del t
        gc.collect()
        reader.poll()
        assert name not in reader and sim.rt.closed == [owner.base_ptr]
    finally:
        reader.close()
        owner.close()


def test_owner_close_keeps_lent_memory(sim):
    owner = ci.CudaPool(4096, slots=4)
    owner.hand_off(owner.alloc((16,), np.uint8))
    block = owner._block
    owner.close()
    assert block.pinned  # a reader may still read it: never cudaFree'd before process exit
    owner2 = ci.CudaPool(4096, slots=4)
    block2 = owner2._block
    x = owner2.alloc((16,), np.uint8)
    owner2.close()
    assert not block2.pinned and sim.rt.freed == []  # x still views it
    del x, block2
    gc.collect()
    assert sim.rt.freed == [owner2.base_ptr]


def test_own_pool_is_viewed_directly(sim):
    owner = ci.CudaPool(4096, slots=4)
    reader = ci.CudaPoolCache(local={owner.name: owner})
    try:
        x = owner.alloc((4,), np.int64)
        loc = owner.hand_off(x)
        v = reader.view(loc, np.int64, (4,))
        assert v.data_ptr() == x.data_ptr() and sim.rt.opened == []
        sub = owner.ref_of(x[1:3])
        assert (sub.offset, sub.nbytes, sub.slot) == (8, 16, ci.from_loc(loc).slot)
        assert owner.ref_of(torch.zeros(2)) is None
    finally:
        reader.close()
        owner.close()


def test_unviewed_release(sim):
    owner = ci.CudaPool(4096, slots=4)
    reader = ci.CudaPoolCache()
    try:
        loc = owner.hand_off(owner.alloc((16,), np.uint8), holder_pid=None)
        reader.release(loc)  # a late reply nobody reads
        assert owner.reclaim() == 1
    finally:
        reader.close()
        owner.close()
