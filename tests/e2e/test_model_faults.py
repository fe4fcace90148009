"""What a model (user code) can do to the worker and to other clients' requests
(tests/e2e/faulty_model.py): a request that makes it raise fails alone, whatever it raises
(SystemExit and GeneratorExit included, on the loop's thread or the compute thread); a
streaming model that raises fails its own request; a model that reuses its output buffer
never sends one client another's data; outputs that cannot be sent are a clear error and
keep no output slot.  Real broker and workers on ipc; every wait bounded."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client
from broker import protocol as P
from client_sdk.errors import Cancelled, InternalError, InvalidInput, WorkerFailed
from tests.e2e.conftest import wait_service

pytestmark = pytest.mark.timeout(180)


def _mixed_load(frontend: str, bad: dict, n_good: int = 48, n_bad: int = 16, extra: dict | None = None,
                service: str = "batched", expect: type = InternalError) -> tuple[int, list]:
    """Good and bad requests at once, interleaved (one bad after every three good) on one
    connection, so that the broker reads them in that order and batches mix them (from two
    clients, libzmq's fair queueing could hand the broker eight bad ones in a row, and no
    batch mixed): (good ones answered right, the bad ones' errors)."""
    extra = extra or {}

    async def scenario():
        async with AsyncClient(frontend, timeout=60) as good_c:
            bad_c = good_c

            async def good(i):
                x = np.full(4, float(i), np.float32)
                with await good_c.infer(service, {"x": x}, meta=extra or None) as r:
                    np.testing.assert_array_equal(r["y"], x + 1)
                return 1

            async def poisoned(i):
                try:
                    with await bad_c.infer(service, {"x": np.zeros(4, np.float32)}, meta={**bad, **extra}):
                        return None
                except expect as e:
                    return e

            calls, bads = [], []
            for i in range(n_good):
                calls.append(asyncio.ensure_future(good(i)))
                if i % 3 == 2 and len(bads) < n_bad:
                    bads.append(asyncio.ensure_future(poisoned(i)))
            res = await asyncio.gather(*calls)
            return sum(res), await asyncio.gather(*bads)

    return asyncio.run(scenario())


@pytest.mark.parametrize("offload", [False, True], ids=["loop-thread", "compute-thread"])
@pytest.mark.parametrize("do", ["raise", "exit", "genexit"])
def test_a_request_that_makes_the_model_raise_fails_alone(cluster, do, offload):
    # A batch that raised failed every request in it (one client's bad input, everyone's
    # error); SystemExit ended the worker (and, retried, every worker of the service), and on
    # the compute thread it killed the thread: the worker hung for good, heartbeating.
    cluster.broker()
    w = cluster.worker("faulty_model:batched", "--service", "batched", "--max-batch", "8", "--max-delay-ms", "5")
    # A batch predicted slow runs on the compute thread: 30 ms is six times the line
    # (`leases.LONG_BATCH_S`); half the load there (each batch sleeps, the halves too).
    slow = {"slow": 0.03} if offload else {}
    good, bad = (24, 8) if offload else (48, 16)
    served, errors = _mixed_load(cluster.frontend, {"do": do}, n_good=good, n_bad=bad, extra=slow)
    assert served == good and len(errors) == bad
    assert all(isinstance(e, InternalError) for e in errors), errors
    assert all(("ValueError" if do == "raise" else {"exit": "SystemExit", "genexit": "GeneratorExit"}[do])
               in str(e) for e in errors), errors[0]
    w.wait_log("the others were served")  # batches did mix good and bad requests
    assert w.p.poll() is None  # the worker serves on
    served, _ = _mixed_load(cluster.frontend, {}, n_good=good, n_bad=0, extra=slow)
    assert served == good


def test_inputs_a_model_refuses_are_the_requests_fault(cluster):
    # A model had no way to say "your input is wrong": what it raised was a 500 "retrying
    # may help" (the shipped `convnet` on a 16x16 image, say).  `gpu_worker.models.
    # InvalidInput` is the request's 422, and in a batch only the requests that raise it alone.
    from client_sdk.errors import InvalidInput

    cluster.broker()
    w = cluster.worker("faulty_model:batched", "--service", "batched", "--max-batch", "8", "--max-delay-ms", "5")
    served, errors = _mixed_load(cluster.frontend, {"do": "refuse"}, expect=InvalidInput)
    assert served == 48 and len(errors) == 16
    assert all(isinstance(e, InvalidInput) and e.code == P.ErrorCode.INVALID_INPUT for e in errors), errors
    assert all("faulty_model: this request's x is refused" in str(e) for e in errors), errors[0]
    assert w.p.poll() is None
    w.terminate()
    assert "failed on a batch" not in w.stderr(None)  # the requests' fault, not the model's: no ERROR


def test_a_batch_run_again_in_parts_does_not_hand_one_request_anothers_outputs(cluster):
    # A model that fills one output buffer on every call: the requests of a batch that
    # raised were run again one by one, and each reply pointed at the buffer the last run
    # filled.  Each run's outputs are copied before the next.
    cluster.broker()
    w = cluster.worker("faulty_model:batched_keeper", "--service", "keeper", "--max-batch", "8",
                       "--max-delay-ms", "5")
    served, errors = _mixed_load(cluster.frontend, {"do": "raise"}, service="keeper")
    assert served == 48 and len(errors) == 16  # (the good ones' values are checked one by one)
    w.wait_log("the others were served")


def test_a_request_cancelled_while_its_batch_runs_again_does_not_shift_the_others_outputs(cluster, gate):
    # A batch that raised runs again in halves on the compute thread; a CANCEL read by the
    # loop meanwhile marks a request of the running half cancelled, and the halves' outputs
    # were matched to their requests by reading that mark again after the run: the request
    # after the cancelled one got its output (x = [2, 2, 2] came back [1, 1, 1], the
    # fidelity hunt), and the ones after it each their neighbour's.
    cluster.broker()
    cluster.worker("rows_model:factory", "--max-batch", "4", "--max-delay-ms", "200", "--no-warmup", env=gate.env)
    gate.open()

    def barrier(c):
        # Refused by the worker loop at once, even while a batch computes: once answered,
        # the worker has read everything the broker sent it before (one connection, in order).
        with pytest.raises(InvalidInput):
            c.infer("rows", {"x": np.zeros(3, np.float32)})

    with Client(cluster.frontend, timeout=30) as c:
        wait_service(c, "rows")
        first = c.infer_stream("rows", {"x": np.full(3, 9, np.int64)})
        gate.wait_entered(1)                 # runs alone (a batch size never seen: compute thread)
        tags = (1, 2, 3, -4)                 # -4: its batch raises
        calls = [c.infer_stream("rows", {"x": np.full(3, t, np.int64)}) for t in tags]
        barrier(c)                           # the four wait at the worker: one batch after `first`
        gate.release()
        np.testing.assert_array_equal(first.result(timeout=20)["x"], [9, 9, 9])
        gate.wait_entered(2)                 # the batch of four
        gate.release()                       # raises: run again as [1, 2] and [3, -4]
        gate.wait_entered(3)                 # [1, 2] runs
        calls[0].cancel()
        barrier(c)                           # the worker read the CANCEL while [1, 2] runs
        gate.release(4)                      # [1, 2], [3, -4], [3], [-4]
        with pytest.raises(Cancelled):
            calls[0].result(timeout=20)
        for t, call in zip(tags[1:3], calls[1:3]):
            r = call.result(timeout=20)
            assert r.timing["batch"] == 4
            np.testing.assert_array_equal(r["x"], [t, t, t])
        with pytest.raises(InternalError, match="a row asked to fail"):
            calls[3].result(timeout=20)
        assert gate.entered() == 6


def test_a_good_request_whose_broker_connection_was_replaced_while_its_batch_ran_is_not_failed_by_anothers_error(
        cluster, gate):
    # A batch that raised runs again in halves, but a request marked stale meanwhile (the
    # broker went silent and the loop reconnected while the compute thread ran the batch)
    # was skipped and answered with the batch's error: its FINAL goes straight to its
    # client (reply_to), which raised InternalError naming another request's bad input for
    # a request that was fine (the races hunt).  Run again, it gets its result directly.
    broker = cluster.broker()
    w = cluster.worker("rows_model:factory", "--max-batch", "4", "--max-delay-ms", "200", "--no-warmup", env=gate.env)
    gate.open()
    # (a client heartbeat far off: it does not notice the broker's pause, nor resend)
    with Client(cluster.frontend, timeout=30, heartbeat_interval=30) as c:
        wait_service(c, "rows")
        first = c.infer_stream("rows", {"x": np.full(3, 9, np.int64)})
        gate.wait_entered(1)                 # runs alone on the compute thread
        good = c.infer_stream("rows", {"x": np.full(3, 5, np.int64)})
        bad = c.infer_stream("rows", {"x": np.full(3, -6, np.int64)})
        with pytest.raises(InvalidInput):    # the barrier: both wait at the worker, behind `first`
            c.infer("rows", {"x": np.zeros(3, np.float32)})
        gate.release()
        np.testing.assert_array_equal(first.result(timeout=20)["x"], [9, 9, 9])
        gate.wait_entered(2)                 # [5, -6] runs on the compute thread
        broker.p.send_signal(signal.SIGSTOP)
        try:
            w.wait_log("reconnecting")       # silent past the liveness window: both marked stale
            gate.release(3)                  # [5, -6] raises; [5] and [-6] run again
            with good.result(timeout=20) as r:
                np.testing.assert_array_equal(r["x"], [5, 5, 5])
                assert r.timing["batch"] == 2
            with pytest.raises(InternalError, match="a row asked to fail"):
                bad.result(timeout=20)
        finally:
            broker.p.send_signal(signal.SIGCONT)
    assert gate.entered() == 4


def test_a_streaming_model_that_raises_fails_its_own_request_and_the_worker_serves_on(cluster):
    # An exception out of a streaming model ended the worker (and, retried, every worker of
    # the service): other clients' streams failed with it.
    cluster.broker()
    w = cluster.worker("faulty_model:streaming", "--service", "s")
    x = np.arange(4, dtype=np.float32)
    with Client(cluster.frontend, timeout=20) as c:
        for do in ("raise", "badtype", "surrogate"):  # (a lone surrogate in its message: the data hunt)
            got = []
            with pytest.raises(InternalError, match="after 2 partial") as e:
                with c.infer_stream("s", {"x": x}, meta={"do": do}) as h:
                    for r in h:
                        with r:
                            if "y" in r:
                                got.append(np.array(r["y"]))
            # (a partial no reply can carry is the model's mistake: not "retrying may help")
            assert ("retrying" in str(e.value)) == (do != "badtype"), e.value
            assert len(got) == 2 and all((g == x + i).all() for i, g in enumerate(got))
        with c.infer_stream("s", {"x": x}) as h:  # and a good one, after
            parts = [np.array(r["y"]) for r in h if "y" in r]
        assert len(parts) == 4 and all((p == x + i).all() for i, p in enumerate(parts))
    assert w.p.poll() is None


def test_a_model_that_reuses_its_output_buffer_never_sends_one_client_anothers_data(cluster):
    # An inline reply was a zero-copy view of the model's own buffer: the next request
    # refilled it while libzmq still sent the previous reply (90 of 200 wrong here).
    cluster.broker()
    cluster.worker("faulty_model:keeper", "--service", "keeper")
    wrong, errors = [], []

    def run(k):
        try:
            with Client(cluster.frontend, timeout=30, transport="inline") as c:
                for i in range(40):
                    x = np.full((1, 1 << 15), k * 1000 + i, np.float32)  # 128 KiB: above pyzmq's copy threshold
                    with c.infer("keeper", {"x": x}) as r:
                        if not np.array_equal(r["y"], x):
                            wrong.append((k, i, float(r["y"].min()), float(r["y"].max())))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not wrong, (errors, wrong[:5])


@pytest.mark.parametrize("do,match", [("many", "at most 256"), ("badname", "must be non-empty strings"),
                                      ("emptyname", "must be non-empty strings"),  # (an input may not be "")
                                      # (numpy 1 refuses the 42-d array in the model itself)
                                      ("deep", "dimensions; the limit is 32|maximum supported dimension"),
                                      ("half", "cannot be sent"), ("v0", "cannot be sent"),
                                      # (the data hunt: the first a reply header its client refused, the
                                      # call waiting out its deadline; the second the worker's death)
                                      ("longname", "output names take 2097152 bytes"),
                                      ("surrname", "is not valid UTF-8"),
                                      # (the edge hunt: an empty output whose shape no header
                                      # may carry was refused by its client as a protocol bug)
                                      ("emptyhuge", "describe more than 1099511627776 bytes"),
                                      # (an AttributeError out of the backend, "retrying may help")
                                      ("list", "returned list; expected a dict of outputs"),
                                      ("noaxis", "expected a leading batch axis of 1")])
def test_outputs_that_cannot_be_sent_are_a_clear_error_and_keep_no_slot(cluster, do, match):
    # These were written slot by slot and failed half way, keeping the slots already taken
    # (lent to the live client for good), or were sent as replies the client refused as a
    # protocol bug.
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    w = cluster.worker("faulty_model:batched", "--service", "batched")
    x = np.ones((1, 2048), np.float32)  # 8 KiB: above the small-inline size, into the ring
    from tests.e2e.test_metrics import scrape

    def ring_bytes_becomes(cond, what):
        deadline = time.monotonic() + 20
        while True:
            used = [v for (name, _), v in scrape(base).items() if name == "zmq_infer_shm_pool_used_bytes"]
            if used and cond(sum(used)):
                return sum(used)
            assert time.monotonic() < deadline, f"output ring: {used} bytes, not {what}"
            time.sleep(0.05)

    with Client(cluster.frontend, timeout=20) as c:
        for _ in range(5):
            with pytest.raises(InternalError, match=match) as e:
                with c.infer("batched", {"x": x}, meta={"do": do}, reply="shm"):
                    pass
            if "maximum supported dimension" not in str(e.value):  # (numpy 1: the model raised it)
                # The model's mistake, met again by the same request: not "retrying may help".
                assert "no reply can carry" in str(e.value) and "retrying" not in str(e.value), e.value
        # A result held: the next STATS (sent when the ring changes) count it and nothing
        # else, so they are not the ones from before the failures.
        with c.infer("batched", {"x": x}, reply="shm") as r:
            np.testing.assert_array_equal(r["y"], x + 1)
            assert ring_bytes_becomes(lambda b: b > 0, "in use") == x.nbytes
        ring_bytes_becomes(lambda b: b == 0, "empty")
    assert w.p.poll() is None


@pytest.mark.parametrize("do, match", [("objects", "has dtype '|O', which cannot be sent"),
                                       ("intname", "must be non-empty strings; the model returned 1")])
def test_outputs_no_reply_can_carry_fail_only_the_request_that_made_them(cluster, do, match):
    # Outputs were checked only as each request's reply was written, after the batch was
    # split: one request that made the model return an object array failed every request
    # of its batch (the models audit).  Such a batch is run again in halves, as one that
    # raised, and only the request that makes the model return them alone fails.
    cluster.broker()
    w = cluster.worker("faulty_model:batched", "--service", "batched", "--max-batch", "8", "--max-delay-ms", "5")
    served, errors = _mixed_load(cluster.frontend, {"do": do})
    assert served == 48 and len(errors) == 16
    assert all(isinstance(e, InternalError) and e.code == P.ErrorCode.INTERNAL for e in errors), errors
    for e in errors:
        # The model's mistake, met again by the same request: not "retrying may help".
        assert "no reply can carry" in str(e) and "retrying" not in str(e) and match in str(e), e
    w.wait_log("the others were served")  # batches did mix good and bad requests
    assert w.p.poll() is None


@pytest.mark.parametrize("do, words", [("surrogate", ["cannot open /data/\\udcff.bin"]),
                                       ("badstr", ["Unprintable: (its str() raised RuntimeError)"]),
                                       ("longmsg", ["xxxx", "more characters cut)"])])
def test_an_error_message_that_cannot_go_as_it_is_fails_only_its_request(cluster, do, words):
    # Found by the data hunt: a model's exception text with a lone surrogate (a non-UTF-8
    # file name), or whose str() raised, took the worker down while its error reply was
    # encoded, and the broker's retries then took the other worker of the service too; a
    # 2 MiB message made a reply header the client refused (the call waited out its deadline).
    cluster.broker()
    workers = [cluster.worker("faulty_model:batched", "--service", "batched") for _ in range(2)]
    x = np.ones((1, 4), np.float32)
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "batched")
        with pytest.raises(InternalError) as e:
            with c.infer("batched", {"x": x}, meta={"do": do}):
                pass
        for w in words:
            assert w in str(e.value), str(e.value)[:300]
        assert len(str(e.value)) < P.MAX_ERROR_MESSAGE + 300
        assert c.in_flight() == 0 and c.pool.live_bytes() == 0
        for _ in range(4):  # both workers serve on
            with c.infer("batched", {"x": x}) as r:
                np.testing.assert_array_equal(r["y"], x + 1)
    assert all(w.p.poll() is None for w in workers)


