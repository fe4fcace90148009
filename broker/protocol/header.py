"""Header frames: the msgpack map that follows MAGIC in a tensor message's first body frame.

Every header a peer sends is decoded and validated here (msgspec checks types while it
decodes; the `check_*` functions check the rest), and every failure is one `ProtocolError`
whose message names the field.  The field-by-field description for implementers in other
languages is docs/protocol.md section 3; the struct definitions below are the authority.

Must never: touch a socket, read a clock, or import a process package (broker state or
server, gpu_worker, client_sdk).
"""
from __future__ import annotations

import functools
from enum import IntEnum
from typing import Any, Sequence, Union

import msgspec
import numpy as np

__all__ = ["MAGIC", "VERSION", "MMI_PREFIX", "MAX_SERVICE_LEN", "MAX_ENVELOPE_LEN",
    "MAX_TENSORS", "MAX_NDIM", "MAX_HEADER_BYTES", "MAX_REPLY_TO_LEN", "MAX_DONE", "MAX_MMI_TOKEN", "ErrorCode",
    "Priority", "ProtocolError", "InlineLoc", "ShmLoc", "CudaLoc", "Location", "TensorRef",
    "ErrorInfo", "Request", "Reply", "Cancel", "Ready", "Welcome", "TRANSPORTS", "REPLY_MODES", "is_header",
    "encode_header", "decode_request", "decode_reply", "decode_cancel", "decode_ready", "decode_welcome",
    "parse_dtype", "dtype_str", "tensor_nbytes", "check_tensors", "check_inline_sizes", "lenient_request_id",
]

# --------------------------------------------------------------------------------------------
# Constants

MAGIC = b"\xc1ZNF"
VERSION = 1
MMI_PREFIX = "mmi."

MAX_SERVICE_LEN = 255
MAX_ENVELOPE_LEN = 255
MAX_TENSORS = 256
MAX_NDIM = 32
MAX_HEADER_BYTES = 1 << 20
MAX_REPLY_TO_LEN = 255
MAX_DONE = 4096          # envelopes in one DONE
MAX_MMI_TOKEN = 64       # bytes of the correlation token an MMI answer echoes


class ErrorCode(IntEnum):
    """Typed error codes carried in a FINAL's header (`error.code`).  HTTP-like numbers so
    that a human reading a packet capture guesses right."""

    PROTOCOL_ERROR = 400
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
    host: str | None = None           # sender's shared-memory host id; required with shm refs
    pid: int | None = None            # sender's pid, so a worker can reclaim output slots of a dead client
    reply: str = "auto"               # "auto" | "shm" | "inline" | "cuda": how outputs come back
    tensors: list[TensorRef] = []
    meta: dict[str, Any] = {}         # free-form, for the model
    queue_ms: float | None = None     # set by the broker at dispatch: time spent in its queue
    reply_to: str | None = None       # "ipc://..." bound by the client: a same-host worker may send the FINAL there


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


class Ready(msgspec.Struct, kw_only=True):
    """Optional 4th frame of READY: what this worker can take."""

    v: int = VERSION
    credit: int = 1
    max_batch: int = 1
    host: str | None = None
    transports: list[str] = msgspec.field(default_factory=lambda: ["inline"])
    pid: int | None = None
    welcome: bool = False   # the worker understands WELCOME (the broker then sends one)


class Welcome(msgspec.Struct, kw_only=True):
    """Header of WELCOME (broker -> worker), the answer to a READY that asked for one: the
    worker is registered, with which broker process, and at what liveness settings."""

    v: int = VERSION
    instance: bytes                # 8 bytes, new at every broker start
    heartbeat_interval: float      # seconds; the worker heartbeats at this rate
    heartbeat_liveness: int        # missed intervals before either side presumes the other dead


_ENC = msgspec.msgpack.Encoder()
_DEC_REQUEST = msgspec.msgpack.Decoder(Request)
_DEC_REPLY = msgspec.msgpack.Decoder(Reply)
_DEC_CANCEL = msgspec.msgpack.Decoder(Cancel)
_DEC_READY = msgspec.msgpack.Decoder(Ready)
_DEC_WELCOME = msgspec.msgpack.Decoder(Welcome)

TRANSPORTS = frozenset({"inline", "shm", "cuda"})
REPLY_MODES = frozenset({"auto", "shm", "inline", "cuda"})


# --------------------------------------------------------------------------------------------
# Header encode / decode

def is_header(frame: Any) -> bool:
    """True if a body frame is one of our header frames (starts with MAGIC)."""
    return bytes(memoryview(frame)[:4]) == MAGIC


def encode_header(msg: Request | Reply | Cancel | Ready) -> bytes:
    return MAGIC + _ENC.encode(msg)


def _decode(frame: Any, decoder: msgspec.msgpack.Decoder, what: str):
    mv = memoryview(frame)
    if mv.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"{what} header is {mv.nbytes} bytes; the limit is {MAX_HEADER_BYTES}")
    if mv[:4] != MAGIC:
        raise ProtocolError(f"{what} header frame must start with the 4-byte magic C1 5A 4E 46")
    try:
        msg = decoder.decode(mv[4:])
    except msgspec.DecodeError as e:  # covers ValidationError
        raise ProtocolError(f"bad {what} header: {e}") from None
    if msg.v != VERSION:
        raise ProtocolError(
            f"{what} header version {msg.v} is not supported; this peer speaks version {VERSION}"
        )
    return msg


