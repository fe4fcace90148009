"""Request ``meta`` reaches a model that declares it: one request, and concurrent requests
that the worker may batch (each still gets its own dict)."""
from __future__ import annotations

import asyncio

import numpy as np

from client_sdk import AsyncClient, Client
from tests.e2e.conftest import wait_service


def test_meta_reaches_the_model(cluster):
    cluster.broker()
    cluster.worker("meta_model:factory", "--service", "scale", "--max-delay-ms", "50")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "scale")
        with c.infer("scale", {"x": x}, meta={"scale": 3}) as r:
            np.testing.assert_array_equal(r["x"], x * 3)
        with c.infer("scale", {"x": x}) as r:  # no meta: the model sees an empty dict
            np.testing.assert_array_equal(r["x"], x)
        with c.infer("scale", {"x": x}, meta={"scale": 2}, reply="inline") as r:
            np.testing.assert_array_equal(r["x"], x * 2)

    async def concurrent():
        async with AsyncClient(cluster.frontend, timeout=10) as ac:
            results = await asyncio.gather(*(ac.infer("scale", {"x": x}, meta={"scale": k}) for k in range(1, 7)))
            try:
                for k, r in enumerate(results, 1):
                    np.testing.assert_array_equal(r["x"], x * k)
            finally:
                for r in results:
                    r.release()

    asyncio.run(concurrent())
