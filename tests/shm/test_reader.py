"""Reader side: descriptor validation, read-only zero-copy views, release, cache upkeep."""
from __future__ import annotations

import os

import numpy as np
import pytest

from shm import (
    IN_FLIGHT, RELEASED, BadDescriptor, SegmentCache, SegmentGone, ShmError, ShmPool, ShmRef,
    StaleDescriptor, fence,
)
from shm.segment import SHM_DIR


@pytest.fixture
def pool():
    with ShmPool(1 << 16, slots=8) as p:
        yield p


@pytest.fixture
def cache():
    with SegmentCache() as c:
        yield c


def sent(pool: ShmPool, shape=(4, 4), dtype=np.float32, fill=3.0):
    """Allocate, fill and mark in flight: what a sender does before sending the ref."""
    a = pool.alloc(shape, dtype)
    a[...] = fill
    ref = pool.ref_of(a)
    pool.mark_in_flight(ref)
    return a, ref


def test_view_is_zero_copy_and_read_only(pool, cache):
    a, ref = sent(pool)
    v = cache.view(ref, np.float32, (4, 4))
    assert (v == 3.0).all() and v.shape == (4, 4) and v.dtype == np.float32
    assert not v.flags.writeable
    with pytest.raises(ValueError):
        v[0, 0] = 1.0
    with pytest.raises(ValueError):
        v.flags.writeable = True
    a[1, 2] = 42.0  # the owner writes; the existing view sees it
    assert v[1, 2] == 42.0
    assert cache.view(ref, "<f4", 16)[6] == 42.0
    assert ref.segment in cache and len(cache) == 1


def test_view_of_a_sub_range_descriptor(pool, cache):
    a, _ = sent(pool, shape=(8,), dtype=np.int32, fill=0)
    a[:] = np.arange(8)
    sub = pool.ref_of(a[2:5])
    assert cache.view(sub, np.int32, 3).tolist() == [2, 3, 4]


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda r: r._replace(generation=r.generation + 1), StaleDescriptor),
        (lambda r: r._replace(generation=-1), BadDescriptor),
        (lambda r: r._replace(offset=0), BadDescriptor),  # inside the header
        (lambda r: r._replace(offset=1 << 40), BadDescriptor),  # past the end
        (lambda r: r._replace(nbytes=-64), BadDescriptor),
        (lambda r: r._replace(offset=r.offset + 64), BadDescriptor),  # not the slot's bytes
        (lambda r: r._replace(nbytes=r.nbytes + 64), BadDescriptor),
        (lambda r: r._replace(slot=8), BadDescriptor),
        (lambda r: r._replace(slot=-1), BadDescriptor),
        (lambda r: r._replace(slot=r.slot + 1), StaleDescriptor),  # a FREE slot
        (lambda r: r._replace(segment="../etc/passwd"), BadDescriptor),
        (lambda r: r._replace(segment="zinf-1-2-../../../etc"), BadDescriptor),
        (lambda r: r._replace(segment=r.segment + "\n"), BadDescriptor),
        (lambda r: r._replace(segment=r.segment.upper()), BadDescriptor),
        (lambda r: r._replace(segment="/dev/shm/" + r.segment), BadDescriptor),
        (lambda r: r._replace(segment=b"zinf"), BadDescriptor),
        (lambda r: r._replace(segment="zinf-999999999-1-0123456789abcdef-5"), SegmentGone),  # no such process
        (lambda r: r._replace(segment=r.segment.rsplit("-", 1)[0] + "-0"), SegmentGone),  # fd 0 is no segment
        (lambda r: r._replace(offset=float(r.offset)), BadDescriptor),
        (lambda r: r._replace(slot=True), BadDescriptor),
        (lambda r: (r.segment, r.offset), BadDescriptor),
        (lambda r: None, BadDescriptor),
    ],
)
def test_forged_descriptors_are_rejected(pool, cache, mutate, error):
    _, ref = sent(pool, shape=(16,), fill=1.0)
    bad = mutate(ref)
    n = bad.nbytes // 4 if isinstance(bad, ShmRef) and isinstance(bad.nbytes, int) and bad.nbytes >= 0 else 16
    with pytest.raises(error):
        cache.view(bad, np.float32, n)
    with pytest.raises(error):
        cache.release(bad)
    assert cache.view(ref, np.float32, 16).sum() == 16  # the real one still works


