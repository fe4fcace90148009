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

Lines reach stderr through a thread of their own (:class:`LineWriter`): the thread that
logs (a latency loop among them) formats its line and queues it, and never waits for the
stream.  A pipe nobody reads, a terminal paused with Ctrl-S or a log collector that stalls
used to block the broker's loop in a write, with every request behind it; now, once
``QUEUED_LINES`` lines wait, new lines are dropped and counted, and the next line written
says how many.  At exit the lines still queued get ``FLUSH_S`` seconds to go out.

Stdlib logging only; nothing here touches a socket.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import datetime
import faulthandler
import json
import logging
import math
import os
import re
import signal
import stat
import sys
import threading
import time
from typing import Any, Iterable

from .header import CudaLoc, ShmLoc

__all__ = ["LEVELS", "FORMATS", "say", "warn_from_signal", "enable_crash_dumps", "announce", "ignore_stop_signals", "block_stop_signals", "unblock_stop_signals", "hold_std_descriptors", "setup_logging", "LineWriter", "line_writer", "QueuedHandler", "add_log_options", "configured_format", "request_fields",
           "request_id", "trace_id", "done_fields", "tensor_fields", "describe_tensors", "TIMINGS",
           "tag_json_line", "TextFormatter", "JsonFormatter"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")

# The attributes every LogRecord has: anything else on a record came in `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_FORMAT = "text"  # what setup_logging configured (the launcher passes it on to its workers)
QUEUED_LINES = 20_000  # lines waiting for a stalled stream before new ones are dropped
FLUSH_S = 2.0  # at exit, how long the lines still queued may take to go out
SIGNAL_WAIT_S = 0.05  # how long a signal handler may wait for a writer's lock before its line is dropped


class LineWriter:
    """Text lines written to ``stream`` by a daemon thread, in the order they were put.

    ``put`` never blocks on the stream: it appends to a queue of at most ``capacity`` lines
    and wakes the thread if it was waiting; with the queue full (the stream has stalled) the
    line is dropped and counted, and the next batch written starts with ``notice(n)`` (a
    line saying that ``n`` were dropped).  The thread writes whatever is queued in one write
    and one flush.  ``flush(timeout)`` waits until what was put before it is written (or
    given up on); ``close(timeout)`` does the same and ends the thread.  A write that fails
    (a full disk, EPIPE, a closed stream) loses its lines, and the next write that succeeds
    starts with a line saying how many were lost and why (they went without a word before:
    the resource audit's full tmpfs)."""

    def __init__(self, stream: Any, capacity: int = QUEUED_LINES, name: str = "log-writer"):
        self.stream = stream
        self.capacity = capacity
        self.notice = lambda n: f"{n} log lines were dropped: the stream they go to was not read fast enough"
        self.lost_notice = lambda n, why: f"{n} log lines were lost: writing them failed ({why})"
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._dropped = 0
        self._lost = 0     # lines whose write failed, not yet reported
        self._lost_why = ""
        self._put = 0      # lines accepted
        self._done = 0     # lines written or given up on
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Lines dropped and not yet reported."""
        return self._dropped

    def put(self, line: str) -> bool:
        """Queue ``line`` (no newline); False: dropped (the queue is full, or closed)."""
        with self._cv:
            return self._queue(line)

    def put_from_signal(self, line: str, wait: float = SIGNAL_WAIT_S) -> bool:
        """``put`` for a signal handler: the handler may have interrupted the main thread
        inside ``put``, holding the lock it would wait for for ever, so it waits at most
        ``wait`` seconds and then drops the line (counted; without the lock, a count that
        may miss one)."""
        if not self._cv.acquire(timeout=wait):
            self._dropped += 1
            return False
        try:
            return self._queue(line)
        finally:
            self._cv.release()

    def _queue(self, line: str) -> bool:
        """`put`'s work, the lock held."""
        if self._closed or len(self._q) >= self.capacity:
            self._dropped += 1
            return False
        self._q.append(line)
        self._put += 1
        if len(self._q) == 1:
            self._cv.notify()  # the thread waits only on an empty queue
        return True

    def flush(self, timeout: float = FLUSH_S) -> bool:
        """Wait up to ``timeout`` s for the lines put so far to be written: True if they were.
        At exit every wait ends by one deadline (FLUSH_S after the exit began: logging
        flushes and closes each handler, and a stream that is not read must not hold the
        exit up once per call)."""
        with self._cv:
            return self._wait(timeout)

    def close(self, timeout: float = FLUSH_S) -> bool:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            done = self._wait(timeout)
        if done:
            self._thread.join(timeout)
        return done

    def _wait(self, timeout: float) -> bool:
        target = self._put
        if _EXIT_BY is not None:
            timeout = min(timeout, max(0.0, _EXIT_BY - time.monotonic()))
        return self._cv.wait_for(lambda: self._done >= target, timeout)

    def _run(self) -> None:
        block_stop_signals()  # the main thread's to take (block_stop_signals)
        q, cv = self._q, self._cv
        while True:
            with cv:
                while not q and not self._closed:
                    cv.wait()
                if not q:
                    return  # closed, and everything written
                lines = list(q)
                q.clear()
                dropped, self._dropped = self._dropped, 0
            n = len(lines)
            if dropped:
                try:
                    lines.insert(0, self.notice(dropped))
                except Exception:  # noqa: BLE001 - a notice is never worth the lines
                    pass
            lost = self._lost
            if lost:
                try:
                    lines.insert(0, self.lost_notice(lost, self._lost_why))
                except Exception:  # noqa: BLE001 - a notice is never worth the lines
                    pass
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
                self._lost = 0
            except Exception as e:  # noqa: BLE001 - EPIPE, a full disk, sys.stderr None: the thread goes on
                self._lost = lost + n
                self._lost_why = f"{type(e).__name__}: {e}"[:200]
                if dropped:
                    with cv:  # (its notice was in this batch: said with the next one instead)
                        self._dropped += dropped
            with cv:
                self._done += n
                cv.notify_all()


class QueuedHandler(logging.Handler):
    """A handler that formats each record in the thread that logs it and hands the line to
    a :class:`LineWriter`: logging never waits for the stream."""

    def __init__(self, writer: LineWriter):
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - as logging.StreamHandler does
            self.handleError(record)
            return
        self.writer.put(line)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        # The writer is the stream's, shared (the launcher's forwarded lines use it too):
        # flushed here, ended at exit (_close_writers) or by setup_logging for another stream.
        self.writer.flush()
        super().close()


_WRITERS: dict[int, LineWriter] = {}  # id(stream) -> its writer (one thread per stream)
_WRITERS_LOCK = threading.Lock()


def say(fd: int, data: bytes) -> None:
    """Write ``data`` to descriptor ``fd`` from a signal handler, never raising: a SIGHUP
    comes when the terminal hung up, and its handler's write to the dead stderr (EIO; or
    /dev/full, a closed pipe) raised into the main loop and ended the process (the
    environment hunt)."""
    if fd == 2 and sys.stderr is None:
        return  # stderr was closed when we started (2>&-): descriptor 2 may be a socket or a segment now
    try:
        os.write(fd, data)
    except OSError:
        pass


def warn_from_signal(name: str, message: str) -> None:
    """Log ``message`` as a WARNING of logger ``name`` from a signal handler, through the
    root's :class:`QueuedHandler` (formatted here, written by its writer thread), so that
    it never waits for stderr: a handler that wrote to descriptor 2 itself (:func:`say`)
    blocked the main thread for good on a stderr nobody reads (a full pipe, a stalled log
    collector), and with it the broker's loop (every request, heartbeats to the workers,
    SIGTERM) or the worker's (its broker presumed it dead).  Logger, handler and module
    locks are not taken (the handler may have interrupted their holder); a line formatted
    like every other keeps ``--log-format json`` one JSON object a line.  Without a queued
    handler (before ``setup_logging``) the line goes to descriptor 2 as :func:`say` has it."""
    root = logging.getLogger()
    if root.level > logging.WARNING:
        return
    for h in root.handlers:
        if isinstance(h, QueuedHandler):
            try:
                line = h.format(logging.LogRecord(name, logging.WARNING, __file__, 0, message, None, None))
            except Exception:  # noqa: BLE001 - a signal handler must not raise into the loop
                return
            h.writer.put_from_signal(line)
            return
    say(2, message.encode(errors="backslashreplace") + b"\n")


def enable_crash_dumps() -> None:
    """faulthandler on (a crash in native code, a model's extension or libzmq's assertions,
    leaves every thread's Python stack on stderr), writing through a non-blocking
    description of stderr where stderr is a pipe or a terminal.  faulthandler writes from
    the fatal signal's handler and only then lets the signal end the process: on a stderr
    pipe nobody read (a stalled log collector) that write blocked for good, and a worker
    that crashed never exited (its supervisor saw no exit to restart it; found by the
    streams hunt).  Its own description (``/proc/self/fd/2`` opened again) keeps
    ``O_NONBLOCK`` off descriptor 2, which other processes and the writer thread share: a
    stack that does not fit is cut, and the process ends.  Regular files never block for
    good and a socket cannot be opened again: those keep stderr itself."""
    target: Any = sys.stderr
    try:
        if sys.stderr is not None and sys.stderr.fileno() == 2:
            mode = os.fstat(2).st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
                target = os.open("/proc/self/fd/2",
                                 os.O_WRONLY | os.O_NONBLOCK | os.O_APPEND | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError, AttributeError):  # no /proc, a pipe without a reader (ENXIO), no descriptor
        pass
    try:
        faulthandler.enable(file=target, all_threads=True)
    except (OSError, ValueError, AttributeError, RuntimeError):  # a stderr without a descriptor (run in
        pass  # process), or none at all (2>&-: RuntimeError; the process exited 1 at once)


def hold_std_descriptors() -> None:
    """Point a closed stdin, stdout or stderr at /dev/null, at the very start of a main:
    else the next file opened takes its number (libzmq's eventfd, a segment, a socket), and
    whatever is written to "stderr" goes into it (the environment hunt's review)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
            except OSError:
                return
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def block_stop_signals() -> None:
    """Keep SIGTERM, SIGINT and SIGHUP off the calling thread (call it first thing in a
    thread of ours).  The kernel hands a process's signal to any thread that does not block
    it, and the interpreter runs the handler on the main thread only once that thread comes
    back to Python: a signal that landed on a helper thread while the main thread waited in
    a system call (a model's read during a batch on a worker's loop thread) was not seen
    until the call returned, and a worker drained late (its probe ready, no STOPPING sent).
    Blocked here, it goes to the main thread, whose call is interrupted (EINTR) and whose
    handler runs at once."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    except (AttributeError, OSError, ValueError):  # no pthread_sigmask here
        pass


def unblock_stop_signals() -> None:
    """Undo `block_stop_signals` on the calling thread: for a thread of ours about to run a
    model's code, since what that code starts inherits the mask (a thread, a forked process,
    and an exec'd one too: `multiprocessing`'s spawn and forkserver, `subprocess`).  Left
    blocked, SIGTERM never reached such a process: `Pool.terminate()` (a `with Pool()`'s
    exit) waited for its workers for good, and a helper's `terminate()` did nothing."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    except (AttributeError, OSError, ValueError):
        pass


def signal_wakeup_pipe() -> tuple[int, int] | None:
    """A non-blocking pipe that the C-level signal handler writes each signal's number to
    (`signal.set_wakeup_fd`): (read end, write end), for a loop to watch the read end.  The
    interpreter runs a Python handler only once the loop's wait returns (PEP 475 restarts
    the wait after EINTR, timeout and all), so a stop set by a handler was seen at the end of
    the wait; a readable pipe ends it at once.  None off the main thread (no pipe made)."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the loop notices at its next wake-up
        os.close(r)
        os.close(w)
        return None
    return r, w


