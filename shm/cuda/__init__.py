"""CUDA IPC data plane: device tensors handed between processes by reference.

The design (pools, slots, ordering, lifetimes) is in `shm.cuda.ipc`'s docstring and
docs/gpu.md.  Everything here imports without CUDA, torch or cuda-python; only what touches a
device raises `CudaUnavailable`, saying what is missing.  Like the rest of `shm`, this
package knows nothing of ZeroMQ or msgpack: `broker.protocol.refs` turns a `DeviceRef` into
the wire's `CudaLoc` and back.
"""
from __future__ import annotations

from .ipc import (
    ALIGN,
    ALIGN_LARGE,
    HANDLE_SIZE,
    CudaPool,
    CudaPoolCache,
    CudaUnavailable,
    DevicePoolBook,
    DevicePoolFull,
    DeviceRef,
    DeviceSlot,
    HostStateTable,
    PoolMeta,
    check_ref,
    cuda_status,
    host_ref,
    read_pool_meta,
    release_word,
    require_cuda,
)
from .ipc import _tensor_at as tensor_at  # noqa: F401  (made public by the split)

__all__ = [
    "ALIGN", "ALIGN_LARGE", "HANDLE_SIZE", "CudaPool", "CudaPoolCache", "CudaUnavailable",
    "DevicePoolBook", "DevicePoolFull", "DeviceRef", "DeviceSlot", "HostStateTable", "PoolMeta",
    "check_ref", "cuda_status", "host_ref", "read_pool_meta", "release_word", "require_cuda",
    "tensor_at",
]
