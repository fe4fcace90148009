"""Owner side: one segment plus a private allocator over its data area.

The allocator is `shm.book.SlotBook` (a byte ring with out-of-order release and the slot
state machine; its docstring explains why a ring); this module owns the segment, the
arrays handed out over it and the descriptors that name them.  The ring's cost is
head-of-line blocking: one long-lived allocation holds back the space behind it -- the
ShmFull message says so.

Only the slot records (state, generation, offset, nbytes, holder) are shared.  The ring,
the free-slot list and the owner's own copy of every slot's state and generation are
private, so a reader can never corrupt the allocator: the owner trusts exactly one thing it
reads back from shared memory, a RELEASED state *with the generation it handed out*.
"""
from __future__ import annotations

import operator
import os
import weakref

import numpy as np

from .book import PidfdHolders, SlotBook, check_geometry
from .errors import BadDescriptor, ShmError, ShmFull, StaleDescriptor
from .segment import (
    FREE, HEADER_SIZE, RELEASED, SLOT_DTYPE, SLOT_SIZE, STATE_NAMES, ShmRef, checked_dtype,
    create_segment, make_ref, mark_closed, normalize_shape,
)

def _finalize_segment(fd: int, owner_pid: int, mm) -> None:
    """Close flag + the owner's descriptor; run by close(), by garbage collection, or at
    interpreter exit.  The memfd vanishes once the last mapping of it goes."""
    if os.getpid() != owner_pid:
        # A forked child inherited the pool object, not the segment.  It leaves the
        # descriptor alone too: the child may have reused that number for a file of its own
        # (its inherited copy goes when it exits or execs: O_CLOEXEC).
        return
    try:
        # Tell readers that cached the mapping: their next view() raises SegmentGone and
        # drops it, so the pages are freed once the last mapping goes.
        mark_closed(mm)
    except (ValueError, TypeError):
        pass
    try:
        os.close(fd)
    except OSError:
        pass


