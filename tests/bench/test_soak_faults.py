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
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def test_the_schedule_is_the_seed_s_and_holds_every_fault():
    plan = sf.schedule(600, 15, seed=3)
    assert plan == sf.schedule(600, 15, seed=3)
    assert plan != sf.schedule(600, 15, seed=4)
    assert all(0 < t < 600 for t, _ in plan) and [t for t, _ in plan] == sorted(t for t, _ in plan)
    assert set(Counter(k for _, k in plan)) == set(sf.FAULTS)
    assert len(sf.schedule(30, 15, seed=3)) <= 2  # a short run holds what fits, no more


def test_growth_is_judged_by_thirds_that_keep_rising():
    flat = [{"t": i, "rss": 100 * 2**20 + (i % 3) * 2**20, "fds": 20 + i % 2, "threads": 5} for i in range(30)]
    assert sf.growth(flat)["growing"] == []
    leak = [{"t": i, "rss": (100 + 2 * i) * 2**20, "fds": 20 + i, "threads": 5} for i in range(30)]
    assert sf.growth(leak)["growing"] == ["rss", "fds"]
    warmup = [{"t": i, "rss": (100 if i < 10 else 160) * 2**20, "fds": 20, "threads": 5} for i in range(30)]
    assert sf.growth(warmup)["growing"] == []  # up once, then flat: not a leak


def test_a_short_run_with_every_fault_passes_and_leaves_nothing_behind():
    plan = [(3.0, "worker-kill"), (5.0, "worker-drain"), (7.0, "client-kill"), (9.0, "broker-restart")]
    lines: list[str] = []
    # Generous margins: a loaded machine may be slow, never wrong.
    r = sf.run(0.3, seed=5, plan=plan, sample_s=1.0, hang_margin_s=30.0, recovery_s=60.0, log=lines.append)
    assert r["verdict"] == "PASS", r["reasons"]
    assert r["reasons"] == [] and r["aborted"] is None
    assert [f["fault"] for f in r["faults"]] == [k for _, k in plan]
    assert all(f["recovery_s"] is not None for f in r["faults"]), r["faults"]
    assert r["fault_counts"] == {k: 1 for k in sf.FAULTS}
    for kind in sf.KINDS:
        c = r["clients"][kind]
        assert c["answers_ok"] > 0 and c["wrong"] == 0 and c["overruns"] == 0, (kind, c)
        assert not any(e.startswith("untyped:") for e in c["errors"]), (kind, c)
    assert r["clients"]["victim"]["processes"] == 2  # the killed one and its successor
    assert r["broker_instances"] == 2 and r["broker_requests_total"].get("protocol_error", 0) == 0
    assert r["probe"]["outcomes"].get("ok", 0) > 0
    assert r["left_processes"] == r["left_shm"] == r["left_files"] == []
    assert r["process_failures"] == [] and r["hangs"] == []
    run_dir = lines[0].rsplit("dir ", 1)[1]
    assert not os.path.exists(run_dir) and _running_with(run_dir) == []


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
