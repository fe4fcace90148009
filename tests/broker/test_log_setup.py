"""The shared log set-up (broker.protocol.logs) and the request's traceparent on the wire,
without processes: formatters, options, the header field (validated, dropped when malformed,
kept through the broker's re-encode), the client core putting it in the header, and the
launcher passing the log format to its workers."""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from broker import protocol as P
from broker.protocol import logs

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def restore_root(monkeypatch):
    monkeypatch.setattr(logs, "_FORMAT", "text")  # what setup_logging sets, for the launcher
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            if h not in handlers:
                h.close()
                if isinstance(h, logs.QueuedHandler):
                    h.writer.close()  # (a test's own stream: its writer thread ends)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def _req(**kw) -> P.Request:
    return P.Request(id=17, pid=4242, **kw)


def test_text_lines_end_with_the_request_fields(restore_root):
    out = io.StringIO()
    logs.setup_logging("info", "text", "worker", stream=out)
    log = logging.getLogger("gpu_worker.t")
    log.debug("hidden")
    log.info("request done", extra=logs.done_fields(_req(traceparent=TP), "echo",
                                                    {"compute_ms": 0.12345, "batch": 2.0, "queue_ms": 0.5}))
    log.warning("plain")
    assert logging.getLogger().handlers[0].flush() is None
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(" worker INFO request done rid=4242:17 trace_id=4bf92f3577b34da6a3ce929d0e0e4736 "
                             "service=echo batch=2 queue_ms=0.5 compute_ms=0.123"), lines[0]
    assert lines[1].endswith(" worker WARNING plain")


def test_json_lines_parse_with_their_fields_and_tracebacks(restore_root):
    out = io.StringIO()
    logs.setup_logging("DEBUG", "json", "broker", stream=out)
    log = logging.getLogger("broker.t")
    log.debug("request tensors", extra=logs.tensor_fields(_req(tensors=[P.TensorRef(
        name="x", dtype="|u1", shape=[16], loc=P.ShmLoc(segment="zinf-1-2-0123456789abcdef-5", offset=4096,
                                                         nbytes=16, slot=3, generation=1))])))
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed %d", 3, extra={"rid": "-:1"})
    logging.getLogger().handlers[0].flush()
    a, b = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: a[k] for k in ("level", "process", "logger", "msg", "rid")} == {
        "level": "DEBUG", "process": "broker", "logger": "broker.t", "msg": "request tensors", "rid": "4242:17"}
    assert "trace_id" not in a and isinstance(a["pid"], int) and a["ts"].endswith("Z")
    assert a["inputs"] == [{"name": "x", "dtype": "|u1", "shape": [16], "loc": "shm",
                            "segment": "zinf-1-2-0123456789abcdef-5", "offset": 4096, "nbytes": 16, "slot": 3}]
    assert b["msg"] == "failed 3" and b["level"] == "ERROR" and "ValueError: boom" in b["exc"]


