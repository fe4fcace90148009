"""`python -m bench.gpu_product` without CUDA: the cuda paths are skipped with the reason and
the CPU-worker path runs through the real broker and worker, bit-exact."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shm.cuda import cuda_status

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_product_runs_its_cpu_path_and_names_what_it_skipped(tmp_path):
    pytest.importorskip("torch")  # the copying model is a torch module
    out = tmp_path / "gpu_product.json"
    p = subprocess.run([sys.executable, "-m", "bench.gpu_product", "--devices", "cuda:0,cpu", "--n", "5",
                        "--rounds", "2", "--sizes", "65536,16", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["rounds"] == 2 and doc["sizes"] == [16, 65536]  # sorted
    cpu = {k: v for k, v in doc["summary"].items() if v["path"] == "shm->cpu"}
    assert sorted(v["bytes"] for v in cpu.values()) == [16, 65536]
    assert all(v["bit_exact"] and v["p50_ms"] > 0 for v in cpu.values())
    assert cpu["shm->cpu/16"]["p50_over_smallest"] == 1.0
    have_cuda, _ = cuda_status()
    if not have_cuda:
        assert "no CUDA device" in doc["skipped"]["cuda:0"] and "skipped cuda:0" in p.stdout
        assert doc["paths"] == ["shm->cpu"]
