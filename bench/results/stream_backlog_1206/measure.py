"""A latest_wins=False stream offered twice what one fixed 20 ms worker serves.

usage: measure.py ENDPOINT OUT.json  (run with the tree under test first on PYTHONPATH)
Sends a 16 B frame every 10 ms for 3 s (100 fps against 50/s of capacity), max_in_flight=2,
timeout=0.1 s, reading what has come back after every send, then everything left.  Records,
per frame, send() to outcome (a result or an error), the largest `pending` seen, and the
stream's counters.  result_ms: send() to the result's arrival (the stream's latencies_ms);
ok_age_ms / err_age_ms: send() to when this loop read the outcome (up to a tick later)."""
import json
import sys
import time

import numpy as np

from client_sdk import Client, EndOfStream, InferenceError

ep, out = sys.argv[1], sys.argv[2]
ages_ok, ages_err, pending_max = [], [], 0
with Client(ep, timeout=5) as c:
    c.infer("fixed", {"x": np.zeros(16, np.uint8)})  # warm
    with c.stream("fixed", latest_wins=False, max_in_flight=2, timeout=0.1, pin=False) as st:
        sent_at = {}

        def drain(wait):
            while True:
                try:
                    r = st.recv(timeout=wait)
                except EndOfStream:  # (before InferenceError: it is one)
                    return
                except InferenceError:  # the head frame's own error (DeadlineExceeded), in order
                    f = min(sent_at)
                    ages_err.append(time.monotonic() - sent_at.pop(f))
                    continue
                except TimeoutError:  # nothing yet (after InferenceError: DeadlineExceeded is a TimeoutError)
                    return
                except Exception:  # anything else: the head frame's too
                    f = min(sent_at)
                    ages_err.append(time.monotonic() - sent_at.pop(f))
                    continue
                ages_ok.append(time.monotonic() - sent_at.pop(r.frame))
                r.release()

        t0 = time.monotonic()
        k = 0
        while time.monotonic() < t0 + 3.0:
            due = t0 + k * 0.01
            while time.monotonic() < due:
                c.pump(max(0.0, due - time.monotonic()))
            sent_at[st.send({"x": np.full(16, k % 256, np.uint8)})] = time.monotonic()
            k += 1
            drain(0.0)
            pending_max = max(pending_max, st.stats().pending)
        drain(5.0)
        s = st.stats()
res = {"frames": k, "completed": s.completed, "failed": s.failed, "expired": getattr(s, "expired", None),
       "pending_max": pending_max,
       "result_ms_p50": float(np.percentile(s.latencies_ms, 50)) if s.latencies_ms else None,
       "result_ms_max": float(max(s.latencies_ms)) if s.latencies_ms else None,
       "ok_age_ms_p50": float(np.percentile(ages_ok, 50) * 1e3) if ages_ok else None,
       "ok_age_ms_max": float(max(ages_ok) * 1e3) if ages_ok else None,
       "err_age_ms_max": float(max(ages_err) * 1e3) if ages_err else None}
print(json.dumps(res))
json.dump(res, open(out, "w"), indent=1)
