"""CUDA IPC data plane: device tensors handed between processes by reference.

The host design (shm/__init__.py) carried over to device memory.  Each process that sends
device tensors owns one *device pool*: a single large device allocation, exported once, carved
into slots by a ring allocator.  Only a `CudaLoc` (pool id, offset, size, device, the pool's
64-byte IPC memory handle and a 64-byte IPC event handle) crosses ZeroMQ.

Why legacy ``cudaIpcGetMemHandle`` on one ``cudaMalloc`` block
--------------------------------------------------------------
- The handle is 64 plain bytes, so it rides inside a msgpack header.  The alternatives,
  ``cudaMemPoolExportToShareableHandle`` and VMM ``cuMemExportToShareableHandle``, hand out
  POSIX file descriptors on Linux (the fabric handle type needs NVSwitch/IMEX), which must
  travel over a Unix socket with SCM_RIGHTS.  ZeroMQ carries bytes, not fds: the same reason
  the host plane uses named /dev/shm files instead of memfds (docs/shm.md).
- One handle per pool, opened once per importer and cached.  A memory-pool export also needs
  ``cudaMemPoolExportPointer`` / ``cudaMemPoolImportPointer`` for *every allocation*, which is
  a per-request driver call on both sides - the per-request handle opening that made Triton's
  Python backend slow is exactly what we are avoiding.  Opening the same legacy handle twice
  in one context is also an error on most drivers, so a cache is needed anyway.
- It works on every CUDA version and GPU that torch supports on Linux, and needs nothing but
  the CUDA runtime that torch already loaded (reached through ctypes; cuda-python is used
  when importable and the runtime library cannot be found).
- The block is raw ``cudaMalloc`` memory outside torch's caching allocator, so an
  ``expandable_segments`` setting or the allocator splitting blocks cannot change which base
  address the handle names.

What it costs: the pool has a fixed size chosen at start (no growth), legacy IPC does not
work between processes that see the device under different MIG instances, and the pool's
physical memory stays allocated for the process's life.

Slots, states and generations
-----------------------------
`DevicePoolBook` is the allocator: pure Python, no CUDA, tested on the CPU.  It is the host
pools' own allocator (`shm.book.SlotBook`), so it has the host ring's state machine
(FREE -> WRITING -> IN_FLIGHT -> RELEASED -> FREE), the same generation rule (up by one on
every return to FREE, so a descriptor names one lifetime of one slot) and the same
private-truth rule (the owner trusts only a RELEASED word carrying
the generation it handed out).  Offsets are aligned to 256 bytes by default (cudaMalloc's
own guarantee: every dtype and 128-bit vector loads are aligned) or to 2 MiB (a large page
per slot, for callers that register slots with other APIs).

Release without a round trip: the state words live in a small host segment made by the
existing shm machinery (`shm.segment.create_segment`, same layout), so a consumer stores
RELEASED with `shm.SegmentCache.release` exactly as for host slots, and crash GC
(`shm.gc.collect`, `python -m shm gc`) removes the tables of dead owners.  The pool id is
that segment's name.  Its header's unused bytes (offset 2048) carry the pool's metadata
(capacity, device, alignment, memory handle, device UUID) so an importer can check bounds
and open the pool even from a descriptor that omits the handle.

Ordering (no host synchronisation on the hot path)
--------------------------------------------------
- Producer: writes a slot on its stream, records the slot's interprocess event on that
  stream (`CudaPool.hand_off`), marks the slot IN_FLIGHT, sends the descriptor.
- Consumer: `CudaPoolCache.view/lease` makes its stream wait on that event
  (cudaStreamWaitEvent): the GPU orders the reads after the writes, the host never waits.
- One event per slot: an event is re-recorded only when its slot is reused, which happens
  only after the consumer released it, so a consumer always waits on the record that
  belongs to the descriptor it holds.
- Consumer release: when a leased tensor is dropped (or released early) the cache records
  an ordinary event on the consumer stream; `poll()` stores RELEASED once that event has
  completed (``cudaEventQuery``, non-blocking).  So the producer can only reuse bytes whose
  reads have finished on the GPU, not just been queued.
- Inputs are never released by the reader (protocol section 7).  A worker sends FINAL only
  after its reads of CUDA inputs are ordered before an event the client can wait on (the
  output events of the reply) or finished; the client makes its pool stream wait on those
  events before reusing the input slots (`CudaPool.free(..., after=events)`).

Lifetime and dead processes
---------------------------
- A consumer that dies holding IN_FLIGHT outputs: the owner recorded it as holder
  (``hand_off(..., holder_pid=)``); `reclaim()` frees those slots once /proc shows that
  pid/starttime gone.  Its CUDA context died with it, so no GPU read can still be pending.
- An owner that dies: the driver tears down its allocation; importers see the state table
  closed or its owner gone (`sweep()`), and close their mapping once no tensor views it.
  Tensors already handed to the user stay mapped until dropped; what they read after the
  owner died is undefined, which is why the client reports WORKER_FAILED for such replies.
- The owner never frees the block while a slot is IN_FLIGHT: `close()` defers the
  ``cudaFree`` until every slot is back or the process exits.

Everything here imports without CUDA, torch or cuda-python; only the functions that touch
a device raise `CudaUnavailable`, with a message that says what is missing.
"""
from __future__ import annotations

