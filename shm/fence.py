"""A full memory fence for the reader's RELEASED store, built from a lock.

Python has no atomics or fences, but it has locks, and a lock round trip has well-defined
ordering on every architecture CPython supports.  ``fence()`` must order every memory load
the calling thread did before it (the reads of tensor bytes through a ``SegmentCache``
view) before every store it does after it (the RELEASED store into the slot's state word).

- x86-64 (TSO): a load is never reordered with a later store, so no fence is needed at all;
  the lock round trip is a few tens of nanoseconds of insurance.
- AArch64: loads may be reordered after later independent stores.  CPython's lock
  ``acquire`` is a load-acquire (``LDAXR``/``CASA``) and ``release`` a store-release
  (``STLR``/``STLXR``/``LDADDL``, or ``SWPL`` -- the store part of a release RMW).
  ArmV8 acquire/release are RCsc: a store-release followed by a load-acquire is *not*
  reordered (unlike RCpc ``LDAPR``).  So in

      <loads of tensor data>
      acquire #1   -- only so that the next release is legal
      release #1   -- store-release: all earlier loads and stores are ordered before it
      acquire #2   -- load-acquire: ordered after release #1 (RCsc), and every later
                      load and store is ordered after it
      release #2   -- leave the lock free
      <store RELEASED>

  the chain  data loads -> release #1 -> acquire #2 -> RELEASED store  is ordered at every
  link, which is exactly a full fence between the preceding loads and the following store.
  One acquire/release pair alone would not do: an acquire orders only what follows it and
  a release only what precedes it, and the plain RELEASED store after ``release #1`` could
  still move up past it.

Each call uses a lock of its own, made for the call.  The ordering argument above needs
no particular lock (RCsc orders a store-release before a later load-acquire whatever their
addresses), and a lock nobody else can see is never contended and can never deadlock --
not even when a signal handler or a weakref finaliser that releases a slot runs in the
middle of another fence on the same thread, which a shared non-reentrant lock would turn
into a hang.  Cost: about 0.3 us, measured by bench/micro_shm.py.
"""
from __future__ import annotations

from threading import Lock


def fence() -> None:
    """Order all earlier loads and stores of this thread before all later ones."""
    lock = Lock()
    lock.acquire()
    lock.release()  # store-release
    lock.acquire()  # load-acquire, not reordered before the release above (RCsc)
    lock.release()


__all__ = ["fence"]
