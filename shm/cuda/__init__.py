"""CUDA IPC data plane: device tensors handed between processes by reference.

The host plane's design (`shm`) carried over to device memory.  Each process that sends
device tensors owns *device pools*: one raw ``cudaMalloc`` block each, exported once with a
legacy ``cudaIpcGetMemHandle`` (64 plain bytes that ride in the msgpack header; why not
memory-pool or VMM exports: docs/gpu.md section 1), carved into slots by the host ring
allocator.  Only a descriptor crosses ZeroMQ: pool id, offset, size, slot, generation,
device, the pool's memory handle and the slot's IPC event handle.

Modules, one job each (import from this package, not from them):

- `refs`: `DeviceRef` / `DeviceSlot` and `check_ref`, the reader's check of a descriptor;
- `book`: `DevicePoolBook`, the pure allocator and slot state machine;
- `table`: `HostStateTable`, the slots' state words in a host segment, and the pool metadata;
- `runtime`: `cuda_status` / `require_cuda`, the one loader of the CUDA runtime
  (`runtime_api`), and `CudaRuntime`, the seam every device call goes through;
- `views`: torch tensors over raw device memory (`tensor_at`), dtypes, device UUIDs;
- `pool`: `CudaPool`, the owner side;
- `importer`: `CudaPoolCache`, the importer side and the release path.

Contract across them:

- Importing any of it needs no CUDA, torch or cuda-python; only what touches a device
  raises `CudaUnavailable`, saying what is missing.  Like the rest of `shm` it knows
  nothing of ZeroMQ or msgpack: `broker.protocol.refs` turns a `DeviceRef` into the wire's
  `CudaLoc` and back.
- The slot rules are the host ones (shm/__init__.py): the owner alone allocates, frees and
  reclaims; the one store another process makes is RELEASED into a slot's state word, in
  the pool's state table, with `shm.SegmentCache.release`.  A descriptor names one lifetime
  of one slot (its generation); readers check it before viewing a byte.
- No host synchronisation on the hot path: the producer records the slot's IPC event after
  its writes (`CudaPool.hand_off`), the consumer's stream waits on it before its reads, and
  the consumer stores RELEASED only once the reads queued on its stream have completed.
- Inputs are never released by the reader (protocol section 7).  A worker sends FINAL
  only once its reads of CUDA inputs are finished or ordered before the reply's output
  events; the client frees its input slots with `CudaPool.free(..., after=those events)`.
- A consumer that dies holding IN_FLIGHT outputs: the owner recorded it as holder
  (``hand_off(holder_pid=)``) and `reclaim()` frees its slots once /proc shows it gone (its
  CUDA context died with it, so no read is pending).  An owner that dies: its allocation
  is torn down by the driver; importers see the table closed or the owner gone (`sweep()`)
  and close their mapping once no tensor views it.  What such a tensor reads after its
  owner died is undefined, which is why the client reports WORKER_FAILED for such replies.
"""
from __future__ import annotations

import importlib
from typing import Any

# Names are loaded from their module on first use (PEP 562): `broker.protocol` needs only
# `DeviceRef`, and a CPU process must not pay for importing the pools and the runtime loader.
_HOME = {
    "ALIGN": "book", "ALIGN_LARGE": "book", "DevicePoolBook": "book", "DevicePoolFull": "book",
    "CudaPoolCache": "importer", "CudaPool": "pool",
    "HANDLE_SIZE": "refs", "DeviceRef": "refs", "DeviceSlot": "refs", "check_ref": "refs", "host_ref": "refs",
    "CudaRuntime": "runtime", "CudaUnavailable": "runtime", "TorchCuda": "runtime", "cuda_status": "runtime",
    "default_runtime": "runtime", "require_cuda": "runtime", "runtime_api": "runtime",
    "HostStateTable": "table", "PoolMeta": "table", "read_pool_meta": "table", "release_word": "table",
    "tensor_at": "views", "on_stream": "views",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