import array
import ctypes
import ctypes.util
import glob
import operator
import os
import struct
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from ..book import SlotBook, check_geometry
from ..errors import BadDescriptor, SegmentGone, ShmError, ShmFull, StaleDescriptor
from ..fence import fence
from ..segment import (
    FREE, HEADER_SIZE, IN_FLIGHT, Q_HOLDER_PID, Q_HOLDER_START, Q_NBYTES, Q_OFFSET, QS, RELEASED,
    SLOT_SIZE, STATE_NAMES, U32, ShmRef, create_segment, open_checked, parse_name, path_of,
    process_alive,
)

__all__ = [
    "ALIGN", "ALIGN_LARGE", "HANDLE_SIZE", "CudaUnavailable", "DevicePoolFull", "DeviceRef",
    "DeviceSlot", "DevicePoolBook", "HostStateTable", "PoolMeta", "read_pool_meta", "check_ref",
    "host_ref", "cuda_status", "require_cuda", "CudaPool", "CudaPoolCache",
    "release_word",
]

ALIGN = 256            # cudaMalloc's own alignment: every dtype and 16-byte vector loads
ALIGN_LARGE = 2 << 20  # one large page per slot
HANDLE_SIZE = 64       # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)


# --------------------------------------------------------------------------------------------
# Errors

class CudaUnavailable(RuntimeError):
    """This process cannot use CUDA (no torch, a CPU-only torch, no GPU, no CUDA runtime)."""


class DevicePoolFull(ShmFull):
    """A device pool cannot satisfy an allocation even after reclaiming released slots."""


# --------------------------------------------------------------------------------------------
# Descriptors

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


def release_word(words, slot: int, generation: int) -> bool:
    """A reader's RELEASED store on a state table it can write (tests, in-process tables).
    True if the slot was IN_FLIGHT at `generation`."""
    b = slot * QS
    if words[b] != (generation << 32) | IN_FLIGHT:
        return False
    fence()
    words[b] = (generation << 32) | RELEASED
    return True


# --------------------------------------------------------------------------------------------
# The allocator (pure)

