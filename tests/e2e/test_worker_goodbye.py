"""A pinned worker's SIGTERM is a goodbye, not a failure (docs/protocol.md section 10.3,
"End"), with real broker, worker and client processes.

A worker that drains ends its leases (LEASE_END `worker_stopping`, no resend), finishes what
it holds, says DISCONNECT and exits; the broker also sees its connection close.  Should the
broker judge the close before it read the DISCONNECT, it would presume the worker dead and
tell the lease's client LEASE_END `worker_failed` with `resend`: the client would send again
requests the worker had answered, and they would run twice.  The broker reads what a closed
worker sent first (`broker.server.Broker._settle_gone`).

Here a rolling restart repeats K times: a `--direct` worker of the `held` model
(tests/e2e/gate_model.py) serves a pinned client; once the client is pinned the next worker
starts; one pinned request is held in the model (on the worker loop's thread) and BEHIND more
wait behind it on the lease when SIGTERM comes, then the gate lets it finish.  A plain (never
leased) worker of the service runs whatever goes through the broker, so a request resent
after a wrong `worker_failed` would run a second time there.  Then:

- every request completed once, with its own result, and ran exactly once (the workers'
  INFO `request done` lines, one per run, name the request's rid `<client pid>:<id>`), and
  no reply matched no waiting request;
- every stopping worker exited 0;
- the client was told of the ends as goodbyes only (`worker_stopping`, no resend), never
  `worker_failed` or `resend`: every LEASE_END the broker sent it is recorded where the SDK
  reads them (a late `worker_failed` for a lease the client already closed is dropped
  silently there, so neither its counters nor its log would show it);
- the broker never logged that it presumed a worker dead.

In practice this broker reads the DISCONNECT before the close event even without
`_settle_gone` (the backend is read before the monitor in each pass, and a stopping worker
keeps its connection a heartbeat interval after its leases end), so this guards the goodbye
end to end rather than reproducing that race, which the scheduler model covers; a broker
that takes a goodbye for a death fails it every time (the recorded `worker_failed` ends).
"""
from __future__ import annotations

import itertools
import os
import re
import select
import signal
import time
from collections import Counter

import numpy as np
import pytest

from broker import protocol as P
from client_sdk import Client, pins

from .conftest import Proc, wait_service

pytestmark = pytest.mark.timeout(60)

K = 7               # workers started, pinned to and SIGTERMed, one after the other
BEHIND = 4          # pinned requests waiting behind the held one at SIGTERM
TIMEOUT_S = 10.0
SERVICE = "held"    # gate_model:held's name
INFO = ("--log-level", "INFO")




# `python -m gpu_worker` with its direct sockets' linger (`DIRECT_LINGER_MS`, 2 s) raised to
# 20 s, the same in both modules that read it, for a test that the linger is not waited out.
_LONG_LINGER = """
import runpy
import gpu_worker.direct, gpu_worker.worker
gpu_worker.direct.DIRECT_LINGER_MS = gpu_worker.worker.DIRECT_LINGER_MS = 20_000
runpy.run_module("gpu_worker", run_name="__main__", alter_sys=True)
"""


def _stderr(proc) -> str:
    """All of a stopped process's stderr."""
    return (proc._err + proc.p.stderr.read()).decode(errors="replace")


def _x(value: float, i: int) -> np.ndarray:
    """`held` reads x[0]: 0 answers at once, < 0 waits for the gate; x[1] tells requests apart."""
    return np.array([value, float(i)])


def _check(handle, x: np.ndarray, done: Counter, key: int) -> None:
    with handle.result(timeout=TIMEOUT_S) as r:
        np.testing.assert_array_equal(r["x"], x)  # its own result
    done[key] += 1