def test_an_input_dtype_torch_cannot_hold_is_the_requests_fault(cluster):
    # Found by the data hunt: strings, datetimes or float128 sent to a torch model were the
    # model's INTERNAL error ("retrying may help"); they are the request's.
    pytest.importorskip("torch")
    from client_sdk.errors import InvalidInput

    cluster.broker()
    w = cluster.worker("faulty_model:torchadd", "--service", "t")
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "t")
        for bad in (np.array(["ab", "cd"]), np.array(["2026-12-05"], dtype="datetime64[D]"), np.zeros(2, "V8")):
            with pytest.raises(InvalidInput, match="has no torch equivalent"):
                with c.infer("t", {"x": bad}):
                    pass
        x = np.arange(4, dtype=np.float32)
        with c.infer("t", {"x": x}) as r:
            np.testing.assert_array_equal(r["y"], x + 1)
    assert w.p.poll() is None
    ws = cluster.worker("faulty_model:torchstream", "--service", "ts")  # and a streaming one
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "ts")
        with pytest.raises(InvalidInput, match="has no torch equivalent"):
            with c.infer_stream("ts", {"x": np.array(["ab"])}) as h:
                list(h)
        with c.infer_stream("ts", {"x": x}) as h:
            assert len([r.release() for r in h]) == 3  # two partials, and the FINAL
    assert ws.p.poll() is None


