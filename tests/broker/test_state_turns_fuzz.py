"""broker.state, "A newcomer's turn", under random traffic: principals sending one request
or bursts beside each other, workers finishing, answering RECALLs by giving back or keeping,
turning BUSY, all in any order.  Whatever the order: every request gets exactly one final
(nothing lost to a give-back, nothing run twice), no worker is sent more than its credit,
a RECALL names only requests its worker holds and each at most once per dispatch, and every
RECALL made for a turn is for a worker of the requester's pool that holds none of its
principal's.  Event by event, injected clock."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.state import _TURN, ClientError, Config, Dispatch, RecallAtWorker, Scheduler, ToClient

WORKERS = (b"w1", b"w2")
PRINCIPALS = (b"a", b"b", b"c", b"d")
EP = "ipc:///run/direct.ipc"

_send = st.tuples(st.just("send"), st.sampled_from(PRINCIPALS), st.integers(1, 4), st.sampled_from([1, 1, 2]))
_op = st.one_of(
    _send,
    _send,  # (twice as likely: the workers fill, and requests queue)
    st.tuples(st.just("final"), st.sampled_from(WORKERS)),
    st.tuples(st.just("answer"), st.sampled_from(WORKERS), st.booleans()),
    st.tuples(st.just("busy"), st.sampled_from(WORKERS), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0.001, 0.01, 0.1])),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, min_size=10, max_size=80), credit=st.integers(2, 4))
def test_turns_lose_nothing_and_ask_only_what_they_may(ops, credit):
    s = Scheduler(Config())
    for w in WORKERS:
        s.worker_ready(w, "svc", 0.0, credit=credit, recall=True, direct=EP)
    now = 0.001
    held = {w: {} for w in WORKERS}    # token -> (principal, request id), in dispatch order
    asked = {w: set() for w in WORKERS}  # tokens a RECALL named, not answered yet
    finals: dict = {}
    sent = []
    rid = 0
    turn_recalls = 0

    def apply(out, why=None):
        nonlocal turn_recalls
        for a in out:
            if isinstance(a, Dispatch):
                assert len(held[a.worker]) < credit, "credit exceeded"
                held[a.worker][a.token] = (a.client, a.request_id)
            elif isinstance(a, (ToClient, ClientError)):
                if isinstance(a, ClientError) or a.final:
                    key = (a.client, a.request_id)
                    assert key not in finals, f"a second final for {key}"
                    finals[key] = a
            elif isinstance(a, RecallAtWorker):
                assert a.tokens and all(t in held[a.worker] for t in a.tokens), a
                assert not set(a.tokens) & asked[a.worker], "asked twice for one dispatch"
                asked[a.worker].update(a.tokens)
                reqs = [s._workers[a.worker].in_flight[t] for t in a.tokens]
                if any(r.recalled is _TURN for r in reqs):
                    turn_recalls += 1
                    assert why is not None
                    assert all(p != why for p, _ in held[a.worker].values()), \
                        "a turn taken at a worker that holds one of the requester's"
                    assert all(r.principal != why for r in reqs)

    # Each principal served once first (a turn remembered: next in the ring once another
    # floods), then the traffic.
    for who in PRINCIPALS:
        rid += 1
        sent.append((who, rid))
        apply(s.client_request(who, rid, "svc", now, payload=rid), who)
        for w in WORKERS:
            for token in list(held[w]):
                held[w].pop(token)
                apply(s.worker_final(w, token, now, "r"))
        now += 0.001
    for op in ops:
        kind = op[0]
        if kind == "send":
            _, who, n, pri = op
            for _ in range(n):
                rid += 1
                sent.append((who, rid))
                apply(s.client_request(who, rid, "svc", now, payload=rid, priority=pri), who)
        elif kind == "final":
            w = op[1]
            if held[w]:
                token = next(iter(held[w]))
                held[w].pop(token)
                asked[w].discard(token)
                apply(s.worker_final(w, token, now, "r"))
        elif kind == "answer":
            _, w, give = op
            if asked[w]:
                tokens = sorted(asked[w])
                asked[w].clear()
                if give:
                    for t in tokens:
                        held[w].pop(t)
                    apply(s.worker_returned(w, tokens, now))
                else:
                    apply(s.worker_returned(w, [], now, kept=tokens))
        elif kind == "busy":
            apply(s.worker_busy(op[1], op[2], now))
        else:
            now += op[1]
            apply(s.tick(now))
    # Drain: every worker answers what it was asked (keeping it) and finishes everything.
    for _ in range(10 * (len(sent) + 1)):
        progressed = False
        for w in WORKERS:
            if asked[w]:
                tokens = sorted(asked[w])
                asked[w].clear()
                apply(s.worker_returned(w, [], now, kept=tokens))
                progressed = True
            if held[w]:
                token = next(iter(held[w]))
                held[w].pop(token)
                apply(s.worker_final(w, token, now, "r"))
                progressed = True
        if not progressed:
            break
    assert set(finals) == set(sent), f"{len(set(sent) - set(finals))} requests never answered"
    assert all(isinstance(a, ToClient) and a.code == 0 for a in finals.values())
