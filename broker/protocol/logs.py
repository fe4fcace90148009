"""Log set-up shared by every process (broker, launcher, worker), and the fields that name a
request in a log line.

    setup_logging(level, fmt, process)   one stderr handler on the root logger:
                                         fmt "text" (one human line) or "json" (one JSON object a line)
    add_log_options(ap)                  --log-level and --log-format on an argparse parser
    request_fields(req)                  {"rid": ..., "trace_id": ...} for `extra=` on a line about `req`
    describe_tensors(refs)               names, dtypes, shapes and locations of tensors (DEBUG lines)

Levels (docs/operations.md, "Logs and traces"): WARNING (the default) is errors and warnings
only; INFO adds one line per request with its critical-path timings; DEBUG adds the tensors
of each request (names, shapes, dtypes, shared-memory segment, offset and size).  Code on the
request path logs a request line only behind an `isEnabledFor` check made once per batch (or
per process), so a level that is off costs it nothing.

A line about a request carries ``rid``, ``<pid>:<id>``: the pid the broker attested for the
client's connection (``-`` over tcp) and the client's request id, which the broker and the
worker both know; and ``trace_id`` when the client sent a W3C traceparent.  Everything a line
passes in ``extra=`` becomes a JSON field (and ``key=value`` at the end of a text line).

Stdlib logging only; nothing here touches a socket.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sys
import threading
from typing import Any, Iterable

from .header import CudaLoc, ShmLoc

__all__ = ["LEVELS", "FORMATS", "setup_logging", "add_log_options", "configured_format", "request_fields",
           "request_id", "trace_id", "done_fields", "tensor_fields", "describe_tensors", "TIMINGS",
           "tag_json_line", "TextFormatter", "JsonFormatter"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")

# The attributes every LogRecord has: anything else on a record came in `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_FORMAT = "text"  # what setup_logging configured (the launcher passes it on to its workers)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """``<time> <process> <LEVEL> <message> key=value ...`` (the extras, in the order given;
    lists and maps as compact JSON)."""

    def __init__(self, process: str):
        super().__init__("%(asctime)s " + process.replace("%", "%%") + " %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if not extras:
            return line
        parts = []
        for k, v in extras.items():
            if v is None:
                continue
            if isinstance(v, (list, tuple, dict)):
                v = json.dumps(v, separators=(",", ":"), default=str)
            parts.append(f"{k}={v}")
        if not parts:
            return line
        head, nl, tail = line.partition("\n")  # a traceback stays below the line
        return f"{head} {' '.join(parts)}{nl}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601), level, process, pid, logger, msg, the
    extras (rid, trace_id, timings, ...), and exc (the traceback) when there is one."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "process": self.process,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _extras(record).items():
            if k not in out and v is not None:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        try:
            return json.dumps(out, default=str, allow_nan=False)
        except (ValueError, TypeError):  # a non-finite float, a key that is not a string
            return json.dumps(_plain(out), default=str, allow_nan=False)


def _plain(v: Any) -> Any:
    """``v`` with what strict JSON cannot hold made text: non-finite floats, non-str keys."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def setup_logging(level: str | int = "WARNING", fmt: str = "text", process: str = "",
                  stream: Any = None) -> logging.Handler:
    """Configure the root logger: one handler on `stream` (stderr) writing `fmt` lines
    ("text" or "json") naming `process` (broker, worker, ...), at `level` (a name of LEVELS,
    any case, or a number).  Replaces the root's handlers; returns the new one."""
    global _FORMAT
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} must be one of {', '.join(FORMATS)}")
    if isinstance(level, str):
        name = level.upper()
        if name not in LEVELS:
            raise ValueError(f"log level {level!r} must be one of {', '.join(LEVELS)}")
        level = getattr(logging, name)
    process = process or os.path.basename(sys.argv[0] or "python")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else TextFormatter(process))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    _FORMAT = fmt
    # Warnings and uncaught thread exceptions through the same handler: in json mode every
    # line on stderr is then one JSON object.
    logging.captureWarnings(True)
    threading.excepthook = _thread_excepthook
    return handler


