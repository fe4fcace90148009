"""Attacks on the shared-memory plane, tried with real processes (issue "Secure by default").

- A client names another process's segment in its request: refused before the worker opens
  anything, with one message whatever the descriptor says (no oracle for bounds, slots or
  generations), and the victim's own calls are untouched.
- Nobody can shrink a segment: the seals make ``ftruncate`` fail, even for its owner; a
  segment without those seals is never mapped, so truncating it afterwards harms nobody.
- A forged ``pid`` in the header pins no output slot: the worker frees the slots of a
  client that died by the pid the kernel attested for its connection.
- Another user cannot open a segment at all (the owner's /proc/<pid>/fd is not theirs).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

import shm
import shm.segment as seg
from broker import protocol as P
from client_sdk import Client, InferenceError
from gpu_worker.planes import NOT_ATTESTED, NOT_OWNED
from tests.e2e.conftest import ROOT, wait_service
from tests.children import readline_within

HOST = P.local_host_id()

VICTIM = """
import sys
import numpy as np
from shm import ShmPool
pool = ShmPool(1 << 20, slots=8)
secret = pool.alloc(4096, np.uint8)
secret[:] = 0x5A
ref = pool.ref_of(secret)
pool.mark_in_flight(ref)
print(*ref, flush=True)
sys.stdin.read()  # hold it until the test ends
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)
    for f in (p.stdin, p.stdout, p.stderr):
        f.close()


