"""bench.chaos: every fault it knows, under load from every kind of client, loses no request
and leaves nothing behind; and its check does catch a wrong reply."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from bench import chaos

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent


def test_the_schedule_is_seeded_paced_and_holds_every_fault():
    plan = chaos.schedule(30, 2.0, seed=7)
    assert plan == chaos.schedule(30, 2.0, seed=7)
    assert plan != chaos.schedule(30, 2.0, seed=8)
    times = [t for t, _ in plan]
    assert times[0] == 2.0 and times[-1] < 30
    assert all(1.5 - 1e-9 <= b - a <= 2.5 + 1e-9 for a, b in zip(times, times[1:]))
    kinds = Counter(k for _, k in plan)
    assert set(kinds) == set(chaos.FAULTS)
    assert max(kinds.values()) - min(kinds.values()) <= 1  # drawn evenly


def test_every_fault_under_load_loses_no_request_and_leaves_nothing_behind():
    plan = [(1.0 + 0.5 * i, kind) for i, kind in enumerate(chaos.FAULTS)]
    res = chaos.run(plan=plan, workers=2, seed=3, hang_s=1.2, settle_s=1.5, counts=True, log=lambda *_: None)
    assert [e["fault"] for e in res["faults"]] == list(chaos.FAULTS)
    assert res["passed"], res
    for name, r in res["clients"].items():
        # pipelined pauses up to 4.5 s per pair, on purpose
        assert r["outcomes"].get("ok", 0) > (2 if name == "pipelined" else 50), (name, r)


def test_over_tcp_a_reset_of_every_client_connection_loses_no_request():
    plan = [(1.0, "reset"), (1.5, "restart-broker"), (2.0, "reset")]
    res = chaos.run(plan=plan, workers=1, seed=4, settle_s=1.5, tcp=True, clients=("small", "async", "pipelined"),
                    counts=True, log=lambda *_: None)
    assert res["tcp"] and [e["fault"] for e in res["faults"]] == ["reset", "restart-broker", "reset"]
    assert res["passed"], res
    for name, r in res["clients"].items():
        assert r["outcomes"].get("ok", 0) > (2 if name == "pipelined" else 50), (name, r)


def test_a_wrong_reply_is_caught(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    res = chaos.run(plan=[], workers=1, seed=1, settle_s=1.0, model="corrupt_model:factory",
                    clients=("small",), log=lambda *_: None)
    assert res["wrong"] > 0 and res["failed"] == 0
    assert not res["passed"]


def test_the_client_process_s_wrong_reply_is_counted_too(monkeypatch):
    """Its only word is its exit status (3): the run must read it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    res = chaos.run(plan=[], workers=1, seed=1, settle_s=1.0, model="corrupt_model:factory",
                    clients=(), log=lambda *_: None)  # the client process alone sends
    assert res["wrong"] >= 1 and not res["passed"]


def test_a_client_that_crashes_fails_the_run(monkeypatch):
    def broken(*_):
        raise RuntimeError("no stream today")

    monkeypatch.setattr(chaos, "_stream_client", broken)
    res = chaos.run(plan=[], workers=1, seed=1, settle_s=0.5, clients=("small", "stream"), log=lambda *_: None)
    assert res["clients"]["stream"]["outcomes"] == {"crashed": 1}
    assert res["idle_clients"] == ["stream"] and not res["passed"]
    with pytest.raises(ValueError, match="nonsense"):
        chaos.run(plan=[], clients=("nonsense",))


def test_without_a_killed_broker_or_worker_the_brokers_count_every_ok_and_no_more():
    """--counts: no process that counts is SIGKILLed, so each ok a client got is one count."""
    plan = [(1.0, "drain-worker"), (1.5, "hang-broker"), (2.0, "kill-client")]
    res = chaos.run(plan=plan, workers=2, seed=5, hang_s=0.9, settle_s=1.0, counts=True,
                    clients=("small", "pinned", "async"), log=lambda *_: None)
    c = res["counts"]
    assert c["exact"] and not c["mismatches"], c
    assert c["brokers"]["ok"] >= c["clients_ok"] > 100, c
    assert res["passed"], res


def test_the_count_check_names_each_kind_of_mismatch():
    ok = {"small": {"outcomes": {"ok": 10}, "client_stats": {"resent_calls": 2}}}
    fine = chaos.check_counts([{"outcomes": {"ok": 11, "client_gone": 1}}], ok, 0, 0, [{"fault": "restart-broker"}])
    assert fine["mismatches"] == [] and not fine["exact"]
    bad = chaos.check_counts([{"outcomes": {"ok": 13, "cancelled": 3}}], ok, 0, 0, [])
    assert len(bad["mismatches"]) == 2 and "1 ok too many" in bad["mismatches"][0], bad
    short = chaos.check_counts([{"outcomes": {"ok": 9}}], ok, 0, 0, [{"fault": "drain-worker"}])
    assert short["mismatches"] == ["the brokers counted 9 ok, the clients got 10: 1 uncounted"], short


def test_a_stream_frame_still_out_as_the_run_stops_is_awaited_not_failed(monkeypatch):
    """The stream client looks at what has come back without waiting (recv(timeout=0)),
    which raises TimeoutError while a frame is out.  The run may stop between that look and
    the stream client's reading of `stop`: the frame is then still to be collected, with the
    request timeout, like every frame out at the stop, and is no failure."""
    import threading

    import client_sdk

    stop = threading.Event()

    class Result:
        def __init__(self, frame, x):
            self.frame, self.x = frame, x

        def __getitem__(self, name):
            return self.x

        def release(self):
            pass

    class Stream:
        def __init__(self):
            self.out, self.n = [], 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def send(self, inputs):
            self.n += 1
            self.out.append(Result(self.n, inputs["x"]))
            return self.n

        def recv(self, timeout=None):
            if timeout == 0.0:
                stop.set()  # the run stops just after this look
                raise TimeoutError("no result within 0s; the frame is still in flight")
            if not self.out:
                raise client_sdk.EndOfStream("nothing to receive")
            return self.out.pop(0)

        def stats(self):
            return {"dropped": 0}

    class Client:
        resent_calls = stray_replies = broker_restarts = broker_reconnects = 0

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def mmi_service(self, name, timeout=None):
            return True

        def stream(self, *args, **kwargs):
            return Stream()

    monkeypatch.setattr(client_sdk, "Client", Client)
    tally = chaos.Tally()
    chaos._stream_client("ipc://unused", tally, stop, 30.0, 1)
    assert +tally.outcomes == Counter(ok=1), (tally.outcomes, tally.samples)
