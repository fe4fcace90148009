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

Must never: touch a socket or parse a frame.
"""
from __future__ import annotations

import resource

__all__ = ["raise_nofile_limit"]

#: above this the kernel's own cap (fs.nr_open, 1048576 by default) applies anyway
_MOST = 1 << 20


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
