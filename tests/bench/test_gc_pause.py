"""bench.gc_pause runs, in processes of its own, and reports each process's startup heap and
what a full collection costs before and after the freeze.  Numbers are the bench's."""
from __future__ import annotations

import pytest

from bench import gc_pause

pytestmark = pytest.mark.timeout(300)


def test_every_process_is_measured_before_and_after_the_freeze():
    res = gc_pause.measure(repeats=1)
    assert set(res["processes"]) == set(gc_pause.TARGETS)
    for r in res["processes"].values():
        assert r["tracked"] > 1000 and r["frozen"] >= r["tracked"] * 0.9
        assert 0 <= r["full_ms_frozen"] < r["full_ms"]
