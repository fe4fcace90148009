"""Data planes: how a worker reads a request's tensors, runs a batch, and places its outputs.

The worker loop (`gpu_worker.worker`) knows nothing of where tensors live; it talks to one
plane, chosen once when the worker starts: `HostPlane` (this module) on a CPU worker,
`gpu_worker.cuda_plane.CudaPlane` on a CUDA one.  Both have the same methods:

    transports                   what READY advertises ("inline", "shm"[, "cuda"])
    admit() -> str | None        None: take a new request; else why it is shed (QUEUE_FULL)
    map_inputs(job, frames)      job.inputs, job.refs: views of the request's tensors
    batch_limit(max_batch) -> n  the largest batch to form now
    run(jobs) -> outputs         one dict name -> array per job, in order
    detach(outputs) -> outputs   copies of run's outputs that outlive the model's next run
    warm(inputs)                 one keep-warm unit: a batch of one, outputs dropped
    write_outputs(job, out) -> (tensor refs, inline frames)   for the reply header and body
    finish_reads(job)            before an error FINAL: reads of the job's inputs are done
    housekeeping()               every heartbeat interval
    lent() -> int                outputs clients hold and have not released (after a reclaim)
    close()                      unlinks the output memory: a stopping worker waits for lent() == 0

Host plane invariants:

* Inputs are read in place: a shared-memory reference becomes a read-only numpy view of the
  client's segment (mapped once per segment, `shm.SegmentCache`), an inline frame a
  read-only numpy view of the received ZeroMQ frame.  Nothing is copied and nothing the
  worker may write aliases a client's memory.  Shared-memory references are only honoured
  from a client on this host.
* Outputs go to this worker's output ring (`shm.ShmPool`, marked IN_FLIGHT for the client's
  pid) when the client is on this host and did not ask for inline, else inline; a full ring
  degrades to inline, never to an error.
* Identity pass-through: an output that *is* one of the request's shared-memory inputs (an
  identity model such as `echo`) is answered with the input's own reference: nothing is
  copied, whatever the tensor's size, and the client keeps that slot until it releases the
  result (docs/protocol.md, section 7).
"""
from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np
import zmq

from broker import protocol as P
from shm.segment import owner_of
from gpu_worker.job import Job


