"""OpenTelemetry spans of a worker (gpu_worker.tracing): a Worker driven in-process through
its upstream seam (as bench.hotpath does) with an in-memory exporter; and, with no OTEL_*
variable set, nothing of OpenTelemetry is imported at all."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import zmq

from broker import protocol as P
from gpu_worker.tracing import Tracing, exporters_configured
from gpu_worker.upstream import BrokerLink

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"


def test_exporters_come_from_the_standard_variables():
    assert exporters_configured({}) == []
    assert exporters_configured({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporters_configured({"OTEL_TRACES_EXPORTER": "console, otlp"}) == ["console", "otlp"]
    assert exporters_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == ["otlp"]
    assert exporters_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert exporters_configured({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) == []


def test_without_otel_variables_nothing_of_opentelemetry_is_imported(tmp_path):
    code = f"""
import logging, os, sys
import numpy as np, zmq
sys.path.insert(0, {str(os.getcwd())!r})
from broker import protocol as P
from broker.protocol.logs import setup_logging
from gpu_worker.worker import Worker, WorkerConfig
from shm import ShmPool
setup_logging("DEBUG", "json", "worker")  # every request line on: still no OpenTelemetry
w = Worker(WorkerConfig(broker="ipc://{tmp_path}/none", model="echo", max_batch=1))
assert w.tracing is None
w.upstream.send = lambda frames: None
pool = ShmPool(1 << 20)
x = pool.alloc((4,), np.uint8); ref = pool.ref_of(x); pool.mark_in_flight(ref)
hdr = P.encode_header(P.Request(id=1, host=P.local_host_id(), pid=os.getpid(), traceparent="00-{TRACE_ID}-{SPAN_ID}-01",
      tensors=[P.TensorRef(name="x", dtype="|u1", shape=[4], loc=P.shm_loc(ref._replace(nbytes=4)))]))
F = zmq.Frame
w.on_message([F(P.MDPW), F(P.W_REQUEST), F(b"e"), F(b""), F(hdr)])
w.run_ready_batches()
assert w.served == 1
w.close(); pool.close()
bad = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not bad, bad
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f'"trace_id": "{TRACE_ID}"' in r.stderr  # the request was logged, with its trace id


class _Link(BrokerLink):
    """The broker connection with the socket taken out: what it would send is kept."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.sent = []

    def send(self, frames) -> None:
        self.sent.append(frames)


@pytest.fixture
def traced_worker(tmp_path):
    pytest.importorskip("opentelemetry.sdk.trace", reason="needs opentelemetry-sdk (the dev extra)")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gpu_worker.worker import Worker, WorkerConfig
    from shm import ShmPool

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    endpoint = f"ipc://{tmp_path}/none"
    w = Worker(WorkerConfig(broker=endpoint, model="echo", max_batch=4, max_delay=0.0),
               upstream=_Link(endpoint, zmq.Context.instance()), tracing=Tracing(provider.get_tracer("t"), "echo"))
    pool = ShmPool(1 << 20)
    xs = []

    def request(rid: int, traceparent: str | None) -> None:
        x = pool.alloc((8,), np.float32)
        ref = pool.ref_of(x)
        pool.mark_in_flight(ref)
        xs.append(x)
        hdr = P.encode_header(P.Request(
            id=rid, host=P.local_host_id(), pid=os.getpid(), queue_ms=1.5, traceparent=traceparent,
            tensors=[P.TensorRef(name="x", dtype="<f4", shape=[8], loc=P.shm_loc(ref._replace(nbytes=32)))]))
        w.on_message([zmq.Frame(P.MDPW), zmq.Frame(P.W_REQUEST), zmq.Frame(b"env%d" % rid), zmq.Frame(b""),
                      zmq.Frame(hdr)])

    try:
        yield w, request, exporter
    finally:
        w.close()
        pool.close()
        provider.shutdown()


def test_a_traced_request_gets_queue_input_compute_output_spans_under_the_clients_span(traced_worker):
    w, request, exporter = traced_worker
    request(1, None)                                   # no traceparent: no spans
    request(2, f"00-{TRACE_ID}-{SPAN_ID}-01")          # sampled: four spans
    request(3, f"00-{TRACE_ID[::-1]}-{SPAN_ID}-00")    # not sampled: none recorded
    w.run_ready_batches(force=True)
    assert w.served == 3
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["queue", "input", "compute", "output"]
    for s in spans:
        assert format(s.context.trace_id, "032x") == TRACE_ID
        assert s.parent is not None and s.parent.is_remote and format(s.parent.span_id, "016x") == SPAN_ID
        assert s.attributes["zmq_infer.rid"] == f"{os.getpid()}:2"
        assert s.attributes["zmq_infer.service"] == "echo" and s.attributes["zmq_infer.batch_size"] == 3
        assert s.start_time <= s.end_time
    queue, inp, compute, out = spans
    assert queue.end_time - queue.start_time == 1_500_000  # the broker's queue_ms, 1.5 ms
    assert queue.end_time == inp.start_time                # the worker read it then
    assert inp.end_time <= compute.start_time + 1000       # one batch, after the inputs were mapped
    assert compute.end_time <= out.start_time              # outputs after compute, one request after another


def test_spans_that_cannot_be_recorded_never_fail_the_request(traced_worker):
    w, request, exporter = traced_worker
    w.tracing.tracer = None  # recording raises: logged (throttled), and the reply is a result as ever
    request(7, f"00-{TRACE_ID}-{SPAN_ID}-01")
    w.run_ready_batches(force=True)
    assert w.served == 1 and exporter.get_finished_spans() == ()
    (head,) = [f for f in w.upstream.sent[-1] if P.is_header(f)]
    rep = P.decode_reply(head)
    assert rep.id == 7 and rep.error is None


def test_a_lone_requests_compute_span_starts_after_its_inputs_were_mapped(tmp_path):
    """The lone-request lane (`Worker._admit`) runs a request while it is handled: its batch
    started at the request's receipt, the very instant its input span starts, so compute (and
    output, behind it) overlapped the mapping of its inputs.  Mapping made slow here: the
    spans follow one another, as the work did."""
    pytest.importorskip("opentelemetry.sdk.trace", reason="needs opentelemetry-sdk (the dev extra)")
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gpu_worker.worker import Worker, WorkerConfig
    from tests.gpu_worker.pair_link import PairLink

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    up = PairLink(f"otel-lane-{id(tmp_path)}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", warmup=False, credit=8), upstream=up,
               tracing=Tracing(provider.get_tracer("t"), "echo"))
    try:
        w._connect()
        w.lone_lane = True  # as serve() has it
        map_inputs = w.plane.map_inputs

        def slow_map(job, rest):
            map_inputs(job, rest)
            time.sleep(0.005)

        w.plane.map_inputs = slow_map
        x = np.arange(4, dtype=np.float32)
        head = P.encode_header(P.Request(id=1, reply="inline", backlog=0, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-01",
                                         tensors=[P.TensorRef("x", "<f4", [4], P.InlineLoc(frame=0))]))
        up.to_worker([P.MDPW, P.W_REQUEST, P.token_envelope(1), b"", head, x.tobytes()])
        assert w.sock.poll(5000)
        w.on_message(w.sock.recv_multipart(copy=False))
        assert w.served == 1 and not w.jobs and len(w.batcher) == 0  # it went by the lane
        queue, inp, compute, out = exporter.get_finished_spans()
        assert [s.name for s in (queue, inp, compute, out)] == ["queue", "input", "compute", "output"]
        assert inp.end_time - inp.start_time >= 5_000_000
        assert inp.end_time <= compute.start_time + 1000  # after the mapping (1 us: ms to ns rounding)
        assert compute.end_time <= out.start_time
    finally:
        w.close()
        provider.shutdown()
