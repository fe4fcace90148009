"""Packing request inputs and unpacking reply outputs.

Inputs: a mapping name -> array (numpy, torch CPU tensor, or anything `np.asarray` takes).
Each tensor goes one of three ways, cheapest first:

1. by reference: it already lives in the client's `ShmPool` (`client.alloc`) and is
   C-contiguous, so only its descriptor is sent (no copy at all);
2. copied once into a temporary pool slot (shared-memory transport on), freed when the
   request's FINAL or error arrives;
3. inline: its bytes ride in a ZeroMQ frame (shared memory off, the pool full, or an empty
   tensor, where a slot would cost more than the zero bytes it saves).

Outputs: `ShmLoc` tensors become read-only views of the worker's segment (no copy) and are
released back to the worker when the user is done with them; inline tensors become
`np.frombuffer` views of the received frame (no copy either).

The wire layout of a tensor is always C order with numpy's `dtype.str`; Fortran-ordered or
strided inputs are made C-contiguous on the way in (that copy is the one the transport needs
anyway).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Container, Mapping
from typing import Any, Callable, Iterator

import numpy as np

import shm as _shm
from broker import protocol as P
from shm.reader import SegmentCache  # (at import: `shm` loads it at first use, which may find no descriptor left)

from . import cuda as _cuda
# InvalidInput lives in errors.py with every other error class; it stays importable from here
# for code written against the older layout.
from .errors import InferenceError, InvalidInput, NotSupported, ProtocolError, WorkerFailed

log = logging.getLogger("client_sdk")

#: a slot lent for a given-up request goes back only once it has been lent this long: a worker
#: frees a slot it lent only while writing the reply (it could not finish it), at once
GIVEN_UP_HOLD_NS = 1_000_000_000

__all__ = ["Result", "Packed", "pack", "unpack", "to_numpy", "OutputLeases", "lease_array",
           "ref_in_pool", "free_temp", "local_output", "Adopted", "release_reply", "alloc_source"]


# --------------------------------------------------------------------------------------------
# Lifetime of arrays that point into shared memory.
#
# NumPy collapses a view's `.base` chain down to the first array that owns its memory or
# whose base is not an ndarray.  An array made by slicing a segment-wide ndarray would
# therefore hand its views a base that skips it, and a finalizer on it would fire while a
# view (`out[0]`, `out.T`) is still being read.  Routing the array through a tiny object that
# exposes `__array_interface__` gives it a non-ndarray base, which stops the collapse: every
# view derived from the returned array keeps that array alive, so its finalizer runs only
# when the last view is gone.

class _Lease:
    __slots__ = ("__array_interface__", "_src", "_owner", "__weakref__")

    def __init__(self, src: np.ndarray, owner: Any = None):
        self._src = src
        self._owner = owner
        self.__array_interface__ = src.__array_interface__


# Forks of this process since it started, in this process (0 in the first; each child
# counts one more than its parent).  A client's slots and buffers are its creator's: what a
# forked child drops or releases (its copies of the parent's Results, its copy of the
# client) must not give them back, or the parent would go on reading a slot the worker has
# handed to another request.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def fork_generation() -> int:
    """This process's `_forks`: an object made here with one value is a forked child's copy
    wherever it reads another."""
    return _forks


def lease_array(src: np.ndarray, on_last_drop: Callable[..., Any], *args: Any,
                owner: Any = None, readonly: bool = False) -> tuple[np.ndarray, weakref.finalize]:
    """A view of `src` whose finalizer (`on_last_drop(*args)`) runs once no view of it is
    left.  The finalizer can also be called early (`fin()`), and runs once either way.
    `owner`, if given, is kept alive as long as any view is."""
    out = np.asarray(_Lease(src, owner))
    if readonly:
        out.flags.writeable = False
    fin = weakref.finalize(out, on_last_drop, *args)
    # Releasing at interpreter exit is pointless (the owner reclaims a dead pid's slots) and
    # would run after the segment cache is gone.
    fin.atexit = False
    return out, fin


# --------------------------------------------------------------------------------------------
# Inputs

def to_numpy(name: str, x: Any) -> np.ndarray:
    """`x` as a numpy array sharing its memory when it can (torch CPU tensors, ndarrays)."""
    if isinstance(x, np.ndarray):
        arr = x
        if type(x) is not np.ndarray and isinstance(x, np.ma.MaskedArray) and np.ma.is_masked(x):
            # Its bytes go, not its mask: the model would compute on the values the mask
            # hides, and the result would look right (the fidelity hunt).  A subclass
            # otherwise travels as its plain array (np.matrix, a masked array hiding nothing).
            raise InvalidInput(
                f"input {name!r} is a masked array with {int(np.ma.count_masked(x))} masked element(s); "
                "a mask cannot be sent: send x.filled(value), and np.ma.getmaskarray(x) as another "
                "input if the model needs it"
            )
    elif type(x).__module__.startswith("torch") and hasattr(x, "numpy") and hasattr(x, "device"):
        arr = _torch_to_numpy(name, x)
    else:
        try:
            arr = np.asarray(x)
        except Exception as e:
            raise InvalidInput(
                f"input {name!r} ({type(x).__name__}) cannot be converted to a numpy array: {e}; "
                "pass a numpy array or a torch CPU tensor"
            ) from None
    if arr.dtype.hasobject:
        raise InvalidInput(
            f"input {name!r} has dtype {arr.dtype}, which holds Python objects and cannot cross "
            "processes; convert it to a numeric, bool, string or datetime dtype first "
            "(for example np.asarray(x, dtype=np.float32))"
        )
    if arr.dtype.itemsize == 0:
        raise InvalidInput(
            f"input {name!r} has dtype {arr.dtype.str!r}, whose items have no size; give them one "
            "(for example '|S1') or send an empty array of a sized dtype"
        )
    if arr.ndim > P.MAX_NDIM:
        raise InvalidInput(f"input {name!r} has {arr.ndim} dimensions; the protocol allows at most {P.MAX_NDIM}")
    if not arr.size and P.claimed_nbytes(arr.shape, arr.dtype.itemsize) > P.MAX_TENSOR_BYTES:
        # Zero bytes, but a header the broker refuses (`P.tensor_nbytes`), which the client
        # raised as a ProtocolError blaming mismatched versions (found by the edge hunt).
        raise InvalidInput(
            f"input {name!r} is empty but its shape {arr.shape} and dtype {arr.dtype.str!r} describe more than "
            f"{P.MAX_TENSOR_BYTES} bytes (counting 0 dimensions as 1), which the protocol refuses; "
            "send it with a smaller shape (e.g. np.empty((0,), dtype))"
        )
    return arr


def _torch_to_numpy(name: str, t: Any) -> np.ndarray:
    if t.device.type != "cpu":
        raise NotSupported(
            f"input {name!r} is a torch tensor on {t.device}; of GPU tensors only CUDA ones can be "
            "passed directly (by CUDA IPC): call .cpu() on it first"
        )
    if t.is_nested:  # (a strided nested tensor has no numpy view: torch raised RuntimeError)
        raise InvalidInput(f"input {name!r} is a nested torch tensor; send each of its tensors as an input "
                           "of its own, or one padded tensor (.to_padded_tensor(0))")
    if str(t.layout) != "torch.strided":
        raise InvalidInput(f"input {name!r} is a {t.layout} torch tensor; call .to_dense() on it first")
    t = t.detach()
    # Lazily conjugated/negated views would otherwise be read as their unresolved bits.
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    try:
        return t.numpy()
    except TypeError as e:  # bfloat16 and other dtypes numpy lacks
        raise InvalidInput(
            f"input {name!r} has torch dtype {t.dtype}, which numpy cannot represent ({e}); convert "
            "it first (.float()), or send its bits (.view(torch.int16)) and convert on the worker"
        ) from None


class Packed:
    """One request's inputs ready for the wire."""

    __slots__ = ("tensors", "frames", "temp", "arrays", "uses_shm", "cuda_temp")

    def __init__(self, tensors: list[P.TensorRef] | None = None, frames: list[Any] | None = None,
                 arrays: dict[str, np.ndarray] | None = None) -> None:
        self.tensors: list[P.TensorRef] = [] if tensors is None else tensors
        self.frames: list[Any] = [] if frames is None else frames  # inline frames, in InlineLoc order
        self.temp: list[Any] = []          # ShmRefs of temporary slots, freed at FINAL
        # what was sent (keeps by-reference inputs alive); for an inline resend
        self.arrays: dict[str, np.ndarray] = {} if arrays is None else arrays
        self.uses_shm = False
        self.cuda_temp: list[Any] | None = None  # temporary device slots (tensors), freed at FINAL


