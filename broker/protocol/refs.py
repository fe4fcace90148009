"""Descriptor conversions between the wire and the memory planes.

`shm` and `shm.cuda` describe a tensor's bytes with their own small tuples (`ShmRef`,
`DeviceRef`) and know nothing of msgpack; the wire carries `ShmLoc` and `CudaLoc`.  These four
functions are the only place one becomes the other, field for field.  They validate nothing:
the owner trusts its own refs, and a reader checks every received one against the slot
record (`shm.SegmentCache`, `shm.cuda.CudaPoolCache`) before it maps a byte.
"""
from __future__ import annotations

from shm.cuda.refs import DeviceRef
from shm.names import ShmRef

from .header import CudaLoc, ShmLoc

__all__ = ["shm_loc", "shm_ref", "cuda_loc", "device_ref"]


def shm_loc(ref: ShmRef) -> ShmLoc:
    """The wire location of a host shared-memory slot."""
    return ShmLoc(segment=ref.segment, offset=ref.offset, nbytes=ref.nbytes, slot=ref.slot,
                  generation=ref.generation)


def shm_ref(loc: ShmLoc) -> ShmRef:
    """The `shm` descriptor a received `ShmLoc` names."""
    return ShmRef(loc.segment, loc.offset, loc.nbytes, loc.slot, loc.generation)


def cuda_loc(ref: DeviceRef) -> CudaLoc:
    """The wire location of a device slot (`CudaPool.hand_off` fills handle and event)."""
    return CudaLoc(pool=ref.pool, offset=ref.offset, nbytes=ref.nbytes, device=ref.device,
                   handle=ref.handle, event=ref.event, slot=ref.slot, generation=ref.generation)


def device_ref(loc: CudaLoc) -> DeviceRef:
    """The `shm.cuda` descriptor a received `CudaLoc` names."""
    return DeviceRef(loc.pool, loc.offset, loc.nbytes, loc.slot, loc.generation, loc.device,
                     loc.handle, loc.event)
