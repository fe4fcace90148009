"""`mmi_service` refuses the service names `infer` refuses (docs/client.md): an empty name,
one over 255 bytes of UTF-8 or not UTF-8 is `InvalidInput`, with `infer`'s words, on both
twins, before anything is sent.  `mmi_service("")` was sent, and the broker's 404 made it
False, as if a real service merely had no worker yet.  A real broker on ipc; every wait
bounded."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client_sdk import AsyncClient, Client
from client_sdk.errors import InvalidInput

pytestmark = pytest.mark.timeout(60)

BAD = ["", "x" * 256, "é" * 128, "\udc80"]  # (128 x 2 bytes: 256 bytes of UTF-8)


def _refusal(fn) -> str:
    with pytest.raises(InvalidInput) as e:
        fn()
    return str(e.value)


def test_mmi_service_refuses_the_names_infer_refuses(cluster):
    cluster.broker()
    x = {"x": np.zeros(1, np.float32)}
    with Client(cluster.frontend, timeout=10) as c:
        for name in BAD:
            said = _refusal(lambda: c.infer(name, x))
            assert _refusal(lambda: c.mmi_service(name)) == said, name
        assert c.mmi_service("x" * 255) is False  # the longest name is still asked about
        assert c.mmi_service("nobody") is False

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=10) as c:
            for name in BAD:
                with pytest.raises(InvalidInput) as infer_e:
                    await c.infer(name, x)
                with pytest.raises(InvalidInput) as mmi_e:
                    await c.mmi_service(name)
                assert str(mmi_e.value) == str(infer_e.value), name
            assert await c.mmi_service("x" * 255) is False

    asyncio.run(scenario())
