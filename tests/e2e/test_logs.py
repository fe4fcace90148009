"""Logs and traces of the real processes (docs/operations.md, "Logs and traces").

A broker and an echo worker run at each level and format; a few requests go through, one of
them with a W3C traceparent; then both are stopped (they drain and exit, so every line is
written) and their whole stderr is read:

- WARNING (the default): no line about any request;
- INFO: one line per request at the worker (`request done`, with its timings) and at the
  broker (`request dispatched`, with its queue wait), each naming the request's rid, and the
  traced request's trace id;
- DEBUG: also the tensors (name, dtype, shape, shared-memory segment, offset, size);
- `--log-format json`: every line is a JSON object with ts, level, process, pid, logger, msg;
- a model that raises (tests/e2e/raising_model.py), at the default level: one ERROR line
  naming the service and the failed batch's rids, and nothing else about the requests;
- with opentelemetry-sdk and `OTEL_TRACES_EXPORTER=console`, the worker's spans for the
  traced request carry the client's trace id, as children of the client's span.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from client_sdk import Client, InternalError
from tests.children import read_rest_within

from .conftest import wait_service

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"
N = 4  # requests per run; the first carries TRACEPARENT
TIMINGS = ("queue_ms", "batch_wait_ms", "input_ms", "compute_ms", "output_ms")


def _run(cluster, level: str, fmt: str = "text", *, env: dict | None = None, traceparent2: str | None = None):
    """Start a broker and a worker at `level`/`fmt`, send N echo requests through shared
    memory, stop both; their stderr (all of it) and the worker's stdout after READY."""
    opts = ("--log-level", level, "--log-format", fmt)
    broker = cluster.broker(*opts)
    worker = cluster.worker("echo", *opts, env=env)
    with Client(cluster.frontend, timeout=10, transport="shm") as c:  # 16 B by reference: the DEBUG lines name the segment
        wait_service(c, "echo")
        x = c.alloc((16,), np.uint8)
        for i in range(N):
            x[:] = i
            tp = TRACEPARENT if i == 0 else (traceparent2 if i == 1 else None)
            with c.infer("echo", {"x": x}, traceparent=tp) as out:
                assert int(out["x"][0]) == i
    assert worker.terminate() == 0
    worker_out = read_rest_within(worker.p.stdout, 10, "the end of the stopped worker's stdout").decode()
    worker_err = _stderr(worker)
    assert broker.terminate() == 0
    return _stderr(broker), worker_err, worker_out


def _stderr(proc) -> str:
    """All of a stopped process's stderr (what wait_log read, then the rest)."""
    return (proc._err + read_rest_within(proc.p.stderr, 10, "the end of a stopped process's stderr")).decode(
        errors="replace")


def _lines(text: str, what: str) -> list[str]:
    return [line for line in text.splitlines() if what in line]


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r" (\w+)=(\S+)", line))


def test_warning_logs_no_request_line(cluster):
    broker_err, worker_err, _ = _run(cluster, "WARNING")
    for text in (broker_err, worker_err):
        for what in ("request done", "request dispatched", "request failed", "rid="):
            assert what not in text, text


def test_info_is_one_line_per_request_with_its_timings_and_rid(cluster):
    broker_err, worker_err, _ = _run(cluster, "info")  # any case
    done = _lines(worker_err, " worker INFO request done ")
    assert len(done) == N, worker_err
    rids = []
    for line in done:
        f = _fields(line)
        assert f["service"] == "echo" and f["batch"] == "1", line
        for t in TIMINGS:
            assert float(f[t]) >= 0, (t, line)
        assert re.fullmatch(rf"{os.getpid()}:\d+", f["rid"]), line  # the client's pid: its request id
        rids.append(f["rid"])
    assert len(set(rids)) == N
    # The traced request, and only it, names its trace id.
    traced = [line for line in done if f"trace_id={TRACE_ID}" in line]
    assert len(traced) == 1 and traced[0] == done[0], done
    assert "request tensors" not in worker_err  # DEBUG only
    # The broker: one line per request at dispatch, the same rids.
    sent = _lines(broker_err, " broker INFO request dispatched ")
    assert sorted(_fields(line)["rid"] for line in sent) == sorted(rids), broker_err
    assert f"trace_id={TRACE_ID}" in sent[0] and all("trace_id" not in line for line in sent[1:]), sent
    for line in sent:
        f = _fields(line)
        assert float(f["queue_ms"]) >= 0 and f["attempt"] == "0" and int(f["worker_pid"]) > 0, line
    assert "request received" not in broker_err  # DEBUG only


