"""The host data plane (gpu_worker.planes.HostPlane) alone: inputs read in place, outputs in
the output ring or inline, identity pass-through, and what it refuses.  No sockets, no torch."""
from __future__ import annotations

import os

import numpy as np
import pytest

import shm
from broker import protocol as P
from gpu_worker.backends import make_backend
from gpu_worker.job import Job
from gpu_worker.models import load_model
from gpu_worker.planes import HostPlane

HOST = P.local_host_id()


@pytest.fixture
def plane():
    p = HostPlane(make_backend(load_model("echo", "cpu"), "cpu"), host=HOST, out_capacity=1 << 20, out_slots=8)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def client_pool():
    with shm.ShmPool(1 << 20) as pool:
        yield pool


def _shm_input(pool, value: np.ndarray, name: str = "x") -> P.TensorRef:
    a = pool.alloc(value.shape, value.dtype)
    a[...] = value
    ref = pool.ref_of(a)
    pool.mark_in_flight(ref)
    return P.TensorRef(name=name, dtype=value.dtype.str, shape=list(value.shape), loc=P.shm_loc(ref))


def _job(tensors, *, reply="auto", host=HOST, pid=None) -> Job:
    pid = os.getpid() if pid is None else pid  # the broker attests the sender: here, this process
    return Job(P.token_envelope(1), P.Request(id=1, host=host, pid=pid, reply=reply, tensors=tensors),
               None, None, 0.0, None, None)


def test_inputs_are_read_only_views_of_shared_memory_and_inline_frames(plane, client_pool):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    frame = np.array([7, 8, 9], np.uint8).tobytes()
    job = _job([_shm_input(client_pool, x),
                P.TensorRef(name="b", dtype="|u1", shape=[3], loc=P.InlineLoc(frame=0))])
    plane.map_inputs(job, [frame])
    assert set(job.inputs) == set(job.refs) == {"x", "b"}
    np.testing.assert_array_equal(job.inputs["x"], x)
    np.testing.assert_array_equal(job.inputs["b"], [7, 8, 9])
    assert not job.inputs["x"].flags.writeable and not job.inputs["b"].flags.writeable
    assert job.cuda_in is False


@pytest.mark.parametrize("shape", [[12], [3, 4], [2, 3, 2], []])
@pytest.mark.parametrize("kind", ["zmq.Frame", "bytearray", "memoryview"])
def test_an_inline_input_is_a_read_only_view_of_its_frame_in_its_shape(plane, kind, shape):
    """A received frame is writable memory (zmq.Frame exports it so); the model still gets
    a read-only view of it, with no copy, in the header's shape (1-d, n-d and 0-d)."""
    import zmq

    x = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape) * 3 + 1
    raw = x.tobytes()
    frame = {"zmq.Frame": lambda: zmq.Frame(raw), "bytearray": lambda: bytearray(raw),
             "memoryview": lambda: memoryview(bytearray(raw))}[kind]()
    job = _job([P.TensorRef(name="a", dtype=x.dtype.str, shape=list(shape), loc=P.InlineLoc(frame=0))])
    plane.map_inputs(job, [frame])
    a = job.inputs["a"]
    assert a.shape == tuple(shape) and a.dtype == x.dtype
    np.testing.assert_array_equal(a, x)
    assert not a.flags.writeable
    assert np.shares_memory(a, np.frombuffer(frame, np.uint8))  # the frame's own bytes


@pytest.mark.parametrize("case", ["other_host", "cuda"])
def test_what_a_host_plane_refuses(plane, client_pool, case):
    if case == "other_host":
        job = _job([_shm_input(client_pool, np.zeros(4, np.uint8))], host="elsewhere/0")
        match = "another host"
    else:
        loc = P.CudaLoc(pool="zinf-1-1-0123456789abcdef-5", offset=0, nbytes=4, device=0, slot=0, generation=0)
        job = _job([P.TensorRef(name="x", dtype="|u1", shape=[4], loc=loc)])
        match = r"--device cuda:N"  # says what to do instead
    with pytest.raises(P.ProtocolError, match=match):
        plane.map_inputs(job, [])
    assert job.inputs is None and job.refs is None


@pytest.mark.parametrize("pid", [-1, 1, os.getpid() + 1], ids=["-1", "1", "another"])
def test_a_segment_the_requester_does_not_own_is_refused_before_it_is_opened(plane, client_pool, pid):
    # The principal is the pid the broker attested (SO_PEERCRED), never anything the client
    # wrote; -1 stands for "not attested" (tcp, another pid namespace).
    job = _job([_shm_input(client_pool, np.arange(4, dtype=np.int16))], pid=pid)
    if pid == -1:
        job.req.pid = None
    with pytest.raises(P.ProtocolError, match="attest|does not own") as e:
        plane.map_inputs(job, [])
    assert client_pool.name not in str(e.value) and "slot" not in str(e.value)  # tells nothing
    assert client_pool.name not in plane.inputs  # never mapped


