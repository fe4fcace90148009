"""Two real processes: zero-copy reads, remote release, crash cleanup, the CLI.

Children are plain ``sys.executable -c`` subprocesses talking line by line over pipes;
every wait is on a line from the child (never a sleep), and every child is killed and
reaped in a ``finally``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shm import RELEASED, SegmentCache, SegmentGone, ShmPool, ShmRef, StaleDescriptor, collect
from shm.gc import list_segments
from shm.segment import SHM_DIR
from tests.children import readline_within

ROOT = Path(__file__).resolve().parents[2]


def _label(name: str) -> str:
    """A segment's name without its descriptor number: the owner may hold the segment under
    several descriptors (its mapping's duplicate, at whatever number was free), and
    `list_segments` names it by the lowest, not always the one its pool was made with."""
    return name.rpartition("-")[0]


def live_segments() -> set[str]:
    """The labels (`_label`) of the live segments."""
    return {_label(s.name) for s in list_segments(count_slots=False)}


class Child:
    """A Python subprocess running ``code``, driven by lines on stdin/stdout."""

    def __init__(self, code: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.pid = self.proc.pid

    def read(self, timeout: float = 30.0) -> str:
        """The child's next line, waited for at most ``timeout`` s."""
        line = readline_within(self.proc.stdout, timeout, f"a line from the child {self.pid}")
        if not line:
            self.proc.wait(timeout=10)
            raise AssertionError(f"child exited with {self.proc.returncode}: {self.proc.stderr.read()}")
        return line.strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Let the child finish (EOF on stdin), or kill it; always reap it."""
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.proc.poll() is None:
            self.proc.kill()
        self.close()


WRITER = """
    import json, sys
    import numpy as np
    from shm import ShmPool
    with ShmPool(1 << 20, slots=16) as pool:
        a = pool.alloc((64, 64), np.uint8)
        a[:] = (np.arange(64 * 64) % 251).reshape(64, 64)
        ref = pool.ref_of(a)
        pool.mark_in_flight(ref)
        print(json.dumps(list(ref)), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "poke":
                a.flat[int(cmd[1])] = int(cmd[2])
                print("ok", flush=True)
            elif cmd[0] == "reclaim":
                print(pool.reclaim(), pool.in_use(), flush=True)
"""


def mapping_of(addr: int) -> str | None:
    """The file backing the mapping that contains ``addr`` in this process, from /proc."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) == 6 else ""
    return None


def test_reader_sees_writer_bytes_in_place():
    with Child(WRITER) as w, SegmentCache() as cache:
        ref = ShmRef(*json.loads(w.read()))
        assert ref.segment.startswith(f"zinf-{w.pid}-")
        v = cache.view(ref, np.uint8, (64, 64))
        assert (v.ravel() == np.arange(64 * 64) % 251).all()
        # The view's memory is the shared file itself, not a copy.
        addr = v.__array_interface__["data"][0]
        assert mapping_of(addr) == f"/memfd:{ref.segment.rsplit('-', 1)[0]} (deleted)"
        # A store in the writer shows up in the view we already have.
        w.send("poke 100 7")
        assert w.read() == "ok"
        assert v.flat[100] == 7
        w.send("poke 4095 200")
        assert w.read() == "ok"
        assert v[63, 63] == 200
        del v
        cache.forget(ref.segment)


def test_remote_release_then_owner_reclaim():
    with Child(WRITER) as w, SegmentCache() as cache:
        ref = ShmRef(*json.loads(w.read()))
        w.send("reclaim")
        assert w.read() == "0 1"  # in flight, nobody released it yet
        assert cache.view(ref, np.uint8, 4096).sum() > 0
        cache.release(ref)
        w.send("reclaim")
        assert w.read() == "1 0"
        with pytest.raises(StaleDescriptor):
            cache.view(ref, np.uint8, 4096)


READER = """
    import json, sys
    import numpy as np
    from shm import SegmentCache, ShmRef
    with SegmentCache() as cache:
        print("ready", flush=True)
        for line in sys.stdin:
            cmd, arg = line.split(" ", 1)
            ref = ShmRef(*json.loads(arg))
            v = cache.view(ref, np.float32, ref.nbytes // 4)
            print(float(v.sum()), flush=True)
            if cmd == "release":
                cache.release(ref)
                print("released", flush=True)
"""


def test_reader_process_releases_owner_reclaims():
    with ShmPool(1 << 16, slots=4) as pool, Child(READER) as r:
        assert r.read() == "ready"
        a = pool.alloc(256, np.float32)
        a[:] = 0.5
        ref = pool.ref_of(a)
        pool.mark_in_flight(ref, holder_pid=r.pid)
        r.send("release " + json.dumps(list(ref)))
        assert r.read() == "128.0"
        assert r.read() == "released"
        assert pool.table[ref.slot]["state"] == RELEASED
        assert pool.reclaim() == 1
        assert pool.in_use() == 0


def test_a_slot_lent_to_a_process_whose_pid_is_now_anothers_is_reclaimed_at_once():
    # The broker attested a pid and its start time; by the time the worker lends the slot the
    # pid is another process's (the attested one exited): that holder is gone already.
    from shm.segment import proc_starttime

    with ShmPool(1 << 16, slots=4) as pool, Child(READER) as r:
        assert r.read() == "ready"
        start = proc_starttime(r.pid)
        lent = []
        for holder_start in (start, start - 1):  # the process that has the pid, and one before it
            ref = pool.ref_of(pool.alloc(16, np.float32))
            pool.mark_in_flight(ref, holder_pid=r.pid, holder_start=holder_start)
            lent.append(ref)
        assert pool.reclaim() == 1 and pool.in_use() == 1  # the live holder's slot stays
        assert pool.table[lent[0].slot]["state"] == 2  # IN_FLIGHT


def test_in_flight_slots_of_a_killed_reader_are_reclaimed():
    with ShmPool(1 << 16, slots=4) as pool, Child(READER) as r:
        assert r.read() == "ready"
        a = pool.alloc(16, np.float32)
        a[:] = 1.0
        ref = pool.ref_of(a)
        pool.mark_in_flight(ref, holder_pid=r.pid)
        r.send("view " + json.dumps(list(ref)))
        assert r.read() == "16.0"  # it holds the slot and never releases it
        assert pool.reclaim() == 0  # holder alive: keep
        r.kill9()
        assert pool.reclaim() == 1
        assert pool.in_use() == 0


def test_a_holder_that_released_and_left_costs_the_owner_no_descriptor():
    # The owner caches a pidfd per holder (how it tells the holder is still the same
    # process); one that released everything and left is never asked about again, so
    # reclaim closes the pidfds of the holders that exited.
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with ShmPool(1 << 16, slots=4) as pool:
        before = fds()
        for _ in range(3):
            with Child(READER) as r:
                assert r.read() == "ready"
                a = pool.alloc(16, np.float32)
                a[:] = 1.0
                ref = pool.ref_of(a)
                del a
                pool.mark_in_flight(ref, holder_pid=r.pid)
                r.send("release " + json.dumps(list(ref)))
                assert r.read() == "16.0" and r.read() == "released"
                assert pool.reclaim() == 1
                assert list(pool._holders._cache) == [r.pid]  # its pidfd, while it lives (the last one's closed)
                r.kill9()
        pool.reclaim()
        assert fds() == before and pool._holders._cache == {}


OWNER = """
    import sys
    import numpy as np
    from shm import ShmPool
    pool = ShmPool(1 << 20, slots=8)
    a = pool.alloc(1024, np.uint8)
    a[:] = 5
    ref = pool.ref_of(a)
    pool.mark_in_flight(ref)
    print(pool.name, ref.offset, ref.slot, ref.generation, flush=True)
    sys.stdin.read()  # block until killed
"""


def test_sigkilled_owners_segment_is_gone_but_mapped_memory_stays_valid():
    with Child(OWNER) as dead, Child(OWNER) as live, SegmentCache() as cache:
        dead_name, off, slot, gen = dead.read().split()
        live_name = live.read().split()[0]
        assert {_label(dead_name), _label(live_name)} <= live_segments()
        assert not os.path.exists(os.path.join(SHM_DIR, dead_name))  # nothing in any filesystem
        ref = ShmRef(dead_name, int(off), 1024, int(slot), int(gen))
        v = cache.view(ref, np.uint8, 1024)
        dead.kill9()
        assert _label(dead_name) not in live_segments() and _label(live_name) in live_segments()
        # The reader's mapping outlives the dead owner (the kernel frees the pages with
        # the last mapping)...
        assert (v == 5).all()
        # ...the reader's sweep lets go of it, and the segment is gone for new descriptors.
        assert cache.sweep() == [dead_name]
        with pytest.raises(SegmentGone):
            cache.view(ref, np.uint8, 1024)
        assert dead_name not in cache
        # Nothing was ever left behind to collect (another test run's files on this host
        # may be: only the dead owner's are looked for, and nothing is removed).
        owner = dead_name.split("-")[1:3]
        assert [n for n in collect(dry_run=True) if n.split("-")[1:3] == owner] == []


LEGACY = "zinf-{pid}-{start}-0123456789abcdef"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def test_collect_removes_legacy_files_of_dead_owners_only(tmp_path, monkeypatch):
    # Earlier versions named segments in /dev/shm; a crashed one may have left files there.
    # Here in a folder of the test's own: a broker running beside it on this host (a second
    # test process) collects /dev/shm's every few seconds, and would take them first.
    import shm.gc

    monkeypatch.setattr(shm.gc, "SHM_DIR", str(tmp_path))
    dead = os.path.join(tmp_path, LEGACY.format(pid=_dead_pid(), start=1))
    mine = os.path.join(tmp_path, LEGACY.format(pid=os.getpid(), start=1))  # wrong start: dead too
    other = os.path.join(tmp_path, "zinf-not-a-segment")
    for p in (dead, mine, other):
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    try:
        assert set(collect(dry_run=True)) >= {os.path.basename(dead), os.path.basename(mine)}
        assert os.path.exists(dead)
        removed = collect()
        assert os.path.basename(dead) in removed and os.path.basename(mine) in removed
        assert not os.path.exists(dead) and not os.path.exists(mine) and os.path.exists(other)
    finally:
        for p in (dead, mine, other):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def test_listing_survives_a_segment_whose_header_lies():
    # Any process of the user can make a memfd with our label and a header of its own:
    # one claiming 2**32 - 1 slots in a 128-byte file is listed without a slot count,
    # and the others are listed as before.
    from shm.segment import HEADER_DTYPE, MAGIC, VERSION, self_identity

    pid, start = self_identity()
    label = f"zinf-{pid}-{start}-{'cd' * 8}"
    fd = os.memfd_create(label, os.MFD_CLOEXEC)
    try:
        h = np.zeros((), HEADER_DTYPE)
        h["magic"], h["version"], h["slot_count"] = MAGIC, VERSION, 0xFFFFFFFF
        os.write(fd, h.tobytes())
        with ShmPool(1 << 16, slots=4) as good:
            rows = {_label(info.name): info for info in list_segments()}
            assert rows[label].live_slots is None
            assert rows[_label(good.name)].live_slots == 0
    finally:
        os.close(fd)


def test_cli_ls_and_gc():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with Child(OWNER) as live, Child(OWNER) as dead:
        live_name = live.read().split()[0]
        dead_name = dead.read().split()[0]
        dead.kill9()
        ls = subprocess.run([sys.executable, "-m", "shm", "ls"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)
        assert ls.returncode == 0, ls.stderr
        rows = {line.split()[0]: line.split() for line in ls.stdout.splitlines()[1:]}
        assert rows[live_name][1] == str(live.pid) and rows[live_name][2] == "yes"
        assert dead_name not in rows
        assert rows[live_name][-1] == "1"  # one live slot
    legacy = os.path.join(SHM_DIR, LEGACY.format(pid=_dead_pid(), start=1))
    try:
        # Any broker running on this host collects such files too (every few seconds): if one
        # took it between our write and the dry run, or the real run, write it again (a few
        # tries; once a run found it gone, the run says nothing of it).
        gc = None
        for _ in range(5):
            with open(legacy, "wb") as f:
                f.write(b"\0" * 4096)
            dry = subprocess.run([sys.executable, "-m", "shm", "gc", "--dry-run"], capture_output=True, text=True,
                                 cwd=ROOT, env=env, timeout=30)
            if not os.path.exists(legacy):
                continue
            assert f"would remove {os.path.basename(legacy)}" in dry.stdout
            gc = subprocess.run([sys.executable, "-m", "shm", "gc"], capture_output=True, text=True, cwd=ROOT,
                                env=env, timeout=30)
            assert gc.returncode == 0, gc.stderr
            if f"removed {os.path.basename(legacy)}" in gc.stdout:
                break
        assert gc is not None and f"removed {os.path.basename(legacy)}" in gc.stdout
        assert not os.path.exists(legacy)
    finally:
        if os.path.exists(legacy):
            os.unlink(legacy)


def test_pool_left_open_is_unlinked_at_normal_exit():
    # Neither close() nor a with-block: a global pool, and an object whose __del__ closes
    # it during interpreter shutdown.  Both paths must be quiet and leave no file.
    code = """
        import numpy as np
        from shm import ShmPool
        pool = ShmPool(1 << 16, slots=4)
        kept = pool.alloc(16, np.uint8)
        class Closer:
            def __del__(self):
                pool.close()
        closer = Closer()
        print(pool.name, flush=True)
    """
    with Child(code) as c:
        name = c.read()
        assert c.proc.wait(timeout=30) == 0
        err = c.proc.stderr.read()
    assert "Traceback" not in err and "Exception" not in err, err
    assert _label(name) not in live_segments()


def test_collect_skips_another_users_files_before_asking_about_their_owner(tmp_path, monkeypatch):
    # /dev/shm is anyone's to write: files of another user, named as a dead owner's, were each
    # judged (a /proc read, an open) and kept, on every pass (the shm audit: 100,000 of them
    # cost 0.45 s a pass, in the broker's loop).  A non-root collector skips them unread.
    import shm.gc

    monkeypatch.setattr(shm.gc, "SHM_DIR", str(tmp_path))
    planted = os.path.join(tmp_path, LEGACY.format(pid=_dead_pid(), start=1))
    with open(planted, "wb") as f:
        f.write(b"\0" * 4096)
    asked = []
    monkeypatch.setattr(shm.gc, "process_alive", lambda pid, start: asked.append(pid) or False)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # as a non-root user (the file is neither's)
    assert collect() == [] and asked == [] and os.path.exists(planted)
