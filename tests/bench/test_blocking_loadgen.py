"""The blocking closed loop (`closed_loop_sync`) measures what it should, interleaves with the
asyncio windows under one stopping rule, and runs with no event loop running; the blocking
ratios (`*_sync`, `tail_ratio_*`) are the quotients they name."""
from __future__ import annotations

import asyncio
import time

import pytest

from bench.hist import LatencyHistogram
from bench.loadgen import (
    RunConfig,
    Workload,
    closed_loop_sync,
    measure_interleaved,
    measure_interleaved_sync,
    parse_size,
    run_window_sync,
)
from bench.report import QUOTIENT_RATIOS, RATIOS, SYNC_RATIOS, TAIL_RATIOS, compute_ratios


class _FakeClock:
    """bench.loadgen's clock (its `time` module) for one test: time moves only when the target
    says it took some, so the window's arithmetic is checked exactly, not against a 2-core
    box's timer overshoot (`0.3 <= elapsed_s < 0.35` failed under load)."""

    def __init__(self):
        self.ns = 1_000_000_000

    def perf_counter_ns(self) -> int:
        return self.ns

    def sleep(self, seconds: float) -> None:
        self.ns += int(round(seconds * 1e9))


def test_closed_loop_sync_recovers_a_known_delay(monkeypatch):
    import bench.loadgen

    clock = _FakeClock()
    monkeypatch.setattr(bench.loadgen, "time", clock)
    starts: list[int] = []

    def sleepy(payload):
        starts.append(clock.ns)
        clock.sleep(0.002)
        return {"queue_ms": 0.5, "compute_ms": 1.0}

    res = closed_loop_sync(sleepy, b"x", duration_s=0.3)
    assert res.errors == 0 and res.ok == res.hist.count
    # One request in flight, back to back: each starts where the previous ended, and none
    # starts at or past the window's end.
    assert res.ok == len(starts) == 150
    assert all(b - a == 2_000_000 for a, b in zip(starts, starts[1:]))
    assert starts[-1] < starts[0] + 300_000_000
    assert res.elapsed_s == pytest.approx(0.3)  # the last request's end: nothing added
    # Timed around the call, nothing added: every latency is the target's 2 ms.
    assert res.hist.min_ms() == pytest.approx(2.0, rel=0.01) and res.hist.max_ms() == pytest.approx(2.0, rel=0.01)
    assert res.server.means_ms()["compute"] == pytest.approx(1.0)


def test_closed_loop_sync_counts_errors_and_late_calls_as_timeouts():
    calls = iter(range(100))

    def flaky(payload):
        i = next(calls)
        if i % 4 == 0:
            raise ValueError("boom")
        if i % 4 == 1:
            return {"error": "server said no"}
        if i % 4 == 2:
            time.sleep(0.03)  # returns after the timeout below: a timeout, not a latency
        return None

    res = closed_loop_sync(flaky, b"x", duration_s=0.0, min_requests=8, timeout_s=0.02)
    assert res.ok == 2 and res.errors == 6 and res.timeouts == 2 and res.hist.count == 2
    assert {"ValueError: boom", "server said no", "timeout after 0.02 s"} <= set(res.error_samples)

    def raises_timeout(payload):
        raise TimeoutError("no reply within 60 s")

    res = closed_loop_sync(raises_timeout, b"x", duration_s=0.0, min_requests=3)
    assert res.timeouts == res.errors == 3 and res.ok == 0


def test_blocking_window_is_closed_loop_concurrency_one():
    cfg = RunConfig(min_requests=2)
    with pytest.raises(ValueError):
        run_window_sync(lambda p: None, b"x", Workload(parse_size("16"), concurrency=2), cfg, 0.01)
    with pytest.raises(ValueError):
        run_window_sync(lambda p: None, b"x", Workload(parse_size("16"), "open", rate=10), cfg, 0.01)
    assert run_window_sync(lambda p: None, b"x", Workload(parse_size("16")), cfg, 0.0).ok == 2


