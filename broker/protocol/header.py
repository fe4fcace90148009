"""Header frames: the msgpack map that follows MAGIC in a tensor message's first body frame.

Every header a peer sends is decoded and validated here (msgspec checks types while it
decodes; the `check_*` functions check the rest), and every failure is one `ProtocolError`
whose message names the field.  The field-by-field description for implementers in other
languages is docs/protocol.md section 3; the struct definitions below are the authority.

Must never: touch a socket, read a clock, or import a process package (broker state or
server, gpu_worker, client_sdk).  (It logs one thing, at DEBUG only: a malformed
traceparent that it drops.)
"""
from __future__ import annotations

import functools
import logging
import re
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Sequence, Union

import msgspec

if TYPE_CHECKING:
    import numpy as np

__all__ = ["LEASED_CLIENT_GONE", "RoutedRequest", "DispatchedRequest", "MAGIC", "VERSION", "MMI_PREFIX", "MAX_SERVICE_LEN", "MAX_CREDIT", "MIN_LIVENESS_WINDOW", "MAX_ENVELOPE_LEN",
    "MAX_TENSORS", "MAX_NDIM", "MAX_HEADER_BYTES", "ROUTED_HEADROOM", "MAX_META_BYTES", "MAX_REPLY_TO_LEN", "MAX_ERROR_MESSAGE", "MAX_DONE", "MAX_MMI_TOKEN",
    "MAX_TENSOR_BYTES", "MAX_DEPTH", "MAX_DTYPE_LEN", "MAX_FORWARD_KEYS", "MAX_FORWARD_BYTES", "ErrorCode",
    "Priority", "ProtocolError", "InlineLoc", "ShmLoc", "CudaLoc", "Location", "TensorRef",
    "ErrorInfo", "Request", "Reply", "Cancel", "Ready", "Welcome", "DoneInfo", "WorkerStats", "TRANSPORTS", "REPLY_MODES", "SMALL_INLINE_BYTES", "is_header",
    "encode_header", "encode_routed", "decode_request", "decode_reply", "decode_cancel", "decode_ready", "decode_welcome",
    "decode_done_info", "decode_worker_stats", "may_be_error", "reply_error_code", "reply_error_text",
    "parse_dtype", "dtype_str", "tensor_nbytes", "claimed_nbytes", "check_tensors", "check_inline_sizes", "lenient_request_id", "header_id",
    "valid_traceparent",
    "LeaseAsk", "LeaseGrant", "LeaseInfo", "LeaseEnd", "LeaseHello", "LEASE_REASONS", "decode_lease_ask",
    "decode_lease_grant", "decode_lease_info", "decode_lease_end", "decode_lease_hello",
]

# --------------------------------------------------------------------------------------------
# Constants

MAGIC = b"\xc1ZNF"
VERSION = 1
MMI_PREFIX = "mmi."

MAX_SERVICE_LEN = 255
MAX_CREDIT = 1 << 16  # requests a worker may hold at once (Ready.credit)
#: the shortest liveness window (heartbeat interval x liveness, seconds) our broker and
#: workers are configured with: shorter, a Python process's ordinary pauses on a busy host
#: (a garbage collection, the scheduler, a model holding the GIL for its switch interval)
#: read as deaths (a 1 ms window: the worker reconnected hundreds of times a second, the
#: broker presumed it dead as often, and requests failed WorkerFailed).  What a WELCOME may
#: carry stays wider (another broker's choice is its own).
MIN_LIVENESS_WINDOW = 0.1
MAX_ENVELOPE_LEN = 255
MAX_TENSORS = 256
MAX_NDIM = 32
MAX_HEADER_BYTES = 1 << 20
#: what a broker's rewrites may add to a request header it admitted (pid, pid_start,
#: queue_ms, returned, backlog and timeout_ms given values, a retry's attempt: 49 bytes at
#: most, measured), which a worker allows a brokered header over MAX_HEADER_BYTES
ROUTED_HEADROOM = 256
#: The most bytes a request's `meta` may take, as msgpack: parameters for the model (data
#: goes in tensors).  Decoded, 64 KiB of tiny values is at most ~5 MB of Python objects and
#: ~10 ms; a whole 1 MiB header of them was 70 MB and 130 ms, for every such request queued.
MAX_META_BYTES = 1 << 16
MAX_REPLY_TO_LEN = 255
#: characters of an error message a reply carries (longer ones are cut, saying so): a model's
#: exception text ends up here, and one of megabytes made a reply header its client refused
MAX_ERROR_MESSAGE = 16384
MAX_DONE = 4096          # envelopes in one DONE
MAX_MMI_TOKEN = 64       # bytes of the correlation token an MMI answer echoes
#: The most bytes one tensor may describe, counting each 0 dimension as 1: itemsize x
#: prod(max(d, 1) for d in shape) <= this.  Far above any real tensor (1 TiB), it is there so
#: that a claimed shape can never overflow a reader's size or stride arithmetic: it bounds
#: every dimension (also the other dimensions of an empty tensor, so [0, 2**62] is refused)
#: and the element count.  Deployment limits on message sizes are a socket's business.
MAX_TENSOR_BYTES = 1 << 40
# Tensors of at most this many bytes travel inline (copied into a frame) rather than by a
# shared-memory reference, unless a client or request asks for shared memory explicitly
# (transport="shm", reply="shm"): below it a copy costs less than the slot bookkeeping and
# mapping on both sides.  Measured crossover: `python -m bench.inline_crossover`.
SMALL_INLINE_BYTES = 4096
#: How deep a header's values may nest: the header map is level 1, `meta` level 2, a map or
#: array inside `meta` level 3, and so on (the typed fields stop at level 4: tensors, a
#: TensorRef, its loc or shape).  `meta` is checked after decoding (`_check_depth`); values
#: of unknown keys are skipped by msgspec without building anything (a broker forwards a
#: request's as their bytes: `MAX_FORWARD_KEYS`), and anything nested past msgspec's own
#: recursion budget (about 1000 levels) is refused as too deep as well.
MAX_DEPTH = 32
#: A request header's top-level keys that this version does not know (a newer client's
#: options for a newer worker) cross the broker unchanged, as their msgpack bytes, never
#: decoded (docs/protocol.md section 5): at most this many of them ...
MAX_FORWARD_KEYS = 64
#: ... in at most this many bytes of msgpack, keys and values (`meta`'s bound: options, not
#: data).  Past either, the request is a 400: silently dropping them is what the rule is against.
MAX_FORWARD_BYTES = MAX_META_BYTES
MAX_DTYPE_LEN = 32       # characters of a dtype string (numpy's longest, e.g. '<m8[100000as]', is far shorter)


