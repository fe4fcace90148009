"""The slot allocator shared by host pools (`ShmPool`) and device pools (`DevicePoolBook`).

A byte ring with out-of-order release:

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
long-lived allocation holds back the space behind it.

Each slot runs FREE -> WRITING -> IN_FLIGHT -> (RELEASED by a reader) -> FREE, and its
generation goes up by one on every return to FREE, so a descriptor names one lifetime of
one slot.  The book holds the truth privately (ring, free-slot stack, every slot's state
and generation) and mirrors it into a caller-supplied u64 view of the shared slot table
(the layout of `shm.segment`), so a reader can never corrupt the allocator: the one thing
read back from shared memory is a RELEASED word *with the generation handed out*.

Knows nothing about segments, arrays or devices: the callers own the memory the offsets
point into, and validate descriptors before passing slot numbers in.
"""
from __future__ import annotations

import errno
import operator
import os
import select
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable

from .errors import OutOfResources, StaleDescriptor
from .segment import (
    FREE, IN_FLIGHT, MAX_ALIGN, MAX_SLOTS, Q_HOLDER_PID, Q_HOLDER_START, Q_LEND_TAG, Q_LENT_AT, Q_NBYTES,
    Q_OFFSET, QS, RELEASED, U32, WRITING, proc_starttime, process_alive,
)

__all__ = ["SlotBook", "PidfdHolders", "ProcHolders", "check_geometry", "UNKNOWN_STARTTIME"]


def check_geometry(capacity, slots, align, align_hint: str = "") -> tuple[int, int, int]:
    """(capacity, slots, align) as ints; ValueError when the book could not manage them."""
    capacity = operator.index(capacity)
    slots = operator.index(slots)
    align = operator.index(align)
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 byte, got {capacity}")
    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
    if not 1 <= align <= MAX_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two in 1..{MAX_ALIGN}, got {align}{align_hint}")
    return capacity, slots, align


#: a holder's starttime when /proc could not be read (OutOfResources): alive until a later
#: look finds the pid gone (its process is then not known, only that it exited or that the
#: pid was reused: either way held until it exits, never taken for dead on a failed read)
UNKNOWN_STARTTIME = -1


def _unknown_alive(pid: int) -> bool:
    """Whether a holder recorded with ``UNKNOWN_STARTTIME`` may still be alive."""
    try:
        return proc_starttime(pid) is not None
    except OutOfResources:
        return True


