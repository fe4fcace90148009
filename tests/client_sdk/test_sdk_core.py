"""ClientCore without any socket or clock: frames and times in, inbox items and frames out.

Each test builds the replies a broker or worker would send with broker.protocol and feeds them
to `on_message` with an explicit `now`, so deadlines, liveness and duplicate handling are one
call each."""
from __future__ import annotations

import numpy as np
import pytest

from broker import protocol as P
from broker.protocol import ErrorCode
from client_sdk import BrokerUnreachable, DeadlineExceeded, InvalidInput, errors
from client_sdk.calls import MMI_SERVICE, mmi_answer, opaque_reply
from client_sdk.core import LIVENESS, REDIAL_S, ClientCore


@pytest.fixture
def core():
    c = ClientCore("ipc:///tmp/zinf-core-test.sock", transport="inline", heartbeat_interval=1.0)
    try:
        yield c
    finally:
        c.close()


def _final(call, value: np.ndarray, *, final: bool = True, seq: int = 0) -> list:
    t = P.TensorRef(name="y", dtype=value.dtype.str, shape=list(value.shape), loc=P.InlineLoc(frame=0))
    head = P.encode_header(P.Reply(id=call.id, tensors=[t], seq=seq))
    return P.client_reply(final, call.service.encode(), [head, value.tobytes()])


def _sent(core, service="echo", now=100.0, **kw):
    call = core.new_call(service, {"x": np.arange(3)}, **kw)
    frames = core.request_frames(call, now)
    assert frames[:3] == [P.MDPC, P.C_REQUEST, service.encode()]
    return call


def test_reply_goes_to_its_call_once_and_a_duplicate_is_dropped(core):
    woken = []
    a, b = _sent(core), _sent(core)
    assert b.id == a.id + 1 and a.id >= 1 and set(core.calls) == {a.id, b.id}  # consecutive, from a random start
    b.notify = lambda: woken.append(b.id)
    assert core.on_message(_final(b, np.int64([7]), final=False), 100.1) == []
    assert core.on_message(_final(b, np.int64([8])), 100.25) == []
    assert woken == [b.id, b.id] and not a.inbox
    (k1, partial), (k2, res) = b.inbox
    assert (k1, k2) == ("partial", "final") and int(partial["y"][0]) == 7 and int(res["y"][0]) == 8
    assert b.done and b.t_done == 100.25 and res.timing["client_ms"] == pytest.approx(250.0)
    assert set(core.calls) == {a.id} and core.discarded == 0
    core.on_message(_final(b, np.int64([8])), 100.3)  # the relayed copy of a direct reply
    assert core.discarded == 1 and len(b.inbox) == 2


def test_error_reply_is_typed_and_finishes_the_call(core):
    call = _sent(core)
    core.on_message(P.client_reply(True, b"echo", P.error_body(call.id, ErrorCode.QUEUE_FULL, "busy")), 101.0)
    kind, err = call.inbox.popleft()
    assert kind == "error" and type(err) is errors.QueueFull and err.request_id == call.id
    assert call.done and not core.calls


def test_a_cancel_we_did_not_ask_for_past_the_deadline_is_the_deadline(core):
    # The broker's deadline cancels the request at its worker, whose 499 can arrive before
    # the broker's own 504: an SLO caller was told "cancelled ... retry" (an AsyncStream's
    # frames, 4 runs in 9).  Before the deadline a CANCELLED is what it says.
    late = _sent(core, timeout=1.0, now=50.0)
    core.on_message(P.client_reply(True, b"echo", P.error_body(late.id, ErrorCode.CANCELLED, "cancelled")), 51.002)
    kind, err = late.inbox.popleft()
    assert kind == "error" and isinstance(err, DeadlineExceeded) and err.request_id == late.id
    early = _sent(core, timeout=1.0, now=50.0)
    core.on_message(P.client_reply(True, b"echo", P.error_body(early.id, ErrorCode.CANCELLED, "cancelled")), 50.5)
    kind, err = early.inbox.popleft()
    assert kind == "error" and type(err) is errors.Cancelled


def test_request_header_carries_the_remaining_deadline(core):
    call = _sent(core, timeout=2.0, now=50.0)
    assert call.deadline == 52.0 and call.remaining(51.5) == 0.5
    err = call.deadline_error()
    assert isinstance(err, DeadlineExceeded) and "2s" in str(err) and err.request_id == call.id


def test_give_up_frees_an_unsent_call_and_cancels_a_sent_one(core):
    unsent = core.new_call("echo", {"x": np.arange(2)})
    assert core.give_up(unsent) is None and unsent.done and unsent.abandoned
    sent = _sent(core)
    assert core.give_up(sent) == P.client_cancel("echo", sent.id)
    assert core.give_up(sent) is None  # once
    core.on_message(_final(sent, np.int64([1])), 101.0)  # its late FINAL is dropped
    assert not sent.inbox and core.discarded == 1 and not core.calls


def test_liveness_is_decided_from_the_times_passed_in(core):
    call = _sent(core, now=10.0)
    limit = 10.0 + LIVENESS * 1.0
    assert core.unreachable(call, limit) is None
    assert isinstance(core.unreachable(call, limit + 0.1), BrokerUnreachable)
    core.on_message(P.client_heartbeat(), 14.0)  # anything heard resets the silence
    assert core.unreachable(call, limit + 0.1) is None and core.fail_unreachable(limit + 0.1) == 0
    assert core.fail_unreachable(14.0 + LIVENESS + 0.5) == 1
    assert core.fail_unreachable(14.0 + LIVENESS + 0.6) == 0  # one error is enough: nothing new failed
    assert [k for k, _ in call.inbox] == ["error"] and isinstance(call.inbox[0][1], BrokerUnreachable)


def test_silence_is_counted_while_the_client_listens_not_while_its_caller_is_away(core):
    """A blocking client looks at its sockets only while a call waits; the broker's silence
    over a spell when nobody looked (the program did something else) is not the broker's."""
    call = _sent(core, now=10.0)
    core.looking(10.0)
    core.looking(10.9)  # waiting: it looks at least once a heartbeat period
    # The caller was away for 20 s; back, it sends its heartbeat only now.
    core.looking(30.0)
    assert core.unreachable(call, 30.1) is None and core.fail_unreachable(30.1) == 0
    # ... and the silence counts again from there, while it listens.
    for t in (31.0, 32.0, 33.0, 34.0, 35.0):
        core.looking(t)
    assert core.fail_unreachable(30.0 + LIVENESS * 1.0) == 0
    assert core.fail_unreachable(30.0 + LIVENESS * 1.0 + 0.1) == 1