class ErrorCode(IntEnum):
    """Typed error codes carried in a FINAL's header (`error.code`).  HTTP-like numbers so
    that a human reading a packet capture guesses right."""

    PROTOCOL_ERROR = 400
    FORBIDDEN = 403       # a tcp client whose CurveZMQ key the broker's allow-list no longer holds
    NOT_LOCAL = 421
    INVALID_INPUT = 422   # the request's tensors do not match what the model declared
    QUEUE_FULL = 429
    CANCELLED = 499
    INTERNAL = 500
    WORKER_FAILED = 502
    SERVICE_UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504


class Priority(IntEnum):
    URGENT = 0
    NORMAL = 1
    BACKGROUND = 2


class ProtocolError(ValueError):
    """A frame or header that breaks the protocol.  The message names what was wrong."""

    code = ErrorCode.PROTOCOL_ERROR


# --------------------------------------------------------------------------------------------
# Header schema.  msgspec validates types while decoding; the `check_*` functions validate the rest.

class InlineLoc(msgspec.Struct, tag="inline", tag_field="kind", frozen=True):
    """Bytes follow in the message: `frame` indexes the frames after the header (0 = first)."""

    frame: int


class ShmLoc(msgspec.Struct, tag="shm", tag_field="kind", frozen=True):
    """Bytes live in a shared-memory segment owned by the sender (see shm/)."""

    segment: str
    offset: int
    nbytes: int
    slot: int
    generation: int


class CudaLoc(msgspec.Struct, tag="cuda", tag_field="kind", frozen=True):
    """Bytes live in a CUDA device memory pool exported once by the sender (docs/gpu.md).

    `handle` is the pool's cudaIpcMemHandle (64 bytes; may be empty once the peer has the pool
    open), `event` an IPC event handle recorded after the producer's last write."""

    pool: str
    offset: int
    nbytes: int
    device: int
    handle: bytes = b""
    event: bytes = b""
    slot: int = -1          # slot in the pool's state table (docs/gpu.md); -1: none
    generation: int = 0     # the slot's generation at hand-off, as for shared memory


Location = Union[InlineLoc, ShmLoc, CudaLoc]


class TensorRef(msgspec.Struct, frozen=True):
    name: str
    dtype: str        # numpy dtype.str, e.g. "<f4", "|u1", "<c16", "<M8[ns]"
    shape: list[int]  # C order (row major); 0-d is []
    loc: Location


class ErrorInfo(msgspec.Struct, frozen=True):
    code: int
    message: str


class Request(msgspec.Struct, kw_only=True):
    """First body frame of a tensor REQUEST (client -> broker -> worker)."""

    v: int = VERSION
    id: int
    priority: int = Priority.NORMAL
    timeout_ms: float | None = None   # budget from the broker's receipt; the broker rewrites it to what is left at dispatch
    deadline_at: float | None = None  # the sender's deadline on its CLOCK_MONOTONIC, seconds: a broker on the same clock ends it there
    host: str | None = None           # sender's shared-memory host id; required with shm refs
    pid: int | None = None            # sender's pid, so a worker can reclaim output slots of a dead client
    pid_start: int | None = None      # set by the broker with pid: that process's start time (a reused pid is another's)
    reply: str = "auto"               # "auto" | "shm" | "inline" | "cuda": how outputs come back
    tensors: list[TensorRef] = []
    meta: dict[str, Any] = {}         # free-form, for the model
    queue_ms: float | None = None     # set by the broker at dispatch: time from its receipt to this dispatch
    returned: int | None = None       # set by the broker: times a busy worker gave it back unstarted (RECALL)
    dropped: int | None = None        # a stream's frames the client gave up unsent (replaced, or expired waiting) since its previous request
    backlog: int | None = None        # set by the broker at dispatch: requests of the service it still has queued
    reply_to: str | None = None       # "ipc://..." bound by the client: a same-host worker may send the FINAL there
    traceparent: str | None = None    # W3C trace context of the client's span, passed through untouched; a malformed one is dropped


class DispatchedRequest(Request, kw_only=True):
    """A `Request` as a worker reads it (`decode_request`): with the keys only a broker
    writes, at dispatch, and only when they have a value (`encode_routed`).  Kept off
    `Request`, which clients encode (msgspec writes every field: a key an older broker does
    not know sends the header down its slower `_Forwarding` path), and off `RoutedRequest`
    (whose every field the broker writes on every dispatch: a first attempt's header gains
    no key)."""

    attempt: int | None = None        # set by the broker: n for the n-th retry after worker deaths (absent: the first)


#: keys only a broker writes (`DispatchedRequest`): one a client sends is dropped, not forwarded
_BROKER_KEYS = frozenset(DispatchedRequest.__struct_encode_fields__) - frozenset(Request.__struct_encode_fields__)


class RoutedRequest(Request, kw_only=True, forbid_unknown_fields=True):
    """A `Request` as the broker reads it: ``meta``, which only the model reads, left as its
    msgpack bytes (`msgspec.Raw`, a view of the frame) and written back as they came (the
    worker decodes it: `decode_request`).  A 1 MiB header could hold a million tiny values
    in ``meta`` (``[[]] * 10**6``): decoded, 70 MB of Python objects and a tenth of a second
    of the broker's loop, for every such request it queued (found by the resource hunt: 40
    of them took the broker to 2.8 GB).  ``meta`` is bounded now (`MAX_META_BYTES`), and the
    broker does not decode it at all.

    Only the keys this version knows: a header with any other is read as a `_Forwarding`
    instead, which carries them to the worker (`decode_request`, `encode_routed`)."""

    meta: msgspec.Raw = msgspec.Raw(b"\x80")


class _Forwarding(RoutedRequest, kw_only=True, forbid_unknown_fields=False, dict=True):
    """A `RoutedRequest` whose header had top-level keys this version does not know: read as
    one (they are skipped), then given ``forwarded``, ``(count, bytes)``: those keys and their
    values as msgpack map entries, the values as the bytes that came (`_unknown_entries`),
    which `encode_routed` writes after the known keys.  (An attribute, not a field: never
    encoded as a key of its own.)"""


class Reply(msgspec.Struct, kw_only=True):
    """First body frame of a PARTIAL or FINAL with tensors, or of a typed error."""

    v: int = VERSION
    id: int
    tensors: list[TensorRef] = []
    error: ErrorInfo | None = None
    timing: dict[str, float] = {}     # queue_ms, batch_wait_ms, input_ms, compute_ms, output_ms, batch
    seq: int = 0                      # PARTIAL sequence number (FINAL carries the count)


class Cancel(msgspec.Struct, kw_only=True):
    v: int = VERSION
    id: int
    queued_only: bool = False  # only while queued at the broker: a run that started goes on (a resend's CANCEL)
    expired: bool = False  # the caller's deadline passed (a leased request's answer and count: DEADLINE_EXCEEDED)


