"""The device pool's allocator: `DevicePoolBook`, pure Python, no CUDA (tested on the CPU).

It is the host pools' own allocator (`shm.book.SlotBook`), so it keeps the host ring's
rules unchanged: the slot state machine (FREE -> WRITING -> IN_FLIGHT -> RELEASED -> FREE,
the owner alone returning a slot to FREE), the generation going up by one on every return to
FREE, and the private truth (from the shared words the owner accepts only a RELEASED word
carrying the generation it handed out).  What is device-specific:

- offsets are relative to the pool's block, aligned to `ALIGN` (256 bytes, cudaMalloc's own
  guarantee: every dtype and 16-byte vector loads) or `ALIGN_LARGE` (a large page per slot);
- every slot record keeps pointing at the state table's token data area (offset
  ``record_offset``, size 0: the extent is not mirrored), which is what `refs.host_ref`
  describes, so `shm.SegmentCache` can validate and release a device slot;
- a descriptor is checked as a (slot, generation) pair (`live_slot`), StaleDescriptor when
  that lifetime is over.
"""
from __future__ import annotations

import array
import operator
from typing import Any, Callable

from ..book import SlotBook, check_geometry
from ..errors import BadDescriptor, ShmFull, StaleDescriptor
from ..segment import FREE, Q_HOLDER_PID, Q_HOLDER_START, Q_NBYTES, Q_OFFSET, QS, STATE_NAMES
from .refs import DeviceSlot

__all__ = ["ALIGN", "ALIGN_LARGE", "DevicePoolBook", "DevicePoolFull"]

ALIGN = 256            # cudaMalloc's own alignment: every dtype and 16-byte vector loads
ALIGN_LARGE = 2 << 20  # one large page per slot


class DevicePoolFull(ShmFull):
    """A device pool cannot satisfy an allocation even after reclaiming released slots."""


class DevicePoolBook(SlotBook):
    """Slot and byte bookkeeping of one device pool; touches no device.

    The host pools' allocator (`shm.book.SlotBook`: a byte ring with out-of-order release
    and the slot state machine) with a device-facing surface: offsets are relative to the
    pool's base, allocations come back as `DeviceSlot`, and descriptors are checked as
    (slot, generation) pairs.

    `words` is the shared slot table (u64 words in the shm slot-record layout): the owner
    mirrors every state change there and reads back exactly one thing, a RELEASED word with
    the generation it handed out.  By default it is a private array (tests, single process).
    Every record's offset and size stay (`record_offset`, 0): the state table's token data
    area, which is what `host_ref` describes.

    Not thread-safe: one owner thread, or a lock around it.
    """

    def __init__(self, capacity: int, *, slots: int = 1024, align: int = ALIGN, words=None,
                 record_offset: int = 0, holders: Any = None,
                 on_free: Callable[[int], None] | None = None):
        capacity, slots, align = check_geometry(capacity, slots, align, " (256 or 2 MiB are usual)")
        if words is None:
            words = memoryview(array.array("Q", bytes(8 * QS * slots)))
        if len(words) < QS * slots:
            raise ValueError(f"state table has {len(words) // QS} slot records, need {slots}")
        super().__init__(capacity, slots, align, words, mirror_extent=False, holders=holders,
                         on_free=on_free)
        self.record_offset = record_offset
        for s in range(slots):
            b = s * QS
            words[b] = 0
            words[b + Q_OFFSET] = record_offset
            words[b + Q_NBYTES] = 0
            words[b + Q_HOLDER_PID] = 0
            words[b + Q_HOLDER_START] = 0

    # ------------------------------------------------------------------ queries
    def state(self, slot: int) -> int:
        return self._pstate[slot]

    def generation(self, slot: int) -> int:
        return self._gen[slot]

    def get(self, slot: int) -> DeviceSlot:
        """The slot's current (or, once FREE, last) allocation."""
        return DeviceSlot(slot, self._gen[slot], self._off[slot], self._nb[slot])

    def live(self) -> list[DeviceSlot]:
        return [self.get(s) for s in range(self.slots) if self._pstate[s] != FREE]

    def in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------------ allocation
    def try_alloc(self, nbytes: int) -> DeviceSlot | None:
        """A WRITING slot of `nbytes`, or None when it does not fit even after reclaim()."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        slot = self.take(nbytes)
        if slot < 0 and self.reclaim():
            slot = self.take(nbytes)
        return None if slot < 0 else self.get(slot)

    def alloc(self, nbytes: int) -> DeviceSlot:
        got = self.try_alloc(nbytes)
        if got is None:
            raise self.full_error(nbytes)
        return got

    def full_error(self, nbytes: int) -> DevicePoolFull:
        """The DevicePoolFull for an allocation of `nbytes` that did not fit, saying why."""
        head = f"device pool: cannot allocate {nbytes} bytes: "
        if nbytes > self.capacity:
            why = (f"larger than the whole pool ({self.capacity} bytes); create the pool with a "
                   "capacity of at least twice the largest tensor")
        elif not self._free:
            why = (f"all {self.slots} slots are live; release results sooner or create the pool "
                   "with more slots")
        else:
            why = (f"no contiguous run of {nbytes} bytes is free ({self.in_use()} live slots hold "
                   f"{self.live_bytes()} of {self.capacity} bytes; the oldest live allocation holds back the "
                   "space after it); release results sooner or create a larger pool")
        return DevicePoolFull(head + why)

    # ------------------------------------------------------------------ state changes
    def live_slot(self, slot: int, generation: int) -> int:
        """`slot`, if (slot, generation) names a live allocation; BadDescriptor for a slot
        out of range, StaleDescriptor for a lifetime that is over."""
        if type(slot) is not int or not 0 <= slot < self.slots:
            raise BadDescriptor(f"slot {slot!r} out of range 0..{self.slots - 1}")
        if generation != self._gen[slot] or self._pstate[slot] == FREE:
            raise StaleDescriptor(
                f"slot {slot} generation {generation!r} is not live (the slot is "
                f"{STATE_NAMES[self._pstate[slot]]} at generation {self._gen[slot]})")
        return slot

    def mark_in_flight(self, slot: int, generation: int, holder_pid: int | None = None,
                       holder_start: int | None = None) -> None:
        """WRITING -> IN_FLIGHT just before the descriptor is sent; re-marking (a retry)
        only updates the holder.  A holder that dies gets its slots reclaimed."""
        self.set_in_flight(self.live_slot(slot, generation), holder_pid, holder_start)

    def free(self, slot: int, generation: int) -> None:
        """The owner returns a live slot (any state) to FREE; its generation goes up."""
        self.free_slot(self.live_slot(slot, generation))
