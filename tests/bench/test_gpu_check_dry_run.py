"""`python -m bench.gpu_check --dry-run` writes valid JSON and never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shm.cuda import cuda_status

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1 and doc["dry_run"] is True
    assert "bench.gpu_check --dry-run" in doc["command"]
    assert doc["versions"]["python"] and "torch" in doc["versions"]
    assert set(doc["checks"]) == {"gpu_tests", "ipc_roundtrip", "no_host_copy", "latency", "product_latency",
                                  "cuda_stages", "keep_warm"}
    ok, _ = cuda_status()
    for check in doc["checks"].values():
        assert check["status"] == "skipped"
        if not ok:
            assert "no CUDA device" in check["reason"]
    assert doc["ok"] is True and not list(tmp_path.glob("*.tmp"))


def test_default_out_follows_OUT(monkeypatch, tmp_path):
    from bench import gpu_check

    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.default_out() == tmp_path / "gpu_check.json"
    monkeypatch.delenv("OUT")
    assert gpu_check.default_out() == ROOT / "bench" / "results" / "gpu_check.json"


def test_memcpy_counting_by_direction():
    from bench.gpu_check import memcpy_counts

    class E:
        def __init__(self, name):
            self.name = name

    class Prof:
        def events(self):
            return [E(n) for n in ("Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD (Device -> Device)",
                                   "Memcpy DtoD (Device -> Device)", "cudaMemcpyAsync", "aten::copy_",
                                   "Memcpy DtoH (Device -> Pageable)", "Memset (Device)")]

    c = memcpy_counts(Prof())
    assert (c["htod"], c["dtoh"], c["dtod"], c["other_memcpy"]) == (1, 1, 2, 0)
    assert c["names"]["cudaMemcpyAsync"] == 1


def test_a_section_that_runs_past_its_time_takes_its_whole_process_tree_with_it(tmp_path):
    """`_run_group`: a section's child whose own children hold the output pipe (the brokers
    and workers of `gpu_product`, the pytest cluster) is stopped with all of them on a
    timeout, and the read of its output does not wait for them."""
    import time

    from bench import gpu_check

    report = gpu_check.Report(tmp_path / "gc.json", [], 60, False)
    marker = f"gpu-check-orphan-{os.getpid()}"
    cmd = [sys.executable, "-c", "import subprocess, sys, time; "
           f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}]); "
           "print('started', flush=True); time.sleep(120)"]
    t0 = time.monotonic()
    rc, out = gpu_check._run_group(report, cmd, 1.0)
    assert rc is None and out == "started\n" and time.monotonic() - t0 < 30
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left == "" and report.children == []


def test_the_benches_gpu_check_runs_need_only_the_device_image(tmp_path):
    """The GPU image has torch, numpy, pyzmq and msgspec carried, not hdrh: every bench a
    `gpu_check` section runs (and the report helpers they write with) must import without
    it, as `worker_stages` once did not (its two sections failed on the H200)."""
    code = ("import sys; sys.modules['hdrh'] = None\n"  # an import of hdrh now raises ImportError
            "import bench.report, bench.gpu_check, bench.gpu_product, bench.worker_stages, bench.lean_floor, bench.keep_warm\n"
            "bench.report.print_and_save({'ok': 1}, sys.argv[1])\n")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["ok"] == 1


def test_python_m_bench_without_the_bench_extra_is_one_line(tmp_path):
    """Installed without the bench extra (as deploy.md installs), `python -m bench` was a
    ModuleNotFoundError traceback (the version-skew hunt); now one line naming the extra."""
    code = "import sys, runpy; sys.modules['hdrh'] = None; sys.argv = ['bench', '--help']; runpy.run_module('bench', run_name='__main__')"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == ("python -m bench: needs the bench extra: pip install 'zmq-infer[bench]' (from a clone: "
                                "pip install '.[bench]'; `make install` has it)")


def test_a_run_that_measures_without_cuda_is_no_success(tmp_path):
    # Found by the architecture audit: without --dry-run and without CUDA, every check was
    # "skipped", "ok" true and the exit 0, which a gate reads as the GPU checks passed.
    ok, _ = cuda_status()
    if ok:
        return  # a CUDA machine measures (its gpu_check run is the device session's)
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, (p.returncode, p.stderr)
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["status"] == "no_device" and "nothing measured" in p.stderr