def test_a_pinned_stream_of_large_partials_goes_at_the_pace_its_client_reads(cluster):
    # Found by the data hunt: five 20 MB inline partials yielded at once went past the local
    # link's 64 MiB cap before the (reading) client could take them; the link took the
    # client for one that stopped reading and the stream failed (WorkerFailed).  Now the
    # stream waits for its client at the cap.
    cluster.broker()
    w = cluster.worker("faulty_model:streaming", "--service", "s", "--direct")
    x = np.zeros(4, np.float32)
    with Client(cluster.frontend, timeout=30, pin=True) as c:
        wait_service(c, "s")
        with c.infer_stream("s", {"x": x}) as h:  # pinned by now
            assert len([r.release() for r in h]) == 5
        for _ in range(2):
            got = []
            with c.infer_stream("s", {"x": x}, meta={"do": "big"}, reply="inline") as h:
                for r in h:
                    with r:
                        if "y" in r:
                            assert r["y"].shape == (5_000_000,) and (r["y"] == len(got)).all()
                            got.append(1)
            assert len(got) == 5
        assert c.pinned("s")
    assert "stopped reading" not in w.stderr()
    assert w.p.poll() is None


def test_a_stream_whose_worker_dies_is_not_run_again(cluster):
    # The broker retried it on another worker: the caller saw partials [0, 1, 0, 1], then an
    # error (docs/client.md: a call that streamed is not replayed).
    cluster.broker()
    for _ in range(2):
        cluster.worker("faulty_model:streaming", "--service", "s")
    x = np.arange(4, dtype=np.float32)
    got = []
    with Client(cluster.frontend, timeout=20) as c:
        with pytest.raises(WorkerFailed, match="not run again"):
            with c.infer_stream("s", {"x": x}, meta={"do": "die"}) as h:
                for r in h:
                    with r:
                        if "y" in r:
                            got.append(float(r["y"][0]))
        assert got == [0.0, 1.0]
        with c.infer_stream("s", {"x": x}) as h:  # the other worker serves on
            assert len([1 for r in h if "y" in r]) == 4


