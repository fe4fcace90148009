"""Frames: every MDP/0.2 (RFC 18) command we send or accept, built and parsed in one place (and MDP/0.1's).

Clients, the broker and workers all build and parse frames through this module; nothing else
in the project does.  It touches no socket and reads no clock.  Everything a peer sends is
validated here, and every failure is one typed error, `ProtocolError`, whose message names
what was wrong; callers log it and answer or drop that one message, never more.

Framing is Majordomo MDP/0.2 (ZeroMQ RFC 18) and MMI (RFC 8), extended so that a plain MDP/0.2
peer never notices: a tensor message carries, as its first body frame, a header frame
(`broker.protocol.header`) that starts with a magic whose first byte, 0xC1, msgpack never
emits.  The frame table is `CLIENT_COMMANDS` and `WORKER_COMMANDS` below: it is the source of
truth, docs/protocol.md sections 2 and 3 are rendered from it (`frame_table`), and a test
keeps the two equal.  ROUTER sockets prepend the peer identity; the parsers here see frames
with it already stripped.

MDP/0.1 (RFC 7, the zguide's Majordomo examples) is served too (docs/protocol.md section
12.1, its table rendered from `MDP01_COMMANDS`): `parse_client` and `parse_worker` read a 0.1
message as the MDP/0.2 command it means, and `to_client01`/`to_worker01` write what the
broker sends a 0.1 peer in RFC 7's framing.  Which framing a message is in is only ever read
from its protocol frame: 0.1's worker REPLY and HEARTBEAT carry 0.2's PARTIAL and FINAL codes.

Invariants a maintainer must keep:
- `envelope` (RFC 18's client address) is opaque, at most 255 bytes, returned unchanged by a
  worker; our broker puts its 8-byte big-endian dispatch token there (`token_envelope`).
- A new command is an extension only if a plain MDP peer never receives it unless it sent
  something that only our peers send (a heartbeat, a header).
- Direct reply (docs/protocol.md section 8): a worker sends to a client's `reply_to` socket
  exactly the frames the broker would relay, without an identity (`client_reply`), and then
  settles the request at the broker with DONE.
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence

import msgspec

from .header import (
    MAX_DONE, MAX_ENVELOPE_LEN, MAX_ERROR_MESSAGE, MAX_SERVICE_LEN, MMI_PREFIX, Cancel, ErrorInfo, ProtocolError,
    DoneInfo, Ready, Reply, Welcome, WorkerStats, decode_done_info, decode_lease_end, decode_lease_grant,
    decode_ready, decode_welcome, decode_worker_stats, encode_header, is_header, reply_error_text,
)

__all__ = ["Command", "CLIENT_COMMANDS", "WORKER_COMMANDS", "frame_table", "MDPC", "MDPW", "C_REQUEST", "C_PARTIAL", "C_FINAL", "C_HEARTBEAT", "C_CANCEL",
    "C_DISCONNECT", "C_FINALS", "W_READY", "W_REQUEST", "W_PARTIAL", "W_FINAL", "W_HEARTBEAT",
    "W_DISCONNECT", "W_CANCEL", "CANCEL_EXPIRED", "CANCEL_CLIENT_GONE", "W_DONE", "W_WELCOME", "W_RECALL", "W_RETURNED", "W_STATS", "worker_stats", "to_worker_recall", "worker_returned", "to_worker_welcome", "client_request", "client_cancel", "client_heartbeat", "broker_heartbeat", "HB_ASK_ROUTE", "INSTANCE_LEN",
    "client_disconnect", "to_client", "error_body", "worker_ready", "worker_reply",
    "worker_done", "client_reply", "direct_finals", "worker_heartbeat", "worker_disconnect",
    "to_worker_request", "to_worker_cancel", "token_envelope", "envelope_token", "ClientMessage",
    "parse_client", "WorkerMessage", "parse_worker", "BrokerToClient", "parse_broker_to_client",
    "BrokerToWorker", "parse_broker_to_worker",
    "C_LEASE", "C_LEASED", "C_LEASE_END", "C_HELLO", "W_LEASE", "W_LEASED", "W_LEASE_END", "LEASE_ID_LEN",
    "lease_id", "lease_number", "client_lease", "client_lease_end", "client_leased",
    "to_worker_lease", "to_worker_lease_end", "worker_leased", "worker_lease_end", "W_BUSY", "worker_busy", "W_STOPPING", "worker_stopping",
    "MDPC01", "MDPW01", "W01_READY", "W01_REQUEST", "W01_REPLY", "W01_HEARTBEAT", "W01_DISCONNECT", "Command01",
    "MDP01_COMMANDS", "frame_table01", "to_client01", "to_worker01",
]

# --------------------------------------------------------------------------------------------
# Constants

MDPC = b"MDPC02"
MDPW = b"MDPW02"

# Client sub-protocol commands (RFC 18 defines 0x01..0x03; the rest are our extensions).
C_REQUEST = b"\x01"
C_PARTIAL = b"\x02"
C_FINAL = b"\x03"
C_HEARTBEAT = b"\x04"
C_CANCEL = b"\x05"
C_DISCONNECT = b"\x06"
C_FINALS = b"\x07"   # direct reply only: several header-only FINALs in one message
# Leases (docs/protocol.md section 10)
C_LEASE = b"\x08"      # C->B: pin me to a worker of this service (LeaseAsk)
C_LEASED = b"\x09"     # B->C: where to connect (LeaseInfo), or an error header
C_LEASE_END = b"\x0a"  # both: the lease is over (LeaseEnd)
C_HELLO = b"\x0b"      # C->W on the worker's direct socket: bind this connection to a lease

# Worker sub-protocol commands (RFC 18 defines 0x01..0x06; the rest are our extensions).
W_READY = b"\x01"
W_REQUEST = b"\x02"
W_PARTIAL = b"\x03"
W_FINAL = b"\x04"
W_HEARTBEAT = b"\x05"
W_DISCONNECT = b"\x06"
W_CANCEL = b"\x07"
W_DONE = b"\x08"
W_WELCOME = b"\x09"
W_RECALL = b"\x0a"    # B->W: give back these requests if you have not started them
W_RETURNED = b"\x0b"  # W->B: these requests were not started and are the broker's again
W_STATS = b"\x0c"     # W->B: what only the worker sees (timings, batch sizes, pool use)
W_LEASE = b"\x0d"     # B->W: a lease on you (LeaseGrant)
W_LEASED = b"\x0e"    # W->B: lease id [, error header: refused]
W_LEASE_END = b"\x0f"  # both: lease id, LeaseEnd
W_BUSY = b"\x10"       # W->B: a long batch runs (1) / ended (0)
W_STOPPING = b"\x11"   # W->B: draining: nothing new, what it holds is finished, then DISCONNECT

# MDP/0.1 (ZeroMQ RFC 7, the zguide's Majordomo examples), which the broker also serves
# (docs/protocol.md section 12.1).  Every 0.1 message starts with an empty frame, then its
# protocol frame; a client's has no command frame (its one command is REQUEST, answered by
# one REPLY).  0.1's worker REPLY (3) and HEARTBEAT (4) are 0.2's PARTIAL and FINAL: a
# message is only ever read in the framing its protocol frame names.
MDPC01 = b"MDPC01"
MDPW01 = b"MDPW01"
W01_READY = b"\x01"
W01_REQUEST = b"\x02"
W01_REPLY = b"\x03"
W01_HEARTBEAT = b"\x04"
W01_DISCONNECT = b"\x05"

INSTANCE_LEN = 8  # a broker's instance id: random, new at every start
MAX_ROUTE_LEN = 255  # a ZeroMQ routing id: 1 to 255 bytes
LEASE_ID_LEN = 8  # a lease id on the wire: big-endian, from the broker's counter


class Command(NamedTuple):
    """One row of the frame table: a command and the frames that follow its command frame."""

    name: str
    code: bytes
    direction: str   # C client, B broker, W worker
    frames: str      # after frame 1 (the command), in order
    origin: str      # "RFC 18" or "extension"


CLIENT_COMMANDS: tuple[Command, ...] = (
    Command("REQUEST", C_REQUEST, "C→B", "service name, body: `[header, inline...]` or opaque", "RFC 18"),
    Command("PARTIAL", C_PARTIAL, "B→C", "service name, body", "RFC 18"),
    Command("FINAL", C_FINAL, "B→C; W→C on `reply_to`", "service name, body (an error is a header with `error`)",
            "RFC 18"),
    Command("HEARTBEAT", C_HEARTBEAT, "C→B, B→C", "C→B: [flags (1 byte; 0x01: name my connection)]; "
            "B→C: [instance id (8 bytes, new at every start), client liveness window in ms (u32, big endian) "
            "[, route: a name of the client's connection (8 bytes; only when its flags asked)]]", "extension"),
    Command("CANCEL", C_CANCEL, "C→B", "service name, header `Cancel`", "extension"),
    Command("DISCONNECT", C_DISCONNECT, "C→B", "none", "extension"),
    Command("FINALS", C_FINALS, "W→C on `reply_to` only", "service name, header, header... (header-only FINALs)",
            "extension"),
    Command("LEASE", C_LEASE, "C→B", "service name, header `LeaseAsk` (section 10)", "extension"),
    Command("LEASED", C_LEASED, "B→C", "service name, header `LeaseInfo`, or a header with `error`", "extension"),
    Command("LEASE_END", C_LEASE_END, "C→B, B→C", "service name, header `LeaseEnd`", "extension"),
    Command("HELLO", C_HELLO, "C→W on a worker's direct socket", "header `LeaseHello`", "extension"),
)

WORKER_COMMANDS: tuple[Command, ...] = (
    Command("READY", W_READY, "W→B", "service name [, header `Ready`] (bare: credit 1, inline only)", "RFC 18"),
    Command("REQUEST", W_REQUEST, "B→W", "envelope, empty, body", "RFC 18"),
    Command("PARTIAL", W_PARTIAL, "W→B", "envelope, empty, body", "RFC 18"),
    Command("FINAL", W_FINAL, "W→B", "envelope, empty, body", "RFC 18"),
    Command("HEARTBEAT", W_HEARTBEAT, "both", "none", "RFC 18"),
    Command("DISCONNECT", W_DISCONNECT, "both", "none; B→W may add a header `Reply` with `error`: the worker's READY was refused (section 3)", "RFC 18 (+ extension)"),
    Command("CANCEL", W_CANCEL, "B→W", "envelope [, reason: one byte]", "extension"),
    Command("DONE", W_DONE, "W→B", f"envelope, envelope... (1 to {MAX_DONE}, one per frame) [, header `DoneInfo`]",
            "extension"),
    Command("WELCOME", W_WELCOME, "B→W", "header `Welcome` (only to a worker whose `Ready` asked for it)",
            "extension"),
    Command("RECALL", W_RECALL, "B→W", f"envelope, envelope... (1 to {MAX_DONE}; only to a worker whose `Ready` "
            "set `recall`)", "extension"),
    Command("RETURNED", W_RETURNED, "W→B", f"envelope... (given back), empty, envelope... (kept: already started); "
            f"1 to {MAX_DONE} in all", "extension"),
    Command("STATS", W_STATS, "W→B", "header `WorkerStats`", "extension"),
    Command("LEASE", W_LEASE, "B→W", "header `LeaseGrant` (only to a worker whose `Ready` set `direct`)", "extension"),
    Command("LEASED", W_LEASED, "W→B", "lease id (8 bytes) [, a header with `error`: refused]", "extension"),
    Command("LEASE_END", W_LEASE_END, "B→W, W→B", "lease id (8 bytes), header `LeaseEnd`", "extension"),
    Command("BUSY", W_BUSY, "W→B", "one byte: `0x01` a long batch runs (what the broker hands "
            "the worker meanwhile waits behind it; section 10.3), `0x00` it ended", "extension"),
    Command("STOPPING", W_STOPPING, "W→B", "none: the worker drains (SIGTERM): it takes nothing new, finishes what "
            "it holds, then says DISCONNECT (only to a broker whose WELCOME set `stopping`)", "extension"),
)


class Command01(NamedTuple):
    """One row of the MDP/0.1 frame table: its frames whole (after the ROUTER's identity),
    and the MDP/0.2 command the broker reads it as, or writes it from."""

    name: str
    code: bytes      # the command frame (b"" for a client's, which has none)
    direction: str
    frames: str
    as02: str


MDP01_COMMANDS: tuple[Command01, ...] = (
    Command01("REQUEST", b"", "C→B", "empty, `MDPC01`, service name, body (1 frame or more)", "client REQUEST"),
    Command01("REPLY", b"", "B→C", "empty, `MDPC01`, service name, body (1 frame or more; an error: the error "
              "header, then its text)", "client FINAL (PARTIALs are not sent)"),
    Command01("READY", W01_READY, "W→B", "empty, `MDPW01`, `0x01`, service name", "READY, bare"),
    Command01("REQUEST", W01_REQUEST, "B→W", "empty, `MDPW01`, `0x02`, envelope, empty, body", "REQUEST"),
    Command01("REPLY", W01_REPLY, "W→B", "empty, `MDPW01`, `0x03`, envelope, empty, body", "FINAL"),
    Command01("HEARTBEAT", W01_HEARTBEAT, "both", "empty, `MDPW01`, `0x04`", "HEARTBEAT"),
    Command01("DISCONNECT", W01_DISCONNECT, "both", "empty, `MDPW01`, `0x05` (nothing more, either way)",
              "DISCONNECT"),
)


def frame_table01(commands: Sequence[Command01]) -> str:
    """The markdown table of MDP/0.1's commands, as docs/protocol.md section 12.1 shows it."""
    rows = ["| command | dir | frames (RFC 7) | read as, or written from (MDP/0.2) |", "|---|---|---|---|"]
    for c in commands:
        rows.append(f"| {c.name} | {c.direction} | {c.frames} | {c.as02} |")
    return "\n".join(rows) + "\n"


def frame_table(protocol: bytes, commands: Sequence[Command]) -> str:
    """The markdown table of one sub-protocol (`MDPC` or `MDPW`), as docs/protocol.md shows it."""
    proto = protocol.decode()
    rows = ["| command | dir | frame 0 | frame 1 | frames 2+ | origin |", "|---|---|---|---|---|---|"]
    for c in commands:
        rows.append(f"| {c.name} | {c.direction} | `{proto}` | `0x{c.code.hex()}` | {c.frames} | {c.origin} |")
    return "\n".join(rows) + "\n"

# --------------------------------------------------------------------------------------------
# Frame builders

def _service_bytes(service: str | bytes) -> bytes:
    b = service.encode() if isinstance(service, str) else bytes(service)
    if not b or len(b) > MAX_SERVICE_LEN:
        raise ProtocolError(f"service name must be 1..{MAX_SERVICE_LEN} bytes, got {len(b)}")
    return b


def client_request(service: str, body: Iterable[Any]) -> list[Any]:
    return [MDPC, C_REQUEST, _service_bytes(service), *body]


def client_cancel(service: str, request_id: int, queued_only: bool = False, expired: bool = False) -> list[Any]:
    if queued_only or expired:
        head = Cancel(id=request_id, queued_only=queued_only, expired=expired)
    else:
        head = Cancel(id=request_id)
    return [MDPC, C_CANCEL, _service_bytes(service), encode_header(head)]


#: a client HEARTBEAT's optional flags frame (one byte), bit 0: name my connection (the
#: answer's `route`); other bits are ignored, and so is the frame by a broker that predates it
HB_ASK_ROUTE = 0x01


def client_heartbeat(ask_route: bool = False) -> list[bytes]:
    """A client HEARTBEAT; ``ask_route``: with the flags frame that asks the broker to name
    the connection in its answer (docs/protocol.md section 2)."""
    return [MDPC, C_HEARTBEAT, bytes([HB_ASK_ROUTE])] if ask_route else [MDPC, C_HEARTBEAT]


def broker_heartbeat(instance: bytes, client_window_ms: int, route: bytes | None = None) -> list[bytes]:
    """The broker's answer to a client HEARTBEAT (docs/protocol.md section 2): its instance id,
    so that a client notices a restart even inside its liveness window, and how long it waits
    for a client with calls in flight before presuming it dead, so that the client heartbeats
    often enough (one place, the broker's config, sets liveness); and, to a client that asked
    (`HB_ASK_ROUTE`), ``route``: a name of the connection the HEARTBEAT came on, the same for
    every answer on it, so that a client notices when its connection was replaced (what went
    to the old one is lost: client.md)."""
    frames = [MDPC, C_HEARTBEAT, instance, int(client_window_ms).to_bytes(4, "big")]
    if route is not None:
        frames.append(route)
    return frames


def client_disconnect() -> list[bytes]:
    return [MDPC, C_DISCONNECT]


def to_client(identity: bytes, final: bool, service: bytes, body: Iterable[Any]) -> list[Any]:
    """A reply as the broker's ROUTER sends it: the client's identity, then `client_reply`."""
    return [identity, *client_reply(final, service, body)]


def error_body(request_id: int, code: int, message: str) -> list[bytes]:
    """An error reply's header.  Whatever ``message`` holds, it encodes: a model's
    exception text may carry lone surrogates (a file name from `os.fsdecode`), which
    msgpack cannot take, or megabytes; encoding failed and took the worker down, and the
    broker's retries then every other worker of the service (the data hunt).  Such
    characters are escaped, and a message over `MAX_ERROR_MESSAGE` characters is cut."""
    if type(message) is not str or len(message) > MAX_ERROR_MESSAGE:
        message = _fit_message(message)
    try:
        return [encode_header(Reply(id=request_id, error=ErrorInfo(code=int(code), message=message)))]
    except (UnicodeEncodeError, ValueError):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return [encode_header(Reply(id=request_id, error=ErrorInfo(code=int(code), message=message)))]


def _fit_message(message: Any) -> str:
    if type(message) is not str:
        try:
            message = str(message)
        except Exception as e:  # a __str__ that raises
            message = f"(a message whose str() raised {type(e).__name__})"
    if len(message) > MAX_ERROR_MESSAGE:
        cut = len(message) - MAX_ERROR_MESSAGE
        message = f"{message[:MAX_ERROR_MESSAGE]}... ({cut} more characters cut)"
    return message


def worker_ready(service: str, caps: Ready | None = None) -> list[bytes]:
    frames = [MDPW, W_READY, _service_bytes(service)]
    if caps is not None:
        frames.append(encode_header(caps))
    return frames


def worker_reply(envelope: bytes, final: bool, body: Iterable[Any]) -> list[Any]:
    return [MDPW, W_FINAL if final else W_PARTIAL, envelope, b"", *body]


def worker_done(envelopes: Sequence[bytes], info: DoneInfo | None = None) -> list[bytes]:
    if info is None:
        return [MDPW, W_DONE, *envelopes]
    return [MDPW, W_DONE, *envelopes, encode_header(info)]


def worker_stats(stats: WorkerStats) -> list[bytes]:
    return [MDPW, W_STATS, encode_header(stats)]


def worker_returned(envelopes: Sequence[bytes], kept: Sequence[bytes] = ()) -> list[bytes]:
    """The answer to a RECALL: the requests the worker dropped unstarted, then (after an empty
    frame) the ones it keeps because they started (docs/protocol.md section 3)."""
    return [MDPW, W_RETURNED, *envelopes, b"", *kept]


def client_reply(final: bool, service: bytes, body: Iterable[Any]) -> list[Any]:
    """A PARTIAL or FINAL to a client, without an identity: what the broker relays after the
    identity frame, and what a worker sends straight to a client's `reply_to` socket (the
    socket is the client's own, so no identity)."""
    return [MDPC, C_FINAL if final else C_PARTIAL, service, *body]


def direct_finals(service: bytes, headers: Sequence[Any]) -> list[Any]:
    """Several header-only FINALs for one client in one message (a batch's replies)."""
    return [MDPC, C_FINALS, service, *headers]


def worker_heartbeat() -> list[bytes]:
    return [MDPW, W_HEARTBEAT]


def worker_disconnect(refusal: list | None = None) -> list:
    """DISCONNECT; to a worker whose READY the broker refused, ``refusal`` (`error_body`)
    says why: a worker of ours stops there instead of registering again, refused again."""
    return [MDPW, W_DISCONNECT, *(refusal or ())]


def to_worker_request(identity: bytes, envelope: bytes, body: Iterable[Any]) -> list[Any]:
    return [identity, MDPW, W_REQUEST, envelope, b"", *body]


def to_worker_welcome(identity: bytes, welcome: Welcome) -> list[bytes]:
    """The broker's answer to a READY whose header set `welcome` (docs/protocol.md section 3)."""
    return [identity, MDPW, W_WELCOME, encode_header(welcome)]


#: a worker CANCEL's optional reason, one byte in a frame after the envelope (docs/protocol.md
#: section 3): the request's deadline passed (the worker answers 504), or its client left.
#: Without it, the client asked.  A worker that predates it reads the envelope only.
CANCEL_EXPIRED = 1
CANCEL_CLIENT_GONE = 2


def to_worker_cancel(identity: bytes, envelope: bytes, why: int = 0) -> list[bytes]:
    if why:
        return [identity, MDPW, W_CANCEL, envelope, bytes((why,))]
    return [identity, MDPW, W_CANCEL, envelope]


def to_worker_recall(identity: bytes, envelopes: Sequence[bytes]) -> list[bytes]:
    return [identity, MDPW, W_RECALL, *envelopes]


def token_envelope(token: int) -> bytes:
    return token.to_bytes(8, "big")


# Leases (docs/protocol.md section 10).  Headers are passed encoded (`encode_header`).

def lease_id(number: int) -> bytes:
    return number.to_bytes(LEASE_ID_LEN, "big")


def lease_number(lease: bytes) -> int:
    return int.from_bytes(lease, "big")


def client_lease(service: str | bytes, header: bytes) -> list[bytes]:
    return [MDPC, C_LEASE, _service_bytes(service), header]


def client_lease_end(service: str | bytes, header: bytes) -> list[bytes]:
    """LEASE_END between a client and the broker (the same frames either way)."""
    return [MDPC, C_LEASE_END, _service_bytes(service), header]


def client_leased(service: str | bytes, body: Sequence[Any]) -> list[Any]:
    """B->C LEASED, without an identity: body is [LeaseInfo header] or an error body."""
    return [MDPC, C_LEASED, _service_bytes(service), *body]


def to_worker_lease(identity: bytes, header: bytes) -> list[bytes]:
    return [identity, MDPW, W_LEASE, header]


def to_worker_lease_end(identity: bytes, lease: bytes, header: bytes) -> list[bytes]:
    return [identity, MDPW, W_LEASE_END, lease, header]


def worker_leased(lease: bytes, error_header: bytes | None = None) -> list[bytes]:
    return [MDPW, W_LEASED, lease] + ([error_header] if error_header is not None else [])


def worker_lease_end(lease: bytes, header: bytes) -> list[bytes]:
    return [MDPW, W_LEASE_END, lease, header]


def worker_stopping() -> list[bytes]:
    """STOPPING: this worker drains; what it holds is finished, then DISCONNECT."""
    return [MDPW, W_STOPPING]


def worker_busy(busy: bool) -> list[bytes]:
    """BUSY: a long batch holding leased requests runs here (True), or it ended (False)."""
    return [MDPW, W_BUSY, b"\x01" if busy else b"\x00"]


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
        if bytes(frames[0]) == MDPC01:
            return _parse_client01(frames, lead)
        raise ProtocolError(f"client message must start with MDPC02, got {bytes(frames[0])[:16]!r}")
    cmd = bytes(frames[1])
    if cmd in (C_REQUEST, C_CANCEL, C_LEASE, C_LEASE_END):
        if len(frames) < 4:
            raise ProtocolError("REQUEST/CANCEL/LEASE/LEASE_END needs a service name and at least one body frame")
        return ClientMessage(cmd, _service(frames[2]), tuple(frames[3:]), lead)
    if cmd == C_HEARTBEAT:
        # The flags frame, if any (its first byte); frames past it are ignored.
        flags = memoryview(frames[2])[:1].tobytes() if len(frames) > 2 else b""  # not a copy of a large frame
        return ClientMessage(cmd, b"", (flags,) if flags else (), lead)
    if cmd == C_DISCONNECT:
        return ClientMessage(cmd, b"", (), lead)
    raise ProtocolError(f"unknown client command {cmd!r}")


def _service(frame: Any) -> bytes:
    """A service name frame: 1..MAX_SERVICE_LEN bytes of UTF-8, else ProtocolError.  (Not
    UTF-8: the broker's names are text, and every such name read as one with U+FFFD in it,
    so a worker registered under one took the requests of every other: the hostile hunt.)"""
    service = bytes(frame)
    if not service or len(service) > MAX_SERVICE_LEN:
        raise ProtocolError(f"service name must be 1..{MAX_SERVICE_LEN} bytes")
    try:
        service.decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"service name must be UTF-8, got {service[:32]!r}") from None
    return service


