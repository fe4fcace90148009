"""Segments: names, owner liveness, the layout, create and attach.

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
import re
import secrets
import stat
import sys
from math import prod as _prod
from typing import Any, NamedTuple

import numpy as np

from .errors import RESOURCE_ERRNOS, BadDescriptor, NotShared, OutOfResources, SegmentGone, ShmError

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    # The reader's one store packs (generation, state) into one little-endian u64.
    raise ImportError("shm: the segment layout is little-endian; big-endian hosts are unsupported")

# Only files of earlier versions (which named segments in /dev/shm) live here; `shm.gc`
# still removes those whose owner died.
SHM_DIR = "/dev/shm"
PREFIX = "zinf-"
# pid (no leading zero, as the kernel prints it), starttime (clock ticks since boot), 64
# random bits, and the owner's file descriptor number.  Always used with fullmatch(), which
# (unlike match() with $) also refuses a trailing newline; the classes admit no "/" and no
# "..".  The memfd's own label is the name without the "-<fd>" suffix.
NAME_RE = re.compile(r"zinf-([1-9][0-9]{0,9})-([0-9]{1,20})-([0-9a-f]{16})-(0|[1-9][0-9]{0,8})")
# Names of the /dev/shm files of earlier versions (crash GC only).
LEGACY_NAME_RE = re.compile(r"zinf-([1-9][0-9]{0,9})-([0-9]{1,20})-([0-9a-f]{16})")
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
U32 = 0xFFFFFFFF


class ShmRef(NamedTuple):
    """Descriptor of bytes in a segment: what crosses ZeroMQ instead of the tensor.

    ``offset`` is the absolute byte offset in the segment file (not relative to the data
    area), so a reader in any language can mmap the file and use it directly.
    """

    segment: str
    offset: int
    nbytes: int
    slot: int
    generation: int


# NamedTuple's generated __new__ is a Python function (~0.4 us); building the tuple
# directly is half that, and descriptors are made on every allocation.
_tuple_new = tuple.__new__


def make_ref(segment: str, offset: int, nbytes: int, slot: int, generation: int) -> ShmRef:
    return _tuple_new(ShmRef, (segment, offset, nbytes, slot, generation))


class Geometry(NamedTuple):
    slot_count: int
    data_offset: int
    data_size: int
    align: int
    total_size: int


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def parse_name(name: object) -> tuple[int, int] | None:
    """(owner pid, owner starttime) of a well-formed segment name, else None."""
    if type(name) is not str:
        return None
    m = NAME_RE.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


_owners: dict[str, tuple[int, int]] = {}


def owner_of(name: object) -> tuple[int, int] | None:
    """The owner (pid, start time) a well-formed segment name states, else None.  A process
    serving others (a worker) compares it with the process the kernel attested for the
    requester before it opens anything: nobody can have it read a segment of another
    process.  On the path of every request, so answers are remembered (a client names the
    same few segments again and again; the memo is bounded)."""
    if type(name) is not str:
        return None
    owner = _owners.get(name)
    if owner is None:
        owner = parse_name(name)
        if owner is None:
            return None  # not remembered: a hostile name may be a megabyte long
        if len(_owners) >= 4096:
            _owners.clear()
        _owners[name] = owner
    return owner


class _Parts(NamedTuple):
    pid: int
    starttime: int
    nonce: int
    fd: int
    label: str  # the memfd's label: what /proc/<pid>/fd/<fd> links to


def name_parts(name: object) -> _Parts:
    if type(name) is not str or (m := NAME_RE.fullmatch(name)) is None:
        raise BadDescriptor(f"invalid segment name {str(name)[:80]!r}: expected zinf-<pid>-<starttime>-<16 hex>-<fd>")
    return _Parts(int(m.group(1)), int(m.group(2)), int(m.group(3), 16), int(m.group(4)),
                  name[: m.start(4) - 1])


def path_of(name: str) -> str:
    """The path through which another process opens segment ``name``: the owner's fd."""
    p = name_parts(name)
    return f"/proc/{p.pid}/fd/{p.fd}"


def proc_starttime(pid: int) -> int | None:
    """Start time (clock ticks after boot, /proc/<pid>/stat field 22) of a running process.

    None when there is no such process or it is a zombie: a zombie has released its
    mappings and will never touch a slot again, so for every use here it is dead.  Raises
    ``OutOfResources`` when /proc cannot be read for want of descriptors or memory (EMFILE,
    ENFILE, ENOMEM): that says nothing of the process, and read as "dead" it had a worker
    reclaim the output slot of a live client that still held its result.
    """
    if pid <= 0:
        return None
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise OutOfResources(f"cannot read /proc/{pid}/stat: {e.strerror}") from None
        return None
    try:
        data = os.read(fd, 4096)
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise OutOfResources(f"cannot read /proc/{pid}/stat: {e.strerror}") from None
        return None
    finally:
        os.close(fd)
    # comm (field 2) may contain spaces and ')': fields 3.. start after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    if len(rest) < 20 or rest[0] in (b"Z", b"X"):
        return None
    # The kernel shows it with the reader's time namespace's boottime offset added: taken
    # off, every process reads the same number for one process (a worker in a namespace
    # with an offset took every client for dead, and lent their output slots again while
    # they held their results: the environment hunt).
    return int(rest[19]) - boot_offset_ticks()


