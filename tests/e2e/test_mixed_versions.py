"""Mixed versions during a rolling upgrade: a broker, workers and clients of this tree next to
those of an earlier release (a git worktree of a fixed commit, `old_tree`), as an operator
meets them while replacing one process at a time.  Each test runs the old side from its own
checkout and the new side from this one, with real processes over ipc."""
from __future__ import annotations

import json
import os
import signal

import pytest

from broker import protocol as P

from .conftest import Proc
from .test_direct_full import CALLS, STREAM_CLIENT, WAIT_S, _gated_worker, _Lines, _stopped_with_finals_waiting
from .test_metrics import scrape, until, value
from .test_plain_close import _dealer, _held, _reply, _request

# One xdist worker runs them all: each worker process would check out the same commits
# with `git worktree add` at once (old_tree), and git's bookkeeping of worktrees races.
pytestmark = [pytest.mark.timeout(90), pytest.mark.xdist_group("old_tree")]

#: the release before the one this tree makes (clients and workers users still run)
PREVIOUS = "5578d288b9b537406b833690e3126a3960192564"
#: a day earlier (before STOPPING, the CANCEL reason and LEASED_CLIENT_GONE)
DAY_BEFORE = "a67461e302fd3622eb833e27dfe53015c85f9892"


# What a client of either version does against the cluster: plain calls (small: inline,
# large: shared memory), an AsyncClient's, pinned calls and a pinned stream (the lease on the
# worker's direct socket and local link), a streamed reply.  One JSON line: each check's
# outcome, and how many replies came pinned (straight from the worker).
CLIENT = """
import asyncio, json, sys, time
import numpy as np
from client_sdk import AsyncClient, Client
ep = sys.argv[1]
x = np.arange(64, dtype=np.float32).reshape(2, 32)
big = np.arange(1 << 16, dtype=np.float32)
out = {}
def same(a, b):
    return bool(np.array_equal(a, b))
with Client(ep, timeout=20) as c:
    out["small"] = all(same(c.infer("echo", {"x": x + i})["x"], x + i) for i in range(5))
    out["big"] = all(same(c.infer("echo", {"x": big + i})["x"], big + i) for i in range(3))
    parts = list(c.infer_stream("chunks", {"x": x}))
    out["stream"] = same(np.concatenate([p["x"] for p in parts if "x" in p]), x)
async def aio():
    async with AsyncClient(ep, timeout=20) as c:
        rs = await asyncio.gather(*[c.infer("echo", {"x": x + i}) for i in range(8)])
        return all(same(r["x"], x + i) for i, r in enumerate(rs))
out["aio"] = asyncio.run(aio())
with Client(ep, timeout=20, pin=True) as c:
    deadline = time.monotonic() + 20
    while not (c.pinned("echo") and c.pinned("chunks")):
        assert time.monotonic() < deadline, "never pinned"
        c.infer("echo", {"x": x})
        list(c.infer_stream("chunks", {"x": x}))
        c.pump(0.05)
    before = c.pinned_replies
    out["pinned"] = all(same(c.infer("echo", {"x": v})["x"], v) for v in (x, big))
    with c.stream("echo", latest_wins=False) as s:
        got = []
        for i in range(5):
            s.send({"x": x + i})
            got.append(same(s.recv(timeout=20)["x"], x + i))
    out["pinned_stream"] = all(got)
    parts = list(c.infer_stream("chunks", {"x": x}))
    out["pinned_chunks"] = same(np.concatenate([p["x"] for p in parts if "x" in p]), x)
    out["came_pinned"] = c.pinned_replies - before
print(json.dumps(out), flush=True)
"""

ALL_GOOD = {"small": True, "big": True, "stream": True, "aio": True, "pinned": True, "pinned_stream": True,
            "pinned_chunks": True}


@pytest.mark.parametrize("old_side", ["broker", "workers", "client", "workers and client"])
@pytest.mark.parametrize("release", [PREVIOUS, DAY_BEFORE])
def test_every_kind_of_call_works_across_versions(cluster, old_tree, release, old_side):
    """Old workers and clients behind a new broker, and new ones behind an old broker (as
    during a rolling upgrade): every kind of call is answered, the right answer, once,
    pinned calls straight from the worker; nobody logs a message it could not read."""
    old = old_tree(release)
    broker = cluster.broker("--http", "127.0.0.1:0", tree=old if old_side == "broker" else None)
    workers = [cluster.worker(model, "--direct", "--out-capacity-mb", "16",
                              tree=old if "workers" in old_side else None) for model in ("echo", "chunks")]
    client = Proc(["-c", CLIENT, cluster.frontend], tree=old if "client" in old_side else None)
    cluster.procs.append(client)
    got = json.loads(_Lines(client).until("{"))
    came_pinned = got.pop("came_pinned")
    assert got == ALL_GOOD, got
    assert came_pinned == 2 + 5 + 3, came_pinned  # two calls, five frames, the FINAL and two partials
    assert client.p.wait(WAIT_S) == 0, client.stderr()
    # Every request counted once (the pinned ones from the workers' STATS), none malformed.
    base = "http://" + broker.field("http")
    until(lambda: value(scrape(base), "zmq_infer_requests_total", service="echo", outcome="ok") >= 5 + 3 + 8 + 2 + 5,
          "the echo requests counted")
    for proc in (*workers, broker):
        proc.terminate()
        log = proc.stderr(None)
        for word in ("malformed", "unknown command", "Traceback"):
            assert word not in log, log[-3000:]