def _worker_service(frame: Any) -> bytes:
    """A READY's service name: as `_service`, not one of the broker's own (``mmi.``), and
    printable (`str.isprintable`).  A raw MDP worker registered ``"echo\\n"`` or one
    with an ANSI escape: a name every metric, log line and MMI answer then carried (escaped,
    but a different service from the one its clients named); `gpu_worker` refuses such names
    itself (models.name_problem), whitespace included."""
    service = _service(frame)
    if service.startswith(MMI_PREFIX.encode()):
        raise ProtocolError("service names starting with 'mmi.' are reserved for the broker")
    name = service.decode()
    if not name.isprintable():
        raise ProtocolError(f"service name {name!r} is not printable (str.isprintable: no control, format, "
                            f"private-use or unassigned characters, no separator but the space)")
    return service


def _parse_client01(frames: Sequence[Any], lead: bool) -> ClientMessage:
    """An MDP/0.1 client message (``frames`` from MDPC01 on): a REQUEST, read as 0.2's."""
    if not lead:
        raise ProtocolError("an MDP/0.1 client message starts with an empty frame (RFC 7's frame 0; a REQ socket "
                            "adds it, a DEALER must send it)")
    if len(frames) < 3:
        raise ProtocolError("an MDP/0.1 REQUEST is empty, MDPC01, service, body (at least one frame)")
    return ClientMessage(C_REQUEST, _service(frames[1]), tuple(frames[2:]), True)