def test_shape_and_dtype_must_match_the_descriptor(pool, cache):
    _, ref = sent(pool, shape=(4, 4), dtype=np.float32)
    for dtype, shape in [(np.float32, (4, 5)), (np.float64, (4, 4)), (np.uint8, 63), (np.float32, ())]:
        with pytest.raises(BadDescriptor, match="bytes"):
            cache.view(ref, dtype, shape)
    with pytest.raises(BadDescriptor, match="object"):
        cache.view(ref, object, 8)
    with pytest.raises(BadDescriptor):
        cache.view(ref, "not-a-dtype", 16)
    with pytest.raises(BadDescriptor):
        cache.view(ref, np.float32, (4, -4))
    with pytest.raises(BadDescriptor):
        cache.view(ref, np.float32, (4.0, 4))
    assert cache.view(ref, np.uint8, (2, 32)).shape == (2, 32)  # any dtype/shape of that size


def test_only_in_flight_slots_can_be_viewed(pool, cache):
    a = pool.alloc(16, np.uint8)
    ref = pool.ref_of(a)
    with pytest.raises(StaleDescriptor, match="WRITING") as e:
        cache.view(ref, np.uint8, 16)  # not sent yet: the owner may still be writing
    assert not e.value.moved_on  # (a state the slot has not left: not a freed one)
    with pytest.raises(StaleDescriptor) as e:
        cache.view(ref._replace(generation=ref.generation + 5), np.uint8, 16)
    assert not e.value.moved_on  # a generation the slot never had
    pool.mark_in_flight(ref)
    cache.view(ref, np.uint8, 16)
    pool.free(ref)
    with pytest.raises(StaleDescriptor, match="FREE") as e:
        cache.view(ref, np.uint8, 16)
    assert e.value.moved_on  # freed since: a copy of a call its owner is done with
    b = pool.alloc(16, np.uint8)  # same slot, next generation
    rb = pool.ref_of(b)
    pool.mark_in_flight(rb)
    assert rb.slot == ref.slot and rb.generation == ref.generation + 1
    with pytest.raises(StaleDescriptor) as e:
        cache.view(ref, np.uint8, 16)
    assert e.value.moved_on
    with pytest.raises(StaleDescriptor):
        cache.release(ref)
    assert pool.table[rb.slot]["state"] == IN_FLIGHT  # the stale release stored nothing


def test_release_stores_released_and_owner_reclaims(pool, cache):
    _, ref = sent(pool)
    cache.view(ref, np.float32, (4, 4))
    cache.release(ref)
    assert pool.table[ref.slot]["state"] == RELEASED
    assert pool.table[ref.slot]["generation"] == ref.generation
    assert pool.in_use() == 1
    assert pool.reclaim() == 1 and pool.in_use() == 0


def test_a_reader_naming_its_pid_views_and_releases_only_slots_lent_to_it(pool, cache):
    # An output is lent to its reader (`holder_pid`); an input is lent to nobody, and one
    # lent to another process is that process's.  A client passes its pid, so that a reply
    # naming either is refused before it reads a byte or stores RELEASED there.
    me = os.getpid()
    _, unlent = sent(pool)
    b = pool.alloc(16, np.uint8)
    other = pool.ref_of(b)
    pool.mark_in_flight(other, holder_pid=1)
    for ref, why in ((unlent, "lent to no reader"), (other, "lent to pid 1")):
        with pytest.raises(BadDescriptor, match=f"not lent to this process .*{why}"):
            cache.view(ref, np.uint8, (ref.nbytes,), holder=me)
        with pytest.raises(BadDescriptor, match="not lent to this process"):
            cache.release(ref, holder=me)
        assert pool.table[ref.slot]["state"] == IN_FLIGHT
    pool.mark_in_flight(unlent, holder_pid=me)  # lent to us now
    assert (cache.view(unlent, np.float32, (4, 4), holder=me) == 3.0).all()
    cache.release(unlent, holder=me)
    assert pool.table[unlent.slot]["state"] == RELEASED and pool.reclaim() == 1


