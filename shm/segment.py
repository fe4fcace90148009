"""Segments: the layout, create and attach (and, from `shm.names`, names and owner liveness).

Everything here is shared by the owner side (``pool``), the reader side (``reader``) and
the inspection tools (``gc``).  The layout is `HEADER_FIELDS` and `SLOT_FIELDS` below: the
single source of truth for every offset (docs/shm.md renders them as tables).

A segment is a sealed memfd (docs/shm.md, "Why sealed memfds"): its owner keeps the file
descriptor open, and a reader opens the owner's ``/proc/<pid>/fd/<fd>``, which the kernel
allows only to processes that could ptrace the owner (the same user).  The seals make
the file impossible to shrink, so a mapped segment can never turn a read into SIGBUS.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import operator
import os
import secrets
import stat
import sys
from math import prod as _prod
from typing import Any, NamedTuple

import numpy as np

from .errors import RESOURCE_ERRNOS, BadDescriptor, NotShared, OutOfResources, SegmentGone, ShmError
# Names, owners and this process's identity (no numpy there: what the broker imports), here
# as they always were.
from .names import (
    LEGACY_NAME_RE, NAME_RE, PREFIX, SHM_DIR, U32, ClockPeers, ShmRef, boot_offset_ticks, make_ref, monotonic_offset_ns,
    name_parts, new_name, owner_of, parse_name, path_of, pid_exists, pid_namespace, proc_starttime, process_alive,
    self_identity,
)

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    # The reader's one store packs (generation, state) into one little-endian u64.
    raise ImportError("shm: the segment layout is little-endian; big-endian hosts are unsupported")

# Seals every segment carries: it can neither shrink (a reader's mapped pages would vanish:
# SIGBUS) nor grow, and no seal can be added or removed any more.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)  # Linux >= 6.3; older kernels refuse it

MAGIC = b"ZINFSEG1"
VERSION = 2
HEADER_SIZE = 4096
SLOT_SIZE = 64
PAGE = mmap.PAGESIZE
MAX_SLOTS = 1 << 20
MAX_ALIGN = 1 << 30

# Slot states (the low 32 bits of a slot's first u64).
FREE = 0
WRITING = 1
IN_FLIGHT = 2
RELEASED = 3
STATE_NAMES = {FREE: "FREE", WRITING: "WRITING", IN_FLIGHT: "IN_FLIGHT", RELEASED: "RELEASED"}



class Field(NamedTuple):
    """One field of an on-file record: the layout tables below are the source of truth for
    the segment format; the numpy dtypes are built from them, and docs/shm.md's tables are
    rendered from them (`layout_table`, kept equal by tests/test_docs.py)."""

    offset: int
    name: str
    format: str   # numpy format: little-endian, fixed size
    note: str


HEADER_FIELDS: tuple[Field, ...] = (
    Field(0, "magic", "S8", "`ZINFSEG1`; written last at creation"),
    Field(8, "version", "<u4", "layout version, 2"),
    Field(12, "header_size", "<u4", "4096"),
    Field(16, "slot_count", "<u4", "records in the slot table"),
    Field(20, "slot_size", "<u4", "64"),
    Field(24, "data_offset", "<u8", "start of the data area: page- and `align`-aligned"),
    Field(32, "data_size", "<u8", "bytes in the data area (`capacity` rounded up to `align`)"),
    Field(40, "align", "<u8", "allocation alignment (power of two; 64 by default)"),
    Field(48, "owner_pid", "<u4", ""),
    Field(52, "closed", "<u4", "0 while the owner lives; 1 once it closed the segment or GC found it dead"),
    Field(56, "owner_starttime", "<u8", "field 22 of /proc/<pid>/stat"),
    Field(64, "owner_pidns", "<u8", "inode of the owner's pid namespace (`/proc/self/ns/pid`)"),
    Field(72, "total_size", "<u8", "data_offset + data_size"),
    Field(80, "nonce", "<u8", "the name's 64 random bits: a reader checks that the file it opened is the one named"),
)

SLOT_FIELDS: tuple[Field, ...] = (
    Field(0, "state", "<u4", "owner (FREE, WRITING, IN_FLIGHT); reader (RELEASED)"),
    Field(4, "generation", "<u4", "owner"),
    Field(8, "offset", "<u8", "owner, at alloc"),
    Field(16, "nbytes", "<u8", "owner, at alloc"),
    Field(24, "holder_pid", "<u4", "owner, at mark_in_flight (0: no holder)"),
    Field(32, "holder_starttime", "<u8", "owner, at mark_in_flight"),
    Field(40, "lend_tag", "<u8", "owner, once the reply naming the slot is written whole: what it was lent for (an output: its request's id; 0: not said)"),
    Field(48, "lent_at", "<u8", "owner, with lend_tag: CLOCK_MONOTONIC, ns"),
)


def _dtype(fields: tuple[Field, ...], itemsize: int) -> np.dtype:
    return np.dtype({"names": [f.name for f in fields], "formats": [f.format for f in fields],
                     "offsets": [f.offset for f in fields], "itemsize": itemsize})


def layout_table(fields: tuple[Field, ...], size: int, note: str) -> str:
    """A record's layout as a markdown table, padding included (docs/shm.md)."""
    rows = [f"| off | field | type | {note} |", "|---|---|---|---|"]
    at = 0
    for f in (*fields, Field(size, "", "V0", "")):
        if f.offset > at:
            gap = f.offset - at
            rows.append(f"| {at} | pad | {'u32' if gap == 4 else f'{gap} bytes'} | 0 |")
        if f.name:
            dt = np.dtype(f.format)
            kind = f"{dt.itemsize} bytes" if dt.kind == "S" else f"{dt.kind}{dt.itemsize * 8}"
            rows.append(f"| {f.offset} | {f.name} | {kind} | {f.note} |")
        at = f.offset + np.dtype(f.format).itemsize
    return "\n".join(rows) + "\n"


