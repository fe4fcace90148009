"""Shared-memory data plane: tensors are written once and read in place by another process.

Only a small descriptor (``ShmRef``) crosses ZeroMQ; the bytes stay in a sealed memfd
that both processes map.  This package knows nothing about ZeroMQ or msgpack.
Design notes and the full memory-ordering argument: docs/shm.md.

Segment
-------
A segment is a memfd named ``zinf-<pid>-<starttime>-<16 hex>-<fd>``, created (mode 0600),
sized, sealed against resizing and mapped MAP_SHARED by exactly one process, its *owner*,
which keeps descriptor ``fd`` open; others open it as ``/proc/<pid>/fd/<fd>`` (only the
same user may).  ``pid`` and ``starttime`` (field 22 of /proc/<pid>/stat) name the owner,
so anyone can tell whether it is still alive even after the pid has been recycled; the
seals mean nobody, the owner included, can shrink it under a reader (SIGBUS).  It holds a 4096-byte header,
a slot table of 64-byte records (one cache line each, so one slot's traffic never
false-shares with another's), and a data area where a slot's bytes are
``[offset, offset + nbytes)``.  Byte offsets: ``shm.segment.HEADER_FIELDS`` and
``SLOT_FIELDS``, the source of truth (docs/shm.md renders them).

``state`` and ``generation`` share one aligned 8-byte word (state in the low half), so
each write of them is a single store and each read a consistent pair.

Slot states and who may move them
---------------------------------
::

    FREE (0) --alloc--> WRITING (1) --mark_in_flight--> IN_FLIGHT (2) --release--> RELEASED (3)
      ^  ^                  |                               |  (reader)                 |
      |  +------free--------+-------------free--------------+                          |
      +------------------------------reclaim (owner)--------------------------------------+

- FREE -> WRITING: the owner, allocating.  It fills the slot's bytes while WRITING.
- WRITING -> IN_FLIGHT: the owner, just before it sends the descriptor.  It records the
  holder (the process expected to release the slot), if there is one.
- IN_FLIGHT -> RELEASED: a reader, when done.  This is the *only* store a non-owner ever
  makes to a segment: one 8-byte store of (same generation, RELEASED), after a fence.
- RELEASED -> FREE, WRITING/IN_FLIGHT -> FREE: the owner only.  ``generation`` goes up by
  one on every return to FREE, so a descriptor names one lifetime of one slot and any
  later use of it is detected (``StaleDescriptor``).

Where each state's slots live: WRITING belongs to the owner alone; IN_FLIGHT slots are
shared with readers, who may only read them; RELEASED slots wait for the owner's next
``reclaim()`` (run lazily, when an allocation does not fit).  The allocator itself
(``shm.book.SlotBook``, shared with the device pools of ``shm.cuda``: ring head/tail,
free slot ids) and the owner's copy of every state and generation live in the
owner's private memory; the owner never trusts anything in the segment except a RELEASED
state carrying the generation it handed out.

Readers map the header and table read-write (for the RELEASED store) and the data area
read-only, validate every descriptor against the slot record before viewing a byte, and
cache one mapping per segment (``SegmentCache``).

When a process dies
-------------------
- An owner (client with input slots, worker with output slots) dies: its descriptor
  goes with it, and new descriptors into its segments fail (``SegmentGone``).  Readers
  that had a segment mapped keep valid memory -- views in use stay correct -- until they
  drop the mapping (``SegmentCache.sweep()`` / ``forget()``); the kernel frees the pages
  with the last mapping.  Nothing is left to collect.
- A reader dies holding IN_FLIGHT slots: if the owner recorded it as the holder
  (``mark_in_flight(ref, holder_pid=...)``), the owner's ``reclaim()`` frees those slots
  once /proc shows that pid/starttime gone.  Slots without a holder (inputs) are freed
  by their owner when their request ends, whoever died.
- A reader dies half-way through its RELEASED store: impossible; it is one store.

Memory ordering, in one paragraph (docs/shm.md has the full argument): the owner's
stores of tensor bytes and of the slot record happen before it sends the descriptor; the
send and the reader's receive are system calls and libzmq lock/atomic handoffs, which
order them release -> acquire across processes on x86 and ARM, so a reader that has the
descriptor sees the bytes.  The reader's RELEASED store must not become visible before
its loads of those bytes: x86 never reorders a load with a later store; on ARM
``fence.fence()`` (two lock round trips) orders them.  The owner reuses the bytes only
after loading RELEASED, and its reuse is control-dependent on that load.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import gc
from .errors import RESOURCE_ERRNOS, BadDescriptor, NotShared, OutOfResources, SegmentGone, ShmError, ShmFull, StaleDescriptor
from .fence import fence
from .gc import collect
from .names import ShmRef

if TYPE_CHECKING:
    from .pool import ShmPool
    from .reader import SegmentCache
    from .segment import FREE, IN_FLIGHT, RELEASED, WRITING

# Loaded at first use (PEP 562): these bring numpy, which a process that only judges names
# and owners (the broker, through `shm.names` and `shm.gc`) never needs.
_LAZY = {"ShmPool": "pool", "SegmentCache": "reader", "FREE": "segment", "WRITING": "segment",
         "IN_FLIGHT": "segment", "RELEASED": "segment"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # (asked once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "ShmRef", "ShmPool", "SegmentCache", "collect", "fence", "gc",
    "ShmError", "ShmFull", "SegmentGone", "StaleDescriptor", "BadDescriptor", "NotShared", "OutOfResources", "RESOURCE_ERRNOS",
    "FREE", "WRITING", "IN_FLIGHT", "RELEASED",
]