def test_debug_adds_tensor_shapes_dtypes_and_shared_memory(cluster):
    # The second request's traceparent is malformed (upper-case hex): ignored, not an error.
    broker_err, worker_err, _ = _run(cluster, "DEBUG", traceparent2=TRACEPARENT.upper())
    tensors = _lines(worker_err, " worker DEBUG request tensors ")
    assert len(tensors) == N, worker_err
    for line in tensors:
        f = _fields(line)
        (inp,), (outp,) = json.loads(f["inputs"]), json.loads(f["outputs"])
        for t in (inp, outp):
            assert (t["name"], t["dtype"], t["shape"], t["loc"], t["nbytes"]) == ("x", "|u1", [16], "shm", 16), line
            assert t["segment"].startswith("zinf-") and t["offset"] >= 0, line
    assert len(_lines(worker_err, " worker INFO request done ")) == N  # INFO lines stay as they are
    received = _lines(broker_err, " broker DEBUG request received ")
    assert len(received) == N, broker_err
    assert json.loads(_fields(received[0])["inputs"])[0]["segment"].startswith("zinf-")
    assert "ignored a malformed traceparent" in broker_err, broker_err
    # the good one's three lines (read, done, tensors: each names its request); the bad one has none
    assert worker_err.count("trace_id=") == 3


def test_json_lines_all_parse_with_their_fields(cluster):
    broker_err, worker_err, _ = _run(cluster, "DEBUG", "json")
    for process, text in (("broker", broker_err), ("worker", worker_err)):
        records = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON
        assert records, process
        for r in records:
            assert {"ts", "level", "process", "pid", "logger", "msg"} <= set(r), r
            assert r["process"] == process and isinstance(r["pid"], int), r
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", r["ts"]), r
        about = [r for r in records if r["msg"].startswith("request")]
        assert about and all(r["rid"].startswith(f"{os.getpid()}:") for r in about), about
        traced = [r for r in about if r.get("trace_id") == TRACE_ID]
        assert len(traced) == 2, about  # INFO and DEBUG lines of the traced request
    done = [json.loads(line) for line in worker_err.splitlines() if '"request done"' in line]
    assert len(done) == N
    for r in done:
        assert r["level"] == "INFO" and r["batch"] == 1 and r["service"] == "echo"
        assert all(isinstance(r[t], float) for t in TIMINGS), r
    shm = [json.loads(line)["inputs"][0] for line in worker_err.splitlines() if '"request tensors"' in line]
    assert len(shm) == N and all(t["loc"] == "shm" and t["segment"].startswith("zinf-") for t in shm)


def _console_spans(text: str) -> list[dict]:
    """The span objects the SDK's console exporter printed (indented JSON, one after another)."""
    dec, spans, i = json.JSONDecoder(), [], 0
    while True:
        j = text.find("{", i)
        if j < 0:
            return spans
        obj, i = dec.raw_decode(text, j)
        spans.append(obj)


def test_a_client_traceparent_reaches_the_workers_log_and_spans(cluster):
    pytest.importorskip("opentelemetry.sdk.trace", reason="needs opentelemetry-sdk (the dev extra)")
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "test-echo"}
    _, worker_err, worker_out = _run(cluster, "INFO", env=env)
    assert len(_lines(worker_err, f"trace_id={TRACE_ID}")) == 1, worker_err
    spans = _console_spans(worker_out)  # exported when the worker exits, at the latest
    assert sorted(s["name"] for s in spans) == ["compute", "input", "output", "queue"], worker_out
    by_name = {s["name"]: s for s in spans}
    for s in spans:  # only the traced request has spans, all children of the client's span
        assert s["context"]["trace_id"] == "0x" + TRACE_ID, s
        assert s["parent_id"] == "0x" + SPAN_ID, s
        assert s["resource"]["attributes"]["service.name"] == "test-echo"
        assert s["attributes"]["zmq_infer.rid"].startswith(f"{os.getpid()}:")
        assert s["start_time"] <= s["end_time"], s
    order = [by_name[n] for n in ("queue", "input", "compute", "output")]
    for a, b in zip(order, order[1:]):  # one after another (ISO times of one format compare as text)
        assert a["start_time"] <= b["start_time"], (a, b)


def _run_failing(cluster, fmt: str):
    """A broker and a worker of raising_model at the default level (WARNING) in `fmt`: one
    request that passes, one the model raises on; both stopped.  Their stderr, and the failed
    request's rid (the client's pid: its request id)."""
    broker = cluster.broker("--log-format", fmt)
    worker = cluster.worker("raising_model:factory", "--service", "raising", "--log-format", fmt)
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "raising")
        with c.infer("raising", {"x": np.zeros(4, np.float32)}) as out:
            assert not out["x"].any()
        with pytest.raises(InternalError, match="told to fail") as e:
            c.infer("raising", {"x": np.ones(4, np.float32)})
    assert e.value.request_id is not None
    assert worker.terminate() == 0
    worker_err = _stderr(worker)
    assert broker.terminate() == 0
    return _stderr(broker), worker_err, f"{os.getpid()}:{e.value.request_id}"