class Ready(msgspec.Struct, kw_only=True):
    """Optional 4th frame of READY: what this worker can take."""

    v: int = VERSION
    credit: int = 1
    max_batch: int = 1
    host: str | None = None
    transports: list[str] = msgspec.field(default_factory=lambda: ["inline"])
    pid: int | None = None
    welcome: bool = False   # the worker understands WELCOME (the broker then sends one)
    recall: bool = False    # the worker answers RECALL with RETURNED (the broker then sends it)
    direct: str | None = None  # the endpoint of the worker's direct socket: it takes leases (section 10)
    link: str | None = None    # the path of its local link (a Unix SOCK_SEQPACKET socket, section 10.6)
    direct_key: str | None = None  # a tcp direct socket's CurveZMQ public key (z85): leaseholders check it
    # The model's declared inputs, name -> [dtype or nil, shape (sizes or nil) or nil], for
    # the broker's model endpoint (docs/operations.md); nil when it declares none.
    inputs: dict[str, tuple[str | None, list[int | None] | None]] | None = None
    # ... and its declared outputs, the same way (what /v2/models/{service} shows).
    outputs: dict[str, tuple[str | None, list[int | None] | None]] | None = None


class Welcome(msgspec.Struct, kw_only=True):
    """Header of WELCOME (broker -> worker), the answer to a READY that asked for one: the
    worker is registered, with which broker process, and at what liveness settings."""

    v: int = VERSION
    instance: bytes                # 8 bytes, new at every broker start
    heartbeat_interval: float      # seconds; the worker heartbeats at this rate
    heartbeat_liveness: int        # missed intervals before either side presumes the other dead
    metrics: bool = False          # the broker counts (--http): send STATS and DONE outcomes
    outcomes: bool = False         # send DONE outcomes (the broker's congestion rule reads 504s), counting or not
    stopping: bool = False         # the broker takes STOPPING (an older one would log it as malformed)
    # the largest frame of a reply the broker reads from this worker (a tcp backend's
    # --max-reply-mb; nil: no limit): a larger one would end the worker's connection
    max_reply_frame: int | None = None


class LeaseAsk(msgspec.Struct, kw_only=True):
    """C->B LEASE (docs/protocol.md section 10)."""

    v: int = VERSION
    id: int                       # from the client's request-id space; LEASED echoes it
    slots: int = 1                # requests in flight wanted at once
    host: str | None = None       # the client's shared-memory host (placement)
    transports: list[str] = msgspec.field(default_factory=lambda: ["inline"])


class LeaseGrant(msgspec.Struct, kw_only=True):
    """B->W LEASE."""

    v: int = VERSION
    lease: bytes                  # 8 bytes
    secret: bytes                 # 16 bytes: binds a direct connection to the lease (HELLO)
    service: str
    slots: int
    client_host: str | None = None
    client_pid: int | None = None  # the kernel's word for the client's ipc connection (SO_PEERCRED)
    client_start: int | None = None  # that process's start time (/proc/<pid>/stat), with client_pid
    principal: str | None = None   # what the lease's requests count against


class LeaseInfo(msgspec.Struct, kw_only=True):
    """B->C LEASED."""

    v: int = VERSION
    id: int                       # the LeaseAsk's
    lease: bytes
    secret: bytes
    endpoint: str                 # the worker's direct socket
    slots: int
    instance: bytes               # the broker's: a lease never outlives the broker that made it
    host: str | None = None       # the worker's shared-memory host (same as the client's: shm works)
    link: str | None = None       # the worker's local link (section 10.6), on a near lease only
    server_key: str | None = None  # the CurveZMQ public key (z85) of a tcp direct socket


class LeaseEnd(msgspec.Struct, kw_only=True):
    """LEASE_END, either way."""

    v: int = VERSION
    lease: bytes
    reason: str
    resend: bool = False          # requests in flight on the lease get no reply: send them through the broker


class LeaseHello(msgspec.Struct, kw_only=True):
    """C->W HELLO on the worker's direct socket."""

    v: int = VERSION
    lease: bytes
    secret: bytes


LEASE_REASONS = frozenset({"worker_failed", "drain", "scale_down", "worker_stopping", "client_gone",
                           "client_done", "broker_restart", "revoked"})


class DoneInfo(msgspec.Struct, kw_only=True):
    """Optional last frame of DONE: per envelope, in order, the FINAL's outcome (0: a
    result, else the error code) and how long ago it was sent to the client (ms), so the
    broker counts direct replies as it counts relayed ones."""

    v: int = VERSION
    codes: list[int] = []
    ages_ms: list[float] = []


#: `WorkerStats.leased`'s outcome for a leased request whose FINAL (or a stream's partial)
#: found its client gone, whether it ran or was told to resend it: ``client_gone``
LEASED_CLIENT_GONE = -1


class WorkerStats(msgspec.Struct, kw_only=True):
    """Header of STATS (worker -> broker, at most once a heartbeat interval): what only the
    worker sees, since its last STATS.  Histograms are bucket counts over the bounds of
    `broker.protocol.stats` (one more count than bounds: +Inf) and their sums; gauges are
    current values (None: not applicable)."""

    v: int = VERSION
    compute: tuple[list[int], float] | None = None    # seconds per request (its batch's time)
    input: tuple[list[int], float] | None = None      # seconds mapping a request's inputs
    output: tuple[list[int], float] | None = None     # seconds writing a request's outputs
    batch: tuple[list[int], float] | None = None      # requests per batch
    keep_warm_runs: int = 0                           # units run since the last STATS
    shm_used: int | None = None                       # output pool bytes in use
    shm_capacity: int | None = None
    cuda_used: int | None = None                      # device pool bytes in use (CUDA workers)
    cuda_capacity: int | None = None
    device_used: int | None = None                    # device memory in use (cudaMemGetInfo)
    device_total: int | None = None
    # Leased requests (docs/protocol.md section 10), whose FINALs never cross the broker:
    # FINALs sent on the direct socket per outcome (0: a result, else the error code;
    # LEASED_CLIENT_GONE: not run, its client gone), and seconds from the worker's receipt of
    # each REQUEST to its FINAL sent.
    leased: dict[int, int] | None = None
    leased_request: tuple[list[int], float] | None = None
    leased_dropped: int = 0  # frames leased streams gave up unsent at their clients (Request.dropped)


_UNKNOWN_CODE = 1 << 20  # an error code no version defines: counted as error_other


class _ErrorOnly(msgspec.Struct):
    error: ErrorInfo | None = None