#: the location of a request's first inline frame (frozen: one instance serves every request)
_FIRST_FRAME = P.InlineLoc(frame=0)


def _inline(arr: np.ndarray, copy: bool, in_shm: bool) -> Any:
    if arr.nbytes == 0:
        return b""
    in_shm = in_shm or _lease_of(arr) is not None
    c = np.ascontiguousarray(arr)
    flat = c.reshape(-1).view(np.uint8)
    # Frames are sent with copy=False, so ZeroMQ keeps a pointer into the buffer until the
    # bytes are on the wire.  Shared memory may be unmapped (client.close) or reused
    # (client.free) before then, and callers of non-blocking sends may overwrite their own
    # array, so those get a private copy.
    if in_shm or (copy and np.may_share_memory(c, arr)):
        return flat.tobytes()
    return flat


def pack(inputs: Mapping[str, Any], pool: Any | None, *, copy_inline: bool = False,
         cuda: Callable[[], Any] | None = None, inline_max: int = 0,
         max_inline_bytes: int | None = None) -> Packed:
    """Pack `inputs`.  `pool` None means inline only; with a pool, tensors of at most
    `inline_max` bytes still go inline (`P.SMALL_INLINE_BYTES`).  `copy_inline` makes inline frames
    private copies (for sends that return before the bytes leave, such as `Stream.send`).
    `cuda()` returns the client's `CudaSide` for torch CUDA tensors (by CUDA IPC); without it
    they are copied to the host (a worker on another host cannot open CUDA IPC handles)."""
    if type(inputs) is dict and len(inputs) == 1:
        # The lean path: one small numpy array, the usual request of an interactive caller.
        # It goes inline as a private copy (`tobytes`, C order), which is what the general
        # path below sends for it too (a small tensor of a client with shared memory is
        # copied; an inline-only client's would be a view, but a copy of at most
        # SMALL_INLINE_BYTES costs less than making that view).  Anything else falls through.
        [(name, x)] = inputs.items()
        if type(x) is np.ndarray and type(name) is str and name:
            nbytes = x.nbytes
            if nbytes <= (P.SMALL_INLINE_BYTES if pool is None else inline_max):
                dt = x.dtype
                if (not dt.hasobject and dt.itemsize and x.ndim <= P.MAX_NDIM
                        and (nbytes or P.claimed_nbytes(x.shape, dt.itemsize) <= P.MAX_TENSOR_BYTES)):
                    return Packed([P.TensorRef(name=name, dtype=dt.str, shape=list(x.shape), loc=_FIRST_FRAME)],
                                  [x.tobytes()], {name: x})
            elif pool is not None and type(x.base) is _Lease:
                # The lean by-reference path: one whole `client.alloc` buffer, the array
                # `alloc` returned (its base is the _Lease; a view of it has that array as
                # base, and goes the general way).  Its bytes are exactly its source's (an
                # array's data pointer cannot be moved), so when that source is a live slot
                # of this pool of as many bytes, the slot's descriptor is what `ref_in_pool`
                # finds for it too: sent by reference, as the general path sends it.
                ref = pool.ref_of(x.base._src)
                dt = x.dtype
                if (ref is not None and ref.nbytes == nbytes and x.flags.c_contiguous
                        and not dt.hasobject and x.ndim <= P.MAX_NDIM):
                    pool.mark_in_flight(ref)
                    out = Packed([P.TensorRef(name=name, dtype=dt.str, shape=list(x.shape), loc=P.shm_loc(ref))],
                                 None, {name: x})
                    out.uses_shm = True
                    return out
    if not isinstance(inputs, Mapping):
        raise InvalidInput(f"inputs must be a mapping name -> array, got {type(inputs).__name__}")
    if len(inputs) > P.MAX_TENSORS:
        raise InvalidInput(f"{len(inputs)} inputs in one request; the protocol allows at most {P.MAX_TENSORS}")
    out = Packed()
    try:
        for name, x in inputs.items():
            if not isinstance(name, str) or not name:
                raise InvalidInput(f"input names must be non-empty strings, got {name!r}")
            if name in out.arrays:  # a Mapping that is not a dict may name one twice
                raise InvalidInput(f"input name {name!r} appears twice in the inputs; give each input a name of its own")
            if type(x) is not np.ndarray and _cuda.is_cuda_tensor(x):
                if cuda is not None:
                    side = cuda()
                    if out.cuda_temp is None:
                        out.cuda_temp = []
                    got = side.pack(x, out.cuda_temp)
                    if got is not None:
                        dts, shp, cloc, sent = got
                        out.arrays[name] = sent
                        out.tensors.append(P.TensorRef(name=name, dtype=dts, shape=shp, loc=cloc))
                        continue
                    # Device pool full: through the host instead.
                x = x.detach().cpu()
            arr = to_numpy(name, x)
            out.arrays[name] = arr
            dt = arr.dtype.str
            shape = list(arr.shape)
            loc = None
            ref = None
            if pool is not None and arr.nbytes > inline_max:
                ref = ref_in_pool(pool, arr)
                if ref is not None and arr.flags.c_contiguous and ref.nbytes == arr.nbytes:
                    pool.mark_in_flight(ref)     # 1. by reference, no copy
                    loc = P.shm_loc(ref)
                else:
                    dst = _try_alloc(pool, arr)
                    if dst is not None:          # 2. one copy into a temporary slot
                        tref = pool.ref_of(dst)
                        out.temp.append(tref)
                        np.copyto(dst, arr, casting="no")
                        pool.mark_in_flight(tref)
                        loc = P.shm_loc(tref)
                        # What was sent, for an inline resend: the caller's array may have
                        # changed since (a stream frame buffer), the slot has not.
                        out.arrays[name] = dst
            if loc is None:                      # 3. inline
                if max_inline_bytes is not None and arr.nbytes > max_inline_bytes:
                    # The broker would drop it with the connection (its --max-frame-mb), which
                    # the client can only see as a reconnect, resent and dropped again
                    # (found by the data hunt: BrokerUnreachable, "check the endpoint").
                    # What to raise depends on why it is inline: a client without shared memory
                    # (tcp, transport="inline") has no pool_capacity that could help.
                    if pool is None:
                        where = "no shared memory here"
                        fix = "send it through shared memory (an ipc:// endpoint, transport 'auto' or 'shm'), or raise"
                    else:
                        where = f"it does not fit the client's pool ({pool.capacity >> 20} MiB, pool_capacity)"
                        fix = "raise pool_capacity, or"
                    raise InvalidInput(
                        f"input {name!r} is {arr.nbytes} bytes ({arr.nbytes / (1 << 20):.6g} MiB) and would go "
                        f"inline ({where}), over max_inline_mb ({max_inline_bytes / (1 << 20):g} MiB, "
                        f"{max_inline_bytes} bytes: the broker's --max-frame-mb, 256 by "
                        f"default); {fix} max_inline_mb to match a broker that takes more")
                loc = P.InlineLoc(frame=len(out.frames))
                # A small tensor of a client with shared memory is copied now (100 ns): it
                # may lie in the pool (also wrapped by torch, where _lease_of cannot see
                # it), and what is sent is what the caller passed at prepare time.
                small = pool is not None and arr.nbytes <= inline_max
                out.frames.append(_inline(arr, copy_inline, ref is not None or small))
            else:
                out.uses_shm = True
            out.tensors.append(P.TensorRef(name=name, dtype=dt, shape=shape, loc=loc))
    except BaseException:
        free_temp(pool, out.temp)
        if out.cuda_temp and cuda is not None:
            cuda().free_temp(out.cuda_temp)
        raise
    return out