def _pump_until(c: Client, cond, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        c.pump(0.01)


def _ready_pumping(c: Client, proc, timeout: float = 30.0) -> None:
    """Wait for `proc`'s READY line while `c` pumps (and so heartbeats)."""
    deadline = time.monotonic() + timeout
    while not select.select([proc.p.stdout.fileno()], [], [], 0)[0]:
        assert time.monotonic() < deadline, f"{proc.args} not ready within {timeout} s"
        c.pump(0.02)
    proc.wait_ready()


def _record_lease_ends(c: Client) -> list:
    """Every LEASE_END the broker sends `c`, decoded, as the SDK's core receives it."""
    core = c._core
    receive = core._on_lease_message
    ends: list = []

    def spy(frames, now):
        if len(frames) == 4 and bytes(frames[0]) == P.MDPC and bytes(frames[1]) == P.C_LEASE_END:
            try:
                ends.append(P.decode_lease_end(frames[3]))
            except P.ProtocolError:
                pass
        return receive(frames, now)

    core._on_lease_message = spy
    return ends


def test_a_pinned_worker_that_says_goodbye_is_never_presumed_dead(cluster, gate, tmp_path, monkeypatch):
    # After a lease's end the client asks for a lease again no sooner than PIN_RETRY_MIN_S
    # (1 s): idle time in each round but the first, which (in this process's client) a
    # tenth of it cuts; the next worker is READY by then either way.
    monkeypatch.setattr(pins, "PIN_RETRY_MIN_S", 0.1)
    runs_log = tmp_path / "runs.log"
    env = {**gate.env, "SLEEPY_LOG": str(runs_log)}
    broker = cluster.broker(*INFO)
    # Runs what goes through the broker (and would run any resent request a second time).
    plain = cluster.worker("gate_model:held", *INFO, env=env)
    gate.open()  # `held` opened the FIFO read-write at load: returns at once

    def direct_worker():
        # --credit 16: the lease gets 8 slots (PIN_SLOTS), the held request and BEHIND fit.
        return cluster.worker("gate_model:held", "--direct", "--max-batch", "1", "--credit", "16", *INFO,
                              env=env, wait=False)

    stopped = []
    done: Counter = Counter()  # request (its x[1]) -> replies
    keys = itertools.count(1)
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        ends = _record_lease_ends(c)
        wait_service(c, SERVICE)
        nxt = direct_worker()
        for k in range(K):
            w = nxt
            _ready_pumping(c, w)
            # Pinned: brokered echoes meanwhile (the first asks for the lease; after an end
            # the client asks again no sooner than its backoff, 0.1 s here).
            deadline = time.monotonic() + TIMEOUT_S
            while not c.pinned(SERVICE):
                assert time.monotonic() < deadline, f"round {k}: not pinned within {TIMEOUT_S} s"
                key = next(keys)
                _check(c.infer_stream(SERVICE, {"x": _x(0, key)}), _x(0, key), done, key)
                if not c.pinned(SERVICE):
                    c.pump(0.05)  # a LEASED on its way is routed
            nxt = direct_worker() if k + 1 < K else None  # the next one starts meanwhile: the lease is this one's
            before = c.pinned_replies
            for _ in range(3):  # a few answered on the lease before SIGTERM
                key = next(keys)
                _check(c.infer_stream(SERVICE, {"x": _x(0, key)}), _x(0, key), done, key)
            assert c.pinned_replies - before == 3, f"round {k}: the echoes did not go on the lease"
            # One held in the model (on the worker loop's thread), BEHIND more on the lease.
            sent = [(key, _x(-1 if i == 0 else 0, key)) for i, key in zip(range(1 + BEHIND), keys)]
            handles = [(key, x, c.infer_stream(SERVICE, {"x": x})) for key, x in sent]
            pid = str(w.p.pid)
            _pump_until(c, lambda: runs_log.exists() and pid in runs_log.read_text().split(),
                        f"round {k}: the held request running at the pinned worker")
            w.p.send_signal(signal.SIGTERM)
            gate.release(1)
            for key, x, h in handles:
                _check(h, x, done, key)
            assert w.p.wait(TIMEOUT_S) == 0, f"round {k}: the stopping worker exited badly: {w.stderr()}"
            # Its lease has ended (the broker's LEASE_END, or the client's own on a 503): the
            # client hears of it by reading, and the next round pins afresh.
            _pump_until(c, lambda: not c.pinned(SERVICE), f"round {k}: the end of the lease heard")
            stopped.append(w)
            broker.pull()
            plain.pull()
        assert c.in_flight() == 0
        stray = c.stray_replies
        sent_in_all = next(keys) - 1

    assert done == Counter({key: 1 for key in range(1, sent_in_all + 1)}), "a request completed twice or never"
    assert stray == 0, f"{stray} replies matched no waiting request (a request answered twice)"
    assert plain.terminate() == 0
    assert broker.terminate() == 0
    broker_err = _stderr(broker)
    worker_errs = [_stderr(plain)] + [_stderr(w) for w in stopped]

    # The client heard of the ends as goodbyes only.  (It may have ended a lease itself
    # first, on the stopping worker's 503: then the broker has no end to relay.)
    assert ends, "no LEASE_END recorded"
    bad = [(e.lease.hex(), e.reason, e.resend) for e in ends if e.resend or e.reason != "worker_stopping"]
    assert not bad, f"the broker ended leases as failed (lease, reason, resend): {bad}"
    # The broker never took a goodbye for a death.
    dead = [line for line in broker_err.splitlines() if "presum" in line]
    assert not dead, "\n".join(dead)
    # Each request ran once, on one worker.
    rids = Counter(m.group(1) for text in worker_errs for line in text.splitlines() if "request done" in line
                   for m in [re.search(r"rid=(\S+)", line)] if m)
    mine = {rid: n for rid, n in rids.items() if rid.startswith(f"{os.getpid()}:")}
    twice = {rid: n for rid, n in mine.items() if n != 1}
    assert not twice, f"requests run more than once: {twice}"
    assert len(mine) == sent_in_all, f"{sent_in_all} requests sent, {len(mine)} ran"


def test_a_call_after_an_unheard_stop_is_not_sent_to_the_gone_worker(cluster):
    """A blocking client reads only while a call waits: between calls, its pinned worker may
    stop and exit with the LEASE_END still unread in the client's socket.  The next call must
    read it first and go through the broker, not on the lease to a worker that is gone (it
    would wait for its deadline: a stopping lease's calls are not resent)."""
    from broker.protocol.wire import touched

    cluster.broker()
    plain = cluster.worker("echo")  # takes what goes through the broker
    direct = cluster.worker("echo", "--direct")
    x = np.arange(4.0)
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        deadline = time.monotonic() + TIMEOUT_S
        while not c.pinned("echo"):
            assert time.monotonic() < deadline, "not pinned"
            with c.infer("echo", {"x": x}):
                pass
            c.pump(0.05)
        before = c.pinned_replies
        with c.infer("echo", {"x": x}) as r:
            np.testing.assert_array_equal(r["x"], x)
        assert c.pinned_replies == before + 1  # on the lease
        direct.p.send_signal(signal.SIGTERM)
        assert direct.p.wait(TIMEOUT_S) == 0
        # The LEASE_END has reached the client's socket; the client has not read it.
        assert c._sock.poll(int(TIMEOUT_S * 1000))
        touched(c._sock)  # a pyzmq poll behind the client's back (wire.Waiter)
        assert c.pinned("echo")  # as far as it knows
        t0 = time.monotonic()
        with c.infer("echo", {"x": x + 1}) as r:
            np.testing.assert_array_equal(r["x"], x + 1)
        assert time.monotonic() - t0 < TIMEOUT_S / 2
        assert c.pinned_replies == before + 1  # through the broker, not the gone worker
    assert plain.terminate() == 0


def test_a_reply_queued_for_a_client_that_closed_does_not_hold_the_workers_exit(cluster, gate):
    """A direct reply queued on the socket to a client's reply inbox after that client closed
    (its file gone, nobody will read it): the worker's exit lingered the whole
    `DIRECT_LINGER_MS` (2 s) on it, on every SIGTERM after such a close.  It closes at once
    now; sockets of live clients still linger for what they hold.  The worker here runs with
    a linger of 20 s (`_LONG_LINGER`), so the old exit is far from a loaded machine's slow one."""
    broker = cluster.broker()
    w = Proc(["-c", _LONG_LINGER, "--broker", cluster.backend, "--model", "gate_model:copying",
              "--heartbeat-interval", "0.2", "--out-capacity-mb", "160", "--service", "gate", "--max-batch", "1"],
             env=gate.env)
    cluster.procs.append(w)
    gate.open()
    w.wait_ready()
    c = Client(cluster.frontend, timeout=20)
    try:
        wait_service(c, "gate")
        gate.release()
        with c.infer("gate", {"x": np.ones(4)}):  # a direct reply: the worker's socket to the inbox is up
            pass
        assert c.direct_replies == 1
        h = c.infer_stream("gate", {"x": np.ones(4)})
        gate.wait_entered(2)
        # The broker stopped: the close's DISCONNECT (and so the cancel at the worker) waits
        # in its socket, and the answer goes straight to the inbox the close is about to shut.
        os.kill(broker.p.pid, signal.SIGSTOP)
    finally:
        c.close(linger=0)  # its inbox closed and unlinked, the call still at the gate
    try:
        gate.release()  # its answer goes to the closed inbox's socket
        t0 = time.monotonic()
        assert w.terminate(timeout=30) == 0
        took = time.monotonic() - t0
    finally:
        os.kill(broker.p.pid, signal.SIGCONT)
    assert took < 8.0, f"the worker's exit took {took:.2f} s"  # (20 s and more before: the linger)
    del h
