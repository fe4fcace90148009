"""bench.hotpath still runs against the components it stubs (a refactor of their socket
calls must not silently break it)."""
from __future__ import annotations

import pytest

from bench import hotpath

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("fn", [hotpath.broker_us, hotpath.worker_us, hotpath.worker_leased_us, hotpath.client_us])
def test_each_component_is_timed(fn):
    us = fn(20)
    assert 0 < us < 10_000


def test_the_worker_is_timed_with_counting_on():
    assert 0 < hotpath.worker_us(20, metrics=True) < 10_000
