"""Pinned streams in the socket-free core (client_sdk/pins.py, mixed into ClientCore): frames
and times in, frames and `ops` out, no socket.  Each test plays the broker's LEASED and
LEASE_END and the leased worker's replies (`on_message(..., pin=...)`) by hand."""
from __future__ import annotations

import ast
import itertools
import pathlib

import numpy as np
import pytest

import client_sdk
from broker import protocol as P
from broker.protocol import ErrorCode
from client_sdk import errors
from client_sdk.core import ClientCore
from client_sdk.pins import (ASK_TIMEOUT_S, PIN_CONNECT_S, PIN_RETRY_MAX_S, PIN_RETRY_MIN_S, PIN_SLOTS, PinClose,
                             PinOpen, PinSend, pin_slots)

LEASE = bytes(7) + b"\x01"
SECRET = bytes(range(16))
INSTANCE = b"broker01"
ENDPOINT = "ipc:///tmp/zinf-pin-test-w.ipc"


@pytest.fixture
def core():
    c = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", heartbeat_interval=1.0, pin=2)
    try:
        yield c
    finally:
        c.close()


def _final(call, value: np.ndarray, *, final: bool = True) -> list:
    t = P.TensorRef(name="y", dtype=value.dtype.str, shape=list(value.shape), loc=P.InlineLoc(frame=0))
    head = P.encode_header(P.Reply(id=call.id, tensors=[t]))
    return P.client_reply(final, call.service.encode(), [head, value.tobytes()])


def _error(call, code, message) -> list:
    return P.client_reply(True, call.service.encode(), P.error_body(call.id, code, message))


def _send(core, service="echo", now=100.0, inputs=None, **kw):
    call = core.new_call(service, inputs if inputs is not None else {"x": np.arange(3)}, **kw)
    frames = core.request_frames(call, now)
    assert frames[:3] == [P.MDPC, P.C_REQUEST, service.encode()]
    return call, frames


def _ops(core) -> list:
    out = list(core.ops)
    core.ops.clear()
    return out


def _ask_of(ops) -> P.LeaseAsk:
    [frames] = [op for op in ops if type(op) is list and op[1] == P.C_LEASE]
    assert frames[:3] == [P.MDPC, P.C_LEASE, b"echo"]
    return P.decode_lease_ask(frames[3])


def _leased(ask_id, *, service=b"echo", lease=LEASE, slots=2, host=None, instance=INSTANCE, endpoint=ENDPOINT):
    info = P.LeaseInfo(id=ask_id, lease=lease, secret=SECRET, endpoint=endpoint, slots=slots, instance=instance,
                       host=host)
    return [P.MDPC, P.C_LEASED, service, P.encode_header(info)]


def _lease_end(resend, *, lease=LEASE, reason="worker_failed"):
    return [P.MDPC, P.C_LEASE_END, b"echo", P.encode_header(P.LeaseEnd(lease=lease, reason=reason, resend=resend))]


def _pinned(core, now=100.0, slots=2):
    """Ask (through a first, brokered request) and get the lease; returns (first call, pin)."""
    first, _ = _send(core, now=now)
    ask = _ask_of(_ops(core))
    assert first.pin is None
    assert core.on_message(_leased(ask.id, slots=slots), now + 0.001) == []
    [op] = _ops(core)
    assert type(op) is PinOpen and op.pin.endpoint == ENDPOINT and op.pin.slots == slots
    return first, op.pin


def _hb(instance=INSTANCE, route=None) -> list:
    """The broker's answer to a heartbeat (its instance, its client window, our route)."""
    return [P.MDPC, P.C_HEARTBEAT, instance, (3000).to_bytes(4, "big"), *([route] if route is not None else [])]


def _ids(out) -> list[int]:
    """The ids of the REQUESTs among frames to send to the broker."""
    return [P.decode_request(f[3], n_inline=len(f) - 4).id for f in out if f[1] == P.C_REQUEST]


def _asks_heartbeat(out) -> bool:
    return out == [P.client_heartbeat(ask_route=True)]


def _result(call):
    kind, res = call.inbox.popleft()
    assert kind == "final", res
    value = int(res["y"][0])
    res.release()
    return value


def test_pin_option_values():
    assert pin_slots(False) == 0 and pin_slots(None) == 0 and pin_slots(True) == PIN_SLOTS == 8
    assert pin_slots(64) == 64
    for bad in (0.5, -1, "yes", 1 << 17):
        with pytest.raises(errors.InvalidInput):
            pin_slots(bad)
    with pytest.raises(errors.InvalidInput):
        client_sdk.Client("ipc:///tmp/zinf-pin-nobody.sock", pin="always")


def test_without_pin_nothing_is_asked_and_lease_messages_are_not_ours():
    c = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", pin=False)
    try:
        call, _ = _send(c)
        assert not c.ops and call.pin is None and not c.pinned("echo")
        # A LEASED nobody asked for (now) is ended at once: its worker's credit goes back.
        [end] = c.on_message(_leased(call.id), 100.1)
        assert end[:2] == [P.MDPC, P.C_LEASE_END] and not c.ops and not c.pins
        assert c.give_up(call) == P.client_cancel("echo", call.id)
    finally:
        c.close()


def test_first_request_asks_once_and_goes_through_the_broker_until_leased(core):
    a, _ = _send(core)
    ask = _ask_of(_ops(core))
    assert ask.slots == 2 and ask.host == P.local_host_id() and ask.transports == ["inline"]
    assert ask.id == a.id + 1  # from the request-id space
    b, _ = _send(core)  # the ask is outstanding: no second one, and no lease yet
    assert not core.ops and a.pin is None and b.pin is None and not core.pinned("echo")
    assert core.on_message(_leased(ask.id), 100.1) == []
    [op] = _ops(core)
    assert type(op) is PinOpen
    assert op.hello[:2] == [P.MDPC, P.C_HELLO]
    hello = P.decode_lease_hello(op.hello[2])
    assert (hello.lease, hello.secret) == (LEASE, SECRET)
    assert core.pinned("echo") and core.pins_granted == 1
    # The calls sent before the lease still answer through the broker.
    core.on_message(_final(a, np.int64([1])), 100.2)
    assert _result(a) == 1 and core.pinned_replies == 0