def test_a_client_that_keeps_coming_back_for_a_moment_still_learns_the_broker_is_dead(core):
    """Forgiven once per message heard: looks 2.5 s apart (each after an absence) and
    nothing heard, the call fails LIVENESS intervals after the first return."""
    call = _sent(core, now=10.0)
    core.last_send = 10.0  # as the twins note it
    failed_at = None
    t = 10.0
    while failed_at is None and t < 100.0:
        t += 2.5
        assert core.looking(t)  # each look is a return from an absence
        if core.fail_unreachable(t):
            failed_at = t
    assert failed_at is not None and 12.5 + LIVENESS * 1.0 < failed_at <= 12.5 + LIVENESS * 1.0 + 2.5
    assert isinstance(call.inbox[0][1], BrokerUnreachable)


def test_a_heard_message_earns_the_next_absence_its_pardon(core):
    call = _sent(core, now=10.0)
    core.looking(10.0)
    assert core.looking(20.0) and core.resumed_at == 20.0
    core.on_message(P.client_heartbeat(), 20.1)  # the answer to the heartbeat of the return
    assert core.looking(40.0) and core.resumed_at == 40.0
    assert core.fail_unreachable(40.1) == 0 and not call.inbox
    assert core.looking(60.0) and core.resumed_at == 40.0  # nothing heard since: no pardon
    assert core.fail_unreachable(60.0) == 1


def test_a_client_that_listens_without_pause_is_never_resumed(core):
    call = _sent(core, now=10.0)
    t = 10.0
    while t < 10.0 + LIVENESS + 1:  # wake-ups a little late (a loaded machine): still listening
        core.looking(t)
        t += 1.0 * 1.5
    assert core.resumed_at == 0.0
    assert isinstance(core.unreachable(call, t), BrokerUnreachable)


def test_heartbeat_due_only_while_calls_wait(core):
    assert not core.heartbeat_due(1000.0)
    call = _sent(core, now=10.0)
    core.heartbeat(10.0)  # one went out at 10.0
    assert not core.heartbeat_due(10.5) and core.heartbeat_due(11.0)
    core.give_up(call)
    assert not core.heartbeat_due(11.0)


def test_a_refused_handshake_dials_again_at_once_then_at_most_once_per_redial_interval(core):
    # libzmq gives a tcp endpoint up at a refused handshake (final): the client dials again
    # itself.  A failure libzmq tries again by itself is only said.
    key = "it refused this client's key"
    core.broker_said(None, 10.0, False)  # nothing reported
    assert core.redial_at is None and core.refused is None
    core.broker_said("no detail given", 10.0, False)
    assert core.redial_at is None and core.refused == "no detail given"
    core.broker_said(key, 10.0, True)
    assert core.redial_at == 10.0 and core.refused == key
    core.broker_said(key, 10.2, True)  # (a second word before the dial)
    assert core.redial_at == 10.0
    core.broker_said("no detail given; most likely `server_key`", 10.25, False)
    assert core.refused == key  # a refusal without detail does not replace one with
    core.redialed(10.3)
    assert core.redial_at is None
    core.broker_said(key, 10.4, True)  # refused again: not before a second on
    assert core.redial_at == pytest.approx(10.3 + REDIAL_S)
    core.redialed(11.3)
    core.broker_said("", 11.4, False)  # the handshake succeeded: nothing to dial, nothing refused
    assert core.redial_at is None and core.refused is None
    core.close()
    core.broker_said(key, 20.0, True)  # a closed client dials nothing
    assert core.redial_at is None


def test_a_deadline_the_broker_was_silent_through_says_so_not_raise_the_timeout(core):
    """A call whose broker answered nothing, not even a heartbeat, for over two heartbeat
    periods since the first heartbeat sent after its last word (a killed broker): its error
    says the broker is silent, not "raise `timeout`", also for a call shorter than that made
    long after (an AR client's 2 s call, 4.5 s after the broker was killed: the rolling-restart
    audit).  A broker that answered since (a slow model, a live broker) leaves the usual
    advice, as does a wait too short to tell."""
    inst, a = b"\x01" * 8, b"route--a"
    core.on_message(P.broker_heartbeat(inst, 10_000, a), 100.0)
    call = _sent(core, now=100.0, timeout=3.0)
    core.heartbeat(100.01)  # unanswered, as every one after it
    core.heartbeat(101.01)
    said = str(core.deadline_error(call))
    assert "nothing has come from the broker at" in said and "for 3.0s" in said, said
    assert "raise `timeout`" not in said, said
    short = _sent(core, now=104.0, timeout=0.5)  # made long after: the broker still silent
    assert "nothing has come from the broker at" in str(core.deadline_error(short))
    core.on_message(P.broker_heartbeat(inst, 10_000, a), 104.6)  # it answers again
    assert "raise `timeout`" in str(core.deadline_error(call))
    late = _sent(core, now=104.7, timeout=0.5)
    core.heartbeat(104.7)
    assert "raise `timeout`" in str(core.deadline_error(late))  # too short a wait to tell


def test_a_refusal_for_good_fails_what_waits_and_what_is_made_until_a_handshake_succeeds(core):
    """The broker refused this client's key (libzmq gave the endpoint up): nothing sent can
    reach it.  Waiting calls and MMI questions fail now with the twin's error; a call made
    meanwhile is answered at once and not sent (None); a handshake that succeeds ends it."""
    from client_sdk.errors import Forbidden

    key = "it refused this client's key"
    waiting = _sent(core, now=10.0)
    q = core.expect_mmi(core.mmi_question("echo"), 10.0)
    core.broker_said(key, 10.1, True)
    assert core.refused_for_good(lambda rid: Forbidden(f"refused ({rid})", request_id=rid), 10.1) == 2
    assert waiting.inbox[-1][0] == "error" and waiting.inbox[-1][1].request_id == waiting.id
    assert waiting.done and waiting.id not in core.calls  # (inline, through the broker: nothing can answer it)
    assert isinstance(q.error, Forbidden)
    made = core.new_call("echo", {"x": np.arange(3)})
    assert core.request_frames(made, 10.2) is None
    assert made.done and made.id not in core.calls and isinstance(made.inbox[-1][1], Forbidden)
    assert core.shut_out is not None  # (the twins' MMI questions raise it, unsent)
    core.redialed(11.1)  # dialled again: calls go out and wait for its word
    assert core.shut_out is None and not _sent(core, now=11.15).inbox
    core.broker_said(key, 11.2, True)
    core.refused_for_good(lambda rid: Forbidden("refused", request_id=rid), 11.2)
    core.broker_said("", 12.2, False, ups=1)  # dialled again, and taken
    assert core.shut_out is None and not _sent(core, now=12.3).inbox


