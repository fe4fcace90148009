"""bench.stalls runs one event end to end and writes strict JSON (its numbers are read by
a person on an idle machine, not asserted here: docs/bench.md)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_kill_round_serves_every_persona_and_writes_strict_json(tmp_path):
    out = tmp_path / "stalls.json"
    short = tempfile.mkdtemp(prefix="st", dir="/tmp")  # its rounds' folders hold ipc paths (at most 107 bytes)
    try:
        env = {**os.environ, "TMPDIR": short, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-m", "bench.stalls", "--events", "kill", "--rounds", "1",
                            "--after-s", "0.5", "--json", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    med = rep["median"]["kill"]
    assert set(med) == {"ar", "game", "slo"}
    for who, m in med.items():
        assert m["failed"] == 0, (who, rep["rounds"]["kill"][0][who]["errors"])
        assert m["gap_ms"] > 0 and m["steady_ms"] > 0, (who, m)
        assert m["repin_s"] is None or m["repin_s"] >= 0, (who, m)  # (null: not pinned again in 0.5 s)