def alloc_source(arr: np.ndarray) -> np.ndarray | None:
    """The pool array behind ``arr`` when ``arr`` is what `lease_array` returned (a
    `client.alloc` buffer itself, not a view of it), else None."""
    lease = arr.base
    return lease._src if type(lease) is _Lease else None


def _lease_of(arr: np.ndarray) -> _Lease | None:
    b = arr
    for _ in range(4):  # a leased array, or a view of one (numpy stops collapsing there)
        b = getattr(b, "base", None)
        if type(b) is _Lease:
            return b
        if not isinstance(b, np.ndarray):
            return None
    return None


def ref_in_pool(pool: Any, arr: np.ndarray) -> Any | None:
    """The descriptor of `arr` if its bytes lie in one live slot of `pool`, else None.

    The pool recognises its arrays by their `.base`; a buffer from `client.alloc` is
    wrapped (see `lease_array`), so for those the same bytes are looked up through the
    pool's own array."""
    lease = arr.base
    if type(lease) is _Lease:
        # What `lease_array` returned (a `client.alloc` buffer): the pool cannot see it
        # through its base (a _Lease is none of its arrays), so it is not asked.
        if not arr.nbytes:
            return None
    else:
        ref = pool.ref_of(arr)
        if ref is not None or not arr.nbytes:
            return ref
        lease = _lease_of(arr)
        if lease is None:
            return None
    src = lease._src
    whole = pool.ref_of(src)
    if whole is None or not arr.flags.c_contiguous:
        return None
    rel = arr.__array_interface__["data"][0] - src.__array_interface__["data"][0]
    if rel < 0 or rel + arr.nbytes > whole.nbytes:
        return None
    if rel == 0 and arr.nbytes == whole.nbytes:
        return whole
    return _shm.ShmRef(whole.segment, whole.offset + rel, arr.nbytes, whole.slot, whole.generation)