def test_a_client_whose_keys_were_taken_before_is_not_told_its_server_key_is_wrong(core):
    # The reconnect-storm audit: handshakes a restarting broker cut short were blamed on
    # `server_key` for clients whose keys it had taken a moment before.
    from client_sdk.core import KNOWN_NO_DETAIL, NO_DETAIL

    blamed = f"{NO_DETAIL}; most likely `server_key` (or $ZMQ_INFER_SERVER_KEY) is not that broker's public certificate"
    core.broker_said(blamed, 10.0, False)  # never taken: the key is the likely cause, as before
    assert core.refused == blamed
    core.broker_said("", 11.0, False)  # a handshake succeeded
    core.broker_said(blamed, 20.0, False)  # the broker restarts
    assert core.refused == KNOWN_NO_DETAIL and "most likely `server_key`" not in core.refused
    assert "restarted" in core.silence_advice(3.0)
    # A success and a later refusal read together (an idle sync client reads its monitor
    # only during calls): the success counts (found by review).
    other = ClientCore("ipc:///tmp/zinf-core-test.sock", heartbeat_interval=1.0)
    try:
        other.broker_said(blamed, 30.0, False, ups=1)
        assert other.refused == KNOWN_NO_DETAIL
    finally:
        other.close()


def test_a_plain_tcp_client_is_not_told_its_server_key_is_wrong():
    """A handshake failed without detail is most likely the wrong `server_key`, for a client
    that has one; a plain tcp client (`insecure=True`) has none, and was told so anyway (the
    client audit): it is told that a broker with keys cuts its greeting short."""
    from client_sdk.core import NO_DETAIL, PLAIN_NO_DETAIL

    c = ClientCore("tcp://127.0.0.1:5555", transport="inline", heartbeat_interval=1.0)
    try:
        c.plain_tcp = True
        c.broker_said(f"{NO_DETAIL}; most likely `server_key` (or $ZMQ_INFER_SERVER_KEY) is not ...", 1.0)
        assert c.refused == PLAIN_NO_DETAIL and "server_key`" in c.refused and "insecure=True" in c.refused
        c.broker_said("one side speaks CurveZMQ and the other plain tcp", 1.1)  # a cause: kept as said
        assert c.refused.startswith("one side speaks")
    finally:
        c.close()


def test_mmi_answers_without_a_token_match_questions_in_order(core):
    first = core.expect_mmi(core.mmi_question("echo"))
    first.abandoned = True             # timed out; its answer is still on the way
    second = core.expect_mmi(core.mmi_question("nope"))
    assert second.frames == P.client_request(MMI_SERVICE, [b"nope", second.token])
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200"]), 1.0)
    assert first.answer is None and second.answer is None  # the late answer went to `first`
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"404"]), 2.0)
    assert mmi_answer(second.answer, "nope") is False and core.discarded == 0
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200"]), 3.0)  # nobody asked
    assert core.discarded == 1
    with pytest.raises(errors.ProtocolError, match="501"):
        mmi_answer([b"501"], "x")


def test_mmi_answers_find_their_question_by_token_when_one_was_lost(core):
    lost = core.expect_mmi(core.mmi_question("echo"))      # its answer never comes (a restart)
    waiting = core.expect_mmi(core.mmi_question("other"))  # still waiting, answer not lost yet
    lost.abandoned = True
    third = core.expect_mmi(core.mmi_question("nope"))
    assert len({lost.token, waiting.token, third.token}) == 3
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"404", third.token]), 1.0)
    assert mmi_answer(third.answer, "nope") is False and lost.answer is None
    assert list(core.mmi_waiters) == [waiting]               # the abandoned one is gone
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200", waiting.token]), 2.0)
    assert mmi_answer(waiting.answer, "other") is True and not core.mmi_waiters
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200", lost.token]), 3.0)  # too late
    assert lost.answer is None and core.discarded == 1


@pytest.mark.parametrize("change", ["restart", "new route"])
def test_mmi_questions_still_waited_for_are_asked_again_after_a_restart_or_a_new_connection(core, change):
    """A question or its answer may be lost with the old broker or connection: the ones
    still waited for are asked again (abandoned and answered ones are not), and the answer
    that comes second for one finds nobody."""
    inst = b"\x01" * 8
    core.on_message(P.broker_heartbeat(inst, 3000, b"route--a"), 100.0)
    waiting = core.expect_mmi(core.mmi_question("echo"))
    gone = core.expect_mmi(core.mmi_question("other"))
    gone.abandoned = True
    answered = core.expect_mmi(core.mmi_question("third"))
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200", answered.token]), 100.1)
    assert core.on_message(P.broker_heartbeat(inst, 3000, b"route--a"), 100.2) == []  # nothing changed
    new = (b"\x02" * 8, b"route--a") if change == "restart" else (inst, b"route--b")
    out = core.on_message(P.broker_heartbeat(new[0], 3000, new[1]), 100.5)
    assert out == [waiting.frames]
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200", waiting.token]), 100.6)
    assert mmi_answer(waiting.answer, "echo") is True
    discarded = core.discarded
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200", waiting.token]), 100.7)  # the other copy
    assert core.discarded == discarded + 1 and not core.mmi_waiters


def test_mmi_questions_are_not_asked_twice_of_a_broker_that_answers_in_order(core):
    """Without tokens an answer goes to the oldest question: a second answer to a question
    asked again would answer the next one, so nothing is asked again."""
    first = core.expect_mmi(core.mmi_question("echo"))
    core.on_message(P.client_reply(True, MMI_SERVICE.encode(), [b"200"]), 100.0)  # no token
    assert mmi_answer(first.answer, "echo") is True
    core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000, b"route--a"), 100.1)
    waiting = core.expect_mmi(core.mmi_question("other"))
    assert core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000, b"route--b"), 100.5) == []
    assert waiting.answer is None