def to_client01(frames: Sequence[Any]) -> list[Any] | None:
    """A message for a client, as `client_reply` writes it (from MDPC02 on), written for an
    MDP/0.1 client instead: ``["", MDPC01, service, body...]`` (the empty frame is RFC 7's
    frame 0; a REQ socket takes it off).  Only a FINAL goes: a 0.1 client takes one reply per
    request, and the FINAL is the outcome (None for anything else: a PARTIAL is dropped).  An
    empty body goes as one empty frame (RFC 7: at least one); an error header is followed by
    its text, ``<code> <NAME>: <message>``, for a client without msgpack."""
    if len(frames) < 3 or bytes(frames[1]) != C_FINAL:
        return None
    body = list(frames[3:])
    if not body:
        body.append(b"")
    else:
        text = reply_error_text(body[0])
        if text is not None:
            body.append(text.encode("utf-8", "backslashreplace"))
    return [b"", MDPC01, frames[2], *body]


class WorkerMessage(msgspec.Struct, frozen=True):
    command: bytes
    service: bytes = b""        # READY
    ready: Ready | None = None  # READY with capabilities
    envelope: bytes = b""       # PARTIAL / FINAL
    body: tuple = ()            # PARTIAL / FINAL body; DONE, RETURNED: the envelopes (bytes)
    info: Any = None            # DONE: its DoneInfo frame (raw), if sent; STATS: the WorkerStats; RETURNED: the kept envelopes; BUSY: a bool


