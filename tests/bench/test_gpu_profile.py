"""`python -m bench.gpu_profile` on the CPU: both processes profiled, the report written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_profiles_client_and_worker_of_the_host_path(tmp_path):
    pytest.importorskip("torch")  # the copying model is a torch module
    p = subprocess.run([sys.executable, "-m", "bench.gpu_profile", "--device", "cpu", "--transport", "shm",
                        "--n", "100", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    text = (tmp_path / "profile_shm.txt").read_text()
    assert "== CLIENT" in text and "== WORKER (start-up included)" in text
    assert "tensors.py:" in text.split("== WORKER")[0] and "(unpack)" in text.split("== WORKER")[0]  # the client's own steps, per request
    assert "planes.py" in text.split("== WORKER")[1] and (tmp_path / "worker_shm.prof").exists()


def test_the_cuda_form_says_why_it_cannot_run_without_cuda():
    from shm.cuda import cuda_status

    if cuda_status()[0]:
        pytest.skip("CUDA is usable here: the GPU check runs this form")
    p = subprocess.run([sys.executable, "-m", "bench.gpu_profile", "--transport", "cuda"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "no CUDA device" in p.stderr and "Traceback" not in p.stderr