def test_pinned_calls_use_the_lease_up_to_its_slots_and_replies_resolve_them(core):
    _, pin = _pinned(core)
    c1, f1 = _send(core, now=101.0)
    c2, _ = _send(core, now=101.0)
    c3, _ = _send(core, now=101.0)  # beyond the 2 slots: through the broker
    assert c1.pin is pin and c2.pin is pin and c3.pin is None and set(pin.calls) == {c1.id, c2.id}
    assert f1[3] and P.decode_request(f1[3], n_inline=len(f1) - 4).id == c1.id  # the same REQUEST frames
    assert core.on_message(_final(c1, np.int64([11])), 101.1, pin=pin) == []
    assert _result(c1) == 11 and core.pinned_replies == 1 and set(pin.calls) == {c2.id}
    c4, _ = _send(core, now=101.2)  # a slot is free again
    assert c4.pin is pin
    core.on_message(_final(c3, np.int64([3])), 101.3)  # the brokered one
    assert _result(c3) == 3 and core.pinned_replies == 1
    # A cancel goes where the call runs.
    assert core.give_up(c2) is None
    [op] = _ops(core)
    assert type(op) is PinSend and op.pin is pin and op.frames == P.client_cancel("echo", c2.id)
    core.on_message(_error(c2, ErrorCode.CANCELLED, "cancelled"), 101.4, pin=pin)
    assert c2.done and not c2.inbox and c2.id not in pin.calls
    assert core.discarded == 1  # the abandoned call's FINAL is dropped


def test_lease_end_with_resend_moves_every_call_to_the_broker_exactly_once(core):
    first, pin = _pinned(core)
    c1, f1 = _send(core, now=101.0)
    c2, _ = _send(core, now=101.0)
    out = core.on_message(_lease_end(True), 102.0)
    assert sorted(P.decode_request(f[3], n_inline=len(f) - 4).id for f in out) == sorted([c1.id, c2.id])
    assert all(f[:3] == [P.MDPC, P.C_REQUEST, b"echo"] for f in out)
    req = P.decode_request(out[0][3], n_inline=len(out[0]) - 4)
    assert req.timeout_ms == pytest.approx(9000.0)  # what is left of the deadline
    [op] = _ops(core)
    assert type(op) is PinClose and op.pin is pin
    assert not core.pinned("echo") and c1.pin is None and c2.pin is None and core.pins_ended == 1
    # A late direct reply (it cannot come on a closed socket, but if it did) is a stray ...
    core.on_message(_final(c1, np.int64([0])), 102.1, pin=pin)
    assert not c1.inbox and core.discarded == 1
    # ... and the broker's answer is the one.
    core.on_message(_final(c1, np.int64([1])), 102.2)
    core.on_message(_final(c2, np.int64([2])), 102.2)
    assert _result(c1) == 1 and _result(c2) == 2 and set(core.calls) == {first.id}
    # A new lease is asked for on a request after the backoff, not before.
    _send(core, now=102.5)
    assert not core.ops
    _send(core, now=102.0 + PIN_RETRY_MIN_S + 0.01)
    _ask_of(_ops(core))


def test_lease_end_with_resend_forgets_abandoned_calls_and_fails_streamed_ones(core):
    first, pin = _pinned(core)
    gone, _ = _send(core, now=101.0)
    streamed, _ = _send(core, now=101.0)
    core.give_up(gone)
    _ops(core)
    core.on_message(_final(streamed, np.int64([5]), final=False), 101.1, pin=pin)
    assert streamed.inbox[0][0] == "partial"
    assert core.on_message(_lease_end(True), 102.0) == []
    assert gone.done and gone.id not in core.calls
    kind, err = streamed.inbox[-1]
    assert kind == "error" and isinstance(err, errors.WorkerFailed) and streamed.done
    # (it may be this client's slowness: a worker ends a connection it holds too much for)
    assert "streamed 1 partial result(s)" in str(err) and "read its replies too slowly" in str(err), err
    assert set(core.calls) == {first.id}
    streamed.inbox.popleft()[1].release()


def test_lease_end_without_resend_lets_calls_finish_on_the_connection(core):
    _, pin = _pinned(core)
    c1, _ = _send(core, now=101.0)
    assert core.on_message(_lease_end(False, reason="worker_stopping"), 102.0) == []
    assert not core.ops and not core.pinned("echo") and pin.ending  # the socket stays for c1
    c2, _ = _send(core, now=102.1)
    assert c2.pin is None  # new calls: through the broker
    core.on_message(_final(c1, np.int64([1])), 102.2, pin=pin)
    assert _result(c1) == 1
    [op] = _ops(core)
    assert type(op) is PinClose and op.pin is pin and LEASE not in core.pin_all


def test_a_given_up_call_on_an_ending_lease_whose_answer_was_lost_lets_the_lease_close(core):
    # Found by the leases audit: `free_given_up` looked at the leases in use only, so a call
    # given up on a lease that had ended without resend (a drain), whose answer never came,
    # kept that lease open, and its connection, for the client's life.
    _, pin = _pinned(core)
    c1, _ = _send(core, now=101.0)
    assert core.on_message(_lease_end(False, reason="drain"), 102.0) == []
    assert pin.ending and LEASE in core.pin_all
    core.give_up(c1, 102.5)  # its CANCEL goes on the lease; its answer is lost
    _ops(core)
    core.free_given_up(103.0, 3.0)  # the window not yet passed
    assert LEASE in core.pin_all
    core.free_given_up(106.0, 3.0)
    assert LEASE not in core.pin_all and any(type(op) is PinClose and op.pin is pin for op in _ops(core))
    assert c1.id not in core.calls and c1.done and c1.pin is None  # nothing can answer it now


def test_a_direct_503_asking_to_resend_goes_through_the_broker_instead(core):
    _, pin = _pinned(core)
    c1, _ = _send(core, now=101.0)
    c2, _ = _send(core, now=101.0)
    msg = "this connection's lease ended (client_gone); resend this request through the broker (it did not run)"
    out = core.on_message(_error(c1, ErrorCode.SERVICE_UNAVAILABLE, msg), 101.5, pin=pin)
    # Parked for the broker's next answer (its heartbeat asked for now), then sent, same id.
    assert _asks_heartbeat(out) and c1.id in core._parked
    assert not c1.inbox and not c1.done and c1.pin is None and c1.id in core.calls
    assert _ids(core.on_message(_hb(), 101.55)) == [c1.id] and not core._parked
    assert not core.pinned("echo") and pin.ending  # c2 still on the connection
    # The broker is told the lease is over (it still counts the lease's slots otherwise).
    [end] = list(core.ops)
    core.ops.clear()
    assert end[:3] == [P.MDPC, P.C_LEASE_END, b"echo"] and P.decode_lease_end(end[3]).lease == pin.lease
    core.on_message(_final(c1, np.int64([1])), 101.6)
    assert _result(c1) == 1
    # A 503 that does not ask to resend is the call's answer.
    core.on_message(_error(c2, ErrorCode.SERVICE_UNAVAILABLE, "no live worker"), 101.7, pin=pin)
    kind, err = c2.inbox.popleft()
    assert kind == "error" and isinstance(err, errors.ServiceUnavailable)
    [op] = _ops(core)
    assert type(op) is PinClose