_ENC = msgspec.msgpack.Encoder()
_DEC_REQUEST = msgspec.msgpack.Decoder(DispatchedRequest)
_DEC_ROUTED = msgspec.msgpack.Decoder(RoutedRequest)  # only known keys: the usual header
_DEC_FORWARDING = msgspec.msgpack.Decoder(_Forwarding)  # any keys (the unknown ones skipped)
_DEC_ENTRIES = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])  # a map's values left as bytes
_KNOWN_KEYS = frozenset(RoutedRequest.__struct_encode_fields__) | _BROKER_KEYS  # never forwarded
_UNKNOWN_FIELD = "Object contains unknown field"  # msgspec's words for `forbid_unknown_fields`
_MAP_TYPES = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # msgpack's first bytes of a map
_DEC_REPLY = msgspec.msgpack.Decoder(Reply)
_DEC_CANCEL = msgspec.msgpack.Decoder(Cancel)
_DEC_READY = msgspec.msgpack.Decoder(Ready)
_DEC_WELCOME = msgspec.msgpack.Decoder(Welcome)
_DEC_DONE_INFO = msgspec.msgpack.Decoder(DoneInfo)
_DEC_STATS = msgspec.msgpack.Decoder(WorkerStats)
_DEC_ERROR_ONLY = msgspec.msgpack.Decoder(_ErrorOnly)
_DEC_LEASE_ASK = msgspec.msgpack.Decoder(LeaseAsk)
_DEC_LEASE_GRANT = msgspec.msgpack.Decoder(LeaseGrant)
_DEC_LEASE_INFO = msgspec.msgpack.Decoder(LeaseInfo)
_DEC_LEASE_END = msgspec.msgpack.Decoder(LeaseEnd)
_DEC_LEASE_HELLO = msgspec.msgpack.Decoder(LeaseHello)

TRANSPORTS = frozenset({"inline", "shm", "cuda"})
REPLY_MODES = frozenset({"auto", "shm", "inline", "cuda"})


# --------------------------------------------------------------------------------------------
# Header encode / decode

def is_header(frame: Any) -> bool:
    """True if a body frame is one of our header frames (starts with MAGIC)."""
    return bytes(memoryview(frame)[:4]) == MAGIC


def encode_header(msg: msgspec.Struct) -> bytes:
    return MAGIC + _ENC.encode(msg)


def encode_routed(req: RoutedRequest, attempt: int | None = None) -> bytes:
    """A request header as the broker dispatches it: the known keys (with what the broker
    rewrote in them), then the keys it did not know, as they came (`_Forwarding`), then
    ``attempt`` when it is a retry (`DispatchedRequest`).  Each key once: a forwarded key is
    never a known one nor a broker's (a client's ``attempt`` is dropped when read), so the
    broker's own values are the only ones."""
    forwarding = type(req) is _Forwarding
    if not forwarding and attempt is None:
        return MAGIC + _ENC.encode(req)
    n, entries = req.forwarded if forwarding else (0, b"")
    known = _ENC.encode(req)
    k, at = _map_head(known)
    if attempt is not None:
        extra = _ENC.encode({"attempt": attempt})
        n, entries = n + 1, b"".join((entries, memoryview(extra)[_map_head(extra)[1]:]))
    return b"".join((MAGIC, _map_prefix(k + n), memoryview(known)[at:], entries))


def _map_head(b: Any) -> tuple[int, int]:
    """(entries, bytes of the map's header) of the msgpack map that `b` starts with."""
    t = b[0]
    if 0x80 <= t <= 0x8F:
        return t & 0x0F, 1
    if t == 0xDE:
        return int.from_bytes(b[1:3], "big"), 3
    if t == 0xDF:
        return int.from_bytes(b[1:5], "big"), 5
    raise ProtocolError("bad request header: not a map")


def _map_prefix(n: int) -> bytes:
    if n < 16:
        return bytes((0x80 | n,))
    return b"\xde" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdf" + n.to_bytes(4, "big")


class _UnknownKey(Exception):
    """`_DEC_ROUTED` met a key this version does not know: read the header again, keeping them."""


def _unknown_entries(body: memoryview) -> tuple[int, memoryview]:
    """The top-level entries of a request header (its map after MAGIC, already decoded as a
    `_Forwarding`) whose keys this version does not know: (how many, their msgpack entries),
    each value the bytes that came (never decoded into objects).  Bounded first by the map's
    entry count (read from its first bytes), then exactly: `MAX_FORWARD_KEYS`,
    `MAX_FORWARD_BYTES`."""
    n, _ = _map_head(body)
    if n > len(_KNOWN_KEYS) + MAX_FORWARD_KEYS:  # before building a str for each key
        raise ProtocolError(f"the request header has {n} keys; a broker forwards at most {MAX_FORWARD_KEYS} "
                            f"that it does not know (and knows {len(_KNOWN_KEYS)})")
    try:
        entries = _DEC_ENTRIES.decode(body)
    except msgspec.DecodeError as e:  # a key that is not UTF-8 (the struct skipped it unread)
        raise ProtocolError(f"bad request header: {e}") from None
    except RecursionError:
        raise ProtocolError(f"bad request header: it nests deeper than {MAX_DEPTH} levels") from None
    unknown = {k: v for k, v in entries.items() if k not in _KNOWN_KEYS}
    if len(unknown) > MAX_FORWARD_KEYS:
        raise ProtocolError(f"the request header has {len(unknown)} keys this broker does not know; "
                            f"it forwards at most {MAX_FORWARD_KEYS}")
    packed = _ENC.encode(unknown)
    _, at = _map_head(packed)
    if len(packed) - at > MAX_FORWARD_BYTES:
        raise ProtocolError(f"the request header's keys this broker does not know take {len(packed) - at} bytes "
                            f"of msgpack; the limit is {MAX_FORWARD_BYTES} (options for the worker: send data as "
                            f"tensors)")
    return len(unknown), memoryview(packed)[at:]  # (not copied again)


def _decode(frame: Any, decoder: msgspec.msgpack.Decoder, what: str, limit: int = MAX_HEADER_BYTES):
    try:
        mv = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"{what} header must be a bytes frame, got {type(frame).__name__}") from None
    if mv.nbytes > limit:
        raise ProtocolError(f"{what} header is {mv.nbytes} bytes; the limit is {limit}")
    if bytes(mv[:4]) != MAGIC:
        raise ProtocolError(f"{what} header frame must start with the 4-byte magic C1 5A 4E 46")
    try:
        msg = decoder.decode(mv[4:])
    except msgspec.DecodeError as e:  # covers ValidationError
        if decoder is _DEC_ROUTED and str(e).startswith(_UNKNOWN_FIELD):
            raise _UnknownKey from None  # (a header with keys only a newer version knows)
        raise ProtocolError(f"bad {what} header: {e}") from None
    except RecursionError:
        # msgspec bounds its recursion by the interpreter's (about 1000 levels, less the
        # caller's stack): far past MAX_DEPTH, so this is always a header nested too deep.
        raise ProtocolError(f"bad {what} header: it nests deeper than {MAX_DEPTH} levels") from None
    except Exception as e:  # anything else a decoder may raise on hostile bytes is still the bytes' fault
        raise ProtocolError(f"bad {what} header: {type(e).__name__}: {e}") from None
    if msg.v != VERSION:
        raise ProtocolError(
            f"{what} header version {msg.v} is not supported; this peer speaks version {VERSION}"
        )
    return msg