def test_options_and_bad_values():
    ap = argparse.ArgumentParser()
    logs.add_log_options(ap)
    a = ap.parse_args([])
    assert (a.log_level, a.log_format) == ("WARNING", "text")
    a = ap.parse_args(["--log-level", "debug", "--log-format", "json"])
    assert (a.log_level, a.log_format) == ("DEBUG", "json")
    for bad in (["--log-level", "loud"], ["--log-format", "xml"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    with pytest.raises(ValueError, match="log format"):
        logs.setup_logging("INFO", "xml")
    with pytest.raises(ValueError, match="log level"):
        logs.setup_logging("LOUD", "text")


def test_request_id_without_a_pid_and_tensor_locations():
    assert logs.request_fields(P.Request(id=5)) == {"rid": "-:5"}
    refs = [P.TensorRef(name="a", dtype="<f4", shape=[2], loc=P.InlineLoc(frame=0)),
            P.TensorRef(name="b", dtype="<f4", shape=[2], loc=P.CudaLoc(pool="p", offset=0, nbytes=8, device=1))]
    assert [(d["loc"], d.get("frame"), d.get("device")) for d in logs.describe_tensors(refs)] == [
        ("inline", 0, None), ("cuda", None, 1)]


def test_tag_json_line_keeps_json_and_wraps_the_rest():
    line = json.loads(logs.tag_json_line('{"level": "INFO", "msg": "m", "pid": 9}', pool="echo", index=1, pid=9))
    assert line == {"pool": "echo", "index": 1, "pid": 9, "level": "INFO", "msg": "m"}
    wrapped = json.loads(logs.tag_json_line("Traceback (most recent call last):", pool="echo", index=0, pid=9))
    assert wrapped["msg"] == "Traceback (most recent call last):" and wrapped["level"] == "WARNING"
    assert {"ts", "process", "pid", "logger", "pool", "index"} <= set(wrapped)


# ------------------------------------------------------------------------ the header field

@pytest.mark.parametrize("tp, ok", [
    (TP, True),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),
    (TP.upper(), False),                                                   # upper-case hex
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),    # another version
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),    # zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),    # zero span id
    (TP + "-extra", False), (TP[:-1], False), ("", False), ("garbage", False), ("x" * 100_000, False),
])
def test_traceparent_validation(tp, ok):
    assert P.valid_traceparent(tp) is ok
    hdr = P.encode_header(P.Request(id=1, traceparent=tp))
    assert P.decode_request(hdr).traceparent == (tp if ok else None)  # malformed: ignored, never a 400


def test_a_traceparent_that_is_not_a_string_is_a_400_naming_the_field():
    with pytest.raises(P.ProtocolError, match="traceparent"):
        P.decode_request(P.encode_header(P.Request(id=1, traceparent=7)))


def test_the_traceparent_survives_the_brokers_re_encode():
    req = P.decode_request(P.encode_header(P.Request(id=3, host="h", pid=1, traceparent=TP)))
    req.queue_ms, req.timeout_ms = 0.25, 99.0  # what the broker rewrites at dispatch
    again = P.decode_request(P.encode_header(req))
    assert again.traceparent == TP and again.queue_ms == 0.25
    assert P.decode_request(P.encode_header(P.Request(id=4))).traceparent is None


def test_the_client_core_sends_the_traceparent_it_is_given():
    from client_sdk import InvalidInput
    from client_sdk.core import ClientCore

    core = ClientCore("ipc:///tmp/zinf-log-test.sock", transport="inline", heartbeat_interval=None)
    try:
        heads = []
        for tp in (TP, None):
            call = core.new_call("echo", {"x": np.arange(3)}, traceparent=tp)
            heads.append(P.decode_request(core.request_frames(call, 1.0)[3], 1).traceparent)
        assert heads == [TP, None]
        with pytest.raises(InvalidInput, match="traceparent"):
            core.new_call("echo", {"x": np.arange(3)}, traceparent=b"00-...")
    finally:
        core.close()


def test_the_launcher_passes_its_log_format_to_its_workers(restore_root):
    from broker.config import PoolConfig
    from broker.launcher import Launcher

    fake = SimpleNamespace(broker=SimpleNamespace(backend_ep="ipc:///b"), _hb=(0.2, 3), _link=())
    pool = PoolConfig(name="echo", model="echo", extra_args=("--log-format", "text"))
    assert "--log-format" not in Launcher._argv(fake, PoolConfig(name="echo", model="echo"))
    logs.setup_logging("WARNING", "json", "broker", stream=io.StringIO())
    argv = Launcher._argv(fake, pool)
    i = argv.index("gpu_worker")
    assert argv[i + 1:i + 3] == ["--log-format", "json"] and argv[-2:] == ["--log-format", "text"]  # extra_args win
    said = []
    fake._say = said.append
    child = SimpleNamespace(pool="echo", index=0, pid=77)
    Launcher._forward(fake, child, '{"msg": "request done", "pid": 77}')
    Launcher._forward(fake, child, "plain line")
    assert [json.loads(s)["msg"] for s in said] == ["request done", "plain line"]
    assert all(json.loads(s)["pool"] == "echo" for s in said)