def test_opaque_reply_parsing():
    assert opaque_reply(P.client_reply(True, b"svc", [b"a", b"b"]), "svc") == (True, [b"a", b"b"])
    assert opaque_reply(P.client_reply(False, b"svc", [b"a"]), "svc") == (False, [])
    with pytest.raises(errors.ServiceUnavailable):
        opaque_reply(P.client_reply(True, b"svc", P.error_body(0, ErrorCode.SERVICE_UNAVAILABLE, "none")), "svc")


def test_not_local_resends_the_same_inputs_inline_under_a_new_id():
    core = ClientCore("ipc:///tmp/zinf-core-test.sock", transport="shm")
    try:
        call = core.new_call("remote", {"x": np.arange(4.0)})
        call.frame, call.dropped = 0, 3  # a latest-wins stream's frame, telling of its drops
        frames = core.request_frames(call, 5.0)
        first = call.id
        assert P.decode_request(frames[3], len(frames) - 4).dropped == 3
        assert call.packed.uses_shm and core.pool.in_use() == 1
        outs = core.on_message(P.client_reply(True, b"remote", P.error_body(first, ErrorCode.NOT_LOCAL, "far")), 5.1)
        assert core.pool.in_use() == 0 and "remote" in core.not_local  # the slot went at that FINAL
        (resend,) = outs
        req = P.decode_request(resend[3], len(resend) - 4)
        assert req.id == call.id != first and req.reply == "inline"
        assert not req.dropped  # counted by the broker with the first copy, which it answered
        assert type(req.tensors[0].loc) is P.InlineLoc
        assert np.frombuffer(bytes(resend[4]), np.float64).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert not call.inbox and not call.done  # the caller never saw the NOT_LOCAL
    finally:
        core.close()


def test_a_client_that_fell_back_to_inline_tries_shared_memory_again_after_a_backoff():
    core = ClientCore("ipc:///tmp/zinf-core-test.sock", transport="auto")

    def reply_to(call, error=None):
        body = (P.error_body(call.id, ErrorCode.NOT_LOCAL, "far") if error
                else [P.encode_header(P.Reply(id=call.id))])
        return body

    x = np.arange(1024.0)  # 8 KiB: above P.SMALL_INLINE_BYTES, so by shared memory when local

    try:
        call = core.new_call("svc", {"x": x})
        core.request_frames(call, 10.0)
        assert call.packed.uses_shm
        core.on_message(P.client_reply(True, b"svc", reply_to(call, "far")), 10.0)  # -> resent inline
        core.on_message(P.client_reply(True, b"svc", reply_to(call)), 10.1)
        # Within the backoff (1 s): inline at once, no round trip wasted on NOT_LOCAL.
        c2 = core.new_call("svc", {"x": x})
        assert not c2.packed.uses_shm and c2.reply == "inline" and not c2.probe
        core.request_frames(c2, 10.2)
        core.on_message(P.client_reply(True, b"svc", reply_to(c2)), 10.9)
        # Past it: shared memory again.  Still remote: resent inline, the backoff doubles.
        core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000), 11.2)
        c3 = core.new_call("svc", {"x": x})
        assert c3.packed.uses_shm and c3.probe
        core.request_frames(c3, 11.2)
        (resend,) = core.on_message(P.client_reply(True, b"svc", reply_to(c3, "far")), 11.2)
        assert P.decode_request(resend[3], len(resend) - 4).reply == "inline"
        assert core.not_local["svc"] == 11.2 + 2.0
        core.on_message(P.client_reply(True, b"svc", reply_to(c3)), 11.3)
        # A local worker appeared: the next probe succeeds and the client stays on shared memory.
        core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000), 13.5)
        c4 = core.new_call("svc", {"x": x})
        assert c4.probe
        core.request_frames(c4, 13.5)
        core.on_message(P.client_reply(True, b"svc", reply_to(c4)), 13.6)
        assert "svc" not in core.not_local
        c5 = core.new_call("svc", {"x": x})
        assert c5.packed.uses_shm and not c5.probe
        core.request_frames(c5, 13.7)
        core.on_message(P.client_reply(True, b"svc", reply_to(c5)), 13.8)
    finally:
        core.close()


def _restart(core, lost_count=1):
    """A broker instance, calls sent to it, then a new instance: the resend frames."""
    core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000), 100.0)
    calls = [_sent(core, now=100.1) for _ in range(lost_count)]
    return calls, core.on_message(P.broker_heartbeat(b"\x02" * 8, 3000), 100.5)


def test_a_broker_restart_resends_what_was_in_flight_under_new_ids(core):
    old, new = b"\x01" * 8, b"\x02" * 8
    core.on_message(P.broker_heartbeat(old, 3000), 100.0)
    lost, streamed, gone = _sent(core, now=100.1), _sent(core, now=100.1), _sent(core, now=100.1)
    core.on_message(_final(streamed, np.int64([1]), final=False), 100.2)
    core.give_up(gone)  # abandoned: nobody waits for it
    assert core.on_message(P.broker_heartbeat(old, 3000), 100.3) == []  # same broker: nothing to do
    after = _sent(core, now=100.4)
    after.broker = new  # as if sent once the client knew the new broker
    old_id = lost.id
    out = core.on_message(P.broker_heartbeat(new, 3000), 100.5)
    # The old copy is cancelled (the new broker drops it if it got it), then sent anew.
    assert out[0] == P.client_cancel("echo", old_id, queued_only=True) and len(out) == 2 and core.broker_restarts == 1
    hdr = P.decode_request(out[1][3], len(out[1]) - 4)
    assert lost.id == hdr.id != old_id and lost.resends == 1 and lost.broker == new
    assert [k for k, _ in streamed.inbox] == ["partial", "error"]  # a stream cannot be replayed
    assert isinstance(streamed.inbox[-1][1], BrokerUnreachable)
    assert after.resends == 0 and after.id in core.calls
    # Nothing waits for the streamed or the abandoned call any more: both are forgotten.
    assert streamed.id not in core.calls and gone.id not in core.calls
    assert core.in_flight() == 2 and set(core.calls) == {old_id, lost.id, after.id}
    # An error from the old run is dropped (the new run may still succeed)...
    err = P.client_reply(True, b"echo", P.error_body(old_id, ErrorCode.WORKER_FAILED, "gone"))
    assert core.on_message(err, 100.6) == [] and core.discarded == 1 and not lost.inbox
    # ...and the new run's result answers the call once.
    core.on_message(_final(lost, np.int64([5])), 100.7)
    assert [k for k, _ in lost.inbox] == ["final"] and lost.id not in core.calls


