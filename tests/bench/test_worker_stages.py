"""`python -m bench.worker_stages`: both workers report their stages, and the stages of ours
add up to its wake-to-sent time (no stage left out or counted twice)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
