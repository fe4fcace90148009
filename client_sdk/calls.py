"""What one request is, and the checks and parsers around it: pure values and functions that
the core (core.py) and both twins share.  Nothing here sends, waits or reads the clock.

- `Call`: one tensor request, from packing to its last reply.  The core owns its fields; a
  twin or a stream may read them and set `notify`, `frame` and `t_submit`.
- `MmiQuery`: one `mmi.service` question waiting for its answer on the client's socket.
- option checks (`parse_priority`, `check_service`, `resolve_transport`) raise InvalidInput
  before anything is packed or sent.
- `opaque_reply`, `mmi_answer`: the meaning of the reply to a plain MDP request.
"""
from __future__ import annotations

import ipaddress
import operator
from collections import deque
from typing import Any, Callable

from broker import protocol as P
from broker.protocol import ErrorCode, Priority

from . import tensors as T
from .errors import DeadlineExceeded, InvalidInput, NotSupported, ProtocolError, error_from

__all__ = ["Call", "MmiQuery", "MMI_SERVICE", "parse_priority", "check_service", "endpoint_is_local",
           "resolve_transport", "opaque_reply", "mmi_answer", "final_of_infer"]

MMI_SERVICE = "mmi.service"

_PRIORITY_NAMES = {"urgent": Priority.URGENT, "normal": Priority.NORMAL, "background": Priority.BACKGROUND}


# ------------------------------------------------------------------------------------ options

def parse_priority(p: Any) -> Priority:
    if isinstance(p, str):
        try:
            return _PRIORITY_NAMES[p.lower()]
        except KeyError:
            raise InvalidInput(f"priority {p!r} must be 'urgent', 'normal' or 'background'") from None
    try:
        if isinstance(p, bool):
            raise TypeError  # True is not a priority
        return Priority(operator.index(p))  # an int (numpy's too), not a float that int() would cut
    except (TypeError, ValueError):
        raise InvalidInput(f"priority {p!r} must be 0 (urgent), 1 (normal), 2 (background) or one of their names") from None


def check_service(service: Any) -> None:
    """Reject a bad service name before anything is packed or sent."""
    if not isinstance(service, str):
        raise InvalidInput(f"service must be a str, got {type(service).__name__}")
    try:
        n = len(service.encode())
    except UnicodeEncodeError as e:  # a lone surrogate (os.fsdecode of a non-UTF-8 name)
        raise InvalidInput(f"service name {service!r} is not valid UTF-8 ({e.reason})") from None
    if not 1 <= n <= P.MAX_SERVICE_LEN:
        raise InvalidInput(f"service name must be 1..{P.MAX_SERVICE_LEN} bytes of UTF-8, got {n}")