# The header record is 128 bytes at offset 0 of a HEADER_SIZE page (the rest is zero, except
# what a device pool's state table stores at shm.cuda.table's META_OFFSET); the slot table
# follows at HEADER_SIZE, one SLOT_SIZE record per slot (one cache line: no false sharing).
HEADER_DTYPE = _dtype(HEADER_FIELDS, 128)
# Index of the header's ``closed`` flag in a u32 view of the header: readers test
# ``h32[H32_CLOSED]``; the owner (or crash GC) sets it with `mark_closed`, nowhere else.
H32_CLOSED = HEADER_DTYPE.fields["closed"][1] // 4
_CLOSED_WORD = (1).to_bytes(4, "little")

SLOT_DTYPE = _dtype(SLOT_FIELDS, SLOT_SIZE)
# Indices into a u64 ('Q') memoryview of the slot table: slot s starts at s * QS.  Python
# scalar access through a memoryview is about as fast as numpy's and needs no boxing into
# numpy scalars, so the hot paths use these; bulk scans use the numpy views.
QS = SLOT_SIZE // 8
Q_WORD = 0  # state (low 32 bits) | generation (high 32 bits): one aligned 8-byte store
Q_OFFSET = 1
Q_NBYTES = 2
Q_HOLDER_PID = 3  # holder pid in the low 32 bits; the high 32 bits are padding, kept 0
Q_HOLDER_START = 4
Q_LEND_TAG = 5  # (read by a holder that gave up on what it was lent for: `SegmentCache.release_given_up`)
Q_LENT_AT = 6
class Geometry(NamedTuple):
    slot_count: int
    data_offset: int
    data_size: int
    align: int
    total_size: int


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def normalize_shape(shape) -> tuple[tuple[int, ...], int]:
    """(shape tuple, element count); TypeError/ValueError on anything else."""
    if type(shape) is tuple:
        # Fast path for the usual tuple of Python ints: C-level prod/min, no Python loop.
        n = _prod(shape)
        if type(n) is int and (not shape or min(shape) >= 0):
            return shape, n
    if type(shape) is not tuple:
        if isinstance(shape, (list, tuple)):
            shape = tuple(shape)
        else:
            try:
                shape = (operator.index(shape),)
            except TypeError:
                shape = tuple(shape)
    n = 1
    plain = True
    for d in shape:
        if type(d) is not int:
            plain = False
            if isinstance(d, bool):
                raise TypeError(f"bad dimension in shape {shape!r}")
            d = operator.index(d)  # numpy integers are fine; floats are not
        if d < 0:
            raise ValueError(f"negative dimension in shape {shape!r}")
        n *= d
    if not plain:
        shape = tuple(operator.index(d) for d in shape)
    return shape, n


