"""The client's CUDA side: a device pool for inputs, a cache of workers' pools for outputs.

Created on first use (`Client.alloc_cuda`, or the first torch CUDA tensor passed to `infer`),
so a client that never touches the GPU never initialises CUDA.  Lifetimes follow the host
plane (docs/gpu.md, sections 3 and 4):

- an `alloc_cuda` tensor is the caller's: sent by reference (the pool's IPC event is recorded
  on the current stream, so the worker reads after the caller's writes), freed when the
  tensor and every view of it are gone;
- any other CUDA tensor is copied once into a temporary slot, freed at the request's FINAL
  with the current stream waiting on the reply's output events (the worker recorded them
  after its last read of the inputs);
- outputs are leases of the worker's pool, released (after the reads queued on the current
  stream complete) with the `Result`.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

import numpy as np

from broker import protocol as P

from .errors import InvalidInput, NotSupported, PoolFull


def unavailable_message(why: str) -> str:
    return (f"CUDA tensors cannot be used by this client: {why}. Pass numpy arrays or CPU "
            "tensors instead (they go through shared memory)")


def is_cuda_tensor(x: Any) -> bool:
    """A torch tensor on a CUDA device (without importing torch)."""
    d = getattr(x, "device", None)
    return getattr(d, "type", None) == "cuda" and type(x).__module__.startswith("torch")


class CudaSide:
    """One device pool (inputs) and one `CudaPoolCache` (outputs) per client.  Used from the
    client's own thread; tensors dropped elsewhere are freed at its next call.

    `runtime`: the `shm.cuda.CudaRuntime` both use (default: the real one); tests pass a
    simulated device."""

    def __init__(self, capacity: int, device: Any = "cuda:0", *, runtime: Any = None):
        from shm.cuda import CudaPool, CudaPoolCache, CudaUnavailable, default_runtime

        self.runtime = runtime if runtime is not None else default_runtime()
        try:
            self.torch = self.runtime.torch()
            self.pool = CudaPool(capacity, device=device, runtime=self.runtime)
        except CudaUnavailable as e:
            raise NotSupported(unavailable_message(str(e))) from None
        self.device = self.pool.device
        # Outputs are leased only where lent to this process (a worker's reply naming another
        # process's slot is refused, and never released).
        self.cache = CudaPoolCache(local={self.pool.name: self.pool}, runtime=self.runtime, holder=os.getpid())
        self._np_dtypes: dict[Any, np.dtype] = {}
        self._user: dict[tuple[int, int], Any] = {}  # (slot, generation) -> finalizer
        self._owner_thread = threading.get_ident()
        self._deferred: deque = deque()
        self.closed = False

    # ------------------------------------------------------------------ dtypes
    def np_dtype(self, tdtype: Any) -> np.dtype:
        dt = self._np_dtypes.get(tdtype)
        if dt is None:
            import torch

            try:
                dt = np.dtype(torch.empty(0, dtype=tdtype).numpy().dtype)
            except TypeError as e:

                raise InvalidInput(f"torch dtype {tdtype} has no numpy equivalent ({e}); convert it first") from None
            self._np_dtypes[tdtype] = dt
        return dt

    def _dtype_of(self, dtype: Any) -> np.dtype:
        import torch

        if isinstance(dtype, torch.dtype):
            return self.np_dtype(dtype)
        return np.dtype(dtype)

    # ------------------------------------------------------------------ user buffers
    def check_device(self, device: Any) -> None:
        d = self.torch.device(device)
        index = d.index if d.index is not None else self.torch.cuda.current_device()
        if d.type != "cuda" or index != self.device:

            raise InvalidInput(f"this client's device pool is on cuda:{self.device}; alloc_cuda cannot "
                               f"allocate on {device!r} (one device per client)")

    def alloc(self, shape: Any, dtype: Any) -> Any:
        """`alloc_cuda`: a tensor in the device pool; PoolFull (an InferenceError and a
        `shm.ShmFull`, as for `alloc`) when the pool has no room."""
        from shm.errors import ShmFull

        self.run_deferred()
        dt = self._dtype_of(dtype)
        try:
            src = self.pool.alloc(shape, dt)
        except ShmFull as e:  # shm.cuda.DevicePoolFull: its message says which limit
            raise PoolFull(f"alloc_cuda: {e} (the client's device pool holds pool_capacity bytes: pass a larger "
                           "pool_capacity, or drop alloc_cuda tensors and release results sooner)") from None
        ref = self.pool.ref_of(src)
        if ref is None or src.numel() == 0:
            return src  # an empty tensor owns no bytes: nothing to free later
        # A second tensor over the slot whose finalizer runs once the caller's tensor and
        # all its views are gone (the pool keeps `src` itself alive).
        t, fin = self.pool.watched_view(ref, dt, tuple(src.shape), self._dropped, (ref,))
        self._user[(ref.slot, ref.generation)] = fin
        return t

    def _dropped(self, ref: Any) -> None:
        self._user.pop((ref.slot, ref.generation), None)
        if threading.get_ident() == self._owner_thread:
            self._free(ref)
        else:
            self._deferred.append(ref)

    def _free(self, ref: Any) -> None:
        if not self.closed:
            try:
                self.pool.free(ref)
            except Exception:  # already freed
                pass

    def run_deferred(self) -> None:
        while self._deferred:
            self._free(self._deferred.popleft())

    # ------------------------------------------------------------------ inputs
    def pack(self, x: Any, temps: list) -> tuple[str, list[int], Any, Any] | None:
        """(dtype str, shape, CudaLoc, what was sent) for CUDA tensor `x`, or None when the
        pool has no room (the caller then copies it to the host)."""
        pool = self.pool
        x = x.detach()
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        dt = self.np_dtype(x.dtype)
        shape = list(x.shape)
        ref = pool.ref_of(x)  # None unless x lies in a live slot (checks the device too)
        if ref is not None:
            return dt.str, shape, P.cuda_loc(pool.hand_off(ref)), x        # by reference, no copy
        dst = pool.try_alloc(tuple(x.shape), dt)
        if dst is None:
            pool.reclaim()
            dst = pool.try_alloc(tuple(x.shape), dt)
            if dst is None:
                return None
        temps.append(dst)
        dst.copy_(x, non_blocking=True)                        # one device copy, on this stream
        return dt.str, shape, P.cuda_loc(pool.hand_off(dst)), dst

    def free_temp(self, temps: list, after: list | tuple = ()) -> None:
        for t in temps:
            try:
                self.pool.free(t, after=after)
            except Exception:  # pool closed
                pass
        temps.clear()

    def events_of(self, tensors: list) -> list:
        """The output events of a reply: later writes into our input slots must follow them."""
        out = []
        for t in tensors:
            loc = t.loc
            if type(loc) is P.CudaLoc and loc.event:
                try:
                    ev = self.cache.event_of(loc)
                except Exception:
                    continue
                if ev is not None:
                    out.append(ev)
        return out

    # ------------------------------------------------------------------ lifecycle
    def poll(self) -> None:
        self.run_deferred()
        try:
            self.cache.poll()
        except Exception:
            pass

    def close(self) -> None:
        if self.closed:
            return
        for fin in list(self._user.values()):
            fin.detach()
        self._user.clear()
        self._deferred.clear()
        self.closed = True
        try:
            self.cache.close()
        finally:
            self.pool.close()