def parse_worker(frames: Sequence[Any]) -> WorkerMessage:
    """Parse frames from a worker (identity already removed).  An MDP/0.1 message (MDPW01)
    comes back as the MDP/0.2 command it means (`_parse_worker01`)."""
    lead = False
    if frames and len(frames[0]) == 0:  # tolerate a REQ-era empty delimiter
        lead = True
        frames = frames[1:]
    if len(frames) < 2:
        raise ProtocolError(f"worker message has {len(frames)} frames; expected at least 2 (MDPW02, command)")
    if bytes(frames[0]) != MDPW:
        if bytes(frames[0]) == MDPW01:
            return _parse_worker01(frames, lead)
        raise ProtocolError(f"worker message must start with MDPW02, got {bytes(frames[0])[:16]!r}")
    cmd = bytes(frames[1])
    if cmd == W_READY:
        if len(frames) not in (3, 4):
            raise ProtocolError("READY is MDPW02, 0x01, service [, capabilities]")
        service = _worker_service(frames[2])
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
    if cmd in (W_LEASED, W_LEASE_END):
        if len(frames) not in (3, 4) or (cmd == W_LEASE_END and len(frames) != 4):
            raise ProtocolError("LEASED is MDPW02, 0x0e, lease id [, error header]; "
                                "LEASE_END is MDPW02, 0x0f, lease id, header")
        lease = bytes(frames[2])
        if len(lease) != LEASE_ID_LEN:
            raise ProtocolError(f"a lease id is {LEASE_ID_LEN} bytes, got {len(lease)}")
        return WorkerMessage(cmd, envelope=lease, info=frames[3] if len(frames) == 4 else None)
    if cmd == W_RETURNED:
        rest = [bytes(f) for f in frames[2:]]
        kept: list[bytes] = []
        if b"" in rest:
            i = rest.index(b"")
            rest, kept = rest[:i], rest[i + 1:]
        if not 1 <= len(rest) + len(kept) <= MAX_DONE:
            raise ProtocolError(f"RETURNED carries {len(rest) + len(kept)} envelopes; expected 1..{MAX_DONE}")
        if any(len(e) > MAX_ENVELOPE_LEN or not e for e in (*rest, *kept)):
            raise ProtocolError("RETURNED envelopes must be 1..255 bytes (one empty frame separates the kept ones)")
        return WorkerMessage(cmd, body=tuple(rest), info=tuple(kept))
    if cmd == W_DONE:
        rest = frames[2:]
        info = None
        if len(rest) > 1 and is_header(rest[-1]):
            # An envelope is never a header: ours are 8-byte tokens that start with 0x00.
            # Kept raw: decoded (`decode_done_info`) only by a broker that counts, and a bad
            # one costs only the counts, never the settling of the envelopes.
            info = bytes(rest[-1])
            rest = rest[:-1]
        n = len(rest)
        if not 1 <= n <= MAX_DONE:
            raise ProtocolError(f"DONE carries {n} envelopes; expected 1..{MAX_DONE}")
        envs = tuple(bytes(f) for f in rest)
        if any(len(e) > MAX_ENVELOPE_LEN for e in envs):
            raise ProtocolError("envelope longer than 255 bytes")
        return WorkerMessage(cmd, body=envs, info=info)
    if cmd == W_STATS:
        if len(frames) != 3:
            raise ProtocolError("STATS is MDPW02, 0x0c, header(WorkerStats)")
        return WorkerMessage(cmd, info=decode_worker_stats(frames[2]))
    if cmd == W_BUSY:
        if len(frames) != 3 or bytes(frames[2]) not in (b"\x00", b"\x01"):
            raise ProtocolError("BUSY is MDPW02, 0x10, one byte (0x01 busy, 0x00 not)")
        return WorkerMessage(cmd, info=bytes(frames[2]) == b"\x01")
    if cmd in (W_HEARTBEAT, W_DISCONNECT, W_STOPPING):
        return WorkerMessage(cmd)
    raise ProtocolError(f"unknown worker command {cmd!r}")


