"""The wire protocol: the single source of truth for every frame and header field.

Clients, the broker and workers all encode and decode through this module; nothing else in
the project builds or parses a frame.  It touches no socket and reads no clock.  Everything a
peer sends is validated here, and every failure is one typed error, `ProtocolError`, with a
message that names the field; callers log it and answer or drop the one message, never more.

Framing is Majordomo MDP/0.2 (ZeroMQ RFC 18) and MMI (RFC 8), extended in a way that a plain
MDP/0.2 peer never notices: a tensor request carries, as its first body frame, a *header
frame* that starts with `MAGIC` (0xC1 is the one byte that msgpack never emits, so no msgpack
body can start with it), followed by a msgpack map.  docs/protocol.md is the prose form of
this module, written for someone implementing a peer in another language.

Frames as seen by the broker (ROUTER sockets prepend the peer identity, stripped before
these functions see them):

Client -> broker (client uses DEALER; a REQ client's leading empty frame is tolerated)
    REQUEST     "MDPC02", 0x01, service, body...            body = [header, inline...] or opaque
    HEARTBEAT   "MDPC02", 0x04                               extension: client liveness
    CANCEL      "MDPC02", 0x05, service, header(Cancel)      extension
    DISCONNECT  "MDPC02", 0x06                               extension
Broker -> client
    PARTIAL     "MDPC02", 0x02, service, body...
    FINAL       "MDPC02", 0x03, service, body...            an error is a FINAL whose header has `error`
    HEARTBEAT   "MDPC02", 0x04                               reply to a client heartbeat
Worker -> client, on the client's reply_to socket only (direct reply)
    FINAL       "MDPC02", 0x03, service, body...             as the broker would relay it
    FINALS      "MDPC02", 0x07, service, header, header...   several FINALs that have no inline frames
Worker -> broker (worker uses DEALER)
    READY       "MDPW02", 0x01, service [, header(Ready)]   a bare 3-frame READY: credit 1, inline only
    PARTIAL     "MDPW02", 0x03, envelope, "", body...
    FINAL       "MDPW02", 0x04, envelope, "", body...
    HEARTBEAT   "MDPW02", 0x05
    DISCONNECT  "MDPW02", 0x06
    DONE        "MDPW02", 0x08, envelope...                  extension: these FINALs went straight to their clients
Broker -> worker
    REQUEST     "MDPW02", 0x02, envelope, "", body...
    HEARTBEAT   "MDPW02", 0x05
    DISCONNECT  "MDPW02", 0x06
    CANCEL      "MDPW02", 0x07, envelope                     extension: drop this request if you still can

`envelope` is what RFC 18 calls the client address: an opaque frame of at most 255 bytes that
the worker returns unchanged.  Our broker puts its dispatch token there (8 bytes, big endian).

Direct reply (extension, docs/protocol.md section 8): a same-host client may name, in its
request header, an ipc endpoint it has bound (`reply_to`).  A worker that can reach it sends
the FINAL there, framed exactly as the broker would (MDPC02, 0x03, service, body...), and then
tells the broker with DONE, which settles the request without a relay.  A plain MDP peer never
sets or reads `reply_to`, so it keeps the relayed path.
"""
from __future__ import annotations

import functools
import hashlib
import os
import socket
from enum import IntEnum
from typing import Any, Iterable, Sequence, Union

import msgspec
import numpy as np

# --------------------------------------------------------------------------------------------
# Constants

MDPC = b"MDPC02"
MDPW = b"MDPW02"

# Client sub-protocol commands (RFC 18 defines 0x01..0x03; 0x04.. are our extensions).
C_REQUEST = b"\x01"
C_PARTIAL = b"\x02"
C_FINAL = b"\x03"
C_HEARTBEAT = b"\x04"
C_CANCEL = b"\x05"
C_DISCONNECT = b"\x06"
C_FINALS = b"\x07"   # direct reply only: several header-only FINALs in one message