# ------------------------------------------------------------------------ error lines, in-process

def test_errors_the_broker_and_the_worker_answer_are_one_info_line_each(restore_root, tmp_path):
    import time

    import zmq

    from broker.server import Broker, BrokerConfig
    from gpu_worker.worker import Worker, WorkerConfig

    out = io.StringIO()
    handler = logs.setup_logging("INFO", "json", "test", stream=out)
    F = zmq.Frame

    class Recording(Broker):
        def send_to_worker(self, frames) -> None:
            pass

        def send_to_client(self, frames) -> None:
            pass

    b = Recording(BrokerConfig(frontend=f"ipc://{tmp_path}/f", backend=f"ipc://{tmp_path}/b"))
    try:  # a request whose deadline passed before it arrived: the broker answers 504 itself
        head = P.encode_header(P.Request(id=9, timeout_ms=0.0, traceparent=TP))
        b.on_client([F(b"\0\0\0\0\1"), F(P.MDPC), F(P.C_REQUEST), F(b"nobody"), F(head)])
        b._act(b.sched.tick(time.monotonic() + 0.01), time.monotonic())
    finally:
        b.close()
    w = Worker(WorkerConfig(broker=f"ipc://{tmp_path}/none", model="echo", warmup=False))
    try:  # a request whose budget is spent when the worker reads it: the worker answers 504
        w.upstream.send = lambda frames: None
        head = P.encode_header(P.Request(id=11, pid=4242, timeout_ms=0.0))
        w.on_message([F(P.MDPW), F(P.W_REQUEST), F(b"e"), F(b""), F(head)])
    finally:
        w.close()
    handler.flush()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    failed = [r for r in lines if r["msg"].startswith("request failed")]
    assert [(r["logger"], r["rid"], r["code"], r.get("trace_id")) for r in failed] == [
        ("broker", "-:9", 504, TP[3:35]), ("gpu_worker", "4242:11", 504, None)], lines


# ---- lines reach the stream through a thread of their own (logs.LineWriter)


@pytest.mark.timeout(60)
def test_a_stream_nobody_reads_never_blocks_the_thread_that_logs():
    # A pipe nobody reads (a terminal paused with Ctrl-S, a stalled log collector) blocked
    # the broker's loop in a write once its 64 KiB were full.  Lines now queue, then drop
    # (counted), and the next line written says how many.
    r, w = os.pipe()
    stream = open(w, "w", encoding="utf-8")
    writer = logs.LineWriter(stream, capacity=100)
    try:
        line = "x" * 1000
        accepted = sum(writer.put(f"{i} {line}") for i in range(2000))  # ~2 MB: far over the pipe
        assert 100 <= accepted < 2000 and writer.dropped == 2000 - accepted
        assert writer.flush(0.2) is False      # the stream is stuck: a bounded wait says so
        got = []

        def drain():
            with open(r, "rb") as f:
                got.append(f.read())

        t = threading.Thread(target=drain)
        t.start()
        assert writer.put("after")             # a line after the stall: it carries the notice
        assert writer.close(10.0) is True
        stream.close()
        t.join(10)
        lines = got[0].decode().splitlines()
        numbers = [int(x.split()[0]) for x in lines if x.endswith(line)]
        assert numbers == sorted(numbers) and len(numbers) == accepted  # in order, none lost
        notice = [x for x in lines if "dropped" in x]
        assert notice == [f"{2000 - accepted} log lines were dropped: the stream they go to was not read fast enough"]
        assert lines[-1] == "after"  # the notice went out with the first batch after the drops
    finally:
        if not stream.closed:
            stream.close()


