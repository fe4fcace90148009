"""docs/shm.md and docs/security.md, taken at their word: each test is a promise the pages
make (quoted in its docstring) that no other test checked.  Pure: one process, plus a
short-lived child where a zombie is needed."""
from __future__ import annotations

import fcntl
import inspect
import logging
import os
import re
import stat
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import shm.segment as seg
from shm import (
    FREE, IN_FLIGHT, RELEASED, BadDescriptor, OutOfResources, SegmentCache, SegmentGone, ShmError, ShmFull,
    ShmPool, StaleDescriptor,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
SHM_MD = (DOCS / "shm.md").read_text()


def _sent(pool: ShmPool, n: int = 64, holder=None):
    a = pool.alloc(n, np.uint8)
    ref = pool.ref_of(a)
    pool.mark_in_flight(ref, holder)
    return a, ref


def _raw_slot(pool: ShmPool, slot: int) -> bytes:
    """Slot record ``slot`` as the file holds it (read through the owner's descriptor)."""
    with open(seg.path_of(pool.name), "rb") as f:
        f.seek(seg.HEADER_SIZE + seg.SLOT_SIZE * slot)
        return f.read(seg.SLOT_SIZE)


# ------------------------------------------------------------------------------ names
def test_the_documented_name_regex_is_the_one_readers_use():
    """"a reader checks the name against `zinf-[1-9][0-9]{0,9}-...` with `fullmatch`"."""
    m = re.search(r"checks the name against\s+`([^`]+)`", SHM_MD)
    assert m, "docs/shm.md no longer states the name regex"
    # The same language: the code's pattern only adds capture groups.
    assert m.group(1) == re.sub(r"\(([^|()]*)\)", r"\1", seg.NAME_RE.pattern)


def test_a_name_states_pid_starttime_nonce_and_the_owners_descriptor():
    """"zinf-<pid>-<starttime>-<16 lowercase hex>-<fd>": pid, field 22 of /proc/<pid>/stat,
    the header's nonce, the owner's descriptor number; "The memfd's own label (what
    /proc/<pid>/fd/<fd> links to, as `/memfd:<label> (deleted)`) is the name without it";
    the memfd is made `MFD_CLOEXEC`."""
    with ShmPool(1 << 16, slots=4) as pool:
        m = re.fullmatch(r"zinf-(\d+)-(\d+)-([0-9a-f]{16})-(\d+)", pool.name)
        assert m, pool.name
        pid, start, nonce, fd = int(m[1]), int(m[2]), m[3], int(m[4])
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            field22 = int(f.read().rsplit(b")", 1)[1].split()[19])
        assert pid == os.getpid() and start == field22 - seg.boot_offset_ticks()
        label = pool.name.rsplit("-", 1)[0]
        assert os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{label} (deleted)"
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        with open(seg.path_of(pool.name), "rb") as f:
            h = np.frombuffer(f.read(seg.HEADER_DTYPE.itemsize), seg.HEADER_DTYPE)[0]
        assert int(h["nonce"]) == int(nonce, 16)
        assert int(h["owner_starttime"]) == start


# ------------------------------------------------------------------------------ layout
def test_the_header_page_holds_a_128_byte_record_and_zeros():
    """"Header: a 128-byte record at offset 0; the rest of the 4096-byte header page is
    zero"; version 2, header_size 4096, slot_size 64, owner_pidns the inode of
    /proc/self/ns/pid, total_size = data_offset + data_size, data_size = `capacity`
    rounded up to `align`, data_offset page- and `align`-aligned."""
    assert seg.HEADER_DTYPE.itemsize == 128 and seg.SLOT_DTYPE.itemsize == 64
    with ShmPool(1000, slots=3, align=8192) as pool:
        with open(seg.path_of(pool.name), "rb") as f:
            page = f.read(4096)
        h = np.frombuffer(page[:128], seg.HEADER_DTYPE)[0]
        assert page[128:] == bytes(4096 - 128)
        assert bytes(h["magic"]) == b"ZINFSEG1"
        assert (int(h["version"]), int(h["header_size"]), int(h["slot_size"])) == (2, 4096, 64)
        assert int(h["owner_pidns"]) == os.stat("/proc/self/ns/pid").st_ino
        assert int(h["data_size"]) == 8192  # 1000 rounded up to the alignment
        assert int(h["data_offset"]) % 8192 == 0 and int(h["data_offset"]) % os.sysconf("SC_PAGE_SIZE") == 0
        assert int(h["total_size"]) == int(h["data_offset"]) + int(h["data_size"])
        assert bytes(h)[88:] == bytes(40)  # the pad


def test_a_slot_record_on_file_is_as_the_table_says():
    """"Slot table at 4096: `slot_count` records of 64 bytes"; "`state` and `generation`
    form one aligned little-endian u64 (state in the low half)"; holder_pid and
    holder_starttime written at mark_in_flight ("0: no holder"); "A slot returned to FREE
    also has its holder fields cleared in the shared record"; "The generation goes up by
    one on every return to FREE"."""
    with ShmPool(1 << 16, slots=4) as pool:
        pid, start = seg.self_identity()
        a, ref = _sent(pool, 100, holder=pid)
        raw = _raw_slot(pool, ref.slot)
        word, offset, nbytes = np.frombuffer(raw[:24], "<u8")
        assert int(word) == (ref.generation << 32) | IN_FLIGHT
        assert (int(offset), int(nbytes)) == (ref.offset, 100)
        assert int.from_bytes(raw[24:28], "little") == pid and raw[28:32] == bytes(4)
        assert int.from_bytes(raw[32:40], "little") == start
        assert raw[40:] == bytes(24)  # lend_tag and lent_at: not said
        pool.tag(ref, 77)  # once the reply is written whole: what the slot is lent for, and when
        raw = _raw_slot(pool, ref.slot)
        assert int.from_bytes(raw[40:48], "little") == 77
        assert 0 < int.from_bytes(raw[48:56], "little") <= time.monotonic_ns() and raw[56:] == bytes(8)
        pool.free(ref)
        del a
        raw = _raw_slot(pool, ref.slot)
        assert int.from_bytes(raw[:8], "little") == ((ref.generation + 1) << 32) | FREE
        assert raw[24:56] == bytes(32)  # holder, tag and time cleared
        b, ref2 = _sent(pool, 8)  # no holder: 0
        assert ref2.slot == ref.slot and ref2.generation == ref.generation + 1  # LIFO: the slot just freed
        assert _raw_slot(pool, ref2.slot)[24:56] == bytes(32)


def test_remarking_in_flight_updates_the_holder_and_a_released_slot_is_stale():
    """"Re-marking an IN_FLIGHT slot ... is allowed and only updates the holder.  Marking a
    slot the reader already RELEASED raises `StaleDescriptor`"."""
    with ShmPool(1 << 16, slots=4) as pool, SegmentCache() as cache:
        pid, start = seg.self_identity()
        a, ref = _sent(pool, 64)
        before = _raw_slot(pool, ref.slot)
        pool.mark_in_flight(ref, pid)
        after = _raw_slot(pool, ref.slot)
        assert after[:24] == before[:24]  # same state word, offset, nbytes
        assert int.from_bytes(after[24:28], "little") == pid
        cache.release(ref)
        with pytest.raises(StaleDescriptor):
            pool.mark_in_flight(ref, pid)
        del a


def test_an_empty_ring_restarts_at_offset_zero_and_empty_allocations_take_no_bytes():
    """"An empty ring restarts at offset 0"; "Empty allocations (`nbytes == 0`) take a slot
    ... but no bytes, and stay out of the ring"."""
    with ShmPool(1 << 12, slots=8) as pool:
        refs = [pool.ref_of(pool.alloc(1000, np.uint8)) for _ in range(3)]
        for r in refs[:2]:
            pool.free(r)
        empty = pool.ref_of(pool.alloc((0, 3), np.float32))
        assert empty.nbytes == 0 and empty.slot not in {r.slot for r in refs[2:]}
        pool.free(refs[2])
        # Only the empty allocation is left: the ring is empty, so a new one starts at 0.
        assert pool.ref_of(pool.alloc(4096, np.uint8)).offset == pool.data_offset


# ------------------------------------------------------------------------------ validation order
def test_validation_runs_in_the_documented_order():
    """"A reader checks, in this order": 1 dtype/shape, 2 the descriptor and the name, 3 the
    segment, 4 slot/offset/generation bounds, 5 the state word (StaleDescriptor "gives the
    slot's current state and generation"), 6 the record's bytes, 8 the size."""
    with ShmPool(1 << 16, slots=4) as pool, SegmentCache() as cache:
        a, ref = _sent(pool, 64)
        # 1 before 2: a bad dtype is named even in a descriptor that is no descriptor.
        with pytest.raises(BadDescriptor, match="dtype"):
            cache.view(("nope", 1), object, 8)
        with pytest.raises(BadDescriptor, match="shape"):
            cache.view(("nope", 1), np.uint8, (-1,))
        # 5 before 6 and 8: a stale descriptor is stale, whatever else is wrong with it.
        stale = ref._replace(generation=ref.generation + 5)
        with pytest.raises(StaleDescriptor, match=rf"IN_FLIGHT at generation {ref.generation}\b"):
            cache.view(stale._replace(nbytes=32), np.uint8, 16)  # 6 and 8 wrong too
        # 6 before 8: bytes outside the record are named as such, not as a size mismatch.
        with pytest.raises(BadDescriptor, match="do not lie in slot"):
            cache.view(ref._replace(nbytes=128), np.uint8, 1)
        del a
        pool.close()
        # 3 before 4: a closed segment is gone, whatever its slot says.
        with pytest.raises(SegmentGone):
            cache.view(ref._replace(slot=1 << 30), np.uint8, 64)


def test_a_second_release_is_a_noop_until_the_owner_reclaims():
    """"a second release of the same generation before the owner reclaims it is a no-op,
    after that it is `StaleDescriptor`"."""
    with ShmPool(1 << 16, slots=4) as pool, SegmentCache() as cache:
        a, ref = _sent(pool, 64)
        cache.release(ref)
        cache.release(ref)
        assert pool.table[ref.slot]["state"] == RELEASED
        del a
        assert pool.reclaim() == 1
        with pytest.raises(StaleDescriptor):
            cache.release(ref)


def test_every_shm_error_is_a_shmerror_and_a_valueerror():
    """"All errors derive from `ShmError(ValueError)`: `SegmentGone`, `StaleDescriptor`,
    `BadDescriptor`, `ShmFull`, `OutOfResources`"."""
    assert issubclass(ShmError, ValueError)
    for cls in (SegmentGone, StaleDescriptor, BadDescriptor, ShmFull, OutOfResources):
        assert issubclass(cls, ShmError), cls


# ------------------------------------------------------------------------------ the cache
def test_a_cache_miss_first_drops_mappings_of_closed_segments():
    """"Each cache miss first drops mappings whose `closed` flag is set"."""
    with ShmPool(1 << 16, slots=4) as p1, ShmPool(1 << 16, slots=4) as p2, SegmentCache() as cache:
        _, r1 = _sent(p1)
        _, r2 = _sent(p2)
        cache.view(r1, np.uint8, 64)
        p1.close()
        assert r1.segment in cache
        cache.view(r2, np.uint8, 64)  # a miss
        assert r1.segment not in cache and r2.segment in cache


def test_the_documented_defaults():
    """`ShmPool(capacity=256 << 20, *, slots=4096, align=64)`; `SegmentCache(max_segments=256,
    max_mapped_bytes=4 TiB)`; "A reader maps at most 64 GiB of one segment" "and 4 TiB in
    all"; a worker maps "at most `max_segments` (256) client segments" and keeps "one reply socket per live client (at most 256", fewer under a
    low descriptor limit; "GPU
    workers pin client segments of up to 4 GiB each and 8 GiB in all"; tensors of at most
    4 KiB (`SMALL_INLINE_BYTES`) go inline."""
    p = inspect.signature(ShmPool).parameters
    assert (p["capacity"].default, p["slots"].default, p["align"].default) == (256 << 20, 4096, 64)
    c = inspect.signature(SegmentCache).parameters
    assert c["max_segments"].default == 256 and c["max_segment_bytes"].default == 64 << 30
    assert c["max_mapped_bytes"].default == 4 << 40
    from broker.protocol.header import SMALL_INLINE_BYTES
    from gpu_worker import cuda_plane
    from gpu_worker.worker import WorkerConfig

    assert (cuda_plane.PIN_MAX_BYTES, cuda_plane.PIN_BUDGET_BYTES) == (4 << 30, 8 << 30)
    assert SMALL_INLINE_BYTES == 4096
    from gpu_worker.planes import input_segments, reply_sockets

    assert WorkerConfig.__dataclass_fields__["direct_sockets"].default is None  # reply_sockets()
    assert reply_sockets(1 << 20) == input_segments(1 << 20) == 256
    assert reply_sockets(1024) == input_segments(1024) == 96


def test_a_reader_maps_a_64_gib_segment_but_not_one_page_more(monkeypatch):
    """"a reader maps at most 64 GiB of one segment and 4 TiB in all" (a sparse memfd costs its
    owner nothing, so the bound is the reader's).  Our own pools are never made larger
    (`create_segment` refuses them); another process's may be."""
    page = os.sysconf("SC_PAGE_SIZE")
    data_offset = seg.round_up(seg.HEADER_SIZE + seg.SLOT_SIZE, page)
    try:
        exact = ShmPool((64 << 30) - data_offset, slots=1)
    except ShmError as e:  # pragma: no cover - a host whose address space is capped
        pytest.skip(f"cannot make a sparse 64 GiB segment here: {e}")
    with pytest.raises(ValueError, match="over the 68719476736 its readers map"):
        ShmPool((64 << 30) - data_offset + page, slots=1)
    monkeypatch.setattr(seg, "MAX_MAPPED_SEGMENT", 1 << 37)  # made as another process would
    over = ShmPool((64 << 30) - data_offset + page, slots=1)
    monkeypatch.undo()
    with exact, over, SegmentCache() as cache:
        _, r1 = _sent(exact, 64)
        _, r2 = _sent(over, 64)
        assert cache.view(r1, np.uint8, 64).shape == (64,)
        with pytest.raises(BadDescriptor, match="more than this reader maps"):
            cache.view(r2, np.uint8, 64)


def test_a_zombie_counts_as_dead():
    """"Zombies (dead but not reaped) count as dead: they have no mappings left"."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.005)
        else:
            pytest.fail("the child never became a zombie")
        assert seg.proc_starttime(child.pid) is None
        assert not seg.process_alive(child.pid, 0)
    finally:
        child.wait(10)


# ------------------------------------------------------------------------------ security.md
def test_a_world_readable_secret_certificate_is_warned_about(tmp_path, caplog):
    """"Keep them 0600 (a world-readable one logs a warning when loaded)"."""
    from broker.protocol import curve
    from broker.security import make_keys

    _, secret = make_keys(str(tmp_path), "alice")
    with caplog.at_level(logging.WARNING):
        curve.load_secret_cert(secret)
    assert not [r for r in caplog.records if "readable by other users" in r.getMessage()]
    os.chmod(secret, 0o644)
    with caplog.at_level(logging.WARNING):
        curve.load_secret_cert(secret)
    assert [r for r in caplog.records if "readable by other users" in r.getMessage() and secret in r.getMessage()]


def test_a_clients_reply_socket_is_named_for_its_process_and_0600(monkeypatch):
    """"every client's direct-reply socket [is] chmod 0600 right after `bind`"; its file name
    is `c-<pid>-<start>-<random>.ipc`, in the 0700 runtime directory."""
    from client_sdk.sockets import ReplyInbox

    base = tempfile.mkdtemp(prefix="zd", dir="/tmp")  # short: an ipc path has 107 bytes at most
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    ctx = zmq.Context()
    inbox = ReplyInbox.open(ctx)
    try:
        assert inbox is not None
        pid, start = seg.self_identity()
        assert re.fullmatch(rf"c-{pid}-{start}-[0-9a-f]+\.ipc", os.path.basename(inbox.path)), inbox.path
        assert stat.S_IMODE(os.stat(inbox.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(inbox.path)).st_mode) == 0o700
    finally:
        if inbox is not None:
            inbox.close()
        ctx.term()
        shutil.rmtree(base)


def test_the_documented_broker_bounds_and_header_limits():
    """The "Bounded resources" table's defaults (256 MiB frames, 4096 requests and 512 MiB per
    principal, 1024 queued per service, `client_hwm` = `max_client_requests`, at least 4096),
    the direct socket's 256 MiB frames, the header limits of "Hostile input" (32 dimensions,
    `MAX_TENSOR_BYTES` 2**40, `MAX_META_BYTES` 64 KiB), and the client's redial at most once a
    second (`REDIAL_S`)."""
    from broker.protocol import header
    from broker.server import BrokerConfig
    from broker.state import Config as SchedulerConfig
    from client_sdk import core
    from gpu_worker import leases

    cfg = BrokerConfig()
    assert cfg.max_frame_bytes == 256 << 20
    s = SchedulerConfig()
    assert (s.max_client_requests, s.max_client_bytes, s.max_queue) == (4096, 512 << 20, 1024)
    assert leases.MAX_FRAME_BYTES == 256 << 20
    assert (header.MAX_NDIM, header.MAX_TENSOR_BYTES, header.MAX_META_BYTES) == (32, 1 << 40, 64 << 10)
    assert core.REDIAL_S == 1.0
    from broker.server import DEFAULT_CLIENT_HWM
    assert DEFAULT_CLIENT_HWM == 4096


def test_a_reader_maps_the_table_read_write_and_the_data_read_only():
    """"Readers map the header and table (`[0, data_offset)`) read-write ... and the data area
    read-only (`ACCESS_READ`) ... The owner maps the whole file read-write"."""
    with ShmPool(1 << 16, slots=4) as pool, SegmentCache() as cache:
        _, ref = _sent(pool)
        cache.view(ref, np.uint8, 64)
        label = pool.name.rsplit("-", 1)[0]
        maps = []  # (size, perms, file offset) of every mapping of this segment
        with open("/proc/self/maps") as f:
            for line in f:
                if f"/memfd:{label} " in line:
                    span, perms, off = line.split()[:3]
                    lo, hi = (int(x, 16) for x in span.split("-"))
                    maps.append((hi - lo, perms, int(off, 16)))
        total = pool.data_offset + pool.capacity
        assert sorted(maps) == sorted([(total, "rw-s", 0), (pool.data_offset, "rw-s", 0),
                                       (pool.capacity, "r--s", pool.data_offset)]), maps