def test_an_identity_output_is_answered_with_the_clients_own_reference(plane, client_pool):
    t = _shm_input(client_pool, np.arange(4, dtype=np.int16))
    job = _job([t])
    plane.map_inputs(job, [])
    (out,) = plane.run([job])
    refs, frames = plane.write_outputs(job, out)
    assert frames == [] and refs == [P.TensorRef(name="x", dtype=t.dtype, shape=[4], loc=t.loc)]


def test_outputs_go_to_the_ring_for_a_local_client_and_inline_otherwise(plane):
    y = np.arange(1024, dtype=np.float64)  # 8 KiB: above P.SMALL_INLINE_BYTES
    ring, frames = plane.write_outputs(_job([]), {"y": y})
    assert frames == [] and type(ring[0].loc) is P.ShmLoc and ring[0].dtype == "<f8" and ring[0].shape == [1024]
    reader = shm.SegmentCache()
    try:
        np.testing.assert_array_equal(reader.view(P.shm_ref(ring[0].loc), np.float64, (1024,)), y)
    finally:
        reader.close()
    unattested = _job([], reply="shm")
    unattested.req.pid = None  # tcp, or another pid namespace: nobody would give the slot back
    for job in (_job([], reply="inline"), _job([], host="elsewhere/0"), unattested):
        refs, frames = plane.write_outputs(job, {"y": y})
        assert refs == [P.TensorRef(name="y", dtype="<f8", shape=[1024], loc=P.InlineLoc(frame=0))]
        assert bytes(frames[0]) == y.tobytes()