def _parse_worker01(frames: Sequence[Any], lead: bool) -> WorkerMessage:
    """An MDP/0.1 worker message (``frames`` from MDPW01 on), as the MDP/0.2 command it
    means: READY as a bare READY, REPLY as FINAL, HEARTBEAT, DISCONNECT."""
    if not lead:
        raise ProtocolError("an MDP/0.1 worker message starts with an empty frame (RFC 7)")
    cmd = bytes(frames[1])
    if cmd == W01_READY:
        if len(frames) != 3:
            raise ProtocolError("an MDP/0.1 READY is empty, MDPW01, 0x01, service (nothing more)")
        service = _worker_service(frames[2])
        return WorkerMessage(W_READY, service=service)
    if cmd == W01_REPLY:
        if len(frames) < 4 or len(frames[3]) != 0:
            raise ProtocolError("an MDP/0.1 REPLY is empty, MDPW01, 0x03, client address, empty, body...")
        env = bytes(frames[2])
        if len(env) > MAX_ENVELOPE_LEN:
            raise ProtocolError("envelope longer than 255 bytes")
        return WorkerMessage(W_FINAL, envelope=env, body=tuple(frames[4:]))
    if cmd == W01_HEARTBEAT:
        return WorkerMessage(W_HEARTBEAT)
    if cmd == W01_DISCONNECT:
        return WorkerMessage(W_DISCONNECT)
    if cmd == W01_REQUEST:
        raise ProtocolError("MDP/0.1 command 0x02 is REQUEST, which only a broker sends")
    raise ProtocolError(f"unknown MDP/0.1 worker command {cmd[:16]!r}")