# Worker sub-protocol commands (RFC 18 defines 0x01..0x06; 0x07 is our extension).
W_READY = b"\x01"
W_REQUEST = b"\x02"
W_PARTIAL = b"\x03"
W_FINAL = b"\x04"
W_HEARTBEAT = b"\x05"
W_DISCONNECT = b"\x06"
W_CANCEL = b"\x07"
W_DONE = b"\x08"

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


class ErrorCode(IntEnum):
    """Typed error codes carried in a FINAL's header (`error.code`).  HTTP-like numbers so
    that a human reading a packet capture guesses right."""

    PROTOCOL_ERROR = 400
    NOT_LOCAL = 421
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
# Header schema.  msgspec validates types while decoding; `_check_*` validates the rest.

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
    """Bytes live in a CUDA device memory pool exported once by the sender (GPU issue).

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


_ENC = msgspec.msgpack.Encoder()
_DEC_REQUEST = msgspec.msgpack.Decoder(Request)
_DEC_REPLY = msgspec.msgpack.Decoder(Reply)
_DEC_CANCEL = msgspec.msgpack.Decoder(Cancel)
_DEC_READY = msgspec.msgpack.Decoder(Ready)

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


# --------------------------------------------------------------------------------------------
# Host identity: two processes may exchange shm references only if they see the same /dev/shm.

@functools.lru_cache(maxsize=1)
def local_host_id() -> str:
    """Identity of this process's shared-memory domain: same boot, same /dev/shm mount.

    The hostname alone is not enough (containers share it but not /dev/shm; a reboot keeps it
    but empties /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover - non-Linux
        boot = "noboot"
    try:
        st = os.stat("/dev/shm")
        mount = f"{st.st_dev}:{st.st_ino}"
    except OSError:  # pragma: no cover
        mount = "noshm"
    digest = hashlib.blake2s(f"{boot}/{mount}".encode(), digest_size=8).hexdigest()
    return f"{socket.gethostname()}/{digest}"


# --------------------------------------------------------------------------------------------
# Frame builders

def _service_bytes(service: str | bytes) -> bytes:
    b = service.encode() if isinstance(service, str) else bytes(service)
    if not b or len(b) > MAX_SERVICE_LEN:
        raise ProtocolError(f"service name must be 1..{MAX_SERVICE_LEN} bytes, got {len(b)}")
    return b


def client_request(service: str, body: Iterable[Any]) -> list[Any]:
    return [MDPC, C_REQUEST, _service_bytes(service), *body]


def client_cancel(service: str, request_id: int) -> list[Any]:
    return [MDPC, C_CANCEL, _service_bytes(service), encode_header(Cancel(id=request_id))]


def client_heartbeat() -> list[bytes]:
    return [MDPC, C_HEARTBEAT]


def client_disconnect() -> list[bytes]:
    return [MDPC, C_DISCONNECT]


def to_client(identity: bytes, final: bool, service: bytes, body: Iterable[Any]) -> list[Any]:
    return [identity, MDPC, C_FINAL if final else C_PARTIAL, service, *body]


def error_body(request_id: int, code: int, message: str) -> list[bytes]:
    return [encode_header(Reply(id=request_id, error=ErrorInfo(code=int(code), message=message)))]


def worker_ready(service: str, caps: Ready | None = None) -> list[bytes]:
    frames = [MDPW, W_READY, _service_bytes(service)]
    if caps is not None:
        frames.append(encode_header(caps))
    return frames


def worker_reply(envelope: bytes, final: bool, body: Iterable[Any]) -> list[Any]:
    return [MDPW, W_FINAL if final else W_PARTIAL, envelope, b"", *body]


def worker_done(envelopes: Sequence[bytes]) -> list[bytes]:
    return [MDPW, W_DONE, *envelopes]


def direct_reply(final: bool, service: bytes, body: Iterable[Any]) -> list[Any]:
    """A reply a worker sends straight to a client's `reply_to` socket: the frames the
    broker would have relayed (no identity: the socket is the client's own)."""
    return [MDPC, C_FINAL if final else C_PARTIAL, service, *body]


def direct_finals(service: bytes, headers: Sequence[Any]) -> list[Any]:
    """Several header-only FINALs for one client in one message (a batch's replies)."""
    return [MDPC, C_FINALS, service, *headers]


def worker_heartbeat() -> list[bytes]:
    return [MDPW, W_HEARTBEAT]


def worker_disconnect() -> list[bytes]:
    return [MDPW, W_DISCONNECT]


def to_worker_request(identity: bytes, envelope: bytes, body: Iterable[Any]) -> list[Any]:
    return [identity, MDPW, W_REQUEST, envelope, b"", *body]


def to_worker_cancel(identity: bytes, envelope: bytes) -> list[bytes]:
    return [identity, MDPW, W_CANCEL, envelope]


def token_envelope(token: int) -> bytes:
    return token.to_bytes(8, "big")


def envelope_token(envelope: Any) -> int | None:
    """The broker's token from an envelope, or None if the envelope is not one of ours."""
    b = bytes(envelope)
    return int.from_bytes(b, "big") if len(b) == 8 else None


# --------------------------------------------------------------------------------------------
# Frame parsers.  Each returns a small tuple-like object or raises ProtocolError.

class ClientMessage(msgspec.Struct, frozen=True):
    command: bytes
    service: bytes = b""
    body: tuple = ()            # frames after the service name
    leading_empty: bool = False  # a REQ-style client: echo the empty delimiter back


def parse_client(frames: Sequence[Any]) -> ClientMessage:
    """Parse frames from a client (identity already removed)."""
    lead = False
    if frames and len(frames[0]) == 0:
        lead = True
        frames = frames[1:]
    if len(frames) < 2:
        raise ProtocolError(f"client message has {len(frames)} frames; expected at least 2 (MDPC02, command)")
    if bytes(frames[0]) != MDPC:
        raise ProtocolError(f"client message must start with MDPC02, got {bytes(frames[0])[:16]!r}")
    cmd = bytes(frames[1])
    if cmd in (C_REQUEST, C_CANCEL):
        if len(frames) < 4:
            raise ProtocolError("REQUEST/CANCEL needs a service name and at least one body frame")
        service = bytes(frames[2])
        if not service or len(service) > MAX_SERVICE_LEN:
            raise ProtocolError(f"service name must be 1..{MAX_SERVICE_LEN} bytes")
        return ClientMessage(cmd, service, tuple(frames[3:]), lead)
    if cmd in (C_HEARTBEAT, C_DISCONNECT):
        return ClientMessage(cmd, b"", (), lead)
    raise ProtocolError(f"unknown client command {cmd!r}")


class WorkerMessage(msgspec.Struct, frozen=True):
    command: bytes
    service: bytes = b""        # READY
    ready: Ready | None = None  # READY with capabilities
    envelope: bytes = b""       # PARTIAL / FINAL
    body: tuple = ()            # PARTIAL / FINAL body; DONE: the envelopes (bytes)


def parse_worker(frames: Sequence[Any]) -> WorkerMessage:
    """Parse frames from a worker (identity already removed)."""
    if frames and len(frames[0]) == 0:  # tolerate a REQ-era empty delimiter
        frames = frames[1:]
    if len(frames) < 2:
        raise ProtocolError(f"worker message has {len(frames)} frames; expected at least 2 (MDPW02, command)")
    if bytes(frames[0]) != MDPW:
        raise ProtocolError(f"worker message must start with MDPW02, got {bytes(frames[0])[:16]!r}")
    cmd = bytes(frames[1])
    if cmd == W_READY:
        if len(frames) not in (3, 4):
            raise ProtocolError("READY is MDPW02, 0x01, service [, capabilities]")
        service = bytes(frames[2])
        if not service or len(service) > MAX_SERVICE_LEN:
            raise ProtocolError(f"service name must be 1..{MAX_SERVICE_LEN} bytes")
        if service.startswith(MMI_PREFIX.encode()):
            raise ProtocolError("service names starting with 'mmi.' are reserved for the broker")
        ready = decode_ready(frames[3]) if len(frames) == 4 else None
        return WorkerMessage(cmd, service=service, ready=ready)
    if cmd in (W_PARTIAL, W_FINAL):
        if len(frames) < 4:
            raise ProtocolError("PARTIAL/FINAL is MDPW02, cmd, envelope, empty, body...")
        if len(frames[3]) != 0:
            raise ProtocolError("PARTIAL/FINAL frame 3 must be the empty envelope delimiter")
        env = bytes(frames[2])
        if len(env) > MAX_ENVELOPE_LEN:
            raise ProtocolError("envelope longer than 255 bytes")
        return WorkerMessage(cmd, envelope=env, body=tuple(frames[4:]))
    if cmd == W_DONE:
        n = len(frames) - 2
        if not 1 <= n <= MAX_DONE:
            raise ProtocolError(f"DONE carries {n} envelopes; expected 1..{MAX_DONE}")
        envs = tuple(bytes(f) for f in frames[2:])
        if any(len(e) > MAX_ENVELOPE_LEN for e in envs):
            raise ProtocolError("envelope longer than 255 bytes")
        return WorkerMessage(cmd, body=envs)
    if cmd in (W_HEARTBEAT, W_DISCONNECT):
        return WorkerMessage(cmd)
    raise ProtocolError(f"unknown worker command {cmd!r}")


class BrokerToClient(msgspec.Struct, frozen=True):
    command: bytes
    service: bytes = b""
    body: tuple = ()


def parse_broker_to_client(frames: Sequence[Any]) -> BrokerToClient:
    if frames and len(frames[0]) == 0:
        frames = frames[1:]
    if len(frames) < 2 or bytes(frames[0]) != MDPC:
        raise ProtocolError("broker message to a client must start with MDPC02 and a command")
    cmd = bytes(frames[1])
    if cmd in (C_PARTIAL, C_FINAL):
        if len(frames) < 3:
            raise ProtocolError("PARTIAL/FINAL needs a service name")
        return BrokerToClient(cmd, bytes(frames[2]), tuple(frames[3:]))
    if cmd == C_FINALS:
        if len(frames) < 4:
            raise ProtocolError("FINALS is MDPC02, 0x07, service, header, header...")
        return BrokerToClient(cmd, bytes(frames[2]), tuple(frames[3:]))
    if cmd == C_HEARTBEAT:
        return BrokerToClient(cmd)
    raise ProtocolError(f"unknown command {cmd!r} from broker")


class BrokerToWorker(msgspec.Struct, frozen=True):
    command: bytes
    envelope: bytes = b""
    body: tuple = ()


def parse_broker_to_worker(frames: Sequence[Any]) -> BrokerToWorker:
    if frames and len(frames[0]) == 0:
        frames = frames[1:]
    if len(frames) < 2 or bytes(frames[0]) != MDPW:
        raise ProtocolError("broker message to a worker must start with MDPW02 and a command")
    cmd = bytes(frames[1])
    if cmd == W_REQUEST:
        if len(frames) < 4 or len(frames[3]) != 0:
            raise ProtocolError("REQUEST is MDPW02, 0x02, envelope, empty, body...")
        return BrokerToWorker(cmd, bytes(frames[2]), tuple(frames[4:]))
    if cmd == W_CANCEL:
        if len(frames) < 3:
            raise ProtocolError("CANCEL is MDPW02, 0x07, envelope")
        return BrokerToWorker(cmd, bytes(frames[2]))
    if cmd in (W_HEARTBEAT, W_DISCONNECT):
        return BrokerToWorker(cmd)
    raise ProtocolError(f"unknown command {cmd!r} from broker")
