"""`python -m bench soak --faults` (bench/soak_faults.py): a short run with one fault of each
kind passes and leaves nothing behind; the schedule is the seed's; growth is told from
noise; a SIGTERM stops everything it started.  Counts and invariants only, no timings: the
suite runs on a loaded 2-core machine."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bench import soak_faults as sf

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def _running_with(text: str) -> list[str]:
    """Processes whose command line holds `text`."""
    return [f"{pid}: {cmd}" for pid, cmd in sf.running_with(text)]


def test_the_schedule_is_the_seed_s_and_holds_every_fault():
    plan = sf.schedule(600, 15, seed=3)
    assert plan == sf.schedule(600, 15, seed=3)
    assert plan != sf.schedule(600, 15, seed=4)
    assert all(0 < t < 600 for t, _ in plan) and [t for t, _ in plan] == sorted(t for t, _ in plan)
    assert set(Counter(k for _, k in plan)) == set(sf.FAULTS)
    assert len(sf.schedule(30, 15, seed=3)) <= 2  # a short run holds what fits, no more


def test_growth_is_judged_on_the_heap_descriptors_and_threads_still_rising_at_the_end():
    def run(anon, shmem=lambda i: 0, fds=lambda i: 20, threads=lambda i: 5):
        return [{"t": i, "anon": anon(i) * 2**20, "shmem": shmem(i) * 2**20, "rss": (anon(i) + shmem(i)) * 2**20,
                 "fds": fds(i), "threads": threads(i)} for i in range(30)]

    assert sf.growth(run(lambda i: 100 + i % 3, fds=lambda i: 20 + i % 2))["growing"] == []  # noise
    assert sf.growth(run(lambda i: 100 + 2 * i, fds=lambda i: 20 + i))["growing"] == ["anon", "fds"]  # leaks
    assert sf.growth(run(lambda i: 100, threads=lambda i: 5 + i // 3))["growing"] == ["threads"]
    assert sf.growth(run(lambda i: 100 if i < 10 else 160))["growing"] == []  # a step that holds
    assert sf.growth(run(lambda i: 100, shmem=lambda i: 8 * i))["growing"] == []  # a ring filling


def test_a_short_run_with_every_fault_passes_and_leaves_nothing_behind():
    plan = [(3.0, "worker-kill"), (5.0, "worker-drain"), (7.0, "client-kill"), (9.0, "broker-restart")]
    lines: list[str] = []
    # Generous margins: a loaded machine may be slow, never wrong.
    r = sf.run(0.3, seed=5, plan=plan, sample_s=1.0, hang_margin_s=30.0, recovery_s=60.0, log=lines.append)
    # (A call resent after the broker restart whose old copy reached the new broker too and
    # answered first had its inputs freed while the new copy was dispatched: that copy was
    # answered 400, a protocol_error nobody read.  It is the sender's cancellation now.)
    assert r["reasons"] == [] and r["aborted"] is None, r["reasons"]
    assert [f["fault"] for f in r["faults"]] == [k for _, k in plan]
    assert all(f["recovery_s"] is not None for f in r["faults"]), r["faults"]
    assert r["fault_counts"] == {k: 1 for k in sf.FAULTS}
    for kind in sf.KINDS:
        c = r["clients"][kind]
        assert c["answers_ok"] > 0 and c["wrong"] == 0 and c["overruns"] == 0, (kind, c)
        assert not any(e.startswith("untyped:") for e in c["errors"]), (kind, c)
    assert r["clients"]["victim"]["processes"] == 2  # the killed one and its successor
    assert r["broker_instances"] == 2
    assert r["probe"]["outcomes"].get("ok", 0) > 0
    assert r["left_processes"] == r["left_shm"] == r["left_files"] == []
    assert r["process_failures"] == [] and r["hangs"] == []
    run_dir = lines[0].rsplit("dir ", 1)[1]
    assert not os.path.exists(run_dir) and _running_with(run_dir) == []
    assert r["verdict"] == "PASS" and r["broker_requests_total"].get("protocol_error", 0) == 0, r["reasons"]


def test_a_sigterm_stops_everything_it_started():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "bench", "soak", "--faults", "--minutes", "5"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        # Its first line comes once everything started: the broker, workers and clients.
        r, _, _ = select.select([p.stdout], [], [], 150)
        assert r, "no first line in 150 s"
        first = p.stdout.readline().decode()
        assert first.startswith("soak with faults:"), first
        run_dir = first.rsplit("dir ", 1)[1].strip()
        assert _running_with(run_dir)  # its processes
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=150)[0].decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == 143, out
    assert "verdict: FAIL" in out and "aborted: stopped" in out, out
    deadline = time.monotonic() + 10  # a killed process is gone once reaped: at once, or nearly
    while _running_with(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running_with(run_dir) == [] and not os.path.exists(run_dir)