def to_worker01(frames: Sequence[Any]) -> list[Any] | None:
    """A message for a worker, as the broker writes it (its identity, MDPW02, command...),
    written for an MDP/0.1 worker instead, exactly as RFC 7 has it (the zguide's worker
    asserts on anything else): REQUEST, HEARTBEAT, DISCONNECT (without a refusal's reason).
    None for the commands MDP/0.1 does not have (CANCEL: the worker's REPLY still comes)."""
    cmd = bytes(frames[2])
    if cmd == W_REQUEST:
        return [frames[0], b"", MDPW01, W01_REQUEST, *frames[3:]]
    if cmd == W_HEARTBEAT:
        return [frames[0], b"", MDPW01, W01_HEARTBEAT]
    if cmd == W_DISCONNECT:
        return [frames[0], b"", MDPW01, W01_DISCONNECT]
    return None


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
        if len(frames) == 2:
            return BrokerToClient(cmd)
        # Frames past the route are ignored (a later extension's).
        if (len(frames) < 4 or len(frames[2]) != INSTANCE_LEN or len(frames[3]) != 4
                or (len(frames) > 4 and not 0 < len(frames[4]) <= MAX_ROUTE_LEN)):
            raise ProtocolError(f"HEARTBEAT is MDPC02, 0x04 [, {INSTANCE_LEN}-byte instance, 4-byte window in ms "
                                f"[, route (1 to {MAX_ROUTE_LEN} bytes)]]")
        route = bytes(frames[4]) if len(frames) > 4 else None
        return BrokerToClient(cmd, body=(bytes(frames[2]), int.from_bytes(bytes(frames[3]), "big"), route))
    raise ProtocolError(f"unknown command {cmd!r} from broker")