def _try_alloc(pool: Any, arr: np.ndarray) -> np.ndarray | None:
    try:
        return pool.try_alloc(arr.shape, arr.dtype)
    except _shm.ShmFull:
        return None
    except (_shm.ShmError, TypeError, ValueError):
        # Too large for any slot, or a dtype the pool refuses: inline still works.
        return None


def free_temp(pool: Any, refs: list[Any]) -> None:
    for ref in refs:
        try:
            pool.free(ref)
        except Exception:  # pool already closed: its segment is gone with the slot
            pass
    refs.clear()


# --------------------------------------------------------------------------------------------
# Outputs

class OutputLeases:
    """Reader side of output slots: maps the worker's segments (one `SegmentCache`, created on
    first use), counts the arrays still alive, and releases each slot once.

    Finalizers can run in any thread and at any allocation (garbage collection), hence the
    re-entrant lock.  Closing waits for the last live lease, so that results dropped after
    `client.close()` still give their slots back to the worker.

    A release stores RELEASED into the ring's slot table, so it needs the ring mapped: one
    that cannot be mapped now (this process out of descriptors or memory) is kept and tried
    again at the next output viewed, at each `sweep` and at close.  Otherwise the worker,
    seeing its holder alive, kept the slot for the client's life."""

    def __init__(self, factory: Callable[[], Any] | None = None):
        # Owners tracked (a pidfd per worker whose ring is mapped): `sweep` drops the rings
        # of workers that died, whose SIGKILL never marked them closed.
        self._factory = factory or (lambda: SegmentCache(track_owners=True))
        self._cache: Any = None
        self._lock = threading.RLock()
        self.own_segment: str | None = None  # the client's input pool: not an output ring
        self.cuda_cache: Any = None  # the client's CudaPoolCache, once it has a CUDA side
        self._dead: set[str] = set()  # rings the last sweep found dead (dropped at the next)
        self._unreleased: set[Any] = set()  # refs whose ring could not be mapped to release them
        self._live = 0
        self._closing = False
        self._gen = _forks  # a forked child's copy gives nothing back (see `_forks`)
        # A worker lends each output slot to the process the broker attested for the request
        # (its `holder_pid`): a slot lent to anyone else, or to nobody (a request's input,
        # ours or another process's), is never viewed or released here.
        self._pid = os.getpid()
        # (segment, slot, generation) -> views of it alive: a slot goes back when its last
        # view goes.  A worker names a slot once; one named twice (two outputs, two replies, a
        # FINAL sent both ways) went back at the first release while a result still viewed it.
        self._views: dict[tuple[str, int, int], int] = {}

    @property
    def cache(self) -> Any:
        with self._lock:
            if self._cache is None:
                if self._closing:
                    raise InferenceError("the client is closed; open a new one", code=None)
                self._cache = self._factory()
            return self._cache

    @property
    def live(self) -> int:
        return self._live

    def forked(self) -> bool:
        """Whether this is a forked child's copy (it gives nothing back)."""
        return self._gen != _forks

    def view(self, loc: P.ShmLoc, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, weakref.finalize]:
        ref = P.shm_ref(loc)
        with self._lock:
            src = self.cache.view(ref, dtype, shape, self._pid)
            self._live += 1
            key = (ref[0], ref[3], ref[4])
            self._views[key] = self._views.get(key, 0) + 1
            if self._unreleased:  # descriptors to map a ring again: give back what waits
                self._retry_releases()
        try:
            return lease_array(src, self._release, ref)
        except BaseException:
            self._release(ref)
            raise

    def _release(self, ref: Any) -> None:
        if self._gen != _forks:
            return  # a forked child's copy of a Result: the slot is its parent's to give back
        with self._lock:
            cache = self._cache
            key = (ref[0], ref[3], ref[4])
            views = self._views.pop(key, 1) - 1
            if views > 0:
                self._views[key] = views  # viewed elsewhere still: the last view gives it back
                cache = None
            try:
                if cache is not None:
                    cache.release(ref, self._pid)
            except _shm.OutOfResources:  # its ring dropped and not to be mapped again now: later
                self._unreleased.add(ref)
            except Exception:  # segment gone (worker died) or cache closed: nothing to give back
                pass
            self._live -= 1
            if self._closing and self._live == 0:
                self._close_cache()

    def _give_back(self, cache: Any, ref: Any) -> bool:
        """Release ``ref``: False when its ring cannot be mapped now (kept for later)."""
        try:
            cache.release(ref, self._pid)
        except _shm.OutOfResources:  # no descriptor or memory to map the ring: later
            self._unreleased.add(ref)
            return False
        except Exception:  # segment gone (worker died), stale or cache closed: nothing to give back
            pass
        self._unreleased.discard(ref)
        return True

    def _retry_releases(self) -> None:
        """Release the slots whose ring could not be mapped before (under the lock)."""
        cache = self._cache
        if cache is None or self._gen != _forks:
            return
        stuck = set()  # rings that cannot be mapped now: their other slots are not tried
        for ref in list(self._unreleased):
            if ref[0] not in stuck and not self._give_back(cache, ref):
                stuck.add(ref[0])

    def sweep(self) -> list[str]:
        """Drop the mappings of output rings whose worker died or closed them (the client's
        heartbeat: `ClientCore.heartbeat`), once seen so at two sweeps in a row: a reply
        the worker sent just before it died may still be unread, and reads its outputs from
        the mapping (the ring's file is gone with its owner).  Arrays still viewing one keep
        it mapped until they go.  Without this, a SIGKILLed worker's ring (256 MiB by
        default) stayed mapped, its memory held, until 64 newer segments pushed it out."""
        with self._lock:
            cache = self._cache
            if cache is None:
                return []
            try:
                if self._unreleased:
                    self._retry_releases()
                dead = cache.dead()
                gone = [name for name in dead if name in self._dead]
                for name in gone:
                    cache.forget(name)
                self._dead = set(dead) - set(gone)
                return gone
            except Exception:  # housekeeping never fails a call
                return []

    def release_given_up(self, given_up: Container[int]) -> int:
        """Give back the output slots lent to this process for requests it gave up on, whose
        replies were lost on their way (`SegmentCache.release_given_up`), in the rings mapped
        here, except those a result views and those lent in the last `GIVEN_UP_HOLD_NS`.
        How many went back."""
        if self._gen != _forks:
            return 0
        with self._lock:
            cache = self._cache
            if cache is None or self._closing:
                return 0
            try:
                return cache.release_given_up(given_up, self._pid, time.monotonic_ns() - GIVEN_UP_HOLD_NS,
                                              keep=self._views, skip=self.own_segment)
            except Exception:  # housekeeping never fails a call
                log.debug("could not give back the slots of given-up requests", exc_info=True)
                return 0

    def release_unviewed(self, loc: P.ShmLoc) -> None:
        """Give back an output slot nobody will read (a discarded late reply)."""
        if self._gen != _forks:
            return
        with self._lock:
            if self._closing or loc.segment == self.own_segment:
                # Never store RELEASED into our own pool: its owner-side reclaim would free
                # a slot we still use (an input buffer a worker echoed back).
                return
            if (loc.segment, loc.slot, loc.generation) in self._views:
                return  # a result views it (a duplicate reply): its last view gives it back
            try:
                ref = P.shm_ref(loc)
                cache = self.cache
            except Exception:  # a malformed descriptor, or the cache cannot be made
                return
            self._give_back(cache, ref)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            if self._live == 0:
                self._close_cache()

    def _close_cache(self) -> None:
        if self._unreleased:
            self._retry_releases()  # descriptors freed since, or held for the mapping till now
            self._unreleased.clear()  # what still cannot be: the worker frees it when we exit
        cache, self._cache = self._cache, None
        if cache is not None:
            try:
                cache.close()
            except Exception:
                pass