def test_after_a_restart_the_old_runs_result_wins_and_cancels_the_new_run(core):
    (lost,), out = _restart(core)
    old_id, new_id = P.decode_cancel(out[0][3]).id, lost.id
    lost.id = old_id
    old_reply = _final(lost, np.int64([5]))  # what a worker of the old run sends straight to us
    lost.id = new_id
    assert core.on_message(old_reply, 100.7) == [P.client_cancel("echo", new_id)]
    assert [k for k, _ in lost.inbox] == ["final"]
    assert old_id not in core.calls and new_id not in core.calls
    core.on_message(_final(lost, np.int64([6])), 100.8)  # the resent run's answer: dropped
    assert core.discarded == 1 and len(lost.inbox) == 1


def test_a_replaced_connection_resends_the_brokered_calls_sent_before_it_was_known(core):
    """The same broker names our connection anew (libzmq connected again): what went on the
    old one, and the replies the broker holds for it, are lost.  Each call sent before the
    answer that says so is sent again (CANCEL of its old id first: a copy on the new
    connection is dropped there), its old id still answerable; a call sent once the new
    route was known is not; a stream whose PARTIALs all came before the last answer on the
    old connection fails, an abandoned call is forgotten; the first route learnt, and the
    same route again, change nothing."""
    inst, a, b = b"\x01" * 8, b"route--a", b"route--b"
    assert core.heartbeat(99.0) == P.client_heartbeat(ask_route=True)  # we ask for the route
    early = _sent(core, now=99.0)  # before the broker's first answer
    assert core.on_message(P.broker_heartbeat(inst, 3000, a), 100.0) == []
    assert early.route == a and core.broker_route == a
    lost, streamed, gone = (_sent(core, now=100.1) for _ in range(3))
    assert lost.route == a
    core.on_message(_final(streamed, np.int64([1]), final=False), 100.2)
    core.give_up(gone)
    assert core.on_message(P.broker_heartbeat(inst, 3000, a), 100.3) == []  # the same connection
    old_ids = early.id, lost.id
    out = core.on_message(P.broker_heartbeat(inst, 3000, b), 100.5)
    assert core.broker_reconnects == 1 and core.broker_restarts == 0 and core.broker_route == b
    assert [f[1] for f in out] == [P.C_CANCEL, P.C_REQUEST] * 2
    assert [P.decode_cancel(f[3]).id for f in out[::2]] == list(old_ids)
    assert all(P.decode_cancel(f[3]).queued_only for f in out[::2])  # a started copy answers
    resent = [P.decode_request(f[3], len(f) - 4).id for f in out[1::2]]
    assert resent == [early.id, lost.id] and early.id not in old_ids and lost.id not in old_ids
    assert early.resends == lost.resends == 1 and early.route == lost.route == b
    assert isinstance(streamed.inbox[-1][1], BrokerUnreachable)
    assert "connection to the broker (or its record of this client) was replaced" in str(streamed.inbox[-1][1])
    assert streamed.id not in core.calls and gone.id not in core.calls
    # Sent once the new route was known: the same connection, nothing to resend.
    after = _sent(core, now=100.6)
    assert core.on_message(P.broker_heartbeat(inst, 3000, b), 100.7) == [] and after.resends == 0
    # The old run's result (it did arrive) still answers the call, once.
    lost_new, lost.id = lost.id, old_ids[1]
    reply = _final(lost, np.int64([5]))
    lost.id = lost_new
    assert core.on_message(reply, 100.8) == [P.client_cancel("echo", lost_new)]
    assert [k for k, _ in lost.inbox] == ["final"]
    # An old run that streams cannot win: its first PARTIAL cancels it (the resend's CANCEL
    # asked for queued copies only, so it would stream on to its end for nobody).
    early_new, early.id = early.id, old_ids[0]
    partial = _final(early, np.int64([6]), final=False)
    early.id = early_new
    assert core.on_message(partial, 100.9) == [P.client_cancel("echo", old_ids[0])]
    assert not early.inbox and early.id in core.calls  # the resent run still answers the call


def test_a_connection_replaced_before_the_broker_first_answered_resends_what_was_sent_on_it(core):
    """The broker died before its answer to the client's first heartbeat left it (a CI run:
    SIGKILLed just after it logged the request): the client never knew it, and the first
    answer, the new broker's, was taken for the broker its calls went to.  The monitor's
    second handshake says the connection was replaced: the first answer is asked about again
    at once, and the next one, on the same connection, sends the calls sent before it again,
    once (a restart and a reset look alike here).  One handshake, or a second once the
    broker was known, changes nothing here."""
    inst, a = b"\x01" * 8, b"route--a"
    core.broker_said("", 99.0, ups=1)  # the first connection
    early = _sent(core, now=99.0)
    core.broker_said("", 99.5, ups=1)  # a second one, no answer heard on the first
    assert core.on_message(P.broker_heartbeat(inst, 3000, a), 100.0) == [P.client_heartbeat(ask_route=True)]
    later = _sent(core, now=100.05)  # once the first answer came: this connection's
    out = core.on_message(P.broker_heartbeat(inst, 3000, a), 100.1)
    assert [f[1] for f in out] == [P.C_CANCEL, P.C_REQUEST]
    assert P.decode_cancel(out[0][3]).queued_only and early.resends == 1 and later.resends == 0
    assert core.broker_reconnects == 1 and core.broker_restarts == 0
    # Known from now on: the same answer again resends nothing.
    assert core.on_message(P.broker_heartbeat(inst, 3000, a), 100.2) == []
    # A handshake once the broker is known is left to the answers' names, as before.
    core.broker_said("", 100.3, ups=1)
    assert core.on_message(P.broker_heartbeat(inst, 3000, a), 100.4) == [] and early.resends == 1


@pytest.mark.parametrize("restarted", [False, True], ids=["reset", "restart"])
def test_a_replaced_connections_first_answer_read_late_sends_the_calls_again_once(core, restarted):
    """The first answer read after the second handshake may be the old connection's (read
    late from the socket): the next one, the new connection's, names another route (or
    broker), and the calls go again once, as at any replaced connection or restart; with
    `restart_resends=1` a call had failed, sent again twice."""
    core.restart_resends = 1
    core.broker_said("", 99.0, ups=2)  # both handshakes read at once
    call = _sent(core, now=99.0)
    assert core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000, b"route--a"), 100.0) == [
        P.client_heartbeat(ask_route=True)]
    out = core.on_message(P.broker_heartbeat(b"\x02" * 8 if restarted else b"\x01" * 8, 3000, b"route--b"), 100.1)
    assert [f[1] for f in out] == [P.C_CANCEL, P.C_REQUEST] and call.resends == 1 and not call.inbox
    assert (core.broker_restarts, core.broker_reconnects) == ((1, 0) if restarted else (0, 1))


