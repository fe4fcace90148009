"""The descriptor limit of the processes we run, raised to what the system allows.

A broker holds a descriptor per client connection; a worker one per mapped client segment
(two: Python's mmap keeps a duplicate), one pidfd per live client and one socket per client
reply endpoint, beside libzmq's own.  Most systems start a process with a soft limit of
1024 descriptors and a much higher hard one (systemd: 524288; Docker: 1048576): the soft
limit is a guard for programs that use `select`, which cannot watch a descriptor past 1024.
Ours do not depend on it (`wire.Waiter` falls back to `poll` for such a descriptor), so
`python -m broker` and `python -m gpu_worker` raise their soft limit to the hard one at
start, as Go's runtime does for every program.  Only for processes of our own: a library
must not change its host application's limits, so the client SDK never calls it.

`Headroom` decides when a process that accepts connections stops and starts accepting,
so that it never runs out of descriptors: libzmq 4.3's ipc listener aborts the whole process
(an assertion) when accept() fails with EMFILE, and its tcp listener retries it in a busy
loop.  The caller counts, unbinds and binds; this only decides.

Must never: touch a socket or parse a frame.
"""
from __future__ import annotations

import errno
import glob
import os
import resource
from typing import Callable

__all__ = ["MIN_NOFILE", "raise_nofile_limit", "nofile_limit", "open_descriptors", "Headroom", "default_reserve", "listen_backlog",
           "move_aside", "paused_by", "put_back", "memory_limit"]

#: above this the kernel's own cap (fs.nr_open, 1048576 by default) applies anyway
_MOST = 1 << 20
#: the least descriptor limit a broker takes a burst of connections with (`default_reserve`:
#: at 256 the resource hunt's 800 clients connecting at once were held off in time, at 128
#: not): under it `python -m broker` warns at start
MIN_NOFILE = 1024


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (at most 2**20); the (soft, hard) limits
    in force after.  Never raises: a limit that cannot be changed stays as it was."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = _MOST if hard == resource.RLIM_INFINITY else min(hard, _MOST)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return (-1, -1)


