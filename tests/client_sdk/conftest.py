"""Fixtures the client tests share: a short ipc endpoint and the fake broker on it
(test_sdk_client.FakeBroker)."""
from __future__ import annotations

import pytest

from .test_sdk_client import FakeBroker


@pytest.fixture
def endpoint(tmp_path_factory):
    # ipc paths are limited to ~107 bytes: keep them short whatever the test's name.
    return f"ipc://{tmp_path_factory.mktemp('ep')}/b.sock"


@pytest.fixture
def fake(endpoint):
    fb = FakeBroker(endpoint)
    fb.start()
    try:
        yield fb
    finally:
        fb.stop()