class Result(Mapping):
    """Outputs of one reply: a read-only mapping name -> np.ndarray.

    Arrays backed by the worker's shared memory are zero-copy views.  Their slot goes back to
    the worker when `release()` is called (or the `with` block ends), or else when the last
    array (and every view derived from it) is garbage-collected.  After `release()` the
    arrays must not be read any more: the worker may already be writing the next result
    there.  Copy (`np.array(r["y"])`) what you want to keep longer.
    """

    __slots__ = ("_arrays", "_fins", "timing", "id", "seq", "final", "frame", "_released", "__weakref__")

    def __init__(self, arrays: dict[str, np.ndarray], fins: list[weakref.finalize], *,
                 timing: dict[str, float] | None = None, id: int = 0, seq: int = 0,
                 final: bool = True, frame: int | None = None):
        self._arrays = arrays
        self._fins = fins
        self.timing: dict[str, float] = dict(timing or {})
        self.id = id
        self.seq = seq
        self.final = final
        self.frame = frame
        self._released = False

    def __getitem__(self, name: str) -> np.ndarray:
        if self._released:
            self._gone(repr(name))
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        if self._released:
            self._gone("its names")
        return iter(self._arrays)

    def __len__(self) -> int:
        if self._released:
            self._gone("its size")
        return len(self._arrays)

    def _gone(self, what: str) -> None:
        # Not a KeyError: Mapping's `in`, `get()`, `keys()` and `len()` answered a released
        # Result as an empty one ("x" in r False, r.get("x") None), with no error at all.
        raise InferenceError(f"{what}: this Result was released; read outputs before release() (or the end "
                             f"of its `with` block), or copy them with np.array(result[name])", code=None)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def zero_copy(self) -> dict[str, bool]:
        """name -> True when that output is a view of shared memory (no copy was made)."""
        return {n: any(f.alive and f.peek()[0] is a for f in self._fins) for n, a in self._arrays.items()}

    def release(self) -> None:
        """Give shared-memory output slots back to the worker now.  Idempotent."""
        if self._released:
            return
        self._released = True
        fins, self._fins = self._fins, []
        # The finalizers first, while the arrays still hold them back: dropped first, the
        # last reference ran each from the collector, where a KeyboardInterrupt (a Ctrl-C
        # landing in the release) is printed and swallowed, and the slot leaked with it
        # (the interruption hunt: 165 of 38,893 Ctrl-Cs).  An exception of one goes on to the
        # caller; the slots after it are given back when the arrays go.
        try:
            for f in fins:
                f()
        finally:
            self._arrays = {}

    def __enter__(self) -> "Result":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        if self._released:
            return f"<Result id={self.id} released>"
        items = ", ".join(f"{n}: {a.dtype}{list(a.shape)}" for n, a in self._arrays.items())
        return f"<Result id={self.id}{'' if self.final else f' partial {self.seq}'} {{{items}}}>"


