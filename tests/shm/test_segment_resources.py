"""A segment whose memfd was made but cannot be mapped now, for want of memory (mmap under
RLIMIT_AS: ENOMEM) or of a descriptor (Python's mmap keeps a duplicate of the file: EMFILE):
`OutOfResources`, as when memfd_create itself fails for those reasons, so that its caller
tries again later (a client kept shared memory off for its life on the plain `ShmError`), and
no descriptor is left behind.  Real limits, in a process of their own."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import os, resource, sys
from shm import OutOfResources, ShmError, ShmPool

def vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10

def fds():
    return len(os.listdir("/proc/self/fd"))

mode = sys.argv[1]
before = fds()
if mode == "memory":
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (64 << 20), old[1]))
    held = []
else:
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, old[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    os.close(held.pop())  # one left: the memfd is made, mmap's duplicate of it is not
try:
    ShmPool(256 << 20 if mode == "memory" else 1 << 20)
except OutOfResources as e:
    print("OutOfResources", flush=True)
except ShmError as e:
    print("ShmError", e, flush=True)
finally:
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_AS if mode == "memory" else resource.RLIMIT_NOFILE, old)
print("descriptors left behind:", fds() - before, flush=True)
pool = ShmPool(1 << 20)  # limits back: made
pool.close()
print("then: made", flush=True)
"""


def test_a_segment_that_cannot_be_mapped_now_is_out_of_resources():
    root = Path(__file__).resolve().parents[2]
    for mode in ("memory", "descriptors"):
        p = subprocess.run([sys.executable, "-c", _SCRIPT, mode], cwd=root, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0 and p.stdout.splitlines() == [
            "OutOfResources", "descriptors left behind: 0", "then: made"], \
            (mode, p.returncode, p.stdout, p.stderr[-3000:])


def test_clock_peers_trust_a_pid_only_for_the_process_that_started_when_attested():
    """`ClockPeers.same`: a process on our clock is (this one, and its pid with its start
    time); a pid whose process did not start at the attested time (attested in another pid
    namespace, or reused) says nothing of the client's clock, nor one that does not exist."""
    import os

    from shm.segment import ClockPeers, proc_starttime

    peers = ClockPeers(limit=2)
    me = os.getpid()
    start = proc_starttime(me)
    assert peers.same(me) and peers.same(me, start)
    assert not peers.same(me, start + 1)
    assert not peers.same(2 ** 22 + 12345)  # above pid_max's default: no such process
    for k in range(5):  # bounded: forgotten at the limit, asked again
        peers.same(me, start) if k % 2 else peers.same(me)
    assert len(peers._known) <= 2