def test_interleaved_sync_and_async_windows_without_a_running_loop():
    order: list[str] = []
    loop_seen: list[bool] = []

    def blocking(payload):
        try:
            asyncio.get_running_loop()
            loop_seen.append(True)
        except RuntimeError:
            loop_seen.append(False)
        if not order or order[-1] != "a:sync":
            order.append("a:sync")
        time.sleep(0.002)

    async def aio(payload):
        if not order or order[-1] != "a":
            order.append("a")
        await asyncio.sleep(0.004)

    cfg = RunConfig(window_s=0.03, warmup_s=0.01, max_duration_s=5.0, min_requests=1)
    wl = Workload(parse_size("16"))
    with asyncio.Runner() as runner:
        ms = measure_interleaved_sync({"a": aio, "a:sync": blocking}, b"x", wl, cfg,
                                      blocking={"a:sync"}, run_async=runner.run)
    assert order[:6] == ["a", "a:sync"] * 3  # warm-up round, then round robin
    assert loop_seen and not any(loop_seen)  # no event loop running around a blocking call
    assert ms["a:sync"].blocking and not ms["a"].blocking
    for m in ms.values():
        assert m.converged and len(m.window_p50_ms) >= 3 and m.hist.count == m.ok > 0
    assert ms["a:sync"].hist.percentile_ms(50) < ms["a"].hist.percentile_ms(50)
    with pytest.raises(ValueError):  # asyncio windows need a loop to run on
        measure_interleaved_sync({"a": aio}, b"x", wl, cfg)


async def test_async_interleaving_takes_a_per_peer_blocking_flag():
    def blocking(payload):
        time.sleep(0.001)

    async def aio(payload):
        await asyncio.sleep(0.001)

    cfg = RunConfig(window_s=0.02, warmup_s=0.0, max_duration_s=0.3, min_requests=1)
    ms = await measure_interleaved({"x": aio, "x:sync": blocking}, b"x", Workload(parse_size("16")),
                                   cfg, blocking=("x:sync",))
    assert ms["x:sync"].blocking and ms["x:sync"].ok > 0 and ms["x"].ok > 0


def _row(peer, nbytes, p50, p99=None):
    return {"peer": peer, "payload_bytes": nbytes, "mode": "closed", "concurrency": 1,
            "latency_ms": {"p50": p50, "p99": p99 if p99 is not None else 2 * p50}}


def test_blocking_ratios_exact_and_missing_reasons():
    ok = {"status": "ok", "reason": ""}
    names = ["broker-shm", "proxy-sdk", "proxy", "direct", "grpc"]
    peers = {k: ok for n in names for k in (n, n + ":sync")}
    peers["grpc:sync"] = {"status": "skipped", "reason": "no blocking client"}
    rows = [_row("broker-shm", 16, 0.6), _row("direct", 16, 0.2),
            _row("broker-shm:sync", 16, 0.5, p99=1.0), _row("proxy-sdk:sync", 16, 0.4, p99=0.56),
            _row("proxy:sync", 16, 0.25), _row("direct:sync", 16, 0.1),
            _row("broker-shm:sync", 6_220_800, 0.55)]
    ratios, missing = compute_ratios(rows, peers)
    assert set(ratios) == set(RATIOS) | set(SYNC_RATIOS) | set(TAIL_RATIOS) | set(QUOTIENT_RATIOS)
    assert set(SYNC_RATIOS) == {f"{k}_sync" for k in RATIOS}
    assert ratios["broker_vs_direct_tiny"] == pytest.approx(3.0)  # asyncio, as today
    assert ratios["broker_vs_direct_tiny_sync"] == pytest.approx(5.0)
    assert ratios["broker_vs_proxy_floor_tiny_sync"] == pytest.approx(1.25)
    assert ratios["proxy_sdk_vs_proxy_tiny_sync"] == pytest.approx(1.6)
    assert ratios["payload_independence_6mb_sync"] == pytest.approx(1.1)
    assert ratios["tail_ratio_tiny"] == pytest.approx(2.0)
    assert ratios["tail_ratio_floor_tiny"] == pytest.approx(1.4)
    assert ratios["tail_ratio_vs_floor_tiny"] == pytest.approx(2.0 / 1.4, rel=1e-3)
    assert "no blocking client" in missing["grpc_vs_shm_6mb_sync"]
    assert "not measured at 67108864 B" in missing["payload_independence_64mb_sync"]
    # Without any :sync entry the report is today's: the asyncio ratios only.
    plain, _ = compute_ratios(rows, {n: ok for n in names})
    assert set(plain) == set(RATIOS)
    # A floor without its blocking result makes the quotient null, with the reason.
    del peers["proxy-sdk:sync"]
    ratios, missing = compute_ratios(rows, peers)
    assert ratios["tail_ratio_floor_tiny"] is None and ratios["tail_ratio_vs_floor_tiny"] is None
    assert "--blocking or --both" in missing["tail_ratio_vs_floor_tiny"]