def _raw_call(endpoint: str, header: P.Request, frames=(), timeout_ms: int = 10_000) -> P.Reply:
    """One request on a fresh raw DEALER; the decoded FINAL header."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(endpoint)
        s.send_multipart(P.client_request("echo", [P.encode_header(header), *frames]))
        assert s.poll(timeout_ms), "no reply"
        msg = s.recv_multipart()
        return P.decode_reply(msg[3], n_inline=len(msg) - 4)
    finally:
        s.close(0)


def test_a_descriptor_into_another_processs_segment_is_refused_and_tells_nothing(cluster):
    cluster.broker()
    cluster.worker("echo")
    victim = _child(VICTIM)
    try:
        name, off, nb, slot, gen = readline_within(victim.stdout, 30, "the victim's secret slot").split()
        ref = shm.ShmRef(name, int(off), int(nb), int(slot), int(gen))
        with Client(cluster.frontend, timeout=10) as c:
            wait_service(c, "echo")
        messages = set()
        # The exact descriptor, and guesses a probing attacker would try next: each answer
        # is the same 400, so none tells it which guess was closer.
        for i, guess in enumerate([ref, ref._replace(generation=ref.generation + 1), ref._replace(slot=7),
                                   ref._replace(offset=0), ref._replace(nbytes=1 << 30)]):
            t = P.TensorRef(name="x", dtype="|u1", shape=[guess.nbytes], loc=P.shm_loc(guess))
            rep = _raw_call(cluster.frontend, P.Request(id=i + 1, host=HOST, reply="inline", tensors=[t]))
            assert rep.error is not None and rep.error.code == P.ErrorCode.PROTOCOL_ERROR
            assert not rep.tensors
            messages.add(rep.error.message)
        assert messages == {f"cannot read inputs: {NOT_OWNED}"}
        assert name not in NOT_OWNED and "slot" not in NOT_OWNED and "generation" not in NOT_OWNED
        # Claiming to be the victim in the header changes nothing: the broker attests the pid.
        t = P.TensorRef(name="x", dtype="|u1", shape=[ref.nbytes], loc=P.shm_loc(ref))
        rep = _raw_call(cluster.frontend, P.Request(id=9, host=HOST, pid=victim.pid, reply="inline", tensors=[t]))
        assert rep.error is not None and rep.error.message.endswith(NOT_OWNED)
        # Everyone else is served as before, over shared memory too.
        with Client(cluster.frontend, timeout=10, transport="shm") as c:
            x = np.arange(1000, dtype=np.int32)
            with c.infer("echo", {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)
    finally:
        _stop(victim)


def test_nobody_can_shrink_a_segment_and_an_unsealed_one_is_never_mapped(cluster, monkeypatch):
    cluster.broker()
    w = cluster.worker("echo")
    with Client(cluster.frontend, timeout=10, transport="shm") as c:
        wait_service(c, "echo")
        x = np.arange(4096, dtype=np.uint8)
        with c.infer("echo", {"x": x}) as r:  # the worker has this client's segment mapped now
            np.testing.assert_array_equal(r["x"], x)
        fd = os.open(seg.path_of(c.pool.name), os.O_RDWR)
        try:
            for size in (0, 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
        finally:
            os.close(fd)
        with c.infer("echo", {"x": x}) as r:
            np.testing.assert_array_equal(r["x"], x)

    # A client whose segment lacks the seals (here: this process, with the seals skipped).
    class NoSeals:
        def __getattr__(self, name):
            return getattr(fcntl, name)

        @staticmethod
        def fcntl(fd, cmd, arg=0):
            return 0 if cmd == fcntl.F_ADD_SEALS else fcntl.fcntl(fd, cmd, arg)

    monkeypatch.setattr(seg, "fcntl", NoSeals())
    with Client(cluster.frontend, timeout=10, transport="shm") as bad:
        with pytest.raises(InferenceError, match="not sealed"):
            bad.infer("echo", {"x": np.zeros(8192, np.uint8)})
        fd = os.open(seg.path_of(bad.pool.name), os.O_RDWR)
        try:
            # Cut off the data area: had a worker mapped it, its next read would be SIGBUS.
            os.ftruncate(fd, bad.pool.data_offset)
        finally:
            os.close(fd)
        monkeypatch.undo()
    with Client(cluster.frontend, timeout=10, transport="shm") as c:
        with c.infer("echo", {"x": x}) as r:
            np.testing.assert_array_equal(r["x"], x)
    assert w.p.poll() is None  # the worker never faulted


def test_a_hugetlb_memfd_is_refused_and_its_worker_lives(cluster):
    # A client made its segment with MFD_HUGETLB and the seals asked for: once the worker
    # had it mapped, the client punched a hole in it (allowed by the seals), took the freed
    # huge page, and the worker's next read of that mapping was a SIGBUS: the worker died,
    # and every client of its service with it.  Only shmem is mapped now.
    cluster.broker()
    w = cluster.worker("echo")
    pid, start = seg.self_identity()
    label = f"zinf-{pid}-{start}-{'ef' * 8}"
    try:
        fd = os.memfd_create(label, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC | os.MFD_HUGETLB)
    except OSError as e:
        pytest.skip(f"no hugetlb memfds here: {e}")
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seg.SEALS)
        with Client(cluster.frontend, timeout=10) as c:
            wait_service(c, "echo")
        t = P.TensorRef(name="x", dtype="|u1", shape=[4096], loc=P.ShmLoc(f"{label}-{fd}", 0, 4096, 0, 1))
        rep = _raw_call(cluster.frontend, P.Request(id=1, host=HOST, reply="inline", tensors=[t]))
        assert rep.error is not None and rep.error.code == P.ErrorCode.PROTOCOL_ERROR
        assert "not shmem" in rep.error.message, rep.error.message
    finally:
        os.close(fd)
    with Client(cluster.frontend, timeout=10, transport="shm") as c:
        x = np.arange(4096, dtype=np.uint8)
        with c.infer("echo", {"x": x}) as r:
            np.testing.assert_array_equal(r["x"], x)
    assert w.p.poll() is None


def test_a_connection_outliving_the_process_that_made_it_reads_nobodys_memory(tmp_path):
    # The broker attests the pid that made a client's ipc connection (SO_PEERCRED).  A process
    # that connects, forks and exits leaves its child a connection the kernel still reports
    # by the dead parent's pid: the broker attested that pid for the child's requests, and
    # once another process had it, the child read that process's shared memory through the
    # worker (found by the shared-memory hunt).  Now a connection whose maker has exited is
    # not attested, and the attestation carries the process's start time, which the worker
    # checks with the pid: a reused pid is another process.  Run in a pid namespace of its
    # own, where a pid can be reused at once (tests/e2e/stale_pid.py).
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode(errors='replace').strip()}")
    run = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable,
                          os.path.join(ROOT, "tests", "e2e", "stale_pid.py"), str(tmp_path)],
                         capture_output=True, timeout=120, cwd=ROOT)
    out = run.stdout.decode()
    assert run.returncode == 0, (out, run.stderr.decode(errors="replace")[-3000:])
    got = dict(line.split(" ", 1) for line in out.splitlines())
    # Unattested: shared memory is refused as NOT_LOCAL (the same tensors inline are served),
    # so that our SDK on such a connection resends inline and its call succeeds.
    assert re.fullmatch(rf"refused 421 worker pid \d+ cannot read the inputs: {re.escape(NOT_ATTESTED)}",
                        got["late"]), got
    assert got["sdk"] == "same", got
    assert got["reused"] == f"refused 400 cannot read inputs: {NOT_OWNED}", got


HOLDER = """
import sys
import numpy as np
import zmq
from broker import protocol as P
s = zmq.Context.instance().socket(zmq.DEALER)
s.linger = 0
s.connect(sys.argv[1])
forged = [1, 2, 999999999, int(sys.argv[2])]
for i in range(8):
    t = P.TensorRef(name="x", dtype="|u1", shape=[4096], loc=P.InlineLoc(frame=0))
    req = P.Request(id=i + 1, host=P.local_host_id(), pid=forged[i % len(forged)], reply="shm", tensors=[t])
    s.send_multipart(P.client_request("echo", [P.encode_header(req), bytes(4096)]))
