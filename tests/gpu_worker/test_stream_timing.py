"""A streaming reply shows every wait its request had, as a batch reply does: each PARTIAL and
the FINAL carry queue_ms and returned (the broker's, from the request), batch_wait_ms (from
the worker's receipt to the stream's start), input_ms and compute_ms.  In process: an inproc
pair stands in for the broker, the model is tests/e2e/gate_model.py's `ticker`."""
from __future__ import annotations

import time

import numpy as np
import pytest

from broker import protocol as P
from gpu_worker.worker import Worker, WorkerConfig
from tests.gpu_worker.pair_link import PairLink

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEPY_LOG", str(tmp_path / "ticks.log"))
    up = PairLink(f"stream-timing-{id(tmp_path)}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="tests.e2e.gate_model:ticker", warmup=False),
               upstream=up)
    w._connect()
    w.up = up
    try:
        yield w
    finally:
        w.close()


def _replies(up: PairLink) -> list[tuple[bytes, P.Reply]]:
    out = []
    while True:
        assert up.peer.poll(5000), "the stream did not end"
        msg = P.parse_worker(up.peer.recv_multipart())
        if msg.command not in (P.W_PARTIAL, P.W_FINAL):
            continue  # heartbeats, STATS
        out.append((msg.command, P.decode_reply(msg.body[0], n_inline=len(msg.body) - 1)))
        if msg.command == P.W_FINAL:
            return out


def test_every_partial_and_the_final_show_every_wait(worker):
    x = np.array([3.0, 0.0])  # three partials, no sleeping
    head = P.Request(id=4, reply="inline", tensors=[P.TensorRef("x", "<f8", [2], P.InlineLoc(frame=0))],
                     queue_ms=7.5, returned=1)
    frames = [P.MDPW, P.W_REQUEST, P.token_envelope(4), b"", P.encode_header(head), x.tobytes()]
    # Received 250 ms ago (as if it had waited behind another stream): the wait shows.
    worker._handle(P.parse_broker_to_worker(frames), time.monotonic() - 0.25)
    worker.run_ready_batches(force=True)
    got = _replies(worker.up)
    assert [cmd for cmd, _ in got] == [P.W_PARTIAL] * 3 + [P.W_FINAL]
    assert [rep.seq for _, rep in got] == [0, 1, 2, 3]
    for cmd, rep in got:
        t = rep.timing
        assert t["queue_ms"] == 7.5 and t["returned"] == 1.0, t
        assert t["batch_wait_ms"] >= 250.0, t
        assert t["input_ms"] >= 0.0 and t["compute_ms"] >= 0.0, t
        assert ("output_ms" in t) == (cmd == P.W_PARTIAL), t  # the FINAL carries no tensors
    # The waits are the request's, the same on every reply; compute_ms grows.
    assert len({rep.timing["batch_wait_ms"] for _, rep in got}) == 1
    computes = [rep.timing["compute_ms"] for _, rep in got]
    assert computes == sorted(computes)


def test_a_request_the_broker_never_queued_shows_no_broker_fields(worker):
    x = np.array([1.0, 0.0])
    head = P.Request(id=5, reply="inline", tensors=[P.TensorRef("x", "<f8", [2], P.InlineLoc(frame=0))])
    worker._handle(P.parse_broker_to_worker(
        [P.MDPW, P.W_REQUEST, P.token_envelope(5), b"", P.encode_header(head), x.tobytes()]), time.monotonic())
    worker.run_ready_batches(force=True)
    for _, rep in _replies(worker.up):
        assert "queue_ms" not in rep.timing and "returned" not in rep.timing, rep.timing
        assert rep.timing["batch_wait_ms"] >= 0.0


def test_a_stream_is_counted_in_the_worker_histograms_as_a_batch_of_one(worker):
    # A service whose model streams had empty compute, input, output and batch histograms
    # (only the batch path observed them).
    worker.counts = True  # as after our broker's WELCOME
    x = np.array([2.0, 0.0])
    head = P.Request(id=5, reply="inline", tensors=[P.TensorRef("x", "<f8", [2], P.InlineLoc(frame=0))])
    frames = [P.MDPW, P.W_REQUEST, P.token_envelope(5), b"", P.encode_header(head), x.tobytes()]
    worker._handle(P.parse_broker_to_worker(frames), time.monotonic())
    worker.run_ready_batches(force=True)
    _replies(worker.up)
    hist = worker._hist
    assert [sum(hist[k].counts) for k in ("compute", "input", "output", "batch")] == [1, 1, 1, 1]


def test_leased_outcomes_waiting_for_a_broker_that_stopped_counting_do_not_spin_the_loop(worker):
    # Review: leased outcomes wait LEASED_STATS_S for their STATS, and the loop's wait is cut
    # to that; a WELCOME of a broker that counts nothing (restarted without --http) left them
    # waiting for good, `_send_stats` returning at once: a 0 ms wait, a worker at 100% CPU.
    worker.counts = True
    worker._leased_outcomes = {0: 3}
    worker._leased_since = time.monotonic() - 1.0
    worker.counts = False  # a WELCOME without `metrics`
    worker._send_stats()
    assert worker._leased_since is None and worker._leased_outcomes == {}