def test_a_direct_429_goes_through_the_broker_and_keeps_the_lease(core):
    _, pin = _pinned(core)
    c1, _ = _send(core, now=101.0)
    out = core.on_message(_error(c1, ErrorCode.QUEUE_FULL, "all 2 slots of this lease are in flight"), 101.1, pin=pin)
    assert len(out) == 1 and c1.pin is None and core.pinned("echo") and not pin.ending


def test_a_refused_ask_backs_off_doubling_up_to_the_maximum(core):
    now = 100.0
    waits = []
    for _ in range(8):
        call, _ = _send(core, now=now)
        ask = _ask_of(_ops(core))
        refusal = [P.MDPC, P.C_LEASED, b"echo",
                   *P.error_body(ask.id, ErrorCode.SERVICE_UNAVAILABLE, "no worker of it takes leases")]
        assert core.on_message(refusal, now) == []
        retry = core._pin_retry["echo"]
        waits.append(retry - now)
        _send(core, now=retry - 0.01)
        assert not core.ops  # not yet
        now = retry
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, PIN_RETRY_MAX_S, PIN_RETRY_MAX_S, PIN_RETRY_MAX_S]
    assert core.pins_refused == 8 and not core.pins


def test_an_unanswered_ask_is_given_up_and_asked_again(core):
    _send(core, now=100.0)
    first = _ask_of(_ops(core))
    _send(core, now=100.0 + ASK_TIMEOUT_S - 0.1)
    assert not core.ops
    _send(core, now=100.0 + ASK_TIMEOUT_S + 0.1)  # lost: refused, backoff starts
    assert not core.ops
    _send(core, now=100.0 + ASK_TIMEOUT_S + 0.1 + PIN_RETRY_MIN_S)
    again = _ask_of(_ops(core))
    assert again.id != first.id
    # The first ask's late answer is not taken: the broker gets its lease back.
    out = core.on_message(_leased(first.id), 110.0)
    assert out and out[0][:3] == [P.MDPC, P.C_LEASE_END, b"echo"]
    end = P.decode_lease_end(out[0][3])
    assert (end.lease, end.reason) == (LEASE, "client_done") and not core.pinned("echo")


def test_a_lease_of_another_broker_instance_is_handed_back(core):
    core.on_message([P.MDPC, P.C_HEARTBEAT, INSTANCE, (3000).to_bytes(4, "big")], 99.0)
    _send(core)
    ask = _ask_of(_ops(core))
    out = core.on_message(_leased(ask.id, instance=b"another!"), 100.1)
    assert P.decode_lease_end(out[0][3]).reason == "client_done" and not core.pinned("echo")


def _old_lease(core, *, route=None, slots=2):
    """A client that knows broker INSTANCE (and, with ``route``, its connection), pinned, with
    `first` brokered (the lease's ask) and a, b in flight on the lease."""
    core.on_message(_hb(route=route), 99.0)
    first, pin = _pinned(core, slots=slots)
    a, _ = _send(core, now=101.0)
    b, _ = _send(core, now=101.0)
    assert a.pin is pin and b.pin is pin and first.pin is None
    _ops(core)
    return first, pin, a, b


def test_a_broker_restart_ends_every_lease_as_a_drain_and_its_calls_finish_on_it(core):
    """The worker, alive, still runs the calls on the lease and answers them on its
    connection: the new broker never held them, so they are not resent (before, every one
    was, and those still running at the worker ran twice).  Brokered calls are resent as
    before (CANCEL of the old id, a new id)."""
    first, pin, a, b = _old_lease(core)
    old_first, old_a, old_b = first.id, a.id, b.id
    out = core.on_message(_hb(b"broker02"), 102.0)
    assert core.broker_restarts == 1
    assert P.client_cancel("echo", old_first, queued_only=True) in out and first.id != old_first
    assert _ids(out) == [first.id]  # the brokered call alone
    assert (a.id, b.id) == (old_a, old_b) and a.pin is pin and b.pin is pin
    assert not core.ops  # no LEASE_END (the new broker never granted it), the connection stays
    assert pin.ending and not pin.closed and not core.pinned("echo") and pin.lease in core.pin_all
    # A new call goes through the broker; the service is asked for again after the backoff.
    c, _ = _send(core, now=102.1)
    assert c.pin is None and not core.ops
    # The old lease's answers are the calls' answers.
    assert core.on_message(_final(a, np.int64([1])), 102.2, pin=pin) == []
    assert _result(a) == 1 and not core.ops
    assert core.on_message(_final(b, np.int64([2])), 102.3, pin=pin) == []
    assert _result(b) == 2
    [op] = _ops(core)  # after the last one, the connection closes
    assert type(op) is PinClose and op.pin is pin and pin.lease not in core.pin_all
    assert core.pinned_replies == 2 and core.discarded == 0
    _send(core, now=102.0 + PIN_RETRY_MIN_S + 0.01)
    ask = _ask_of(_ops(core))  # pinned again, by the new broker
    core.on_message(_leased(ask.id, lease=bytes(7) + b"\x02", instance=b"broker02"), 103.1)
    assert core.pinned("echo")


def test_a_broker_restart_leaves_an_idle_lease_closed_and_an_ask_void(core):
    core.on_message(_hb(), 99.0)
    first, pin = _pinned(core)
    out = core.on_message(_hb(b"broker02"), 100.5)
    assert _ids(out) == [first.id]
    [op] = _ops(core)
    assert type(op) is PinClose and op.pin is pin and not core.pin_all
    # An ask of the old broker unanswered: void, asked of the new one at the next call.
    core2 = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", heartbeat_interval=1.0, pin=2)
    try:
        core2.on_message(_hb(), 99.0)
        _send(core2)
        _ask_of(_ops(core2))
        core2.on_message(_hb(b"broker02"), 100.1)
        assert not core2._asking
        _send(core2, now=100.2)
        _ask_of(_ops(core2))
    finally:
        core2.close()


