"""Waiting on child processes with a deadline: a child that hangs fails the test, with a
message naming what was awaited, instead of hanging it.

``pipe.readline()`` blocks until the child writes a line or exits.  `readline_within` waits
for the line with `select` and reads the pipe's file descriptor itself (``os.read``), keeping
what it read past the line for its next call.  Once it was used on a pipe, it must be that
pipe's only reader: a buffered ``pipe.readline()`` or ``pipe.read()`` would not see the bytes
it holds, and it would not see the bytes such a read buffered.

`read_rest_within` bounds a read to the end of a child's pipe, which a child of the child
may hold open after the child exited.  `read_within` and `wait_child` bound the two waits
on a forked child: its answer on a pipe (``os.read``) and its exit (``os.waitpid``).
"""
from __future__ import annotations

import io
import os
import select
import signal
import time
import weakref

# The bytes read from each pipe past the last line returned (the pipe object is the key, not
# its file descriptor: a closed pipe's number is reused).
_rest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def readline_within(pipe, timeout: float, what: str):
    """The next line of ``pipe`` (a `subprocess.Popen` pipe), newline included, as
    ``pipe.readline()`` returns it: ``str`` for a text pipe, ``bytes`` otherwise, and what is
    left (possibly empty) once the child closed its end.  Raises `TimeoutError`, naming
    ``what`` (the line awaited), when no whole line came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    fd = pipe.fileno()
    buf = _rest.get(pipe, b"")
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            _rest[pipe] = buf
            raise TimeoutError(f"no line from the child within {timeout} s: waited for {what}; read so far: {buf!r}")
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:  # end of file: the child closed its end
                break
            buf += chunk
    line, sep, rest = buf.partition(b"\n")
    _rest[pipe] = rest
    line += sep
    if isinstance(pipe, io.TextIOBase):
        return line.decode(pipe.encoding or "utf-8", errors=pipe.errors or "strict")
    return line


def read_rest_within(pipe, timeout: float, what: str):
    """What is left of ``pipe`` (a `subprocess.Popen` pipe) up to its end of file, as
    ``pipe.read()`` returns it (``str`` for a text pipe), including what `readline_within`
    read past its last line.  The end of file comes when every process holding the write
    end closed it: the child, and any child of its own that inherited it (a model's helper,
    a forked server) and may outlive it.  Raises `TimeoutError`, naming ``what``, with what
    was read so far, when it did not come within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    fd = pipe.fileno()
    buf = _rest.pop(pipe, b"")
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the child's pipe did not end within {timeout} s (a process of its own still "
                               f"holds it?): waited for {what}; read so far: {buf[-2000:]!r}")
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    if isinstance(pipe, io.TextIOBase):
        return buf.decode(pipe.encoding or "utf-8", errors=pipe.errors or "strict")
    return buf


def read_within(fd: int, n: int, timeout: float, what: str) -> bytes:
    """One ``os.read(fd, n)`` once ``fd`` is readable (b"" at end of file).  Raises
    `TimeoutError`, naming ``what``, when it is not readable within ``timeout`` seconds."""
    if not select.select([fd], [], [], timeout)[0]:
        raise TimeoutError(f"nothing to read within {timeout} s: waited for {what}")
    return os.read(fd, n)


def wait_child(pid: int, timeout: float, what: str) -> int:
    """The exit code of the forked child ``pid`` (as ``os.waitstatus_to_exitcode``), reaped.
    When it is still running after ``timeout`` seconds it is killed (SIGKILL) and reaped,
    and `AssertionError` names ``what`` (the child's work)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # killed: it exits now
            raise AssertionError(f"the child {pid} ({what}) was still running after {timeout} s")
        time.sleep(0.01)  # polling for its exit (a condition, not a delay)
