"""The host state table of a device pool: its slots' state words, in a zinf segment.

Contract:

- The table is an ordinary segment (`shm.segment.create_segment`, the host layout
  unchanged), so a reader stores RELEASED with `shm.SegmentCache.release` as for a host
  slot, a dead owner's table vanishes with its last mapping (a sealed memfd), and the pool id is
  the segment's name.  Its data area is a token 64 bytes that every slot record points at
  with size 0 (`refs.host_ref`).
- The header's unused bytes at `META_OFFSET` carry the pool's metadata, written once by the
  owner before any descriptor is sent and never changed::

      2048  magic "ZINFCUDA"  2056 version u32  2060 device u32  2064 capacity u64
      2072  align u64         2080 memory handle, 64 bytes       2144 device UUID, 16 bytes
            (all zero: unknown)

  so an importer can check bounds and open the pool from a descriptor without a handle,
  and map the owner's ordinal to its own (`views.local_ordinal`).
- Only the owner process closes the table: the header's closed flag is set
  (`shm.segment.mark_closed`) and the owner's descriptor closed, by `close()`, by garbage collection
  or at exit; a forked child that inherited the object does neither.
"""
from __future__ import annotations

import os
import struct
import weakref
from typing import NamedTuple

from ..errors import BadDescriptor
from ..fence import fence
from ..segment import (
    HEADER_SIZE, IN_FLIGHT, QS, RELEASED, SLOT_SIZE, create_segment, mark_closed, open_checked,
)
from .refs import HANDLE_SIZE

__all__ = ["META_OFFSET", "HostStateTable", "PoolMeta", "read_pool_meta", "release_word"]

META_OFFSET = 2048
META_MAGIC = b"ZINFCUDA"
META_VERSION = 1
_META = struct.Struct("<8sIIQQ64s16s")  # magic, version, device, capacity, align, handle, uuid


class PoolMeta(NamedTuple):
    capacity: int
    device: int
    align: int
    handle: bytes
    uuid: bytes  # 16 bytes, or empty when unknown


def _finalize_table(fd: int, owner_pid: int, mm) -> None:
    if os.getpid() != owner_pid:  # a forked child: not its table, maybe not its fd number
        return
    try:
        mark_closed(mm)  # importers drop their mappings
    except (ValueError, TypeError):
        pass
    try:
        os.close(fd)
    except OSError:
        pass


class HostStateTable:
    """State words of a device pool's slots, in a zinf segment with the host layout.

    The data area is a token 64 bytes: every slot record points at its start with size 0,
    which is what `host_ref` describes, so `shm.SegmentCache` validates and releases device
    slots with no code of its own."""

    def __init__(self, slots: int):
        name, mm, geo, fd = create_segment(1, slots, 64)
        self._finalizer = weakref.finalize(self, _finalize_table, fd, os.getpid(), mm)
        self.name = name
        self.slots = slots
        self.data_offset = geo.data_offset
        self._mm = mm
        root = memoryview(mm)
        tab = root[HEADER_SIZE: HEADER_SIZE + SLOT_SIZE * slots]
        self.words = tab.cast("Q")
        self._views = (self.words, tab, root)
        self.closed = False

    def write_meta(self, meta: PoolMeta) -> None:
        handle = bytes(meta.handle).ljust(HANDLE_SIZE, b"\0")[:HANDLE_SIZE]
        uuid = bytes(meta.uuid).ljust(16, b"\0")[:16]
        self._mm[META_OFFSET: META_OFFSET + _META.size] = _META.pack(
            META_MAGIC, META_VERSION, meta.device, meta.capacity, meta.align, handle, uuid)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for v in self._views:
            v.release()
        self._views = ()
        self.words = None
        self._finalizer()
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover - nothing else exports it
            pass


def read_pool_meta(name: str) -> tuple[PoolMeta, int]:
    """(metadata, data offset) of a device pool's state table, read from the file.
    SegmentGone / BadDescriptor as for host segments."""
    fd, h = open_checked(name, os.O_RDONLY, "device pool")
    try:
        raw = os.pread(fd, _META.size, META_OFFSET)
    finally:
        os.close(fd)
    if len(raw) < _META.size:
        raise BadDescriptor(f"{name} has no device pool metadata")
    magic, version, device, capacity, align, handle, uuid = _META.unpack(raw)
    if magic != META_MAGIC or version != META_VERSION:
        raise BadDescriptor(f"{name} is not a device pool table (or has another layout version)")
    if uuid == bytes(16):
        uuid = b""
    return PoolMeta(capacity, device, align, handle, uuid), int(h["data_offset"])


def release_word(words, slot: int, generation: int) -> bool:
    """A reader's RELEASED store on a state table it can write (tests, in-process tables).
    True if the slot was IN_FLIGHT at `generation`."""
    b = slot * QS
    if words[b] != (generation << 32) | IN_FLIGHT:
        return False
    fence()
    words[b] = (generation << 32) | RELEASED
    return True