def test_segment_gone_after_owner_closes(cache):
    with ShmPool(1 << 16, slots=4) as p:
        _, ref = sent(p)
        v = cache.view(ref, np.float32, (4, 4))
    # Unlinked and flagged closed: the cached mapping is dropped on next use...
    with pytest.raises(SegmentGone):
        cache.view(ref, np.float32, (4, 4))
    assert ref.segment not in cache
    # ...the view already handed out still reads the same bytes...
    assert (v == 3.0).all()
    # ...and without a cached mapping the file is simply not there.
    with pytest.raises(SegmentGone):
        cache.view(ref, np.float32, (4, 4))
    with pytest.raises(SegmentGone):
        cache.release(ref)


def test_forget_sweep_close_and_lru():
    with ShmPool(1 << 16, slots=4) as p1, ShmPool(1 << 16, slots=4) as p2, ShmPool(1 << 16, slots=4) as p3:
        refs = [sent(p)[1] for p in (p1, p2, p3)]
        cache = SegmentCache(max_segments=2)
        views = [cache.view(r, np.float32, (4, 4)) for r in refs]
        assert len(cache) == 2 and refs[0].segment not in cache  # least recently used went
        assert cache.view(refs[0], np.float32, (4, 4)).sum() == 48  # re-attached on demand
        cache.forget(refs[0].segment)
        cache.forget(refs[0].segment)  # idempotent
        assert refs[0].segment not in cache
        assert cache.sweep() == []
        p3.close()
        assert cache.sweep() == [refs[2].segment]
        cache.close()
        cache.close()
        assert len(cache) == 0
        assert all((v == 3.0).all() for v in views)  # unmapping never pulls memory from under a view
        with pytest.raises(ShmError, match="closed"):
            cache.view(refs[1], np.float32, (4, 4))


def test_attach_rejects_files_that_are_not_segments(cache):
    import fcntl

    from shm.segment import SEALS, self_identity

    pid, start = self_identity()
    label = f"zinf-{pid}-{start}-{'ab' * 8}"
    # A regular file at the named descriptor: not a memfd of that label.
    with open(os.path.join(SHM_DIR, "zinf-test-regular"), "wb") as f:
        os.unlink(f.name)
        with pytest.raises(SegmentGone):
            cache.view(ShmRef(f"{label}-{f.fileno()}", 4096, 0, 0, 0), np.uint8, 0)
    # A memfd with the right label but no seals: it could be shrunk under a reader.
    fd = os.memfd_create(label, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8192)
        with pytest.raises(BadDescriptor, match="not sealed"):
            cache.view(ShmRef(f"{label}-{fd}", 4096, 0, 0, 0), np.uint8, 0)
        # Sealed, but nothing in it.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        with pytest.raises(BadDescriptor, match="magic"):
            cache.view(ShmRef(f"{label}-{fd}", 4096, 0, 0, 0), np.uint8, 0)
    finally:
        os.close(fd)
    assert len(cache) == 0