for _ in range(8):
    assert s.poll(10000)
    msg = s.recv_multipart()
    assert P.decode_reply(msg[3]).error is None
print("HELD", flush=True)  # eight output slots lent, never released
sys.stdin.read()
"""


def _live_slots(owner_pid: int) -> int:
    from shm.gc import list_segments

    return sum(s.live_slots or 0 for s in list_segments() if s.owner_pid == owner_pid)


def test_forged_pids_pin_no_output_slot(cluster):
    b = cluster.broker()
    w = cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    holder = _child(HOLDER, cluster.frontend, str(b.p.pid))  # among the claims: a live process
    try:
        said = readline_within(holder.stdout, 30, "the holder's HELD (its 8 calls answered)")
        assert said.strip() == "HELD", holder.stderr.read() if holder.poll() else ""
        worker_pid = int(w.field("pid"))
        assert _live_slots(worker_pid) >= 8
        holder.kill()
        holder.wait(10)
        deadline = time.monotonic() + 5.0
        while _live_slots(worker_pid) > 0:  # freed by the holder the kernel named, not the claims
            assert time.monotonic() < deadline, f"{_live_slots(worker_pid)} output slots still pinned"
            time.sleep(0.02)
    finally:
        _stop(holder)


NOBODY = 65534


def _nobody_python() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another user")
    py = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if py is None:
        pytest.skip("no system python3 that another user can run")
    try:
        ok = subprocess.run([py, "-c", "pass"], user=NOBODY, group=NOBODY, timeout=30, capture_output=True)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot run a process as uid {NOBODY}: {e}")
    if ok.returncode != 0:
        pytest.skip(f"cannot run {py} as uid {NOBODY}: {ok.stderr[-200:]!r}")
    return py


def test_another_user_cannot_open_a_segment():
    py = _nobody_python()
    with shm.ShmPool(1 << 16, slots=4) as pool:
        a = pool.alloc(64, np.uint8)
        a[:] = 7
        path = seg.path_of(pool.name)
        probe = ("import os, sys\n"
                 "try:\n"
                 "    os.open(sys.argv[1], os.O_RDONLY)\n"
                 "except PermissionError:\n"
                 "    print('EACCES')\n"
                 "else:\n"
                 "    print('OPENED')\n")
        got = subprocess.run([py, "-c", probe, path], user=NOBODY, group=NOBODY, timeout=30,
                             capture_output=True, text=True)
        assert got.stdout.strip() == "EACCES", (got.stdout, got.stderr)
        # Nor is there a name in /dev/shm to open instead.
        assert not any(n.startswith(pool.name.rsplit("-", 1)[0]) for n in os.listdir(seg.SHM_DIR))


def test_a_slot_its_sender_freed_since_is_a_cancellation_and_a_slot_it_never_had_a_400(cluster):
    """A request naming a slot of the sender's own memory that the sender freed since (its
    generation moved on: a copy of a call already answered, sent again after a broker
    restart or a worker's death) is answered 499, taken as cancelled by its sender, with
    nothing read; one naming a generation the slot never had, or a slot not yet handed off
    (WRITING), is a forged or early reference: 400, as before."""
    from shm import ShmPool

    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    pool = ShmPool(1 << 20, slots=8)
    try:
        def call(i: int, ref) -> P.Reply:
            t = P.TensorRef(name="x", dtype="|u1", shape=[ref.nbytes], loc=P.shm_loc(ref))
            return _raw_call(cluster.frontend, P.Request(id=i, host=HOST, reply="inline", tensors=[t]))

        a = pool.alloc(64, np.uint8)
        a[:] = 7
        freed = pool.ref_of(a)
        pool.mark_in_flight(freed)
        rep = call(1, freed)  # in flight: served
        assert rep.error is None and len(rep.tensors) == 1
        pool.free(freed)
        rep = call(2, freed)
        assert rep.error is not None and rep.error.code == P.ErrorCode.CANCELLED, rep.error
        assert "taken as cancelled by its sender" in rep.error.message and not rep.tensors

        b = pool.alloc(64, np.uint8)
        live = pool.ref_of(b)
        rep = call(3, live)  # WRITING: never handed off
        assert rep.error is not None and rep.error.code == P.ErrorCode.PROTOCOL_ERROR, rep.error
        pool.mark_in_flight(live)
        rep = call(4, live._replace(generation=live.generation + 1))  # a generation it never had
        assert rep.error is not None and rep.error.code == P.ErrorCode.PROTOCOL_ERROR, rep.error
        assert call(5, live).error is None  # the real one still serves
    finally:
        pool.close()