def test_one_handshake_then_the_first_answer_resends_nothing(core):
    core.broker_said("", 99.0, ups=1)
    call = _sent(core, now=99.0)
    assert core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000, b"route--a"), 100.0) == []
    assert call.resends == 0 and core.broker_reconnects == 0


def test_a_stream_whose_first_partial_came_after_the_last_answer_on_the_old_connection_goes_on(core):
    """A DEALER keeps the order of what it receives across connections: a stream with a
    PARTIAL before the last answer naming the old connection was that connection's (it
    fails, however many PARTIALs came since), but one whose first PARTIAL came after it may
    be the new one's (sent just after libzmq connected again).  That one cannot be replayed:
    it is neither failed nor resent, goes on while PARTIALs come, and fails only once
    nothing came for it for the silence window."""
    core.heartbeat_interval = 1.0
    inst = b"\x01" * 8
    core.on_message(P.broker_heartbeat(inst, 3000, b"route--a"), 100.0)
    old_stream, live, lost = (_sent(core, now=100.1) for _ in range(3))
    core.on_message(_final(old_stream, np.int64([1]), final=False), 100.2)
    core.on_message(P.broker_heartbeat(inst, 3000, b"route--a"), 100.3)  # the last answer on a
    core.on_message(_final(old_stream, np.int64([2]), final=False), 100.35)  # a fast stream: still a's
    core.on_message(_final(live, np.int64([1]), final=False), 100.4)
    core.on_message(_final(lost, np.int64([1]), final=False), 100.4)
    plain = _sent(core, now=100.45)
    out = core.on_message(P.broker_heartbeat(inst, 3000, b"route--b"), 100.5)
    assert [P.decode_request(f[3], len(f) - 4).id for f in out if f[1] == P.C_REQUEST] == [plain.id]
    assert isinstance(old_stream.inbox[-1][1], BrokerUnreachable)
    for s in (live, lost):
        assert s.resends == 0 and s.id in core.calls and [k for k, _ in s.inbox] == ["partial"]
    core.on_message(_final(live, np.int64([2]), final=False), 101.0)  # the new connection's
    core.heartbeat(105.6)  # 5.1 s after the new route: `lost` heard nothing, `live` did
    assert isinstance(lost.inbox[-1][1], BrokerUnreachable) and "streaming" in str(lost.inbox[-1][1])
    assert [k for k, _ in live.inbox] == ["partial", "partial"]
    core.on_message(_final(live, np.int64([3])), 105.7)
    assert [k for k, _ in live.inbox] == ["partial", "partial", "final"]


def test_a_restart_seen_with_a_new_route_resends_once(core):
    """A new broker instance comes with a new route too: the restart path alone resends."""
    core.on_message(P.broker_heartbeat(b"\x01" * 8, 3000, b"\0r1"), 100.0)
    call = _sent(core, now=100.1)
    out = core.on_message(P.broker_heartbeat(b"\x02" * 8, 3000, b"\0r1"), 100.5)  # the same name, by chance
    assert [f[1] for f in out] == [P.C_CANCEL, P.C_REQUEST] and call.resends == 1
    assert core.broker_restarts == 1 and core.broker_reconnects == 0
    assert core.on_message(P.broker_heartbeat(b"\x02" * 8, 3000, b"\0r1"), 100.6) == []
    # and a broker that names no route (older, or a relay in front of it) changes nothing
    assert core.on_message(P.broker_heartbeat(b"\x02" * 8, 3000), 100.7) == [] and core.broker_route == b"\0r1"


def test_resends_after_reconnects_share_the_restart_bound(core):
    core.restart_resends = 1
    core.on_message(P.broker_heartbeat(b"a" * 8, 3000, b"\0r1"), 1.0)
    call = _sent(core, now=1.0)
    assert [f[1] for f in core.on_message(P.broker_heartbeat(b"a" * 8, 3000, b"\0r2"), 2.0)] == [P.C_CANCEL,
                                                                                                  P.C_REQUEST]
    assert core.on_message(P.broker_heartbeat(b"a" * 8, 3000, b"\0r3"), 3.0) == []
    kind, err = call.inbox.popleft()
    assert kind == "error" and isinstance(err, BrokerUnreachable) and "resent 1 times" in str(err)
    assert core.in_flight() == 0 and core.broker_reconnects == 2


def test_resends_after_restarts_are_bounded(core):
    core.restart_resends = 1
    core.on_message(P.broker_heartbeat(b"a" * 8, 3000), 1.0)
    call = _sent(core, now=1.0)
    out = core.on_message(P.broker_heartbeat(b"b" * 8, 3000), 2.0)
    assert [f[1] for f in out] == [P.C_CANCEL, P.C_REQUEST]
    assert core.on_message(P.broker_heartbeat(b"c" * 8, 3000), 3.0) == []
    kind, err = call.inbox.popleft()
    assert kind == "error" and isinstance(err, BrokerUnreachable) and "resent 1 times" in str(err)
    assert core.in_flight() == 0  # forgotten: no FINAL comes for it from a dead broker


def test_heartbeats_go_out_every_interval_while_calls_wait_whatever_else_is_sent(core):
    call = _sent(core, now=10.0)
    core.last_send = 10.9  # other traffic does not hold the heartbeat back
    assert core.heartbeat_due(10.95)
    assert core.heartbeat(10.95) == P.client_heartbeat(ask_route=True) and not core.heartbeat_due(11.5)
    assert core.heartbeat_due(11.95)
    core.give_up(call)
    assert not core.heartbeat_due(20.0)


def test_the_broker_sets_how_often_a_client_heartbeats(core):
    _sent(core, now=10.0)
    core.heartbeat(10.0)
    assert core.heartbeat_period == 1.0 and not core.heartbeat_due(10.5)
    core.on_message(P.broker_heartbeat(b"i" * 8, 600), 10.0)  # it presumes a client dead after 0.6 s
    assert core.heartbeat_period == pytest.approx(0.2) and core.heartbeat_due(10.25)
    core.on_message(P.broker_heartbeat(b"i" * 8, 60_000), 11.0)  # never longer than our own
    assert core.heartbeat_period == 1.0


