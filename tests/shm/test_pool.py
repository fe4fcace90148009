"""Owner side: allocation, descriptors, state transitions, exhaustion, close."""
from __future__ import annotations

import gc as pygc
import os
import subprocess
import sys

import numpy as np
import pytest

from shm import (
    FREE, IN_FLIGHT, RELEASED, WRITING, BadDescriptor, SegmentCache, ShmError, ShmFull, ShmPool,
    ShmRef, StaleDescriptor,
)
from shm import SegmentGone
from shm.segment import HEADER_DTYPE, MAGIC, SEALS, open_checked, parse_name, path_of, proc_starttime
from tests.children import wait_child


def path(pool: ShmPool) -> str:
    return path_of(pool.name)


def exists(name: str) -> bool:
    """Whether segment ``name`` can still be opened by a reader."""
    try:
        fd, _ = open_checked(name, os.O_RDONLY)
    except SegmentGone:
        return False
    os.close(fd)
    return True


def record(pool: ShmPool, slot: int) -> dict:
    r = pool.table[slot]
    return {k: int(r[k]) for k in pool.table.dtype.names}


def test_segment_file_name_header_and_mode():
    with ShmPool(1 << 16, slots=8) as pool:
        pid, st = parse_name(pool.name)
        assert pid == os.getpid() and st == proc_starttime(os.getpid())
        s = os.stat(path(pool))
        assert s.st_mode & 0o777 == 0o600
        assert s.st_size == pool.data_offset + pool.capacity
        with open(path(pool), "rb") as f:
            h = np.frombuffer(f.read(HEADER_DTYPE.itemsize), HEADER_DTYPE)[0]
        assert bytes(h["magic"]) == MAGIC
        assert int(h["slot_count"]) == 8 and int(h["data_offset"]) == pool.data_offset
        assert int(h["data_size"]) == pool.capacity and int(h["align"]) == 64
        assert int(h["owner_pid"]) == os.getpid() and int(h["closed"]) == 0
        assert pool.data_offset % 4096 == 0 and pool.data_offset >= 4096 + 64 * 8
    assert not exists(pool.name)