def test_a_request_that_kills_its_worker_takes_no_other_request_with_it(cluster):
    # A request that crashes the worker process (native code, an abort) dies with every
    # request its worker held.  They were retried together and batched together again, so
    # the others died with it again and failed with it (max_retries 1 here: the default 2
    # takes one more round).  A last attempt runs alone on a worker holding nothing else: only
    # the killer fails, and it takes one worker per attempt.  The broker says which request
    # it was at its default level (the counts hunt: only the deaths were WARNINGs, and the
    # failed request's rid was in an INFO line alone).
    broker = cluster.broker("--max-retries", "1")
    workers = [cluster.worker("faulty_model:batched", "--service", "batched", "--max-batch", "8",
                              "--max-delay-ms", "20") for _ in range(3)]
    slow = {"slow": 1}  # batches of 0.15 s: the requests pile up at the workers

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=60) as good_c, \
                AsyncClient(cluster.frontend, timeout=60) as bad_c:
            async def good(i):
                x = np.full(4, float(i), np.float32)
                with await good_c.infer("batched", {"x": x}, meta=slow) as r:
                    np.testing.assert_array_equal(r["y"], x + 1)
                return i

            async def killer():
                with pytest.raises(WorkerFailed) as e:
                    await bad_c.infer("batched", {"x": np.zeros(4, np.float32)}, meta={"do": "crash", **slow})
                return e.value

            calls = [asyncio.ensure_future(good(i)) for i in range(12)]
            k = asyncio.ensure_future(killer())
            calls += [asyncio.ensure_future(good(i)) for i in range(12, 36)]
            return await asyncio.gather(*calls), await k

    served, err = asyncio.run(scenario())
    assert sorted(served) == list(range(36))
    assert "alone" in str(err), err
    rid = f"rid={os.getpid()}:{err.request_id}"
    broker.wait_log(rid)
    lines = [ln for ln in broker._err.decode().splitlines() if rid in ln]
    assert len(lines) == 1 and " WARNING request failed: " in lines[0] and "code=502" in lines[0], lines
    dead = [w for w in workers if w.p.poll() is not None]
    assert len(dead) == 2 and all(w.p.returncode == 70 for w in dead)
    with Client(cluster.frontend, timeout=20) as c:  # the survivor serves on
        with c.infer("batched", {"x": np.ones(4, np.float32)}) as r:
            assert r["y"][0] == 2.0