def decode_request(frame: Any, n_inline: int | None = None, frames: Sequence[Any] | None = None,
                   routed: bool = False, brokered: bool = False) -> DispatchedRequest:
    """Decode and validate a request header.  `n_inline` is the number of frames after the
    header; when given, inline references are checked against it and their sizes later by
    `check_inline_sizes`.  With ``frames`` (the frames after the header) both are checked
    here, in one pass over the tensors.  ``routed``: as the broker reads it, a
    `RoutedRequest` (``meta`` undecoded: its size and first byte checked; its contents are
    the worker's to check), and top-level keys this version does not know kept, as their
    bytes, for `encode_routed` to forward (a `_Forwarding`; a receiver that is not routing,
    a worker, ignores them).  ``brokered``: as a worker reads a header a broker dispatched
    (`encode_routed`), which may be up to ``ROUTED_HEADROOM`` over the limit the broker
    held its client to."""
    if routed:
        try:
            req = _decode(frame, _DEC_ROUTED, "request")
        except _UnknownKey:
            req = _decode(frame, _DEC_FORWARDING, "request")  # every check as for the usual header
            req.forwarded = _unknown_entries(memoryview(frame)[4:])
        if req.meta != _EMPTY_META:  # (the usual case, at the cost of a comparison)
            _check_meta_size(req.meta)
    else:
        limit = MAX_HEADER_BYTES + ROUTED_HEADROOM if brokered else MAX_HEADER_BYTES
        if len(frame) > MAX_META_BYTES:
            # Only a header this long can hold a `meta` over its bound: measured first
            # (as the broker reads it), before building any of it.
            _check_meta_size(_decode(frame, _DEC_FORWARDING, "request", limit).meta)
        req = _decode(frame, _DEC_REQUEST, "request", limit)
        if req.meta:
            _check_depth(req.meta, "request")
    if not 0 <= req.id < 1 << 64:
        raise ProtocolError(f"request id {req.id} must be an unsigned 64-bit integer")
    if req.priority not in (0, 1, 2):
        raise ProtocolError(f"priority {req.priority} must be 0 (urgent), 1 (normal) or 2 (background)")
    if req.timeout_ms is not None and not req.timeout_ms == req.timeout_ms:  # NaN
        raise ProtocolError("timeout_ms must be a number, not NaN")
    if req.reply not in REPLY_MODES:
        raise ProtocolError(f"reply mode {req.reply!r} must be one of {sorted(REPLY_MODES)}")
    by_ref = check_tensors(req.tensors, n_inline, frames)
    if by_ref and req.host is None and any(type(t.loc) is ShmLoc for t in req.tensors):
        raise ProtocolError("a request with shared-memory tensors must name its host (field 'host')")
    rt = req.reply_to
    if rt is not None:
        if not rt.startswith("ipc:///") or len(rt) > MAX_REPLY_TO_LEN or "\x00" in rt:
            raise ProtocolError(
                f"reply_to must be an absolute ipc:// endpoint of at most {MAX_REPLY_TO_LEN} characters, got {rt[:64]!r}"
            )
        if req.host is None:
            raise ProtocolError("a request with reply_to must name its host (field 'host')")
    tp = req.traceparent
    if tp is not None and not valid_traceparent(tp):
        # W3C Trace Context: a traceparent that does not parse is ignored, never an error.
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("ignored a malformed traceparent %r (request id %d)", tp[:64], req.id)
        req.traceparent = None
    return req


_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_log = logging.getLogger("broker.protocol")


def valid_traceparent(tp: Any) -> bool:
    """Whether `tp` is a W3C traceparent of version 00: ``00-<32 hex>-<16 hex>-<2 hex>``,
    lower-case hex, neither id all zeros."""
    return type(tp) is str and len(tp) == 55 and _TRACEPARENT.fullmatch(tp) is not None


def decode_reply(frame: Any, n_inline: int | None = None, frames: Sequence[Any] | None = None) -> Reply:
    """Decode and validate a reply header (``n_inline`` and ``frames`` as for
    `decode_request`)."""
    rep = _decode(frame, _DEC_REPLY, "reply")
    check_tensors(rep.tensors, n_inline, frames)
    return rep


def decode_cancel(frame: Any) -> Cancel:
    return _decode(frame, _DEC_CANCEL, "cancel")


def decode_welcome(frame: Any) -> Welcome:
    w = _decode(frame, _DEC_WELCOME, "welcome")
    if len(w.instance) != 8:
        raise ProtocolError(f"welcome instance must be 8 bytes, got {len(w.instance)}")
    if not (0 < w.heartbeat_interval <= 3600) or not (1 <= w.heartbeat_liveness <= 1000):
        raise ProtocolError(f"welcome liveness settings out of range: {w.heartbeat_interval} s x {w.heartbeat_liveness}")
    return w


def decode_done_info(frame: Any, n: int) -> DoneInfo:
    """The trailing header of a DONE with `n` envelopes; its lists must have `n` entries."""
    d = _decode(frame, _DEC_DONE_INFO, "done")
    if len(d.codes) != n or len(d.ages_ms) != n:
        raise ProtocolError(f"DONE info has {len(d.codes)} codes and {len(d.ages_ms)} ages for {n} envelopes")
    return d


def decode_worker_stats(frame: Any) -> WorkerStats:
    return _decode(frame, _DEC_STATS, "stats")


#: a reply header's ``error`` key with a nil value, as `encode_header` writes every result's
_NIL_ERROR = b"\xa5error\xc0"


def may_be_error(frame: Any) -> bool:
    """Whether a reply's header frame may carry an error: False for a header that holds the
    ``error`` key with nil (a result, as our workers write it), True otherwise (an error, or
    a header another implementation wrote without the key: `reply_error_code` tells).  About
    0.4 us against the decode's 1 us (a 132-byte result header, here), for the broker that
    reads only the errors (its congestion rule) of every FINAL it relays.  (A worker's unknown key holding a map with
    ``error: nil`` would hide its error from that rule, never from its client.)"""
    try:
        f = frame if type(frame) is bytes else bytes(frame)
    except Exception:
        return True
    return _NIL_ERROR not in f


def reply_error_code(frame: Any) -> int:
    """The error code of a reply's header frame, 0 for a result (or a frame that is not a
    header: an opaque MDP reply).  Reads only `error`, for the broker's outcome counts; a
    header that does not decode, or whose `error` does not (a code that is not a number, no
    message), is an error of unknown code: its client cannot take it for a result either."""
    try:
        mv = memoryview(frame)
        if bytes(mv[:4]) != MAGIC:
            return 0
    except Exception:
        return 0
    try:
        e = _DEC_ERROR_ONLY.decode(mv[4:]).error
    except Exception:
        return _UNKNOWN_CODE
    if e is None:
        return 0
    code = int(e.code)
    return code if code > 0 else _UNKNOWN_CODE  # never 0 (a result) nor a negative (the broker's own)


