"""Segment names and their owners, without numpy: what a segment's name says (owner pid,
start time, nonce, descriptor), whether that owner still runs, and this process's own
identity and clock.  `shm.segment` re-exports all of it beside the layout, creation and
attachment; a process that only judges names and owners (the broker: descriptors it
relays, reaping what dead peers left, clients' clocks) imports this module alone and never
loads numpy (about 40-70 ms of its start here).
"""
from __future__ import annotations

import os
import re
import secrets
from typing import Any, NamedTuple

from .errors import RESOURCE_ERRNOS, BadDescriptor, OutOfResources, ShmError

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


__all__ = [
    "SHM_DIR", "PREFIX", "NAME_RE", "LEGACY_NAME_RE", "U32", "ShmRef", "make_ref", "parse_name", "owner_of",
    "name_parts", "path_of", "proc_starttime", "boot_offset_ticks", "monotonic_offset_ns", "ClockPeers",
    "pid_exists", "process_alive", "self_identity", "pid_namespace", "new_name",
]