def test_a_model_that_crashes_in_native_code_leaves_its_stack_on_stderr(cluster):
    # A segmentation fault in a model's extension ended the worker without a word: nothing
    # said where.  The worker's stderr now holds every thread's Python stack at the fault.
    cluster.broker("--max-retries", "0")
    w = cluster.worker("faulty_model:batched", "--service", "batched")
    with Client(cluster.frontend, timeout=30) as c:
        with pytest.raises(WorkerFailed):
            c.infer("batched", {"x": np.zeros(4, np.float32)}, meta={"do": "segv"})
    assert w.p.wait(30) != 0
    err = w.stderr(tail=None)  # the whole of it: the stack runs past any tail on a long path
    assert "Fatal Python error: Segmentation fault" in err and "faulty_model.py" in err, err[-3000:]


def test_a_service_whose_last_worker_crashed_says_it_crashed(cluster):
    # After its only worker crashed, the service's requests failed ServiceUnavailable saying
    # the worker went "presumed dead after silence, or stopped" (the models audit): the
    # broker saw its connection close without a DISCONNECT, and says so.
    from client_sdk.errors import ServiceUnavailable

    cluster.broker("--max-retries", "0", "--service-grace", "0.3")
    w = cluster.worker("faulty_model:batched", "--service", "batched")
    with Client(cluster.frontend, timeout=30) as c:
        with pytest.raises(WorkerFailed):
            c.infer("batched", {"x": np.zeros(4, np.float32)}, meta={"do": "crash"})
        assert w.p.wait(30) == 70
        with pytest.raises(ServiceUnavailable) as e:
            c.infer("batched", {"x": np.zeros(4, np.float32)})
    words = str(e.value)
    assert "its last one went" in words and "it crashed or was killed" in words, words
    assert "silence" not in words, words


