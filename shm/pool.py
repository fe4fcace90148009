"""Owner side: one segment plus a private allocator over its data area.

The allocator is a byte ring with out-of-order release:

- allocations are carved at ``head`` (rounded up to ``align``) in allocation order;
- ``tail`` is the start of the oldest allocation that is still live; freeing any other
  allocation only marks it, and the tail jumps over the freed prefix when the oldest one
  goes; symmetrically, freeing the newest allocations pulls ``head`` back, so an
  alloc/free round trip next to a long-lived allocation costs no ring space;
- when the bytes after ``head`` are too few, the next allocation wraps to offset 0 if it
  fits below ``tail``; the skipped end of the area is reused once the tail passes it.

Why a ring and not a general-purpose allocator: requests are mostly freed in roughly the
order they were made, so a ring needs no search, no coalescing and no per-size bins, and
an allocation is a handful of integer operations.  Its cost is head-of-line blocking: one
long-lived allocation holds back the space behind it -- the ShmFull message says so.

Only the slot records (state, generation, offset, nbytes, holder) are shared.  The ring,
the free-slot list and the owner's own copy of every slot's state and generation are
private, so a reader can never corrupt the allocator: the owner trusts exactly one thing it
reads back from shared memory, a RELEASED state *with the generation it handed out*.
"""
from __future__ import annotations

import operator
import os
import select
import weakref
from collections import deque

import numpy as np

from . import gc as _gc
from .errors import BadDescriptor, ShmError, ShmFull, StaleDescriptor
from .segment import (
    FREE, HEADER_SIZE, IN_FLIGHT, MAX_ALIGN, MAX_SLOTS, Q_HOLDER_PID, Q_HOLDER_START,
    Q_NBYTES, Q_OFFSET, QS, RELEASED, SHM_DIR, SLOT_DTYPE, SLOT_SIZE, STATE_NAMES, U32,
    WRITING, ShmRef, checked_dtype, create_segment, make_ref, normalize_shape, proc_starttime, process_alive,
)

_collected_in: int | None = None


def _collect_once() -> None:
    """Run crash GC the first time this process creates a pool.

    Every client and worker creates a pool at start, so segments of crashed processes are
    swept without anyone running ``python -m shm gc``; once per process keeps it cheap.
    """
    global _collected_in
    pid = os.getpid()
    if _collected_in == pid:
        return
    _collected_in = pid
    try:
        _gc.collect()
    except OSError:  # pragma: no cover - an unreadable /dev/shm must not stop the pool
        pass


def _finalize_segment(name: str, owner_pid: int, mm) -> None:
    """Close flag + unlink; run by close(), by garbage collection, or at interpreter exit."""
    if os.getpid() != owner_pid:
        # A forked child inherited the pool object; the segment is still its parent's.
        return
    try:
        # Tell readers that cached the mapping: their next view() raises SegmentGone and
        # drops it, so the tmpfs pages are freed once the last mapping goes.
        mm[52:56] = b"\x01\x00\x00\x00"
    except (ValueError, TypeError):
        pass
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class _Holders:
    """Starttimes of holder pids, cached behind a pidfd so a reused pid is never trusted.

    Reading /proc/<pid>/stat costs ~10 us; the worker marks every output with the client's
    pid.  A pidfd refers to one process forever, and polls readable once it exits, so
    while our pidfd for a pid is not readable that pid still names the process whose
    starttime we cached.
    """

    MAX = 1024

    def __init__(self) -> None:
        self._cache: dict[int, tuple[int, int, select.poll]] = {}
        self._use_pidfd = hasattr(os, "pidfd_open")

    def _drop(self, pid: int) -> None:
        ent = self._cache.pop(pid, None)
        if ent is not None:
            os.close(ent[1])

    def starttime(self, pid: int) -> int:
        ent = self._cache.get(pid)
        if ent is not None:
            if not ent[2].poll(0):
                return ent[0]
            self._drop(pid)
        st = proc_starttime(pid)
        if st is None:
            return 0  # already dead: the slot is reclaimable at once
        if self._use_pidfd and len(self._cache) < self.MAX:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return st
            except OSError:  # ENOSYS / EPERM under seccomp: fall back to /proc reads
                self._use_pidfd = False
                return st
            if proc_starttime(pid) != st:
                # The pid was reused between the two reads: the pidfd is for a newer
                # process than ``st`` describes.  Don't cache; ``st``'s process is dead.
                os.close(fd)
                return st
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self._cache[pid] = (st, fd, poller)
        return st

    def alive(self, pid: int, starttime: int) -> bool:
        if starttime == 0:
            return False
        ent = self._cache.get(pid)
        if ent is not None and ent[0] == starttime:
            if not ent[2].poll(0):
                return True
            self._drop(pid)
            return False
        return process_alive(pid, starttime)

    def close(self) -> None:
        for pid in list(self._cache):
            self._drop(pid)