def test_a_failing_model_is_one_error_line_with_the_batchs_rids(cluster):
    broker_err, worker_err, rid = _run_failing(cluster, "text")
    failed = _lines(worker_err, " worker ERROR model raising failed on a batch of 1")
    assert len(failed) == 1, worker_err
    f = _fields(failed[0])
    assert f["service"] == "raising" and json.loads(f["rids"]) == [rid], failed[0]
    assert "told to fail" in failed[0]
    assert len(_lines(worker_err, "failed on a batch")) == 1, worker_err
    for text in (broker_err, worker_err):  # WARNING: no INFO line about any request
        assert " INFO " not in text and " DEBUG " not in text, text
        for what in ("request done", "request dispatched", "request failed", "rid="):
            assert what not in text, text


def test_a_failing_models_error_line_in_json_has_its_rids(cluster):
    broker_err, worker_err, rid = _run_failing(cluster, "json")
    records = [json.loads(line) for line in worker_err.splitlines() if line.strip()]  # every line is JSON
    failed = [r for r in records if "failed on a batch" in r["msg"]]
    assert len(failed) == 1, records
    (r,) = failed
    assert r["level"] == "ERROR" and r["process"] == "worker" and r["service"] == "raising", r
    assert r["msg"].startswith("model raising failed on a batch of 1: ") and r["rids"] == [rid], r
    for text in (broker_err, worker_err):
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert not [x for x in recs if x["level"] in ("INFO", "DEBUG") or x["msg"].startswith("request")], recs


def test_a_worker_death_and_a_service_left_without_workers_are_warnings(cluster, tmp_path):
    """At the default level (WARNING), a standalone broker said nothing when a worker died
    holding requests, nor when a service lost its last worker: only INFO lines did (the
    observability hunt).  Both are WARNINGs now, naming the pid, the service and what the
    death costs; the first worker's death (another remains) is not the service's last."""
    import signal

    broker = cluster.broker()  # the default level
    held = {"SLEEPY_LOG": str(tmp_path / "runs.log")}
    one = cluster.worker("gate_model:sleepy", "--max-batch", "1", env=held)
    two = cluster.worker("gate_model:sleepy", "--max-batch", "1", env=held)
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "sleepy")
        c.infer("sleepy", {"x": np.zeros(1)}).release()
    one.p.send_signal(signal.SIGKILL)
    one.p.wait(10)
    broker.wait_log(f"worker pid {one.p.pid} closed its connection without a DISCONNECT; presumed dead; "
                    "service 'sleepy', ")
    two.p.send_signal(signal.SIGKILL)
    two.p.wait(10)
    broker.wait_log("(retried on another worker, or failed); it was the service's last live worker: its requests "
                    "wait 1 s (--service-grace) for another, then fail SERVICE_UNAVAILABLE")
    assert broker.terminate() == 0
    text = _stderr(broker)
    first = _lines(text, f"worker pid {one.p.pid}")
    assert len(first) == 1 and "WARNING" in first[0] and "last live worker" not in first[0], first
    last = _lines(text, f"worker pid {two.p.pid}")
    assert len(last) == 1 and "WARNING" in last[0] and "last live worker" in last[0], last


def test_clients_that_close_normally_are_no_warning(cluster):
    # The metrics hunt: 20 clients that opened and closed normally left 1-3 WARNINGs "could
    # not send to client b'...': Host unreachable" (the answer to a client's last heartbeat,
    # sent after it had closed), naming a raw routing id.  A client that left is nothing wrong.
    b = cluster.broker()
    cluster.worker("echo")
    for i in range(40):
        with Client(cluster.frontend, timeout=10) as c:
            if i % 4 == 0:
                c.infer("echo", {"x": np.zeros(4, np.float32)}).release()
            # else closed at once: its first heartbeat's answer on its way as it goes
    b.terminate()
    assert "could not send to client" not in b.stderr(None)


def test_a_peers_words_cannot_forge_a_line(cluster):
    """A service name (or any text a peer chose) with a newline in it is written escaped in
    the broker's text lines: it cannot start a line of its own (the fuzz audit: a client's
    service name and header `host` were written raw, a forged line each)."""
    import zmq

    from broker import protocol as P

    b = cluster.broker("--log-level", "INFO", "--service-grace", "0.2")
    name = "ghost\n2026-01-01 00:00:00,000 broker WARNING FORGED-LINE"
    s = zmq.Context.instance().socket(zmq.DEALER)
    try:
        s.connect(cluster.frontend)
        s.send_multipart(P.client_request(name, [P.encode_header(P.Request(id=1))]))
        assert s.poll(10_000), "no answer to the request for a service nobody serves"
        s.recv_multipart()  # (its 503)
    finally:
        s.close(0)
    assert b.terminate() == 0
    err = _stderr(b)
    assert not [line for line in err.splitlines() if line.startswith("2026-01-01 00:00:00,000")], err
    said = [line for line in err.splitlines() if "FORGED-LINE" in line]
    assert said and all("ghost\\n2026-01-01" in line for line in said), err