class DevicePoolBook(SlotBook):
    """Slot and byte bookkeeping of one device pool; touches no device.

    The host pools' allocator (`shm.book.SlotBook`: a byte ring with out-of-order release
    and the slot state machine) with a device-facing surface: offsets are relative to the
    pool's base, allocations come back as `DeviceSlot`, and descriptors are checked as
    (slot, generation) pairs.

    `words` is the shared slot table (u64 words in the shm slot-record layout): the owner
    mirrors every state change there and reads back exactly one thing, a RELEASED word with
    the generation it handed out.  By default it is a private array (tests, single process).
    Every record's offset and size stay (`record_offset`, 0): the state table's token data
    area, which is what `host_ref` describes.

    Not thread-safe: one owner thread, or a lock around it.
    """

    def __init__(self, capacity: int, *, slots: int = 1024, align: int = ALIGN, words=None,
                 record_offset: int = 0, holders: Any = None,
                 on_free: Callable[[int], None] | None = None):
        capacity, slots, align = check_geometry(capacity, slots, align, " (256 or 2 MiB are usual)")
        if words is None:
            words = memoryview(array.array("Q", bytes(8 * QS * slots)))
        if len(words) < QS * slots:
            raise ValueError(f"state table has {len(words) // QS} slot records, need {slots}")
        super().__init__(capacity, slots, align, words, mirror_extent=False, holders=holders,
                         on_free=on_free)
        self.record_offset = record_offset
        for s in range(slots):
            b = s * QS
            words[b] = 0
            words[b + Q_OFFSET] = record_offset
            words[b + Q_NBYTES] = 0
            words[b + Q_HOLDER_PID] = 0
            words[b + Q_HOLDER_START] = 0

    # ------------------------------------------------------------------ queries
    def state(self, slot: int) -> int:
        return self._pstate[slot]

    def generation(self, slot: int) -> int:
        return self._gen[slot]

    def get(self, slot: int) -> DeviceSlot:
        return DeviceSlot(slot, self._gen[slot], self._off[slot], self._nb[slot])

    def live(self) -> list[DeviceSlot]:
        return [self.get(s) for s in range(self.slots) if self._pstate[s] != FREE]

    def in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------------ allocation
    def try_alloc(self, nbytes: int) -> DeviceSlot | None:
        """A WRITING slot of `nbytes`, or None when it does not fit even after reclaim()."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        slot = self.take(nbytes)
        if slot < 0 and self.reclaim():
            slot = self.take(nbytes)
        return None if slot < 0 else self.get(slot)

    def alloc(self, nbytes: int) -> DeviceSlot:
        got = self.try_alloc(nbytes)
        if got is None:
            raise self._full(nbytes)
        return got

    def _full(self, nbytes: int) -> DevicePoolFull:
        head = f"device pool: cannot allocate {nbytes} bytes: "
        if nbytes > self.capacity:
            why = (f"larger than the whole pool ({self.capacity} bytes); create the pool with a "
                   "capacity of at least twice the largest tensor")
        elif not self._free:
            why = (f"all {self.slots} slots are live; release results sooner or create the pool "
                   "with more slots")
        else:
            why = (f"no contiguous run of {nbytes} bytes is free ({self.in_use()} live slots hold "
                   f"{self.live_bytes()} of {self.capacity} bytes; the oldest live allocation holds back the "
                   "space after it); release results sooner or create a larger pool")
        return DevicePoolFull(head + why)

    # ------------------------------------------------------------------ state changes
    def _own(self, slot: int, generation: int) -> int:
        if type(slot) is not int or not 0 <= slot < self.slots:
            raise BadDescriptor(f"slot {slot!r} out of range 0..{self.slots - 1}")
        if generation != self._gen[slot] or self._pstate[slot] == FREE:
            raise StaleDescriptor(
                f"slot {slot} generation {generation!r} is not live (the slot is "
                f"{STATE_NAMES[self._pstate[slot]]} at generation {self._gen[slot]})")
        return slot

    def mark_in_flight(self, slot: int, generation: int, holder_pid: int | None = None) -> None:
        """WRITING -> IN_FLIGHT just before the descriptor is sent; re-marking (a retry)
        only updates the holder.  A holder that dies gets its slots reclaimed."""
        self.set_in_flight(self._own(slot, generation), holder_pid)

    def free(self, slot: int, generation: int) -> None:
        """The owner returns a live slot (any state) to FREE; its generation goes up."""
        self.free_slot(self._own(slot, generation))


# --------------------------------------------------------------------------------------------
# The host state table

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


def _finalize_table(name: str, owner_pid: int, mm) -> None:
    if os.getpid() != owner_pid:  # a forked child inherited the object, not the table
        return
    try:
        mm[52:56] = b"\x01\x00\x00\x00"  # header.closed: importers drop their mappings
    except (ValueError, TypeError):
        pass
    try:
        os.unlink(path_of(name))
    except (FileNotFoundError, ShmError):
        pass


class HostStateTable:
    """State words of a device pool's slots, in a zinf segment with the host layout.

    The data area is a token 64 bytes: every slot record points at its start with size 0,
    which is what `host_ref` describes, so `shm.SegmentCache` validates and releases device
    slots with no code of its own."""

    def __init__(self, slots: int):
        name, mm, geo = create_segment(1, slots, 64)
        self._finalizer = weakref.finalize(self, _finalize_table, name, os.getpid(), mm)
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


# --------------------------------------------------------------------------------------------
# CUDA access (lazy: nothing below runs at import)

def cuda_status() -> tuple[bool, str]:
    """(usable, reason): can this process use CUDA devices through torch?  Never raises."""
    try:
        import torch
    except Exception as e:  # ImportError or a broken install
        return False, f"torch is not importable ({type(e).__name__}: {e}); pip install '.[torch]'"
    if getattr(torch.version, "cuda", None) is None:
        return False, (f"this torch build ({torch.__version__}) is CPU-only: no CUDA device. Install a "
                       "CUDA build of torch on a machine with an NVIDIA GPU")
    try:
        if not torch.cuda.is_available():
            return False, ("torch has CUDA support but sees no CUDA device (check nvidia-smi, the "
                           "driver and CUDA_VISIBLE_DEVICES)")
    except Exception as e:  # driver/runtime mismatch
        return False, f"CUDA initialisation failed: {e}"
    return True, "ok"


def require_cuda():
    """torch, when CUDA is usable; CudaUnavailable (with the reason) otherwise."""
    ok, why = cuda_status()
    if not ok:
        raise CudaUnavailable(why)
    import torch

    return torch


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_SIZE)]


class _CtypesRuntime:
    """The CUDA runtime torch already loaded, through ctypes: no extra dependency, and the
    same library (so the same primary context) as torch's own calls."""

    kind = "ctypes"

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._lib = lib
        c_int, c_void_p, c_size_t, c_uint = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        sig = {
            "cudaGetDevice": [ctypes.POINTER(c_int)],
            "cudaSetDevice": [c_int],
            "cudaMalloc": [ctypes.POINTER(c_void_p), c_size_t],
            "cudaFree": [c_void_p],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), c_void_p],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(c_void_p), _IpcHandle, c_uint],
            "cudaIpcCloseMemHandle": [c_void_p],
        }
        for fname, args in sig.items():
            f = getattr(lib, fname)
            f.argtypes = args
            f.restype = c_int
        lib.cudaGetErrorString.argtypes = [c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, err: int, what: str) -> None:
        if err:
            msg = self._lib.cudaGetErrorString(err)
            raise RuntimeError(f"{what} failed: CUDA error {err} ({msg.decode() if msg else '?'})")

    def _on(self, device: int):
        runtime = self

        class _Switch:
            def __enter__(self):
                cur = ctypes.c_int(-1)
                runtime._check(runtime._lib.cudaGetDevice(ctypes.byref(cur)), "cudaGetDevice")
                self.prev = cur.value
                if self.prev != device:
                    runtime._check(runtime._lib.cudaSetDevice(device), "cudaSetDevice")

            def __exit__(self, *exc):
                if self.prev != device and self.prev >= 0:
                    runtime._lib.cudaSetDevice(self.prev)

        return _Switch()

    def malloc(self, nbytes: int, device: int) -> int:
        p = ctypes.c_void_p()
        with self._on(device):
            self._check(self._lib.cudaMalloc(ctypes.byref(p), nbytes), f"cudaMalloc({nbytes})")
        return int(p.value)

    def free(self, ptr: int, device: int) -> None:
        with self._on(device):
            self._check(self._lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def ipc_get_mem_handle(self, ptr: int, device: int) -> bytes:
        h = _IpcHandle()
        with self._on(device):
            self._check(self._lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), HANDLE_SIZE)

    def ipc_open_mem_handle(self, handle: bytes, device: int) -> int:
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), bytes(handle), HANDLE_SIZE)
        p = ctypes.c_void_p()
        with self._on(device):
            # 1 = cudaIpcMemLazyEnablePeerAccess, the only flag the call accepts.
            self._check(self._lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1), "cudaIpcOpenMemHandle")
        return int(p.value)

    def ipc_close_mem_handle(self, ptr: int, device: int) -> None:
        with self._on(device):
            self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


