"""Run a command as pid 1 of a pid namespace of its own, with its own /proc (as a container
without a shared pid namespace runs it), forwarding SIGTERM and SIGINT to it and exiting
with its status: ``python own_pidns.py PROGRAM ARGS...``.  Linux, root only; exits 125 with
the reason when the namespace cannot be made (the caller skips)."""

import ctypes
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

libc = ctypes.CDLL(None, use_errno=True)


def fail(what: str) -> None:
    print(f"own_pidns: {what}: {os.strerror(ctypes.get_errno())}", file=sys.stderr, flush=True)
    os._exit(125)


if libc.unshare(CLONE_NEWPID | CLONE_NEWNS) != 0:
    fail("unshare")
child = os.fork()
if child == 0:
    # Our own /proc, for the new pid namespace, in a mount namespace of our own.
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        fail("mount --make-rprivate /")
    if libc.mount(b"proc", b"/proc", b"proc", 0, None) != 0:
        fail("mount proc")
    os.execvp(sys.argv[1], sys.argv[1:])


def forward(signum, _frame):
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