def input_segments(limit: int | None = None) -> int:
    """How many client segments a worker keeps mapped: `shm.reader.MAX_SEGMENTS`, fewer
    where this process may open few descriptors (each mapped segment holds two: Python's
    mmap keeps a duplicate per mapping, and a segment is two), so that the cache leaves
    room for the reply sockets, the clients' pidfds and the connections (a hard limit of
    1024 gets 96; 2304 or more, the whole 256)."""
    from broker.protocol.limits import nofile_limit
    from shm.reader import MAX_SEGMENTS

    limit = nofile_limit() if limit is None else limit
    return max(16, min(MAX_SEGMENTS, (limit - 256) // 8))


def reply_sockets(limit: int | None = None) -> int:
    """How many reply sockets (`DirectSockets`, one per client process a worker answers
    directly) stay open: 256, fewer under a low descriptor limit (each holds two: its
    connection and its mailbox), never fewer than the 64 kept before.  A client process
    past them was answered on a new connection each time (about 65 µs more a reply, and
    an accept at the client): a host of a hundred game-server processes calling one
    worker in turn."""
    from broker.protocol.limits import nofile_limit

    limit = nofile_limit() if limit is None else limit
    return max(64, min(256, (limit - 256) // 8))

__all__ = ["DataPlane", "HostPlane", "NotAttested", "ReplyTooLarge", "check_owner", "is_same_array"]

CUDA_ON_CPU_WORKER = ("CUDA IPC tensors need a worker on a CUDA device (start it with "
                      "python -m gpu_worker --device cuda:N); this worker runs on the CPU")


class DataPlane(Protocol):
    """What the worker loop needs from a data plane (see the module docstring)."""

    transports: tuple[str, ...]

    def admit(self) -> str | None: ...
    def map_inputs(self, job: Job, frames) -> None: ...
    def batch_limit(self, max_batch: int) -> int: ...
    def run(self, jobs: list[Job]) -> list: ...
    def detach(self, outs: list) -> list: ...
    def warm(self, inputs) -> None: ...
    def write_outputs(self, job: Job, out: dict, checked: bool = False,
                      max_inline: int | None = None) -> tuple[list[P.TensorRef], list]: ...
    def finish_reads(self, job: Job) -> None: ...
    def housekeeping(self) -> None: ...
    def lent(self) -> int: ...
    def usage(self) -> dict: ...
    def close(self) -> None: ...


def _within(arr: np.ndarray, inputs) -> bool:
    """Whether ``arr``'s memory may lie in one of ``inputs`` (a bounds check, O(1) each)."""
    if not inputs:
        return False
    for x in inputs.values():
        if type(x) is np.ndarray and np.may_share_memory(arr, x):
            return True
    return False


#: bytes of output names one reply may carry (UTF-8): half a header, the rest for shapes,
#: dtypes, locations and timing, which are bounded by MAX_TENSORS and MAX_NDIM
MAX_OUTPUT_NAMES = P.MAX_HEADER_BYTES // 2


class OutputRefused(TypeError, ValueError):
    """What a model returned cannot go in a reply (`check_outputs`): the model's fault, and
    the same request fails the same way again.  A TypeError or a ValueError, as each check
    raised before it had a class of its own."""


class ReplyTooLarge(OutputRefused):
    """An output would go inline in a frame larger than the broker reads from this worker
    (`Welcome.max_reply_frame`: a tcp backend's --max-reply-mb).  Sent, it ended the
    worker's connection, and the request, retried elsewhere, ended the next worker's."""


def check_outputs(out: Any) -> None:
    """What a reply can carry, checked before anything is written: a dict of at most
    `P.MAX_TENSORS` outputs named by strings, each at most `P.MAX_NDIM` dimensions (a model
    that breaks this gets a clear error naming it, not a reply its client refuses as a
    protocol bug), named in valid UTF-8 and at most `MAX_OUTPUT_NAMES` bytes of names."""
    if not isinstance(out, dict):
        raise OutputRefused(f"the model returned {type(out).__name__} for a request; expected a dict of outputs")
    if len(out) > P.MAX_TENSORS:
        raise OutputRefused(f"the model returned {len(out)} outputs; a reply carries at most {P.MAX_TENSORS}")
    names = 0  # their UTF-8 bytes: a reply header over MAX_HEADER_BYTES is refused by its client
    for name, value in out.items():
        if type(name) is not str or not name:  # ("" as a client's input name is refused too)
            raise OutputRefused(f"output names must be non-empty strings; the model returned {name!r}")
        if name.isascii():
            names += len(name)
        else:
            try:
                names += len(name.encode())
            except UnicodeEncodeError as e:  # checked here, before an output slot is taken
                raise OutputRefused(f"output name {name!r} is not valid UTF-8 ({e.reason})") from None
        ndim = np.ndim(value)
        if ndim > P.MAX_NDIM:
            raise OutputRefused(f"output {name!r} has {ndim} dimensions; the limit is {P.MAX_NDIM}")
        itemsize = None
        if isinstance(value, np.ndarray):  # (a subclass too: np.ma, np.matrix, sent as its plain array)
            if value.dtype.hasobject or value.dtype.itemsize == 0:
                # (object arrays' bytes are pointers; a zero-size item a client cannot read)
                raise OutputRefused(f"output {name!r} has dtype {value.dtype.str!r}, which cannot be sent")
            if not value.size:
                itemsize = value.dtype.itemsize
        elif type(value).__module__.startswith("torch") and hasattr(value, "element_size") and not value.numel():
            itemsize = value.element_size()
        if itemsize is not None and P.claimed_nbytes(value.shape, itemsize) > P.MAX_TENSOR_BYTES:
            # An empty array with an absurd shape ((0, 1 << 40) float32): zero bytes, but
            # every peer refuses its header (`P.tensor_nbytes`), so its client raised a
            # ProtocolError blaming mismatched versions (found by the edge hunt).
            raise OutputRefused(f"output {name!r} is empty but its shape {tuple(value.shape)} and dtype {value.dtype} "
                             f"describe more than {P.MAX_TENSOR_BYTES} bytes (counting 0 dimensions as 1), "
                             "which no peer accepts")
    if names > MAX_OUTPUT_NAMES:
        raise OutputRefused(f"the model's {len(out)} output names take {names} bytes; a reply's take at most "
                         f"{MAX_OUTPUT_NAMES} (its header is at most {P.MAX_HEADER_BYTES})")


class HostPlane:
    """Tensors in host memory: shared-memory views and inline frames in, the output ring or
    inline frames out.  Owns the input segment cache and the output ring."""

    def __init__(self, backend, *, host: str, transports=("inline", "shm"), out_capacity: int = 256 << 20,
                 out_slots: int = 4096):
        from shm import SegmentCache, ShmPool
        from shm.book import PidfdHolders

        self.backend = backend
        self.host = host
        self.transports = tuple(transports)
        #: which clients are alive: a pidfd per live client, shared by the input cache, the
        #: output ring and the reply sockets (`DirectSockets`), closed once the client exits
        self.holders = PidfdHolders()
        #: client segments, mapped read-only once each
        self.inputs = SegmentCache(owners=self.holders, max_segments=input_segments())
        #: this worker's output ring (None without the "shm" transport)
        self.out_pool = (ShmPool(out_capacity, slots=out_slots, holders=self.holders)
                         if "shm" in self.transports else None)
        #: whether an attested client may open the output ring, by (pid, start time)
        self._readers: dict[tuple, bool] = {}

    def admit(self) -> str | None:
        return None

    # ------------------------------------------------------------------ inputs

    def map_inputs(self, job: Job, frames) -> None:
        req = job.req
        inputs: dict[str, np.ndarray] = {}
        refs: dict[str, P.TensorRef] = {}
        for t in req.tensors:
            inputs[t.name] = self.map_tensor(req, t, P.parse_dtype(t.dtype), frames)
            refs[t.name] = t
        job.inputs, job.refs = inputs, refs

    def map_tensor(self, req: P.Request, t: P.TensorRef, dt: np.dtype, frames) -> np.ndarray:
        """A read-only view of one host tensor of ``req`` (shared memory or an inline frame)."""
        loc = t.loc
        kind = type(loc)
        if kind is P.ShmLoc:
            if req.host != self.host:
                raise P.ProtocolError("shared-memory reference from another host")
            check_owner(req, loc.segment)
            return self.inputs.view(P.shm_ref(loc), dt, tuple(t.shape))
        if kind is P.InlineLoc:
            # The frame itself (zmq.Frame, bytes, memoryview: all export their buffer); its
            # size was checked against the shape when the header was decoded, so a 1-d
            # tensor is the view as it comes.  Read-only, as a shared-memory input is: a
            # model must not count on writing into its inputs on one transport only.
            shape = t.shape
            arr = np.frombuffer(frames[loc.frame], dtype=dt)  # parse_dtype refuses itemsize 0
            if len(shape) != 1:
                arr = arr.reshape(shape)
            arr.setflags(write=False)
            return arr
        raise P.ProtocolError(CUDA_ON_CPU_WORKER)

    # ------------------------------------------------------------------ running

    def batch_limit(self, max_batch: int) -> int:
        return max_batch

    def run(self, jobs: list[Job]) -> list:
        if getattr(self.backend, "takes_meta", False):  # fixed when the backend is made: no per-request cost otherwise
            return self.backend.run([j.inputs for j in jobs], meta=[j.req.meta for j in jobs])
        return self.backend.run([j.inputs for j in jobs])

    def detach(self, outs: list) -> list:
        """``run``'s per-request outputs copied out of whatever memory the model keeps (it
        may fill the same buffer on every call): what `Worker._isolate` keeps of one half
        while it runs the next."""
        copied = []
        for out in outs:
            if isinstance(out, dict):
                out = {k: (v.clone() if hasattr(v, "clone") and not isinstance(v, np.ndarray)
                           else np.array(v, copy=True)) for k, v in out.items()}
            copied.append(out)
        return copied

    def warm(self, inputs) -> None:
        """A keep-warm unit (`gpu_worker.keepwarm`): ``inputs`` (the model's example) as a
        batch of one; its outputs are dropped."""
        self.backend.run([inputs])

    # ------------------------------------------------------------------ outputs

    def write_outputs(self, job: Job, out: dict, checked: bool = False,
                      max_inline: int | None = None) -> tuple[list[P.TensorRef], list[Any]]:
        """``checked``: `check_outputs` passed on ``out`` already (a batch's, `Worker._run_model`);
        ``max_inline``: the largest inline frame the reply may carry (`ReplyTooLarge` past it,
        the slots taken freed)."""
        req = job.req
        # An output slot is lent to the process the broker attested, which gives it back by
        # releasing it or by dying; a request without one (tcp, another pid namespace) would
        # pin the slot for good, so it gets its outputs inline, whatever it asked for.
        want_shm = (self.out_pool is not None and req.pid is not None and req.host == self.host
                    and req.reply != "inline" and self._may_read(req))
        refs: list[P.TensorRef] = []
        frames: list[Any] = []
        if not checked:
            check_outputs(out)  # before any slot is taken: a model's mistake costs no slot
        lent: list[Any] = []  # output slots taken for this reply: freed if it fails half way
        try:
            self._write(job, req, out, want_shm, refs, frames, lent, max_inline)
        except BaseException:
            for ref in lent:
                self.out_pool.free(ref)
            raise
        if lent:
            # What each slot is lent for, written once the reply is whole: a client that gave
            # up on the request (its reply lost with a broker) gives back the slots so tagged,
            # and a slot freed just above never carries a tag (docs/shm.md, "When a process dies").
            for ref in lent:
                self.out_pool.tag(ref, req.id)
        return refs, frames

    def _may_read(self, req: P.Request) -> bool:
        """Whether the attested client can open this worker's output ring.  The kernel opens
        `/proc/<pid>/fd` only for a process of the owner's user and group (or one with
        CAP_SYS_PTRACE): a client of another uid (a root client of a service user's
        worker, or the reverse) was handed shared-memory outputs it could not open, and its
        call failed with a ProtocolError.  Such a client gets its outputs inline.  Asked
        once per client process (its /proc directory is owned by its effective ids)."""
        key = (req.pid, req.pid_start)
        ok = self._readers.get(key)
        if ok is None:
            try:
                st = os.stat(f"/proc/{req.pid}")
            except OSError:  # gone (its answer goes nowhere) or unreadable: as before
                return True
            ok = st.st_uid == os.geteuid() and st.st_gid == os.getegid()
            if len(self._readers) >= 4096:
                self._readers.clear()
            self._readers[key] = ok
        return ok

    def _write(self, job: Job, req, out: dict, want_shm: bool, refs: list, frames: list, lent: list,
               max_inline: int | None = None) -> None:
        for name, value in out.items():
            arr = value if type(value) is np.ndarray else np.asarray(value)
            same = job.inputs.get(name) if job.inputs else None
            if same is not None and type(job.refs[name].loc) is P.ShmLoc and req.reply != "inline" and is_same_array(arr, same):
                # Identity output: hand back the client's own reference; no byte moves.
                refs.append(P.TensorRef(name=name, dtype=job.refs[name].dtype, shape=list(arr.shape), loc=job.refs[name].loc))
                continue
            dts = arr.dtype.str
            # Small outputs go inline unless the request asked for shared memory by name.
            if want_shm and (arr.nbytes > P.SMALL_INLINE_BYTES or req.reply == "shm"):
                buf = self.out_pool.try_alloc(arr.shape, arr.dtype)
                if buf is not None:
                    ref = self.out_pool.ref_of(buf)
                    lent.append(ref)
                    np.copyto(buf, arr)
                    self.out_pool.mark_in_flight(ref, holder_pid=req.pid, holder_start=req.pid_start)
                    refs.append(P.TensorRef(name=name, dtype=dts, shape=list(arr.shape),
                                            loc=P.shm_loc(ref)))
                    continue
                # Output ring full (the client holds many results): degrade to inline, never fail.
            refs.append(P.TensorRef(name=name, dtype=dts, shape=list(arr.shape), loc=P.InlineLoc(frame=len(frames))))
            nbytes = arr.nbytes
            if max_inline is not None and nbytes > max_inline:
                raise ReplyTooLarge(f"output {name[:200]!r} is {nbytes} bytes, over the {max_inline} bytes a reply frame "
                                    f"may carry through the broker (its --max-reply-mb, on a tcp backend): ask for a "
                                    f"smaller output, or start the broker with a larger --max-reply-mb")
            if nbytes <= P.SMALL_INLINE_BYTES and not arr.dtype.hasobject:
                # A small copy (in C order, whatever the layout) costs less than the views.
                # (Object arrays are refused below, as the buffer protocol refuses them:
                # their bytes would be pointers.)
                frames.append(arr.tobytes())
                continue
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)  # a copy: ours
            elif nbytes >= zmq.COPY_THRESHOLD and not _within(arr, job.inputs):  # (pyzmq copies smaller frames,
                # and so does the local link: broker.protocol.link._kept)
                # The model's own memory (a buffer it keeps and fills again for the next
                # batch, while libzmq may still be sending this one): a copy, or another
                # client's data could go out under this reply.  Views of the request's own
                # inputs (an echo) go as they are.
                arr = arr.copy()
            # Raw bytes view: the buffer protocol refuses some dtypes (datetime64) as typed views.
            frames.append(arr.reshape(-1).view(np.uint8).data)

    def finish_reads(self, job: Job) -> None:
        pass  # host reads are done when the model call returns

    def housekeeping(self) -> None:
        # Outputs of clients that died (their holder pid is gone) and released ones go back
        # now, not at the next allocation that finds the ring full.
        if self.out_pool is not None:
            self.out_pool.reclaim()
        # Inputs of clients that died: a SIGKILL never marks a segment closed, and our
        # mapping would keep its memory (and the owner's pid, were it reused) until 64
        # other segments pushed it out.
        self.inputs.sweep()

    def usage(self) -> dict:
        """Pool use for the worker's STATS (`P.WorkerStats` fields): output ring bytes."""
        pool = self.out_pool
        if pool is None:
            return {}
        return {"shm_used": pool.live_bytes(), "shm_capacity": pool.capacity}

    def lent(self) -> int:
        pool = self.out_pool
        if pool is None:
            return 0
        pool.reclaim()  # released slots, and those of holders that died
        return pool.in_use()

    def close(self) -> None:
        self.inputs.close()
        if self.out_pool is not None:
            self.out_pool.close()
        self.holders.close()


NOT_ATTESTED = ("shared-memory and CUDA references need a sender the broker can attest (a "
                "local ipc connection in this pid namespace); send the tensors inline")


class NotAttested(P.ProtocolError):
    """A shared-memory or CUDA reference from a sender the broker did not attest: answered
    NOT_LOCAL (421), not 400, since the same tensors sent inline are served (our SDK resends
    them so at once).  Such a sender is a connection whose maker has exited (a forked child
    kept it), or one an older broker did not attest in time (docs/security.md)."""
NOT_OWNED = ("a shared-memory or CUDA reference names memory that the sending process does not "
             "own; send tensors from the process that allocated them, or inline")


def check_owner(req: P.Request, segment: str) -> None:
    """Refuse a reference into memory the requester does not own, before anything is opened.

    The principal is the process the broker attested for the request's connection (its pid
    from SO_PEERCRED and that process's start time, rewritten into ``req.pid`` and
    ``req.pid_start`` at dispatch; whatever the client wrote there is discarded); the owner
    is the pid and start time a segment's name states, which the reader checks against the
    segment's header when it opens it.  The start time tells a reused pid from the process
    that connected (it exited, a child it forked kept the connection); a broker that sends
    none (an older one) is checked by pid alone.  The message is the same whatever the segment, so
    it tells the sender nothing about memory that is not its own."""
    if req.pid is None:
        raise NotAttested(NOT_ATTESTED)
    owner = owner_of(segment)
    if owner is None or owner[0] != req.pid or (req.pid_start is not None and owner[1] != req.pid_start):
        raise P.ProtocolError(NOT_OWNED)


def is_same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` is ``b``'s memory, seen whole (the identity pass-through test)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.flags.c_contiguous
        # may_share_memory first (a bounds check in C, 0.3 µs): most outputs are new
        # memory, and the addresses (a dict built per __array_interface__, 2 µs each) are
        # asked only of those that overlap the input
        and np.may_share_memory(a, b)
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )
