"""OpenTelemetry spans for the requests a worker runs: optional, and free when off.

On only when both hold: the environment configures traces with the standard variables
(``OTEL_TRACES_EXPORTER`` naming an exporter other than ``none``, or
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, which mean
``otlp``; ``OTEL_SDK_DISABLED=true`` turns it off) and `opentelemetry-sdk` is importable
(``pip install 'zmq-infer[otel]'``; the ``otlp`` exporter also needs
``opentelemetry-exporter-otlp``).  Otherwise `from_env` returns None without importing
anything of OpenTelemetry, and the worker's request path pays one ``is None`` per batch.

What is recorded: for each request of a batch that carries a W3C ``traceparent`` (the client
passes it, `Client.infer(..., traceparent=...)`; the broker forwards it untouched), four spans,
children of the client's span, named ``queue`` (the broker's queue wait, ``queue_ms``, ending
when the worker read the request), ``input`` (mapping its inputs), ``compute`` (its batch) and
``output`` (writing its outputs).  They are built after the reply was sent, from the times the
worker measures anyway (no clock is read for them on the request path); the client's sampled
flag decides (``-01``: recorded; ``-00``: not, with the SDK's default parent-based sampler).
Requests without a traceparent get no spans.  Exporters and the sampler are the SDK's, from the
environment (``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ...); an application
that set its own SDK tracer provider before starting a `Worker` has its provider used instead.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

from broker import protocol as P
from broker.protocol.logs import request_id

__all__ = ["Tracing", "exporters_configured", "from_env"]

log = logging.getLogger("gpu_worker.tracing")

#: span names, in the order a request goes through them
SPANS = ("queue", "input", "compute", "output")
DEFAULT_SERVICE_NAME = "zmq-infer-worker"
_ENTRY_POINTS = "opentelemetry_traces_exporter"


def exporters_configured(env: Mapping[str, str] = os.environ) -> list[str]:
    """The trace exporters the standard OTEL_* variables ask for ([] when none)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            return ["otlp"]
        return []
    return [n for n in (x.strip() for x in names.split(",")) if n and n != "none"]


def from_env(service: str, env: Mapping[str, str] = os.environ) -> "Tracing | None":
    """The worker's tracing, configured from the environment; None when it is not asked for
    (then nothing of OpenTelemetry is imported) or cannot be had (a warning says why)."""
    names = exporters_configured(env)
    if not names:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:
        log.warning("OTEL_* variables ask for trace exporters %s, but opentelemetry-sdk is not installed "
                    "(pip install 'zmq-infer[otel]'); no spans", ",".join(names))
        return None
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # the application configured its own: use it
        return Tracing(current.get_tracer("gpu_worker"), service)
    provider = _provider(names, env)
    if provider is None:
        return None
    trace.set_tracer_provider(provider)  # model code's own spans join the same pipeline
    log.info("tracing on: exporters %s", ",".join(names))
    return Tracing(provider.get_tracer("gpu_worker"), service)


def _provider(names: list[str], env: Mapping[str, str]):
    from importlib.metadata import entry_points

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    processors = []
    for name in names:
        found = list(entry_points(group=_ENTRY_POINTS, name=name))
        if not found:
            log.warning("no OpenTelemetry trace exporter named %r is installed (OTEL_TRACES_EXPORTER)%s", name,
                        "; pip install opentelemetry-exporter-otlp" if name.startswith("otlp") else "")
            continue
        try:
            processors.append(BatchSpanProcessor(found[0].load()()))
        except Exception as e:
            log.warning("cannot start the OpenTelemetry trace exporter %r: %s: %s", name, type(e).__name__, e)
    if not processors:
        return None
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER
    for p in processors:
        provider.add_span_processor(p)
    return provider


class Tracing:
    """Spans for one worker's requests, recorded after the fact (see the module docstring).

    Per batch the worker calls `batch(started, compute_ms, n)`, ``started`` the monotonic time
    its batch started, after the inputs of its requests were mapped (the compute span begins
    there), then `request(job, timing)` for each of its requests in reply order (also those
    without a traceparent: the output spans follow one another, from the compute span's end)."""

    def __init__(self, tracer: Any, service: str):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.service = service
        self._extract = TraceContextTextMapPropagator().extract
        self._bad = P.RateLimitedLog(log)
        self._offset_ns = 0      # wall clock - monotonic clock, in ns
        self._offset_at = -1e18  # when (monotonic s) it was last read
        self._compute = (0, 0)   # this batch's compute span, ns
        self._cursor = 0         # where the next request's output span starts, ns
        self._batch = 0

    def _ns(self, t: float) -> int:
        """A monotonic time (s) as a wall-clock time in ns (what spans carry)."""
        return int(t * 1e9) + self._offset_ns

    def batch(self, started: float, compute_ms: float, n: int) -> None:
        if started - self._offset_at > 1.0:  # the clocks are compared at most once a second
            self._offset_ns = time.time_ns() - time.monotonic_ns()
            self._offset_at = started
        t0 = self._ns(started)
        t1 = t0 + int(compute_ms * 1e6)
        self._compute = (t0, t1)
        self._cursor = t1
        self._batch = n

    def request(self, job: Any, timing: Mapping[str, float]) -> None:
        out0 = self._cursor
        out1 = out0 + int(timing.get("output_ms", 0.0) * 1e6)
        self._cursor = out1
        req = job.req
        if req is None or req.traceparent is None:
            return
        try:
            parent = self._extract({"traceparent": req.traceparent})
            recv = self._ns(job.received)
            attrs = {"zmq_infer.rid": request_id(req), "zmq_infer.service": self.service,
                     "zmq_infer.batch_size": self._batch}
            spans = (
                ("queue", recv - int(timing.get("queue_ms", 0.0) * 1e6), recv),
                ("input", recv, recv + int(job.input_ms * 1e6)),
                ("compute", *self._compute),
                ("output", out0, out1),
            )
            start = self.tracer.start_span
            for name, t0, t1 in spans:
                start(name, context=parent, start_time=t0, attributes=attrs).end(end_time=max(t0, t1))
        except Exception:
            self._bad.exception("could not record the spans of request %s", request_id(req))
