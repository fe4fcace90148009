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
from shm.segment import SHM_DIR

ROOT = Path(__file__).resolve().parents[2]


def shm_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("zinf-")}


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

    def read(self) -> str:
        line = self.proc.stdout.readline()
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
        assert mapping_of(addr).startswith(os.path.join(SHM_DIR, ref.segment))
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


def test_sigkilled_owner_is_collected_live_owner_is_not():
    before = shm_files()
    with Child(OWNER) as dead, Child(OWNER) as live, SegmentCache() as cache:
        dead_name, off, slot, gen = dead.read().split()
        live_name = live.read().split()[0]
        assert {dead_name, live_name} <= shm_files()
        # Both owners alive: nothing to collect.
        assert dead_name not in collect() and live_name not in collect(dry_run=True)
        ref = ShmRef(dead_name, int(off), 1024, int(slot), int(gen))
        v = cache.view(ref, np.uint8, 1024)
        dead.kill9()
        assert dead_name in collect(dry_run=True)
        assert dead_name in shm_files()  # dry run touched nothing
        removed = collect()
        assert dead_name in removed and live_name not in removed
        assert dead_name not in shm_files() and live_name in shm_files()
        # The reader's mapping outlives the dead owner's name...
        assert (v == 5).all()
        # ...but the segment is gone for new descriptors, and the cache lets go of it.
        with pytest.raises(SegmentGone):
            cache.view(ref, np.uint8, 1024)
        assert dead_name not in cache
        live.kill9()
        assert live_name in collect()
    assert shm_files() == before


def test_new_pool_collects_dead_owners_once_per_process():
    with Child(OWNER) as dead:
        name = dead.read().split()[0]
        dead.kill9()
    assert name in shm_files()
    code = """
        from shm import ShmPool
        with ShmPool(4096, slots=1):
            pass
        print("done", flush=True)
    """
    with Child(code) as c:
        assert c.read() == "done"
    assert name not in shm_files()


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
        assert rows[dead_name][2] == "no"
        assert rows[live_name][-1] == "1"  # one live slot
        dry = subprocess.run([sys.executable, "-m", "shm", "gc", "--dry-run"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)
        assert f"would remove {dead_name}" in dry.stdout and dead_name in shm_files()
        gc = subprocess.run([sys.executable, "-m", "shm", "gc"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)
        assert gc.returncode == 0 and f"removed {dead_name}" in gc.stdout
        assert live_name not in gc.stdout
        assert dead_name not in shm_files() and live_name in shm_files()
        live.kill9()
        collect()
    assert live_name not in shm_files()


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
    assert name not in shm_files()
