"""The lean by-reference path, held to the general path's behaviour.

`tensors.pack` sends one whole `client.alloc` buffer by reference in one step;
`tensors.local_output` hands back "the output is exactly one of this request's inputs" (the
usual echo) without re-slicing it, and an output viewing a `client.alloc` buffer without a
`weakref.finalize` (it has nothing to give back); `ClientCore` passes its own pool's inputs to
`unpack` without a closure per call.  Each must send the same descriptor, mark and free the
same slots and deliver arrays of the same lifetime as the general path, and leave anything
else to it.
"""
from __future__ import annotations

import gc
import types

import numpy as np
import pytest

import shm
from broker import protocol as P
from client_sdk import Client
from client_sdk import tensors as T
from client_sdk.errors import InferenceError
from client_sdk.core import ClientCore

from .test_sdk_client import WAIT

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["shm", "auto"])
def core(request, tmp_path):
    c = ClientCore(f"ipc://{tmp_path}/none.sock", transport=request.param, heartbeat_interval=None)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def spy(monkeypatch):
    """Counts the general path's look-ups (`ref_in_pool`): the lean branch makes none."""
    calls = []
    real = T.ref_in_pool

    def counted(pool, arr):
        calls.append(arr)
        return real(pool, arr)

    monkeypatch.setattr(T, "ref_in_pool", counted)
    return calls


def _general(inputs: dict, core: ClientCore) -> T.Packed:
    # Not a dict: the lean branches are skipped, the general loop packs it.
    return T.pack(types.MappingProxyType(inputs), core.pool, inline_max=core.inline_max)


def _lean(inputs: dict, core: ClientCore) -> T.Packed:
    return T.pack(inputs, core.pool, inline_max=core.inline_max)


def _state(core: ClientCore, slot: int) -> int:
    return int(core.pool.table["state"][slot])


# ================================================================================================
# pack(): one whole client.alloc buffer

@pytest.mark.parametrize("shape, dtype", [((64, 48, 3), np.uint8), ((4097,), np.uint8), ((33, 40), np.float32),
                                          ((2, 3, 4, 90), ">i4"), ((1200,), np.complex128)])
def test_a_whole_alloc_buffer_packs_as_the_general_path_does(core, spy, shape, dtype):
    x = core.alloc(shape, dtype)
    x[...] = 1
    ref = core.pool.ref_of(x.base._src)
    lean = _lean({"x": x}, core)
    assert spy == []  # the lean branch: no general look-up
    assert _state(core, ref.slot) == shm.IN_FLIGHT  # marked before the descriptor leaves
    general = _general({"x": x}, core)  # marking again only updates the holder
    assert len(spy) == 1
    assert lean.tensors == general.tensors
    assert lean.tensors[0] == P.TensorRef(name="x", dtype=np.dtype(dtype).str, shape=list(shape), loc=P.shm_loc(ref))
    for p in (lean, general):
        assert p.arrays["x"] is x and p.uses_shm and p.frames == [] and p.temp == [] and p.cuda_temp is None
    assert core.pool.in_use() == 1  # no temporary slot
    core.free(x)
    assert core.pool.in_use() == 0


def test_views_of_an_alloc_buffer_take_the_general_path(core, spy):
    x = core.alloc((8, 1024), np.float32)
    x[...] = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    whole = core.pool.ref_of(x.base._src)
    cases = [
        (x[2:], P.shm_loc(shm.ShmRef(whole.segment, whole.offset + 2 * 4096, 6 * 4096, whole.slot,
                                     whole.generation))),   # a sub-slice: the same slot, by reference
        (x.reshape(-1), P.shm_loc(whole)),                   # every byte, through a view
        (x.view(np.uint8), P.shm_loc(whole)),
        (x[:, ::2], None),                                   # strided: copied into a temporary slot
    ]
    for v, want in cases:
        spy.clear()
        p = _lean({"v": v}, core)
        assert spy == [v]  # the general path looked it up
        if want is None:
            assert len(p.temp) == 1 and p.tensors[0].loc.slot != whole.slot
            np.testing.assert_array_equal(p.arrays["v"], v)
            T.free_temp(core.pool, p.temp)
        else:
            assert p.tensors == _general({"v": v}, core).tensors
            assert p.tensors[0].loc == want and p.temp == [] and p.arrays["v"] is v
    assert core.pool.in_use() == 1