_CLK_TCK = os.sysconf("SC_CLK_TCK")
_boot_offset: tuple[int, int] | None = None  # (pid, ticks): read once per process


def boot_offset_ticks() -> int:
    """This process's time namespace's CLOCK_BOOTTIME offset, in clock ticks (0 without
    time namespaces); read once per process (a child may be in another namespace)."""
    global _boot_offset
    pid = os.getpid()
    if _boot_offset is None or _boot_offset[0] != pid:
        ticks = 0
        try:
            with open("/proc/self/timens_offsets", "rb") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == b"boottime":
                        ticks = (int(parts[1]) * 1_000_000_000 + int(parts[2])) * _CLK_TCK // 1_000_000_000
        except (OSError, ValueError):
            ticks = 0
        _boot_offset = (pid, ticks)
    return _boot_offset[1]


#: whether this kernel has time namespaces (Linux 5.6): without them every process reads
#: one CLOCK_MONOTONIC
_TIMENS = os.path.exists("/proc/self/timens_offsets")


def monotonic_offset_ns(pid: int | None = None) -> int | None:
    """The CLOCK_MONOTONIC offset of process ``pid``'s time namespace (None: this process's),
    in nanoseconds: two processes with the same offset read the same `time.monotonic()`.
    0 on a kernel without time namespaces; None when it cannot be read (the process has
    exited, or its /proc is not ours to read)."""
    if not _TIMENS:
        return 0
    try:
        with open("/proc/self/timens_offsets" if pid is None else f"/proc/{int(pid)}/timens_offsets", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] == b"monotonic":
                    return int(parts[1]) * 1_000_000_000 + int(parts[2])
    except (OSError, ValueError):
        return None
    return None


class ClockPeers:
    """Which processes read this process's CLOCK_MONOTONIC (the same time-namespace offset),
    so that a deadline one of them sends as a time on its clock (`deadline_at`) can be taken
    as it is: asked of /proc once per process (pid and start time), the answers of at most
    ``limit`` processes kept (then forgotten at once, and asked again)."""

    def __init__(self, limit: int = 1 << 16):
        self.mine = monotonic_offset_ns()
        self._known: dict[tuple, bool] = {}
        self._limit = limit

    def same(self, pid: int, start: Any = None) -> bool:
        """Whether process ``pid`` (started at ``start``, when known) reads our clock; False
        when that cannot be told: the process has exited, its /proc is not ours, or the
        process /proc shows under that pid did not start at ``start`` (a pid attested in
        another pid namespace, or reused: its clock says nothing of the client's)."""
        key = (pid, start)
        same = self._known.get(key)
        if same is None:
            if start is not None:
                try:
                    if proc_starttime(pid) != start:
                        return False
                except OutOfResources:
                    return False  # (not kept: asked again at the next request)
            if len(self._known) >= self._limit:
                self._known.clear()
            theirs = monotonic_offset_ns(pid)
            same = self._known[key] = theirs is not None and theirs == self.mine
        return same


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's included): one `kill(pid, 0)`, about a
    microsecond; says nothing of which process it is (`process_alive` does)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


def process_alive(pid: int, starttime: int) -> bool:
    """True if ``pid`` is running and is the same process that had ``starttime``; also True
    when that cannot be told now (``OutOfResources``): a live process taken for dead loses
    what it holds, a dead one taken for alive only keeps it a while longer."""
    try:
        st = proc_starttime(pid)
    except OutOfResources:
        return True
    return st is not None and st == starttime


_identity: tuple[int, int] | None = None


def self_identity() -> tuple[int, int]:
    """(pid, starttime) of this process, re-read after a fork."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        st = proc_starttime(pid)
        if st is None:  # pragma: no cover - /proc not mounted
            raise ShmError("shm needs /proc (to name segments by owner pid and start time)")
        _identity = (pid, st)
    return _identity


def pid_namespace() -> int:
    """Inode of this process's pid namespace, 0 if unknown.

    Liveness is judged by pid; a pid is only meaningful inside one pid namespace, so crash
    GC never judges a segment whose header names a different namespace.
    """
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover
        return 0


def new_name() -> str:
    pid, st = self_identity()
    return f"{PREFIX}{pid}-{st}-{secrets.token_hex(8)}"


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
    "read_header", "normalize_shape", "checked_dtype", "mark_closed", "H32_CLOSED", "MAX_MAPPED_SEGMENT",
]