def reply_error_text(frame: Any) -> str | None:
    """``<code> <NAME>: <message>`` of an error reply's header frame, for a reader without
    msgpack (an MDP/0.1 client: docs/protocol.md section 12.1); None for a result, a frame
    that is not a header, or one that does not decode."""
    try:
        mv = memoryview(frame)
        if bytes(mv[:4]) != MAGIC:
            return None
        e = _DEC_ERROR_ONLY.decode(mv[4:]).error
    except Exception:
        return None
    if e is None:
        return None
    try:
        name = ErrorCode(e.code).name
    except ValueError:
        name = "ERROR"
    return f"{e.code} {name}: {e.message}"


def decode_ready(frame: Any) -> Ready:
    r = _decode(frame, _DEC_READY, "ready")
    if not 1 <= r.credit <= MAX_CREDIT:
        raise ProtocolError(f"credit {r.credit} must be between 1 and {MAX_CREDIT}")
    if r.max_batch < 1:
        raise ProtocolError(f"max_batch {r.max_batch} must be at least 1")
    bad = set(r.transports) - TRANSPORTS
    if bad:
        raise ProtocolError(f"unknown transports {sorted(bad)}; known: {sorted(TRANSPORTS)}")
    if r.direct is not None and not _endpoint_ok(r.direct):
        raise ProtocolError("ready direct must be an ipc:// or tcp:// endpoint of at most 255 characters")
    if r.link is not None and not _link_ok(r.link):
        raise ProtocolError("ready link must be an absolute path of at most 100 characters")
    if r.link is not None and r.direct is None:
        raise ProtocolError("ready link needs a direct socket as well")
    if r.direct_key is not None and not (_z85_key_ok(r.direct_key) and r.direct is not None
                                         and r.direct.startswith("tcp://")):
        raise ProtocolError("ready direct_key must be a 40-character z85 key, with a tcp:// direct socket")
    return r


def _z85_key_ok(key: Any) -> bool:
    from .curve import z85_key  # (zmq.auth: only for the messages that carry a key)

    return isinstance(key, str) and z85_key(key) is not None


def _link_ok(path: Any) -> bool:
    # sun_path holds 108 bytes
    return isinstance(path, str) and path.startswith("/") and 1 < len(path.encode()) <= 100 and "\0" not in path


def _endpoint_ok(ep: Any) -> bool:
    return isinstance(ep, str) and len(ep) <= 255 and ep.startswith(("ipc://", "tcp://")) and len(ep) > 6


def _check_lease_id(lease: bytes, what: str) -> None:
    if len(lease) != 8:
        raise ProtocolError(f"{what} lease id must be 8 bytes, got {len(lease)}")


def decode_lease_ask(frame: Any) -> LeaseAsk:
    a = _decode(frame, _DEC_LEASE_ASK, "lease ask")
    if not 0 <= a.id < 1 << 64:
        raise ProtocolError(f"lease ask id {a.id} must be an unsigned 64-bit integer")
    if not 1 <= a.slots <= 1 << 16:
        raise ProtocolError(f"lease slots {a.slots} must be between 1 and 65536")
    bad = set(a.transports) - TRANSPORTS
    if bad:
        raise ProtocolError(f"unknown transports {sorted(bad)}; known: {sorted(TRANSPORTS)}")
    return a


def decode_lease_grant(frame: Any) -> LeaseGrant:
    g = _decode(frame, _DEC_LEASE_GRANT, "lease grant")
    _check_lease_id(g.lease, "lease grant")
    if len(g.secret) != 16 or not 1 <= g.slots <= 1 << 16:
        raise ProtocolError("lease grant needs a 16-byte secret and 1..65536 slots")
    return g


def decode_lease_info(frame: Any) -> LeaseInfo:
    i = _decode(frame, _DEC_LEASE_INFO, "lease info")
    _check_lease_id(i.lease, "lease info")
    if len(i.secret) != 16 or not _endpoint_ok(i.endpoint) or not 1 <= i.slots <= 1 << 16:
        raise ProtocolError("lease info needs a 16-byte secret, an ipc:// or tcp:// endpoint and 1..65536 slots")
    if i.link is not None and not _link_ok(i.link):
        raise ProtocolError("lease info link must be an absolute path of at most 100 characters")
    if i.server_key is not None and not _z85_key_ok(i.server_key):
        raise ProtocolError("lease info server_key must be a 40-character z85 key")
    return i


def decode_lease_end(frame: Any) -> LeaseEnd:
    e = _decode(frame, _DEC_LEASE_END, "lease end")
    _check_lease_id(e.lease, "lease end")
    if e.reason not in LEASE_REASONS:
        raise ProtocolError(f"lease end reason {e.reason!r} is not one of {sorted(LEASE_REASONS)}")
    return e


def decode_lease_hello(frame: Any) -> LeaseHello:
    h = _decode(frame, _DEC_LEASE_HELLO, "lease hello")
    _check_lease_id(h.lease, "lease hello")
    if len(h.secret) != 16:
        raise ProtocolError("lease hello needs the lease's 16-byte secret")
    return h


_EMPTY_META = msgspec.Raw(b"\x80")


def _check_meta_size(meta: msgspec.Raw) -> None:
    """A `RoutedRequest`'s ``meta``: at most MAX_META_BYTES, and a map (its first byte)."""
    raw = memoryview(meta)
    if raw.nbytes > MAX_META_BYTES:
        raise ProtocolError(f"the request's 'meta' is {raw.nbytes} bytes of msgpack; the limit is {MAX_META_BYTES} "
                            f"(parameters for the model: send data as tensors)")
    if raw.nbytes and raw[0] not in _MAP_TYPES:
        raise ProtocolError("bad request header: 'meta' must be a map")


_CONTAINERS = frozenset({dict, list, tuple})  # what msgspec builds for maps, arrays, array keys


class _TooDeep(Exception):
    pass


def _check_depth(meta: dict, what: str) -> None:
    """Refuse a decoded `meta` that nests deeper than MAX_DEPTH (the header map is level 1,
    `meta` level 2).  A member is looked into only when it is a non-empty container, and a
    container's members only when any is one (`isdisjoint(map(type, ...))` runs at C speed
    over scalars); the recursion stops at MAX_DEPTH, whatever the input."""
    if _CONTAINERS.isdisjoint(map(type, meta.values())):
        return  # the usual case: flat parameters (meta's keys are str, by the schema)
    try:
        _walk(meta.values(), 2)
    except _TooDeep:
        raise ProtocolError(f"{what} header nests deeper than {MAX_DEPTH} levels (in 'meta'); the limit is {MAX_DEPTH}") from None


