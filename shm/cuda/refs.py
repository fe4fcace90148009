"""Device descriptors: what names one device slot, and the reader's check of a received one.

Contract:

- A `DeviceRef` has exactly the fields of the wire's `CudaLoc`; `broker.protocol.refs`
  (`cuda_loc`, `device_ref`) is the only place one becomes the other.  This module knows
  nothing of msgpack.
- ``pool`` is the name of the pool's state table (a zinf segment name, so it names the
  owner's pid and start time); ``(slot, generation)`` names one lifetime of one slot of it;
  ``offset``/``nbytes`` are bytes from the pool's base; ``device`` is the owner's ordinal.
- `check_ref` is the reader's one shape check of a received descriptor (no I/O; the state
  table check comes after it, in `CudaPoolCache`).  A descriptor without a slot (slot -1,
  `CudaLoc`'s default) is refused: there is nothing to validate or release without one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import BadDescriptor
from ..names import U32, ShmRef, parse_name

__all__ = ["HANDLE_SIZE", "DeviceSlot", "DeviceRef", "check_ref", "host_ref"]

HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)


class DeviceSlot(NamedTuple):
    """One allocation of a `DevicePoolBook`: offset is relative to the pool's base."""

    slot: int
    generation: int
    offset: int
    nbytes: int


class DeviceRef(NamedTuple):
    """One device slot handed to another process: the fields of the protocol's `CudaLoc`
    (broker.protocol.refs converts one into the other)."""

    pool: str        # the state table's segment name: unique per pool, carries the owner's pid
    offset: int      # bytes from the pool's base
    nbytes: int
    slot: int
    generation: int
    device: int      # the owner's CUDA ordinal
    handle: bytes = b""   # the pool's IPC memory handle (empty once the peer has the pool open)
    event: bytes = b""    # IPC event recorded after the producer's last write (empty: none)


def check_ref(ref: Any) -> DeviceRef:
    """A received device descriptor as a `DeviceRef`, checked field by field (the reader
    never trusts one); BadDescriptor names what is wrong.  Anything with DeviceRef's fields
    is accepted, so the protocol's `CudaLoc` is checked without a conversion."""
    pool, slot, gen = ref.pool, ref.slot, ref.generation
    if slot == -1:
        raise BadDescriptor(
            f"CUDA location in pool {pool!r} names no slot (slot -1): the sender must fill slot and "
            "generation (a pool id of the form '<segment>/<slot>/<generation>' is not accepted)")
    if parse_name(pool) is None:
        raise BadDescriptor(f"CUDA pool id {pool!r} is not a state-table segment name")
    for what, v in (("offset", ref.offset), ("nbytes", ref.nbytes), ("slot", slot), ("generation", gen),
                    ("device", ref.device)):
        if type(v) is not int or v < 0:
            raise BadDescriptor(f"CUDA location field {what} must be a non-negative int, got {v!r}")
    if gen > U32:
        raise BadDescriptor(f"generation {gen} out of range")
    for what, b in (("handle", ref.handle), ("event", ref.event)):
        if b and len(b) != HANDLE_SIZE:
            raise BadDescriptor(f"CUDA location {what} must be {HANDLE_SIZE} bytes or empty, got {len(b)}")
    if type(ref) is DeviceRef:
        return ref
    return DeviceRef(pool, ref.offset, ref.nbytes, slot, gen, ref.device, bytes(ref.handle), bytes(ref.event))


def host_ref(ref: DeviceRef, record_offset: int) -> ShmRef:
    """The host descriptor of a device slot's state word: zero bytes at the table's data
    offset, which is what its slot record says, so `SegmentCache` validates and releases it
    unchanged."""
    return ShmRef(ref.pool, record_offset, 0, ref.slot, ref.generation)

