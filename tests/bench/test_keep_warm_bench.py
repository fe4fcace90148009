"""`python -m bench.keep_warm` on the CPU: both workers serve, every pause is reported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_first_request_after_each_pause_with_keep_warm_on_and_off(tmp_path):
    out = tmp_path / "kw.json"
    p = subprocess.run([sys.executable, "-m", "bench.keep_warm", "--device", "cpu", "--model", "echo",
                        "--pauses", "0.01,0.12", "--rounds", "2", "--steady", "10", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert set(doc["steady_p50_ms"]) == {"kw-on", "kw-off"} and all(v > 0 for v in doc["steady_p50_ms"].values())
    assert set(doc["after_pause"]) == {"0.01", "0.12"}
    for row in doc["after_pause"].values():
        for service in ("kw-on", "kw-off"):
            r = row[service]
            assert r["first_ms"] > 0 and r["second_ms"] > 0 and len(r["first_all_ms"]) == 2
    # The 0.12 s pauses leave the kw-on worker idle past its 50 ms period: it ran units.
    assert doc["keep_warm_runs"]["kw-on"] >= 1 and doc["keep_warm_runs"]["kw-off"] == 0


def test_a_cuda_device_without_cuda_says_why():
    from shm.cuda import cuda_status

    if cuda_status()[0]:
        return  # CUDA here: gpu_check's keep_warm section runs this form
    p = subprocess.run([sys.executable, "-m", "bench.keep_warm", "--device", "cuda:0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "no CUDA device" in p.stderr and "Traceback" not in p.stderr
