"""CudaPool and CudaPoolCache driven on the CPU: the device is simulated.

The pools take their CUDA access as one object (``runtime=``, a `shm.cuda.CudaRuntime`);
here it is `tests.shm.cuda_fake.FakeCudaRuntime`: host memory as device memory, CPU tensors,
events that complete when the test says so.  Everything else - state tables in /dev/shm,
descriptors through broker.protocol, validation, leases, the deferred release, reclaim,
closing pools whose owner went away - is the real code.  What only a GPU can show (real IPC
between processes, stream ordering) is in tests/gpu/test_gpu_cuda.py.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the simulated device's tensors are torch CPU tensors")

from broker import protocol as P  # noqa: E402
from shm import BadDescriptor, SegmentGone, StaleDescriptor  # noqa: E402
from shm.cuda import CudaPool, CudaPoolCache, check_ref  # noqa: E402
from tests.shm.cuda_fake import sim  # noqa: E402,F401  (fixture)


def test_hand_off_view_lease_release_reclaim(sim):
    owner = CudaPool(1 << 20, device=0, slots=8, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        x = owner.alloc((4, 5), np.float32)
        x.copy_(torch.arange(20, dtype=torch.float32).reshape(4, 5))
        loc = P.cuda_loc(owner.hand_off(x, holder_pid=None))
        # On the wire and back, as the worker gets it.
        wire = P.decode_request(P.encode_header(P.Request(id=1, tensors=[
            P.TensorRef(name="x", dtype="<f4", shape=[4, 5], loc=loc)]))).tensors[0].loc
        ev = sim.Event.from_ipc_handle(0, wire.event)
        assert ev.interprocess and ev.records == 1
        assert len(wire.handle) == 64 and wire.handle == owner.handle
        t, fin = reader.lease(wire, np.float32, (4, 5))
        assert torch.equal(t, x) and t.data_ptr() == x.data_ptr()  # the same bytes, no copy
        assert sim.cuda.stream.waited[-1] is ev                      # ordered after the producer
        assert sim.memory.opened == [owner.base_ptr] and wire.pool in reader
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
    owner = CudaPool(1 << 16, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        loc = P.cuda_loc(owner.hand_off(owner.alloc((16,), np.uint8)))
        t, fin = reader.lease(loc, np.uint8, (16,))
        sim.auto_done = False  # the consumer's kernels are still running
        fin()
        assert reader.poll() == 0 and owner.reclaim() == 0
        sim.auto_done = True
        for ev in sim.events.values():
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
    owner = CudaPool(1 << 16, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        x = owner.alloc((8,), np.int32)
        loc = P.cuda_loc(owner.hand_off(x))
        v = reader.view(loc, np.int32, (8,))
        del v
        gc.collect()
        assert reader.poll() == 0 and owner.reclaim() == 0  # inputs: the owner frees them
        pool = reader._pools[loc.pool]
        assert pool.live == 0
        owner.free(x, after=[sim.Event()])
        assert owner.in_use() == 0 and len(sim.cuda.stream.waited) == 2
    finally:
        reader.close()
        owner.close()


def test_descriptor_checks(sim):
    owner = CudaPool(4096, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        x = owner.alloc((64,), np.uint8)
        loc = P.cuda_loc(owner.hand_off(x))
        with pytest.raises(BadDescriptor, match="bytes but the descriptor has 64"):
            reader.view(loc, np.uint8, (65,))
        r = check_ref(loc)
        far = P.cuda_loc(r._replace(offset=4090))
        with pytest.raises(BadDescriptor, match="outside pool"):
            reader.view(far, np.uint8, (64,))
        with pytest.raises(BadDescriptor, match="does not match"):
            reader.view(P.cuda_loc(r._replace(handle=b"\x01" * 64)), np.uint8, (64,))
        # Once the pool is open, a descriptor without the handle is enough.
        assert reader.view(P.cuda_loc(r._replace(handle=b"")), np.uint8, (64,)).shape == (64,)
        # Wrong generation: stale before a byte is viewed.
        with pytest.raises(StaleDescriptor):
            reader.view(P.cuda_loc(r._replace(generation=5, handle=b"")), np.uint8, (64,))
        with pytest.raises(BadDescriptor, match="no torch equivalent"):
            owner.alloc((2,), "<U3")
        assert len(sim.memory.opened) == 1  # one open per pool, however many descriptors
    finally:
        reader.close()
        owner.close()


def test_empty_and_scalar_tensors(sim):
    owner = CudaPool(4096, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        e = owner.alloc((0, 3), np.float32)
        s = owner.alloc((), np.float64)
        s.fill_(2.5)
        le = P.cuda_loc(owner.hand_off(e))
        ls = P.cuda_loc(owner.hand_off(s))
        assert check_ref(le).nbytes == 0
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
    owner = CudaPool(4096, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        loc = P.cuda_loc(owner.hand_off(owner.alloc((16,), np.uint8)))
        t, fin = reader.lease(loc, np.uint8, (16,))
        name = loc.pool
        owner.close()  # the owner goes away (close = state table marked closed and unlinked)
        assert reader.sweep() == [name]
        assert name in reader and sim.memory.closed == []  # a tensor still views it
        with pytest.raises(SegmentGone):
            reader.view(loc, np.uint8, (16,))
        del t
        gc.collect()
        reader.poll()
        assert name not in reader and sim.memory.closed == [owner.base_ptr]
    finally:
        reader.close()
        owner.close()


def test_owner_close_keeps_lent_memory(sim):
    owner = CudaPool(4096, slots=4, runtime=sim)
    owner.hand_off(owner.alloc((16,), np.uint8))
    block = owner._block
    owner.close()
    assert block.pinned  # a reader may still read it: never cudaFree'd before process exit
    owner2 = CudaPool(4096, slots=4, runtime=sim)
    block2 = owner2._block
    x = owner2.alloc((16,), np.uint8)
    owner2.close()
    assert not block2.pinned and sim.memory.freed == []  # x still views it
    del x, block2
    gc.collect()
    assert sim.memory.freed == [owner2.base_ptr]


def test_own_pool_is_viewed_directly(sim):
    owner = CudaPool(4096, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim, local={owner.name: owner})
    try:
        x = owner.alloc((4,), np.int64)
        loc = P.cuda_loc(owner.hand_off(x))
        v = reader.view(loc, np.int64, (4,))
        assert v.data_ptr() == x.data_ptr() and sim.memory.opened == []
        sub = owner.ref_of(x[1:3])
        assert (sub.offset, sub.nbytes, sub.slot) == (8, 16, check_ref(loc).slot)
        assert owner.ref_of(torch.zeros(2)) is None
    finally:
        reader.close()
        owner.close()


def test_unviewed_release(sim):
    owner = CudaPool(4096, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        loc = P.cuda_loc(owner.hand_off(owner.alloc((16,), np.uint8), holder_pid=None))
        reader.release(loc)  # a late reply nobody reads
        assert owner.reclaim() == 1
    finally:
        reader.close()
        owner.close()


def test_cache_takes_a_device_ref_as_well_as_a_cuda_loc(sim):
    owner = CudaPool(4096, slots=4, runtime=sim)
    reader = CudaPoolCache(runtime=sim)
    try:
        x = owner.alloc((4,), np.int32)
        x.copy_(torch.arange(4, dtype=torch.int32))
        ref = owner.hand_off(x)  # a DeviceRef, never converted to the wire's CudaLoc
        assert reader.event_of(ref) is sim.Event.from_ipc_handle(0, ref.event)
        t, fin = reader.lease(ref, np.int32, (4,))
        assert torch.equal(t, x) and t.data_ptr() == x.data_ptr()
        with pytest.raises(BadDescriptor, match="names no slot"):
            reader.view(P.CudaLoc(pool=ref.pool, offset=0, nbytes=16, device=0), np.int32, (4,))
        fin()
        assert reader.poll() == 1 and owner.reclaim() == 1
    finally:
        reader.close()
        owner.close()