def test_alloc_in_a_full_pool_is_an_inference_error_and_still_a_shm_full():
    import shm
    from client_sdk import InferenceError, PoolFull

    core = ClientCore("ipc:///tmp/zinf-core-test.sock", transport="shm", pool_capacity=1 << 16)
    try:
        # The client's own argument is named (client.md: "a larger `pool_capacity`"), not only
        # the pool's `capacity=`.
        with pytest.raises(PoolFull, match="pass a larger pool_capacity") as e:
            core.alloc((1 << 20,), np.uint8)
        assert isinstance(e.value, InferenceError) and isinstance(e.value, shm.ShmFull)
    finally:
        core.close()


# --- small tensors inline (P.SMALL_INLINE_BYTES) -------------------------------------------

def _header(core, call) -> P.Request:
    frames = core.request_frames(call, 50.0)
    return P.decode_request(frames[3], len(frames) - 4)


def test_auto_sends_tensors_up_to_the_threshold_inline_and_larger_ones_by_shared_memory():
    core = ClientCore("ipc:///tmp/zinf-core-small.sock", transport="auto")
    try:
        assert core.use_shm and core.inline_max == P.SMALL_INLINE_BYTES == 4096
        at = np.arange(P.SMALL_INLINE_BYTES, dtype=np.uint8)
        above = np.arange(P.SMALL_INLINE_BYTES + 1, dtype=np.uint8)
        big = np.arange(2048, dtype=np.float32)  # 8 KiB
        call = core.new_call("echo", {"at": at, "above": above, "big": big})
        assert call.packed.uses_shm and call.reply == "auto"
        req = _header(core, call)
        kinds = {t.name: type(t.loc) for t in req.tensors}
        assert kinds == {"at": P.InlineLoc, "above": P.ShmLoc, "big": P.ShmLoc}
        assert req.reply == "auto"  # the worker may answer small outputs inline
        assert core.pool.in_use() == 2  # temporary slots for the two large ones only
        (frame,) = call.packed.frames
        assert bytes(frame) == at.tobytes()
        # Only small tensors: nothing in shared memory at all.
        small = core.new_call("echo", {"x": np.arange(4.0)})
        assert not small.packed.uses_shm and small.packed.temp == []
        assert type(_header(core, small).tensors[0].loc) is P.InlineLoc
        assert core.pool.in_use() == 2
    finally:
        core.close()


def test_a_small_array_from_the_pool_goes_inline_as_a_private_copy():
    core = ClientCore("ipc:///tmp/zinf-core-small.sock", transport="auto")
    try:
        x = core.alloc((16,), np.uint8)
        x[:] = np.arange(16, dtype=np.uint8)
        call = core.new_call("echo", {"x": x, "v": x[4:12]})
        assert not call.packed.uses_shm
        for frame, want in zip(call.packed.frames, (x, x[4:12])):
            # bytes, not a view of the pool: the slot may be freed or unmapped before ZeroMQ
            # has the frame on the wire (frames are sent with copy=False).
            assert type(frame) is bytes and frame == want.tobytes()
        assert all(type(t.loc) is P.InlineLoc for t in _header(core, call).tensors)
        x[:] = 0
        assert call.packed.frames[0] == bytes(range(16))  # the sent copy did not change
    finally:
        core.close()


def test_transport_shm_sends_even_a_tiny_tensor_by_reference_and_asks_for_a_shm_reply():
    core = ClientCore("ipc:///tmp/zinf-core-small.sock", transport="shm")
    try:
        assert core.inline_max == 0
        call = core.new_call("echo", {"x": np.arange(2, dtype=np.int8), "e": np.zeros((0, 3))})
        assert call.packed.uses_shm and call.reply == "shm"
        req = _header(core, call)
        kinds = {t.name: type(t.loc) for t in req.tensors}
        assert kinds == {"x": P.ShmLoc, "e": P.InlineLoc}  # an empty tensor has nothing to put in a slot
        assert req.reply == "shm" and core.pool.in_use() == 1
        # An explicit reply mode is kept as asked.
        assert core.new_call("echo", {"x": np.arange(2)}, reply="inline").reply == "inline"
    finally:
        core.close()


def test_transport_shm_asks_shared_memory_outputs_except_for_cuda_inputs(monkeypatch):
    """transport="shm" turns a default reply into "shm" (outputs by reference whatever their
    size), but a request with CUDA inputs keeps "auto", so its outputs may stay on the device
    (docs/gpu.md)."""
    from client_sdk import core as core_mod
    from client_sdk.tensors import Packed

    c = ClientCore("ipc:///tmp/zinf-reply-test.sock", transport="shm", heartbeat_interval=None)
    try:
        assert c.new_call("echo", {"x": np.zeros(2, np.uint8)}).reply == "shm"

        def cuda_pack(inputs, pool, **kw):
            p = Packed()
            p.tensors.append(P.TensorRef(name="x", dtype="<f4", shape=[4], loc=P.CudaLoc(
                pool="p", offset=0, nbytes=16, device=0)))
            return p

        monkeypatch.setattr(core_mod.T, "pack", cuda_pack)
        call = c.new_call("echo", {"x": np.zeros(4, np.float32)})
        assert call.reply == "auto"
        assert c.new_call("echo", {"x": np.zeros(4, np.float32)}, reply="inline").reply == "inline"
    finally:
        c.close()


def test_an_input_too_large_for_the_pool_and_for_a_frame_is_invalid_input():
    # It went inline, the broker dropped it with the connection (--max-frame-mb), and the
    # client resent it twice before BrokerUnreachable said to check the endpoint (found by
    # the data hunt).  It is refused before anything is sent, saying what to raise.
    c = ClientCore("ipc:///tmp/zinf-core-test.sock", transport="inline", heartbeat_interval=1.0, max_inline_mb=1)
    try:
        with pytest.raises(InvalidInput, match=r"'x' is 2097152 bytes \(2 MiB\) and would go inline.*max_inline_mb "
                                               r"\(1 MiB, 1048576 bytes") as e:
            c.new_call("echo", {"x": np.zeros(2 << 20, np.uint8)})
        # One byte over: the sizes say so (both read "1 MiB" before: the memory audit).
        with pytest.raises(InvalidInput, match=r"'x' is 1048577 bytes"):
            c.new_call("echo", {"x": np.zeros((1 << 20) + 1, np.uint8)})
        # No shared memory here: a larger pool_capacity would not help, so it is not suggested.
        assert "pool_capacity" not in str(e.value) and "shared memory (an ipc://" in str(e.value)
        c.new_call("echo", {"x": np.zeros(1 << 20, np.uint8)})  # at the limit: fine
    finally:
        c.close()
    c = ClientCore("ipc:///tmp/zinf-core-test.sock", transport="auto", heartbeat_interval=1.0, max_inline_mb=1,
                   pool_capacity=1 << 20)
    try:
        with pytest.raises(InvalidInput, match=r"the client's pool.*raise pool_capacity, or max_inline_mb"):
            c.new_call("echo", {"x": np.zeros(2 << 20, np.uint8)})
    finally:
        c.close()
    for bad in (0, -1, float("inf"), True, "256"):
        with pytest.raises(InvalidInput, match="max_inline_mb"):
            ClientCore("ipc:///tmp/zinf-core-test.sock", max_inline_mb=bad)