@pytest.mark.parametrize("release", [PREVIOUS, DAY_BEFORE])
def test_an_old_client_that_stops_reading_gets_a_cut_streams_partials_then_one_clear_error(cluster, old_tree,
                                                                                           release):
    """A new worker ends the pinned stream of a client that reads nothing for 0.5 s with a
    502 FINAL after the partials it queued (protocol.md 10.3); an old client reads them, in
    order, then that error, and does not run the stream again."""
    cluster.broker()
    w = cluster.worker("faulty_model:streaming", "--service", "s", "--direct", "--no-link")
    client = Proc(["-c", STREAM_CLIENT, cluster.frontend], tree=old_tree(release))
    cluster.procs.append(client)
    out = _Lines(client)
    out.until("PINNED")
    out.until("STOPPING")
    w.wait_log("not reading")
    os.kill(client.p.pid, signal.SIGCONT)
    got = json.loads(out.until("{"))
    assert got["in_order"] and got["n"] >= 1, got
    assert got["error"][0] == "WorkerFailed" and f"cut after {got['n']} partial" in got["error"][1], got
    assert client.p.wait(WAIT_S) == 0


@pytest.mark.parametrize("release", [PREVIOUS, DAY_BEFORE])
def test_answers_a_new_worker_held_for_a_client_that_left_are_counted_once_by_an_old_broker(cluster, gate, old_tree,
                                                                                            release):
    """A new worker holds the FINALs of a pinned client that stopped reading and drops them
    when it exits: its STATS count them `LEASED_CLIENT_GONE` (-1).  The previous release's
    broker counts them `client_gone`; the one of a day before, which predates the code,
    `error_other` (what it names every outcome it does not know); each request once."""
    broker = cluster.broker("--http", "127.0.0.1:0", tree=old_tree(release))
    base = "http://" + broker.field("http")
    w = _gated_worker(cluster, gate)
    client, _, pinning = _stopped_with_finals_waiting(cluster, gate, w)
    client.kill()

    def counted():
        s = scrape(base)
        n = {o: value(s, "zmq_infer_requests_total", service="gate", outcome=o)
             for o in ("ok", "client_gone", "error_other")}
        return sum(n.values()) == pinning + CALLS and n

    n = until(counted, "every request of the client that left counted")
    gone = "client_gone" if release == PREVIOUS else "error_other"
    assert n[gone] >= 1 and n["ok"] + n[gone] == pinning + CALLS, n
    assert w.p.poll() is None


@pytest.mark.parametrize("release", [PREVIOUS, DAY_BEFORE])
def test_a_closed_plain_clients_running_request_is_cancelled_at_an_old_worker_and_counted_once(
        cluster, gate, tmp_path, old_tree, release):
    """The new broker ends a plain client's requests when its connection closes, its
    running one by a CANCEL (with a reason byte the day-before worker does not read): an old
    worker's answer to it is counted `client_gone` once, and the next client is served."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    depth, ran, w = _held(cluster, gate, tmp_path, base, tree=old_tree(release))
    gone, live = _dealer(cluster.frontend), _dealer(cluster.frontend)
    try:
        for i in range(5):
            gone.send_multipart(P.client_request("held", _request(i + 1, -1.0)))  # held until released
        until(lambda: depth() == 4 and ran() == 1, "one request held at the worker, four queued")
        live.send_multipart(P.client_request("held", _request(1, -1.0)))
        until(lambda: depth() == 5, "the live client's request queued")
        gone.close()
        until(lambda: depth() == 1, "the closed client's queued requests dropped")
        gate.release(2)  # the cancelled one (an old worker may run it to its end), then the live one
        rep = _reply(live)
        assert rep.error is None and rep.id == 1, rep.error

        def counted():
            s = scrape(base)
            return {o: value(s, "zmq_infer_requests_total", service="held", outcome=o)
                    for o in ("ok", "client_gone", "cancelled", "error_other")}

        until(lambda: counted()["client_gone"] == 5, "the closed client's five requests counted client_gone")
        assert counted() == {"ok": 1, "client_gone": 5, "cancelled": 0, "error_other": 0}
        assert ran() == 2
    finally:
        gone.close(0)
        live.close(0)
    w.terminate()
    assert "malformed" not in w.stderr(None)