@pytest.mark.parametrize("nbytes, reply, by_ring", [
    (16, "auto", False),                     # small: a copy costs less than a slot
    (P.SMALL_INLINE_BYTES, "auto", False),   # the threshold itself is still inline
    (P.SMALL_INLINE_BYTES + 8, "auto", True),
    (8192, "auto", True),
    (16, "shm", True),                       # asked for shared memory by name: whatever the size
])
def test_small_outputs_go_inline_unless_the_request_asks_for_shared_memory(plane, nbytes, reply, by_ring):
    y = np.arange(nbytes // 8, dtype=np.float64)
    job = _job([], reply=reply)  # a local client the broker attested
    refs, frames = plane.write_outputs(job, {"y": y})
    if by_ring:
        assert frames == [] and type(refs[0].loc) is P.ShmLoc and plane.out_pool.in_use() == 1
        reader = shm.SegmentCache()
        try:
            np.testing.assert_array_equal(reader.view(P.shm_ref(refs[0].loc), np.float64, y.shape), y)
        finally:
            reader.close()
    else:
        assert refs == [P.TensorRef(name="y", dtype="<f8", shape=list(y.shape), loc=P.InlineLoc(frame=0))]
        assert bytes(frames[0]) == y.tobytes() and plane.out_pool.in_use() == 0


def test_a_full_ring_degrades_to_inline(plane):
    big = np.zeros(2 << 20, np.uint8)  # larger than the whole ring
    refs, frames = plane.write_outputs(_job([]), {"y": big})
    assert type(refs[0].loc) is P.InlineLoc and len(frames) == 1


def test_without_the_shm_transport_there_is_no_ring():
    p = HostPlane(None, host=HOST, transports=("inline",))
    try:
        assert p.out_pool is None and p.transports == ("inline",)
        refs, frames = p.write_outputs(_job([]), {"y": np.ones(2, np.uint8)})
        assert type(refs[0].loc) is P.InlineLoc
        assert p.admit() is None and p.batch_limit(8) == 8
    finally:
        p.close()


def test_a_cpu_worker_never_loads_the_cuda_plane(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from gpu_worker.worker import Worker, WorkerConfig; "
            f"w = Worker(WorkerConfig(broker='ipc://{tmp_path}/none.ipc', device='cpu', warmup=False)); "
            "print(type(w.plane).__name__, 'gpu_worker.cuda_plane' in sys.modules, "
            "'gpu_worker.cuda_runtime' in sys.modules); w.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["HostPlane", "False", "False"]


def test_is_same_array_is_the_whole_input_and_nothing_else():
    from gpu_worker.planes import is_same_array

    buf = np.arange(64, dtype=np.uint8)
    x = buf[:16]
    assert is_same_array(x.reshape(1, 16)[0], x)                    # a view of all of it: the identity
    assert not is_same_array(buf[1:17], x)                           # overlapping, shifted
    assert not is_same_array(x.copy(), x)                            # equal bytes, other memory
    assert not is_same_array(x[:8], x)                               # a part
    assert not is_same_array(x.view(np.int8), x)                     # another dtype
    assert not is_same_array(buf[::4], buf[::4].copy())              # strided, other memory
    y = np.arange(32, dtype=np.uint8).reshape(4, 8)
    assert not is_same_array(y.T.T[:, ::2], y[:, ::2])               # the same non-contiguous view


def test_a_reference_is_checked_against_the_attested_pid_and_its_start_time():
    # The start time tells a reused pid from the process the broker attested; an older
    # broker sends none, and the pid alone is checked.
    from gpu_worker.planes import NOT_ATTESTED, NOT_OWNED, NotAttested, check_owner

    seg = "zinf-4242-77-00112233445566ff-9"
    check_owner(P.Request(id=1, pid=4242, pid_start=77), seg)
    check_owner(P.Request(id=1, pid=4242), seg)
    for req, why in ((P.Request(id=1, pid=4242, pid_start=78), NOT_OWNED),
                     (P.Request(id=1, pid=4243, pid_start=77), NOT_OWNED),
                     (P.Request(id=1), NOT_ATTESTED)):
        with pytest.raises(P.ProtocolError) as e:
            check_owner(req, seg)
        assert str(e.value) == why
        assert isinstance(e.value, NotAttested) == (why is NOT_ATTESTED)  # answered NOT_LOCAL


def test_an_empty_output_whose_header_no_peer_takes_is_refused_for_a_subclass_too():
    """An empty (0, 1 << 40) float32 output describes more bytes than any header may (0
    dimensions counted as 1): refused before it is sent, a plain array as a masked one
    (which went through as a header its client refused, a ProtocolError)."""
    from gpu_worker.planes import check_outputs

    for value in (np.zeros((0, 1 << 40), np.float32), np.ma.zeros((0, 1 << 40), np.float32)):
        with pytest.raises(ValueError, match="describe more than"):
            check_outputs({"y": value})
    check_outputs({"y": np.ma.zeros((0, 4), np.float32)})  # an ordinary empty one is fine


def test_the_input_cache_leaves_room_under_a_low_descriptor_limit():
    """Each mapped client segment holds two descriptors: under a hard limit of 1024 the cache
    keeps fewer (the complexity hunt raised it from 64 to 256 segments, 512 descriptors)."""
    from gpu_worker.planes import input_segments
    from shm.reader import MAX_SEGMENTS

    assert input_segments(1024) == 96 and input_segments(1 << 20) == MAX_SEGMENTS == 256
    assert input_segments(300) == 16  # never fewer than a handful
    assert 2 * input_segments(1024) < 1024 // 4


def test_reply_sockets_are_as_many_as_the_descriptor_limit_leaves_room_for():
    """A worker answered each client process past its 64th on a new connection per reply (the
    complexity hunt: about 65 µs more): now 256 stay open where descriptors allow."""
    from gpu_worker.planes import reply_sockets
    from gpu_worker.worker import WorkerConfig

    assert reply_sockets(1 << 20) == 256 and reply_sockets(1024) == 96 and reply_sockets(300) == 64
    assert WorkerConfig("ipc:///x/b.ipc", model="echo").direct_sockets is None  # None: reply_sockets()
    WorkerConfig("ipc:///x/b.ipc", model="echo", direct_sockets=8)  # still settable


def test_an_output_ring_over_half_the_workers_memory_is_warned_of():
    # The memory audit: a worker in a 200 MiB cgroup with the default 256 MiB ring was
    # OOM-killed by its fourth 40 MiB reply (the ring's pages count as they are written).
    from gpu_worker.worker import ring_too_large

    assert ring_too_large(256 << 20, 200 << 20) is not None
    words = ring_too_large(256 << 20, 200 << 20)
    assert "256 MiB" in words and "200 MiB" in words and "--out-capacity-mb" in words
    assert ring_too_large(256 << 20, 512 << 20) is None and ring_too_large(256 << 20, None) is None


def test_an_output_ring_no_client_would_map_is_refused_at_the_start():
    import pytest

    from gpu_worker.worker import ConfigError, WorkerConfig
    from shm.segment import create_segment, max_capacity

    most = max_capacity()
    with pytest.raises(ConfigError, match="at most 65535 MiB"):
        WorkerConfig(broker="ipc:///x", out_capacity=1 << 36).check()
    WorkerConfig(broker="ipc:///x", out_capacity=most).check()
    with pytest.raises(ValueError, match=f"at most {most} bytes"):  # and any segment made so
        create_segment(most + 64, 4096, 64)
