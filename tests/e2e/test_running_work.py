"""Work that is already at a worker, against the real processes (`python -m broker`, `python -m
gpu_worker`): a request parked behind a busy worker's long batch is taken back for an idle
worker (RECALL), and cancelling a running request frees the worker for the next one (a
streaming model stops at its next partial; a batch that cannot be interrupted drops the
cancelled result).

The models are tests/e2e/gate_model.py's `sleepy` (sleeps x[0] seconds; its warm-up is fast,
so even a long call runs on the worker loop's own thread, the hard case) and `ticker` (a
stream of x[0] partials, one every x[1] seconds); `held` is `sleepy` whose call with x[0] < 0
waits until the test releases it (the `gate` fixture), so "not parked behind a long batch"
is "done while it is still held".  Both log each real call (or partial) to
$SLEEPY_LOG with the worker's pid, which is how a test sees where and how far work ran.
Timing bounds are generous (a loaded 2-core machine); each is far below what the request
would take without the behaviour under test.  No sleeps as synchronisation.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from broker import protocol as P
from client_sdk import Client
from tests.e2e.conftest import Gate

# A held batch runs for as long as the test holds it: a stall of the loaded machine longer
# than the default 0.6 s liveness window would read as the worker's death (its held request
# run again elsewhere).  No test here looks at silence: 3 s.
pytestmark = [pytest.mark.timeout(60), pytest.mark.heartbeat_liveness(15)]

WAIT = 10.0


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _wait_for(cond, timeout: float = WAIT, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout} s")
        time.sleep(0.005)  # polling a file the worker writes (a condition, not a delay)


def test_a_short_request_is_not_parked_behind_a_long_batch(cluster, tmp_path):
    """The issue's case: two workers, default credit.  A runs on one, B on the other, C (20 ms)
    arrives while both are busy and is placed behind A (both hold one; the tie goes to the
    least recently used).  When B's worker goes idle, the broker takes C back from A's
    worker, which is inside A's batch on its loop thread, and C runs there: C is answered
    while A still runs, and its timing says so.

    A and B are `held`, each worker on its own FIFO, so the test ends B's batch only once C
    is parked at A's worker (its debug log) and ends A's only after C is answered: on a
    loaded machine B cannot end before C is queued (C would then go to B's idle worker
    directly, never parked), and "not behind A" needs no clock bound."""
    log = tmp_path / "runs.log"
    gates = [Gate(tmp_path / f"gate{i}.fifo", tmp_path / f"gate{i}.entered") for i in (1, 2)]
    try:
        cluster.broker()
        workers = [cluster.worker("gate_model:held", "--log-level", "debug",
                                  env={"SLEEPY_LOG": str(log), **g.env}) for g in gates]
        for g in gates:
            g.open()
        gate_of = {str(w.p.pid): g for w, g in zip(workers, gates)}
        worker_of = {str(w.p.pid): w for w in workers}
        with Client(cluster.frontend, timeout=WAIT) as c:
            a = c.infer_stream("held", {"x": np.array([-1.0])}, timeout=50.0)  # held until released
            _wait_for(lambda: len(_lines(log)) == 1, what="A started")
            b = c.infer_stream("held", {"x": np.array([-1.0])}, timeout=50.0)
            _wait_for(lambda: len(_lines(log)) == 2, what="B started")
            pid_a, pid_b = _lines(log)
            assert pid_a != pid_b
            cc = c.infer_stream("held", {"x": np.array([0.02])})
            # C is parked at A's worker (read there while A's batch computes) ...
            worker_of[pid_a].wait_log("read a request from the broker while a batch computes", timeout=WAIT)
            # ... and stays parked a while (a span its queue time must cover, not a wait for
            # anything), then B's batch ends.
            time.sleep(0.1)
            gate_of[pid_b].release()
            res_c = cc.result(timeout=WAIT)  # while A is still held
            res_b = b.result(timeout=WAIT)
            gate_of[pid_a].release()
            res_a = a.result(timeout=WAIT)
            runs = _lines(log)
            assert len(runs) == 3, runs
            # C ran on B's worker, not behind A.
            assert runs[2] == pid_b, runs
            # Every wait shows: handed back once, and its queue time covers the parked time.
            assert res_c.timing.get("returned") == 1.0, res_c.timing
            assert res_c.timing["queue_ms"] >= 100.0, res_c.timing
            assert "returned" not in res_b.timing and "returned" not in res_a.timing
            for r in (res_a, res_b, res_c):
                r.release()
    finally:
        for g in gates:
            g.close()


def test_cancelling_a_stream_stops_it_at_its_next_partial(cluster, tmp_path):
    """A stream of 200 partials, 50 ms apart (10 s), cancelled after its first: the worker
    stops it at its next partial, and the next request is answered at once, not after 10 s.
    The bounds leave a loaded machine seconds (and dozens of partials) to pass the cancel on,
    and are still half of what the uncancelled stream takes."""
    log = tmp_path / "ticks.log"
    cluster.broker()
    worker = cluster.worker("gate_model:ticker", env={"SLEEPY_LOG": str(log)})
    pid = worker.p.pid
    with Client(cluster.frontend, timeout=WAIT) as c:
        h = c.infer_stream("ticker", {"x": np.array([200.0, 0.05])})
        first = next(h)
        assert not first.final
        first.release()
        assert h.cancel()
        t0 = time.monotonic()
        nxt = c.infer_stream("ticker", {"x": np.array([2.0, 0.01])})
        got = [r for r in nxt]
        took = time.monotonic() - t0
        assert [r.final for r in got] == [False, False, True]
        for r in got:
            r.release()
        # The next request started soon after the cancel, not 10 s later.
        assert took < 5.0, f"the next request took {took:.3f} s"
        ticks = [line for line in log.read_text().splitlines() if line.startswith(f"{pid} ")]
        # 2 from the second request; the cancelled one stopped well before the end of its 200.
        assert len(ticks) - 2 < 100, ticks


def test_a_cancelled_batch_drops_its_result_and_the_next_request_follows(cluster, tmp_path, gate):
    """A batch cannot be interrupted: a request cancelled while it runs gets CANCELLED
    instead of its result when the batch ends, and the request behind it (already at the
    worker, credit 2) starts right after.  The long request is `held`: the test ends its
    batch only once the worker has read the cancel and the next request (its debug log),
    so a loaded machine cannot let the batch end first; a second run of it (a retry) would
    be held again, and the next request never answered."""
    log = tmp_path / "runs.log"
    cluster.broker()
    w = cluster.worker("gate_model:held", "--log-level", "debug", env={"SLEEPY_LOG": str(log), **gate.env})
    gate.open()
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(cluster.frontend)
    try:
        def request(rid, x):
            x = np.array([x])
            head = P.encode_header(P.Request(id=rid, reply="inline", timeout_ms=WAIT * 1000, tensors=[
                P.TensorRef(name="x", dtype=x.dtype.str, shape=list(x.shape), loc=P.InlineLoc(frame=0))]))
            s.send_multipart(P.client_request("held", [head, x.tobytes()]))

        def final(timeout=WAIT):
            assert s.poll(int(timeout * 1000)), "no reply"
            msg = P.parse_broker_to_client(s.recv_multipart())
            assert msg.command == P.C_FINAL
            return P.decode_reply(msg.body[0], len(msg.body) - 1)

        request(1, -1.0)  # held until released
        _wait_for(lambda: len(_lines(log)) == 1, what="the long request started")
        s.send_multipart(P.client_cancel("held", 1))
        request(2, 0.0)
        # The broker passes the cancel and then the request on in that order: the worker
        # read both while the batch computes.
        w.wait_log("read a request from the broker while a batch computes", timeout=WAIT)
        t0 = time.monotonic()
        gate.release()
        first = final()
        assert first.id == 1 and first.error is not None, first
        assert first.error.code == P.ErrorCode.CANCELLED and "result was dropped" in first.error.message
        second = final()
        took = time.monotonic() - t0
        assert second.id == 2 and second.error is None, second
        assert len(_lines(log)) == 1, _lines(log)  # the cancelled request ran once
        # The follow-up ran as soon as the batch ended (milliseconds; seconds on a loaded machine).
        assert took < 5.0, f"took {took:.3f} s"
    finally:
        s.close(linger=0)


def _until_pinned(c: Client, service: str) -> None:
    """Fast requests (the first asks for the lease) until `c` holds one: a condition."""
    deadline = time.monotonic() + WAIT
    while not c.pinned(service):
        assert time.monotonic() < deadline, f"not pinned to {service!r} within {WAIT} s"
        c.infer(service, {"x": np.array([0.0])}, timeout=WAIT).release()
        if not c.pinned(service):
            c.pump(0.05)  # a LEASED on its way is routed


def test_pinned_streams_and_brokered_work_are_not_parked_behind_a_long_leased_batch(cluster, tmp_path, gate):
    """The head-of-line rule with leases (docs/protocol.md section 10.3), both directions.
    W1 takes leases (--direct), W2 does not; two pinned clients, A and B, both hold a lease
    on W1.  A's request runs on W1's loop thread (gate_model's `held`: predicted fast) and
    is held there until the test releases it, so "not parked behind it" is "done while it
    is still held", with no clock margin for a loaded machine to miss:

    - B's 20 ms request, sent on B's lease, is not held behind it: W1 answers "send it
      through the broker", B's SDK does, and it runs on the idle W2;
    - W1 told the broker BUSY, so brokered requests go to W2 even when W2 holds two (without
      BUSY, W1 - same load by leased slots, none held - would get them): E waits behind
      W2's two short ones, not behind A's."""
    log = tmp_path / "runs.log"
    env = {"SLEEPY_LOG": str(log), **gate.env}
    cfg = tmp_path / "broker.toml"
    # A blocking client heartbeats only while it waits: a long client liveness keeps the
    # leases of the clients the test is not waiting on.
    cfg.write_text("[scheduler]\nclient_liveness = 60.0\n")
    cluster.broker("--config", str(cfg))
    # credit 4: leases hold at most half of it, one slot for each of A and B
    w1 = cluster.worker("gate_model:held", "--direct", "--credit", "4", "--log-level", "debug", env=env)
    w2 = cluster.worker("gate_model:held", "--credit", "3", env=env)
    gate.open()
    pid1, pid2 = str(w1.p.pid), str(w2.p.pid)
    with Client(cluster.frontend, timeout=WAIT, pin=1) as a, Client(cluster.frontend, timeout=WAIT, pin=1) as b, \
            Client(cluster.frontend, timeout=WAIT) as plain:
        _until_pinned(a, "held")
        _until_pinned(b, "held")
        pinned_before = b.pinned_replies
        ha = a.infer_stream("held", {"x": np.array([-1.0])}, timeout=50.0)  # held until released
        _wait_for(lambda: len(_lines(log)) == 1, what="A started")
        assert _lines(log) == [pid1]  # on A's lease
        res_b = b.infer("held", {"x": np.array([0.02])}, timeout=WAIT)  # done while A is held
        assert _lines(log)[1] == pid2, _lines(log)
        assert b.pinned_replies == pinned_before  # its answer came through the broker
        assert b.pinned("held")                   # and its lease stays
        res_b.release()
        w1.wait_log("told the broker BUSY")
        d1 = plain.infer_stream("held", {"x": np.array([0.2])})
        d2 = plain.infer_stream("held", {"x": np.array([0.2])})
        _wait_for(lambda: len(_lines(log)) == 3, what="D1 started")
        e = plain.infer_stream("held", {"x": np.array([0.02])})
        res_e = e.result(timeout=WAIT)  # done while A is still held
        runs = _lines(log)
        assert runs[2:] == [pid2, pid2, pid2], runs  # D1, D2, E: all on W2
        for h in (d1, d2):
            h.result(timeout=WAIT).release()
        res_e.release()
        gate.release(1)  # only now does A's batch end
        ha.result(timeout=WAIT).release()


def test_a_sigterm_during_a_long_leased_batch_ends_the_worker_leases_at_once(cluster, tmp_path, gate):
    """A worker stopped (SIGTERM) while a leased request runs long on its loop thread ends
    its leases at once, as it says STOPPING at once (from its heartbeat thread), not after
    that batch: its leaseholder hears LEASE_END and sends its next request through the
    broker to the other worker, instead of on the lease, where it waited behind the batch at
    a worker that was leaving (docs/operations.md, "A worker is stopped"; the idle hunt).
    The held request still finishes exactly once, and the worker exits 0."""
    log = tmp_path / "runs.log"
    env = {"SLEEPY_LOG": str(log), **gate.env}
    cfg = tmp_path / "broker.toml"
    # A blocking client heartbeats only while it waits: a long client liveness keeps its lease.
    cfg.write_text("[scheduler]\nclient_liveness = 60.0\n")
    cluster.broker("--config", str(cfg))
    # credit 4: the lease holds 2 slots, so the second request would fit on it
    w1 = cluster.worker("gate_model:held", "--direct", "--credit", "4", env=env)
    w2 = cluster.worker("gate_model:held", env=env)
    gate.open()
    pid1, pid2 = str(w1.p.pid), str(w2.p.pid)
    with Client(cluster.frontend, timeout=WAIT, pin=2) as c:
        _until_pinned(c, "held")
        ha = c.infer_stream("held", {"x": np.array([-1.0])}, timeout=50.0)  # held until released
        _wait_for(lambda: len(_lines(log)) == 1, what="A started")
        assert _lines(log) == [pid1]  # on the lease
        w1.p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT
        while c.pinned("held"):  # LEASE_END comes while A is still held
            assert time.monotonic() < deadline, "the lease lasted as long as the batch, past the worker's STOPPING"
            c.pump(0.05)
        res_b = c.infer("held", {"x": np.array([0.02])}, timeout=WAIT)  # done while A is held
        assert _lines(log) == [pid1, pid2]
        res_b.release()
        gate.release(1)  # only now does A's batch end
        res_a = ha.result(timeout=WAIT)
        assert float(res_a["x"][0]) == -1.0
        res_a.release()
    assert w1.p.wait(WAIT) == 0
    assert _lines(log) == [pid1, pid2]  # each ran once


def test_brokered_work_is_not_parked_behind_a_long_brokered_batch(cluster, tmp_path, gate):
    """The head-of-line rule for a brokered batch that runs long at a worker that takes
    leases (the stalls hunt: a pinned AR stream's frame, bounced behind a 2 s brokered
    request, went back through the broker to that same worker, the least loaded by credit,
    and sat there 1-2 s while newer requests were taken back ahead of it; the stream's
    results, in order, all waited for it).  W2 holds a pinned client's lease (2 of its 6
    slots), so by credit it looks busier than W1; W1 runs a brokered request held at the
    gate (predicted fast: on its loop thread).  W1 tells the broker BUSY though no leased
    request is in its batch (before, it did not, and the two requests sent meanwhile were
    handed to W1 and waited there until taken back: `returned` in their timing, 3 runs of
    3), so they go to W2, the broker's first choice now.  (Whether the broker read the BUSY
    before their REQUESTs is up to a loaded machine: a request handed to W1 first is taken
    back at once, all of what a busy worker holds may be; so the test holds the mechanism,
    and that they ran on W2 while A was held.)"""
    log = tmp_path / "runs.log"
    env = {"SLEEPY_LOG": str(log), **gate.env}
    cfg = tmp_path / "broker.toml"
    # A blocking client heartbeats only while it waits: a long client liveness keeps its lease.
    cfg.write_text("[scheduler]\nclient_liveness = 60.0\n")
    cluster.broker("--config", str(cfg))
    # credit 6: the lease takes 2; 4 left for brokered work, room for the two requests
    # even while the DONEs of the pinning client's first (brokered) calls are on their way
    w2 = cluster.worker("gate_model:held", "--direct", "--credit", "6", env=env)
    gate.open()
    with Client(cluster.frontend, timeout=WAIT, pin=2) as p, Client(cluster.frontend, timeout=WAIT) as plain:
        _until_pinned(p, "held")  # on W2, the only worker yet
        w1 = cluster.worker("gate_model:held", "--direct", "--credit", "4", "--log-level", "debug", env=env)
        pid1, pid2 = str(w1.p.pid), str(w2.p.pid)
        ha = plain.infer_stream("held", {"x": np.array([-1.0])}, timeout=50.0)  # held until released
        _wait_for(lambda: len(_lines(log)) == 1, what="A started")
        assert _lines(log) == [pid1]  # the least loaded by credit
        w1.wait_log("told the broker BUSY", timeout=5.0)
        d = [plain.infer_stream("held", {"x": np.array([0.05])}) for _ in range(2)]
        res = [h.result(timeout=WAIT) for h in d]  # done while A is still held
        assert _lines(log)[1:] == [pid2, pid2], _lines(log)
        for r in res:
            r.release()
        gate.release(1)  # only now does A's batch end
        ha.result(timeout=WAIT).release()