def test_a_hugetlb_memfd_is_never_mapped(cache):
    # Sealed as asked, but on hugetlbfs: a hole its owner punches (the seals allow it) loses
    # its page for good, and a reader's next touch of a mapping it cached is a SIGBUS.
    import fcntl

    from shm.segment import SEALS, self_identity

    pid, start = self_identity()
    label = f"zinf-{pid}-{start}-{'cd' * 8}"
    try:
        fd = os.memfd_create(label, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC | os.MFD_HUGETLB)
    except OSError as e:
        pytest.skip(f"no hugetlb memfds here: {e}")
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        with pytest.raises(BadDescriptor, match="not shmem.*MFD_HUGETLB"):
            cache.view(ShmRef(f"{label}-{fd}", 4096, 0, 0, 0), np.uint8, 0)
    finally:
        os.close(fd)
    assert len(cache) == 0


@pytest.mark.parametrize("seal", ["F_SEAL_WRITE", "F_SEAL_FUTURE_WRITE"])
def test_a_segment_sealed_against_writing_is_a_bad_descriptor(cache, seal):
    # A well-formed header, the seals we ask for, and one more: the reader's writable
    # mapping of the slot table (for its RELEASED store) is refused by the kernel, and that
    # is a BadDescriptor like every other refusal, not an OSError, and leaks nothing.
    import fcntl

    from shm.segment import HEADER_DTYPE, MAGIC, SEALS, VERSION, pid_namespace, self_identity

    pid, start = self_identity()
    nonce = 0x1122334455667788
    label = f"zinf-{pid}-{start}-{nonce:016x}"
    fd = os.memfd_create(label, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 12288)
        h = np.zeros((), HEADER_DTYPE)
        for k, v in dict(version=VERSION, header_size=4096, slot_count=1, slot_size=64, data_offset=8192,
                         data_size=4096, align=64, owner_pid=pid, owner_starttime=start,
                         owner_pidns=pid_namespace(), total_size=12288, nonce=nonce, magic=MAGIC).items():
            h[k] = v
        os.pwrite(fd, h.tobytes(), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | getattr(fcntl, seal, 0x0010))  # F_SEAL_FUTURE_WRITE: Linux 5.1
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(BadDescriptor, match="cannot map"):
            cache.view(ShmRef(f"{label}-{fd}", 8192, 0, 0, 0), np.uint8, 0)
        assert len(os.listdir("/proc/self/fd")) == before and len(cache) == 0
    finally:
        os.close(fd)


def test_only_a_cache_given_owners_holds_a_descriptor_per_owner():
    # A worker's input cache tracks each owner behind a pidfd (its sweep polls them); a
    # client's caches, which never sweep by owner, hold none.
    from shm.book import PidfdHolders

    def pidfds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
            except OSError:
                pass
        return n

    owners = PidfdHolders()
    with ShmPool(1 << 16, slots=4) as pool:
        a = pool.alloc(16, np.uint8)
        ref = pool.ref_of(a)
        pool.mark_in_flight(ref)
        before = pidfds()
        with SegmentCache() as plain:
            plain.view(ref, np.uint8, 16)
            assert pidfds() == before and plain.sweep() == []
        with SegmentCache(owners=owners) as tracked:
            tracked.view(ref, np.uint8, 16)
            assert pidfds() == before + 1 and tracked.sweep() == []  # the owner (us) lives
        owners.close()
        assert pidfds() == before


def test_fence_is_callable_and_reentrant_safe():
    for _ in range(3):
        fence()


def test_a_reader_maps_no_segment_larger_than_its_bound():
    # memfds are not bounded by /dev/shm, and a sparse one costs its owner nothing: the
    # reader bounds what a client can make it map (max_segments x max_segment_bytes).
    with ShmPool(2 << 20, slots=4) as big, SegmentCache(max_segment_bytes=1 << 20) as cache:
        a = big.alloc(16, np.uint8)
        ref = big.ref_of(a)
        big.mark_in_flight(ref)
        with pytest.raises(BadDescriptor, match="more than this reader maps"):
            cache.view(ref, np.uint8, 16)
        assert len(cache) == 0