def test_what_is_no_live_buffer_of_this_pool_takes_the_general_path(core, tmp_path, spy):
    other = ClientCore(f"ipc://{tmp_path}/other.sock", transport="shm", heartbeat_interval=None)
    try:
        theirs = other.alloc((4200,), np.uint8)
        theirs[...] = 7
        p = _lean({"x": theirs}, core)  # another client's buffer: copied into one of ours
        assert len(spy) == 1 and len(p.temp) == 1 and p.tensors[0].loc.segment == core.pool.name
        np.testing.assert_array_equal(p.arrays["x"], theirs)
        T.free_temp(core.pool, p.temp)
    finally:
        other.close()
    x = core.alloc((4200,), np.uint8)
    x[...] = 3
    core.free(x)  # its slot is gone: the bytes are copied, as before
    spy.clear()
    p = _lean({"x": x}, core)
    assert spy == [x] and len(p.temp) == 1
    np.testing.assert_array_equal(p.arrays["x"], 3)
    T.free_temp(core.pool, p.temp)
    small = core.alloc((16,), np.uint8)  # at most inline_max bytes: inline, as before
    p = _lean({"s": small}, core)
    assert (type(p.tensors[0].loc) is P.InlineLoc) == (core.transport == "auto") and p.temp == []
    empty = core.alloc((0,), np.uint8)
    assert T.ref_in_pool(core.pool, empty) is None  # as before: zero bytes are never a reference
    p = _lean({"e": empty}, core)
    assert p.frames == [b""] and not p.uses_shm
    assert core.pool.in_use() == 2  # small and empty
    p = T.pack({"x": core.alloc((5000,), np.uint8)}, None)  # no pool (inline only): not by reference
    assert type(p.tensors[0].loc) is P.InlineLoc


def test_ref_in_pool_of_alloc_buffers_and_their_views(core):
    x = core.alloc((4, 1000), np.int16)
    whole = core.pool.ref_of(x.base._src)
    assert T.ref_in_pool(core.pool, x) == whole
    part = T.ref_in_pool(core.pool, x[1:3])
    assert (part.slot, part.offset, part.nbytes) == (whole.slot, whole.offset + 2000, 4000)
    assert T.ref_in_pool(core.pool, x[:, 1:]) is None  # not contiguous
    assert T.ref_in_pool(core.pool, np.zeros(4)) is None
    core.free(x)
    assert T.ref_in_pool(core.pool, x) is None


# ================================================================================================
# Outputs that are this request's own inputs

def _identity(call) -> P.Reply:
    return P.Reply(id=call.id, tensors=list(call.packed.tensors), timing={"compute_ms": 0.5})


def _deliver(core: ClientCore, call, rep: P.Reply, *, general: bool):
    """Route `rep` to `call`: in one step, or (an empty first frame) through the general path."""
    frames = P.client_reply(True, call.service.encode(), [P.encode_header(rep)])
    assert core.on_message([b"", *frames] if general else frames, 2.0, direct=True) == []
    kind, res = call.inbox.popleft()
    assert kind == "final"
    return res


@pytest.mark.parametrize("general", [False, True])
def test_an_alloc_buffer_handed_back_is_a_read_only_view_of_it(core, general):
    x = core.alloc((64, 96), np.float32)
    x[...] = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    slot = core.pool.ref_of(x.base._src).slot
    call = core.new_call("identity", {"x": x})
    core.request_frames(call, 1.0)
    res = _deliver(core, call, _identity(call), general=general)
    y = res["x"]
    assert res.zero_copy == {"x": True} and not y.flags.writeable
    assert np.shares_memory(y, x) and y.dtype == x.dtype and y.shape == x.shape
    assert type(y.base) is T._Lease  # views of it keep it: its base never collapses
    assert y.base._src is x  # the whole input as sent: not sliced again
    assert [type(f) for f in res._fins] == [T._NothingToFree]  # nothing to give back, no weakref.finalize
    assert call.adopted == {} and core.in_flight() == 0
    assert _state(core, slot) == shm.IN_FLIGHT and core.pool.in_use() == 1  # still the caller's
    x[0, 0] = -1  # the same bytes, no copy
    assert y[0, 0] == -1
    # Sent again, it is copied (as before): an output is never a buffer of the caller's.
    p = T.pack({"y": y}, core.pool, inline_max=core.inline_max)
    assert len(p.temp) == 1
    T.free_temp(core.pool, p.temp)
    tail = y[1:].T
    res.release()
    assert res.released and res.zero_copy == {}
    with pytest.raises(InferenceError, match="released"):
        res["x"]
    # The caller's buffer lives as long as any view of it: its own, or an output's.
    del x, y, p, call
    gc.collect()
    assert core.pool.in_use() == 1
    assert tail[0, 0] == 96.0
    del tail
    gc.collect()
    assert core.pool.in_use() == 0