def _walk(members, depth: int) -> None:
    """`members` belong to a container at level `depth`."""
    for v in members:
        if type(v) in _CONTAINERS:
            if depth >= MAX_DEPTH:
                raise _TooDeep
            if v:
                if type(v) is dict:
                    if not _CONTAINERS.isdisjoint(map(type, v)):  # array keys decode to tuples
                        _walk(v, depth + 1)
                    v = v.values()
                if not _CONTAINERS.isdisjoint(map(type, v)):
                    _walk(v, depth + 1)


@functools.lru_cache(maxsize=512)
def parse_dtype(s: str) -> np.dtype:
    """numpy dtype from its `.str`, refusing dtypes whose bytes are not plain data and dtypes
    of item size 0 (`|V0`, `|S0`, `<U0`: a tensor of them is 0 bytes whatever its shape, so
    no size check could bound what a reader loops over)."""
    if len(s) > MAX_DTYPE_LEN or s.lstrip("<>|=")[:1] == "a":
        # Far longer than any dtype.str, or numpy's deprecated 'a' alias (numpy would warn on
        # every such message): numpy is not asked.
        raise ProtocolError(f"unknown dtype {s[:MAX_DTYPE_LEN]!r}; use numpy's dtype.str, e.g. '<f4' or '|u1'")
    try:
        import numpy as np  # here, not at the top: a broker reads the common dtypes without it (`_itemsize`)
    except (OSError, ImportError) as e:
        # A broker loads numpy here, for its first uncommon dtype: with no descriptor or
        # memory left that fails, which says nothing of the request (503: send it again).
        err = ProtocolError(f"cannot check dtype {s[:MAX_DTYPE_LEN]!r} now ({type(e).__name__}: {e}); "
                            f"send it again")
        err.code = ErrorCode.SERVICE_UNAVAILABLE
        raise err from None
    try:
        dt = np.dtype(s)
    except Exception:  # TypeError, ValueError, or whatever numpy's parser makes of a hostile string
        raise ProtocolError(f"unknown dtype {s!r}; use numpy's dtype.str, e.g. '<f4' or '|u1'") from None
    if dt.hasobject:
        raise ProtocolError(f"dtype {s!r} holds Python objects, which cannot cross processes")
    if dt.str != s:
        # Ambiguous spellings ('float', 'i') would make two peers disagree on the size.
        raise ProtocolError(f"dtype {s!r} is not canonical; send numpy's dtype.str ({dt.str!r})")
    if dt.itemsize == 0:
        raise ProtocolError(f"dtype {s!r} has item size 0; zero-size dtypes are refused (give the item a size, e.g. '|S1')")
    return dt


def dtype_str(dt: np.dtype) -> str:
    return dt.str


#: item sizes of numpy's canonical `dtype.str` for the plain numbers, bool and the sized
#: bytes, strings and voids: what `parse_dtype` accepts, told without numpy, so that the
#: broker, which checks every tensor it relays (`tensor_nbytes`) and reads nothing else of a
#: dtype, never loads numpy (tests/broker/test_start_imports.py checks the two agree)
_PLAIN_ITEMSIZE = {"|b1": 1, "|i1": 1, "|u1": 1, **{f"{o}{k}{n}": n for o in "<>" for k, ns in
                   (("i", (2, 4, 8)), ("u", (2, 4, 8)), ("f", (2, 4, 8)), ("c", (8, 16))) for n in ns}}
_SIZED_DTYPE = re.compile(r"(?:\|([SV])|([<>])U)([1-9][0-9]{0,7})")


def _itemsize(s: str) -> int:
    """The item size of dtype string ``s`` as `parse_dtype(s).itemsize` gives it (and its
    refusals), without numpy for the common canonical strings."""
    n = _PLAIN_ITEMSIZE.get(s)
    if n is not None:
        return n
    m = _SIZED_DTYPE.fullmatch(s) if type(s) is str else None
    if m is not None:
        return int(m.group(3)) * (4 if m.group(2) else 1)
    return parse_dtype(s).itemsize  # datetimes and anything else: numpy's word


def tensor_nbytes(ref: TensorRef) -> int:
    """Bytes of a tensor: itemsize x prod(shape).  Raises ProtocolError for a dtype that
    `parse_dtype` refuses, a negative dimension, or a tensor over MAX_TENSOR_BYTES (each 0
    dimension counted as 1), computed with Python ints and without numpy allocating."""
    n = _itemsize(ref.dtype)
    empty = False
    for d in ref.shape:
        if d <= 0:
            if d < 0:
                raise ProtocolError(f"tensor {ref.name!r} has a negative dimension in shape {_short(ref.shape)}")
            empty = True
            continue
        n *= d
        if n > MAX_TENSOR_BYTES:
            raise ProtocolError(
                f"tensor {ref.name!r}: dtype {ref.dtype} and shape {_short(ref.shape)} describe more than "
                f"{MAX_TENSOR_BYTES} bytes (counting 0 dimensions as 1); the limit is {MAX_TENSOR_BYTES}"
            )
    return 0 if empty else n


def claimed_nbytes(shape: Sequence[int], itemsize: int) -> int:
    """The bytes a header with this shape and item size describes, each 0 dimension counted
    as 1, as `tensor_nbytes` counts them against MAX_TENSOR_BYTES: an empty array whose
    claim is over the limit has a header every peer refuses (a sender checks this first)."""
    n = itemsize
    for d in shape:
        n *= d or 1
    return n


def _short(shape: Sequence[int]) -> str:
    return str(list(shape)) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dims)"


def check_tensors(tensors: Sequence[TensorRef], n_inline: int | None,
                  frames: Sequence[Any] | None = None) -> bool:
    """Validate tensor references (names, dimensions, sizes, locations; with ``frames``,
    the frames after the header, also each inline frame's size, as `check_inline_sizes`);
    whether any tensor is not inline."""
    if len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"{len(tensors)} tensors in one message; the limit is {MAX_TENSORS}")
    if frames is not None:
        n_inline = len(frames)
    by_ref = False
    names = set()
    for t in tensors:
        if t.name in names:
            raise ProtocolError(f"tensor name {t.name!r} appears twice")
        if not t.name:
            # (a model cannot name an output so either: a plain client's input named "" was
            # answered 500, the worker failing to send its echo; the interop audit)
            raise ProtocolError("a tensor name may not be empty")
        names.add(t.name)
        if len(t.shape) > MAX_NDIM:
            raise ProtocolError(f"tensor {t.name!r} has {len(t.shape)} dimensions; the limit is {MAX_NDIM}")
        nbytes = tensor_nbytes(t)  # dtype, negative and absurd dimensions
        loc = t.loc
        if type(loc) is InlineLoc:
            if loc.frame < 0 or (n_inline is not None and loc.frame >= n_inline):
                raise ProtocolError(
                    f"tensor {t.name!r} refers to inline frame {loc.frame}, but the message has "
                    f"{n_inline} frames after the header"
                )
            if frames is not None:
                got = memoryview(frames[loc.frame]).nbytes
                if got != nbytes:
                    raise ProtocolError(
                        f"tensor {t.name!r}: inline frame {loc.frame} has {got} bytes; "
                        f"dtype {t.dtype} and shape {t.shape} need {nbytes}"
                    )
        else:
            by_ref = True
            if loc.offset < 0 or loc.nbytes != nbytes:
                raise ProtocolError(
                    f"tensor {t.name!r}: location says {loc.nbytes} bytes at offset {loc.offset}, "
                    f"but dtype {t.dtype} and shape {t.shape} need {nbytes}"
                )
    return by_ref