def test_a_call_its_worker_refuses_after_the_restart_goes_through_the_new_broker_once(core):
    """The worker, reconnecting to the new broker, ended its leases and answers 503
    "resend through the broker" for what it had not started: sent once, same id, after the
    broker's next heartbeat answer; the other call finishes on the lease."""
    first, pin, a, b = _old_lease(core)
    core.on_message(_hb(b"broker02"), 102.0)
    old_a = a.id
    msg = "this connection's lease ended (broker connection re-established); resend this request through the broker"
    out = core.on_message(_error(a, ErrorCode.SERVICE_UNAVAILABLE, msg), 102.1, pin=pin)
    assert _asks_heartbeat(out) and not core.ops  # no LEASE_END: the lease was over already
    assert a.pin is None and a.id == old_a and not a.inbox and set(pin.calls) == {b.id}
    out = core.on_message(_hb(b"broker02"), 102.2)
    assert _ids(out) == [old_a] and len(out) == 1  # no CANCEL, no new id
    assert a.broker == b"broker02"
    assert core.on_message(_hb(b"broker02"), 102.3) == []  # nothing twice
    core.on_message(_final(a, np.int64([1])), 102.4)
    core.on_message(_final(b, np.int64([2])), 102.5, pin=pin)
    assert _result(a) == 1 and _result(b) == 2 and a.resends == 0
    assert core.discarded == 0 and core.pinned_replies == 1


def test_a_call_refused_before_the_client_knows_of_the_restart_is_sent_once(core):
    """The worker may hear of the new broker first: its 503 comes before the heartbeat
    answer that names the new broker.  Sent through the broker at once, the call reached the
    new broker and started; the answer, a moment later, had it sent again under a new id (a
    call sent before it may have been lost with the old broker), and it ran twice (the
    earlier attempt's "last call ran twice").  Parked, it waits for that answer."""
    first, pin, a, b = _old_lease(core)
    old_first, old_a = first.id, a.id
    msg = "this connection's lease ended (broker connection re-established); resend this request through the broker"
    out = core.on_message(_error(a, ErrorCode.SERVICE_UNAVAILABLE, msg), 101.5, pin=pin)
    assert _asks_heartbeat(out) and a.id in core._parked
    [end] = _ops(core)  # the client had not ended the lease: it says so (a new broker ignores it)
    assert end[1] == P.C_LEASE_END
    # A second refusal before the answer: parked too, no second heartbeat.
    assert core.on_message(_error(b, ErrorCode.SERVICE_UNAVAILABLE, msg), 101.6, pin=pin) == []
    [op] = _ops(core)
    assert type(op) is PinClose
    out = core.on_message(_hb(b"broker02"), 102.0)
    assert core.broker_restarts == 1
    requests = _ids(out)
    assert sorted(requests) == sorted([first.id, old_a, b.id]) and len(requests) == 3
    assert first.id != old_first and P.client_cancel("echo", old_first, queued_only=True) in out
    assert [f for f in out if f[1] == P.C_CANCEL and f != P.client_cancel("echo", old_first, queued_only=True)] == []
    assert a.id == old_a and a.resends == 0 and b.resends == 0
    assert core.on_message(_hb(b"broker02"), 102.1) == []
    for c, v in ((a, 1), (b, 2), (first, 0)):
        core.on_message(_final(c, np.int64([v])), 102.2)
        assert _result(c) == v
    assert core.discarded == 0 and core.in_flight() == 0


def test_the_connection_lost_after_a_restart_sends_its_calls_through_the_broker_once(core):
    """The old lease's worker died too (its local link closed): its calls go through the
    broker once, after its next answer; a late reply on the old connection is a stray."""
    first, pin, a, b = _old_lease(core)
    core.on_message(_hb(b"broker02"), 102.0)
    ended = core.pins_ended
    out = core.pin_link_lost(pin, 102.1, "the worker closed the lane connection")
    assert _asks_heartbeat(out) and core.pins_ended == ended
    ops = _ops(core)
    assert [type(op) for op in ops] == [PinClose]  # no LEASE_END: over already
    assert core.pin_link_lost(pin, 102.2, "again") == []
    out = core.on_message(_hb(b"broker02"), 102.3)
    assert sorted(_ids(out)) == sorted([a.id, b.id]) and len(out) == 2
    core.on_message(_final(a, np.int64([9])), 102.4, pin=pin)  # late, on the old connection
    assert not a.inbox and core.discarded == 1
    core.on_message(_final(a, np.int64([1])), 102.5)
    core.on_message(_final(b, np.int64([2])), 102.5)
    assert _result(a) == 1 and _result(b) == 2


def test_two_restarts_leave_the_old_leases_calls_where_they_are(core):
    first, pin, a, b = _old_lease(core)
    core.on_message(_hb(b"broker02"), 102.0)
    msg = "this connection's lease ended (broker restarted); resend this request through the broker"
    core.on_message(_error(a, ErrorCode.SERVICE_UNAVAILABLE, msg), 102.1, pin=pin)  # parked
    out = core.on_message(_hb(b"broker03"), 102.2)  # a second restart: its answer sends it there
    assert core.broker_restarts == 2 and b.pin is pin and b.resends == 0
    assert _ids(out).count(a.id) == 1 and b.id not in _ids(out) and a.broker == b"broker03"
    core.on_message(_final(b, np.int64([2])), 102.3, pin=pin)
    assert _result(b) == 2


def test_a_stream_on_a_lease_streams_on_across_a_restart(core):
    first, pin, a, b = _old_lease(core)
    core.on_message(_final(a, np.int64([0]), final=False), 101.5, pin=pin)
    core.on_message(_hb(b"broker02"), 102.0)
    assert a.pin is pin and a.inbox[-1][0] == "partial"  # not failed (it was: it cannot be replayed)
    core.on_message(_final(a, np.int64([1]), final=False), 102.1, pin=pin)
    core.on_message(_final(a, np.int64([2])), 102.2, pin=pin)
    kinds = [k for k, _ in a.inbox]
    assert kinds == ["partial", "partial", "final"]
    for _, r in a.inbox:
        r.release()