def test_an_output_that_is_part_of_an_input_or_another_type_is_sliced_as_before(core):
    x = core.alloc((16, 512), np.uint8)
    x[...] = np.arange(x.size, dtype=np.uint64).reshape(x.shape).astype(np.uint8)
    call = core.new_call("identity", {"x": x})
    core.request_frames(call, 1.0)
    loc = call.packed.tensors[0].loc
    half = P.ShmLoc(segment=loc.segment, offset=loc.offset + 4096, nbytes=4096, slot=loc.slot,
                    generation=loc.generation)
    rep = P.Reply(id=call.id, tensors=[
        P.TensorRef(name="half", dtype="|u1", shape=[8, 512], loc=half),
        P.TensorRef(name="words", dtype="<u4", shape=[16, 128], loc=loc),   # other dtype, same bytes
        P.TensorRef(name="flat", dtype="|u1", shape=[8192], loc=loc),       # other shape
    ])
    res = _deliver(core, call, rep, general=False)
    np.testing.assert_array_equal(res["half"], x[8:])
    np.testing.assert_array_equal(res["words"], x.view("<u4"))
    np.testing.assert_array_equal(res["flat"], x.reshape(-1))
    assert res.zero_copy == {"half": True, "words": True, "flat": True}
    assert all(not a.flags.writeable and np.shares_memory(a, x) and a.base._src is not x for a in res.values())
    res.release()
    core.free(x)


@pytest.mark.parametrize("general", [False, True])
def test_a_temporary_slot_handed_back_is_adopted_as_before(core, general):
    x = np.arange(3000, dtype=np.float64).reshape(30, 100)
    call = core.new_call("identity", {"x": x})
    core.request_frames(call, 1.0)
    (tref,) = call.packed.temp
    res = _deliver(core, call, _identity(call), general=general)
    y = res["x"]
    np.testing.assert_array_equal(y, x)
    assert res.zero_copy == {"x": True} and not y.flags.writeable
    assert call.packed.temp == [] and call.adopted == {}  # adopted, then the request's hold dropped
    assert core.pool.in_use() == 1 and _state(core, tref.slot) == shm.IN_FLIGHT
    assert y.base._src is call.packed.arrays["x"]  # the slot's own array: not sliced again
    assert T.ref_in_pool(core.pool, y) == tref  # sent again: by reference of the adopted slot, as before
    res.release()  # the slot goes back at once
    assert core.pool.in_use() == 0
    res.release()  # idempotent
    # Without release(): when the last view of it goes.
    call = core.new_call("identity", {"x": x})
    core.request_frames(call, 3.0)
    res = _deliver(core, call, _identity(call), general=general)
    keep = res["x"][3:]
    del res, y
    gc.collect()
    assert core.pool.in_use() == 1  # a view still reads it
    np.testing.assert_array_equal(keep, x[3:])
    del keep
    gc.collect()
    assert core.pool.in_use() == 0


def test_the_stand_in_finalizer_of_an_alloc_output():
    arr = np.arange(3)
    fin = T._NothingToFree(arr)
    assert fin.alive and fin.peek()[0] is arr
    assert fin() is None and not fin.alive and fin.peek() is None and fin.detach() is None
    fin = T._NothingToFree(arr)
    assert fin.detach()[0] is arr and not fin.alive
    fin = T._NothingToFree(np.arange(2))  # its array gone: dead, like a weakref.finalize
    gc.collect()
    assert not fin.alive and fin.peek() is None


def test_outputs_of_a_request_with_no_shared_memory_inputs_are_never_local(core):
    call = core.new_call("echo", {"x": np.zeros(0, np.int16)})  # empty: inline, whatever the transport
    assert not call.packed.uses_shm and core._own_inputs(call) is None


# ================================================================================================
# Through a blocking client

@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_client_sends_an_alloc_buffer_by_reference_and_gets_it_back(fake, endpoint, transport):
    with Client(endpoint, transport=transport, timeout=WAIT) as c:
        x = c.alloc((48, 64, 3), np.uint8)
        x[...] = 5
        ref = c.pool.ref_of(x.base._src)
        for _ in range(3):  # the first one checks the service; then the lean path
            with c.infer("identity", {"x": x}) as r:
                assert r.zero_copy == {"x": True} and not r["x"].flags.writeable
                assert np.shares_memory(r["x"], x)
                np.testing.assert_array_equal(r["x"], 5)
            _, req = fake.requests[-1]
            assert [t.loc for t in req.tensors] == [P.shm_loc(ref)]
            assert c.pool.in_use() == 1 and c.in_flight() == 0
        with c.infer("echo", {"x": x}) as r:  # a copy in the worker's memory
            np.testing.assert_array_equal(r["x"], 5)
            assert r.zero_copy == {"x": True} and not np.shares_memory(r["x"], x)
        c.free(x)
        assert c.pool.in_use() == 0