class ShmPool:
    """A shared-memory segment owned by this process, with a slot allocator.

    Not thread-safe: use one pool per thread or guard it with a lock.  A pool belongs to
    the process that created it; a forked child must not allocate from it.
    """

    def __init__(self, capacity: int = 256 << 20, *, slots: int = 4096, align: int = 64,
                 holders: PidfdHolders | None = None):
        """``holders``: where the liveness of the processes lent slots is cached (a worker
        shares one with its input cache and reply sockets: one pidfd per live client); by
        default the pool's own, closed with it."""
        self._closed = True  # so close()/finalisers are harmless if __init__ fails
        capacity, slots, align = check_geometry(capacity, slots, align)
        name, mm, geo, fd = create_segment(capacity, slots, align)
        self._finalizer = weakref.finalize(self, _finalize_segment, fd, os.getpid(), mm)
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
        self._raw: list[np.ndarray | None] = [None] * slots  # uint8 array over the slot
        self._arr: list[object] = [None] * slots  # what alloc()/alloc_nbytes() returned
        self._ref: list[ShmRef | None] = [None] * slots
        # For ref_of: id(raw) -> slot finds views; id(what alloc returned) -> slot is the
        # fast path.  Both objects are held in _raw/_arr, so their ids cannot be reused
        # while they are keys.
        self._by_raw: dict[int, int] = {}
        self._by_arr: dict[int, int] = {}
        raws, arrs, refs, by_raw, by_arr = self._raw, self._arr, self._ref, self._by_raw, self._by_arr

        def forget(slot: int) -> None:
            # A closure over the containers, not a bound method: pool -> book -> pool would
            # be a cycle, and the segment's unlink would wait for the cycle collector.
            raw = raws[slot]
            if raw is not None:
                by_raw.pop(id(raw), None)  # (pop: a forget cut short by a signal may run again)
                by_arr.pop(id(arrs[slot]), None)
                raws[slot] = None
            arrs[slot] = None
            refs[slot] = None

        book = self._book = SlotBook(
            self.capacity, slots, align, self._q, base=self.data_offset,
            holders=holders if holders is not None else PidfdHolders(), on_free=forget,
        )
        # The book's containers are mutated in place, never rebound, so these aliases stay
        # the truth and the hot paths skip one attribute lookup.
        self._gen = book._gen
        self._pstate = book._pstate  # FREE / WRITING / IN_FLIGHT (never RELEASED)
        self._off = book._off  # absolute file offsets
        self._nb = book._nb
        self._free = book._free
        self._ring = book._ring
        self._holders = book._holders
        self._own_holders = holders is None
        self._take = book.take  # close() swaps in one that raises ShmError
        self._free_slot = book.free_slot
        self._set_in_flight = book.set_in_flight
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
    def mapping(self):
        """The segment's whole mmap (for pinning it with cudaHostRegister)."""
        return self._mm

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def table(self) -> np.ndarray:
        """The shared slot table as a structured array (live view; for tests and debugging)."""
        if self._closed:
            raise ShmError("pool is closed")
        return self._table

    @property
    def _head(self) -> int:
        return self._book._head

    @property
    def _wraps(self) -> int:
        return self._book.wraps

    # ------------------------------------------------------------------ allocation
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
            live = self._book.live_bytes()
            oldest = self._book.oldest()
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
        self._ref[slot] = None  # made on demand, for this generation (never a stale one)
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
    def mark_in_flight(self, ref: ShmRef, holder_pid: int | None = None, holder_start: int | None = None,
                       tag: int = 0) -> None:
        """WRITING -> IN_FLIGHT, before the descriptor is sent.

        ``holder_pid`` names the process that will read and release the slot (the client,
        for outputs); if it dies first, reclaim() frees the slot.  Leave it None for slots
        the owner frees itself (inputs).  Re-marking an IN_FLIGHT slot (a retry) only
        updates the holder.  ``holder_start``: the holder's start time, as attested with its
        pid (`SlotBook.set_in_flight`).  ``tag``: what the slot is lent for (an output: its
        request's id), for a holder that gives up on it (`SegmentCache.release_given_up`).
        """
        self._set_in_flight(self._own(ref), holder_pid, holder_start, tag)

    def tag(self, ref: ShmRef, tag: int) -> None:
        """Record what an IN_FLIGHT slot is lent for (its request's id) and when, once the
        reply naming it is written whole (`SlotBook.set_tag`)."""
        self._book.set_tag(self._own(ref), tag)

    def free(self, ref: ShmRef) -> None:
        """Owner returns a slot (any live state) to FREE; its generation goes up by one."""
        self._free_slot(self._own(ref))

    def reclaim(self) -> int:
        """Free RELEASED slots and IN_FLIGHT slots whose holder died; how many were freed."""
        if self._closed:
            return 0
        # A vectorised scan of the shared states: far cheaper than visiting every
        # IN_FLIGHT slot once thousands are lent out.
        return self._book.reclaim(np.flatnonzero(self._state_col == RELEASED).tolist())

    def live_bytes(self) -> int:
        """Bytes held by live allocations (O(live slots): for periodic reports, not per request)."""
        if self._closed:
            return 0
        return self._book.live_bytes()

    def in_use(self) -> int:
        """Number of live (non-FREE) slots."""
        if self._closed:
            return 0
        return self._book.in_use()

    def close(self) -> None:
        """Mark closed, unlink, unmap.  Idempotent; arrays still alive keep their pages."""
        if self._closed:
            return
        self._closed = True
        # Instead of a closed check on every allocation; a closure over the name, since a
        # bound method stored on self would make the pool a reference cycle.
        name = self.name

        def take_closed(nbytes: int) -> int:
            raise ShmError(f"ShmPool {name} is closed")

        self._take = take_closed
        self._finalizer()
        if self._own_holders:
            self._holders.close()
        self._by_raw.clear()
        self._by_arr.clear()
        # In place: the book's on_free closure holds these lists too, and must not keep
        # the arrays alive.
        self._raw.clear()
        self._arr.clear()
        self._ref.clear()
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