def _thread_excepthook(args) -> None:
    if args.exc_type is SystemExit:
        return
    logging.getLogger("threads").error("uncaught exception in thread %s", getattr(args.thread, "name", "?"),
                                       exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def configured_format() -> str:
    """The format the last `setup_logging` chose ("text" before any)."""
    return _FORMAT


def _level(text: str) -> str:
    name = text.upper()
    if name not in LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LEVELS)}, not {text!r}")
    return name


def add_log_options(ap: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, as every process takes them."""
    ap.add_argument("--log-level", type=_level, default="WARNING", metavar="LEVEL",
                    help="WARNING (default): errors and warnings only; INFO: also one line per request with "
                         "its timings; DEBUG: also each request's tensors (shapes, dtypes, shared-memory "
                         "locations)")
    ap.add_argument("--log-format", choices=FORMATS, default="text",
                    help="text (default) or json: one JSON object a line (ts, level, process, pid, logger, "
                         "msg, rid, trace_id, ...)")


def tag_json_line(text: str, **tags: Any) -> str:
    """A child's stderr line as one JSON line with `tags` first (the launcher's copy of its
    workers' lines, `--log-format json`): a JSON object line gets the tags added; any other
    line (a traceback, a library's print) is wrapped as the `msg` of a WARNING line."""
    if len(text) > 2 and text[0] == "{" and text[-1] == "}":
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return json.dumps({**tags, **obj}, default=str)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    return json.dumps({"ts": now, "level": "WARNING", "process": "worker", **tags, "logger": "stderr",
                       "msg": text}, default=str)


# ------------------------------------------------------------------------------ requests

def request_id(req: Any) -> str:
    """``<pid>:<id>``: the client's attested pid (``-`` when unknown: tcp) and request id."""
    pid = req.pid
    return f"{'-' if pid is None else pid}:{req.id}"


def trace_id(req: Any) -> str | None:
    """The trace id (32 hex) of the request's traceparent, None without one."""
    tp = req.traceparent
    return None if tp is None else tp[3:35]


def request_fields(req: Any) -> dict[str, Any]:
    """What a log line about `req` (a P.Request) carries in `extra=`: rid, and trace_id
    when the client sent a traceparent."""
    fields = {"rid": request_id(req)}
    tp = req.traceparent
    if tp is not None:
        fields["trace_id"] = tp[3:35]
    return fields


#: the timings a worker reports (docs/protocol.md section 5, Reply), in the order a line shows them
TIMINGS = ("batch", "queue_ms", "batch_wait_ms", "input_ms", "compute_ms", "output_ms", "returned")


def done_fields(req: Any, service: str, timing: dict[str, float]) -> dict[str, Any]:
    """`extra=` of the INFO line for a finished request: rid, trace_id, service, timings."""
    fields = request_fields(req)
    fields["service"] = service
    for k in TIMINGS:
        v = timing.get(k)
        if v is not None:
            fields[k] = int(v) if k in ("batch", "returned") else round(v, 3)
    return fields


def tensor_fields(req: Any, outputs: Iterable[Any] | None = None) -> dict[str, Any]:
    """`extra=` of the DEBUG line with a request's tensors: its inputs and, when given, outputs."""
    fields = request_fields(req)
    fields["inputs"] = describe_tensors(req.tensors)
    if outputs is not None:
        fields["outputs"] = describe_tensors(outputs)
    return fields


def describe_tensors(refs: Iterable[Any]) -> list[dict[str, Any]]:
    """Name, dtype, shape and location of each TensorRef: inline frame, shared-memory
    segment/offset/nbytes, or CUDA pool/offset/nbytes/device."""
    out = []
    for t in refs:
        loc = t.loc
        d: dict[str, Any] = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
        kind = type(loc)
        if kind is ShmLoc:
            d.update(loc="shm", segment=loc.segment, offset=loc.offset, nbytes=loc.nbytes, slot=loc.slot)
        elif kind is CudaLoc:
            d.update(loc="cuda", pool=loc.pool, offset=loc.offset, nbytes=loc.nbytes, device=loc.device)
        else:
            d.update(loc="inline", frame=getattr(loc, "frame", None))
        out.append(d)
    return out