def test_calls_given_up_on_an_old_lease_or_while_parked(core):
    """A call on the old lease is cancelled where it runs; a parked one has nothing to
    cancel and is forgotten at the answer (never sent); the client's close ends the old
    connection without a LEASE_END."""
    first, pin, a, b = _old_lease(core)
    core.on_message(_hb(b"broker02"), 102.0)
    assert core.give_up(a, 102.1) is None
    [op] = _ops(core)
    assert type(op) is PinSend and op.frames == P.client_cancel("echo", a.id)
    msg = "this connection's lease ended (broker restarted); resend this request through the broker"
    core.on_message(_error(b, ErrorCode.SERVICE_UNAVAILABLE, msg), 102.2, pin=pin)
    assert core.give_up(b, 102.3) is None  # no CANCEL: the broker never had it
    assert _ids(core.on_message(_hb(b"broker02"), 102.4)) == [] and b.id not in core.calls and b.done
    core.on_message(_error(a, ErrorCode.CANCELLED, "cancelled"), 102.5, pin=pin)
    assert a.done and not a.inbox
    [op] = _ops(core)
    assert type(op) is PinClose


def test_a_parked_call_is_failed_by_the_brokers_silence_and_never_sent(core):
    first, pin, a, b = _old_lease(core)
    core.on_message(_hb(b"broker02"), 102.0)
    msg = "this connection's lease ended (broker restarted); resend this request through the broker"
    core.on_message(_error(a, ErrorCode.SERVICE_UNAVAILABLE, msg), 102.1, pin=pin)
    later = 102.1 + 60.0  # the broker silent for a minute: b is on its lease, a waits for the broker
    assert core.fail_unreachable(later) >= 1
    assert isinstance(a.inbox[-1][1], errors.BrokerUnreachable) and not b.inbox
    assert _ids(core.on_message(_hb(b"broker02"), later + 1)) == []
    assert a.id not in core.calls


def test_close_with_calls_on_an_old_lease_closes_its_connection(core):
    first, pin, a, b = _old_lease(core)
    core.on_message(_hb(b"broker02"), 102.0)
    core.pin_goodbye()
    assert [type(op) for op in _ops(core)] == [PinClose]  # no LEASE_END: nobody holds it


def test_a_replaced_broker_connection_ends_every_lease_as_a_drain(core):
    """The broker granted the lease to the old connection (it ends it, client_gone, once it
    presumes that connection's client gone, and ignores a LEASE_END from the new one): the
    calls on it, a stream among them, finish on the lease's connection; the brokered ones
    are sent again on the new connection."""
    first, pin, a, b = _old_lease(core, route=b"route--a")
    core.on_message(_final(b, np.int64([0]), final=False), 101.1, pin=pin)
    old = first.id
    out = core.on_message(_hb(route=b"route--b"), 102.0)
    ops = _ops(core)
    # LEASE_END: a lease granted to the new connection would stay otherwise (the broker
    # ignores it for the old connection's); the connection stays, for a and b
    assert [type(op) for op in ops] == [list] and ops[0][1] == P.C_LEASE_END
    assert P.decode_lease_end(ops[0][3]).lease == LEASE
    assert P.client_cancel("echo", old, queued_only=True) in out and _ids(out) == [first.id]
    assert a.pin is pin and b.pin is pin and not b.inbox[-1][0] == "error" and not core.pinned("echo")
    core.on_message(_final(a, np.int64([1])), 102.1, pin=pin)
    core.on_message(_final(b, np.int64([2])), 102.2, pin=pin)
    assert _result(a) == 1 and [k for k, _ in b.inbox] == ["partial", "final"]
    for _, r in b.inbox:
        r.release()
    assert [type(op) for op in _ops(core)] == [PinClose]
    assert core.broker_reconnects == 1 and core.broker_restarts == 0 and core.discarded == 0
    # Should the broker's LEASE_END with resend reach this client after all (its worker
    # died), what is left on the lease goes through the broker, once.


def test_a_lease_end_with_resend_for_an_old_lease_sends_what_is_left_once(core):
    first, pin, a, b = _old_lease(core, route=b"route--a")
    core.on_message(_hb(route=b"route--b"), 102.0)
    _ops(core)
    out = core.on_message(_lease_end(True), 102.1)
    assert sorted(_ids(out)) == sorted([a.id, b.id])
    assert core.on_message(_lease_end(True), 102.2) == []
    assert core.pin_link_lost(pin, 102.3, "closed") == []


def test_close_says_client_done_for_each_lease_and_closes_its_connection(core):
    _, pin = _pinned(core)
    c1, _ = _send(core, now=101.0)
    core.pin_goodbye()
    ops = _ops(core)
    assert [type(op) for op in ops] == [list, PinClose]
    assert ops[0][:3] == [P.MDPC, P.C_LEASE_END, b"echo"]
    assert P.decode_lease_end(ops[0][3]) == P.LeaseEnd(lease=LEASE, reason="client_done")
    assert c1.pin is None and not core.pins and not core.pin_all


def test_a_connection_that_cannot_open_gives_the_lease_back(core):
    _, pin = _pinned(core)
    core.pin_broken(pin, 100.5, "no such file")
    ops = _ops(core)
    assert [type(op) for op in ops] == [list, PinClose] and ops[0][1] == P.C_LEASE_END
    assert not core.pinned("echo") and core._pin_retry["echo"] == pytest.approx(101.5)


def test_reroute_and_unregister_take_a_call_off_its_lease(core):
    _, pin = _pinned(core)
    c1, _ = _send(core, now=101.0)
    core.reroute(c1)
    assert c1.pin is None and not pin.calls and c1.id in core.calls
    c2, _ = _send(core, now=101.0)
    core.unregister(c2)
    assert c2.pin is None and not pin.calls


