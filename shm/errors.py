"""Errors raised by the shared-memory data plane.

Every error is a ``ValueError`` (through ``ShmError``) because each one means "this value --
a descriptor, a request size, a segment name -- cannot be used", and callers that already
catch ``ValueError`` for bad input keep working.  The subclasses say what the caller should
do next:

- ``SegmentGone``: the owner closed or died; drop whatever refers to the segment.
- ``StaleDescriptor``: the slot was freed (and maybe reused) since the descriptor was made;
  the data it named no longer exists.  Usually a late or duplicated message.
- ``BadDescriptor``: the descriptor could never have been valid (forged, corrupted, wrong
  shape/dtype for its size).  A bug in the sender.
- ``NotShared`` (a ``BadDescriptor``): the kernel refused this process the owner's
  descriptors (``/proc/<pid>/fd``: another user, or an owner that is not dumpable).  The
  value may be fine; the two processes cannot share memory, so send the bytes instead.
- ``ShmFull``: the pool has no room; the message says how to give it some.
- ``OutOfResources``: this process (or the host) is out of descriptors or memory, so it
  cannot tell or do what was asked now; nothing is wrong with the value, and the same call
  may succeed later.  Never read as "dead" or "bad": a liveness question it interrupts is
  answered "alive".
"""
from __future__ import annotations


class ShmError(ValueError):
    """Base class of every error raised by ``shm``."""


class ShmFull(ShmError):
    """A pool cannot satisfy an allocation even after reclaiming released slots."""


class SegmentGone(ShmError):
    """The segment named by a descriptor no longer exists (owner closed it or died)."""


class StaleDescriptor(ShmError):
    """The descriptor names a slot generation that is no longer live.  ``moved_on``: the
    slot's generation is past the descriptor's (its owner freed it since the descriptor was
    made), not a state or a generation the slot never had (a forged or early reference).
    Set by the reader's checks (`shm.reader`); the owner's own refusals leave it False.  At
    the generation counter's wrap (2^32 generations of one slot) a freed slot reads as not
    moved on: the stricter answer."""

    def __init__(self, *args, moved_on: bool = False):
        super().__init__(*args)
        self.moved_on = moved_on


class BadDescriptor(ShmError):
    """The descriptor is malformed or inconsistent with the segment it names."""


class NotShared(BadDescriptor):
    """The owner's descriptors are closed to this process (EACCES on ``/proc/<pid>/fd``): it
    runs as another user, or is not dumpable.  Nothing can be shared with it; copy instead."""


class OutOfResources(ShmError):
    """Out of descriptors or memory (EMFILE, ENFILE, ENOMEM): not the value's fault; retry later."""


#: errnos that mean "this process or host is out of a resource", not "no such thing"
RESOURCE_ERRNOS = frozenset({24, 23, 12})  # EMFILE, ENFILE, ENOMEM


__all__ = ["ShmError", "ShmFull", "SegmentGone", "StaleDescriptor", "BadDescriptor", "NotShared", "OutOfResources",
           "RESOURCE_ERRNOS"]