class ShmPool:
    """A shared-memory segment owned by this process, with a slot allocator.

    Not thread-safe: use one pool per thread or guard it with a lock.  A pool belongs to
    the process that created it; a forked child must not allocate from it.
    """

    def __init__(self, capacity: int = 256 << 20, *, slots: int = 4096, align: int = 64):
        self._closed = True  # so close()/finalisers are harmless if __init__ fails
        capacity = operator.index(capacity)
        slots = operator.index(slots)
        align = operator.index(align)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 byte, got {capacity}")
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        if not 1 <= align <= MAX_ALIGN or align & (align - 1):
            raise ValueError(f"align must be a power of two in 1..{MAX_ALIGN}, got {align}")
        _collect_once()
        name, mm, geo = create_segment(capacity, slots, align)
        self._finalizer = weakref.finalize(self, _finalize_segment, name, os.getpid(), mm)
        try:
            self.name: str = name
            self.capacity: int = geo.data_size
            self.slots: int = slots
            self.align: int = align
            self.data_offset: int = geo.data_offset
            self._mm = mm
            root = memoryview(mm)
            tab = root[HEADER_SIZE : HEADER_SIZE + SLOT_SIZE * slots]
            self._q = tab.cast("Q")
            self._views = (self._q, tab, root)
            self._table = np.ndarray((slots,), SLOT_DTYPE, buffer=mm, offset=HEADER_SIZE)
            self._state_col = self._table["state"]
            probe = np.frombuffer(mm, np.uint8, count=1)
            self._base_addr: int = probe.__array_interface__["data"][0]
            del probe
        except BaseException:
            self._finalizer()
            raise
        self._amask = align - 1
        # Private allocator state -- the truth; shared memory only mirrors it.
        self._gen = [0] * slots
        self._pstate = bytearray(slots)  # FREE / WRITING / IN_FLIGHT (never RELEASED)
        self._off = [0] * slots  # absolute file offsets
        self._nb = [0] * slots
        self._raw: list[np.ndarray | None] = [None] * slots  # uint8 array over the slot
        self._arr: list[object] = [None] * slots  # what alloc()/alloc_nbytes() returned
        self._ref: list[ShmRef | None] = [None] * slots
        # For ref_of: id(raw) -> slot finds views; id(what alloc returned) -> slot is the
        # fast path.  Both objects are held in _raw/_arr, so their ids cannot be reused
        # while they are keys.
        self._by_raw: dict[int, int] = {}
        self._by_arr: dict[int, int] = {}
        self._free = list(range(slots - 1, -1, -1))  # stack: pop() gives slot 0 first
        # Live (and not yet skipped-over freed) allocations in allocation order:
        # (slot, generation at alloc, start, end), offsets relative to the data area.
        self._ring: deque[tuple[int, int, int, int]] = deque()
        self._head = 0  # relative to the data area
        self._holder_of: dict[int, tuple[int, int]] = {}  # IN_FLIGHT slot -> (pid, starttime)
        self._holders = _Holders()
        self._wraps = 0
        self._closed = False

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.in_use()}/{self.slots} slots live"
        return f"<ShmPool {getattr(self, 'name', '?')} capacity={getattr(self, 'capacity', 0)} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def table(self) -> np.ndarray:
        """The shared slot table as a structured array (live view; for tests and debugging)."""
        if self._closed:
            raise ShmError("pool is closed")
        return self._table

    # ------------------------------------------------------------------ allocation
    def _take(self, nbytes: int) -> int:
        """Reserve a slot and ``nbytes`` of the ring; the slot id, or -1 if it doesn't fit."""
        if self._closed:
            raise ShmError(f"ShmPool {self.name} is closed")
        free = self._free
        if not free:
            return -1
        if nbytes:
            ring = self._ring
            if ring:
                tail = ring[0][2]
                head = self._head
                start = (head + self._amask) & ~self._amask
                if head > tail:  # live bytes are [tail, head): free is [head, end) + [0, tail)
                    if start + nbytes > self.capacity:
                        if nbytes > tail:
                            return -1
                        start = 0
                        self._wraps += 1
                elif start + nbytes > tail:  # wrapped: the only free bytes are [head, tail)
                    return -1
            elif nbytes > self.capacity:
                return -1
            else:
                start = 0
            slot = free.pop()
            self._head = start + nbytes
            ring.append((slot, self._gen[slot], start, self._head))
            off = self.data_offset + start
        else:
            # Empty arrays take a slot (so every descriptor has a generation to check) but
            # no bytes, and stay out of the ring so they never block its tail.
            slot = free.pop()
            off = self.data_offset
        gen = self._gen[slot]
        self._pstate[slot] = WRITING
        self._off[slot] = off
        self._nb[slot] = nbytes
        q = self._q
        b = slot * QS
        q[b + Q_OFFSET] = off
        q[b + Q_NBYTES] = nbytes
        q[b] = (gen << 32) | WRITING
        return slot

    def _reclaim_and_take(self, nbytes: int) -> int:
        """Second try after _take failed: reclaim lazily, only when space is short."""
        return self._take(nbytes) if self.reclaim() else -1

    def _full(self, nbytes: int) -> ShmFull:
        head = f"ShmPool {self.name}: cannot allocate {nbytes} bytes: "
        if nbytes > self.capacity:
            why = (
                f"larger than the whole data area ({self.capacity} bytes). Create the pool "
                "with capacity= at least twice the largest tensor, so one can be written "
                "while the previous one is still being read."
            )
        elif not self._free:
            why = (
                f"all {self.slots} slots are live. Free input slots when their request "
                "finishes and release result arrays when done with them, or create the "
                "pool with more slots=."
            )
        else:
            live = sum(e[3] - e[2] for e in self._ring if self._gen[e[0]] == e[1])
            oldest = self._ring[0][0] if self._ring else None
            why = (
                f"no contiguous run of {nbytes} bytes is free ({self.in_use()} live slots "
                f"hold {live} of {self.capacity} bytes; the oldest live slot {oldest} holds "
                "back the space after it, as the pool reuses bytes in allocation order). "
                "Free inputs and release results sooner, or create the pool with a larger "
                "capacity=."
            )
        return ShmFull(head + why)

    def _prepare(self, shape, dtype) -> tuple[tuple[int, ...], np.dtype, int]:
        dt = checked_dtype(dtype)
        shape, n = normalize_shape(shape)
        return shape, dt, n * dt.itemsize

    def _make_array(self, slot: int, shape, dt: np.dtype) -> np.ndarray:
        # An array built straight on the mmap (not a slice of a bigger array) becomes the
        # ``.base`` of every view derived from it -- numpy collapses view chains only up to
        # an array whose own base is not an array -- so ref_of can find the slot of any
        # view with one dict lookup, and never mistakes a stale array of a freed slot for
        # the slot's next occupant.  Positional arguments: frombuffer's keywords cost 2x.
        nb = self._nb[slot]
        raw = np.frombuffer(self._mm, dt, nb // dt.itemsize, self._off[slot])
        arr = raw if raw.shape == shape else raw.reshape(shape)
        self._raw[slot] = raw
        self._arr[slot] = arr
        self._by_raw[id(raw)] = slot
        self._by_arr[id(arr)] = slot
        return arr

    def try_alloc(self, shape, dtype) -> np.ndarray | None:
        """Like alloc(), but None instead of ShmFull."""
        shape, dt, nbytes = self._prepare(shape, dtype)
        slot = self._take(nbytes)
        if slot < 0:
            slot = self._reclaim_and_take(nbytes)
            if slot < 0:
                return None
        return self._make_array(slot, shape, dt)

    def alloc(self, shape, dtype) -> np.ndarray:
        """A writable, C-contiguous array in shared memory; its slot is WRITING."""
        shape, dt, nbytes = self._prepare(shape, dtype)
        slot = self._take(nbytes)
        if slot < 0:
            slot = self._reclaim_and_take(nbytes)
            if slot < 0:
                raise self._full(nbytes)
        return self._make_array(slot, shape, dt)

    def alloc_nbytes(self, nbytes: int) -> tuple[ShmRef, memoryview]:
        """Raw form of alloc(): the descriptor and a writable memoryview of ``nbytes``."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        slot = self._take(nbytes)
        if slot < 0:
            slot = self._reclaim_and_take(nbytes)
            if slot < 0:
                raise self._full(nbytes)
        raw = np.frombuffer(self._mm, np.uint8, nbytes, self._off[slot])
        mv = memoryview(raw)
        ref = make_ref(self.name, self._off[slot], nbytes, slot, self._gen[slot])
        self._raw[slot] = raw
        self._arr[slot] = mv
        self._ref[slot] = ref
        self._by_raw[id(raw)] = slot
        self._by_arr[id(mv)] = slot
        return ref, mv

    # ------------------------------------------------------------------ descriptors
    def _slot_ref(self, slot: int) -> ShmRef:
        ref = self._ref[slot]
        if ref is None:
            ref = self._ref[slot] = make_ref(self.name, self._off[slot], self._nb[slot], slot, self._gen[slot])
        return ref

    def ref_of(self, arr) -> ShmRef | None:
        """Descriptor for ``arr`` if its bytes lie inside one live slot of this pool, else None.

        Works for what alloc()/alloc_nbytes() returned and for C-contiguous views of it
        (slices, reshapes, ``.view(dtype)``, ``np.frombuffer`` of the memoryview).  A view
        of part of a slot gets a descriptor of just those bytes (same slot and generation).
        """
        # Fast path, the common case: exactly what alloc() returned.  One dict lookup and
        # no look at the data pointer, so the cost cannot depend on the size.
        slot = self._by_arr.get(id(arr))
        if slot is not None and self._arr[slot] is arr:
            ref = self._ref[slot]
            if ref is None:
                ref = self._ref[slot] = make_ref(self.name, self._off[slot], self._nb[slot], slot, self._gen[slot])
            return ref
        # Walk up the owner chain (ndarray.base / memoryview.obj) to the slot's array.
        # Usually one step: numpy collapses views of views onto it.  A few more appear
        # when the memory passed through a memoryview (np.frombuffer(mv)[i:]).
        by_raw = self._by_raw
        raws = self._raw
        obj = arr
        for _ in range(8):
            slot = by_raw.get(id(obj))
            if slot is not None and raws[slot] is obj:
                break
            obj = obj.obj if type(obj) is memoryview else getattr(obj, "base", None)
            if obj is None:
                return None
        else:
            return None
        if arr is self._arr[slot]:
            return self._slot_ref(slot)
        if type(arr) is memoryview:
            if not arr.c_contiguous:
                return None
            a = np.frombuffer(arr, np.uint8) if arr.nbytes else None
        elif isinstance(arr, np.ndarray):
            if not arr.flags.c_contiguous:
                return None
            a = arr if arr.nbytes else None
        else:
            return None
        slot_nb = self._nb[slot]
        if a is None:
            # Zero bytes lie inside any slot; where numpy put the pointer doesn't matter.
            rel, n = 0, 0
        else:
            n = a.nbytes
            rel = a.__array_interface__["data"][0] - (self._base_addr + self._off[slot])
            if rel < 0 or rel + n > slot_nb:
                return None
        if rel == 0 and n == slot_nb:
            return self._slot_ref(slot)
        return make_ref(self.name, self._off[slot] + rel, n, slot, self._gen[slot])

    def _own(self, ref) -> int:
        """The slot of a live descriptor of this pool; BadDescriptor / StaleDescriptor else."""
        if self._closed:
            raise ShmError(f"ShmPool {self.name} is closed")
        try:
            segment, off, nb, slot, gen = ref
        except (TypeError, ValueError):
            raise BadDescriptor(f"not a descriptor: {ref!r}") from None
        if segment != self.name:
            raise BadDescriptor(f"descriptor names segment {segment!r}, not this pool's {self.name}")
        if type(slot) is not int or not 0 <= slot < self.slots:
            raise BadDescriptor(f"slot {slot!r} out of range 0..{self.slots - 1}")
        cur = self._gen[slot]
        if gen != cur or self._pstate[slot] == FREE:
            raise StaleDescriptor(
                f"slot {slot} generation {gen!r} is not live (slot is "
                f"{STATE_NAMES[self._pstate[slot]]} at generation {cur}); it was freed already"
            )
        o = self._off[slot]
        if not (type(off) is int and type(nb) is int and nb >= 0 and o <= off and off + nb <= o + self._nb[slot]):
            raise BadDescriptor(
                f"descriptor bytes [{off!r}, +{nb!r}) are not inside slot {slot} [{o}, +{self._nb[slot]})"
            )
        return slot

    # ------------------------------------------------------------------ state changes
    def mark_in_flight(self, ref: ShmRef, holder_pid: int | None = None) -> None:
        """WRITING -> IN_FLIGHT, before the descriptor is sent.

        ``holder_pid`` names the process that will read and release the slot (the client,
        for outputs); if it dies first, reclaim() frees the slot.  Leave it None for slots
        the owner frees itself (inputs).  Re-marking an IN_FLIGHT slot (a retry) only
        updates the holder.
        """
        slot = self._own(ref)
        q = self._q
        b = slot * QS
        gen = self._gen[slot]
        if self._pstate[slot] == IN_FLIGHT and q[b] == (gen << 32) | RELEASED:
            raise StaleDescriptor(f"slot {slot} generation {gen} was already released by its reader")
        if holder_pid is None:
            hp = hs = 0
        else:
            hp = operator.index(holder_pid)
            if not 0 < hp <= U32:
                raise ValueError(f"holder_pid must be a positive pid, got {holder_pid!r}")
            hs = self._holders.starttime(hp)
        q[b + Q_HOLDER_PID] = hp
        q[b + Q_HOLDER_START] = hs
        self._pstate[slot] = IN_FLIGHT
        q[b] = (gen << 32) | IN_FLIGHT
        if hp:
            self._holder_of[slot] = (hp, hs)
        elif self._holder_of:
            self._holder_of.pop(slot, None)

    def _free_slot(self, slot: int) -> None:
        g = (self._gen[slot] + 1) & U32
        self._gen[slot] = g
        self._pstate[slot] = FREE
        self._q[slot * QS] = g << 32  # | FREE (0): one store, generation and state together
        raw = self._raw[slot]
        if raw is not None:
            del self._by_raw[id(raw)]
            del self._by_arr[id(self._arr[slot])]
            self._raw[slot] = None
        self._arr[slot] = None
        self._ref[slot] = None
        if self._holder_of:
            self._holder_of.pop(slot, None)
        self._free.append(slot)
        if self._nb[slot]:
            ring = self._ring
            gens = self._gen
            while ring:
                e = ring[0]
                if gens[e[0]] == e[1]:
                    break
                ring.popleft()
            # Also give back a freed suffix: an allocation freed before anything newer
            # (the common alloc/free round trip) then costs no ring space at all, instead
            # of marching head around the ring behind a long-lived allocation.
            while ring:
                e = ring[-1]
                if gens[e[0]] == e[1]:
                    break
                ring.pop()
            # Empty: restart at 0 for the longest possible run.
            self._head = ring[-1][3] if ring else 0

    def free(self, ref: ShmRef) -> None:
        """Owner returns a slot (any live state) to FREE; its generation goes up by one."""
        self._free_slot(self._own(ref))

    def reclaim(self) -> int:
        """Free RELEASED slots and IN_FLIGHT slots whose holder died; how many were freed."""
        if self._closed:
            return 0
        n = 0
        q = self._q
        pstate = self._pstate
        gens = self._gen
        for s in np.flatnonzero(self._state_col == RELEASED).tolist():
            b = s * QS
            w = q[b]
            if w & U32 != RELEASED:
                continue
            if pstate[s] == IN_FLIGHT and w >> 32 == gens[s]:
                self._free_slot(s)
                n += 1
            else:
                # A late RELEASED for an older generation (possible only after the owner
                # freed a slot that was still lent out): ignore it and put back the truth.
                q[b] = (gens[s] << 32) | pstate[s]
        if self._holder_of:
            verdict: dict[tuple[int, int], bool] = {}
            for s, key in list(self._holder_of.items()):
                alive = verdict.get(key)
                if alive is None:
                    alive = verdict[key] = self._holders.alive(*key)
                if not alive and pstate[s] == IN_FLIGHT:
                    self._free_slot(s)
                    n += 1
        return n

    def in_use(self) -> int:
        """Number of live (non-FREE) slots."""
        if self._closed:
            return 0
        return self.slots - len(self._free)

    def close(self) -> None:
        """Mark closed, unlink, unmap.  Idempotent; arrays still alive keep their pages."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._holders.close()
        self._by_raw.clear()
        self._by_arr.clear()
        self._raw = self._arr = self._ref = []  # type: ignore[assignment]
        self._table = self._state_col = None  # type: ignore[assignment]
        for v in self._views:
            v.release()
        self._views = ()
        self._q = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            # Arrays from alloc() are still alive: unmapping under them would make their
            # next access a segfault.  The mmap object unmaps when the last one is gone.
            pass


__all__ = ["ShmPool", "ShmRef"]