def test_shared_memory_goes_on_a_near_lease_and_inline_on_a_far_one():
    c = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="auto", heartbeat_interval=1.0, pin=4)
    try:
        x = {"x": np.arange(2048, dtype=np.float32)}  # 8 KiB: above P.SMALL_INLINE_BYTES
        early = c.new_call("echo", x)  # packed before any lease: shared memory
        assert early.packed.uses_shm
        c.request_frames(early, 100.0)
        ask = _ask_of(_ops(c))
        assert ask.transports == ["shm", "inline"] and ask.host == P.local_host_id()
        # A far lease (no host): new calls pack inline and go on it; a call packed with
        # references cannot, and goes through the broker.
        c.on_message(_leased(ask.id, slots=4), 100.1)
        [op] = _ops(c)
        far = op.pin
        assert not far.near
        shm_call = c.new_call("echo", x)
        assert c.pin_inline("echo")
        assert not shm_call.packed.uses_shm and shm_call.reply == "inline"
        c.request_frames(shm_call, 100.2)
        assert shm_call.pin is far
        c.on_message(_lease_end(False, reason="drain"), 100.3)
        _ops(c)
        # A near lease: references go on it.
        c.request_frames(c.new_call("echo", x), 100.3 + PIN_RETRY_MIN_S)
        ask = _ask_of(_ops(c))
        c.on_message(_leased(ask.id, lease=bytes(7) + b"\x02", slots=4, host=P.local_host_id()), 102.0)
        [op] = _ops(c)
        assert op.pin.near
        near_call = c.new_call("echo", x)
        assert near_call.packed.uses_shm
        c.request_frames(near_call, 102.1)
        assert near_call.pin is op.pin
    finally:
        c.close()


