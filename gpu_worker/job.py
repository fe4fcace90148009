"""One request held by the worker, from its REQUEST to its FINAL.

A `Job` is plain data shared by the worker loop (`gpu_worker.worker`), the data planes
(`gpu_worker.planes`, `gpu_worker.cuda_plane`) and the direct-reply gathering
(`gpu_worker.direct`).  Invariants a maintainer must keep:

* ``envelope`` is the broker's token for this dispatch attempt; every reply and DONE for the
  job carries it, and nothing else identifies the job to the broker.
* ``req`` is None only for an opaque MDP request (no header): such a job is never batched,
  never replied to directly and has no tensors.
* ``inputs`` and ``refs`` are set together by a plane's ``map_inputs`` (both None until
  then): views of the client's memory, never copies the worker may write to.
* ``cuda_in`` is True once a CUDA IPC input was viewed on the worker's stream (set even if
  a later input of the same request then failed to map): the reads queued for it must be
  finished before the client is told FINAL, which frees the inputs.
* ``device_ran`` is True once the job was part of a batch run on the device (the CUDA
  plane's `run`): only then are reads of its inputs queued on the worker stream.
* ``route`` is None for a request the broker handed over; for one that came on the worker's
  direct socket under a lease (docs/protocol.md section 10) it is the connection's routing
  id, every reply goes back there, and ``envelope`` is the worker's own key for it (never
  8 bytes long, so never one of the broker's tokens).
"""
from __future__ import annotations

__all__ = ["Job"]


class Job:
    """One request held by the worker."""

    __slots__ = ("envelope", "req", "inputs", "opaque", "received", "deadline", "refs", "input_ms", "cuda_in",
                 "device_ran", "cancelled", "code", "route", "stale", "resend")

    def __init__(self, envelope, req, inputs, opaque, received, deadline, refs, route=None):
        self.envelope = envelope
        self.req = req            # P.Request or None (opaque)
        self.inputs = inputs      # dict name -> ndarray (views)
        self.opaque = opaque      # body frames of an opaque request
        self.received = received
        self.deadline = deadline
        self.refs = refs          # name -> TensorRef of the input (for identity pass-through)
        self.input_ms = 0.0       # mapping the inputs (shm views, inline frames)
        self.cuda_in = False      # some input is a CUDA IPC view (the worker stream reads it)
        self.device_ran = False   # part of a batch run on the device: reads of its inputs were queued
        self.cancelled = False    # a CANCEL arrived while it ran: its result is not sent
        self.code = 0             # its FINAL's outcome: 0 (a result) or the error code sent
        self.route = route        # a leased request's direct connection (routing id); None: brokered
        # Brokered, and the broker connection it came on was replaced while it ran: a reply
        # through the (new) broker has nowhere to go (its token is unknown there)
        self.stale = False
        # Leased, and answered "resend it through the broker" (it did not run): the broker
        # counts it when it comes there, so it is no leased outcome (`Worker._count_leased`)
        self.resend = False