class _CudaPythonRuntime:
    """cuda-python's runtime bindings (``cuda.bindings.runtime``, or ``cuda.cudart`` before
    12.6), used when no libcudart can be found for ctypes."""

    kind = "cuda-python"

    def __init__(self, rt):
        self._rt = rt
        self.path = getattr(rt, "__file__", "cuda-python")

    def _ok(self, res, what: str):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def _on(self, device: int):
        rt, ok = self._rt, self._ok

        class _Switch:
            def __enter__(self):
                self.prev = ok(rt.cudaGetDevice(), "cudaGetDevice")
                if self.prev != device:
                    ok(rt.cudaSetDevice(device), "cudaSetDevice")

            def __exit__(self, *exc):
                if self.prev != device:
                    rt.cudaSetDevice(self.prev)

        return _Switch()

    def malloc(self, nbytes, device):
        with self._on(device):
            return int(self._ok(self._rt.cudaMalloc(nbytes), "cudaMalloc"))

    def free(self, ptr, device):
        with self._on(device):
            self._ok(self._rt.cudaFree(ptr), "cudaFree")

    def ipc_get_mem_handle(self, ptr, device):
        with self._on(device):
            h = self._ok(self._rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        return bytes(h.reserved)[:HANDLE_SIZE]

    def ipc_open_mem_handle(self, handle, device):
        h = self._rt.cudaIpcMemHandle_t()
        h.reserved = bytes(handle)
        with self._on(device):
            return int(self._ok(self._rt.cudaIpcOpenMemHandle(h, self._rt.cudaIpcMemLazyEnablePeerAccess),
                                "cudaIpcOpenMemHandle"))

    def ipc_close_mem_handle(self, ptr, device):
        with self._on(device):
            self._ok(self._rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


def _libcudart_candidates() -> list[str]:
    found: list[str] = []
    try:  # the copy torch loaded, whatever its file is called
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libcudart" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:  # pragma: no cover
        pass
    name = ctypes.util.find_library("cudart")
    if name:
        found.append(name)
    try:
        import torch

        site = os.path.dirname(os.path.dirname(torch.__file__))
        found += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
        found += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*")))
    except Exception:
        pass
    return found


_runtime: Any = None
_runtime_lock = threading.Lock()


def runtime():
    """The CUDA runtime wrapper for raw allocation and IPC; CudaUnavailable without one."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        torch = require_cuda()
        torch.cuda.init()  # loads libcudart, so /proc/self/maps names it
        errors = []
        for path in _libcudart_candidates():
            try:
                _runtime = _CtypesRuntime(ctypes.CDLL(path), path)
                return _runtime
            except (OSError, AttributeError) as e:
                errors.append(f"{path}: {e}")
        for mod in ("cuda.bindings.runtime", "cuda.cudart"):
            try:
                import importlib

                _runtime = _CudaPythonRuntime(importlib.import_module(mod))
                return _runtime
            except ImportError as e:
                errors.append(f"{mod}: {e}")
        raise CudaUnavailable("no CUDA runtime library found for IPC (looked for libcudart through "
                              "/proc/self/maps, ldconfig and torch's wheels, and for cuda-python): "
                              + "; ".join(errors))


# --------------------------------------------------------------------------------------------
# Tensors over raw device memory

_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtype(dt: np.dtype):
    got = _TORCH_DTYPES.get(dt.str)
    if got is None:
        import torch

        try:
            got = torch.from_numpy(np.empty(0, dt)).dtype
        except TypeError:
            raise BadDescriptor(f"dtype {dt} has no torch equivalent; the CUDA path carries torch dtypes") from None
        _TORCH_DTYPES[dt.str] = got
    return got


class _DeviceBlock:
    """A raw device allocation; freed when the last tensor over it and its pool are gone."""

    def __init__(self, rt, nbytes: int, device: int):
        self.rt, self.nbytes, self.device = rt, nbytes, device
        self.ptr = rt.malloc(nbytes, device)
        self.pinned = False  # set by the pool while slots are lent: never freed then

    def __del__(self):
        if self.ptr and not self.pinned:
            try:
                self.rt.free(self.ptr, self.device)
            except Exception:
                pass
            self.ptr = 0


class _DeviceView:
    """`__cuda_array_interface__` over `ptr`; torch keeps it (and `keep`) alive as long as
    any tensor shares the storage, so a finalizer on it runs after the last view is gone."""

    __slots__ = ("__cuda_array_interface__", "keep", "__weakref__")

    def __init__(self, ptr: int, shape: tuple, dt: np.dtype, keep: Any):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": dt.str, "data": (ptr, False),
                                         "strides": None, "version": 2}
        self.keep = keep


def _tensor_at(ptr: int, shape: tuple, dt: np.dtype, device: int, keep: Any, on_drop=None, args=()):
    import torch

    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=_torch_dtype(dt), device=f"cuda:{device}"), None
    _torch_dtype(dt)  # refuse dtypes torch lacks before building anything
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


def _on_device(t: Any, device: int) -> bool:
    """Is `t` a tensor on CUDA device `device`?  (A seam: the CPU simulation tests replace
    it, with `_tensor_at`, `runtime` and `require_cuda`.)"""
    d = getattr(t, "device", None)
    return d is not None and d.type == "cuda" and d.index == device


def _device_uuid(torch, device: int) -> bytes:
    try:
        u = torch.cuda.get_device_properties(device).uuid
        return bytes(u.bytes) if hasattr(u, "bytes") else bytes.fromhex(str(u).replace("-", "")[-32:])
    except Exception:
        return b""


def _local_ordinal(torch, uuid: bytes, fallback: int) -> int:
    """The ordinal this process uses for the device the owner called `fallback`: the same
    GPU may have another number under a different CUDA_VISIBLE_DEVICES."""
    if uuid:
        for i in range(torch.cuda.device_count()):
            if _device_uuid(torch, i) == uuid:
                return i
    return fallback


# --------------------------------------------------------------------------------------------
# Owner side

class CudaPool:
    """A device pool owned by this process: one block, exported once, slots handed out as
    torch tensors (views of the block).  Not thread-safe.

        pool = CudaPool(256 << 20, device=0)
        t = pool.alloc((1080, 1920, 3), np.uint8)      # a torch.cuda tensor, slot WRITING
        t.copy_(frame, non_blocking=True)              # write on this stream
        loc = pool.hand_off(t, holder_pid=client_pid)  # event recorded, slot IN_FLIGHT
        ...send loc...; later pool.free(t) or the reader releases and reclaim() frees it
    """

    def __init__(self, capacity: int, *, device: int | str | None = None, slots: int = 1024,
                 align: int = ALIGN, holders: Any = None):
        torch = require_cuda()
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
        rt = runtime()
        self._block = _DeviceBlock(rt, (capacity + ALIGN - 1) // ALIGN * ALIGN, self.device)
        self._table = None
        try:
            self.handle = rt.ipc_get_mem_handle(self._block.ptr, self.device)
            self._table = HostStateTable(slots)
            self._table.write_meta(PoolMeta(capacity, self.device, align, self.handle,
                                            _device_uuid(torch, self.device)))
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
        _torch_dtype(dt)
        s = self.book.try_alloc(n)
        if s is None:
            return None
        try:
            t, _ = _tensor_at(self.base_ptr + s.offset, shape, dt, self.device, self._block)
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
            raise self.book._full(n)
        return t

    def _slot_freed(self, slot: int) -> None:
        # Every return to FREE (free(), a reader's release, a dead holder) passes here.
        self._tensors.pop(slot, None)
        off = self.book._off[slot]
        if self._by_start.get(off) == slot:
            del self._by_start[off]

    def ref_of(self, t) -> DeviceRef | None:
        """The descriptor of `t` if it is a contiguous view inside one live slot."""
        if self._closed or not _on_device(t, self.device) or not t.is_contiguous():
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

    def view(self, ref: DeviceRef, dtype, shape):
        """A tensor over one of our own slots (a reply that hands an input back)."""
        self._check_open()
        s = self.book._own(ref.slot, ref.generation)
        rec = self.book.get(s)
        if ref.pool != self.name or not (rec.offset <= ref.offset and ref.offset + ref.nbytes <= rec.offset + rec.nbytes):
            raise BadDescriptor(f"{ref} is not inside slot {s} of {self.name}")
        dt = np.dtype(dtype)
        return _tensor_at(self.base_ptr + ref.offset, tuple(shape), dt, self.device, self._block)[0]

    # ------------------------------------------------------------------ hand-off
    def _event(self, slot: int):
        ev = self._events[slot]
        if ev is None:
            # Interprocess events cannot time; blocking=False keeps a host wait (never on the
            # hot path) from sleeping in the driver.
            ev = self._events[slot] = self._torch.cuda.Event(interprocess=True)
        return ev

    def hand_off(self, x, *, stream=None, holder_pid: int | None = None, include_handle: bool = True):
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
        self.book.mark_in_flight(ref.slot, ref.generation, holder_pid)
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


# --------------------------------------------------------------------------------------------
# Importer side

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
    IPC handle.  Not thread-safe, except that finalizers may run in any thread.
    """

    def __init__(self, *, local: dict[str, CudaPool] | None = None, max_events: int = 4096):
        self._local = local if local is not None else {}
        self._pools: dict[str, _Imported] = {}
        self._events: OrderedDict[bytes, Any] = OrderedDict()
        self._max_events = max_events
        self._dropped: deque = deque()  # (pool name, ref, stream) from finalizers
        self._pending: list[tuple[Any, DeviceRef]] = []
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
        torch = require_cuda()
        meta, data_offset = read_pool_meta(ref.pool)
        if handle and bytes(handle) != meta.handle:
            raise BadDescriptor(f"the memory handle in the descriptor does not match pool {ref.pool}'s")
        device = _local_ordinal(torch, meta.uuid, meta.device)
        ptr = runtime().ipc_open_mem_handle(meta.handle, device)
        owner = parse_name(ref.pool)
        p = self._pools[ref.pool] = _Imported(ref.pool, ptr, meta.capacity, device, data_offset, owner, meta.handle)
        return p

    def _event(self, handle: bytes, device: int):
        ev = self._events.get(handle)
        if ev is None:
            torch = require_cuda()
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
        torch = require_cuda()
        p = self._open(ref, loc.handle)
        if ref.offset + ref.nbytes > p.capacity:
            raise BadDescriptor(f"bytes [{ref.offset}, +{ref.nbytes}) lie outside pool {ref.pool} ({p.capacity} bytes)")
        # Validation on the host: the slot is IN_FLIGHT at this generation (else stale).
        self.states.view(host_ref(ref, p.data_offset), np.uint8, (0,))
        if stream is None:
            stream = torch.cuda.current_stream(p.device)
        if loc.event:
            stream.wait_event(self._event(bytes(loc.event), p.device))
        p.live += 1
        try:
            t, fin = _tensor_at(p.ptr + ref.offset, shape, dt, p.device, p, self._on_drop,
                                (ref, stream if release else None))
        except BaseException:
            p.live -= 1
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
                continue
            if stream is None:  # a borrow: the owner frees it, we only stop counting it
                p.live -= 1
                continue
            if torch is None:
                torch = require_cuda()
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

    def _release_now(self, ref: DeviceRef) -> int:
        p = self._pools.get(ref.pool)
        if p is None:
            return 0
        p.live -= 1
        try:
            self.states.release(host_ref(ref, p.data_offset))
            return 1
        except ShmError:  # the owner closed or died: nothing to give back
            return 0

    def release(self, loc, *, stream=None) -> None:
        """Give back a slot that was never viewed (a discarded late reply)."""
        ref = check_ref(loc)
        torch = require_cuda()
        p = self._pools.get(ref.pool)
        if p is None:
            try:
                p = self._open(ref, loc.handle)
            except ShmError:
                return
        p.live += 1
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
                runtime().ipc_close_mem_handle(p.ptr, p.device)
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