def test_segment_is_a_sealed_memfd_nobody_can_resize():
    import fcntl

    with ShmPool(1 << 16, slots=8) as pool:
        assert os.readlink(path(pool)).startswith("/memfd:zinf-")
        assert not os.path.exists(os.path.join("/dev/shm", pool.name))  # no name in any filesystem
        fd = os.open(path(pool), os.O_RDWR)
        try:
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            for size in (0, 4096, pool.data_offset + pool.capacity + 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(fd)


def test_alloc_returns_writable_c_contiguous_arrays_in_the_segment():
    with ShmPool(1 << 16, slots=8) as pool:
        a = pool.alloc((3, 5), np.float32)
        assert a.shape == (3, 5) and a.dtype == np.float32
        assert a.flags.c_contiguous and a.flags.writeable
        a[:] = 1.5
        ref = pool.ref_of(a)
        assert ref == ShmRef(pool.name, ref.offset, 60, ref.slot, 0)
        assert pool.data_offset <= ref.offset and ref.offset + 60 <= pool.data_offset + pool.capacity
        rec = record(pool, ref.slot)
        assert rec["state"] == WRITING and rec["offset"] == ref.offset and rec["nbytes"] == 60
        # The bytes really are in the file.
        with open(path(pool), "rb") as f:
            f.seek(ref.offset)
            assert np.frombuffer(f.read(60), np.float32).tolist() == [1.5] * 15
        b = pool.alloc(7, "u1")
        assert b.shape == (7,)
        assert pool.in_use() == 2


def test_shapes_and_dtypes():
    with ShmPool(1 << 16, slots=16) as pool:
        assert pool.alloc((), np.float64).shape == ()
        assert pool.alloc([2, np.int64(3)], np.int16).shape == (2, 3)
        rec = np.dtype([("a", "<i4"), ("b", "<f8")])
        assert pool.alloc(4, rec).dtype == rec
        with pytest.raises(TypeError):
            pool.alloc(3, object)
        with pytest.raises(TypeError):
            pool.alloc(3, np.dtype([("a", "O")]))
        with pytest.raises(ValueError):
            pool.alloc((2, -1), np.float32)
        with pytest.raises(TypeError):
            pool.alloc((2.0,), np.float32)
        with pytest.raises(ValueError):
            pool.alloc_nbytes(-1)
        assert pool.in_use() == 3  # failures took nothing


def test_empty_and_zero_d_arrays_get_slots():
    with ShmPool(1 << 16, slots=8) as pool, SegmentCache() as cache:
        e = pool.alloc((0, 4), np.float32)
        z = pool.alloc((), np.int64)
        z[()] = 42
        re, rz = pool.ref_of(e), pool.ref_of(z)
        assert re.nbytes == 0 and rz.nbytes == 8 and re.slot != rz.slot
        assert pool.ref_of(e.reshape(4, 0)) == re
        pool.mark_in_flight(re)
        pool.mark_in_flight(rz)
        assert cache.view(re, np.float32, (0, 4)).shape == (0, 4)
        assert cache.view(rz, np.int64, ()).item() == 42
        ref, mv = pool.alloc_nbytes(0)
        assert ref.nbytes == 0 and len(mv) == 0
        pool.free(re)
        with pytest.raises(StaleDescriptor):
            pool.free(re)


def test_ref_of_views_and_foreign_arrays():
    with ShmPool(1 << 16, slots=8) as pool:
        a = pool.alloc((4, 8), np.float32)
        full = pool.ref_of(a)
        assert pool.ref_of(a) is full  # cached, O(1)
        assert pool.ref_of(a.reshape(-1)) == full
        assert pool.ref_of(a.view(np.uint8)) == full
        sub = pool.ref_of(a[1:3])
        assert sub == ShmRef(pool.name, full.offset + 32, 64, full.slot, full.generation)
        assert pool.ref_of(a[1:3][1:]) == ShmRef(pool.name, full.offset + 64, 32, full.slot, 0)
        assert pool.ref_of(a[:, 1:]) is None  # not contiguous
        assert pool.ref_of(a.T) is None
        assert pool.ref_of(np.zeros((4, 8), np.float32)) is None
        assert pool.ref_of(np.frombuffer(bytearray(8), np.uint8)) is None
        assert pool.ref_of("not an array") is None
        with ShmPool(1 << 16, slots=8) as other:
            assert other.ref_of(a) is None
        one_d = pool.alloc(16, np.uint8)
        assert pool.ref_of(one_d).nbytes == 16
        assert pool.ref_of(one_d[4:]).offset == pool.ref_of(one_d).offset + 4
        ref, mv = pool.alloc_nbytes(100)
        assert pool.ref_of(mv) is ref
        assert pool.ref_of(mv[10:20]) == ShmRef(pool.name, ref.offset + 10, 10, ref.slot, ref.generation)
        assert pool.ref_of(np.frombuffer(mv, np.uint8)[50:]) == ShmRef(pool.name, ref.offset + 50, 50, ref.slot, 0)
        pool.free(full)
        # A stale array of a freed slot is not attributed to whoever gets the bytes next.
        b = pool.alloc((4, 8), np.float32)
        assert pool.ref_of(a) is None and pool.ref_of(a[1:]) is None
        assert pool.ref_of(b).generation == 1 or pool.ref_of(b).slot != full.slot


def test_ref_of_large_array():
    with ShmPool((64 << 20) + 4096, slots=4) as pool:
        big = pool.alloc(64 << 20, np.uint8)  # never touched: tmpfs pages stay unallocated
        small = pool.alloc(64, np.uint8)
        assert pool.ref_of(big).nbytes == 64 << 20
        assert pool.ref_of(small).nbytes == 64
        assert pool.ref_of(big[1 << 20 :]).nbytes == 63 << 20


def test_state_transitions_and_generations():
    with ShmPool(1 << 16, slots=4) as pool, SegmentCache() as cache:
        a = pool.alloc(16, np.uint8)
        ref = pool.ref_of(a)
        assert record(pool, ref.slot)["state"] == WRITING
        pool.mark_in_flight(ref, holder_pid=os.getpid())
        rec = record(pool, ref.slot)
        assert rec["state"] == IN_FLIGHT and rec["holder_pid"] == os.getpid()
        assert rec["holder_starttime"] == proc_starttime(os.getpid())
        pool.mark_in_flight(ref)  # a retry re-sends: allowed, clears the holder
        assert record(pool, ref.slot)["holder_pid"] == 0
        cache.view(ref, np.uint8, 16)
        cache.release(ref)
        cache.release(ref)  # idempotent until reclaimed
        assert record(pool, ref.slot)["state"] == RELEASED
        with pytest.raises(StaleDescriptor):
            pool.mark_in_flight(ref)
        assert pool.reclaim() == 1
        rec = record(pool, ref.slot)
        assert rec["state"] == FREE and rec["generation"] == 1
        with pytest.raises(StaleDescriptor):
            cache.release(ref)
        with pytest.raises(StaleDescriptor):
            pool.free(ref)
        with pytest.raises(StaleDescriptor):
            pool.mark_in_flight(ref)
        # The owner may free a slot in any live state; each return to FREE bumps generation.
        gens = []
        for _ in range(3):
            b = pool.alloc(8, np.uint8)
            rb = pool.ref_of(b)
            gens.append((rb.slot, rb.generation))
            pool.free(rb)
        for s, g in gens:
            assert record(pool, s)["generation"] > g


def test_owner_rejects_foreign_and_forged_descriptors():
    with ShmPool(1 << 16, slots=4) as pool:
        ref = pool.ref_of(pool.alloc(64, np.uint8))
        with pytest.raises(BadDescriptor):
            pool.free(ref._replace(segment="zinf-1-1-0000000000000000-5"))
        with pytest.raises(BadDescriptor):
            pool.free(ref._replace(slot=99))
        with pytest.raises(BadDescriptor):
            pool.free(ref._replace(nbytes=65))
        with pytest.raises(BadDescriptor):
            pool.mark_in_flight(ref._replace(offset=ref.offset - 64))
        with pytest.raises(StaleDescriptor):
            pool.free(ref._replace(generation=5))
        with pytest.raises(BadDescriptor):
            pool.free(("x",))
        with pytest.raises(ValueError):
            pool.mark_in_flight(ref, holder_pid=-3)
        pool.free(ref)


def test_exhaustion_raises_shmfull_and_changes_nothing():
    with ShmPool(4096, slots=4, align=64) as pool:
        a = pool.alloc(3000, np.uint8)
        a[:] = 7
        before = pool.table.copy()
        with pytest.raises(ShmFull, match="capacity"):
            pool.alloc(2000, np.uint8)
        with pytest.raises(ShmFull, match="larger than the whole data area"):
            pool.alloc(5000, np.uint8)
        assert pool.try_alloc(2000, np.uint8) is None
        assert (pool.table == before).all() and pool.in_use() == 1 and (a == 7).all()
        for _ in range(3):
            pool.alloc(0, np.uint8)
        with pytest.raises(ShmFull, match="slots"):
            pool.alloc(1, np.uint8)
        assert isinstance(ShmFull("x"), ShmError) and isinstance(ShmFull("x"), ValueError)


def test_alloc_reclaims_released_slots_before_failing():
    with ShmPool(4096, slots=4) as pool, SegmentCache() as cache:
        refs = []
        for _ in range(4):
            refs.append(pool.ref_of(pool.alloc(1024, np.uint8)))
            pool.mark_in_flight(refs[-1])
        for r in refs:
            cache.release(r)
        assert pool.in_use() == 4
        big = pool.alloc(4096, np.uint8)  # succeeds only through reclaim()
        assert big.nbytes == 4096 and pool.in_use() == 1


def test_ring_wraps_and_frees_out_of_order():
    with ShmPool(4096, slots=16, align=64) as pool:
        a = pool.ref_of(pool.alloc(1024, np.uint8))
        b = pool.ref_of(pool.alloc(1024, np.uint8))
        c = pool.ref_of(pool.alloc(1024, np.uint8))
        pool.free(b)  # out of order: a still blocks the tail
        with pytest.raises(ShmFull):
            pool.alloc(2048, np.uint8)
        pool.free(a)  # tail jumps over a and b
        d = pool.ref_of(pool.alloc(1024, np.uint8))  # fits at the end
        assert d.offset == c.offset + 1024
        e = pool.ref_of(pool.alloc(2048, np.uint8))  # wraps to the start
        assert e.offset == pool.data_offset
        assert pool._wraps == 1
        with pytest.raises(ShmFull):
            pool.alloc(64, np.uint8)
        for r in (c, d, e):
            pool.free(r)
        assert pool.in_use() == 0
        assert pool.ref_of(pool.alloc(4096, np.uint8)).offset == pool.data_offset


def test_alloc_free_round_trip_does_not_walk_the_ring():
    # A long-lived allocation plus many short ones freed newest-first must never fill up.
    with ShmPool(4096, slots=4) as pool:
        keep = pool.alloc(64, np.uint8)
        for _ in range(1000):
            x = pool.alloc(1000, np.uint8)
            pool.free(pool.ref_of(x))
        assert pool.ref_of(keep) is not None


def test_align_2mib():
    align = 2 << 20
    with ShmPool(5 << 20, slots=8, align=align) as pool:
        assert pool.data_offset % align == 0
        assert pool.capacity == 6 << 20  # rounded up to a whole number of aligned blocks
        refs = [pool.ref_of(pool.alloc(n, np.uint8)) for n in (1, 100, 4096)]
        assert all(r.offset % align == 0 for r in refs)
        assert len({r.offset for r in refs}) == 3
        with pytest.raises(ShmFull):
            pool.alloc(1, np.uint8)
    with pytest.raises(ValueError):
        ShmPool(1 << 16, align=3)
    with pytest.raises(ValueError):
        ShmPool(0)
    with pytest.raises(ValueError):
        ShmPool(1 << 16, slots=0)


def test_close_is_idempotent_and_keeps_live_arrays_valid():
    pool = ShmPool(1 << 16, slots=4)
    a = pool.alloc(100, np.uint8)
    a[:] = 9
    p = path(pool)
    pool.close()
    pool.close()
    assert not os.path.exists(p) and pool.closed
    # The mapping outlives the pool while an array uses it (no segfault, same bytes).
    assert (a == 9).all()
    a[0] = 1
    with pytest.raises(ShmError, match="closed"):
        pool.alloc(1, np.uint8)
    assert pool.in_use() == 0 and pool.reclaim() == 0


def test_garbage_collected_pool_unlinks_its_segment():
    pool = ShmPool(1 << 16, slots=4)
    p = path(pool)
    del pool
    pygc.collect()
    assert not os.path.exists(p)


# 3.12: forks on purpose; alone the process has one thread, in a full run earlier tests' process-wide
# threads (pyzmq's zero-copy garbage collector, the log writer, libzmq's) are there to warn about.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_does_not_unlink_the_parents_segment():
    with ShmPool(1 << 16, slots=4) as pool:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            pool.close()
            os._exit(0)
        assert wait_child(pid, 30, "closing its copy of the pool") == 0
        assert exists(pool.name)


def test_reclaim_frees_in_flight_slots_of_dead_holders():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # reaped: its pid is now dead (or a different process)
    with ShmPool(1 << 16, slots=4) as pool:
        mine = pool.ref_of(pool.alloc(8, np.uint8))
        theirs = pool.ref_of(pool.alloc(8, np.uint8))
        nobody = pool.ref_of(pool.alloc(8, np.uint8))
        pool.mark_in_flight(mine, holder_pid=os.getpid())
        pool.mark_in_flight(theirs, holder_pid=child.pid)
        pool.mark_in_flight(nobody)
        assert pool.reclaim() == 1
        assert record(pool, theirs.slot)["state"] == FREE
        assert record(pool, mine.slot)["state"] == IN_FLIGHT
        assert record(pool, nobody.slot)["state"] == IN_FLIGHT
        assert pool.in_use() == 2


def test_stale_released_store_is_repaired_not_trusted():
    with ShmPool(1 << 16, slots=1) as pool, SegmentCache() as cache:
        old = pool.ref_of(pool.alloc(8, np.uint8))
        pool.mark_in_flight(old)
        cache.view(old, np.uint8, 8)
        pool.free(old)  # the owner takes it back while a reader still holds it (misuse)
        new = pool.ref_of(pool.alloc(8, np.uint8))
        pool.mark_in_flight(new)
        # Simulate the old reader's release landing late: (old generation, RELEASED).
        pool._q[new.slot * 8] = (old.generation << 32) | RELEASED
        assert pool.reclaim() == 0  # not freed...
        rec = record(pool, new.slot)
        assert rec["state"] == IN_FLIGHT and rec["generation"] == new.generation  # ...repaired
        assert cache.view(new, np.uint8, 8).nbytes == 8


def test_a_holder_whose_liveness_cannot_be_read_is_alive_not_dead(monkeypatch):
    # Out of descriptors, /proc/<pid>/stat could not be opened, and that read as "no such
    # process": the worker reclaimed the output slot of a live client that still held its
    # result, and the next request's output was written over it (seen at RLIMIT_NOFILE).
    import errno

    import shm.segment as segment

    real_open = os.open
    blocked = {"on": False}

    def fake_open(path, *a, **kw):
        if blocked["on"] and str(path).startswith("/proc/"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with ShmPool(1 << 16, slots=4) as pool:
            unknown = pool.ref_of(pool.alloc(8, np.uint8))
            known = pool.ref_of(pool.alloc(8, np.uint8))
            pool.mark_in_flight(known, holder_pid=child.pid)  # its starttime read (and cached)
            blocked["on"] = True
            with pytest.raises(segment.OutOfResources):
                proc_starttime(child.pid)
            assert segment.process_alive(child.pid, 12345) is True  # cannot tell: alive
            pool.mark_in_flight(unknown, holder_pid=child.pid)  # its starttime cannot be read
            assert pool.reclaim() == 0
            blocked["on"] = False
            assert pool.reclaim() == 0  # readable again, and the holder lives
            assert record(pool, unknown.slot)["state"] == IN_FLIGHT
            child.stdin.close()
            child.wait(timeout=30)
            assert pool.reclaim() == 2  # it exited: both go
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_a_free_cut_short_by_a_signal_never_leaves_a_stale_descriptor_cached():
    # Ctrl-C (or an alarm's handler) raising inside the free: the slot was already on the
    # free list with the old generation's descriptor still cached, and the next allocation
    # on it was refused as stale.  The caches are forgotten before the slot is published.
    with ShmPool(1 << 16, slots=2) as pool:
        first = pool.alloc(8, np.uint8)
        old = pool.ref_of(first)  # cached
        book = pool._book
        real = book._on_free

        def interrupted(slot):
            raise KeyboardInterrupt  # as the handler runs, before the caches are forgotten

        book._on_free = interrupted
        with pytest.raises(KeyboardInterrupt):
            pool.free(old)
        book._on_free = real
        for _ in range(4):  # whichever slot each gets, its descriptor is live
            arr = pool.alloc(8, np.uint8)
            ref = pool.ref_of(arr)
            pool.mark_in_flight(ref)
            pool.free(ref)


class _Holders:
    """Holder liveness the test decides: pid -> alive."""

    def __init__(self):
        self.live: dict[int, bool] = {}
        self.asked: list[int] = []

    def starttime(self, pid: int) -> int:
        return 1000 + pid

    def alive(self, pid: int, starttime: int) -> bool:
        self.asked.append(pid)
        return self.live.get(pid, False)

    def prune(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_reclaim_asks_each_holder_once_and_frees_only_a_dead_ones_slots():
    """`SlotBook` keeps held slots by holder: `reclaim` asks each holder once whether it lives
    (not each slot: a walk of 4,000 held slots took 1.3 ms at each of the worker's
    housekeeping passes) and frees exactly the IN_FLIGHT slots of those that died; a slot
    freed, or lent again to another, leaves its first holder's books."""
    holders = _Holders()
    holders.live.update({11: True, 22: True, 33: True})
    with ShmPool(1 << 20, slots=64, holders=holders) as pool:
        book = pool._book
        refs = {pid: [] for pid in (11, 22, 33)}
        for i in range(30):
            pid = (11, 22, 33)[i % 3]
            ref, _ = pool.alloc_nbytes(64)
            pool.mark_in_flight(ref, holder_pid=pid)
            refs[pid].append(ref)
        pool.free(refs[33].pop())                # its owner freed one
        moved = refs[22].pop()                   # one lent again, to 11 now
        pool.mark_in_flight(moved, holder_pid=11)
        refs[11].append(moved)

        def by_holder():
            out: dict[int, set[int]] = {}
            for slot, (pid, _) in book._holder_of.items():
                out.setdefault(pid, set()).add(slot)
            return out
        assert {k[0]: v for k, v in book._held_by.items()} == by_holder()
        assert pool.reclaim() == 0 and sorted(holders.asked) == [11, 22, 33]

        holders.live[22] = False
        holders.asked.clear()
        before = pool.in_use()
        assert pool.reclaim() == len(refs[22]) == 9
        assert sorted(holders.asked) == [11, 22, 33] and pool.in_use() == before - 9
        assert {k[0] for k in book._held_by} == {11, 33}
        assert {k[0]: v for k, v in book._held_by.items()} == by_holder()
        for pid in (11, 33):
            for r in refs[pid]:
                pool.free(r)
        assert not book._held_by and not book._holder_of and pool.in_use() == 0


def test_a_holder_entry_left_by_an_interrupted_update_frees_nothing_of_another_holder():
    """An update of the holder books cut short by a signal handler's exception leaves at
    most an extra entry in `_held_by` (the order of the two steps); `reclaim` frees a slot
    only for the holder `_holder_of` names, and drops the stray entry."""
    holders = _Holders()
    holders.live.update({11: True, 22: True})
    with ShmPool(1 << 20, slots=8, holders=holders) as pool:
        book = pool._book
        ref, _ = pool.alloc_nbytes(64)
        pool.mark_in_flight(ref, holder_pid=22)
        key11 = (11, holders.starttime(11))
        book._held_by.setdefault(key11, set()).add(ref.slot)   # the stray entry: 11 never held it
        holders.live[11] = False
        assert pool.reclaim() == 0 and pool.in_use() == 1       # 22's slot stays lent
        assert key11 not in book._held_by
        pool.free(ref)
        assert not book._held_by and not book._holder_of