def endpoint_is_local(endpoint: str) -> bool:
    """Whether a broker at `endpoint` runs on this host (ipc, inproc, TCP to loopback)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    rest = rest.rsplit(";", 1)[-1]  # "tcp://source;host:port": the peer is after the ';'
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_transport(transport: str, endpoint: str) -> bool:
    """True when inputs should go through shared memory."""
    if transport == "shm":
        return True
    if transport == "inline":
        return False
    if transport == "auto":
        return endpoint_is_local(endpoint)
    raise InvalidInput(f"transport {transport!r} must be 'auto', 'shm' or 'inline'")


# ------------------------------------------------------------------------------------ opaque replies

def opaque_reply(frames: list[Any], service: str) -> tuple[bool, list[bytes]]:
    """(True, body) for the FINAL of an opaque request; raises its error; (False, []) for
    anything else (a PARTIAL, a heartbeat)."""
    try:
        msg = P.parse_broker_to_client(frames)
        if msg.command != P.C_FINAL:
            return False, []
        body = [bytes(f) for f in msg.body]
        rep = P.decode_reply(body[0], len(body) - 1) if body and P.is_header(body[0]) else None
    except P.ProtocolError as e:
        raise ProtocolError(f"bad reply to an opaque request to {service!r}: {e}") from None
    if rep is not None:
        if rep.error is not None:
            raise error_from(rep.error.code, rep.error.message)
        raise ProtocolError(f"service {service!r} answered an opaque request with a tensor header")
    return True, body


def final_of_infer(service: str, res: Any, partials: int, instead: str = "use infer_stream()") -> Any:
    """What `infer` returns for a FINAL that followed `partials` PARTIALs: the FINAL itself,
    unless the service streamed everything and the FINAL is empty (then the caller meant
    `infer_stream`: a typed error rather than an empty result; ``instead``: what to do)."""
    if partials and len(res) == 0:
        res.release()
        raise NotSupported(f"service {service!r} streams its results ({partials} PARTIALs, then an empty "
                           f"FINAL); {instead} to receive them")
    return res


def mmi_answer(body: list[bytes], name: str) -> bool:
    """The meaning of an `mmi.service` answer body: True for "200", False for "404"."""
    code = bytes(body[0]) if body else b""
    if code == b"200":
        return True
    if code == b"404":
        return False
    if code == b"403":  # the broker no longer serves this client's key (docs/security.md)
        raise error_from(ErrorCode.FORBIDDEN, f"mmi.service for {name!r}: this client's CurveZMQ key was removed "
                                              f"from the broker's client allow-list")
    raise ProtocolError(f"mmi.service answered {code!r} for {name!r}; expected b'200' or b'404'")


# ------------------------------------------------------------------------------------ calls

class Call:
    """One tensor request and what its caller has not consumed yet.

    A twin or a stream may read every field, take items from `inbox` (oldest first), and set
    `notify` (called after each item lands in `inbox`), `frame`, `t_submit` and `no_pin`
    (before it is submitted: never on a lease); everything else is the core's."""

    __slots__ = ("id", "service", "packed", "priority", "meta", "reply", "timeout",
                 "deadline", "t_sent", "t_submit", "t_done", "inbox", "done", "abandoned", "retried", "probe",
                 "frame", "notify", "adopted", "broker", "route", "mark", "resends", "partials", "old_ids", "dropped",
                 "traceparent", "pin", "no_pin", "__weakref__")

    def __init__(self, service: str, *, timeout: float | None):
        self.id = 0              # 0 until registered by request_frames (and again if unregistered)
        self.dropped = 0         # a stream's frames dropped (latest wins) since its previous request
        self.service = service
        self.packed: T.Packed | None = None
        self.priority = Priority.NORMAL
        self.meta: dict[str, Any] = {}
        self.reply = "auto"
        self.timeout = timeout
        self.deadline: float | None = None
        self.t_sent = 0.0
        self.t_submit = 0.0   # when the caller handed it over (a stream frame may wait before it is sent)
        self.t_done = 0.0
        # ("partial", Result) | ("final", Result) | ("error", InferenceError)
        self.inbox: deque[tuple[str, Any]] = deque()
        self.done = False        # FINAL (or error) received: inputs freed, nothing more will come
        self.abandoned = False   # the caller gave up: discard what still arrives
        self.retried = False
        self.probe = False       # sent through shared memory to a service that was not local before
        self.frame: int | None = None
        self.notify: Callable[[], None] | None = None
        self.adopted: dict[int, T.Adopted] = {}  # input slots handed back as outputs
        self.broker: bytes | None = None  # instance id of the broker it was last sent to, as known then
        self.route: bytes | None = None   # ... and the broker's name of our connection then
        self.mark = 0            # the core's route mark at its last PARTIAL (core._on_broker_instance)
        self.resends = 0         # times sent again because the broker restarted or our connection was replaced
        self.partials = 0        # PARTIALs delivered (a streamed call is not resent)
        self.old_ids: list[int] = []  # ids it was sent under before a broker restart (still answerable)
        self.traceparent: str | None = None  # W3C traceparent sent in the request header (docs/client.md)
        self.pin: Any = None     # the lease (pins.Pin) it is in flight on; None: through the broker
        self.no_pin = False      # never on a lease (a `pin=False` stream's frame)

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now

    def deadline_error(self, advice: str | None = None) -> DeadlineExceeded:
        """The error for a call that outlived its deadline (the twin cancels it); ``advice``
        in place of the class's usual hint."""
        return deadline_exceeded(f"no reply from service {self.service!r} within {self.timeout:g}s; "
                                 "the request was cancelled", advice, self.id or None)


def deadline_exceeded(text: str, advice: str | None = None, request_id: int | None = None) -> DeadlineExceeded:
    """A `DeadlineExceeded` saying ``text``, then ``advice`` in place of the class's usual hint
    ("raise the timeout, lower the load ..."), when there is one."""
    err = DeadlineExceeded(text, request_id=request_id)
    if advice is not None:
        err.args = (f"{text}; {advice}",)
    return err


class MmiQuery:
    """One `mmi.service` question sent on the client's own socket, waiting for its answer.

    `token` rides after the name and our broker echoes it after the status code
    (docs/protocol.md section 4), so an answer finds its own question even when an earlier
    answer was lost."""

    __slots__ = ("name", "token", "frames", "answer", "abandoned", "notify", "t_sent", "error")

    def __init__(self, name: str, token: bytes, frames: list[Any]):
        self.name = name
        self.token = token
        self.frames = frames     # the REQUEST to send
        self.answer: list[bytes] | None = None
        self.abandoned = False   # the asker timed out: the answer is consumed and dropped
        self.notify: Callable[[], None] | None = None
        self.t_sent = 0.0        # when it was asked (`ClientCore.expect_mmi`): its silence counts from then
        self.error: BaseException | None = None  # the broker's silence (`ClientCore.fail_unreachable`)