def test_the_notice_is_a_log_line_of_the_configured_format(restore_root):
    out = io.StringIO()
    handler = logs.setup_logging("INFO", "json", "broker", stream=out)
    line = json.loads(handler.writer.notice(7))
    assert line["level"] == "WARNING" and line["process"] == "broker"
    assert line["msg"].startswith("7 log lines were dropped: stderr was not read fast enough")
    assert logs.line_writer(out) is handler.writer  # the launcher's forwarded lines share it


def test_a_signal_handlers_line_is_a_log_line_and_never_waits_for_the_lock(restore_root):
    # The SIGHUP handlers wrote to descriptor 2 themselves: on a stderr nobody read, the main
    # thread blocked there for good.  warn_from_signal queues a formatted line instead, and a
    # handler that interrupted the main thread inside put (the writer's lock held) gives its
    # line up after SIGNAL_WAIT_S rather than wait for itself.
    out = io.StringIO()
    handler = logs.setup_logging("WARNING", "json", "broker", stream=out)
    logs.warn_from_signal("broker", "SIGHUP ignored")
    assert handler.writer.flush(5.0)
    line = json.loads(out.getvalue().splitlines()[-1])
    assert (line["level"], line["logger"], line["msg"]) == ("WARNING", "broker", "SIGHUP ignored")
    with handler.writer._cv:  # as if the signal came inside put()
        assert handler.writer.put_from_signal("held", wait=0.01) is False
    assert handler.writer.dropped == 1
    logging.getLogger().setLevel(logging.ERROR)  # --log-level ERROR: warnings are not wanted
    logs.warn_from_signal("broker", "not said")
    assert handler.writer.flush(5.0) and "not said" not in out.getvalue()


def test_a_text_line_is_one_line_whatever_its_words():
    """Control characters, C1 controls and the Unicode line separators in a message, an
    extra or an exception's message are escaped or indented: a peer's words cannot start a
    line of their own (the fuzz audit, then its review)."""
    import sys

    f = logs.TextFormatter("broker")
    forged = "x\n2026-01-01 00:00:00,000 broker WARNING FORGED\r\u2028\u2029\x85\x9b\x00"
    r = logging.LogRecord("broker", logging.INFO, __file__, 1, "no worker for %r", (forged,), None)
    r.service = forged
    line = f.format(r)
    assert line.splitlines() == [line] and "\\n2026-01-01" in line and "\\u2028" in line
    try:
        raise ValueError(forged)
    except ValueError:
        r = logging.LogRecord("broker", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    lines = f.format(r).splitlines()
    assert lines[0].endswith("ERROR boom") and lines[1] == "Traceback (most recent call last):"
    assert not [ln for ln in lines[2:] if not ln[:1].isspace()], lines  # the message's lines, indented
    assert any("  2026-01-01 00:00:00,000 broker WARNING FORGED" in ln for ln in lines), lines


def test_lines_a_failed_write_lost_are_said_by_the_next_write(restore_root):
    """The resource audit: logs on a full disk lost about 12 s of lines without a word.  A
    write that fails is counted, and the next one that succeeds starts with how many and
    why (in the configured format)."""
    class Disk(io.StringIO):
        full = True

        def write(self, text):
            if self.full:
                raise OSError(28, "No space left on device")
            return super().write(text)

    disk = Disk()
    handler = logs.setup_logging("INFO", "json", "broker", stream=disk)
    log = logging.getLogger("broker.test")
    for i in range(5):
        log.info("line %d", i)
        assert handler.writer.flush(5.0)
    disk.full = False
    log.info("after")
    assert handler.writer.flush(5.0)
    lines = [json.loads(x) for x in disk.getvalue().splitlines()]
    assert [x["msg"] for x in lines][-1] == "after"
    (said,) = [x for x in lines if "lost" in x["msg"]]
    assert said["level"] == "WARNING" and said["msg"].startswith("5 log lines were lost: writing them to stderr failed")
    assert "No space left on device" in said["msg"]
