"""bench.restart's connection-reset round runs and measures what it says: a request in flight
when the relay resets the client's connection still gets its result (resent by the client),
once.  Numbers are the bench's business (BENCHMARKS.md), not this test's."""
from __future__ import annotations

import math

import pytest

from bench import restart

pytestmark = pytest.mark.timeout(120)


def test_the_reset_round_measures_a_request_that_outlived_its_connection():
    took = restart.reset_round(0.2)
    assert math.isfinite(took) and 0 < took < 30