@pytest.mark.parametrize("name", ["../../etc/passwd", "zinf-1-2-3", "x" * 4096, "", "zinf-%d-1-0123456789abcdef-3\n"])
def test_a_worker_refuses_every_name_not_of_the_requester_with_one_message(name):
    """security.md: "a worker maps only segments whose owner is the pid the broker attested
    for the request; one message for every refusal" (`NOT_OWNED`: it names no segment,
    bound, slot or generation), for a name that is no segment name at all too."""
    from broker import protocol as P
    from gpu_worker.planes import NOT_OWNED, check_owner

    pid, start = seg.self_identity()
    if "%d" in name:
        name = name % pid  # our own segment's name, but with a newline: not a name
    with pytest.raises(P.ProtocolError) as e:
        check_owner(P.Request(id=1, pid=pid, pid_start=start), name)
    assert str(e.value) == NOT_OWNED


def test_a_segment_costs_one_descriptor_and_each_mapping_one_more():
    """"Each segment costs its owner one file descriptor, and each mapping one more (Python's
    `mmap` keeps a duplicate)": two for an owner (its memfd, its mapping), two for a reader
    (its two mappings; the descriptor it opened them through is closed)."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    with ShmPool(1 << 16, slots=4) as pool, SegmentCache() as cache:
        assert fds() == before + 2
        a, ref = _sent(pool)
        cache.view(ref, np.uint8, 64)
        assert fds() == before + 4
        cache.forget(ref.segment)
        assert fds() == before + 2
        del a  # (a live array keeps its mapping, and so its descriptor, past close)
    assert fds() == before


def test_a_reference_from_another_host_is_refused_before_its_owner_is_asked():
    """security.md: an attested requester's refused references all get `NOT_OWNED`, except a
    request whose `host` is not the worker's: "from another host", whatever it names (the
    requester's own claim; nothing of anyone's memory)."""
    import types

    from broker import protocol as P
    from gpu_worker.planes import NOT_OWNED, HostPlane

    plane = types.SimpleNamespace(host="here/0", inputs=None)  # nothing is opened before the checks
    pid, start = seg.self_identity()
    other = f"zinf-{pid + 1}-{start}-0123456789abcdef-3"
    for host, why in (("elsewhere/0", "shared-memory reference from another host"), ("here/0", NOT_OWNED)):
        for name in (other, "../../etc/passwd"):
            t = P.TensorRef("x", "|u1", [16], P.ShmLoc(name, 4096, 16, 0, 0))
            req = P.Request(id=1, host=host, pid=pid, pid_start=start, tensors=[t])
            with pytest.raises(P.ProtocolError) as e:
                HostPlane.map_tensor(plane, req, t, np.dtype(np.uint8), [])
            assert str(e.value) == why
