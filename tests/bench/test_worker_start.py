"""bench.worker_start: a worker started from a source tree, timed to its READY against a real
broker, and everything stopped afterwards."""
from __future__ import annotations

import pytest

from bench import worker_start

pytestmark = pytest.mark.timeout(120)


def test_one_round_times_a_worker_to_ready(tmp_path):
    out = tmp_path / "start.json"
    assert worker_start.main(["--rounds", "1", "--json", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    (root, r), = res["roots"].items()
    assert root == str(worker_start.ROOT) and len(r["seconds"]) == 1 and 0 < r["median_s"] < 120