def decode_request(frame: Any, n_inline: int | None = None) -> Request:
    """Decode and validate a request header.  `n_inline` is the number of frames after the
    header; when given, inline references are checked against it and their sizes later by
    `check_inline_sizes`."""
    req = _decode(frame, _DEC_REQUEST, "request")
    if not 0 <= req.id < 1 << 64:
        raise ProtocolError(f"request id {req.id} must be an unsigned 64-bit integer")
    if req.priority not in (0, 1, 2):
        raise ProtocolError(f"priority {req.priority} must be 0 (urgent), 1 (normal) or 2 (background)")
    if req.timeout_ms is not None and not req.timeout_ms == req.timeout_ms:  # NaN
        raise ProtocolError("timeout_ms must be a number, not NaN")
    if req.reply not in REPLY_MODES:
        raise ProtocolError(f"reply mode {req.reply!r} must be one of {sorted(REPLY_MODES)}")
    check_tensors(req.tensors, n_inline)
    if req.host is None and any(type(t.loc) is ShmLoc for t in req.tensors):
        raise ProtocolError("a request with shared-memory tensors must name its host (field 'host')")
    rt = req.reply_to
    if rt is not None:
        if not rt.startswith("ipc:///") or len(rt) > MAX_REPLY_TO_LEN or "\x00" in rt:
            raise ProtocolError(
                f"reply_to must be an absolute ipc:// endpoint of at most {MAX_REPLY_TO_LEN} characters, got {rt[:64]!r}"
            )
        if req.host is None:
            raise ProtocolError("a request with reply_to must name its host (field 'host')")
    return req


def decode_reply(frame: Any, n_inline: int | None = None) -> Reply:
    rep = _decode(frame, _DEC_REPLY, "reply")
    check_tensors(rep.tensors, n_inline)
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


def decode_ready(frame: Any) -> Ready:
    r = _decode(frame, _DEC_READY, "ready")
    if not 1 <= r.credit <= 1 << 16:
        raise ProtocolError(f"credit {r.credit} must be between 1 and 65536")
    if r.max_batch < 1:
        raise ProtocolError(f"max_batch {r.max_batch} must be at least 1")
    bad = set(r.transports) - TRANSPORTS
    if bad:
        raise ProtocolError(f"unknown transports {sorted(bad)}; known: {sorted(TRANSPORTS)}")
    return r


@functools.lru_cache(maxsize=512)
def parse_dtype(s: str) -> np.dtype:
    """numpy dtype from its `.str`, refusing dtypes whose bytes are not plain data."""
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):
        raise ProtocolError(f"unknown dtype {s!r}; use numpy's dtype.str, e.g. '<f4' or '|u1'") from None
    if dt.hasobject:
        raise ProtocolError(f"dtype {s!r} holds Python objects, which cannot cross processes")
    if dt.str != s:
        # Ambiguous spellings ('float', 'i') would make two peers disagree on the size.
        raise ProtocolError(f"dtype {s!r} is not canonical; send numpy's dtype.str ({dt.str!r})")
    return dt


def dtype_str(dt: np.dtype) -> str:
    return dt.str


def tensor_nbytes(ref: TensorRef) -> int:
    n = parse_dtype(ref.dtype).itemsize
    for d in ref.shape:
        n *= d
    return n


def check_tensors(tensors: Sequence[TensorRef], n_inline: int | None) -> None:
    if len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"{len(tensors)} tensors in one message; the limit is {MAX_TENSORS}")
    names = set()
    for t in tensors:
        if t.name in names:
            raise ProtocolError(f"tensor name {t.name!r} appears twice")
        names.add(t.name)
        if len(t.shape) > MAX_NDIM:
            raise ProtocolError(f"tensor {t.name!r} has {len(t.shape)} dimensions; the limit is {MAX_NDIM}")
        for d in t.shape:
            if d < 0:
                raise ProtocolError(f"tensor {t.name!r} has a negative dimension in shape {t.shape}")
        nbytes = tensor_nbytes(t)
        loc = t.loc
        if type(loc) is InlineLoc:
            if loc.frame < 0 or (n_inline is not None and loc.frame >= n_inline):
                raise ProtocolError(
                    f"tensor {t.name!r} refers to inline frame {loc.frame}, but the message has "
                    f"{n_inline} frames after the header"
                )
        else:
            if loc.offset < 0 or loc.nbytes != nbytes:
                raise ProtocolError(
                    f"tensor {t.name!r}: location says {loc.nbytes} bytes at offset {loc.offset}, "
                    f"but dtype {t.dtype} and shape {t.shape} need {nbytes}"
                )


def check_inline_sizes(tensors: Sequence[TensorRef], frames: Sequence[Any]) -> None:
    """Inline frames must hold exactly the bytes their reference describes."""
    for t in tensors:
        if type(t.loc) is InlineLoc:
            got = memoryview(frames[t.loc.frame]).nbytes
            want = tensor_nbytes(t)
            if got != want:
                raise ProtocolError(
                    f"tensor {t.name!r}: inline frame {t.loc.frame} has {got} bytes; "
                    f"dtype {t.dtype} and shape {t.shape} need {want}"
                )


def lenient_request_id(frame: Any) -> int:
    """Best-effort request id from a header that failed validation, so that the error reaches
    the right call on the client; 0 when even that is unreadable."""
    try:
        m = msgspec.msgpack.decode(memoryview(frame)[4:])
        rid = m.get("id") if isinstance(m, dict) else None
        return rid if isinstance(rid, int) and 0 <= rid < 1 << 64 else 0
    except Exception:
        return 0