def test_the_broker_reads_the_id_of_a_header_over_the_limit():
    """So that its refusal reaches the call that sent it (a plain client, an older SDK)."""
    head = P.encode_header(P.Request(id=4242, tensors=[P.TensorRef(name="n" * (P.MAX_HEADER_BYTES + 10), dtype="<f4",
                                                                   shape=[1], loc=P.InlineLoc(frame=0))]))
    assert len(head) > P.MAX_HEADER_BYTES
    assert P.lenient_request_id(head) == 4242


def test_release_unread_gives_back_every_slot_a_left_reply_names(core):
    """What a closing client's sockets still hold (`ClientCore.release_unread`): each output
    slot named by a FINAL, a PARTIAL or a worker's FINALS batch goes back once; anything else
    (heartbeats, errors, opaque bodies, garbage) gives nothing back and raises nothing."""
    given = []
    core.leases.release_unviewed = given.append

    def loc(slot):
        return P.ShmLoc(segment="zinf-1-1-0000000000000000-3", offset=4096 + 64 * slot, nbytes=8, slot=slot,
                        generation=1)

    def head(rid, *slots):
        return P.encode_header(P.Reply(id=rid, tensors=[
            P.TensorRef(name=f"y{s}", dtype="<f8", shape=[1], loc=loc(s)) for s in slots]))

    core.release_unread(P.client_reply(True, b"svc", [head(7, 0, 1)]))
    core.release_unread(P.client_reply(False, b"svc", [head(8, 2)]))
    core.release_unread([P.MDPC, P.C_FINALS, b"svc", head(9, 3), head(10, 4)])
    for other in (P.client_reply(True, b"svc", P.error_body(11, ErrorCode.CANCELLED, "x")),
                  P.client_reply(True, b"svc", [b"opaque"]), [P.MDPC, P.C_HEARTBEAT], [b"junk"], []):
        core.release_unread(other)
    assert [g.slot for g in given] == [0, 1, 2, 3, 4]


def test_close_cancels_what_may_come_back_in_shared_memory_and_lingers_until_it_is_answered(core):
    """`close()`'s wait, decided here (docs/client.md, "Closing with requests in flight"):
    every call in flight whose answer may name output slots is cancelled and given up; an
    inline one is not waited for; the wait ends as each is answered, or at once for a call
    through a broker silent for the liveness window."""
    shm_a = _sent(core, reply="shm")
    inline, auto = _sent(core, reply="inline"), _sent(core, reply="auto")  # (auto: inline on an inline client)
    given = _sent(core, reply="shm")
    assert core.give_up(given, 100.0) is not None  # its CANCEL went when its caller gave up
    core.last_recv = 100.0
    calls, frames = core.close_cancel(100.0)
    assert [c.id for c in calls] == [shm_a.id, given.id]
    assert not inline.abandoned and not auto.abandoned
    cancelled = {P.decode_cancel(f[3]).id for f in frames}
    assert cancelled == {c.id for c in calls if c is not given}  # one CANCEL each, none again
    assert all(c.abandoned and c.notify is None for c in calls)
    assert core.lingering(calls, 100.1)
    for c in calls:  # each answered: a result (released unread) or the worker's 499
        core.on_message(_final(c, np.int64([1])), 100.2)
    assert not core.lingering(calls, 100.2) and core.discarded == len(calls)
    assert all(not c.inbox for c in calls)  # nothing delivered to anyone
    # Through a silent broker: not waited for (its answer cannot come), counted from the
    # send: a client that has not heard from the broker yet (a session's first frames)
    # waits (the AsyncClient hunt: its close had waited for nothing).
    late = _sent(core, reply="shm", now=100.3)
    calls, _ = core.close_cancel(100.3)
    assert calls == [late] and core.lingering(calls, 100.4)
    assert not core.lingering(calls, 100.3 + 6 * core.heartbeat_interval)
    core.last_recv = 0.0  # never heard
    assert core.lingering(calls, 100.4)
    # ... unless its endpoint says why nothing came (no socket file, nothing listening):
    # a client pointed at no broker closes at once.
    core.endpoint_problem = lambda: "no socket at /tmp/nowhere.ipc"
    assert not core.lingering(calls, 100.4)
    core.last_recv = 100.35  # heard once: the broker was there, its answer may still come
    assert core.lingering(calls, 100.4)


def test_linger_is_a_number_of_seconds_from_zero():
    for ok in (0, 0.5, 3):
        c = ClientCore("ipc:///tmp/zinf-core-test.sock", linger=ok)
        assert c.linger == ok
        c.close()
    for bad in (-1, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(InvalidInput, match="linger must be a number of seconds >= 0"):
            ClientCore("ipc:///tmp/zinf-core-test.sock", linger=bad)


def test_a_pool_no_worker_would_map_is_refused_at_once():
    # The memory audit: pool_capacity=64 GiB (what docs/client.md said a worker maps) made a
    # segment of 64 GiB and 100 KiB, which every worker refused as a protocol bug.
    from shm.segment import MAX_MAPPED_SEGMENT, max_capacity

    most = max_capacity()
    assert MAX_MAPPED_SEGMENT - (1 << 20) < most < MAX_MAPPED_SEGMENT
    for too_big in (1 << 36, most + 1):
        with pytest.raises(InvalidInput, match=rf"pool_capacity {too_big} is over the {most} bytes a worker maps"):
            ClientCore("ipc:///tmp/zinf-core-test.sock", pool_capacity=too_big)
    ClientCore("ipc:///tmp/zinf-core-test.sock", pool_capacity=most).close()