@pytest.mark.parametrize("do", ["exit", "raise", "return"])
def test_a_child_the_model_forked_ends_where_it_leaves_the_model(cluster, do):
    # Found by the fork hunt: a model forking a helper whose child ended with sys.exit() (or
    # raised, or returned) left that child in the worker's own code, over the parent's
    # sockets: it spun at full CPU, the parent waited for it for good (the request timed
    # out), and it ignored SIGTERM and outlived the worker.  Now the child exits there, as
    # Python would end it (the leak fixture checks that none is left).
    cluster.broker()
    w = cluster.worker("faulty_model:forking", "--service", "forking")
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "forking")
        for i in range(3):
            x = np.full(4, float(i), np.float32)
            with c.infer("forking", {"x": x}, meta={"do": do}) as r:
                np.testing.assert_array_equal(r["y"], x + 1)
                want = 0 if do in ("exit", "return") else 1
                assert os.waitstatus_to_exitcode(int(r["status"])) == want
    assert w.p.poll() is None
    assert w.terminate() == 0, w.stderr()
    if do == "raise":
        assert "forking: the child raised" in w.stderr(None)  # the child's traceback, as Python prints it


# ---- model-author mistakes that the docs' audit found silent or fatal


@pytest.mark.parametrize("model", ["inputwriter", "torchwriter"])
def test_a_model_that_writes_to_its_input_is_refused_at_its_warm_up(tmp_path, model):
    """docs/models.md: never write to an input.  A torch model that did (x.add_(1)) crashed
    the worker with SIGSEGV on the first request whose input came in shared memory (mapped
    read-only), and every worker the broker retried it on; now its warm-up says so, one
    line, exit 2, before it registers."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "gpu_worker", "--model", f"faulty_model:{model}", "--device", "cpu",
                        "--broker", f"ipc://{tmp_path}/nobody.ipc", "--out-capacity-mb", "1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "wrote to its input 'x'" in lines[0] and "copy it first" in lines[0], lines[0]
    assert "--no-warmup" not in lines[0]  # (it would only move the crash to serving)


def test_a_cost_that_fails_counts_as_the_whole_bound(cluster):
    """docs/models.md: a batch holds at most --max-cost.  A cost() that raised (or said NaN)
    was taken as 1.0, silently: batches of 8 under a bound of 8 at a cost of 4 each.  Now such
    a request counts as --max-cost (it runs alone), and the worker says why."""
    cluster.broker()
    w = cluster.worker("faulty_model:badcost", "--max-batch", "8", "--max-cost", "8", "--max-delay-ms", "50")

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=30) as c:
            while not await c.mmi_service("badcost"):
                await asyncio.sleep(0.01)
            xs = [np.full(4, i, np.float32) for i in range(8)]
            results = await asyncio.gather(*(c.infer("badcost", {"x": x}) for x in xs))
            sizes = [r.timing["batch"] for r in results]
            for x, r in zip(xs, results):
                np.testing.assert_array_equal(r["y"], x + 1)
                r.release()
            return sizes

    # A request that comes alone takes the lone-request lane, where no cost() is asked (a
    # loaded machine sent all eight so once, and the line never came): rounds until one
    # batch was planned, each of batches of 1.
    said = "cost() failed (RuntimeError: cost() broke)"
    for _ in range(20):
        assert asyncio.run(scenario()) == [1] * 8
        if said in w.pull():
            break
    w.wait_log(said)


def test_keep_warm_with_example_inputs_that_raise_is_off_not_a_crash(cluster):
    """docs/models.md: a model without example inputs is not kept warm.  One whose
    example_inputs() raised (a file it reads missing), started with --no-warmup and
    keep-warm on, exited with a traceback; now keep-warm is off, and says why."""
    cluster.broker()
    w = cluster.worker("faulty_model:brokenexamples", "--no-warmup", "--keep-warm-ms", "10")
    w.wait_log("keep-warm off for brokenexamples: its example_inputs() raised FileNotFoundError")
    with Client(cluster.frontend, timeout=30) as c:
        wait_service(c, "brokenexamples")
        with c.infer("brokenexamples", {"x": np.zeros(4, np.float32)}) as r:
            np.testing.assert_array_equal(r["y"], np.ones(4, np.float32))


def test_a_model_that_fails_on_batches_only_is_served_and_said(cluster):
    """Run again in halves down to ones, every request of a batch that raised was served,
    and nothing said that the model fails on every batch (its compute paid over again)."""
    cluster.broker()
    # (its warm-up, at max-batch 8, refuses it: --no-warmup, as a model whose examples pass would)
    w = cluster.worker("faulty_model:batchfault", "--max-batch", "8", "--max-delay-ms", "50", "--no-warmup")

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=30) as c:
            while not await c.mmi_service("batchfault"):
                await asyncio.sleep(0.01)
            xs = [np.full(4, i, np.float32) for i in range(8)]
            for x, r in zip(xs, await asyncio.gather(*(c.infer("batchfault", {"x": x}) for x in xs))):
                np.testing.assert_array_equal(r["y"], x + 1)
                r.release()

    asyncio.run(scenario())
    w.wait_log("served each of its requests when run again in smaller batches: it fails on batches")


def test_example_inputs_that_do_not_fit_the_declared_inputs_are_said(cluster, tmp_path):
    """The worker's warm-up (and keep-warm, 105 runs a second when idle) ran the model on
    example inputs its own service answers 422; now the warm-up refuses them (one line,
    exit 2), and keep-warm is off with a WARNING naming the misfit."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "gpu_worker", "--model", "faulty_model:misfit", "--device", "cpu",
                        "--broker", f"ipc://{tmp_path}/nobody.ipc", "--out-capacity-mb", "1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "do not fit its declared inputs: input 'x' has shape [5], expected [3]" in p.stderr, p.stderr
    cluster.broker()
    w = cluster.worker("faulty_model:misfit", "--no-warmup", "--keep-warm-ms", "10")
    w.wait_log("keep-warm off for misfit: its example_inputs() do not fit its declared inputs (input 'x' has shape")