# np.dtype(...) costs more than a dict lookup, and callers repeat a handful of dtypes.
_DTYPES: dict[object, np.dtype] = {}


def checked_dtype(dtype) -> np.dtype:
    """np.dtype(dtype), refusing dtypes that cannot be shared (TypeError)."""
    try:
        dt = _DTYPES.get(dtype)
    except TypeError:  # unhashable spec, e.g. a list of fields
        dt = None
    if dt is not None:
        return dt
    dt = np.dtype(dtype)
    if dt.hasobject:
        # Object arrays hold pointers into one process's heap: meaningless (and a crash
        # when dereferenced) in any other process.
        raise TypeError(f"dtype {dt} holds Python object pointers; it cannot live in shared memory")
    if dt.itemsize == 0:
        raise TypeError(f"dtype {dt} has no size")
    if len(_DTYPES) < 256:
        try:
            _DTYPES[dtype] = dt
        except TypeError:
            pass
    return dt


def create_segment(capacity: int, slots: int, align: int) -> tuple[str, mmap.mmap, Geometry, int]:
    """Create, size, seal, map and initialise a new segment: (name, mapping, geometry, fd).
    The caller owns it and must keep ``fd`` open for as long as others may attach: the
    segment is reachable only through it (and vanishes once it and every mapping are gone)."""
    pid, st = self_identity()
    # The data area starts on a page boundary (so readers can map it read-only on its own)
    # and on an ``align`` boundary (so every allocation offset is aligned in the file).
    data_offset = round_up(HEADER_SIZE + SLOT_SIZE * slots, max(align, PAGE))
    data_size = round_up(capacity, align)
    total = data_offset + data_size
    if total > MAX_MAPPED_SEGMENT:
        raise ValueError(f"a segment of {capacity} bytes would be {total} bytes with its header and slot table, over "
                         f"the {MAX_MAPPED_SEGMENT} its readers map: at most {max_capacity(slots, align)} bytes")
    nonce = secrets.randbits(64)
    label = f"{PREFIX}{pid}-{st}-{nonce:016x}"
    fd = _memfd(label)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, total)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        # Out of memory (mmap under RLIMIT_AS) or descriptors (mmap's duplicate of the file)
        # is this moment's, as at memfd_create: the caller may try again later.
        cls = OutOfResources if e.errno in RESOURCE_ERRNOS else ShmError
        raise cls(f"cannot create a {total >> 20} MiB shared-memory segment: {e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    hdr = np.ndarray((), HEADER_DTYPE, buffer=mm)
    hdr["version"] = VERSION
    hdr["header_size"] = HEADER_SIZE
    hdr["slot_count"] = slots
    hdr["slot_size"] = SLOT_SIZE
    hdr["data_offset"] = data_offset
    hdr["data_size"] = data_size
    hdr["align"] = align
    hdr["owner_pid"] = pid
    hdr["owner_starttime"] = st
    hdr["owner_pidns"] = pid_namespace()
    hdr["total_size"] = total
    hdr["nonce"] = nonce
    # Magic last: a file without it is a segment still being created (or a stranger).
    hdr["magic"] = MAGIC
    del hdr
    return f"{label}-{fd}", mm, Geometry(slots, data_offset, data_size, align, total), fd


def _memfd(label: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(label, flags | _MFD_NOEXEC_SEAL)
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise OutOfResources(f"memfd_create failed: {e.strerror}") from None
        if e.errno != 22:  # EINVAL: a kernel before 6.3 does not know MFD_NOEXEC_SEAL
            raise ShmError(f"memfd_create failed: {e.strerror}") from None
    try:
        return os.memfd_create(label, flags)
    except OSError as e:  # pragma: no cover - memfds exist since Linux 3.17
        if e.errno in RESOURCE_ERRNOS:
            raise OutOfResources(f"memfd_create failed: {e.strerror}") from None
        raise ShmError(f"memfd_create failed: {e.strerror}") from None


def read_header(fd: int, name: str) -> np.void:
    """Read and validate the header of an open segment file; BadDescriptor if malformed."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
    if len(raw) < HEADER_DTYPE.itemsize:
        raise BadDescriptor(f"segment {name} is too small to be a zinf segment ({size} bytes)")
    h = np.frombuffer(raw, HEADER_DTYPE)[0]
    if bytes(h["magic"]) != MAGIC:
        raise BadDescriptor(f"segment {name} has no {MAGIC!r} magic (not initialised, or not ours)")
    if int(h["version"]) != VERSION:
        raise BadDescriptor(f"segment {name} has layout version {int(h['version'])}, this reader knows {VERSION}")
    slots = int(h["slot_count"])
    data_offset = int(h["data_offset"])
    data_size = int(h["data_size"])
    align = int(h["align"])
    if (
        int(h["header_size"]) != HEADER_SIZE
        or int(h["slot_size"]) != SLOT_SIZE
        or not 1 <= slots <= MAX_SLOTS
        or data_offset % PAGE
        or data_offset < HEADER_SIZE + SLOT_SIZE * slots
        or not 1 <= align <= MAX_ALIGN
        or align & (align - 1)
        or data_offset % align
        or data_size < 1
        or int(h["total_size"]) != data_offset + data_size
        or data_offset + data_size > size
    ):
        raise BadDescriptor(f"segment {name} has an inconsistent header (file size {size})")
    p = name_parts(name)
    if (p.pid, p.starttime, p.nonce) != (int(h["owner_pid"]), int(h["owner_starttime"]), int(h["nonce"])):
        raise SegmentGone(f"segment {name} does not exist (its owner closed it or died)")
    return h


class Attached(NamedTuple):
    """A reader's mappings of one segment."""

    name: str
    table_mm: mmap.mmap  # header + slot table, read-write (for the one RELEASED store)
    data_mm: mmap.mmap  # data area, read-only: a reader cannot scribble on tensors
    q: memoryview  # 'Q' view of the slot table
    h32: memoryview  # 'I' view of the header
    views: tuple  # every memoryview to release before unmapping
    slot_count: int
    data_offset: int
    data_end: int
    data_addr: int  # virtual address of the data area in this process


#: statfs's f_type of shmem, where memfd_create puts a memfd made without MFD_HUGETLB
TMPFS_MAGIC = 0x01021994


class _StatFs(ctypes.Structure):
    # struct statfs: f_type comes first, a long (an unsigned int on s390x); the rest is not
    # read (room to spare: 120 bytes on x86-64 and aarch64).
    _fields_ = [("f_type", ctypes.c_uint if os.uname().machine == "s390x" else ctypes.c_long),
                ("_rest", ctypes.c_byte * 256)]


try:
    _fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
except (OSError, AttributeError):  # pragma: no cover - a libc without fstatfs
    _fstatfs = None


def fs_magic(fd: int) -> int:
    """The type of the filesystem ``fd``'s file lives on (statfs's f_type), -1 if unknown."""
    if _fstatfs is None:
        return -1
    buf = _StatFs()
    if _fstatfs(fd, ctypes.byref(buf)) != 0:
        return -1
    return buf.f_type & 0xFFFFFFFF


def open_checked(name: str, flags: int, what: str = "segment") -> tuple[int, np.void]:
    """Open a live segment through its owner's descriptor and read its header: (fd, header).
    The caller closes fd.  SegmentGone if it does not exist (any more) or its owner closed
    it; BadDescriptor otherwise.

    Race-free: whatever the owner's descriptor number refers to by the time we open it, the
    checks run on the file we opened -- a regular file on shmem, sealed against shrinking, whose
    header names the same owner and nonce as ``name``."""
    p = name_parts(name)
    path = f"/proc/{p.pid}/fd/{p.fd}"
    gone = f"{what} {name} does not exist (its owner closed it or died)"
    try:
        target = os.readlink(path)
    except FileNotFoundError:
        raise SegmentGone(gone) from None
    except PermissionError:
        raise NotShared(f"cannot open {what} {name}: permission denied (segments are "
                        f"shared only between processes of one user)") from None
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise OutOfResources(f"cannot open {what} {name}: {e.strerror}") from None
        raise BadDescriptor(f"cannot open {what} {name}: {e.strerror}") from None
    if target != f"/memfd:{p.label} (deleted)":
        raise SegmentGone(gone)  # the descriptor was closed, its number reused
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise SegmentGone(gone) from None
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise OutOfResources(f"cannot open {what} {name}: {e.strerror}") from None
        raise BadDescriptor(f"cannot open {what} {name}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SegmentGone(gone)
        fs = fs_magic(fd)
        if fs != TMPFS_MAGIC and fs != -1:  # -1: the type cannot be had here, the seals must do
            # A hugetlbfs memfd takes seals too, but a hole punched in it (which the seals
            # allow) loses its page for good: a reader's next touch is a SIGBUS, the reading
            # process dead.  On shmem a punched page comes back, zeroed, at the next touch.
            raise BadDescriptor(f"{what} {name} is not shmem (a memfd made with MFD_HUGETLB?: filesystem "
                                f"0x{fs:x}); a reader of it can be killed, so it is never mapped")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & SEALS != SEALS:
            raise BadDescriptor(f"{what} {name} is not sealed against resizing; refusing to map it")
        h = read_header(fd, name)
        if int(h["closed"]):
            raise SegmentGone(f"{what} {name} was closed by its owner")
    except BaseException:
        os.close(fd)
        raise
    return fd, h


def mark_closed(target: Any) -> None:
    """Set the header's closed flag, the one write of it: readers that cached the mapping
    drop it at their next look (`SegmentCache`), and `open_checked` refuses the segment
    from then on.  `target` is the owner's writable mapping of the file, or a file
    descriptor opened for writing (crash GC, which never maps what it removes).  Errors of
    the mapping (ValueError once it is closed) or of the write (OSError) propagate."""
    offset = H32_CLOSED * 4
    if isinstance(target, int):
        os.pwrite(target, _CLOSED_WORD, offset)
    else:
        target[offset: offset + 4] = _CLOSED_WORD


#: default largest segment a reader maps: memfds are not bounded by /dev/shm's size, and a
#: sparse one costs its owner nothing, so a reader bounds what a client can make it map
MAX_MAPPED_SEGMENT = 1 << 36  # 64 GiB


def max_capacity(slots: int = 4096, align: int = 64) -> int:
    """The largest data area a segment of ``slots`` slots may have for its readers to map it
    (`MAX_MAPPED_SEGMENT` counts its header and slot table too): a pool of exactly 64 GiB
    was made, and every worker refused its requests, as a protocol bug (the memory audit)."""
    data_offset = round_up(HEADER_SIZE + SLOT_SIZE * slots, max(align, PAGE))
    return (MAX_MAPPED_SEGMENT - data_offset) // align * align


def attach_segment(name: str, max_size: int = MAX_MAPPED_SEGMENT) -> Attached:
    """Map an existing segment for reading.  SegmentGone if it does not exist or is closed;
    BadDescriptor if it is larger than ``max_size`` bytes."""
    fd, h = open_checked(name, os.O_RDWR)
    try:
        if int(h["total_size"]) > max_size:
            raise BadDescriptor(f"segment {name} is {int(h['total_size']) >> 20} MiB, more than this reader "
                                f"maps ({max_size >> 20} MiB); use a smaller pool")
        slots = int(h["slot_count"])
        data_offset = int(h["data_offset"])
        data_size = int(h["data_size"])
        try:
            # Writable: a reader stores RELEASED in its slot's word.  A segment sealed
            # against writing (F_SEAL_WRITE, F_SEAL_FUTURE_WRITE: none of ours is) refuses
            # this mapping (EPERM): the descriptor is bad.
            table_mm = mmap.mmap(fd, data_offset, flags=mmap.MAP_SHARED, access=mmap.ACCESS_WRITE)
        except PermissionError as e:
            raise BadDescriptor(f"cannot map segment {name}'s slot table: {e.strerror}") from None
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:
                raise OutOfResources(f"cannot map segment {name}: {e.strerror}") from None
            raise
        try:
            # ACCESS_READ (not prot=PROT_READ) so the buffer *reports* read-only; otherwise
            # numpy would hand out writeable arrays over PROT_READ pages (a segfault).
            data_mm = mmap.mmap(fd, data_size, access=mmap.ACCESS_READ, offset=data_offset)
        except BaseException as e:
            table_mm.close()
            if isinstance(e, PermissionError):
                raise BadDescriptor(f"cannot map segment {name}'s data area: {e.strerror}") from None
            if isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS:
                # ENOMEM and the like: this reader's resources, not the descriptor's fault
                raise OutOfResources(f"cannot map segment {name}: {e.strerror}") from None
            raise
    finally:
        os.close(fd)
    root = memoryview(table_mm)
    tab = root[HEADER_SIZE : HEADER_SIZE + SLOT_SIZE * slots]
    q = tab.cast("Q")
    hdr = root[:HEADER_SIZE]
    h32 = hdr.cast("I")
    probe = np.frombuffer(data_mm, np.uint8, count=1)
    data_addr = probe.__array_interface__["data"][0]
    del probe
    return Attached(
        name, table_mm, data_mm, q, h32, (h32, hdr, q, tab, root), slots, data_offset,
        data_offset + data_size, data_addr,
    )


def detach(a: Attached) -> None:
    """Drop a reader's mappings.  Arrays still viewing the data keep it mapped until they die."""
    for v in a.views:
        try:
            v.release()
        except BufferError:  # pragma: no cover - we never export these
            pass
    for m in (a.table_mm, a.data_mm):
        try:
            m.close()
        except BufferError:
            # Live arrays still point into this mapping; unmapping now would turn their
            # next access into a segfault.  The mmap object unmaps when the last one dies.
            pass


__all__ = [
    "SHM_DIR", "PREFIX", "NAME_RE", "LEGACY_NAME_RE", "SEALS", "MAGIC", "VERSION", "HEADER_SIZE", "SLOT_SIZE",
    "FREE", "WRITING", "IN_FLIGHT", "RELEASED", "STATE_NAMES", "HEADER_DTYPE", "SLOT_DTYPE",
    "ShmRef", "make_ref", "Geometry", "parse_name", "owner_of", "name_parts", "path_of", "proc_starttime", "boot_offset_ticks", "process_alive", "pid_exists",
    "self_identity", "pid_namespace", "create_segment", "attach_segment", "detach",
    "read_header", "normalize_shape", "checked_dtype", "mark_closed", "H32_CLOSED", "MAX_MAPPED_SEGMENT", "max_capacity",
]