def check_inline_sizes(tensors: Sequence[TensorRef], frames: Sequence[Any]) -> None:
    """Inline frames must hold exactly the bytes their reference describes."""
    for t in tensors:
        if type(t.loc) is InlineLoc:
            if not 0 <= t.loc.frame < len(frames):
                raise ProtocolError(
                    f"tensor {t.name!r} refers to inline frame {t.loc.frame}, but the message has "
                    f"{len(frames)} frames after the header"
                )
            got = memoryview(frames[t.loc.frame]).nbytes
            want = tensor_nbytes(t)
            if got != want:
                raise ProtocolError(
                    f"tensor {t.name!r}: inline frame {t.loc.frame} has {got} bytes; "
                    f"dtype {t.dtype} and shape {t.shape} need {want}"
                )


class _IdOnly(msgspec.Struct):
    id: int = 0


_DEC_ID = msgspec.msgpack.Decoder(_IdOnly)

# Bytes that follow a msgpack scalar's first byte (fixed-size formats), for `_scan_id`.
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
          0xD3: 8, 0xCA: 4, 0xCB: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
# Formats whose first byte is followed by a big-endian length of 1, 2 or 4 bytes, then that
# many bytes (ext: one type byte more).
_SIZED = {0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0), 0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),
          0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}


def _scan_id(b: bytes) -> int:
    """`id` from the top-level map of msgpack bytes `b`, reading key by key and skipping only
    scalar values: no recursion, whatever follows (our peers send `v`, then `id`).  0 when a
    container comes before `id` or anything is malformed."""
    if not b:
        return 0
    t = b[0]
    if 0x80 <= t <= 0x8F:
        n, i = t & 0x0F, 1
    elif t == 0xDE:
        n, i = int.from_bytes(b[1:3], "big"), 3
    elif t == 0xDF:
        n, i = int.from_bytes(b[1:5], "big"), 5
    else:
        return 0
    end = len(b)
    for _ in range(min(n, 64)):
        if i >= end:
            return 0
        # key: a string
        t = b[i]
        if 0xA0 <= t <= 0xBF:
            kl, i = t & 0x1F, i + 1
        elif t in (0xD9, 0xDA, 0xDB):
            w = _SIZED[t][0]
            kl, i = int.from_bytes(b[i + 1:i + 1 + w], "big"), i + 1 + w
        else:
            return 0
        key = b[i:i + kl]
        i += kl
        if i >= end:
            return 0
        t = b[i]
        if key == b"id":
            if t <= 0x7F:
                return t
            if t in (0xCC, 0xCD, 0xCE, 0xCF):
                w = _FIXED[t]
                raw = b[i + 1:i + 1 + w]
                return int.from_bytes(raw, "big") if len(raw) == w else 0
            return 0
        # skip a scalar value
        if t <= 0x7F or t >= 0xE0:
            i += 1
        elif 0xA0 <= t <= 0xBF:
            i += 1 + (t & 0x1F)
        elif t in _FIXED:
            i += 1 + _FIXED[t]
        elif t in _SIZED:
            w, extra = _SIZED[t]
            i += 1 + w + extra + int.from_bytes(b[i + 1:i + 1 + w], "big")
        else:
            return 0  # a container (or 0xC1): give up rather than recurse
    return 0


# What our encoder writes first in every header (msgspec keeps the fields' order): a map,
# then `v` = 1 and the key `id`.
_V1_ID = b"\xa1v\x01\xa2id"
_UINT_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def header_id(frame: Any) -> int | None:
    """`id` of a header frame as its sender wrote it, for a relay that checks whose answer a
    reply is without decoding it (the broker, at each reply it relays): a few bytes read when
    the header starts as ours do (`v`, then `id`, and no `id` key after it), else as
    `lenient_request_id` reads it (0 when it cannot be read).  None for a frame that is not
    a header."""
    try:
        mv = memoryview(frame)
        data = mv[:4096].tobytes()
    except Exception:
        return None
    if data[:4] != MAGIC:
        return None
    if len(data) > 11 and 0x80 <= data[4] <= 0x8F and data[5:11] == _V1_ID:  # (a frame cut short: lenient)
        t = data[11]
        rid = None
        if t <= 0x7F:
            rid, end = t, 12
        else:
            w = _UINT_WIDTH.get(t)
            if w is not None and len(data) >= 12 + w:
                rid, end = int.from_bytes(data[12:12 + w], "big"), 12 + w
        # ...unless an `id` key may come again after it, which a decoder reads last (msgspec,
        # our clients'): a worker that wrote two named another request than the one it was
        # checked as (the interop audit).  The two bytes are looked for bare, so that a key
        # written in a longer string format (str8: d9 02 "id") is seen too (found by review);
        # those bytes elsewhere (a tensor named "id", a float's bits), or a header over 4
        # KiB, cost the decode below, which reads what a client reads.
        if rid is not None and mv.nbytes <= 4096 and data.find(b"id", end) < 0:
            return rid
    return lenient_request_id(frame)


def lenient_request_id(frame: Any) -> int:
    """Best-effort request id from a header that failed validation, so that the error reaches
    the right call on the client; 0 when even that is unreadable.  Never raises: msgspec
    decodes only `id` (other keys are skipped without building anything); when that fails
    too (a header nested too deep for msgspec, say), `_scan_id` reads the top-level keys
    that precede `id` without recursing; of a header over MAX_HEADER_BYTES, only that scan
    of its first 4 KiB."""
    try:
        mv = memoryview(frame)
        if mv.nbytes < 5:
            return 0
        body = mv[4:]
        try:
            if mv.nbytes > MAX_HEADER_BYTES:
                raise ValueError  # not decoded: only its first bytes are read
            rid = _DEC_ID.decode(body).id
        except Exception:
            # A header over the limit too: its id is among its first keys, and the refusal
            # must reach the call that sent it (with 0, the call waited out its deadline).
            rid = _scan_id(bytes(body[:4096]))
        return rid if type(rid) is int and 0 <= rid < 1 << 64 else 0
    except Exception:
        return 0
