"""CudaLoc on the wire and the host state table of a device pool, on the CPU.

The release path of a device slot is the host one: the owner's state words live in a zinf
segment, a reader stores RELEASED through shm.SegmentCache, the owner's book reclaims.
"""
from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from broker import protocol as P
from shm import SegmentCache, SegmentGone, StaleDescriptor, BadDescriptor
from shm.cuda import (
    HANDLE_SIZE, DevicePoolBook, DeviceRef, HostStateTable, PoolMeta, check_ref, host_ref,
    read_pool_meta,
)
from shm.segment import path_of

POOL = "zinf-4242-81234-0f3a9c2d4b5e6f70-5"


def ref(**kw):
    base = dict(pool=POOL, offset=512, nbytes=1080 * 1920 * 3, slot=3, generation=9, device=1)
    base.update(kw)
    return DeviceRef(**base)


def test_loc_round_trip_through_a_request_header():
    r = ref(handle=b"\x01" * HANDLE_SIZE, event=b"\x02" * HANDLE_SIZE)
    loc = P.cuda_loc(r)
    req = P.Request(id=7, pid=4242, tensors=[P.TensorRef(name="image", dtype="|u1", shape=[1080, 1920, 3], loc=loc)])
    back = P.decode_request(P.encode_header(req))
    got = back.tensors[0].loc
    assert type(got) is P.CudaLoc
    assert got.handle == b"\x01" * HANDLE_SIZE and got.event == b"\x02" * HANDLE_SIZE
    assert check_ref(got) == r and P.device_ref(got) == r


def test_loc_without_handle_and_reply_side():
    r = ref(nbytes=4000, offset=0, slot=0, generation=0, device=0)
    loc = P.cuda_loc(r)
    rep = P.decode_reply(P.encode_header(P.Reply(id=1, tensors=[P.TensorRef(name="logits", dtype="<f4", shape=[1000], loc=loc)])))
    assert check_ref(rep.tensors[0].loc) == r and rep.tensors[0].loc.handle == b""


def test_protocol_checks_nbytes_against_dtype_and_shape():
    loc = P.cuda_loc(ref(nbytes=10))
    req = P.Request(id=1, tensors=[P.TensorRef(name="x", dtype="<f4", shape=[3], loc=loc)])
    with pytest.raises(P.ProtocolError, match="need 12"):
        P.decode_request(P.encode_header(req))


# The pool id is a segment name and nothing else.  A location without slot fields (slot -1,
# as an old peer sent it, with "<segment>/<slot>/<generation>" in the pool id) used to be
# parsed from the pool id; that fallback is gone, so it is refused.
@pytest.mark.parametrize("pool, slot, err", [
    (POOL, -1, "names no slot"),
    (f"{POOL}/1/2", -1, "names no slot"),
    ("../etc/passwd/1/2", -1, "names no slot"),
    ("../etc/passwd/1/2", 1, "not a state-table segment name"),
    ("..%2Fpasswd", 1, "not a state-table segment name"),
    (POOL + "/x/2", 1, "not a state-table segment name"),
    (POOL + "/1/-2", 1, "not a state-table segment name"),
])
def test_bad_pool_ids_are_refused(pool, slot, err):
    loc = P.CudaLoc(pool=pool, offset=0, nbytes=1, device=0, slot=slot, generation=2)
    with pytest.raises(BadDescriptor, match=err):
        check_ref(loc)


def test_bad_fields_are_refused():
    with pytest.raises(BadDescriptor, match="handle must be 64 bytes"):
        check_ref(P.CudaLoc(pool=POOL, offset=0, nbytes=1, device=0, handle=b"x", slot=1, generation=2))
    with pytest.raises(BadDescriptor, match="device"):
        check_ref(P.CudaLoc(pool=POOL, offset=0, nbytes=1, device=-1, slot=1, generation=2))
    with pytest.raises(BadDescriptor, match="generation"):
        check_ref(P.CudaLoc(pool=POOL, offset=0, nbytes=1, device=0, slot=1, generation=1 << 33))
    with pytest.raises(BadDescriptor, match="slot"):
        check_ref(P.CudaLoc(pool=POOL, offset=0, nbytes=1, device=0, slot=-2, generation=2))


def test_a_loc_carries_its_slot_fields_on_the_wire():
    r = ref()
    loc = P.cuda_loc(r)
    assert loc.pool == POOL and loc.slot == 3 and loc.generation == 9
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(loc), type=P.CudaLoc)
    assert check_ref(wire) == r and P.device_ref(wire) == r
    # An old peer's location (no slot fields sent, the slot in the pool id) is refused.
    with pytest.raises(BadDescriptor, match="names no slot"):
        check_ref(P.CudaLoc(pool=f"{POOL}/3/9", offset=512, nbytes=r.nbytes, device=1))


def test_host_state_table_release_path():
    table = HostStateTable(8)
    cache = SegmentCache()
    try:
        assert os.readlink(path_of(table.name)).startswith("/memfd:")
        table.write_meta(PoolMeta(1 << 20, 2, 256, b"\xab" * 64, b"\x11" * 16))
        meta, data_offset = read_pool_meta(table.name)
        assert meta == PoolMeta(1 << 20, 2, 256, b"\xab" * 64, b"\x11" * 16)
        assert data_offset == table.data_offset
        book = DevicePoolBook(1 << 20, slots=8, words=table.words, record_offset=table.data_offset)
        s = book.alloc(1000)
        r = DeviceRef(table.name, s.offset, s.nbytes, s.slot, s.generation, 2)
        h = host_ref(r, data_offset)
        with pytest.raises(StaleDescriptor):  # WRITING: not visible to readers yet
            cache.view(h, np.uint8, (0,))
        book.mark_in_flight(s.slot, s.generation)
        cache.view(h, np.uint8, (0,))  # validation only: the slot is IN_FLIGHT at that generation
        cache.release(h)
        cache.release(h)  # idempotent until reclaimed
        assert book.reclaim() == 1
        with pytest.raises(StaleDescriptor):
            cache.release(h)
        # Through a real CudaLoc, as a consumer gets it.
        s2 = book.alloc(10)
        book.mark_in_flight(s2.slot, s2.generation)
        loc = P.cuda_loc(DeviceRef(table.name, s2.offset, 10, s2.slot, s2.generation, 2))
        cache.release(host_ref(check_ref(loc), data_offset))
        assert book.reclaim() == 1
    finally:
        cache.close()
        table.close()
    with pytest.raises(SegmentGone):
        read_pool_meta(table.name)


def test_closed_table_tells_cached_readers():
    table = HostStateTable(2)
    cache = SegmentCache()
    try:
        table.write_meta(PoolMeta(4096, 0, 256, b"\0" * 64, b""))
        book = DevicePoolBook(4096, slots=2, words=table.words, record_offset=table.data_offset)
        s = book.alloc(1)
        book.mark_in_flight(s.slot, s.generation)
        h = host_ref(DeviceRef(table.name, s.offset, 1, s.slot, s.generation, 0), table.data_offset)
        cache.view(h, np.uint8, (0,))
        assert read_pool_meta(table.name)[0].uuid == b""
        table.close()
        with pytest.raises(SegmentGone):
            cache.view(h, np.uint8, (0,))
    finally:
        cache.close()
        table.close()


def test_read_pool_meta_refuses_plain_segments():
    from shm import ShmPool

    with ShmPool(4096, slots=1) as p:
        with pytest.raises(BadDescriptor, match="not a device pool"):
            read_pool_meta(p.name)