def unpack(reply: P.Reply, frames: list[Any], leases: OutputLeases, *, final: bool,
           frame: int | None = None,
           local: Callable[[P.ShmLoc, np.dtype, tuple], tuple | None] | None = None,
           own: tuple[str, Packed, dict[int, Adopted], Callable[[Any], None]] | None = None) -> Result:
    """Build a Result from a decoded reply header and the frames after it (zmq.Frame or
    bytes).  Inline sizes must have been checked (`protocol.check_inline_sizes`).

    Outputs that point into the client's own pool (a worker may hand an input back
    unchanged) are views of the request's inputs: `own` = (segment, packed, adopted, free)
    names that pool and what `local_output` needs for them.  Or `local(loc, dtype, shape)`
    resolves them: it returns (array, finalizer), or None for a segment that is not ours."""
    arrays: dict[str, np.ndarray] = {}
    fins: list[weakref.finalize] = []
    t = None
    try:
        for t in reply.tensors:
            dt = P.parse_dtype(t.dtype)
            shape = tuple(t.shape)
            loc = t.loc
            if type(loc) is P.InlineLoc:
                fr = frames[loc.frame]
                try:
                    buf = fr.buffer  # a zmq.Frame: its bytes without a copy
                except AttributeError:
                    buf = memoryview(fr)
                # np.ndarray over the buffer: frombuffer().reshape() in one step (the sizes
                # were checked against dtype and shape).  Read-only like shared-memory
                # outputs, so code never depends on the transport: over a read-only view,
                # so that `flags.writeable = True` is refused too (as for a mapped slot).
                arr = (np.frombuffer(buf.toreadonly(), dt).reshape(shape) if buf.nbytes
                       else np.empty(shape, dt))
                if dt.kind == "c" and arr.__array_interface__["data"][0] % min(dt.itemsize, 16):
                    # A frame lies anywhere in libzmq's receive buffer; numpy takes complex
                    # items 8 bytes off a 16-byte boundary as aligned, torch does not, and
                    # torch.from_numpy(out).clone() crashed the process (SIGSEGV: the
                    # fidelity hunt).  Such an output is copied (complex dtypes only).
                    arr = arr.copy()
                arr.flags.writeable = False
            elif type(loc) is P.ShmLoc:
                if own is not None:
                    got = (local_output(own[1], loc, dt, shape, own[2], own[3])
                           if loc.segment == own[0] else None)
                else:
                    got = local(loc, dt, shape) if local is not None else None
                try:
                    arr, fin = got if got is not None else leases.view(loc, dt, shape)
                except _shm.SegmentGone as e:
                    raise WorkerFailed(f"output {t.name!r}: the worker's segment is gone ({e}); "
                                       "the worker probably died, retry the request") from None
                except _shm.OutOfResources as e:
                    raise InferenceError(f"output {t.name!r}: this process cannot map it now ({e}): it is out of "
                                         "descriptors or memory; raise its RLIMIT_NOFILE, or hold fewer results "
                                         "and clients at once", code=None) from None
                except _shm.ShmError as e:
                    raise ProtocolError(f"output {t.name!r}: bad shared-memory descriptor ({e})") from None
                fins.append(fin)
            else:
                cache = leases.cuda_cache
                if cache is None:
                    raise NotSupported(
                        f"output {t.name!r} arrived in CUDA memory, but this client has no CUDA "
                        "side (pass CUDA tensors or call alloc_cuda first); send the request with "
                        "reply='shm' or reply='inline'"
                    )
                try:
                    arr, fin = cache.lease(loc, dt, shape)
                except _shm.SegmentGone as e:
                    raise WorkerFailed(f"output {t.name!r}: the worker's device pool is gone ({e}); "
                                       "the worker probably died, retry the request") from None
                except _shm.ShmError as e:
                    raise ProtocolError(f"output {t.name!r}: bad CUDA descriptor ({e})") from None
                fins.append(fin)
            arrays[t.name] = arr
    except BaseException:
        for f in fins:
            f()
        # The failing slot (the loop's `t`) and those after it were never viewed: give them
        # back too (one whose ring cannot be mapped now is given back later: `OutputLeases`).
        tensors = reply.tensors
        at = next((k for k, u in enumerate(tensors) if u is t), len(tensors))
        for t in tensors[at:]:
            if type(t.loc) is P.ShmLoc:
                leases.release_unviewed(t.loc)
            elif type(t.loc) is P.CudaLoc:
                _release_cuda(leases, t.loc)
        raise
    return Result(arrays, fins, timing=reply.timing, id=reply.id, seq=reply.seq, final=final, frame=frame)