class ProcHolders:
    """Holder liveness from /proc: (pid, starttime) names a process forever."""

    @staticmethod
    def starttime(pid: int) -> int:
        try:
            return proc_starttime(pid) or 0
        except OutOfResources:
            return UNKNOWN_STARTTIME

    @staticmethod
    def alive(pid: int, starttime: int) -> bool:
        if starttime == UNKNOWN_STARTTIME:
            return _unknown_alive(pid)
        return starttime != 0 and process_alive(pid, starttime)

    def prune(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _close_pidfds(pid_of: dict[int, int], owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child's copies are its own to close (they are O_CLOEXEC)
    for fd in list(pid_of):
        try:
            os.close(fd)
        except OSError:
            pass
    pid_of.clear()


class PidfdHolders:
    """Starttimes of holder pids, cached behind a pidfd so a reused pid is never trusted.

    Reading /proc/<pid>/stat costs ~10 us; the worker marks every output with the client's
    pid.  A pidfd refers to one process forever, and polls readable once it exits, so
    while our pidfd for a pid is not readable that pid still names the process whose
    starttime we cached.

    A pidfd is an open descriptor: one is kept per holder process while it lives, and
    `prune` (the owner's housekeeping, through `SlotBook.reclaim`) closes those of the
    processes that exited, whether or not anything of ours still names them: a client
    that released its outputs and left is never looked up again.
    """

    MAX = 1024

    def __init__(self) -> None:
        self._cache: dict[int, tuple[int, int, select.poll]] = {}
        self._use_pidfd = hasattr(os, "pidfd_open")
        self._pid_of: dict[int, int] = {}  # pidfd -> pid
        self._exits = select.poll()  # every cached pidfd: readable once its process exited
        # Dropped without close() (an owner never closed): the descriptors go with it.  A
        # closure over the dict, not self: self would never be collected.
        # Not at interpreter exit (the descriptors go with the process), where it would
        # leave a holder still in use by a daemon thread with closed descriptors.
        weakref.finalize(self, _close_pidfds, self._pid_of, os.getpid()).atexit = False

    def _drop(self, pid: int) -> None:
        ent = self._cache.pop(pid, None)
        if ent is not None:
            fd = ent[1]
            del self._pid_of[fd]
            self._exits.unregister(fd)
            os.close(fd)

    def prune(self) -> int:
        """Close the pidfds of the cached processes that exited (one poll for all of them);
        how many went."""
        if not self._cache:
            return 0
        gone = [self._pid_of[fd] for fd, _ in self._exits.poll(0)]
        for pid in gone:
            self._drop(pid)
        return len(gone)

    def starttime(self, pid: int) -> int:
        ent = self._cache.get(pid)
        if ent is not None:
            if not ent[2].poll(0):
                return ent[0]
            self._drop(pid)
        try:
            st = proc_starttime(pid)
        except OutOfResources:
            return UNKNOWN_STARTTIME  # not "dead": out of descriptors says nothing of the holder
        if st is None:
            return 0  # already dead: the slot is reclaimable at once
        if self._use_pidfd and len(self._cache) < self.MAX:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return st
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                    # ENOSYS / EPERM under seccomp: /proc reads from now on.  Out of
                    # descriptors is not forever: this pid goes uncached, that is all.
                    self._use_pidfd = False
                return st
            if process_alive(pid, st) is False:
                # The pid was reused between the two reads: the pidfd is for a newer
                # process than ``st`` describes.  Don't cache; ``st``'s process is dead.
                os.close(fd)
                return st
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self._cache[pid] = (st, fd, poller)
            self._pid_of[fd] = pid
            self._exits.register(fd, select.POLLIN)
        return st

    def alive(self, pid: int, starttime: int) -> bool:
        if starttime == 0:
            return False
        if starttime == UNKNOWN_STARTTIME:
            return _unknown_alive(pid)
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


class SlotBook:
    """Ring and slot bookkeeping over ``capacity`` bytes; touches no memory but ``words``.

    ``words``: u64 view of the shared slot table, at least ``QS * slots`` words.
    ``base``: added to every ring offset before it is recorded (a host pool's data area
    starts after the header; a device pool's offsets are from its block's base).
    ``mirror_extent``: also store offset and nbytes in the slot record.  A device pool's
    records must keep pointing at the state table's token data area, so it passes False.
    ``on_free(slot)``: runs on every return to FREE (free, a reader's release, a dead
    holder), after the book's own state is updated.
    ``holders``: holder liveness, `ProcHolders` by default (`starttime(pid)`,
    `alive(pid, starttime)`, `prune()` at each `reclaim`, `close()`).

    Methods take slot numbers the caller has already checked against a descriptor.
    Not thread-safe: one owner thread, or a lock around it.
    """

    def __init__(self, capacity: int, slots: int, align: int, words, *, base: int = 0,
                 mirror_extent: bool = True, holders: Any = None,
                 on_free: Callable[[int], None] | None = None):
        self.capacity = capacity
        self.slots = slots
        self.align = align
        self.words = words
        self.base = base
        self._mirror_extent = mirror_extent
        self._holders = holders if holders is not None else ProcHolders()
        self._on_free = on_free
        self._amask = align - 1
        self._gen = [0] * slots
        self._pstate = bytearray(slots)  # FREE / WRITING / IN_FLIGHT (never RELEASED)
        self._off = [0] * slots  # base + ring offset
        self._nb = [0] * slots
        self._free = list(range(slots - 1, -1, -1))  # stack: pop() gives slot 0 first
        # Live (and not yet skipped-over freed) allocations in allocation order:
        # (slot, generation at alloc, start, end), offsets relative to the ring.
        self._ring: deque[tuple[int, int, int, int]] = deque()
        self._head = 0
        self._in_flight: set[int] = set()
        self._holder_of: dict[int, tuple[int, int]] = {}  # IN_FLIGHT slot -> (pid, starttime)
        # The same, by holder: `reclaim` asks each holder once whether it lives and visits
        # only a dead one's slots (a walk of every held slot cost 1.3 ms at 4,000 held, at
        # each of the worker's housekeeping passes)
        self._held_by: dict[tuple[int, int], set[int]] = {}
        self.wraps = 0

    # ------------------------------------------------------------------ queries
    def in_use(self) -> int:
        """Number of live (non-FREE) slots."""
        return self.slots - len(self._free)

    def live_bytes(self) -> int:
        """Bytes held by live allocations (for the pool-full messages)."""
        gens = self._gen
        return sum(e[3] - e[2] for e in self._ring if gens[e[0]] == e[1])

    def oldest(self) -> int | None:
        """The slot at the ring's tail: the one holding back the space after it."""
        return self._ring[0][0] if self._ring else None

    # ------------------------------------------------------------------ state changes
    def take(self, nbytes: int) -> int:
        """Reserve a slot (now WRITING) and ``nbytes`` of the ring; the slot, or -1."""
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
                        self.wraps += 1
                elif start + nbytes > tail:  # wrapped: the only free bytes are [head, tail)
                    return -1
            elif nbytes > self.capacity:
                return -1
            else:
                start = 0
            slot = free.pop()
            self._head = start + nbytes
            ring.append((slot, self._gen[slot], start, self._head))
        else:
            # Empty allocations take a slot (so every descriptor has a generation to check)
            # but no bytes, and stay out of the ring so they never block its tail.
            slot = free.pop()
            start = 0
        off = self.base + start
        self._pstate[slot] = WRITING
        self._off[slot] = off
        self._nb[slot] = nbytes
        w = self.words
        b = slot * QS
        if self._mirror_extent:
            w[b + Q_OFFSET] = off
            w[b + Q_NBYTES] = nbytes
        w[b] = (self._gen[slot] << 32) | WRITING
        return slot

    def set_in_flight(self, slot: int, holder_pid: int | None = None, holder_start: int | None = None,
                      tag: int = 0) -> None:
        """WRITING -> IN_FLIGHT of a live slot; re-marking (a retry) only updates the holder.

        ``holder_pid`` names the process that will release the slot; if it dies first,
        reclaim() frees the slot.  None: the owner frees it itself.  ``holder_start``: that
        process's start time as attested with its pid, when known: a pid now another
        process's (it started at another time) is a holder gone already.  ``tag``: what the
        slot is lent for (an output: its request's id), stored with the time of the lending,
        so that a holder that gave up on that request, whose reply was lost on its way,
        can give the slot back (`SegmentCache.release_given_up`).
        """
        w = self.words
        b = slot * QS
        gen = self._gen[slot]
        if self._pstate[slot] == IN_FLIGHT and w[b] == (gen << 32) | RELEASED:
            raise StaleDescriptor(f"slot {slot} generation {gen} was already released by its reader")
        if holder_pid is None:
            hp = hs = 0
        else:
            hp = operator.index(holder_pid)
            if not 0 < hp <= U32:
                raise ValueError(f"holder_pid must be a positive pid, got {holder_pid!r}")
            hs = self._holders.starttime(hp)
            if holder_start is not None and hs != holder_start and hs != UNKNOWN_STARTTIME:
                hs = 0  # the attested process exited and its pid was reused: reclaimable at once
        w[b + Q_HOLDER_PID] = hp
        w[b + Q_HOLDER_START] = max(hs, 0)  # (informational: liveness reads _holder_of)
        if tag:
            w[b + Q_LEND_TAG] = tag
            w[b + Q_LENT_AT] = time.monotonic_ns()
        self._pstate[slot] = IN_FLIGHT
        self._in_flight.add(slot)
        w[b] = (gen << 32) | IN_FLIGHT
        if self._holder_of and slot in self._holder_of:
            self._forget_holder(slot)
        if hp:
            # `_held_by` first: a signal handler's exception between the two steps then leaves
            # only an extra entry there, which `reclaim` checks against `_holder_of` (a slot
            # in `_holder_of` alone would never be freed at its holder's death)
            key = (hp, hs)
            held = self._held_by.get(key)
            if held is None:
                self._held_by[key] = {slot}
            else:
                held.add(slot)
            self._holder_of[slot] = key

    def set_tag(self, slot: int, tag: int) -> None:
        """Record what an IN_FLIGHT slot was lent for (``tag``, not 0) and when: the worker
        does it once the reply naming the slot is written whole, so that a slot it frees
        (a reply it could not finish) never carries a tag its holder may act on
        (`SegmentCache.release_given_up`)."""
        w = self.words
        b = slot * QS
        w[b + Q_LEND_TAG] = tag
        w[b + Q_LENT_AT] = time.monotonic_ns()

    def _forget_holder(self, slot: int) -> tuple[int, int] | None:
        """``slot`` leaves its holder's books (`_holder_of` first, then `_held_by`: cut short,
        it leaves only an extra `_held_by` entry); its holder, if any."""
        key = self._holder_of.pop(slot, None)
        if key is not None:
            held = self._held_by.get(key)
            if held is not None:
                held.discard(slot)
                if not held:
                    del self._held_by[key]
        return key

    def free_slot(self, s: int) -> None:
        """A live slot (any state) goes back to FREE; its generation goes up by one."""
        # The owner forgets the slot's caches first: an exception from a signal handler
        # (Ctrl-C, an alarm) anywhere below must not leave a slot on the free list that
        # still has the old generation's descriptor cached (the next request on it was
        # refused as stale).
        if self._on_free is not None:
            self._on_free(s)
        g = (self._gen[s] + 1) & U32
        self._gen[s] = g
        self._pstate[s] = FREE
        w = self.words
        # Guarded: on the alloc/free round trip both are usually empty, and an empty
        # truth test is cheaper than a discard or pop.
        if self._in_flight:
            self._in_flight.discard(s)
        if self._holder_of and self._forget_holder(s) is not None:
            b = s * QS
            w[b + Q_HOLDER_PID] = 0
            w[b + Q_HOLDER_START] = 0
            w[b + Q_LEND_TAG] = 0
            w[b + Q_LENT_AT] = 0
        w[s * QS] = g << 32  # | FREE (0): one store, generation and state together
        self._free.append(s)
        if self._nb[s]:
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

    def reclaim(self, candidates: Iterable[int] | None = None) -> int:
        """Free IN_FLIGHT slots their reader released and those whose holder died.

        ``candidates``: the slots whose shared word to look at, e.g. a vectorised scan for
        RELEASED states over a large table; by default every IN_FLIGHT slot.  Any candidate
        word other than the truth -- a late RELEASED for an older generation (possible only
        after the owner freed a slot still lent out), or garbage -- is overwritten with it.
        Returns how many slots were freed.  Closes the cached pidfds of holders that
        exited (`PidfdHolders.prune`).
        """
        n = 0
        w = self.words
        pstate = self._pstate
        gens = self._gen
        for s in list(self._in_flight) if candidates is None else candidates:
            b = s * QS
            word = w[b]
            gen = gens[s]
            if word == (gen << 32) | RELEASED and pstate[s] == IN_FLIGHT:
                self.free_slot(s)
                n += 1
            elif word != (gen << 32) | pstate[s]:
                w[b] = (gen << 32) | pstate[s]
        # Holders that exited let go of their cached pidfds, including those that hold
        # nothing of ours any more (they released everything, then left).
        self._holders.prune()
        holder_of = self._holder_of
        for key in [k for k in self._held_by if not self._holders.alive(*k)]:
            held = self._held_by.get(key, ())
            for s in list(held):
                if holder_of.get(s) != key:
                    held.discard(s)  # left by an update a signal cut short: not this holder's
                elif pstate[s] == IN_FLIGHT:
                    self.free_slot(s)
                    n += 1
            if not held:
                self._held_by.pop(key, None)
        return n
