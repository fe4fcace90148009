"""Torch tensors over raw device memory, and the device facts the pools need from torch.

Contract of `tensor_at` (the owner's slots and the importer's mappings both go through it):

- the tensor *views* the bytes at ``ptr``: never a copy (it raises if torch copied), so a
  write through it is a write into the slot;
- ``keep`` (the owner's block, an importer's mapping record) stays referenced as long as
  any tensor shares the storage, so the memory outlives every view of it;
- ``on_drop(*args)``, when given, runs once the tensor and every view of it are gone (a
  `weakref.finalize`, not run at interpreter exit), from whatever thread dropped the last
  one: it must make no CUDA call;
- a tensor with no elements views nothing: it is a plain empty tensor and no finalizer is
  made (the caller accounts for it at once).

Torch is imported only inside the functions, so this module imports without it.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..errors import BadDescriptor

__all__ = ["torch_dtype", "tensor_at", "on_device", "on_stream", "device_uuid", "local_ordinal"]

_TORCH_DTYPES: dict[str, Any] = {}


def torch_dtype(dt: np.dtype):
    """The torch dtype of numpy dtype `dt`; BadDescriptor when torch has none."""
    got = _TORCH_DTYPES.get(dt.str)
    if got is None:
        import torch

        try:
            got = torch.from_numpy(np.empty(0, dt)).dtype
        except TypeError:
            raise BadDescriptor(f"dtype {dt} has no torch equivalent; the CUDA path carries torch dtypes") from None
        _TORCH_DTYPES[dt.str] = got
    return got


class on_stream:
    """``with on_stream(torch, s):`` does what ``with torch.cuda.stream(s):`` does, without
    its device lookups.

    torch's context asks for the current device by way of ``torch.cuda.is_available()``
    (one cudaGetDeviceCount each) several times a use; on the GPU machine each took about
    15 us, and a request on the worker's CUDA path paid for five.  Here the current device
    is read once; when the stream is on it (a worker's one device) the current stream is
    swapped directly and put back on exit, otherwise torch's context does it (it also
    switches the device).  ``None`` is a no-op, as in torch."""

    __slots__ = ("_torch", "_stream", "_prev", "_ctx")

    def __init__(self, torch: Any, stream: Any):
        self._torch = torch
        self._stream = stream
        self._prev: Any = None
        self._ctx: Any = None

    def __enter__(self) -> Any:
        s = self._stream
        if s is None:
            return None
        torch = self._torch
        if torch.cuda.current_device() != s.device_index:
            self._ctx = torch.cuda.stream(s)
            return self._ctx.__enter__()
        self._prev = torch.cuda.current_stream(s.device_index)
        torch.cuda.set_stream(s)
        return None  # as torch's context

    def __exit__(self, *exc: Any) -> bool:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            return bool(ctx.__exit__(*exc))
        prev, self._prev = self._prev, None
        if prev is not None:
            self._torch.cuda.set_stream(prev)
        return False


class _DeviceView:
    """`__cuda_array_interface__` over `ptr`; torch keeps it (and `keep`) alive as long as
    any tensor shares the storage, so a finalizer on it runs after the last view is gone."""

    __slots__ = ("__cuda_array_interface__", "keep", "__weakref__")

    def __init__(self, ptr: int, shape: tuple, dt: np.dtype, keep: Any):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": dt.str, "data": (ptr, False),
                                         "strides": None, "version": 2}
        self.keep = keep


def tensor_at(ptr: int, shape: tuple, dt: np.dtype, device: int, keep: Any, on_drop=None, args=()):
    """(tensor, finalizer or None): a torch CUDA tensor of `shape` and `dt` over the bytes
    at `ptr` on `device`, by the rules in the module docstring."""
    import torch

    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=torch_dtype(dt), device=f"cuda:{device}"), None
    torch_dtype(dt)  # refuse dtypes torch lacks before building anything
    holder = _DeviceView(ptr, tuple(shape), dt, keep)
    fin = weakref.finalize(holder, on_drop, *args) if on_drop is not None else None
    if fin is not None:
        fin.atexit = False
    t = torch.as_tensor(holder)
    alive = weakref.ref(holder)
    del holder
    # Both would silently break the lifetime rules: a copy is not shared memory, and a
    # holder torch does not keep would release the slot while the tensor is still in use.
    if t.device.index != device or t.data_ptr() != ptr:  # pragma: no cover
        raise RuntimeError(f"torch copied the device buffer instead of viewing it ({t.device}, {t.data_ptr():#x})")
    if alive() is None:  # pragma: no cover
        raise RuntimeError("torch.as_tensor did not keep the __cuda_array_interface__ owner alive")
    return t, fin


def on_device(t: Any, device: int) -> bool:
    """Is `t` a tensor on CUDA device `device`?"""
    d = getattr(t, "device", None)
    return d is not None and d.type == "cuda" and d.index == device


def device_uuid(torch, device: int) -> bytes:
    """The 16-byte UUID of CUDA device `device` (as `torch` numbers it); empty if unknown."""
    try:
        u = torch.cuda.get_device_properties(device).uuid
        return bytes(u.bytes) if hasattr(u, "bytes") else bytes.fromhex(str(u).replace("-", "")[-32:])
    except Exception:
        return b""


def local_ordinal(torch, uuid: bytes, fallback: int) -> int:
    """The ordinal this process uses for the device the owner called `fallback`: the same
    GPU may have another number under a different CUDA_VISIBLE_DEVICES."""
    if uuid:
        for i in range(torch.cuda.device_count()):
            if device_uuid(torch, i) == uuid:
                return i
    return fallback