class Adopted:
    """An input slot a worker handed back as an output: it now lives as long as the outputs
    that view it (and the request, until its FINAL), then `free(ref)` runs once."""

    __slots__ = ("ref", "_free", "_holds", "__weakref__")

    def __init__(self, ref: Any, free: Callable[[Any], None]):
        self.ref = ref
        self._free = free
        self._holds = 0

    def hold(self) -> None:
        self._holds += 1

    def drop(self) -> None:
        self._holds -= 1
        if self._holds == 0:
            free, self._free = self._free, None
            if free is not None:
                free(self.ref)


def local_output(packed: Packed, loc: P.ShmLoc, dt: np.dtype, shape: tuple,
                 adopted: dict[int, Adopted], free: Callable[[Any], None]) -> tuple[np.ndarray, weakref.finalize]:
    """A read-only output viewing bytes of one of this request's own inputs (no copy).

    The bytes must lie inside an input sent by reference or through a temporary slot; a
    temporary slot is adopted (kept past the FINAL until the outputs are gone), a buffer
    from `client.alloc` stays the caller's and is kept alive by the view."""
    for t in packed.tensors:
        il = t.loc
        if (type(il) is P.ShmLoc and il.segment == loc.segment and il.slot == loc.slot
                and il.generation == loc.generation and il.offset <= loc.offset
                and loc.offset + loc.nbytes <= il.offset + il.nbytes):
            break
    else:
        raise ProtocolError(
            f"an output points at slot {loc.slot} of the client's own segment, which is not an "
            "input of this request"
        )
    base = packed.arrays[t.name]
    if il.offset == loc.offset and il.nbytes == loc.nbytes and base.dtype is dt and base.shape == shape:
        # The usual echo: the whole input, as it was sent.  What was sent (C-contiguous,
        # exactly the input's bytes) is already the view asked for.
        src = base
    elif loc.nbytes:
        start = loc.offset - il.offset
        src = base.reshape(-1).view(np.uint8)[start:start + loc.nbytes].view(dt).reshape(shape)
    else:
        src = np.empty(shape, dt)
    keeper = adopted.get(loc.slot) if adopted else None
    if keeper is None and packed.temp:
        for i, r in enumerate(packed.temp):
            if r.slot == loc.slot and r.generation == loc.generation:
                keeper = adopted[loc.slot] = Adopted(packed.temp.pop(i), free)
                keeper.hold()  # the request's own hold, dropped after its FINAL
                break
    if keeper is None:
        # A client.alloc buffer: the view keeps it alive, nothing to free.  Still wrapped
        # as `lease_array` wraps (views of it keep it, its base stays a _Lease), with a
        # finalizer that has nothing to run.
        out = np.asarray(_Lease(src))
        out.flags.writeable = False
        return out, _NothingToFree(out)
    keeper.hold()
    return lease_array(src, keeper.drop, owner=keeper, readonly=True)


