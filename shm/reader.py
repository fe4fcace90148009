"""Reader side: map each segment once, validate descriptors, hand out zero-copy views.

A reader never trusts a descriptor: it arrived over a socket, perhaps late, duplicated or
from a buggy peer.  Everything is checked against the segment before a byte of tensor data
is touched, and the data area is mapped read-only so a reader cannot scribble on it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

import numpy as np

from .book import PidfdHolders, ProcHolders
from .errors import BadDescriptor, SegmentGone, ShmError, StaleDescriptor
from .fence import fence
from .segment import (
    H32_CLOSED, IN_FLIGHT, MAX_MAPPED_SEGMENT, Q_HOLDER_PID, Q_LEND_TAG, Q_LENT_AT, Q_NBYTES, Q_OFFSET, QS, RELEASED,
    STATE_NAMES, U32, Attached,
    ShmRef, attach_segment, checked_dtype, detach, normalize_shape, parse_name,
)


#: segments a reader keeps mapped by default: more than the clients a worker serves in turn
MAX_SEGMENTS = 256
#: bytes a reader keeps mapped in all by default (address space: a sparse memfd costs its
#: owner nothing): what 64 segments of the largest size mapped (`MAX_MAPPED_SEGMENT`) came to
MAX_MAPPED_BYTES = 64 * MAX_MAPPED_SEGMENT


def _mapped_bytes(a: Attached) -> int:
    return len(a.table_mm) + len(a.data_mm)


class SegmentCache:
    """Mappings of other processes' segments (data area read-only), one per segment, reused.

    Attaching costs a few syscalls and two mmaps; every later view() is a dictionary
    lookup plus validation.  At most ``max_segments`` stay mapped, of at most
    ``max_mapped_bytes`` in all (least recently used goes first): a worker keeps one
    segment per client it serves, so the count must cover the clients that take turns
    (with 64, a worker serving more clients than that mapped a segment again at every
    request), while the bytes bound what a client's sparse memfds can make it map.  Segments whose owner closed them are dropped the next time they are
    touched, and by sweep(), so an unlinked segment's memory is not kept alive by us.

    Not thread-safe: one cache per thread, or guard it with a lock.
    """

    def __init__(self, max_segments: int = MAX_SEGMENTS, *, on_forget=None,
                 max_segment_bytes: int = MAX_MAPPED_SEGMENT, max_mapped_bytes: int = MAX_MAPPED_BYTES,
                 owners: PidfdHolders | None = None, track_owners: bool = False):
        if max_segments < 1:
            raise ValueError("max_segments must be >= 1")
        if max_mapped_bytes < 1:
            raise ValueError("max_mapped_bytes must be >= 1")
        # At most max_mapped_bytes of address space, whatever clients send (and one
        # segment of at most max_segment_bytes over it, the one just mapped).
        self._max_seg_bytes = max_segment_bytes
        self._max_bytes = max_mapped_bytes
        self._mapped = 0  # bytes of the mappings in _segs
        self._segs: OrderedDict[str, Attached] = OrderedDict()
        self._max = max_segments
        self._closed = False
        # Called with a segment's name just before its mapping is closed, whatever the
        # reason (LRU, closed segment, sweep, close): a GPU worker unregisters its
        # cudaHostRegister pinning there, which must happen while the pages are mapped.
        self.on_forget = on_forget
        # The owners' liveness for sweep(check_owners=True): with ``owners`` (a worker's,
        # shared with its output pool and reply sockets) or ``track_owners`` (our own), a
        # pidfd per owner, taken at attach and closed once the owner exits, at the next
        # owner sweep (one poll for all, no /proc read).  Without either, a /proc read per
        # segment at each such sweep, and no descriptor held: a cache that never sweeps by
        # owner must not keep one per owner it ever met.
        self._track = owners is not None or track_owners
        self._own_owners = owners is None and track_owners
        self._owners = owners if owners is not None else PidfdHolders() if track_owners else ProcHolders()

    def __enter__(self) -> SegmentCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._segs)

    def __contains__(self, segment: object) -> bool:
        return segment in self._segs

    def __repr__(self) -> str:
        return f"<SegmentCache {len(self._segs)} segments mapped>"

    # ------------------------------------------------------------------ mappings
    def _get(self, name: str) -> Attached:
        a = self._segs.get(name)
        if a is not None:
            if a.h32[H32_CLOSED]:
                self.forget(name)
                raise SegmentGone(f"segment {name} was closed (its owner closed it or died)")
            self._segs.move_to_end(name)
            return a
        if self._closed:
            raise ShmError("SegmentCache is closed")
        self.sweep(check_owners=False)
        a = attach_segment(name, self._max_seg_bytes)  # validates the name before touching the filesystem
        self._segs[name] = a
        self._mapped += _mapped_bytes(a)
        if self._track:
            ids = parse_name(name)
            if ids is not None:
                self._owners.starttime(ids[0])  # a pidfd for sweep to poll (once per owner)
        while len(self._segs) > self._max or (self._mapped > self._max_bytes and len(self._segs) > 1):
            self.forget(next(iter(self._segs)))
        return a

    def _check(self, ref, released_ok: bool = False, holder: int | None = None) -> tuple[Attached, int, int]:
        """Validate ``ref`` against its slot record.  (mapping, slot index, state word).

        The returned word is -1 when ``released_ok`` and the slot is already RELEASED at
        the descriptor's generation.  ``holder``: the pid the owner must have lent the slot
        to (`ShmPool.mark_in_flight`'s ``holder_pid``), else BadDescriptor.
        """
        try:
            name, off, nb, slot, gen = ref
        except (TypeError, ValueError):
            raise BadDescriptor(f"not a descriptor (segment, offset, nbytes, slot, generation): {ref!r}") from None
        if type(name) is not str:
            raise BadDescriptor(f"segment name must be a str, got {type(name).__name__}")
        if not (type(off) is int and type(nb) is int and type(slot) is int and type(gen) is int):
            raise BadDescriptor(f"descriptor fields must be ints: {ref!r}")
        a = self._get(name)
        if not 0 <= slot < a.slot_count:
            raise BadDescriptor(f"slot {slot} out of range 0..{a.slot_count - 1} in {name}")
        if off < a.data_offset or nb < 0 or off + nb > a.data_end:
            raise BadDescriptor(
                f"bytes [{off}, +{nb}) are outside the data area [{a.data_offset}, {a.data_end}) of {name}"
            )
        if not 0 <= gen <= U32:
            raise BadDescriptor(f"generation {gen} out of range")
        q = a.q
        b = slot * QS
        w = q[b]
        state = w & U32
        if w >> 32 != gen or state != IN_FLIGHT:
            if released_ok and state == RELEASED and w >> 32 == gen:
                return a, b, -1
            raise StaleDescriptor(
                f"descriptor for slot {slot} generation {gen} of {name} is stale: the slot is "
                f"{STATE_NAMES.get(state, state)} at generation {w >> 32}",
                moved_on=w >> 32 > gen,
            )
        if holder is not None and q[b + Q_HOLDER_PID] & U32 != holder:
            # Not lent to this reader: a request's input (its owner frees it, and a RELEASED
            # stored by us would free it under that request), or a slot lent to another
            # process (whose view of it would be overwritten once we released it).
            lent = q[b + Q_HOLDER_PID] & U32
            raise BadDescriptor(
                f"slot {slot} of {name} is not lent to this process (pid {holder}): "
                + (f"it is lent to pid {lent}" if lent else "it is lent to no reader (an input of a request?)")
            )
        so = q[b + Q_OFFSET]
        sn = q[b + Q_NBYTES]
        if off < so or off + nb > so + sn:
            raise BadDescriptor(
                f"bytes [{off}, +{nb}) do not lie in slot {slot}'s record [{so}, +{sn}) of {name}"
            )
        if q[b] != w:
            # The owner moved the slot on while we looked at it: our reads of offset and
            # nbytes may belong to the next generation.
            raise StaleDescriptor(f"slot {slot} of {name} changed while being validated",
                                  moved_on=int(q[b]) >> 32 > gen)
        return a, b, w

    # ------------------------------------------------------------------ public API
    def view(self, ref: ShmRef, dtype, shape, holder: int | None = None) -> np.ndarray:
        """A read-only ndarray over the descriptor's bytes, without copying them.
        ``holder``: refuse (BadDescriptor) a slot its owner did not lend to that pid (a
        client viewing outputs passes its own: an input of a request, which nobody may
        release, has no holder)."""
        try:
            dt = checked_dtype(dtype)
        except TypeError as e:
            raise BadDescriptor(f"bad dtype {dtype!r}: {e}") from None
        try:
            shape, n = normalize_shape(shape)
        except (TypeError, ValueError) as e:
            raise BadDescriptor(f"bad shape {shape!r}: {e}") from None
        a, _, _ = self._check(ref, holder=holder)
        nb = ref[2]
        if n * dt.itemsize != nb:
            raise BadDescriptor(
                f"shape {shape} of {dt} is {n * dt.itemsize} bytes but the descriptor has {nb}"
            )
        # frombuffer with positional arguments is the cheapest way numpy offers to wrap
        # memory; the data mapping is read-only, so the array is too (and cannot be
        # made writeable).
        arr = np.frombuffer(a.data_mm, dt, n, ref[1] - a.data_offset)
        return arr if arr.shape == shape else arr.reshape(shape)

    def release(self, ref: ShmRef, holder: int | None = None) -> None:
        """Tell the owner this reader is done with the slot (IN_FLIGHT -> RELEASED).

        Call it only after every read of the slot's bytes has finished, including
        asynchronous ones (a non-blocking device copy).  Releasing twice is a no-op while
        the owner has not reclaimed the slot; afterwards it raises StaleDescriptor.
        ``holder``: as for `view`, nothing is stored into a slot not lent to that pid.
        """
        a, b, w = self._check(ref, released_ok=True, holder=holder)
        if w < 0:
            return
        # Our loads of the tensor (done by the caller before this call) must be complete
        # before the owner can see RELEASED and overwrite the bytes.  See shm/fence.py.
        fence()
        a.q[b] = (w & ~U32) | RELEASED  # one aligned 8-byte store: same generation, RELEASED

    def release_given_up(self, given_up: Container[int], holder: int, lent_before_ns: int,
                         keep: Container[tuple[str, int, int]] = (), skip: str | None = None) -> int:
        """Give back the slots of the mapped rings that their owners lent to ``holder`` for a
        request it gave up on (its reply was lost on its way, with a broker that died or a
        connection that was dropped: the holder will never be told their descriptors).

        A slot goes back when it is IN_FLIGHT, lent to ``holder``, its ``lend_tag`` is in
        ``given_up`` (0 is no tag), it was lent before ``lent_before_ns`` (CLOCK_MONOTONIC), and its
        (segment, slot, generation) is not in ``keep`` (slots the holder views).  The same
        store as `release`, and as safe without a compare-and-swap: a slot lent to a live
        holder leaves IN_FLIGHT only by that holder's RELEASED, or by its owner freeing it
        at once when the reply could not be written (within the lending, long before
        ``lent_before_ns``), so the generation checked just before the store is still the
        slot's when it lands.  ``skip``: a segment never touched (the holder's own pool).
        Returns how many slots went back."""
        n = 0
        for name, a in list(self._segs.items()):
            if name == skip or a.h32[H32_CLOSED]:
                continue
            rows = np.frombuffer(a.q, np.uint64).reshape(-1, QS)
            try:
                # One copy of the records lent to the holder, then every test on that copy: the
                # live table moves under the look (the owner lends and frees as it goes).
                idx = np.flatnonzero(rows[:, Q_HOLDER_PID] == holder)
                snap = rows[idx]  # (indexing by a list of rows copies them)
            finally:
                del rows  # (an export of the mapping: `detach` could not close it)
            hit = (((snap[:, 0] & U32) == IN_FLIGHT) & (snap[:, Q_LEND_TAG] != 0) & (snap[:, Q_LENT_AT] != 0)
                   & (snap[:, Q_LENT_AT] < lent_before_ns))
            q = a.q
            for i in np.flatnonzero(hit).tolist():
                s, w, tag, at = int(idx[i]), int(snap[i, 0]), int(snap[i, Q_LEND_TAG]), int(snap[i, Q_LENT_AT])
                if tag not in given_up or (name, s, w >> 32) in keep:
                    continue
                b = s * QS
                if q[b] != w or q[b + Q_LEND_TAG] != tag or q[b + Q_LENT_AT] != at or q[b + Q_HOLDER_PID] != holder:
                    continue  # moved on since the look (one lifetime keeps its word, tag and time)
                q[b] = (w & ~U32) | RELEASED  # nothing was read: no fence needed
                n += 1
        return n

    def mapping(self, segment: str):
        """The read-only mmap of ``segment``'s data area, if it is mapped (else None).

        For pinning it (cudaHostRegister); valid until ``on_forget`` is called for it."""
        a = self._segs.get(segment)
        return None if a is None else a.data_mm

    def forget(self, segment: str) -> None:
        """Drop the mapping of ``segment`` (views already handed out stay valid)."""
        a = self._segs.pop(segment, None)
        if a is not None:
            self._mapped -= _mapped_bytes(a)
            hook = self.on_forget
            if hook is not None:
                try:
                    hook(segment)
                except Exception:  # a failing hook must not leak the mapping
                    pass
            detach(a)

    def sweep(self, check_owners: bool = True) -> list[str]:
        """Drop mappings of segments that were closed or, with check_owners, whose owner died.

        Cheap without check_owners (one load per segment); with it, one poll of the owners'
        pidfds and one per segment (a /proc read each without ``owners``, or where pidfds
        are not to be had).
        Workers call it with the heartbeat (`HostPlane.housekeeping`): a client killed with
        SIGKILL never marks its segment closed, and our mapping would keep its memory.
        """
        dropped = self.dead(check_owners)
        for name in dropped:
            self.forget(name)
        return dropped

    def dead(self, check_owners: bool = True) -> list[str]:
        """The segments `sweep` would drop now (closed, or with check_owners, their owner
        died), left mapped: for a caller that drops them only once seen dead twice."""
        out = []
        owners = self._owners
        if check_owners:
            owners.prune()
        for name, a in self._segs.items():
            gone = bool(a.h32[H32_CLOSED])
            if not gone and check_owners:
                ids = parse_name(name)
                gone = ids is not None and not owners.alive(*ids)
            if gone:
                out.append(name)
        return out

    def close(self) -> None:
        """Drop every mapping.  Idempotent."""
        self._closed = True
        for name in list(self._segs):
            self.forget(name)
        if self._own_owners:
            self._owners.close()


__all__ = ["SegmentCache", "MAX_SEGMENTS", "MAX_MAPPED_BYTES"]
