"""gpu_worker.health (`python -m gpu_worker --health-port`), in process: liveness from the
loop's stamp (a stale stamp is dead, unless a batch is computing), and the HTTP paths'
answers, 503 included.  A worker's readiness against a real broker coming up is
tests/e2e/test_health.py."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from gpu_worker.health import HealthServer, loop_alive, parse_port

pytestmark = pytest.mark.timeout(30)


def _get(server: HealthServer, path: str) -> tuple[int, dict]:
    url = "http://%s:%d%s" % (*server.address, path)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_stale_loop_stamp_is_dead_unless_a_batch_computes():
    now = time.monotonic()
    assert loop_alive(lambda: now, lambda: 0.6, lambda: False)
    assert not loop_alive(lambda: now - 10.0, lambda: 0.6, lambda: False)   # the loop stopped passing
    assert loop_alive(lambda: now - 10.0, lambda: 0.6, lambda: True)        # a long batch: alive
    # The window is at least 2 s (a loaded machine stalls a loop that long) ...
    assert loop_alive(lambda: now - 1.5, lambda: 0.6, lambda: False)
    # ... and a longer liveness window (heartbeat interval x liveness) is honoured.
    assert loop_alive(lambda: now - 5.0, lambda: 6.0, lambda: False)
    assert not loop_alive(lambda: now - 7.0, lambda: 6.0, lambda: False)


def test_live_and_ready_answer_503_when_they_are_not():
    stamp = [time.monotonic()]
    state = {"computing": False, "registered": False}
    h = HealthServer(("127.0.0.1", 0),
                     live=lambda: loop_alive(lambda: stamp[0], lambda: 0.6, lambda: state["computing"]),
                     ready=lambda: state["registered"])
    try:
        assert _get(h, "/v2/health/live") == (200, {"live": True})
        assert _get(h, "/v2/health/ready") == (503, {"ready": False})   # not registered yet
        state["registered"] = True
        assert _get(h, "/v2/health/ready/") == (200, {"ready": True})   # a trailing slash is the same path
        stamp[0] -= 10.0                                                # the loop stalls
        assert _get(h, "/v2/health/live") == (503, {"live": False})
        state["computing"] = True                                       # in a batch: computing is living
        assert _get(h, "/v2/health/live?probe=1") == (200, {"live": True})
        status, body = _get(h, "/v2/models/echo/ready")
        assert status == 404 and "no such path" in body["error"]
    finally:
        h.close()


def test_parse_port():
    assert parse_port("8080") == ("127.0.0.1", 8080)
    assert parse_port("0.0.0.0:9") == ("0.0.0.0", 9)
    assert parse_port("[::1]:9") == ("::1", 9)
    assert parse_port(":0") == ("127.0.0.1", 0)
    for bad in ("x", "h:x", "70000", "-1"):
        with pytest.raises(ValueError, match="--health-port"):
            parse_port(bad)


def test_head_and_an_absolute_form_target_are_probes_like_any_other():
    # Some load balancers probe with HEAD; a proxy may send the absolute form.  Both were 501
    # and 404 here while the broker's port answered them.
    import http.client

    h = HealthServer(("127.0.0.1", 0), live=lambda: True, ready=lambda: True)
    try:
        conn = http.client.HTTPConnection(*h.address, timeout=10)
        conn.request("HEAD", "/v2/health/live")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"" and int(r.getheader("Content-Length")) > 0
        conn.close()
        conn = http.client.HTTPConnection(*h.address, timeout=10)
        conn.request("GET", "http://%s:%d/v2/health/ready#x" % h.address)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"ready": True}
        conn.close()
    finally:
        h.close()