def test_a_worker_serving_a_hundred_clients_in_turn_maps_each_once(monkeypatch):
    # Found by the complexity hunt: the cache kept 64 segments, so a worker serving more
    # clients than that in turn (a gateway's hundreds of connections, one segment each)
    # missed on every request: each view mapped its client's segment again and unmapped
    # another (about 70 µs a request instead of 2).
    import shm.reader as reader

    attached = []
    real = reader.attach_segment
    monkeypatch.setattr(reader, "attach_segment", lambda *a, **kw: attached.append(a[0]) or real(*a, **kw))
    pools = [ShmPool(1 << 16, slots=2) for _ in range(100)]
    try:
        refs = []
        for p in pools:
            a = p.alloc(16, np.uint8)
            refs.append(p.ref_of(a))
            p.mark_in_flight(refs[-1])
        with SegmentCache() as cache:
            for _ in range(2):
                for ref in refs:
                    cache.view(ref, np.uint8, 16)
            assert len(attached) == 100, f"{len(attached)} mappings made for 100 segments"
    finally:
        for p in pools:
            p.close()


def test_a_reader_maps_no_more_bytes_in_all_than_its_bound():
    # What a client can make a worker map is bounded in all, not only per segment: the
    # least recently used mappings go first past max_mapped_bytes.
    pools = [ShmPool(1 << 20, slots=2) for _ in range(3)]
    try:
        refs = []
        for p in pools:
            a = p.alloc(16, np.uint8)
            refs.append(p.ref_of(a))
            p.mark_in_flight(refs[-1])
        with SegmentCache(max_mapped_bytes=(2 << 20) + (1 << 19)) as cache:
            for ref in refs:
                cache.view(ref, np.uint8, 16)
            assert [ref.segment in cache for ref in refs] == [False, True, True]
            with pytest.raises(ValueError):
                SegmentCache(max_mapped_bytes=0)
    finally:
        for p in pools:
            p.close()


def test_slots_lent_for_requests_given_up_on_go_back_and_no_other(pool, cache):
    # A reply lost on its way (a broker that died) names slots lent to a live reader, which
    # never learns their descriptors.  The reader gives up on the request: what was lent
    # for it (the owner's `tag`, the request id), to it, long enough ago, and not viewed by
    # it goes back; nothing else does.
    import time

    me = os.getpid()

    def lent(tag, holder=me):
        ref = pool.ref_of(pool.alloc(16, np.uint8))
        pool.mark_in_flight(ref, holder_pid=holder, tag=tag)
        return ref

    lost, answered, viewed, others, untagged = lent(7), lent(8), lent(7), lent(7, holder=1), lent(0)
    cache.view(viewed, np.uint8, (16,), holder=me)  # (maps the ring)
    row = pool.table[lost.slot]
    assert row["lend_tag"] == 7 and row["holder_pid"] == me and row["lent_at"] > 0
    keep = {(viewed[0], viewed.slot, viewed.generation)}
    assert cache.release_given_up({7}, me, int(row["lent_at"]), keep=keep) == 0  # lent too recently
    assert cache.release_given_up({7}, me, time.monotonic_ns() + 1, keep=keep, skip=pool.name) == 0
    assert cache.release_given_up({7, 0}, me, time.monotonic_ns() + 1, keep=keep) == 1
    states = {ref.slot: int(pool.table[ref.slot]["state"]) for ref in (lost, answered, viewed, others, untagged)}
    assert states == {lost.slot: RELEASED, answered.slot: IN_FLIGHT, viewed.slot: IN_FLIGHT,
                      others.slot: IN_FLIGHT, untagged.slot: IN_FLIGHT}
    assert pool.reclaim() == 1
    assert pool.table[lost.slot]["lend_tag"] == 0 and pool.table[lost.slot]["lent_at"] == 0
    assert cache.release_given_up({7}, me, time.monotonic_ns() + 1, keep=keep) == 0  # (freed: only the viewed left)