class BrokerToWorker(msgspec.Struct, frozen=True):
    command: bytes
    envelope: bytes = b""   # REQUEST, CANCEL: the envelope; LEASE, LEASE_END: the lease id
    body: tuple = ()        # REQUEST: body frames; RECALL: envelopes; WELCOME, LEASE, LEASE_END: the decoded header;
    #                         CANCEL: (its reason: CANCEL_EXPIRED, CANCEL_CLIENT_GONE or 0,)


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
            raise ProtocolError("CANCEL is MDPW02, 0x07, envelope[, reason]")
        why = bytes(frames[3]) if len(frames) > 3 else b""
        return BrokerToWorker(cmd, bytes(frames[2]), (why[0] if len(why) == 1 else 0,))
    if cmd == W_RECALL:
        n = len(frames) - 2
        if not 1 <= n <= MAX_DONE:
            raise ProtocolError(f"RECALL carries {n} envelopes; expected 1..{MAX_DONE}")
        return BrokerToWorker(cmd, body=tuple(bytes(f) for f in frames[2:]))
    if cmd == W_WELCOME:
        if len(frames) != 3:
            raise ProtocolError("WELCOME is MDPW02, 0x09, header(Welcome)")
        return BrokerToWorker(cmd, body=(decode_welcome(frames[2]),))
    if cmd == W_LEASE:  # body: (LeaseGrant,); envelope: its lease id
        if len(frames) != 3:
            raise ProtocolError("LEASE is MDPW02, 0x0d, header(LeaseGrant)")
        grant = decode_lease_grant(frames[2])
        return BrokerToWorker(cmd, grant.lease, (grant,))
    if cmd == W_LEASE_END:  # envelope: the lease id; body: (LeaseEnd,)
        if len(frames) != 4:
            raise ProtocolError("LEASE_END is MDPW02, 0x0f, lease id, header(LeaseEnd)")
        lease = bytes(frames[2])
        if len(lease) != LEASE_ID_LEN:
            raise ProtocolError(f"a lease id is {LEASE_ID_LEN} bytes, got {len(lease)}")
        end = decode_lease_end(frames[3])
        if end.lease != lease:
            raise ProtocolError("LEASE_END's header names another lease than its id frame")
        return BrokerToWorker(cmd, lease, (end,))
    if cmd == W_DISCONNECT:  # body: (a Reply header with the refusal,) or ()
        return BrokerToWorker(cmd, body=(bytes(frames[2]),) if len(frames) == 3 else ())
    if cmd == W_HEARTBEAT:
        return BrokerToWorker(cmd)
    raise ProtocolError(f"unknown command {cmd!r} from broker")
