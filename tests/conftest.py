"""Suite-wide hygiene: every test must leave no child process, no shared-memory segment
still open, no /dev/shm file and no client reply-socket file behind.

The check is a fixture (autouse) rather than a session hook so that the failure names the
test that leaked.  Children are found through /proc (no psutil dependency): any process whose
parent chain leads to this pytest process.
"""
from __future__ import annotations

import os
import time

import pytest

SHM_DIR = "/dev/shm"
SHM_PREFIX = "zinf-"


def reply_socket_files(me: int) -> set[str]:
    """Direct-reply socket files (`client_sdk.sockets.ReplyInbox`) of clients in this process."""
    from broker.protocol.naming import default_runtime_dir

    d = default_runtime_dir()
    try:
        return {n for n in os.listdir(d) if n.startswith(f"c-{me}-") and n.endswith(".ipc")}
    except FileNotFoundError:
        return set()


def shm_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


def open_segments(me: int) -> set[str]:
    """Segments this process owns and has not closed (a ShmPool, a device pool's state table
    or a client left open).  Closed ones may stay mapped while arrays view them."""
    from shm.gc import _segments_of
    from shm.segment import H32_CLOSED

    out = set()
    for name in _segments_of(str(me)):
        try:
            fd = os.open(f"/proc/{me}/fd/{name.rsplit('-', 1)[1]}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            closed = int.from_bytes(os.pread(fd, 4, H32_CLOSED * 4), "little")
        finally:
            os.close(fd)
        if not closed:
            out.add(name)
    return out


def _open_segments_after_gc(me: int, before: set[str]) -> set[str]:
    left = open_segments(me) - before
    if left:  # a pool dropped without close() is closed by its finalizer: give it the chance
        import gc

        gc.collect()
        left = open_segments(me) - before
    return left


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    if rest[0] == b"Z":  # zombie: reaped by its parent soon, not a leak of a live process
        return None
    return int(rest[1])


# Long-lived helpers that multiprocessing starts once per interpreter, not per test.
_IGNORED = (b"resource_tracker", b"forkserver")


def _ignored(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return True
    return any(tag in cmd for tag in _IGNORED)


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = _ppid(int(name))
            if pp is not None:
                parents[int(name)] = pp
    out: set[int] = set()
    frontier = {root}
    while frontier:
        nxt = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out |= nxt
        frontier = nxt
    return {p for p in out if not _ignored(p)}


def _ours(name: str, me: int) -> bool:
    """A segment is this suite's if its owner (the pid in its name) is this process or one of
    its children, or is dead (a child that crashed).  Other programs on the machine, such as a
    second test run, may create segments at the same time; they are not our leaks."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return True
    if pid == me or pid in descendants(me):
        return True
    return not os.path.exists(f"/proc/{pid}")


def _settle(check, timeout: float = 5.0):
    """Poll a leak check until it is empty or the timeout passes (processes take a moment to
    be reaped after a kill).  Returns the last value seen."""
    deadline = time.monotonic() + timeout
    value = check()
    while value and time.monotonic() < deadline:
        time.sleep(0.02)
        value = check()
    return value


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test that leaves a child process, an open segment or a zinf-* file in
    /dev/shm behind."""
    me = os.getpid()
    before_files = shm_files()
    before_segments = open_segments(me)
    before_procs = descendants(me)
    before_socks = reply_socket_files(me)
    yield
    left_procs = _settle(lambda: descendants(me) - before_procs)
    left_files = _settle(lambda: {n for n in shm_files() - before_files if _ours(n, me)})
    left_socks = reply_socket_files(me) - before_socks
    left_segments = _open_segments_after_gc(me, before_segments)
    problems = []
    if left_segments:
        problems.append(f"shared-memory segments left open (a ShmPool or Client not closed): {sorted(left_segments)}")
    if left_socks:
        problems.append(f"client reply sockets left open (a Client or AsyncClient not closed): {sorted(left_socks)}")
    if left_procs:
        cmdlines = []
        for pid in sorted(left_procs):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                    cmdlines.append(f"{pid}: {cmd}")
            except OSError:
                pass
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        problems.append("child processes left running: " + "; ".join(cmdlines))
    if left_files:
        for n in left_files:
            try:
                os.unlink(os.path.join(SHM_DIR, n))
            except OSError:
                pass
        problems.append(f"/dev/shm files left behind: {sorted(left_files)}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