def _noop() -> None:
    pass


class _NothingToFree:
    """The finalizer of an output that gives nothing back when it goes (a view of a
    `client.alloc` buffer): what `Result` asks of a `weakref.finalize` (`alive`, `peek`,
    calling it; `detach`), without registering one, as nothing has to run at the end."""

    __slots__ = ("_ref",)

    def __init__(self, arr: np.ndarray):
        self._ref: Any = weakref.ref(arr)

    @property
    def alive(self) -> bool:
        return self._ref is not None and self._ref() is not None

    def peek(self) -> tuple | None:
        arr = None if self._ref is None else self._ref()
        return None if arr is None else (arr, _noop, (), {})

    def detach(self) -> tuple | None:
        got = self.peek()
        self._ref = None
        return got

    def __call__(self, _: Any = None) -> None:
        self._ref = None


def release_reply(reply: P.Reply, leases: OutputLeases) -> None:
    """Give back every output slot of a reply nobody will read."""
    for t in reply.tensors:
        if type(t.loc) is P.ShmLoc:
            leases.release_unviewed(t.loc)
        elif type(t.loc) is P.CudaLoc:
            _release_cuda(leases, t.loc)


def _release_cuda(leases: OutputLeases, loc: P.CudaLoc) -> None:
    if leases.forked():
        return
    cache = leases.cuda_cache
    if cache is not None:
        try:
            cache.release(loc)
        except Exception:  # the worker's pool is gone: nothing to give back
            pass
