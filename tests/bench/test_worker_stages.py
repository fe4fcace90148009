"""`python -m bench.worker_stages`: both workers report their stages, and the stages of ours
add up to its wake-to-sent time (no stage left out or counted twice)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_worker_stages_reports_every_stage(tmp_path):
    out = tmp_path / "stages.json"
    p = subprocess.run([sys.executable, "-m", "bench.worker_stages", "--n", "300", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    ours, lean = doc["ours"], doc["lean"]
    assert ours["n"] >= 290 and lean["n"] >= 290
    parts = ["wake -> drain", "drain -> admit", "admit -> run", "run -> model", "model", "model -> reply",
             "reply -> sent"]
    assert all(ours[k] is not None and ours[k] > 0 for k in parts), ours
    # medians do not add exactly; their sum stays near the median of the whole
    assert 0.5 * ours["wake -> sent"] < sum(ours[k] for k in parts) < 2 * ours["wake -> sent"]
    assert lean["received -> sent"] > 0 and 0 < ours["received -> sent"] < ours["wake -> sent"]


def test_worker_stages_with_our_client_and_its_gpu_form_without_cuda(tmp_path, capsys):
    """`--client sdk`: our Client to a worker of gpu_product's copying model, its round trip
    and the plane's stages reported; the CUDA form says why it cannot run without CUDA (its
    `main` here: a process of its own spent 1.5 s importing torch to say so)."""
    pytest.importorskip("torch")  # the copying model is a torch module
    from bench import worker_stages
    from shm.cuda import cuda_status

    out = tmp_path / "sdk.json"
    p = subprocess.run([sys.executable, "-m", "bench.worker_stages", "--client", "sdk", "--n", "200",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["client_p50_us"] > 0 and "lean" not in doc
    cs = doc["client_stages"]  # the client's own stages, each timed per call
    assert set(cs) == {"pack", "unpack", "infer", "use", "release"}
    assert 0 < cs["pack"] < cs["infer"] and 0 < cs["unpack"] < cs["infer"]
    ours = doc["ours"]
    assert ours["  of which: map inputs"] > 0 and ours["  of which: write outputs"] > 0 and ours["model"] > 0
    if not cuda_status()[0]:
        capsys.readouterr()
        assert worker_stages.main(["--client", "sdk", "--transport", "cuda"]) == 3
        assert "no CUDA device" in capsys.readouterr().err


def test_the_worker_options_for_every_form_parse_as_the_proxied_worker_takes_them():
    """The GPU form's options are only run on a GPU machine: parse them here, so an option
    `bench.proxied_worker` does not take (as `--cuda-pool-mb` once was) fails on the CPU."""
    import argparse

    from bench.worker_stages import worker_args
    from gpu_worker.__main__ import add_model_options

    for client, device in (("lean", "cpu"), ("sdk", "cpu"), ("sdk", "cuda:0")):
        ap = argparse.ArgumentParser(exit_on_error=False)
        ap.add_argument("--connect", required=True)
        add_model_options(ap)
        args = ap.parse_args(["--connect", "ipc:///x", *worker_args(client, device)])
        assert (args.device or "cpu") == device and args.max_batch == 1