def drain_pipe(fd: int) -> None:
    """Read a non-blocking pipe until it is empty (`signal_wakeup_pipe`'s bytes)."""
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


def ignore_stop_signals() -> None:
    """SIGTERM and SIGINT ignored from now on: for a process that has finished its drain and
    only exits.  The interpreter's exit puts the default action back for every signal it
    had a handler for, so a signal during it (tens of milliseconds; more with large modules
    loaded) ended the process by that signal instead of with its exit code; an ignored one
    stays ignored.  Main thread only (as `signal.signal`); elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def announce(line: str, stream: Any = None, log: logging.Logger | None = None) -> None:
    """Print a process's READY line on ``stream`` (stdout), in UTF-8 whatever the locale;
    an stdout that cannot take it (/dev/full, a pipe nobody reads any more) is a WARNING,
    not the end of a serving process.  UTF-8 because the line is read by programs (the
    launcher decodes its workers' lines as UTF-8): a non-ASCII service name or path under a
    locale that is not UTF-8 (PYTHONUTF8=0 LC_ALL=C: an ASCII stdout) could not be encoded,
    no READY came out, and the launcher killed the worker as hung at its ready timeout
    (the streams hunt).  ``log``: the logger of the WARNING (this module's by default)."""
    out = sys.stdout if stream is None else stream
    try:
        raw = getattr(out, "buffer", None)
        if raw is None:  # a text stream without bytes under it (io.StringIO)
            print(line, file=out, flush=True)
        else:
            out.flush()  # what the text layer still holds goes first
            raw.write((line + "\n").encode("utf-8", "backslashreplace"))
            raw.flush()
    except (OSError, ValueError, AttributeError) as e:  # ValueError: stdout closed; AttributeError: None (2>&-)
        (log or logging.getLogger("broker.protocol.logs")).warning(
            "could not print the READY line on stdout (%r): %s", line, e)


def line_writer(stream: Any) -> LineWriter:
    """The one :class:`LineWriter` of ``stream`` in this process (made on first use), so
    that the log lines and the lines the launcher forwards from its workers keep one order
    on stderr."""
    with _WRITERS_LOCK:
        w = _WRITERS.get(id(stream))
        if w is None or w.stream is not stream or w._closed:
            w = _WRITERS[id(stream)] = LineWriter(stream)
        return w


_EXIT_BY: float | None = None  # at exit: when waits for the writers end


@atexit.register
def _close_writers() -> None:
    # Exit hooks run last registered first: this one before logging.shutdown (logging was
    # imported first), which flushes and closes the handlers too.  Together they give the
    # lines still queued FLUSH_S to go out, so a process exits even if its stderr is never
    # read.
    global _EXIT_BY
    _EXIT_BY = time.monotonic() + FLUSH_S
    for w in list(_WRITERS.values()):
        w.close()


def _after_fork_in_child() -> None:
    # The writer threads did not come with the fork: a child (a model that forks, say)
    # starts its own, with nothing of the parent's queue (those lines are the parent's).
    for w in _WRITERS.values():
        w._q.clear()
        w._cv = threading.Condition(threading.Lock())
        w._put = w._done = w._dropped = 0

        if not w._closed:
            w._thread = threading.Thread(target=w._run, name=w._thread.name, daemon=True)
            w._thread.start()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


#: what a text line must not carry raw: C0 controls but the tab, DEL, C1 controls (NEL, CSI...)
#: and the Unicode line and paragraph separators (str.splitlines splits on those too)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
#: the same but the newline, which a traceback is made of
_BREAKS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
#: the lines of a traceback that start at its left edge (the rest is indented, or a message)
_TRACEBACK_HEADS = ("Traceback (most recent call last):",
                    "During handling of the above exception, another exception occurred:",
                    "The above exception was the direct cause of the following exception:")


def _escape(m: re.Match) -> str:
    return repr(m.group())[1:-1]  # ("\\n", "\\x00", "\\u2028")


def _escaped(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x00``): a
    peer's words in a line (a service name, a host, a model's message) cannot start a line
    of their own, a forged one (the fuzz audit)."""
    return _CONTROL.sub(_escape, text)


class TextFormatter(logging.Formatter):
    """``<time> <process> <LEVEL> <message> key=value ...`` (the extras, in the order given;
    lists and maps as compact JSON).  One record, one line (a traceback below it): control
    characters in the message and the extras are escaped (`_escaped`)."""

    def __init__(self, process: str):
        super().__init__("%(asctime)s " + process.replace("%", "%%") + " %(levelname)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        if _CONTROL.search(record.message):
            record.message = _escaped(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        """The traceback, below the line, with every line that is not one of its own
        headers indented: an exception's message is anybody's words (a peer's, in a
        ValueError naming what it sent), and its lines must not pass for log lines."""
        text = _BREAKS.sub(_escape, super().formatException(ei))
        return "\n".join(line if not line or line[0].isspace() or line in _TRACEBACK_HEADS else "  " + line
                         for line in text.split("\n"))

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
            else:
                v = str(v)
                if _CONTROL.search(v):
                    v = _escaped(v)
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
    any case, or a number), through the stream's :class:`LineWriter`.  Replaces the root's
    handlers; returns the new one (its ``flush()`` waits for the lines logged so far)."""
    global _FORMAT
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} must be one of {', '.join(FORMATS)}")
    if isinstance(level, str):
        name = level.upper()
        if name not in LEVELS:
            raise ValueError(f"log level {level!r} must be one of {', '.join(LEVELS)}")
        level = getattr(logging, name)
    process = process or os.path.basename(sys.argv[0] or "python")
    writer = line_writer(sys.stderr if stream is None else stream)
    handler = QueuedHandler(writer)
    formatter = JsonFormatter(process) if fmt == "json" else TextFormatter(process)
    handler.setFormatter(formatter)

    def notice(n: int) -> str:
        return formatter.format(logging.LogRecord(
            __name__, logging.WARNING, __file__, 0,
            "%d log lines were dropped: stderr was not read fast enough (a pipe nobody reads, a "
            "paused terminal, a stalled log collector)", (n,), None))

    def lost_notice(n: int, why: str) -> str:
        return formatter.format(logging.LogRecord(
            __name__, logging.WARNING, __file__, 0, "%d log lines were lost: writing them to stderr failed (%s)",
            (n, why), None))

    writer.notice = notice
    writer.lost_notice = lost_notice
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        if isinstance(h, QueuedHandler) and h.writer is not writer:
            h.writer.close()  # its stream's writer thread ends
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