def nofile_limit() -> int:
    """The soft RLIMIT_NOFILE now (2**20 when unlimited or unknown)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return _MOST
    return _MOST if soft == resource.RLIM_INFINITY else soft


def open_descriptors() -> int:
    """How many descriptors this process has open (a listing of /proc/self/fd: about 100 us
    for a thousand; -1 when it cannot be listed, e.g. with none left to list it)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (the listing's own)
    except OSError:
        return -1


def default_reserve(limit: int) -> int:
    """The descriptors `Headroom` keeps free under ``limit``: an eighth of it, but a third
    up to 256 (low limits: a burst of connections that libzmq's I/O thread accepts before
    the pause takes effect must still fit: the resource hunt aborted a broker at 256 and
    384 with 800 clients connecting at once), 16 to 1024.  (At most a third: accepting
    resumes under ``limit - 2 * reserve``.)"""
    return max(16, min(1024, max(limit // 8, min(limit // 3, 256))))


def listen_backlog(reserve: int) -> int:
    """The listen backlog for a socket whose accepting a `Headroom` of ``reserve`` pauses:
    connections already queued in the kernel when it pauses are still accepted, so they
    must fit in half the reserve (libzmq's default is 100)."""
    return max(8, min(100, reserve // 2))


#: the listen backlog of a tcp endpoint (the kernel caps it at net.core.somaxconn): nothing
#: pauses its accepting (its socket has no file to move aside), and 1,000-3,000 clients
#: redialling a restarted broker overflowed libzmq's 100: the kernel dropped their
#: connections in silence, and plain clients sat on dead ones for libzmq's 30 s handshake
#: limit (the reconnect-storm audit: 34 s for the last, 7 s with this;
#: bench/results/reconnect_storm_1207).  somaxconn was 128 before Linux 5.4: raise it there
TCP_BACKLOG = 4096


class Headroom:
    """Whether to accept connections, for a process whose descriptor limit is ``limit``.

    It pauses when the descriptors in use reach ``limit - reserve`` and resumes once they
    are below ``limit - 2 * reserve``.  The count is an estimate between listings:
    ``accepted()`` adds one per connection accepted, and the process's descriptors are
    listed again (``count``) only once the estimate reaches the pause mark, and at each
    ``tick()`` while paused, so a process far from its limit pays one addition per
    connection.  The reserve (`default_reserve`) covers the connections
    libzmq accepts between its event and the pause, and the process's other descriptors.
    """

    def __init__(self, limit: int, count: Callable[[], int] = open_descriptors, reserve: int | None = None):
        self.limit = limit
        self.reserve = reserve if reserve is not None else default_reserve(limit)
        self.count = count
        self.paused = False
        self.used = max(0, count())
        self._pause_at = limit - self.reserve
        self._resume_below = limit - 2 * self.reserve

    def accepted(self, n: int = 1) -> bool:
        """``n`` connections were accepted: True when accepting must pause now."""
        self.used += n
        if self.paused or self.used < self._pause_at:
            return False
        used = self.count()
        self.used = used if used >= 0 else self.limit  # cannot even list: as full
        if self.used >= self._pause_at:
            self.paused = True
            return True
        return False

    def watch(self) -> str | None:
        """A periodic look for a process that does not see its connections come (no
        accept events): lists its descriptors; "pause" or "resume" when that changes now."""
        if self.paused:
            return "resume" if self.tick() else None
        used = self.count()
        self.used = used if used >= 0 else self.limit
        if self.used >= self._pause_at:
            self.paused = True
            return "pause"
        return None

    def tick(self) -> bool:
        """A periodic look (about once a second): True when accepting may resume now."""
        if not self.paused:
            return False
        used = self.count()
        if used < 0:
            return False
        self.used = used
        if used < self._resume_below:
            self.paused = False
            return True
        return False


def move_aside(path: str) -> str:
    """Move a listening ipc socket's file out of the way (new connects find nothing there
    and keep trying; the connections made go on); where it went.  OSError if it cannot."""
    aside = f"{path}.{os.getpid()}.paused"
    os.rename(path, aside)
    return aside


def paused_by(path: str) -> list[int]:
    """The pids of the processes that moved ``path`` aside (`move_aside`) and left it there:
    its socket files ``PATH.PID.paused``."""
    pids = []
    for aside in glob.glob(glob.escape(path) + ".*.paused"):
        pid = aside[len(path) + 1:-len(".paused")]
        if pid.isdigit():
            pids.append(int(pid))
    return pids


def put_back(aside: str, path: str) -> None:
    """Undo `move_aside`; OSError (EEXIST) when another socket took the path meanwhile, the
    file then left where it is (still ours to unlink)."""
    if os.path.exists(path):
        raise OSError(errno.EEXIST, "another socket took the path meanwhile")
    os.rename(aside, path)


def memory_limit(root: str = "/") -> int | None:
    """The bytes of memory this process may use: its cgroup's limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``: a container's or a systemd unit's MemoryMax) where there is
    one, else the machine's physical memory; None when neither can be read.  ``root``: where
    /proc and /sys are (tests).

    /proc/self/cgroup names the cgroup from the host's root when the process has no cgroup
    namespace of its own, while a container sees its own cgroup mounted at the hierarchy's
    root: the path is tried whole, then with its leading parts dropped, down to the mount
    itself (a v1 container's limit was missed, and the host's memory taken: the review)."""
    phys = None
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return phys
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            base, name = "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        steps = [p for p in path.split("/") if p]
        for k in range(len(steps) + 1):
            try:
                with open(os.path.join(root, base, *steps[k:], name)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and (best is None or int(text) < best):
                best = int(text)
            break  # (the deepest one found is this process's: "max" there is no limit)
    if best is not None and (phys is None or best < phys):
        return best
    return phys
