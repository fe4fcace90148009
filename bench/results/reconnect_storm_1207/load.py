"""N AsyncClients in one process, each calling echo every ~0.5-1 s. Writes JSONL of outcomes."""
import asyncio, json, os, random, sys, time
import numpy as np
from client_sdk import AsyncClient
import client_sdk

ep, n, dur, out, key = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
skey = os.environ["SKEY"]
recs = []

async def one(i):
    c = AsyncClient(ep, server_key=skey, client_key=key, timeout=3.0)
    x = np.arange(16, dtype=np.uint8)
    t_end = time.time() + dur
    await asyncio.sleep(random.random())
    try:
        while time.time() < t_end:
            t0 = time.time()
            try:
                r = await asyncio.wait_for(c.infer("echo", {"x": x}, timeout=3.0), 10)
                recs.append((i, t0, time.time(), "ok", ""))
            except Exception as e:
                recs.append((i, t0, time.time(), type(e).__name__, str(e)[:300]))
            await asyncio.sleep(0.5 + random.random() * 0.5)
    finally:
        try:
            await asyncio.wait_for(c.close(), 5)
        except Exception as e:
            recs.append((i, time.time(), time.time(), "close:" + type(e).__name__, str(e)[:200]))

async def main():
    await asyncio.gather(*(one(i) for i in range(n)))

try:
    asyncio.run(asyncio.wait_for(main(), dur + 60))
finally:
    with open(out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
