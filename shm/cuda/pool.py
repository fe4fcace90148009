"""The owner side: `CudaPool`, one device block of this process, exported once, whose slots
are handed to other processes as `DeviceRef`s.

Invariants a maintainer must keep:

- One raw ``cudaMalloc`` block per pool, outside torch's caching allocator, exported once
  (``cudaIpcGetMemHandle``): the handle names the block's base for the pool's whole life.
- Hand-off order: the slot's interprocess event is recorded on the writer's stream *after*
  the writes, then the slot goes IN_FLIGHT, then the descriptor (handle, event) is
  returned to be sent.  No host wait.
- One IPC event per slot, re-recorded only when the slot is handed off again, which can
  only happen after its reader released it: a reader always waits on the record made for
  the descriptor it holds.
- Bytes a reader may still read are never reused or freed: slots return to FREE only on a
  RELEASED word (stored by the reader after its reads completed), a dead holder, or the
  owner's `free` (inputs, ordered after the reader's events with ``after=``); `close()`
  keeps the block allocated to process exit while any slot is IN_FLIGHT.
- Every CUDA call goes through the pool's `CudaRuntime` (``runtime=``).
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

import numpy as np

from ..errors import BadDescriptor, ShmError
from ..segment import FREE
from .book import ALIGN, DevicePoolBook
from .refs import DeviceRef, DeviceSlot
from .runtime import CudaRuntime, default_runtime
from .table import HostStateTable, PoolMeta
from .views import device_uuid, torch_dtype

__all__ = ["CudaPool"]


class _DeviceBlock:
    """A raw device allocation; freed when the last tensor over it and its pool are gone."""

    def __init__(self, api, nbytes: int, device: int):
        self.api, self.nbytes, self.device = api, nbytes, device
        self.ptr = api.malloc(nbytes, device)
        self.pinned = False  # set by the pool while slots are lent: never freed then

    def __del__(self):
        if self.ptr and not self.pinned:
            try:
                self.api.free(self.ptr, self.device)
            except Exception:
                pass
            self.ptr = 0


class CudaPool:
    """A device pool owned by this process: one block, exported once, slots handed out as
    torch tensors (views of the block).  Not thread-safe.

        pool = CudaPool(256 << 20, device=0)
        t = pool.alloc((1080, 1920, 3), np.uint8)      # a torch.cuda tensor, slot WRITING
        t.copy_(frame, non_blocking=True)              # write on this stream
        ref = pool.hand_off(t, holder_pid=client_pid)  # event recorded, slot IN_FLIGHT
        ...send broker.protocol.cuda_loc(ref); later pool.free(t), or the reader releases
        and reclaim() frees it
    """

    def __init__(self, capacity: int, *, device: int | str | None = None, slots: int = 1024,
                 align: int = ALIGN, holders: Any = None, runtime: CudaRuntime | None = None):
        self._rt = rt = runtime if runtime is not None else default_runtime()
        torch = rt.torch()
        self._torch = torch
        if device is None:
            self.device = torch.cuda.current_device()
        elif isinstance(device, int):
            self.device = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"a device pool lives on a CUDA device, not {device!r}")
            self.device = dev.index if dev.index is not None else torch.cuda.current_device()
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 byte, got {capacity}")
        api = rt.api()
        self._block = _DeviceBlock(api, (capacity + ALIGN - 1) // ALIGN * ALIGN, self.device)
        self._table = None
        try:
            self.handle = api.ipc_get_mem_handle(self._block.ptr, self.device)
            self._table = HostStateTable(slots)
            self._table.write_meta(PoolMeta(capacity, self.device, align, self.handle,
                                            device_uuid(torch, self.device)))
            self.book = DevicePoolBook(capacity, slots=slots, align=align, words=self._table.words,
                                       record_offset=self._table.data_offset, holders=holders,
                                       on_free=self._slot_freed)
        except BaseException:
            if self._table is not None:
                self._table.close()
            raise
        self.name = self._table.name
        self.capacity = capacity
        self.base_ptr = self._block.ptr
        self._events: list[Any] = [None] * slots
        self._event_handles: list[bytes] = [b""] * slots
        self._tensors: dict[int, Any] = {}  # slot -> the tensor alloc() returned
        self._by_start: dict[int, int] = {}  # offset -> slot of a live allocation with bytes
        self._closed = False

    def __enter__(self) -> "CudaPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<CudaPool {self.name} cuda:{self.device} {self.capacity} bytes>"

    # ------------------------------------------------------------------ allocation
    def _ref(self, s: DeviceSlot) -> DeviceRef:
        return DeviceRef(self.name, s.offset, s.nbytes, s.slot, s.generation, self.device)

    def try_alloc(self, shape, dtype):
        """A torch CUDA tensor in a WRITING slot, or None when the pool is full."""
        self._check_open()
        dt = np.dtype(dtype)
        shape = tuple(operator.index(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        n = dt.itemsize
        for d in shape:
            if d < 0:
                raise ValueError(f"negative dimension in shape {shape}")
            n *= d
        torch_dtype(dt)
        s = self.book.try_alloc(n)
        if s is None:
            return None
        try:
            t, _ = self._rt.tensor_at(self.base_ptr + s.offset, shape, dt, self.device, self._block)
        except BaseException:
            self.book.free(s.slot, s.generation)
            raise
        self._tensors[s.slot] = t
        if n:
            self._by_start[s.offset] = s.slot
        return t

    def alloc(self, shape, dtype):
        t = self.try_alloc(shape, dtype)
        if t is None:
            n = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
            raise self.book.full_error(n)
        return t

    def _slot_freed(self, slot: int) -> None:
        # Every return to FREE (free(), a reader's release, a dead holder) passes here.
        self._tensors.pop(slot, None)
        off = self.book.get(slot).offset
        if self._by_start.get(off) == slot:
            del self._by_start[off]

    def ref_of(self, t) -> DeviceRef | None:
        """The descriptor of `t` if it is a contiguous view inside one live slot."""
        if self._closed or not self._rt.on_device(t, self.device) or not t.is_contiguous():
            return None
        nbytes = t.numel() * t.element_size()
        rel = t.data_ptr() - self.base_ptr
        slot = self._by_start.get(rel)
        if slot is None:
            for s in self.book.live():
                if s.offset <= rel and rel + nbytes <= s.offset + s.nbytes and s.nbytes:
                    slot = s.slot
                    break
            else:
                for slot_, ten in self._tensors.items():  # empty tensors: by identity
                    if ten is t:
                        return self._ref(self.book.get(slot_))
                return None
        s = self.book.get(slot)
        if self.book.state(slot) == FREE or not (s.offset <= rel and rel + nbytes <= s.offset + s.nbytes):
            return None
        return DeviceRef(self.name, rel, nbytes, slot, s.generation, self.device)

    def _resolve(self, x) -> DeviceRef:
        if isinstance(x, DeviceRef):
            return x
        ref = self.ref_of(x)
        if ref is None:
            raise BadDescriptor("tensor does not lie in a live slot of this pool (allocate it with pool.alloc)")
        return ref

    def _check_open(self) -> None:
        if self._closed:
            raise ShmError(f"CudaPool {self.name} is closed")

    def _own_view(self, ref: DeviceRef, dtype, shape, on_drop=None, args=()):
        self._check_open()
        s = self.book.live_slot(ref.slot, ref.generation)
        rec = self.book.get(s)
        if ref.pool != self.name or not (rec.offset <= ref.offset and ref.offset + ref.nbytes <= rec.offset + rec.nbytes):
            raise BadDescriptor(f"{ref} is not inside slot {s} of {self.name}")
        dt = np.dtype(dtype)
        return self._rt.tensor_at(self.base_ptr + ref.offset, tuple(shape), dt, self.device, self._block,
                                  on_drop, args)

    def view(self, ref: DeviceRef, dtype, shape):
        """A tensor over one of our own slots (a reply that hands an input back)."""
        return self._own_view(ref, dtype, shape)[0]

    def watched_view(self, ref: DeviceRef, dtype, shape, on_drop, args=()):
        """(tensor, finalizer or None): a tensor over one of our own slots, and
        ``on_drop(*args)`` run once it and every view of it are gone (from any thread; it
        must make no CUDA call).  None for an empty tensor, which views nothing."""
        return self._own_view(ref, dtype, shape, on_drop, args)

    # ------------------------------------------------------------------ hand-off
    def _event(self, slot: int):
        ev = self._events[slot]
        if ev is None:
            # Interprocess events cannot time; blocking=False keeps a host wait (never on the
            # hot path) from sleeping in the driver.
            ev = self._events[slot] = self._torch.cuda.Event(interprocess=True)
        return ev

    def hand_off(self, x, *, stream=None, holder_pid: int | None = None, holder_start: int | None = None,
                 include_handle: bool = True):
        """Record the slot's IPC event after the writes queued so far on `stream` (default:
        the current stream), mark it IN_FLIGHT and return its `DeviceRef`, handle and event
        included.  No host wait."""
        self._check_open()
        ref = self._resolve(x)
        torch = self._torch
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        ev = self._event(ref.slot)
        ev.record(stream)
        h = self._event_handles[ref.slot]
        if not h:
            h = self._event_handles[ref.slot] = bytes(ev.ipc_handle())
        self.book.mark_in_flight(ref.slot, ref.generation, holder_pid, holder_start)
        return ref._replace(handle=self.handle if include_handle else b"", event=h)

    def free(self, x, *, after: Iterable[Any] = (), stream=None) -> None:
        """Return a slot now.  `after`: events (e.g. a reply's opened IPC events) that later
        writes into these bytes must follow; `stream` (default current) waits on them, so
        reuse on that stream is ordered after a reader's last access without a host wait."""
        ref = self._resolve(x)
        events = list(after)
        if events:
            st = stream if stream is not None else self._torch.cuda.current_stream(self.device)
            for ev in events:
                st.wait_event(ev)
        self.book.free(ref.slot, ref.generation)

    def reclaim(self) -> int:
        return self.book.reclaim()

    def in_use(self) -> int:
        return self.book.in_use()

    def close(self) -> None:
        """Close the state table (importers let go) and drop our block reference.  The device
        memory itself is freed once no tensor views it - unless a slot is still IN_FLIGHT,
        when it is kept to process exit: a reader may still be reading it."""
        if self._closed:
            return
        self._closed = True
        self.book.reclaim()
        if self.book.in_flight():
            self._block.pinned = True  # an importer may read it still: never cudaFree it
        self._tensors.clear()
        self._by_start.clear()
        self._table.close()
        self._block = None
        self._events = []