def _rounds_until(cluster, w, service: str, said: str, meta: dict | None = None) -> None:
    """Rounds of 8 requests at once until the worker logs ``said``: a request that comes
    alone takes the lone-request lane, and a batch of one is not one that failed whole."""

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=30) as c:
            while not await c.mmi_service(service):
                await asyncio.sleep(0.01)
            xs = [np.full(4, i, np.float32) for i in range(8)]
            got = await asyncio.gather(*(c.infer(service, {"x": x}, meta=meta) for x in xs), return_exceptions=True)
            for x, r in zip(xs, got):
                if meta is None:  # served, each request run again alone
                    np.testing.assert_array_equal(r["y"], x + 1)
                    r.release()
                else:  # refused, each: the model's mistake
                    assert isinstance(r, InternalError) and "no reply can carry" in str(r), r

    for _ in range(20):
        asyncio.run(scenario())
        if said in w.pull():
            break
    w.wait_log(said)


def test_a_batch_whose_outputs_are_refused_is_said_so_not_said_to_have_raised(cluster):
    """A batch whose outputs no reply can carry (an object array) is run again in halves,
    as one that raised; the worker said the model "raised on a batch", which it never did
    (and, for a batch every request of which was refused, logged the error's repr as a
    failure).  Now the lines say the outputs were refused, and why."""
    cluster.broker()
    w = cluster.worker("faulty_model:batchobjects", "--max-batch", "8", "--max-delay-ms", "50", "--no-warmup")
    _rounds_until(cluster, w, "batchobjects", "model 'batchobjects' returned outputs no reply can carry on a batch of")
    w.wait_log("(output 'y' has dtype '|O', which cannot be sent) and served each of its requests when run again")
    assert "raised on a batch" not in w.pull()

    other = cluster.worker("faulty_model:batched", "--service", "batched", "--max-batch", "8", "--max-delay-ms", "50")
    _rounds_until(cluster, other, "batched", "model batched returned outputs no reply can carry on a batch of",
                  meta={"do": "objects"})
    other.wait_log("which cannot be sent service=batched rids=")
    assert "failed on a batch" not in other.pull()
