"""A congested worker serves a client's parked requests newest first, as the broker's
congested queue does (gpu_worker/batching.py, "Congestion"; docs/models.md, "Batching
policy"): real broker and worker processes, a gated model, no sleeps."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from broker import protocol as P

from .conftest import RunLog


def _tagged(rid: int, tag: int, timeout_ms: int = 20_000, dropped: int | None = None) -> list:
    """A REQUEST for `gate_model:counted` with a deadline (20 s unless said): x = [tag];
    ``dropped`` set (0 included): a stream's frame."""
    t = P.TensorRef(name="x", dtype="<i8", shape=[1], loc=P.InlineLoc(frame=0))
    head = P.encode_header(P.Request(id=rid, timeout_ms=timeout_ms, tensors=[t], dropped=dropped))
    return P.client_request("cq", [head, np.array([tag], np.int64).tobytes()])


def _recv_final(sock: zmq.Socket) -> P.Reply:
    assert sock.poll(10_000), "no reply within 10 s"
    m = P.parse_broker_to_client(sock.recv_multipart())
    assert m.command == P.C_FINAL, m
    return P.decode_reply(m.body[0], n_inline=len(m.body) - 1)


@pytest.mark.parametrize("frames", [False, True], ids=["calls", "stream_frames"])
def test_requests_parked_at_a_congested_worker_go_newest_first(cluster, gate, tmp_path, frames):
    """Credit 6, batches of one: request 0 runs, held at the gate; 1 to 4 park in the
    worker's batcher behind it (the worker read them: it answered the cancel of a fifth
    sent after them).  Request 1, with a 0.3 s timeout, is lost to its deadline while it
    waits: the backlog costs calls, so the group is congested (``--lifo-after-ms`` 60 s:
    any loss counts), and once the gate opens the newest goes first: 4, 3, 2.  Before, the
    worker served its parked requests in arrival order, the oldest first, while the
    broker's congested queue sent the newest: a flood parked at the worker waited there
    first in first out until it expired.  (That a backlog which loses nothing keeps its
    order: tests/e2e/test_running_work.py, a model slower than ``lifo_after``.)  A stream's
    frames (the header's ``dropped``, written on each) keep their order even then: 2, 3, 4
    (their client takes the results in send order; a newer frame run first would wait)."""
    cluster.broker()
    runs = RunLog(tmp_path / "runs.log")
    p = cluster.worker("gate_model:counted", "--service", "cq", "--max-batch", "1", "--credit", "6",
                       "--no-warmup", "--lifo-after-ms", "60000", env={**gate.env, "RUN_LOG": str(runs.path)},
                       wait=False)
    gate.open()  # returns at once: the model holds the FIFO open for reading and writing
    p.wait_ready()

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(cluster.frontend)
    try:
        deadline = time.monotonic() + 20
        while True:  # until the broker knows the worker (MMI: a condition, not a delay)
            s.send_multipart(P.client_request("mmi.service", [b"cq"]))
            assert s.poll(10_000), "no MMI answer"
            if P.parse_broker_to_client(s.recv_multipart()).body[0] == b"200":
                break
            assert time.monotonic() < deadline, "no worker for 'cq'"
            time.sleep(0.01)
        dropped = 0 if frames else None
        s.send_multipart(_tagged(1, 0, dropped=dropped))
        runs.until(1)  # the first runs alone, held at the gate (offloaded: no warm-up timed it)
        s.send_multipart(_tagged(2, 1, timeout_ms=300, dropped=dropped))
        for tag in range(2, 6):
            s.send_multipart(_tagged(tag + 1, tag, dropped=dropped))
        s.send_multipart(P.client_cancel("cq", 6))  # the fifth: dispatched, so the worker answers
        rep = _recv_final(s)
        assert rep.id == 6 and rep.error is not None and rep.error.code == P.ErrorCode.CANCELLED, rep
        # The worker read 1 to 4 before that cancel: they wait in its batcher, and 1 is lost.
        rep = _recv_final(s)
        assert rep.id == 2 and rep.error is not None and rep.error.code == P.ErrorCode.DEADLINE_EXCEEDED, rep
        for n in range(2, 5):
            gate.release(1)
            runs.until(n)
        gate.release(1)
        done = sorted(_recv_final(s).id for _ in range(4))
        assert done == [1, 3, 4, 5]
    finally:
        s.close(0)
    order = runs.order()
    if frames:
        assert order == [0, 2, 3, 4], f"run order {order}: a stream's frames were not served in order"
    else:
        assert order == [0, 4, 3, 2], f"run order {order}: the parked requests were not served newest first"
