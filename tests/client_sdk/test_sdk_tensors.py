"""Packing, unpacking, result lifetimes and error mapping, without any socket."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import shm
from broker import protocol as P
from broker.protocol import ErrorCode
from client_sdk import InvalidInput, errors
from client_sdk import tensors as T
from client_sdk.tensors import Result
from tests.children import readline_within


@pytest.fixture
def pool():
    with shm.ShmPool(1 << 20) as p:
        yield p


def _bytes_of(frame) -> bytes:
    return bytes(memoryview(frame).cast("B")) if not isinstance(frame, bytes) else frame


def _roundtrip(packed: T.Packed, leases: T.OutputLeases, pool=None) -> Result:
    """`packed` sent back as a reply; its slots of `pool` lent to this process first, as a
    worker lends its outputs to the client (the client views only slots lent to it)."""
    if pool is not None:
        for ref in packed.temp:
            pool.mark_in_flight(ref, holder_pid=os.getpid())
    return T.unpack(P.Reply(id=1, tensors=packed.tensors), packed.frames, leases, final=True)


# -------------------------------------------------------------------------------- errors

def test_error_classes_and_codes():
    for code in ErrorCode:
        e = errors.error_from(code, "why")
        assert isinstance(e, errors.InferenceError) and e.code == code
        assert str(e).startswith("why (")  # every message carries what to do
    assert isinstance(errors.error_from(ErrorCode.PROTOCOL_ERROR, "x"), P.ProtocolError)
    assert isinstance(errors.error_from(ErrorCode.DEADLINE_EXCEEDED, "x"), TimeoutError)
    odd = errors.error_from(418, "teapot")
    assert type(odd) is errors.InferenceError and odd.code == 418 and "upgrade" in str(odd)
    assert issubclass(errors.NotSupported, NotImplementedError)
    assert "endpoint" in str(errors.BrokerUnreachable())


# -------------------------------------------------------------------------------- packing

def test_inline_packing_is_c_order_and_zero_copy_when_possible():
    f = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    c = np.arange(6, dtype=np.float64)
    p = T.pack({"f": f, "c": c, "z": np.int8(7), "e": np.zeros((2, 0))}, None)
    assert [type(t.loc) for t in p.tensors] == [P.InlineLoc] * 4
    assert [t.loc.frame for t in p.tensors] == [0, 1, 2, 3]
    assert _bytes_of(p.frames[0]) == np.ascontiguousarray(f).tobytes()
    assert np.shares_memory(p.frames[1], c)  # contiguous: sent from the caller's memory
    assert p.tensors[2].shape == [] and _bytes_of(p.frames[2]) == b"\x07"
    assert p.frames[3] == b"" and p.tensors[3].shape == [2, 0]
    assert not p.uses_shm and not p.temp


def test_copy_inline_makes_private_frames():
    c = np.arange(6, dtype=np.float64)
    p = T.pack({"c": c}, None, copy_inline=True)
    c[:] = -1
    assert np.frombuffer(p.frames[0], np.float64).tolist() == list(range(6))


def test_shm_packing_and_views(pool):
    leases = T.OutputLeases()
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    p = T.pack({"x": x, "t": x.transpose(2, 0, 1)}, pool)
    assert p.uses_shm and len(p.temp) == 2 and pool.in_use() == 2
    assert all(pool.table["state"][r.slot] == shm.IN_FLIGHT for r in p.temp)  # readable by workers
    # The client's own pool is readable through a SegmentCache (same process here).
    r = _roundtrip(p, leases, pool)
    np.testing.assert_array_equal(r["t"], x.transpose(2, 0, 1))
    assert r.zero_copy == {"x": True, "t": True}
    r.release()
    T.free_temp(pool, p.temp)
    assert pool.in_use() == 0
    leases.close()


def test_failed_pack_frees_its_slots(pool):
    with pytest.raises(InvalidInput, match="Python objects"):
        T.pack({"ok": np.zeros(100), "bad": np.array([None])}, pool)
    assert pool.in_use() == 0


def test_input_validation():
    with pytest.raises(InvalidInput, match="at most"):
        T.pack({f"t{i}": np.zeros(1) for i in range(P.MAX_TENSORS + 1)}, None)
    with pytest.raises(InvalidInput, match="dimensions"):
        T.pack({"x": np.zeros((1,) * (P.MAX_NDIM + 1))}, None)
    with pytest.raises(InvalidInput, match="non-empty strings"):
        T.pack({"": np.zeros(1)}, None)
    for dt in ("V0", np.dtype([])):  # items of no size: refused here, not by the broker's 400
        with pytest.raises(InvalidInput, match="no size"):
            T.pack({"x": np.empty((1 << 20,), dt)}, None)
    # Empty, but with a shape every peer refuses (over MAX_TENSOR_BYTES, 0 dimensions
    # counted as 1): refused here, on the lean path too, not by the broker's 400 (a
    # ProtocolError that blamed mismatched versions).  At the limit it is sent.
    empty_huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (0, 1 << 40), (0, 0))
    for inputs in ({"x": empty_huge}, {"x": empty_huge, "y": np.zeros(1)}):
        with pytest.raises(InvalidInput, match="describe more than"):
            T.pack(inputs, None)
    at_limit = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (0, P.MAX_TENSOR_BYTES), (0, 0))
    assert T.pack({"x": at_limit}, None).tensors[0].shape == [0, P.MAX_TENSOR_BYTES]
    p = T.pack({"l": [[1, 2], [3, 4]]}, None)  # array-likes are accepted
    assert p.tensors[0].shape == [2, 2]


# -------------------------------------------------------------------------------- results

def test_result_mapping_and_release_semantics():
    r = T.unpack(P.Reply(id=9, tensors=[P.TensorRef(name="a", dtype="<i2", shape=[2],
                                                    loc=P.InlineLoc(frame=0))], timing={"q": 1.0}),
                 [np.array([5, 6], "<i2").tobytes()], T.OutputLeases(), final=True)
    assert list(r) == ["a"] and len(r) == 1 and "a" in r and r.timing == {"q": 1.0}
    assert r["a"].tolist() == [5, 6] and not r["a"].flags.writeable
    assert "a: int16[2]" in repr(r)
    with r:
        pass
    assert r.released and "released" in repr(r)
    with pytest.raises(errors.InferenceError, match="released"):
        r["a"]
    # Not a KeyError, which Mapping's `in`, get(), keys() and len() took for an empty Result
    # (no error at all); each raises now.
    for look in (lambda: "a" in r, lambda: r.get("a"), lambda: list(r.keys()), lambda: len(r),
                 lambda: list(r.items())):
        with pytest.raises(errors.InferenceError, match="released") as ei:
            look()
        assert not isinstance(ei.value, KeyError) and ei.value.code is None


def test_lease_finalizer_waits_for_every_view():
    fired = []
    out, fin = T.lease_array(np.arange(10), fired.append, "gone")
    views = [out[2:], out.reshape(2, 5).T, out.view(np.uint8)[::8]]
    del out
    gc.collect()
    assert fired == []
    views.pop()
    views.pop()
    gc.collect()
    assert fired == []
    views.pop()
    gc.collect()
    assert fired == ["gone"]


def test_leases_close_waits_for_live_results(pool):
    leases = T.OutputLeases()
    p = T.pack({"x": np.arange(8.0)}, pool)
    r = _roundtrip(p, leases, pool)
    leases.close()  # the client closed; the result is still in use
    assert leases.live == 1 and r["x"][7] == 7.0
    slot = p.temp[0].slot
    r.release()
    assert pool.table["state"][slot] == shm.RELEASED  # still given back after close
    assert leases.live == 0


def test_a_dead_workers_ring_is_dropped_at_the_second_sweep_that_finds_it_dead():
    """The client's heartbeat sweeps its output rings by owner (a SIGKILLed worker never marks
    its ring closed).  A reply the worker sent just before it died may still be unread and
    reads its outputs from the cached mapping (the ring's file is gone with its owner), so a
    ring found dead is dropped at the next sweep, not at once."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, numpy as np\n"
        "from shm import ShmPool\n"
        "pool = ShmPool(1 << 20, slots=8)\n"
        "refs = []\n"
        "for v in (1, 2):\n"
        "    a = pool.alloc(16, np.uint8); a[:] = v; r = pool.ref_of(a)\n"
        f"    pool.mark_in_flight(r, holder_pid={os.getpid()}); refs.append(r)\n"
        "print(' '.join(' '.join(map(str, r)) for r in refs), flush=True)\n"
        "sys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    leases = T.OutputLeases()
    try:
        f = readline_within(owner.stdout, 30, "the owner's two slots").split()
        seg = f[0]
        locs = [P.ShmLoc(segment=f[i], offset=int(f[i + 1]), nbytes=int(f[i + 2]), slot=int(f[i + 3]),
                         generation=int(f[i + 4])) for i in (0, 5)]
        first, _ = leases.view(locs[0], np.dtype(np.uint8), (16,))
        assert int(first[0]) == 1
        del first
        gc.collect()
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert leases.sweep() == []  # seen dead once: kept
        second, _ = leases.view(locs[1], np.dtype(np.uint8), (16,))  # the reply sent before it died
        assert int(second[0]) == 2
        del second
        gc.collect()
        assert leases.sweep() == [seg]  # dead twice: dropped
        assert leases.sweep() == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdin.close()
        owner.stdout.close()
        leases.close()


def _starve_attach(monkeypatch):
    """Mapping a segment fails as in a process out of descriptors, until the returned
    function is called."""
    import shm.reader

    real = shm.reader.attach_segment

    def starved(*a, **kw):
        raise shm.OutOfResources("cannot open segment: Too many open files")

    monkeypatch.setattr(shm.reader, "attach_segment", starved)
    return lambda: monkeypatch.setattr(shm.reader, "attach_segment", real)


@pytest.mark.parametrize("later", ["sweep", "view", "close"])
def test_output_slots_that_could_not_be_mapped_are_given_back_once_they_can(pool, monkeypatch, later):
    # A client out of descriptors when a worker's first output arrived got "cannot map it
    # now", and the slots stayed lent for the client's life: the failing one was never
    # released, the others' release needed the mapping that had just failed (the error was
    # swallowed), and nothing tried again; the worker, seeing its holder alive, kept them
    # (the resource hunt: 3 of 3 leaked, even after close()).  They are given back at the
    # next output viewed, at the heartbeat's sweep, or at close.
    leases = T.OutputLeases()
    p = T.pack({"x": np.arange(8.0), "y": np.arange(4.0)}, pool)
    slots = [t.slot for t in p.temp]
    assert len(slots) == 2 and all(pool.table["state"][s] == shm.IN_FLIGHT for s in slots)
    fed = _starve_attach(monkeypatch)
    with pytest.raises(errors.InferenceError, match="cannot map it now"):
        _roundtrip(p, leases, pool)
    leases.sweep()  # still out of descriptors: kept for later
    assert all(pool.table["state"][s] == shm.IN_FLIGHT for s in slots)
    fed()
    try:
        if later == "sweep":
            leases.sweep()
        elif later == "view":
            q = T.pack({"z": np.arange(16.0)}, pool)
            with _roundtrip(q, leases, pool) as r:
                assert r["z"][15] == 15.0
        else:
            leases.close()
        assert all(pool.table["state"][s] == shm.RELEASED for s in slots)
    finally:
        leases.close()


def test_a_release_that_cannot_map_its_ring_is_tried_again(pool, monkeypatch):
    # A viewed output whose ring mapping was dropped meanwhile (least recently used, or a
    # sweep) maps it again to store RELEASED: out of descriptors then, it is tried later.
    leases = T.OutputLeases()
    p = T.pack({"x": np.arange(8.0)}, pool)
    slot = p.temp[0].slot
    r = _roundtrip(p, leases, pool)
    leases.cache.forget(p.tensors[0].loc.segment)  # views stay valid, the mapping is gone
    fed = _starve_attach(monkeypatch)
    r.release()
    assert pool.table["state"][slot] == shm.IN_FLIGHT and leases.live == 0
    fed()
    leases.sweep()
    assert pool.table["state"][slot] == shm.RELEASED
    leases.close()
