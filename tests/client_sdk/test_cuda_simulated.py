"""The SDK's CUDA side (client_sdk/cuda.py, tensors.pack/unpack) on the simulated device of
tests/shm/cuda_fake.py: real pools, state tables, descriptors and leases; CPU tensors stand
in for device tensors."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the simulated device's tensors are torch CPU tensors")

from broker import protocol as P  # noqa: E402
from client_sdk import cuda as sdk_cuda  # noqa: E402
from client_sdk import tensors as T  # noqa: E402
from shm.cuda import CudaPool, check_ref  # noqa: E402
from tests.shm.cuda_fake import sim  # noqa: E402,F401  (fixture)


@pytest.fixture
def cpu_tensors_are_cuda(monkeypatch):
    # tensors.pack asks client_sdk.cuda.is_cuda_tensor before any CudaSide (and so any
    # runtime) exists, so this one check is patched rather than injected.
    monkeypatch.setattr(sdk_cuda, "is_cuda_tensor", lambda x: isinstance(x, torch.Tensor))


@pytest.fixture
def side(sim, cpu_tensors_are_cuda):  # noqa: F811
    s = sdk_cuda.CudaSide(1 << 20, device=0, runtime=sim)
    yield s
    s.close()


def test_inputs_by_reference_and_by_copy_outputs_leased(side, sim):  # noqa: F811
    buf = side.alloc((4,), torch.int32)
    buf.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    other = torch.arange(3, dtype=torch.float32)
    packed = T.pack({"a": buf, "b": other}, None, cuda=lambda: side)
    a, b = packed.tensors
    assert type(a.loc) is P.CudaLoc and type(b.loc) is P.CudaLoc and not packed.frames
    assert a.dtype == "<i4" and a.shape == [4] and b.dtype == "<f4"
    assert len(packed.cuda_temp) == 1 and side.pool.in_use() == 2
    assert torch.equal(packed.cuda_temp[0], other)              # copied once into a slot
    assert side.pool.ref_of(buf).offset == check_ref(a.loc).offset  # buf itself: by reference

    worker = CudaPool(1 << 20, device=0, slots=8, runtime=sim)            # the worker's output pool
    try:
        y = worker.alloc((2, 2), np.int16)
        y.copy_(torch.tensor([[5, 6], [7, 8]], dtype=torch.int16))
        loc = P.cuda_loc(worker.hand_off(y, holder_pid=os.getpid()))
        rep = P.decode_reply(P.encode_header(P.Reply(id=1, tensors=[
            P.TensorRef(name="y", dtype="<i2", shape=[2, 2], loc=loc)])))
        leases = T.OutputLeases()
        leases.cuda_cache = side.cache
        res = T.unpack(rep, [], leases, final=True)
        assert torch.equal(res["y"], y) and res["y"].data_ptr() == y.data_ptr()
        # FINAL: the temporary input slot is freed after the reply's output events.
        events = side.events_of(rep.tensors)
        assert len(events) == 1 and events[0] is sim.Event.from_ipc_handle(0, loc.event)
        side.free_temp(packed.cuda_temp, after=events)
        assert sim.cuda.stream.waited[-1] is events[0]
        assert side.pool.in_use() == 1 and packed.cuda_temp == []
        res.release()
        side.poll()
        assert worker.reclaim() == 1 and worker.in_use() == 0    # released with the Result
        leases.close()
    finally:
        worker.close()
    del buf, packed, a
    gc.collect()
    side.poll()
    assert side.pool.in_use() == 0                               # alloc buffer freed on drop


def test_unviewed_cuda_outputs_are_released(side, sim):  # noqa: F811
    worker = CudaPool(1 << 20, device=0, slots=8, runtime=sim)
    try:
        y = worker.alloc((3,), np.float32)
        loc = P.cuda_loc(worker.hand_off(y, holder_pid=os.getpid()))
        rep = P.Reply(id=2, tensors=[P.TensorRef(name="y", dtype="<f4", shape=[3], loc=loc)])
        leases = T.OutputLeases()
        leases.cuda_cache = side.cache
        T.release_reply(rep, leases)
        side.poll()
        assert worker.reclaim() == 1
        leases.close()
    finally:
        worker.close()


def test_full_device_pool_falls_back_to_the_host(sim, cpu_tensors_are_cuda):  # noqa: F811
    side = sdk_cuda.CudaSide(256, device=0, runtime=sim)
    try:
        big = torch.arange(1000, dtype=torch.float32)
        packed = T.pack({"x": big}, None, cuda=lambda: side)
        assert type(packed.tensors[0].loc) is P.InlineLoc and not packed.cuda_temp
        np.testing.assert_array_equal(np.frombuffer(bytes(packed.frames[0]), np.float32), big.numpy())
        assert side.pool.in_use() == 0
    finally:
        side.close()


def test_alloc_cuda_on_a_full_device_pool_is_pool_full(sim, monkeypatch, tmp_path):  # noqa: F811
    """docs/client.md: every error derives from InferenceError.  A device pool with no room
    is `PoolFull`, as for `alloc()` (and still a `shm.ShmFull`), with the pool's reason and
    what to change; the pool is left as it was."""
    import shm
    import shm.cuda
    from client_sdk import Client, InferenceError, PoolFull

    monkeypatch.setattr(shm.cuda, "default_runtime", lambda: sim)  # the client's CudaSide runs on the simulation
    with Client(f"ipc://{tmp_path}/none.ipc", pool_capacity=4096) as c:
        with pytest.raises(PoolFull) as info:
            c.alloc_cuda((4096,), np.float32)  # 16 KiB in a 4 KiB device pool
        e = info.value
        assert isinstance(e, InferenceError) and isinstance(e, shm.ShmFull) and e.code is None
        assert "larger than the whole pool" in str(e) and "pool_capacity" in str(e), str(e)
        side = c._core._cuda
        assert side is not None and side.pool.in_use() == 0  # nothing half-allocated
        t = c.alloc_cuda((16,), np.float32)                   # what fits still does
        assert tuple(t.shape) == (16,) and side.pool.in_use() == 1
        # Every slot live: the other reason, the same class.
        held = [t]
        with pytest.raises(PoolFull, match="alloc_cuda"):
            while len(held) < 10_000:
                held.append(c.alloc_cuda((16,), np.float32))
        del held, t


def test_a_cuda_output_not_lent_to_this_process_is_refused_and_never_released(side, sim):  # noqa: F811
    """A worker's reply naming a device slot not lent to this client (another process's
    input, handed off without a holder, or an output lent to another process): leased,
    its release freed that slot under its owner's request.  As for shared memory, the client
    takes as output only a slot whose holder is its own pid."""
    from client_sdk import ProtocolError

    other = CudaPool(1 << 20, device=0, slots=8, runtime=sim)  # another client's input pool, say
    try:
        leases = T.OutputLeases()
        leases.cuda_cache = side.cache
        for holder in (None, 1):  # an input; an output lent to another process (pid 1: alive)
            x = other.alloc((3,), np.float32)
            loc = P.cuda_loc(other.hand_off(x, holder_pid=holder))
            rep = P.Reply(id=3, tensors=[P.TensorRef(name="y", dtype="<f4", shape=[3], loc=loc)])
            with pytest.raises(ProtocolError, match="not lent to this process"):
                T.unpack(rep, [], leases, final=True)
            T.release_reply(rep, leases)  # as for a reply nobody reads: nothing either
            gc.collect()
            side.poll()
            assert other.reclaim() == 0 and other.in_use() >= 1, "the client released a slot not lent to it"
        leases.close()
    finally:
        other.close()


def test_a_cuda_slot_named_twice_goes_back_only_when_no_result_leases_it(side, sim):  # noqa: F811
    """As for shared memory (tests/e2e/test_buggy_worker.py): a worker that names one device
    slot twice (two outputs of a reply, two replies, a duplicate FINAL discarded) made the
    client store RELEASED at the first drop, or at the duplicate's release, while a result
    still leased the slot: the worker wrote its next output there, under that result.  The
    slot goes back once nothing leases it any more."""
    worker = CudaPool(1 << 20, device=0, slots=8, runtime=sim)
    try:
        y = worker.alloc((3,), np.float32)
        loc = P.cuda_loc(worker.hand_off(y, holder_pid=os.getpid()))
        ref = P.TensorRef(name="a", dtype="<f4", shape=[3], loc=loc)
        leases = T.OutputLeases()
        leases.cuda_cache = side.cache
        first = T.unpack(P.Reply(id=1, tensors=[ref, P.TensorRef(name="b", dtype="<f4", shape=[3], loc=loc)]),
                         [], leases, final=True)
        second = T.unpack(P.Reply(id=2, tensors=[ref]), [], leases, final=True)
        T.release_reply(P.Reply(id=1, tensors=[ref]), leases)  # a duplicate FINAL, discarded
        second.release()
        del second
        gc.collect()
        side.poll()
        assert worker.reclaim() == 0, "the slot went back while a result leased it"
        assert torch.equal(first["a"], first["b"])
        first.release()
        side.poll()
        assert worker.reclaim() == 1 and worker.in_use() == 0
        leases.close()
    finally:
        worker.close()