def test_pins_module_is_socket_free():
    src = (pathlib.Path(client_sdk.__file__).parent / "pins.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    assert not {"zmq", "asyncio", "time", "socket", "selectors"} & names


def test_a_pinning_client_sends_the_same_request_frames_as_a_plain_one():
    plain = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", pin=False)
    pinning = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", pin=True)
    try:
        plain._ids, pinning._ids = itertools.count(7), itertools.count(7)
        kw = dict(timeout=3.0, priority="urgent", meta={"k": 1}, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
        a = plain.request_frames(plain.new_call("echo", {"x": np.arange(5)}, **kw), 100.0)
        b = pinning.request_frames(pinning.new_call("echo", {"x": np.arange(5)}, **kw), 100.0)
        assert [bytes(f) for f in a] == [bytes(f) for f in b]
        assert not plain.ops and len(pinning.ops) == 1  # the ask, beside the request
    finally:
        plain.close()
        pinning.close()


# ------------------------------------------------------------------ streams pin by default (issue 13)

def _plain_core(**kw):
    return ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", heartbeat_interval=1.0, **kw)


def test_a_stream_pins_its_service_on_a_plain_client_and_nothing_else():
    c = _plain_core(pin=False)
    twin = _plain_core(pin=False)  # the same client without any stream: the reference frames
    try:
        c._ids = itertools.count(7)
        before, _ = _send(c, "other")
        assert not c.ops and before.pin is None
        assert c.stream_pins(None) is True
        c.pin_on_demand("echo", 2)  # what client.stream("echo") does
        assert c.pin_services == {"echo": 2}
        first, _ = _send(c, "echo")
        ask = _ask_of(_ops(c))
        assert ask.slots == 2 and first.pin is None  # brokered until LEASED: its max_in_flight
        # A plain request to another service: no ask, and the frames of a client without streams.
        n = next(c._ids)
        c._ids, twin._ids = itertools.count(n), itertools.count(n)
        other, frames = _send(c, "other", now=100.5)
        _, twin_frames = _send(twin, "other", now=100.5)
        assert not c.ops and not twin.ops and other.pin is None
        assert [bytes(f) for f in frames] == [bytes(f) for f in twin_frames]
        # LEASED is ours now (a client without streams drops it: see above).
        assert c.on_message(_leased(ask.id, slots=2), 100.6) == []
        [op] = _ops(c)
        assert type(op) is PinOpen and c.pinned("echo") and not c.pinned("other")
        on_lease, _ = _send(c, "echo", now=101.0)
        still_brokered, _ = _send(c, "other", now=101.0)
        assert on_lease.pin is op.pin and still_brokered.pin is None and not c.ops
        c.on_message(_final(on_lease, np.int64([4])), 101.1, pin=op.pin)
        assert _result(on_lease) == 4 and c.pinned_replies == 1
        # Closing ends the lease as a pinning client's does.
        c.pin_goodbye()
        ops = _ops(c)
        assert [type(o) for o in ops] == [list, PinClose]
        assert P.decode_lease_end(ops[0][3]) == P.LeaseEnd(lease=LEASE, reason="client_done")
    finally:
        c.close()
        twin.close()


def test_a_stream_asks_for_the_largest_max_in_flight_of_its_service():
    c = _plain_core(pin=False)
    try:
        c.pin_on_demand("echo", 3)
        c.pin_on_demand("echo", PIN_SLOTS + 12)
        c.pin_on_demand("echo", 1)  # the largest stream's stays
        _send(c, "echo")
        assert _ask_of(_ops(c)).slots == PIN_SLOTS + 12
    finally:
        c.close()


def test_a_pin_false_stream_never_asks_and_never_goes_on_a_lease(core):
    plain = _plain_core(pin=False)
    try:
        assert plain.stream_pins(False) is False  # client.stream(..., pin=False) pins nothing
        call = plain.new_call("echo", {"x": np.arange(3)})
        call.no_pin = True  # what a pin=False stream marks its frames with
        plain.request_frames(call, 100.0)
        assert not plain.ops and not plain.pin_services and call.pin is None
    finally:
        plain.close()
    # On a pinning client too: its frames stay brokered beside the lease.
    _, pin = _pinned(core)
    frame = core.new_call("echo", {"x": np.arange(3)})
    frame.no_pin = True
    core.request_frames(frame, 101.0)
    assert frame.pin is None and not pin.calls and not core.ops


def test_stream_pin_option_values():
    c = _plain_core(pin=False)
    deaf = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="inline", heartbeat_interval=None)
    try:
        assert c.stream_pins(None) is True and c.stream_pins(True) is True and c.stream_pins(False) is False
        for bad in ("yes", 1, 0.5):
            with pytest.raises(errors.InvalidInput):
                c.stream_pins(bad)
        # Without heartbeats: None does not pin, True cannot.
        assert deaf.stream_pins(None) is False and deaf.stream_pins(False) is False
        with pytest.raises(errors.InvalidInput, match="heartbeats"):
            deaf.stream_pins(True)
    finally:
        c.close()
        deaf.close()


def test_a_pinning_client_keeps_its_own_slots_for_a_stream(core):
    core.pin_on_demand("echo", 50)
    assert not core.pin_services  # pin=2 pins every service already
    _send(core)
    assert _ask_of(_ops(core)).slots == 2


def test_the_last_stream_closing_ends_its_lease_and_unpins_the_service():
    c = _plain_core(pin=False)
    try:
        c.pin_on_demand("echo", 2)
        c.pin_on_demand("echo", 2)  # two streams of one service
        first, _ = _send(c, "echo")
        ask = _ask_of(_ops(c))
        assert c.on_message(_leased(ask.id, slots=2), 100.1) == []
        [op] = _ops(c)
        on_lease, _ = _send(c, "echo", now=100.2)
        assert on_lease.pin is op.pin
        c.pin_release("echo", 100.3)  # one of two closed: still pinned
        assert c.pinned("echo") and not c.ops
        c.pin_release("echo", 100.4)  # the last: LEASE_END, the call in flight finishes on the lease
        [end] = _ops(c)
        assert P.decode_lease_end(end[3]) == P.LeaseEnd(lease=LEASE, reason="client_done")
        assert not c.pinned("echo") and "echo" not in c.pin_services
        c.on_message(_final(on_lease, np.int64([5])), 100.5, pin=op.pin)
        assert _result(on_lease) == 5
        assert [type(o) for o in _ops(c)] == [PinClose]  # its connection closes after its last call
        later, _ = _send(c, "echo", now=200.0)  # the service is not pinned any more: no ask
        assert later.pin is None and not c.ops
    finally:
        c.close()


def test_a_stream_on_a_tcp_client_does_not_pin_by_default():
    c = ClientCore("tcp://127.0.0.1:5555", transport="inline", heartbeat_interval=1.0)
    try:
        assert c.stream_pins(None) is False and c.stream_pins(True) is True
    finally:
        c.close()


def test_a_link_lost_under_a_lease_in_use_resends_its_calls_and_hands_the_lease_back(core):
    """The worker's local link closed under the client (docs/protocol.md 10.6): what was on
    it goes through the broker now, the broker is told the lease is over (its slots come
    back), and a LEASE_END the broker sends after it finds nothing left to resend."""
    first, pin = _pinned(core)
    core.on_message(_final(first, np.int64([0])), 100.01)
    assert _result(first) == 0
    a, fa = _send(core, now=100.1)
    b, fb = _send(core, now=100.1)
    assert a.pin is pin and b.pin is pin
    _ops(core)
    out = core.pin_link_lost(pin, 100.2, "the worker closed the lane connection")
    assert _asks_heartbeat(out)  # parked until the broker's next answer (pins.py, `_park`)
    out = core.on_message(_hb(), 100.25)
    assert sorted(bytes(f[2]) for f in out) == [b"echo", b"echo"]
    assert {P.decode_request(f[3]).id for f in out} == {a.id, b.id}  # the same ids, through the broker
    ops = _ops(core)
    [end] = [op for op in ops if type(op) is list and op[1] == P.C_LEASE_END]
    assert P.decode_lease_end(end[3]).reason == "client_done"
    assert any(type(op) is PinClose for op in ops)
    assert a.pin is None and b.pin is None and not core.pinned("echo") and core.pins_ended == 1
    assert core.on_message(_lease_end(True), 100.3) == []  # the broker's word, after: nothing twice
    assert core.pin_link_lost(pin, 100.4, "again") == [] and not core.ops
    core.on_message(_final(a, np.int64([1])), 100.5)
    core.on_message(_final(b, np.int64([2])), 100.5)
    assert _result(a) == 1 and _result(b) == 2


TCP_ENDPOINT = "tcp://192.0.2.7:7001"


def _tcp_pinned(now=100.0):
    """A remote client (tcp broker) leased a worker's tcp direct socket: (client, first call, pin)."""
    c = ClientCore("tcp://127.0.0.1:5555", transport="inline", heartbeat_interval=1.0, pin=2)
    first, _ = _send(c, now=now)
    ask = _ask_of(_ops(c))
    assert c.on_message(_leased(ask.id, endpoint=TCP_ENDPOINT), now + 0.001) == []
    [op] = _ops(c)
    assert type(op) is PinOpen and op.pin.endpoint == TCP_ENDPOINT
    return c, first, op.pin


def test_a_tcp_lease_takes_calls_only_once_its_handshake_succeeded():
    """docs/protocol.md 10.4: until the twin saw the connection's handshake succeed, the
    lease's calls go through the broker (an address we cannot reach costs them nothing)."""
    c, _, pin = _tcp_pinned()
    try:
        assert not pin.ready and not c.pinned("echo")
        early, _ = _send(c, now=100.1)
        assert early.pin is None and not _ops(c)  # brokered, and no second ask
        assert c.pin_disconnected(pin, 100.2, "no connection yet") == []  # libzmq tries again
        assert pin.trouble == "no connection yet" and not pin.closed
        c.pin_connected(pin)
        assert pin.ready and c.pinned("echo")
        on, _ = _send(c, now=100.3)
        assert on.pin is pin
    finally:
        c.close()


def test_a_tcp_lease_without_a_handshake_in_time_goes_back_to_the_broker():
    c, _, pin = _tcp_pinned()
    try:
        c.pin_disconnected(pin, 100.5, "the worker refused the handshake (its key, or ours)")
        _send(c, now=100.0 + PIN_CONNECT_S - 0.01)
        assert not _ops(c) and not pin.closed  # not yet
        late, _ = _send(c, now=100.0 + PIN_CONNECT_S + 0.01)
        assert late.pin is None
        ops = _ops(c)
        assert [type(op) for op in ops] == [list, PinClose] and ops[0][1] == P.C_LEASE_END
        assert P.decode_lease_end(ops[0][3]).reason == "client_done"
        assert pin.closed and c.pins_refused == 1 and not c.pins
        # brokered for the backoff, then asked again
        _send(c, now=100.0 + PIN_CONNECT_S + 0.5)
        assert not _ops(c)
        _send(c, now=100.0 + PIN_CONNECT_S + PIN_RETRY_MIN_S + 0.02)
        assert _ask_of(_ops(c)).slots == 2
    finally:
        c.close()


def test_a_heartbeat_gives_back_a_tcp_lease_no_call_asked_for():
    c, _, pin = _tcp_pinned()
    try:
        c.heartbeat(100.0 + PIN_CONNECT_S / 2)
        assert not _ops(c)
        c.heartbeat(100.0 + PIN_CONNECT_S + 0.1)
        assert [type(op) for op in _ops(c)] == [list, PinClose] and pin.closed
        # a late handshake of the closed lease changes nothing
        c.pin_connected(pin)
        assert not pin.ready and not c.pinned("echo")
    finally:
        c.close()


def test_a_tcp_connection_lost_after_its_handshake_resends_what_was_on_it():
    """A drop (or a peer silent past libzmq's heartbeats: a partition) after the handshake is
    a lost connection: the calls on it go through the broker now, the lease goes back."""
    c, _, pin = _tcp_pinned()
    try:
        c.pin_connected(pin)
        a, _ = _send(c, now=101.0)
        b, _ = _send(c, now=101.0)
        assert a.pin is pin and b.pin is pin
        _ops(c)
        assert _asks_heartbeat(c.pin_disconnected(pin, 101.5, "the connection dropped"))
        out = c.on_message(_hb(), 101.55)
        assert {P.decode_request(f[3]).id for f in out} == {a.id, b.id}
        ops = _ops(c)
        assert [type(op) for op in ops] == [list, PinClose] and ops[0][1] == P.C_LEASE_END
        assert a.pin is None and b.pin is None and c.pins_ended == 1
        assert c.pin_disconnected(pin, 101.6, "again") == [] and not c.ops
    finally:
        c.close()


def test_ipc_and_link_leases_are_ready_at_once(core):
    _, pin = _pinned(core)
    assert pin.ready and core.pinned("echo")


def test_a_tcp_handshake_refused_for_good_gives_the_lease_back_at_once():
    """libzmq does not try again after a handshake the worker refused (or one that failed on
    the protocol): waiting out PIN_CONNECT_S would only delay the broker getting its slots."""
    c, _, pin = _tcp_pinned()
    try:
        assert c.pin_disconnected(pin, 100.1, "the worker refused the handshake", final=True) == []
        ops = _ops(c)
        assert [type(op) for op in ops] == [list, PinClose] and ops[0][1] == P.C_LEASE_END
        assert pin.closed and c.pins_refused == 1 and not c.pins
    finally:
        c.close()


def test_a_pinned_call_is_not_given_up_for_the_brokers_silence(core):
    # Its worker answers it, on a connection watched on its own (pin_link_lost): a partition
    # between the client and its broker alone failed it with BrokerUnreachable after five
    # heartbeat intervals (found by the network hunt).  A brokered call still is.
    first, pin = _pinned(core)
    pin.ready = True  # the connection's handshake succeeded (what the twins report)
    pinned, _ = _send(core, now=100.5)
    assert pinned.pin is pin
    later = 100.5 + 60.0  # the broker silent for a minute
    assert core.unreachable(pinned, later) is None
    assert isinstance(core.unreachable(first, later), errors.BrokerUnreachable)
    assert core.fail_unreachable(later) == 1
    assert not pinned.inbox and first.inbox[0][0] == "error"


def test_close_gives_up_a_parked_call_which_is_then_never_sent():
    """A call off its lease, parked until the broker's next heartbeat answer (`_park`), when
    close() begins: it never ran and nothing will answer it, so close() does not wait for
    it, and it is not sent through the broker at that answer, which the close's wait reads
    (it went out as a new request of a client about to leave: run for nobody, and its reply
    in shared memory, coming after the close, kept its slot lent)."""
    core = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", transport="auto", heartbeat_interval=1.0, pin=2)
    try:
        core.on_message(_hb(), 99.0)
        first, pin = _pinned(core)
        a, _ = _send(core, now=101.0, reply="shm")  # (its answer may name output slots)
        assert a.pin is pin
        msg = "this connection's lease ended (client_gone); resend this request through the broker (it did not run)"
        assert _asks_heartbeat(core.on_message(_error(a, ErrorCode.SERVICE_UNAVAILABLE, msg), 101.5, pin=pin))
        assert a.id in core._parked
        calls, _ = core.close_cancel(101.6)
        assert first in calls and a not in calls
        assert a.abandoned
        assert _ids(core.on_message(_hb(), 101.7)) == [], "the parked call was sent during close()'s wait"
        assert a.id not in core.calls and a.done
    finally:
        core.close()


# ------------------------------------------------------------------ ids given up on (docs/shm.md)

def test_the_ids_of_a_call_that_no_answer_came_for_are_given_up_for_their_output_slots(monkeypatch):
    """A call sent again after a broker restart has two ids; the one that does not answer
    is given up (its reply may have been lost with the broker, naming output slots lent to
    this process), and so is every id of a call forgotten without an answer.  Kept for
    `GIVEN_UP_LOOKS` heartbeat looks, at most `GIVEN_UP_MAX` of them."""
    from types import SimpleNamespace

    from client_sdk import core as core_mod

    # (transport "auto" on ipc: outputs may come in slots; an inline client gives nothing up)
    c = ClientCore("ipc:///tmp/zinf-pin-core-test.sock", heartbeat_interval=1.0, pool_capacity=1 << 20, pin=False)
    try:
        c.on_message(_hb(), 100.0)
        a, _ = _send(c, now=100.0)
        b, _ = _send(c, now=100.0)
        old_a, old_b = a.id, b.id
        out = c.on_message(_hb(b"broker02"), 101.0)  # a restart: both sent again, under new ids
        assert sorted(_ids(out)) == sorted([a.id, b.id]) and old_a not in (a.id, b.id)
        assert not c._given_up  # both ids of each still answerable
        c.on_message(_final(a, np.int64([1])), 101.1)  # a's new run answers
        assert list(c._given_up) == [old_a]
        c.on_message(_final(SimpleNamespace(id=old_b, service="echo"), np.int64([2])), 101.2)  # b's old run
        assert list(c._given_up) == [old_a, b.id]
        assert _result(a) == 1 and _result(b) == 2
        d, _ = _send(c, now=102.0)
        c.on_message(_final(d, np.int64([3])), 102.1)  # answered at once: nothing given up
        assert list(c._given_up) == [old_a, b.id] and _result(d) == 3
        monkeypatch.setattr(core_mod, "GIVEN_UP_MAX", 2)
        e, _ = _send(c, now=103.0)
        c._forget(e)  # forgotten without an answer (as when a stream is cut by a restart)
        assert list(c._given_up) == [b.id, e.id]  # the oldest went
        f, _ = _send(c, now=103.5, reply="inline")
        c._forget(f)  # its outputs come inline: nothing to give back
        assert list(c._given_up) == [b.id, e.id]
        c._looks += core_mod.GIVEN_UP_LOOKS
        c._return_given_up()
        assert list(c._given_up) == [b.id, e.id]  # (not yet older than the window)
        c._looks += 1
        c._return_given_up()
        assert not c._given_up
    finally:
        c.close()
