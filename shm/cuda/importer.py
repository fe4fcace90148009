"""The importer side: `CudaPoolCache`, other processes' device pools opened once each, and
the release path of the slots it was handed.

Invariants a maintainer must keep:

- Each pool is opened once per process (``cudaIpcOpenMemHandle``; opening a legacy handle
  twice in one context fails on most drivers) and cached; a process's own pools are
  viewed directly (``local=``), since it cannot open its own handle.
- Nothing is viewed before the descriptor is checked: its fields (`refs.check_ref`), its
  bytes against the pool's capacity, and its slot against the state table (IN_FLIGHT at
  that generation, through `shm.SegmentCache`).
- Reads are ordered after the producer's writes on the GPU: the consumer stream waits on
  the descriptor's IPC event before the tensor is returned.  The host never waits.
- A slot is released only after the reads queued on the consumer stream have completed:
  a dropped lease is queued by its finalizer (which makes no CUDA call: it may run in any
  thread, even during a graph capture), `poll()` records an event on that stream, and
  stores RELEASED once ``cudaEventQuery`` says it completed.  Borrowed views (`view`) are
  never released: the owner frees inputs.
- A pool whose owner closed it or died is closed here (``cudaIpcCloseMemHandle``) only
  once no tensor views it.
- Every CUDA call goes through the cache's `CudaRuntime` (``runtime=``).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ..errors import BadDescriptor, ShmError
from ..segment import parse_name, process_alive
from .pool import CudaPool
from .refs import DeviceRef, check_ref, host_ref
from .runtime import CudaRuntime, CudaUnavailable, default_runtime
from .table import read_pool_meta
from .views import local_ordinal

__all__ = ["CudaPoolCache"]


class _Imported:
    __slots__ = ("name", "ptr", "capacity", "device", "data_offset", "live", "doomed", "owner", "handle")

    def __init__(self, name, ptr, capacity, device, data_offset, owner, handle):
        self.name, self.ptr, self.capacity, self.device = name, ptr, capacity, device
        self.handle = handle
        self.data_offset = data_offset
        self.live = 0
        self.doomed = False
        self.owner = owner


class CudaPoolCache:
    """Other processes' device pools, each opened once and cached, and the release path.

    `view()` borrows (inputs: the owner frees them); `lease()` also returns a finalizer that
    releases the slot once the tensor and every view of it are gone.  Releases are stored in
    `poll()`, after the reads queued on the consumer stream have completed; `view` and
    `lease` poll too.  Own pools (`local`) are viewed directly: a process cannot open its own
    IPC handle.  Descriptors are anything `check_ref` accepts (a protocol `CudaLoc` or a
    `DeviceRef`).  Not thread-safe, except that finalizers may run in any thread.
    """

    def __init__(self, *, local: dict[str, CudaPool] | None = None, max_events: int = 4096,
                 runtime: CudaRuntime | None = None, holder: int | None = None):
        # ``holder``: a reader of outputs (a client) passes its pid, and `lease` and
        # `release` then take only slots lent to it (`SegmentCache.view`'s ``holder``): a
        # worker's reply naming another process's input, or an output lent to another
        # process, is refused before anything is read or RELEASED stored there.
        self._holder = holder
        self._rt = runtime if runtime is not None else default_runtime()
        self._local = local if local is not None else {}
        self._pools: dict[str, _Imported] = {}
        self._events: OrderedDict[bytes, Any] = OrderedDict()
        self._max_events = max_events
        self._dropped: deque = deque()  # (pool name, ref, stream) from finalizers
        self._pending: list[tuple[Any, DeviceRef]] = []
        # (pool, slot, generation) -> its leases and releases not yet given back: a slot a
        # worker named twice (two outputs, two replies, a duplicate FINAL) goes back at the
        # last of them, not at the first while a result still leases it.
        self._held: dict[tuple[str, int, int], int] = {}
        self._states = None
        self._closed = False

    @property
    def states(self):
        if self._states is None:
            from ..reader import SegmentCache

            self._states = SegmentCache(max_segments=256)
        return self._states

    def __contains__(self, pool: str) -> bool:
        return pool in self._pools

    def __len__(self) -> int:
        return len(self._pools)

    def add_local(self, pool: CudaPool) -> None:
        self._local[pool.name] = pool

    # ------------------------------------------------------------------ opening
    def _open(self, ref: DeviceRef, handle: bytes) -> _Imported:
        p = self._pools.get(ref.pool)
        if p is not None:
            if handle and handle != p.handle:
                raise BadDescriptor(f"the memory handle in the descriptor does not match pool {ref.pool}'s")
            return p
        if self._closed:
            raise ShmError("CudaPoolCache is closed")
        torch = self._rt.torch()
        meta, data_offset = read_pool_meta(ref.pool)
        if handle and bytes(handle) != meta.handle:
            raise BadDescriptor(f"the memory handle in the descriptor does not match pool {ref.pool}'s")
        device = local_ordinal(torch, meta.uuid, meta.device)
        ptr = self._rt.api().ipc_open_mem_handle(meta.handle, device)
        owner = parse_name(ref.pool)
        p = self._pools[ref.pool] = _Imported(ref.pool, ptr, meta.capacity, device, data_offset, owner, meta.handle)
        return p

    def _event(self, handle: bytes, device: int):
        ev = self._events.get(handle)
        if ev is None:
            torch = self._rt.torch()
            ev = self._events[handle] = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), handle)
            while len(self._events) > self._max_events:
                self._events.popitem(last=False)
        else:
            self._events.move_to_end(handle)
        return ev

    def event_of(self, loc) -> Any:
        """The opened IPC event of a received location (for `CudaPool.free(after=...)`)."""
        ref = check_ref(loc)
        p = self._open(ref, loc.handle)
        return self._event(bytes(loc.event), p.device) if loc.event else None

    # ------------------------------------------------------------------ viewing
    def _view(self, loc, dtype, shape, stream, release: bool):
        ref = check_ref(loc)
        dt = np.dtype(dtype)
        shape = tuple(shape)
        n = dt.itemsize
        for d in shape:
            n *= d
        if n != ref.nbytes:
            raise BadDescriptor(f"shape {shape} of {dt} is {n} bytes but the descriptor has {ref.nbytes}")
        self.poll()
        local = self._local.get(ref.pool)
        if local is not None:
            return local.view(ref, dt, shape), None
        torch = self._rt.torch()
        p = self._open(ref, loc.handle)
        if ref.offset + ref.nbytes > p.capacity:
            raise BadDescriptor(f"bytes [{ref.offset}, +{ref.nbytes}) lie outside pool {ref.pool} ({p.capacity} bytes)")
        # Validation on the host: the slot is IN_FLIGHT at this generation (else stale),
        # and, leased by a reader that names its pid, lent to it.
        self.states.view(host_ref(ref, p.data_offset), np.uint8, (0,), self._holder if release else None)
        if stream is None:
            stream = torch.cuda.current_stream(p.device)
        if loc.event:
            stream.wait_event(self._event(bytes(loc.event), p.device))
        p.live += 1
        if release:
            self._hold(ref)
        try:
            t, fin = self._rt.tensor_at(p.ptr + ref.offset, shape, dt, p.device, p, self._on_drop,
                                        (ref, stream if release else None))
        except BaseException:
            p.live -= 1
            if release:
                self._unhold(ref)
            raise
        if fin is None:  # an empty tensor views nothing: account for it now
            self._on_drop(ref, stream if release else None)
        return t, fin

    def view(self, loc, dtype, shape, *, stream=None):
        """Borrow a tensor over a descriptor's bytes (no copy, no host wait): `stream`
        (default current) waits on the producer's event first.  Never releases the slot."""
        return self._view(loc, dtype, shape, stream, release=False)[0]

    def lease(self, loc, dtype, shape, *, stream=None):
        """(tensor, finalizer): the slot is released once the tensor and its views are gone,
        or when the finalizer is called - after the reads queued on `stream` finish."""
        t, fin = self._view(loc, dtype, shape, stream, release=True)
        if fin is None:
            return t, weakref.finalize(t, lambda: None)
        return t, fin

    def _on_drop(self, ref: DeviceRef, stream) -> None:
        # Runs from a finalizer: any thread, maybe inside another CUDA call or a graph
        # capture, so no CUDA here - poll() does the work at a safe point.
        self._dropped.append((ref, stream))

    # ------------------------------------------------------------------ releasing
    def poll(self) -> int:
        """Store RELEASED for dropped leases whose reads have completed; close mappings of
        gone pools nobody views any more.  Non-blocking.  Returns slots released."""
        done = 0
        torch = None
        while self._dropped:
            ref, stream = self._dropped.popleft()
            p = self._pools.get(ref.pool)
            if p is None:  # already closed
                if stream is not None:
                    self._unhold(ref)
                continue
            if stream is None:  # a borrow: the owner frees it, we only stop counting it
                p.live -= 1
                continue
            if torch is None:
                torch = self._rt.torch()
            ev = torch.cuda.Event()
            ev.record(stream)
            self._pending.append((ev, ref))
        still = []
        for ev, ref in self._pending:
            if ev.query():
                done += self._release_now(ref)
            else:
                still.append((ev, ref))
        self._pending = still
        self._close_doomed()
        return done

    def _hold(self, ref: DeviceRef) -> None:
        k = (ref.pool, ref.slot, ref.generation)
        self._held[k] = self._held.get(k, 0) + 1

    def _unhold(self, ref: DeviceRef) -> bool:
        """One lease or release of the slot done: True when it was the last."""
        k = (ref.pool, ref.slot, ref.generation)
        n = self._held.pop(k, 1) - 1
        if n > 0:
            self._held[k] = n
        return n <= 0

    def _release_now(self, ref: DeviceRef) -> int:
        last = self._unhold(ref)
        p = self._pools.get(ref.pool)
        if p is None:
            return 0
        p.live -= 1
        if not last:  # leased or named again meanwhile: the last one gives it back
            return 0
        try:
            self.states.release(host_ref(ref, p.data_offset), self._holder)
            return 1
        except ShmError:  # the owner closed or died: nothing to give back
            return 0

    def release(self, loc, *, stream=None) -> None:
        """Give back a slot that was never viewed (a discarded late reply)."""
        ref = check_ref(loc)
        torch = self._rt.torch()
        p = self._pools.get(ref.pool)
        if p is None:
            try:
                p = self._open(ref, loc.handle)
            except ShmError:
                return
        p.live += 1
        self._hold(ref)
        self._dropped.append((ref, stream if stream is not None else torch.cuda.current_stream(p.device)))
        self.poll()

    def sync(self) -> None:
        """Wait (host) for every pending release; for shutdown and tests, not the hot path."""
        self.poll()
        for ev, _ in self._pending:
            ev.synchronize()
        self.poll()

    # ------------------------------------------------------------------ closing
    def sweep(self) -> list[str]:
        """Mark pools whose owner closed them or died; their mappings are closed as soon as
        no tensor views them (now, or in a later poll)."""
        gone = []
        for name, p in self._pools.items():
            if p.doomed:
                continue
            dead = p.owner is not None and not process_alive(*p.owner)
            if not dead:
                try:
                    read_pool_meta(name)
                except ShmError:
                    dead = True
            if dead:
                p.doomed = True
                gone.append(name)
        self._close_doomed()
        return gone

    def _close_doomed(self) -> None:
        for name in [n for n, p in self._pools.items() if p.doomed and p.live <= 0]:
            p = self._pools.pop(name)
            try:
                self._rt.api().ipc_close_mem_handle(p.ptr, p.device)
            except Exception:
                pass
            if self._states is not None:
                self._states.forget(name)

    def close(self) -> None:
        """Stop opening pools; close every mapping nothing views (the rest on their last drop
        through poll()).  Pending releases are flushed first."""
        self._closed = True
        if self._pending or self._dropped:
            try:
                self.sync()
            except CudaUnavailable:
                pass
        for p in self._pools.values():
            p.doomed = True
        if self._pools:
            self._close_doomed()
        self._events.clear()
        if self._states is not None and not self._pools:
            self._states.close()
