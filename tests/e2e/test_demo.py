"""`make demo` in small: the same script, fewer and smaller frames."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_demo_streams_prints_table_and_writes_png(tmp_path):
    pytest.importorskip("torch", reason="the demo's cartoon model needs torch (pip install '.[torch]')")
    out = subprocess.run(
        [sys.executable, "-m", "client_sdk.demo", "--frames", "30", "--fps", "30", "--size", "320x180",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=150,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["frames", "done"])
    frames, done, dropped, failed = (int(v) for v in lines[header + 1].split()[:4])
    assert frames == 30 and done + dropped == 30 and failed == 0 and done > 0
    png = tmp_path / "cartoon_before_after.png"
    assert png.stat().st_size > 1000
    assert "left in /dev/shm" not in out.stderr
